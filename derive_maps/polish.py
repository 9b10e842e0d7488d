"""Joint minimax polish of all maps' coefficients.

Minimizes ``E(theta) = max_{x in [l, u]} |g(x; theta)|`` over all 3K coefficients, where ``g`` is
the composite's log error ``log F`` (objective ``"log"``) or its absolute error ``F - 1``
(``"abs"``). The method is sequential linear programming on an exchange set, with a trust region
(Madsen's minimax method):

1. the exchange set is built from the composite's extrema: both endpoints and every zero of ``F'``,
   isolated rigorously by :func:`derive_maps.certify.critical_points` (no grid, so no narrow
   excursion is left out), plus ``sub`` evenly spaced points inside each monotone piece between
   consecutive extrema (they let the linear model see shoulders that a step can turn into new
   extrema; without them the iteration stalls at a tiny trust radius);
2. ``g`` and ``dg/dtheta`` are evaluated there in ``numpy.longdouble``, vectorized (at an extremum
   ``x*(theta)`` the first-order change of ``g(x*(theta); theta)`` is the partial derivative in theta
   alone, since ``g' = 0`` there);
3. the linear model ``min t  s.t.  |g_j + J_j delta| <= t,  |delta_i| <= radius * s_i`` (``s_i`` the
   coefficient's magnitude; everything in units of the current error, since HiGHS' feasibility
   tolerances are absolute) is solved with scipy's HiGHS, with a small L1 penalty on ``delta`` that
   pins the K-1 scale gauges (scaling one map's output up and the next map's input down leaves F
   unchanged);
4. the step is accepted when the true objective -- recomputed in mpmath at ``dps`` digits on the
   rigorously isolated extrema of the new coefficients -- drops by at least 1% of the predicted
   drop; the radius doubles after good agreement (rho > 0.75), halves after poor agreement
   (rho < 0.25) and is quartered after a rejection.

It stops when the predicted drop is below ``rtol * E`` (converged), the radius below
``min_radius`` (converged: no productive step at any scale), the error at or below ``target``
(if given), or after ``max_iter`` iterations
(``converged`` False; with ``strict=True`` a :class:`~derive_maps.errors.ConvergenceError`).

The iteration is deterministic (no randomness; HiGHS is deterministic for a given problem), and
the polished coefficients are float64 numbers: every candidate is rounded to float64 before it is
evaluated, so the reported error is that of the map set as stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mpmath
import numpy as np
from scipy.optimize import linprog

from . import mpcomposite as mc
from .certify import critical_points, enclose_rational
from .errors import (ConvergenceError, DeriveMapsError, RealLike, check_dps, check_interval, check_maps,
                     check_positive)
from .intervals import DTYPE
from .progress import Progress

OBJECTIVES = ("log", "abs")

#: HiGHS' default primal and dual feasibility tolerance. It is absolute, and the step's LP is posed in
#: units of the current error, so each step is solved to within this fraction of the error: what may
#: differ between scipy (HiGHS) releases.
LP_TOLERANCE = 1e-7
#: The default convergence rule: stop when the LP predicts a drop below this fraction of the error.
DEFAULT_RTOL = 1e-7


@dataclass
class PolishResult:
    """``error``: max |g| over the extrema of the returned float64 maps (mpmath); ``history``: one
    dict per iteration (error, predicted, actual, radius, rho, number of exchange points)."""
    maps: tuple
    objective: str
    l: float
    u: float
    error: float
    start_error: float
    iterations: int
    converged: bool
    n_extrema: int
    history: list = field(default_factory=list)


def jets(theta: np.ndarray, x: np.ndarray):
    """``F(x)`` and ``dF/dtheta`` (rows) at points x, vectorized in the dtype of x."""
    th = theta.reshape(-1, 3)
    s = x.copy()
    st = []
    with np.errstate(all="ignore"):
        for a, b, c in th:
            st.append(s)
            t = s * s
            s = s * (a + t * (b + c * t))
        G = np.empty((x.size, theta.size), dtype=x.dtype)
        tail = np.ones_like(x)
        for k in range(len(th) - 1, -1, -1):
            a, b, c = th[k]
            sk = st[k]
            t = sk * sk
            G[:, 3 * k] = tail * sk
            G[:, 3 * k + 1] = tail * sk * t
            G[:, 3 * k + 2] = tail * sk * t * t
            tail = tail * (a + t * (3 * b + 5 * c * t))
    return s, G


def _round_theta(theta: np.ndarray) -> np.ndarray:
    """Round to float64 values (held in the working dtype)."""
    return theta.astype(np.float64).astype(DTYPE)


def _maps_of(theta: np.ndarray):
    v = theta.astype(np.float64)
    return tuple(tuple(float(x) for x in v[i:i + 3]) for i in range(0, v.size, 3))


class _Problem:
    def __init__(self, lf, uf, objective, dps, sub):
        self.lf, self.uf = lf, uf
        self.objective = objective
        self.dps = dps
        self.sub = sub
        self.l_x = enclose_rational(lf)[1]          # inner float endpoints of [l, u]
        self.u_x = enclose_rational(uf)[0]

    def g_mp(self, F):
        if self.objective == "log":
            return mpmath.log(F) if F > 0 else mpmath.inf
        return F - 1

    def extrema(self, theta):
        xs = critical_points(_maps_of(theta), self.lf, self.uf)
        return np.concatenate([[self.l_x], xs, [self.u_x]])

    def error(self, theta, pts):
        """max |g| over the points, in mpmath at dps digits."""
        th = mc.to_theta(_maps_of(theta))
        with mpmath.workdps(self.dps):
            worst = mpmath.mpf(0)
            for x in pts:
                n, d = DTYPE(x).as_integer_ratio()
                v = abs(self.g_mp(mc.value(th, mpmath.mpf(n) / d)))
                if v > worst:
                    worst = v
        return float(worst)

    def exchange(self, pts):
        if self.sub <= 0:
            return pts
        fr = (np.arange(1, self.sub + 1, dtype=DTYPE) / DTYPE(self.sub + 1))
        mids = (pts[:-1, None] + (pts[1:] - pts[:-1])[:, None] * fr[None, :]).ravel()
        return np.concatenate([pts, mids])

    def linear_model(self, theta, X):
        F, G = jets(theta, X)
        with np.errstate(all="ignore"):
            if self.objective == "log":
                g = np.log(F)
                J = G / F[:, None]
            else:
                g = F - 1
                J = G
        g = g.astype(np.float64)
        J = J.astype(np.float64)
        ok = np.isfinite(g) & np.all(np.isfinite(J), axis=1)
        return g[ok], J[ok]


def polish(maps, l: RealLike, u: RealLike, *, objective: str = "log", dps: int = 40,
           max_iter: int = 300, rtol: float = DEFAULT_RTOL, radius: float = 1e-3, min_radius: float = 1e-12,
           sub: int = 8, target: float | None = None, strict: bool = False,
           progress: bool | None = None, label: str = "polish") -> PolishResult:
    """Polish ``maps`` for the minimax of ``g`` on ``[l, u]`` (see the module docstring).

    ``radius``: initial trust radius, relative to each coefficient's magnitude; ``target``: stop as
    soon as the error is at most this (reported as converged).
    """
    start = check_maps(maps)
    lf, uf = check_interval(l, u)
    dps = check_dps(dps)
    if objective not in OBJECTIVES:
        raise DeriveMapsError(f"objective = {objective!r}: expected one of {OBJECTIVES}")
    check_positive(rtol, "rtol")
    check_positive(radius, "radius")
    if isinstance(sub, bool) or not isinstance(sub, int) or sub < 0:
        raise DeriveMapsError(f"sub = {sub!r}: expected a number of points >= 0")
    P = _Problem(lf, uf, objective, dps, sub)
    theta = np.array([v for t in start for v in t], dtype=DTYPE)
    n = theta.size
    pts = P.extrema(theta)
    e_cur = P.error(theta, pts)
    if not np.isfinite(e_cur):
        raise DeriveMapsError("polish: the starting composite is <= 0 somewhere in [l, u], so log F is "
                              "undefined there; start from a better map set or use objective='abs'")
    e0 = e_cur
    scale = np.maximum(np.abs(theta.astype(np.float64)), 1e-2)
    history = []
    converged = False
    it = 0
    with Progress(max_iter, label, enabled=progress) as bar:
        for it in range(1, max_iter + 1):
            if target is not None and e_cur <= target:
                converged = True
                it -= 1
                break
            X = P.exchange(pts)
            g, J = P.linear_model(theta, X)
            m = g.size
            # Work in units of the current error: HiGHS' tolerances (~1e-7) are absolute.
            g = g / e_cur
            S = J * (scale * radius / e_cur)
            ones = np.ones((m, 1))
            Z = np.zeros((m, n))
            eye = np.eye(n)
            A = np.vstack([np.hstack([S, -ones, Z]), np.hstack([-S, -ones, Z]),
                           np.hstack([eye, np.zeros((n, 1)), -eye]),
                           np.hstack([-eye, np.zeros((n, 1)), -eye])])
            b = np.concatenate([-g, g, np.zeros(2 * n)])
            c = np.concatenate([np.zeros(n), [1.0], np.full(n, 1e-4 / n)])
            bounds = [(-1, 1)] * n + [(0, None)] + [(0, 1)] * n
            lp = linprog(c, A_ub=A, b_ub=b, bounds=bounds, method="highs")
            if lp.status != 0:
                raise ConvergenceError(f"polish: the linear subproblem failed at iteration {it} "
                                       f"({lp.message}); try a smaller radius")
            t = float(lp.x[n]) * e_cur
            predicted = e_cur - t
            if predicted <= rtol * e_cur:
                converged = True
                break
            cand = _round_theta(theta + (lp.x[:n] * scale * radius).astype(DTYPE))
            try:
                cand_pts = P.extrema(cand)
                e_new = P.error(cand, cand_pts)
            except ConvergenceError:      # a degenerate candidate: treat as a failed step
                e_new = float("inf")
            rho = (e_cur - e_new) / predicted
            history.append(dict(iteration=it, error=e_cur, predicted=t, actual=e_new, radius=radius,
                                rho=rho, points=m))
            if rho > 0.01:
                theta, e_cur, pts = cand, e_new, cand_pts
                if rho > 0.75:
                    radius = min(radius * 2, 0.1)
                elif rho < 0.25:
                    radius /= 2
            else:
                radius /= 4
            bar.update(it, detail=f"E = {e_cur:.4g}")
            if radius < min_radius:
                converged = True
                break
        else:
            if strict:
                raise ConvergenceError(f"polish: not converged after {max_iter} iterations "
                                       f"(E = {e_cur:.4g}, trust radius {radius:.3g}); raise max_iter")
    return PolishResult(maps=_maps_of(theta), objective=objective, l=float(lf), u=float(uf),
                        error=e_cur, start_error=e0, iterations=it, converged=converged,
                        n_extrema=int(pts.size), history=history)
