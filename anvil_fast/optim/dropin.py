"""The drop-in :class:`DropInAnvil`: ANVIL for the hidden matrices + Adam for the rest, as a ``torch.optim.Optimizer``
(what ``anvil_fast.ANVIL`` builds for a model of plain tensors).

Building one runs three steps, each a function of this module that can be called and read alone:

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

from .frontend import (AnvilFrontend, NonFiniteGradientWarning, check_hyperparameters, check_options,
                       hyperparameter_groups)
from .optimizer import AnvilAndAdam, NonFiniteGradientError

#: Module names (last component) whose parameters of ndim >= 2 are output heads, hence Adam.
HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")
#: The dtypes a bank holds (bf16: the seed's storage; float32: the parameter is the fp32 master).
MATRIX_DTYPES = (torch.bfloat16, torch.float32)
STATE_FORMAT = "anvil_fast.ANVIL/2"
#: The format of the state dicts keyed by bank label (still loaded: :meth:`DropInAnvil.load_state_dict`).
LEGACY_STATE_FORMAT = "anvil_fast.ANVIL/1"
#: The key of the first saved param group that holds the optimizer-wide values (a state dict's
#: top-level keys beyond "state" and "param_groups" do not survive torch.distributed.checkpoint).
EXTRAS_KEY = "anvil_fast"
#: Components torch.compile inserts into parameter and module names.
_COMPILE_PREFIX = "_orig_mod"


class StaleParameterError(RuntimeError):
    """A parameter's storage, dtype or device changed after the optimizer was built."""


# ====================================================================================== classify
@dataclass
class Route:
    """One parameter's route. A matrix route carries the banked view: ``count`` matrices of
    ``rows x cols`` (a 2-D weight: 1; a stack ``[E, r, c]``: E; after ``split_rows=k``: k times more),
    stored transposed (``transposed``: the layer reads them as ``[in, out]``, :mod:`anvil_ref.config`)."""

    name: str
    param: Tensor
    kind: str  #: "matrix" or "adam"
    reason: str
    count: int = 0
    rows: int = 0
    cols: int = 0
    transposed: bool = False


#: ``io_layers=``: where the observed input and output layers go; ``frozen=``: what becomes of
#: parameters frozen at construction.
IO_LAYERS = ("adam", "anvil")
FROZEN = ("leave", "include")


def _pairs_of(params) -> tuple[list[tuple[str, Tensor]], bool]:
    """torch's reading of ``params``: (name, tensor) pairs and whether names were given."""
    if isinstance(params, Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        + torch.typename(params))
    items = list(params)
    if any(isinstance(it, dict) for it in items):
        raise TypeError("ANVIL takes a model, its named_parameters() or parameters, not param-group dicts "
                        "(it builds its own 'anvil' and 'adam' groups)")
    named = [isinstance(it, tuple) for it in items]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    for it in items:
        if isinstance(it, tuple) and (len(it) != 2 or not isinstance(it[0], str)):
            raise TypeError(f"a named parameter must be a (name, tensor) pair, got {it!r:.80}")
    pairs = [it if isinstance(it, tuple) else (f"param{i}", it) for i, it in enumerate(items)]
    for name, p in pairs:
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)} "
                            f"({name})")
    if len({id(p) for _, p in pairs}) != len(pairs):
        warnings.warn("optimizer contains a parameter group with duplicate parameters; in future, this will cause "
                      "an error (ANVIL keeps the first of each)", UserWarning, stacklevel=4)
    return pairs, all(named) and bool(items)


def _owning_modules(params: Sequence[Tensor]) -> tuple[nn.Module | None, dict[int, list[tuple[str, nn.Module]]]]:
    """For parameters given without their model: the modules holding them (one scan of the live
    ``nn.Module`` objects) and the smallest module holding all of them (the model; None if there is
    none). Owner names are relative to that model."""
    import gc

    wanted = {id(p) for p in params}
    if not wanted:
        return None, {}
    with warnings.catch_warnings():  # some live objects warn when their type is asked for
        warnings.simplefilter("ignore")
        modules = [m for m in gc.get_objects() if _is_module(m)]
    holders = [m for m in modules if any(id(p) in wanted for p in m._parameters.values() if p is not None)]
    if not holders:
        return None, {}
    roots = [m for m in modules if type(m).__name__ != "OptimizedModule"]
    model, size = None, None
    for m in roots:
        ids = {id(p) for p in m.parameters()}
        if wanted <= ids and (size is None or len(ids) < size):
            model, size = m, len(ids)
    owners: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    if model is not None:
        for mname, mod in model.named_modules(remove_duplicate=False):
            for _, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                if id(p) in wanted:
                    owners[id(p)].append((_strip_compile(mname), mod))
    else:
        for mod in holders:
            for p in mod._parameters.values():
                if p is not None and id(p) in wanted:
                    owners[id(p)].append(("", mod))
    return model, dict(owners)


def _is_module(obj) -> bool:
    try:
        return isinstance(obj, nn.Module)
    except ReferenceError:  # a weak proxy whose object is gone
        return False


