"""The input families of the differential tests (anvil_fast.studies.difftest, anvil_fast.studies.harness) and their
error measure.

``make_matrix(family, shape, seed=...)`` builds a float32 batch ``[chunk, rows, cols]`` of one family,
deterministic in its seed; ``rel_errs`` / ``rel_err`` measure an output against a float64 reference
(relative Frobenius error per matrix; absolute where the reference is zero; inf where the output is
not finite).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FAMILIES = ("gaussian", "low_rank", "near_rank1", "decaying", "zero", "huge", "tiny", "well_conditioned")
#: Families on which the eager bf16 path is also judged against the float64 reference (the second side
#: of anvil_fast/core/tolerances.py's rule): every singular value of X / d inside the maps' design interval and far
#: from 0, so no rounding is amplified by the composite's large slope near 0.
WELL_CONDITIONED = ("well_conditioned",)
#: Singular values of the "well_conditioned" family: uniform in [lo, hi] (condition number <= 2).
WELL_CONDITIONED_SV = (0.5, 1.0)

#: Scale exponents of the "huge" and "tiny" families: 2**100 overflows fp32 squares (the seed's bf16
#: Gram), 2**-100 underflows them.
HUGE_EXP, TINY_EXP = 100, -100


def make_matrix(family: str, shape: tuple[int, ...], *, seed: int = 0, device="cpu") -> Tensor:
    """A float32 batch ``[chunk, rows, cols]`` of the named family (deterministic in ``seed``)."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    g = torch.Generator().manual_seed(seed)
    b, m, n = shape
    k = min(m, n)
    if family in ("gaussian", "huge", "tiny"):
        x = torch.randn(shape, generator=g)
        x = x * 2.0 ** {"gaussian": 0, "huge": HUGE_EXP, "tiny": TINY_EXP}[family]
    elif family == "low_rank":
        r = max(1, k // 8)
        x = torch.randn(b, m, r, generator=g) @ torch.randn(b, r, n, generator=g) / math.sqrt(r)
    elif family == "near_rank1":
        x = torch.randn(b, m, 1, generator=g) * torch.randn(b, 1, n, generator=g) + 1e-4 * torch.randn(shape, generator=g)
    elif family == "well_conditioned":
        lo, hi = WELL_CONDITIONED_SV
        s = lo + (hi - lo) * torch.rand(b, 1, k, generator=g)
        u = torch.linalg.qr(torch.randn(b, m, k, generator=g))[0]
        v = torch.linalg.qr(torch.randn(b, n, k, generator=g))[0]
        x = (u * s) @ v.mT
    elif family == "decaying":
        s = 0.9 ** torch.arange(k, dtype=torch.float32)
        u = torch.linalg.qr(torch.randn(b, m, k, generator=g))[0]
        v = torch.linalg.qr(torch.randn(b, n, k, generator=g))[0]
        x = (u * s) @ v.mT
    else:
        x = torch.zeros(shape)
    return x.to(device)


def rel_errs(y: Tensor, ref: Tensor) -> Tensor:
    """Per matrix ||y - ref||_F / ||ref||_F (absolute where ||ref|| = 0; inf where y is not finite), on the
    CPU. Computed in float64 on y's device: only the per-matrix values travel (a spectrum probe's output is
    2^26 elements, half a GiB in float64, which a copy to the host per call would move)."""
    y64 = y.detach().double().reshape(-1, *y.shape[-2:])
    r64 = ref.detach().to(y64.device, torch.float64).reshape(-1, *ref.shape[-2:])
    num = (y64 - r64).flatten(1).norm(dim=1)
    den = r64.flatten(1).norm(dim=1)
    err = torch.where(den > 0, num / den.clamp_min(1e-300), num)
    return torch.where(torch.isfinite(y64).flatten(1).all(dim=1), err, torch.full_like(err, math.inf)).cpu()


def rel_err(y: Tensor, ref: Tensor) -> float:
    """max over matrices of ||y - ref||_F / ||ref||_F (absolute where ||ref|| = 0; inf if y is not finite)."""
    return float(rel_errs(y, ref).max())
