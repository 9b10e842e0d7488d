"""The polar factor and the odd-quintic iterations that approximate it, as an implementation declares them.

ANVIL's cascade (:mod:`anvil_ref.cascade`) is one such iteration; Newton-Schulz (Muon) and Polar
Express are others. An implementation declares three things, and this module runs exactly that math
in float64:

* **its per-step coefficients** ``(a_k, b_k, c_k)``, k = 1..K, any K (a map set, :mod:`anvil_ref.maps`);
* **its orientation rule** (``transpose_when``): which matrices it transposes before iterating, so
  that the Gram ``A = Z Z^T`` of the oriented matrix ``Z`` is the one it forms::

      "tall"    rows > cols are transposed: the Gram is formed on the short side (rows x rows of a wide Z)
      "wide"    rows < cols are transposed: the long side
      "never"   Z = X;     "always"   Z = X^T

  (ANVIL's cascade multiplies a tall X from the right instead, ``X (b A + c A^2)`` with ``A = X^T X``:
  the same products as transposing, so its rule is "tall");
* **its normalization** ``Z_0 = N(Z)``, :data:`NORMALIZATIONS`::

      "frobenius"        Z / (margin ||Z||_F + eps)                          (ANVIL, dion)
      "frobenius_clamp"  Z / max(margin ||Z||_F, eps)                        (torch, emerging, heavyball)
      "aol"              diag(r) Z,  r_i = max(sum_j |(Z Z^T)_ij|, eps)^(-1/2)   (row scaling, dion's AOL)

and iterates on the oriented matrix, transposing the result back::

    A_k     = Z_k Z_k^T
    Z_{k+1} = a_k Z_k + (b_k A_k + c_k A_k^2) Z_k

Each step maps every singular value ``s -> p_k(s) = a_k s + b_k s^3 + c_k s^5`` and keeps the singular
vectors, so with ``X = U diag(s) V^T`` a Frobenius normalization gives ``U diag(F(s / d)) V^T``,
``F = p_K o ... o p_1`` (:func:`anvil_ref.cascade.composite`), whatever the orientation: the rule then
decides only which Gram is formed (cost and rounding). AOL's row scaling is not a function of the
singular values; it depends on the orientation.

The singular values of ``Z_0`` lie in ``[0, spectrum_top]`` (:func:`spectrum_top`): ``1 / margin``
for the Frobenius normalizations (``s_max <= ||X||_F``), 1 for AOL (``D A D`` with ``D = diag(r)`` has
every absolute row sum at most 1, so its eigenvalues, the squared singular values of ``diag(r) Z``,
are at most 1).

The target of every such iteration is the polar factor ``U V^T`` (:func:`polar_factor`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import ReferenceInputError, like, to_f64, to_scalar
from .cascade import composite, frobenius_scale, quintic
from .maps import MapsLike, load_maps

#: Normalizations an implementation can declare (module docstring).
NORMALIZATIONS = ("frobenius", "frobenius_clamp", "aol")
#: Orientation rules an implementation can declare (module docstring).
ORIENTATIONS = ("tall", "wide", "never", "always")


def _check(normalization: str, transpose_when: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ReferenceInputError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
    if transpose_when not in ORIENTATIONS:
        raise ReferenceInputError(f"transpose_when: expected one of {ORIENTATIONS}, got {transpose_when!r}")


def transposes(shape: tuple[int, ...], *, transpose_when: str) -> bool:
    """Whether the orientation rule transposes a matrix of ``shape`` (``[..., rows, cols]``)."""
    _check("frobenius", transpose_when)
    rows, cols = shape[-2], shape[-1]
    return {"tall": rows > cols, "wide": rows < cols, "never": False, "always": True}[transpose_when]


def gram_side(shape: tuple[int, ...], *, transpose_when: str) -> int:
    """The side of the Gram ``Z Z^T`` the rule forms for a matrix of ``shape``: its cols if transposed,
    else its rows."""
    return shape[-1] if transposes(shape, transpose_when=transpose_when) else shape[-2]


def normalize(z: Any, *, normalization: str, margin: float = 1.0, eps: float = 1e-7) -> Any:
    """``Z_0 = N(Z)`` of the oriented matrix (module docstring), one per matrix of a batch."""
    _check(normalization, "tall")
    z_ = to_f64(z, "z", min_ndim=2)
    margin = to_scalar(margin, "margin", lo=0.0)
    eps = to_scalar(eps, "eps", lo=0.0)
    zt = np.swapaxes(z_, -1, -2)
    if normalization == "aol":
        if eps == 0.0:
            raise ReferenceInputError("aol: eps must be > 0 (a zero row would divide by zero)")
        r = np.maximum(np.abs(z_ @ zt).sum(axis=-1), eps) ** -0.5
        return like(z_ * r[..., :, None], z)
    if margin == 0.0 and eps == 0.0:
        raise ReferenceInputError("margin and eps are both 0: the normalization would divide by zero")
    if normalization == "frobenius":
        d = frobenius_scale(z_ @ zt, margin=margin, eps=eps)
    else:
        d = np.maximum(margin * np.sqrt(np.square(z_).sum(axis=(-2, -1), keepdims=True)), eps)
    if np.any(d == 0.0):
        raise ReferenceInputError("frobenius_clamp: a zero matrix with eps = 0 would divide by zero")
    return like(z_ / d, z)


def quintic_step(z: Any, coeffs: tuple[float, float, float]) -> Any:
    """One step on the oriented matrix: ``a Z + (b A + c A^2) Z`` with ``A = Z Z^T``."""
    z_ = to_f64(z, "z", min_ndim=2)
    a, b, c = coeffs
    g = z_ @ np.swapaxes(z_, -1, -2)
    return like(a * z_ + (b * g + c * (g @ g)) @ z_, z)


def quintic_iteration(x: Any, *, coeffs: MapsLike, normalization: str = "frobenius", margin: float = 1.0,
                      eps: float = 1e-7, transpose_when: str = "tall") -> Any:
    """The declared iteration (module docstring) of ``x`` (``[..., rows, cols]``, finite): orient,
    normalize, one :func:`quintic_step` per coefficient triple, orient back. Returns float64 of
    ``x``'s shape (a CPU torch.float64 tensor for torch input, else a NumPy array)."""
    _check(normalization, transpose_when)
    maps_ = load_maps(coeffs)
    x_ = to_f64(x, "x", min_ndim=2)
    if x_.shape[-1] == 0 or x_.shape[-2] == 0:
        raise ReferenceInputError(f"x: matrices must have at least one row and one column, got shape {x_.shape}")
    flip = transposes(x_.shape, transpose_when=transpose_when)
    z = np.swapaxes(x_, -1, -2) if flip else x_
    z = normalize(z, normalization=normalization, margin=margin, eps=eps)
    for triple in maps_:
        z = quintic_step(z, triple)
    return like(np.swapaxes(z, -1, -2) if flip else z, x)


