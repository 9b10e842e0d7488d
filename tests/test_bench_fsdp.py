"""anvil_fast.bench fsdp: its argument checks and, on gloo CPU ranks, that the bytes it reports as
sent are the bytes the exchange formula predicts (timings come only from the GPU)."""

from __future__ import annotations

import argparse

import pytest

from anvil_fast.bench import fsdp as B


def _args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    B.add_args(ap)
    return ap.parse_args([f"--{k}={v}" for k, v in kw.items()])


@pytest.mark.parametrize("kw", [dict(worlds="0,2"), dict(worlds="two"), dict(worlds=""), dict(steps=0)])
def test_bad_worlds_or_steps_get_one_line_and_status_2(kw, capsys):
    assert B.run(_args(**kw)) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "--worlds" in out[0] and "--steps" in out[0]


def _rows(text: str) -> dict[int, list[float]]:
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[0].isdigit():
            rows[int(cells[0])] = [float(c) for c in cells[1:]]
    return rows


@pytest.mark.slow
def test_the_table_reports_the_formulas_bytes_on_gloo_ranks(capsys):
    """One rank sends nothing; two ranks send exactly what ``comm_bytes`` says, summed over both."""
    assert B.run(_args(size="tiny", worlds="1,2", dtype="float32", steps=1)) == 0
    out = capsys.readouterr().out
    assert "single-process drop-in step" in out
    rows = _rows(out)
    assert sorted(rows) == [1, 2], out
    step1, *_, mb1, formula1 = rows[1]
    step2, *_, mb2, formula2 = rows[2]
    assert mb1 == formula1 == 0.0
    assert mb2 == formula2 > 0.0
    assert step1 > 0.0 and step2 > 0.0
