"""The composite and its slope in mpmath.

For a map set ``theta = (a_1, b_1, c_1, ..., a_K, b_K, c_K)`` and stages ``s_0 = x``,
``s_k = p_k(s_{k-1})``, ``F = s_K``::

    dF/dx     = prod_k p_k'(s_{k-1})

(The coefficient gradients the polish step needs: :func:`derive_maps.polish.jets`, vectorized.)

All arithmetic is mpmath at the caller's working precision (use ``mpmath.workdps``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mpmath

Theta = list  # flat list of mpf, length 3K


def to_theta(maps: Sequence[Sequence]) -> Theta:
    """Flatten a map set into a list of mpf (exact for float64 coefficients)."""
    return [mpmath.mpf(v) for triple in maps for v in triple]


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
