"""anvil_fast.studies.adapters: each adapter builds where its library is, says why not where it is not, and
declares the math its library states."""

from __future__ import annotations

import sys

import pytest
import torch

import anvil_ref as R
from anvil_fast.studies import adapters as A
from anvil_fast.studies import harness as H
from anvil_fast.core.cascade import FAITHFUL, SAFE


def test_unknown_names_and_policies_are_refused():
    with pytest.raises(ValueError, match="unknown 'nope'"):
        A.build("nope")
    with pytest.raises(ValueError, match="compile"):
        A.build("torch-muon", compile="sometimes")


def test_cuda_only_adapters_say_so_on_the_cpu():
    cuda_only = [n for n, a in A.ADAPTERS.items() if a.cuda_only]
    assert "dion-newton-schulz-triton" in cuda_only and "emerging-quintic-syrk" in cuda_only
    for n in cuda_only:
        with pytest.raises(A.Unavailable, match="needs CUDA"):
            A.build(n, device="cpu")


def test_a_missing_library_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "dion", None)  # import dion raises ImportError
    with pytest.raises(A.Unavailable, match="dion not installed"):
        A.build("dion-muon")
    monkeypatch.setitem(sys.modules, "heavyball.utils", None)
    with pytest.raises(A.Unavailable, match="heavyball not installed"):
        A.build("heavyball-ns5")
    impls, missing = A.load(["dion-muon", "anvil-safe"])
    assert [i.name for i in impls] == ["anvil-safe"] and "not installed" in missing["dion-muon"]


def test_emerging_optimizers_says_why_it_is_missing():
    try:
        import emerging_optimizers  # noqa: F401
    except Exception:
        with pytest.raises(A.Unavailable, match="emerging-optimizers not (installed|importable)") as info:
            A.build("emerging-quintic")
        if sys.version_info < (3, 12):
            assert "Python >= 3.12" in str(info.value)
    else:
        assert A.build("emerging-quintic").math.coeffs[0] == (4.0848, -6.8946, 2.9270)


def test_the_declared_math_is_the_library_s_own():
    from torch.optim import _muon

    m = A.build("torch-muon").math
    assert m.coeffs == ((_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C),) * _muon.DEFAULT_NS_STEPS
    assert (m.normalization, m.margin, m.eps, m.transpose_when) == ("frobenius_clamp", 1.0, _muon.EPS, "tall")
    m = A.build("anvil-safe").math
    assert m.coeffs == R.ANVIL_MAPS and m.margin == SAFE.margin() and m.eps == R.FROBENIUS_EPS
    assert A.build("anvil-faithful").math.margin == FAITHFUL.margin()
    assert A.build("anvil-safe-muon-jordan5").math.coeffs == R.load_maps("muon_jordan5")


def test_pytorch_optimizer_and_heavyball_declare_their_tables():
    mx = pytest.importorskip("pytorch_optimizer.optimizer.utils.matrix", reason="pytorch-optimizer (test extra)")
    pe = mx.NS_COEFFICIENTS["polar_express"]
    assert A.build("pytorch-optimizer-polar-express").math.coeffs == tuple(tuple(t) for t in pe[:5])
    assert A.build("pytorch-optimizer-original").math.coeffs == (tuple(mx.NS_COEFFICIENTS["original"][0]),) * 5
    hu = pytest.importorskip("heavyball.utils", reason="heavyball (test extra)")
    abc = hu.ABC_LIST_STABLE
    assert A.build("heavyball-msign").math.coeffs == tuple(tuple(t) for t in abc) + (tuple(abc[-1]),) * (10 - len(abc))


def test_every_available_cpu_adapter_runs_through_the_harness_without_a_false_alarm():
    # the field's correct code: no FAIL on the probe of the math (fewer matrices than a default run)
    # nor on the safety families; the explosions of a math in bf16 are findings
    names = [n for n, a in A.ADAPTERS.items() if not a.cuda_only]
    impls, missing = A.load(names, device="cpu")
    assert set(i.name for i in impls) | set(missing) == set(names)
    assert all(isinstance(v, str) and v for v in missing.values())
    rows = H.judge(impls, shapes=[(2, 24, 16)], families=("spectrum", "gaussian", "tiny"), progress=False,
                   spectrum_count=256)
    assert [r.impl for r in rows if r.family == "gaussian"] == [i.name for i in impls]
    bad = [(r.impl, r.family, r.failures()) for r in rows if r.verdict() == "FAIL"]
    assert not bad, bad
    for r in rows:
        assert r.conforms, (r.impl, r.note)
    by = {(r.impl, r.family): r for r in rows}
    assert by["anvil-safe", "gaussian"].verdict() == by["anvil-faithful", "gaussian"].verdict() == "ok"


def test_the_gram_forms_declare_their_restarts_and_dtype():
    from anvil_fast.core.cascade import GRAM_SIDE_RESTARTS

    m = A.build("anvil-gram-side").math
    assert m.restarts == tuple(k - 1 for k in GRAM_SIDE_RESTARTS)  # ANVIL_MAPS' studied schedule
    assert m.forms() == H.GRAM_FORMS and A.build("anvil-safe").math.forms() == H.FORMS
    pytest.importorskip("pytorch_optimizer.optimizer.utils.matrix", reason="pytorch-optimizer (test extra)")
    m = A.build("pytorch-optimizer-gram-ns").math
    assert (m.restarts, m.dtype) == ((2,), "float16")


def test_gram_newton_schulz_skips_cleanly_where_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "gram_newton_schulz", None)
    for n in ("gram-newton-schulz", "gram-newton-schulz-standard"):
        with pytest.raises(A.Unavailable, match="gram-newton-schulz not installed"):
            A.build(n)
    with pytest.raises(A.Unavailable, match="needs CUDA"):
        A.build("gram-newton-schulz-quack")


def test_the_listing_names_every_adapter():
    text = A.listing(device="cpu")
    for n in A.ADAPTERS:
        assert n in text
    assert "available" in text


@pytest.mark.gpu
def test_cuda_adapters_build_where_their_library_is():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    impls, missing = A.load([n for n, a in A.ADAPTERS.items() if a.cuda_only], device="cuda")
    for n, why in missing.items():
        assert "needs CUDA" not in why, (n, why)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dion-polar-express-triton", "dion-normuon-triton", "gram-newton-schulz-quack",
                                  "dion-polar-express", "gram-newton-schulz"])
def test_a_compiled_library_function_runs_every_row_after_its_spectrum_row(name):
    """dion's and gram-newton-schulz's functions are compiled whole (torch.compile(fullgraph=True)) on
    CUDA: each row after the spectrum row (where the lift runs) still calls them compiled, none raises."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    impls, missing = A.load([name], device="cuda")
    if not impls:
        pytest.skip(f"{name}: {missing.get(name)}")
    rows = H.judge(impls, shapes=[(4, 256, 768)], families=("spectrum", "gaussian", "near_rank1"), device="cuda",
                   spectrum_count=256, progress=False)
    assert all(r.verdict() != "FAIL" and "raised" not in r.note for r in rows), \
        [(r.family, r.verdict(), r.failures(), r.note) for r in rows]
