"""The Gram-side cascade: reference (float64) equal to anvil_ref.cascade for every schedule, and the
fast path (CPU: torch fallback and interpreted Triton kernels) against its own eager bf16 version."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import anvil_ref as A
from anvil_ref import ReferenceInputError
from anvil_ref.cascade import cascade
from anvil_ref.gram_side import check_restarts, gram_side_cascade
from tests.test_cascade import lipschitz_of_composite

U64 = np.finfo(np.float64).eps / 2

SCHEDULES = [(), (3,), (2, 4), (2, 3, 4, 5, 6)]
SHAPES = {"tall": (1, 40, 12), "wide": (1, 12, 40), "square": (1, 20, 20), "batched": (2, 3, 30, 10)}


def equality_tolerance(n: int, maps) -> float:
    """Bound on ||gram_side_cascade(X) - cascade(X)||_2 from float64 rounding alone. Each side is
    within its own rounding bound of the exact result (tests/test_cascade.py's reasoning: products of
    inner dimension <= n, each entry with relative error <= n*u, amplified by at most max|F'|): the
    cascade makes 3 products per map, the Gram side 4 (Q_k's A^2, Q A, (Q A) Q, R Q_k) plus a restart's
    X_0 R and Gram and the final X_0 R (3 more, counted for every map to cover any schedule)."""
    k = len(maps)
    return ((3 * k + 1) + (7 * k + 3)) * n * U64 * lipschitz_of_composite(maps) * 4


def _x(shape, seed, spread=1e-3):
    rng = np.random.default_rng(seed)
    *lead, m, n = shape
    r = min(m, n)
    u = np.linalg.qr(rng.standard_normal((*lead, m, r)))[0]
    v = np.linalg.qr(rng.standard_normal((*lead, n, r)))[0]
    s = np.exp(rng.uniform(np.log(spread), 0.0, (*lead, 1, r)))
    return (u * s) @ np.swapaxes(v, -1, -2)


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_reference_equals_cascade(shape, sched):
    x = _x(shape, seed=11)
    got, want = gram_side_cascade(x, restarts=sched), cascade(x)
    err = np.linalg.norm(got - want, 2, axis=(-2, -1)).max()
    tol = equality_tolerance(max(shape[-2:]), A.ANVIL_MAPS)
    assert err <= tol, f"{shape} {sched}: ||gram_side - cascade||_2 = {err:.3e} > {tol:.3e}"
    # the output is not trivially small: F maps these singular values to ~1
    assert np.linalg.norm(want, 2, axis=(-2, -1)).min() > 0.5


@pytest.mark.parametrize("name", A.available_map_sets())
@pytest.mark.parametrize("sched", [(), (3,), (2, 4)], ids=str)
def test_reference_equals_cascade_every_map_set(name, sched):
    maps = A.load_maps(name)
    sched = tuple(j for j in sched if j <= len(maps))
    for shape in ((2, 36, 9), (2, 9, 36)):
        x = _x(shape, seed=5)
        got = gram_side_cascade(x, maps=name, restarts=sched, margin=1.02, eps=1e-7)
        want = cascade(x, maps=name, margin=1.02, eps=1e-7)
        err = np.linalg.norm(got - want, 2, axis=(-2, -1)).max()
        assert err <= equality_tolerance(36, maps), f"{name} {shape} {sched}: {err:.3e}"


def test_reference_differs_from_cascade_with_other_normalization():
    # the check above can fail: a different margin on one side moves the output far beyond the bound
    x = _x((1, 40, 12), seed=3)
    err = np.linalg.norm((gram_side_cascade(x, margin=1.2) - cascade(x))[0], 2)
    assert err > 1e3 * equality_tolerance(40, A.ANVIL_MAPS)


def test_reference_torch_in_torch_out_and_zero():
    x = torch.zeros(2, 30, 10, dtype=torch.float64)
    y = gram_side_cascade(x, restarts=(3,))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float64 and tuple(y.shape) == (2, 30, 10)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("bad,match", [((1,), "map number in 2..6"), ((7,), "2..6"), ((4, 3), "increasing"),
                                       ((3, 3), "increasing"), (3, "tuple"), ((2.5,), "map number"),
                                       ((True,), "map number")])
def test_bad_restarts(bad, match):
    with pytest.raises(ReferenceInputError, match=match):
        check_restarts(bad, 6)
    with pytest.raises(ReferenceInputError, match=match):
        gram_side_cascade(np.ones((4, 2)), restarts=bad)


def test_reference_bad_input():
    with pytest.raises(ReferenceInputError, match="at least one row"):
        gram_side_cascade(np.ones((0, 3)))
    with pytest.raises(ReferenceInputError, match="both 0"):
        gram_side_cascade(np.ones((3, 2)), margin=0.0, eps=0.0)


# ------------------------------------------------------------------ fast path (CPU)
import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from anvil_fast.studies import difftest as D
from anvil_fast.core.cascade import (GRAM_SIDE, GRAM_SIDE_RESTARTS, SAFE, CascadeConfig, CascadeWorkspace,  # noqa: E402
                                cascade_workspace, fast_cascade, fast_gram_side, get_config,
                                gram_side_workspace)
from anvil_fast.kernels.gram import GramInputError, sym_aX_plus_mm  # noqa: E402
from anvil_fast.core.gram_side import GRAM_SIDE_MIN_ASPECT, eager_gram_side_cascade, uses_gram_side  # noqa: E402
from anvil_fast.studies.gram_side_study import STUDY_ALLOWANCE, choose_schedule  # noqa: E402
from anvil_fast.studies.near_rank1 import EXPLODED, near_rank1, top_singular_value  # noqa: E402

STUDY_JSON = Path(__file__).resolve().parents[1] / "papers" / "data" / "gram_side_study.json"


def _bf16(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_config_is_registered_and_validated():
    from anvil_fast.core.cascade import restarts_of
    from anvil_fast.core.gram_side import STUDIED

    assert get_config("gram_side") is GRAM_SIDE and GRAM_SIDE.gram_side == STUDIED
    assert restarts_of(GRAM_SIDE) == GRAM_SIDE_RESTARTS and restarts_of(SAFE) is None
    assert restarts_of(dataclasses.replace(GRAM_SIDE, gram_side=(3, 5)), "polar_express_paper6") == (3, 5)
    # SAFE's normalization, margin and guard are kept
    assert (GRAM_SIDE.fp32_trace, GRAM_SIDE.prescale, GRAM_SIDE.margin(), GRAM_SIDE.guard) == \
        (SAFE.fp32_trace, SAFE.prescale, SAFE.margin(), SAFE.guard)
    with pytest.raises(ValueError, match="prescale"):
        CascadeConfig("x", fp32_trace=True, prescale=False, margin_slack=0.0, fused_axb=True, guard=True,
                      gram_side=(3,))
    with pytest.raises(ValueError, match="tuple"):
        dataclasses.replace(GRAM_SIDE, gram_side=[3])


@pytest.mark.parametrize("shape,want", [((24, 2816, 768), True), ((24, 768, 3072), True), ((768, 768), False),
                                        ((1000, 600), False), ((1536, 768), True), ((1535, 768), False),
                                        ((1, 256), True)])
def test_dispatch_rule(shape, want):
    assert uses_gram_side(shape) is want
    assert uses_gram_side(shape, device="cpu") is want
    assert GRAM_SIDE_MIN_ASPECT == 2.0


@pytest.mark.parametrize("shape,want", [((24, 2816, 768), True), ((24, 768, 3072), True), ((8, 256, 768), False),
                                        ((8, 768, 256), False), ((1024, 512), True), ((766, 383), False),
                                        ((768, 768), False)])
def test_dispatch_rule_on_cuda_needs_a_long_enough_short_side(shape, want):
    # the H200 bank benchmark: the Gram side wins on short side 768 and loses on 256
    assert uses_gram_side(shape, device="cuda") is want
    assert uses_gram_side(shape, device=torch.device("cuda", 0)) is want


def test_sym_aX_plus_mm_torch_and_interpreted_kernel():
    n = 40  # not a multiple of the interpreter's 32-tiles: partial tiles are masked
    A = _bf16((2, n, n), 1)
    A = ((A.float() + A.float().mT) / 2).bfloat16()
    B = ((A.float() @ A.float()) * 0.1).bfloat16()  # a polynomial in A: B P is symmetric in exact arithmetic
    P = (2.0 * A.float() + B.float() @ A.float()).bfloat16()
    got = sym_aX_plus_mm(P, B, P, a=1.5, backend="torch")
    want = 1.5 * P.float() + B.float() @ P.float()
    assert torch.equal(got, got.mT)  # exactly symmetric
    low = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert torch.equal(got[:, low], want.bfloat16()[:, low])  # the lower triangle, rounded once
    from anvil_fast.kernels.backend import interpreting

    if interpreting():
        # The kernel sums the same fp32 products in another order (32-wide K tiles): the sums differ by
        # <= n * 2**-24 relative, which moves a bf16 rounding only for values that close to a rounding
        # boundary, a share ~ n * 2**-24 / 2**-8 = n * 2**-16 (6e-4 here), and then by one ulp.
        tri = sym_aX_plus_mm(P, B, P, a=1.5, backend="triton")
        assert torch.equal(tri, tri.mT)
        assert float((tri == got).double().mean()) >= 0.99
        ulp = torch.exp2(torch.floor(torch.log2(got.float().abs().clamp_min(2.0 ** -126))) - 7)
        assert bool(((tri.float() - got.float()).abs() <= ulp).all())


def test_sym_aX_plus_mm_slices_the_batch_at_the_grid_limit(triton_dev, monkeypatch):
    # The v1 kernel's grid axis 1 holds the matrix index: with its limit lowered to 2, five matrices
    # take three launches and give the bits of one launch.
    from anvil_fast.kernels import backend as T
    from anvil_fast.kernels import gram_kernels as K
    from anvil_fast.kernels.gram import TileConfig

    v1 = TileConfig(32, 32, 32, 4, 1, kernel="v1")
    A = _bf16((5, 40, 40), 3)
    A = ((A.float() + A.float().mT) / 2).bfloat16().to(triton_dev)
    B = ((A.float() @ A.float()) * 0.1).bfloat16()
    whole = sym_aX_plus_mm(A, B, A, a=0.5, backend="triton", config=v1)
    real, launches = K._sym_mm_add_kernel_v1, []

    class Count:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(K, "_sym_mm_add_kernel_v1", Count())
    monkeypatch.setattr(T, "MAX_GRID_Y", 2)
    sliced = sym_aX_plus_mm(A, B, A, a=0.5, backend="triton", config=v1)
    assert [g[1] for g in launches] == [2, 2, 1]
    assert torch.equal(sliced, whole)


def test_sym_aX_plus_mm_bad_input():
    a = _bf16((2, 8, 8), 0)
    with pytest.raises(GramInputError, match="square"):
        sym_aX_plus_mm(a, a, _bf16((2, 8, 4), 1), a=1.0)
    with pytest.raises(GramInputError, match="finite"):
        sym_aX_plus_mm(a, a, a, a=float("nan"))
    with pytest.raises(GramInputError, match="overlap"):
        sym_aX_plus_mm(a, a, a, a=1.0, out=a)


@pytest.mark.parametrize("shape", [(2, 72, 24), (2, 24, 72)], ids=["tall", "wide"])
@pytest.mark.parametrize("sched", [(), (3,), (2, 4)], ids=str)
def test_interpreted_kernels_against_torch_fallback(shape, sched):
    # The kernels sum in another order than the torch fallback, and the Gram side carries a differing
    # last bit into every later product, so the two are two draws of one error: the factor rule.
    from anvil_fast.kernels.backend import interpreting
    from anvil_fast.core.tolerances import bf16_bound

    if not interpreting():
        pytest.skip("needs Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    ref = A.cascade(x.bfloat16(), margin=GRAM_SIDE.margin())
    tri = D.rel_err(fast_gram_side(x, restarts=sched, backend="triton"), ref)
    tor = D.rel_err(fast_gram_side(x, restarts=sched, backend="torch"), ref)
    assert tri <= bf16_bound(tor) and tor <= bf16_bound(tri), (tri, tor)


def _gram_side_with_a_copy(x: torch.Tensor, sched, backend: str) -> torch.Tensor:
    """The Gram-side cascade in its obvious form, Q = a I + B built in a buffer of its own by a copy of
    B, with the same kernels as the package: the oracle for its buffer rotation (Q made in B's buffer
    once B's last reader has run), which must change no bit."""
    from anvil_fast.core.cascade import normalize_workspace
    from anvil_fast.core.gram_side import restart_product
    from anvil_fast.kernels.gram import XTX, XXT, aX_plus_mm, ba_plus_cAA

    ws = CascadeWorkspace.for_shape(tuple(x.shape), x.device)
    ws.X.copy_(x)
    normalize_workspace(ws, GRAM_SIDE, margin=A.FROBENIUS_MARGIN, eps=A.FROBENIUS_EPS, backend=backend,
                        compile=False, partials_ready=False)
    tall = x.shape[-2] > x.shape[-1]
    gram = XTX if tall else XXT
    X0, C, Am, B = ws.X, ws.C, ws.A, ws.B
    R, R2, P = torch.empty_like(Am), torch.empty_like(Am), torch.empty_like(Am)
    gram(X0, out=Am, backend=backend)
    fresh = True
    maps = A.load_maps(A.ANVIL_MAPS)
    for k, (a, b, c) in enumerate(maps, start=1):
        if k in sched:
            restart_product(X0, R, C, tall, backend)
            X0, C = C, X0
            gram(X0, out=Am, backend=backend)
            fresh = True
        ba_plus_cAA(Am, alpha=c, beta=b, out=B, backend=backend)
        if fresh:
            R.copy_(B)
            d = R.diagonal(dim1=-2, dim2=-1)
            d.copy_(d.float() + a)
            fresh = False
        else:
            (aX_plus_mm(R, R, B, a=a, out=R2, backend=backend) if tall
             else aX_plus_mm(R, B, R, a=a, out=R2, backend=backend))
            R, R2 = R2, R
        if k < len(maps) and k + 1 not in sched:
            sym_aX_plus_mm(Am, B, Am, a=a, out=P, backend=backend)
            sym_aX_plus_mm(P, B, P, a=a, out=Am, backend=backend)
    restart_product(X0, R, C, tall, backend)
    return C


@pytest.mark.parametrize("shape", [(2, 72, 24), (2, 24, 72)], ids=["tall", "wide"])
@pytest.mark.parametrize("sched", [(), (3,), (2, 4), (2, 3, 4, 5, 6)], ids=str)
def test_buffer_rotation_changes_no_bit(shape, sched, triton_dev):
    x = _bf16(shape, 11).to(triton_dev)
    for be in ("torch", "triton"):
        ws = CascadeWorkspace.for_shape(tuple(x.shape), x.device)
        ws.X.copy_(x)
        cfg = dataclasses.replace(GRAM_SIDE, gram_side=tuple(sched))
        # called directly: cascade_workspace's dispatch sends short sides under 384 to SAFE on CUDA
        got = gram_side_workspace(ws, config=cfg, backend=be, compile=False)
        want = _gram_side_with_a_copy(x, sched, be)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (be, shape, sched)


def test_dispatch_in_cascade_workspace():
    tall = torch.randn(2, 72, 24, generator=torch.Generator().manual_seed(4))
    square = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(4))
    assert torch.equal(fast_cascade(tall, config="gram_side", backend="torch"), fast_gram_side(tall, backend="torch"))
    assert not torch.equal(fast_cascade(tall, config="gram_side", backend="torch"),
                           fast_cascade(tall, config=SAFE, backend="torch"))
    assert torch.equal(fast_cascade(square, config="gram_side", backend="torch"),
                       fast_cascade(square, config=SAFE, backend="torch"))


def test_workspace_reuse_gives_the_same_result():
    x = _bf16((3, 64, 16), 5)
    ws = CascadeWorkspace.for_shape(tuple(x.shape), "cpu")
    outs = []
    for _ in range(2):
        ws.X.copy_(x)
        outs.append(cascade_workspace(ws, config=GRAM_SIDE, backend="torch").clone())
    assert ws.gram_side is not None and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", ["gaussian", "well_conditioned", "decaying", "near_rank1", "zero", "huge", "tiny"])
@pytest.mark.parametrize("shape", [(3, 64, 24), (3, 24, 64)], ids=["tall", "wide"])
def test_difftest_rows_within_tolerances(shape, family):
    row, ref = D.cascade_row(shape, family, GRAM_SIDE, backend="torch")
    assert row.verdict() == "ok", row
    if family == "zero":
        assert row.fast == 0.0
    if family in ("gaussian", "well_conditioned"):
        # the path is accurate, not merely close to its eager twin: within the bf16 cascade's own error
        assert row.fast <= 0.02, row


def test_difftest_rule_catches_a_wrong_restart():
    # a fast path that forgot to reset R at the restart (R := R Q_3 ... on top of X_0 R) is far outside
    shape = (3, 64, 24)
    x = D.make_matrix("gaussian", shape, seed=0)
    ref = A.cascade(x.bfloat16(), margin=GRAM_SIDE.margin())
    good = eager_gram_side_cascade(x, margin=GRAM_SIDE.margin())
    bad = eager_gram_side_cascade(x, margin=GRAM_SIDE.margin(), restarts=())
    from anvil_fast.core.tolerances import bf16_bound
    assert D.rel_err(fast_gram_side(x, backend="torch"), ref) <= bf16_bound(D.rel_err(good, ref))
    # the schedule changes the rounding only, never the math: both are within the rule of each other...
    assert D.rel_err(bad, ref) <= bf16_bound(D.rel_err(good, ref)) or GRAM_SIDE_RESTARTS == ()
    # ...while a missing map (the math) is not
    wrong = eager_gram_side_cascade(x, margin=GRAM_SIDE.margin(), maps=A.ANVIL_MAPS[:5], restarts=(3,))
    assert D.rel_err(wrong, ref) > bf16_bound(D.rel_err(good, ref))


def test_zero_and_extreme_scales():
    z = fast_gram_side(torch.zeros(2, 48, 16), backend="torch")
    assert torch.equal(z, torch.zeros_like(z))
    for e in (100, -100):
        x = torch.randn(2, 48, 16, generator=torch.Generator().manual_seed(6)) * 2.0 ** e
        y = fast_gram_side(x, backend="torch")
        # finite, nothing overflowed or exploded (at 2**-100 the input is far below eps: a tiny output)
        assert torch.isfinite(y.float()).all() and top_singular_value(y).max() <= EXPLODED


def test_near_rank1_never_explodes_cpu():
    x = near_rank1(24, 96, 32, seed=7)
    sig = top_singular_value(fast_cascade(x, config=GRAM_SIDE, backend="torch"))
    assert torch.isfinite(sig).all() and sig.max() <= EXPLODED, sig.max()
    # and the check can fail: no restart at all explodes on the same inputs
    assert top_singular_value(fast_gram_side(x, restarts=(), backend="torch")).max() > EXPLODED


def test_bank_update_with_gram_side_is_chunk_independent():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "chunk_independence", Path(__file__).resolve().parents[1] / "tools" / "chunk_independence.py")
    ci = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ci)
    rows = ci.compare((4, 72, 24), GRAM_SIDE, "cpu", compile_post=False)
    assert rows and all(same for _, same, _ in rows), rows


