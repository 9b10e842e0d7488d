"""derive_maps.certify: certified bounds hold against dense high-precision sampling, and catch
narrow excursions that a grid misses."""

import math

import mpmath
import numpy as np
import pytest

from anvil_ref.cascade import composite
from anvil_ref.constants import ANVIL_MAPS
from anvil_ref.maps import load_maps
from derive_maps.certify import (certify_envelope, certify_headroom, certify_range, critical_points,
                                 enclose_rational)
from derive_maps.errors import DeriveMapsError
from derive_maps.polar_express import greedy

L, U = "1/300", "1/1.05"
MUON = ((3.4445, -4.7750, 2.0315),) * 5


def _mpmaps(maps):
    return [[mpmath.mpf(v) for v in t] for t in maps]


def _samples(maps, e, n=1500, seed=0):
    """Dense sample points: a geometric grid, random points, and clusters around the extrema."""
    rng = np.random.default_rng(seed)
    x = [np.geomspace(1 / 300, 1 / 1.05, n), rng.uniform(1 / 300, 1 / 1.05, n)]
    for c in (e.argmin, e.argmax):
        x.append(np.clip(c + np.linspace(-1e-4, 1e-4, 201) * c, 1 / 300, 1 / 1.05))
    crit = np.asarray(critical_points(maps, L, U), dtype=float)
    x.append(crit[:: max(1, crit.size // 300)])
    return np.concatenate(x)


@pytest.mark.parametrize("name", ["anvil", "anvil_express", "muon"])
def test_envelope_never_contradicted_by_dense_sampling(name):
    maps = MUON if name == "muon" else load_maps(name)
    e = certify_envelope(maps, L, U)
    assert e.f_min_certified <= e.f_min_attained <= e.f_max_attained <= e.f_max_certified
    th = _mpmaps(maps)
    worst = mpmath.mpf(0)
    with mpmath.workdps(30):
        for x in _samples(maps, e):
            F = composite(mpmath.mpf(float(x)), maps=th)
            assert e.f_min_certified <= F <= e.f_max_certified, x
            worst = max(worst, abs(mpmath.log(F)))
        # the attained values are attained
        assert composite(mpmath.mpf(e.argmax), maps=th) >= e.f_max_attained
        assert composite(mpmath.mpf(e.argmin), maps=th) <= e.f_min_attained
    assert worst <= e.max_abs_log_certified
    # and the bound is tight: within rtol = 1e-3 of what the sampling sees
    assert e.max_abs_log_certified <= float(worst) * (1 + 2e-3)


def _narrow_peak_set(G=1e9, eta=1e-10, xm=0.61234):
    """A deliberate narrow excursion: p1 is a cubic whose maximum 1 + eta is reached at xm, and p2 a
    steep expander around 1 (p2(1) = 1, p2'(1) = G). F = p2(p1(x)) exceeds 1 only where p1 is within
    1/G of its maximum: a peak of height ~1 + G eta = 1.1 about 1e-5 wide."""
    a1 = 1.5 * (1 + eta) / xm
    b1 = -a1 / (3 * xm * xm)
    b2 = (G - 1) / 2
    return ((a1, b1, 0.0), (1 - b2, b2, 0.0)), xm


def test_catches_a_narrow_excursion_that_a_grid_misses():
    maps, xm = _narrow_peak_set()
    th = _mpmaps(maps)
    with mpmath.workdps(40):
        f = lambda s: composite(s, maps=th)  # noqa: E731
        x_star = mpmath.findroot(lambda s: mpmath.diff(f, s), mpmath.mpf(xm))
        true_max = f(x_star)
    assert 1.09 < true_max < 1.11
    for n in (1_000, 10_000):                        # grids see nothing above 1
        assert composite(np.linspace(0.3, 0.9, n), maps=maps).max() < 1.0
    e = certify_envelope(maps, "0.3", "0.9")
    assert e.f_max_certified >= true_max >= e.f_max_attained
    assert abs(e.argmax - float(x_star)) < 1e-5
    assert e.f_max_certified - float(true_max) <= 2e-3


def test_anvils_own_narrow_dip():
    # ANVIL_MAPS: |log F| = 4.0131e-4 at both ends, but a dip 5e-5 wide near sigma = 0.95228 goes to
    # 6.59e-4; a 10^4-point geometric grid does not see it.
    x = np.geomspace(1 / 300, 1 / 1.05, 10_000)
    grid = np.abs(np.log(composite(x, maps=ANVIL_MAPS))).max()
    e = certify_envelope(ANVIL_MAPS, L, U)
    th = _mpmaps(ANVIL_MAPS)
    with mpmath.workdps(40):
        g = lambda s: mpmath.log(composite(s, maps=th))  # noqa: E731
        x_star = mpmath.findroot(lambda s: mpmath.diff(g, s), mpmath.mpf("0.9522787"))
        dip = -g(x_star)
    assert grid < 4.02e-4 < 6.5e-4 < dip <= e.max_abs_log_certified
    assert e.max_abs_log_attained <= dip


@pytest.mark.parametrize("name, band", [("anvil", 0.01), ("anvil_express", 0.01), ("muon", 0.5)])
def test_headroom(name, band):
    maps = MUON if name == "muon" else load_maps(name)
    h = certify_headroom(maps, U, band=band)
    th = _mpmaps(maps)
    with mpmath.workdps(30):
        u = mpmath.mpf(1) / mpmath.mpf("1.05")
        for t in np.linspace(0, 1, 400):
            F = composite(u * (1 + mpmath.mpf(float(t)) * h.certified), maps=th)
            assert abs(mpmath.log(F)) <= band
        if h.upper is not None:
            F = composite(u * (1 + mpmath.mpf(h.upper)), maps=th)
            assert not (F > 0 and abs(mpmath.log(F)) <= band)
            assert h.upper - h.certified <= 1e-6
        else:
            assert h.certified == h.h_max


@pytest.mark.parametrize("n_maps", [4, 6])
def test_critical_points_of_the_greedy_composite(n_maps):
    # Each greedy map has 2 interior extrema on its interval and maps it onto the next one in three
    # monotone pieces, so the composite has 2 (1 + 3 + ... + 3^(K-1)) = 3^K - 1 interior extrema.
    g = greedy(l=L, u=U, n_maps=n_maps, final_recentre="geometric")
    xs = np.asarray(critical_points(g.maps, L, U), dtype=np.longdouble)
    assert len(xs) == 3 ** n_maps - 1
    if n_maps == 4:   # and a dense sample sees the same sign changes of F' (zero steps ignored)
        x = np.geomspace(1 / 300, 1 / 1.05, 400_001).astype(np.longdouble)
        F = composite(x, maps=[tuple(np.longdouble(v) for v in m) for m in g.maps])
        d = np.diff(F)
        keep = d != 0
        sd, xm = np.sign(d[keep]), x[1:][keep]
        changes = xm[1:][sd[1:] != sd[:-1]]
        assert len(changes) == len(xs)
        assert np.all(np.abs(changes - xs) <= 5e-5 * xs)      # 3 sample spacings


def test_stage_range_contains_samples():
    lo_min, hi_min, lo_max, hi_max = certify_range(ANVIL_MAPS[:2], L, U)
    x = np.geomspace(1 / 300, 1 / 1.05, 100_001)
    x[0], x[-1] = np.nextafter(1 / 300, 1), np.nextafter(1 / 1.05, 0)   # inside the real interval
    s = composite(x, maps=ANVIL_MAPS[:2])
    assert lo_min <= s.min() and s.max() <= hi_max
    assert hi_min - lo_min < 1e-9 and hi_max - lo_max < 1e-9


def test_rational_endpoints_are_enclosed():
    from fractions import Fraction
    lo, hi = enclose_rational(Fraction(1, 300))
    assert Fraction(*lo.as_integer_ratio()) <= Fraction(1, 300) <= Fraction(*hi.as_integer_ratio())
    assert hi > lo


@pytest.mark.parametrize("call, match", [
    (lambda: certify_envelope([], L, U), "empty"),
    (lambda: certify_envelope([(1, 2, float("nan"))], L, U), "finite"),
    (lambda: certify_envelope(ANVIL_MAPS, 0, U), "l > 0"),
    (lambda: certify_envelope(ANVIL_MAPS, U, L), "l < u"),
    (lambda: certify_envelope(ANVIL_MAPS, L, U, rtol=0), "rtol"),
    (lambda: certify_headroom(ANVIL_MAPS, U, band=-1), "band"),
    (lambda: certify_envelope("no_such_set", L, U), "unknown map set"),
])
def test_bad_input(call, match):
    with pytest.raises(DeriveMapsError, match=match):
        call()


@pytest.mark.parametrize("band", [0.01, 1e-3, 0.05, 0.3, 2.0])
def test_band_limits_round_outward_and_inward(band):
    from fractions import Fraction

    from derive_maps.certify import _band_limits
    with mpmath.workdps(60):
        lo, hi = mpmath.exp(-mpmath.mpf(band)), mpmath.exp(mpmath.mpf(band))

    def q(x):
        return mpmath.mpf(Fraction(*np.longdouble(x).as_integer_ratio()).numerator) / \
            Fraction(*np.longdouble(x).as_integer_ratio()).denominator

    in_lo, in_hi, out_lo, out_hi = _band_limits(band)
    with mpmath.workdps(60):
        assert q(in_lo) > lo and q(in_hi) < hi, "inner limits must lie strictly inside the band"
        assert q(out_lo) < lo and q(out_hi) > hi, "outer limits must lie strictly outside the band"


def test_lower_bound_survives_a_large_value_elsewhere():
    # On [1/300, 0.953] the composite reaches about exp(27.4) near the top while its minimum is
    # 0.99934 (at 0.9522787, found here in mpmath); each bound refines to a tolerance of its own
    # size, so the lower one is not spoilt by the 27.4 of the upper one.
    e = certify_envelope(ANVIL_MAPS, "1/300", "0.953")
    th = _mpmaps(ANVIL_MAPS)

    def slope(x):      # F'(x) = prod_k p_k'(s_{k-1}), written out
        d = mpmath.mpf(1)
        for a, b, c in th:
            d *= a + 3 * b * x ** 2 + 5 * c * x ** 4
            x = a * x + b * x ** 3 + c * x ** 5
        return d
    with mpmath.workdps(40):
        g = lambda s: composite(s, maps=th)  # noqa: E731
        x_star = mpmath.findroot(slope, (mpmath.mpf("0.95227"), mpmath.mpf("0.95229")), solver="anderson")
        true_min = float(g(x_star))
    assert 0.99933 < true_min < 0.99935
    assert e.f_min_certified <= true_min <= e.f_min_attained
    # the promise of certify_envelope's rtol (1e-3): relative to the bound's own |log|
    assert e.f_min_certified >= true_min * (1 - 2e-3 * abs(math.log(true_min))) - 1e-15
    assert e.f_max_certified <= e.f_max_attained * (1 + 1e-3 * abs(math.log(e.f_max_attained))) * (1 + 1e-15)
    # the attained value is F at a point (argmin), an upper bound on the minimum
    with mpmath.workdps(40):
        assert float(g(mpmath.mpf(e.argmin))) <= e.f_min_attained * (1 + 1e-15)
    assert 27.0 < e.max_abs_log_certified < 28.0
    assert e.max_abs_log_attained <= e.max_abs_log_certified


def test_a_certificate_at_the_rounding_floor_says_so():
    # The seven-map greedy set on [1/300, 1/1.05] is accurate to far below what the 64-bit interval
    # format resolves through seven maps: its certified bound is the arithmetic's floor. A value F
    # attains (at 50 digits, on a grid) is orders of magnitude below it.
    from derive_maps.frontier import exact_set
    maps = exact_set(7, "1/300", U)
    e = certify_envelope(maps, L, U)
    assert e.floor_limited and e.floor_boxes > 0
    xs = np.concatenate([[e.argmin, e.argmax], np.geomspace(1 / 300, 1 / 1.05, 400)])
    th = _mpmaps(maps)
    with mpmath.workdps(50):
        worst = max(abs(mpmath.log(composite(mpmath.mpf(float(x)), maps=th))) for x in xs)
    assert 0 < worst < e.max_abs_log_certified / 100
    # a certificate far above the floor is not flagged
    assert not certify_envelope(ANVIL_MAPS, L, U).floor_limited
