"""derive_maps.intervals and derive_maps.enclosure: every enclosure contains the exact value."""

from fractions import Fraction

import mpmath
import numpy as np
import pytest

from anvil_ref.cascade import composite
from anvil_ref.constants import ANVIL_MAPS
from derive_maps.enclosure import enclose, point_jets
from derive_maps.intervals import (BIG, DTYPE, exact_product, iv_add, iv_clamp, iv_mul, iv_point, iv_sqr,
                                   iv_sub)


def _fr(x):
    return Fraction(*DTYPE(x).as_integer_ratio())


def _rand_iv(rng, n):
    a = rng.normal(size=n) * 10.0 ** rng.integers(-3, 3, n)
    b = a + np.abs(rng.normal(size=n)) * 10.0 ** rng.integers(-12, 1, n)
    return a.astype(DTYPE), b.astype(DTYPE)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "sqr"])
def test_operations_enclose_the_exact_result(op):
    rng = np.random.default_rng(1)
    a, b = _rand_iv(rng, 300), _rand_iv(rng, 300)
    f = dict(add=lambda: iv_add(a, b), sub=lambda: iv_sub(a, b), mul=lambda: iv_mul(a, b),
             sqr=lambda: iv_sqr(a))[op]
    lo, hi = f()
    for i in range(0, 300, 7):
        for x in (_fr(a[0][i]), _fr(a[1][i]), (_fr(a[0][i]) + _fr(a[1][i])) / 2):
            for y in (_fr(b[0][i]), _fr(b[1][i])):
                exact = dict(add=x + y, sub=x - y, mul=x * y, sqr=x * x)[op]
                assert _fr(lo[i]) <= exact <= _fr(hi[i])


def test_rounding_is_outward():
    # 0.1 + 0.2 in the interval format: the exact sum of the two binary numbers is inside, and the
    # interval is not degenerate (the rounded sum alone would not contain it).
    lo, hi = iv_add(iv_point(0.1), iv_point(0.2))
    exact = Fraction(0.1) + Fraction(0.2)
    assert _fr(lo) < exact < _fr(hi)


def test_exact_products_and_clamp():
    assert exact_product(3, 0.1) is not None and _fr(exact_product(3, 0.1)) == 3 * Fraction(0.1)
    (lo, hi), blown = iv_clamp((np.array([-1e60, 0.0], dtype=DTYPE), np.array([1.0, 1e70], dtype=DTYPE)))
    assert blown.tolist() == [True, True] and hi[1] == BIG and lo[0] == -BIG


@pytest.mark.parametrize("maps", [ANVIL_MAPS, ((3.4445, -4.7750, 2.0315),) * 5])
def test_box_enclosures_contain_high_precision_values(maps):
    rng = np.random.default_rng(2)
    lo = np.sort(rng.uniform(1 / 300, 0.95, 200))
    hi = np.minimum(lo + 10.0 ** rng.uniform(-9, -1.5, 200), 0.9523)
    e = enclose(lo, hi, maps)
    # an enclosure may be the whole line only for a wide box at the steep top of the interval (there
    # the interval dependency of six composed quintics exceeds BIG); every other one is finite
    blown = ~np.all([np.isfinite(a) for pair in (e.value, e.d1) for a in pair], axis=0)
    assert not np.any(blown & ~((hi - lo > 1e-2) & (hi > 0.9))), (lo[blown], hi[blown])
    th = [[mpmath.mpf(v) for v in t] for t in maps]
    with mpmath.workdps(40):
        for i in [i for i in range(0, 200, 3) if not blown[i]]:
            for t in (0, 0.37, 1):
                x = mpmath.mpf(float(lo[i])) + (mpmath.mpf(float(hi[i])) - mpmath.mpf(float(lo[i]))) * t
                F = Fraction(mpmath.nstr(composite(x, maps=th), 35))
                dF = Fraction(mpmath.nstr(mpmath.diff(lambda s: composite(s, maps=th), x), 35))
                tol = Fraction(1, 10 ** 25)
                for (lo_, hi_), exact in ((e.value, F), (e.d1, dF)):
                    assert _fr(lo_[i]) <= exact + tol
                    assert exact - tol <= _fr(hi_[i])


def test_point_jets_are_tight():
    # At a point only rounding widens the enclosure: at most ~1e-13 even where the composite is
    # steepest (sigma -> 0.95, where later maps amplify earlier rounding ~1e6 times).
    x = np.geomspace(1 / 300, 0.95, 50)
    v, d, d2 = point_jets(x, ANVIL_MAPS, second=True)
    assert np.all(v[1] - v[0] <= 1e-12)
    ref = composite(x, maps=ANVIL_MAPS)
    assert np.all(np.abs((v[0] + v[1]) / 2 - ref) <= 1e-12)


def test_blown_up_boxes_become_the_whole_line():
    e = enclose(np.array([0.96]), np.array([1.2]), ANVIL_MAPS)      # F reaches ~1e176 there
    assert e.value[0][0] == -np.inf and e.value[1][0] == np.inf
