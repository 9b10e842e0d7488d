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

``prescale=True`` (the safe configuration) also multiplies x by ``2**-e`` per matrix, with
``2**e <= max|x| < 2**(e+1)`` (``e`` clamped to [-126, 126]), before the cast. A power-of-two scale
is exact in fp32 and bf16, so X is the seed's X up to an exact factor; the cascade is scale
invariant except for FROBENIUS_EPS, which the normalization scales by the same factor (see
:mod:`anvil_fast.cascade`). It keeps the Gram and its trace finite for every finite input (the
seed's bf16 Gram overflows once entries pass ~1e19, and ``A/d**2`` then gives NaN) and keeps
x > bf16's largest finite value from becoming inf in the cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from anvil_ref.constants import RAIL_SLOW_BETA

from ._compile import maybe_compiled, want_compile

#: Clamp of the prescale exponent, so that ``2**-e`` and ``eps * 2**-e`` stay finite in fp32.
PRESCALE_EXP_LIMIT = 126


def _rails_lookahead(grad: Tensor, velocity: Tensor, momentum_t: Tensor, fast_beta_t: Tensor,
                     fast_weight_t: Tensor, x_out: Tensor, scale_out: Tensor, prescale: bool) -> None:
    g = grad.float()
    momentum = momentum_t.to(g.dtype)
    velocity[0].lerp_(g, 1 - fast_beta_t.to(g.dtype))
    velocity[1].lerp_(g, 1 - RAIL_SLOW_BETA)
    w = fast_weight_t.to(g.dtype)
    blend = w * velocity[0] + (1 - w) * velocity[1]
    g = g.lerp(blend, momentum)
    if prescale:
        amax = g.abs().amax(dim=(-2, -1), keepdim=True)
        e = torch.floor(torch.log2(amax)).clamp(-PRESCALE_EXP_LIMIT, PRESCALE_EXP_LIMIT)
        scale = torch.exp2(-e)
        scale_out.copy_(scale)
        x_out.copy_(g * scale)
    else:
        scale_out.fill_(1.0)
        x_out.copy_(g)


def rails_lookahead(grad: Tensor, velocity: Tensor, momentum_t: Tensor, fast_beta_t: Tensor,
                    fast_weight_t: Tensor, *, x_out: Tensor, scale_out: Tensor, prescale: bool = False,
                    compile: bool | None = None) -> None:
    """One twin-rail step in place on ``velocity`` ([2, *chunk] fp32), writing the cascade's bf16
    input into ``x_out`` ([*chunk] bf16) and the prescale factor (1 when ``prescale`` is off) into
    ``scale_out`` ([chunk..., 1, 1] fp32). ``grad`` is the bf16 (or fp32) gradient; it is not
    written."""
    fn = maybe_compiled(_rails_lookahead, want_compile(compile, grad))
    fn(grad, velocity, momentum_t, fast_beta_t, fast_weight_t, x_out, scale_out, bool(prescale))
