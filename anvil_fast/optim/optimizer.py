"""AnvilAndAdam on the fast path: the seed's optimizer with its explicit communication schedule.

ANVIL updates the *banks* (3-D bf16 parameters ``[n_matrices, rows, cols]``, sharded over ranks by
matrix); Adam updates everything else, either *sharded* (first dimension split over ranks) or
*replicated* (every rank updates the whole parameter, on flat buffers: :mod:`.replicated_adam`).
The math is anvil_ref's (:class:`anvil_ref.optimizer.ReferenceAnvilAndAdam` is the specification;
its module docstring states the semantics, including the Adam gradients kept between Adam steps).

One step (:meth:`AnvilAndAdam.step`) is a host part, :meth:`~AnvilAndAdam.prepare`, then a device
part, :meth:`~AnvilAndAdam.body`. The host part checks everything the step reads, fixes the
:class:`StepPlan` (which gradients are read, which Adam rows are active, tied or not), advances the
Adam step counts and stages the scalars (step 0 below). The device part launches steps 1-3 for that
plan, reading gradients only from the mapping it is given and branching on nothing but the plan, so
one CUDA graph of it replays any step of the same plan (:class:`~anvil_fast.optim.graphs.StepGraph`).
In launch order; on NCCL the launch order *is* the comms schedule, since the collectives run on one
stream in enqueue order and ``Handle.wait()`` is a stream wait:

0. (host part) Stage this step's scalars: one host-to-device copy (:mod:`.bank_scalars`).
   (device part) On Adam steps, the replicated parameters' flat all-reduce starts (one per dtype).
1. Scatter phase, in ``scatter_order``: each sharded parameter with a gradient starts its
   reduce-scatter (a bank's lands in the bank's persistent ``grad`` buffer); the sparse update's
   ``launch()`` runs at :data:`SPARSE_UPDATE_LABEL`'s place; while tied, ``embed.grad^T`` is added
   into ``lm_head.grad`` (Triton ``transpose_add``) just before lm_head's reduce.
2. Work phase, in ``work_order``: wait for the reduce, update (``bank_update(bank)`` or Adam),
   start the gather; at the first replicated label, the fused replicated Adam pass; the sparse
   update's ``update()`` at its place. On one CUDA process (world size 1: no collective to order)
   the banks run on side streams instead (``lanes``, :mod:`.lanes`), every one launched before the
   main stream's Adam updates, replicated pass and sparse update, which run beside them in
   ``work_order``; the main stream waits for the lanes before phase 3. Each kernel is the same, so
   the bits are too.
3. Finish: wait for lm_head's gather, then (tied) ``embed = lm_head^T`` (``transpose_copy``), the
   sparse update's ``finish()``, then wait for every gather not deferred. Deferred gathers come back
   as :class:`~anvil_fast.parallel.comms.Handle` objects the caller waits before reading the parameter.

The gradients come from ``.grad`` (:meth:`~AnvilAndAdam.step`) or from persistent buffers at fixed
addresses (:meth:`~AnvilAndAdam.grad_buffers`, :meth:`~AnvilAndAdam.step_from_buffers`: what a CUDA
graph needs; a bank's buffer is its bf16 ``grad`` itself on one process, a replicated parameter's
its slice of the flat all-reduce buffer, so the caller's one copy into them is the only pass). The
schedule above is the same for both; with a captured step, steps 1-3 are one graph replay after
the host part.

Adam runs only when ``do_adam``; on other steps Adam gradients stay in ``.grad`` and the next
backward accumulates into them. ANVIL runs every step. Everything the step will read is checked
before anything is written (shapes, dtypes, devices; with ``check_finite=True`` also NaN/inf, on all
ranks together), so a refused step leaves parameters and state untouched.

Departures from the seed, each for a reason:

* ``param_cfgs`` and the state are keyed by label, not by parameter object, and ``state_dict`` is
  keyed by label too: the seed's ``id(p)`` keys do not survive a process restart.
* The comms go through :mod:`.comms` (gloo has no ``get_future``; one process needs no group).
* Adam's scalars come from a device table inside the one per-step upload instead of 0-D CPU
  tensors, so one Triton kernel serves sharded and replicated parameters without recompiling.
* Tied ``embed``/``lm_head`` may also be replicated (the seed assumes sharded).
* ``allow_fp32_banks=True`` accepts float32 banks (for the drop-in optimizer on fp32 models): the
  parameter itself is the fp32 master, split exactly into the bf16 + uint16 halves the bank update
  works on before each update and joined back after it (same bits as the seed's storage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from anvil_ref.config import ConfigError, ParamConfig, build_param_config, check_labels, check_order
from anvil_ref.constants import (
    ADAM_DEFAULTS,
    ANVIL_DEFAULTS,
    EMBED_LABEL,
    LM_HEAD_LABEL,
    SPARSE_UPDATE_LABEL,
)
from anvil_ref.equalizer import lane_energy_shape

from anvil_fast.kernels.adam import adam_row, adam_update_
from anvil_fast.kernels.bank_scalars import ADAM_COLUMNS, BankScalarStaging
from anvil_fast.parallel.comms import DONE, Comms, Handle, resolve_comms
from .lanes import MAX_LANES, bank_work, make_lanes, run_on_lanes
from .replicated_adam import ReplicatedAdam
from anvil_fast.kernels.transpose import transpose_add, transpose_copy


STATE_FORMAT = "anvil_fast.AnvilAndAdam/1"


class SparseUpdate(Protocol):
    """Row-sparse updates outside the dense reduce/gather path (seed: the n-gram table,
    value_embeds), slotted into the step's schedule so their exchanges overlap the dense ones."""

    def launch(self) -> None:
        """At SPARSE_UPDATE_LABEL's place in scatter_order: start the gradient exchange."""

    def update(self) -> None:
        """At SPARSE_UPDATE_LABEL's place in work_order: wait for the exchange and update (e.g.
        with :meth:`AnvilAndAdam.adam_update_shard`)."""

    def finish(self) -> None:
        """After the lm_head gather: land what the next steps read before deferred gathers."""


@dataclass(frozen=True)
class StepPlan:
    """What one step launches, decided on the host before anything is written: a captured step
    graph is valid for exactly one plan."""

    do_adam: bool
    read: tuple[str, ...]  #: labels whose gradient the step reads, in optimizer order
    active_adam: tuple[str, ...]  #: Adam labels updated (step count advanced) this step
    tied_now: bool  #: embed and lm_head tied on this step