@pytest.mark.gpu
def test_gram_side_gpu():
    for shape in [(4, 2816, 768), (4, 768, 3072), (8, 256, 768)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(8)).cuda()
        y = fast_cascade(x, config=GRAM_SIDE)
        ref = A.cascade(x.cpu().bfloat16(), margin=GRAM_SIDE.margin())
        e = eager_gram_side_cascade(x, margin=GRAM_SIDE.margin())
        from anvil_fast.core.tolerances import bf16_bound
        assert D.rel_err(y, ref) <= bf16_bound(D.rel_err(e, ref)), shape
        # the Triton kernels against the same path's torch fallback on the same GPU: one draw of the same error
        t = fast_gram_side(x, backend="torch")
        assert D.rel_err(y, ref) <= bf16_bound(D.rel_err(t, ref)), shape
    x = near_rank1(64, 2816, 768, seed=7, device="cuda")
    assert top_singular_value(fast_cascade(x, config=GRAM_SIDE)).max() <= EXPLODED


@pytest.mark.gpu
def test_gram_side_gpu_at_a_short_side_of_384():
    """The Gram side forced (no dispatch rule) on the small GPT's bank shapes, short side 384, where
    training on the GPU had Gram-side updates refused: within the bf16 bound of the eager path and of
    its own torch fallback, and no explosion on near-rank-1 input."""
    from anvil_fast.core.tolerances import bf16_bound
    for shape in [(6, 1536, 384), (6, 384, 1536), (6, 1152, 384)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(10)).cuda()
        y = fast_gram_side(x)
        ref = A.cascade(x.cpu().bfloat16(), margin=GRAM_SIDE.margin())
        e = eager_gram_side_cascade(x, margin=GRAM_SIDE.margin())
        assert D.rel_err(y, ref) <= bf16_bound(D.rel_err(e, ref)), shape
        t = fast_gram_side(x, backend="torch")
        assert D.rel_err(y, ref) <= bf16_bound(D.rel_err(t, ref)), shape
        x1 = near_rank1(64, *shape[1:], seed=11, device="cuda")
        assert top_singular_value(fast_gram_side(x1)).max() <= EXPLODED, shape


