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
but by the normalization (:func:`anvil_fast.cascade.cascade_workspace`), which reads the bf16 X
anyway: finding ``max|x|`` here would need a second pass over the fp32 gradient and both rails
(the reduction must finish before the first scaled element can be written), about 3x this phase's
bytes; over the bf16 X it is one extra 2-byte read. Since bf16 and fp32 share their exponent range,
casting before scaling by an exact power of two loses nothing outside fp32's subnormal range.
"""

from __future__ import annotations

import torch
from torch import Tensor

from anvil_ref.constants import RAIL_SLOW_BETA

from ._compile import maybe_compiled, want_compile

#: Clamp of the prescale exponent, so that ``2**-e`` and ``eps * 2**-e`` stay finite in fp32.
PRESCALE_EXP_LIMIT = 126
#: bf16's largest finite value (the SAFE cast clamps to it).
BF16_MAX = torch.finfo(torch.bfloat16).max


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


def rails_lookahead(grad: Tensor, velocity: Tensor, momentum_t: Tensor, fast_beta_t: Tensor,
                    fast_weight_t: Tensor, *, x_out: Tensor, prescale: bool = False,
                    compile: bool | None = None) -> None:
    """One twin-rail step in place on ``velocity`` ([2, *chunk] fp32), writing the cascade's bf16
    input into ``x_out`` ([*chunk] bf16; clamped to bf16's finite range when ``prescale``).
    ``grad`` is the bf16 (or fp32) gradient; it is not written."""
    fn = maybe_compiled(_rails_lookahead, want_compile(compile, grad))
    fn(grad, velocity, momentum_t, fast_beta_t, fast_weight_t, x_out, bool(prescale))
