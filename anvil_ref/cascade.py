"""Frobenius normalization and the six-map quintic cascade (seed: ``anvil_cascade`` after the rails).

For one matrix ``X`` (m x n; leading dimensions are a batch and every matrix is treated alone)::

    A_0 = G(X)                           G(X) = X^T X if m > n (tall), else X X^T (wide or square)
    d   = margin * sqrt(tr A_0) + eps    tr A_0 = ||X||_F^2 in either orientation
    X_1 = X / d,   A_1 = A_0 / d^2        (the first Gram is rescaled, not recomputed)
    X_{k+1} = a_k X_k + X_k (b_k A_k + c_k A_k^2)     tall: right multiplication
    X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k     wide/square: left multiplication
    A_{k+1} = G(X_{k+1})

With ``X = U diag(s) V^T`` each map acts on the singular values alone, ``s -> p_k(s)`` with
``p_k(s) = a_k s + b_k s^3 + c_k s^5``, so the cascade returns ``U diag(F(s/d)) V^T`` where
``F = p_6 o ... o p_1`` is :func:`composite`. Both orientations give the same matrix in exact
arithmetic; the choice (the smaller Gram) only matters for cost and rounding.

A zero matrix is a documented finite case: ``d = eps`` and the result is exactly zero.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._arrays import ReferenceInputError, like, to_f64, to_scalar
from .constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN
from .maps import MapsLike, load_maps


def quintic(sigma: Any, coeffs: tuple[float, float, float]) -> Any:
    """One odd quintic ``p(s) = a*s + b*s**3 + c*s**5`` (Horner form ``s*(a + s^2*(b + c*s^2))``).

    Uses only ``+`` and ``*``, so it evaluates floats, NumPy arrays, mpmath numbers and intervals
    alike, in their own arithmetic. No conversion is made.
    """
    a, b, c = coeffs
    s2 = sigma * sigma
    return sigma * (a + s2 * (b + c * s2))


def composite(sigma: Any, *, maps: MapsLike = ANVIL_MAPS) -> Any:
    """The scalar composite ``F(s) = p_K(...p_2(p_1(s)))`` of a map set, in the arithmetic of ``sigma``.

    Pass mpmath numbers (and coefficients converted with ``mpmath.mpf``, which is exact for the
    binary64 values) for a high-precision evaluation; plain floats give float64. A name or a JSON
    path is resolved with :func:`anvil_ref.maps.load_maps`; literal coefficients are used as given
    (unconverted, so mpmath numbers and intervals keep their own arithmetic).
    """
    for coeffs in load_maps(maps) if isinstance(maps, (str, os.PathLike)) else maps:
        sigma = quintic(sigma, coeffs)
    return sigma


def is_tall(shape: tuple[int, ...]) -> bool:
    """Orientation rule: a matrix is tall when it has more rows than columns (``m > n``)."""
    return shape[-2] > shape[-1]


def gram(x: Any) -> Any:
    """The cascade's Gram ``G(X)``: ``X^T X`` for tall X, ``X X^T`` for wide or square X (batched)."""
    x_ = to_f64(x, "x", min_ndim=2)
    xt = np.swapaxes(x_, -1, -2)
    return like(xt @ x_ if is_tall(x_.shape) else x_ @ xt, x)


def frobenius_scale(first_gram: Any, *, margin: float = FROBENIUS_MARGIN,
                    eps: float = FROBENIUS_EPS) -> Any:
    """``d = margin * sqrt(tr A_0) + eps``, one per matrix, shaped ``[..., 1, 1]``."""
    a = to_f64(first_gram, "first_gram", min_ndim=2)
    tr = np.trace(a, axis1=-2, axis2=-1)[..., None, None]
    return like(margin * np.sqrt(tr) + eps, first_gram)


def frobenius_normalize(x: Any, *, margin: float = FROBENIUS_MARGIN, eps: float = FROBENIUS_EPS) -> Any:
    """``X / (margin * ||X||_F + eps)``, with ``||X||_F^2`` read off the trace of the first Gram."""
    x_ = to_f64(x, "x", min_ndim=2)
    return like(x_ / frobenius_scale(gram(x_), margin=margin, eps=eps), x)


def normalized_pair(x: Any, *, margin: float = FROBENIUS_MARGIN,
                    eps: float = FROBENIUS_EPS) -> tuple[np.ndarray, np.ndarray]:
    """``X_1 = X / d`` and ``A_1 = A_0 / d^2`` (the first Gram rescaled, not recomputed), float64
    NumPy arrays, after checking what the cascade needs: matrices of at least one row and one column,
    ``margin, eps >= 0`` and not both 0 (the normalization would divide by zero)."""
    x_ = to_f64(x, "x", min_ndim=2)
    if x_.shape[-1] == 0 or x_.shape[-2] == 0:
        raise ReferenceInputError(f"x: matrices must have at least one row and one column, got shape {x_.shape}")
    margin = to_scalar(margin, "margin", lo=0.0)
    eps = to_scalar(eps, "eps", lo=0.0)
    if margin == 0.0 and eps == 0.0:
        raise ReferenceInputError("margin and eps are both 0: the normalization would divide by zero")
    a0 = gram(x_)
    d = frobenius_scale(a0, margin=margin, eps=eps)
    return x_ / d, a0 / (d * d)


def quintic_map(x: Any, coeffs: tuple[float, float, float], *, a_gram: Any = None) -> Any:
    """One map of the cascade on a matrix: ``a X + X (b A + c A^2)`` if tall, else
    ``a X + (b A + c A^2) X``, with ``A = G(X)`` (or ``a_gram`` when the caller has it)."""
    x_ = to_f64(x, "x", min_ndim=2)
    a_ = to_f64(gram(x_) if a_gram is None else a_gram, "a_gram", min_ndim=2)
    a, b, c = coeffs
    poly = b * a_ + c * (a_ @ a_)
    return like(a * x_ + (x_ @ poly if is_tall(x_.shape) else poly @ x_), x)


def cascade(x: Any, *, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
            eps: float = FROBENIUS_EPS) -> Any:
    """The full cascade (module docstring): Frobenius normalization, then every map in order.

    ``x`` has shape ``[..., m, n]`` with m, n >= 1 and finite entries. Returns float64 of the same
    shape (a CPU torch.float64 tensor for torch input, else a NumPy array).
    """
    maps_ = load_maps(maps)
    xk, ak = normalized_pair(x, margin=margin, eps=eps)
    for k, coeffs in enumerate(maps_):
        xk = quintic_map(xk, coeffs, a_gram=ak if k == 0 else None)
    return like(xk, x)
