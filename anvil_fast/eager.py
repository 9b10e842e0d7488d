"""Plain eager-torch bf16 versions of ANVIL's math: the seed's operations and roundings, with
library matmuls (cuBLAS on a GPU, the CPU BLAS otherwise) instead of the symmetric Triton kernels,
and no torch.compile.

They serve two purposes: the "eager bf16" error floor that the fast path is judged against (see
tests/tolerances.py), and a seed-faithful bf16 cascade that runs anywhere (derive_maps measures
bf16-realized envelopes with it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN, SPLIT_BADDBMM_MIN_ROWS
from anvil_ref.maps import MapsLike, load_maps


def _gram(x: Tensor, tall: bool) -> Tensor:
    return x.mT @ x if tall else x @ x.mT


def eager_bf16_cascade(x: Tensor, *, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                       eps: float = FROBENIUS_EPS, split: bool | None = None) -> Tensor:
    """The seed's bf16 cascade in eager torch: ``x`` ([..., m, n], any float dtype) is cast to bf16;
    every Gram, ``b*A + c*A@A`` (one baddbmm: fp32 accumulation, one rounding) and ``a*X + X@B``
    (one baddbmm, or bmm then add when ``split``; default: rows > SPLIT_BADDBMM_MIN_ROWS, as the
    seed) is rounded to bf16; the trace and the normalization are computed in fp32. Returns bf16.
    """
    maps_ = load_maps(maps)
    if x.ndim < 2:
        raise ValueError(f"x: expected [..., rows, cols], got shape {tuple(x.shape)}")
    lead = x.shape[:-2]
    X = x.reshape(-1, *x.shape[-2:]).to(torch.bfloat16)
    tall = X.size(-2) > X.size(-1)
    if split is None:
        split = X.size(-2) > SPLIT_BADDBMM_MIN_ROWS
    A = _gram(X, tall)
    tr = A.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None]
    d = tr.sqrt() * margin + eps
    X = (X.float() / d).bfloat16()
    A = (A.float() / d.square()).bfloat16()
    for k, (a, b, c) in enumerate(maps_):
        if k > 0:
            A = _gram(X, tall)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        if split:
            C = torch.bmm(X, B) if tall else torch.bmm(B, X)
            X = C.add_(X, alpha=a)
        else:
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X.reshape(*lead, *X.shape[-2:])
