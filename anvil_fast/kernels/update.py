"""Sign-aligned decay and the parameter update on a bf16 parameter with a uint16 mantissa
(seed: ``AnvilAndAdam._sign_aligned_decay_update``; reference: :mod:`anvil_ref.update` for the math,
:mod:`anvil_ref.storage` for the bits).

The fp32 master weight is the bit pattern ``(p << 16) | mantissa``: ``p`` is the bf16 parameter the
model reads (the master truncated), ``mantissa`` its low half. One step, all in fp32 and in the seed's
order::

    W   = master(p, mantissa)
    on  = (gate * W >= 0)                       gate: the slow rail (fp32)
    W' = W - W * on * eff_wd * eff_lr - U * eff_lr
    p, mantissa <- high and low halves of W'

so the master is exact fp32 and the bf16 parameter is always its truncation.

Why not the seed's shifts: the seed widens to uint32 and shifts (``p.to(uint32) << 16``), and torch
on the CPU implements no shifts for uint32. This module forms the same bit pattern with int32
arithmetic that both devices implement and that cannot overflow::

    raw = int32(int16 view of p) * 65536 + (int32(int16 view of mantissa) & 0xFFFF)
    hi  = raw >> 16                (arithmetic shift: back to the signed 16-bit pattern)
    lo  = raw & 0xFFFF, wrapped to int16 by subtracting 65536 when bit 15 is set

``raw`` is the two's-complement int32 whose bits are ``(p << 16) | mantissa``; viewing it as float32
gives the master. Tests check it against :func:`anvil_ref.storage.join_fp32` / ``split_fp32`` on all
16-bit halves that matter (signs, zeros, subnormals, infinities, NaN payloads).

Two implementations of the same operations, chosen by ``fused``:

* ``fused=False``: the functions below through torch.compile (the FAITHFUL configuration, as the seed).
* ``fused=True`` (the SAFE configuration) where Triton runs: :func:`_update_kernel`, one program per
  tile of one matrix. Why a hand-written kernel for an element-wise pass Inductor fuses well: it is the
  step's only torch.compile'd function, so with it the drop-in's first step traces and generates
  nothing through Dynamo and Inductor (one trace, code generation and compile per bank shape); the
  kernel takes the shape as arguments and compiles once per storage form. It writes the same bits:
  the same fp32 operations in the same order, the joins, splits and the bf16 rounding on the bits,
  and the compiler's contraction of a multiply into the following subtraction left on, as Inductor
  leaves it (``enable_fp_fusion``); the tests compare both forms bit for bit.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from .backend import matrix_slices, triton_available, use_triton
from .compiled import maybe_compiled, want_compile

if triton_available():
    import triton
    import triton.language as tl

    from .backend import from_bf16
else:  # pragma: no cover - exercised only where triton is absent
    triton = None


def join_fp32(p16: Tensor, m16: Tensor) -> Tensor:
    """fp32 master from the int16 views of the parameter and the mantissa (bit-exact;
    :func:`anvil_ref.storage.join_fp32` in int32 arithmetic that ``torch.compile`` and both devices run)."""
    raw = p16.to(torch.int32) * 65536 + (m16.to(torch.int32) & 0xFFFF)
    return raw.view(torch.float32)


def split_fp32(w: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) int16 halves of an fp32 tensor's bit pattern (:func:`anvil_ref.storage.split_fp32`)."""
    raw = w.view(torch.int32)
    hi = (raw >> 16).to(torch.int16)
    lo = raw & 0xFFFF
    lo = (lo - ((lo >> 15) << 16)).to(torch.int16)
    return hi, lo


def _halves(master: Tensor) -> tuple[Tensor, Tensor]:
    # An fp32's bit pattern, little-endian, is the int16 pair (low half, high half): the halves are
    # strided int16 views, so splitting and joining are two plain copies each (one pass over the
    # bytes, no integer arithmetic) instead of the shift-and-mask form above.
    pairs = master.view(torch.int16).view(*master.shape, 2)
    return pairs[..., 1], pairs[..., 0]