def named_parameters_of(params, *, frozen: str = "leave") -> tuple[list[tuple[str, Tensor]],
                                                                    dict[int, list[tuple[str, nn.Module]]]]:
    """``(name, parameter)`` pairs (deduplicated by identity, torch.compile's ``_orig_mod.``
    components removed; with ``frozen="leave"`` only those requiring gradients) and id(parameter) ->
    every ``(module name, module)`` owning it (a tied weight has several owners). Parameters given
    without their model get their owners from :func:`_owning_modules`."""
    return _collect(params, frozen=frozen)[:2]


def _collect(params, *, frozen: str = "leave"):
    """:func:`named_parameters_of` plus the model (None when there is none), whether names were
    known, and the parameters left out because they were frozen."""
    if isinstance(params, nn.Module):
        model = params
        owners: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
        for mname, mod in params.named_modules(remove_duplicate=False):
            for _, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                owners[id(p)].append((_strip_compile(mname), mod))
        pairs, named_given = list(params.named_parameters()), True
        owners = dict(owners)
    else:
        pairs, named_given = _pairs_of(params)
        model, owners = _owning_modules([p for _, p in pairs if isinstance(p, nn.Parameter)])
    seen, out, left = set(), [], []
    for name, p in pairs:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not p.requires_grad and frozen == "leave":
            left.append((_strip_compile(name), p))
            continue
        if not (p.is_leaf or p.retains_grad):
            raise ValueError(f"can't optimize a non-leaf Tensor ({name}: a result of a computation; pass the "
                             "parameter it was computed from)")
        out.append((_strip_compile(name), p))
    return out, owners, model, named_given, left


def _strip_compile(name: str) -> str:
    return ".".join(c for c in name.split(".") if c != _COMPILE_PREFIX)


class _NameRule:
    """A names list or a predicate on names (picklable, unlike a closure)."""

    def __init__(self, rule, what: str, names: Sequence[str]):
        self.pred = rule if callable(rule) else None
        self.names: frozenset[str] = frozenset()
        if rule is not None and self.pred is None:
            wanted = {rule} if isinstance(rule, str) else set(rule)
            unknown = sorted(wanted - set(names))
            if unknown:
                raise ValueError(f"{what}=: unknown parameter names {unknown} (known: the names describe() prints)")
            self.names = frozenset(wanted)

    def __call__(self, name: str) -> bool:
        return bool(self.pred(name)) if self.pred is not None else name in self.names


def _rule(rule, what: str, names: Sequence[str]) -> Callable[[str], bool]:
    """A names list or a predicate, as a predicate (unknown names refused)."""
    return _NameRule(rule, what, names)


def _module_fact(p: Tensor, mods: Sequence[tuple[str, nn.Module]]) -> tuple[str, bool, bool] | None:
    """What the owning module's type says a parameter of ndim >= 2 is: (reason, flatten,
    transposed), or None when it says nothing (a plain Parameter of a custom module)."""
    if _rnn_weight(p, mods):  # torch's fused recurrent kernels read weight_ih, weight_hh, weight_hr as [out, in]
        return "recurrent matrix", False, False
    for _, m in mods:
        if isinstance(m, _ConvNd) and m.weight is p:
            if getattr(m, "transposed", False):
                return "conv transpose (flattened [in, out * kernel], transposed)", True, True
            return "conv (flattened)", True, False
    for _, m in mods:
        if type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is p and p.ndim == 2 \
                and p.shape[-1] == getattr(m, "nf", None):
            return "Conv1D weight [in, out] (transposed)", False, True
        if isinstance(m, nn.Linear) and m.weight is p:
            return "matrix", False, False
        if isinstance(m, nn.MultiheadAttention) and any(getattr(m, k, None) is p for k in (
                "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")):
            return "matrix", False, False
    return None


#: Gates stacked in a recurrent layer's weight_ih / weight_hh, each its own [hidden, in] matrix.
RNN_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _blocks(p: Tensor, mods: Sequence[tuple[str, nn.Module]]) -> tuple[int, str]:
    """The independent matrices a layer stacks along a weight's first axis: a grouped convolution's
    groups (each maps its own slice of the input channels), a recurrent layer's gates (LSTM: i, f, g,
    o; GRU: r, z, n), each orthogonalized on its own as Muon practice treats a fused q, k, v;
    ``(1, "")`` for any other weight."""
    for _, m in mods:
        if isinstance(m, _ConvNd) and m.weight is p and m.groups > 1:
            return m.groups, f"groups={m.groups}: one matrix per group"
        if isinstance(m, nn.RNNBase):
            for wn in m._flat_weights_names:
                if getattr(m, wn, None) is p and wn.startswith(("weight_ih", "weight_hh")):
                    k = RNN_GATES.get(m.mode.split("_")[0], 1)
                    return k, f"{type(m).__name__} {wn}: one matrix per gate" if k > 1 else f"{type(m).__name__} {wn}"
    return 1, ""


