"""Falsification search: small adversarial inputs through the real bf16 cascade, held against a robust
certificate (:mod:`derive_maps.robust`).

A certificate for ``inputs`` (``"general"``: matrices with ``m`` singular values, ``"diagonal"``:
one nonzero per row and column) on ``[l, u]`` says: every output singular value is at most
``f_max`` (``[0, u]``, any input of the class), and the output singular values paired with input
singular values in ``[l, u]`` lie in ``[f_min, f_max]``. :func:`search` looks for inputs that
break it and returns the extremes it saw (:class:`Finding`); what it measures is a measurement on
the inputs it tried, never a bound.

The cascade is :func:`anvil_fast.core.eager.eager_bf16_cascade` in SAFE's order (fp32 trace, prescale,
first Gram of the normalized X) with ``gemm="fp32"`` (bf16 operands, fp32 products and sums, one
rounding: the fast kernels' rounding points), at the total margin ``1 / u`` the certificate is
for, on the CPU with one thread (fixed summation order). Inputs are bf16 matrices; their normalized
singular values ``sigma / (margin ||X||_F)`` are computed in float64.

Inputs: ``m x n`` blocks (``general``; ``block=(m, n)``) ``X = U diag(t) V^T`` with Haar ``U, V``,
``t`` on the circle ``t_1^2 + t_2^2 = u^2`` when ``m = 2`` (every spectrum of the class) or drawn
around the certificate's critical points; diagonal ``k x k`` matrices with random signs (``diagonal``).
Then ``rounds`` of local search: the worst inputs, moved by a few bf16 units entrywise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .errors import DeriveMapsError, RealLike, check_maps, parse_real


@dataclass(frozen=True)
class Finding:
    """What a search saw: the largest output singular value (``out_max``, at the input ``at_max``)
    over every input, and the smallest one (``out_min``, at ``at_min``) over the inputs whose
    normalized singular values all lie in ``[l, u]`` (None without an ``l`` or such inputs).
    ``inputs``: how many were run. Measured values, not bounds."""
    inputs: int
    out_max: float
    at_max: list
    out_min: float | None
    at_min: list | None
    block: tuple
    kind: str

    def as_dict(self) -> dict:
        return asdict(self)

    def violations(self, f_max: float, f_min: float | None = None) -> list[str]:
        """The ways this finding breaks a certificate ``[f_min, f_max]`` (empty: none)."""
        out = []
        if not (self.out_max <= f_max):
            out.append(f"output singular value {self.out_max!r} > certified max {f_max!r} at {self.at_max}")
        if f_min is not None and self.out_min is not None and not (self.out_min >= f_min):
            out.append(f"output singular value {self.out_min!r} < certified min {f_min!r} at {self.at_min}")
        return out


def bf16_cascade(x: torch.Tensor, maps, u: RealLike) -> torch.Tensor:
    """SAFE's bf16 cascade (eager, fp32 products) of the bank ``x`` at the total margin ``1 / u``."""
    from anvil_fast.core.eager import eager_bf16_cascade
    margin = float(1 / parse_real(u, "u"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return eager_bf16_cascade(x, maps=maps, margin=margin, fp32_trace=True, prescale=True, gemm="fp32")
    finally:
        torch.set_num_threads(threads)


def normalized_singular_values(x: torch.Tensor, u: RealLike) -> np.ndarray:
    """``sigma / (margin ||X||_F)`` of the bf16-rounded bank ``x`` (float64), per matrix."""
    xb = x.to(torch.bfloat16).double()
    margin = float(1 / parse_real(u, "u"))
    nrm = torch.linalg.matrix_norm(xb)[..., None]
    return (torch.linalg.svdvals(xb) / (margin * nrm)).numpy()


def _haar(count: int, m: int, k: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(count, m, k, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]


def _spectra(count: int, k: int, l: float, u: float, points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``count`` spectra of ``k`` values (unnormalized: the cascade normalizes), half log-uniform on
    ``[l/4, u]``, half with values at the given sensitive ``points`` (normalized positions)."""
    lo = max(l / 4, 1e-4)
    t = np.exp(rng.uniform(np.log(lo), np.log(u), size=(count, k)))
    if points.size:
        pick = rng.random((count, k)) < 0.5
        t = np.where(pick, rng.choice(points, size=(count, k)) * np.exp(rng.normal(0, 1e-2, (count, k))), t)
    if k == 2:
        # every 2-value spectrum, on the circle t1^2 + t2^2 = u^2 (what the normalization makes of it)
        a = rng.uniform(0, np.pi / 4, size=count // 2)
        t[: count // 2] = np.stack([np.cos(a), np.sin(a)], 1)
    return t


def _near_identity(count: int, k: int, scale: float, g: torch.Generator) -> torch.Tensor:
    """``count`` orthogonal ``k x k`` matrices within about ``scale`` rad of the identity."""
    W = torch.randn(count, k, k, generator=g, dtype=torch.float64) * scale
    return torch.linalg.matrix_exp(W - W.mT)


def search(maps, *, u: RealLike, l: RealLike | None = None, inputs: str = "general", block: tuple = (2, 2),
           budget: int = 2048, rounds: int = 3, points=(), seeds=(), seed: int = 0) -> Finding:
    """Search ``budget`` inputs of the class (then ``rounds`` of local moves around the worst) for the
    extremes of the bf16 cascade's output singular values (module docstring). ``points``: normalized
    singular values worth visiting (a certificate's argmin/argmax, the first map's dip). ``seeds``:
    known adversarial inputs of the block's shape (:data:`ADVERSARIAL`), each run with ``budget // 4``
    neighbours (rotated by up to about 3e-3 rad on both sides; general inputs only)."""
    maps_ = check_maps(maps)
    uf = float(parse_real(u, "u"))
    lf = None if l is None else float(parse_real(l, "l"))
    if inputs not in ("general", "diagonal"):
        raise DeriveMapsError(f"inputs = {inputs!r}: expected 'general' or 'diagonal'")
    m, n = (int(block[0]), int(block[1]))
    if m < 1 or n < 1:
        raise DeriveMapsError(f"block = {block!r}: expected two positive sizes")
    k = min(m, n)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    pts = np.asarray(points, dtype=np.float64)
    t = torch.as_tensor(_spectra(budget, k, lf or 1e-3, uf, pts, rng))
    if inputs == "diagonal":
        signs = torch.as_tensor(rng.choice([-1.0, 1.0], size=(budget, k)))
        X = torch.zeros(budget, m, n, dtype=torch.float64)
        idx = torch.arange(k)
        X[:, idx, idx] = t * signs
    else:
        X = (_haar(budget, m, k, g) * t[:, None, :]) @ _haar(budget, n, k, g).mT
    if len(seeds):
        S = torch.as_tensor(np.asarray(seeds, dtype=np.float64))
        if tuple(S.shape[-2:]) != (m, n):
            raise DeriveMapsError(f"seeds of shape {tuple(S.shape[-2:])} for a block {(m, n)}")
        reps = max(1, budget // 4)
        near = S.repeat_interleave(reps, 0)
        if inputs == "general":
            near = _near_identity(near.shape[0], m, 1.5e-3, g) @ near @ _near_identity(near.shape[0], n, 1.5e-3, g)
        X = torch.cat([X, S, near])
    best_hi, best_lo = (-np.inf, None), (np.inf, None)
    total = 0
    for r in range(rounds + 1):
        Xb = X.to(torch.bfloat16)
        Y = bf16_cascade(Xb, maps_, u)
        s_out = torch.linalg.svdvals(Y.double()).numpy()
        s_out = np.where(np.isfinite(s_out), s_out, np.inf)
        s_in = normalized_singular_values(Xb, u)
        total += Xb.shape[0]
        hi = s_out.max(1)
        i = int(np.argmax(hi))
        if hi[i] > best_hi[0]:
            best_hi = (float(hi[i]), Xb[i].float().tolist())
        if lf is not None:
            inside = np.all((s_in >= lf) & (s_in <= uf), axis=1)
            if inside.any():
                lo = np.where(inside, s_out.min(1), np.inf)
                j = int(np.argmin(lo))
                if lo[j] < best_lo[0]:
                    best_lo = (float(lo[j]), Xb[j].float().tolist())
        if r == rounds:
            break
        # local moves: the 32 worst of each side, every entry moved by up to 4 bf16 units
        score_hi = np.argsort(-hi)[:32]
        sel = score_hi
        if lf is not None and inside.any():
            sel = np.concatenate([sel, np.argsort(np.where(inside, s_out.min(1), np.inf))[:32]])
        base = Xb[torch.as_tensor(sel)].double()
        reps = max(1, budget // base.shape[0])
        base = base.repeat(reps, 1, 1)
        step = torch.as_tensor(rng.integers(-4, 5, size=base.shape), dtype=torch.float64) * 2.0 ** -8
        moved = base * (1 + step)
        if inputs == "diagonal":
            moved = moved * (base != 0)
        X = moved
    return Finding(inputs=total, out_max=best_hi[0], at_max=best_hi[1],
                   out_min=None if best_lo[1] is None else best_lo[0], at_min=best_lo[1],
                   block=(m, n), kind=inputs)


def padded(block: torch.Tensor, shape: tuple, at: tuple = (0, 0)) -> torch.Tensor:
    """``block`` (``[..., m, n]``) inside a zero matrix of ``shape`` at offset ``at``."""
    out = torch.zeros(*block.shape[:-2], *shape, dtype=block.dtype)
    m, n = block.shape[-2:]
    out[..., at[0]:at[0] + m, at[1]:at[1] + n] = block
    return out


#: The falsifying input of the scalar model: a 2 x 2 bf16 matrix (normalized singular values 0.883,
#: 0.358) on which the seven-map l = 1/100 set certified under a scalar model explodes.
FALSIFIER_2X2 = ((-0.392578125, -0.58984375), (0.1552734375, -0.796875))

#: Known adversarial inputs per block shape, which :func:`search` seeds with (``seeds=``).
ADVERSARIAL = {(2, 2): (FALSIFIER_2X2,)}
