"""papers/orthogonalizers.py: the paper's table of other libraries' orthogonalizations, rendered from the JSON
the harness writes (here a small CPU run; the paper's comes from results/h200_orthogonalizers)."""

from __future__ import annotations

import json

from anvil_fast.studies import adapters as A
from anvil_fast.studies import harness as H
from papers import orthogonalizers as peers


def _data(tmp_path):
    impls, _ = A.load(["torch-muon", "anvil-safe"])
    rows = H.judge(impls, shapes=[(2, 24, 16)], families=("gaussian", "well_conditioned", "near_rank1"),
                   near_rank1_count=4, progress=False)
    path = tmp_path / "orthogonalizers.json"
    H.write_json(H.to_json(rows, command="python -m anvil_fast.studies.difftest --adapter torch-muon,anvil-safe", impls=impls,
                           unavailable={"dion-muon": "dion not installed"}), str(path))
    return json.loads(path.read_text()), rows


def test_the_table_renders_the_json(tmp_path):
    data, rows = _data(tmp_path)
    text = peers.table(data)
    lines = [line for line in text.splitlines() if line.startswith("| torch-muon") or line.startswith("| anvil-safe")]
    assert len(lines) == 2
    by = {(r.impl, r.family): r for r in rows}
    muon = lines[0].split(" | ")
    assert muon[1] == "24x16" and muon[2] == f"{by['torch-muon', 'well_conditioned'].fast:.3g}"
    assert muon[5] == f"{by['torch-muon', 'gaussian'].polar:.3g}"
    assert "Not run there: dion-muon (dion not installed)" in text
    assert "generated_by" not in text and "python -m anvil_fast.studies.difftest --adapter torch-muon,anvil-safe" in text


def test_the_statements_follow_the_numbers(tmp_path):
    data, _ = _data(tmp_path)
    said = {e["impl"]: peers.classify(e) for e in peers.summarize(data)}
    # Muon's quintic is ~0.2 from the polar factor in float64 already: its math limits it
    assert "its math limits it" in said["torch-muon"] and "as accurate as its math allows" in said["torch-muon"]
    assert "its rounding limits it" in said["anvil-safe"]


def test_without_data_the_table_says_which_command_writes_it(monkeypatch):
    monkeypatch.setattr(peers, "SOURCE", "results/no_such_run/orthogonalizers.json")
    text = peers.table()
    assert "no data yet" in text and "results/no_such_run/orthogonalizers.json" in text
    assert "--adapter all" in peers.COMMAND and "--json" in peers.COMMAND
