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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from anvil_ref.constants import LANE_ENERGY_FLOOR

from ._compile import maybe_compiled, want_compile

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


def _guarded_equalizer(v: Tensor, lane_energy: Tensor, beta2: float, red_dim: int, guard_trips: Tensor) -> Tensor:
    lane_power = v.float().square().mean(dim=red_dim, keepdim=True)
    lane_len = v.size(red_dim)
    pre_norm = lane_power.sum(dim=(-2, -1), keepdim=True).mul_(lane_len).sqrt_()
    bound = GUARD_NORM_RATIO * math.sqrt(min(v.size(-2), v.size(-1)))
    ok = torch.isfinite(pre_norm) & (pre_norm <= bound)
    lane_energy.copy_(torch.where(ok, lane_energy.lerp(lane_power.to(dtype=lane_energy.dtype), 1 - beta2),
                                  lane_energy))
    lane_gain = lane_energy.clamp_min(LANE_ENERGY_FLOOR).rsqrt()
    post_power = (lane_power * lane_len) * lane_gain.float().square()
    post_norm = post_power.sum(dim=(-2, -1), keepdim=True).sqrt_()
    eq_scale = lane_gain * (pre_norm / post_norm.clamp_min_(LANE_ENERGY_FLOOR))
    guard_trips.add_((~ok).reshape(guard_trips.shape).to(guard_trips.dtype))
    return v.copy_(torch.where(ok, v * eq_scale.type_as(v), torch.zeros((), dtype=v.dtype, device=v.device)))


def reduction_dim(shape) -> int:
    """The seed's red_dim: -1 (over columns) when rows >= cols, else -2."""
    return -1 if shape[-2] >= shape[-1] else -2


def rail_equalizer(v: Tensor, lane_energy: Tensor, beta2: float, red_dim: int, *, guard_trips: Tensor | None = None,
                   compile: bool | None = None) -> Tensor:
    """Equalize ``v`` ([chunk, rows, cols] bf16) in place and update ``lane_energy`` in place; returns
    ``v``. With ``guard_trips`` (an int32 tensor of one entry per matrix) the guard is on."""
    if red_dim not in (-1, -2):
        raise ValueError(f"red_dim: expected -1 or -2, got {red_dim}")
    c = want_compile(compile, v)
    if guard_trips is None:
        return maybe_compiled(_rail_equalizer, c)(v, lane_energy, float(beta2), red_dim)
    return maybe_compiled(_guarded_equalizer, c)(v, lane_energy, float(beta2), red_dim, guard_trips)
