"""Adam with bias correction and cautious decay (anvil_ref.adam), as one elementwise pass.

The math is the seed's ``_adam_update_step`` for parameter ``p``, gradient ``g`` and fp32 moments::

    m' = m*beta1 + g*(1 - beta1);  v' = v*beta2 + (1 - beta2)*g*g
    u  = m' / (sqrt(v') + eps) * step_size;  u += p * [u*p > 0] * eff_wd;  p' = p - u

with ``step_size = lr*sqrt(1 - beta2^t)/(1 - beta1^t)`` and ``eff_wd = lr^2 * weight_decay * wd_mul``
(``lr`` includes ``lr_mul``) computed in Python doubles and rounded to fp32 once (:func:`adam_row`).

Why a Triton kernel instead of the seed's ``torch.compile``'d function: the scalars come from a
device table row (:mod:`anvil_fast.kernels.bank_scalars`) that one H2D copy per step refreshes, and one
kernel serves both the sharded parameters (one row for the whole tensor) and the flat buffers of
the replicated ones (a per-element row index, :mod:`anvil_fast.optim.replicated_adam`), with no
recompilation when a rate changes and no compile time at start. Division and square root use the
IEEE round-to-nearest forms (``div_rn``, ``sqrt_rn``), like torch, not Triton's fast approximations.
A row whose ``active`` column is 0 leaves ``p``, ``m`` and ``v`` unchanged (a parameter with no
gradient this step). ``p`` may be fp32 or bf16 (computed in fp32, rounded once at the store).

On CPU (or without Triton) the same arithmetic runs as plain torch ops (:func:`adam_torch_`); tests
run the kernel on CPU through Triton's interpreter (``backend="triton"``; ``ROUND_FIX`` rounds the
bf16 store on the bit pattern there, see :mod:`anvil_fast.kernels.backend`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .bank_scalars import ADAM_COLUMNS

from .backend import round_fix, triton_available, use_triton

if triton_available():  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl

    from .backend import to_bf16
else:  # pragma: no cover - exercised only where triton is absent
    triton = None

N_COLS = len(ADAM_COLUMNS)
BLOCK = 1024


def adam_row(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, wd_mul: float,
             step: int, active: bool = True) -> tuple[float, ...]:
    """One row of the Adam table (columns :data:`~anvil_fast.kernels.bank_scalars.ADAM_COLUMNS`) for step
    count ``step`` (after incrementing) and ``lr`` including ``lr_mul``; Python doubles, as the seed
    computes them (``lr * (bias2 ** 0.5 / bias1)``, ``lr * lr * weight_decay * wd_mul``)."""
    if not active:  # eps 1 keeps the masked arithmetic of an inactive row finite
        return (0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0)
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    return (beta1, 1 - beta1, beta2, 1 - beta2, eps, lr * (bias2 ** 0.5 / bias1),
            lr * lr * weight_decay * wd_mul, 1.0)


if triton is not None:

    @triton.jit
    def _adam_elements(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, beta1, omb1, beta2, omb2, eps, step_size, eff_wd, active,
                       BF16_P: tl.constexpr, ROUND_FIX: tl.constexpr):
        # The update of the elements ``offs`` (the module docstring's formulas); shared by the kernels.
        p_raw = tl.load(p_ptr + offs, mask=mask, other=0.0)
        p = p_raw.to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        m_new = m * beta1 + g * omb1
        v_new = v * beta2 + g * g * omb2
        u = tl.div_rn(m_new, tl.sqrt_rn(v_new) + eps) * step_size
        u = u + tl.where(u * p > 0, p * eff_wd, 0.0)
        p_new = p - u
        keep = active > 0
        tl.store(m_ptr + offs, tl.where(keep, m_new, m), mask=mask)
        tl.store(v_ptr + offs, tl.where(keep, v_new, v), mask=mask)
        if BF16_P:
            p_out = to_bf16(p_new, ROUND_FIX)
        else:
            p_out = p_new.to(p_raw.dtype)
        tl.store(p_ptr + offs, tl.where(keep, p_out, p_raw), mask=mask)

    @triton.jit
    def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, seg_ptr, table_ptr, row, n, SEGMENTED: tl.constexpr,
                     BF16_P: tl.constexpr, ROUND_FIX: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if SEGMENTED:
            r = tl.load(seg_ptr + offs, mask=mask, other=0).to(tl.int64)
            t = table_ptr + r * 8
            beta1 = tl.load(t + 0, mask=mask, other=0.0)
            omb1 = tl.load(t + 1, mask=mask, other=0.0)
            beta2 = tl.load(t + 2, mask=mask, other=0.0)
            omb2 = tl.load(t + 3, mask=mask, other=0.0)
            eps = tl.load(t + 4, mask=mask, other=1.0)
            step_size = tl.load(t + 5, mask=mask, other=0.0)
            eff_wd = tl.load(t + 6, mask=mask, other=0.0)
            active = tl.load(t + 7, mask=mask, other=0.0)
        else:
            t = table_ptr + row * 8
            beta1 = tl.load(t + 0)
            omb1 = tl.load(t + 1)
            beta2 = tl.load(t + 2)
            omb2 = tl.load(t + 3)
            eps = tl.load(t + 4)
            step_size = tl.load(t + 5)
            eff_wd = tl.load(t + 6)
            active = tl.load(t + 7)
        _adam_elements(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, beta1, omb1, beta2, omb2, eps, step_size, eff_wd,
                       active, BF16_P, ROUND_FIX)


    @triton.jit
    def _adam_table_kernel(blocks_ptr, addr_ptr, gaddr_ptr, meta_ptr, table_ptr, BF16_P: tl.constexpr,
                           ROUND_FIX: tl.constexpr, BLOCK: tl.constexpr):
        # Many parameters in one launch: program i updates block blocks[i, 1] of parameter
        # j = blocks[i, 0], whose parameter and moments are at the addresses addr[j, 0:3], its
        # gradient at gaddr[j], its element count and table row meta[j]. A gradient address of 0 (no
        # gradient this step) leaves the parameter and its moments untouched, as an inactive row does.
        j = tl.load(blocks_ptr + 2 * tl.program_id(0)).to(tl.int64)
        blk = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1).to(tl.int64)
        n = tl.load(meta_ptr + 2 * j).to(tl.int64)
        row = tl.load(meta_ptr + 2 * j + 1).to(tl.int64)
        g_addr = tl.load(gaddr_ptr + j)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = (offs < n) & (offs * 0 + g_addr != 0)
        if BF16_P:
            p_ptr = tl.load(addr_ptr + 3 * j).to(tl.pointer_type(tl.bfloat16))
            g_ptr = g_addr.to(tl.pointer_type(tl.bfloat16))
        else:
            p_ptr = tl.load(addr_ptr + 3 * j).to(tl.pointer_type(tl.float32))
            g_ptr = g_addr.to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(addr_ptr + 3 * j + 1).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(addr_ptr + 3 * j + 2).to(tl.pointer_type(tl.float32))
        t = table_ptr + row * 8
        beta1 = tl.load(t + 0)
        omb1 = tl.load(t + 1)
        beta2 = tl.load(t + 2)
        omb2 = tl.load(t + 3)
        eps = tl.load(t + 4)
        step_size = tl.load(t + 5)
        eff_wd = tl.load(t + 6)
        active = tl.load(t + 7)
        _adam_elements(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, beta1, omb1, beta2, omb2, eps, step_size, eff_wd,
                       active, BF16_P, ROUND_FIX)


def adam_block_table(numels: list[int], rows: list[int], device) -> tuple[Tensor, Tensor]:
    """The launch tables of :func:`adam_table_`: ``blocks`` (int32 [total blocks, 2]: parameter,
    block) and ``meta`` (int64 [parameters, 2]: element count, table row), built once."""
    blocks = [(j, b) for j, n in enumerate(numels) for b in range(-(-n // BLOCK))]
    return (torch.tensor(blocks or [(0, 0)], dtype=torch.int32, device=device).reshape(-1, 2),
            torch.tensor(list(zip(numels, rows)), dtype=torch.int64, device=device).reshape(-1, 2))


def adam_table_(blocks: Tensor, addresses: Tensor, grad_addresses: Tensor, meta: Tensor, table: Tensor, *,
                bf16: bool) -> None:
    """Adam on many parameters of one dtype in one launch, each read and written where it lives:
    ``addresses`` (int64 ``[parameters, 3]``: parameter, exp_avg, exp_avg_sq) and
    ``grad_addresses`` (int64 ``[parameters]``; 0: no gradient this step) are device tables; the
    same update as :func:`adam_update_`, each parameter's scalars from its ``table`` row. Triton
    only (CUDA, or the interpreter)."""
    if not use_triton(blocks, "triton"):
        raise ValueError("adam_table_ needs Triton (CUDA, or TRITON_INTERPRET=1)")
    _adam_table_kernel[(blocks.shape[0],)](blocks, addresses, grad_addresses, meta, table, BF16_P=bool(bf16),
                                          ROUND_FIX=round_fix(), BLOCK=BLOCK)


def _check(p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> None:
    for name, x in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if x.numel() != p.numel():
            raise ValueError(f"adam: {name} has {x.numel()} elements, the parameter {p.numel()}")
        if not x.is_contiguous():
            raise ValueError(f"adam: {name} must be contiguous")
    if not p.is_contiguous():
        raise ValueError("adam: the parameter must be contiguous")
    if m.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"adam: moments must be float32, got {m.dtype}, {v.dtype}")


def adam_torch_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, cols: list[Tensor]) -> None:
    """The plain-torch pass (CPU fallback); ``cols`` are the table's columns, each a 0-D tensor or
    one value per element."""
    beta1, omb1, beta2, omb2, eps, step_size, eff_wd, active = cols
    gf = g.float()
    pf = p.float()
    m_new = m * beta1 + gf * omb1
    v_new = v * beta2 + gf * gf * omb2
    u = m_new / (v_new.sqrt() + eps) * step_size
    u = u + torch.where(u * pf > 0, pf * eff_wd, torch.zeros((), dtype=torch.float32))
    keep = active > 0
    m.copy_(torch.where(keep, m_new, m))
    v.copy_(torch.where(keep, v_new, v))
    p.copy_(torch.where(keep, (pf - u).to(p.dtype), p))


def adam_update_(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, table: Tensor, row: int, *,
                 backend: str = "auto") -> None:
    """Adam on one tensor (a sharded parameter's slice), its scalars from ``table[row]``; ``backend``
    as :func:`anvil_fast.kernels.backend.use_triton`."""
    _check(p, g, exp_avg, exp_avg_sq)
    n = p.numel()
    if n == 0:
        return
    if use_triton(p, backend):
        grid = (triton.cdiv(n, BLOCK),)
        _adam_kernel[grid](p, g, exp_avg, exp_avg_sq, table, table, row, n, SEGMENTED=False,
                           BF16_P=p.dtype == torch.bfloat16, ROUND_FIX=round_fix(), BLOCK=BLOCK)
    else:
        cols = [table[row, k] for k in range(N_COLS)]
        adam_torch_(p.view(-1), g.reshape(-1), exp_avg.view(-1), exp_avg_sq.view(-1), cols)


def fused_adam_(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, segment: Tensor, table: Tensor, *,
                backend: str = "auto") -> None:
    """Adam on flat buffers holding many parameters: element i uses ``table[segment[i]]``."""
    _check(p, g, exp_avg, exp_avg_sq)
    if segment.numel() != p.numel() or segment.dtype != torch.int32:
        raise ValueError("fused_adam_: segment must be int32 with one entry per element")
    n = p.numel()
    if n == 0:
        return
    if use_triton(p, backend):
        grid = (triton.cdiv(n, BLOCK),)
        _adam_kernel[grid](p, g, exp_avg, exp_avg_sq, segment, table, 0, n, SEGMENTED=True,
                           BF16_P=p.dtype == torch.bfloat16, ROUND_FIX=round_fix(), BLOCK=BLOCK)
    else:
        per_elem = table.index_select(0, segment.long())
        adam_torch_(p, g, exp_avg, exp_avg_sq, [per_elem[:, k] for k in range(N_COLS)])


__all__ = ["adam_row", "adam_update_", "fused_adam_", "adam_torch_", "adam_table_", "adam_block_table", "N_COLS"]
