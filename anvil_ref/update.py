"""ANVIL's parameter update: effective rates, per-matrix multipliers, and sign-aligned decay
(seed: ``AnvilAndAdam._build_param_cfg``, ``stage_bank_scalars``, ``_sign_aligned_decay_update``).

For a bank of matrices ``P`` (``[chunk, m, n]``), its equalized update ``U``, the slow rail ``S`` (the
gate) and the per-step hyper-parameters::

    eff_wd   = wd_mul * weight_decay * lr                             (one scalar per bank)
    eff_lr_k = lr_mul * shape_mult * mult_k * lr                      (one scalar per matrix k)
    shape_mult = shape_lr_multiplier(m, n, convention)                (of the chunk's matrix shape;
                                                                      seed: max(1, m / n) ** 0.5)
    mult_k   = 0 if k is frozen, else 2 if the bank is mlp_bank and k is odd, else 1
    aligned  = [S * P >= 0]                                           (elementwise; zero counts)
    P'       = P - P * aligned * eff_wd * eff_lr_k - U * eff_lr_k

so the decay term scales with ``lr**2`` and a frozen matrix (eff_lr = 0) does not move at all. The
index k is the matrix's global index in the bank (``rank * chunk + i`` in the seed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ._arrays import ReferenceInputError, like, same_shape, to_f64, to_scalar
from .constants import MLP_BANK_LABEL, ODD_MATRIX_LR_MUL


#: The conventions :func:`shape_lr_multiplier` knows.
LR_SCALE_CONVENTIONS = ("seed", "match_rms_adamw")


def shape_lr_multiplier(rows: int, cols: int, *, convention: str = "seed") -> float:
    """The learning-rate multiplier of a ``rows x cols`` matrix::

        "seed":             max(1, rows / cols) ** 0.5       (tall matrices get a larger step)
        "match_rms_adamw":  0.2 * max(rows, cols) ** 0.5     (torch.optim.Muon's rule: the update's
                                                              RMS matches AdamW's, so an AdamW
                                                              learning rate transfers)
    """
    if rows < 1 or cols < 1:
        raise ReferenceInputError(f"matrix shape must be positive, got ({rows}, {cols})")
    if convention == "seed":
        return max(1.0, rows / cols) ** 0.5
    if convention == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    raise ReferenceInputError(f"lr_scale convention must be one of {LR_SCALE_CONVENTIONS}, got {convention!r}")


def per_matrix_lr_multipliers(label: str, n_matrices: int, *,
                              frozen: Iterable[int] = frozenset()) -> tuple[float, ...]:
    """``mult_k`` for k = 0..n_matrices-1: 0 for frozen matrices; for ``mlp_bank`` 2 on odd global
    indices (its c_proj matrices) and 1 on even ones; 1 for every other bank."""
    frozen = frozenset(frozen)
    bad = sorted(k for k in frozen if not isinstance(k, (int, np.integer)) or not 0 <= k < n_matrices)
    if bad:
        raise ReferenceInputError(f"{label}: frozen matrix indices {bad} are outside [0, {n_matrices})")
    mults = []
    for k in range(n_matrices):
        if k in frozen:
            mults.append(0.0)
        elif label == MLP_BANK_LABEL and k % 2 == 1:
            mults.append(ODD_MATRIX_LR_MUL)
        else:
            mults.append(1.0)
    return tuple(mults)


def effective_weight_decay(*, lr: float, weight_decay: float, wd_mul: float) -> float:
    """``eff_wd = wd_mul * weight_decay * lr`` (the seed's product order)."""
    return wd_mul * weight_decay * lr


def effective_lrs(*, lr: float, lr_mul: float, per_matrix: Iterable[float]) -> np.ndarray:
    """``eff_lr_k = lr_mul * mult_k * lr`` as a ``[chunk, 1, 1]`` float64 array; ``lr_mul`` already
    includes the shape multiplier (as the seed's config does)."""
    return np.array([lr_mul * m * lr for m in per_matrix], dtype=np.float64)[:, None, None]


def decay_mask(gate: Any, p: Any) -> Any:
    """``aligned = [gate * p >= 0]`` as 0.0/1.0 (zero in either counts as aligned)."""
    g, p_ = to_f64(gate, "gate"), to_f64(p, "p")
    same_shape("p", p_, "gate", g)
    return like((g * p_ >= 0).astype(np.float64), p)


def sign_aligned_update(p: Any, update: Any, gate: Any, *, eff_lr: Any, eff_wd: float) -> Any:
    """``P' = P - P * aligned * eff_wd * eff_lr - U * eff_lr`` (module docstring).

    ``p``, ``update`` and ``gate`` share one shape ``[..., m, n]``; ``eff_lr`` is a scalar or
    broadcasts against it (``[chunk, 1, 1]`` for per-matrix rates). Returns float64 (the kind of p).
    """
    p_ = to_f64(p, "p", min_ndim=2)
    u = to_f64(update, "update")
    same_shape("p", p_, "update", u)
    lr = to_f64(eff_lr, "eff_lr")
    try:
        np.broadcast_shapes(lr.shape, p_.shape)
    except ValueError:
        raise ReferenceInputError(f"eff_lr: shape {lr.shape} does not broadcast against p's {p_.shape}") from None
    wd = to_scalar(eff_wd, "eff_wd")
    aligned = decay_mask(gate, p_)
    return like(p_ - p_ * aligned * wd * lr - u * lr, p)
