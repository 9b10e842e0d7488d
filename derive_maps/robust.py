"""The robust certificate: a rigorous bound on what the bf16 cascade does to a singular value.

:mod:`derive_maps.certify` certifies the composite ``F = p_K o ... o p_1`` in exact arithmetic. The
fast cascade rounds: this module certifies the composite *under a rounding model* of it, with the
same standard (outward-rounded interval arithmetic, nothing sampled).

Rounding model (:class:`RoundingModel`). A singular value ``x`` of the normalized input becomes
``s_0`` and passes the stages ``s_k`` (one per map ``p_k(s) = s (a + h(s^2))``, ``h(t) = b t + c t^2``)::

    x      in [l / sqrt(1 + delta0), u / sqrt(1 - delta0)]       the trace (a factor in [1-delta0, 1+delta0])
    s_0    = x (1 + e_0)                                          the bf16 normalized iterate X_1
    t_k    = s_{k-1}^2 (1 + e_A)                                  the Gram A (fp32 sums, one bf16 rounding)
    h_k    = h(t_k) (1 + e_B) + g_B (|b| t_k + |c| t_k^2)        B = b A + c A^2
    y_k    = s_{k-1} (a + h_k) + g_Y (|a| + |h_k|) |s_{k-1}|      a X + X B, fp32 sums
    s_k    = y_k (1 + e_X)                                        its bf16 rounding (the next iterate)

with ``|e_0|, |e_X| <= delta_x``, ``|e_A| <= delta_gram``, ``|e_B| <= delta_b``, ``|g_B| <= gamma_b``,
``|g_Y| <= gamma_y``, every one chosen independently at every stage (an adversary, not a
distribution). Output: ``s_K``. :func:`rounding_model` derives the deltas from the kernels.

Certificates (:func:`robust_envelope`): the input interval is cut into cells; each cell's stage
interval is cut into ``pieces`` before every map (the reachable set of one cell is connected, so
its hull loses nothing, and the pieces keep the dependency loss of the interval extension small),
every quantity above is enclosed with outward rounding (:mod:`derive_maps.intervals`), and ``h``'s
range on an interval is exact (its end points and its vertex). The result bounds ``s_K`` for every
input in the interval and every admissible perturbation: the **robust envelope** (certified
min/max on ``[l, u]``, hence a certified ``max |log s_K|``) and, on ``[0, u]``, the **robust
headroom** ``max s_K - 1`` (how far above 1 the output can go; ``inf`` when some stage may leave
``[-1e50, 1e50]``: blow-up). A value the model certainly reaches (a perturbation sequence tracked in
the same arithmetic, its reachable interval grown from the corners of every perturbation) brackets
each bound from the other side.

``python -m derive_maps robust anvil`` prints both for a set under the SAFE model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from fractions import Fraction

import numpy as np

from anvil_ref.constants import BF16_UNIT_ROUNDOFF, FP32_UNIT_ROUNDOFF, FROBENIUS_MARGIN

from .certify import _log_down, _log_up, enclose_rational, f64_down, f64_up
from .errors import DeriveMapsError, RealLike, check_maps, check_positive, parse_real
from .intervals import BIG, DTYPE, Interval, iv_add, iv_clamp, iv_intersect, iv_mul, iv_point, iv_sqr, iv_sub

CONFIGS = ("safe", "faithful")

#: Default tolerance of the verdict: the output may exceed 1 by at most a few bf16 units
#: (2^-5 = 8 units of 2^-8) for every admissible perturbation.
DEFAULT_EPS = 2.0 ** -5


# ---------------------------------------------------------------------------------------------
# The rounding model.

@dataclass(frozen=True)
class RoundingModel:
    """Relative perturbations of one cascade stage (see the module docstring for where each acts)."""
    delta_x: float      #: bf16 rounding of every iterate X_k (and of the normalized X_1)
    delta_gram: float   #: the Gram A = X^T X: fp32 sums, one bf16 rounding
    delta_b: float      #: bf16 rounding of B = b A + c A^2
    gamma_b: float      #: fp32 sums of B, relative to |b| t + |c| t^2
    gamma_y: float      #: fp32 sums of a X + X B, relative to (|a| + |h|) |s|
    delta0: float       #: the trace of the normalization

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v < 0.5):
                raise DeriveMapsError(f"rounding model: {k} = {v!r}; expected a relative perturbation in [0, 0.5)")

    def as_dict(self) -> dict:
        return asdict(self)


def gamma(n: int, unit: float = FP32_UNIT_ROUNDOFF) -> float:
    """``gamma_n = n u / (1 - n u)``: relative error bound of a chain of ``n`` roundings (Higham, 3.1),
    rounded up in float64."""
    nu = n * unit
    if nu >= 1:
        raise DeriveMapsError(f"gamma_{n}: {n} roundings of unit {unit:g} admit no relative bound")
    return float(np.nextafter(nu / (1 - nu), np.inf))


def _compose(*rel: float) -> float:
    """``prod (1 + r) - 1`` rounded up: relative perturbations in sequence."""
    out = Fraction(1)
    for r in rel:
        out *= 1 + Fraction(r)
    return f64_up(DTYPE(out - 1)) if out != 1 else 0.0


def rounding_model(config: str = "safe", *, rows: int = 768, cols: int = 768, u: float = BF16_UNIT_ROUNDOFF,
                   eps: float = FP32_UNIT_ROUNDOFF) -> RoundingModel:
    """The rounding model of the fast cascade on ``rows x cols`` matrices (``config`` ``"safe"`` or
    ``"faithful"``, :mod:`anvil_fast.cascade`).

    Derivation. A bf16 rounding of a matrix ``M`` is ``M + E`` with ``|E_ij| <= u |M_ij|``, ``u = 2^-8``.
    To first order a singular value with singular vectors ``y, z`` moves by ``y^T E z``, so by at most
    ``u sum |M_ij| |y_i| |z_j|``. At the rank-1 point ``M = sigma y z^T`` -- the input whose top
    singular value sits at the end of the interval, where the composite is steepest and the
    headroom is decided -- that is ``u sigma (sum y_i^2)(sum z_j^2) = u sigma``: one rounding of a
    matrix is a relative perturbation ``u`` of the singular value it carries. The same argument
    gives the fp32 sums: at the rank-1 point the terms of ``(X^T X)_ij``, ``(A^2)_ij`` and
    ``(X B)_ij`` all have the sign of the result (products ``y_i y_k z_k z_j`` with squares in the
    middle), so a chain of ``n`` fp32 roundings is a relative ``gamma_n`` (``eps = 2^-24``); the
    two sums that can cancel (``b A + c A^2`` and ``a X + X B``) carry their error relative to the
    sum of the absolute terms (``gamma_b``, ``gamma_y``). Per stage, with ``k`` the Gram side
    (``min(rows, cols)``) and ``K`` the reduction length (``max(rows, cols)``):

    * ``delta_x = u``: ``a X + X B`` is one fused kernel with one rounding (SAFE); FAITHFUL's split
      path (bmm, then add_) rounds twice: ``(1 + u)^2 - 1``.
    * ``delta_gram = (1 + u)(1 + gamma_K) - 1``; FAITHFUL rounds its first Gram twice (taken of the
      unnormalized X, then rescaled by 1/d^2 and rounded again): one more factor ``1 + u``.
    * ``delta_b = u``; ``gamma_b = gamma_{k + 2}`` (the product's k-term sum, then the scale and the add).
    * ``gamma_y = gamma_{k + 2}`` (the product's k-term sum, the scale by a, the add).
    * ``delta0``, SAFE: the trace is the fp32 sum of squares of the prescaled bf16 X (the squares are
      exact: 16 significand bits), summed in blocks of NORM_BLOCK = 2^12 (a tree, depth 12), the
      block partials by _REDUCE_BLOCK lanes (``ceil(nb / 1024)`` sequential adds per lane, then a
      tree of depth 10): ``gamma_D`` with ``D = 12 + ceil(nb / 1024) + 10``; then ``sqrt`` (one
      rounding: two on the trace's scale), the product with the margin (two), the margin's own fp32
      rounding (two) and the division ``x s / d`` (two): ``delta0 = (1 + gamma_D)(1 + eps)^8 - 1``.
      FAITHFUL: the trace is the fp32 sum of the bf16-rounded Gram diagonal, each entry a K-term
      fp32 sum rounded to bf16: ``delta0 = (1 + gamma_K)(1 + u)(1 + gamma_{k - 1})(1 + eps)^6 - 1``.
      The worst case ``u`` is what the rounding of the diagonal can do; its typical size is
      ``u / sqrt(3 k)`` (independent roundings), which is why FAITHFUL fails often but not always.

    Subnormal numbers and second-order terms of the perturbation expansion are outside the model.
    """
    if config not in CONFIGS:
        raise DeriveMapsError(f"config = {config!r}: expected one of {CONFIGS}")
    for name, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DeriveMapsError(f"{name} = {v!r}: expected a positive integer")
    check_positive(u, "u")
    check_positive(eps, "eps")
    from anvil_fast.normalize import NORM_BLOCK, _REDUCE_BLOCK

    k, K = min(rows, cols), max(rows, cols)
    if config == "safe":
        nb = -(-rows * cols // NORM_BLOCK)
        depth = int(math.log2(NORM_BLOCK)) + -(-nb // _REDUCE_BLOCK) + int(math.log2(_REDUCE_BLOCK))
        return RoundingModel(delta_x=u, delta_gram=_compose(u, gamma(K, eps)), delta_b=u,
                             gamma_b=gamma(k + 2, eps), gamma_y=gamma(k + 2, eps),
                             delta0=_compose(gamma(depth, eps), *([eps] * 8)))
    return RoundingModel(delta_x=_compose(u, u), delta_gram=_compose(u, u, gamma(K, eps)), delta_b=u,
                         gamma_b=gamma(k + 2, eps), gamma_y=gamma(k + 2, eps),
                         delta0=_compose(gamma(K, eps), u, gamma(max(k - 1, 1), eps), *([eps] * 6)))


def uniform_model(delta: float, delta0: float = 0.0) -> RoundingModel:
    """Every rounding point perturbs by at most ``delta`` (``gamma_b = gamma_y = 0``), the trace by ``delta0``."""
    return RoundingModel(delta_x=delta, delta_gram=delta, delta_b=delta, gamma_b=0.0, gamma_y=0.0, delta0=delta0)


def safe_u(slack: float | None = None) -> Fraction:
    """The end of the SAFE configuration's interval: ``1 / (FROBENIUS_MARGIN (1 + slack))``
    (``slack`` defaults to SAFE_MARGIN_SLACK)."""
    if slack is None:
        from anvil_fast.cascade import SAFE_MARGIN_SLACK
        slack = SAFE_MARGIN_SLACK
    return 1 / (Fraction(FROBENIUS_MARGIN) * (1 + Fraction(slack)))


# ---------------------------------------------------------------------------------------------
# Interval evaluation of one stage.

def _factor(delta: float) -> Interval:
    """``[1 - delta, 1 + delta]`` rounded outward (a 0-d interval)."""
    d = DTYPE(delta)
    return np.nextafter(DTYPE(1) - d, DTYPE(-np.inf)), np.nextafter(DTYPE(1) + d, DTYPE(np.inf))


def _sym(r: np.ndarray) -> Interval:
    """``[-r, r]`` for ``r >= 0``."""
    return -r, r


def _iv_abs(a: Interval) -> Interval:
    """``|a|``."""
    lo = np.where(a[0] >= 0, a[0], np.where(a[1] <= 0, -a[1], DTYPE(0)))
    return lo, np.maximum(np.abs(a[0]), np.abs(a[1]))


def _hull_h(T: Interval, b: float, c: float) -> Interval:
    """The exact range of ``h(t) = b t + c t^2`` on ``T`` (end points and vertex), enclosed outward."""
    bb, cc = iv_point(b), iv_point(c)

    def h(t):
        tt = iv_point(t)
        return iv_add(iv_mul(bb, tt), iv_mul(cc, iv_sqr(tt)))

    h0, h1 = h(T[0]), h(T[1])
    lo, hi = np.minimum(h0[0], h1[0]), np.maximum(h0[1], h1[1])
    if c != 0:
        # vertex value -b^2 / (4c); including it where it may lie inside T can only widen the range
        num = iv_mul(bb, bb)
        den = (DTYPE(4) * DTYPE(c), DTYPE(4) * DTYPE(c))   # exact: a power-of-two multiple
        q = (num[0] / den[0], num[1] / den[1]) if c > 0 else (num[1] / den[1], num[0] / den[0])
        v = (np.nextafter(-q[1], DTYPE(-np.inf)), np.nextafter(-q[0], DTYPE(np.inf)))
        ts = DTYPE(-b) / (DTYPE(2) * DTYPE(c))
        tlo, thi = np.nextafter(ts, DTYPE(-np.inf)), np.nextafter(ts, DTYPE(np.inf))
        inside = (T[0] <= thi) & (T[1] >= tlo)
        lo = np.where(inside, np.minimum(lo, v[0]), lo)
        hi = np.where(inside, np.maximum(hi, v[1]), hi)
    return lo, hi


def _stage(S: Interval, coeffs, m: RoundingModel, *, eA=None, eB=None, gB=None, gY=None, eX=None) -> Interval:
    """Enclosure of ``s_k`` for ``s_{k-1}`` in ``S`` (see the module docstring). Each ``e*``/``g*`` may
    fix that perturbation to one value (a corner) instead of its whole range.

    The core ``y = s (a + (1 + e_B) h((1 + e_A) s^2))`` is the intersection of its natural extension
    and its mean-value form in ``s`` (value at the midpoint over the whole perturbation box, plus
    the enclosed ``dy/ds`` times ``S - mid``): the natural extension alone loses an amount linear in
    the width of ``S``, which the perturbations keep from shrinking."""
    a, b, c = (float(v) for v in coeffs)
    one = iv_point(1.0)
    fA = _factor(m.delta_gram) if eA is None else iv_add(one, iv_point(eA))
    fB = _factor(m.delta_b) if eB is None else iv_add(one, iv_point(eB))
    aa = iv_point(a)

    def core_h(T):
        T = (np.maximum(T[0], DTYPE(0)), T[1])
        return T, iv_mul(_hull_h(T, b, c), fB)

    T, H = core_h(iv_mul(iv_sqr(S), fA))
    Y = iv_mul(S, iv_add(aa, H))
    if np.any(S[1] > S[0]):
        mid = np.minimum(np.maximum(S[0] + (S[1] - S[0]) / 2, S[0]), S[1])
        M = iv_point(mid)
        _, Hm = core_h(iv_mul(iv_sqr(M), fA))
        Ym = iv_mul(M, iv_add(aa, Hm))
        # dy/ds = a + (1 + e_B) (3 b T + 5 c T^2),  T = (1 + e_A) s^2
        D = iv_add(aa, iv_mul(fB, iv_add(iv_mul(iv_mul(iv_point(3.0), iv_point(b)), T),
                                         iv_mul(iv_mul(iv_point(5.0), iv_point(c)), iv_sqr(T)))))
        Y = iv_intersect(Y, iv_add(Ym, iv_mul(D, iv_sub(S, M))))
    # the fp32-sum terms: s g_B (|b| t + |c| t^2) and g_Y (|a| + |h_k|) |s|, with h_k = h (1 + e_B) + g_B (...)
    absTs = iv_add(iv_mul(iv_point(abs(b)), T), iv_mul(iv_point(abs(c)), iv_sqr(T)))
    G = _sym(iv_mul(iv_point(m.gamma_b), absTs)[1]) if gB is None else iv_mul(iv_point(gB), absTs)
    Y = iv_add(Y, iv_mul(S, G))
    V = iv_mul(iv_add(iv_point(abs(a)), _iv_abs(iv_add(H, G))), _iv_abs(S))
    Y = iv_add(Y, _sym(iv_mul(iv_point(m.gamma_y), V)[1]) if gY is None else iv_mul(iv_point(gY), V))
    fX = _factor(m.delta_x) if eX is None else iv_add(one, iv_point(eX))
    return iv_mul(Y, fX)


def _split(S: Interval, pieces: int) -> Interval:
    """Cut every interval into ``pieces`` equal parts (rows: intervals, columns: parts); the end
    points are the original ones, so the parts cover the interval."""
    w = (S[1] - S[0])[:, None]
    f = (np.arange(pieces + 1, dtype=DTYPE) / DTYPE(pieces))[None, :]
    edges = S[0][:, None] + w * f
    edges[:, 0], edges[:, -1] = S[0], S[1]
    edges = np.maximum.accumulate(edges, axis=1)
    return edges[:, :-1], edges[:, 1:]


def propagate(maps, cells: Interval, m: RoundingModel, *, pieces: int = 8):
    """Enclosures of the output for every input in each cell (DTYPE arrays), and the mask of cells
    that may blow up (some stage may leave ``[-1e50, 1e50]``; their enclosure is the whole line)."""
    n = cells[0].shape[0]
    blown = np.zeros(n, dtype=bool)
    S = iv_mul(cells, _factor(m.delta_x))
    for coeffs in maps:
        P = _split(S, pieces)
        Y = _stage((P[0].ravel(), P[1].ravel()), coeffs, m)
        Y, bl = iv_clamp(Y)
        lo, hi = Y[0].reshape(n, pieces).min(1), Y[1].reshape(n, pieces).max(1)
        blown |= bl.reshape(n, pieces).any(1)
        S = (lo, hi)
    lo = np.where(blown, DTYPE(-np.inf), S[0])
    hi = np.where(blown, DTYPE(np.inf), S[1])
    return (lo, hi), blown


_CORNER_NAMES = ("eA", "eB", "gB", "gY", "eX")


def _corners(m: RoundingModel) -> list[dict]:
    sizes = dict(eA=m.delta_gram, eB=m.delta_b, gB=m.gamma_b, gY=m.gamma_y, eX=m.delta_x)
    out = [{}]
    for k in _CORNER_NAMES:
        vals = (-sizes[k], sizes[k]) if sizes[k] > 0 else (0.0,)
        out = [dict(o, **{k: v}) for o in out for v in vals]
    return out


def _corner_critical(coeffs, cn: dict, s_lo: np.ndarray, s_hi: np.ndarray) -> list[np.ndarray]:
    """Interior candidates of one corner: the positive zeros of ``q'`` for the quintic
    ``q(s) = a s + B b s^3 + B A^2 c s^5`` (``A = 1 + eA``, ``B = 1 + eB``, the g-terms left out: a
    candidate only has to lie in the reached interval), clipped into ``[s_lo, s_hi]`` (a clipped
    candidate is an end point again)."""
    a, b, c = (float(v) for v in coeffs)
    A, B = 1.0 + cn.get("eA", 0.0), 1.0 + cn.get("eB", 0.0)
    # q'(s) = a + 3 B A b s^2 + 5 B A^2 c s^4 = 0, a quadratic in s^2
    out = []
    for r in np.roots([5 * B * A * A * c, 3 * B * A * b, a]):
        if abs(r.imag) < 1e-12 and r.real > 0:
            x = float(np.sqrt(r.real))
            out.append(np.clip(np.full(s_lo.shape, x, dtype=DTYPE), s_lo, s_hi))
    return out


def reached(maps, x: np.ndarray, m: RoundingModel) -> Interval:
    """For each input ``x`` (exact float64 values), an interval ``[lo, hi]`` of outputs that some
    admissible perturbation sequence certainly reaches: lower bounds on the max and upper bounds on
    the min of the model's output. Stage by stage the reachable set (an interval: the continuous
    image of a box) is grown from its two ends by every corner of every perturbation."""
    x = np.asarray(x, dtype=np.float64)
    d = m.delta_x
    # s_0 = x (1 + e_0) with |e_0| <= d: factors one ulp inside 1 -+ d are admissible whatever the
    # rounding of 1 -+ d; of each product keep the end of its enclosure that lies inside
    one = DTYPE(1)
    f_lo = np.nextafter(one - DTYPE(d), one) if d > 0 else one
    f_hi = np.nextafter(one + DTYPE(d), one) if d > 0 else one
    s_lo = iv_mul(iv_point(x), (np.full(x.shape, f_lo), np.full(x.shape, f_lo)))[1]
    s_hi = iv_mul(iv_point(x), (np.full(x.shape, f_hi), np.full(x.shape, f_hi)))[0]
    corners = _corners(m)
    for coeffs in maps:
        cand_lo, cand_hi = [], []
        for cn in corners:
            for s in (s_lo, s_hi, *_corner_critical(coeffs, cn, s_lo, s_hi)):
                Y = _stage(iv_point(s), coeffs, m, **cn)
                # a reached value lies in Y: Y's upper end bounds it from above, its lower end from below
                cand_lo.append(Y[1])
                cand_hi.append(Y[0])
        # the reached set contains every candidate value; its min is <= min(upper ends), its max >= max(lower ends)
        s_lo = np.min(np.stack(cand_lo), 0)
        s_hi = np.max(np.stack(cand_hi), 0)
        # [s_lo, s_hi] lies inside the reached interval whenever it is not empty; a reached set
        # narrower than the enclosures (no perturbation) leaves the two within an ulp: swap them
        s_lo, s_hi = np.minimum(s_lo, s_hi), np.maximum(s_lo, s_hi)
        s_lo, s_hi = np.clip(s_lo, -BIG, BIG), np.clip(s_hi, -BIG, BIG)
    return s_lo, s_hi


# ---------------------------------------------------------------------------------------------
# Certificates.

@dataclass(frozen=True)
class RobustEnvelope:
    """Certified bounds on the model's output ``s_K`` for inputs in ``[l, u]`` (before the trace's
    widening, which is applied inside) and every admissible perturbation.

    ``f_min_certified <= min s_K <= f_min_reached`` and ``f_max_reached <= max s_K <= f_max_certified``;
    ``max_abs_log_certified`` bounds ``max |log s_K|`` on ``[l, u]`` (inf if ``l = 0``, or if ``s_K``
    may reach 0, or blow up). ``argmax``: an input at which ``f_max_reached`` is reached.
    """
    l: float
    u: float
    x_lo: float
    x_hi: float
    f_min_certified: float
    f_min_reached: float
    f_max_reached: float
    f_max_certified: float
    argmax: float
    max_abs_log_certified: float
    max_abs_log_reached: float
    blown_up: bool
    cells: int
    pieces: int
    model: dict

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def headroom_certified(self) -> float:
        """How far above 1 the output can go (rigorous upper bound; inf on blow-up)."""
        return self.f_max_certified - 1.0

    @property
    def headroom_reached(self) -> float:
        return self.f_max_reached - 1.0


def _input_interval(l: Fraction, u: Fraction, delta0: float):
    """``[l / sqrt(1 + delta0), u / sqrt(1 - delta0)]`` enclosed outward in DTYPE: a trace that is
    off by a factor ``1 + e`` divides every singular value by ``sqrt(1 + e)``."""
    lo = enclose_rational(l)[0]
    hi = enclose_rational(u)[1]
    if delta0 > 0:
        d0 = Fraction(delta0)
        # 1/sqrt(1 + d0) >= 1 - d0/2 and 1/sqrt(1 - d0) <= 1 + d0/2 / (1 - d0)^(3/2) <= 1 + d0 (d0 <= 1/4)
        if d0 > Fraction(1, 4):
            raise DeriveMapsError(f"delta0 = {delta0}: expected at most 1/4")
        lo = enclose_rational(Fraction(*lo.as_integer_ratio()) * (1 - d0 / 2))[0]
        hi = enclose_rational(Fraction(*hi.as_integer_ratio()) * (1 + d0))[1]
    return max(lo, DTYPE(0)), hi


#: Relative position of the first geometric cell edge when an interval starts at 0 (below it one
#: cell ``[0, x0]``: the composite is about ``F'(0) x`` there, far below 1).
ZERO_CELL = 2.0 ** -30


def _cells(lo, hi, n: int, geometric: bool) -> Interval:
    """``n`` cells covering ``[lo, hi]``: geometric (equal relative width, which is what the
    interval extension's dependency loss scales with), with one cell ``[0, x0]`` if ``lo = 0``."""
    lf, hf = float(lo), float(hi)
    if not geometric or n < 3:
        e = np.linspace(lf, hf, n + 1).astype(DTYPE)
    elif lf > 0:
        e = np.geomspace(lf, hf, n + 1).astype(DTYPE)
    else:
        e = np.concatenate([[0.0], np.geomspace(hf * ZERO_CELL, hf, n)]).astype(DTYPE)
    e[0], e[-1] = lo, hi
    e = np.maximum.accumulate(e)
    return e[:-1].copy(), e[1:].copy()


#: Cells the branch and bound may hold at once before it stops refining (their bounds still count).
MAX_CELLS = 200_000


def _reached_at(maps_, C: Interval, idx: np.ndarray, model: RoundingModel, x_lo, x_hi):
    """Reached intervals at the ends and midpoints of the cells ``idx``: (points, lo, hi)."""
    pts = np.unique(np.concatenate([C[0][idx], C[1][idx], (C[0][idx] + (C[1][idx] - C[0][idx]) / 2)])
                    .astype(np.float64))
    pts = pts[(pts >= float(x_lo)) & (pts <= float(x_hi))]
    if not pts.size:
        pts = np.array([float(x_hi)])
    r_lo, r_hi = reached(maps_, pts, model)
    return pts, r_lo, r_hi


def robust_envelope(maps, l: RealLike, u: RealLike, model: RoundingModel, *, cells: int = 256,
                    pieces: int = 64, rtol: float = 0.02, max_levels: int = 40) -> RobustEnvelope:
    """The robust envelope of ``maps`` on ``[l, u]`` under ``model`` (``l = 0`` allowed: then the max
    is what matters, the headroom; the certified ``max |log|`` is inf).

    Branch and bound: a cell is bisected (geometrically) until its enclosure cannot move a bound by
    more than ``rtol`` of ``|log|`` of the value reached (or ``max_levels`` / MAX_CELLS is hit; the
    open cells' enclosures then count as they are). Reached values come from :func:`reached` at the
    ends and midpoints of the cells that decide the bounds."""
    maps_ = check_maps(maps)
    lf, uf = parse_real(l, "l"), parse_real(u, "u")
    if lf < 0 or uf <= lf:
        raise DeriveMapsError(f"interval [{float(lf):g}, {float(uf):g}]: expected 0 <= l < u")
    if not isinstance(model, RoundingModel):
        raise DeriveMapsError(f"model: expected a RoundingModel, got {type(model).__name__}")
    for name, v in (("cells", cells), ("pieces", pieces), ("max_levels", max_levels)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DeriveMapsError(f"{name} = {v!r}: expected a positive integer")
    check_positive(rtol, "rtol")
    x_lo, x_hi = _input_interval(lf, uf, model.delta0)
    C = _cells(x_lo, x_hi, cells, geometric=True)
    amax, amin = DTYPE(-np.inf), DTYPE(np.inf)
    argmax = float(x_hi)
    cmax, cmin = DTYPE(-np.inf), DTYPE(np.inf)
    is_blown = False
    ncells = 0
    for level in range(max_levels):
        ncells += C[0].size
        Y, blown = propagate(maps_, C, model, pieces=pieces)
        k = min(16, Y[1].size)
        idx = np.unique(np.concatenate([np.argsort(Y[1])[-k:], np.argsort(Y[0])[:k]]))
        pts, r_lo, r_hi = _reached_at(maps_, C, idx, model, x_lo, x_hi)
        i = int(np.argmax(r_hi))
        if r_hi[i] > amax:
            amax, argmax = r_hi[i], float(pts[i])
        amin = min(amin, r_lo.min())
        if amax >= BIG:           # a perturbation sequence that certainly leaves [-1e50, 1e50]
            is_blown = True
            cmax, cmin = DTYPE(np.inf), min(cmin, DTYPE(-np.inf))
            break
        with np.errstate(all="ignore"):
            tol_hi = DTYPE(rtol * max(abs(float(np.log(float(amax)))), 1e-6) * float(amax)) if amax > 0 else DTYPE(0)
            tol_lo = DTYPE(rtol * max(abs(float(np.log(float(amin)))), 1e-6) * float(amin)) if amin > 0 else DTYPE(0)
        # A cell is done when its bound is within the tolerance of the value reached, or of its own
        # midpoint's enclosure: one input's reachable set is already ~delta wide, splitting the
        # cell cannot bring its bound below that of its points.
        mid = C[0] + (C[1] - C[0]) / 2
        Ym, _ = propagate(maps_, (mid, mid.copy()), model, pieces=pieces)
        ref_hi, ref_lo = np.maximum(amax, Ym[1]), np.minimum(amin, Ym[0])
        done = ~blown & (Y[1] <= ref_hi + tol_hi) & ((lf == 0) | (Y[0] >= ref_lo - tol_lo))
        last = level == max_levels - 1 or 2 * int((~done).sum()) > MAX_CELLS
        leave = done | np.full(done.shape, last)
        if leave.any():
            cmax = max(cmax, Y[1][leave].max())
            cmin = min(cmin, Y[0][leave].min())
            is_blown |= bool(blown[leave].any())
        if last or done.all():
            break
        lo, hi = C[0][~done], C[1][~done]
        mid = np.where(lo > 0, np.sqrt(lo) * np.sqrt(hi), lo + (hi - lo) / 2)
        mid = np.minimum(np.maximum(mid, lo), hi)
        C = (np.concatenate([lo, mid]), np.concatenate([mid, hi]))
    is_blown = is_blown or not np.isfinite(cmax)
    if is_blown or lf == 0 or cmin <= 0:
        mal_c = float("inf")
    else:
        mal_c = max(_log_up(cmax), -_log_down(cmin))
    mal_r = max(_log_down(amax) if amax > 0 else float("-inf"), -_log_up(amin) if amin > 0 else float("inf"))
    return RobustEnvelope(l=float(lf), u=float(uf), x_lo=f64_down(x_lo), x_hi=f64_up(x_hi),
                          f_min_certified=f64_down(cmin), f_min_reached=f64_up(amin),
                          f_max_reached=f64_down(amax), f_max_certified=f64_up(cmax), argmax=argmax,
                          max_abs_log_certified=mal_c, max_abs_log_reached=max(mal_r, 0.0),
                          blown_up=is_blown, cells=int(ncells), pieces=pieces, model=model.as_dict())


@dataclass(frozen=True)
class RobustVerdict:
    """Whether a set survives the model: no blow-up on ``[0, u]`` and ``max s_K <= 1 + eps`` there."""
    headroom: RobustEnvelope       #: on [0, u]
    envelope: RobustEnvelope | None  #: on [l, u] (None if not asked)
    eps: float
    passed: bool
    reason: str

    def as_dict(self) -> dict:
        return dict(headroom=self.headroom.as_dict(), envelope=None if self.envelope is None else self.envelope.as_dict(),
                    eps=self.eps, passed=self.passed, reason=self.reason)


def robust_verdict(maps, model: RoundingModel, *, l: RealLike | None, u: RealLike, eps: float | None = None,
                   **kw) -> RobustVerdict:
    """Certify ``maps`` under ``model``: refused if the output may blow up on ``[0, u]`` or may exceed
    ``1 + eps`` there (``eps`` default DEFAULT_EPS); passed if the certified max is at most ``1 + eps``."""
    eps = DEFAULT_EPS if eps is None else check_positive(eps, "eps")
    h = robust_envelope(maps, 0, u, model, **kw)
    e = robust_envelope(maps, l, u, model, **kw) if l is not None else None
    if h.blown_up:
        return RobustVerdict(h, e, eps, False, "blows up: some stage may leave [-1e50, 1e50]")
    if h.f_max_certified > 1 + eps:
        how = "reaches" if h.f_max_reached > 1 + eps else "may reach"
        return RobustVerdict(h, e, eps, False, f"{how} {h.f_max_reached if how == 'reaches' else h.f_max_certified:.6g} "
                             f"> 1 + eps = {1 + eps:g}")
    return RobustVerdict(h, e, eps, True, f"max output <= {h.f_max_certified:.6g} <= 1 + eps = {1 + eps:g}")


def model_for(config: str | None, *, delta: float | None = None, delta0: float | None = None, rows: int = 768,
              cols: int = 768) -> RoundingModel:
    """The CLI's model: ``config``'s derived one, with ``delta`` (every rounding point) and ``delta0``
    overriding it where given."""
    m = rounding_model(config or "safe", rows=rows, cols=cols)
    if delta is not None:
        check_positive(delta, "delta", allow_zero=True)
        m = replace(m, delta_x=delta, delta_gram=delta, delta_b=delta, gamma_b=0.0, gamma_y=0.0)
    if delta0 is not None:
        check_positive(delta0, "delta0", allow_zero=True)
        m = replace(m, delta0=delta0)
    return m
