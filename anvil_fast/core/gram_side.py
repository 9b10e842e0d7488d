"""The Gram-side cascade on bf16 banks (reference: :mod:`anvil_ref.gram_side`; configuration:
:data:`anvil_fast.core.cascade.GRAM_SIDE`).

For a tall bank (rows m > cols n) every map of the standard cascade re-forms the Gram and the
product ``X B`` on the long side. The same maps run on the short side: with ``Q = a I + B`` and
``B = b A + c A^2`` (``ba_plus_cAA``), per matrix and after SAFE's normalization (unchanged: fp32
trace, prescale, margin slack, and the equalizer's guard after the cascade)::

    A = XTX(X_0)                                        X_0: the normalized X_1
    for map k = 1 .. K (a, b, c):
        if k is in the restart schedule:                X = X_0 R,  A = XTX(X),  X_0 <- X,  R <- I
        B = ba_plus_cAA(A, alpha=c, beta=b)             B = b A + c A^2          (symmetric kernel)
        R = a I + B       (first map after a (re)start)  |  R <- a R + R B        (aX_plus_mm)
        if map k + 1 needs A:
            P = a A + B A                               P = Q A                  (symmetric output)
            A = a P + B P                               A = Q Q A = Q A Q        (symmetric output)
    output X_0 R                                        (aX_plus_mm with a = 0)

Wide banks take the mirrored form (``XXT``, ``R <- a R + B R``, output ``R X_0``), as the reference.

Why these forms. ``Q A Q`` is written ``Q (Q A)`` -- the same matrix in exact arithmetic, because Q is
a polynomial in A and commutes with it -- so both products are ``a Y + B Y``: one fused kernel with
one rounding each, and ``Q`` itself is never formed. Both results are symmetric (``Q A = A Q``), so
both run on lower tiles only and mirror them (:func:`anvil_fast.kernels.gram.sym_aX_plus_mm`): ~(T-1)/(2T)
of their FLOPs saved and ``A`` stays exactly symmetric, which ``ba_plus_cAA`` assumes. ``R`` is a
product of commuting polynomials in ``A_1``, also symmetric in exact arithmetic, but a rounded ``R``
carries the drift the restarts exist to remove; it is kept as computed (bf16, see the study's R
column). Measured with the study (``python -m anvil_fast.studies.gram_side_study``) run both ways: with
``R``'s update mirrored as well, its error on the tall spectrum input rose past the rule's allowance
and the rule picked two restarts; with ``P`` mirrored and ``R`` full, the chosen schedule's errors stay
within the rule's allowance of those with ``P`` as a full product, and the rule's choice is the same.
The final ``X_0 R`` uses ``aX_plus_mm`` with ``a = 0``: one read of X_0 more than a bare GEMM, so
that every product of the path is the same tuned one-rounding kernel.

Dispatch (:func:`uses_gram_side`): the short side pays only when ``max(m, n) / min(m, n)`` is large.
Per matrix, counting a symmetric product of T tiles as (T+1)/(2T) of a full one, the standard cascade
costs ``K (3 m n^2 + n^3)``-ish FLOPs and the Gram side ``(3 + 3 r) m n^2`` (r restarts) plus ~5 n^3
per map (:func:`cascade_flops`): with one restart, 1.61x fewer for the 2816 x 768 banks, 1.18x more
for a square bank. GRAM_SIDE_MIN_ASPECT is the threshold; the bank benchmark
(``python -m anvil_fast.bench bank``, its Gram-side table) measures where it pays on a GPU.

Where Triton cannot run, the same operations run as plain torch with the same roundings (fp32
products of bf16 operands, one rounding per product), as SAFE does.

The driver (:func:`anvil_fast.core.cascade.gram_side_workspace`, :func:`anvil_fast.core.cascade.fast_gram_side`)
lives with the standard one in :mod:`anvil_fast.core.cascade`, which dispatches to it; this module holds
what is the Gram side's own: its buffers, schedule, dispatch rule, eager form and FLOP count (its
symmetric product is a Gram kernel: :mod:`anvil_fast.kernels.gram`, :mod:`anvil_fast.kernels.gram_kernels`).
``python -m anvil_fast.studies.gram_side_study`` runs the error study that picks the default schedule.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN
from anvil_ref.gram_side import check_restarts
from anvil_ref.maps import MapsLike, load_maps

from anvil_fast.kernels.gram import aX_plus_mm

#: The default restart schedule (map numbers, 1-based): one restart before map 4, the schedule that
#: ``python -m anvil_fast.studies.gram_side_study`` picks (papers/data/gram_side_study.md states the rule).
#: It is ANVIL_MAPS' schedule only: every map set has its own (:func:`studied_restarts`).
GRAM_SIDE_RESTARTS: tuple[int, ...] = (4,)
#: ``CascadeConfig.gram_side = STUDIED`` (GRAM_SIDE's): the schedule the study chose for the map set in
#: use. A schedule is a property of the maps, not of the configuration: the error a restart removes is
#: the bf16 rounding of ``A`` amplified by every map since the last (re)start, about ``a_k^2`` per map on
#: small singular values, and Polar Express's first map (a = 8.2) amplifies it 4.4x more than ANVIL's
#: (a = 3.9). With ANVIL's schedule, Polar Express's six maps explode on spectra that fall as a power
#: of the index, the spectra of a small GPT's momentum (the study's power-law inputs); their own
#: schedule, two restarts, does not.
STUDIED = "studied"
#: The study's choice for every map set the package names (ANVIL_MAPS and anvil_ref/map_sets/*.json),
#: generated by ``python -m anvil_fast.studies.gram_side_study --schedules`` (its header says so).
GRAM_SIDE_SCHEDULES_FILE = Path(__file__).with_name("gram_side_schedules.json")
#: The Gram side runs where ``max(rows, cols) / min(rows, cols) >= GRAM_SIDE_MIN_ASPECT``; square-ish
#: banks keep the standard cascade (no FLOP saving there, see the module docstring).
GRAM_SIDE_MIN_ASPECT: float = 2.0
#: On CUDA it also needs ``min(rows, cols) >= GRAM_SIDE_MIN_SHORT``. Measured on an H200 (the bank
#: benchmark's Gram-side table, results/h200_gram_side/bench_bank.log): the Gram side's cascade phase
#: is 1.16-1.32x faster than SAFE's on the 2816 x 768, 3072 x 768 and 768 x 3072 banks (short side
#: 768) and 0.78x on 8 x 256 x 768 (short side 256), where its n x n products are too small to fill
#: the GPU and the kernels' launch count dominates. At a short side of 384 (the small GPT's 1152 x 384,
#: 1536 x 384 and 384 x 1536 banks) the whole step pays: 0.400-0.402 ms on an H200 against 0.465 ms with
#: those banks on SAFE, fresh processes alternating, and with each map set's own restart schedule 30
#: steps of its training refused no update (results/h200_gram_side_schedules/). The threshold is the
#: smallest short side measured to pay. Elsewhere (CPU, Triton's interpreter: the tests) speed is not the
#: point, and every bank past the aspect ratio takes the Gram side, so small test shapes exercise it.
GRAM_SIDE_MIN_SHORT: int = 384


def maps_key(maps: MapsLike) -> tuple[tuple[float, float, float], ...]:
    """A map set as exact float coefficients: the key of :func:`studied_restarts`'s table."""
    return tuple(tuple(float(v) for v in t) for t in load_maps(maps))


