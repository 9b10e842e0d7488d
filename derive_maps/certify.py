"""Certified envelope, worst |log F| and headroom of a map set's composite, by branch and bound.

For a map set ``p_1..p_K`` (float64 coefficients, taken as exact) and ``F = p_K o ... o p_1``:

* :func:`certify_envelope` encloses ``min F`` and ``max F`` over a real interval ``[l, u]``:
  ``f_min_certified <= min F <= f_min_attained`` and ``f_max_attained <= max F <= f_max_certified``,
  hence a rigorous upper bound on ``max |log F|``. The interval is split into boxes; on each box
  :func:`derive_maps.enclosure.enclose` gives rigorous enclosures of F, F' and F''. A box on which F'
  has no zero is monotone and bounded by its endpoint values; any other box is bounded by its
  enclosure and bisected until it can no longer move the bound by more than ``rtol`` of the error
  (or until the rounding floor of the arithmetic is reached; such boxes still count, with their
  enclosures). Nothing is sampled: a narrow excursion between grid points cannot be missed.
* :func:`certify_headroom` finds how far above ``u`` the composite stays inside the band
  ``|log F| <= band``: ``F`` is certified inside the band on ``[u, u (1 + certified)]``, and
  ``F(u (1 + upper))`` is certified outside it.
* :func:`critical_points` isolates every zero of ``F'`` in ``(l, u)`` (each one is bracketed by a
  certified sign change of ``F'`` on a box where ``F''`` has no zero, then bisected to the last bit
  of the working format): the composite's alternation points.

Endpoints are exact rationals (``"1/300"``, ``"1/1.05"``) and enclosed from outside; reported bounds
are rounded outward to float64.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction

import mpmath
import numpy as np

from .enclosure import enclose, map_consts as _consts, point_jets
from .errors import (ConvergenceError, DeriveMapsError, RealLike, check_interval, check_maps, check_positive,
                     parse_real)
from .intervals import DTYPE, geometric_edges, iv_contains_zero
from .progress import Progress

#: Boxes the branch and bound may hold at once before it gives up (memory guard).
MAX_ACTIVE_BOXES = 4_000_000


# ---------------------------------------------------------------------------------------------
# Exact rationals <-> the interval format, outward rounding for reports.

def enclose_rational(q: Fraction) -> tuple[np.longdouble, np.longdouble]:
    """The tightest pair ``lo <= q <= hi`` of :data:`DTYPE` numbers."""
    x = DTYPE(q.numerator) / DTYPE(q.denominator)
    lo = hi = x
    while Fraction(*lo.as_integer_ratio()) > q:
        lo = np.nextafter(lo, DTYPE(-np.inf))
    while Fraction(*hi.as_integer_ratio()) < q:
        hi = np.nextafter(hi, DTYPE(np.inf))
    return lo, hi


def _exact(x) -> Fraction:
    return Fraction(*DTYPE(x).as_integer_ratio())


def f64_down(x) -> float:
    """The largest float64 <= x (x a DTYPE number)."""
    if not np.isfinite(x):
        return float(x)
    f = float(x)
    return float(np.nextafter(f, -np.inf)) if Fraction(f) > _exact(x) else f


def f64_up(x) -> float:
    """The smallest float64 >= x."""
    if not np.isfinite(x):
        return float(x)
    f = float(x)
    return float(np.nextafter(f, np.inf)) if Fraction(f) < _exact(x) else f


def _log_up(x) -> float:
    """An upper bound (float64) on ``log(x)`` for a positive DTYPE number x (mpmath at 30 digits,
    then one float64 ulp up)."""
    if not np.isfinite(x):
        return float("inf")
    with mpmath.workdps(30):
        v = mpmath.log(mpmath.mpf(_exact(x).numerator) / _exact(x).denominator)
    return float(np.nextafter(float(v), np.inf))


def _log_down(x) -> float:
    if x <= 0:
        return float("-inf")
    if not np.isfinite(x):
        return float("inf")
    with mpmath.workdps(30):
        v = mpmath.log(mpmath.mpf(_exact(x).numerator) / _exact(x).denominator)
    return float(np.nextafter(float(v), -np.inf))


# ---------------------------------------------------------------------------------------------
# Envelope.

@dataclass(frozen=True)
class Envelope:
    """Certified bounds of the composite on ``[l, u]``.

    ``f_min_certified <= min F <= f_min_attained`` and ``f_max_attained <= max F <= f_max_certified``:
    ``f_min_attained`` is F's value at the point ``argmin`` (the lowest value seen at a point, an
    upper bound on the minimum, not the minimum itself), ``f_max_attained`` likewise at ``argmax``.
    ``max_abs_log_certified`` is a rigorous upper bound on ``max |log F|`` (``inf`` if F may reach
    0 or below); ``max_abs_log_attained`` is a value of ``|log F|`` that F certainly reaches.
    ``floor_limited``: some bound is set by boxes at the rounding floor of the interval format (the
    certificate is then the arithmetic's resolution, not the composite's accuracy: two sets both at
    the floor cannot be ordered by their certified values).
    """
    l: float
    u: float
    f_min_certified: float
    f_min_attained: float
    f_max_attained: float
    f_max_certified: float
    argmin: float
    argmax: float
    max_abs_log_certified: float
    max_abs_log_attained: float
    boxes: int
    floor_boxes: int
    floor_limited: bool = False
    #: the widest floored box's enclosure in units of ``|log F|`` (``log(hi / lo)``; 0 if no box reached
    #: the floor): a bound the floor decides lies within it of ``max |log F|``, so two runs whose
    #: roundings differ (another NumPy's longdouble kernels) agree to within the larger one
    floor_width: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _initial_boxes(lo, hi, n0: int):
    lo_f, hi_f = float(lo), float(hi)
    if lo_f > 0 and hi_f / lo_f > 4:
        edges = geometric_edges(lo_f, hi_f, n0).astype(DTYPE)
    else:
        edges = np.linspace(lo_f, hi_f, n0 + 1).astype(DTYPE)
    edges[0], edges[-1] = lo, hi
    edges = np.maximum.accumulate(edges)
    return edges[:-1].copy(), edges[1:].copy()


#: The smallest tolerance a bound refines to, relative to its value: 8 units of the interval format.
FLOOR_TOL = 8 * float(np.finfo(DTYPE).eps)


def _own_tolerance(a, rtol: float) -> float:
    """The tolerance of a bound whose attained value is ``a``: ``rtol |log a|`` relative to ``a``
    (each bound gets one of its own size: one scaled by the interval's worst ``|log F|`` would swamp a
    bound whose own value is close to 1 wherever F is large elsewhere), and at least the format's
    floor."""
    lg = abs(math.log(float(a))) if a > 0 and np.isfinite(a) and float(a) > 0 else 1.0
    return rtol * lg * max(abs(float(a)), 1e-300) + FLOOR_TOL


def _envelope_raw(maps, lo, hi, *, rtol: float, atol: float | None, n0: int = 64,
                  progress: Progress | None = None):
    """Branch and bound on ``[lo, hi]`` (DTYPE numbers). Returns a dict of DTYPE bounds."""
    consts = _consts(maps)
    blo, bhi = _initial_boxes(lo, hi, n0)
    amax, amin = DTYPE(-np.inf), DTYPE(np.inf)
    xmax = xmin = blo[0]
    cmax, cmin = DTYPE(-np.inf), DTYPE(np.inf)
    floor_hi, floor_lo = DTYPE(-np.inf), DTYPE(np.inf)
    floor_width = 0.0
    nbox = floor = level = 0
    total_width = float(hi - lo) or 1.0
    while blo.size:
        level += 1
        nbox += blo.size
        if blo.size > MAX_ACTIVE_BOXES:
            raise ConvergenceError(f"certification needs more than {MAX_ACTIVE_BOXES} boxes at once "
                                   f"(level {level}); loosen rtol (now {rtol:g})")
        e = enclose(blo, bhi, maps, consts)
        vl, _, _ = point_jets(blo, maps, consts)
        vh, _, _ = point_jets(bhi, maps, consts)
        # Values certainly attained (point enclosures: lo end for the max, hi end for the min).
        for pts, val in ((blo, vl), (bhi, vh), (e.mid, e.mid_value)):
            i = int(np.argmax(val[0]))
            if val[0][i] > amax:
                amax, xmax = val[0][i], pts[i]
            j = int(np.argmin(val[1]))
            if val[1][j] < amin:
                amin, xmin = val[1][j], pts[j]
        mono = ~iv_contains_zero(e.d1)
        ub = np.where(mono, np.maximum(vl[1], vh[1]), e.value[1])
        lb = np.where(mono, np.minimum(vl[0], vh[0]), e.value[0])
        if atol is None:
            tol_hi, tol_lo = _own_tolerance(amax, rtol), _own_tolerance(amin, rtol)
        else:
            tol_hi = tol_lo = atol
        done = (ub <= amax + DTYPE(tol_hi)) & (lb >= amin - DTYPE(tol_lo))
        # Rounding floor: the box enclosure is no wider than a point enclosure, splitting cannot help.
        pw = (e.mid_value[1] - e.mid_value[0])
        floored = ~done & (((e.value[1] - e.value[0]) <= 4 * pw) | ((bhi - blo) <= 4 * np.spacing(bhi)))
        leave = done | floored
        floor += int(floored.sum())
        if floored.any():
            floor_hi = max(floor_hi, ub[floored].max())
            floor_lo = min(floor_lo, lb[floored].min())
            with np.errstate(all="ignore"):
                ratio = (ub[floored] / lb[floored]).astype(np.float64)
            w = math.log(max(float(ratio.max()), 1.0)) if (lb[floored] > 0).all() else math.inf
            floor_width = max(floor_width, w * (1 + 1e-12))
        if leave.any():
            cmax = max(cmax, ub[leave].max())
            cmin = min(cmin, lb[leave].min())
        blo, bhi = blo[~leave], bhi[~leave]
        if progress is not None:
            progress.update(advance=0.0, detail=f"level {level}, {blo.size} boxes open")
            progress.update(max(progress.done, 1.0 - float((bhi - blo).sum()) / total_width))
        mid = blo + (bhi - blo) / 2
        blo, bhi = np.concatenate([blo, mid]), np.concatenate([mid, bhi])
    # A bound is the floor's when a floored box sets it beyond the tolerance of the attained value.
    if atol is None:
        tol_hi, tol_lo = _own_tolerance(amax, rtol), _own_tolerance(amin, rtol)
    floor_limited = bool(floor_hi > amax + DTYPE(tol_hi) or floor_lo < amin - DTYPE(tol_lo))
    return dict(amin=amin, amax=amax, cmin=cmin, cmax=cmax, xmin=xmin, xmax=xmax, boxes=nbox, floor=floor,
                floor_limited=floor_limited, floor_width=floor_width)


def certify_envelope(maps, l: RealLike, u: RealLike, *, rtol: float = 1e-3,
                     progress: bool | None = None) -> Envelope:
    """Rigorous envelope of the composite of ``maps`` on the real interval ``[l, u]``.

    ``rtol``: each certified bound is within ``rtol`` times its own ``|log|`` of a value F attains
    (``f_max_certified <= f_max_attained (1 + rtol |log f_max_attained|)`` and
    ``f_min_certified >= f_min_attained (1 - rtol |log f_min_attained|)`` for positive values, plus
    :data:`FLOOR_TOL`), unless the rounding floor of the interval format is reached first
    (``floor_boxes`` > 0; ``floor_limited`` when that decides a bound).
    """
    maps_ = check_maps(maps)
    lf, uf = check_interval(l, u)
    check_positive(rtol, "rtol")
    lo, _ = enclose_rational(lf)
    _, hi = enclose_rational(uf)
    with Progress(1.0, "certify envelope", enabled=progress) as bar:
        r = _envelope_raw(maps_, lo, hi, rtol=rtol, atol=None, progress=bar)
    cmin, cmax, amin, amax = r["cmin"], r["cmax"], r["amin"], r["amax"]
    mal_c = max(_log_up(cmax), -_log_down(cmin)) if cmin > 0 else float("inf")
    mal_a = max(_log_down(amax) if amax > 0 else float("-inf"),
                -_log_up(amin) if amin > 0 else float("inf"))
    return Envelope(l=float(lf), u=float(uf), f_min_certified=f64_down(cmin), f_min_attained=f64_up(amin),
                    f_max_attained=f64_down(amax), f_max_certified=f64_up(cmax),
                    argmin=float(r["xmin"]), argmax=float(r["xmax"]),
                    max_abs_log_certified=mal_c, max_abs_log_attained=max(mal_a, 0.0),
                    boxes=int(r["boxes"]), floor_boxes=int(r["floor"]), floor_limited=r["floor_limited"],
                    floor_width=r["floor_width"] if r["floor_limited"] else 0.0)


def certify_range(maps, l: RealLike, u: RealLike, *, rel: float = 1e-12) -> tuple[float, float, float, float]:
    """Certified range of the composite on [l, u] for quantities not near 1 (the stage values of
    an interval chain): ``(min_lo, min_hi, max_lo, max_hi)`` with ``min F in [min_lo, min_hi]`` and
    ``max F in [max_lo, max_hi]``, each pair within about ``rel`` relative."""
    maps_ = check_maps(maps)
    lf, uf = check_interval(l, u)
    lo, _ = enclose_rational(lf)
    _, hi = enclose_rational(uf)
    # Tolerance relative to the size of the values: first a coarse pass for the scale.
    v, _, _ = point_jets(np.array([lo, hi]), maps_)
    scale = float(max(abs(v[0]).max(), abs(v[1]).max(), 1e-300))
    r = _envelope_raw(maps_, lo, hi, rtol=0.0, atol=rel * scale)
    return f64_down(r["cmin"]), f64_up(r["amin"]), f64_down(r["amax"]), f64_up(r["cmax"])


# ---------------------------------------------------------------------------------------------
# Headroom.

@dataclass(frozen=True)
class Headroom:
    """``|log F| <= band`` holds on ``[u, u (1 + certified)]`` (rigorous); ``F(u (1 + upper))`` is
    certainly outside the band (``upper`` is None when no such point was found up to ``h_max``;
    then ``certified == h_max``)."""
    u: float
    band: float
    h_max: float
    certified: float
    upper: float | None


def _f64_below(v) -> float:
    """The largest float64 strictly below the mpmath number ``v`` (exp of a nonzero float is
    irrational, so "strictly" costs nothing)."""
    f = float(v)
    while mpmath.mpf(f) >= v:
        f = float(np.nextafter(f, -np.inf))
    return f


def _f64_above(v) -> float:
    f = float(v)
    while mpmath.mpf(f) <= v:
        f = float(np.nextafter(f, np.inf))
    return f


def _band_limits(band: float):
    """Float bounds of ``[exp(-band), exp(band)]`` rounded directionally: the inner pair lies inside
    the band (a value between them is in it), the outer pair outside (a value beyond them is not).
    Float64 values, so they are exact in :data:`DTYPE` too."""
    with mpmath.workdps(40):
        lo = mpmath.exp(-mpmath.mpf(band))
        hi = mpmath.exp(mpmath.mpf(band))
        limits = (_f64_above(lo), _f64_below(hi), _f64_below(lo), _f64_above(hi))
    return tuple(DTYPE(x) for x in limits)


def _headroom_raw(maps, start, u_ref: Fraction, *, band: float, h_max: float, resolution: float):
    consts = _consts(maps)
    in_lo, in_hi, out_lo, out_hi = _band_limits(band)
    end = enclose_rational(u_ref * (1 + Fraction(h_max)))[1]
    blo, bhi = _initial_boxes(start, end, 64)
    x_out = DTYPE(np.inf)
    fail = DTYPE(np.inf)
    while blo.size:
        cut = min(x_out, fail)
        keep = blo < cut
        blo, bhi = blo[keep], bhi[keep]
        if not blo.size:
            break
        e = enclose(blo, bhi, maps, consts)
        inside = (e.value[0] >= in_lo) & (e.value[1] <= in_hi)
        for pts, val in ((blo, point_jets(blo, maps, consts)[0]), (e.mid, e.mid_value)):
            out = (val[1] < out_lo) | (val[0] > out_hi)
            if out.any():
                x_out = min(x_out, pts[out].min())
        box_out = (e.value[1] < out_lo) | (e.value[0] > out_hi)
        if box_out.any():
            x_out = min(x_out, blo[box_out].min())
        undecided = ~inside
        tiny = undecided & ((bhi - blo) <= DTYPE(resolution) * bhi)
        if tiny.any():
            fail = min(fail, blo[tiny].min())
        sel = undecided & ~tiny
        blo, bhi = blo[sel], bhi[sel]
        mid = blo + (bhi - blo) / 2
        blo, bhi = np.concatenate([blo, mid]), np.concatenate([mid, bhi])
    return min(x_out, fail), x_out, end


def certify_headroom(maps, u: RealLike, *, band: float = 0.01, h_max: float = 0.25,
                     resolution: float = 1e-7) -> Headroom:
    """How far above ``u`` the composite stays inside ``|log F| <= band`` (see :class:`Headroom`).

    ``resolution``: relative width below which an undecided box counts as leaving the band.
    """
    maps_ = check_maps(maps)
    uf = parse_real(u, "u")
    if uf <= 0:
        raise DeriveMapsError(f"u = {float(uf):g}: the headroom is measured above a positive u")
    check_positive(band, "band")
    check_positive(h_max, "h_max")
    check_positive(resolution, "resolution")
    start = enclose_rational(uf)[0]
    first_bad, x_out, end = _headroom_raw(maps_, start, uf, band=band, h_max=h_max,
                                          resolution=resolution)
    if not np.isfinite(first_bad):
        return Headroom(u=float(uf), band=band, h_max=h_max, certified=h_max, upper=None)
    cert = max(float((_exact(first_bad) / uf) - 1), 0.0)
    cert = float(np.nextafter(cert, -np.inf)) if cert > 0 else 0.0
    upper = None
    if np.isfinite(x_out):
        upper = float(np.nextafter(float((_exact(x_out) / uf) - 1), np.inf))
    return Headroom(u=float(uf), band=band, h_max=h_max, certified=cert, upper=upper)


# ---------------------------------------------------------------------------------------------
# Critical points.

def _solve_brackets(lo, hi, maps, consts, sign_lo):
    """Each bracket ``[lo, hi]`` holds exactly one zero of F' (certified sign change, F'' of one
    sign): safeguarded Newton (a bisection step whenever Newton leaves the bracket), keeping the
    bracket by the certified sign of F', until the bracket is a few ulps wide or the sign of F'
    can no longer be resolved."""
    x = lo + (hi - lo) / 2
    active = np.ones(lo.shape, dtype=bool)
    for _ in range(100):
        _, d, d2 = point_jets(x, maps, consts, second=True)
        s = np.where(d[0] > 0, 1, np.where(d[1] < 0, -1, 0))
        unresolved = s == 0
        lo = np.where(active & (s == sign_lo), x, lo)
        hi = np.where(active & (s == -sign_lo), x, hi)
        active &= ~unresolved & (hi - lo > 4 * np.spacing(hi))
        if not active.any():
            break
        f1 = (d[0] + d[1]) / 2
        f2 = (d2[0] + d2[1]) / 2
        with np.errstate(all="ignore"):
            newton = x - f1 / f2
        ok = np.isfinite(newton) & (newton > lo) & (newton < hi)
        x = np.where(active, np.where(ok, newton, lo + (hi - lo) / 2), x)
    return x


def critical_points(maps, l: RealLike, u: RealLike, *, max_levels: int = 200) -> np.ndarray:
    """Every zero of F' in ``[l, u]`` (sorted, DTYPE). Zeros that the arithmetic cannot separate
    (double roots, or clusters closer than the rounding floor) come back as one point each."""
    maps_ = check_maps(maps)
    lf, uf = check_interval(l, u)
    consts = _consts(maps_)
    lo = enclose_rational(lf)[1]
    hi = enclose_rational(uf)[0]
    blo, bhi = _initial_boxes(lo, hi, 256)
    roots, brackets = [], []
    for _level in range(max_levels):
        if not blo.size:
            break
        if blo.size > MAX_ACTIVE_BOXES:
            raise ConvergenceError("critical-point isolation needs too many boxes; the composite "
                                   "has more extrema than can be separated (is it degenerate?)")
        e = enclose(blo, bhi, maps_, consts)
        has0 = iv_contains_zero(e.d1)
        blo, bhi, d2 = blo[has0], bhi[has0], (e.d2[0][has0], e.d2[1][has0])
        if not blo.size:
            break
        _, dl, _ = point_jets(blo, maps_, consts)
        _, dh, _ = point_jets(bhi, maps_, consts)
        sl = np.where(dl[0] > 0, 1, np.where(dl[1] < 0, -1, 0))
        sh = np.where(dh[0] > 0, 1, np.where(dh[1] < 0, -1, 0))
        mono = ~iv_contains_zero(d2)
        unique = mono & (sl * sh == -1)
        none = mono & (sl * sh == 1)
        if unique.any():
            brackets.append((blo[unique], bhi[unique], sl[unique]))
        tiny = ~unique & ~none & ((bhi - blo) <= 4 * np.spacing(bhi))
        if tiny.any():
            roots.append(blo[tiny] + (bhi[tiny] - blo[tiny]) / 2)
        rest = ~unique & ~none & ~tiny
        blo, bhi = blo[rest], bhi[rest]
        mid = blo + (bhi - blo) / 2
        blo, bhi = np.concatenate([blo, mid]), np.concatenate([mid, bhi])
    else:
        raise ConvergenceError(f"critical-point isolation did not finish in {max_levels} levels")
    if brackets:
        roots.append(_solve_brackets(np.concatenate([b[0] for b in brackets]),
                                     np.concatenate([b[1] for b in brackets]), maps_, consts,
                                     np.concatenate([b[2] for b in brackets])))
    if not roots:
        return np.zeros(0, dtype=DTYPE)
    r = np.sort(np.concatenate(roots))
    # merge duplicates from adjacent boxes sharing an endpoint root
    keep = np.concatenate([[True], np.diff(r) > 4 * np.spacing(r[1:])])
    return r[keep]
