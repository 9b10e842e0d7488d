"""The drop-in :class:`DropInAnvil`: ANVIL for the hidden matrices + Adam for the rest, as a ``torch.optim.Optimizer``
(what ``anvil_fast.ANVIL`` builds for a model of plain tensors). This module is its construction and
step engine (reading the gradients, the non-finite verdict, the hand-over of the groups' values, the
device step's reports); the plan is :mod:`anvil_fast.optim.plan`, the torch.optim contract (state
dicts, copies) :mod:`anvil_fast.optim.contract`.

Building one runs three steps, each a function of :mod:`anvil_fast.optim.plan` that can be called and read alone:

* :func:`classify`: every parameter gets a route (a matrix for ANVIL, or Adam) and the reason, from
  its module's type and what a traced forward saw it do (:mod:`anvil_fast.optim.roles`: ``example_input=``
  at construction, or the model's first forward, after which the plan is rebuilt if it changed);
* :func:`plan_routes`: matrices of equal ``(rows, cols, dtype)`` are put into banks
  ``[n, rows, cols]``, Adam parameters are marked sharded or replicated; the result is the plan
  :meth:`DropInAnvil.describe` prints;
* :func:`build_banks`: each bank's storage is allocated and every member parameter becomes a view
  of it (zero-copy: the model reads the bank, and ``model.state_dict()`` still holds each parameter
  under its own name).

:func:`anvil_fast.optim.entry.ANVIL`'s docstring states the rules, the update and the torch.optim behaviour.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from anvil_ref.config import ConfigError
from anvil_ref.constants import ADAM_DEFAULTS, ANVIL_DEFAULTS
from anvil_ref.rails import rail_scalars

from .contract import (EXTRAS_KEY, LEGACY_STATE_FORMAT, STATE_FORMAT, TorchContract, _StateView,  # noqa: F401
                       merged_state_keys)
from .frontend import (AnvilFrontend, NonFiniteGradientWarning, check_hyperparameters, check_options,
                       hyperparameter_groups, lean_step)
from .optimizer import AnvilAndAdam, NonFiniteGradientError
from .plan import (FROZEN, HEAD_NAMES, IO_LAYERS, MATRIX_DTYPES, Bank, BankPlan, Plan, PlanEntry, Route,  # noqa: F401
                   _collect, _owning_modules, _strip_compile, build_banks, classify, named_parameters_of, plan_routes)


class StaleParameterError(RuntimeError):
    """A parameter's storage, dtype or device changed after the optimizer was built."""


# ====================================================================================== the optimizer
def holds_dtensors(params) -> bool:
    """Whether ``params`` (a module, or a list/tuple of parameters or (name, parameter) pairs) holds
    a DTensor. An iterator is not consumed here (the drop-in refuses DTensors met in one)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(params, nn.Module):
        return any(isinstance(p, DTensor) for p in params.parameters())
    if isinstance(params, (list, tuple)):
        return any(isinstance(it[1] if isinstance(it, tuple) else it, DTensor) for it in params)
    return False


def refuse_ddp_with_own_averaging(params, world_size: int) -> None:
    """DDP averages the gradients in backward; a drop-in on several ranks averages them again (and
    shards the update by matrix): refused, naming both ways out."""
    if world_size <= 1 or not isinstance(params, nn.Module):
        return
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, DistributedDataParallel) for m in params.modules()):
        raise ConfigError(
            f"the model is wrapped in DistributedDataParallel, which averages every gradient across the ranks in "
            f"backward, and ANVIL on {world_size} ranks averages them again itself: pass the unwrapped model "
            "(ddp_model.module) and drop DDP, or pass comms=anvil_fast.parallel.comms.LocalComms() to let every rank run "
            "the whole update on DDP's averaged gradients")


def refuse_dtensors_in(named: Sequence[tuple[str, Tensor]]) -> None:
    """DTensor parameters that reached the single-process drop-in (an iterator of parameters hides
    them from the FSDP2 path): refused."""
    if not dist.is_available():
        return
    from torch.distributed.tensor import DTensor

    found = [n for n, p in named if isinstance(p, DTensor)]
    if found:
        raise ConfigError(f"{found[0]} (and {len(found) - 1} more) are DTensors (FSDP2): pass the model itself, "
                          "or a list of its named_parameters(), so ANVIL takes its FSDP2 path")


def check_parameters(named: Sequence[tuple[str, Tensor]]) -> None:
    """Parameters the drop-in cannot own: on the meta device (no memory yet), or two Parameters over
    one memory (a tie the banks would undo)."""
    meta = [n for n, p in named if p.device.type == "meta"]
    if meta:
        raise ConfigError(f"{meta[0]} (and {len(meta) - 1} more) are on the meta device: they have no memory yet, "
                          "and ANVIL moves every parameter into its bank or buffer at construction. Build the "
                          "optimizer after model.to_empty(device=...) and the weights' initialization or loading")
    by_storage: dict[tuple, list[tuple[int, int, str]]] = defaultdict(list)
    for n, p in named:
        if p.numel():  # the span of memory the view reaches (disjoint views of one storage are fine: banks)
            lo = p.storage_offset() * p.element_size()
            hi = lo + (1 + sum((d - 1) * st for d, st in zip(p.shape, p.stride()))) * p.element_size()
            by_storage[(p.device, p.untyped_storage().data_ptr())].append((lo, hi, n))
    shared = []
    for spans in by_storage.values():
        spans.sort()
        shared += [(a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    if shared:
        a, b = shared[0]
        raise ConfigError(f"{a} and {b} are two Parameters over one memory (a weight tied by sharing storage rather "
                          "than by being one Parameter); ANVIL gives each parameter memory of its own, which would "
                          f"untie them. Tie them as one Parameter (e.g. module_b.weight = module_a.weight) or give "
                          f"each its own copy")


def _before_step(opt: "DropInAnvil", args, kwargs) -> None:
    """Step pre-hook: a parameter frozen at construction must not have a gradient (it would
    silently not train)."""
    for name, p in opt._left_out:
        if p.grad is not None:
            raise ConfigError(f"{name} was frozen (requires_grad=False) when the optimizer was built, so it is not "
                              "in the plan, and it has a gradient now: it would not be trained. Build the optimizer "
                              "with frozen='include' (frozen parameters get their place and state, and train once "
                              "they have gradients) or add it with add_param_group; nothing was updated")


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the
    caller built the optimizer through ``anvil_fast.ANVIL``, a subclass or directly)."""
    import sys

    f, level = sys._getframe(1), 1
    while f is not None and f.f_globals.get("__name__", "").startswith("anvil_fast."):
        f, level = f.f_back, level + 1
    return level