def _rnn_weight(p: Tensor, mods: Sequence[tuple[str, nn.Module]]) -> bool:
    return any(isinstance(m, nn.RNNBase) and any(getattr(m, wn, None) is p for wn in m._flat_weights_names)
               for _, m in mods)


def _split_blocks(r: "Route", k: int, why: str) -> "Route":
    """``r`` with each matrix cut into ``k`` row blocks (the view stays contiguous: a first-axis
    split); a block of one row or one column is a vector, not a matrix: Adam."""
    if k == 1:
        return r
    rows = r.rows // k
    if rows == 1 or r.cols == 1:
        return Route(r.name, r.param, "adam", f"{why}, each [{rows}, {r.cols}]: a vector, not a matrix "
                     "(depthwise: one filter per channel)")
    return Route(r.name, r.param, "matrix", f"{r.reason}, {why} [{rows}, {r.cols}]", r.count * k, rows, r.cols,
                 r.transposed)


def classify(named: Sequence[tuple[str, Tensor]], owners: Mapping[int, list[tuple[str, nn.Module]]], *,
             adam=None, anvil=None, head_names: Sequence[str] = HEAD_NAMES, observation=None,
             io_layers: str = "adam", forced: Mapping[str, Mapping[str, Any]] | None = None) -> list[Route]:
    """Each parameter's route, by the first rule that matches (:func:`anvil_fast.optim.entry.ANVIL`'s
    docstring, "Routing").
    ``observation``: an :class:`anvil_fast.optim.roles.Observation` of a forward (None: nothing observed);
    ``forced``: name -> a route recorded by :meth:`DropInAnvil.state_dict` (kind, transposed, reason),
    taken as it is (a state dict or a pickled optimizer carries its plan)."""
    from .roles import describe_use

    names = [n for n, _ in named]
    is_adam, is_anvil = _rule(adam, "adam", names), _rule(anvil, "anvil", names)
    heads = {head_names} if isinstance(head_names, str) else set(head_names)
    if io_layers not in IO_LAYERS:
        raise ValueError(f"io_layers must be one of {IO_LAYERS}, got {io_layers!r}")
    obs = observation if observation is not None and observation.complete else None
    forced = dict(forced or {})
    routes = []
    for name, p in named:
        mods = owners.get(id(p), [])
        fact = _module_fact(p, mods) if p.ndim >= 2 else None
        role = obs.role(p) if obs is not None else None
        flatten = (fact[1] if fact else False) or p.ndim > 3
        if fact is not None:
            transposed = fact[2]
        else:
            seen = obs.orientation(p) if obs is not None and role == "matrix" else None
            transposed = bool(seen)
        if name in forced:
            f = forced[name]
            if f["kind"] == "adam":
                routes.append(Route(name, p, "adam", f["reason"]))
            else:
                r = _matrix_route(name, p, f["reason"], flatten=flatten, transposed=bool(f["transposed"]))
                view = f.get("view")
                if view:
                    if math.prod(view) != p.numel():
                        raise ConfigError(f"{name}: the recorded matrices {list(view)} do not hold its "
                                          f"{p.numel()} elements")
                    r.count, r.rows, r.cols = (int(v) for v in view)
                routes.append(r)
        elif is_anvil(name):
            if p.ndim < 2:
                raise ConfigError(f"{name}: anvil= needs a parameter with ndim >= 2, got shape {tuple(p.shape)}")
            routes.append(_matrix_route(name, p, "anvil=", flatten=flatten, transposed=transposed))
            k, why = _blocks(p, mods)
            if k > 1 and (routes[-1].rows // k) > 1:
                routes[-1] = _split_blocks(routes[-1], k, why)
        elif is_adam(name):
            routes.append(Route(name, p, "adam", "adam="))
        elif p.ndim < 2:
            routes.append(Route(name, p, "adam", "scalar/vector"))
        elif any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.weight is p for _, m in mods):
            routes.append(Route(name, p, "adam", "embedding"))
        elif role == "lookup":
            routes.append(Route(name, p, "adam", f"lookup table (observed: {describe_use(obs, p)})"))
        elif _is_head(name, mods, heads):
            routes.append(Route(name, p, "adam", "output head"))
        elif io_layers == "adam" and obs is not None and id(p) in obs.output_layers:
            routes.append(Route(name, p, "adam", "output layer (observed: its product is a model output)"))
        elif io_layers == "adam" and obs is not None and id(p) in obs.input_layers:
            routes.append(Route(name, p, "adam", "input layer (observed: applied to the model's input)"))
        elif p.shape[0] > 1 and all(d == 1 for d in p.shape[1:]):
            routes.append(Route(name, p, "adam", f"a column {list(p.shape)} (a per-output gain such as weight_norm's "
                                                 "g, or a layer of one input): a vector, not a matrix"))
        elif fact is not None:
            routes.append(_split_blocks(_matrix_route(name, p, fact[0], flatten=fact[1], transposed=fact[2]),
                                        *_blocks(p, mods)))
        elif role == "elementwise":
            routes.append(Route(name, p, "adam", f"observed: {describe_use(obs, p)}"))
        elif role == "matrix":
            kind = "matrix" if p.ndim == 2 else "stack"
            if p.ndim > 3:
                raise ConfigError(f"{name}: a parameter of shape {tuple(p.shape)} is a matrix operand (observed) but "
                                  f"no rule views it as matrices; pass anvil=[{name!r}] to bank it as "
                                  f"[{p.shape[0]}, {math.prod(p.shape[1:])}], or adam=[{name!r}]")
            how = "[in, out], transposed" if transposed else (
                "[out, in]" if obs.orientation(p) is False else "[out, in] assumed: orientation not seen")
            routes.append(_matrix_route(name, p, f"{kind} (observed: {describe_use(obs, p)}, {how})", flatten=False,
                                        transposed=transposed))
        else:
            why = "not observed" if obs is None else "not used in the observed forward"
            if p.shape[0] == 1 and (p.ndim == 2 or p.ndim >= 3):
                routes.append(Route(name, p, "adam", f"broadcast table (leading dimension of size 1, {why})"))
            elif p.ndim == 2:
                routes.append(_matrix_route(name, p, "matrix" if obs is None else f"matrix ({why})", flatten=False,
                                            transposed=False))
            elif p.ndim == 3:
                routes.append(_matrix_route(name, p, "stack" if obs is None else f"stack ({why})", flatten=False,
                                            transposed=False))
            else:
                raise ConfigError(f"{name}: no rule covers a parameter of shape {tuple(p.shape)} (matrices are 2-D, "
                                  f"stacks 3-D, convolution weights any ndim); pass adam=[{name!r}] to use Adam for "
                                  f"it, or anvil=[{name!r}] to bank it as [{p.shape[0]}, {math.prod(p.shape[1:])}]")
    for r in routes:
        if not r.param.dtype.is_floating_point:
            raise ConfigError(f"{r.name}: a {r.param.dtype} parameter cannot be optimized (floating point only)")
    return routes


