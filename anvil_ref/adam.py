"""Adam with bias correction and cautious decay, exactly as the seed (``_adam_update`` and
``_adam_update_step``).

For parameter ``p``, gradient ``g``, moments ``m, v`` and the step count ``t`` after incrementing
(the first update has t = 1), with ``lr = cfg.lr * lr_mul``::

    m'   = beta1 * m + (1 - beta1) * g
    v'   = beta2 * v + (1 - beta2) * g^2
    eta  = lr * sqrt(1 - beta2^t) / (1 - beta1^t)             (bias-corrected step size)
    u    = eta * m' / (sqrt(v') + eps)                        (eps added to sqrt(v'), not inside it)
    u'   = u + p * [u * p > 0] * lr^2 * weight_decay * wd_mul (cautious decay: strict inequality)
    p'   = p - u'

Note the two decays differ: ANVIL's sign-aligned decay gates on ``gate * p >= 0`` (zero counts as
aligned) and scales with ``lr * eff_lr``; Adam's gates on ``u * p > 0`` (zero does not) and scales
with ``lr^2``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ._arrays import ReferenceInputError, like, same_shape, to_f64, to_scalar


class AdamResult(NamedTuple):
    """What :func:`adam_update` returns (float64, the kind of ``p``)."""

    p: Any
    exp_avg: Any
    exp_avg_sq: Any


def adam_moments(exp_avg: Any, exp_avg_sq: Any, g: Any, *, beta1: float, beta2: float) -> tuple[Any, Any]:
    """``m' = beta1 m + (1 - beta1) g`` and ``v' = beta2 v + (1 - beta2) g^2``."""
    m, v, g_ = to_f64(exp_avg, "exp_avg"), to_f64(exp_avg_sq, "exp_avg_sq"), to_f64(g, "g")
    same_shape("g", g_, "exp_avg", m)
    same_shape("g", g_, "exp_avg_sq", v)
    return like(beta1 * m + (1.0 - beta1) * g_, exp_avg), like(beta2 * v + (1.0 - beta2) * g_ * g_, exp_avg_sq)


def adam_step_size(*, lr: float, beta1: float, beta2: float, step: int) -> float:
    """``eta = lr * sqrt(1 - beta2^t) / (1 - beta1^t)`` for step count ``t >= 1``."""
    if not isinstance(step, (int, np.integer)) or step < 1:
        raise ReferenceInputError(f"step: Adam's step count starts at 1 (after the increment), got {step!r}")
    return lr * (math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step))


def adam_update(p: Any, g: Any, exp_avg: Any, exp_avg_sq: Any, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, wd_mul: float = 1.0) -> AdamResult:
    """One Adam step (module docstring); ``step`` is t after incrementing, ``lr`` includes lr_mul.

    Returns :class:`AdamResult` ``(p', m', v')``; the inputs are not modified.
    """
    p_, g_ = to_f64(p, "p"), to_f64(g, "g")
    same_shape("p", p_, "g", g_)
    beta1 = to_scalar(beta1, "beta1", lo=0.0, hi=1.0)
    beta2 = to_scalar(beta2, "beta2", lo=0.0, hi=1.0)
    if beta1 == 1.0 or beta2 == 1.0:
        raise ReferenceInputError(f"beta1 and beta2 must be < 1 (bias correction divides by 1 - beta^t), "
                                  f"got {beta1}, {beta2}")
    eps = to_scalar(eps, "eps", lo=0.0)
    if eps == 0.0:
        raise ReferenceInputError("eps: must be > 0 (with eps = 0 a zero gradient gives 0/0)")
    m, v = adam_moments(exp_avg, exp_avg_sq, g_, beta1=beta1, beta2=beta2)
    eta = adam_step_size(lr=lr, beta1=beta1, beta2=beta2, step=step)
    u = eta * (m / (np.sqrt(v) + eps))
    eff_wd = lr * lr * weight_decay * wd_mul
    u = u + p_ * (u * p_ > 0) * eff_wd
    return AdamResult(like(p_ - u, p), like(m, p), like(v, p))