@functools.lru_cache(maxsize=None)
def studied_schedules() -> dict[tuple, tuple[int, ...] | None]:
    """:data:`GRAM_SIDE_SCHEDULES_FILE` as ``{maps_key: restarts or None}`` (None: no schedule qualified)."""
    doc = json.loads(GRAM_SIDE_SCHEDULES_FILE.read_text())
    return {maps_key(e["maps"]): (None if e["restarts"] is None else tuple(e["restarts"])) for e in doc["map_sets"]}


@functools.lru_cache(maxsize=64)
def _studied(key: tuple) -> tuple[int, ...] | None:
    if key == maps_key(ANVIL_MAPS):
        return GRAM_SIDE_RESTARTS
    return studied_schedules().get(key)


def studied_restarts(maps: MapsLike = ANVIL_MAPS) -> tuple[int, ...] | None:
    """The restart schedule the Gram-side study chose for ``maps`` (:data:`GRAM_SIDE_RESTARTS` for
    ANVIL_MAPS), or None: the study found no schedule within its rule for them, or never ran on them (a
    map set of the caller's own). Under :data:`STUDIED` such banks run the standard cascade; to run
    the Gram side on them anyway, pass a schedule (``fast_gram_side(..., restarts=...)`` or a
    configuration with a tuple), after ``python -m anvil_fast.studies.gram_side_study --maps`` on them."""
    return _studied(maps_key(maps))


