"""The device-decided step's scalars in one launch: :func:`derive_scalars_triton`, the Triton form of
:func:`anvil_fast.optim.device_step.derive_scalars` (its docstring has the formulas; that torch function
is the specification and the CPU's implementation).

Why a kernel of its own: compiled, the torch function is a chain of about ten tiny Inductor kernels
(a reduction for ``ok``, the record table's gather, the concatenation, the staging gather, one kernel
per state it advances), each a microsecond of work behind a launch gap, and the whole chain sits at
the head of every step, before any bank can start. Here one program does it all: it reads the flags
once, evaluates each staging position's value straight from its index in the concatenation (no
concatenated buffer), and writes the step's state after a barrier.

The same float64 operations in the same order, rounded once to fp32, so it writes what the compiled
torch function writes: no sum here has a product beside it that could be contracted into an FMA,
divisions round to nearest, and Adam's ``beta**t`` is CUDA's ``pow`` (libdevice), as Inductor's code
calls it. The interpreter has no libdevice: there ``pow`` is ``exp2(t log2 b)``, exact where ``b`` is a
power of two and ``t`` an integer (the interpreter tests use such betas); the GPU test holds the
native form to the compiled function bit for bit.

One program, one element per thread (:data:`SCALARS_BLOCK` = 32 x :data:`SCALARS_WARPS`): a thread
runs CUDA's float64 ``pow`` as a long dependent chain, so the staging positions go one per thread
and most models' fit in one pass (one warp looping over them took 30 us on an H100). Every
element is loaded and stored by the thread that owns it, the state read before the barrier is
written only after it, and a scalar read-modify-write (the counters, the lean rails' step) reads its
old value before the barrier, so no thread can see another's store.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import interpreting, triton_available

#: Warps of the one program, and elements per loop step: one per thread, none owned by two threads.
SCALARS_WARPS = 16
SCALARS_BLOCK = 32 * SCALARS_WARPS

if triton_available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
else:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:

    @triton.jit
    def _pow(b, t, NATIVE_POW: tl.constexpr):
        if NATIVE_POW:
            return libdevice.pow(b, t)
        else:
            return tl.exp2(t * tl.log2(b))

    @triton.jit
    def _scalars_kernel(hyper_ptr, has_ptr, flags_ptr, counters_ptr, last_bad_ptr, steps_ptr, rail_ptr, active_ptr,
                        out_ptr, lr_coef_ptr, wd_coef_ptr, alr_mul_ptr, awd_mul_ptr, inactive_ptr, gather_ptr,
                        record_ptr, n_flags, n_bank, n_mat, n_adam, n_out, n_record, RECORD: tl.constexpr,
                        LEAN: tl.constexpr, NATIVE_POW: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        # ok: no flag set
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for k in range(0, n_flags, BLOCK):
            f = tl.load(flags_ptr + k + i, mask=k + i < n_flags, other=0)
            bad = tl.maximum(bad, (f != 0).to(tl.int32))
        ok = 1 - tl.max(bad, axis=0)
        lr = tl.load(hyper_ptr + 0)
        mom = tl.load(hyper_ptr + 1)
        fb = tl.load(hyper_ptr + 2)
        fw = tl.load(hyper_ptr + 3)
        wd = tl.load(hyper_ptr + 4)
        alr = tl.load(hyper_ptr + 5)
        b1 = tl.load(hyper_ptr + 6)
        b2 = tl.load(hyper_ptr + 7)
        eps = tl.load(hyper_ptr + 8)
        awd = tl.load(hyper_ptr + 9)
        taken = tl.load(counters_ptr + 0)
        skipped = tl.load(counters_ptr + 1)
        if RECORD:
            t = tl.minimum(tl.maximum(taken, 0), n_record - 1).to(tl.int64)
            mom = tl.load(record_ptr + 3 * t + 0).to(tl.float64)
            fb = tl.load(record_ptr + 3 * t + 1).to(tl.float64)
            fw = tl.load(record_ptr + 3 * t + 2).to(tl.float64)
        if LEAN:
            rail = tl.load(rail_ptr)
        # The staging buffer: each position's value from its index g in derive_scalars' concatenation
        # [4 fields per bank | eff_lr per matrix | 8 columns per Adam row | 0].
        n_field = 4 * n_bank
        n_lr = n_field + n_mat
        n_row = n_lr + 8 * n_adam
        for k in range(0, n_out, BLOCK):
            m = k + i < n_out
            g = tl.load(gather_ptr + k + i, mask=m, other=n_row)
            is_f = g < n_field
            is_l = (g >= n_field) & (g < n_lr)
            is_a = (g >= n_lr) & (g < n_row)
            q = g % 4
            wdc = tl.load(wd_coef_ptr + g // 4, mask=m & is_f, other=0.0)
            field = tl.where(q == 0, mom, tl.where(q == 1, wdc * wd * lr, tl.where(q == 2, fb, fw)))
            eff_lr = tl.load(lr_coef_ptr + (g - n_field), mask=m & is_l, other=0.0) * lr
            r = (g - n_lr) // 8
            c = (g - n_lr) % 8
            act = tl.load(has_ptr + n_mat + r, mask=m & is_a, other=0) * ok
            on = act != 0
            steps = tl.load(steps_ptr + r, mask=m & is_a, other=1.0) + act.to(tl.float64)
            lr_row = alr * tl.load(alr_mul_ptr + r, mask=m & is_a, other=0.0)
            bias1 = 1 - _pow(b1, steps, NATIVE_POW)
            bias2 = 1 - _pow(b2, steps, NATIVE_POW)
            half = tl.full([BLOCK], 0.5, tl.float64)
            step_size = tl.where(on, lr_row * (_pow(bias2, half, NATIVE_POW) / tl.where(on, bias1, 1.0)), 0.0)
            eff_wd = lr_row * lr_row * awd * tl.load(awd_mul_ptr + r, mask=m & is_a, other=0.0)
            col = tl.where(c == 0, b1, tl.where(c == 1, 1 - b1, tl.where(c == 2, b2, tl.where(c == 3, 1 - b2, tl.where(
                c == 4, eps, tl.where(c == 5, step_size, tl.where(c == 6, eff_wd, 1.0)))))))
            col = tl.where(on, col, tl.load(inactive_ptr + c, mask=m & is_a, other=0.0))
            val = tl.where(is_f, field, tl.where(is_l, eff_lr, tl.where(is_a, col, 0.0)))
            tl.store(out_ptr + k + i, val.to(tl.float32), mask=m)
        tl.debug_barrier()
        # the step's state, after every read of its old values above
        for k in range(0, n_mat, BLOCK):
            m = k + i < n_mat
            tl.store(active_ptr + k + i, tl.load(has_ptr + k + i, mask=m, other=0) * ok, mask=m)
        for k in range(0, n_adam, BLOCK):
            m = k + i < n_adam
            a = tl.load(has_ptr + n_mat + k + i, mask=m, other=0) * ok
            tl.store(steps_ptr + k + i, tl.load(steps_ptr + k + i, mask=m, other=0.0) + a.to(tl.float64), mask=m)
        for k in range(0, n_flags, BLOCK):
            m = k + i < n_flags
            f = tl.load(flags_ptr + k + i, mask=m, other=0)
            lb = tl.load(last_bad_ptr + k + i, mask=m, other=0)
            tl.store(last_bad_ptr + k + i, tl.where(ok != 0, lb, f), mask=m)
        tl.store(counters_ptr + 0, taken + ok)
        tl.store(counters_ptr + 1, skipped + (1 - ok))
        if LEAN:
            tl.store(rail_ptr, rail + ok.to(rail.dtype))


def _check(name: str, t: Tensor, dtype: torch.dtype, device) -> None:
    if t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"scalars: {name} must be a contiguous {dtype} tensor on {device}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")


def derive_scalars_triton(hyper: Tensor, has: Tensor, flags: Tensor, counters: Tensor, last_bad: Tensor,
                          adam_steps: Tensor, rail_step: Tensor, bank_active: Tensor, out_values: Tensor,
                          lr_coef: Tensor, wd_coef: Tensor, adam_lr_mul: Tensor, adam_wd_mul: Tensor, inactive: Tensor,
                          gather: Tensor, record: Tensor | None, n_bank: int, n_mat: int, lean: bool) -> None:
    """:func:`anvil_fast.optim.device_step.derive_scalars` (same arguments, same writes) in one launch."""
    dev = hyper.device
    f64, f32, i32 = torch.float64, torch.float32, torch.int32
    for name, t, dt in (("hyper", hyper, f64), ("has", has, i32), ("flags", flags, i32), ("counters", counters, i32),
                        ("last_bad", last_bad, i32), ("adam_steps", adam_steps, f64),
                        ("bank_active", bank_active, i32), ("out_values", out_values, f32), ("lr_coef", lr_coef, f64),
                        ("wd_coef", wd_coef, f64), ("adam_lr_mul", adam_lr_mul, f64),
                        ("adam_wd_mul", adam_wd_mul, f64), ("inactive", inactive, f64), ("gather", gather, torch.int64)):
        _check(name, t, dt, dev)
    n_adam = adam_steps.numel()
    if hyper.numel() != 10 or counters.numel() != 2 or last_bad.numel() != flags.numel() \
            or bank_active.numel() != n_mat or lr_coef.numel() != n_mat or wd_coef.numel() != n_bank \
            or has.numel() != n_mat + n_adam or inactive.numel() != 8 or gather.numel() != out_values.numel():
        raise ValueError(f"scalars: sizes disagree (hyper {hyper.numel()}, counters {counters.numel()}, flags "
                         f"{flags.numel()} / last_bad {last_bad.numel()}, {n_mat} matrices: bank_active "
                         f"{bank_active.numel()}, lr_coef {lr_coef.numel()}; {n_bank} banks: wd_coef {wd_coef.numel()};"
                         f" has {has.numel()} for {n_mat} + {n_adam}; inactive {inactive.numel()}; gather "
                         f"{gather.numel()} for {out_values.numel()} staging values)")
    if record is not None:
        _check("record", record, f32, dev)
        if record.ndim != 2 or record.shape[1] != 3 or record.shape[0] < 1:
            raise ValueError(f"scalars: record must be [steps, 3], got {tuple(record.shape)}")
    def ptr(t: Tensor | None) -> Tensor:
        # an empty tensor's address may be null, which the launcher refuses; nothing reads it (masks)
        return t if t is not None and t.numel() else hyper

    _scalars_kernel[(1,)](
        hyper, ptr(has), flags, counters, last_bad, ptr(adam_steps), rail_step, ptr(bank_active), out_values,
        ptr(lr_coef), ptr(wd_coef), ptr(adam_lr_mul), ptr(adam_wd_mul), inactive, gather, ptr(record), flags.numel(), n_bank,
        n_mat, n_adam, out_values.numel(), record.shape[0] if record is not None else 1, RECORD=record is not None,
        LEAN=bool(lean), NATIVE_POW=not interpreting(), BLOCK=SCALARS_BLOCK, num_warps=SCALARS_WARPS)


__all__ = ["derive_scalars_triton", "SCALARS_BLOCK", "SCALARS_WARPS"]