def default_grad_read(device: torch.device, bank_config: Any, dtypes=()) -> str:
    """How a one-process step reads the gradients by default: on the CPU, ``"transient"`` (no
    gradient buffer outlives a bank's update); on CUDA, in place where the bank update's rails are
    the Triton kernel (SAFE and GRAM_SIDE) and every parameter is float32 or bfloat16 (the in-place
    kernels' dtypes), else through the banks' buffers."""
    from anvil_fast.kernels.backend import triton_available
    from anvil_fast.core.cascade import DEFAULT_CONFIG, get_config

    if device.type != "cuda":
        return "transient"
    cfg = DEFAULT_CONFIG if bank_config is None else get_config(bank_config)
    ok = all(d in (torch.float32, torch.bfloat16) for d in dtypes)
    return "in_place" if triton_available() and cfg.triton_elementwise and ok else "buffers"


class DropInAnvil(TorchContract, AnvilFrontend):
    """The one-process (or several-rank, sharded by matrix) drop-in: what ``anvil_fast.ANVIL(model)``
    builds for a model of plain tensors. Its rules, update, torch.optim behaviour, state dict and
    arguments are :func:`anvil_fast.optim.entry.ANVIL`'s docstring."""

    def __init__(self, params, lr: float = ANVIL_DEFAULTS["lr"], adam_lr: float = ADAM_DEFAULTS["lr"], *,
                 momentum: float = ANVIL_DEFAULTS["momentum"], fast_beta: float | None = None,
                 fast_weight: float = 1.0, beta2: float = ANVIL_DEFAULTS["beta2"],
                 weight_decay: float = ANVIL_DEFAULTS["weight_decay"],
                 adam_betas: Sequence[float] = ADAM_DEFAULTS["betas"],
                 adam_eps: float = ADAM_DEFAULTS["eps"], adam_weight_decay: float = ADAM_DEFAULTS["weight_decay"],
                 rails: str = "nesterov", total_steps: int | None = None, lr_scale: str = "seed",
                 adam: Iterable[str] | Callable[[str], bool] | None = None,
                 anvil: Iterable[str] | Callable[[str], bool] | None = None,
                 head_names: Sequence[str] = HEAD_NAMES, split_rows: Mapping[str, int] | None = None,
                 nonfinite: str = "skip", shard_min_numel: int = 1 << 16, comms: Any = None,
                 bank_config: Any = None, maps: Any = None, cuda_graphs: bool | None = None,
                 compile: bool | None = None, rails_dtype: torch.dtype = torch.float32, grad_read: str | None = None,
                 example_input: Any = None, io_layers: str = "adam", frozen: str = "leave",
                 _routes: Mapping[str, Mapping[str, Any]] | None = None):
        self._init_kwargs = dict(lr=lr, adam_lr=adam_lr, momentum=momentum, fast_beta=fast_beta,
                                 fast_weight=fast_weight, beta2=beta2, weight_decay=weight_decay,
                                 adam_betas=tuple(adam_betas), adam_eps=adam_eps, adam_weight_decay=adam_weight_decay,
                                 rails=rails, total_steps=total_steps, lr_scale=lr_scale, adam=adam, anvil=anvil,
                                 head_names=head_names, split_rows=dict(split_rows or {}), nonfinite=nonfinite,
                                 shard_min_numel=shard_min_numel, comms=comms, bank_config=bank_config, maps=maps,
                                 cuda_graphs=cuda_graphs, compile=compile, rails_dtype=rails_dtype,
                                 grad_read=grad_read, io_layers=io_layers, frozen=frozen)
        anvil_group, adam_group = hyperparameter_groups(
            lr, adam_lr, momentum=momentum, fast_beta=fast_beta, fast_weight=fast_weight, beta2=beta2,
            weight_decay=weight_decay, adam_betas=adam_betas, adam_eps=adam_eps, adam_weight_decay=adam_weight_decay)
        check_options(rails, total_steps, lr_scale, nonfinite)
        if io_layers not in IO_LAYERS:
            raise ValueError(f"io_layers must be one of {IO_LAYERS}, got {io_layers!r}")
        if frozen not in FROZEN:
            raise ValueError(f"frozen must be one of {FROZEN}, got {frozen!r}")
        if rails_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rails_dtype must be torch.float32 (default) or torch.bfloat16 (the lean state), got "
                             f"{rails_dtype!r}")
        from .device_step import GRAD_READS

        if grad_read is not None and grad_read not in GRAD_READS:
            raise ValueError(f"grad_read must be None or one of {GRAD_READS}, got {grad_read!r}")

        if not isinstance(params, nn.Module):
            params = list(params) if not isinstance(params, Tensor) else params
        named, owners, model, self._names_given, self._left_out = _collect(params, frozen=frozen)
        if not named and self._left_out:  # only frozen parameters, given on purpose: planned as torch's
            named, self._left_out = self._left_out, []  # optimizers hold them (a step trains them once
            # they have gradients)
        if not named:
            raise ValueError("optimizer got an empty parameter list")
        refuse_dtensors_in(named)
        check_parameters(named)
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        self._named, self._owners, self._model = named, owners, model
        self._observation, self._unobserved = None, ""
        if _routes is None:
            if example_input is not None and model is None:
                raise ConfigError("example_input= needs the model: pass ANVIL(model, example_input=...), or the "
                                  "parameters of one nn.Module")
            from .roles import trace_at_construction

            self._observation, self._unobserved = trace_at_construction(model, example_input,
                                                                        [p for _, p in named + self._left_out])

        from anvil_fast.parallel.comms import resolve_comms

        self.comms = resolve_comms(comms)
        refuse_ddp_with_own_averaging(params, self.comms.world_size)
        engine = self.comms.world_size == 1
        if engine and grad_read is None:
            grad_read = default_grad_read(device, bank_config, {p.dtype for _, p in named})
        elif not engine and grad_read in ("in_place", "transient"):
            raise ValueError(f"grad_read={grad_read!r} is the one-process step's; on several ranks every gradient "
                             "is reduced into the banks' buffers")
        if engine and grad_read == "transient" and device.type == "cuda":
            raise ValueError("grad_read='transient' is the CPU's read (a CUDA graph would bake the addresses of "
                             "buffers that live for one update); on CUDA use 'in_place' or 'buffers'")
        self.grad_read = grad_read if engine else "buffers"
        self.rails, self.total_steps, self.nonfinite = rails, total_steps, nonfinite
        self.engine = None  #: the one-process, device-decided step (anvil_fast.optim.device_step)
        self._taken = 0  #: steps taken (the rails' t) on several ranks; the engine counts on the device
        self._skipped = 0  #: steps skipped for non-finite gradients, likewise
        self._hyper_key = None
        self._groups_init = (anvil_group, adam_group)
        plan = self._plan_for(_routes)
        self._setup(plan, device, first=True)
        if self._left_out:
            self.register_step_pre_hook(_before_step)
        if _routes is None and self._observation is None and self.matrix_banks:
            warnings.warn(f"ANVIL: the model could not be traced ({self._unobserved}), so its input and output "
                          "layers are not recognised and every 2-D or 3-D parameter of no known layer type is banked "
                          "by its shape; pass example_input= (one batch of the model's input) to route by what each "
                          "parameter does, and check opt.describe()", UserWarning, stacklevel=_caller_level())

    # ------------------------------------------------------------------ routing and building
    def _plan_for(self, forced=None) -> Plan:
        kw = self._init_kwargs
        routes = classify(self._named, self._owners, adam=kw["adam"], anvil=kw["anvil"], head_names=kw["head_names"],
                          observation=self._observation, io_layers=kw["io_layers"], forced=forced)
        # Reading .grad where it is (in place, or transient on the CPU), Adam updates every
        # parameter where it lives: the flat buffers of small "replicated" parameters (a gradient
        # copy and a row index per element) would only cost memory, so every Adam parameter keeps
        # its own state (the update is element-wise, so the values are the same bits either way).
        return plan_routes(routes, split_rows=kw["split_rows"], world_size=self.comms.world_size,
                           shard_min_numel=0 if self.grad_read != "buffers" else kw["shard_min_numel"])

    def _setup(self, plan: Plan, device: torch.device, *, first: bool) -> None:
        """Banks, the inner optimizer, param_groups and state views for ``plan`` (at construction, and
        again when parameters are added or a loaded state dict routes them otherwise)."""
        kw = self._init_kwargs
        with torch.no_grad():
            for _, p in self._named:  # the inner optimizer's flat buffers and shards are views
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
        self.matrix_banks = build_banks(plan, device)
        self.adam_params = [(n, p) for n, p, _ in plan.adam]
        anvil_group, adam_group = self._groups_init
        self.inner = self._build_inner(plan, anvil_group, adam_group, lr_scale=kw["lr_scale"],
                                       bank_config=kw["bank_config"], maps=kw["maps"], compile=kw["compile"],
                                       rails_dtype=kw["rails_dtype"], grad_in_place=self.grad_read != "buffers")
        self.plan: list[PlanEntry] = plan.entries
        self._slots = None
        groups = []
        bank_params = [p for b in self.matrix_banks for _, p, _, _ in b.plan.members]
        bank_names = [n for b in self.matrix_banks for n, _, _, _ in b.plan.members]
        if bank_params:
            groups.append(dict(params=bank_params, **anvil_group))
        if self.adam_params:
            groups.append(dict(params=[p for _, p in self.adam_params], **adam_group))
        if self._names_given:
            names = {"anvil": bank_names, "adam": [n for n, _ in self.adam_params]}
            for g in groups:
                g["param_names"] = names[g["kind"]]
        if first:
            self._install_groups(groups, kw["lr"], kw["momentum"])
        else:
            live = {g["kind"]: g for g in self.param_groups}
            if set(live) != {g["kind"] for g in groups}:
                warnings.warn("ANVIL: the new plan (added parameters, or a loaded state dict's routing) changed "
                              f"which parameter groups exist ({sorted(live)} -> {sorted(g['kind'] for g in groups)}); "
                              "an LR scheduler built before holds the old groups", UserWarning,
                              stacklevel=_caller_level())
            for g in groups:
                if g["kind"] in live:
                    g.update({k: v for k, v in live[g["kind"]].items() if k not in ("params", "param_names")})
            self.param_groups[:] = groups
        self._make_state_views()
        self._record_storage()
        self._hyper_key = None
        if self.comms.world_size == 1:
            self._build_engine(kw["cuda_graphs"], device)
        else:
            self._use_cuda_graphs(kw["cuda_graphs"], device)
        if first and not self.matrix_banks and any(p.ndim >= 2 for _, p in self._named):
            warnings.warn("ANVIL: no parameter was banked, so every parameter trains with Adam and lr= changes "
                          "nothing; see opt.describe() for each parameter's route and pass anvil=[names] to bank "
                          "matrices", UserWarning, stacklevel=3)

    def _routes_of(self) -> dict[str, dict[str, Any]]:
        """The plan as a state dict records it: name -> kind, transposed, reason."""
        return {e.name: {"kind": "adam" if e.route == "adam" else "matrix", "transposed": e.transposed,
                         "reason": e.reason} for e in self.plan}

    def _rebuild(self, plan: Plan) -> None:
        device = self._named[0][1].device
        with torch.no_grad():
            for _, p in self._named:  # each parameter takes back memory of its own
                p.data = p.data.clone()
        self._setup(plan, device, first=False)

    # ------------------------------------------------------------------ more parameters
    #: the constructor's names of a group's values, per kind (a dict given to add_param_group)
    _GROUP_KEYS = {"anvil": {"lr": "lr", "momentum": "momentum", "fast_beta": "fast_beta",
                             "fast_weight": "fast_weight", "beta2": "beta2", "weight_decay": "weight_decay"},
                   "adam": {"adam_lr": "lr", "adam_betas": "betas", "adam_eps": "eps",
                            "adam_weight_decay": "weight_decay"}}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters (a layer unfrozen later, a new head), routed by the same rules as at
        construction: the model's module types, and the trace made at construction (which saw the
        frozen parameters too); each joins a bank or Adam, and the param group of its kind. Every bank
        runs with one set of values, so the dict may hold the constructor's value names (``lr``,
        ``momentum``, ... ``adam_lr``, ``adam_betas``, ...) only with the values the groups hold now;
        other values are refused (ValueError) rather than silently ignored. The state of the
        parameters already here is kept bit for bit; the step counts go on."""
        if not getattr(self, "_planned", True):  # torch.optim.Optimizer.__init__ installing the planned groups
            return torch.optim.Optimizer.add_param_group(self, param_group)
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with 'params', got {type(param_group).__name__}")
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        names = param_group.get("param_names")
        if names is not None and len(names) != len(params):
            raise ValueError(f"param_names has {len(names)} names for {len(params)} parameters")
        live = {g["kind"]: g for g in self.param_groups}
        unknown = sorted(set(param_group) - {"params", "param_names"} - set(self._GROUP_KEYS["anvil"])
                         - set(self._GROUP_KEYS["adam"]))
        if unknown:
            raise ValueError(f"add_param_group: unknown keys {unknown} (expected 'params', 'param_names' and the "
                             "constructor's value names: lr, momentum, fast_beta, fast_weight, beta2, weight_decay, "
                             "adam_lr, adam_betas, adam_eps, adam_weight_decay)")
        for kind, keys in self._GROUP_KEYS.items():
            now = live.get(kind, dict(zip(("anvil", "adam"), self._groups_init))[kind])
            for key, gkey in keys.items():
                if key in param_group:
                    v = tuple(param_group[key]) if gkey == "betas" else param_group[key]
                    cur = tuple(now[gkey]) if gkey == "betas" else now[gkey]
                    if v != cur:
                        raise ValueError(f"add_param_group: {key}={v!r} differs from the {kind} group's {cur!r}; "
                                         "ANVIL runs every bank (and every Adam parameter) with one set of values, so "
                                         "added parameters take the values of their kind's group")
        mine = {id(p) for _, p in self._named}
        known = {id(p): n for n, p in self._model.named_parameters()} if self._model is not None else {}
        left = {id(p): n for n, p in self._left_out}
        new = []
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
            if id(p) in mine or any(q is p for _, q in new):
                raise ValueError("some parameters appear in more than one parameter group")
            if not (p.is_leaf or p.retains_grad):
                raise ValueError("can't optimize a non-leaf Tensor")
            name = names[i] if names is not None else known.get(id(p), left.get(id(p), f"param{len(self._named) + i}"))
            new.append((_strip_compile(name), p))
        if not new:
            return
        if len({n for n, _ in self._named} | {n for n, _ in new}) != len(self._named) + len(new):
            raise ValueError(f"add_param_group: parameter names {sorted({n for n, _ in new} & {n for n, _ in self._named})}"
                             " are taken; pass param_names")
        check_parameters(list(self._named) + new)
        devices = {p.device for _, p in new} - {self._named[0][1].device}
        if devices:
            raise ValueError(f"all parameters must be on one device ({self._named[0][1].device}), got {sorted(map(str, devices))}")
        if self._model is not None:
            _, owners = named_parameters_of(self._model, frozen="include")
        else:
            owners = _owning_modules([p for _, p in new if isinstance(p, nn.Parameter)])[1]
        saved = self._state_by_name()
        forced = {n: {"kind": k, "transposed": t, "reason": r, "view": v} for n, k, t, r, v in
                  zip(self._names_in_order(), *(self._routes_list()[key] for key in ("kinds", "transposed", "reasons",
                                                                                      "views")))}
        self._named = list(self._named) + new
        self._owners = {**self._owners, **owners}
        self._left_out = [(n, p) for n, p in self._left_out if all(p is not q for _, q in new)]
        self._names_given = self._names_given or names is not None
        counts = self._state_extras()
        self._rebuild(self._plan_for(forced))
        self._restore_by_name(saved)
        self._load_state_extras(counts)

    def _state_by_name(self) -> dict[str, dict[str, Any]]:
        return {n: self._saved_state_of(p) for n, p in self._named if p in self.state}

    @torch.no_grad()
    def _restore_by_name(self, saved: Mapping[str, Mapping[str, Any]]) -> None:
        for n, p in self._named:
            if n not in saved:
                continue
            live = self.state[p]
            for k, v in saved[n].items():
                if isinstance(live[k], Tensor):
                    live[k].copy_(v)
                else:
                    live.write(k, v)

    # ------------------------------------------------------------------ construction helpers
    def _build_inner(self, plan: Plan, anvil_group: dict, adam_group: dict, *, lr_scale: str, bank_config,
                     maps, compile, rails_dtype=torch.float32, grad_in_place: bool = False) -> AnvilAndAdam:
        table: dict[str, dict] = {}
        for b in plan.banks:
            table[b.label] = {"optim": "anvil", "comms": "sharded", "reshape": (b.n_pad, b.rows, b.cols),
                              "frozen_matrices": tuple(range(b.n, b.n_pad)), "lr_scale": lr_scale,
                              "transposed": b.transposed}
        for name, p, comms in plan.adam:
            p.label = name
            table[name] = {"optim": "adam", "comms": comms, "adam_betas": list(adam_group["betas"])}
        size = {b.label: b.n_pad * b.rows * b.cols for b in plan.banks}
        order = sorted(size, key=lambda l: -size[l]) + \
            [n for n, _, c in plan.adam if c == "sharded"] + [n for n, _, c in plan.adam if c == "replicated"]
        bank_update = None
        if compile is not None and plan.banks:
            import functools

            from anvil_fast.core.bank import anvil_bank_update

            bank_update = functools.partial(anvil_bank_update, compile=compile)
        named = [(b.label, b.param) for b in self.matrix_banks] + [(n, p) for n, p, _ in plan.adam]
        anvil_defaults = {k: anvil_group[k] for k in ("lr", "momentum", "beta2", "weight_decay")}
        adam_defaults = {k: adam_group[k] for k in ("lr", "eps", "weight_decay")}
        return AnvilAndAdam(named, table, order, order, adam_defaults, anvil_defaults, bank_update,
                            comms=self.comms, check_finite=False, tie_embeddings=False, allow_fp32_banks=True,
                            bank_config=bank_config, maps=maps, rails_dtype=rails_dtype, grad_in_place=grad_in_place,
                            lanes=1)  # one process steps through DeviceStep, which has its own lanes

    def _local_slots(self, bank: Bank, first: int, count: int) -> slice:
        """A member's matrices within this rank's chunk of the bank's state."""
        chunk = self.inner.param_cfgs[bank.label].chunk_size
        lo = self.comms.rank * chunk
        a, b = max(first, lo), min(first + count, lo + chunk)
        return slice(a - lo, max(a, b) - lo)

    def _make_state_views(self) -> None:
        self.state = defaultdict(dict)
        for bank in self.matrix_banks:
            st = self.inner.param_states[bank.label]
            for _, p, first, count in bank.plan.members:
                s = self._local_slots(bank, first, count)
                views = dict(fast_rail=st["velocity"][0, s], slow_rail=st["velocity"][1, s],
                             lane_energy=st["lane_energy"][s])
                if "mantissa" in st:  # a bf16 matrix's fp32 master is its value + this low half
                    views["mantissa"] = st["mantissa"][s]
                if count == 1:
                    views = {k: v.squeeze(0) if v.shape[0] == 1 else v for k, v in views.items()}
                self.state[p] = _StateView(lambda views=views: dict(views))
        for name, p in self.adam_params:
            st = self.inner.param_states[name]
            self.state[p] = _StateView(lambda st=st: dict(step=st["step"], exp_avg=st["exp_avg"],
                                                          exp_avg_sq=st["exp_avg_sq"]),
                                       lambda k, v, st=st: st.__setitem__(k, v))

    def _record_storage(self) -> None:
        self._storage = [(n, p, p.data_ptr(), p.dtype, p.device) for b in self.matrix_banks for n, p, _, _ in b.plan.members]
        self._storage += [(n, p, p.data_ptr(), p.dtype, p.device) for n, p in self.adam_params]
        self._storage_params = [p for _, p, _, _, _ in self._storage]
        self._storage_ptrs = [ptr for _, _, ptr, _, _ in self._storage]

    def _build_engine(self, flag: bool | None, device: torch.device) -> None:
        """The one-process step (:class:`~anvil_fast.optim.device_step.DeviceStep`): graphs where capture is
        valid (``cuda_graphs`` as in :func:`anvil_fast.optim.entry.ANVIL`'s docstring)."""
        from .device_step import DeviceStep
        from .graphs import capture_unsupported_reason

        graphs = False
        if flag is True or (flag is None and device.type == "cuda"):
            reason = capture_unsupported_reason(self.inner)
            if reason is None:
                graphs = True
            elif flag:
                raise ValueError(f"cuda_graphs=True: {reason}")
            else:
                warnings.warn(f"ANVIL: CUDA graphs are off ({reason}); the step runs eagerly", UserWarning,
                              stacklevel=3)
        record = None
        if self.rails == "record":
            record = np.array([tuple(rail_scalars(t, self.total_steps)) for t in range(self.total_steps)],
                              dtype=np.float64).astype(np.float32)
        self.engine = DeviceStep(self, grad_read=self.grad_read, cuda_graphs=graphs, record=record)

    def _use_cuda_graphs(self, flag: bool | None, device: torch.device) -> None:
        """Replay each step's device part as one CUDA graph (:class:`~anvil_fast.optim.graphs.StepGraph`,
        one capture per set of parameters with gradients) where capture is valid."""
        from .graphs import capture_unsupported_reason

        if flag is False or (flag is None and device.type != "cuda"):
            return
        reason = capture_unsupported_reason(self.inner)
        if reason is None:
            self.inner.capture_step(strict=bool(flag))
        elif flag:
            raise ValueError(f"cuda_graphs=True: {reason}")
        else:
            warnings.warn(f"ANVIL: CUDA graphs are off ({reason}); the step runs eagerly", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ counters
    @property
    def taken_steps(self) -> int:
        """Steps taken (the record rails' t). On CUDA reading it waits for the device."""
        eng = getattr(self, "engine", None)
        return eng.counts()[0] if eng is not None else self._taken

    @taken_steps.setter
    def taken_steps(self, v: int) -> None:
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.set_counts(int(v), eng.counts()[1])
        else:
            self._taken = int(v)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients. On CUDA reading it waits for the device and
        reports (warns about) the skips not reported yet."""
        eng = getattr(self, "engine", None)
        if eng is None:
            return self._skipped
        self._report(wait=True, stacklevel=3)
        return eng.counts()[1]

    @skipped_steps.setter
    def skipped_steps(self, v: int) -> None:
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.set_counts(eng.counts()[0], int(v))
        else:
            self._skipped = int(v)

    @property
    def refused_updates(self) -> dict[str, int]:
        """Matrix updates refused so far, per bank label: cascade outputs that came out non-finite (or,
        with SAFE's guard, exploded), so that their matrices took only the sign-aligned weight decay
        (the warnings say the same, step by step). This process's matrices, counted by this optimizer
        object: a state dict does not carry the count (an optimizer that loads one, or a deep copy,
        starts at 0), while ``skipped_steps`` is restored. A bank that refused none has 0. On CUDA
        reading it waits for the device and reports (warns about) what is not reported yet."""
        self._report(wait=True, stacklevel=3)
        out = {}
        for label, bank in self.inner.banks.items():
            trips = getattr(bank, "guard_trips", None)
            out[label] = int(trips.sum()) if trips is not None else 0
        return out

    # ------------------------------------------------------------------ introspection
    @property
    def banks(self) -> dict[str, list[str]]:
        """Bank label -> the names of its member parameters, in bank order."""
        return {b.label: [n for n, _, _, _ in b.plan.members] for b in self.matrix_banks}

    @property
    def adam_names(self) -> dict[str, str]:
        """Adam parameter name -> "sharded" or "replicated"."""
        return {n: self.inner.param_cfgs[n].comms for n, _ in self.adam_params}

    def _route_text(self, e: PlanEntry) -> str:
        if e.route == "adam":
            return f"adam ({e.comms})"
        first, end = e.slots
        where = f"matrix {first}" if end - first == 1 else f"matrices {first}-{end - 1}"
        return f"{e.route} [{', '.join(map(str, e.bank_shape))}] {where}"

    def _plan_summary(self) -> list[str]:
        n_bank = sum(e.route != "adam" for e in self.plan)
        return [f"{len(self.matrix_banks)} bank(s) holding {n_bank} parameter(s); "
                f"{len(self.plan) - n_bank} parameter(s) on Adam; world size {self.comms.world_size}",
                self._routing_note()]

    def _routing_note(self) -> str:
        obs = self._observation
        if obs is not None:
            return f"routes: by what each parameter does in the observed forward ({obs.source})"
        if self._unobserved:
            return (f"routes: by module types and shapes only, not observed: {self._unobserved} (input and output "
                    "layers are not recognised; output heads by head_names); pass example_input= to trace a forward")
        return "routes: recorded in a loaded state dict or a pickled optimizer"

    def banked_state(self, name: str) -> dict[str, Tensor]:
        """A banked parameter's live state in its banked form ``[count, rows, cols]`` (one process:
        every matrix is this rank's): ``fast_rail``, ``slow_rail``, ``lane_energy``, ``mantissa``
        (a float32 matrix, its own master: its low halves, as a bf16 one's mantissa, a copy) and
        ``own_master`` (whether the parameter is its own fp32 master)."""
        for b in self.matrix_banks:
            for n, _, first, count in b.plan.members:
                if n == name:
                    st = self.inner.param_states[b.label]
                    if "mantissa" in st:
                        mantissa = st["mantissa"][first:first + count]
                    else:  # a float32 matrix is its own master: its low halves, as a bf16 one's mantissa
                        w = b.param.data.view(b.plan.n_pad, b.plan.rows, b.plan.cols)[first:first + count]
                        mantissa = w.contiguous().view(torch.int16).view(*w.shape, 2)[..., 0].contiguous() \
                            .view(torch.uint16)
                    return dict(fast_rail=st["velocity"][0, first:first + count],
                                slow_rail=st["velocity"][1, first:first + count],
                                lane_energy=st["lane_energy"][first:first + count], mantissa=mantissa,
                                own_master="mantissa" not in st)
        raise KeyError(name)

    # ------------------------------------------------------------------ step
    @lean_step
    def step(self, closure=None):
        """One ANVIL + Adam step from the parameters' ``.grad`` (:func:`anvil_fast.optim.entry.ANVIL`'s
        docstring); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_storage()
        if self.engine is not None:
            self._engine_step()
            return loss
        read, without_grad = self._collect_gradients()
        # the verdict's kernels are launched first and read last: the host prepares the step while
        # the device checks, so the one host sync waits on little but those kernels
        flags = self._nonfinite_flags(read)
        self._apply_hyperparameters()
        prepared = self.inner.prepare_from_buffers(read, do_adam=True)
        if not self._gradients_finite(flags, prepared):
            return loss
        saved = self._save_members(without_grad)
        self.inner.run_prepared(prepared)  # one graph replay where captured; .grad is not read
        self._restore_members(saved)
        self._taken += 1
        return loss

    def _engine_step(self) -> None:
        """The one-process step: the host part (hyper-parameters when they changed, the record
        schedule's end) and the device part (:class:`~anvil_fast.optim.device_step.DeviceStep`)."""
        eng = self.engine
        if eng.cuda:
            self._report(wait=False, stacklevel=4)  # what earlier steps refused, if the device is done
        if self.rails == "record" and self._host_taken() >= self.total_steps:
            self._report(wait=True, stacklevel=4)
            if eng.counts()[0] >= self.total_steps:
                raise ValueError(f"rails='record': the schedule covers total_steps={self.total_steps} steps and all "
                                 f"were taken; build the optimizer with a larger total_steps")
        self._apply_groups(self._host_taken, every_step=self.rails == "record", rails_on_device=eng.record is not None)
        if not eng.step():
            return  # no parameter has a gradient: nothing ran, nothing counted
        if self.nonfinite == "raise" or not eng.cuda:
            self._report(wait=True, stacklevel=4)

    def _host_taken(self) -> int:
        """The host's count of taken steps without waiting: exact once every step was reported
        (always on the CPU); on CUDA a skip not reported yet counts as taken here."""
        eng = self.engine
        return int(eng.seen[0]) + (eng.attempted - int(eng.seen[0] + eng.seen[1]))

    def _report(self, *, wait: bool, stacklevel: int) -> None:
        """Warn about (or, ``nonfinite="raise"``, raise for) what the device refused in steps not
        reported yet: skipped steps (non-finite gradients) and refused matrix updates."""
        eng = self.engine
        if eng is None:
            return
        news = eng.news(wait)
        if news is None:
            return
        skipped, names, refused = news
        if skipped:
            more = f" ({skipped} step(s) since the last report)" if skipped > 1 else ""
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(f"non-finite gradient (NaN or inf) in {', '.join(names)}{more}; nothing "
                                             "was updated")
            warnings.warn(f"ANVIL: step skipped for every parameter: non-finite gradient (NaN or inf) in "
                          f"{', '.join(names)}{more} ({int(eng.seen[1])} step(s) skipped so far)",
                          NonFiniteGradientWarning, stacklevel=stacklevel)
        if refused:
            from .device_step import NonFiniteUpdateError, NonFiniteUpdateWarning

            cfg = next(iter(self.inner.banks.values())).config.name
            what = ", ".join(f"{label}: {k} matrix update(s)" for label, k in refused.items())
            msg = (f"ANVIL ({cfg} configuration): {what} came out non-finite"
                   f"{' or exploded' if cfg != 'faithful' else ''} and were not applied (those matrices only took "
                   "their sign-aligned weight decay; their rails took the step)")
            if self.nonfinite == "raise":
                raise NonFiniteUpdateError(msg)
            warnings.warn(msg, NonFiniteUpdateWarning, stacklevel=stacklevel)

    def _check_storage(self) -> None:
        # every change the check is for (model.to(dtype), .double(), a new device, p.data = ...)
        # gives the parameter new memory, so the addresses alone are compared on every step (a map
        # over the C method: a quarter less host time than a comprehension's per-item frame)
        if list(map(Tensor.data_ptr, self._storage_params)) == self._storage_ptrs:
            return
        stale = [(name, p, dtype, device) for name, p, ptr, dtype, device in self._storage
                 if p.data_ptr() != ptr or p.dtype != dtype or p.device != device]
        if stale:
            name, p, dtype, device = stale[0]
            more = f" (and {len(stale) - 1} more: {', '.join(n for n, *_ in stale[1:4])}" + \
                (", ...)" if len(stale) > 4 else ")") if len(stale) > 1 else ""
            raise StaleParameterError(
                f"{name}{more}: the parameter's storage changed since the optimizer was built (was {dtype} on "
                f"{device}, is {p.dtype} on {p.device}{', new memory' if p.dtype == dtype else ''}; e.g. "
                "model.to(dtype), model.double(), p.data = ...): the optimizer would update memory the model no "
                "longer reads. Build a new ANVIL after changing the model")

    def grad_slots(self) -> list[tuple[str, Tensor, Tensor, str, Bank | None, int]]:
        """Per parameter: (name, parameter, its slot in the inner optimizer's persistent gradient
        buffer shaped like the parameter, inner label, bank or None, member index); built once,
        since the buffers live as long as the optimizer."""
        if self._slots is None:
            bufs = self.inner.grad_buffers()
            slots = []
            for b in self.matrix_banks:
                whole = bufs[b.label].view(b.plan.n_pad, b.plan.rows, b.plan.cols)
                slots += [(name, p, whole[first:first + count].view(p.shape), b.label, b, i)
                          for i, (name, p, first, count) in enumerate(b.plan.members)]
            slots += [(n, p, bufs[n], n, None, 0) for n, p in self.adam_params]
            self._slots = slots
        return self._slots

    def _collect_gradients(self) -> tuple[list[str], list[tuple[Bank, int]]]:
        """Copy every ``.grad`` into its slot of the persistent gradient buffers (checked first):
        one ``_foreach_copy_`` per (buffer dtype, gradient dtype) pair, and for a bank the copy is
        also the cast to bf16 the gradient travels in, so a CUDA graph of the step reads fixed
        addresses. Returns the inner labels read and (bank, member index) of the members without a
        gradient in banks that have one (their slots are zeroed: a stale slot must not trip the
        finite check; the members are restored after the step)."""
        pairs: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
        read: dict[str, None] = {}
        missing = []
        for name, p, dst, label, bank, i in self.grad_slots():
            g = p.grad
            if g is None:
                missing.append((dst, label, bank, i))
                continue
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:  # copy_ would broadcast or cast
                raise ValueError(f"{name}: gradient {g.dtype} {tuple(g.shape)} on {g.device} does not match "
                                 f"the parameter's {p.dtype} {tuple(p.shape)} on {p.device}; nothing was updated")
            if g.is_sparse:
                raise ValueError(f"{name}: sparse gradients are not supported; nothing was updated")
            d, src = pairs.setdefault((dst.dtype, g.dtype), ([], []))
            d.append(dst)
            src.append(g)
            read[label] = None
        without = []
        for dst, label, bank, i in missing:
            if bank is not None and label in read:
                dst.zero_()
                without.append((bank, i))
        for d, src in pairs.values():
            torch._foreach_copy_(d, src)
        return list(read), without

    def _nonfinite_flags(self, read: list[str]) -> Tensor:
        """One fused norm pass per dtype over the buffers the step reads (so a gradient that
        overflows bf16 in the cast counts as infinite) and one all-reduce, launched, not waited for."""
        bufs = self.inner.grad_buffers()
        return self.inner.nonfinite_flags({l: bufs[l] for l in read})

    def _gradients_finite(self, flags: Tensor, prepared) -> bool:
        """The verdict (the step's one host sync). On NaN/inf: undo the prepared step's host part,
        name the parameters, then skip (warn) or raise."""
        if not flags.any().item():
            return True
        self.inner.cancel_prepared(prepared)
        self._skip_or_raise(self._nonfinite_names(), world_size=self.comms.world_size, stacklevel=4)
        return False

    def _nonfinite_names(self) -> list[str]:
        """The parameters whose gradient slot holds NaN/inf on any rank (the rare path: one flag each)."""
        slots = self.grad_slots()
        flags = torch.stack([(~torch.isfinite(dst)).any() if p.grad is not None and dst.numel()
                             else torch.zeros((), dtype=torch.bool, device=self.inner.device)
                             for _, p, dst, *_ in slots]).float()
        if self.comms.world_size > 1:
            self.comms.all_reduce_sum_now(flags)
        return [slots[i][0] for i in flags.nonzero().flatten().tolist()]

    def _apply_hyperparameters(self) -> None:
        """The groups checked and handed to the inner optimizer at every step (several ranks)."""
        self._apply_groups(self._host_taken if self.engine is not None else (lambda: self._taken), every_step=True)

    def _hand_over(self, values: Mapping[str, Mapping[str, Any]]) -> None:
        """The inner optimizer's one seam for the group values
        (:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.set_hyperparameters`), then, on one process, the
        device step's inbox from the values the inner optimizer holds."""
        self.inner.set_hyperparameters(anvil=values.get("anvil"), adam=values.get("adam"))
        if self.engine is not None:
            self.engine.load_hyper()

    def _hand_over_rails(self, anvil: Mapping[str, Any]) -> None:
        # the inner optimizer's values only: the device step reads the rails from its record table
        # (derive_scalars), and its inbox, left as it is, is not sent again (DeviceStep.upload)
        self.inner.set_hyperparameters(anvil=anvil)

    def _save_members(self, without: list[tuple[Bank, int]]) -> list[tuple[Tensor, Tensor]]:
        """(live slice, copy) of every weight and state slice of the members without a gradient."""
        saved = []
        for b, i in without:
            _, p, first, count = b.plan.members[i]
            st = self.inner.param_states[b.label]
            s = self._local_slots(b, first, count)
            live = [p.data, st["velocity"][:, s], st["lane_energy"][s]] + \
                ([st["mantissa"][s]] if "mantissa" in st else [])
            trips = getattr(self.inner.banks[b.label], "guard_trips", None)
            if trips is not None:
                live.append(trips[s])
            saved += [(t, t.clone()) for t in live]
        return saved

    @staticmethod
    def _restore_members(saved: list[tuple[Tensor, Tensor]]) -> None:
        if saved:
            torch._foreach_copy_([t for t, _ in saved], [c for _, c in saved])


__all__ = ["DropInAnvil", "HEAD_NAMES", "StaleParameterError", "NonFiniteGradientWarning", "NonFiniteGradientError",
           "PlanEntry", "classify", "plan_routes", "build_banks", "named_parameters_of"]
