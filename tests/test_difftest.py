"""Differential tests: every fast component within tests/tolerances.py of anvil_ref, on every input
family (anvil_fast.difftest), and the harness itself can fail.

CPU: plain-torch kernels, eager (torch.compile is covered by one smoke test in test_bank.py), plus the
Triton kernels through the interpreter on one small shape. GPU: Triton kernels and torch.compile on
the record's shapes.
"""

from __future__ import annotations

import pytest
import torch

from anvil_fast import difftest as D
from anvil_fast.cascade import FAITHFUL, SAFE
from tests.tolerances import check

# FAITHFUL is the seed: it explodes on near-rank-1 input and overflows on huge input (by design;
# tests/test_near_rank1.py). Every other family must be within tolerance in both configurations.
FAITHFUL_FAMILIES = tuple(f for f in D.FAMILIES if f not in ("near_rank1", "huge"))


def _assert_rows(rows):
    bad = [r for r in rows if not check(r.component, fast=r.fast, eager=r.eager, floor=r.floor, ulps=r.ulps)]
    assert not bad, D.format_table(bad)


@pytest.mark.parametrize("family", D.FAMILIES)
def test_safe_within_tolerance_cpu(family):
    for shape in [(3, 40, 24), (2, 24, 40), (2, 32, 32)]:
        _assert_rows(D.run(shape, family, SAFE, compile=False))


@pytest.mark.parametrize("family", FAITHFUL_FAMILIES)
def test_faithful_within_tolerance_cpu(family):
    _assert_rows(D.run((3, 40, 24), family, FAITHFUL, compile=False))


def test_triton_kernels_in_the_interpreter_within_tolerance():
    pytest.importorskip("triton")
    for cfg in (SAFE, FAITHFUL):
        row, _ = D.cascade_row((2, 40, 24), "gaussian", cfg, backend="triton", compile=False,
                               device="cuda" if torch.cuda.is_available() else "cpu")
        _assert_rows([row])


def test_the_harness_catches_a_wrong_cascade(monkeypatch):
    # a mutant: the last map skipped (the cascade is robust to small coefficient errors by design,
    # so a plausible slip is a dropped step) -> the cascade row must fail
    import anvil_fast.difftest as mod
    from anvil_ref.constants import ANVIL_MAPS

    wrong = list(ANVIL_MAPS[:-1])
    real = mod.fast_cascade
    monkeypatch.setattr(mod, "fast_cascade", lambda x, **kw: real(x, **{**kw, "maps": wrong}))
    row, _ = D.cascade_row((2, 48, 32), "gaussian", SAFE, compile=False)
    assert not check(row.component, fast=row.fast, eager=row.eager, floor=row.floor)


def test_the_harness_catches_a_wrong_update(monkeypatch):
    import anvil_fast.difftest as mod

    real = mod.sign_aligned_decay_update
    monkeypatch.setattr(mod, "sign_aligned_decay_update",
                        lambda p, m, u, wd, lr, g, **kw: real(p, m, u, wd * 1.001, lr, g, **kw))
    row = D.update_row(torch.randn(2, 16, 8), (2, 16, 8), "gaussian", SAFE, compile=False)
    assert not check("update", fast=row.fast, eager=row.eager, floor=row.floor)


def test_cli_prints_a_table(capsys):
    assert D.main(["--shapes", "2x16x8", "--families", "gaussian,zero", "--configs", "safe", "--compile", "no"]) == 0
    out = capsys.readouterr().out
    assert "cascade" in out and "update" in out and "FAIL" not in out


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SAFE, FAITHFUL], ids=lambda c: c.name)
def test_gpu_within_tolerance(config):
    fams = D.FAMILIES if config is SAFE else FAITHFUL_FAMILIES
    for shape in [(4, 96, 96), (2, 256, 768), (2, 2816, 768)]:
        for fam in fams:
            _assert_rows(D.run(shape, fam, config, device="cuda"))
