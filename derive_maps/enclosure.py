"""Rigorous enclosures of a composite of odd quintics and of its first two derivatives on boxes.

For maps ``p_k(s) = a_k s + b_k s^3 + c_k s^5`` (float64 coefficients, taken as exact) and the
composite ``F = p_K o ... o p_1`` with stages ``s_0 = x``, ``s_k = p_k(s_{k-1})``::

    F'  = prod_k p_k'(s_{k-1})                                  p'(s)  = a + s^2 (3b + 5c s^2)
    F_k'' = p_k''(s_{k-1}) (F_{k-1}')^2 + p_k'(s_{k-1}) F_{k-1}''  p''(s) = s (6b + 20c s^2)

Each quantity is enclosed on a box ``X = [x_lo, x_hi]`` (many boxes at once) in outward-rounded
interval arithmetic (:mod:`derive_maps.intervals`). Every stage value is the intersection of its
natural interval extension and its mean-value form ``s_k(m) + s_k'(X) (X - m)`` (``m`` the box
midpoint), which keeps the overestimation quadratic in the box width; the final value also
intersects the second-order form ``F(m) + F'(m) (X - m) + F''(X) (X - m)^2 / 2``, and the
derivative intersects its mean-value form ``F'(m) + F''(X) (X - m)``.

A box on which some stage leaves ``[-1e50, 1e50]`` is "blown up": its enclosures are the whole line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .intervals import (BIG, DTYPE, Interval, exact_product, iv_add, iv_clamp, iv_intersect, iv_mul,
                        iv_point, iv_scale, iv_shift, iv_sqr, iv_sub)

Maps = tuple[tuple[float, float, float], ...]


class _Const:
    """An exact constant (fast path) or, where the format cannot hold it, a tiny interval."""

    def __init__(self, k: int, c: float) -> None:
        p = exact_product(k, c)
        self.exact = p
        self.iv = None if p is not None else iv_mul(iv_point(k), iv_point(c))

    def times(self, a: Interval) -> Interval:
        return iv_scale(self.exact, a) if self.exact is not None else iv_mul(self.iv, a)

    def plus(self, a: Interval) -> Interval:
        return iv_shift(self.exact, a) if self.exact is not None else iv_add(self.iv, a)


@dataclass(frozen=True)
class MapConsts:
    """One map's coefficients and derived constants (3b, 5c, 6b, 20c) in the interval format."""
    a: _Const
    b: _Const
    c: _Const
    b3: _Const
    c5: _Const
    b6: _Const
    c20: _Const


def map_consts(maps: Maps) -> list[MapConsts]:
    return [MapConsts(_Const(1, a), _Const(1, b), _Const(1, c), _Const(3, b), _Const(5, c),
                      _Const(6, b), _Const(20, c)) for a, b, c in maps]


def _p(s: Interval, t: Interval, k: MapConsts) -> Interval:
    """p(s) = s (a + t (b + c t)) with t = s^2."""
    return iv_mul(s, k.a.plus(iv_mul(t, k.b.plus(k.c.times(t)))))


def _dp(t: Interval, k: MapConsts) -> Interval:
    """p'(s) = a + t (3b + 5c t)."""
    return k.a.plus(iv_mul(t, k.b3.plus(k.c5.times(t))))


def _d2p(s: Interval, t: Interval, k: MapConsts) -> Interval:
    """p''(s) = s (6b + 20c t)."""
    return iv_mul(s, k.b6.plus(k.c20.times(t)))


def _blow(a: Interval, blown: np.ndarray) -> Interval:
    if not blown.any():
        return a
    return np.where(blown, DTYPE(-np.inf), a[0]), np.where(blown, DTYPE(np.inf), a[1])


def point_jets(x: np.ndarray, maps: Maps, consts: list[MapConsts] | None = None,
               *, second: bool = False):
    """Enclosures of ``F(x)`` and ``F'(x)`` (and ``F''(x)`` if ``second``) at points ``x`` (exact
    float64 or :data:`DTYPE` values). Returns ``(F, F', F'')`` with ``F''`` None unless asked."""
    consts = map_consts(maps) if consts is None else consts
    s = iv_point(x)
    shape = s[0].shape
    d = iv_point(np.ones(shape))
    d2 = iv_point(np.zeros(shape)) if second else None
    blown = np.zeros(shape, dtype=bool)
    for k in consts:
        t = iv_sqr(s)
        dpk = _dp(t, k)
        if second:
            d2, b2 = iv_clamp(iv_add(iv_mul(_d2p(s, t, k), iv_sqr(d)), iv_mul(dpk, d2)))
            blown |= b2
        d, b1 = iv_clamp(iv_mul(d, dpk))
        s, b0 = iv_clamp(_p(s, t, k))
        blown |= b0 | b1
    return _blow(s, blown), _blow(d, blown), (_blow(d2, blown) if second else None)


@dataclass
class BoxEnclosure:
    """Enclosures on each box: ``value`` of F, ``d1`` of F', ``d2`` of F''; ``mid_value`` and
    ``mid_d1`` of F and F' at the box midpoints ``mid``."""
    value: Interval
    d1: Interval
    d2: Interval
    mid: np.ndarray
    mid_value: Interval
    mid_d1: Interval


def enclose(lo: np.ndarray, hi: np.ndarray, maps: Maps, consts: list[MapConsts] | None = None
            ) -> BoxEnclosure:
    """Enclose F, F', F'' on the boxes ``[lo_i, hi_i]`` (arrays of float64 or :data:`DTYPE`, ``lo <= hi``)."""
    consts = map_consts(maps) if consts is None else consts
    lo = np.asarray(lo, dtype=DTYPE)
    hi = np.asarray(hi, dtype=DTYPE)
    mid = np.minimum(np.maximum(lo + (hi - lo) / 2, lo), hi)
    box = (lo, hi)
    dx = iv_sub(box, iv_point(mid))                  # X - m, contains 0
    s, d, d2 = box, iv_point(np.ones(lo.shape)), iv_point(np.zeros(lo.shape))
    sm, dm = iv_point(mid), iv_point(np.ones(lo.shape))
    blown = np.zeros(lo.shape, dtype=bool)       # some stage of the box enclosure left [-BIG, BIG]
    blown_mid = np.zeros(lo.shape, dtype=bool)   # some stage at the midpoint did
    for k in consts:
        t = iv_sqr(s)
        dpk = _dp(t, k)
        d2, b2 = iv_clamp(iv_add(iv_mul(_d2p(s, t, k), iv_sqr(d)), iv_mul(dpk, d2)))
        d, b1 = iv_clamp(iv_mul(d, dpk))
        tm = iv_sqr(sm)
        dm, b3 = iv_clamp(iv_mul(dm, _dp(tm, k)))
        sm, b4 = iv_clamp(_p(sm, tm, k))
        blown_mid |= b3 | b4
        s, b0 = iv_clamp(iv_intersect(_p(s, t, k), iv_add(sm, iv_mul(d, dx))))
        blown |= b0 | b1 | b2 | blown_mid
    taylor2 = iv_add(iv_add(sm, iv_mul(dm, dx)), iv_scale(DTYPE(0.5), iv_mul(d2, iv_sqr(dx))))
    val = iv_intersect(s, taylor2)
    d = iv_intersect(d, iv_add(dm, iv_mul(d2, dx)))   # mean-value form of F'
    return BoxEnclosure(_blow(val, blown), _blow(d, blown), _blow(d2, blown), mid,
                        _blow(sm, blown_mid), _blow(dm, blown_mid))