def spectrum_top(*, normalization: str, margin: float = 1.0) -> float:
    """The largest singular value ``Z_0 = N(Z)`` can have (module docstring): ``1 / margin`` for the
    Frobenius normalizations, 1 for AOL."""
    _check(normalization, "tall")
    return 1.0 if normalization == "aol" else 1.0 / to_scalar(margin, "margin", lo=0.0)


def normalized_singular_values(x: Any, *, normalization: str = "frobenius", margin: float = 1.0, eps: float = 1e-7,
                               transpose_when: str = "tall") -> np.ndarray:
    """The singular values of ``Z_0 = N(Z)`` (descending, ``[..., min(rows, cols)]``, float64 NumPy)."""
    _check(normalization, transpose_when)
    x_ = to_f64(x, "x", min_ndim=2)
    z = np.swapaxes(x_, -1, -2) if transposes(x_.shape, transpose_when=transpose_when) else x_
    return np.linalg.svd(normalize(z, normalization=normalization, margin=margin, eps=eps), compute_uv=False)


def composite_slope(sigma: Any, *, maps: MapsLike) -> Any:
    """``F'(s)`` of the composite ``F = p_K o ... o p_1`` by the chain rule,
    ``F'(s) = prod_k p_k'(s_{k-1})`` with ``s_0 = s``, ``s_k = p_k(s_{k-1})`` and
    ``p'(s) = a + 3 b s^2 + 5 c s^4``, in the arithmetic of ``sigma``."""
    slope = 1.0
    for a, b, c in load_maps(maps):
        s2 = sigma * sigma
        slope = slope * (a + s2 * (3.0 * b + 5.0 * c * s2))
        sigma = quintic(sigma, (a, b, c))
    return slope


def composite_max(*, maps: MapsLike, top: float, points: int = 65537) -> float:
    """``max F(s)`` over ``points`` equally spaced ``s`` in ``[0, top]`` (float64; a grid, not a
    certificate: :mod:`derive_maps` certifies)."""
    top = to_scalar(top, "top", lo=0.0)
    return float(np.max(composite(np.linspace(0.0, top, int(points)), maps=load_maps(maps))))


def polar_factor(x: Any, *, rtol: float | None = None) -> Any:
    """The polar factor ``U V^T`` of each matrix (``x = U diag(s) V^T``, float64 SVD), with the
    singular values at most ``rtol * s_max`` treated as zero (default ``max(rows, cols) * 2**-52``):
    their singular vectors are not determined by ``x``, and every odd iteration maps a zero
    singular value to zero. A zero matrix gives zero."""
    x_ = to_f64(x, "x", min_ndim=2)
    u, s, vh = np.linalg.svd(x_, full_matrices=False)
    tol = (max(x_.shape[-2:]) * 2.0 ** -52 if rtol is None else to_scalar(rtol, "rtol", lo=0.0)) * s[..., :1]
    keep = (s > tol).astype(np.float64)
    return like((u * keep[..., None, :]) @ vh, x)