def _is_head(name: str, mods: Sequence[tuple[str, nn.Module]], heads: set[str]) -> bool:
    """Whether an owning module's name ends in a head name (without modules: the parameter name's
    module part)."""
    module_names = [m for m, _ in mods if m] or [name.rsplit(".", 1)[0] if "." in name else ""]
    return any(m.rsplit(".", 1)[-1] in heads for m in module_names)


def _matrix_route(name: str, p: Tensor, reason: str, *, flatten: bool, transposed: bool = False) -> Route:
    if p.dtype not in MATRIX_DTYPES:
        raise ConfigError(f"{name}: a {p.dtype} matrix cannot be banked (banks are bfloat16 or float32); convert "
                          f"the model or pass adam=[{name!r}]")
    if p.numel() == 0:
        raise ConfigError(f"{name}: an empty parameter {tuple(p.shape)} cannot be banked; pass adam=[{name!r}]")
    if flatten or p.ndim == 2:
        return Route(name, p, "matrix", reason, 1, p.shape[0], math.prod(p.shape[1:]), transposed)
    return Route(name, p, "matrix", reason, p.shape[0], p.shape[1], p.shape[2], transposed)


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
    transposed: bool = False  #: the bank stores the matrices transposed (anvil_ref.config)


@dataclass
class BankPlan:
    label: str
    rows: int
    cols: int
    dtype: torch.dtype
    members: list[tuple[str, Tensor, int, int]] = field(default_factory=list)  #: (name, param, first, count)
    transposed: bool = False  #: every member reads its matrices as [in, out] (anvil_ref.config)
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
        if by_name[name].transposed and k != 1:
            raise ConfigError(f"split_rows=: {name} is stored [in, out] (transposed: {by_name[name].reason}), so its "
                              f"rows are input features and {k} row blocks would split the inputs, not the outputs "
                              "(q, k, v); splitting the output axis cannot be a view of a bank. Leave it unsplit, or "
                              "build the layer as nn.Linear ([out, in]) and split that")
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
        key = (rows, r.cols, r.param.dtype, r.transposed)
        if key not in banks:
            suffix = "_transposed" if r.transposed else ""
            banks[key] = BankPlan(f"bank_{rows}x{r.cols}_{str(r.param.dtype).split('.')[-1]}{suffix}", rows, r.cols,
                                  r.param.dtype, transposed=r.transposed)
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
                                     (first, first + count), transposed=r.transposed))
    return Plan(list(banks.values()), adam, entries)


# ====================================================================================== build
@dataclass
class Bank:
    """A built bank: its parameter ``[n_pad * rows, cols]`` (what AnvilAndAdam updates; the members
    are views of it). The members' gradients go into the inner optimizer's persistent gradient
    buffer of the bank (:meth:`DropInAnvil.grad_slots`)."""

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