_LITTLE_ENDIAN = sys.byteorder == "little"


def split_fp32_(master: Tensor, hi: Tensor, lo: Tensor) -> None:
    """``hi``/``lo`` (bf16, uint16) = the high/low 16 bits of fp32 ``master`` (exact), in place: the
    drop-in's split of an fp32 parameter into a bank's parameter and mantissa."""
    h, l_ = _halves(master) if _LITTLE_ENDIAN else split_fp32(master)
    hi.view(torch.int16).copy_(h)
    lo.view(torch.int16).copy_(l_)


def join_fp32_(hi: Tensor, lo: Tensor, master: Tensor) -> None:
    """fp32 ``master`` = the bit pattern ``(hi << 16) | lo`` (exact)."""
    if not _LITTLE_ENDIAN:  # pragma: no cover - every CUDA host is little-endian
        master.copy_(join_fp32(hi.view(torch.int16), lo.view(torch.int16)))
        return
    h, l_ = _halves(master)
    h.copy_(hi.view(torch.int16))
    l_.copy_(lo.view(torch.int16))


def _bf16_rounded(x: Tensor) -> Tensor:
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), kept as fp32; exact for every finite x
    (an overflow rounds to inf, as the hardware cast does). Why on the bits: inside one fused kernel
    Inductor computes bf16 values in fp32 and drops an explicit ``.to(torch.bfloat16)`` followed by
    ``.float()``, so that rounding would silently vanish under torch.compile; integer arithmetic is
    kept as written. The same bit form as the kernels' ``to_bf16`` under the interpreter
    (:mod:`anvil_fast.kernels.backend`)."""
    r = x.view(torch.int32)
    r = (r + (0x7FFF + ((r >> 16) & 1))) & -65536
    return r.view(torch.float32)


def _equalized(update: Tensor, gain: Tensor, ok: Tensor, lanes_are_rows: bool) -> Tensor:
    """The equalizer's last step, as the update reads it: ``bf16(update * gain[lane])`` where the
    matrix passed the guard, else 0 (``_equalizer_apply_kernel`` of :mod:`anvil_fast.kernels.equalizer`,
    value for value: both form the product as one fp32 multiply, which nothing can contract, so only
    its rounding to bf16 needs care, and :func:`_bf16_rounded` does it). Only for guarded updates: a
    matrix with ``ok`` set has finite entries and a finite gain, the range where the bit form is exact."""
    g = gain.unsqueeze(-1) if lanes_are_rows else gain.unsqueeze(-2)
    scaled = _bf16_rounded(update.float() * g.float())
    return torch.where(ok.reshape(-1, 1, 1) != 0, scaled, torch.zeros((), dtype=torch.float32, device=update.device))


def _decayed(w: Tensor, update: Tensor, wd_tensor: Tensor, lr_tensor: Tensor, gate_src: Tensor) -> Tensor:
    """W' from the fp32 master W, in the seed's order of operations."""
    wd_factor = wd_tensor.to(torch.float32)
    lr_factor = lr_tensor.to(torch.float32)
    aligned = (gate_src.float() * w) >= 0
    return w - (w * aligned * wd_factor * lr_factor) - (update.float() * lr_factor)


def _sign_aligned_decay_update(p16: Tensor, m16: Tensor, update: Tensor, wd_tensor: Tensor, lr_tensor: Tensor,
                               gate_src: Tensor, active: Tensor | None = None, gain: Tensor | None = None,
                               ok: Tensor | None = None, lanes_are_rows: bool = True) -> None:
    w = join_fp32(p16, m16)
    if gain is not None:
        update = _equalized(update, gain, ok, lanes_are_rows)
    w_new = _decayed(w, update, wd_tensor, lr_tensor, gate_src)
    if active is not None:
        w_new = torch.where(active != 0, w_new, w)
    hi, lo = split_fp32(w_new)
    p16.copy_(hi)
    m16.copy_(lo)


def _sign_aligned_decay_update_fp32(w32: Tensor, update: Tensor, wd_tensor: Tensor, lr_tensor: Tensor,
                                    gate_src: Tensor, active: Tensor | None = None, gain: Tensor | None = None,
                                    ok: Tensor | None = None, lanes_are_rows: bool = True) -> None:
    # The same expression on the float32 master itself: the bf16 + mantissa form's join and split
    # are exact bit copies, so both write the same bits; this one skips the two passes over halves.
    if gain is not None:
        update = _equalized(update, gain, ok, lanes_are_rows)
    w_new = _decayed(w32, update, wd_tensor, lr_tensor, gate_src)
    w32.copy_(w_new if active is None else torch.where(active != 0, w_new, w32))


#: Rows x columns of one matrix per program of :func:`_update_kernel` (2048 elements, 16 per thread at
#: 4 warps: 16-byte loads of the 16-bit halves along a row, and the lane index is the tile's own row or
#: column, no division per element).
_TILE_ROWS, _TILE_COLS, _UPDATE_WARPS = 16, 128, 4

if triton is not None:

    @triton.jit
    def _update_kernel(p_ptr, m_ptr, u_ptr, gate_ptr, lr_ptr, wd_ptr, act_ptr, gain_ptr, ok_ptr, rows, cols,
                       col_tiles, MANTISSA: tl.constexpr, U_BF16: tl.constexpr, GATE_BF16: tl.constexpr,
                       ACTIVE: tl.constexpr, EQ: tl.constexpr, LANE_IS_ROW: tl.constexpr, TR: tl.constexpr,
                       TC: tl.constexpr):
        # The expressions of _sign_aligned_decay_update(_fp32) with _equalized, in their order.
        t = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        r = (t // col_tiles) * TR + tl.arange(0, TR)
        k = (t % col_tiles) * TC + tl.arange(0, TC)
        m = (r[:, None] < rows) & (k[None, :] < cols)
        off = c * rows * cols + r.to(tl.int64)[:, None] * cols + k[None, :]
        if MANTISSA:
            # join_fp32: the int16 halves as the int32 pattern (p << 16) | mantissa
            hi = tl.load(p_ptr + off, mask=m, other=0).to(tl.int32)
            lo = tl.load(m_ptr + off, mask=m, other=0).to(tl.int32)
            w = (hi * 65536 + (lo & 0xFFFF)).to(tl.float32, bitcast=True)
        else:
            w = tl.load(p_ptr + off, mask=m, other=0.0)
        if U_BF16:
            u = from_bf16(tl.load(u_ptr + off, mask=m, other=0.0), True)
        else:
            u = tl.load(u_ptr + off, mask=m, other=0.0).to(tl.float32)
        if EQ:
            # _equalized: bf16(u * gain[lane]) on the bits where the guard passed, else 0
            if LANE_IS_ROW:
                lane = r[:, None]
                lanes = rows
            else:
                lane = k[None, :]
                lanes = cols
            g = from_bf16(tl.load(gain_ptr + c * lanes + lane, mask=m, other=0.0), True)
            bits = (u * g).to(tl.int32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
            ok = tl.load(ok_ptr + c) != 0
            u = tl.where(ok, bits.to(tl.float32, bitcast=True), 0.0)
        if GATE_BF16:  # the rails stored in bf16 (rails_dtype): widened exactly, as gate_src.float()
            gate = from_bf16(tl.load(gate_ptr + off, mask=m, other=0.0), True)
        else:
            gate = tl.load(gate_ptr + off, mask=m, other=0.0)
        lr = tl.load(lr_ptr + c)
        wd = tl.load(wd_ptr)
        aligned = (gate * w >= 0).to(tl.float32)
        w_new = w - w * aligned * wd * lr - u * lr
        if ACTIVE:
            w_new = tl.where(tl.load(act_ptr + c) != 0, w_new, w)
        if MANTISSA:
            # split_fp32: the high half (arithmetic shift) and the low half (int32 -> int16 keeps the low bits)
            raw = w_new.to(tl.int32, bitcast=True)
            tl.store(p_ptr + off, (raw >> 16).to(tl.int16), mask=m)
            tl.store(m_ptr + off, raw.to(tl.int16), mask=m)
        else:
            tl.store(p_ptr + off, w_new, mask=m)


def _fusable(p: Tensor, mantissa: Tensor | None, update: Tensor, gate: Tensor, eff_lr: Tensor, eff_wd: Tensor,
             active: Tensor | None) -> bool:
    """Whether :func:`_update_kernel` takes these tensors: [chunk, rows, cols] contiguous, a bf16 or
    fp32 update and gate, fp32 rates on the parameter's device, an int32 ``active``. Anything else runs
    the compiled functions (same values)."""
    ts = [p, update, gate, eff_lr, eff_wd] + [t for t in (mantissa, active) if t is not None]
    return (p.dim() == 3 and all(t.is_contiguous() and t.device == p.device for t in ts)
            and update.dtype in (torch.bfloat16, torch.float32) and gate.dtype in (torch.bfloat16, torch.float32)
            and eff_lr.dtype == torch.float32 and eff_lr.numel() == p.shape[0]
            and eff_wd.dtype == torch.float32 and eff_wd.numel() == 1
            and (active is None or (active.dtype == torch.int32 and active.numel() == p.shape[0])))


def _update_fused(p: Tensor, m16: Tensor | None, update: Tensor, gate: Tensor, eff_lr: Tensor, eff_wd: Tensor,
                  active: Tensor | None, gain: Tensor | None = None, ok: Tensor | None = None,
                  lanes_are_rows: bool = True) -> None:
    chunk, rows, cols = p.shape
    if p.numel() == 0:  # nothing to update, and CUDA refuses an empty grid
        return
    col_tiles = triton.cdiv(cols, _TILE_COLS)
    tiles = triton.cdiv(rows, _TILE_ROWS) * col_tiles
    for s, e in matrix_slices(chunk):
        _update_kernel[(tiles, e - s)](
            p[s:e], p[s:e] if m16 is None else m16[s:e], update[s:e], gate[s:e], eff_lr.reshape(-1)[s:e], eff_wd,
            p if active is None else active.reshape(-1)[s:e], p if gain is None else gain[s:e],
            p if ok is None else ok[s:e], rows, cols, col_tiles, MANTISSA=m16 is not None,
            U_BF16=update.dtype == torch.bfloat16, GATE_BF16=gate.dtype == torch.bfloat16,
            ACTIVE=active is not None, EQ=gain is not None,
            LANE_IS_ROW=lanes_are_rows, TR=_TILE_ROWS, TC=_TILE_COLS, num_warps=_UPDATE_WARPS)


def _int16_view(t: Tensor, name: str) -> Tensor:
    if t.dtype not in (torch.bfloat16, torch.uint16, torch.int16, torch.float16):
        raise ValueError(f"{name}: expected a 16-bit tensor (bf16 parameter / uint16 mantissa), got {t.dtype}")
    return t.view(torch.int16)


def sign_aligned_update(p: Tensor, mantissa: Tensor | None, update: Tensor, *, gate: Tensor, eff_lr: Tensor,
                        eff_wd: Tensor, active: Tensor | None = None, equalizer=None, red_dim: int | None = None,
                        compile: bool | None = None, fused: bool = False, backend: str = "auto") -> None:
    """:func:`anvil_ref.update.sign_aligned_update` in place on the fp32 master ``W``:
    ``W' = W - W*[gate*W >= 0]*eff_wd*eff_lr - update*eff_lr``. The master is either ``p`` itself
    (a float32 parameter slice, ``mantissa=None``) or the pair ``p`` (the bf16 parameter slice, or
    its uint16 view) + ``mantissa`` (uint16, the low halves: the seed's storage). ``eff_wd`` is a
    0-D fp32 tensor, ``eff_lr`` ``[chunk, 1, 1]`` fp32, ``gate`` fp32 like ``p``. ``active``: an
    optional ``[chunk, 1, 1]`` int32 device mask; a matrix whose entry is 0 keeps its master bit
    for bit (a member without a gradient, or a step the device refused). The gate and the two
    rates are keyword-only: each pair has the same type, so a positional swap would run and be
    wrong.

    ``equalizer``: the :class:`anvil_fast.kernels.equalizer.EqualizerWork` of a guarded equalization
    that left its application to this pass (``equalize(..., apply=False)``): ``update`` is then the
    bf16 cascade output and the update applied is ``bf16(update * gain[lane])`` where the guard passed
    and 0 where it did not, the same values the equalizer's own application writes; ``red_dim`` is the
    equalization's reduction axis (lanes are rows for -1, columns for -2). Why here: the update reads
    every element of ``update`` anyway, so the application costs no pass of its own over it.

    ``fused``: :func:`_update_kernel` where Triton runs (:func:`anvil_fast.kernels.backend.use_triton`
    with ``backend``) and the tensors suit it (contiguous, fp32 rates, a bf16 or fp32 update and
    gate), else the compiled functions; both write the same bits (module docstring)."""
    if p.shape != update.shape or p.shape != gate.shape or (mantissa is not None and p.shape != mantissa.shape):
        raise ValueError(f"shapes differ: p {tuple(p.shape)}, mantissa "
                         f"{None if mantissa is None else tuple(mantissa.shape)}, update {tuple(update.shape)}, "
                         f"gate {tuple(gate.shape)}")
    eq = {} if equalizer is None else _equalizer_args(update, equalizer, red_dim)
    if mantissa is None and p.dtype != torch.float32:
        raise ValueError(f"p: without a mantissa the master must be the float32 parameter itself, got {p.dtype}")
    p16, m16 = (p, None) if mantissa is None else (_int16_view(p, "p"), _int16_view(mantissa, "mantissa"))
    if fused and use_triton(p, backend) and _fusable(p16, m16, update, gate, eff_lr, eff_wd, active):
        _update_fused(p16, m16, update, gate, eff_lr, eff_wd, active, **eq)
        return
    c = want_compile(compile, p)
    if mantissa is None:
        maybe_compiled(_sign_aligned_decay_update_fp32, c)(p, update, eff_wd, eff_lr, gate, active, **eq)
        return
    maybe_compiled(_sign_aligned_decay_update, c)(p16, m16, update, eff_wd, eff_lr, gate, active, **eq)


def _equalizer_args(update: Tensor, work, red_dim: int | None) -> dict:
    if red_dim not in (-1, -2):
        raise ValueError(f"red_dim: with an equalizer to apply, expected its reduction axis -1 or -2, got {red_dim}")
    if update.dim() != 3 or update.dtype != torch.bfloat16:
        raise ValueError(f"update: the equalizer's application needs the [chunk, rows, cols] bf16 cascade output, "
                         f"got {update.dtype} {tuple(update.shape)}")
    chunk, rows, cols = update.shape
    lanes = rows if red_dim == -1 else cols
    if tuple(work.gain.shape) != (chunk, lanes) or work.gain.dtype != torch.bfloat16 \
            or tuple(work.ok.shape) != (chunk,) or work.ok.dtype != torch.int32:
        raise ValueError(f"equalizer: expected bf16 gains of shape {(chunk, lanes)} and int32 verdicts of shape "
                         f"{(chunk,)} for update {tuple(update.shape)} with red_dim {red_dim}; got gains "
                         f"{work.gain.dtype} {tuple(work.gain.shape)}, verdicts {work.ok.dtype} {tuple(work.ok.shape)}")
    return dict(gain=work.gain, ok=work.ok, lanes_are_rows=red_dim == -1)