# ------------------------------------------------------------------ the study's rule and the default
def test_choose_schedule_rule():
    rows = [{"restarts": [], "excess_max": 0.0, "exploded": 3},
            {"restarts": [3], "excess_max": 0.5, "exploded": 0},
            {"restarts": [4], "excess_max": 0.1 * STUDY_ALLOWANCE, "exploded": 0},
            {"restarts": [5], "excess_max": 0.0, "exploded": 0},
            {"restarts": [2, 4], "excess_max": -1.0, "exploded": 0}]
    assert choose_schedule(rows) == (5,)  # fewest restarts first, then the smallest excess
    assert choose_schedule(rows[:3] + rows[4:]) == (4,)
    assert choose_schedule([rows[0], rows[1], rows[4]]) == (2, 4)
    assert choose_schedule(rows[:2]) is None  # none qualifies: that map set keeps the standard cascade


def test_default_schedule_is_the_studys_choice():
    res = json.loads(STUDY_JSON.read_text())
    assert tuple(res["chosen"]) == GRAM_SIDE_RESTARTS
    assert tuple(choose_schedule(res["schedules"])) == GRAM_SIDE_RESTARTS


SCHEDULES_JSON = Path(__file__).resolve().parents[1] / "anvil_fast" / "core" / "gram_side_schedules.json"