@dataclass(frozen=True)
class PreparedStep:
    """A step whose host part ran (:meth:`AnvilAndAdam.prepare_from_buffers`): its plan, the
    gradient buffers it reads, and the step graph's key (None without graphs)."""

    plan: StepPlan
    grads: Mapping[str, Tensor]
    key: Any = None


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or infinity (raised by the opt-in check before anything is written)."""


def _reshape_of(param: Tensor, entry: Mapping) -> tuple[int, ...] | None:
    # Tensor.reshape is a method; the seed shadows it with a tuple attribute on bank parameters.
    r = param.__dict__.get("reshape") if hasattr(param, "__dict__") else None
    if isinstance(r, (tuple, list)):
        return tuple(r)
    r = entry.get("reshape") if isinstance(entry, Mapping) else None
    return tuple(r) if r is not None else None


def _plain_cfg(cfg: ParamConfig) -> dict[str, Any]:
    """A config as plain containers (``torch.load(..., weights_only=True)`` refuses a frozenset)."""
    out = asdict(cfg)
    out["frozen_matrices"] = sorted(out["frozen_matrices"])
    return out


# ====================================================================================== classify
@dataclass
class Classified:
    """The parameters as the table describes them, checked (:func:`classify_params`)."""

    labels: list[str]  #: in the parameters' order
    scatter_order: list[str]
    work_order: list[str]
    params: dict[str, Tensor]  #: label -> parameter
    names: dict[str, str]  #: label -> the caller's name
    param_cfgs: dict[str, ParamConfig]
    device: torch.device
    tied: bool  #: embed and lm_head start tied


def classify_params(named_params: Iterable[tuple[str, Tensor]], param_table: Mapping[str, Mapping], *,
                    scatter_order: Sequence[str] | None, work_order: Sequence[str] | None, adam_defaults: Mapping,
                    anvil_defaults: Mapping, world_size: int, rank: int, allow_fp32_banks: bool,
                    tie_embeddings: bool | None) -> Classified:
    """Read every parameter's label, table entry and tensor and check them all (labels, orders,
    one device, contiguous floating-point tensors, bf16 banks, the tied pair) before anything is
    allocated or written; raises :class:`~anvil_ref.config.ConfigError` naming the culprit."""
    named = list(named_params)
    for name, p in named:
        if getattr(p, "label", None) is None:
            raise ConfigError(f"parameter {name!r} has no .label attribute (its param_table key)")
    labels = check_labels([p.label for _, p in named], param_table)
    if not labels:
        raise ConfigError("AnvilAndAdam needs at least one parameter")
    scatter = check_order("scatter_order", scatter_order, labels)
    work = check_order("work_order", work_order, labels)
    params: dict[str, Tensor] = {p.label: p for _, p in named}
    names: dict[str, str] = {p.label: name for name, p in named}
    devices = {p.device for p in params.values()}
    if len(devices) != 1:
        raise ConfigError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    param_cfgs: dict[str, ParamConfig] = {}
    for label, p in params.items():
        entry = param_table[label]
        cfg = build_param_config(label, entry, shape=tuple(p.shape), reshape=_reshape_of(p, entry),
                                 frozen_matrices=set(getattr(p, "frozen_matrices", ()) or ()) |
                                 set(entry.get("frozen_matrices", ()) if isinstance(entry, Mapping) else ()),
                                 adam_defaults=adam_defaults, anvil_defaults=anvil_defaults,
                                 world_size=world_size, rank=rank)
        if not p.is_contiguous():
            raise ConfigError(f"{label}: parameters must be contiguous (shards and flat buffers are views)")
        if not p.dtype.is_floating_point:
            raise ConfigError(f"{label}: parameters must be floating point, got {p.dtype}")
        if cfg.optim == "anvil":
            ok = (torch.bfloat16, torch.float32) if allow_fp32_banks else (torch.bfloat16,)
            if p.dtype not in ok:
                raise ConfigError(f"{label}: ANVIL banks must be bfloat16 (the fp32 master is the bf16 "
                                  f"parameter + a uint16 mantissa), got {p.dtype}"
                                  + ("" if allow_fp32_banks else "; convert it, or pass "
                                     "allow_fp32_banks=True to keep a float32 parameter"))
        param_cfgs[label] = cfg
    tied = _check_tying(params, param_cfgs, tie_embeddings)
    return Classified(labels=labels, scatter_order=scatter, work_order=work, params=params, names=names,
                      param_cfgs=param_cfgs, device=devices.pop(), tied=tied)


def _check_tying(params: Mapping[str, Tensor], param_cfgs: Mapping[str, ParamConfig],
                 tie_embeddings: bool | None) -> bool:
    if tie_embeddings is None:
        tie_embeddings = EMBED_LABEL in params and LM_HEAD_LABEL in params
    if not tie_embeddings:
        return False
    if EMBED_LABEL not in params or LM_HEAD_LABEL not in params:
        raise ConfigError(f"tie_embeddings needs both {EMBED_LABEL!r} and {LM_HEAD_LABEL!r} parameters")
    e, h = params[EMBED_LABEL], params[LM_HEAD_LABEL]
    if e.ndim != 2 or tuple(e.shape) != tuple(h.shape)[::-1]:
        raise ConfigError(f"tied {EMBED_LABEL} {tuple(e.shape)} and {LM_HEAD_LABEL} {tuple(h.shape)} "
                          "must be 2-D transposes of each other")
    if param_cfgs[EMBED_LABEL].optim != "adam" or param_cfgs[LM_HEAD_LABEL].optim != "adam":
        raise ConfigError("tied embed and lm_head must both be Adam parameters")
    return True


# ====================================================================================== plan
@dataclass
class RowPlan:
    """Which label goes where (:func:`plan_rows`), in the parameters' order."""

    adam_labels: list[str]
    adam_row: dict[str, int]  #: label -> its row of the Adam scalar table
    replicated_labels: list[str]  #: the Adam labels on the replicated flat buffers
    bank_labels: list[str]


def plan_rows(labels: Sequence[str], param_cfgs: Mapping[str, ParamConfig]) -> RowPlan:
    adam = [l for l in labels if param_cfgs[l].optim == "adam"]
    return RowPlan(adam_labels=adam, adam_row={label: i for i, label in enumerate(adam)},
                   replicated_labels=[l for l in adam if param_cfgs[l].comms == "replicated"],
                   bank_labels=[l for l in labels if param_cfgs[l].optim == "anvil"])


# ====================================================================================== build
def new_param_states(params: Mapping[str, Tensor], param_cfgs: Mapping[str, ParamConfig],
                     device: torch.device, rails_dtype: torch.dtype = torch.float32) -> dict[str, dict[str, Any]]:
    """Zeroed optimizer state for this rank: Adam's moments (a chunk of a sharded parameter, the whole
    of a replicated one); a bank's two rails (``rails_dtype``: fp32, or bf16 for the lean state) and
    lane energy for its chunk of matrices, and for a bf16 bank the mantissa (the fp32 masters' low
    halves; a float32 bank is its own master)."""
    states: dict[str, dict[str, Any]] = {}
    for label, cfg in param_cfgs.items():
        p = params[label]
        if cfg.optim == "adam":
            shape = (cfg.chunk_size, *p.shape[1:]) if cfg.comms == "sharded" else tuple(p.shape)
            z = torch.zeros(shape, dtype=torch.float32, device=device)
            states[label] = dict(step=0, exp_avg=z, exp_avg_sq=torch.zeros_like(z))
        else:
            chunk_shape = (cfg.chunk_size, *cfg.reshape[1:])
            states[label] = dict(
                velocity=torch.zeros((2, *chunk_shape), dtype=rails_dtype, device=device),
                lane_energy=torch.zeros(lane_energy_shape(chunk_shape, transposed=cfg.transposed), dtype=torch.float32,
                                        device=device))
            if p.dtype != torch.float32:
                states[label]["mantissa"] = torch.zeros(chunk_shape, dtype=torch.uint16, device=device)
    return states


