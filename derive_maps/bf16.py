"""bf16 envelope, measured: what the actual bf16 cascade does to singular values on a suite of inputs.

A measurement, not a bound: the extremes over the matrices of the suite, which say nothing about
other inputs (:mod:`derive_maps.robust` certifies; :mod:`derive_maps.falsify` searches). Runs
:func:`anvil_fast.core.eager.eager_bf16_cascade` (the seed-faithful bf16 cascade, on the CPU) on a
fixed, seeded suite of test matrices ``X = U diag(sigma) V^T`` with Haar-random ``U, V`` and
prescribed singular values, and measures the singular values of the bf16 output in float64. The
cascade divides by ``1.05 ||X||_F + 1e-6``, so the prescribed values are the *normalized* ones
``t_i`` with ``sum t_i^2 = (1 / 1.05)^2`` (then ``||X||_F = 1 / 1.05`` and the cascade sees ``t_i``
up to the 1e-6 epsilon). Spectra (all inside ``[l, u]`` with a 15% margin at the bottom, because
rounding the input to bf16 moves the small singular values by up to ~0.4% of the largest):

* ``spread``: ``t`` geometric from ``1.15 l`` up, the top set by the norm constraint (~0.67);
* ``near_rank1``: one dominant ``t_1 = sqrt(u^2 - sum rest^2)`` (within ~0.1% of ``u`` for the
  smaller shapes) and the rest geometric in ``[1.15 l, 2 l]``;
* ``flat``: all equal, ``t_i = u / sqrt(k)`` (an input that is already orthogonal).

Two suites: DEFAULT_SHAPES (64 to 768 rows, two seeds: 30 matrices) and SMALL_SHAPES (2 x 2 and
8 x 8, eight seeds: 48 matrices), where ``near_rank1`` is ill-conditioned (a 2 x 2 one has
singular values ``1.15 l`` next to ``~u``: below the resolution of a bf16 iterate, ``u ||X||_F``,
see :func:`derive_maps.robust.resolution_limits`, so its small singular value comes out anywhere).

The envelope is ``[min, max]`` of all output singular values over the suite; the realized input
range (normalized singular values of the bf16-rounded input, computed in float64) is reported so
the coverage of ``[l, u]`` is visible. Products follow the model of a bf16 GEMM with fp32
accumulation (``gemm="fp32"`` of the eager cascade: bf16 operands multiplied in fp32, the result
rounded once to bf16, as a GPU's tensor cores do), with one torch thread: the CPU's own bf16 GEMM
kernels (oneDNN's AMX or AVX-512 paths) accumulate in orders that differ between machines and even
between processes, which moved stored envelopes by up to 6e-4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from anvil_ref.constants import FROBENIUS_EPS, FROBENIUS_MARGIN

from .errors import DeriveMapsError, check_maps

KINDS = ("spread", "near_rank1", "flat")

#: Matrix shapes of the default suite: square, wide, tall (the seed's three bank shapes are
#: 768 x 768, 256 x 768 / 768 x 256 per head group, and 768 x 2816; 2816 is left out to keep the
#: suite fast on a CPU), and a small square one for the top-end (near_rank1 reaches closest to u).
DEFAULT_SHAPES = ((64, 64), (256, 256), (256, 768), (768, 256), (768, 768))
QUICK_SHAPES = ((64, 64), (128, 384))
DEFAULT_SEEDS = (0, 1)
#: The small suite: 2 x 2 and 8 x 8 matrices (ill-conditioned where near_rank1), more seeds.
SMALL_SHAPES = ((2, 2), (8, 8))
SMALL_SEEDS = tuple(range(8))


@dataclass(frozen=True)
class Bf16Envelope:
    lo: float                   # min output singular value over the suite
    hi: float                   # max output singular value over the suite
    input_lo: float             # min normalized input singular value (bf16-rounded input)
    input_hi: float             # max normalized input singular value
    matrices: int
    per_kind: dict = field(default_factory=dict)

    @property
    def max_abs_log(self) -> float:
        return max(abs(np.log(self.lo)), abs(np.log(self.hi)))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["max_abs_log"] = self.max_abs_log
        return d


def _haar(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def spectrum(kind: str, k: int, *, l: float, u: float) -> np.ndarray:
    """Normalized singular values of one test matrix (descending), ``sum t^2 = u^2``."""
    lo = 1.15 * l
    if kind == "flat":
        return np.full(k, u / np.sqrt(k))
    if kind == "near_rank1":
        rest = np.geomspace(lo, 2 * l, k - 1) if k > 1 else np.zeros(0)
        top2 = u * u - float(np.sum(rest ** 2))
        if top2 <= rest.max(initial=0) ** 2:
            raise DeriveMapsError(f"near_rank1 spectrum: k = {k} singular values >= {lo:g} do not fit "
                                  f"under the norm u = {u:g}; use a smaller shape or a smaller l")
        return np.concatenate([[np.sqrt(top2)], rest[::-1]])
    if kind == "spread":
        if k == 1:
            return np.array([u])
        # geometric from lo to T with sum of squares = u^2: bisect on T
        a, b = lo, u
        for _ in range(200):
            T = (a + b) / 2
            if np.sum(np.geomspace(lo, T, k) ** 2) > u * u:
                b = T
            else:
                a = T
        t = np.geomspace(lo, a, k)
        # put the leftover norm into the top value so that sum t^2 = u^2 exactly
        t[-1] = np.sqrt(u * u - np.sum(t[:-1] ** 2))
        return t[::-1]
    raise DeriveMapsError(f"spectrum kind = {kind!r}: expected one of {KINDS}")


def test_matrix(shape: tuple[int, int], kind: str, seed: int, *, l: float, u: float) -> tuple[torch.Tensor, np.ndarray]:
    """One seeded float64 test matrix and its normalized singular values."""
    m, n = shape
    k = min(m, n)
    g = torch.Generator().manual_seed(10_007 * seed + 101 * m + n + 7 * KINDS.index(kind))
    t = spectrum(kind, k, l=l, u=u)
    X = (_haar(m, k, g) * torch.as_tensor(t.copy())) @ _haar(n, k, g).T
    return X, t


def bf16_envelope(maps, *, l: float = 1 / 300, u: float = 1 / FROBENIUS_MARGIN,
                  shapes=DEFAULT_SHAPES, kinds=KINDS, seeds=DEFAULT_SEEDS) -> Bf16Envelope:
    """Run the bf16 cascade of ``maps`` on the suite and return the envelope of output singular values."""
    maps_ = check_maps(maps)
    from anvil_fast.core.eager import eager_bf16_cascade

    lo, hi = np.inf, -np.inf
    in_lo, in_hi = np.inf, -np.inf
    per_kind: dict = {}
    count = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for shape in shapes:
            for kind in kinds:
                for seed in seeds:
                    X, _ = test_matrix(shape, kind, seed, l=l, u=u)
                    Xb = X.to(torch.bfloat16)
                    d = FROBENIUS_MARGIN * torch.linalg.matrix_norm(Xb.double()) + FROBENIUS_EPS
                    sin = torch.linalg.svdvals(Xb.double()) / d
                    with torch.no_grad():
                        Y = eager_bf16_cascade(X, maps=maps_, gemm="fp32")
                    s = torch.linalg.svdvals(Y.double()).numpy()
                    if not np.all(np.isfinite(s)):
                        s = np.array([np.inf])
                    lo, hi = min(lo, float(s.min())), max(hi, float(s.max()))
                    in_lo, in_hi = min(in_lo, float(sin.min())), max(in_hi, float(sin.max()))
                    pk = per_kind.setdefault(kind, [np.inf, -np.inf])
                    pk[0], pk[1] = min(pk[0], float(s.min())), max(pk[1], float(s.max()))
                    count += 1
    finally:
        torch.set_num_threads(threads)
    return Bf16Envelope(lo=lo, hi=hi, input_lo=in_lo, input_hi=in_hi, matrices=count,
                        per_kind={k: tuple(v) for k, v in per_kind.items()})