def _power_law(shape, p, seed=0):
    from anvil_fast.studies.gram_side_study import study_input

    return study_input(f"power_law_{p}", shape, seed=seed)


def test_every_named_map_set_has_the_schedule_its_study_chose():
    from anvil_fast.core.gram_side import studied_restarts
    from anvil_fast.studies.gram_side_study import STUDY_INPUTS, named_map_sets

    doc = json.loads(SCHEDULES_JSON.read_text())
    assert doc["generated_by"].startswith("python -m anvil_fast.studies.gram_side_study --schedules")
    assert doc["inputs"] == [n for n, _, _ in STUDY_INPUTS] and doc["allowance"] == STUDY_ALLOWANCE
    sets = named_map_sets()
    assert [e["name"] for e in doc["map_sets"]] == list(sets)  # every named map set, none stale
    for e in doc["map_sets"]:
        assert [tuple(t) for t in e["maps"]] == [tuple(map(float, t)) for t in A.load_maps(sets[e["name"]])], e["name"]
        chosen = choose_schedule(e["schedules"])  # the rule applied to the stored rows gives the stored choice
        assert (None if chosen is None else list(chosen)) == e["restarts"], e["name"]
        assert studied_restarts(sets[e["name"]]) == (None if chosen is None else chosen), e["name"]
    # ANVIL_MAPS' entry is the default schedule, and Polar Express's six maps need another one
    assert studied_restarts(A.ANVIL_MAPS) == GRAM_SIDE_RESTARTS
    assert studied_restarts("polar_express_paper6") not in (None, GRAM_SIDE_RESTARTS)


