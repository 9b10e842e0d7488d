"""The robust certificate: a rigorous bound on what the bf16 cascade does to singular values.

:mod:`derive_maps.certify` certifies the composite ``F = p_K o ... o p_1`` in exact arithmetic. The
fast cascade rounds: this module certifies the composite *under a rounding model* of it, with the
same standard (outward-rounded interval arithmetic, nothing sampled). A certificate names the
inputs it covers (:class:`RoundingModel`, :func:`rounding_model`):

* ``inputs="diagonal"``: matrices with at most one nonzero per row and per column (diagonal
  matrices, and the same under row and column permutations and sign changes), any size. Each
  singular value is one entry and stays one entry through the cascade (``A``, ``B`` and every
  iterate are diagonal), so every rounding is relative to the value it carries: the **scalar
  model** below is exact about which value is rounded where.
* ``inputs="general"``: every matrix whose nonzero entries fit in a ``rows x cols`` block (zero rows
  and columns around it change nothing: they stay exactly zero, and an fp32 sum of exact zeros adds
  nothing to the error). It has ``m = min(rows, cols)`` singular values, and a rounding couples
  them: the **cross-talk model** below.

Where the kernels round (SAFE, :mod:`anvil_fast.core.cascade`, :mod:`anvil_fast.kernels.gram`,
:mod:`anvil_fast.kernels.normalize`; :func:`anvil_fast.core.eager.eager_bf16_cascade` with ``fp32_trace``,
``prescale`` and ``gemm="fp32"`` rounds at the same points): the trace is an fp32 sum of squares of
the bf16 input; ``X_1 = bf16(fp32(x s / d))``; per map ``A = bf16(fp32 sums of X X^T)``,
``B = bf16(fp32(c (A A) + b A))``, ``X <- bf16(fp32(a X + X B))`` (one rounding: the fused kernel).
A bf16 rounding of a matrix ``M`` is ``M + E`` with ``|E_ij| <= u |M_ij|`` (``u = 2^-8``); an fp32
sum of ``n`` products of bf16 numbers (each exact in fp32) errs by at most ``gamma_n`` times the sum of
the absolute terms.

Scalar model (diagonal inputs). A singular value ``x`` of the normalized input becomes ``s_0`` and
passes the stages ``s_k`` (one per map ``p_k(s) = s (a + h(s^2))``, ``h(t) = b t + c t^2``)::

    x      in [l / ((1 + delta_eps) sqrt(1 + delta0)), u / sqrt(1 - delta0)]   trace and eps
    s_0    = x (1 + e_0)                                          the bf16 normalized iterate X_1
    t_k    = s_{k-1}^2 (1 + e_A)                                  the Gram A
    h_k    = h(t_k) (1 + e_B) + g_B (|b| t_k + |c| t_k^2)        B = b A + c A^2
    y_k    = s_{k-1} (a + h_k) + g_Y (|a| + |h_k|) |s_{k-1}|      a X + X B, fp32 sums
    s_k    = y_k (1 + e_X)                                        its bf16 rounding (the next iterate)

with ``|e_0|, |e_X| <= delta_x``, ``|e_A| <= (1 + delta_gram)(1 + gamma_gram) - 1``,
``|e_B| <= delta_b``, ``|g_B| <= gamma_b``, ``|g_Y| <= gamma_y``, every one chosen independently at every
stage (an adversary, not a distribution). Output: ``s_K``, a *signed* value: its sign is that of the
diagonal entry, so a sign flip of one singular direction is an output below 0.

Cross-talk model (general inputs). The rounding of a matrix moves *every* singular value by up to
``u ||M||_F`` (Weyl: ``|sigma_i(M + E) - sigma_i(M)| <= ||E||_2 <= u || |M| ||_2 <= u ||M||_F``), not by
``u sigma_i``: a small singular value next to large ones is swamped. Per stage, with ``X`` the iterate
(singular values ``sigma_j``, the tracked one ``s``, all of them at most ``S`` in magnitude:
the frame below), exactly::

    X' = p(X) + (B~ - h(A)) X + E_Y + E_X,        p(X) has the singular values |p(sigma_j)|

and ``||B~ - h(A)|| <= ||h(A~) - h(A)|| + ||B~ - h(A~)||`` with ``A~ = A + E_A``,
``h(A~) - h(A) = (b/2 + c A) E_A + E_A (b/2 + c A) + c E_A^2``. Every norm is bounded through
``||X||_F^2 <= s^2 + (m - 1) S^2``, ``||A||_F^2 <= s^4 + (m - 1) S^4``, ``||h(A)||_F^2 <= h(s^2)^2 +
(m - 1) max|h|^2``, ``||p(X)||_F^2 <= p(s)^2 + (m - 1) max|p|^2`` (:func:`_cross_eps` has every term),
so Weyl gives ``s' in p(s) +- eps(s)`` for the tracked value, matched to the output's singular values
in sorted order. Composing the stages pairs every input singular value with one of the output's
(one to one), each output value inside its input's enclosure. The first iterate: ``s_0 in x +-
(delta_x + delta_z (1 + delta_x)) ||Z||_F`` (``Z`` the exactly normalized input, ``||Z||_F <= u``;
``X_1 = bf16(fp32(x s / d))`` rounds each entry twice). The **frame**
(:func:`cross_frame`) is the bound ``S`` of every stage: the same propagation over all of ``[0, u]``
(every singular value of every admissible input, and the zero ones the roundings fill in), stage by
stage; a stage on which some value may blow up makes the frame, and every certificate under it,
blow up. ``m = 1`` would not be the scalar model (the norms bound what the scalar model knows
exactly), so a one-singular-value class is ``inputs="diagonal"``.

Certificates (:func:`robust_envelope`): the input interval is cut into cells; each cell's stage
interval is cut into ``pieces`` before every map, every quantity above is enclosed with outward
rounding (:mod:`derive_maps.intervals`), and ``h``'s range on an interval is exact (its end points
and its vertex). The result bounds the output for every input in the interval and every admissible
perturbation: the **robust envelope**, two-sided (certified min and max on ``[l, u]``, hence a
certified ``max |log|``) and, on ``[0, u]``, the **robust headroom** (``max - 1``; ``inf`` when some
stage may leave ``[-1e50, 1e50]``: blow-up). A value the model certainly reaches brackets each bound
from the other side. :func:`robust_verdict` (the one verdict rule: the CLI and the frontier take it
from there) passes a set when nothing may blow up, ``|output|`` on ``[0, u]`` stays below its limit
(a sign flip counts) and the min on ``[l, u]`` above its own, the limits widened by the set's own
certified exact error. A certificate holds for its class only (:meth:`RoundingModel.covers`: shape,
norm floor, size limits); :func:`class_membership` checks a given matrix against it.

``python -m derive_maps robust anvil`` prints both for a set under the SAFE model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from fractions import Fraction

import numpy as np

from anvil_ref.constants import (BF16_UNIT_ROUNDOFF, FP32_UNIT_ROUNDOFF, FROBENIUS_EPS, FROBENIUS_MARGIN, MIN_NORM,
                                 NORM_BLOCK, NORM_REDUCE_BLOCK, SAFE_MARGIN_SLACK)

from .certify import _log_down, _log_up, enclose_rational, f64_down, f64_up
from .errors import DeriveMapsError, RealLike, check_maps, check_positive, parse_real
from .intervals import (BIG, DTYPE, Interval, geometric_edges, iv_abs, iv_add, iv_clamp, iv_intersect, iv_max, iv_min, iv_mul,
                        iv_mul_pos, iv_point, iv_sqr, iv_sqrt, iv_sub)
from .progress import Progress

CONFIGS = ("safe", "faithful")
INPUTS = ("general", "diagonal")

#: Default tolerance of the verdict: the output may leave [1/(1 + eps), 1 + eps] by at most a few
#: bf16 units (2^-5 = 8 units of 2^-8) for every admissible perturbation.
DEFAULT_EPS = 2.0 ** -5

#: Default block of the general-input model: the largest matrices the falsification search of the
#: tests checks (tests/test_robust.py).
DEFAULT_BLOCK = 8


# ---------------------------------------------------------------------------------------------
# The rounding model.

@dataclass(frozen=True)
class RoundingModel:
    """Elementwise relative rounding bounds of one cascade stage (module docstring: where each acts),
    and the inputs the model covers."""
    delta_x: float       #: bf16 rounding of every iterate X_k (and of the normalized X_1)
    delta_gram: float    #: the Gram A: its bf16 rounding (relative to the fp32 sums)
    delta_b: float       #: bf16 rounding of B = b A + c A^2
    gamma_b: float       #: fp32 sums of B, relative to |b| |A| + |c| |A| |A|
    gamma_y: float       #: fp32 sums of a X + X B, relative to (|a| + |B|) |X|
    delta0: float        #: the trace of the normalization (relative error of d^2)
    gamma_gram: float = 0.0  #: the Gram's fp32 sums, relative to |X| |X|^T
    delta_eps: float = 0.0   #: the normalization's eps: normalized values shrink by up to 1 / (1 + delta_eps)
    #: how many singular values share one matrix: 1 is the scalar model (diagonal inputs); m >= 2 the
    #: cross-talk model of an m-singular-value block
    singular_values: int = 1
    #: the fp32 rounding of every entry of ``x s / d`` before X_1's bf16 rounding (cross-talk model; the
    #: scalar model carries it in ``delta0``: one entry per singular value, rounded relative to it)
    delta_z: float = 0.0
    #: the class's norm floor: inputs with ``||X||_F >= min_norm`` (what ``delta_eps`` was derived for; 0: none)
    min_norm: float = 0.0
    #: the class's size limits (0: none): the nonzero block's long side (the fp32 sums' length) and the
    #: matrix's entries (the trace's summation depth)
    max_long_side: int = 0
    max_entries: int = 0

    def __post_init__(self):
        for k, v in asdict(self).items():
            if k in ("singular_values", "max_long_side", "max_entries"):
                low = 1 if k == "singular_values" else 0
                if isinstance(v, bool) or not isinstance(v, int) or v < low:
                    raise DeriveMapsError(f"rounding model: {k} = {v!r}; expected an integer >= {low}")
            elif k == "min_norm":
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise DeriveMapsError(f"rounding model: min_norm = {v!r}; expected a finite norm >= 0")
            elif not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v < 0.5):
                raise DeriveMapsError(f"rounding model: {k} = {v!r}; expected a relative perturbation in [0, 0.5)")

    @property
    def cross_talk(self) -> bool:
        return self.singular_values > 1

    def covers(self) -> str:
        """The inputs the model's certificates hold for, in words: every assumption of the model
        (:func:`class_membership` checks a given matrix against them)."""
        if not self.cross_talk:
            shape = "diagonal inputs (at most one nonzero per row and column)"
        else:
            m = self.singular_values
            side = f"at most {self.max_long_side}" if self.max_long_side else "any length"
            shape = (f"matrices whose nonzero entries fit in a {m} x n block (at most {m} singular values; "
                     f"long side n {side}; zero rows and columns around it allowed)")
        norm = (f"||X||_F >= {self.min_norm:g}" if self.min_norm > 0
                else "any Frobenius norm (the normalization's eps left out)")
        size = f"at most {self.max_entries} entries" if self.max_entries else "any number of entries"
        return f"{shape}, {norm}, {size}"

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


#: Unit of the fp32 accumulations in the products: a tensor core may truncate its additions instead
#: of rounding them to nearest, which doubles the unit (the products of bf16 numbers are exact).
ACCUMULATION_UNIT = 2 * FP32_UNIT_ROUNDOFF


def rounding_model(config: str = "safe", *, rows: int = DEFAULT_BLOCK, cols: int = DEFAULT_BLOCK,
                   inputs: str = "general", min_norm: float = MIN_NORM, u: float = BF16_UNIT_ROUNDOFF,
                   eps: float = FP32_UNIT_ROUNDOFF) -> RoundingModel:
    """The rounding model of the fast cascade (``config`` ``"safe"`` or ``"faithful"``,
    :mod:`anvil_fast.core.cascade`) for ``inputs`` (``"general"``: every matrix whose nonzero block is at
    most ``rows x cols``; ``"diagonal"``: one nonzero per row and column in a ``rows x cols``
    matrix) whose Frobenius norm is at least ``min_norm`` (for the low end only).

    Derivation, per stage (``L = max(rows, cols)``, the longest fp32 sum; ``v = ACCUMULATION_UNIT``):

    * ``delta_x = u``: ``a X + X B`` is one fused kernel with one rounding (SAFE); FAITHFUL's split
      path (bmm, then add_) rounds twice: ``(1 + u)^2 - 1``.
    * ``delta_gram = u`` (one rounding of the fp32 sums), ``gamma_gram = gamma_L(v)`` (their error,
      relative to ``|X| |X|^T``); FAITHFUL rounds its first Gram twice (taken of the unnormalized
      X, then rescaled by ``1/d^2`` in fp32 and rounded again), and that Gram is of ``x/d``, not of
      the rounded ``X_1``: its ``delta_gram`` carries both (``(1 + u)^4 (1 + eps) - 1``, for every
      stage: an upper bound).
    * ``delta_b = u``; ``gamma_b = gamma_{L + 2}(v)`` (the product's sum, then the scale and the add).
    * ``gamma_y = gamma_{L + 2}(v)`` (the product's sum, the scale by a, the add).
    * Diagonal inputs: every sum has one nonzero term, a product of bf16 numbers, exact in fp32, so
      ``gamma_gram = 0`` and ``gamma_b = gamma_y = gamma_2`` (the two scalings and the add).
    * ``delta0``, SAFE: the trace is the fp32 sum of squares of the prescaled bf16 X (the squares are
      exact: 16 significand bits), summed in blocks of NORM_BLOCK = 2^12 (a tree, depth 12), the
      block partials by NORM_REDUCE_BLOCK = 2^10 lanes (``ceil(nb / 1024)`` sequential adds per
      lane, then a tree of depth 10): ``gamma_D`` with ``D = 12 + ceil(nb / 1024) + 10``; then
      ``sqrt`` (one rounding: two on the trace's scale), the product with the margin (two), the
      margin's own fp32 rounding (two) and the division ``x s / d`` (two):
      ``delta0 = (1 + gamma_D)(1 + eps)^8 - 1``.
      FAITHFUL: the trace is the fp32 sum of the bf16-rounded Gram diagonal, each entry an L-term
      fp32 sum rounded to bf16: ``delta0 = (1 + gamma_L)(1 + u)(1 + gamma_{k - 1})(1 + eps)^6 - 1``.
    * ``delta_eps = eps_F / (margin min_norm)`` with the cascade's ``eps_F = FROBENIUS_EPS``.
    * ``singular_values``: ``min(rows, cols)`` for general inputs, 1 for diagonal ones.
    * ``delta_z = eps`` for general inputs: ``X_1 = bf16(fp32(x s / d))`` rounds every entry of the
      exactly normalized ``Z`` twice, so ``||X_1 - Z||_2 <= (delta_x + delta_z (1 + delta_x)) ||Z||_F``;
      for diagonal ones that rounding is relative to the singular value it carries and is in ``delta0``.
    * The class (:meth:`RoundingModel.covers`, :func:`class_membership`): ``||X||_F >= min_norm``; a
      nonzero block of long side at most ``L`` (general inputs: the fp32 sums' length; zero terms add
      exactly); at most ``ceil(nb / 1024) * 1024 * 4096`` entries (SAFE: the trace's depth holds for
      every matrix of that many; FAITHFUL: ``rows * cols``, its trace sums a diagonal of ``L`` terms).

    Subnormal numbers are outside the model (the prescale keeps X_1 at unit scale; a singular
    direction below 2^-126 of it is below every resolution limit anyway).
    """
    if config not in CONFIGS:
        raise DeriveMapsError(f"config = {config!r}: expected one of {CONFIGS}")
    if inputs not in INPUTS:
        raise DeriveMapsError(f"inputs = {inputs!r}: expected one of {INPUTS}")
    for name, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DeriveMapsError(f"{name} = {v!r}: expected a positive integer")
    check_positive(u, "u")
    check_positive(eps, "eps")
    check_positive(min_norm, "min_norm")
    k, L = min(rows, cols), max(rows, cols)
    v = 2 * eps
    diag = inputs == "diagonal"
    g_sum = gamma(2, v) if diag else gamma(L + 2, v)
    # the trace's depth holds for every matrix of as many norm blocks as the given one's lanes take
    nb = -(-rows * cols // NORM_BLOCK)
    lane_adds = -(-nb // NORM_REDUCE_BLOCK)
    common = dict(delta_b=u, gamma_b=g_sum, gamma_y=g_sum, gamma_gram=0.0 if diag else gamma(L, v),
                  delta_eps=f64_up(DTYPE(FROBENIUS_EPS) / (DTYPE(FROBENIUS_MARGIN) * DTYPE(min_norm)) * (1 + 1e-15)),
                  singular_values=1 if diag else k, delta_z=0.0 if diag else eps, min_norm=float(min_norm),
                  max_long_side=0 if diag else L,
                  max_entries=(lane_adds * NORM_REDUCE_BLOCK * NORM_BLOCK) if config == "safe" else rows * cols)
    if config == "safe":
        depth = int(math.log2(NORM_BLOCK)) + lane_adds + int(math.log2(NORM_REDUCE_BLOCK))
        return RoundingModel(delta_x=u, delta_gram=u, delta0=_compose(gamma(depth, eps), *([eps] * 8)), **common)
    return RoundingModel(delta_x=_compose(u, u), delta_gram=_compose(u, u, u, u, eps),
                         delta0=_compose(gamma(L, eps), u, gamma(max(k - 1, 1), eps), *([eps] * 6)), **common)


def uniform_model(delta: float, delta0: float = 0.0) -> RoundingModel:
    """Every rounding point perturbs by at most ``delta`` (``gamma_b = gamma_y = 0``), the trace by
    ``delta0``: a scalar model."""
    return RoundingModel(delta_x=delta, delta_gram=delta, delta_b=delta, gamma_b=0.0, gamma_y=0.0, delta0=delta0)


def safe_u(slack: float | None = None) -> Fraction:
    """The end of the SAFE configuration's interval: ``1 / (FROBENIUS_MARGIN (1 + slack))``
    (``slack`` defaults to SAFE_MARGIN_SLACK)."""
    if slack is None:
        slack = SAFE_MARGIN_SLACK
    return 1 / (Fraction(FROBENIUS_MARGIN) * (1 + Fraction(slack)))


def resolution_limits(model: RoundingModel | None = None) -> dict:
    """What a bf16 cascade can resolve of a matrix with singular values ``sigma_1 >= ...``, from the
    rounding bounds of ``model`` (default: SAFE's on 2 x 2 blocks):

    * ``iterate``: one rounding of an iterate moves every singular value by up to
      ``delta_x ||X||_F >= delta_x sigma_1``; a singular value below ``delta_x sigma_1`` can be
      rounded to 0 (the ratio ``sigma_i / sigma_1`` it resolves is ``delta_x`` at best);
    * ``gram``: the rounding of ``A = X X^T`` moves its eigenvalues ``sigma_j^2`` by up to
      ``delta_gram ||A||_F >= delta_gram sigma_1^2``: the Gram resolves ``sigma_i / sigma_1`` only down to
      ``sqrt(delta_gram)``.

    Both for ``m`` singular values at ``sigma_1`` (the worst case of the norms): multiplied by
    ``sqrt(m)`` and ``m^(1/4)``.
    """
    m = model or rounding_model("safe", rows=2, cols=2)
    k = m.singular_values
    return dict(iterate=m.delta_x, gram=math.sqrt(m.delta_gram), iterate_block=m.delta_x * math.sqrt(k),
                gram_block=math.sqrt(m.delta_gram * math.sqrt(k)), singular_values=k)


# ---------------------------------------------------------------------------------------------
# Interval evaluation of one stage: the scalar model.

def _factor(delta: float) -> Interval:
    """``[1 - delta, 1 + delta]`` rounded outward (a 0-d interval)."""
    d = DTYPE(delta)
    return np.nextafter(DTYPE(1) - d, DTYPE(-np.inf)), np.nextafter(DTYPE(1) + d, DTYPE(np.inf))


def _sym(r: np.ndarray) -> Interval:
    """``[-r, r]`` for ``r >= 0``."""
    return -r, r


_iv_abs = iv_abs


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


def _gram_factor(m: RoundingModel) -> float:
    """The scalar model's relative perturbation of ``t = s^2`` by the Gram."""
    return _compose(m.delta_gram, m.gamma_gram)


def _stage(S: Interval, coeffs, m: RoundingModel, *, eA=None, eB=None, gB=None, gY=None, eX=None) -> Interval:
    """Scalar model: enclosure of ``s_k`` for ``s_{k-1}`` in ``S`` (see the module docstring). Each
    ``e*``/``g*`` may fix that perturbation to one value (a corner) instead of its whole range.

    The core ``y = s (a + (1 + e_B) h((1 + e_A) s^2))`` is the intersection of its natural extension
    and its mean-value form in ``s`` (value at the midpoint over the whole perturbation box, plus
    the enclosed ``dy/ds`` times ``S - mid``): the natural extension alone loses an amount linear in
    the width of ``S``, which the perturbations keep from shrinking."""
    a, b, c = (float(v) for v in coeffs)
    one = iv_point(1.0)
    fA = _factor(_gram_factor(m)) if eA is None else iv_add(one, iv_point(eA))
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




def _p(S: Interval, coeffs) -> Interval:
    """Enclosure of the exact map ``p(s) = s (a + h(s^2))`` for ``s`` in ``S``: the natural extension
    (``h``'s exact range) intersected with the mean-value form ``p(m) + p'(S) (S - m)``."""
    a, b, c = (float(v) for v in coeffs)
    aa = iv_point(a)
    T = iv_sqr(S)
    Y = iv_mul(S, iv_add(aa, _hull_h(T, b, c)))
    if np.any(S[1] > S[0]):
        mid = np.minimum(np.maximum(S[0] + (S[1] - S[0]) / 2, S[0]), S[1])
        M = iv_point(mid)
        Ym = iv_mul(M, iv_add(aa, _hull_h(iv_sqr(M), b, c)))
        b3, c5 = iv_mul(iv_point(3.0), iv_point(b)), iv_mul(iv_point(5.0), iv_point(c))   # 3b, 5c enclosed
        D = iv_add(aa, iv_mul(T, iv_add(b3, iv_mul(c5, T))))
        Y = iv_intersect(Y, iv_add(Ym, iv_mul(D, iv_sub(S, M))))
    return Y


# ---------------------------------------------------------------------------------------------
# The cross-talk model.

@dataclass(frozen=True)
class Frame:
    """Bounds on every singular value of every stage of every admissible input (the ``S`` of the
    cross-talk model): ``bound[k]`` bounds ``|sigma|`` of the iterate entering map ``k + 1``
    (``bound[K]``: the output), ``pmax[k]`` / ``hmax[k]`` bound ``|p_{k+1}|`` on ``[0, bound[k]]`` and
    ``|h_{k+1}|`` on ``[0, bound[k]^2]``; ``norm_z`` bounds the Frobenius norm of the exactly normalized
    input. ``blown``: some stage may leave ``[-1e50, 1e50]``."""
    x_hi: float
    norm_z: float
    bound: tuple
    pmax: tuple
    hmax: tuple
    blown: bool

    def as_dict(self) -> dict:
        return dict(x_hi=self.x_hi, norm_z=self.norm_z, bound=[float(v) for v in self.bound],
                    pmax=[float(v) for v in self.pmax], hmax=[float(v) for v in self.hmax], blown=self.blown)


def _c(v) -> Interval:
    return iv_point(np.asarray(v, dtype=DTYPE))


def _range_abs_p(coeffs, top) -> DTYPE:
    """An upper bound on ``|p|`` over ``[0, top]`` (1024 pieces, each enclosed)."""
    e = np.linspace(0.0, 1.0, 1025).astype(DTYPE) * DTYPE(top)
    e[-1] = DTYPE(top)
    P = _p((e[:-1], e[1:]), coeffs)
    return np.max(iv_abs(P)[1])


def _range_abs_h(coeffs, top2) -> DTYPE:
    """An upper bound on ``|h|`` over ``[0, top2]`` (exact range: end points and vertex)."""
    _, b, c = (float(v) for v in coeffs)
    H = _hull_h((np.array([DTYPE(0)]), np.array([DTYPE(top2)])), b, c)
    return np.max(iv_abs(H)[1])


def weyl_eps(coeffs, m: RoundingModel, *, nsq: Interval, AF: Interval, X2: Interval, hAF: Interval,
             pF: Interval) -> Interval:
    """The cross-talk model's Weyl bound on one stage (module docstring): ``||X' - p(X)||_2`` for an
    iterate with ``||X||_F^2`` in ``nsq``, ``||X X^T||_F`` in ``AF``, ``||X||_2`` in ``X2``,
    ``||h(X X^T)||_F`` in ``hAF`` and ``||p(X)||_F`` in ``pF`` (intervals; the formula is increasing in
    each, so its upper end bounds it over the box and its lower end is its value at a point).
    Every term, in the order the kernels round::

        e_A = delta_gram ||A||_F + (1 + delta_gram) gamma_gram ||X||_F^2          ||E_A||_2, ||E_A||_F
        d_H = max(|b|, |b + 2c ||A||_2|) e_A + |c| e_A^2                       ||h(A~) - h(A)||
        g_B = gamma_b (|c| ||A~||_F^2 + |b| ||A~||_F),  ||A~||_F <= ||A||_F + e_A
        e_B = delta_b (||h(A)||_F + d_H + g_B) + g_B                             ||B~ - h(A~)||
        e_Y = gamma_y (|a| + ||B~||_F) ||X||_F,         ||B~||_F <= ||h(A)||_F + d_H + e_B
        e_X = delta_x (||p(X)||_F + (d_H + e_B) ||X||_F + e_Y)                    the iterate's rounding
        eps = (d_H + e_B) ||X||_2 + e_Y + e_X
    """
    a, b, c = (float(v) for v in coeffs)
    dg, gg = _c(m.delta_gram), _c(m.gamma_gram)
    eA = iv_add(iv_mul_pos(dg, AF), iv_mul_pos(iv_add(_c(1.0), dg), iv_mul_pos(gg, nsq)))
    # ||(b/2 + cA) E + E (b/2 + cA)|| <= 2 max_{t in [0, ||A||]} |b/2 + c t| ||E|| = max(|b|, |b + 2c ||A|||) ||E||
    A2 = iv_sqr(X2)
    K = iv_max(_c(abs(b)), iv_abs(iv_add(_c(b), iv_mul(_c(2.0 * c), A2))))
    dH = iv_add(iv_mul_pos(K, eA), iv_mul_pos(_c(abs(c)), iv_sqr(eA)))
    hF = iv_add(hAF, dH)                                                         # ||h(A~)||_F
    AtF = iv_add(AF, eA)
    gB = iv_mul_pos(_c(m.gamma_b), iv_add(iv_mul_pos(_c(abs(c)), iv_sqr(AtF)), iv_mul_pos(_c(abs(b)), AtF)))
    eB = iv_add(iv_mul_pos(_c(m.delta_b), iv_add(hF, gB)), gB)
    dB = iv_add(dH, eB)                                                          # ||B~ - h(A)||
    BF = iv_add(hF, eB)                                                          # ||B~||_F
    nf = iv_sqrt(nsq)
    YF = iv_add(pF, iv_mul_pos(dB, nf))                                              # ||a X + B~ X||_F
    eY = iv_mul_pos(_c(m.gamma_y), iv_mul_pos(iv_add(_c(abs(a)), BF), nf))
    eX = iv_mul_pos(_c(m.delta_x), iv_add(YF, eY))
    return iv_add(iv_add(iv_mul_pos(dB, X2), eY), eX)


def _cross_eps(SA: Interval, PS: Interval, HS: Interval, coeffs, m: RoundingModel, Sg, pmax, hmax,
               nsq_cap=None) -> Interval:
    """:func:`weyl_eps` for a tracked singular value with ``|s|`` in ``SA``, ``|p(s)|`` in ``PS`` and
    ``|h(s^2)|`` in ``HS``, the other ``m - 1`` at most the frame's ``Sg`` (``|p|`` at most ``pmax``,
    ``|h|`` at most ``hmax``): ``||X||_F^2 <= s^2 + (m - 1) Sg^2`` (at most ``nsq_cap``, the first
    iterate's), ``||A||_F^2 <= s^4 + (m - 1) Sg^4``, ``||X||_2 <= max(|s|, Sg)``, ``||h(A)||_F^2 <=
    h(s^2)^2 + (m - 1) hmax^2``, ``||p(X)||_F^2 <= p(s)^2 + (m - 1) pmax^2``."""
    K1 = _c(m.singular_values - 1)
    S2 = iv_sqr(_c(Sg))
    s2 = iv_sqr(SA)
    nsq = iv_add(s2, iv_mul_pos(K1, S2))
    if nsq_cap is not None:
        nsq = iv_min(nsq, _c(nsq_cap))
    AF = iv_min(iv_sqrt(iv_add(iv_sqr(s2), iv_mul_pos(K1, iv_sqr(S2)))), nsq)
    X2 = iv_max(SA, _c(Sg)) if m.singular_values > 1 else SA
    hAF = iv_sqrt(iv_add(iv_sqr(HS), iv_mul_pos(K1, iv_sqr(_c(hmax)))))
    pF = iv_sqrt(iv_add(iv_sqr(PS), iv_mul_pos(K1, iv_sqr(_c(pmax)))))
    return weyl_eps(coeffs, m, nsq=nsq, AF=AF, X2=X2, hAF=hAF, pF=pF)


def _stage_cross(S: Interval, coeffs, m: RoundingModel, Sg, pmax, hmax, nsq_cap=None) -> Interval:
    """Cross-talk model: enclosure of the stage's output for tracked values in ``S`` (signed)."""
    P = _p(S, coeffs)
    SA = iv_abs(S)
    _, b, c = (float(v) for v in coeffs)
    HS = iv_abs(_hull_h(iv_sqr(S), b, c))
    E = _cross_eps((SA[1], SA[1]), (iv_abs(P)[1],) * 2, (HS[1], HS[1]), coeffs, m, Sg, pmax, hmax, nsq_cap)
    return iv_sub(P, (-E[1], E[1]))


def _first_delta(m: RoundingModel) -> Interval:
    """``delta_x + delta_z (1 + delta_x)``: the first iterate's two roundings (fp32, then bf16) per entry,
    relative to ``|Z|`` entrywise."""
    return iv_add(_c(m.delta_x), iv_mul(_c(m.delta_z), iv_add(_c(1.0), _c(m.delta_x))))


def _first_cross(cells: Interval, m: RoundingModel, norm_z) -> Interval:
    """The first iterate: ``s_0 in x +- (delta_x + delta_z (1 + delta_x)) ||Z||_F`` (``||Z||_F <= norm_z``)."""
    e0 = iv_mul(_first_delta(m), _c(norm_z))[1]
    return np.nextafter(cells[0] - e0, DTYPE(-np.inf)), np.nextafter(cells[1] + e0, DTYPE(np.inf))


#: Cells and pieces of the frame's propagation over [0, u].
FRAME_CELLS = 4096
FRAME_PIECES = 8


@functools.lru_cache(maxsize=64)
def _frame_cached(maps, x_hi_exact: Fraction, model: RoundingModel) -> Frame:
    x_hi = enclose_rational(x_hi_exact)[1]
    C = _cells(DTYPE(0), x_hi, FRAME_CELLS, geometric=True)
    norm_z = x_hi
    S = _first_cross(C, model, norm_z)
    n = S[0].size
    bounds, pmaxs, hmaxs = [], [], []
    blown = False
    for k, coeffs in enumerate(maps):
        Sg = np.maximum(np.max(np.abs(S[0])), np.max(np.abs(S[1])))
        bounds.append(Sg)
        if blown or Sg >= BIG:
            blown = True
            pmaxs.append(DTYPE(np.inf))
            hmaxs.append(DTYPE(np.inf))
            continue
        pm, hm = _range_abs_p(coeffs, Sg), _range_abs_h(coeffs, iv_sqr(_c(Sg))[1])
        pmaxs.append(pm)
        hmaxs.append(hm)
        cap = iv_sqr(iv_add(_c(norm_z), iv_mul(_first_delta(model), _c(norm_z))))[1] if k == 0 else None
        P = _split(S, FRAME_PIECES)
        Y = _stage_cross((P[0].ravel(), P[1].ravel()), coeffs, model, Sg, pm, hm, cap)
        Y, bl = iv_clamp(Y)
        blown |= bool(bl.any())
        S = (Y[0].reshape(n, FRAME_PIECES).min(1), Y[1].reshape(n, FRAME_PIECES).max(1))
    Sg = np.maximum(np.max(np.abs(S[0])), np.max(np.abs(S[1])))
    bounds.append(DTYPE(np.inf) if blown else Sg)
    return Frame(x_hi=f64_up(x_hi), norm_z=f64_up(norm_z), bound=tuple(bounds), pmax=tuple(pmaxs),
                 hmax=tuple(hmaxs), blown=blown or bool(Sg >= BIG))


def cross_frame(maps, u: RealLike, model: RoundingModel) -> Frame:
    """The frame of the cross-talk model for inputs normalized into ``[0, u]`` (the margin's end)."""
    maps_ = check_maps(maps)
    uf = parse_real(u, "u")
    x_hi = _input_interval(Fraction(0), uf, model.delta0)[1]
    return _frame_cached(tuple(tuple(float(v) for v in mp) for mp in maps_), Fraction(*x_hi.as_integer_ratio()),
                         model)


# ---------------------------------------------------------------------------------------------
# Propagation (both models).

def _split(S: Interval, pieces: int) -> Interval:
    """Cut every interval into ``pieces`` equal parts (rows: intervals, columns: parts); the end
    points are the original ones, so the parts cover the interval."""
    w = (S[1] - S[0])[:, None]
    f = (np.arange(pieces + 1, dtype=DTYPE) / DTYPE(pieces))[None, :]
    edges = S[0][:, None] + w * f
    edges[:, 0], edges[:, -1] = S[0], S[1]
    edges = np.maximum.accumulate(edges, axis=1)
    return edges[:, :-1], edges[:, 1:]


def propagate(maps, cells: Interval, m: RoundingModel, *, pieces: int = 8, frame: Frame | None = None):
    """Enclosures of the output for every input in each cell (DTYPE arrays), and the mask of cells
    that may blow up (some stage may leave ``[-1e50, 1e50]``; their enclosure is the whole line).
    The cross-talk model needs its ``frame`` (:func:`cross_frame`)."""
    n = cells[0].shape[0]
    blown = np.zeros(n, dtype=bool)
    if m.cross_talk:
        if frame is None:
            raise DeriveMapsError("propagate: the cross-talk model needs its frame (cross_frame(maps, u, model))")
        if frame.blown:
            return (np.full(n, DTYPE(-np.inf)), np.full(n, DTYPE(np.inf))), np.ones(n, dtype=bool)
        S = _first_cross(cells, m, frame.norm_z)
        cap = iv_sqr(iv_add(_c(frame.norm_z), iv_mul(_first_delta(m), _c(frame.norm_z))))[1]
    else:
        S = iv_mul(cells, _factor(m.delta_x))
    for k, coeffs in enumerate(maps):
        P = _split(S, pieces)
        flat = (P[0].ravel(), P[1].ravel())
        if m.cross_talk:
            Y = _stage_cross(flat, coeffs, m, frame.bound[k], frame.pmax[k], frame.hmax[k], cap if k == 0 else None)
        else:
            Y = _stage(flat, coeffs, m)
        Y, bl = iv_clamp(Y)
        lo, hi = Y[0].reshape(n, pieces).min(1), Y[1].reshape(n, pieces).max(1)
        blown |= bl.reshape(n, pieces).any(1)
        S = (lo, hi)
    lo = np.where(blown, DTYPE(-np.inf), S[0])
    hi = np.where(blown, DTYPE(np.inf), S[1])
    return (lo, hi), blown


_CORNER_NAMES = ("eA", "eB", "gB", "gY", "eX")


def _corners(m: RoundingModel) -> list[dict]:
    sizes = dict(eA=_gram_factor(m), eB=m.delta_b, gB=m.gamma_b, gY=m.gamma_y, eX=m.delta_x)
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
            for sgn in (1.0, -1.0):
                out.append(np.clip(np.full(s_lo.shape, sgn * x, dtype=DTYPE), s_lo, s_hi))
    return out


def _reached_cross(maps, x: np.ndarray, m: RoundingModel, frame: Frame) -> Interval:
    """Reached intervals of the cross-talk model: from an interval inside the reachable set, the
    next one holds ``p(s) +- eps(s)`` for every ``s`` in it (the formula's value: the lower end of its
    enclosure at a point), so it holds the hull of those values at the end points and the critical
    points of ``p``."""
    e0 = iv_mul(_c(m.delta_x), _c(frame.norm_z))[0]
    xs = np.asarray(x, dtype=DTYPE)
    s_lo, s_hi = np.nextafter(xs - e0, xs), np.nextafter(xs + e0, xs)   # inside [x - e0, x + e0]
    cap = iv_sqr(iv_add(_c(frame.norm_z), iv_mul(_c(m.delta_x), _c(frame.norm_z))))[0]
    for k, coeffs in enumerate(maps):
        a, b, c = (float(v) for v in coeffs)
        cands = [s_lo, s_hi] + _corner_critical(coeffs, {}, s_lo, s_hi)
        lo_c, hi_c = [], []
        for s in cands:
            S = iv_point(s)
            P = _p(S, coeffs)
            HS = iv_abs(_hull_h(iv_sqr(S), b, c))
            E = _cross_eps(iv_abs(S), iv_abs(P), HS, coeffs, m, frame.bound[k], frame.pmax[k], frame.hmax[k],
                           cap if k == 0 else None)
            # p(s) + eps(s) >= P_lo + E_lo is reached from above, p(s) - eps(s) <= P_hi - E_lo from below
            hi_c.append(np.nextafter(P[0] + E[0], DTYPE(-np.inf)))
            lo_c.append(np.nextafter(P[1] - E[0], DTYPE(np.inf)))
        s_lo, s_hi = np.min(np.stack(lo_c), 0), np.max(np.stack(hi_c), 0)
        s_lo, s_hi = np.minimum(s_lo, s_hi), np.maximum(s_lo, s_hi)
        s_lo, s_hi = np.clip(s_lo, -BIG, BIG), np.clip(s_hi, -BIG, BIG)
    return s_lo, s_hi


def reached(maps, x: np.ndarray, m: RoundingModel, frame: Frame | None = None) -> Interval:
    """For each input ``x`` (exact float64 values), an interval ``[lo, hi]`` of outputs that some
    admissible perturbation sequence certainly reaches: lower bounds on the max and upper bounds on
    the min of the model's output. Stage by stage the reachable set (an interval: the continuous
    image of a box) is grown from its two ends by every corner of every perturbation (scalar model)
    or by the band ``p(s) +- eps(s)`` (cross-talk model, which needs its ``frame``)."""
    x = np.asarray(x, dtype=np.float64)
    if m.cross_talk:
        if frame is None:
            raise DeriveMapsError("reached: the cross-talk model needs its frame (cross_frame(maps, u, model))")
        return _reached_cross(maps, x, m, frame)
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
    """Certified bounds on the model's output for inputs in ``[l, u]`` (before the trace's and eps'
    widening, which is applied inside) and every admissible perturbation.

    ``f_min_certified <= min <= f_min_reached`` and ``f_max_reached <= max <= f_max_certified``;
    ``max_abs_log_certified`` bounds ``max |log|`` of the output on ``[l, u]`` (inf if ``l = 0``, or if
    the output may reach 0 or below, or blow up). ``argmax`` / ``argmin``: inputs at which
    ``f_max_reached`` / ``f_min_reached`` are reached (attained points, not located extrema).
    ``converged``: every cell met its tolerance (False: the work budget ran out first; the bounds
    are still certified, only looser). ``covers``: the inputs the model holds for.
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
    argmin: float
    max_abs_log_certified: float
    max_abs_log_reached: float
    blown_up: bool
    cells: int
    pieces: int
    converged: bool
    covers: str
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


def _input_interval(l: Fraction, u: Fraction, delta0: float, delta_eps: float = 0.0):
    """``[l / ((1 + delta_eps) sqrt(1 + delta0)), u / sqrt(1 - delta0)]`` enclosed outward in DTYPE:
    a trace that is off by a factor ``1 + e`` divides every singular value by ``sqrt(1 + e)``, and
    the normalization's eps divides them by up to ``1 + delta_eps``."""
    lo = enclose_rational(l)[0]
    hi = enclose_rational(u)[1]
    if delta0 > 0 or delta_eps > 0:
        d0 = Fraction(delta0)
        # 1/sqrt(1 + d0) >= 1 - d0/2 and 1/sqrt(1 - d0) <= 1 + d0/2 / (1 - d0)^(3/2) <= 1 + d0 (d0 <= 1/4)
        if d0 > Fraction(1, 4):
            raise DeriveMapsError(f"delta0 = {delta0}: expected at most 1/4")
        lo = enclose_rational(Fraction(*lo.as_integer_ratio()) * (1 - d0 / 2) / (1 + Fraction(delta_eps)))[0]
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
        e = geometric_edges(lf, hf, n).astype(DTYPE)
    else:
        e = np.concatenate([[0.0], geometric_edges(hf * ZERO_CELL, hf, n - 1)]).astype(DTYPE)
    e[0], e[-1] = lo, hi
    e = np.maximum.accumulate(e)
    return e[:-1].copy(), e[1:].copy()


#: Cells the branch and bound may hold at once before it stops refining (their bounds still count).
MAX_CELLS = 200_000
#: Cell evaluations (cells times levels) a certificate may spend before it stops refining.
MAX_WORK = 2_000_000


def _reached_at(maps_, C: Interval, idx: np.ndarray, model: RoundingModel, x_lo, x_hi, frame):
    """Reached intervals at the ends and midpoints of the cells ``idx``: (points, lo, hi)."""
    pts = np.unique(np.concatenate([C[0][idx], C[1][idx], (C[0][idx] + (C[1][idx] - C[0][idx]) / 2)])
                    .astype(np.float64))
    pts = pts[(pts >= float(x_lo)) & (pts <= float(x_hi))]
    if not pts.size:
        pts = np.array([float(x_hi)])
    r_lo, r_hi = reached(maps_, pts, model, frame)
    return pts, r_lo, r_hi


def robust_envelope(maps, l: RealLike, u: RealLike, model: RoundingModel, *, cells: int = 256,
                    pieces: int = 64, rtol: float = 0.02, max_levels: int = 40, max_work: int = MAX_WORK,
                    margin_u: RealLike | None = None, decide: tuple | None = None,
                    progress: bool | None = None) -> RobustEnvelope:
    """The robust envelope of ``maps`` on ``[l, u]`` under ``model`` (``l = 0`` allowed: then the max
    is what matters, the headroom; the certified ``max |log|`` is inf). ``margin_u``: the end of the
    normalization's interval, where the cross-talk model's frame is taken (default ``u``).

    Branch and bound: a cell is bisected (geometrically) until its enclosure cannot move a bound by
    more than ``rtol`` of ``|log|`` of the value reached (or ``max_levels`` / MAX_CELLS / ``max_work``
    is hit; the open cells' enclosures then count as they are, and ``converged`` is False). The low
    side is decided once the model reaches 0 or below (``max |log|`` is inf then, whatever a finer
    cut finds). Reached values come from :func:`reached` at the ends and midpoints of the cells that
    decide the bounds. ``decide = (lo, hi)``: stop as soon as the model reaches a value below ``lo``
    or above ``hi`` (a verdict's limits: refused whatever a finer cut finds; ``converged`` is then
    False, and the certified bounds, still rigorous, are those of the cells of that level)."""
    maps_ = check_maps(maps)
    lf, uf = parse_real(l, "l"), parse_real(u, "u")
    if lf < 0 or uf <= lf:
        raise DeriveMapsError(f"interval [{float(lf):g}, {float(uf):g}]: expected 0 <= l < u")
    if not isinstance(model, RoundingModel):
        raise DeriveMapsError(f"model: expected a RoundingModel, got {type(model).__name__}")
    for name, v in (("cells", cells), ("pieces", pieces), ("max_levels", max_levels), ("max_work", max_work)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DeriveMapsError(f"{name} = {v!r}: expected a positive integer")
    check_positive(rtol, "rtol")
    mu = uf if margin_u is None else parse_real(margin_u, "margin_u")
    if mu < uf:
        raise DeriveMapsError(f"margin_u = {float(mu):g} is below u = {float(uf):g}: the normalization's "
                              "interval holds every input")
    frame = cross_frame(maps_, mu, model) if model.cross_talk else None
    x_lo, x_hi = _input_interval(lf, uf, model.delta0, model.delta_eps)
    C = _cells(x_lo, x_hi, cells, geometric=True)
    amax, amin = DTYPE(-np.inf), DTYPE(np.inf)
    argmax = argmin = float(x_hi)
    cmax, cmin = DTYPE(-np.inf), DTYPE(np.inf)
    is_blown = bool(frame is not None and frame.blown)
    converged = True
    ncells = 0
    total = float(x_hi - x_lo) or 1.0
    label = f"robust envelope on [{float(lf):.4g}, {float(uf):.6g}]"
    with Progress(1.0, label, enabled=progress) as bar:
        for level in range(max_levels):
            if is_blown:
                cmax, cmin = DTYPE(np.inf), DTYPE(-np.inf)
                break
            ncells += C[0].size
            Y, blown = propagate(maps_, C, model, pieces=pieces, frame=frame)
            k = min(16, Y[1].size)
            idx = np.unique(np.concatenate([np.argsort(Y[1])[-k:], np.argsort(Y[0])[:k]]))
            pts, r_lo, r_hi = _reached_at(maps_, C, idx, model, x_lo, x_hi, frame)
            i = int(np.argmax(r_hi))
            if r_hi[i] > amax:
                amax, argmax = r_hi[i], float(pts[i])
            j = int(np.argmin(r_lo))
            if r_lo[j] < amin:
                amin, argmin = r_lo[j], float(pts[j])
            if amax >= BIG or amin <= -BIG:   # a perturbation sequence that certainly leaves [-1e50, 1e50]
                is_blown = True
                cmax, cmin = DTYPE(np.inf), DTYPE(-np.inf)
                break
            if decide is not None and ((decide[0] is not None and amin < decide[0])
                                       or (decide[1] is not None and amax > decide[1])):
                converged = False
                cmax = max(cmax, Y[1].max())
                cmin = min(cmin, Y[0].min())
                is_blown |= bool(blown.any())
                break
            tol_hi = DTYPE(rtol * max(abs(math.log(float(amax))), 1e-6) * float(amax)) if float(amax) > 0 else DTYPE(0)
            tol_lo = DTYPE(rtol * max(abs(math.log(float(amin))), 1e-6) * float(amin)) if float(amin) > 0 else DTYPE(0)
            # A cell is done when its bound is within the tolerance of the value reached, or of its own
            # midpoint's enclosure: one input's reachable set is already ~delta wide, splitting the
            # cell cannot bring its bound below that of its points.
            mid = C[0] + (C[1] - C[0]) / 2
            Ym, _ = propagate(maps_, (mid, mid.copy()), model, pieces=pieces, frame=frame)
            ref_hi, ref_lo = np.maximum(amax, Ym[1]), np.minimum(amin, Ym[0])
            # on [0, u] the low side counts as |output|: a cell is done there once its min is above minus
            # the max side's reference (it cannot raise max |output| past the max)
            low_done = (Y[0] >= -(ref_hi + tol_hi)) if lf == 0 else ((amin <= 0) | (Y[0] >= ref_lo - tol_lo))
            done = ~blown & (Y[1] <= ref_hi + tol_hi) & low_done
            open_ = int((~done).sum())
            out_of_budget = ncells + 2 * open_ > max_work
            last = level == max_levels - 1 or 2 * open_ > MAX_CELLS or out_of_budget
            if last and open_:
                converged = False
            leave = done | np.full(done.shape, last)
            if leave.any():
                cmax = max(cmax, Y[1][leave].max())
                cmin = min(cmin, Y[0][leave].min())
                is_blown |= bool(blown[leave].any())
            bar.update(max(bar.done, 1.0 - float((C[1][~done] - C[0][~done]).sum()) / total),
                       detail=f"level {level + 1}, {open_} cells open")
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
                          f_max_reached=f64_down(amax), f_max_certified=f64_up(cmax), argmax=argmax, argmin=argmin,
                          max_abs_log_certified=mal_c, max_abs_log_reached=max(mal_r, 0.0),
                          blown_up=is_blown, cells=int(ncells), pieces=pieces, converged=converged,
                          covers=model.covers(), model=model.as_dict())


def resolution_floor(model: RoundingModel, u: RealLike) -> float:
    """The cross-talk model's resolution at the first iterate for inputs normalized into ``[0, u]``:
    its rounding moves every singular value by up to ``delta_x ||Z||_F`` (``||Z||_F <= u``, widened by
    the trace), so an input singular value at or below it may become 0 (0 for the scalar model)."""
    if not model.cross_talk:
        return 0.0
    x_hi = _input_interval(Fraction(0), parse_real(u, "u"), model.delta0)[1]
    return f64_down(iv_mul(_first_delta(model), _c(x_hi))[0])


@dataclass(frozen=True)
class RobustVerdict:
    """Whether a set survives the model (:func:`robust_verdict`): no blow-up on ``[0, u]``,
    ``|output| <= hi_limit`` there and, with an ``l``, ``min >= lo_limit`` on ``[l, u]`` (a two-sided
    envelope). ``headroom`` is None when the set is refused before any propagation (an ``l`` below the
    model's :func:`resolution_floor`, or an exact composite that may reach 0 on ``[l, u]``).
    ``exact_error``: the allowance, the set's certified exact ``max |log F|`` on ``[l, u]``."""
    headroom: RobustEnvelope | None  #: on [0, u]
    envelope: RobustEnvelope | None  #: on [l, u] (None if not asked)
    eps: float
    hi_limit: float
    lo_limit: float | None
    passed: bool
    reason: str
    exact_error: float = 0.0
    covers: str = ""

    def as_dict(self) -> dict:
        return dict(headroom=None if self.headroom is None else self.headroom.as_dict(),
                    envelope=None if self.envelope is None else self.envelope.as_dict(),
                    eps=self.eps, hi_limit=self.hi_limit, lo_limit=self.lo_limit, passed=self.passed,
                    reason=self.reason, exact_error=self.exact_error, covers=self.covers)


def exact_allowance(maps, l: RealLike | None, u: RealLike, exact=None) -> float:
    """The verdict's allowance: the set's certified exact ``max |log F|`` on ``[l, u]``
    (:func:`derive_maps.certify.certify_envelope`; 0 without an ``l``). ``exact``: that certificate,
    already computed (an :class:`~derive_maps.certify.Envelope` of the same interval)."""
    if l is None:
        return 0.0
    lf, uf = parse_real(l, "l"), parse_real(u, "u")
    if exact is None:
        from .certify import certify_envelope
        exact = certify_envelope(maps, lf, uf)
    elif (exact.l, exact.u) != (float(lf), float(uf)):
        raise DeriveMapsError(f"exact: a certificate on [{exact.l:g}, {exact.u:g}], expected one on "
                              f"[{float(lf):g}, {float(uf):g}]")
    return exact.max_abs_log_certified


def robust_verdict(maps, model: RoundingModel, *, l: RealLike | None, u: RealLike, eps: float | None = None,
                   exact=None, **kw) -> RobustVerdict:
    """The one verdict rule of the robust certificates (``python -m derive_maps robust`` and the
    frontier both take it from here). With ``e`` the set's certified exact ``max |log F|`` on ``[l, u]``
    (:func:`exact_allowance`: a coarse set cannot beat its own exact error; 0 without ``l``) and
    ``eps`` (default DEFAULT_EPS), ``maps`` passes under ``model`` when

    * its exact composite stays away from 0 on ``[l, u]`` (``e`` finite),
    * no stage may blow up and ``|output| <= hi_limit = exp(e) (1 + eps)`` on ``[0, u]`` (both signs: an
      output flipped past ``-hi_limit`` is refused like one above ``hi_limit``),
    * with ``l``: ``output >= lo_limit = exp(-e) / (1 + eps)`` on ``[l, u]``.

    ``exact``: the exact certificate on ``[l, u]`` if already computed."""
    eps = DEFAULT_EPS if eps is None else check_positive(eps, "eps")
    e = exact_allowance(maps, l, u, exact)
    covers = model.covers()
    if not math.isfinite(e):
        return RobustVerdict(None, None, eps, math.inf, 0.0, False,
                             "the exact composite may reach 0 on [l, u]", e, covers)
    hi_limit = math.exp(e) * (1 + eps)
    lo_limit = math.exp(-e) / (1 + eps) if l is not None else None
    if l is not None:
        floor = resolution_floor(model, u)
        x_lo = _input_interval(parse_real(l, "l"), parse_real(u, "u"), model.delta0, model.delta_eps)[0]
        if x_lo <= DTYPE(floor):
            return RobustVerdict(None, None, eps, hi_limit, lo_limit, False,
                                 f"reaches 0 on [l, u]: the first iterate's rounding moves every singular value by "
                                 f"up to {floor:.3g} >= l (the resolution of a bf16 iterate with "
                                 f"{model.singular_values} singular values)", e, covers)
    e_env = robust_envelope(maps, l, u, model, margin_u=u, decide=(lo_limit, hi_limit), **kw) if l is not None else None
    h = robust_envelope(maps, 0, u, model, decide=(-hi_limit, hi_limit), **kw)

    def verdict(passed, reason):
        return RobustVerdict(h, e_env, eps, hi_limit, lo_limit, passed, reason, e, covers)
    if h.blown_up:
        how = "blows up" if h.f_max_reached >= 1e49 or h.f_min_reached <= -1e49 else "may blow up"
        return verdict(False, f"{how}: some stage may leave [-1e50, 1e50]")
    mag_c = max(h.f_max_certified, -h.f_min_certified)
    if mag_c > hi_limit:
        mag_r = max(h.f_max_reached, -h.f_min_reached)
        how = "reaches" if mag_r > hi_limit else "may reach"
        return verdict(False, f"|output| {how} {mag_r if how == 'reaches' else mag_c:.6g} > {hi_limit:.6g} on [0, u]")
    if e_env is not None and e_env.f_min_certified < lo_limit:
        how = "reaches" if e_env.f_min_reached < lo_limit else "may reach"
        return verdict(False, f"{how} {e_env.f_min_reached if how == 'reaches' else e_env.f_min_certified:.6g} "
                              f"< {lo_limit:.6g} on [l, u]")
    low = "" if e_env is None else f", min >= {e_env.f_min_certified:.6g} >= {lo_limit:.6g} on [l, u]"
    return verdict(True, f"|output| <= {mag_c:.6g} <= {hi_limit:.6g} on [0, u]{low}")


@dataclass(frozen=True)
class Membership:
    """Whether an input lies inside a certificate's class (:func:`class_membership`): ``inside``, and
    ``reason`` (the first assumption a matrix breaks, or what was checked)."""
    inside: bool
    reason: str

    def __bool__(self) -> bool:
        return self.inside


def _as_float64(x) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):           # a torch tensor (torch is not imported here)
        x = x.detach().cpu()
        if not x.dtype.is_floating_point and not x.dtype.is_complex:
            x = x.double()
        x = x.double().numpy()
    a = np.asarray(x)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise DeriveMapsError(f"class_membership: expected a real matrix (numpy array or torch tensor), got "
                              f"dtype {a.dtype}")
    return a.astype(np.float64)


def class_membership(x, model: RoundingModel) -> Membership:
    """Whether the matrix ``x`` (numpy array or torch tensor, ``[..., rows, cols]``: a bank is checked
    matrix by matrix) lies inside the class of ``model``'s certificates (:meth:`RoundingModel.covers`):
    its Frobenius norm at least ``min_norm``, at most ``max_entries`` entries, and its shape: at most one
    nonzero per row and column (diagonal inputs), or nonzero entries inside a block with at most
    ``singular_values`` rows or columns and a long side of at most ``max_long_side`` (general inputs).
    A certificate's bounds are proven for the class only: check a gradient before relying on one."""
    if not isinstance(model, RoundingModel):
        raise DeriveMapsError(f"model: expected a RoundingModel, got {type(model).__name__}")
    a = _as_float64(x)
    if a.ndim < 2:
        raise DeriveMapsError(f"class_membership: expected a matrix [..., rows, cols], got shape {a.shape}")
    if a.size == 0:
        raise DeriveMapsError(f"class_membership: the matrix is empty (shape {a.shape})")
    rows, cols = a.shape[-2:]
    mats = a.reshape(-1, rows, cols)
    many = mats.shape[0] > 1
    if model.max_entries and rows * cols > model.max_entries:
        return Membership(False, f"{rows} x {cols} = {rows * cols} entries > {model.max_entries}, the class's size "
                                 "limit (the trace's summation depth)")
    for k, m in enumerate(mats):
        at = f"matrix {k}: " if many else ""
        if not np.isfinite(m).all():
            return Membership(False, f"{at}non-finite entries")
        norm = float(np.linalg.norm(m))
        if norm < model.min_norm:
            return Membership(False, f"{at}||X||_F = {norm:.3g} < {model.min_norm:g}, the class's norm floor (the "
                                     "normalization's eps shrinks its singular values beyond the model)")
        nz = m != 0
        per_row, per_col = nz.sum(1), nz.sum(0)
        if not model.cross_talk:
            if per_row.max() > 1 or per_col.max() > 1:
                r = int(np.argmax(per_row)) if per_row.max() > 1 else int(np.argmax(per_col))
                what = "row" if per_row.max() > 1 else "column"
                return Membership(False, f"{at}{what} {r} holds {max(per_row.max(), per_col.max())} nonzeros: not a "
                                         "diagonal input (at most one nonzero per row and column)")
            continue
        nr, nc = int((per_row > 0).sum()), int((per_col > 0).sum())
        short, long_ = min(nr, nc), max(nr, nc)
        if short > model.singular_values:
            return Membership(False, f"{at}the nonzero entries span {nr} rows and {nc} columns: more than "
                                     f"{model.singular_values} on the short side")
        if model.max_long_side and long_ > model.max_long_side:
            return Membership(False, f"{at}the nonzero block's long side is {long_} > {model.max_long_side} (the "
                                     "fp32 sums' length the model assumes)")
    return Membership(True, f"inside: {model.covers()}")


def model_for(config: str | None, *, delta: float | None = None, delta0: float | None = None,
              rows: int = DEFAULT_BLOCK, cols: int = DEFAULT_BLOCK, inputs: str = "general",
              min_norm: float = MIN_NORM) -> RoundingModel:
    """The CLI's model: ``config``'s derived one for ``inputs`` on ``rows x cols`` blocks, with
    ``delta`` (every rounding point) and ``delta0`` overriding it where given."""
    m = rounding_model(config or "safe", rows=rows, cols=cols, inputs=inputs, min_norm=min_norm)
    if delta is not None:
        check_positive(delta, "delta", allow_zero=True)
        m = replace(m, delta_x=delta, delta_gram=delta, delta_b=delta, gamma_b=0.0, gamma_y=0.0, gamma_gram=0.0)
    if delta0 is not None:
        check_positive(delta0, "delta0", allow_zero=True)
        m = replace(m, delta0=delta0)
    return m
