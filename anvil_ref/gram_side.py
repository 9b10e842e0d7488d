"""The Gram-side cascade: the maps of :mod:`anvil_ref.cascade` run on the short side, with restarts.

For one tall matrix ``X`` (m x n, m > n; leading dimensions are a batch), after the same Frobenius
normalization as :func:`anvil_ref.cascade.cascade` (``X_1 = X / d``, ``A_1 = X_1^T X_1``)::

    Q_k     = a_k I + b_k A_k + c_k A_k^2           (n x n, a polynomial in A_k)
    A_{k+1} = Q_k A_k Q_k                            (= X_{k+1}^T X_{k+1}, since X_{k+1} = X_k Q_k)
    R       = Q_1 Q_2 ... Q_K,   output  X_1 R

Every ``Q_k`` is a polynomial in ``A_1``, so all of them commute with each other and with every
``A_k``; ``X_1 R`` is the cascade's ``X_{K+1}`` in exact arithmetic. Rounded, ``A_k`` drifts away
from ``(X_1 R)^T (X_1 R)`` (most on small singular values), so the iteration may be *restarted*
before map j::

    X = X_0 R,   A = G(X),   X_0 <- X,   R <- I

where ``X_0`` is the matrix the current ``R`` multiplies (``X_1`` until the first restart). The
restart schedule is data: a strictly increasing tuple of map numbers ``j`` (1-based, as the maps are
counted in the cascade: map 1 is the first), each in ``2 .. K`` (a restart before map 1 would
change nothing). In exact arithmetic every schedule gives the same matrix.

Wide matrices (m < n) and square ones take the mirrored form on the left side, ``A = X X^T``,
``X_{k+1} = Q_k X_k``, ``R = Q_K ... Q_1``, output ``R X_1`` (the same side rule as
:func:`anvil_ref.cascade.gram`: the smaller Gram, ``X X^T`` for square matrices).

A zero matrix gives exactly zero (``d = eps``, every ``A_k`` is zero, ``R = prod a_k I``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import ReferenceInputError, like, to_f64
from .cascade import gram, is_tall, normalized_pair
from .constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN
from .maps import MapsLike, load_maps


def check_restarts(restarts: Any, n_maps: int) -> tuple[int, ...]:
    """A restart schedule as a tuple of ints, strictly increasing, each in ``2 .. n_maps``."""
    try:
        sched = tuple(restarts)
    except TypeError:
        raise ReferenceInputError(f"restarts: expected a tuple of map numbers, got {type(restarts).__name__}") from None
    for j in sched:
        if isinstance(j, bool) or not isinstance(j, (int, np.integer)) or not 2 <= int(j) <= n_maps:
            raise ReferenceInputError(f"restarts: every entry must be a map number in 2..{n_maps} (1-based; a "
                                      f"restart before map 1 changes nothing), got {sched!r}")
    sched = tuple(int(j) for j in sched)
    if any(b <= a for a, b in zip(sched, sched[1:])):
        raise ReferenceInputError(f"restarts: expected strictly increasing map numbers, got {sched!r}")
    return sched


def map_polynomial(a_gram: Any, coeffs: tuple[float, float, float]) -> Any:
    """``Q = a I + b A + c A^2`` for a batch of symmetric ``A`` ([..., n, n])."""
    a_ = to_f64(a_gram, "a_gram", min_ndim=2)
    a, b, c = coeffs
    eye = np.eye(a_.shape[-1])
    return like(a * eye + b * a_ + c * (a_ @ a_), a_gram)


def gram_update(a_gram: Any, q: Any) -> Any:
    """``A_{k+1} = Q A Q`` (the Gram of the mapped matrix)."""
    a_ = to_f64(a_gram, "a_gram", min_ndim=2)
    q_ = to_f64(q, "q", min_ndim=2)
    return like(q_ @ a_ @ q_, a_gram)


def apply_side(x: Any, r: Any) -> Any:
    """``X R`` for tall X, ``R X`` for wide or square X: the accumulated maps applied to X."""
    x_ = to_f64(x, "x", min_ndim=2)
    r_ = to_f64(r, "r", min_ndim=2)
    return like(x_ @ r_ if is_tall(x_.shape) else r_ @ x_, x)


def gram_side_cascade(x: Any, *, maps: MapsLike = ANVIL_MAPS, restarts: Any = (), margin: float = FROBENIUS_MARGIN,
                      eps: float = FROBENIUS_EPS) -> Any:
    """The Gram-side cascade (module docstring) with restart schedule ``restarts``.

    ``x`` has shape ``[..., m, n]`` with m, n >= 1 and finite entries; ``margin``/``eps`` as in
    :func:`anvil_ref.cascade.cascade`. Returns float64 of x's shape (a CPU torch.float64 tensor for
    torch input, else a NumPy array), equal to ``cascade(x, maps=maps, margin=margin, eps=eps)`` in
    exact arithmetic for every schedule.
    """
    maps_ = load_maps(maps)
    sched = check_restarts(restarts, len(maps_))
    x0, ak = normalized_pair(x, margin=margin, eps=eps)
    r = np.broadcast_to(np.eye(ak.shape[-1]), ak.shape).copy()
    for k, coeffs in enumerate(maps_, start=1):
        if k in sched:
            x0 = apply_side(x0, r)
            ak = gram(x0)
            r = np.broadcast_to(np.eye(ak.shape[-1]), ak.shape).copy()
        q = map_polynomial(ak, coeffs)
        r = r @ q if is_tall(x0.shape) else q @ r
        ak = gram_update(ak, q)
    return like(apply_side(x0, r), x)
