"""Twin-rail momentum and the Nesterov lookahead, fused with the cast to the cascade's bf16 input
(seed: the first lines of ``anvil_cascade``; reference: :mod:`anvil_ref.rails`).

The seed's operations, in fp32 and in this order (each ``lerp`` as torch computes it)::

    g  = grad.float()
    v0 <- lerp(v0, g, 1 - beta_f)           fast rail (beta_f: 0-D device tensor)
    v1 <- lerp(v1, g, 1 - RAIL_SLOW_BETA)   slow rail
    b  = w * v0 + (1 - w) * v1              blend (w: 0-D device tensor)
    x  = lerp(g, b, mu)                     lookahead (mu: 0-D device tensor)
    X  = bf16(x)                            the cascade's input

The per-step scalars are 0-D device tensors, so new values never recompile and a captured CUDA
graph reads the current ones.

``prescale=True`` (the safe configuration) clamps x to bf16's largest finite value before the cast,
so no finite x becomes inf. The configuration's power-of-two prescale itself is *not* applied here
but by the normalization (:func:`anvil_fast.core.cascade.cascade_workspace`), which reads the bf16 X
anyway: finding ``max|x|`` before the cast would need a second pass over the fp32 gradient and both
rails (the reduction must finish before the first scaled element can be written), about 3x this
phase's bytes. Since bf16 and fp32 share their exponent range, casting before scaling by an exact
power of two loses nothing outside fp32's subnormal range.

Two implementations of the same operations:

* ``fused=False``: the seed's code above, run through torch.compile (the FAITHFUL configuration:
  the seed's operations as the seed compiles them).
* ``fused=True`` (the SAFE configuration, on CUDA): one Triton kernel. Why not the compiled code:
  measured on an H200 (anvil_fast/NOTES.md), the compiled function took as long as moving ~55 bytes per
  element would, where 20 are needed (read the bf16 gradient and both fp32 rails, write both rails
  and the bf16 X). The kernel does exactly one read and one write of each and, while every element
  of X is in registers, writes the per-block partials of the normalization
  (:mod:`anvil_fast.kernels.normalize`), so the normalization need not read X to find its scale and norm. Each ``lerp`` is torch's formula
  (``a + w (b - a)`` for ``|w| < 0.5``, else ``b - (b - a)(1 - w)``) with the multiply-add fused
  (``fma``), as torch's CUDA and vectorized CPU lerps contract it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from anvil_ref.constants import NORM_BLOCK, RAIL_SLOW_BETA
from anvil_ref.storage import RAIL_KEY_MULTIPLIER

from .compiled import maybe_compiled, want_compile
from .backend import matrix_slices, round_fix, triton_available, use_triton, widen_fix
from .normalize import NORM_WARPS, NormPartials, blocks_per_matrix

#: Clamp of the prescale exponent, so that ``2**-e`` and ``eps * 2**-e`` stay finite in fp32.
PRESCALE_EXP_LIMIT = 126
#: bf16's largest finite value (the SAFE cast clamps to it).
BF16_MAX = torch.finfo(torch.bfloat16).max

if triton_available():
    import triton
    import triton.language as tl

    from .backend import from_bf16, to_bf16
    from .normalize import tile_partials
else:  # pragma: no cover - exercised only where triton is absent
    triton = None


def _hash32_torch(x: Tensor) -> Tensor:
    # anvil_ref.storage.hash32 on int64 tensors holding uint32 values (torch has no uint32 shifts on
    # every device; the products stay below 2**64 since both factors are below 2**32).
    m = 0xFFFFFFFF
    x = x & m
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _stochastic_bf16_torch(v: Tensor, step: Tensor, salt: int, index: Tensor) -> Tensor:
    """:func:`anvil_ref.storage.stochastic_round_bf16` of fp32 ``v`` as a bf16 tensor (bit for bit)."""
    key = _hash32_torch(step.to(torch.int64) * RAIL_KEY_MULTIPLIER + salt)
    r = _hash32_torch(index ^ key) & 0xFFFF
    bits = v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((bits + r) >> 16) & 0xFFFF
    return (hi - ((hi >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def _rails_lookahead(grad: Tensor, velocity: Tensor, momentum_t: Tensor, fast_beta_t: Tensor,
                     fast_weight_t: Tensor, x_out: Tensor, prescale: bool) -> None:
    g = grad.float()
    momentum = momentum_t.to(g.dtype)
    velocity[0].lerp_(g, 1 - fast_beta_t.to(g.dtype))
    velocity[1].lerp_(g, 1 - RAIL_SLOW_BETA)
    w = fast_weight_t.to(g.dtype)
    blend = w * velocity[0] + (1 - w) * velocity[1]
    g = g.lerp(blend, momentum)
    x_out.copy_(g.clamp(-BF16_MAX, BF16_MAX) if prescale else g)


def _rails_lookahead_masked(grad: Tensor, velocity: Tensor, momentum_t: Tensor, fast_beta_t: Tensor,
                            fast_weight_t: Tensor, x_out: Tensor, prescale: bool, active: Tensor,
                            sr_step: Tensor | None, index: Tensor | None) -> None:
    # The same operations as _rails_lookahead, out of place, then kept only where ``active`` (a
    # [chunk, 1, 1] mask; an inactive matrix keeps its rails and gets X = 0); bf16 rails (the lean
    # state, ``sr_step`` given) are widened before and rounded stochastically after.
    g = grad.float()
    on = active != 0
    momentum = momentum_t.to(g.dtype)
    v0_old, v1_old = velocity[0].float(), velocity[1].float()
    v0 = v0_old.lerp(g, 1 - fast_beta_t.to(g.dtype))
    v1 = v1_old.lerp(g, 1 - RAIL_SLOW_BETA)
    w = fast_weight_t.to(g.dtype)
    x = g.lerp(w * v0 + (1 - w) * v1, momentum)
    if index is None:  # fp32 rails
        velocity[0].copy_(torch.where(on, v0, v0_old))
        velocity[1].copy_(torch.where(on, v1, v1_old))
    else:
        velocity[0].copy_(torch.where(on, _stochastic_bf16_torch(v0, sr_step, 0, index), velocity[0]))
        velocity[1].copy_(torch.where(on, _stochastic_bf16_torch(v1, sr_step, 1, index), velocity[1]))
    x = torch.where(on, x, torch.zeros((), dtype=x.dtype, device=x.device))
    x_out.copy_(x.clamp(-BF16_MAX, BF16_MAX) if prescale else x)


if triton is not None:

    @triton.jit
    def _lerp(a, b, w):
        # torch's lerp (ATen/native/Lerp.h) with the multiply-add fused.
        d = b - a
        return tl.where(tl.abs(w) < 0.5, tl.fma(w, d, a), tl.fma(-(1.0 - w), d, b))

    @triton.jit
    def _hash32(x):
        # anvil_ref.storage.hash32 on uint32 (products wrap modulo 2**32; the constants are made
        # uint32, since a literal past 2**31 would promote the product to int64).
        x = x ^ (x >> 16)
        x = x * tl.full((), 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full((), 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _stochastic_bf16(v, key, idx):
        # anvil_ref.storage.stochastic_round_bf16: add 16 random bits to the fp32 pattern, keep the
        # high half.
        r = _hash32(idx ^ key) & 0xFFFF
        bits = v.to(tl.uint32, bitcast=True)
        return ((bits + r) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _rails_kernel(g_ptr, gptrs_ptr, act_ptr, v0_ptr, v1_ptr, x_ptr, mu_ptr, fb_ptr, w_ptr, pa_ptr, ps_ptr,
                      step_ptr, slow_w, bf16_max, mn, nb, first, CLAMP: tl.constexpr, PARTIALS: tl.constexpr,
                      GPTRS: tl.constexpr, G_BF16: tl.constexpr, ACTIVE: tl.constexpr, LEAN: tl.constexpr,
                      LIMIT: tl.constexpr, ROUND_FIX: tl.constexpr, WIDEN_FIX: tl.constexpr, BLOCK: tl.constexpr):
        # Program (b, c): elements [b BLOCK, (b + 1) BLOCK) of matrix c (blocks never straddle two
        # matrices, so each block's partials belong to one matrix's norm).
        b = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        inner = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = inner < mn
        offs = c * mn + inner
        if ACTIVE:
            # an inactive matrix (no gradient, or a step the device refused) keeps its rails, X = 0
            on = (inner * 0 + tl.load(act_ptr + c)) != 0
        else:
            on = inner >= 0
        mu = tl.load(mu_ptr)
        fw = 1.0 - tl.load(fb_ptr)
        w = tl.load(w_ptr)
        if GPTRS:
            # the gradient read where autograd left it: matrix c's address from a device table
            base = tl.load(gptrs_ptr + c)
            if G_BF16:
                g_raw = tl.load(base.to(tl.pointer_type(tl.bfloat16)) + inner, mask=m & on, other=0.0)
            else:
                g_raw = tl.load(base.to(tl.pointer_type(tl.float32)) + inner, mask=m & on, other=0.0)
        else:
            g_raw = tl.load(g_ptr + offs, mask=m, other=0.0)
        if g_raw.dtype == tl.bfloat16:
            g = from_bf16(g_raw, WIDEN_FIX)
        else:
            # an fp32 gradient travels in bf16, as the seed's: rounded once, here in registers
            g = from_bf16(to_bf16(g_raw.to(tl.float32), ROUND_FIX), WIDEN_FIX)
        v0_raw = tl.load(v0_ptr + offs, mask=m, other=0.0)
        v1_raw = tl.load(v1_ptr + offs, mask=m, other=0.0)
        if LEAN:
            v0 = _lerp(from_bf16(v0_raw, WIDEN_FIX), g, fw)
            v1 = _lerp(from_bf16(v1_raw, WIDEN_FIX), g, slow_w)
            t = tl.load(step_ptr).to(tl.uint32)
            key0 = _hash32(t * tl.full((), 0x9E3779B9, tl.uint32))
            key1 = _hash32(t * tl.full((), 0x9E3779B9, tl.uint32) + tl.full((), 1, tl.uint32))
            idx = (first * mn + offs).to(tl.uint32)
            tl.store(v0_ptr + offs, _stochastic_bf16(v0, key0, idx), mask=m & on)
            tl.store(v1_ptr + offs, _stochastic_bf16(v1, key1, idx), mask=m & on)
        else:
            v0 = _lerp(v0_raw, g, fw)
            v1 = _lerp(v1_raw, g, slow_w)
            tl.store(v0_ptr + offs, v0, mask=m & on)
            tl.store(v1_ptr + offs, v1, mask=m & on)
        x = _lerp(g, w * v0 + (1.0 - w) * v1, mu)
        if CLAMP:
            x = tl.minimum(tl.maximum(x, -bf16_max, propagate_nan=tl.PropagateNan.ALL), bf16_max,
                           propagate_nan=tl.PropagateNan.ALL)
        x = tl.where(on, x, 0.0)
        xb = to_bf16(x, ROUND_FIX)
        tl.store(x_ptr + offs, xb, mask=m)
        if PARTIALS:
            amax, ss = tile_partials(tl.where(m, from_bf16(xb, WIDEN_FIX), 0.0), LIMIT)
            tl.store(pa_ptr + c * nb + b, amax)
            tl.store(ps_ptr + c * nb + b, ss)


def _check_fused(grad: Tensor | None, velocity: Tensor, x_out: Tensor, partials: NormPartials | None) -> None:
    shape = tuple(x_out.shape)
    if len(shape) != 3:
        raise ValueError(f"rails: x_out must be [chunk, rows, cols], got {shape}")
    checks = [("velocity", velocity, (torch.float32, torch.bfloat16), (2, *shape)),
              ("x_out", x_out, (torch.bfloat16,), shape)]
    if grad is not None:
        checks.insert(0, ("grad", grad, (torch.bfloat16, torch.float32), shape))
    for name, t, dt, want in checks:
        if t.dtype not in dt or tuple(t.shape) != want or not t.is_contiguous() or t.device != x_out.device:
            raise ValueError(f"rails: {name} must be a contiguous {' or '.join(map(str, dt))} tensor of shape "
                             f"{want} on {x_out.device}, got {t.dtype} {tuple(t.shape)} on {t.device} "
                             f"(contiguous: {t.is_contiguous()})")
    if partials is not None:
        want = (shape[0], blocks_per_matrix(shape[1], shape[2]))
        if tuple(partials.amax.shape) != want or tuple(partials.sumsq.shape) != want:
            raise ValueError(f"rails: partials must be [chunk, blocks] = {want}, got {tuple(partials.amax.shape)}")


def _rails_fused(grad: Tensor | None, velocity: Tensor, momentum_t: Tensor, fast_beta_t: Tensor,
                 fast_weight_t: Tensor, x_out: Tensor, prescale: bool, partials: NormPartials | None, *,
                 grad_ptrs: Tensor | None = None, grad_dtype: torch.dtype | None = None,
                 active: Tensor | None = None, sr_step: Tensor | None = None, first: int = 0) -> None:
    _check_fused(grad, velocity, x_out, partials)
    chunk, rows, cols = x_out.shape
    mn, nb = rows * cols, blocks_per_matrix(rows, cols)
    v0, v1 = velocity[0], velocity[1]
    lean = velocity.dtype == torch.bfloat16
    if not lean:
        sr_step = None
    elif sr_step is None:
        raise ValueError("rails: bf16 rails (the lean state) need sr_step, the device step counter of their rounding")
    for s, e in matrix_slices(chunk):
        pa = partials.amax[s:e] if partials is not None else x_out  # unused when PARTIALS is off
        ps = partials.sumsq[s:e] if partials is not None else x_out
        _rails_kernel[(nb, e - s)](
            grad[s:e] if grad is not None else x_out, grad_ptrs[s:e] if grad_ptrs is not None else x_out,
            active.reshape(-1)[s:e] if active is not None else x_out, v0[s:e], v1[s:e], x_out[s:e], momentum_t,
            fast_beta_t, fast_weight_t, pa, ps, sr_step if sr_step is not None else momentum_t, 1 - RAIL_SLOW_BETA,
            BF16_MAX, mn, nb, first + s, CLAMP=bool(prescale), PARTIALS=partials is not None,
            GPTRS=grad_ptrs is not None, G_BF16=grad_dtype == torch.bfloat16, ACTIVE=active is not None, LEAN=lean,
            LIMIT=PRESCALE_EXP_LIMIT, ROUND_FIX=round_fix(), WIDEN_FIX=widen_fix(), BLOCK=NORM_BLOCK,
            num_warps=NORM_WARPS)


def twin_rail(grad: Tensor | None, velocity: Tensor, *, momentum: Tensor, fast_beta: Tensor, fast_weight: Tensor,
              x_out: Tensor, prescale: bool = False, fused: bool = False, partials: NormPartials | None = None,
              grad_ptrs: Tensor | None = None, grad_dtype: torch.dtype | None = None, active: Tensor | None = None,
              sr_step: Tensor | None = None, first: int = 0, backend: str = "auto",
              compile: bool | None = None) -> bool:
    """:func:`anvil_ref.rails.twin_rail` in place: one twin-rail step on ``velocity`` ([2, *chunk]
    fp32, or bf16 for the lean state), writing the lookahead, the cascade's bf16 input, into
    ``x_out`` ([*chunk] bf16; clamped to bf16's finite range when ``prescale``). ``grad`` is the
    bf16 (or fp32) gradient; it is not written. ``momentum``, ``fast_beta``, ``fast_weight``: 0-D
    fp32 device tensors, keyword-only as in the reference (three same-typed rates: a positional
    swap would run).

    ``fused``: run the Triton kernel where ``backend`` lets it (:func:`anvil_fast.kernels.backend.use_triton`),
    else the compiled torch code. ``partials``: with the kernel, also write X's normalization
    partials there. Returns True when the partials were written (the caller's normalization may
    then skip its own pass).

    ``grad_ptrs`` (kernel only): instead of ``grad``, an int64 ``[chunk]`` device table of each
    matrix's gradient address (dtype ``grad_dtype``), so the kernel reads gradients where autograd
    wrote them and a CUDA graph replays whatever those addresses are. ``active``: an int32 ``[chunk]``
    device mask; an inactive matrix keeps its rails bit for bit and gets ``X = 0``. bf16 rails round
    stochastically (:func:`anvil_ref.storage.stochastic_round_bf16`) with the bits of the 0-D int
    device step ``sr_step`` and each element's index in the bank (``first``: the index of this
    chunk's first matrix in its bank, so that a sharded bank draws the same bits)."""
    masked = active is not None or velocity.dtype == torch.bfloat16
    if grad_ptrs is not None or (fused and use_triton(x_out, backend)):
        if grad_ptrs is not None and not use_triton(x_out, "triton" if backend == "auto" else backend):
            raise ValueError("rails: grad_ptrs needs the Triton kernel (CUDA, or the interpreter)")
        _rails_fused(grad, velocity, momentum, fast_beta, fast_weight, x_out, bool(prescale), partials,
                     grad_ptrs=grad_ptrs, grad_dtype=grad_dtype, active=active, sr_step=sr_step, first=first)
        return partials is not None
    if grad is None:
        raise ValueError("rails: grad is required without grad_ptrs")
    if not masked:
        fn = maybe_compiled(_rails_lookahead, want_compile(compile, grad))
        fn(grad, velocity, momentum, fast_beta, fast_weight, x_out, bool(prescale))
        return False
    chunk, rows, cols = x_out.shape
    if active is None:
        active = torch.ones((chunk, 1, 1), dtype=torch.int32, device=x_out.device)
    index = None
    if velocity.dtype == torch.bfloat16:
        if sr_step is None:
            raise ValueError("rails: bf16 rails (the lean state) need sr_step, the device step counter of their "
                             "rounding")
        index = (first * rows * cols + torch.arange(chunk * rows * cols, device=x_out.device)).view(chunk, rows, cols)
    fn = maybe_compiled(_rails_lookahead_masked, want_compile(compile, grad))
    fn(grad, velocity, momentum, fast_beta, fast_weight, x_out, bool(prescale), active.reshape(chunk, 1, 1),
       sr_step if index is not None else None, index)
    return False
