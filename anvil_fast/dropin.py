"""``anvil_fast.ANVIL``: ANVIL for the hidden matrices + Adam for the rest, as a ``torch.optim.Optimizer``.

Building one runs three steps, each a function of this module that can be called and read alone:

* :func:`classify`: every parameter gets a route (a matrix for ANVIL, or Adam) and the reason;
* :func:`plan_routes`: matrices of equal ``(rows, cols, dtype)`` are put into banks
  ``[n, rows, cols]``, Adam parameters are marked sharded or replicated; the result is the plan
  :meth:`ANVIL.describe` prints;
* :func:`build_banks`: each bank's storage is allocated and every member parameter becomes a view
  of it (zero-copy: the model reads the bank, and ``model.state_dict()`` still holds each parameter
  under its own name).

The class docstring states the rules, the update and the torch.optim behaviour.
"""

from __future__ import annotations

import inspect
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
from anvil_ref.update import LR_SCALE_CONVENTIONS

from .optimizer import AnvilAndAdam, NonFiniteGradientError

#: Module names (last component) whose parameters of ndim >= 2 are output heads, hence Adam.
HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")
#: The dtypes a bank holds (bf16: the seed's storage; float32: the parameter is the fp32 master).
MATRIX_DTYPES = (torch.bfloat16, torch.float32)
RAILS = ("nesterov", "record")
NONFINITE_POLICIES = ("skip", "raise")
STATE_FORMAT = "anvil_fast.ANVIL/1"
#: Components torch.compile inserts into parameter and module names.
_COMPILE_PREFIX = "_orig_mod"


class StaleParameterError(RuntimeError):
    """A parameter's storage, dtype or device changed after the optimizer was built."""


class NonFiniteGradientWarning(RuntimeWarning):
    """A step was skipped because a gradient held NaN or infinity (``nonfinite="skip"``)."""


# ====================================================================================== classify
@dataclass
class Route:
    """One parameter's route. A matrix route carries the banked view: ``count`` matrices of
    ``rows x cols`` (a 2-D weight: 1; a stack ``[E, r, c]``: E; after ``split_rows=k``: k times more)."""

    name: str
    param: Tensor
    kind: str  #: "matrix" or "adam"
    reason: str
    count: int = 0
    rows: int = 0
    cols: int = 0


def named_parameters_of(params) -> tuple[list[tuple[str, Tensor]], dict[int, list[tuple[str, nn.Module]]]]:
    """``(name, parameter)`` pairs (deduplicated by identity, trainable only, torch.compile's
    ``_orig_mod.`` components removed) and, for a module, id(parameter) -> every ``(module name,
    module)`` owning it (a tied weight has several owners)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    if isinstance(params, nn.Module):
        for mname, mod in params.named_modules(remove_duplicate=False):
            for _, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                owners[id(p)].append((_strip_compile(mname), mod))
        pairs = list(params.named_parameters())
    else:
        items = list(params)
        if any(isinstance(it, dict) for it in items):
            raise TypeError("ANVIL takes a model, its named_parameters() or parameters, not param-group dicts "
                            "(it builds its own 'anvil' and 'adam' groups)")
        pairs = [it if isinstance(it, tuple) else (f"param{i}", it) for i, it in enumerate(items)]
    seen, out = set(), []
    for name, p in pairs:
        if not isinstance(p, Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(p).__name__}")
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((_strip_compile(name), p))
    return out, dict(owners)


def _strip_compile(name: str) -> str:
    return ".".join(c for c in name.split(".") if c != _COMPILE_PREFIX)


def _rule(rule, what: str, names: Sequence[str]) -> Callable[[str], bool]:
    """A names list or a predicate, as a predicate (unknown names refused)."""
    if rule is None:
        return lambda name: False
    if callable(rule):
        return lambda name: bool(rule(name))
    if isinstance(rule, str):
        rule = [rule]
    wanted = set(rule)
    unknown = sorted(wanted - set(names))
    if unknown:
        raise ValueError(f"{what}=: unknown parameter names {unknown} (known: the names describe() prints)")
    return wanted.__contains__


def classify(named: Sequence[tuple[str, Tensor]], owners: Mapping[int, list[tuple[str, nn.Module]]], *,
             adam=None, anvil=None, head_names: Sequence[str] = HEAD_NAMES) -> list[Route]:
    """Each parameter's route, by the first rule that matches (class docstring, "Routing")."""
    names = [n for n, _ in named]
    is_adam, is_anvil = _rule(adam, "adam", names), _rule(anvil, "anvil", names)
    heads = {head_names} if isinstance(head_names, str) else set(head_names)
    routes = []
    for name, p in named:
        mods = owners.get(id(p), [])
        is_conv = any(isinstance(m, _ConvNd) and m.weight is p for _, m in mods)
        if is_anvil(name):
            if p.ndim < 2:
                raise ConfigError(f"{name}: anvil= needs a parameter with ndim >= 2, got shape {tuple(p.shape)}")
            routes.append(_matrix_route(name, p, "anvil=", flatten=is_conv or p.ndim > 3))
        elif is_adam(name):
            routes.append(Route(name, p, "adam", "adam="))
        elif p.ndim < 2:
            routes.append(Route(name, p, "adam", "scalar/vector"))
        elif any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.weight is p for _, m in mods):
            routes.append(Route(name, p, "adam", "embedding"))
        elif _is_head(name, mods, heads):
            routes.append(Route(name, p, "adam", "output head"))
        elif is_conv:
            routes.append(_matrix_route(name, p, "conv (flattened)", flatten=True))
        elif p.ndim == 2:
            routes.append(_matrix_route(name, p, "matrix", flatten=False))
        elif p.ndim == 3:
            routes.append(_matrix_route(name, p, "stack", flatten=False))
        else:
            raise ConfigError(f"{name}: no rule covers a parameter of shape {tuple(p.shape)} (matrices are 2-D, "
                              f"stacks 3-D, convolution weights any ndim); pass adam=[{name!r}] to use Adam for it, "
                              f"or anvil=[{name!r}] to bank it as [{p.shape[0]}, {math.prod(p.shape[1:])}]")
    for r in routes:
        if not r.param.dtype.is_floating_point:
            raise ConfigError(f"{r.name}: a {r.param.dtype} parameter cannot be optimized (floating point only)")
    return routes


