"""Twin-rail momentum and its schedule (seed: the first lines of ``anvil_cascade``; the schedule
``get_rail_beta`` and the engage rule from the seed README).

One step, for a gradient ``g`` and the two rails ``v0`` (fast) and ``v1`` (slow)::

    v0' = beta_f * v0 + (1 - beta_f) * g              (fast rail)
    v1' = beta_s * v1 + (1 - beta_s) * g              (slow rail, beta_s = RAIL_SLOW_BETA)
    b   = w * v0' + (1 - w) * v1'                     (blend)
    x   = (1 - mu) * g + mu * b                       (Nesterov lookahead: the cascade's input)

with the per-step scalars ``(mu, beta_f, w)`` = :func:`rail_scalars` ``(step, total_steps)``. The seed
writes these as ``lerp_``; ``a.lerp(b, t) = a + t*(b - a)`` is the same affine combination.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._arrays import ReferenceInputError, like, same_shape, to_f64, to_scalar
from .constants import (
    RAIL_BETA_COOLDOWN_STEPS,
    RAIL_BETA_MAX,
    RAIL_BETA_MIN,
    RAIL_BETA_WARMUP_STEPS,
    RAIL_ENGAGE_STEP,
    RAIL_FAST_BETA,
    RAIL_FAST_WEIGHT,
    RAIL_RULE,
    RAIL_RULES,
    RAIL_SCALED_REFERENCE_STEPS,
    RAIL_SLOW_BETA,
)


class RailSteps(NamedTuple):
    """The rail schedule's three step counts for one run length."""

    engage: int  #: first step at which the blend reads both rails
    warmup: int  #: steps of the beta warm-up
    cooldown: int  #: steps of the beta cool-down at the end of the run