def test_each_map_set_runs_its_own_schedule_and_does_not_explode():
    # Polar Express's first map has slope 8.2 at 0 (ANVIL's: 3.9): between ANVIL's restarts the Gram's
    # rounding grows ~4.4x more, and on a power-law spectrum (a small GPT's momentum) the output explodes.
    from anvil_fast.core.gram_side import studied_restarts
    from anvil_fast.core.tolerances import exploded_sigma
    from anvil_ref.polar import composite_max, spectrum_top

    maps = "polar_express_paper6"
    x = _power_law((2, 1536, 384), 1.4)  # the study's input: the smallest CUDA-dispatched short side
    limit = exploded_sigma(composite_max(maps=maps, top=spectrum_top(normalization="frobenius",
                                                                      margin=GRAM_SIDE.margin())))
    own = studied_restarts(maps)
    got = fast_cascade(x, maps=maps, config=GRAM_SIDE, backend="torch")  # the dispatch (aspect 4: Gram side)
    assert torch.equal(got, fast_gram_side(x, maps=maps, restarts=own, backend="torch"))
    assert torch.equal(got, fast_gram_side(x, maps=maps, backend="torch"))  # the driver's default is the same
    assert top_singular_value(got).max() <= limit
    ref = A.cascade(x.bfloat16(), maps=maps, margin=GRAM_SIDE.margin())
    safe = fast_cascade(x, maps=maps, config=SAFE, backend="torch")
    assert D.rel_err(got, ref) <= D.rel_err(safe, ref) + STUDY_ALLOWANCE
    # the input tells the schedules apart: ANVIL's on these maps explodes
    assert top_singular_value(fast_gram_side(x, maps=maps, restarts=GRAM_SIDE_RESTARTS, backend="torch")).max() > limit


