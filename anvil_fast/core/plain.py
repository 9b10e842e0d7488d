"""The benchmark's baseline: the seed's bank update with plain library matmuls (no symmetric
kernels), as one torch.compile'd twin-rail + cascade function (the seed's ``anvil_cascade`` with
``X.mT @ X`` / ``baddbmm`` in place of XTX / XXT / ba_plus_cAA) followed by the same compiled
equalizer and update as the fast path. The same math as the FAITHFUL configuration; used by
``python -m anvil_fast.bench`` only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN, RAIL_SLOW_BETA

from anvil_fast.kernels.compiled import maybe_compiled
from anvil_fast.kernels.equalizer import equalize
from anvil_fast.kernels.update import sign_aligned_update


def _plain_cascade(grad_chunk: Tensor, velocity: Tensor, momentum_t: Tensor, split_baddbmm: bool,
                   fast_beta_t: Tensor, fast_weight_t: Tensor) -> Tensor:
    grad_chunk = grad_chunk.float()
    momentum = momentum_t.to(grad_chunk.dtype)
    velocity[0].lerp_(grad_chunk, 1 - fast_beta_t.to(grad_chunk.dtype))
    velocity[1].lerp_(grad_chunk, 1 - RAIL_SLOW_BETA)
    w = fast_weight_t.to(grad_chunk.dtype)
    blend = w * velocity[0] + (1 - w) * velocity[1]
    g = grad_chunk.lerp_(blend, momentum)
    X = g.bfloat16().contiguous()
    tall = g.size(-2) > g.size(-1)
    A = X.mT @ X if tall else X @ X.mT
    tr = A.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None]
    d = tr.sqrt() * FROBENIUS_MARGIN + FROBENIUS_EPS
    X = (X.float() / d).bfloat16()
    A = (A.float() / d.square()).bfloat16()
    for k, (a, b, c) in enumerate(ANVIL_MAPS):
        if k > 0:
            A = X.mT @ X if tall else X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        if split_baddbmm:
            C = torch.bmm(X, B) if tall else torch.bmm(B, X)
            X = C.add_(X, alpha=a)
        else:
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X


def plain_cascade(bank, *, compile: bool = True) -> Tensor:
    """Rails + plain cascade of one bank (updates bank.velocity in place); returns the bf16 output."""
    fn = maybe_compiled(_plain_cascade, compile)
    return fn(bank.grad, bank.velocity, bank.momentum, bank.split_baddbmm, bank.fast_beta, bank.fast_weight)


def plain_bank_update(bank, *, compile: bool = True) -> None:
    """The seed's anvil_bank_update with the plain cascade."""
    v = plain_cascade(bank, compile=compile)
    v = equalize(v, bank.lane_energy, beta2=bank.beta2, red_dim=bank.red_dim, compile=compile)
    sign_aligned_update(bank.p_slice, bank.mantissa, v, gate=bank.velocity[1], eff_lr=bank.eff_lr,
                        eff_wd=bank.eff_wd, compile=compile)
