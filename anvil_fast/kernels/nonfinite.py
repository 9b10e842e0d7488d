"""The non-finite gradient check on the device: one flag per parameter, set where its gradient, as
the step reads it, holds a NaN or an infinity.

"As the step reads it": a bank's gradient travels in bf16 (the seed's), so an fp32 gradient entry
beyond bf16's range counts as infinite; an Adam parameter's gradient is read in its own dtype. The
flags are written on the device and never waited for: the step decides on the device
(:mod:`anvil_fast.optim.device_step`) and reports later.

Two forms of the same rule:

* :func:`check_addresses` (Triton): the gradients read where autograd left them, through device
  tables of addresses (0: no gradient, nothing read), one launch per (dtype, bf16 cast) group, each
  program one block of one segment (a matrix or a parameter) -- a CUDA graph of it replays whatever
  the addresses are.
* :func:`check_buffers` (torch): ``torch._foreach_norm(..., inf)`` over gradients at fixed
  addresses (the buffers a bank reads); the inf-norm is non-finite exactly when an element is (no
  sum can overflow), a handful of launches for any number of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .backend import round_fix, triton_available, use_triton, widen_fix

#: Elements per program of the address-table check.
CHECK_BLOCK = 4096

if triton_available():
    import triton
    import triton.language as tl

    from .backend import from_bf16, to_bf16
else:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:

    @triton.jit
    def _check_kernel(blocks_ptr, addr_ptr, meta_ptr, flags_ptr, G_BF16: tl.constexpr, CAST_BF16: tl.constexpr,
                      ROUND_FIX: tl.constexpr, WIDEN_FIX: tl.constexpr, BLOCK: tl.constexpr):
        # Program i: block blocks[i, 1] of segment j = blocks[i, 0], whose address is addr[j] (0: no
        # gradient) and whose element count and flag index are meta[j]. Every program that meets a
        # NaN or inf stores the same 1, so the unordered stores need no atomics.
        j = tl.load(blocks_ptr + 2 * tl.program_id(0)).to(tl.int64)
        blk = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1).to(tl.int64)
        base = tl.load(addr_ptr + j)
        n = tl.load(meta_ptr + 2 * j)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = (offs < n) & (offs * 0 + base != 0)
        if G_BF16:
            x = from_bf16(tl.load(base.to(tl.pointer_type(tl.bfloat16)) + offs, mask=m, other=0.0), WIDEN_FIX)
        else:
            x = tl.load(base.to(tl.pointer_type(tl.float32)) + offs, mask=m, other=0.0)
            if CAST_BF16:
                x = from_bf16(to_bf16(x, ROUND_FIX), WIDEN_FIX)
        bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0)
        tl.store(flags_ptr + tl.load(meta_ptr + 2 * j + 1), bad, mask=bad > 0)


class AddressCheck:
    """The launch tables of one :func:`check_addresses` group: segments of ``numels`` elements whose
    flags are ``flag_of`` (built once; the addresses come per step in ``addresses``)."""

    def __init__(self, numels: Sequence[int], flag_of: Sequence[int], device, *, dtype: torch.dtype,
                 cast_bf16: bool):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"check: gradients must be float32 or bfloat16, got {dtype}")
        self.dtype, self.cast_bf16 = dtype, bool(cast_bf16) and dtype == torch.float32
        blocks = [(j, b) for j, n in enumerate(numels) for b in range(-(-int(n) // CHECK_BLOCK))]
        self.blocks = torch.tensor(blocks or [(0, 0)], dtype=torch.int32, device=device).reshape(-1, 2)
        self.meta = torch.tensor(list(zip(numels, flag_of)), dtype=torch.int64, device=device).reshape(-1, 2)
        self.empty = not blocks


def check_addresses(group: AddressCheck, addresses: Tensor, flags: Tensor) -> None:
    """Set ``flags[flag_of[j]] = 1`` where segment j's gradient (at ``addresses[j]``) holds NaN/inf."""
    if group.empty:
        return
    if not use_triton(flags, "triton"):
        raise ValueError("check_addresses needs Triton (CUDA, or TRITON_INTERPRET=1)")
    _check_kernel[(group.blocks.shape[0],)](group.blocks, addresses, group.meta, flags,
                                            G_BF16=group.dtype == torch.bfloat16, CAST_BF16=group.cast_bf16,
                                            ROUND_FIX=round_fix(), WIDEN_FIX=widen_fix(), BLOCK=CHECK_BLOCK,
                                            num_warps=8)


class BufferCheck:
    """:func:`check_buffers` over gradients at fixed addresses, ``grads[i]`` flagging ``flags[i]``
    (the grouping by dtype and the permutation back to that order are built once: nothing here
    copies from the host, so a CUDA graph can capture it)."""

    def __init__(self, grads: Sequence[Tensor], device):
        self.grads = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(self.grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        self.groups = [[self.grads[i] for i in ids] for ids in by_dtype.values()]
        order = [i for ids in by_dtype.values() for i in ids]
        inverse = [0] * len(order)
        for k, i in enumerate(order):
            inverse[i] = k
        self.inverse = torch.tensor(inverse, dtype=torch.int64, device=device)


def check_buffers(check: BufferCheck, flags: Tensor, *, mask: Tensor | None = None) -> None:
    """``flags[i] = 1`` where ``check.grads[i]`` holds NaN/inf, else 0 (``mask``: an int32 device
    tensor of one entry per gradient; 0 clears that flag, e.g. for the stale buffer of a parameter
    without a gradient this step). A bank buffer is bf16 already, so its check is the bf16 one."""
    if not check.grads:
        return
    norms = [n for grads in check.groups for n in torch._foreach_norm(grads, float("inf"))]
    bad = torch.stack([n.float() for n in norms]).isfinite().logical_not_().to(torch.int32)
    bad = bad.index_select(0, check.inverse)
    flags[:bad.numel()].copy_(bad if mask is None else bad * mask)


__all__ = ["AddressCheck", "BufferCheck", "check_addresses", "check_buffers", "CHECK_BLOCK"]
