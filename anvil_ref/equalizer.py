"""The lane-energy equalizer (seed: ``AnvilAndAdam._rail_equalizer``), as the seed's code does it.

For one m x n matrix ``V`` (leading dimensions are a batch) the reduction axis is the *shorter*
dimension: the last axis (over columns) when ``m >= n``, else the rows. A "lane" is one entry of the
other, longer (or equal) dimension: a row when ``m >= n``, a column otherwise. With ``L`` the number
of entries reduced (the lane length)::

    P_i  = (1/L) * sum_j V_ij^2                  lane power (mean square of lane i)
    E_i' = beta2 * E_i + (1 - beta2) * P_i       lane-energy EMA (seed: lerp with weight 1 - beta2)
    g_i  = 1 / sqrt(max(E_i', 1e-10))            lane gain
    r    = sqrt(L * sum_i P_i)                   = ||V||_F, the norm before equalization
    q    = max(sqrt(L * sum_i P_i g_i^2), 1e-10) = ||diag(g) V||_F, the norm after the gains
    V'   = V * g_i * (r / q)                     every lane rescaled; ||V'||_F = ||V||_F

The seed's docstring and its state comment say the lanes are "reduced over ... the longer
dimension"; its code (``red_dim = -1 if rows >= cols else -2``) reduces over the shorter one. The
code is the specification; see :mod:`anvil_ref` for the list of such disagreements.

A zero ``V`` is a documented finite case: ``V' = 0`` and ``E' = beta2 * E``.

A *transposed* matrix (:mod:`anvil_ref.config`, ``transposed``) is stored as ``V = M^T`` of the
matrix ``M`` it acts as; its lanes are ``M``'s, so the reduction axis is ``M``'s mapped to the
stored layout: ``equalize(V) = equalize(M)^T`` with the lane energy stored transposed as well.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._arrays import ReferenceInputError, like, to_f64, to_scalar
from .constants import LANE_ENERGY_FLOOR


class EqualizeResult(NamedTuple):
    """What :func:`equalize` returns (float64, the kind of ``v``)."""

    v: Any  #: the equalized matrix V'
    lane_energy: Any  #: the updated lane energy E'


def reduction_axis(shape: tuple[int, ...], *, transposed: bool = False) -> int:
    """The axis the lane power is averaged over: -1 (columns) if rows >= cols, else -2 (rows).
    ``transposed``: ``shape`` stores the transposes of the matrices the update is defined on, and the
    axis is theirs, in the stored layout (-2 if cols >= rows, else -1)."""
    if len(shape) < 2:
        raise ReferenceInputError(f"expected a matrix or a batch of matrices, got shape {tuple(shape)}")
    if transposed:
        return -2 if shape[-1] >= shape[-2] else -1
    return -1 if shape[-2] >= shape[-1] else -2


def lane_energy_shape(shape: tuple[int, ...], *, transposed: bool = False) -> tuple[int, ...]:
    """Shape of the lane-energy state for a bank of matrices of ``shape``: ``[..., m, 1]`` if m >= n,
    else ``[..., 1, n]`` (``transposed``: the reduction axis of :func:`reduction_axis` with it)."""
    axis = reduction_axis(shape, transposed=transposed)
    out = list(shape)
    out[axis] = 1
    return tuple(out)


def lane_power(v: Any) -> Any:
    """``P = mean(V^2)`` over the reduction axis, kept as a size-1 axis."""
    v_ = to_f64(v, "v", min_ndim=2)
    return like(np.mean(v_ * v_, axis=reduction_axis(v_.shape), keepdims=True), v)


def lane_energy_ema(lane_energy: Any, power: Any, *, beta2: float) -> Any:
    """``E' = beta2 * E + (1 - beta2) * P``."""
    e, p = to_f64(lane_energy, "lane_energy"), to_f64(power, "power")
    if e.shape != p.shape:
        raise ReferenceInputError(f"lane_energy: shape {e.shape} does not match the lane power's {p.shape}")
    beta2 = to_scalar(beta2, "beta2", lo=0.0, hi=1.0)
    return like(beta2 * e + (1.0 - beta2) * p, lane_energy)


def lane_gain(lane_energy: Any) -> Any:
    """``g = 1 / sqrt(max(E, 1e-10))``."""
    e = to_f64(lane_energy, "lane_energy")
    return like(1.0 / np.sqrt(np.maximum(e, LANE_ENERGY_FLOOR)), lane_energy)


def equalize(v: Any, lane_energy: Any, *, beta2: float) -> EqualizeResult:
    """One equalizer step (module docstring). ``lane_energy`` has shape :func:`lane_energy_shape`
    ``(v.shape)``; returns :class:`EqualizeResult` ``(v', E')``. Inputs are not modified."""
    v_ = to_f64(v, "v", min_ndim=2)
    e = to_f64(lane_energy, "lane_energy")
    expected = lane_energy_shape(v_.shape)
    if e.shape != expected:
        raise ReferenceInputError(f"lane_energy: expected shape {expected} for v of shape {v_.shape} "
                                  f"(one entry per lane), got {e.shape}")
    axis = reduction_axis(v_.shape)
    length = v_.shape[axis]
    p = lane_power(v_)
    e_new = lane_energy_ema(e, p, beta2=beta2)
    g = lane_gain(e_new)
    pre_norm = np.sqrt(length * np.sum(p, axis=(-2, -1), keepdims=True))
    post_norm = np.maximum(np.sqrt(length * np.sum(p * g * g, axis=(-2, -1), keepdims=True)),
                           LANE_ENERGY_FLOOR)
    return EqualizeResult(like(v_ * g * (pre_norm / post_norm), v), like(e_new, v))