def test_a_map_set_the_study_has_not_seen_keeps_the_standard_cascade():
    from anvil_fast.core.gram_side import studied_restarts

    mine = tuple((a * (1 + 1e-9), b, c) for a, b, c in A.load_maps(A.ANVIL_MAPS))  # not a studied set
    assert studied_restarts(mine) is None
    x = torch.randn(2, 96, 24, generator=torch.Generator().manual_seed(5))
    assert torch.equal(fast_cascade(x, maps=mine, config=GRAM_SIDE, backend="torch"),
                       fast_cascade(x, maps=mine, config=SAFE, backend="torch"))
    with pytest.raises(ValueError, match="no restart schedule for these maps"):
        fast_gram_side(x, maps=mine, backend="torch")
    with pytest.raises(ValueError, match="no schedule for these maps"):
        eager_gram_side_cascade(x, maps=mine)
    y = fast_gram_side(x, maps=mine, restarts=(4,), backend="torch")  # a schedule asked for is run
    from anvil_fast.core.tolerances import bf16_bound

    ref = A.cascade(x.bfloat16(), maps=mine, margin=GRAM_SIDE.margin())
    e = eager_gram_side_cascade(x, maps=mine, restarts=(4,), margin=GRAM_SIDE.margin())
    assert D.rel_err(y, ref) <= bf16_bound(D.rel_err(e, ref))
    assert not torch.equal(y, fast_cascade(x, maps=mine, config=SAFE, backend="torch"))


