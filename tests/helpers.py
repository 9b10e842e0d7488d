"""Shared test helpers: matrices with prescribed singular values, exact (mpmath) composites, and the
CUDA caching allocator's rounding."""

from __future__ import annotations

import mpmath
import numpy as np

from anvil_ref.cascade import composite


def orthonormal(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """An n x k matrix with orthonormal columns (k <= n), Haar-distributed."""
    q, r = np.linalg.qr(rng.standard_normal((n, k)))
    return q * np.sign(np.diag(r))


def matrix_with_spectrum(rng: np.random.Generator, m: int, n: int, s: np.ndarray):
    """(X, U, s, V) with X = U diag(s) V^T, U m x r and V n x r orthonormal, r = len(s) <= min(m, n)."""
    r = len(s)
    u, v = orthonormal(rng, m, r), orthonormal(rng, n, r)
    return (u * s) @ v.T, u, np.asarray(s, dtype=np.float64), v


def exact_composite(values, maps, *, dps: int = 50) -> np.ndarray:
    """F(values) evaluated in mpmath at ``dps`` digits, the coefficients taken as exact binary64
    numbers; returned rounded to float64."""
    with mpmath.workdps(dps):
        mp_maps = [tuple(mpmath.mpf(c) for c in t) for t in maps]
        return np.array([float(composite(mpmath.mpf(float(v)), maps=mp_maps)) for v in np.ravel(values)])


def exact_cascade_spectrum(s, maps, *, margin: float, eps: float, dps: int = 50) -> np.ndarray:
    """F(s_i / d) with d = margin * sqrt(sum s_i^2) + eps, all in mpmath at ``dps`` digits (the
    constants taken as their exact binary64 values); returned rounded to float64."""
    with mpmath.workdps(dps):
        mp_maps = [tuple(mpmath.mpf(c) for c in t) for t in maps]
        s_mp = [mpmath.mpf(float(v)) for v in s]
        d = mpmath.mpf(margin) * mpmath.sqrt(mpmath.fsum(v * v for v in s_mp)) + mpmath.mpf(eps)
        return np.array([float(composite(v / d, maps=mp_maps)) for v in s_mp])


def cuda_block_bound(nbytes: int) -> int:
    """The most bytes PyTorch's CUDA caching allocator (default settings: no expandable segments, no
    max split size) counts in ``memory_allocated`` for one request of ``nbytes``: the request rounded
    up to 512 B (kMinBlockSize), plus, for a request over 1 MiB (kSmallSize), the remainder of the
    block it takes, which it splits off only when more than 1 MiB would remain."""
    return -(-int(nbytes) // 512) * 512 + ((1 << 20) if nbytes > (1 << 20) else 0)
