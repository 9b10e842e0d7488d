"""derive_maps.remez: the minimax odd polynomial for the constant 1 on [l, u]."""

import mpmath
import pytest

from derive_maps.errors import ConvergenceError, DeriveMapsError
from derive_maps.remez import narrow_limit, odd_poly, recentre, remez_odd


def _mp(s):
    from derive_maps.errors import parse_real
    q = parse_real(s, "x")
    return mpmath.mpf(q.numerator) / q.denominator


@pytest.mark.parametrize("l, u", [("1e-3", "1"), ("0.3", "2"), ("1/300", "1/1.05")])
def test_degree_one_closed_form(l, u):
    # best c*x for 1 on [l, u]: c = 2/(l+u), E = (u-l)/(u+l)
    with mpmath.workdps(40):
        r = remez_odd(l, u, degree=1)
        L, U = _mp(l), _mp(u)
        assert abs(r.coeffs[0] - 2 / (L + U)) < mpmath.mpf(10) ** -35
        assert abs(r.error - (U - L) / (U + L)) < mpmath.mpf(10) ** -35


@pytest.mark.parametrize("l, u", [("1e-3", "1"), ("0.3", "2"), ("1/300", "1/1.05")])
def test_cubic_matches_the_papers_closed_form(l, u):
    # Polar Express paper, Sec. 4.2: p = beta * p_NS(alpha x), p_NS = 3/2 x - 1/2 x^3,
    # alpha = sqrt(3 / (u^2 + l u + l^2)), beta = 4 / (2 + l u (l + u) alpha^3)
    with mpmath.workdps(40):
        L, U = _mp(l), _mp(u)
        al = mpmath.sqrt(3 / (U ** 2 + L * U + L ** 2))
        be = 4 / (2 + L * U * (L + U) * al ** 3)
        r = remez_odd(l, u, degree=3)
        assert abs(r.coeffs[0] - be * 3 / 2 * al) < mpmath.mpf(10) ** -34
        assert abs(r.coeffs[1] + be / 2 * al ** 3) < mpmath.mpf(10) ** -34


@pytest.mark.parametrize("degree", [5, 7, 9])
def test_equioscillation_and_optimality(degree):
    with mpmath.workdps(40):
        r = remez_odd("1/300", "1/1.05", degree=degree)
        n = (degree + 1) // 2
        assert len(r.reference) == n + 1
        errs = [1 - odd_poly(r.coeffs, x) for x in r.reference]
        # alternating signs, equal magnitude E
        for e0, e1 in zip(errs, errs[1:]):
            assert e0 * e1 < 0
        for e in errs:
            assert abs(abs(e) - r.error) <= mpmath.mpf(10) ** -25 * r.error
        # no point of a dense sample exceeds E
        L, U = _mp("1/300"), _mp("1/1.05")
        worst = max(abs(1 - odd_poly(r.coeffs, L + (U - L) * k / 4000)) for k in range(4001))
        assert worst <= r.error * (1 + mpmath.mpf(10) ** -25)


def test_higher_degree_is_better():
    e = [remez_odd("1e-3", "1", degree=d).error for d in (3, 5, 7)]
    assert e[0] > e[1] > e[2]


def test_narrow_interval_tends_to_newton_schulz():
    assert narrow_limit(3, 1) == (mpmath.mpf("1.875"), mpmath.mpf("-1.25"), mpmath.mpf("0.375"))
    with mpmath.workdps(40):
        for w in ("1e-4", "1e-7", "1e-15", "1e-30"):
            l = 1 - _mp(w)
            r = remez_odd(l, 1)
            m = (l + 1) / 2
            limit = narrow_limit(3, m)
            for c, c0 in zip(r.coeffs, limit):
                assert abs(c / c0 - 1) <= 10 * _mp(w) ** 2 + mpmath.mpf(10) ** -30


def test_recentre_modes():
    with mpmath.workdps(40):
        r = remez_odd("0.1", "1")
        l, u = _mp("0.1"), _mp("1")
        g = recentre(r.coeffs, l, u, mode="geometric")
        assert abs(odd_poly(g, l) * odd_poly(g, u) - 1) < mpmath.mpf(10) ** -35
        a = recentre(g, l, u, mode="arithmetic")
        assert abs(odd_poly(a, l) + odd_poly(a, u) - 2) < mpmath.mpf(10) ** -35
        # the Remez solution is already arithmetically centred
        assert abs(odd_poly(r.coeffs, l) + odd_poly(r.coeffs, u) - 2) < mpmath.mpf(10) ** -30
        with pytest.raises(DeriveMapsError, match="arithmetic"):
            recentre(r.coeffs, l, u, mode="median")


@pytest.mark.parametrize("kwargs, match", [
    (dict(l=0, u=1), "l > 0"),
    (dict(l=-1, u=1), "l > 0"),
    (dict(l=1, u=1), "l < u"),
    (dict(l="2", u="1"), "l < u"),
    (dict(l="1e-3", u=1, degree=4), "odd positive"),
    (dict(l="1e-3", u=1, dps=10), "too low"),
    (dict(l="one", u=1), "cannot read"),
    (dict(l=float("nan"), u=1), "finite"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(DeriveMapsError, match=match):
        remez_odd(**kwargs)


def test_non_convergence_is_reported():
    with pytest.raises(ConvergenceError, match="max_iter"):
        remez_odd("1e-3", "1", max_iter=1, tol=1e-30)
