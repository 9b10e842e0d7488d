"""Remez exchange for the best odd polynomial approximation of the constant 1 on ``[l, u]``.

Among odd polynomials ``p(x) = c_0 x + c_1 x^3 + ... + c_{n-1} x^{2n-1}`` (degree ``d = 2n - 1``),
find the one minimizing ``E = max_{x in [l, u]} |1 - p(x)|`` for ``0 < l < u``: the building block
of the Polar Express (the sign function is 1 on the positive singular values). The odd monomials
form a Haar system on ``[l, u]`` when ``l > 0``, so the optimum is unique and characterized by
equioscillation: ``1 - p`` takes the values ``+E, -E, ...`` alternately at ``n + 1`` points.

Exchange iteration (all in mpmath at the working precision):

1. on the reference ``x_0 < ... < x_n`` solve the linear system
   ``sum_j c_j x_i^(2j+1) + (-1)^i h = 1`` for the coefficients and the levelled error ``h``;
2. find all local extrema of ``e(x) = 1 - p(x)`` on ``[l, u]``: the two endpoints and the roots of
   ``p'(x) = sum_j (2j+1) c_j x^(2j)``, a polynomial of degree n-1 in ``y = x^2`` (mpmath.polyroots);
3. take as new reference ``n + 1`` alternating extrema containing the largest ``|e|`` (the standard
   one-for-all exchange);
4. stop when ``max |e| - |h| <= tol * |h| + 10**-(dps - 8)`` (the de la Vallée Poussin gap: the
   optimal error lies between ``|h|`` and ``max |e|``; the absolute term is the precision floor).

For the quintic (n = 3) the extrema are the endpoints and the two roots ``q < r`` of
``5c y^2 + 3b y + a``, which is Algorithm 3 of the Polar Express paper.

Narrow intervals: as ``w = (u - l) / u -> 0`` the optimum tends to ``P_n(x / m)`` with ``m = (l + u) / 2``,
where ``P_n`` is the odd polynomial with ``P_n(1) = 1`` and ``P_n^(k)(1) = 0`` for ``k = 1..n-1``
(for the quintic ``(15 y - 10 y^3 + 3 y^5) / 8``, the Newton-Schulz quintic); coefficients agree to
``O(w^2)`` relative and ``E = O(w^n)``. When ``w^n`` is below ``10**-(dps - 10)`` the exchange cannot
resolve ``E`` any more, and :func:`remez_odd` returns this limit instead (``iterations == 0``).

The log error is not a separate problem: a polynomial's ``max |log p|`` on ``[l, u]`` depends only on
the ratio ``max p / min p`` once it is scaled so ``min p * max p = 1``, and the ratio is
``(1 + E) / (1 - E)`` for the abs-optimal ``p``, which is smallest exactly when E is; so the
log-optimal polynomial is the abs-optimal one times ``1 / sqrt(1 - E^2)`` (:func:`recentre`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mpmath

from .errors import ConvergenceError, DeriveMapsError, RealLike, check_dps, check_interval

DEFAULT_DPS = 40


@dataclass(frozen=True)
class RemezResult:
    """``coeffs``: mpf coefficients of x, x^3, ..., x^d; ``error``: the minimax error E;
    ``reference``: the n + 1 equioscillation points; ``iterations``: exchanges done."""
    coeffs: tuple
    error: object
    reference: tuple
    iterations: int

    def __iter__(self):  # (a, b, c) unpacking for quintics
        return iter(self.coeffs)


def _mp(q):
    return mpmath.mpf(q.numerator) / q.denominator


def odd_poly(coeffs, x):
    """``sum_j coeffs[j] x^(2j+1)`` (Horner in x^2)."""
    t = x * x
    acc = mpmath.mpf(0)
    for c in reversed(coeffs):
        acc = acc * t + c
    return x * acc


def _extrema(coeffs, l, u):
    """Endpoints and interior critical points of the odd polynomial on [l, u], sorted."""
    n = len(coeffs)
    pts = [l, u]
    if n >= 2:
        # p'(x) = sum (2j+1) c_j y^j with y = x^2; polyroots wants highest degree first
        dcoef = [(2 * j + 1) * coeffs[j] for j in range(n)][::-1]
        while len(dcoef) > 1 and dcoef[0] == 0:
            dcoef = dcoef[1:]
        if len(dcoef) > 1:
            try:
                roots = mpmath.polyroots(dcoef, maxsteps=200, extraprec=2 * mpmath.mp.dps)
            except mpmath.libmp.libhyper.NoConvergence:
                raise ConvergenceError("remez: the roots of p' did not converge; raise dps") from None
            tol = mpmath.mpf(10) ** (-(mpmath.mp.dps // 2))
            for y in roots:
                if abs(mpmath.im(y)) <= tol * (1 + abs(y)):
                    y = mpmath.re(y)
                    if l * l < y < u * u:
                        pts.append(mpmath.sqrt(y))
    return sorted(pts)


def remez_odd(l: RealLike, u: RealLike, *, degree: int = 5, dps: int = DEFAULT_DPS,
              tol: float | None = None, max_iter: int = 100) -> RemezResult:
    """The minimax odd polynomial of ``degree`` approximating 1 on ``[l, u]`` (see module docstring).

    ``l``/``u`` may be rationals, strings like ``"1/300"`` or mpmath numbers (taken as exact).
    ``tol`` defaults to ``10**(-(dps - 5))`` relative.
    """
    dps = check_dps(dps)
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or degree % 2 == 0:
        raise DeriveMapsError(f"degree = {degree!r}: expected an odd positive integer (1, 3, 5, ...)")
    with mpmath.workdps(dps):
        if isinstance(l, mpmath.mpf) or isinstance(u, mpmath.mpf):
            lm, um = mpmath.mpf(l), mpmath.mpf(u)
            if not (lm > 0):
                check_interval(0, 1)  # raises the l <= 0 message
            if not (lm < um):
                raise DeriveMapsError(f"l = {mpmath.nstr(lm, 8)} >= u = {mpmath.nstr(um, 8)}: "
                                      "the interval [l, u] needs l < u")
        else:
            lf, uf = check_interval(l, u)
            lm, um = _mp(lf), _mp(uf)
        n = (degree + 1) // 2
        if ((um - lm) / um) ** n < mpmath.mpf(10) ** (-(dps - 10)):
            coeffs = narrow_limit(n, (lm + um) / 2)
            ext = _extrema(coeffs, lm, um)
            return RemezResult(coeffs=coeffs, error=max(abs(1 - odd_poly(coeffs, x)) for x in ext),
                               reference=(lm, um), iterations=0)
        return _remez(lm, um, degree, tol, max_iter, dps)


def narrow_limit(n: int, m):
    """Coefficients of ``P_n(x / m)``: the odd polynomial of degree 2n-1 with ``P_n(1) = 1`` and its
    first n-1 derivatives zero at 1 (the limit of the minimax polynomial on a shrinking interval
    around m)."""
    A = mpmath.matrix(n, n)
    rhs = mpmath.matrix([1] + [0] * (n - 1))
    for k in range(n):                 # k-th derivative of x^(2j+1) at 1
        for j in range(n):
            e = 2 * j + 1
            A[k, j] = mpmath.ff(e, k)  # falling factorial e (e-1) ... (e-k+1)
    c = mpmath.lu_solve(A, rhs)
    return tuple(c[j] / m ** (2 * j + 1) for j in range(n))


def _remez(l, u, degree, tol, max_iter, dps):
    n = (degree + 1) // 2
    tol_m = mpmath.mpf(tol) if tol is not None else mpmath.mpf(10) ** (-(dps - 5))
    floor = mpmath.mpf(10) ** (-(dps - 8))
    # Chebyshev-extrema reference on [l, u]
    ref = [(l + u) / 2 - (u - l) / 2 * mpmath.cos(mpmath.pi * i / n) for i in range(n + 1)]
    ref[0], ref[-1] = l, u
    for it in range(1, max_iter + 1):
        A = mpmath.matrix(n + 1, n + 1)
        for i, x in enumerate(ref):
            xp = x
            x2 = x * x
            for j in range(n):
                A[i, j] = xp
                xp *= x2
            A[i, n] = (-1) ** i
        try:
            sol = mpmath.lu_solve(A, mpmath.matrix([1] * (n + 1)))
        except (ZeroDivisionError, ValueError):
            raise ConvergenceError("remez: singular reference system; the interval is too narrow "
                                   "for this precision (raise dps or widen [l, u])") from None
        coeffs = tuple(sol[j] for j in range(n))
        h = sol[n]
        ext = _extrema(coeffs, l, u)
        errs = [1 - odd_poly(coeffs, x) for x in ext]
        emax = max(abs(e) for e in errs)
        if emax - abs(h) <= tol_m * abs(h) + floor or abs(h) == 0:
            return RemezResult(coeffs=coeffs, error=emax, reference=tuple(ref), iterations=it)
        ref = _exchange(ext, errs, n + 1)
    raise ConvergenceError(f"remez: no convergence in {max_iter} exchanges on "
                           f"[{mpmath.nstr(l, 8)}, {mpmath.nstr(u, 8)}]; raise max_iter or dps")


def _exchange(ext, errs, m):
    """Choose m alternating extrema including the largest |e| (keep, in each run of equal sign,
    the largest; then trim from the end with the smaller |e|)."""
    pts, vals = [], []
    for x, e in zip(ext, errs):
        if e == 0:
            continue
        if vals and (vals[-1] > 0) == (e > 0):
            if abs(e) > abs(vals[-1]):
                pts[-1], vals[-1] = x, e
        else:
            pts.append(x)
            vals.append(e)
    while len(pts) > m:
        if abs(vals[0]) < abs(vals[-1]):
            pts.pop(0)
            vals.pop(0)
        else:
            pts.pop()
            vals.pop()
    if len(pts) < m:
        raise ConvergenceError("remez: fewer alternation points than unknowns; the degree is too "
                               "high for this interval at this precision (raise dps)")
    return pts


def recentre(coeffs, l, u, *, mode: str = "arithmetic"):
    """Scale ``p`` so that it is centred on 1 between its values at ``l`` and ``u``:
    ``"arithmetic"``: ``(p(l) + p(u)) / 2 = 1``; ``"geometric"``: ``p(l) p(u) = 1`` (log-centred)."""
    pl, pu = odd_poly(coeffs, l), odd_poly(coeffs, u)
    if mode == "arithmetic":
        s = 2 / (pl + pu)
    elif mode == "geometric":
        if pl <= 0 or pu <= 0:
            raise DeriveMapsError("geometric recentring needs p(l) > 0 and p(u) > 0")
        s = 1 / mpmath.sqrt(pl * pu)
    else:
        raise DeriveMapsError(f"recentre mode = {mode!r}: expected 'arithmetic' or 'geometric'")
    return tuple(c * s for c in coeffs)
