"""The optimizer's configuration: the per-parameter table, its checks, and the schedule orders
(seed: ``ParamConfig``, ``AnvilAndAdam.__init__`` and ``_build_param_cfg``).

Shared by the reference optimizer (:mod:`anvil_ref.optimizer`) and the fast one
(``anvil_fast.optim.optimizer``), so a table is read and checked by one piece of code.

A ``param_table`` maps each label to an entry::

    {"optim": "anvil" | "adam", "comms": "sharded" | "replicated",
     "adam_betas": [beta1, beta2] (Adam only), "lr_mul": 1.0, "wd_mul": 1.0}

ANVIL parameters additionally carry ``reshape`` (the bank shape ``[n_matrices, rows, cols]``; the
seed reads it from the parameter's ``.reshape`` attribute), optionally ``frozen_matrices`` (global
indices whose learning rate is 0), ``lr_scale`` (the shape multiplier's convention,
:func:`anvil_ref.update.shape_lr_multiplier`; default "seed") and ``transposed`` (default False).

``transposed``: the bank stores each matrix as the transpose of the one it acts as. A layer
``y = x @ W`` with ``W`` of shape ``[in, out]`` (transformers' ``Conv1D``) is the layer
``y = x @ M.T`` of ``nn.Linear`` with ``M = W.T`` of shape ``[out, in]``; its update is defined as
that of ``M``: the learning-rate shape multiplier is ``shape_lr_multiplier(out, in)`` (the stored
``cols, rows``), the equalizer reduces over ``M``'s axis (:func:`anvil_ref.equalizer.reduction_axis`
with ``transposed=True``), and rails, cascade and decay, which commute with the transpose, need no
change (the cascade's maps are odd polynomials ``X -> a X + b (X X^T) X + ...``, and
``p(X^T) = p(X)^T``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ._arrays import ReferenceInputError
from .update import LR_SCALE_CONVENTIONS, per_matrix_lr_multipliers, shape_lr_multiplier

OPTIMS = ("adam", "anvil")
COMMS = ("replicated", "sharded")


class ConfigError(ReferenceInputError):
    """A parameter table, label or schedule order that cannot be used (the message says why)."""


@dataclass(slots=True)
class ParamConfig:
    """Per-parameter configuration (the seed's fields; the training loop rewrites ``lr`` and, for
    ANVIL, ``momentum`` every step)."""

    label: str
    optim: str
    comms: str
    adam_betas: tuple[float, float] | None
    lr_mul: float  #: for ANVIL this includes the shape multiplier, as in the seed
    wd_mul: float
    lr: float
    initial_lr: float
    weight_decay: float
    eps: float | None = None
    reshape: tuple[int, ...] | None = None
    chunk_size: int | None = None
    momentum: float | None = None
    beta2: float | None = None
    #: ANVIL: one multiplier per matrix of this rank's chunk (global index rank*chunk + i)
    per_matrix_lr_mul: tuple[float, ...] | None = None
    frozen_matrices: frozenset[int] = field(default_factory=frozenset)
    #: ANVIL: each stored matrix is the transpose of the matrix it acts as (module docstring)
    transposed: bool = False


def _real(entry: Mapping, key: str, default: float, label: str) -> float:
    v = entry.get(key, default)
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}: {key} must be a number, got {v!r}") from None
    if not math.isfinite(v):
        raise ConfigError(f"{label}: {key} must be finite, got {v}")
    return v


def build_param_config(label: str, entry: Mapping, *, shape: Sequence[int],
                       reshape: Sequence[int] | None, frozen_matrices: Iterable[int] = (),
                       adam_defaults: Mapping, anvil_defaults: Mapping, world_size: int = 1,
                       rank: int = 0) -> ParamConfig:
    """One parameter's :class:`ParamConfig` from its table entry, as the seed builds it.

    ``shape`` is the parameter's own shape. Raises :class:`ConfigError` for an unknown optim or
    comms, Adam without betas, an ANVIL parameter without a reshape (or one whose size differs from
    the parameter's, or whose first dimension ``world_size`` does not divide), a sharded Adam
    parameter whose first dimension ``world_size`` does not divide, or an ANVIL parameter that is not
    sharded (the seed would silently never update it).
    """
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{label}: table entry must be a mapping, got {type(entry).__name__}")
    optim, comms = entry.get("optim"), entry.get("comms")
    if optim not in OPTIMS:
        raise ConfigError(f"{label}: optim must be one of {OPTIMS}, got {optim!r}")
    if comms not in COMMS:
        raise ConfigError(f"{label}: comms must be one of {COMMS}, got {comms!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world_size {world_size}")
    betas = entry.get("adam_betas")
    betas = tuple(float(b) for b in betas) if betas is not None else None
    lr_mul = _real(entry, "lr_mul", 1.0, label)
    wd_mul = _real(entry, "wd_mul", 1.0, label)
    shape = tuple(int(s) for s in shape)
    if optim == "adam":
        if betas is None or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"{label}: Adam needs adam_betas = [beta1, beta2] in [0, 1), got {betas!r}")
        chunk = None
        if comms == "sharded":
            if len(shape) == 0 or shape[0] % world_size:
                raise ConfigError(f"{label}: sharded Adam splits the first dimension over {world_size} "
                                  f"ranks, which does not divide shape {shape}")
            chunk = shape[0] // world_size
        lr = float(adam_defaults["lr"])
        return ParamConfig(label=label, optim=optim, comms=comms, adam_betas=betas, lr_mul=lr_mul,
                           wd_mul=wd_mul, lr=lr, initial_lr=lr,
                           weight_decay=float(adam_defaults["weight_decay"]),
                           eps=float(adam_defaults["eps"]), chunk_size=chunk)
    # ANVIL
    if comms != "sharded":
        raise ConfigError(f"{label}: ANVIL banks are updated through the sharded path only; set comms "
                          f"to 'sharded' (with comms={comms!r} the seed would never update it)")
    if reshape is None:
        raise ConfigError(f"{label}: an ANVIL parameter needs a reshape (its bank shape "
                          "[n_matrices, rows, cols])")
    reshape = tuple(int(s) for s in reshape)
    if len(reshape) != 3 or min(reshape) < 1:
        raise ConfigError(f"{label}: reshape must be [n_matrices, rows, cols] with positive sizes, got {reshape}")
    if math.prod(reshape) != math.prod(shape):
        raise ConfigError(f"{label}: reshape {reshape} holds {math.prod(reshape)} elements, the "
                          f"parameter of shape {shape} holds {math.prod(shape)}")
    if reshape[0] % world_size:
        raise ConfigError(f"{label}: reshape[0]={reshape[0]} must be divisible by world_size={world_size}")
    chunk = reshape[0] // world_size
    convention = entry.get("lr_scale", "seed")
    if convention not in LR_SCALE_CONVENTIONS:
        raise ConfigError(f"{label}: lr_scale must be one of {LR_SCALE_CONVENTIONS}, got {convention!r}")
    transposed = entry.get("transposed", False)
    if not isinstance(transposed, bool):
        raise ConfigError(f"{label}: transposed must be True or False, got {transposed!r}")
    rows, cols = (reshape[-1], reshape[-2]) if transposed else (reshape[-2], reshape[-1])
    lr_mul = shape_lr_multiplier(rows, cols, convention=convention) * lr_mul
    frozen = frozenset(int(k) for k in frozen_matrices)
    all_mults = per_matrix_lr_multipliers(label, reshape[0], frozen=frozen)
    lr = float(anvil_defaults["lr"])
    return ParamConfig(label=label, optim=optim, comms=comms, adam_betas=betas, lr_mul=lr_mul,
                       wd_mul=wd_mul, lr=lr, initial_lr=lr,
                       weight_decay=float(anvil_defaults["weight_decay"]), reshape=reshape,
                       chunk_size=chunk, momentum=float(anvil_defaults["momentum"]),
                       beta2=float(anvil_defaults["beta2"]),
                       per_matrix_lr_mul=all_mults[rank * chunk:(rank + 1) * chunk],
                       frozen_matrices=frozen, transposed=transposed)


def check_labels(labels: Iterable[str], param_table: Mapping[str, Mapping]) -> list[str]:
    """The labels, in order, after checking each is a known table entry and appears once."""
    seen: list[str] = []
    for label in labels:
        if label is None:
            raise ConfigError("a parameter has no label; every parameter needs one (its param_table key)")
        if label not in param_table:
            raise ConfigError(f"label {label!r} has no entry in param_table (known: {sorted(param_table)})")
        if label in seen:
            raise ConfigError(f"label {label!r} is used by more than one parameter; labels must be unique")
        seen.append(label)
    return seen


def check_order(name: str, order: Sequence[str] | None, labels: Iterable[str]) -> list[str]:
    """``order`` after checking it lists every present label exactly once and nothing else."""
    labels = list(labels)
    if order is None:
        return labels
    order = list(order)
    dup = sorted({x for x in order if order.count(x) > 1})
    missing = [x for x in labels if x not in order]
    extra = [x for x in order if x not in labels]
    if dup or missing or extra:
        raise ConfigError(f"{name} must list every parameter label exactly once: "
                          f"duplicated {dup}, missing {missing}, unknown {extra}")
    return order