def test_the_papers_schedule_table_is_rendered_from_the_json():
    from anvil_fast.studies.gram_side_study import schedules_markdown

    doc = json.loads(SCHEDULES_JSON.read_text())
    md = Path(__file__).resolve().parents[1] / "papers" / "data" / "gram_side_schedules.md"
    assert md.read_text() == schedules_markdown(doc, doc.pop("generated_by"))


@pytest.mark.slow
def test_regenerating_a_map_sets_schedule_changes_nothing():
    # The whole table takes ~20 min on 2 cores; one five-map entry ~2 min: its choice and its rows'
    # explosion counts must come out as stored, its errors to within the CPU's summation order.
    from anvil_fast.studies.gram_side_study import named_map_sets, schedule_entry, study

    name = "polar_express_nanogpt5"
    stored = next(e for e in json.loads(SCHEDULES_JSON.read_text())["map_sets"] if e["name"] == name)
    fresh = schedule_entry(name, study(maps=named_map_sets()[name], r_precision=False))
    assert fresh["restarts"] == stored["restarts"] and fresh["maps"] == stored["maps"]
    for f, s_ in zip(fresh["schedules"], stored["schedules"], strict=True):
        assert (f["restarts"], f["exploded"]) == (s_["restarts"], s_["exploded"])
        if s_["exploded"] == 0:  # an exploded row's error is as large as the explosion: compared by its count
            assert f["excess_max"] == pytest.approx(s_["excess_max"], rel=1e-2, abs=1e-4), f["restarts"]


