"""The lane-energy equalizer on the fast path (seed: ``AnvilAndAdam._rail_equalizer``; reference:
:mod:`anvil_ref.equalizer`), with an optional guard.

The seed's code, kept operation for operation (fp32 statistics, the gain cast to bf16 before the
in-place bf16 multiply)::

    P   = mean(V**2, red_dim)                 fp32, one per lane
    r   = sqrt(L * sum P)                      pre-equalization norm
    E  <- lerp(E, P, 1 - beta2)                lane-energy EMA (in place)
    g   = rsqrt(max(E, LANE_ENERGY_FLOOR))
    q   = max(sqrt(sum(L * P * g**2)), LANE_ENERGY_FLOOR)
    V  <- V * bf16(g * r / q)

``guard=True`` (the SAFE configuration) adds one test per matrix on numbers the equalizer already
has: ``ok = isfinite(r) and r <= GUARD_NORM_RATIO * sqrt(min(rows, cols))``. Any cascade output
whose singular values are all <= 1.1 passes (its Frobenius norm is at most 1.1 sqrt(min(rows,
cols))); a non-finite or exploded one fails. A failing matrix gets a zero orthogonalized update (as if
the cascade had returned zero: only the sign-aligned weight decay still moves it), its lane energy is
left unchanged, and ``guard_trips[i]`` is incremented: visibly, instead of writing NaN or a
1e15-sized step into the weights. (The guard protects the weights and the lane energy; a non-finite
*gradient* still enters the rails -- the optimizer's opt-in finite-gradient check runs before.) Branchless (``torch.where``), so it
captures in a CUDA graph.

Two implementations of the same operations:

* ``fused=False``: the code above through torch.compile (the FAITHFUL configuration, as the seed).
* ``fused=True`` (the SAFE configuration, on CUDA): three Triton kernels -- the lane powers (one
  program per block of lanes of one matrix), the per-matrix statistics (pre- and post-norm, the
  guard, the lane-energy update and the bf16 gains: one program per matrix), and the scaling of V.
  A bank update leaves the scaling to the parameter update (``apply=False``), which reads V anyway:
  one pass over V fewer, the same values (:func:`anvil_fast.kernels.update.sign_aligned_update`).
  Why not the compiled code: its per-matrix sums are reductions whose strategy Inductor picks from
  the *number of matrices*, so a bank's result depended on how many matrices it held. Measured on an
  H200 (``tools/chunk_independence.py``, results/anvil_fast_h200/run6/): a 24x3072x768 bank and its
  two 12-matrix halves gave different V (the eager CUDA reductions differed even at 24x768x768), so
  the sharded optimizer on two GPUs did not reproduce the one-GPU run bit for bit. Every reduction
  of the kernels has a fixed shape and order per matrix, so each matrix's result is the same
  whatever else is in its bank. The sums are fp32 in another order than torch's, the gain's
  ``rsqrt`` is ``1 / sqrt`` with both correctly rounded, and the lane-energy ``lerp`` is torch's
  formula with a fused multiply-add (as in :mod:`anvil_fast.kernels.rails`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from anvil_ref.constants import LANE_ENERGY_FLOOR, NORM_BLOCK
from anvil_ref.equalizer import reduction_axis

from .compiled import maybe_compiled, want_compile
from .backend import matrix_slices, round_fix, triton_available, use_triton, widen_fix
from .normalize import NORM_WARPS, blocks_per_matrix

if triton_available():
    import triton
    import triton.language as tl

    from .backend import from_bf16, to_bf16
    from .rails import _lerp
else:  # pragma: no cover - exercised only where triton is absent
    triton = None

#: A matrix's update is refused when ||V||_F > GUARD_NORM_RATIO * sqrt(min(rows, cols)).
GUARD_NORM_RATIO = 1.1


def _rail_equalizer(v: Tensor, lane_energy: Tensor, beta2: float, red_dim: int) -> Tensor:
    lane_power = v.float().square().mean(dim=red_dim, keepdim=True)
    lane_len = v.size(red_dim)
    pre_norm = lane_power.sum(dim=(-2, -1), keepdim=True).mul_(lane_len).sqrt_()
    lane_energy.lerp_(lane_power.to(dtype=lane_energy.dtype), 1 - beta2)
    lane_gain = lane_energy.clamp_min(LANE_ENERGY_FLOOR).rsqrt_()
    post_power = (lane_power * lane_len) * lane_gain.float().square()
    post_norm = post_power.sum(dim=(-2, -1), keepdim=True).sqrt_()
    eq_scale = lane_gain * (pre_norm / post_norm.clamp_min_(LANE_ENERGY_FLOOR))
    return v.mul_(eq_scale.type_as(v))


def _guarded_equalizer(v: Tensor, lane_energy: Tensor, beta2: float, red_dim: int, guard_trips: Tensor,
                       bound: float | None = None, active: Tensor | None = None) -> Tensor:
    lane_power = v.float().square().mean(dim=red_dim, keepdim=True)
    lane_len = v.size(red_dim)
    pre_norm = lane_power.sum(dim=(-2, -1), keepdim=True).mul_(lane_len).sqrt_()
    if bound is None:
        bound = GUARD_NORM_RATIO * math.sqrt(min(v.size(-2), v.size(-1)))
    ok = torch.isfinite(pre_norm) & (pre_norm <= bound)
    # an inactive matrix (no gradient this step, or a refused step) keeps its lane energy and is not
    # counted as a refusal (its V is zero)
    keep = ok if active is None else ok & (active.reshape(ok.shape) != 0)
    lane_energy.copy_(torch.where(keep, lane_energy.lerp(lane_power.to(dtype=lane_energy.dtype), 1 - beta2),
                                  lane_energy))
    lane_gain = lane_energy.clamp_min(LANE_ENERGY_FLOOR).rsqrt()
    post_power = (lane_power * lane_len) * lane_gain.float().square()
    post_norm = post_power.sum(dim=(-2, -1), keepdim=True).sqrt_()
    eq_scale = lane_gain * (pre_norm / post_norm.clamp_min_(LANE_ENERGY_FLOOR))
    refused = ~ok if active is None else ~ok & (active.reshape(ok.shape) != 0)
    guard_trips.add_(refused.reshape(guard_trips.shape).to(guard_trips.dtype))
    return v.copy_(torch.where(ok, v * eq_scale.type_as(v), torch.zeros((), dtype=v.dtype, device=v.device)))


@dataclass
class EqualizerWork:
    """Buffers of the Triton equalizer for one bank shape: lane powers (fp32) and bf16 gains per lane,
    and the guard's verdict per matrix."""

    lane_power: Tensor
    gain: Tensor
    ok: Tensor

    @classmethod
    def for_shape(cls, shape: tuple[int, int, int], device, red_dim: int | None = None) -> "EqualizerWork":
        chunk, rows, cols = shape
        lanes = rows if (reduction_axis(shape) if red_dim is None else red_dim) == -1 else cols
        # empty, not zeros: _lane_power_kernel writes every lane power and _equalizer_stats_kernel every
        # gain and verdict before _equalizer_apply_kernel reads them; a fill would be one more kernel in
        # each captured step
        return cls(lane_power=torch.empty((chunk, lanes), dtype=torch.float32, device=device),
                   gain=torch.empty((chunk, lanes), dtype=torch.bfloat16, device=device),
                   ok=torch.empty((chunk,), dtype=torch.int32, device=device))


