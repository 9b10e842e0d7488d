"""tools/h200_session.sh: which stages a call runs on which card, and what each peers run is given.

The script runs with stand-ins on PATH: ``nvidia-smi`` names the card, ``python3`` records its arguments and
does nothing, so only the script's own choices are under test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _run(tmp_path: Path, card: str, **env: str) -> tuple[str, list[str]]:
    bin_dir, work, out = tmp_path / "bin", tmp_path / "work", tmp_path / "out"
    for d in (bin_dir, work / "tools", out):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "tools" / "h200_session.sh", work / "tools" / "h200_session.sh")
    calls = tmp_path / "python3_calls.txt"
    (bin_dir / "nvidia-smi").write_text(f"#!/usr/bin/env bash\necho '{card}'\n")
    (bin_dir / "python3").write_text(f"#!/usr/bin/env bash\necho \"$*\" >> '{calls}'\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    full = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "OUT": str(out), **env}
    res = subprocess.run(["bash", "tools/h200_session.sh"], cwd=work, env=full, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    stages = (out / "stages.txt").read_text()
    peers = [line for line in (calls.read_text().splitlines() if calls.exists() else [])
             if line.startswith("-m anvil_fast.bench peers")]
    return stages, peers


def test_another_card_runs_the_stages_named_for_elsewhere(tmp_path):
    stages, _ = _run(tmp_path, "NVIDIA H100 80GB HBM3", STAGES="stage_for_h200", STAGES_ELSEWHERE="stage_for_others")
    assert "== stage_for_others" in stages and "== stage_for_h200" not in stages
    assert "card NVIDIA H100 80GB HBM3 is not an H200" in stages


def test_an_h200_runs_stages(tmp_path):
    stages, _ = _run(tmp_path, "NVIDIA H200", STAGES="stage_for_h200", STAGES_ELSEWHERE="stage_for_others")
    assert "== stage_for_h200" in stages and "stage_for_others" not in stages


def test_the_first_peers_run_takes_its_own_arguments_and_limit(tmp_path):
    stages, peers = _run(tmp_path, "NVIDIA H200", STAGES="peers", PEERS_REPEATS="3", T_PEERS="100",
                         T_PEERS_FIRST="330", PEERS_ARGS="--sizes small --contenders anvil,adamw",
                         PEERS_ARGS_FIRST="--sizes small")
    assert len(peers) == 3, peers
    assert "--budget-s 300" in peers[0] and peers[0].rstrip().endswith("--sizes small")
    for i, line in enumerate(peers[1:], start=2):
        assert "--budget-s 70" in line and line.rstrip().endswith("--contenders anvil,adamw"), line
        assert f"/run{i} " in line
    assert "peers 1/3: limit 330 s, arguments: --sizes small" in stages


def test_without_first_arguments_every_peers_run_is_the_same(tmp_path):
    _, peers = _run(tmp_path, "NVIDIA H200", STAGES="peers", PEERS_REPEATS="2", T_PEERS="100",
                    PEERS_ARGS="--sizes medium")
    assert len(peers) == 2 and all("--budget-s 70" in p and p.rstrip().endswith("--sizes medium") for p in peers)