def _is_head(name: str, mods: Sequence[tuple[str, nn.Module]], heads: set[str]) -> bool:
    """Whether an owning module's name ends in a head name (without modules: the parameter name's
    module part)."""
    module_names = [m for m, _ in mods] or [name.rsplit(".", 1)[0] if "." in name else ""]
    return any(m.rsplit(".", 1)[-1] in heads for m in module_names)


def _matrix_route(name: str, p: Tensor, reason: str, *, flatten: bool) -> Route:
    if p.dtype not in MATRIX_DTYPES:
        raise ConfigError(f"{name}: a {p.dtype} matrix cannot be banked (banks are bfloat16 or float32); convert "
                          f"the model or pass adam=[{name!r}]")
    if p.numel() == 0:
        raise ConfigError(f"{name}: an empty parameter {tuple(p.shape)} cannot be banked; pass adam=[{name!r}]")
    if flatten or p.ndim == 2:
        return Route(name, p, "matrix", reason, 1, p.shape[0], math.prod(p.shape[1:]))
    return Route(name, p, "matrix", reason, p.shape[0], p.shape[1], p.shape[2])


# ====================================================================================== plan
@dataclass(frozen=True)
class PlanEntry:
    """One parameter of the plan (``opt.plan``; ``opt.describe()`` prints them)."""

    name: str
    shape: tuple[int, ...]
    route: str  #: a bank label, or "adam"
    reason: str
    bank_shape: tuple[int, int, int] | None = None  #: the bank's [n, rows, cols] (n includes padding)
    slots: tuple[int, int] | None = None  #: the parameter's matrices [first, end) in its bank
    comms: str = "sharded"  #: Adam: "sharded" or "replicated"; banks are always sharded by matrix


@dataclass
class BankPlan:
    label: str
    rows: int
    cols: int
    dtype: torch.dtype
    members: list[tuple[str, Tensor, int, int]] = field(default_factory=list)  #: (name, param, first, count)
    n: int = 0  #: matrices of the members
    n_pad: int = 0  #: n rounded up to a multiple of the world size (frozen zero matrices)


@dataclass
class Plan:
    banks: list[BankPlan]
    adam: list[tuple[str, Tensor, str]]  #: (name, param, "sharded" | "replicated")
    entries: list[PlanEntry]