def uses_gram_side(shape, *, device=None, min_aspect: float = GRAM_SIDE_MIN_ASPECT,
                   min_short: int = GRAM_SIDE_MIN_SHORT) -> bool:
    """Dispatch rule: whether a bank of ``shape`` ([..., rows, cols]) on ``device`` (a torch device or
    its name; None: not CUDA) runs the Gram side."""
    m, n = int(shape[-2]), int(shape[-1])
    if min(m, n) <= 0 or max(m, n) < min_aspect * min(m, n):
        return False
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return not on_cuda or min(m, n) >= min_short


# ------------------------------------------------------------------------------------------------
# The cascade

@dataclass
class GramSideWork:
    """The Gram side's square buffers (n = the bank's short side): P = Q A, and R's pair, which rotates
    with the workspace's B (the cascade makes each fresh Q in B's buffer and hands R's to B)."""

    P: Tensor
    R: Tensor
    R2: Tensor

    @classmethod
    def for_workspace(cls, ws) -> "GramSideWork":  # ws: anvil_fast.core.cascade.CascadeWorkspace
        sq = tuple(ws.A.shape)
        return cls(*(torch.empty(sq, dtype=torch.bfloat16, device=ws.A.device) for _ in range(3)))


def restart_product(x0: Tensor, r: Tensor, out: Tensor, tall: bool, backend: str) -> None:
    """``out = X0 R`` (tall) or ``R X0`` (wide): a restart applies the accumulated short-side
    polynomial ``R`` to the restart's iterate, one rounding (``aX_plus_mm`` with ``a = 0``)."""
    if tall:
        aX_plus_mm(x0, x0, r, a=0.0, out=out, backend=backend)
    else:
        aX_plus_mm(x0, r, x0, a=0.0, out=out, backend=backend)


# ------------------------------------------------------------------------------------------------
# The eager bf16 version (the difftest's floor for this path, and the study's R-precision variant)

def eager_gram_side_cascade(x: Tensor, *, restarts=None, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                            eps: float = FROBENIUS_EPS, gemm: str = "library", r_fp32: bool = False) -> Tensor:
    """The Gram-side cascade in plain eager torch with SAFE's normalization (as
    :func:`anvil_fast.core.eager.eager_bf16_cascade` with ``fp32_trace=True, prescale=True``): library
    matmuls (``gemm="library"``) or fp32 products of the bf16 operands (``"fp32"``), every product
    rounded once to bf16, ``Q (Q A)`` as two ``baddbmm`` without symmetrization. ``r_fp32``: keep R
    in fp32 (products with R in fp32, one rounding of the output) to measure what bf16 R costs.
    ``restarts``: default the study's schedule for ``maps`` (:func:`studied_restarts`)."""
    from .eager import _BF16_MAX, _addmm, _gram, _mm

    maps_ = load_maps(maps)
    if restarts is None:
        restarts = studied_restarts(maps_)
        if restarts is None:
            raise ValueError("restarts: the Gram-side study has no schedule for these maps; pass one")
    sched = check_restarts(restarts, len(maps_))
    lead = x.shape[:-2]
    X = x.reshape(-1, *x.shape[-2:]).float().clamp(-_BF16_MAX, _BF16_MAX).bfloat16()
    tall = X.size(-2) > X.size(-1)
    xf = X.float()
    s = torch.exp2(-torch.floor(torch.log2(xf.abs().amax(dim=(-2, -1), keepdim=True))).clamp(-126, 126))
    xf = xf * s
    d = xf.square().sum(dim=(-2, -1), keepdim=True).sqrt() * margin + eps * s
    X0 = (xf / d).bfloat16()
    A = _gram(X0, tall, gemm)
    eye = torch.eye(A.shape[-1], device=A.device)

    def apply_r(x0, r):
        if r_fp32:
            return (x0.float() @ r if tall else r @ x0.float()).bfloat16()
        return _mm(x0, r, gemm) if tall else _mm(r, x0, gemm)

    Rk = None
    for k, (a, b, c) in enumerate(maps_, start=1):
        if k in sched:
            X0 = apply_r(X0, Rk)
            A = _gram(X0, tall, gemm)
            Rk = None
        B = _addmm(b, A, c, A, A, gemm) if c != 0 else (A.float() * b).bfloat16()
        if Rk is None:
            Rk = B.float() + a * eye
            Rk = Rk if r_fp32 else Rk.bfloat16()
        elif r_fp32:
            Rk = a * Rk + (Rk @ B.float() if tall else B.float() @ Rk)
        else:
            Rk = _addmm(a, Rk, 1.0, Rk, B, gemm) if tall else _addmm(a, Rk, 1.0, B, Rk, gemm)
        if k < len(maps_) and k + 1 not in sched:
            P = _addmm(a, A, 1.0, B, A, gemm)
            A = _addmm(a, P, 1.0, B, P, gemm)
    Y = apply_r(X0, Rk)
    return Y.reshape(*lead, *Y.shape[-2:])


