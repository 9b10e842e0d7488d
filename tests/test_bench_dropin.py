"""``python -m anvil_fast.bench dropin --device cpu``: the benchmark's smoke mode runs end to end
(every variant that exists on CPU, the phase table, the summary table). No timing is asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from anvil_fast.bench import COMMANDS


def test_dropin_is_registered():
    assert "dropin" in COMMANDS


def test_dropin_cpu_smoke_runs_end_to_end():
    out = subprocess.run([sys.executable, "-m", "anvil_fast.bench", "dropin", "--device", "cpu", "--rep-ms", "1",
                          "--profile"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for row in ("| host part (inbox) |", "| non-finite check |", "| banks, one stream |", "| banks, 1 stream(s) |",
                "| Adam |", "| whole device part |",
                "| smoke | ANVIL, default arguments |", "| smoke | ANVIL, cuda_graphs=False |",
                "| smoke | ANVIL, rails_dtype=bf16 (lean state) |",
                "| smoke | torch Muon + fused AdamW |", "| smoke | fused AdamW alone |"):
        assert row in text, f"{row!r} missing from:\n{text}"
    assert "profile of one step, smoke anvil:" in text and "aten ops" in text
    # capture is not valid on CPU: the variant says why instead of failing the run
    assert "anvil_graphs: not run: ValueError: cuda_graphs=True: CUDA graphs need the optimizer's tensors on a CUDA device" in text


def test_dropin_refuses_unknown_variant(capsys):
    from anvil_fast.bench import main

    assert main(["dropin", "--device", "cpu", "--variants", "anvil,nope"]) == 2
    assert "unknown variants ['nope']" in capsys.readouterr().out


@pytest.mark.gpu
def test_dropin_gpu_quick():
    from anvil_fast.bench import main

    assert main(["dropin", "--sizes", "small", "--rep-ms", "50", "--warmup", "3"]) == 0


def test_dropin_memory_table_runs_on_cpu():
    """``--memory`` prints one row per optimizer, AdamW's ratio 1 and the drop-in's next to it (the
    1.05x bound itself is tests/test_dropin_memory.py's)."""
    out = subprocess.run([sys.executable, "-m", "anvil_fast.bench", "dropin", "--device", "cpu", "--memory",
                          "--sizes", "tiny"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [l for l in out.stdout.splitlines() if l.startswith("| tiny ")]
    assert [r.split("|")[2].strip() for r in rows] == ["torch AdamW", "ANVIL, default arguments",
                                                       "ANVIL, grad_read='buffers'",
                                                       "ANVIL, rails_dtype=bf16 (lean state)"]
    assert rows[0].split("|")[4].strip() == "1.000"


def test_floor_takes_each_banks_configuration():
    # the same model under SAFE and under GRAM_SIDE (on the CPU the Gram side runs on every bank of
    # aspect >= 2): the matmul floor follows the configuration, the memory floor does not move
    from anvil_fast import ANVIL
    from anvil_fast.bench.dropin import floor_ms
    from anvil_fast.core.gram_side import cascade_flops
    from anvil_fast.models.gpt import build

    floors, tall = {}, []
    for cfg in ("safe", "gram_side"):
        opt = ANVIL(build("tiny", seed=0, device="cpu"), bank_config=cfg)
        floors[cfg] = floor_ms(opt, 1.0, 1.0)
        tall = [tuple(b.p_slice.shape) for b in opt.inner.banks.values()
                if max(b.p_slice.shape[-2:]) >= 2 * min(b.p_slice.shape[-2:])]
    assert tall, "the tiny model has a bank the Gram side takes"
    saved = sum(c * (cascade_flops(m, n)["standard"] - cascade_flops(m, n)["gram_side"]) for c, m, n in tall)
    assert saved > 0
    assert floors["safe"][0] == floors["gram_side"][0]
    assert floors["safe"][1] - floors["gram_side"][1] == pytest.approx(saved / 1e9, rel=1e-9)
