"""Outward-rounded interval arithmetic on NumPy arrays, vectorized over many boxes at once.

An interval is a pair ``(lo, hi)`` of equally shaped arrays of dtype :data:`DTYPE`
(``numpy.longdouble``); it encloses every real number ``x`` with ``lo <= x <= hi``. Each elementary
operation is done in that binary format with round-to-nearest (NumPy's elementwise ``+``, ``-``,
``*`` return the correctly rounded exact result; no fused multiply-add), and the result is then
moved one ulp outward with ``nextafter``. The exact result lies within half an ulp of the rounded
one, so the widened interval encloses it: every enclosure here is rigorous, not an estimate.

``longdouble`` is the x87 80-bit format on x86-64 Linux (64-bit significand, about 2000 times finer
than float64, which matters: a six-map composite amplifies rounding errors of its early stages by
the product of the later maps' slopes). Where ``longdouble`` is plain float64 (Windows, Apple
silicon), everything stays rigorous, only the enclosures get wider.

Overflow is kept out of the arithmetic instead of handled inside it: callers clamp every stage to
``[-BIG, BIG]`` with :func:`iv_clamp` and flag the clamped entries as "blown up" (their enclosure is
then replaced by the whole line). With operands at most ``BIG = 1e50`` no product or sum of the
quintic's Horner scheme exceeds 1e300, so no ``inf`` and no NaN ever enters an operation here.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

Interval = tuple[np.ndarray, np.ndarray]

#: The binary format of all interval endpoints.
DTYPE = np.longdouble

#: Magnitude beyond which a stage value counts as blown up (see module docstring).
BIG = DTYPE(1e50)

_NEG_INF = DTYPE(-np.inf)
_POS_INF = DTYPE(np.inf)


def geometric_edges(lo: float, hi: float, n: int) -> np.ndarray:
    """``n + 1`` float64 points ``lo (hi / lo)^(k / n)``, each correctly rounded (mpmath at 40 digits,
    then rounded to nearest): the same partition under every NumPy release (``numpy.geomspace``'s
    vectorized log and power may differ by an ulp between releases, and a certificate's boxes, hence
    its last digits, follow them)."""
    import mpmath
    with mpmath.workdps(40):
        a, r = mpmath.mpf(float(lo)), mpmath.log(mpmath.mpf(float(hi)) / mpmath.mpf(float(lo)))
        return np.array([float(a * mpmath.exp(r * k / n)) for k in range(n + 1)], dtype=np.float64)


def _down(x: np.ndarray) -> np.ndarray:
    return np.nextafter(x, _NEG_INF)


def _up(x: np.ndarray) -> np.ndarray:
    return np.nextafter(x, _POS_INF)


def iv_point(x) -> Interval:
    """The degenerate interval ``[x, x]`` of values exactly representable in :data:`DTYPE`
    (every float64 is)."""
    x = np.array(x, dtype=DTYPE)
    return x, x.copy()


def iv_add(a: Interval, b: Interval) -> Interval:
    """``a + b``."""
    return _down(a[0] + b[0]), _up(a[1] + b[1])


def iv_sub(a: Interval, b: Interval) -> Interval:
    """``a - b``."""
    return _down(a[0] - b[1]), _up(a[1] - b[0])


def iv_mul(a: Interval, b: Interval) -> Interval:
    """``a * b`` (the hull of the four endpoint products)."""
    p1, p2, p3, p4 = a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]
    lo = np.minimum(np.minimum(p1, p2), np.minimum(p3, p4))
    hi = np.maximum(np.maximum(p1, p2), np.maximum(p3, p4))
    return _down(lo), _up(hi)


def iv_scale(c, a: Interval) -> Interval:
    """``c * a`` for an exact scalar ``c`` (a DTYPE number)."""
    p1, p2 = c * a[0], c * a[1]
    if c >= 0:
        return _down(p1), _up(p2)
    return _down(p2), _up(p1)


def iv_shift(c, a: Interval) -> Interval:
    """``c + a`` for an exact scalar ``c``."""
    return _down(c + a[0]), _up(c + a[1])


def iv_sqr(a: Interval) -> Interval:
    """``a**2`` (tighter than ``a*a``: never negative)."""
    lo, hi = a
    l2, h2 = lo * lo, hi * hi
    pos, neg = lo >= 0, hi <= 0
    out_lo = np.where(pos, l2, np.where(neg, h2, 0))
    out_hi = np.where(pos, h2, np.where(neg, l2, np.maximum(l2, h2)))
    return np.maximum(_down(out_lo), DTYPE(0)), _up(out_hi)


def exact_product(k: int, c: float):
    """``k * c`` as one :data:`DTYPE` number if that format holds it exactly (true in the 64-bit
    format for the small integers used here), else None."""
    p = DTYPE(k) * DTYPE(c)
    return p if Fraction(*p.as_integer_ratio()) == k * Fraction(c) else None


def iv_clamp(a: Interval) -> tuple[Interval, np.ndarray]:
    """Clamp to ``[-BIG, BIG]``; also return the mask of entries that were clamped (blown up)."""
    blown = (a[0] < -BIG) | (a[1] > BIG)
    return (np.clip(a[0], -BIG, BIG), np.clip(a[1], -BIG, BIG)), blown


def iv_intersect(a: Interval, b: Interval) -> Interval:
    """Intersection of two enclosures of the same quantity (both rigorous, so is the result)."""
    return np.maximum(a[0], b[0]), np.minimum(a[1], b[1])


def iv_contains_zero(a: Interval) -> np.ndarray:
    return (a[0] <= 0) & (a[1] >= 0)


def iv_sqrt(a: Interval) -> Interval:
    """``sqrt(a)`` for ``a >= 0`` (negative lower ends are read as 0; the square root of the format
    is correctly rounded, so one ulp outward encloses it)."""
    lo = np.maximum(a[0], DTYPE(0))
    return np.maximum(_down(np.sqrt(lo)), DTYPE(0)), _up(np.sqrt(np.maximum(a[1], DTYPE(0))))


def iv_abs(a: Interval) -> Interval:
    """``|a|``."""
    lo = np.where(a[0] >= 0, a[0], np.where(a[1] <= 0, -a[1], DTYPE(0)))
    return lo, np.maximum(np.abs(a[0]), np.abs(a[1]))


def iv_max(a: Interval, b: Interval) -> Interval:
    """``max(a, b)`` (elementwise, of two enclosed quantities)."""
    return np.maximum(a[0], b[0]), np.maximum(a[1], b[1])


def iv_min(a: Interval, b: Interval) -> Interval:
    """``min(a, b)``."""
    return np.minimum(a[0], b[0]), np.minimum(a[1], b[1])


def iv_mul_pos(a: Interval, b: Interval) -> Interval:
    """``a * b`` for ``a, b >= 0`` (two products instead of four)."""
    return _down(a[0] * b[0]), _up(a[1] * b[1])
