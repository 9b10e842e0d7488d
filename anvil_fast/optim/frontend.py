"""What the two front-ends of ANVIL share: :class:`AnvilFrontend`, the base of the one-process
drop-in (:class:`anvil_fast.optim.dropin.DropInAnvil`) and of the FSDP2 front-end
(:class:`anvil_fast.optim.fsdp.FSDPAnvil`); ``anvil_fast.ANVIL`` (:mod:`anvil_fast.optim.entry`) builds the one
the parameters call for.

Both hold torch's two param groups, ``"anvil"`` and ``"adam"``, built and checked here from the
constructor's arguments (:func:`hyperparameter_groups`, :func:`check_options`), and both read them
at each step through :meth:`AnvilFrontend._apply_groups`: the record schedule's rails written into
the anvil group, a scheduler's Adam momentum into ``betas``, every value checked, then the values
handed on once (:meth:`AnvilFrontend._hand_over`: the drop-in to its inner optimizer, the FSDP2
front-end to the drop-in its owners run). The plan's table (:meth:`AnvilFrontend.describe`), the
taken and skipped step counters, the non-finite policy and torch's state-dict hooks are here too;
each front-end supplies its routes' text, its summary and its state dict's body.

**The learning rate's path**, from ``opt.param_groups[0]["lr"]`` to the kernels, through each
module once: this module (the group checked, the change noticed) -> :mod:`anvil_fast.optim.dropin`
(:meth:`~anvil_fast.optim.dropin.DropInAnvil._hand_over`, the one call to the inner optimizer) ->
:mod:`anvil_fast.optim.optimizer` (:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.set_hyperparameters`, the one
writer of the inner optimizer's learning rates, and
:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.hyperparameters`, their one reader) -> the device's
scalars (:mod:`anvil_fast.optim.device_step` derives them into :mod:`anvil_fast.kernels.bank_scalars`' device
buffer on one process; :meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.stage_bank_scalars` on several
ranks) -> the kernels, which read that buffer (``tests/test_frontend.py`` follows one step).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch import Tensor

from anvil_ref.rails import rail_scalars
from anvil_ref.update import LR_SCALE_CONVENTIONS

from .optimizer import NonFiniteGradientError

RAILS = ("nesterov", "record")
#: The anvil group's entries ``rails="record"`` writes before every step (:func:`anvil_ref.rails.rail_scalars`).
RECORD_RAIL_KEYS = ("momentum", "fast_beta", "fast_weight")
NONFINITE_POLICIES = ("skip", "raise")


class NonFiniteGradientWarning(RuntimeWarning):
    """A step was skipped because a gradient held NaN or infinity (``nonfinite="skip"``)."""


def check_hyperparameters(kind: str, g: Mapping[str, Any]) -> None:
    """torch's optimizers' rules: ValueError naming the value."""
    def real(key):
        v = g[key]
        if isinstance(v, Tensor) and v.numel() != 1:
            raise ValueError(f"Tensor {key} must be 1-element (the {kind} group's {key} is {tuple(v.shape)})")
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{kind} group: {key} must be a number, got {v!r}") from None

    def check(key, v, ok, want):
        if not (math.isfinite(v) and ok(v)):
            raise ValueError(f"Invalid {key} in the {kind} group: {v} (expected {want})")

    check("lr", real("lr"), lambda v: v >= 0, "a finite value >= 0")
    check("weight_decay", real("weight_decay"), lambda v: v >= 0, "a finite value >= 0")
    if kind == "anvil":
        check("momentum", real("momentum"), lambda v: 0 <= v < 1, "a value in [0, 1)")
        if g["fast_beta"] is not None:
            check("fast_beta", real("fast_beta"), lambda v: 0 <= v <= 1, "None or a value in [0, 1]")
        check("fast_weight", real("fast_weight"), lambda v: True, "a finite value")
        check("beta2", real("beta2"), lambda v: 0 <= v <= 1, "a value in [0, 1]")
    else:
        betas = g["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid betas in the adam group: {betas!r} (expected two values)")
        for i, b in enumerate(betas):
            check(f"beta parameter at index {i}", float(b), lambda v: 0 <= v < 1, "a value in [0, 1)")
        check("eps", real("eps"), lambda v: v >= 0, "a finite value >= 0")


def hyperparameter_groups(lr, adam_lr, *, momentum, fast_beta, fast_weight, beta2, weight_decay, adam_betas,
                          adam_eps, adam_weight_decay) -> tuple[dict[str, Any], dict[str, Any]]:
    """The anvil and adam param groups' values (without ``params``), checked."""
    anvil_group = dict(kind="anvil", lr=lr, momentum=momentum, fast_beta=fast_beta, fast_weight=fast_weight,
                       beta2=beta2, weight_decay=weight_decay)
    adam_group = dict(kind="adam", lr=adam_lr, betas=tuple(float(b) for b in adam_betas), eps=adam_eps,
                      weight_decay=adam_weight_decay)
    check_hyperparameters("anvil", anvil_group)
    check_hyperparameters("adam", adam_group)
    return anvil_group, adam_group


