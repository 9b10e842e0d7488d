"""anvil_ref.polar: any declared odd-quintic iteration in float64, and the polar factor; and the
derived quantities anvil_fast.core.tolerances takes from them for a declared iteration."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

import anvil_ref as R
from anvil_fast.core import tolerances as T
from anvil_ref import polar as P

KJ = (3.4445, -4.7750, 2.0315)


def _x(shape=(3, 20, 12), seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("rule", P.ORIENTATIONS)
def test_frobenius_iteration_is_the_cascade_in_any_orientation(rule):
    x = _x()
    y = P.quintic_iteration(x, coeffs=R.ANVIL_MAPS, normalization="frobenius", margin=R.FROBENIUS_MARGIN,
                            eps=R.FROBENIUS_EPS, transpose_when=rule)
    assert np.abs(y - R.cascade(x)).max() < 1e-13


def test_the_iteration_maps_singular_values_by_the_composite():
    # U F(s / d) V^T with d = max(margin ||X||_F, eps), computed here from the SVD
    x = _x((2, 9, 14), seed=1)
    maps = [KJ] * 5
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    d = np.maximum(1.02 * np.sqrt((x ** 2).sum(axis=(-2, -1))), 1e-7)[:, None]
    want = (u * R.composite(s / d, maps=maps)[:, None, :]) @ vh
    y = P.quintic_iteration(x, coeffs=maps, normalization="frobenius_clamp", margin=1.02, eps=1e-7)
    assert np.abs(y - want).max() < 1e-12


def test_clamped_and_additive_eps_differ_only_near_zero():
    x = _x((1, 6, 4), seed=2)
    args = dict(coeffs=[KJ], margin=1.0)
    big = [P.quintic_iteration(x, normalization=n, eps=1e-7, **args) for n in ("frobenius", "frobenius_clamp")]
    assert np.abs(big[0] - big[1]).max() < 1e-6
    tiny = 1e-12 * x  # ||X|| << eps: both divide by ~eps (relative difference ||X|| / eps ~ 5e-5)
    a = P.quintic_iteration(tiny, normalization="frobenius", eps=1e-7, **args)
    b = P.quintic_iteration(tiny, normalization="frobenius_clamp", eps=1e-7, **args)
    assert np.allclose(a, b, rtol=1e-3, atol=0) and np.abs(a).max() < 1e-3
    assert np.abs(P.quintic_iteration(tiny, normalization="frobenius_clamp", eps=0.0, **args) - big[1]).max() < 1e-12


def test_aol_scales_rows_of_the_oriented_matrix_to_a_unit_bound():
    x = _x((4, 10, 7), seed=3)
    for rule in ("tall", "wide"):
        s = P.normalized_singular_values(x, normalization="aol", eps=1e-7, transpose_when=rule)
        assert s.max() <= 1.0 + 1e-12 and s.min() > 0
    z = np.swapaxes(x, -1, -2)  # "tall" transposes this 10x7 matrix
    r = np.abs(z @ np.swapaxes(z, -1, -2)).sum(axis=-1) ** -0.5
    assert np.allclose(P.normalize(z, normalization="aol", eps=1e-7), z * r[..., None], rtol=1e-14)


def test_transposes_and_gram_side():
    assert P.transposes((3, 8, 5), transpose_when="tall") and not P.transposes((3, 5, 8), transpose_when="tall")
    assert P.gram_side((8, 5), transpose_when="tall") == 5 and P.gram_side((8, 5), transpose_when="wide") == 8
    assert P.gram_side((5, 8), transpose_when="never") == 5 and P.gram_side((5, 8), transpose_when="always") == 8


def test_composite_slope_matches_mpmath():
    maps = R.ANVIL_MAPS
    for s in (0.0, 0.1, 0.5, 0.9):
        f = lambda t: R.composite(t, maps=[tuple(mpmath.mpf(v) for v in m) for m in maps])  # noqa: E731
        want = float(mpmath.diff(f, mpmath.mpf(s)))
        assert P.composite_slope(s, maps=maps) == pytest.approx(want, rel=1e-10, abs=1e-10)
    assert P.composite_slope(0.0, maps=maps) == pytest.approx(np.prod([m[0] for m in maps]), rel=1e-15)


def test_polar_factor():
    x = _x((2, 8, 5), seed=4)
    u, _, vh = np.linalg.svd(x, full_matrices=False)
    assert np.abs(P.polar_factor(x) - u @ vh).max() < 1e-13
    assert not P.polar_factor(np.zeros((1, 3, 4))).any()
    low = x[:, :, :2] @ x[:, :2, :]  # rank 2: the zero singular values' vectors are dropped
    pf = P.polar_factor(low)
    assert np.linalg.matrix_rank(pf[0]) == 2 and np.allclose(np.linalg.svd(pf, compute_uv=False)[:, :2], 1)


def test_composite_max():
    assert P.composite_max(maps=R.ANVIL_MAPS, top=1 / R.FROBENIUS_MARGIN) == pytest.approx(1.0004, abs=2e-4)
    assert P.spectrum_top(normalization="frobenius", margin=1.05) == 1 / 1.05
    assert P.spectrum_top(normalization="aol", margin=1.05) == 1.0


@pytest.mark.parametrize("kw, match", [
    (dict(normalization="spectral"), "normalization"),
    (dict(transpose_when="sideways"), "transpose_when"),
    (dict(margin=0.0, eps=0.0), "both 0"),
    (dict(coeffs=[(1, 2)]), "triple"),
])
def test_bad_declarations_are_refused(kw, match):
    args = dict(coeffs=[KJ], normalization="frobenius", margin=1.0, eps=1e-7, transpose_when="tall") | kw
    with pytest.raises(R.ReferenceInputError, match=match):
        P.quintic_iteration(_x(), **args)


# ------------------------------------------------------------------------------ tolerances of a declared iteration

def test_roundings_of_an_identity_step_are_counted_by_hand():
    # one step (a, 0, 0): Z -> a Z, a linear map of gain 1 relative; the cast and Z_0 (2) plus the
    # step's own rounding (1); B = 0 and dB = 0 * dA: nothing from A and B
    s = np.array([[0.9, 0.5, 0.1]])
    for a in (1.0, 3.0):
        assert T.declared_roundings([(a, 0.0, 0.0)], s, long_side=5, gram_side=3) == pytest.approx(3.0, rel=1e-12)


def test_roundings_of_b_are_counted_by_hand():
    # one step (1, b, 0) on k equal singular values t (l = t^2, R = 1 + b l, G' = 1 + 3 b l):
    # * the cast and Z_0 (2 roundings) pass the map: iid entries see G' on the diagonal and
    #   (G'^2 + R^2) / 2 off it, relative to Y = R Z_0: [k G'^2 + k (k - 1) (G'^2 + R^2) / 2] / k^2 / R^2 each;
    # * Z_1's own rounding: 1;
    # * B = b l I rounded (entries of RMS RHO ||B||_F / k = RHO |b| l / sqrt(k)) reaches Z_1 as dB Z_0:
    #   k^2 entries, each t^2 times that variance, over ||Y||^2 = k R^2 t^2: (b l)^2 / R^2;
    #   A = l I rounded likewise, reaching B with weight b: (b l)^2 / R^2.
    k, t, b = 4, 0.5, -0.8
    lam = t * t
    R, dg = 1 + b * lam, 1 + 3 * b * lam
    iid0 = (k * dg ** 2 + k * (k - 1) * (dg ** 2 + R ** 2) / 2) / k ** 2 / R ** 2
    want = 2 * iid0 + 1 + 2 * (b * lam) ** 2 / R ** 2
    s = np.full((1, k), t)
    assert T.declared_roundings([(1.0, b, 0.0)], s, long_side=k, gram_side=k) == pytest.approx(want, rel=1e-12)


def test_exploded_sigma():
    assert T.exploded_sigma(0.9) == T.EXPLODED_SIGMA
    assert T.exploded_sigma(1.2) == pytest.approx(1.32)