#: Lanes per program and reduction elements per step of the lane-power kernel; lanes per step of
#: the per-matrix kernel.
_LANE_BLOCK, _RED_BLOCK, _STAT_BLOCK = 32, 128, 1024

if triton is not None:

    @triton.jit
    def _lane_power_kernel(v_ptr, lp_ptr, lanes, red, s_lane, s_red, mn, WIDEN_FIX: tl.constexpr,
                           LB: tl.constexpr, RB: tl.constexpr):
        # lane_power[c, l] = sum_r v[c, l, r]**2 / red, the sum in a fixed order: RB-wide slices
        # accumulated element-wise in sequence, then one tree over the RB accumulators.
        lb = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        lane = lb * LB + tl.arange(0, LB)
        r = tl.arange(0, RB)
        base = v_ptr + c * mn + lane.to(tl.int64)[:, None] * s_lane
        acc = tl.zeros([LB, RB], dtype=tl.float32)
        for k in range(0, red, RB):
            m = (lane[:, None] < lanes) & (k + r[None, :] < red)
            x = from_bf16(tl.load(base + (k + r).to(tl.int64)[None, :] * s_red, mask=m, other=0.0), WIDEN_FIX)
            acc += x * x
        tl.store(lp_ptr + c * lanes + lane, tl.div_rn(tl.sum(acc, axis=1), red.to(tl.float32)), mask=lane < lanes)

    @triton.jit
    def _equalizer_stats_kernel(lp_ptr, e_ptr, gain_ptr, ok_ptr, trips_ptr, act_ptr, lanes, lane_len, bound, omb2,
                                floor, GUARD: tl.constexpr, ACTIVE: tl.constexpr, ROUND_FIX: tl.constexpr,
                                SB: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, SB)
        acc = tl.zeros([SB], dtype=tl.float32)
        for k in range(0, lanes, SB):
            acc += tl.load(lp_ptr + c * lanes + k + i, mask=k + i < lanes, other=0.0)
        pre = tl.sqrt_rn(tl.sum(acc, axis=0) * lane_len)
        if GUARD:
            ok = pre <= bound  # false for NaN and inf: isfinite(pre) and pre <= bound
        else:
            ok = tl.zeros([], dtype=tl.int32) == 0
        if ACTIVE:
            # an inactive matrix (no gradient, or a refused step) keeps its lane energy, uncounted
            act = tl.load(act_ptr + c) != 0
        else:
            act = tl.zeros([], dtype=tl.int32) == 0
        keep = ok & act
        # The new lane energy is computed twice (same inputs, same operations, same bits) and stored
        # only in the last pass, so no pass reads what another thread of this program wrote.
        acc = tl.zeros([SB], dtype=tl.float32)
        for k in range(0, lanes, SB):
            m = k + i < lanes
            lp = tl.load(lp_ptr + c * lanes + k + i, mask=m, other=0.0)
            e = tl.load(e_ptr + c * lanes + k + i, mask=m, other=1.0)
            g = tl.div_rn(1.0, tl.sqrt_rn(tl.maximum(tl.where(keep, _lerp(e, lp, omb2), e), floor)))
            acc += tl.where(m, (lp * lane_len) * (g * g), 0.0)
        post = tl.sqrt_rn(tl.sum(acc, axis=0))
        ratio = tl.div_rn(pre, tl.maximum(post, floor))
        for k in range(0, lanes, SB):
            m = k + i < lanes
            lp = tl.load(lp_ptr + c * lanes + k + i, mask=m, other=0.0)
            e = tl.load(e_ptr + c * lanes + k + i, mask=m, other=1.0)
            e = tl.where(keep, _lerp(e, lp, omb2), e)
            g = tl.div_rn(1.0, tl.sqrt_rn(tl.maximum(e, floor)))
            tl.store(e_ptr + c * lanes + k + i, e, mask=m)
            tl.store(gain_ptr + c * lanes + k + i, to_bf16(g * ratio, ROUND_FIX), mask=m)
        tl.store(ok_ptr + c, ok.to(tl.int32))
        if GUARD:
            tl.store(trips_ptr + c, tl.load(trips_ptr + c) + (act & (ok == 0)).to(tl.int32))

    @triton.jit
    def _equalizer_apply_kernel(v_ptr, gain_ptr, ok_ptr, mn, cols, lanes, LANE_IS_ROW: tl.constexpr,
                                ROUND_FIX: tl.constexpr, WIDEN_FIX: tl.constexpr, BLOCK: tl.constexpr):
        # v <- ok ? bf16(v * gain[lane]) : 0, as torch's where(ok, v * gain.type_as(v), 0).
        b = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        inner = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = inner < mn
        lane = inner // cols if LANE_IS_ROW else inner % cols
        ok = tl.load(ok_ptr + c) != 0
        g = from_bf16(tl.load(gain_ptr + c * lanes + lane, mask=m, other=0.0), WIDEN_FIX)
        x = from_bf16(tl.load(v_ptr + c * mn + inner, mask=m, other=0.0), WIDEN_FIX)
        y = tl.where(ok, to_bf16(x * g, ROUND_FIX), to_bf16(tl.zeros_like(x), ROUND_FIX))
        tl.store(v_ptr + c * mn + inner, y, mask=m)