class _StateView(Mapping):
    """``opt.state[p]``: live views of the optimizer's state for one parameter."""

    def __init__(self, read: Callable[[], dict[str, Any]], write: Callable[[str, Any], None] | None = None):
        self._read, self._write = read, write

    def write(self, key: str, value: Any) -> None:
        """Set a value that is not a live tensor (Adam's step count)."""
        if self._write is None:
            raise KeyError(f"{key}: this state holds live tensors only (copy into them)")
        self._write(key, value)

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
    """How a one-process step reads the gradients by default: in place where the bank update's
    rails are the Triton kernel (SAFE and GRAM_SIDE on CUDA) and every parameter is float32 or
    bfloat16 (the in-place kernels' dtypes), else through the banks' buffers."""
    from anvil_fast.kernels.backend import triton_available
    from anvil_fast.core.cascade import DEFAULT_CONFIG, get_config

    cfg = DEFAULT_CONFIG if bank_config is None else get_config(bank_config)
    ok = all(d in (torch.float32, torch.bfloat16) for d in dtypes)
    return "in_place" if device.type == "cuda" and triton_available() and cfg.triton_elementwise and ok \
        else "buffers"


class DropInAnvil(AnvilFrontend):
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
        elif not engine and grad_read == "in_place":
            raise ValueError("grad_read='in_place' is the one-process step's; on several ranks every gradient is "
                             "reduced into the banks' buffers")
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
        # Reading in place, Adam updates every parameter where it lives in one launch: the flat
        # buffers of small "replicated" parameters (a gradient copy and a row index per element)
        # would only cost memory, so every Adam parameter keeps its own state.
        return plan_routes(routes, split_rows=kw["split_rows"], world_size=self.comms.world_size,
                           shard_min_numel=0 if self.grad_read == "in_place" else kw["shard_min_numel"])

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
                                       rails_dtype=kw["rails_dtype"], grad_in_place=self.grad_read == "in_place")
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
                            bank_config=bank_config, maps=maps, rails_dtype=rails_dtype, grad_in_place=grad_in_place)

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
    @torch.no_grad()
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
        self._apply_groups(self._host_taken, every_step=self.rails == "record")
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
    def _state_dict(self) -> dict[str, Any]:
        """torch's format (:func:`anvil_fast.optim.entry.ANVIL`'s docstring, "State dict")."""
        return self._torch_state()

    def _torch_state(self) -> dict[str, Any]:
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            for p in g["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        state = {index[id(p)]: self._saved_state_of(p) for g in self.param_groups for p in g["params"]}
        # anything else in opt.state (a hook's entry) is kept as it is, as torch's optimizers keep it
        state.update({k: v for k, v in self.state.items() if not isinstance(k, Tensor)})
        if groups:
            groups[0][EXTRAS_KEY] = dict(format=STATE_FORMAT, world_size=self.comms.world_size, rank=self.comms.rank,
                                         routes=self._routes_list(), **self._state_extras())
        return {"state": state, "param_groups": groups}

    def _saved_state_of(self, p: Tensor) -> dict[str, Any]:
        return {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in self.state[p].items()}

    def _routes_list(self) -> dict[str, list]:
        """The plan in the state dict's parameter order: each parameter's index in the parameters as
        given (``order``), kinds, transposed flags, matrix views ([count, rows, cols] before
        split_rows) and reasons. Names are torch's ``param_names``, where names were given."""
        entries = {e.name: e for e in self.plan}
        names = [n for b in self.matrix_banks for n, _, _, _ in b.plan.members] + [n for n, _ in self.adam_params]
        views = {}
        for b in self.matrix_banks:
            k = dict(self._init_kwargs["split_rows"])
            for n, p, first, count in b.plan.members:
                split = k.get(n, 1)
                views[n] = [count // split, b.plan.rows * split, b.plan.cols]
        given = {n: i for i, (n, _) in enumerate(self._named)}
        return {"order": [given[n] for n in names],
                "kinds": ["adam" if entries[n].route == "adam" else "matrix" for n in names],
                "transposed": [entries[n].transposed for n in names], "views": [views.get(n) for n in names],
                "reasons": [entries[n].reason for n in names]}

    def _names_in_order(self) -> list[str]:
        """This optimizer's parameter names in the state dict's parameter order."""
        return [n for b in self.matrix_banks for n, _, _, _ in b.plan.members] + [n for n, _ in self.adam_params]

    def _state_extras(self) -> dict[str, Any]:
        """The optimizer-wide values a state dict carries (beside the per-parameter state): the step
        counts, and the count the lean rails' rounding draws its bits from."""
        return {"taken_steps": self.taken_steps, "skipped_steps": self.skipped_steps,
                "rail_step": int(self.inner.rail_step)}

    def _load_state_extras(self, d: Mapping[str, Any]) -> None:
        """Restore :meth:`_state_extras` (checked by :meth:`load_state_dict` to hold its keys; a
        state dict written before the lean rails existed has no rail step: 0)."""
        self.taken_steps = int(d["taken_steps"])
        self.skipped_steps = int(d["skipped_steps"])
        self.inner.rail_step.fill_(int(d.get("rail_step", 0)))

    @staticmethod
    def _as_state_dict(state_dict):
        return dict(state_dict)

    def _load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """torch's loading by position (:func:`anvil_fast.optim.entry.ANVIL`'s docstring, "State dict")."""
        if sd.get("format") == LEGACY_STATE_FORMAT:
            sd = self._from_legacy(sd)
        self._load_torch_state(sd)

    def _saved_extras(self, sd: Mapping[str, Any]) -> tuple[list, dict]:
        groups = sd.get("param_groups")
        if not isinstance(groups, (list, tuple)) or not isinstance(sd.get("state"), Mapping) or not groups \
                or not all(isinstance(g, Mapping) and "params" in g for g in groups):
            raise ValueError("not an optimizer state dict: expected torch's format {'state': {...}, 'param_groups': "
                             f"[{{..., 'params': [...]}}, ...]}} (got keys {sorted(map(str, sd))})")
        extras = groups[0].get(EXTRAS_KEY)
        if not isinstance(extras, Mapping) or extras.get("format") != STATE_FORMAT:
            got = extras.get("format") if isinstance(extras, Mapping) else None
            raise ValueError(f"not an anvil_fast.ANVIL state dict: its first param group has no {EXTRAS_KEY!r} entry "
                             f"of format {STATE_FORMAT!r} (got {got!r}); a state dict of another optimizer cannot be "
                             "loaded")
        return list(groups), dict(extras)

    def _load_torch_state(self, sd: Mapping[str, Any]) -> None:
        groups, extras = self._saved_extras(sd)
        missing = sorted({"world_size", "rank", "routes"} - set(extras) |
                         (set(self._state_extras()) - {"rail_step"} - set(extras)))
        if missing:
            raise ValueError(f"state dict: {EXTRAS_KEY!r} lacks {missing}")
        if (extras["world_size"], extras["rank"]) != (self.comms.world_size, self.comms.rank):
            raise ConfigError(f"state dict of rank {extras['rank']} of {extras['world_size']} cannot be loaded by rank "
                              f"{self.comms.rank} of {self.comms.world_size} (each rank holds its own matrices' state)")
        saved_ids = [i for g in groups for i in g["params"]]
        saved_names = [n for g in groups for n in g.get("param_names", [])]
        by_name = self._match_routes(extras["routes"], len(saved_ids),
                                     saved_names if len(saved_names) == len(saved_ids) else None)
        mine = [p for g in self.param_groups for p in g["params"]]
        if by_name is None:
            if len(groups) != len(self.param_groups):
                raise ValueError("loaded state dict has a different number of parameter groups")
            if any(len(g["params"]) != len(h["params"]) for g, h in zip(groups, self.param_groups)):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 "optimizer's group")
            id_map = dict(zip(saved_ids, mine))
        else:
            where = {n: p for n, p in self._named}
            id_map = {i: where[n] for i, n in zip(saved_ids, by_name)}
        # ---- check everything
        writes: list[tuple[Any, ...]] = []
        state = merged_state_keys(sd["state"])
        unknown = [k for k in state if k not in id_map and isinstance(k, int)]
        if unknown:
            raise ValueError(f"state dict: state entries {unknown[:4]} belong to no parameter of its param groups")
        other = {k: v for k, v in state.items() if k not in id_map}  # kept as they are, as torch does
        names = {id(p): n for n, p in self._named}
        for k, saved in state.items():
            if k not in id_map:
                continue
            p = id_map[k]
            live = self.state[p]
            name = names[id(p)]
            if not isinstance(saved, Mapping):
                raise ValueError(f"state dict: {name}: state must be a mapping, got {type(saved).__name__}")
            keys = set(saved) - ({"mantissa"} - set(live))  # a float32 matrix is its own master
            if keys != set(live):
                raise ValueError(f"state dict: {name}: saved state {sorted(saved)}, this optimizer keeps "
                                 f"{sorted(live)} for it")
            for key in live:
                v, cur = saved[key], live[key]
                if isinstance(cur, Tensor):
                    if not isinstance(v, Tensor) and key == "step" and cur.ndim == 0:
                        v = torch.tensor(v, dtype=cur.dtype)
                    if not isinstance(v, Tensor) or tuple(v.shape) != tuple(cur.shape) or v.dtype != cur.dtype:
                        raise ValueError(f"state dict: {name}.{key}: saved {_describe_value(v)}, expected {cur.dtype} "
                                         f"{tuple(cur.shape)}")
                elif isinstance(v, Tensor) and v.numel() == 1 and key == "step":
                    v = int(v.item())
                elif type(v) is not type(cur) and not (isinstance(v, int) and isinstance(cur, int)):
                    raise ValueError(f"state dict: {name}.{key}: saved {_describe_value(v)}, expected a "
                                     f"{type(cur).__name__}")
                writes.append((p, key, v))
        for g in groups:
            for k in ("kind",):
                if k not in g:
                    raise ValueError(f"state dict: a param group lacks {k!r}")
        kinds = {g["kind"]: g for g in groups}
        for g in self.param_groups:
            if g["kind"] not in kinds:
                raise ValueError(f"state dict has no {g['kind']!r} param group (it has {sorted(kinds)})")
            check_hyperparameters(g["kind"], {**g, **{k: v for k, v in kinds[g["kind"]].items()
                                                       if k not in ("params", "param_names", EXTRAS_KEY)}})
        # ---- write
        with torch.no_grad():
            for p, key, v in writes:
                live = self.state[p]
                if isinstance(live[key], Tensor):
                    live[key].copy_(v.to(live[key].device))
                else:
                    live.write(key, v)
        for g in self.param_groups:
            saved = kinds[g["kind"]]
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()
                      if k not in ("params", "param_names", EXTRAS_KEY)})
            if "param_names" in saved:  # torch: the loaded names replace the current ones
                g["param_names"] = list(saved["param_names"])
        for k, v in other.items():
            self.state[k] = v
        self._load_state_extras(extras)

    def _match_routes(self, routes: Mapping[str, Any], n_saved: int,
                      saved_names: list[str] | None) -> list[str] | None:
        """Compare the saved plan with this one: None when they agree position by position (load by
        position, as torch does); else, when the saved dict names this optimizer's parameters (its
        ``param_names``) or lists as many parameters in the order given, their names here, position
        by position: this plan is first rebuilt as the saved one routes them (a state dict carries
        its routing). Anything else: ValueError."""
        try:
            order, kinds, transposed = list(routes["order"]), list(routes["kinds"]), list(routes["transposed"])
            views, reasons = list(routes["views"]), list(routes["reasons"])
        except (KeyError, TypeError):
            raise ValueError("state dict: its routes entry is malformed (expected order, kinds, transposed, views, "
                             "reasons)") from None
        if not len(order) == len(kinds) == len(transposed) == len(views) == len(reasons) == n_saved:
            raise ValueError(f"state dict: its routes list {len(order)} parameters, its param groups {n_saved}")
        mine = self._routes_list()
        if kinds == mine["kinds"] and transposed == mine["transposed"] and \
                [tuple(v) if v else None for v in views] == [tuple(v) if v else None for v in mine["views"]]:
            return None
        ours = [n for n, _ in self._named]
        if saved_names is not None and set(saved_names) == set(ours):
            names = saved_names
        elif len(order) == len(ours) and sorted(order) == list(range(len(ours))):
            names = [ours[i] for i in order]
        else:
            diff = next((i for i, (a, b) in enumerate(zip(kinds, mine["kinds"])) if a != b), None)
            where = f" (first difference at position {diff}: saved {kinds[diff]}, here {mine['kinds'][diff]})" \
                if diff is not None else ""
            raise ValueError("loaded state dict routes its parameters differently from this optimizer and names "
                             f"other parameters{where}: it was saved for another model or other routing arguments "
                             "(describe() gives this plan)")
        forced = {n: {"kind": k, "transposed": bool(t), "reason": r, "view": v}
                  for n, k, t, r, v in zip(names, kinds, transposed, reasons, views)}
        self._adopt(forced)
        return names

    def _adopt(self, forced: Mapping[str, Mapping[str, Any]]) -> None:
        """Rebuild the plan as ``forced`` records it (a loaded state dict's routing)."""
        self._observation, self._unobserved = None, ""
        self._rebuild(self._plan_for(forced))

    def _from_legacy(self, sd: Mapping[str, Any]) -> dict[str, Any]:
        """A state dict of format ``anvil_fast.ANVIL/1`` (state keyed by bank label and Adam name, the
        inner ``anvil_fast.AnvilAndAdam/1`` dict) in torch's format, this optimizer rebuilt on its plan
        (every non-Adam parameter banked by its shape, none transposed)."""
        from .optimizer import STATE_FORMAT as INNER_FORMAT

        inner = sd.get("anvil")
        if not isinstance(inner, Mapping) or inner.get("format") != INNER_FORMAT:
            raise ValueError(f"a {LEGACY_STATE_FORMAT!r} state dict needs its inner {INNER_FORMAT!r} dict under 'anvil'")
        if (inner["world_size"], inner["rank"]) != (self.comms.world_size, self.comms.rank):
            raise ConfigError(f"state dict of rank {inner['rank']} of {inner['world_size']} cannot be loaded by rank "
                              f"{self.comms.rank} of {self.comms.world_size} (sharded state is per rank)")
        cfgs = inner["param_cfgs"]
        adam_names = {l for l, c in cfgs.items() if c["optim"] == "adam"}
        bank_labels = {l for l, c in cfgs.items() if c["optim"] == "anvil"}
        ours = {n for n, _ in self._named}
        if not adam_names <= ours:
            raise ValueError(f"legacy state dict: Adam parameters {sorted(adam_names - ours)[:4]} are not parameters "
                             "of this optimizer")
        forced = {}
        for n, p in self._named:
            if n in adam_names:
                forced[n] = {"kind": "adam", "transposed": False, "reason": "recorded (legacy state dict)"}
            else:
                forced[n] = {"kind": "matrix", "transposed": False, "reason": "recorded (legacy state dict)"}
        self._adopt(forced)
        mine = {b.label for b in self.matrix_banks}
        if mine != bank_labels:
            raise ValueError(f"legacy state dict: banks {sorted(bank_labels)} do not match this model's "
                             f"{sorted(mine)}")
        state: dict[str, dict[str, Any]] = {}
        for b in self.matrix_banks:
            st = inner["state"][b.label]
            if tuple(cfgs[b.label]["reshape"])[1:] != (b.plan.rows, b.plan.cols):
                raise ValueError(f"legacy state dict: {b.label} holds {cfgs[b.label]['reshape']}")
            for n, _, first, count in b.plan.members:
                s = self._local_slots(b, first, count)
                views = dict(fast_rail=st["velocity"][0, s], slow_rail=st["velocity"][1, s],
                             lane_energy=st["lane_energy"][s], mantissa=st["mantissa"][s])
                if count == 1:
                    views = {k: v.squeeze(0) if v.shape[0] == 1 else v for k, v in views.items()}
                state[n] = views
        for n, _ in self.adam_params:
            st = inner["state"][n]
            state[n] = dict(step=st["step"], exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"])
        new = self._torch_state()  # this optimizer's layout; its per-parameter values replaced below
        new["state"] = {i: state[n] for i, n in enumerate(self._names_in_order())}
        old_groups = {g["kind"]: g for g in sd["param_groups"]}
        for g in new["param_groups"]:
            g.update({k: v for k, v in old_groups.get(g["kind"], {}).items() if k != "params"})
        new["param_groups"][0][EXTRAS_KEY].update(taken_steps=int(sd["taken_steps"]),
                                                  skipped_steps=int(sd["skipped_steps"]))
        return new

    # ------------------------------------------------------------------ copies
    def __reduce_ex__(self, protocol):
        """Pickling and deepcopy rebuild the optimizer from its parameters, arguments, plan and state
        dict (:func:`_rebuild`): what the step engine holds (CUDA graphs, streams, compiled
        functions) is made anew, never copied."""
        r = self._routes_list()
        routes = {n: {"kind": k, "transposed": t, "reason": why, "view": v} for n, k, t, why, v
                  in zip(self._names_in_order(), r["kinds"], r["transposed"], r["reasons"], r["views"])}
        # the recorded plan replaces the routing arguments (a predicate may not pickle), and the model
        # is never part of the copy: the parameters are
        kwargs = dict(self._init_kwargs, adam=None, anvil=None)
        spec = dict(cls=type(self), named=list(self._named) + list(self._left_out), names_given=self._names_given,
                    kwargs=kwargs, routes=routes, state=_uint16_as_int16(self.state_dict()))
        return _rebuild, (spec,)


def merged_state_keys(state: Mapping) -> dict:
    """``state`` with entries under ``"3"`` merged into those under ``3``: torch.distributed.checkpoint
    loads the non-tensor values of an int-keyed dict (Adam's step) under the key's string."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in state.items() if not isinstance(k, str)
           or not k.isdigit() or int(k) not in state}
    for k, v in state.items():
        if isinstance(k, str) and k.isdigit() and int(k) in state and isinstance(v, Mapping):
            out[int(k)] = {**out[int(k)], **v}
    return out


def _describe_value(v) -> str:
    return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, Tensor) else f"{type(v).__name__} {v!r:.40}"


def _uint16_as_int16(x, back: bool = False):
    """uint16 tensors (the mantissas) as bit-identical int16 views and back: plain pickle cannot load
    a uint16 tensor (torch.save's zip format can)."""
    if isinstance(x, Tensor):
        return _Uint16(x.view(torch.int16)) if not back and x.dtype == torch.uint16 else x
    if isinstance(x, _Uint16):
        return x.bits.view(torch.uint16)
    if isinstance(x, dict):
        return {k: _uint16_as_int16(v, back) for k, v in x.items()}
    if isinstance(x, list):
        return [_uint16_as_int16(v, back) for v in x]
    return x


@dataclass
class _Uint16:
    bits: Tensor


def _rebuild(spec: Mapping[str, Any]) -> "DropInAnvil":
    """The optimizer :meth:`DropInAnvil.__reduce_ex__` describes, over the (copied) parameters."""
    if spec["names_given"]:
        params = list(spec["named"])
    else:
        params = [p for _, p in spec["named"]]
    opt = spec["cls"](params, **spec["kwargs"], _routes=spec["routes"])
    opt.load_state_dict(_uint16_as_int16(spec["state"], back=True))
    return opt


__all__ = ["DropInAnvil", "HEAD_NAMES", "StaleParameterError", "NonFiniteGradientWarning", "NonFiniteGradientError",
           "PlanEntry", "classify", "plan_routes", "build_banks", "named_parameters_of"]
