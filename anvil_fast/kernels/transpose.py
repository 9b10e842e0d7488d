"""Tiled transposes for the tied embedding (seed: ``transpose_add``, ``transpose_copy``).

While ``embed`` ([vocab, d]) is tied to ``lm_head`` ([d, vocab]), the optimizer adds ``embed.grad^T``
into ``lm_head.grad`` before the reduction and copies ``lm_head^T`` into ``embed`` after the gather:

    transpose_add(src, dst):   dst += src^T     (dst computed in fp32, rounded once to dst's dtype)
    transpose_copy(src, dst):  dst  = src^T

Why a kernel: ``dst.add_(src.T)`` reads one operand against its memory order, and on a GPU such a
strided read of a [50304, 768] matrix fetches a whole 32-byte sector per 2-byte element. The
kernel loads a [BR, BC] tile along ``src``'s rows (coalesced), transposes it in registers/shared
memory (``tl.trans``), and writes it along ``dst``'s rows (coalesced). Offsets are 64-bit. The
results are bitwise those of ``dst.add_(src.T)`` / ``dst.copy_(src.T)`` in torch (one fp32 add and
one rounding per element), which the tests check.

On CPU (or without Triton) the torch expressions above run instead; ``backend="triton"`` runs the
kernel anyway (on CPU under ``TRITON_INTERPRET=1``, as the tests do; there the fp32 -> bf16 store
rounds on the bit pattern, ``ROUND_FIX`` of :mod:`anvil_fast.kernels.backend`, because the interpreter's
own cast truncates).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import round_fix, triton_available, use_triton

if triton_available():
    import triton
    import triton.language as tl

    from .backend import to_bf16
else:  # pragma: no cover
    triton = None

BR, BC = 64, 64


if triton is not None:

    @triton.jit
    def _transpose_kernel(src, dst, R, C, s_sr, s_sc, s_dr, s_dc, ADD: tl.constexpr, BF16_OUT: tl.constexpr,
                          ROUND_FIX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        c = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        mask = (r[:, None] < R) & (c[None, :] < C)
        x = tl.load(src + r[:, None] * s_sr + c[None, :] * s_sc, mask=mask, other=0.0)
        xt = tl.trans(x)  # [BC, BR]: dst rows c, dst cols r
        mask_t = (c[:, None] < C) & (r[None, :] < R)
        d_ptr = dst + c[:, None] * s_dr + r[None, :] * s_dc
        if ADD:
            d = tl.load(d_ptr, mask=mask_t, other=0.0)
            val = d.to(tl.float32) + xt.to(tl.float32)
            if BF16_OUT:
                out = to_bf16(val, ROUND_FIX)
            else:
                out = val.to(dst.dtype.element_ty)
        else:
            out = xt.to(dst.dtype.element_ty)
        tl.store(d_ptr, out, mask=mask_t)


def _check(src: Tensor, dst: Tensor, what: str) -> None:
    if src.ndim != 2 or dst.ndim != 2 or dst.shape != (src.shape[1], src.shape[0]):
        raise ValueError(f"{what}: dst must be src transposed; got src {tuple(src.shape)}, dst {tuple(dst.shape)}")
    if src.device != dst.device:
        raise ValueError(f"{what}: src on {src.device}, dst on {dst.device}")
    if not src.dtype.is_floating_point or not dst.dtype.is_floating_point:
        raise ValueError(f"{what}: floating-point tensors only, got {src.dtype}, {dst.dtype}")


def _launch(src: Tensor, dst: Tensor, add: bool) -> None:
    R, C = src.shape
    grid = (triton.cdiv(R, BR), triton.cdiv(C, BC))
    _transpose_kernel[grid](src, dst, R, C, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
                            ADD=add, BF16_OUT=dst.dtype == torch.bfloat16, ROUND_FIX=round_fix(), BR=BR, BC=BC)


@torch.no_grad()
def transpose_add(src: Tensor, dst: Tensor, *, backend: str = "auto") -> None:
    """``dst += src^T`` in place (src [R, C], dst [C, R]; any strides)."""
    _check(src, dst, "transpose_add")
    if src.numel() == 0:
        return
    if use_triton(dst, backend):
        _launch(src, dst, True)
    else:
        dst.add_(src.T)


@torch.no_grad()
def transpose_copy(src: Tensor, dst: Tensor, *, backend: str = "auto") -> None:
    """``dst = src^T`` in place (src [R, C], dst [C, R]; any strides)."""
    _check(src, dst, "transpose_copy")
    if src.numel() == 0:
        return
    if use_triton(dst, backend):
        _launch(src, dst, False)
    else:
        dst.copy_(src.T)


__all__ = ["transpose_add", "transpose_copy"]
