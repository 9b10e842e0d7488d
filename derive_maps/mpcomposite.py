"""The composite and its derivatives in mpmath: values, slopes and coefficient gradients.

For a map set ``theta = (a_1, b_1, c_1, ..., a_K, b_K, c_K)`` and stages ``s_0 = x``,
``s_k = p_k(s_{k-1})``, ``F = s_K``::

    dF/dx     = prod_k p_k'(s_{k-1})
    dF/da_k   = T_k s_{k-1},  dF/db_k = T_k s_{k-1}^3,  dF/dc_k = T_k s_{k-1}^5,
                with T_k = prod_{j > k} p_j'(s_{j-1})  (the slope of the maps after k)

All arithmetic is mpmath at the caller's working precision (use ``mpmath.workdps``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mpmath

Theta = list  # flat list of mpf, length 3K


def to_theta(maps: Sequence[Sequence]) -> Theta:
    """Flatten a map set into a list of mpf (exact for float64 coefficients)."""
    return [mpmath.mpf(v) for triple in maps for v in triple]


def to_maps(theta: Theta) -> tuple[tuple[float, float, float], ...]:
    """Round a flat mpf list to float64 triples (round to nearest)."""
    vals = [float(v) for v in theta]
    return tuple(tuple(vals[i:i + 3]) for i in range(0, len(vals), 3))


def stages(theta: Theta, x) -> list:
    """``[s_0, s_1, ..., s_K]`` at x."""
    s = mpmath.mpf(x)
    out = [s]
    for k in range(0, len(theta), 3):
        a, b, c = theta[k:k + 3]
        t = s * s
        s = s * (a + t * (b + c * t))
        out.append(s)
    return out


def value(theta: Theta, x):
    return stages(theta, x)[-1]


def value_and_slope(theta: Theta, x):
    """``(F(x), F'(x))``."""
    s = mpmath.mpf(x)
    d = mpmath.mpf(1)
    for k in range(0, len(theta), 3):
        a, b, c = theta[k:k + 3]
        t = s * s
        d = d * (a + t * (3 * b + 5 * c * t))
        s = s * (a + t * (b + c * t))
    return s, d


def value_and_gradient(theta: Theta, x):
    """``(F(x), [dF/dtheta_i])``."""
    st = stages(theta, x)
    n = len(theta) // 3
    grad = [mpmath.mpf(0)] * len(theta)
    tail = mpmath.mpf(1)
    for k in range(n - 1, -1, -1):
        a, b, c = theta[3 * k:3 * k + 3]
        s = st[k]
        t = s * s
        grad[3 * k] = tail * s
        grad[3 * k + 1] = tail * s * t
        grad[3 * k + 2] = tail * s * t * t
        tail = tail * (a + t * (3 * b + 5 * c * t))
    return st[-1], grad
