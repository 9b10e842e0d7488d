"""The drop-in's plan: each parameter's route (a matrix for ANVIL, or Adam) and the reason
(:func:`classify`), the banks the matrix routes share (:func:`plan_routes`), and the banks built
over the parameters (:func:`build_banks`: every member becomes a view of its bank). The rules are
:func:`anvil_fast.optim.entry.ANVIL`'s docstring, "Routing"; the facts a traced forward gives are
:mod:`anvil_fast.optim.roles`'. Nothing here keeps state: :class:`anvil_fast.optim.dropin.DropInAnvil`
calls these once when it is built (and again when parameters are added or a state dict's routing is
adopted).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from anvil_ref.config import ConfigError

#: Module names (last component) whose parameters of ndim >= 2 are output heads, hence Adam.
HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")
#: The dtypes a bank holds (bf16: the seed's storage; float32: the parameter is the fp32 master).
MATRIX_DTYPES = (torch.bfloat16, torch.float32)

#: Components torch.compile inserts into parameter and module names.
_COMPILE_PREFIX = "_orig_mod"


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


__all__ = ["HEAD_NAMES", "MATRIX_DTYPES", "IO_LAYERS", "FROZEN", "RNN_GATES", "Route", "classify", "PlanEntry", "BankPlan",
           "Plan", "plan_routes", "Bank", "build_banks", "named_parameters_of"]
