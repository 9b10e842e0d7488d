"""The reference optimizer step: the seed's ``AnvilAndAdam.step`` in float64, minus communication.

:class:`ReferenceAnvilAndAdam` holds a float64 copy of every parameter and all optimizer state, and
applies one step from the gradients it is given:

* **ANVIL banks** (every step): the gradient is viewed in the bank shape ``reshape``; twin rails
  (:func:`~anvil_ref.rails.twin_rail`), cascade (:func:`~anvil_ref.cascade.cascade`), equalizer
  (:func:`~anvil_ref.equalizer.equalize`), then :func:`~anvil_ref.update.sign_aligned_update` gated
  on the slow rail *after* this step's update. A ``transposed`` bank (:mod:`anvil_ref.config`)
  stores the transposes of its matrices: its step is the step of the transposed bank, transposed
  back (state included), so it equals that of the same layer stored as ``nn.Linear`` stores it.
* **Adam** (only when ``do_adam``): :func:`~anvil_ref.adam.adam_update`. On other steps the
  gradients are kept: the next step's gradient is added to them, as ``backward()`` accumulating into
  a ``.grad`` the seed does not clear. So the ``grads`` passed to :meth:`step` are each backward
  pass's own contribution.
* **Tied embeddings** (both ``embed`` and ``lm_head`` present, before :meth:`copy_lm_state_to_embed`):
  on an Adam step ``lm_head``'s gradient gets ``embed``'s gradient transposed added (only when
  ``lm_head`` has one, as in the seed), ``embed`` is not updated by Adam, and afterwards
  ``embed = lm_head^T``.
* **Untie**: :meth:`copy_lm_state_to_embed` copies lm_head's Adam moments, transposed, and its step
  count to embed; from then on the two are independent.

Parameters without a gradient are left alone (no update, no state change), as in the seed. The
reference is single-process and its math is independent of the world size: gradients are the
global (averaged) gradients, and per-matrix multipliers use global matrix indices.

Storage: the fast path keeps a bank's fp32 master as a bf16 parameter plus a uint16 mantissa. The
reference keeps a float64 master instead; :meth:`reset`, which in the seed zeroes the mantissa,
here truncates each bank's master to bf16 (:func:`~anvil_ref.storage.bf16_truncate`), the same
effect on the weights.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ._arrays import ReferenceInputError, to_f64, to_scalar
from .adam import adam_update
from .cascade import cascade
from .config import ConfigError, ParamConfig, build_param_config, check_labels, check_order
from .constants import (
    ADAM_DEFAULTS,
    ANVIL_DEFAULTS,
    ANVIL_MAPS,
    EMBED_LABEL,
    FROBENIUS_EPS,
    FROBENIUS_MARGIN,
    LM_HEAD_LABEL,
)
from .equalizer import equalize, lane_energy_shape
from .maps import MapsLike, load_maps
from .rails import RailScalars, twin_rail
from .storage import bf16_truncate, round_to_fp32
from .update import effective_lrs, effective_weight_decay, sign_aligned_update


@dataclass
class ParamSpec:
    """A parameter given to the reference: its value and, for ANVIL banks, its bank shape."""

    value: Any
    reshape: Sequence[int] | None = None
    frozen_matrices: Iterable[int] = field(default_factory=frozenset)


class ReferenceAnvilAndAdam:
    """Float64 reference of ``AnvilAndAdam`` (module docstring).

    Args:
        params: label -> :class:`ParamSpec` (or a bare array for Adam parameters).
        param_table: label -> entry, as in the seed (see :mod:`anvil_ref.config`).
        scatter_order, work_order: optional; checked like the seed's (every label once), otherwise
            unused: without communication the order of independent updates does not change them.
        adam_defaults, anvil_defaults: as in the seed (lr, eps, weight_decay; lr, momentum, beta2,
            weight_decay).
        maps, margin, eps: the cascade's map set (a name, JSON path or triples) and normalization.

    Hyper-parameters change the way the seed's training loop changes them: ``param_cfgs[label].lr``
    and ``.momentum``, and :meth:`set_rails`; or all rail scalars at once with :meth:`set_rail_scalars`.
    Before the first ``set_rails`` the fast rail's beta is 0.0 and its weight 1.0, as in the seed.
    """

    def __init__(self, params: Mapping[str, ParamSpec | Any], param_table: Mapping[str, Mapping], *,
                 scatter_order: Sequence[str] | None = None, work_order: Sequence[str] | None = None,
                 adam_defaults: Mapping = ADAM_DEFAULTS, anvil_defaults: Mapping = ANVIL_DEFAULTS,
                 maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                 eps: float = FROBENIUS_EPS):
        labels = check_labels(params.keys(), param_table)
        check_order("scatter_order", scatter_order, labels)
        check_order("work_order", work_order, labels)
        self.maps = load_maps(maps)
        self.margin, self.eps = to_scalar(margin, "margin", lo=0.0), to_scalar(eps, "eps", lo=0.0)
        self.params: dict[str, np.ndarray] = {}
        self.param_cfgs: dict[str, ParamConfig] = {}
        self.state: dict[str, dict[str, Any]] = {}
        for label in labels:
            spec = params[label] if isinstance(params[label], ParamSpec) else ParamSpec(params[label])
            value = to_f64(spec.value, label)
            self.params[label] = value
            cfg = build_param_config(label, param_table[label], shape=value.shape, reshape=spec.reshape,
                                     frozen_matrices=spec.frozen_matrices, adam_defaults=adam_defaults,
                                     anvil_defaults=anvil_defaults)
            self.param_cfgs[label] = cfg
            if cfg.optim == "adam":
                self.state[label] = dict(step=0, exp_avg=np.zeros_like(value), exp_avg_sq=np.zeros_like(value))
            else:
                self.state[label] = dict(velocity=np.zeros((2, *cfg.reshape)),
                                         lane_energy=np.zeros(lane_energy_shape(cfg.reshape,
                                                                                transposed=cfg.transposed)))
        #: Adam gradients accumulated since the last Adam step (label -> float64 array)
        self.pending_grads: dict[str, np.ndarray] = {}
        self.fast_beta, self.fast_weight = 0.0, 1.0
        self.split_embed = False
        self.tied = EMBED_LABEL in self.params and LM_HEAD_LABEL in self.params
        if self.tied:
            e, h = self.params[EMBED_LABEL].shape, self.params[LM_HEAD_LABEL].shape
            if len(e) != 2 or e != h[::-1]:
                raise ConfigError(f"tied {EMBED_LABEL} {e} and {LM_HEAD_LABEL} {h} must be 2-D transposes "
                                  "of each other")

    @classmethod
    def from_named_parameters(cls, named_params: Iterable[tuple[str, Any]], param_table: Mapping, **kwargs):
        """Build from ``(name, tensor)`` pairs whose tensors carry the seed's attributes: ``.label``,
        and for banks ``.reshape`` and optionally ``.frozen_matrices``."""
        params = {}
        for name, p in named_params:
            label = getattr(p, "label", None)
            if label is None:
                raise ConfigError(f"parameter {name!r} has no .label attribute")
            if label in params:
                raise ConfigError(f"label {label!r} is used by more than one parameter (again by {name!r})")
            # A tensor's own .reshape is a method; the seed shadows it with a tuple on bank parameters,
            # so only an instance attribute counts.
            reshape = vars(p).get("reshape") if hasattr(p, "__dict__") else None
            params[label] = ParamSpec(p, reshape, getattr(p, "frozen_matrices", frozenset()))
        return cls(params, param_table, **kwargs)

    # ------------------------------------------------------------------ hyper-parameters
    def set_rails(self, fast_beta: float, fast_weight: float) -> None:
        """The fast rail's beta and its weight in the blend, for the following steps."""
        self.fast_beta = to_scalar(fast_beta, "fast_beta", lo=0.0, hi=1.0)
        self.fast_weight = to_scalar(fast_weight, "fast_weight")

    def set_rail_scalars(self, scalars: RailScalars) -> None:
        """Apply :func:`~anvil_ref.rails.rail_scalars`' output: the rails, and every bank's momentum."""
        self.set_rails(scalars.fast_beta, scalars.fast_weight)
        for cfg in self.param_cfgs.values():
            if cfg.optim == "anvil":
                cfg.momentum = to_scalar(scalars.momentum, "momentum", lo=0.0, hi=1.0)

    # ------------------------------------------------------------------ the step
    def _check_grads(self, grads: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = {}
        for label, g in grads.items():
            if label not in self.params:
                raise ReferenceInputError(f"grads: unknown label {label!r} (known: {sorted(self.params)})")
            g_ = to_f64(g, f"grads[{label!r}]")
            if g_.shape != self.params[label].shape:
                raise ReferenceInputError(f"grads[{label!r}]: shape {g_.shape} does not match the "
                                          f"parameter's {self.params[label].shape}")
            out[label] = g_
        return out

    def _anvil_step(self, label: str, grad: np.ndarray) -> None:
        cfg, st = self.param_cfgs[label], self.state[label]
        # a transposed bank is updated as the bank of the matrices it stores transposed
        t = (lambda x: np.swapaxes(x, -1, -2)) if cfg.transposed else (lambda x: x)
        p = t(self.params[label].reshape(cfg.reshape))
        g = t(grad.reshape(cfg.reshape))
        rails = twin_rail(g, t(st["velocity"][0]), t(st["velocity"][1]), momentum=cfg.momentum,
                          fast_beta=self.fast_beta, fast_weight=self.fast_weight)
        u = cascade(rails.lookahead, maps=self.maps, margin=self.margin, eps=self.eps)
        u, energy = equalize(u, t(st["lane_energy"]), beta2=cfg.beta2)
        eff_wd = effective_weight_decay(lr=cfg.lr, weight_decay=cfg.weight_decay, wd_mul=cfg.wd_mul)
        eff_lr = effective_lrs(lr=cfg.lr, lr_mul=cfg.lr_mul, per_matrix=cfg.per_matrix_lr_mul)
        p_new = sign_aligned_update(p, u, rails.v_slow, eff_lr=eff_lr, eff_wd=eff_wd)
        self.params[label] = np.ascontiguousarray(t(p_new)).reshape(self.params[label].shape)
        self.state[label] = dict(velocity=np.ascontiguousarray(np.stack([t(rails.v_fast), t(rails.v_slow)])),
                                 lane_energy=np.ascontiguousarray(t(energy)))

    def _adam_step(self, label: str, grad: np.ndarray) -> None:
        cfg, st = self.param_cfgs[label], self.state[label]
        beta1, beta2 = cfg.adam_betas
        t = st["step"] + 1
        r = adam_update(self.params[label], grad, st["exp_avg"], st["exp_avg_sq"], step=t,
                        lr=cfg.lr * cfg.lr_mul, beta1=beta1, beta2=beta2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, wd_mul=cfg.wd_mul)
        self.params[label] = r.p
        self.state[label] = dict(step=t, exp_avg=r.exp_avg, exp_avg_sq=r.exp_avg_sq)

    def step(self, grads: Mapping[str, Any], *, do_adam: bool) -> None:
        """One optimizer step from this backward pass's gradients (label -> array).

        Everything is checked before anything changes: an unknown label, a wrong shape or a
        non-finite gradient raises :class:`~anvil_ref._arrays.ReferenceInputError` and leaves the
        optimizer as it was.
        """
        grads = self._check_grads(grads)
        pending = dict(self.pending_grads)
        for label, g in grads.items():
            if self.param_cfgs[label].optim == "adam":
                pending[label] = pending[label] + g if label in pending else g
        for label, g in grads.items():
            if self.param_cfgs[label].optim == "anvil":
                self._anvil_step(label, g)
        if not do_adam:
            self.pending_grads = pending
            return
        tied_now = self.tied and not self.split_embed
        if tied_now and LM_HEAD_LABEL in pending and EMBED_LABEL in pending:
            pending[LM_HEAD_LABEL] = pending[LM_HEAD_LABEL] + pending[EMBED_LABEL].T
        for label, g in pending.items():
            if tied_now and label == EMBED_LABEL:
                continue
            self._adam_step(label, g)
        if tied_now:
            self.params[EMBED_LABEL] = self.params[LM_HEAD_LABEL].T.copy()
        self.pending_grads = {}

    # ------------------------------------------------------------------ untie, reset, state
    def copy_lm_state_to_embed(self) -> None:
        """Untie: embed's Adam moments become lm_head's transposed, its step count lm_head's."""
        if not self.tied:
            raise ConfigError(f"untie needs both {EMBED_LABEL!r} and {LM_HEAD_LABEL!r} parameters")
        lm = self.state[LM_HEAD_LABEL]
        self.state[EMBED_LABEL] = dict(step=lm["step"], exp_avg=lm["exp_avg"].T.copy(),
                                       exp_avg_sq=lm["exp_avg_sq"].T.copy())
        self.split_embed = True

    def reset(self) -> None:
        """The seed's reset: zero the rails and lane energies, zero the mantissas (here: truncate the
        bank masters to bf16), and tie the embeddings again."""
        self.split_embed = False
        for label, cfg in self.param_cfgs.items():
            if cfg.optim == "anvil":
                st = self.state[label]
                self.state[label] = dict(velocity=np.zeros_like(st["velocity"]),
                                         lane_energy=np.zeros_like(st["lane_energy"]))
                self.params[label] = bf16_truncate(round_to_fp32(self.params[label])).astype(np.float64)

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of everything a continuation needs, keyed by label."""
        return copy.deepcopy(dict(params=self.params, state=self.state, pending_grads=self.pending_grads,
                                  split_embed=self.split_embed, rails=(self.fast_beta, self.fast_weight),
                                  param_cfgs={k: asdict(c) for k, c in self.param_cfgs.items()}))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; labels and shapes must match this optimizer's."""
        sd = copy.deepcopy(dict(state_dict))
        if set(sd["params"]) != set(self.params):
            raise ConfigError(f"state_dict labels {sorted(sd['params'])} differ from this optimizer's "
                              f"{sorted(self.params)}")
        for label, value in sd["params"].items():
            if np.shape(value) != self.params[label].shape:
                raise ConfigError(f"state_dict params[{label!r}]: shape {np.shape(value)} differs from "
                                  f"{self.params[label].shape}")
        self.params = {k: np.asarray(v, dtype=np.float64) for k, v in sd["params"].items()}
        self.state = sd["state"]
        self.pending_grads = sd["pending_grads"]
        self.split_embed = bool(sd["split_embed"])
        self.fast_beta, self.fast_weight = sd["rails"]
        for label, fields in sd["param_cfgs"].items():
            self.param_cfgs[label] = ParamConfig(**fields)
