"""Differential tests: every fast component within anvil_fast/core/tolerances.py of anvil_ref, on every input
family (anvil_fast.studies.difftest), and the harness itself can fail.

CPU: plain-torch kernels, eager (torch.compile is covered by one smoke test in test_bank.py), plus the
Triton kernels through the interpreter on one small shape. GPU: Triton kernels and torch.compile on
the record's shapes.
"""

from __future__ import annotations

import pytest
import torch

from anvil_fast.studies import difftest as D
from anvil_fast.core.cascade import FAITHFUL, SAFE
from anvil_fast.core import tolerances as TOL
from anvil_fast.core.tolerances import check, check_row

# FAITHFUL is the seed: it explodes on near-rank-1 input and overflows on huge input (by design;
# tests/test_near_rank1.py). Every other family must be within tolerance in both configurations.
FAITHFUL_FAMILIES = tuple(f for f in D.FAMILIES if f not in ("near_rank1", "huge"))


def _assert_rows(rows, *, same_backend=True):
    bad = [r for r in rows if not check_row(r, same_backend=same_backend)]
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
        _assert_rows([row], same_backend=False)


def test_the_harness_catches_a_wrong_cascade(monkeypatch):
    # a mutant: the last map skipped (the cascade is robust to small coefficient errors by design,
    # so a plausible slip is a dropped step) -> the cascade row must fail
    import anvil_fast.studies.difftest as mod
    from anvil_ref.constants import ANVIL_MAPS

    wrong = list(ANVIL_MAPS[:-1])
    real = mod.fast_cascade
    monkeypatch.setattr(mod, "fast_cascade", lambda x, **kw: real(x, **{**kw, "maps": wrong}))
    row, _ = D.cascade_row((2, 48, 32), "gaussian", SAFE, compile=False)
    assert not check(row.component, fast=row.fast, eager=row.eager, floor=row.floor)
    assert not check_row(row)


def _shared_maps_bug(monkeypatch, maps):
    """Both the fast and the eager cascade run ``maps`` (a bug in what both import), the reference not."""
    import anvil_fast.studies.difftest as mod

    fast, eager = mod.fast_cascade, mod.eager_bf16_cascade
    monkeypatch.setattr(mod, "fast_cascade", lambda x, **kw: fast(x, **{**kw, "maps": maps}))
    monkeypatch.setattr(mod, "eager_bf16_cascade", lambda x, **kw: eager(x, **{**kw, "maps": maps}))


@pytest.mark.parametrize("config", [SAFE, FAITHFUL], ids=lambda c: c.name)
@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (2, 32, 32)])
def test_a_shared_one_percent_coefficient_change_fails(monkeypatch, config, shape):
    # +1% on every map's c in what fast and eager both use: the factor rule still passes (fast ==
    # eager), the eager-vs-float64 side must not
    from anvil_ref.constants import ANVIL_MAPS

    _shared_maps_bug(monkeypatch, tuple((a, b, 1.01 * c) for a, b, c in ANVIL_MAPS))
    row, _ = D.cascade_row(shape, "well_conditioned", config, compile=False)
    assert check(row.component, fast=row.fast, eager=row.eager, floor=row.floor), "the factor rule alone"
    assert not check_row(row), D.format_table([row])


def test_a_shared_dropped_map_fails(monkeypatch):
    # (a wrong margin is not visible here: on well-conditioned input every s/d stays inside the maps'
    # design interval, where F ~ 1 whatever d is; the margin matters at its top end, near-rank-1 input,
    # tests/test_near_rank1.py)
    from anvil_ref.constants import ANVIL_MAPS

    _shared_maps_bug(monkeypatch, ANVIL_MAPS[:-1])
    row, _ = D.cascade_row((3, 40, 24), "well_conditioned", SAFE, compile=False)
    assert not check_row(row), D.format_table([row])


def test_a_fast_only_coefficient_change_loses_the_shared_bits(monkeypatch):
    import anvil_fast.studies.difftest as mod
    from anvil_ref.constants import ANVIL_MAPS

    wrong = tuple((a, b, 1.001 * c) for a, b, c in ANVIL_MAPS)
    fast = mod.fast_cascade
    monkeypatch.setattr(mod, "fast_cascade", lambda x, **kw: fast(x, **{**kw, "maps": wrong}))
    row, _ = D.cascade_row((3, 40, 24), "gaussian", SAFE, compile=False)
    assert check(row.component, fast=row.fast, eager=row.eager, floor=row.floor), "the factor rule alone"
    assert not check_row(row), D.format_table([row])
    assert check_row(row, same_backend=False)  # across backends only the factor rule applies