def check_options(rails: str, total_steps: int | None, lr_scale: str, nonfinite: str) -> None:
    """The rails, the record schedule's length, the learning-rate convention and the non-finite
    policy: ValueError naming the value."""
    if rails not in RAILS:
        raise ValueError(f"rails must be one of {RAILS}, got {rails!r}")
    if rails == "record" and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                              or total_steps < 1):
        raise ValueError(f"rails='record' needs total_steps, an int >= 1 (the run's length), got {total_steps!r}")
    if lr_scale not in LR_SCALE_CONVENTIONS:
        raise ValueError(f"lr_scale must be one of {LR_SCALE_CONVENTIONS}, got {lr_scale!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")


def lean_step(step: Callable) -> Callable:
    """A front-end's ``step`` as torch.optim runs every optimizer's step (its step pre- and post-hooks,
    a profiler range ``Optimizer.step#<class>.step``, here also without autograd), but with no range
    and no hook loop when there is neither a hook nor a profiler to see them.

    torch.optim wraps each optimizer class's step at construction (``Optimizer.profile_hook_step``):
    on every call a profiler range (two dispatcher calls) and the hook loops, with no profiler on and
    no hook registered too. With ``torch.no_grad()``'s context that is a fixed host cost per step of
    the order of the drop-in's whole graphed step (``tools/graph_nodes.py`` times both). The function
    returned is marked ``hooked`` so that torch does not wrap it again, and it runs torch's own
    wrapper whenever a step hook is registered (on the optimizer or globally) or a profiler is on
    (``torch.autograd._profiler_enabled()``: torch.profiler's and autograd's profilers), so hooks,
    traces and memory profiles see the step as they see any optimizer's."""
    wrapped = torch.optim.Optimizer.profile_hook_step(torch.no_grad()(step))

    @functools.wraps(step)
    def run(self, *args, **kwargs):
        if (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_step_hooks()
                or torch._C._autograd._profiler_enabled()):
            return wrapped(self, *args, **kwargs)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return step(self, *args, **kwargs)
        finally:
            torch._C._set_grad_enabled(grad)

    run.hooked = True
    return run


#: torch's registries of global step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` /
#: ``..._post_hook``), dicts it fills in place: looked up once, not on every step
_GLOBAL_PRE = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)


def _global_step_hooks() -> bool:
    """Whether a global optimizer step hook is registered; True where this torch keeps them elsewhere."""
    return _GLOBAL_PRE is None or _GLOBAL_POST is None or bool(_GLOBAL_PRE) or bool(_GLOBAL_POST)


