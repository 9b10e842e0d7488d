"""Plain eager-torch bf16 versions of ANVIL's math: the seed's operations and roundings, with
library matmuls (cuBLAS on a GPU, the CPU BLAS otherwise) instead of the symmetric Triton kernels,
and no torch.compile.

They serve two purposes: the "eager bf16" error floor that the fast path is judged against (see
anvil_fast/core/tolerances.py), and a seed-faithful bf16 cascade that runs anywhere (derive_maps measures
bf16 envelopes on suites of inputs with it).

``eager_bf16_cascade`` with its defaults is the seed; ``fp32_trace=True, prescale=True`` and a
widened ``margin`` give the eager floor of the fast path's SAFE configuration (anvil_fast.core.cascade).
``eager_rails``, ``eager_equalizer`` and ``eager_update`` are the seed's remaining operations,
written out plainly and out of place (the update joins the fp32 master by stacking the two 16-bit
halves and viewing them as float32, a formulation independent of anvil_fast.kernels.update's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from anvil_ref.constants import (
    ANVIL_MAPS,
    FROBENIUS_EPS,
    FROBENIUS_MARGIN,
    LANE_ENERGY_FLOOR,
    RAIL_SLOW_BETA,
    SPLIT_BADDBMM_MIN_ROWS,
)
from anvil_ref.equalizer import reduction_axis
from anvil_ref.maps import MapsLike, load_maps

_BF16_MAX = torch.finfo(torch.bfloat16).max


#: How eager_bf16_cascade forms its products: the library's bf16 GEMM ("library"), or the model of a
#: bf16 GEMM with fp32 accumulation ("fp32": the bf16 operands multiplied in fp32, the result rounded
#: once to bf16). The model's bits do not depend on which bf16 kernel the CPU's BLAS picks (oneDNN's
#: AMX and AVX-512 bf16 kernels accumulate in different orders, and their choice can change with
#: the machine), so measurements that are stored and re-checked use it.
GEMMS = ("library", "fp32")


def _mm(x: Tensor, y: Tensor, gemm: str) -> Tensor:
    return x @ y if gemm == "library" else (x.float() @ y.float()).bfloat16()


def _addmm(beta: float, c: Tensor, alpha: float, x: Tensor, y: Tensor, gemm: str) -> Tensor:
    """``beta*c + alpha*(x @ y)`` rounded once to bf16."""
    if gemm == "library":
        return torch.baddbmm(c, x, y, beta=beta, alpha=alpha)
    return (beta * c.float() + alpha * (x.float() @ y.float())).bfloat16()


def _gram(x: Tensor, tall: bool, gemm: str = "library") -> Tensor:
    return _mm(x.mT, x, gemm) if tall else _mm(x, x.mT, gemm)


def eager_bf16_cascade(x: Tensor, *, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                       eps: float = FROBENIUS_EPS, split: bool | None = None, fp32_trace: bool = False,
                       prescale: bool = False, gemm: str = "library") -> Tensor:
    """The seed's bf16 cascade in eager torch: ``x`` ([..., m, n], any float dtype) is cast to bf16;
    every Gram, ``b*A + c*A@A`` (one baddbmm: fp32 accumulation, one rounding) and ``a*X + X@B``
    (one baddbmm, or bmm then add when ``split``; default: rows > SPLIT_BADDBMM_MIN_ROWS, as the
    seed) is rounded to bf16; the trace and the normalization are computed in fp32. Returns bf16.

    ``fp32_trace``: take the trace as the fp32 sum of squares of the bf16 X instead of the bf16
    Gram's diagonal. ``prescale`` (needs ``fp32_trace``): clamp x to bf16's finite range before the
    cast, scale X by an exact power of two (max |X| in [1, 2)) in the normalization, eps alike, and
    take the first Gram of the normalized X (anvil_fast.core.cascade's SAFE order). Both off reproduce
    the seed. ``gemm``: how products are formed (:data:`GEMMS`).
    """
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    maps_ = load_maps(maps)
    if x.ndim < 2:
        raise ValueError(f"x: expected [..., rows, cols], got shape {tuple(x.shape)}")
    lead = x.shape[:-2]
    x3 = x.reshape(-1, *x.shape[-2:])
    if prescale and not fp32_trace:
        raise ValueError("prescale takes the first Gram after the normalization: it needs fp32_trace=True")
    X = (x3.float().clamp(-_BF16_MAX, _BF16_MAX) if prescale else x3).to(torch.bfloat16)
    tall = X.size(-2) > X.size(-1)
    if split is None:
        split = X.size(-2) > SPLIT_BADDBMM_MIN_ROWS
    xf, s = X.float(), 1.0
    if prescale:
        s = torch.exp2(-torch.floor(torch.log2(xf.abs().amax(dim=(-2, -1), keepdim=True))).clamp(-126, 126))
        xf = xf * s
    else:
        A = _gram(X, tall, gemm)
    if fp32_trace:
        tr = xf.square().sum(dim=(-2, -1), keepdim=True)
    else:
        tr = A.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None]
    d = tr.sqrt() * margin + eps * s
    X = (xf / d).bfloat16()
    A = _gram(X, tall, gemm) if prescale else (A.float() / d.square()).bfloat16()
    for k, (a, b, c) in enumerate(maps_):
        if k > 0:
            A = _gram(X, tall, gemm)
        # torch (seen on 2.13's CPU build) returns the input unscaled, or NaN for beta = 0, from a bf16
        # baddbmm with alpha = 0 on matrices 32 or more wide; b*A in fp32, rounded once, is the same math.
        B = _addmm(b, A, c, A, A, gemm) if c != 0 else (A.float() * b).bfloat16()
        if split:
            C = _mm(X, B, gemm) if tall else _mm(B, X, gemm)
            X = C.add_(X, alpha=a)
        else:
            X = _addmm(a, X, 1.0, X, B, gemm) if tall else _addmm(a, X, 1.0, B, X, gemm)
    return X.reshape(*lead, *X.shape[-2:])


def eager_rails(grad: Tensor, v_fast: Tensor, v_slow: Tensor, *, momentum: float, fast_beta: float,
                fast_weight: float) -> tuple[Tensor, Tensor, Tensor]:
    """The seed's twin-rail step and Nesterov lookahead in eager fp32, out of place. The scalars are
    taken as fp32 0-D tensors, as the bank stores them. Returns (lookahead fp32, v_fast', v_slow')."""
    g = grad.float()
    f32 = dict(dtype=torch.float32, device=g.device)
    mu, fb, w = (torch.tensor(v, **f32) for v in (momentum, fast_beta, fast_weight))
    v0 = v_fast.float().lerp(g, 1 - fb)
    v1 = v_slow.float().lerp(g, 1 - RAIL_SLOW_BETA)
    blend = w * v0 + (1 - w) * v1
    return g.lerp(blend, mu), v0, v1


def eager_equalizer(v: Tensor, lane_energy: Tensor, *, beta2: float) -> tuple[Tensor, Tensor]:
    """The seed's equalizer in eager torch, out of place: returns (equalized bf16 V, new lane
    energy). Lanes: reduced over the columns when rows >= cols, else the rows (the seed's red_dim)."""
    red_dim = reduction_axis(v.shape)
    lane_power = v.float().square().mean(dim=red_dim, keepdim=True)
    lane_len = v.size(red_dim)
    pre_norm = (lane_power.sum(dim=(-2, -1), keepdim=True) * lane_len).sqrt()
    energy = lane_energy.lerp(lane_power.to(lane_energy.dtype), 1 - beta2)
    gain = energy.clamp_min(LANE_ENERGY_FLOOR).rsqrt()
    post_norm = ((lane_power * lane_len) * gain.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    scale = gain * (pre_norm / post_norm.clamp_min(LANE_ENERGY_FLOOR))
    return v * scale.to(v.dtype), energy


def eager_update(p: Tensor, mantissa: Tensor | None, update: Tensor, gate: Tensor, *, eff_wd: Tensor,
                 eff_lr: Tensor) -> tuple[Tensor, Tensor | None]:
    """The seed's sign-aligned decay + update in eager fp32, out of place: returns the new (bf16
    parameter, uint16 mantissa), or (float32 parameter, None) for a float32 parameter (its own
    master, ``mantissa=None``). The bf16 master is joined by stacking the int16 halves (low half
    first, little-endian) and viewing the pair as one float32."""
    if mantissa is None:
        w = p.float()
    else:
        lo, hi = mantissa.view(torch.int16), p.view(torch.int16)
        w = torch.stack([lo, hi], dim=-1).view(torch.float32).squeeze(-1)
    wd, lr = eff_wd.to(torch.float32), eff_lr.to(torch.float32)
    aligned = (gate.float() * w) >= 0
    w_new = w - (w * aligned * wd * lr) - (update.float() * lr)
    if mantissa is None:
        return w_new, None
    halves = w_new.unsqueeze(-1).view(torch.int16)
    return halves[..., 1].contiguous().view(torch.bfloat16), halves[..., 0].contiguous().view(torch.uint16)