def rail_steps(total_steps: int, rule: str = RAIL_RULE, *,
               reference_steps: int = RAIL_SCALED_REFERENCE_STEPS) -> RailSteps:
    """The schedule's step counts for a run of ``total_steps`` under ``rule`` (anvil_ref.constants,
    RAIL_RULE): ``"absolute"``, the record's steps whatever the length; ``"scaled"``, each multiplied
    by ``total_steps / reference_steps`` and rounded half up, at least 1."""
    if rule not in RAIL_RULES:
        raise ReferenceInputError(f"rule must be one of {RAIL_RULES}, got {rule!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ReferenceInputError(f"total_steps must be an int >= 1, got {total_steps!r}")
    base = (RAIL_ENGAGE_STEP, RAIL_BETA_WARMUP_STEPS, RAIL_BETA_COOLDOWN_STEPS)
    if rule == "absolute":
        return RailSteps(*base)
    if reference_steps < 1:
        raise ReferenceInputError(f"reference_steps must be >= 1, got {reference_steps}")
    return RailSteps(*(max(1, (2 * n * total_steps + reference_steps) // (2 * reference_steps)) for n in base))


class RailScalars(NamedTuple):
    """The three per-step scalars of the twin rails."""

    momentum: float  #: Nesterov lookahead mu
    fast_beta: float  #: the fast rail's beta
    fast_weight: float  #: the fast rail's weight w in the blend


class TwinRailResult(NamedTuple):
    """What one twin-rail step returns (all float64, the kind of the gradient given)."""

    lookahead: Any  #: x = (1 - mu) g + mu b, the cascade's input
    v_fast: Any  #: the fast rail after the step
    v_slow: Any  #: the slow rail after the step


def rail_beta(step: int, total_steps: int, *, warmup_steps: int = RAIL_BETA_WARMUP_STEPS,
              cooldown_steps: int = RAIL_BETA_COOLDOWN_STEPS, beta_min: float = RAIL_BETA_MIN,
              beta_max: float = RAIL_BETA_MAX) -> float:
    """The scheduled rail beta (``get_rail_beta``), with ``c = total_steps - cooldown_steps``::

        beta(t) = beta_min + (t / warmup_steps) * (beta_max - beta_min)   if t < warmup_steps
                = beta_max - ((t - c) / cooldown_steps) * (beta_max - beta_min)   elif t > c
                = beta_max                                                  otherwise

    The warm-up branch wins where the two ramps overlap (a run shorter than warm-up + cool-down),
    as in the record's code. ``step`` must lie in ``[0, total_steps]``: past the end the cool-down
    would extrapolate below beta_min, so it is refused.
    """
    if not isinstance(step, int) or not isinstance(total_steps, int):
        raise ReferenceInputError(f"step and total_steps must be ints, got {step!r}, {total_steps!r}")
    if total_steps < 1 or not 0 <= step <= total_steps:
        raise ReferenceInputError(f"step must lie in [0, total_steps] with total_steps >= 1; got "
                                  f"step={step}, total_steps={total_steps}")
    if warmup_steps < 1 or cooldown_steps < 1:
        raise ReferenceInputError(f"warmup_steps and cooldown_steps must be >= 1, got "
                                  f"{warmup_steps}, {cooldown_steps}")
    cooldown_start = total_steps - cooldown_steps
    if step < warmup_steps:
        return beta_min + (step / warmup_steps) * (beta_max - beta_min)
    if step > cooldown_start:
        return beta_max - ((step - cooldown_start) / cooldown_steps) * (beta_max - beta_min)
    return beta_max


def rail_scalars(step: int, total_steps: int, *, engage_step: int = RAIL_ENGAGE_STEP,
                 engaged_fast_beta: float = RAIL_FAST_BETA,
                 engaged_fast_weight: float = RAIL_FAST_WEIGHT, warmup_steps: int = RAIL_BETA_WARMUP_STEPS,
                 cooldown_steps: int = RAIL_BETA_COOLDOWN_STEPS) -> RailScalars:
    """The record's per-step rail scalars::

        mu     = beta(t)
        beta_f = beta(t)  if t < engage_step  else  RAIL_FAST_BETA
        w      = 1.0      if t < engage_step  else  RAIL_FAST_WEIGHT

    Before the engage step the blend reads the fast rail alone (w = 1) on the scheduled beta, which
    is plain Nesterov momentum; the slow rail accumulates all along. ``engage_step``,
    ``warmup_steps`` and ``cooldown_steps`` of another rule: :func:`rail_steps`; an engage step past
    the run (e.g. ``total_steps + 1``) keeps ``w = 1`` throughout, the record's momentum schedule
    without the second rail.
    """
    beta = rail_beta(step, total_steps, warmup_steps=warmup_steps, cooldown_steps=cooldown_steps)
    if step < engage_step:
        return RailScalars(momentum=beta, fast_beta=beta, fast_weight=1.0)
    return RailScalars(momentum=beta, fast_beta=engaged_fast_beta, fast_weight=engaged_fast_weight)


def ema(v: Any, g: Any, *, beta: float) -> Any:
    """One exponential-moving-average step ``v' = beta * v + (1 - beta) * g`` (both rails use it)."""
    v_, g_ = to_f64(v, "v"), to_f64(g, "g")
    same_shape("v", v_, "g", g_)
    beta = to_scalar(beta, "beta", lo=0.0, hi=1.0)
    return like(beta * v_ + (1.0 - beta) * g_, g)


def blend_rails(v_fast: Any, v_slow: Any, *, fast_weight: float) -> Any:
    """The blend ``b = w * v0 + (1 - w) * v1``."""
    v0, v1 = to_f64(v_fast, "v_fast"), to_f64(v_slow, "v_slow")
    same_shape("v_fast", v0, "v_slow", v1)
    w = to_scalar(fast_weight, "fast_weight")
    return like(w * v0 + (1.0 - w) * v1, v_fast)


def nesterov_lookahead(g: Any, blend: Any, *, momentum: float) -> Any:
    """The lookahead ``x = (1 - mu) * g + mu * b``."""
    g_, b_ = to_f64(g, "g"), to_f64(blend, "blend")
    same_shape("g", g_, "blend", b_)
    mu = to_scalar(momentum, "momentum", lo=0.0, hi=1.0)
    return like((1.0 - mu) * g_ + mu * b_, g)


def twin_rail(g: Any, v_fast: Any, v_slow: Any, *, momentum: float, fast_beta: float,
              fast_weight: float, slow_beta: float = RAIL_SLOW_BETA) -> TwinRailResult:
    """One twin-rail step (the module docstring's four equations, in order).

    Returns :class:`TwinRailResult` ``(lookahead, v_fast, v_slow)``; the inputs are not modified.
    """
    v0 = ema(v_fast, g, beta=fast_beta)
    v1 = ema(v_slow, g, beta=slow_beta)
    b = blend_rails(v0, v1, fast_weight=fast_weight)
    x = nesterov_lookahead(g, b, momentum=momentum)
    return TwinRailResult(x, v0, v1)