def plan_routes(routes: Sequence[Route], *, split_rows: Mapping[str, int] | None = None, world_size: int = 1,
                shard_min_numel: int = 1 << 16) -> Plan:
    """Banks for the matrix routes (equal rows, cols, dtype share one; ``split_rows`` applied) and
    sharded/replicated for the Adam routes. Nothing is allocated or re-pointed here."""
    split_rows = dict(split_rows or {})
    by_name = {r.name: r for r in routes}
    for name, k in split_rows.items():
        if name not in by_name:
            raise ValueError(f"split_rows=: unknown parameter name {name!r}")
        if by_name[name].kind != "matrix":
            raise ConfigError(f"split_rows=: {name} goes to Adam ({by_name[name].reason}); only matrices split")
        if not isinstance(k, int) or k < 1 or by_name[name].rows % k:
            raise ConfigError(f"split_rows=: {name} has {by_name[name].rows} rows per matrix, which {k!r} blocks "
                              "do not divide (expected a positive int dividing the rows)")
    banks: dict[tuple, BankPlan] = {}
    adam: list[tuple[str, Tensor, str]] = []
    placed: dict[str, tuple[BankPlan, int, int]] = {}
    for r in routes:
        if r.kind == "adam":
            p = r.param
            big = p.ndim >= 1 and p.numel() >= shard_min_numel
            sharded = big and (world_size == 1 or p.shape[0] % world_size == 0)
            adam.append((r.name, p, "sharded" if sharded else "replicated"))
            continue
        k = split_rows.get(r.name, 1)
        rows, count = r.rows // k, r.count * k
        key = (rows, r.cols, r.param.dtype)
        if key not in banks:
            banks[key] = BankPlan(f"bank_{rows}x{r.cols}_{str(r.param.dtype).split('.')[-1]}", rows, r.cols,
                                  r.param.dtype)
        b = banks[key]
        b.members.append((r.name, r.param, b.n, count))
        placed[r.name] = (b, b.n, count)
        b.n += count
    for b in banks.values():
        b.n_pad = -(-b.n // world_size) * world_size
    clash = sorted({b.label for b in banks.values()} & {n for n, _, _ in adam})
    if clash:
        raise ConfigError(f"parameter names {clash} collide with generated bank labels; rename them")
    adam_comms = {n: c for n, _, c in adam}
    entries = []
    for r in routes:
        if r.kind == "adam":
            entries.append(PlanEntry(r.name, tuple(r.param.shape), "adam", r.reason, comms=adam_comms[r.name]))
        else:
            b, first, count = placed[r.name]
            reason = r.reason + (f", split_rows={split_rows[r.name]}" if r.name in split_rows else "")
            entries.append(PlanEntry(r.name, tuple(r.param.shape), b.label, reason, (b.n_pad, b.rows, b.cols),
                                     (first, first + count)))
    return Plan(list(banks.values()), adam, entries)


# ====================================================================================== build
@dataclass
class Bank:
    """A built bank: its parameter ``[n_pad * rows, cols]`` (what AnvilAndAdam updates; the members
    are views of it). The members' gradients go into the inner optimizer's persistent gradient
    buffer of the bank (:meth:`ANVIL._grad_slots`)."""

    plan: BankPlan
    param: nn.Parameter

    @property
    def label(self) -> str:
        return self.plan.label


@torch.no_grad()
def build_banks(plan: Plan, device: torch.device) -> list[Bank]:
    """Allocate each bank, copy its members in and re-point each member's ``.data`` to its slice
    (a contiguous run of matrices, viewed in the parameter's own shape)."""
    out = []
    for b in plan.banks:
        storage = torch.zeros((b.n_pad, b.rows, b.cols), dtype=b.dtype, device=device)
        for _, p, first, count in b.members:
            storage[first:first + count].view(p.shape).copy_(p.data)
        for _, p, first, count in b.members:
            p.data = storage[first:first + count].view(p.shape)
        bank = nn.Parameter(storage.view(b.n_pad * b.rows, b.cols), requires_grad=True)
        bank.label = b.label
        out.append(Bank(b, bank))
    return out


def _check_hyperparameters(kind: str, g: Mapping[str, Any]) -> None:
    """torch's optimizers' rules: ValueError naming the value."""
    def real(key):
        v = g[key]
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


class _StateView(Mapping):
    """``opt.state[p]``: live views of the optimizer's state for one parameter."""

    def __init__(self, read: Callable[[], dict[str, Any]]):
        self._read = read

    def __getitem__(self, key):
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return f"StateView({ {k: (tuple(v.shape) if isinstance(v, Tensor) else v) for k, v in self._read().items()} })"


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
            "(ddp_model.module) and drop DDP, or pass comms=anvil_fast.comms.LocalComms() to let every rank run "
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


#: The class ``ANVIL(model)`` builds for a model with DTensor (FSDP2) parameters; registered by
#: :mod:`anvil_fast.fsdp` when it is imported (``anvil_fast.ANVIL`` imports it), so this module does
#: not depend on it.
_DTENSOR_PATH: list[type] = []


def register_dtensor_path(cls: type) -> None:
    """Make ``ANVIL(params)`` build ``cls`` when ``params`` holds DTensors (:mod:`anvil_fast.fsdp`)."""
    _DTENSOR_PATH[:] = [cls]


def default_grad_read(device: torch.device, bank_config: Any, dtypes=()) -> str:
    """How a one-process step reads the gradients by default: in place where the bank update's
    rails are the Triton kernel (SAFE and GRAM_SIDE on CUDA) and every parameter is float32 or
    bfloat16 (the in-place kernels' dtypes), else through the banks' buffers."""
    from ._triton import triton_available
    from .cascade import DEFAULT_CONFIG, get_config

    cfg = DEFAULT_CONFIG if bank_config is None else get_config(bank_config)
    ok = all(d in (torch.float32, torch.bfloat16) for d in dtypes)
    return "in_place" if device.type == "cuda" and triton_available() and cfg.triton_elementwise and ok \
        else "buffers"


class ANVIL(torch.optim.Optimizer):
    """ANVIL for the hidden matrices + Adam for everything else, for any model.

    Example (a complete training loop)::

        import torch, anvil_fast
        model = anvil_fast.gpt.build("tiny")                 # any nn.Module
        opt = anvil_fast.ANVIL(model, lr=0.02, adam_lr=0.008)
        print(opt.describe())                                 # the plan: each parameter's route, and why
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 1000)
        for step in range(1000):
            x = torch.randint(0, 256, (8, 65))
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    **Routing** (the first matching rule wins; never by a coincidence of sizes):

    1. ``anvil=`` (names, or a predicate on names) -> a matrix (refused for ndim < 2; ndim >= 4
       is flattened as a convolution weight is).
    2. ``adam=`` (names or predicate) -> Adam.
    3. ndim < 2 (scalars, norms, biases) -> Adam.
    4. the weight of an ``nn.Embedding``/``nn.EmbeddingBag``, by identity (so an output head tied to
       an embedding is caught here too) -> Adam.
    5. a parameter (ndim >= 2) of a module whose name's last component is in ``head_names``
       (default ``HEAD_NAMES``: lm_head, head, classifier, fc_out, output_layer) -> Adam.
    6. a convolution weight (any ``_ConvNd``) ``[d0, d1, d2, ...]`` -> the matrix ``[d0, d1*d2*...]``.
    7. ndim == 2 -> the matrix ``[d0, d1]``.
    8. ndim == 3 -> a stack: each ``[i]`` is a matrix ``[d1, d2]`` (e.g. per-expert weights).
    9. anything else -> ConfigError naming the parameter (pass ``adam=[name]`` or ``anvil=[name]``).

    Parameters with ``requires_grad=False`` at construction are left out (frozen layers).
    Only what the module tells is used: given ``named_parameters()`` or plain parameters (named
    ``param0, param1, ...``) rules 4 and 6 cannot apply and rule 5 reads the parameter's name.
    An ``nn.Sequential``'s last ``nn.Linear`` is named by its index, so it is a matrix by rule 7:
    check ``describe()`` and pass ``adam=["N.weight"]`` for an output layer.
    A matrix needs dtype float32 or bfloat16. ``split_rows={name: k}`` splits that parameter's
    matrices into k equal row blocks, each its own matrix (e.g. a fused qkv projection ``[3d, d]``
    with k=3, or per-head splitting). Matrices of equal ``(rows, cols, dtype)`` share one bank
    ``[n, rows, cols]``; each member parameter is a view of its bank. Under torch.distributed a
    bank is padded with frozen zero matrices to a multiple of the world size and sharded by
    matrix; Adam parameters with ``numel >= shard_min_numel`` (and a first dimension the world size
    divides) are sharded, the others replicated. A model with parameters of ndim >= 2 but no bank
    gets a UserWarning. bf16 matrices keep the seed's exact fp32 master (bf16 parameter + uint16
    mantissa); float32 matrices are their own master.

    **The update.** For a matrix ``P`` of ``rows x cols`` (as banked) with gradient ``G``, the
    rails and lane-energy equalizer of :mod:`anvil_ref` give the update ``U`` and the slow rail
    ``S``; then (:func:`anvil_ref.update.sign_aligned_update`)::

        eff_lr = lr * scale(rows, cols)
        eff_wd = weight_decay * lr
        P'     = P - P * [S * P >= 0] * eff_wd * eff_lr - U * eff_lr

    with ``lr_scale`` choosing ``scale`` (:func:`anvil_ref.update.shape_lr_multiplier`)::

        "seed" (default):  scale = max(1, rows / cols) ** 0.5      (the record's)
        "match_rms_adamw": scale = 0.2 * max(rows, cols) ** 0.5    (torch.optim.Muon's rule, so an
                                                                     AdamW learning rate transfers)

    Adam is :mod:`anvil_ref.adam`'s (the seed's) with ``adam_betas``, ``adam_eps``,
    ``adam_weight_decay`` and ``lr = adam_lr``.

    **Rails.** ``rails="nesterov"`` (default): every step uses the anvil group's ``momentum``,
    ``fast_beta`` (None: = momentum) and ``fast_weight`` (1.0: plain Nesterov momentum). It is the
    default because the record's schedule is tied to a run length and to an engage step tuned for the
    record's run. ``rails="record"`` (needs ``total_steps``, an int >= 1): before the t-th taken step
    (t = 0, 1, ...; skipped steps do not count) the anvil group's momentum, fast_beta and fast_weight
    are set to :func:`anvil_ref.rails.rail_scalars` ``(t, total_steps)`` (visible in
    ``param_groups``); a step after ``total_steps`` taken steps raises ValueError.

    **param_groups**: ``[anvil, adam]`` (a group without parameters is left out): anvil has
    ``kind="anvil", lr, momentum, fast_beta, fast_weight, beta2, weight_decay``; adam has
    ``kind="adam", lr, betas, eps, weight_decay``. Every value may change between steps (LR
    schedulers, you) and takes effect at the next step; values are validated at construction and
    at every step as torch's optimizers do (ValueError naming the value). ``defaults`` holds lr and
    momentum, so momentum-cycling schedulers (OneCycleLR, CyclicLR) work: they cycle the anvil
    group's momentum, and a ``momentum`` they write into the adam group is Adam's beta1. Groups are
    planned once: ``add_param_group`` raises.

    **step(closure=None)** returns the closure's loss. Per step:

    * a parameter whose ``.grad`` is None is not touched (its weights and all its state, also inside
      a bank whose other members have gradients; Adam's step count does not advance for it);
    * non-finite gradients never reach the state: with ``nonfinite="skip"`` (default) a step whose
      gradients hold NaN/inf (on any rank) is skipped for every parameter (nothing written, no step
      counted), a :class:`NonFiniteGradientWarning` names the parameters and ``skipped_steps``
      counts; ``nonfinite="raise"`` raises :class:`NonFiniteGradientError` instead. The check reads
      the gradients as the step reads them (a bank's in bf16, so an fp32 gradient beyond bf16's
      range counts as infinite). On one process the verdict is the device's
      (:mod:`anvil_fast.device_step`): the step never waits for the device; every kernel that
      writes state is masked by it, so a refused step leaves every weight and state tensor bit for
      bit as it was. On CUDA the warning therefore comes at a later step, or when ``skipped_steps``
      (or ``taken_steps``) is read, which waits for the device; ``nonfinite="raise"`` waits after
      every step (one host sync per step) and raises there. On the CPU, and on several ranks (one
      host sync), it comes from the step itself;
    * a matrix whose update comes out non-finite (FAITHFUL: the seed's cascade can overflow on
      rank-1-like input; SAFE's guard also refuses an exploded one) is not applied: that matrix
      only takes its sign-aligned decay, and a :class:`anvil_fast.device_step.NonFiniteUpdateWarning`
      names the bank and the configuration (``nonfinite="raise"``:
      :class:`~anvil_fast.device_step.NonFiniteUpdateError`); no NaN or inf reaches a weight or
      the lane energies;
    * a step in which no parameter has a ``.grad`` does nothing and counts nothing;
    * a parameter whose storage, dtype or device changed since construction (``model.to(dtype)``,
      ``model.double()``, ``p.data = ...``) raises :class:`StaleParameterError`: build a new optimizer;
    * ``.grad`` is left as the caller gave it.

    Several ranks: initialize the process group first, start every rank from the same weights, do
    not wrap the model in DDP (the optimizer averages gradients itself; refused), and let the ranks
    agree on which parameters have gradients. A model sharded with FSDP2 (``fully_shard``: DTensor
    parameters) is taken as it is and gets :class:`anvil_fast.fsdp.FSDPAnvil` (owner ranks update
    whole matrices; see that module).

    **torch.optim behaviour.** ``zero_grad``, LR schedulers, ``torch.amp.GradScaler``
    (``scaler.step(opt)``) and ``torch.compile(model)`` (before or after building; the
    ``_orig_mod.`` prefix is dropped from names) work. ``opt.state[p]`` is a live view of p's state:
    matrices ``fast_rail, slow_rail, lane_energy, mantissa`` in the banked shape (``[count, rows,
    cols]``, or ``[rows, cols]`` for one matrix; on several ranks only this rank's matrices), Adam
    ``step, exp_avg, exp_avg_sq`` (this rank's shard when sharded). ``state_dict()`` holds only
    tensors and plain containers (``torch.load(f)`` with ``weights_only=True`` loads it);
    ``load_state_dict`` restores it bit for bit.

    Args:
        params: an ``nn.Module`` (preferred: module types and names are known), its
            ``named_parameters()``, or plain parameters. Param-group dicts are refused.
        lr, adam_lr: ANVIL's and Adam's learning rates (0.023, 0.008: the record's).
        momentum, fast_beta, fast_weight: the rails (above).
        beta2: the lane-energy equalizer's decay (0.9).
        weight_decay: ANVIL's sign-aligned decay (2.25; scaled by lr twice, above).
        adam_betas, adam_eps, adam_weight_decay: Adam's ((0.9, 0.95), 1e-10, 0.005).
        rails, total_steps: "nesterov" or "record" (above).
        lr_scale: "seed" or "match_rms_adamw" (above).
        adam, anvil: names (or a predicate on names) forced onto Adam / onto the matrix route.
        head_names: module names whose parameters of ndim >= 2 are output heads.
        split_rows: ``{name: k}`` (above).
        nonfinite: "skip" or "raise" (above).
        shard_min_numel: Adam parameters at least this large are sharded (the others share flat
            buffers and one fused launch; reading gradients in place, one launch serves every Adam
            parameter where it lives, so none is put on the flat buffers).
        comms: a :class:`~anvil_fast.comms.Comms`, a process group, or None (the default group if
            torch.distributed is initialized, else one process).
        bank_config, maps: the bank update's cascade configuration and map set.
        cuda_graphs: None (default): on CUDA, replay each step's device part (the check, the
            scalars, every bank update, Adam) as one CUDA graph where capture is valid (off with a
            warning giving the reason where it is not, e.g. gloo; off on the CPU); True: capture or
            raise; False: off.
        compile: run the bank update's element-wise phases through torch.compile (None: on CUDA).
        rails_dtype: ``torch.float32`` (default: the seed's rails) or ``torch.bfloat16``, the lean
            state: both rails stored in bf16 (2 x 2 B per banked weight instead of 2 x 4 B), each
            update computed in fp32 and rounded stochastically
            (:func:`anvil_ref.storage.stochastic_round_bf16`: unbiased, and the same bits on every
            device and sharding).
        grad_read: how a one-process step reads the gradients: ``"in_place"`` (the kernels read
            each ``.grad`` where autograd wrote it, through device tables of addresses: no copy and
            no gradient buffer; SAFE and GRAM_SIDE on CUDA, the default there) or ``"buffers"``
            (every ``.grad`` copied into the banks' bf16 buffers first: FAITHFUL's compiled rails
            read those; the default on the CPU); None picks. In place, a gradient must be
            contiguous (autograd's always are; an assigned strided one is refused). On several
            ranks the gradients are reduced into the buffers.
    """

    def __new__(cls, params=None, *args, **kwargs):
        # a model sharded with FSDP2 (DTensor parameters) takes anvil_fast.fsdp's owner-rank path
        if cls is ANVIL and params is not None and holds_dtensors(params):
            if not _DTENSOR_PATH:
                raise ConfigError("the parameters are DTensors (FSDP2): use anvil_fast.ANVIL, or import "
                                  "anvil_fast.fsdp first, which registers ANVIL's FSDP2 path")
            return super().__new__(_DTENSOR_PATH[0])
        return super().__new__(cls)

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
                 compile: bool | None = None, rails_dtype: torch.dtype = torch.float32, grad_read: str | None = None):
        anvil_group = dict(kind="anvil", lr=lr, momentum=momentum, fast_beta=fast_beta, fast_weight=fast_weight,
                           beta2=beta2, weight_decay=weight_decay)
        adam_group = dict(kind="adam", lr=adam_lr, betas=tuple(float(b) for b in adam_betas), eps=adam_eps,
                          weight_decay=adam_weight_decay)
        _check_hyperparameters("anvil", anvil_group)
        _check_hyperparameters("adam", adam_group)
        if rails not in RAILS:
            raise ValueError(f"rails must be one of {RAILS}, got {rails!r}")
        if rails == "record" and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                  or total_steps < 1):
            raise ValueError(f"rails='record' needs total_steps, an int >= 1 (the run's length), got {total_steps!r}")
        if lr_scale not in LR_SCALE_CONVENTIONS:
            raise ValueError(f"lr_scale must be one of {LR_SCALE_CONVENTIONS}, got {lr_scale!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if rails_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rails_dtype must be torch.float32 (default) or torch.bfloat16 (the lean state), got "
                             f"{rails_dtype!r}")
        from .device_step import GRAD_READS

        if grad_read is not None and grad_read not in GRAD_READS:
            raise ValueError(f"grad_read must be None or one of {GRAD_READS}, got {grad_read!r}")

        named, owners = named_parameters_of(params)
        if not named:
            raise ValueError("ANVIL got no parameters that require gradients")
        refuse_dtensors_in(named)
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        routes = classify(named, owners, adam=adam, anvil=anvil, head_names=head_names)

        from .comms import resolve_comms

        self.comms = resolve_comms(comms)
        refuse_ddp_with_own_averaging(params, self.comms.world_size)
        engine = self.comms.world_size == 1
        if engine and grad_read is None:
            grad_read = default_grad_read(device, bank_config, {p.dtype for _, p in named})
        elif not engine and grad_read == "in_place":
            raise ValueError("grad_read='in_place' is the one-process step's; on several ranks every gradient is "
                             "reduced into the banks' buffers")
        self.grad_read = grad_read if engine else "buffers"
        # Reading in place, Adam updates every parameter where it lives in one launch: the flat
        # buffers of small "replicated" parameters (a gradient copy and a row index per element)
        # would only cost memory, so every Adam parameter keeps its own state.
        plan = plan_routes(routes, split_rows=split_rows, world_size=self.comms.world_size,
                           shard_min_numel=0 if self.grad_read == "in_place" else shard_min_numel)
        self._banks = build_banks(plan, device)
        self._adam_named = [(n, p) for n, p, _ in plan.adam]
        self.inner = self._build_inner(plan, anvil_group, adam_group, lr_scale=lr_scale, bank_config=bank_config,
                                       maps=maps, compile=compile, rails_dtype=rails_dtype,
                                       grad_in_place=self.grad_read == "in_place")
        self.plan: list[PlanEntry] = plan.entries
        self.rails, self.total_steps, self.nonfinite = rails, total_steps, nonfinite
        self._slots = None
        self._engine = None  #: the one-process, device-decided step (anvil_fast.device_step)
        self._taken = 0
        self._skipped = 0
        self._hyper_key = None

        groups = []
        bank_params = [p for b in self._banks for _, p, _, _ in b.plan.members]
        if bank_params:
            groups.append(dict(params=bank_params, **anvil_group))
        if self._adam_named:
            groups.append(dict(params=[p for _, p in self._adam_named], **adam_group))
        self._planned = False
        super().__init__(groups, dict(lr=lr))
        # set after the groups exist: torch would otherwise copy momentum into the adam group
        self.defaults["momentum"] = momentum
        self._planned = True
        self._make_state_views()
        self._record_storage()
        if not self._banks and any(p.ndim >= 2 for _, p in named):
            warnings.warn("ANVIL: no parameter was banked, so every parameter trains with Adam and lr= changes "
                          "nothing; see opt.describe() for each parameter's route and pass anvil=[names] to bank "
                          "matrices", UserWarning, stacklevel=2)
        if engine:
            self._build_engine(cuda_graphs, device)
        else:
            self._use_cuda_graphs(cuda_graphs, device)

    # ------------------------------------------------------------------ construction helpers
    def _build_inner(self, plan: Plan, anvil_group: dict, adam_group: dict, *, lr_scale: str, bank_config,
                     maps, compile, rails_dtype=torch.float32, grad_in_place: bool = False) -> AnvilAndAdam:
        table: dict[str, dict] = {}
        for b in plan.banks:
            table[b.label] = {"optim": "anvil", "comms": "sharded", "reshape": (b.n_pad, b.rows, b.cols),
                              "frozen_matrices": tuple(range(b.n, b.n_pad)), "lr_scale": lr_scale}
        for name, p, comms in plan.adam:
            p.label = name
            table[name] = {"optim": "adam", "comms": comms, "adam_betas": list(adam_group["betas"])}
        size = {b.label: b.n_pad * b.rows * b.cols for b in plan.banks}
        order = sorted(size, key=lambda l: -size[l]) + \
            [n for n, _, c in plan.adam if c == "sharded"] + [n for n, _, c in plan.adam if c == "replicated"]
        bank_update = None
        if compile is not None and plan.banks:
            import functools

            from .bank import anvil_bank_update

            bank_update = functools.partial(anvil_bank_update, compile=compile)
        named = [(b.label, b.param) for b in self._banks] + [(n, p) for n, p, _ in plan.adam]
        anvil_defaults = {k: anvil_group[k] for k in ("lr", "momentum", "beta2", "weight_decay")}
        adam_defaults = {k: adam_group[k] for k in ("lr", "eps", "weight_decay")}
        return AnvilAndAdam(named, table, order, order, adam_defaults, anvil_defaults, bank_update,
                            comms=self.comms, check_finite=False, tie_embeddings=False, allow_fp32_banks=True,
                            bank_config=bank_config, maps=maps, rails_dtype=rails_dtype, grad_in_place=grad_in_place)

    def _local_slots(self, bank: Bank, first: int, count: int) -> slice:
        """A member's matrices within this rank's chunk of the bank's state."""
        chunk = self.inner.param_cfgs[bank.label].chunk_size
        lo = self.comms.rank * chunk
        a, b = max(first, lo), min(first + count, lo + chunk)
        return slice(a - lo, max(a, b) - lo)

    def _make_state_views(self) -> None:
        self.state = defaultdict(dict)
        for bank in self._banks:
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
        for name, p in self._adam_named:
            st = self.inner.param_states[name]
            self.state[p] = _StateView(lambda st=st, name=name: dict(step=self._adam_step(name), exp_avg=st["exp_avg"],
                                                                     exp_avg_sq=st["exp_avg_sq"]))

    def _adam_step(self, name: str):
        """An Adam parameter's step count (in the one-process step, a 0-D view of the device's)."""
        return self.inner.param_states[name]["step"]

    def _record_storage(self) -> None:
        self._storage = [(n, p, p.data_ptr(), p.dtype, p.device) for b in self._banks for n, p, _, _ in b.plan.members]
        self._storage += [(n, p, p.data_ptr(), p.dtype, p.device) for n, p in self._adam_named]
        self._storage_params = [p for _, p, _, _, _ in self._storage]
        self._storage_ptrs = [ptr for _, _, ptr, _, _ in self._storage]

    def _build_engine(self, flag: bool | None, device: torch.device) -> None:
        """The one-process step (:class:`~anvil_fast.device_step.DeviceStep`): graphs where capture is
        valid (``cuda_graphs`` as in the class docstring)."""
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
        self._engine = DeviceStep(self, grad_read=self.grad_read, cuda_graphs=graphs, record=record)

    def _use_cuda_graphs(self, flag: bool | None, device: torch.device) -> None:
        """Replay each step's device part as one CUDA graph (:class:`~anvil_fast.graphs.StepGraph`,
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_planned", True):
            raise ValueError("ANVIL plans its parameter groups once, at construction (banks are views of the "
                             "parameters); build a new ANVIL over every parameter instead of add_param_group")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ counters
    @property
    def taken_steps(self) -> int:
        """Steps taken (the record rails' t). On CUDA reading it waits for the device."""
        eng = getattr(self, "_engine", None)
        return eng.counts()[0] if eng is not None else getattr(self, "_taken", 0)

    @taken_steps.setter
    def taken_steps(self, v: int) -> None:
        eng = getattr(self, "_engine", None)
        if eng is not None:
            eng.set_counts(int(v), eng.counts()[1])
        else:
            self._taken = int(v)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients. On CUDA reading it waits for the device and
        reports (warns about) the skips not reported yet."""
        eng = getattr(self, "_engine", None)
        if eng is None:
            return getattr(self, "_skipped", 0)
        self._report(wait=True, stacklevel=3)
        return eng.counts()[1]

    @skipped_steps.setter
    def skipped_steps(self, v: int) -> None:
        eng = getattr(self, "_engine", None)
        if eng is not None:
            eng.set_counts(eng.counts()[0], int(v))
        else:
            self._skipped = int(v)

    # ------------------------------------------------------------------ introspection
    @property
    def banks(self) -> dict[str, list[str]]:
        """Bank label -> the names of its member parameters, in bank order."""
        return {b.label: [n for n, _, _, _ in b.plan.members] for b in self._banks}

    @property
    def adam_names(self) -> dict[str, str]:
        """Adam parameter name -> "sharded" or "replicated"."""
        return {n: self.inner.param_cfgs[n].comms for n, _ in self._adam_named}

    def describe(self) -> str:
        """The plan as text: one line per parameter (name, shape, route, reason)."""
        rows = [("parameter", "shape", "route", "reason")]
        for e in self.plan:
            if e.route == "adam":
                route = f"adam ({e.comms})"
            else:
                first, end = e.slots
                where = f"matrix {first}" if end - first == 1 else f"matrices {first}-{end - 1}"
                route = f"{e.route} [{', '.join(map(str, e.bank_shape))}] {where}"
            rows.append((e.name, str(list(e.shape)), route, e.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        n_bank = sum(e.route != "adam" for e in self.plan)
        lines.append(f"{len(self._banks)} bank(s) holding {n_bank} parameter(s); "
                     f"{len(self.plan) - n_bank} parameter(s) on Adam; world size {self.comms.world_size}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One ANVIL + Adam step from the parameters' ``.grad`` (class docstring); returns the
        closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_storage()
        if self._engine is not None:
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
        schedule's end) and the device part (:class:`~anvil_fast.device_step.DeviceStep`)."""
        eng = self._engine
        if eng.cuda:
            self._report(wait=False, stacklevel=4)  # what earlier steps refused, if the device is done
        if self.rails == "record" and self._host_taken() >= self.total_steps:
            self._report(wait=True, stacklevel=4)
            if eng.counts()[0] >= self.total_steps:
                raise ValueError(f"rails='record': the schedule covers total_steps={self.total_steps} steps and all "
                                 f"were taken; build the optimizer with a larger total_steps")
        key = tuple(v for g in self.param_groups for k, v in g.items() if k != "params")
        if self.rails == "record" or key != self._hyper_key:
            self._apply_hyperparameters()
            eng.set_hyper(self._hyper_values())
            self._hyper_key = tuple(v for g in self.param_groups for k, v in g.items() if k != "params")
        if not eng.step():
            return  # no parameter has a gradient: nothing ran, nothing counted
        if self.nonfinite == "raise" or not eng.cuda:
            self._report(wait=True, stacklevel=4)

    def _host_taken(self) -> int:
        """The host's count of taken steps without waiting: exact once every step was reported
        (always on the CPU); on CUDA a skip not reported yet counts as taken here."""
        eng = self._engine
        return int(eng.seen[0]) + (eng.attempted - int(eng.seen[0] + eng.seen[1]))

    def _hyper_values(self) -> list[float]:
        """The inbox's hyper-parameters (:data:`anvil_fast.device_step.HYPER`): what
        :meth:`_apply_hyperparameters` handed the inner optimizer (one rule for both steps)."""
        inner, vals = self.inner, [0.0] * 10
        if self._banks:
            cfg = inner.param_cfgs[self._banks[0].label]
            vals[0:5] = [cfg.lr, cfg.momentum, inner.fast_beta, inner.fast_weight, cfg.weight_decay]
        if self._adam_named:
            cfg = inner.param_cfgs[self._adam_named[0][0]]
            vals[5:10] = [cfg.lr, cfg.adam_betas[0], cfg.adam_betas[1], cfg.eps, cfg.weight_decay]
        return vals

    def _report(self, *, wait: bool, stacklevel: int) -> None:
        """Warn about (or, ``nonfinite="raise"``, raise for) what the device refused in steps not
        reported yet: skipped steps (non-finite gradients) and refused matrix updates."""
        eng = self._engine
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
        # gives the parameter new memory, so the addresses alone are compared on every step
        if [p.data_ptr() for p in self._storage_params] == self._storage_ptrs:
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

    def _grad_slots(self) -> list[tuple[str, Tensor, Tensor, str, Bank | None, int]]:
        """Per parameter: (name, parameter, its slot in the inner optimizer's persistent gradient
        buffer shaped like the parameter, inner label, bank or None, member index); built once,
        since the buffers live as long as the optimizer."""
        if self._slots is None:
            bufs = self.inner.grad_buffers()
            slots = []
            for b in self._banks:
                whole = bufs[b.label].view(b.plan.n_pad, b.plan.rows, b.plan.cols)
                slots += [(name, p, whole[first:first + count].view(p.shape), b.label, b, i)
                          for i, (name, p, first, count) in enumerate(b.plan.members)]
            slots += [(n, p, bufs[n], n, None, 0) for n, p in self._adam_named]
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
        for name, p, dst, label, bank, i in self._grad_slots():
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

    def _nonfinite_names(self) -> list[str]:
        """The parameters whose gradient slot holds NaN/inf on any rank (the rare path: one flag each)."""
        slots = self._grad_slots()
        flags = torch.stack([(~torch.isfinite(dst)).any() if p.grad is not None and dst.numel()
                             else torch.zeros((), dtype=torch.bool, device=self.inner.device)
                             for _, p, dst, *_ in slots]).float()
        if self.comms.world_size > 1:
            self.comms.all_reduce_sum_now(flags)
        return [slots[i][0] for i in flags.nonzero().flatten().tolist()]

    def _apply_hyperparameters(self) -> None:
        """Validate the groups, set the record's rails if asked, and hand the values to the inner
        optimizer (checked before anything is written)."""
        for g in self.param_groups:
            if g["kind"] == "anvil" and self.rails == "record":
                t = self._host_taken() if self._engine is not None else self._taken
                if t >= self.total_steps:
                    raise ValueError(f"rails='record': the schedule covers total_steps={self.total_steps} steps and "
                                     f"all were taken; build the optimizer with a larger total_steps")
                s = rail_scalars(t, self.total_steps)
                g.update(momentum=s.momentum, fast_beta=s.fast_beta, fast_weight=s.fast_weight)
            if g["kind"] == "adam" and "momentum" in g:  # a momentum-cycling scheduler's beta1
                g["betas"] = (float(g["momentum"]), float(g["betas"][1]))
            _check_hyperparameters(g["kind"], g)
        for g in self.param_groups:
            if g["kind"] == "anvil":
                fast_beta = g["momentum"] if g["fast_beta"] is None else g["fast_beta"]
                for b in self._banks:
                    cfg = self.inner.param_cfgs[b.label]
                    cfg.lr, cfg.momentum = float(g["lr"]), float(g["momentum"])
                    # beta2 is a Python float baked into the bank update: a step graph captured
                    # with another value is not replayed (StepGraph keys its captures by it)
                    cfg.weight_decay, cfg.beta2 = float(g["weight_decay"]), float(g["beta2"])
                    self.inner.banks[b.label].beta2 = cfg.beta2
                self.inner.set_rails(float(fast_beta), float(g["fast_weight"]))
            else:
                for name, _ in self._adam_named:
                    cfg = self.inner.param_cfgs[name]
                    cfg.lr, cfg.adam_betas = float(g["lr"]), tuple(float(b) for b in g["betas"])
                    cfg.eps, cfg.weight_decay = float(g["eps"]), float(g["weight_decay"])

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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and plain containers only) and the groups' hyper-parameters."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        inner = self.inner.state_dict()
        inner["pending_grads"] = {}  # Adam runs every step here: .grad belongs to the caller
        return {"format": STATE_FORMAT, "anvil": inner, "param_groups": groups, "taken_steps": self.taken_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output in place, bit for bit (checked before written)."""
        groups = state_dict.get("param_groups")
        if state_dict.get("format") != STATE_FORMAT or groups is None or len(groups) != len(self.param_groups):
            raise ValueError(f"not an anvil_fast.ANVIL state dict of this plan (format {state_dict.get('format')!r}, "
                             f"expected {STATE_FORMAT!r} with {len(self.param_groups)} param groups)")
        for g, saved in zip(self.param_groups, groups):
            if g["kind"] != saved.get("kind"):
                raise ValueError(f"param group kinds differ: {g['kind']} vs {saved.get('kind')}")
        kept = {n: p.grad for n, p in self._adam_named}
        try:
            self.inner.load_state_dict(state_dict["anvil"])
        finally:
            for n, p in self._adam_named:  # .grad belongs to the caller, not to the checkpoint
                p.grad = kept[n]
        for g, saved in zip(self.param_groups, groups):
            g.update(saved)
        if self._engine is not None:
            self._engine.set_counts(int(state_dict["taken_steps"]), int(state_dict["skipped_steps"]))
            self._hyper_key = None
        else:
            self._taken = int(state_dict["taken_steps"])
            self._skipped = int(state_dict["skipped_steps"])


# ANVIL defines __new__ (the FSDP2 dispatch), which inspect.signature(ANVIL) would report instead
# of the constructor's arguments
ANVIL.__signature__ = inspect.Signature(list(inspect.signature(ANVIL.__init__).parameters.values())[1:])


__all__ = ["ANVIL", "HEAD_NAMES", "StaleParameterError", "NonFiniteGradientWarning", "NonFiniteGradientError",
           "PlanEntry", "classify", "plan_routes", "build_banks", "named_parameters_of"]