@pytest.mark.parametrize("component", ["momentum", "equalizer"])
def test_a_shared_elementwise_coefficient_change_fails(monkeypatch, component):
    # a bug shared by fast and eager in an element-wise component: the rail blend weight, or the
    # equalizer's EMA weight, both off by 1%
    import anvil_fast.studies.difftest as mod

    if component == "momentum":
        rails, eager = mod.twin_rail, mod.eager_rails
        monkeypatch.setattr(mod, "twin_rail",
                            lambda g, v, *, fast_weight, **kw: rails(g, v, fast_weight=fast_weight * 1.01, **kw))
        monkeypatch.setattr(mod, "eager_rails", lambda *a, fast_weight, **kw: eager(*a, fast_weight=fast_weight * 1.01, **kw))
        row, _ = D.momentum_row((3, 40, 24), "gaussian", SAFE, compile=False)
    else:
        eq, eager = mod.equalize, mod.eager_equalizer
        monkeypatch.setattr(mod, "equalize", lambda v, e, *, beta2, **kw: eq(v, e, beta2=1 - (1 - beta2) * 1.01, **kw))
        monkeypatch.setattr(mod, "eager_equalizer", lambda v, e, *, beta2: eager(v, e, beta2=1 - (1 - beta2) * 1.01))
        _, ref_y = D.cascade_row((3, 40, 24), "gaussian", SAFE, compile=False)
        row, _ = D.equalizer_row(ref_y, (3, 40, 24), "gaussian", SAFE, compile=False)
    assert check(row.component, fast=row.fast, eager=row.eager, floor=row.floor), "the factor rule alone"
    assert not check_row(row), D.format_table([row])


def test_the_harness_catches_a_wrong_update(monkeypatch):
    import anvil_fast.studies.difftest as mod

    real = mod.sign_aligned_update
    monkeypatch.setattr(mod, "sign_aligned_update",
                        lambda p, m, u, *, eff_wd, **kw: real(p, m, u, eff_wd=eff_wd * 1.001, **kw))
    row = D.update_row(torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(101)), (2, 16, 8), "gaussian", SAFE, compile=False)
    assert not check("update", fast=row.fast, eager=row.eager, floor=row.floor)


def test_cli_prints_a_table(capsys):
    assert D.main(["--shapes", "2x16x8", "--families", "gaussian,zero", "--configs", "safe", "--compile", "no"]) == 0
    out = capsys.readouterr().out
    assert "cascade" in out and "update" in out and "\n8 rows: 8 ok, 0 FAIL, 0 expected-fail\n" in out


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SAFE, FAITHFUL], ids=lambda c: c.name)
def test_gpu_within_tolerance(config):
    fams = D.FAMILIES if config is SAFE else FAITHFUL_FAMILIES
    for shape in [(4, 96, 96), (2, 256, 768), (2, 2816, 768)]:
        for fam in fams:
            _assert_rows(D.run(shape, fam, config, device="cuda"), same_backend=False)


def test_the_eager_side_counts_roundings_by_path_and_size():
    # the split ``a*X + X@B`` (FAITHFUL above SPLIT_BADDBMM_MIN_ROWS rows) makes 27 roundings, the fused
    # one 21; the mean singular-value bound applies up to CASCADE_SV_MAX_DIM rows/cols, and where it
    # applies a missing measurement fails
    from anvil_fast.core import tolerances as TOL

    def row(shape, config, eager, sv):
        return D.Row("cascade", shape, "well_conditioned", config, fast=eager, floor=0.0017, eager=eager,
                     same_bits=1.0, eager_sv=sv, well_conditioned=True)

    mid = (27 ** 0.5 * TOL.RHO + 21 ** 0.5 * TOL.RHO) / 2
    assert check_row(row((2, 2816, 768), "faithful", mid, None))
    assert not check_row(row((2, 2816, 768), "safe", mid, None))
    assert not check_row(row((2, 40, 24), "faithful", 0.004, None))
    assert check_row(row((2, 40, 24), "faithful", 0.004, 0.5 * TOL.cascade_sv_bound()))
    assert not check_row(row((2, 40, 24), "faithful", 0.004, 1.5 * TOL.cascade_sv_bound()))


def test_the_cascades_shared_bits_check_holds_only_where_it_separates_a_slip():
    # Below the size limit a share under SAME_BITS fails the row; above it the share is not judged
    # (honest and slipped shares overlap there), the other sides of the rule still are.
    import dataclasses

    small = D.Row("cascade", (2, 48, 32), "gaussian", "safe", 0.005, 0.002, 0.005, "", same_bits=0.3,
                  well_conditioned=False, device="cpu", cap_ratio=0.01)
    big = dataclasses.replace(small, shape=(2, 256, 768))
    assert not TOL.check_row(small)
    assert TOL.check_row(dataclasses.replace(small, same_bits=0.9))
    assert TOL.check_row(big)
    assert not TOL.check_row(dataclasses.replace(big, fast=0.05))  # the factor rule still applies
    assert max(small.shape[-2:]) <= TOL.SAME_BITS_CASCADE_MAX_DIM < max(big.shape[-2:])