# ====================================================================================== the optimizer
class AnvilAndAdam:
    """ANVIL for the banks + Adam for the rest, with the seed's explicit comms schedule.

    Args:
        named_params: ``(name, parameter)`` pairs; each parameter carries ``.label`` (its
            ``param_table`` key) and, for banks, ``.reshape`` (``[n_matrices, rows, cols]``; or a
            ``"reshape"`` table entry) and optionally ``.frozen_matrices`` (global indices, LR 0).
        param_table: label -> entry (see :mod:`anvil_ref.config`).
        scatter_order, work_order: every label exactly once (None: the parameters' order).
        adam_defaults, anvil_defaults: as in the seed (anvil_ref.constants' defaults).
        bank_update: ``f(bank)`` running one bank's update eagerly; default
            ``anvil_fast.core.bank.anvil_bank_update`` (:meth:`use_cuda_graphs` captures it per bank;
            :meth:`update_bank` runs whichever a step uses).
        comms: a :class:`~anvil_fast.parallel.comms.Comms`, a process group, or None (the default group when
            torch.distributed is initialized, else one process).
        check_finite: check every gradient the step reads for NaN/inf first (one host sync per step).
        tie_embeddings: treat ``embed``/``lm_head`` as tied until :meth:`copy_lm_state_to_embed`;
            None: tied when both labels are present (the seed).
        allow_fp32_banks: accept float32 banks (module docstring).
        bank_config, maps: the bank update's cascade configuration (``"safe"``/``"faithful"``/
            ``"gram_side"`` or an :class:`anvil_fast.core.cascade.CascadeConfig`; default, per bank:
            :func:`anvil_fast.core.cascade.default_config_for`) and map set (default ANVIL_MAPS), passed to
            :meth:`anvil_fast.core.bank.AnvilBank.create`.
        grad_in_place: the caller's step reads the gradients without the banks' persistent buffers
            (the drop-in's ``grad_read`` "in_place" and "transient"): each bank holds no gradient
            buffer and takes its cascade workspace per update.
        lanes: side streams for the banks on one CUDA process (:mod:`.lanes`; the module docstring's
            phase 2). None: :data:`~anvil_fast.optim.lanes.MAX_LANES` where the world size is 1 and the
            device is CUDA, else 1; 1: every update on the main stream, in ``work_order``. More than 1
            needs a world size of 1 (with several ranks the launch order is the comms schedule).
    """

    def __init__(self, named_params: Iterable[tuple[str, Tensor]], param_table: Mapping[str, Mapping],
                 scatter_order: Sequence[str] | None = None, work_order: Sequence[str] | None = None,
                 adam_defaults: Mapping = ADAM_DEFAULTS, anvil_defaults: Mapping = ANVIL_DEFAULTS,
                 bank_update: Callable | None = None, *, comms: Comms | Any = None, check_finite: bool = False,
                 tie_embeddings: bool | None = None, allow_fp32_banks: bool = False, bank_config: Any = None,
                 maps: Any = None, rails_dtype: torch.dtype = torch.float32, grad_in_place: bool = False,
                 lanes: int | None = None):
        if rails_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"rails_dtype must be torch.float32 (the seed's rails) or torch.bfloat16 (the lean "
                              f"state), got {rails_dtype!r}")
        self.rails_dtype = rails_dtype
        self.comms = resolve_comms(comms)
        self.world_size, self.rank = self.comms.world_size, self.comms.rank
        self.adam_defaults, self.anvil_defaults = dict(adam_defaults), dict(anvil_defaults)
        self.param_table = param_table
        self.check_finite = bool(check_finite)

        # read and check everything before touching any parameter
        c = classify_params(named_params, param_table, scatter_order=scatter_order, work_order=work_order,
                            adam_defaults=self.adam_defaults, anvil_defaults=self.anvil_defaults,
                            world_size=self.world_size, rank=self.rank, allow_fp32_banks=allow_fp32_banks,
                            tie_embeddings=tie_embeddings)
        self.labels, self.scatter_order, self.work_order = c.labels, c.scatter_order, c.work_order
        self.params, self.names, self.param_cfgs = c.params, c.names, c.param_cfgs
        self.device, self.tied = c.device, c.tied
        if bank_update is None and any(cfg.optim == "anvil" for cfg in self.param_cfgs.values()):
            from anvil_fast.core.bank import anvil_bank_update as bank_update
        self.bank_update = bank_update  #: ``f(bank)``: one bank's update, eagerly
        self.bank_graphs = None  #: :class:`~anvil_fast.optim.graphs.BankUpdateGraphs` once :meth:`use_cuda_graphs` ran

        rows = plan_rows(self.labels, self.param_cfgs)
        self.adam_labels, self.adam_row = rows.adam_labels, rows.adam_row
        self.replicated_labels, self.bank_labels = rows.replicated_labels, rows.bank_labels

        self.param_states = new_param_states(self.params, self.param_cfgs, self.device, rails_dtype)
        #: 0-D int64: bank updates run so far (the lean rails' rounding draws its bits from it)
        self.rail_step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.replicated = ReplicatedAdam(
            [(l, self.params[l], self.param_states[l], self.adam_row[l]) for l in self.replicated_labels],
            self.device, self.comms) if self.replicated_labels else None
        self._build_banks(bank_config, maps, grad_in_place)
        self._build_lanes(lanes)
        self._init_step_state()

    def _build_banks(self, bank_config: Any, maps: Any, grad_in_place: bool = False) -> None:
        """One staging buffer for every device scalar, then each bank over the live state tensors."""
        self.staging = BankScalarStaging([self.param_cfgs[l].chunk_size for l in self.bank_labels],
                                         self.device, adam_rows=len(self.adam_labels))
        self.adam_table = self.staging.adam_table()
        self._shard_staging = BankScalarStaging([], self.device, adam_rows=1)  # adam_update_shard
        self.banks: dict[str, Any] = {}
        if not self.bank_labels:
            return
        from anvil_fast.core.bank import AnvilBank

        from anvil_fast.core.cascade import default_config_for

        extra = {} if maps is None else {"maps": maps}
        for i, label in enumerate(self.bank_labels):
            cfg = self.param_cfgs[label]
            live = self.live_bank_state(label)
            config = bank_config if bank_config is not None else \
                default_config_for(tuple(live["p_slice"].shape), self.device)
            bank = AnvilBank.create(
                label, live["p_slice"], beta2=cfg.beta2, velocity=live["velocity"],
                lane_energy=live["lane_energy"], mantissa=live.get("mantissa"), scalars=self.staging.scalars(i),
                eff_lr=self.staging.eff_lr(i), rails_dtype=self.rails_dtype, config=config, transposed=cfg.transposed,
                persistent_workspace=not grad_in_place, grad_buffer=not grad_in_place, **extra)
            bank.rail_step = self.rail_step
            bank.first = self.rank * cfg.chunk_size
            self.banks[label] = bank

    def _build_lanes(self, lanes: int | None) -> None:
        """The banks' side streams (:mod:`.lanes`): :attr:`bank_lanes`, lists of bank labels each on its
        own stream, or None where every bank runs on the main stream."""
        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1):
            raise ConfigError(f"lanes must be None or an int >= 1 (side streams for the banks), got {lanes!r}")
        if lanes is not None and lanes > 1 and self.world_size > 1:
            raise ConfigError(f"lanes={lanes} runs the banks on side streams of one process; with {self.world_size} "
                              "ranks the launch order is the comms schedule: pass lanes=1 or None")
        one = self.world_size == 1 and self.device.type == "cuda"
        n = (MAX_LANES if lanes is None else lanes) if one else 1
        labels = list(self.bank_labels)
        plan = make_lanes(labels, [bank_work((self.param_cfgs[l].chunk_size, *self.param_cfgs[l].reshape[1:]))
                                   for l in labels], n, self.device) if labels else []
        #: lists of bank labels, each updated in order on its own CUDA stream (None: the main stream)
        self.bank_lanes = plan if len(plan) > 1 else None

    def _init_step_state(self) -> None:
        """The rails before :meth:`set_rails`, and the per-step caches (host tables, index maps)."""
        self.fast_beta, self.fast_weight = 0.0, 1.0
        self.split_embed = False
        self._label_index = {l: i for i, l in enumerate(self.labels)}
        self._cfg_list = list(self.param_cfgs.values())
        self._bank_cfg_list = [self.param_cfgs[l] for l in self.bank_labels]
        self._inactive_row = np.array(adam_row(lr=0, beta1=0, beta2=0, eps=1, weight_decay=0, wd_mul=0, step=1,
                                               active=False), dtype=np.float64)
        self._adam_host_table = np.zeros((len(self.adam_labels), len(ADAM_COLUMNS)), dtype=np.float64)
        self._replicated_set = frozenset(self.replicated_labels)
        #: label -> the reduce chunk a sharded Adam label's gradient is reduced into (allocated on first use)
        self.reduce_chunks: dict[str, Tensor] = {}
        #: label -> its persistent gradient buffer once :meth:`grad_buffers` built them (None before)
        self.built_grad_buffers: dict[str, Tensor] | None = None
        self.step_graph = None  #: a :class:`~anvil_fast.optim.graphs.StepGraph` once :meth:`capture_step` ran
        self._positions: dict[tuple[str, ...], Tensor] = {}

    # ------------------------------------------------------------------ views and helpers
    def _lo_hi(self, cfg: ParamConfig) -> tuple[int, int]:
        lo = self.rank * cfg.chunk_size
        return lo, lo + cfg.chunk_size

    def _param_shard(self, label: str) -> Tensor:
        """This rank's slice of a sharded parameter (a bank: in its bank shape)."""
        cfg, p = self.param_cfgs[label], self.params[label]
        lo, hi = self._lo_hi(cfg)
        full = p.data.view(cfg.reshape) if cfg.optim == "anvil" else p.data
        return full[lo:hi]

    def live_bank_state(self, label: str) -> dict[str, Tensor]:
        """The bank's state tensors as the live optimizer and parameter hold them now (the one
        definition both the bank and the CUDA graphs' address check use)."""
        st = self.param_states[label]
        out = dict(velocity=st["velocity"], lane_energy=st["lane_energy"], p_slice=self._param_shard(label))
        if "mantissa" in st:
            out["mantissa"] = st["mantissa"]
        return out

    def set_rails(self, fast_beta: float, fast_weight: float) -> None:
        """The fast rail's beta and its weight in the twin-rail blend, for the following steps."""
        fb, fw = float(fast_beta), float(fast_weight)
        if not (0.0 <= fb <= 1.0) or not math.isfinite(fw):
            raise ValueError(f"set_rails: fast_beta must lie in [0, 1] and fast_weight be finite, got {fb}, {fw}")
        self.fast_beta, self.fast_weight = fb, fw

    def set_rail_scalars(self, scalars) -> None:
        """Apply :func:`anvil_ref.rails.rail_scalars`' output: rails and every bank's momentum."""
        self.set_rails(scalars.fast_beta, scalars.fast_weight)
        for label in self.bank_labels:
            self.param_cfgs[label].momentum = float(scalars.momentum)

    def set_hyperparameters(self, anvil: Mapping[str, Any] | None = None, adam: Mapping[str, Any] | None = None
                            ) -> None:
        """A front-end's per-step values, the one way they reach this optimizer: ``anvil`` (``lr``,
        ``momentum``, ``fast_beta`` (None: = momentum), ``fast_weight``, ``weight_decay``, ``beta2``)
        for every bank, ``adam`` (``lr``, ``betas``, ``eps``, ``weight_decay``) for every Adam label;
        None leaves that kind as it is. The front-end checks them first."""
        if anvil is not None:
            fast_beta = anvil["momentum"] if anvil["fast_beta"] is None else anvil["fast_beta"]
            for label, bank in self.banks.items():
                cfg = self.param_cfgs[label]
                cfg.lr, cfg.momentum = float(anvil["lr"]), float(anvil["momentum"])
                # beta2 is a Python float baked into the bank update: a step graph captured with
                # another value is not replayed (StepGraph keys its captures by it)
                cfg.weight_decay, cfg.beta2 = float(anvil["weight_decay"]), float(anvil["beta2"])
                bank.beta2 = cfg.beta2
            self.set_rails(float(fast_beta), float(anvil["fast_weight"]))
        if adam is not None:
            for label in self.adam_labels:
                cfg = self.param_cfgs[label]
                cfg.lr, cfg.adam_betas = float(adam["lr"]), tuple(float(b) for b in adam["betas"])
                cfg.eps, cfg.weight_decay = float(adam["eps"]), float(adam["weight_decay"])

    def hyperparameters(self) -> list[float]:
        """The values :meth:`set_hyperparameters` set, in the order of
        :data:`anvil_fast.optim.device_step.HYPER` (the first bank's and the first Adam label's: the
        front-ends set every bank alike and every Adam label alike; zeros for a kind absent)."""
        vals = [0.0] * 10
        if self.bank_labels:
            cfg = self.param_cfgs[self.bank_labels[0]]
            vals[0:5] = [cfg.lr, cfg.momentum, self.fast_beta, self.fast_weight, cfg.weight_decay]
        if self.adam_labels:
            cfg = self.param_cfgs[self.adam_labels[0]]
            vals[5:10] = [cfg.lr, cfg.adam_betas[0], cfg.adam_betas[1], cfg.eps, cfg.weight_decay]
        return vals

    def use_cuda_graphs(self, **kwargs) -> Any:
        """Capture every bank's update in a CUDA graph and use the replays from now on (returns the
        :class:`~anvil_fast.optim.graphs.BankUpdateGraphs`)."""
        from .graphs import BankUpdateGraphs

        self.bank_graphs = BankUpdateGraphs(self, update=self.bank_update, **kwargs)
        return self.bank_graphs

    def update_bank(self, bank) -> None:
        """One bank's update as a step runs it: the replay of its graph once :meth:`use_cuda_graphs`
        captured them, else :attr:`bank_update`."""
        (self.bank_update if self.bank_graphs is None else self.bank_graphs)(bank)

    # ------------------------------------------------------------------ per-step scalars
    def _check_hyperparameters(self) -> None:
        # Every step, so the common case is one vectorized test; the per-label loop names the culprit.
        cfgs = self._cfg_list
        vals = [c.lr for c in cfgs] + [c.lr_mul for c in cfgs] + [c.wd_mul for c in cfgs] + \
            [c.weight_decay for c in cfgs] + [c.momentum for c in self._bank_cfg_list] + \
            [c.beta2 for c in self._bank_cfg_list]
        try:
            if np.isfinite(np.asarray(vals, dtype=np.float64)).all():
                return
        except (TypeError, ValueError):
            pass
        for label, cfg in self.param_cfgs.items():
            vals = dict(lr=cfg.lr, lr_mul=cfg.lr_mul, wd_mul=cfg.wd_mul, weight_decay=cfg.weight_decay)
            if cfg.optim == "anvil":
                vals.update(momentum=cfg.momentum, beta2=cfg.beta2)
            bad = {k: v for k, v in vals.items() if v is None or not math.isfinite(v)}
            if bad:
                raise ValueError(f"{label}: hyper-parameters must be finite numbers, got {bad}")

    def _active_adam(self, do_adam: bool, read: Sequence[str]) -> list[str]:
        if not do_adam:
            return []
        read = set(read)
        return [l for l in self.adam_labels if l in read
                and not (l == EMBED_LABEL and self.tied and not self.split_embed)]

    def _bank_fields(self) -> tuple[list, list]:
        fields_, lrs = [], []
        for label in self.bank_labels:
            cfg = self.param_cfgs[label]
            # the products keep the seed's order (wd_mul * weight_decay * lr; lr_mul * mult * lr)
            fields_.append((cfg.momentum, cfg.wd_mul * cfg.weight_decay * cfg.lr, self.fast_beta, self.fast_weight))
            lrs.append([cfg.lr_mul * m * cfg.lr for m in cfg.per_matrix_lr_mul])
        return fields_, lrs

    def stage_bank_scalars(self, active_adam: Sequence[str] = ()) -> None:
        """Upload this step's scalars (banks', and the Adam rows of ``active_adam``, whose step
        counts advance here) in one host-to-device copy."""
        table = None
        if active_adam:
            table = self._adam_host_table
            table[:] = self._inactive_row
            for label in active_adam:
                cfg, st = self.param_cfgs[label], self.param_states[label]
                st["step"] += 1
                b1, b2 = cfg.adam_betas
                table[self.adam_row[label]] = adam_row(lr=cfg.lr * cfg.lr_mul, beta1=b1, beta2=b2, eps=cfg.eps,
                                                       weight_decay=cfg.weight_decay, wd_mul=cfg.wd_mul,
                                                       step=st["step"])
        fields_, lrs = self._bank_fields()
        self.staging.upload(fields_, lrs, table)

    # ------------------------------------------------------------------ the step rule
    def reads_grad(self, label: str, do_adam: bool) -> bool:
        """The step rule: a step reads a bank's gradient always and an Adam parameter's only when
        ``do_adam``; what it reads it consumes, what it does not read is kept for the next
        backward pass to accumulate into. :meth:`step`, :meth:`step_from_buffers` and
        :mod:`anvil_fast.optim.overlap`'s drivers all decide by it."""
        return do_adam or self.param_cfgs[label].optim == "anvil"

    def step_labels(self, do_adam: bool, labels: Iterable[str] | None = None) -> list[str]:
        """The labels of ``labels`` (None: every label, in ``self.labels`` order), in their order,
        whose gradients a step with ``do_adam`` reads (:meth:`reads_grad`)."""
        return [l for l in (self.labels if labels is None else labels) if self.reads_grad(l, do_adam)]

    def step_grads(self, do_adam: bool) -> dict[str, Tensor]:
        """label -> ``.grad`` for the labels a step with ``do_adam`` reads that have one."""
        return {l: g for l in self.step_labels(do_adam) if (g := self.params[l].grad) is not None}

    def release_grads(self, do_adam: bool) -> None:
        """After a step with ``do_adam``: drop the ``.grad`` of every label it read; the others'
        are kept (the next backward pass accumulates into them)."""
        for label in self.step_labels(do_adam):
            self.params[label].grad = None

    # ------------------------------------------------------------------ checks before a step
    def _validate(self, grads: Mapping[str, Tensor], deferred: frozenset[str]) -> None:
        for label in deferred:
            if label not in self.params:
                raise ConfigError(f"deferred_labels: unknown label {label!r}")
            if self.param_cfgs[label].comms != "sharded":
                raise ConfigError(f"deferred_labels: {label!r} is replicated; only sharded parameters gather")
        self._check_hyperparameters()
        if self.bank_graphs is not None:  # every baked address still live, before any write
            self.bank_graphs.check_all()
        buffers = self.built_grad_buffers or {}
        for label, g in grads.items():
            if buffers.get(label) is g:
                continue  # a persistent buffer: shape, dtype and device are right by construction
            p = self.params[label]
            if tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"{label}: gradient shape {tuple(g.shape)} differs from the parameter's {tuple(p.shape)}")
            if g.device != p.device:
                raise ValueError(f"{label}: gradient on {g.device}, parameter on {p.device}")
            if g.dtype != p.dtype:
                raise ValueError(f"{label}: gradient dtype {g.dtype} differs from the parameter's {p.dtype}")
            if g.is_sparse:
                raise ValueError(f"{label}: sparse gradients are not supported (route them through a SparseUpdate)")
        if self.check_finite:
            hit = self.nonfinite_labels(grads)
            if hit:
                names = [f"{l} ({self.names[l]})" for l in hit]
                raise NonFiniteGradientError(f"non-finite gradient (NaN or inf) in {', '.join(names)}"
                                             f"{'' if self.world_size == 1 else ' on at least one rank'}; "
                                             "nothing was updated")

    # ------------------------------------------------------------------ comms
    def _launch_reduce(self, label: str, grad: Tensor) -> tuple[Handle, Tensor]:
        cfg = self.param_cfgs[label]
        if cfg.optim == "anvil":
            bank = self.banks[label]
            if grad.data_ptr() == bank.grad.data_ptr() and self.world_size == 1:
                return DONE, bank.grad  # the persistent buffer is the bank's own
            src = grad.contiguous().view(cfg.reshape)
            if src.dtype != bank.grad.dtype:  # fp32 banks: the gradient travels in bf16, as the seed's
                src = src.to(bank.grad.dtype)
            return self.comms.reduce_scatter_avg(bank.grad, src), bank.grad
        if self.world_size == 1:
            return DONE, grad.contiguous()
        chunk = self.reduce_chunks.get(label)
        if chunk is None:  # allocated once: a captured step bakes its address
            chunk = self.reduce_chunks[label] = torch.empty((cfg.chunk_size, *grad.shape[1:]), dtype=grad.dtype,
                                                           device=self.device)
        return self.comms.reduce_scatter_avg(chunk, grad.contiguous()), chunk

    def launch_reduce(self, label: str, grad: Tensor) -> tuple[Handle, Tensor]:
        """Start the reduce-scatter of a sharded parameter's gradient ahead of :meth:`body` (which
        then takes it through ``launched``): the result lands where phase 1 would put it. Refused
        while embed and lm_head are tied, whose reduce needs both gradients summed first."""
        cfg = self.param_cfgs.get(label)
        if cfg is None or cfg.comms != "sharded":
            raise ConfigError(f"launch_reduce: {label!r} is not a sharded parameter of this optimizer")
        if self.tied and not self.split_embed and label in (EMBED_LABEL, LM_HEAD_LABEL):
            raise ConfigError(f"launch_reduce: {label!r} is tied; its reduce needs embed^T + lm_head first "
                              "(untie with copy_lm_state_to_embed, or let step() launch it)")
        return self._launch_reduce(label, grad)

    def launch_gather(self, label: str) -> Handle:
        """Start the all-gather of a sharded parameter's updated shard into its full replica
        (phase 2 launches one after each update; the studies time them alone)."""
        cfg, p = self.param_cfgs[label], self.params[label]
        full = p.data.view(cfg.reshape) if cfg.optim == "anvil" else p.data
        return self.comms.all_gather(full, self._param_shard(label))

    # ------------------------------------------------------------------ updates
    def adam_update(self, label: str, grad_chunk: Tensor) -> None:
        """Adam on ``label``'s shard (a replicated parameter: all of it) from its reduced gradient
        chunk, with the scalars the step staged (:meth:`stage_bank_scalars`): one piece of phase
        2, public so a caller can run or time it alone."""
        st = self.param_states[label]
        p_slice = self._param_shard(label) if self.param_cfgs[label].comms == "sharded" else self.params[label].data
        adam_update_(p_slice, grad_chunk, st["exp_avg"], st["exp_avg_sq"], self.adam_table, self.adam_row[label])

    def anvil_update(self, label: str, grad_chunk: Tensor, bank_update: Callable) -> None:
        """``bank_update`` on ``label``'s bank, whose gradient buffer ``grad_chunk`` must be (the
        reduce-scatter lands there): one piece of phase 2, public so a caller can run or time it
        alone."""
        bank = self.banks[label]
        assert grad_chunk is bank.grad
        bank_update(bank)

    @torch.no_grad()
    def adam_update_shard(self, param: Tensor, grad_chunk: Tensor) -> None:
        """Adam on this rank's shard of a sharded parameter whose gradient was reduced outside
        :meth:`step` (a SparseUpdate's rows). Same update, state and config as in step()."""
        label = getattr(param, "label", None)
        if label not in self.params or self.params[label] is not param:
            raise ConfigError(f"adam_update_shard: parameter {label!r} is not one of this optimizer's")
        cfg, st = self.param_cfgs[label], self.param_states[label]
        if cfg.optim != "adam" or cfg.comms != "sharded":
            raise ConfigError(f"adam_update_shard: {label!r} is not a sharded Adam parameter")
        if param.grad is not None:
            raise ConfigError(f"adam_update_shard: {label!r} has a .grad; step() would update it a second time")
        if tuple(grad_chunk.shape) != tuple(st["exp_avg"].shape):
            raise ValueError(f"adam_update_shard: gradient shard {tuple(grad_chunk.shape)}, expected "
                             f"{tuple(st['exp_avg'].shape)}")
        st["step"] += 1
        b1, b2 = cfg.adam_betas
        row = adam_row(lr=cfg.lr * cfg.lr_mul, beta1=b1, beta2=b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       wd_mul=cfg.wd_mul, step=st["step"])
        self._shard_staging.upload([], [], np.array([row]))
        adam_update_(self._param_shard(label), grad_chunk.contiguous(), st["exp_avg"], st["exp_avg_sq"],
                     self._shard_staging.adam_table(), 0)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, do_adam: bool = True, sparse_update: SparseUpdate | None = None,
             deferred_labels: Iterable[str] = frozenset()) -> dict[str, Handle]:
        """One step (module docstring) from the parameters' ``.grad``. Returns label -> gather handle
        for each deferred label that gathered; wait each before the first read of that parameter's
        full replica."""
        deferred = frozenset(deferred_labels)
        grads = self.step_grads(do_adam)
        plan = self.prepare(grads, do_adam, deferred=deferred)
        handles = self.body(plan, grads, sparse_update=sparse_update, deferred=deferred)
        self.release_grads(do_adam)
        return handles

    def plan_of(self, grads: Mapping[str, Tensor], do_adam: bool) -> StepPlan:
        """The step's plan: which gradients it reads and which Adam rows it updates."""
        read = tuple(l for l in self.labels if l in grads)
        return StepPlan(do_adam=bool(do_adam), read=read, active_adam=tuple(self._active_adam(do_adam, read)),
                        tied_now=self.tied and not self.split_embed)

    def prepare(self, grads: Mapping[str, Tensor], do_adam: bool, *, deferred: frozenset[str] = frozenset(),
                before_write: Callable[[StepPlan], None] | None = None) -> StepPlan:
        """Host part of a step: check everything the step reads (``grads``: label -> the gradient
        the device part will read), then advance the Adam step counts and upload every scalar (one
        host-to-device copy). ``before_write(plan)`` runs after the checks and before the first
        write (the step graph checks its baked addresses there)."""
        self._validate(grads, deferred)
        plan = self.plan_of(grads, do_adam)
        if before_write is not None:
            before_write(plan)
        self.stage_bank_scalars(plan.active_adam)
        return plan

    def body(self, plan: StepPlan, grads: Mapping[str, Tensor], *, sparse_update: SparseUpdate | None = None,
             deferred: frozenset[str] = frozenset(), bank_update: Callable | None = None,
             launched: Mapping[str, tuple[Handle, Tensor]] | None = None) -> dict[str, Handle]:
        """Device part of a step (phases 0-3 of the module docstring after the scalar upload): every
        launch for ``plan``, reading gradients only from ``grads`` (labels ``plan.read``). Nothing
        here inspects ``.grad`` or branches on tensor values, so a CUDA graph of it replays the step.
        ``launched``: label -> :meth:`launch_reduce`'s result for reduces the caller already started
        (from the backward pass, :mod:`.overlap`); phase 1 takes those instead of launching. An error
        on the way (a ``bank_update`` that raises, a capture it breaks) leaves no reduce pending for the
        next step."""
        try:
            return self._body(plan, grads, sparse_update=sparse_update, deferred=deferred, bank_update=bank_update,
                              launched=launched)
        except BaseException:
            if self.replicated is not None:
                self.replicated.discard_pending()
            raise

    def _body(self, plan: StepPlan, grads: Mapping[str, Tensor], *, sparse_update: SparseUpdate | None,
              deferred: frozenset[str], bank_update: Callable | None,
              launched: Mapping[str, tuple[Handle, Tensor]] | None) -> dict[str, Handle]:
        bank_update = self.update_bank if bank_update is None else bank_update
        do_adam, tied_now = plan.do_adam, plan.tied_now
        lm, embed = grads.get(LM_HEAD_LABEL), grads.get(EMBED_LABEL)
        pending: dict[str, tuple[Handle, Tensor]] = {}

        # ---- phase 0: the replicated flat all-reduce (the scalars went up in prepare())
        if tied_now and do_adam and lm is not None and embed is not None \
                and self.param_cfgs[LM_HEAD_LABEL].comms == "replicated":
            transpose_add(embed, lm)
        if do_adam and self.replicated is not None:
            self.replicated.launch_reduce(set(plan.active_adam) & self._replicated_set, grads)

        # ---- phase 1: reduces in scatter_order
        for label in self.scatter_order:
            if label == SPARSE_UPDATE_LABEL and sparse_update is not None:
                sparse_update.launch()
            cfg = self.param_cfgs[label]
            g = grads.get(label)
            if g is None or cfg.comms == "replicated":
                continue
            if label == LM_HEAD_LABEL and tied_now and do_adam and embed is not None:
                transpose_add(embed, g)
            if label == EMBED_LABEL and tied_now:
                continue
            if launched is not None and label in launched:
                pending[label] = launched[label]
                continue
            pending[label] = self._launch_reduce(label, g)

        # ---- phase 2: updates in work_order (on one CUDA process, the banks on their lanes)
        gathers: list[Handle] = []
        deferred_handles: dict[str, Handle] = {}
        lm_gather = None
        replicated_done = False

        def work(label: str, grad_chunk: Tensor | None) -> bool:
            # one label's piece of phase 2 (the sparse update at its place, the replicated pass at the
            # first replicated label); whether it updated the label (so its gather starts)
            nonlocal replicated_done
            if label == SPARSE_UPDATE_LABEL and sparse_update is not None:
                sparse_update.update()
            cfg = self.param_cfgs[label]
            if cfg.optim == "adam" and cfg.comms == "replicated":
                if do_adam and not replicated_done and self.replicated is not None:
                    self.replicated.update(self.adam_table)
                    replicated_done = True
                return False
            if grad_chunk is None:
                return False
            if cfg.optim == "adam":
                self.adam_update(label, grad_chunk)
            else:
                self.anvil_update(label, grad_chunk, bank_update)
            return True

        if self.bank_lanes is None:
            for label in self.work_order:
                grad_chunk = None
                if label in pending:
                    handle, grad_chunk = pending.pop(label)
                    handle.wait()
                if work(label, grad_chunk):
                    lm_gather = self._start_gather(label, deferred, deferred_handles, gathers) or lm_gather
        else:
            # world size 1: the waits complete nothing on a device and the gathers move nothing, so the
            # banks may all start before any Adam update, and every gather after the last update
            ready: dict[str, Tensor] = {}
            for label in self.work_order:
                if label in pending:
                    handle, ready[label] = pending.pop(label)
                    handle.wait()

            def bank_on_lane(label: str) -> None:
                if label in ready:
                    self.anvil_update(label, ready[label], bank_update)

            def main_stream_part() -> None:  # Adam, the replicated pass, the sparse update
                for label in self.work_order:
                    if label not in self.banks:
                        work(label, ready.get(label))

            run_on_lanes(self.bank_lanes, bank_on_lane, self.device, then=main_stream_part)
            for label in self.work_order:
                if label in ready:
                    lm_gather = self._start_gather(label, deferred, deferred_handles, gathers) or lm_gather

        if self.rails_dtype == torch.bfloat16 and any(l in self.banks for l in plan.read):
            self.rail_step.add_(1)  # the lean rails' next rounding draws new bits

        # ---- phase 3: lm_head's gather, the tied copy, the sparse finish, the other gathers
        if lm_gather is not None:
            lm_gather.wait()
        if do_adam and tied_now:
            transpose_copy(self.params[LM_HEAD_LABEL].data, self.params[EMBED_LABEL].data)
        if sparse_update is not None:
            sparse_update.finish()
        for g in gathers:
            g.wait()
        return deferred_handles

    def _start_gather(self, label: str, deferred: frozenset[str], deferred_handles: dict[str, Handle],
                      gathers: list[Handle]) -> Handle | None:
        """Phase 2's gather after ``label``'s update: deferred (returned to the caller), lm_head's
        (returned here: phase 3 waits it first), or one of ``gathers``."""
        g = self.launch_gather(label)
        if label in deferred:
            deferred_handles[label] = g
        elif label == LM_HEAD_LABEL:
            return g
        else:
            gathers.append(g)
        return None

    # ------------------------------------------------------------------ persistent gradient buffers
    def grad_buffers(self) -> Mapping[str, Tensor]:
        """label -> the persistent buffer :meth:`step_from_buffers` reads that label's gradient
        from (allocated on the first call, then the same tensors for the optimizer's life; a
        read-only view of :attr:`built_grad_buffers`, so a step asking for it copies nothing). Each has
        the parameter's shape; copy the gradient in with ``copy_`` (or one ``torch._foreach_copy_``
        per dtype pair). A bank's buffer is bf16 whatever the parameter's dtype (the gradient
        travels in bf16, as the seed's), so the copy is also the cast; on one process it *is* the
        bank's own gradient buffer, so that copy is the only pass over the gradient. A replicated
        Adam parameter's buffer is its slice of the flat all-reduce buffer."""
        if self.built_grad_buffers is None:
            out = {}
            flat = self.replicated.grad_views() if self.replicated is not None else {}
            for label in self.labels:
                cfg, p = self.param_cfgs[label], self.params[label]
                if cfg.optim == "anvil":
                    bank = self.banks[label]
                    out[label] = bank.grad.view(p.shape) if self.world_size == 1 else \
                        torch.zeros(p.shape, dtype=bank.grad.dtype, device=self.device)
                elif cfg.comms == "replicated":
                    out[label] = flat[label]
                else:
                    out[label] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            self.built_grad_buffers = out
        return MappingProxyType(self.built_grad_buffers)

    @torch.no_grad()
    def step_from_buffers(self, labels: Iterable[str] | None = None, do_adam: bool = True) -> dict[str, Handle]:
        """One step reading the gradients of ``labels`` (None: every label) from
        :meth:`grad_buffers`; the other parameters and their state are not touched (an Adam one's
        step count does not advance). ``.grad`` is neither read nor written. Uses the whole-step
        CUDA graph when :meth:`capture_step` installed one. Returns the deferred gather handles
        (none: deferred gathers and sparse updates go through :meth:`step`)."""
        wanted = self.labels if labels is None else list(labels)
        return self.run_prepared(self.prepare_from_buffers(wanted, do_adam))

    def prepare_from_buffers(self, labels: Iterable[str], do_adam: bool = True) -> PreparedStep:
        """The host part of :meth:`step_from_buffers`, apart, so a caller can do host work of its own
        between it and :meth:`run_prepared` while the device catches up (the drop-in waits for its
        non-finite verdict there); :meth:`cancel_prepared` undoes it when the step is then not taken.

        A step from the buffers is these two calls and nothing between: this one runs
        :meth:`prepare` (the checks; with a step graph, its baked addresses too
        (:meth:`~anvil_fast.optim.graphs.StepGraph.before_write`), before anything is written; the Adam
        step counts; the scalar upload) and names the graph the plan replays
        (:meth:`~anvil_fast.optim.graphs.StepGraph.key`); :meth:`run_prepared` runs the device part: the
        graph's replay (:meth:`~anvil_fast.optim.graphs.StepGraph.run`, which captures a plan met for the
        first time) or :meth:`body`."""
        bufs = self.grad_buffers()
        wanted = set(labels)
        unknown = sorted(wanted - set(self.params))
        if unknown:
            raise ConfigError(f"step_from_buffers: unknown labels {unknown}")
        grads = {l: bufs[l] for l in self.step_labels(do_adam) if l in wanted}
        graph = self.step_graph
        plan = self.prepare(grads, do_adam, before_write=None if graph is None else graph.before_write)
        return PreparedStep(plan, grads, None if graph is None else graph.key(plan))

    def run_prepared(self, prepared: PreparedStep) -> dict[str, Handle]:
        """The device part of a step :meth:`prepare_from_buffers` prepared (one graph replay where
        :meth:`capture_step` installed the graphs)."""
        if self.step_graph is not None:
            return self.step_graph.run(prepared.plan, prepared.key, prepared.grads)
        return self.body(prepared.plan, prepared.grads)

    def cancel_prepared(self, prepared: PreparedStep) -> None:
        """Undo :meth:`prepare_from_buffers` for a step that is not taken: the Adam step counts go
        back (the uploaded scalars are simply overwritten by the next step's upload)."""
        for label in prepared.plan.active_adam:
            self.param_states[label]["step"] -= 1

    def capture_step(self, **kwargs) -> Any:
        """Replay :meth:`step_from_buffers`' device part as one CUDA graph per plan from now on
        (returns the :class:`~anvil_fast.optim.graphs.StepGraph`; raises ``GraphUnsupported`` with the
        reason where capture is not valid)."""
        from .graphs import StepGraph

        self.step_graph = StepGraph(self, **kwargs)
        return self.step_graph

    @torch.no_grad()
    def nonfinite_flags(self, grads: Mapping[str, Tensor]) -> Tensor:
        """One float32 flag per label (``self.labels`` order): 1 where ``grads[label]`` holds NaN
        or infinity on this rank or any other, launched and not waited for (the host sync is the
        caller's, e.g. :meth:`nonfinite_labels`). One ``_foreach_norm`` per dtype: an L1 norm is
        non-finite exactly when an element is NaN or infinite, or when the absolute sum overflows
        float32 (past 3.4e38), which a gradient whose squares and Frobenius norm must stay finite
        cannot use either; so a handful of launches whatever the number of parameters."""
        flags = torch.zeros(len(self.labels), dtype=torch.float32, device=self.device)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for l in self.labels:
            if l in grads:
                by_dtype.setdefault(grads[l].dtype, []).append(l)
        order = [l for ls in by_dtype.values() for l in ls]
        if order:
            norms = [n for ls in by_dtype.values() for n in torch._foreach_norm([grads[l] for l in ls], 1)]
            bad = torch.stack([n.float() for n in norms]).isfinite().logical_not_().float()
            flags.index_copy_(0, self._label_positions(tuple(order)), bad)
        if self.world_size > 1:
            self.comms.all_reduce_sum_now(flags)  # every rank refuses together
        return flags

    def _label_positions(self, order: tuple[str, ...]) -> Tensor:
        """The positions of ``order``'s labels in ``self.labels`` as a device tensor, made once per
        order: a fresh one each step would be a copy from pageable host memory, which waits for
        every kernel queued before it, so the host could not prepare the step while the device
        checks the gradients."""
        idx = self._positions.get(order)
        if idx is None:
            idx = self._positions[order] = torch.tensor([self._label_index[l] for l in order], device=self.device)
        return idx

    def nonfinite_labels(self, grads: Mapping[str, Tensor]) -> list[str]:
        """The labels of ``grads`` holding NaN or infinity on this rank or any other
        (:meth:`nonfinite_flags`, then one host sync; every rank gets the same answer)."""
        if not grads and self.world_size == 1:
            return []
        return [l for l, f in zip(self.labels, self.nonfinite_flags(grads).tolist()) if f]

    # ------------------------------------------------------------------ untie, reset
    @torch.no_grad()
    def copy_lm_state_to_embed(self) -> None:
        """Untie: embed's Adam moments become lm_head's, transposed (all-gather lm_head's shards,
        transpose, take embed's shard), and its step count lm_head's."""
        if not self.tied:
            raise ConfigError(f"untie needs tied {EMBED_LABEL!r} and {LM_HEAD_LABEL!r} parameters")
        lm_cfg, em_cfg = self.param_cfgs[LM_HEAD_LABEL], self.param_cfgs[EMBED_LABEL]
        lm_st, em_st = self.param_states[LM_HEAD_LABEL], self.param_states[EMBED_LABEL]
        lm_shape = tuple(self.params[LM_HEAD_LABEL].shape)
        for key in ("exp_avg", "exp_avg_sq"):
            if lm_cfg.comms == "sharded" and self.world_size > 1:
                full = torch.empty(lm_shape, dtype=torch.float32, device=self.device)
                self.comms.all_gather(full, lm_st[key].contiguous()).wait()
            else:
                full = lm_st[key]
            if em_cfg.comms == "sharded":
                lo, hi = self._lo_hi(em_cfg)
            else:
                lo, hi = 0, lm_shape[1]
            transpose_copy(full[:, lo:hi], em_st[key])
        em_st["step"] = lm_st["step"]
        self.split_embed = True

    @torch.no_grad()
    def reset(self) -> None:
        """Zero every bank's rails, lane energy and mantissa (which truncates the fp32 masters to
        their bf16 halves) and tie the embeddings again. Adam state is left alone (the seed)."""
        self.split_embed = False
        for label in self.bank_labels:
            st = self.param_states[label]
            st["velocity"].zero_()
            st["lane_energy"].zero_()
            if "mantissa" in st:
                st["mantissa"].zero_()
            else:
                self.params[label].data.view(torch.int32).bitwise_and_(-65536)  # 0xFFFF0000

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """This rank's optimizer state, keyed by label: Adam moments and step counts, bank rails,
        lane energies and mantissas, the configs (lr, momentum, ...), rails, untie state, and the
        Adam gradients kept from non-Adam steps. Sharded tensors are this rank's shards, so a
        checkpoint is loaded by the same rank of the same world size. ``copy=False`` returns the
        live tensors (cheaper; they change with the next step)."""
        c = (lambda t: t.detach().clone()) if copy else (lambda t: t)
        state = {label: {k: (c(v) if isinstance(v, Tensor) else v) for k, v in st.items()}
                 for label, st in self.param_states.items()}
        pending = {l: c(self.params[l].grad) for l in self.adam_labels if self.params[l].grad is not None}
        return dict(format=STATE_FORMAT, world_size=self.world_size, rank=self.rank, labels=list(self.labels),
                    state=state, param_cfgs={l: _plain_cfg(cfg) for l, cfg in self.param_cfgs.items()},
                    rails=(self.fast_beta, self.fast_weight), split_embed=self.split_embed, pending_grads=pending,
                    rail_step=c(self.rail_step))

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output in place (every tensor is copied into the live one:
        the replicated moments are views into flat buffers and the CUDA graphs bake the banks'
        addresses). Everything is checked before anything is written."""
        sd = state_dict
        if sd.get("format") != STATE_FORMAT:
            raise ConfigError(f"not an AnvilAndAdam state dict (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
        if (sd["world_size"], sd["rank"]) != (self.world_size, self.rank):
            raise ConfigError(f"state dict of rank {sd['rank']} of {sd['world_size']} cannot be loaded by rank "
                              f"{self.rank} of {self.world_size} (sharded state is per rank)")
        if list(sd["labels"]) != self.labels:
            raise ConfigError(f"state dict labels {sd['labels']} differ from this optimizer's {self.labels}")
        state = {}
        for label, st in sd["state"].items():
            live = self.param_states[label]
            if "mantissa" in st and "mantissa" not in live:
                # a float32 bank saved with a mantissa: it held the parameter's own low halves, which
                # the parameter (its own master now) still has
                st = {k: v for k, v in st.items() if k != "mantissa"}
            state[label] = st
            if set(st) != set(live):
                raise ConfigError(f"{label}: state keys {sorted(st)} differ from {sorted(live)}")
            for k, v in st.items():
                if k == "step":  # an int, or a 0-D tensor (the one-process step keeps it on the device)
                    continue
                if isinstance(live[k], Tensor) and (tuple(v.shape) != tuple(live[k].shape) or v.dtype != live[k].dtype):
                    raise ConfigError(f"{label}.{k}: saved {tuple(v.shape)} {v.dtype}, live "
                                      f"{tuple(live[k].shape)} {live[k].dtype}")
        for label, f in sd["param_cfgs"].items():
            cfg = self.param_cfgs[label]
            for k in ("optim", "comms", "reshape", "chunk_size"):
                saved = tuple(f[k]) if isinstance(f[k], list) else f[k]
                if saved != getattr(cfg, k):
                    raise ConfigError(f"{label}: saved {k}={f[k]!r} differs from this optimizer's {getattr(cfg, k)!r}")
        for label, g in sd["pending_grads"].items():
            if label not in self.adam_labels or tuple(g.shape) != tuple(self.params[label].shape):
                raise ConfigError(f"pending gradient {label!r}: not an Adam parameter of this shape")
        # ---- write
        for label, st in state.items():
            live = self.param_states[label]
            for k, v in st.items():
                if isinstance(live[k], Tensor):
                    live[k].copy_(torch.as_tensor(v))
                else:
                    live[k] = int(v) if k == "step" else v
        names = {f.name for f in fields(ParamConfig)}
        for label, f in sd["param_cfgs"].items():
            cfg = self.param_cfgs[label]
            for k, v in f.items():
                if k in names:
                    setattr(cfg, k, frozenset(v) if k == "frozen_matrices" else (tuple(v) if isinstance(v, list) else v))
        self.fast_beta, self.fast_weight = (float(x) for x in sd["rails"])
        if "rail_step" in sd:
            self.rail_step.copy_(torch.as_tensor(sd["rail_step"]))
        self.split_embed = bool(sd["split_embed"])
        for label in self.adam_labels:
            p = self.params[label]
            g = sd["pending_grads"].get(label)
            p.grad = None if g is None else g.detach().to(device=p.device, dtype=p.dtype).clone()


__all__ = ["AnvilAndAdam", "StepPlan", "SparseUpdate", "SPARSE_UPDATE_LABEL", "NonFiniteGradientError"]
