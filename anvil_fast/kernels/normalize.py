"""The SAFE configuration's Frobenius normalization as Triton kernels, fed by per-block partials
(reference: :func:`anvil_ref.cascade.frobenius_normalize`; the plain-torch form is
``anvil_fast.core.cascade._normalize``, which runs where these kernels do not).

Per matrix, on the bf16 X (its values ``x`` exactly, in fp32)::

    e  = floor(log2 max|x|)  clamped to [-126, 126]       s = 2**-e   (an exact power of two)
    tr = sum((x s)**2)                                    fp32
    d  = margin * sqrt(tr) + eps * s
    X <- bf16((x s) / d)

The same numbers as ``_normalize``; only the fp32 summation order of ``tr`` differs. The sum is
formed in two levels so that no pass over X has to wait for a whole-matrix reduction:

* every block ``b`` of NORM_BLOCK consecutive elements of one matrix leaves two partials: its
  ``amax_b = max|x|`` (taken on the bit patterns with the sign cleared, so a NaN wins and propagates
  like torch's ``amax``) and ``ss_b = sum((x s_b)**2)`` with its *own* power of two
  ``s_b = 2**-e_b``, so no partial can overflow or lose the block's small values to underflow;
* ``tr = sum_b ss_b * (2**(e_b - e))**2``: the factor is an exact power of two, ``e_b <= e``, and a
  block whose factor underflows (``e_b - e < -126``) holds only values below 2**-126 of the
  largest, whose squares cannot move an fp32 sum that contains ``1 <= (max|x| s)**2 < 4``.

Who writes the partials. The twin-rail kernel (:mod:`anvil_fast.kernels.rails`) produces them while it
writes X (it holds every element in registers anyway), so the bank update's normalization reads X
once and writes it once (4 bytes per element; the compiled ``_normalize`` needed three passes:
amax, sum of squares, scale). For an X that did not come from the rails (``fast_cascade``, the
difftest), :func:`block_partials` reads it once more. Then :func:`normalize_from_partials` runs two
kernels: one program per matrix reduces its partials to ``s`` and ``d`` (fixed order: the result is
deterministic, the same on every rank), and an element-wise kernel scales X in place.

Exponents are read off the fp32 bit pattern, not ``log2``: Triton's ``log2`` is an approximation on
GPUs, and ``floor(log2 a)`` must be exact for ``s`` to be the power of two the docstring promises.
Division and square root use the IEEE round-to-nearest forms (``div_rn``, ``sqrt_rn``), like torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from anvil_ref.constants import NORM_BLOCK, NORM_REDUCE_BLOCK

from .backend import matrix_slices, round_fix, triton_available, widen_fix

#: Warps of the kernels that take one NORM_BLOCK of a matrix per program.
NORM_WARPS = 8

if triton_available():
    import triton
    import triton.language as tl

    from .backend import from_bf16, to_bf16
else:  # pragma: no cover - exercised only where triton is absent
    triton = None


def blocks_per_matrix(rows: int, cols: int) -> int:
    return -(-rows * cols // NORM_BLOCK)


@dataclass
class NormPartials:
    """Per-block partials of one bank's X ([chunk, blocks_per_matrix] fp32 each) and the per-matrix
    denominators ``d`` ([chunk, 1, 1] fp32) the finalizing kernel leaves next to ``scale``."""

    amax: Tensor
    sumsq: Tensor
    d: Tensor

    @classmethod
    def for_shape(cls, shape: tuple[int, int, int], device) -> "NormPartials":
        chunk, rows, cols = shape
        nb = blocks_per_matrix(rows, cols)
        f32 = dict(dtype=torch.float32, device=device)
        # empty, not zeros: the partials' writer (the rails or _partials_kernel) covers every block of
        # every matrix and _finalize_kernel every d before anything reads them, and a fill would be one
        # more kernel in each captured step (the drop-in takes this workspace per update)
        return cls(amax=torch.empty((chunk, nb), **f32), sumsq=torch.empty((chunk, nb), **f32),
                   d=torch.empty((chunk, 1, 1), **f32))


if triton is not None:

    @triton.jit
    def _floor_log2(a, LIMIT: tl.constexpr):
        # floor(log2(a)) for a >= 0 from the exponent field, clamped to [-LIMIT, LIMIT]: exact for
        # normal numbers; 0 and subnormals give -LIMIT (as torch's floor(log2(.)) clamped does),
        # inf and NaN give LIMIT.
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        return tl.minimum(tl.maximum(e, -LIMIT), LIMIT)

    @triton.jit
    def _exp2i(k):
        # 2**k as fp32 for an integer k <= 127, built on the bits (exact); 0 below 2**-126.
        v = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
        return tl.where(k < -126, 0.0, v)

    @triton.jit
    def _abs_max(x):
        # max |x| on the bit patterns (sign cleared): a NaN's pattern exceeds inf's, so it wins.
        bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def tile_partials(xf, LIMIT: tl.constexpr):
        # xf: fp32 values of one block (0 where masked) -> (max|x|, sum((x 2**-e_b)**2)); the rails'
        # kernel calls it too, so the partials it writes are these bits.
        amax = _abs_max(xf)
        y = xf * _exp2i(-_floor_log2(amax, LIMIT))
        return amax, tl.sum(y * y, axis=0)

    @triton.jit
    def _partials_kernel(x_ptr, pa_ptr, ps_ptr, mn, nb, LIMIT: tl.constexpr, WIDEN_FIX: tl.constexpr,
                         BLOCK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < mn
        x = from_bf16(tl.load(x_ptr + c * mn + offs, mask=m, other=0.0), WIDEN_FIX)
        amax, ss = tile_partials(x, LIMIT)
        tl.store(pa_ptr + c * nb + b, amax)
        tl.store(ps_ptr + c * nb + b, ss)

    @triton.jit
    def _finalize_kernel(pa_ptr, ps_ptr, s_ptr, d_ptr, nb, margin, eps, LIMIT: tl.constexpr,
                         RBLOCK: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, RBLOCK)
        amax_bits = tl.zeros([RBLOCK], dtype=tl.int32)
        for k in range(0, nb, RBLOCK):
            pa = tl.load(pa_ptr + c * nb + k + i, mask=k + i < nb, other=0.0)
            amax_bits = tl.maximum(amax_bits, pa.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        e = _floor_log2(tl.max(amax_bits, axis=0).to(tl.float32, bitcast=True), LIMIT)
        acc = tl.zeros([RBLOCK], dtype=tl.float32)
        for k in range(0, nb, RBLOCK):
            pa = tl.load(pa_ptr + c * nb + k + i, mask=k + i < nb, other=0.0)
            ps = tl.load(ps_ptr + c * nb + k + i, mask=k + i < nb, other=0.0)
            f = _exp2i(_floor_log2(pa, LIMIT) - e)
            acc += ps * (f * f)
        s = _exp2i(-e)
        tr = tl.sum(acc, axis=0)
        tl.store(s_ptr + c, s)
        tl.store(d_ptr + c, tl.sqrt_rn(tr) * margin + eps * s)

    @triton.jit
    def _scale_kernel(x_ptr, s_ptr, d_ptr, mn, ROUND_FIX: tl.constexpr, WIDEN_FIX: tl.constexpr,
                      BLOCK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        offs = c * mn + b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK) < mn
        s = tl.load(s_ptr + c)
        d = tl.load(d_ptr + c)
        x = from_bf16(tl.load(x_ptr + offs, mask=m, other=0.0), WIDEN_FIX)
        tl.store(x_ptr + offs, to_bf16(tl.div_rn(x * s, d), ROUND_FIX), mask=m)


def _check_x(X: Tensor, p: NormPartials) -> tuple[int, int, int]:
    if X.dtype != torch.bfloat16 or X.ndim != 3 or not X.is_contiguous():
        raise ValueError(f"normalize: X must be a contiguous [chunk, rows, cols] bf16 tensor, got {X.dtype} "
                         f"{tuple(X.shape)} (contiguous: {X.is_contiguous()})")
    chunk, rows, cols = X.shape
    want = (chunk, blocks_per_matrix(rows, cols))
    if tuple(p.amax.shape) != want or tuple(p.sumsq.shape) != want or p.amax.device != X.device:
        raise ValueError(f"normalize: partials must be fp32 {want} on {X.device}, got {tuple(p.amax.shape)} "
                         f"on {p.amax.device}")
    return chunk, rows, cols


def block_partials(X: Tensor, p: NormPartials, *, limit: int) -> None:
    """Write the per-block partials of the bf16 X into ``p`` (one read of X)."""
    chunk, rows, cols = _check_x(X, p)
    mn, nb = rows * cols, p.amax.shape[1]
    for s, e in matrix_slices(chunk):
        _partials_kernel[(nb, e - s)](X[s:e], p.amax[s:e], p.sumsq[s:e], mn, nb, LIMIT=limit,
                                      WIDEN_FIX=widen_fix(), BLOCK=NORM_BLOCK, num_warps=NORM_WARPS)


def normalize_from_partials(X: Tensor, scale: Tensor, p: NormPartials, *, margin: float, eps: float,
                            limit: int) -> None:
    """From the partials of X: ``scale`` <- s and ``p.d`` <- d per matrix, then X <- bf16(X s / d) in
    place (one read and one write of X)."""
    chunk, rows, cols = _check_x(X, p)
    mn, nb = rows * cols, p.amax.shape[1]
    _finalize_kernel[(chunk,)](p.amax, p.sumsq, scale, p.d, nb, float(margin), float(eps), LIMIT=limit,
                               RBLOCK=NORM_REDUCE_BLOCK, num_warps=4)
    for s, e in matrix_slices(chunk):
        _scale_kernel[(nb, e - s)](X[s:e], scale[s:e], p.d[s:e], mn, ROUND_FIX=round_fix(),
                                   WIDEN_FIX=widen_fix(), BLOCK=NORM_BLOCK, num_warps=NORM_WARPS)