# ------------------------------------------------------------------------------------------------
# FLOPs: the package's one count (the benchmarks' rooflines take it from here)

#: The symmetric kernels' square tile side, which sets how many tiles of a Gram they execute.
SYMMETRIC_BLOCK = 128


class MapFlops(NamedTuple):
    """FLOPs of one map's three products over a bank ``[c, m, n]`` (``k = min(m, n)``,
    ``K = max(m, n)``): the full products of the math (``plain``) and what the symmetric kernels
    execute (``executed``: lower tiles of the ``k x k`` outputs only)."""

    gram: tuple[float, float]
    baa: tuple[float, float]
    axb: tuple[float, float]

    @property
    def plain(self) -> float:
        return self.gram[0] + self.baa[0] + self.axb[0]

    @property
    def executed(self) -> float:
        return self.gram[1] + self.baa[1] + self.axb[1]


def symmetric_share(k: int, block: int = SYMMETRIC_BLOCK) -> float:
    """The share of a ``k x k`` product's ``T^2`` tiles (``T = ceil(k / block)``) a symmetric kernel
    executes: the ``T (T + 1) / 2`` lower ones, ``(T + 1) / (2 T)``."""
    t = math.ceil(k / block)
    return (t + 1) / (2 * t)


def map_flops(shape, *, block: int = SYMMETRIC_BLOCK) -> MapFlops:
    """Per map of a bank ``[c, m, n]``: Gram ``2 k^2 K``, ``A@A`` ``2 k^3`` (both symmetric:
    :func:`symmetric_share` of them executed) and ``X@B`` ``2 k^2 K`` (a full product), times the
    bank's ``c`` matrices."""
    c, m, n = shape
    k, K = min(m, n), max(m, n)
    lower = symmetric_share(k, block)
    gram, baa, axb = 2 * k * k * K * c, 2 * k ** 3 * c, 2 * k * k * K * c
    return MapFlops((gram, lower * gram), (baa, lower * baa), (axb, axb))


def cascade_flops(m: int, n: int, *, maps: int = len(ANVIL_MAPS), restarts=None,
                  block: int = SYMMETRIC_BLOCK) -> dict[str, float]:
    """FLOPs of one matrix's cascade, standard (``maps`` x :func:`map_flops`' executed count) and
    Gram side (``restarts``: default GRAM_SIDE's), a symmetric product costing
    :func:`symmetric_share` of a full one. Returns {"standard", "gram_side", "ratio"} (ratio =
    standard / gram_side)."""
    sched = GRAM_SIDE_RESTARTS if restarts is None else tuple(restarts)
    f = map_flops((1, m, n), block=block)
    sym = symmetric_share(min(m, n), block)
    gram, sq, full = f.gram[1], f.baa[0], f.axb[0]
    standard = maps * f.executed
    # per map: B (sym); R update (full) except after a (re)start; P and A (both sym) unless the
    # next map restarts or this is the last; per restart: X_0 R (full) and its Gram; final X_0 R.
    starts = 1 + len(sched)
    updates = maps - 1 - len(sched)
    gs = gram + maps * sq * sym + (maps - starts) * sq + updates * (2 * sq * sym) \
        + len(sched) * (full + gram) + full
    return {"standard": standard, "gram_side": gs, "ratio": standard / gs}