def _equalizer_fused(v: Tensor, lane_energy: Tensor, beta2: float, red_dim: int, guard_trips: Tensor | None,
                     work: EqualizerWork, active: Tensor | None = None, apply: bool = True) -> Tensor:
    shape = tuple(v.shape)
    if len(shape) != 3 or v.dtype != torch.bfloat16 or not v.is_contiguous():
        raise ValueError(f"equalizer: v must be a contiguous [chunk, rows, cols] bf16 tensor, got {v.dtype} {shape}")
    chunk, rows, cols = shape
    lanes, red = (rows, cols) if red_dim == -1 else (cols, rows)
    s_lane, s_red = (cols, 1) if red_dim == -1 else (1, cols)
    if tuple(work.lane_power.shape) != (chunk, lanes) or not lane_energy.is_contiguous() \
            or lane_energy.numel() != chunk * lanes or lane_energy.dtype != torch.float32:
        raise ValueError(f"equalizer: lane_energy must be contiguous fp32 with {chunk} x {lanes} lanes and the work "
                         f"buffers for {shape}; got {lane_energy.dtype} {tuple(lane_energy.shape)}, work "
                         f"{tuple(work.lane_power.shape)}")
    guard = guard_trips is not None
    mn, nb = rows * cols, blocks_per_matrix(rows, cols)
    for s, e in matrix_slices(chunk):
        _lane_power_kernel[(triton.cdiv(lanes, _LANE_BLOCK), e - s)](
            v[s:e], work.lane_power[s:e], lanes, red, s_lane, s_red, mn, WIDEN_FIX=widen_fix(),
            LB=_LANE_BLOCK, RB=_RED_BLOCK, num_warps=8)
    _equalizer_stats_kernel[(chunk,)](
        work.lane_power, lane_energy, work.gain, work.ok, guard_trips if guard else work.ok,
        active.reshape(-1) if active is not None else work.ok, lanes, float(red),
        GUARD_NORM_RATIO * math.sqrt(min(rows, cols)), 1 - float(beta2), LANE_ENERGY_FLOOR, GUARD=guard,
        ACTIVE=active is not None, ROUND_FIX=round_fix(), SB=_STAT_BLOCK, num_warps=4)
    if not apply:
        return v
    for s, e in matrix_slices(chunk):
        _equalizer_apply_kernel[(nb, e - s)](
            v[s:e], work.gain[s:e], work.ok[s:e], mn, cols, lanes, LANE_IS_ROW=red_dim == -1, ROUND_FIX=round_fix(),
            WIDEN_FIX=widen_fix(), BLOCK=NORM_BLOCK, num_warps=NORM_WARPS)
    return v


