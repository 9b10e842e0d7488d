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
