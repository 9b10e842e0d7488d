"""``Q = a I + Q`` in place, for a batch of square bf16 matrices: the Gram-side cascade's start of an
accumulated polynomial (:func:`anvil_fast.core.cascade.gram_side_workspace`; reference:
:func:`anvil_ref.gram_side.map_polynomial`, whose ``b A + c A^2`` is the ``B`` that becomes ``Q``).

Off the diagonal nothing changes; on it ``Q_ii`` becomes ``bf16(fp32(Q_ii) + a)``, the diagonal added in
fp32 and rounded once (``a`` an fp32 scalar). A bf16 tensor's in-place ``add_(a)`` would first round
``a`` to bf16, a bias of up to 2**-9 on every eigenvalue of Q that the accumulated polynomial never
loses.

Why a kernel: as torch operations the diagonal is three small kernels (to fp32, the add, back to bf16),
three launches where one touches the ``n`` diagonal entries of each matrix. On CPU (or without Triton)
the torch operations run; ``backend="triton"`` runs the kernel anyway (on CPU under
``TRITON_INTERPRET=1``, as the tests do).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .backend import matrix_slices, round_fix, triton_available, use_triton, widen_fix

if triton_available():
    import triton
    import triton.language as tl

    from .backend import from_bf16, to_bf16
else:  # pragma: no cover
    triton = None

#: Diagonal entries per program (of one matrix's n).
BLOCK = 256


if triton is not None:

    @triton.jit
    def _plus_identity_kernel(Q, n, nn, a, WIDEN_FIX: tl.constexpr, ROUND_FIX: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        # entry (i, i) of matrix c: c * n^2 + i * (n + 1); the batch offset in int64 (batches of large n
        # pass 2**31 elements)
        p = Q + tl.program_id(1).to(tl.int64) * nn + i.to(tl.int64) * (n + 1)
        x = tl.load(p, mask=m, other=0.0)
        tl.store(p, to_bf16(from_bf16(x, WIDEN_FIX) + a, ROUND_FIX), mask=m)


def _plus_identity_torch(Q: Tensor, a: float) -> None:
    diag = Q.diagonal(dim1=-2, dim2=-1)
    diag.copy_(diag.float() + a)


@torch.no_grad()
def plus_identity_(Q: Tensor, a: float, *, backend: str = "auto") -> Tensor:
    """``Q = a I + Q`` in place for a contiguous bf16 ``Q`` of shape ``[..., n, n]``, the diagonal
    ``bf16(fp32(Q_ii) + a)``; returns ``Q``. ``a``: a finite Python number."""
    if not isinstance(Q, Tensor):
        raise ValueError(f"plus_identity_: Q must be a tensor, got {type(Q).__name__}")
    if Q.dtype != torch.bfloat16 or Q.ndim < 2 or Q.shape[-1] != Q.shape[-2]:
        raise ValueError(f"plus_identity_: expected a bf16 Q of square shape [..., n, n], got {Q.dtype} "
                         f"{tuple(Q.shape)}")
    if not Q.is_contiguous():
        raise ValueError("plus_identity_: Q must be contiguous")
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
        raise ValueError(f"plus_identity_: a must be a finite number, got {a!r}")
    if Q.numel() == 0:
        return Q
    if not use_triton(Q, backend):
        _plus_identity_torch(Q, float(a))
        return Q
    n = Q.shape[-1]
    q3 = Q.view(-1, n, n)
    for s, e in matrix_slices(q3.shape[0]):
        _plus_identity_kernel[(triton.cdiv(n, BLOCK), e - s)](
            q3[s:e], n, n * n, float(a), WIDEN_FIX=widen_fix(), ROUND_FIX=round_fix(), BLOCK=BLOCK, num_warps=4)
    return Q


__all__ = ["plus_identity_"]