def defers_application(v: Tensor, *, fused: bool, guard: bool, backend: str = "auto") -> bool:
    """Whether :func:`equalize` may leave its last step, ``v *= gain[lane]`` (0 where the guard
    failed), to the update: with the Triton kernels (their gains and verdicts are buffers) and the
    guard on (a matrix that passes it has finite entries, the range where the update's bit form of the
    bf16 rounding is exact)."""
    return bool(fused and guard and use_triton(v, backend))


def equalize(v: Tensor, lane_energy: Tensor, *, beta2: float, red_dim: int | None = None,
             guard_trips: Tensor | None = None, compile: bool | None = None, fused: bool = False,
             work: EqualizerWork | None = None, active: Tensor | None = None, finite_only: bool = False,
             backend: str = "auto", apply: bool = True) -> Tensor:
    """:func:`anvil_ref.equalizer.equalize` in place: equalize ``v`` ([chunk, rows, cols] bf16) and
    update ``lane_energy``; returns ``v``. ``red_dim``: the lane-reduction axis, by default
    :func:`anvil_ref.equalizer.reduction_axis` of ``v``'s shape (a bank passes the one it stored).
    With ``guard_trips`` (an int32 tensor of one entry per matrix) the guard is on; ``finite_only``
    narrows it to non-finite updates (the FAITHFUL configuration: the seed's arithmetic for every
    finite update, and never a NaN or inf into the weights or the lane energy). ``active``: an int32
    ``[chunk]`` device mask; an inactive matrix keeps its lane energy. ``fused``: the Triton kernels
    where they can run (:func:`anvil_fast.kernels.backend.use_triton`), with ``work`` as their buffers
    (allocated here if not given; a CUDA graph wants them allocated once).

    ``apply=False`` (the Triton kernels with the guard on, :func:`defers_application`): the lane
    energy, the gains and the verdicts are computed into ``work`` and ``v`` is left as it is, for the
    update to apply as it reads ``v`` (:func:`anvil_fast.kernels.update.sign_aligned_update`'s
    ``equalizer``)."""
    if red_dim is None:
        red_dim = reduction_axis(v.shape)
    if red_dim not in (-1, -2):
        raise ValueError(f"red_dim: expected -1 or -2, got {red_dim}")
    if not apply and not defers_application(v, fused=fused, guard=guard_trips is not None and not finite_only,
                                            backend=backend):
        raise ValueError("equalize: apply=False needs the Triton kernels (fused=True where they run) with the guard "
                         "on (guard_trips given, finite_only off); elsewhere the equalizer applies its own gains")
    if not apply and work is None:
        raise ValueError("equalize: apply=False needs work, the buffers the update reads the gains from")
    if fused and use_triton(v, backend) and not finite_only:
        if work is None:
            work = EqualizerWork.for_shape(tuple(v.shape), v.device, red_dim)
        return _equalizer_fused(v, lane_energy, beta2, red_dim, guard_trips, work, active, apply)
    c = want_compile(compile, v)
    if guard_trips is None:
        if active is not None:
            raise ValueError("equalize: active needs guard_trips (the masked form is the guarded one)")
        return maybe_compiled(_rail_equalizer, c)(v, lane_energy, float(beta2), red_dim)
    act = None if active is None else active.reshape(v.shape[0], 1, 1)
    return maybe_compiled(_guarded_equalizer, c)(v, lane_energy, float(beta2), red_dim, guard_trips,
                                                 math.inf if finite_only else None, act)