def test_cascade_flops_by_hand():
    from anvil_fast.core.gram_side import cascade_flops

    # m = 8, n = 2, one tile (block >= n: a symmetric product costs a full one), K = 6 maps.
    m, n = 8, 2
    gram, sq, long = 2 * m * n * n, 2 * n ** 3, 2 * m * n * n
    standard = 6 * (gram + sq + long)
    # no restart: first Gram; 6 x B; R updated on maps 2..6; P and Q P on maps 1..5; the output X_1 R
    none = gram + 6 * sq + 5 * sq + 5 * 2 * sq + long
    # restart before map 4: R fresh at maps 1 and 4 (updates on 2, 3, 5, 6); no A update after map 3
    # (map 4 re-forms it) nor after map 6; the restart's X_0 R and Gram
    one = gram + 6 * sq + 4 * sq + 4 * 2 * sq + (long + gram) + long
    got0, got1 = cascade_flops(m, n, restarts=(), block=128), cascade_flops(m, n, restarts=(4,), block=128)
    assert (got0["standard"], got0["gram_side"]) == (standard, none)
    assert (got1["standard"], got1["gram_side"]) == (standard, one)
    assert cascade_flops(n, m, restarts=(4,), block=128) == got1  # wide: the mirrored count
    # n = 256 in tiles of 128: a symmetric product executes 3 of its 4 tiles. B, P and A are
    # symmetric, R's update and the long-side products full
    m, n = 1024, 256
    gram, sq, long = 2 * m * n * n * 3 / 4, 2 * n ** 3, 2 * m * n * n
    one = gram + 6 * sq * 3 / 4 + 4 * sq + 4 * 2 * sq * 3 / 4 + (long + gram) + long
    assert cascade_flops(m, n, restarts=(4,), block=128)["gram_side"] == one


@pytest.mark.gpu
def test_gram_side_cascade_replays_in_a_cuda_graph():
    """Captured once (after a warm-up that tunes the kernels and allocates the Gram side's buffers),
    replayed on a new input: the same bits as an eager run on that input."""
    shape = (8, 1024, 256)
    g = torch.Generator().manual_seed(9)
    x1, x2 = (torch.randn(shape, generator=g).bfloat16().cuda() for _ in range(2))
    ws = CascadeWorkspace.for_shape(shape, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            ws.X.copy_(x1)
            cascade_workspace(ws, config=GRAM_SIDE)
    torch.cuda.current_stream().wait_stream(s)
    ws.X.copy_(x1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cascade_workspace(ws, config=GRAM_SIDE)
    ws.X.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    want = fast_cascade(x2, config=GRAM_SIDE)
    assert torch.equal(out, want)
    assert not torch.equal(want, fast_cascade(x1, config=GRAM_SIDE))  # the replay read the new input


def test_the_default_configuration_takes_the_gram_side_where_it_wins_on_cuda():
    """bank_config=None: GRAM_SIDE on CUDA banks of aspect >= 2 and short side >= 384 (the small and
    medium GPT's qkv, fc and mlp.proj), SAFE on square and narrow ones and everywhere on the CPU."""
    from anvil_fast.core.cascade import GRAM_SIDE, SAFE, default_config_for

    assert default_config_for((12, 2304, 768), "cuda") is GRAM_SIDE
    assert default_config_for((12, 768, 3072), "cuda") is GRAM_SIDE
    assert default_config_for((12, 768, 768), "cuda") is SAFE
    assert default_config_for((6, 1152, 384), "cuda") is GRAM_SIDE  # the small GPT's qkv bank
    assert default_config_for((8, 256, 768), "cuda") is SAFE  # short side 256 < 384
    assert default_config_for((12, 2304, 768), "cpu") is SAFE


def test_module_docstring_flop_ratios_are_cascade_flops():
    # the dispatch paragraph of anvil_fast.core.gram_side quotes two ratios: they are cascade_flops'
    import re

    import anvil_fast.core.gram_side as G

    doc = " ".join(G.__doc__.split())
    m = re.search(r"with one restart, (\d+\.\d+)x fewer for the 2816 x 768 banks, (\d+\.\d+)x more for a square bank",
                  doc)
    assert m, "the docstring's FLOP sentence"
    assert float(m.group(1)) == round(G.cascade_flops(2816, 768)["ratio"], 2)
    assert float(m.group(2)) == round(1 / G.cascade_flops(768, 768)["ratio"], 2)