class AnvilFrontend(torch.optim.Optimizer):
    """The base of both front-ends (module docstring). A subclass sets ``rails``, ``total_steps``,
    ``nonfinite`` and ``plan`` (its :class:`~anvil_fast.optim.dropin.PlanEntry` list), installs its groups
    with :meth:`_install_groups`, and defines :meth:`_route_text`, :meth:`_plan_summary`,
    :meth:`_hand_over`, :meth:`_state_dict` and :meth:`_load_state_dict`."""

    _taken = 0  #: steps taken (the record rails' t)
    _skipped = 0  #: steps skipped for non-finite gradients
    _hyper_key = None  #: the group values last handed over (None: hand them over at the next step)

    def _install_groups(self, groups: list[dict[str, Any]], lr: float, momentum: float) -> None:
        self._planned = False
        torch.optim.Optimizer.__init__(self, groups, dict(lr=lr))
        # set after the groups exist: torch would otherwise copy momentum into the adam group
        self.defaults["momentum"] = momentum
        self._planned = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_planned", True):
            raise ValueError("ANVIL plans its parameter groups once, at construction (banks are views of the "
                             "parameters); build a new ANVIL over every parameter instead of add_param_group")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ counters
    @property
    def taken_steps(self) -> int:
        """Steps taken (the record rails' t)."""
        return self._taken

    @taken_steps.setter
    def taken_steps(self, v: int) -> None:
        self._taken = int(v)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients."""
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, v: int) -> None:
        self._skipped = int(v)

    def _skip_or_raise(self, names: list[str], *, world_size: int, stacklevel: int) -> None:
        """The ``nonfinite`` policy for a step whose gradients hold NaN/inf in ``names``: raise, or
        count the skipped step and warn (``stacklevel`` points the warning at the caller's step)."""
        where = "" if world_size == 1 else " (on at least one rank)"
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(f"non-finite gradient (NaN or inf) in {', '.join(names)}{where}; nothing "
                                         "was updated")
        self._skipped += 1
        warnings.warn(f"ANVIL: step skipped for every parameter: non-finite gradient (NaN or inf) in "
                      f"{', '.join(names)}{where} ({self._skipped} step(s) skipped so far)",
                      NonFiniteGradientWarning, stacklevel=stacklevel)

    # ------------------------------------------------------------------ the groups at each step
    def _group_key(self, skip: tuple[str, ...] = ()) -> tuple:
        return tuple(v for g in self.param_groups for k, v in g.items() if k != "params" and k not in skip)

    def _apply_groups(self, taken: Callable[[], int], *, every_step: bool, rails_on_device: bool = False) -> bool:
        """Validate the groups (the record's rails set first from ``taken()``, a momentum-cycling
        scheduler's Adam momentum copied into ``betas``) and hand their values over
        (:meth:`_hand_over`), everything checked before anything is handed; unless ``every_step``,
        only when they changed since the last hand-over. ``rails_on_device``: what runs the update
        reads the record's rails from its own table at its own step count (the one-process device
        step), so a step whose groups changed in the rails alone writes them into the groups, for
        their readers, and hands nothing over. Returns whether they were handed over."""
        if not every_step and self._group_key() == self._hyper_key:
            return False
        for g in self.param_groups:
            if g["kind"] == "anvil" and self.rails == "record":
                t = taken()
                if t >= self.total_steps:
                    raise ValueError(f"rails='record': the schedule covers total_steps={self.total_steps} steps and "
                                     f"all were taken; build the optimizer with a larger total_steps")
                s = rail_scalars(t, self.total_steps)
                g.update(momentum=s.momentum, fast_beta=s.fast_beta, fast_weight=s.fast_weight)
            if g["kind"] == "adam" and "momentum" in g:  # a momentum-cycling scheduler's beta1
                g["betas"] = (float(g["momentum"]), float(g["betas"][1]))
        # after the record's rails and Adam's betas were written
        key = self._group_key(RECORD_RAIL_KEYS if rails_on_device else ())
        values = {g["kind"]: {k: v for k, v in g.items() if k not in ("params", "param_names")}
                  for g in self.param_groups}
        if rails_on_device and key == self._hyper_key:
            if "anvil" in values:
                self._hand_over_rails(values["anvil"])
            return False
        for g in self.param_groups:
            check_hyperparameters(g["kind"], g)
        self._hand_over(values)
        self._hyper_key = key
        return True

    def _hand_over(self, values: Mapping[str, Mapping[str, Any]]) -> None:
        """Give the checked group values (kind -> name -> value) to what runs the update."""
        raise NotImplementedError

    def _hand_over_rails(self, anvil: Mapping[str, Any]) -> None:
        """The anvil group's values where only the record's rails changed (``rails_on_device``):
        what runs the update reads the rails from its own table; its holder of the values is kept
        in step for their readers."""
        self._hand_over({"anvil": anvil})

    # ------------------------------------------------------------------ introspection
    def describe(self) -> str:
        """The plan as text: one line per parameter (name, shape, route, reason), then a summary."""
        rows = [("parameter", "shape", "route", "reason")]
        rows += [(e.name, str(list(e.shape)), self._route_text(e), e.reason) for e in self.plan]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        return "\n".join(lines + self._plan_summary())

    def _route_text(self, e) -> str:
        raise NotImplementedError

    def _plan_summary(self) -> list[str]:
        raise NotImplementedError

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """torch's format (each front-end's docstring), through torch's state-dict hooks."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd = self._state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state dict (each front-end's docstring) through torch's load hooks;
        everything is checked before anything is written."""
        sd = self._as_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        self._load_state_dict(sd)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    @staticmethod
    def _as_state_dict(state_dict):
        return dict(state_dict) if isinstance(state_dict, Mapping) else state_dict

    def _state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_state_dict(self, sd) -> None:
        raise NotImplementedError


__all__ = ["AnvilFrontend", "NonFiniteGradientWarning", "lean_step", "check_hyperparameters", "hyperparameter_groups",
           "check_options", "RAILS", "NONFINITE_POLICIES"]
