"""What each parameter does in a forward pass: the observation :class:`anvil_fast.ANVIL` routes by.

:func:`observe` runs one forward of a model (:func:`trace_at_construction`: once, when the optimizer
is built, on ``example_input=`` or on what the model offers, :func:`offered_input`) under a
:class:`torch.overrides.TorchFunctionMode` that sees every torch function and tensor method call,
and follows three things through them, by tensor identity:

* **Parameter uses.** A tensor derived from a parameter by views, transposes, casts, indexing of whole
  matrices or arithmetic with constants (parameters, buffers, numbers: ``w * scale``,
  ``w[expert]``, ``w.T``) carries that parameter. Where such a tensor meets an activation (a tensor
  computed from the model's inputs), the call says what the parameter does:

  - ``"matrix"``: it is a matrix operand of a product (``F.linear``, ``matmul``/``@``, ``mm``,
    ``bmm``, ``addmm``, ``baddbmm``, ``mv``, ``einsum``, ``tensordot``, convolutions, grouped
    matmuls). The call also tells its **orientation**: ``F.linear(x, W)`` reads ``W`` as
    ``[out, in]``; ``x @ W`` (and ``addmm(b, x, W)``, transformers' ``Conv1D``) as ``[in, out]``,
    i.e. *transposed*; an ``einsum`` operand by which of its last two indices is summed over;
    transposes between the parameter and the call are followed.
  - ``"lookup"``: it is indexed by an activation (``F.embedding``, ``w[ids]``, ``index_select``,
    ``gather``): a table.
  - ``"elementwise"`` (with the call's name): it is added to, multiplied with, concatenated with...
    an activation (a position table, a class token, a gain).

* **The input layer**: a product whose activation operand came from the model's inputs through
  calls that involve no layer's output (reshapes, casts, normalizations, additions of tables) is
  the layer applied to the input (a stem convolution, a patch embedding, the first ``nn.Linear``).
  A lookup ends that chain (an embedding table *is* the input layer, and the layers after it are not).

* **The output layers**: a product whose result reaches a model output (every tensor of what
  ``forward`` returns: a tuple, a dict, a ``ModelOutput``) through calls that combine it with no
  other layer's result (casts, reshapes, scaling, a loss against labels) produced that output.
  A residual sum combines two layers' results, so a model returning hidden states has none.

Nothing is changed: every call runs as it would, and a failure of the bookkeeping never reaches the
forward (the observation is then marked incomplete and the caller falls back). Tensors the mode did
not see being made (an op outside torch's function-override protocol) count as activations of
unknown origin, which never makes a parameter a matrix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

#: Calls whose tensor operands include a matrix being multiplied (the parameter is a matrix operand).
MATRIX_PRODUCTS = frozenset({
    "linear", "bilinear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm",
    "mv", "addmv", "einsum", "tensordot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "_grouped_mm", "grouped_mm", "multi_head_attention_forward", "addmm_", "baddbmm_"})
#: Calls that read rows of a table by an index.
LOOKUPS = frozenset({"embedding", "embedding_bag", "index_select", "gather", "take", "take_along_dim"})
#: Calls after which a parameter-derived tensor's last two axes are the parameter's, swapped or not,
#: when its last two dimensions are unchanged (views, casts, copies, element-wise arithmetic).
_SWAPS = frozenset({"transpose", "transpose_", "swapaxes", "swapdims", "t", "t_", "mT", "T", "permute", "adjoint",
                    "mH", "H"})


@dataclass
class Observation:
    """What one observed forward saw (module docstring), keyed by ``id(parameter)``."""

    source: str  #: "example_input", or where the input the model offered came from
    uses: dict[int, set[str]] = field(default_factory=dict)  #: "matrix", "lookup", "elementwise"
    calls: dict[int, list[str]] = field(default_factory=dict)  #: the calls that showed each use
    transposed: dict[int, set[bool | None]] = field(default_factory=dict)  #: per matrix use
    input_layers: set[int] = field(default_factory=set)
    output_layers: set[int] = field(default_factory=set)
    complete: bool = True  #: False: the bookkeeping failed somewhere; nothing here is to be trusted
    failure: str = ""

    def seen(self, p: Tensor) -> bool:
        return id(p) in self.uses

    def role(self, p: Tensor) -> str | None:
        """"matrix" when every use is a matrix operand; "lookup" or "elementwise" when one is (a
        parameter used both ways is not a plain matrix); None if unseen."""
        uses = self.uses.get(id(p))
        if not uses:
            return None
        if uses == {"matrix"}:
            return "matrix"
        return "lookup" if "lookup" in uses else "elementwise"

    def orientation(self, p: Tensor) -> bool | None:
        """True: every matrix use reads the parameter as ``[in, out]``; False: as ``[out, in]``;
        None: unknown or mixed."""
        seen = self.transposed.get(id(p), set())
        return next(iter(seen)) if len(seen) == 1 else None

    def first_call(self, p: Tensor, kind: str) -> str:
        for c in self.calls.get(id(p), []):
            k, name = c.split(":", 1)
            if k == kind:
                return name
        return "?"


@dataclass(frozen=True)
class _P:
    """A tensor derived from parameters (and constants): the parameters, and whether its last two
    axes are the (single) source parameter's last two, swapped (True), in order (False), or unknown."""

    src: frozenset[int]
    swapped: bool | None


@dataclass(frozen=True)
class _A:
    """An activation: whether it descends from the inputs through no layer (``inp``), and the layers
    whose product reaches it combined with no other layer (``outs``)."""

    inp: bool
    outs: frozenset[int]


_STATIC = "static"
_UNKNOWN = _A(False, frozenset())


def _call_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # a property (Tensor.T, .mT): its descriptor's name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _tensors(x) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _output_tensors(x, depth: int = 0) -> list[Tensor]:
    """Every tensor in what a forward returns (tuples, lists, dicts, dataclasses like ModelOutput)."""
    if depth > 6:
        return []
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _output_tensors(v, depth + 1)]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in _output_tensors(v, depth + 1)]
    if hasattr(x, "__dataclass_fields__"):
        return [t for k in x.__dataclass_fields__ for t in _output_tensors(getattr(x, k, None), depth + 1)]
    return []


def _einsum_transposed(eq: str, pos: int, swapped: bool | None) -> bool | None:
    """Orientation of einsum operand ``pos``: its last index summed over and the one before kept is
    ``[out, in]`` (not transposed); the other way round, transposed; anything else unknown."""
    if swapped is None or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    ops = lhs.split(",")
    if pos >= len(ops):
        return None
    labels = ops[pos].replace("...", "")
    if len(labels) < 2:
        return None
    a, b = labels[-2], labels[-1]
    if b not in out and a in out:
        stored = False
    elif a not in out and b in out:
        stored = True
    else:
        return None
    return stored != swapped


class _Tracer(TorchFunctionMode):
    def __init__(self, params: Iterable[Tensor], statics: Iterable[Tensor], obs: Observation):
        super().__init__()
        self.obs = obs
        self.info: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.params = {id(p): p for p in params}
        for p in self.params.values():
            self.info[p] = _P(frozenset([id(p)]), False)
        for b in statics:
            if id(b) not in self.params:
                self.info[b] = _STATIC

    def mark_inputs(self, values) -> None:
        for t in _tensors(values):
            if t not in self.info:
                self.info[t] = _A(True, frozenset())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.obs.complete:
            try:
                self._record(_call_name(func), args, kwargs, out)
            except Exception as e:  # the bookkeeping must never break the forward
                self.obs.complete, self.obs.failure = False, f"{type(e).__name__} in {_call_name(func)}: {e}"
        return out

    # -------------------------------------------------------------- bookkeeping
    def _kind(self, t: Tensor):
        return self.info.get(t, _UNKNOWN)

    def _use(self, srcs: Iterable[int], kind: str, name: str, transposed: bool | None = None) -> None:
        for s in srcs:
            self.obs.uses.setdefault(s, set()).add(kind)
            calls = self.obs.calls.setdefault(s, [])
            if len(calls) < 8:
                calls.append(f"{kind}:{name}")
            if kind == "matrix":
                self.obs.transposed.setdefault(s, set()).add(transposed)

    def _set(self, out, value) -> None:
        for t in _tensors(out):
            self.info[t] = value

    def _record(self, name: str, args, kwargs, out) -> None:
        ins = _tensors(args) + _tensors(kwargs)
        kinds = [(t, self._kind(t)) for t in ins]
        pars = [(t, k) for t, k in kinds if isinstance(k, _P)]
        acts = [k for _, k in kinds if isinstance(k, _A)]
        if not _tensors(out):
            return
        if not acts:  # parameters and constants only: a derived parameter (or a constant)
            if not pars:
                self._set(out, _STATIC)
                return
            if name in MATRIX_PRODUCTS:  # e.g. a product of two parameters (a low-rank B @ A)
                self._use({s for _, k in pars for s in k.src}, "matrix", name, None)
                self._set(out, _P(frozenset(s for _, k in pars for s in k.src), None))
                return
            self._set(out, self._derive(name, args, pars, out))
            return
        # an activation is involved
        if name in MATRIX_PRODUCTS and pars:
            layer = frozenset(s for _, k in pars for s in k.src)
            for t, k in pars:
                self._use(k.src, "matrix", name, self._orientation(name, args, kwargs, t, k))
            if any(a.inp and not a.outs for a in acts):
                self.obs.input_layers |= layer
            self._set(out, _A(False, layer))
            return
        table = self._lookup_table(name, args, pars)
        if table is not None:
            self._use(table.src, "lookup", name)
            self._set(out, _A(False, table.src))
            return
        if name == "__getitem__" and pars and self._selects_whole_matrices(args[0], out):
            k = self._kind(args[0])  # w[expert_index]: whole matrices of a stack
            self._set(out, _P(k.src, k.swapped) if isinstance(k, _P) else _UNKNOWN)
            return
        if pars:
            self._use({s for _, k in pars for s in k.src}, "elementwise", name)
        inp = any(a.inp for a in acts) and not any(a.outs for a in acts)
        nonempty = [a.outs for a in acts if a.outs]
        outs = nonempty[0] if len(nonempty) == 1 else frozenset()
        self._set(out, _A(inp, outs))

    def _derive(self, name: str, args, pars, out):
        srcs = frozenset(s for _, k in pars for s in k.src)
        t, k = pars[0]
        outs = [o for o in _tensors(out)]
        swapped: bool | None = k.swapped if len(srcs) == 1 else None
        o = outs[0]
        if swapped is not None:
            if name in _SWAPS:
                swapped = self._swap(name, args, t, o, swapped)
            elif t.ndim < 2 or o.ndim < 2 or tuple(o.shape[-2:]) != tuple(t.shape[-2:]):
                swapped = None
        return _P(srcs, swapped)

    @staticmethod
    def _swap(name: str, args, t: Tensor, o: Tensor, swapped: bool) -> bool | None:
        nd = t.ndim
        if nd < 2:
            return None
        if name in ("t", "t_", "T", "H"):
            return (not swapped) if nd == 2 else None
        if name in ("mT", "adjoint", "mH"):
            return not swapped
        if name == "permute":
            dims = args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else ())
            dims = [int(d) % nd for d in (dims if isinstance(dims, (list, tuple, torch.Size)) else [dims])]
            if len(dims) != nd:
                return None
            last = tuple(dims[-2:])
            return swapped if last == (nd - 2, nd - 1) else (not swapped) if last == (nd - 1, nd - 2) else None
        d = [int(x) % nd for x in args[1:3] if isinstance(x, int)]
        if len(d) != 2:
            return None
        if set(d) == {nd - 2, nd - 1}:
            return not swapped
        return swapped if not ({nd - 2, nd - 1} & set(d)) else None

    def _orientation(self, name: str, args, kwargs, t: Tensor, k: _P) -> bool | None:
        """Whether the parameter behind operand ``t`` is stored ``[in, out]`` (module docstring)."""
        if k.swapped is None:
            return None
        pos = next((i for i, a in enumerate(args) if a is t), None)
        if name in ("linear", "bilinear", "mv", "multi_head_attention_forward"):
            return k.swapped  # read as [out, in]
        if name == "addmv":
            return k.swapped
        if name.startswith("conv_transpose"):
            return not k.swapped  # [in, out, *kernel]
        if name.startswith("conv"):
            return k.swapped
        if name == "einsum":
            eq = args[0] if args and isinstance(args[0], str) else None
            ops = [a for a in args[1:]] if eq is not None else []
            if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
                ops = list(ops[0])
            idx = next((i for i, a in enumerate(ops) if a is t), None)
            return None if eq is None or idx is None else _einsum_transposed(eq, idx, k.swapped)
        if name in ("matmul", "__matmul__", "mm", "bmm", "_grouped_mm", "grouped_mm"):
            right = pos == 1
        elif name == "__rmatmul__":  # x @ W seen from W: W.__rmatmul__(x)
            right = pos == 0
        elif name in ("addmm", "baddbmm", "addbmm", "addmm_", "baddbmm_"):
            if pos not in (1, 2):
                return None
            right = pos == 2
        else:
            return None
        if pos is None:
            return None
        # right operand: its dim -2 is summed over, so it is [in, out]; left (W @ x): [out, in]
        return (not k.swapped) if right else k.swapped

    def _lookup_table(self, name: str, args, pars) -> _P | None:
        """The table of a lookup by an activation index, if this call is one."""
        if not pars:
            return None
        if name in ("embedding", "embedding_bag") and len(args) > 1 and isinstance(self._kind(args[1]), _P):
            return self._kind(args[1])
        if name in ("index_select", "gather", "take", "take_along_dim") and isinstance(self._kind(args[0]), _P):
            t = args[0]
            if name == "index_select" and t.ndim >= 3 and len(args) > 1 and isinstance(args[1], int) \
                    and args[1] % t.ndim < t.ndim - 2:
                return None
            return self._kind(t)
        if name == "__getitem__" and isinstance(self._kind(args[0]), _P):
            t = args[0]
            if self._selects_whole_matrices(t, None):
                return None
            return self._kind(t)
        return None

    @staticmethod
    def _selects_whole_matrices(t: Tensor, out) -> bool:
        """``t[index]`` on a stack (ndim >= 3) indexing its leading axes only: the result is made of
        whole matrices (an expert's weight), not rows of a table."""
        if not isinstance(t, Tensor) or t.ndim < 3:
            return False
        if out is not None:
            o = _tensors(out)
            return bool(o) and o[0].ndim >= 2 and tuple(o[0].shape[-2:]) == tuple(t.shape[-2:])
        return True

    def finish(self, output) -> None:
        for t in _output_tensors(output):
            k = self._kind(t)
            if isinstance(k, _A):
                self.obs.output_layers |= k.outs


def _compiled(model: nn.Module) -> bool:
    return any(type(m).__name__ == "OptimizedModule" for m in model.modules())


def observe(model: nn.Module, example_input, params: Iterable[Tensor]) -> Observation:
    """One forward of ``model`` on ``example_input`` (a tensor, a tuple of positional arguments, or
    a dict of keyword arguments) under the tracer: in eval mode, without gradients, with the random
    number generators forked (nothing of the model or of the global random state changes)."""
    if isinstance(example_input, Mapping):
        args, kwargs = (), dict(example_input)
    elif isinstance(example_input, (tuple, list)):
        args, kwargs = tuple(example_input), {}
    else:
        args, kwargs = (example_input,), {}
    obs = Observation("example_input")
    tracer = _Tracer(params, list(model.buffers()), obs)
    tracer.mark_inputs((args, kwargs))
    modes = {m: m.training for m in model.modules()}
    devices = sorted({t.device.index or 0 for t in _tensors((args, kwargs)) if t.device.type == "cuda"})
    try:
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.no_grad(), tracer:
            out = model(*args, **kwargs)
        tracer.finish(out)
    finally:
        for m, training in modes.items():
            m.training = training
    return obs


def _dynamo_off():
    """A context in which torch.compile'd modules run their original forward eagerly, so the tracer
    sees every call of a compiled model or submodule (nothing is compiled or recompiled)."""
    import torch._dynamo

    return torch._dynamo.config.patch(disable=True)


def _first_rows(x):
    """Batch 1 of an offered input: every tensor's first row (a sequence-classification model without
    a padding token refuses a batch of several)."""
    if isinstance(x, Tensor):
        return x[:1] if x.ndim else x
    if isinstance(x, Mapping):
        return {k: _first_rows(v) for k, v in x.items()}
    return x


def offered_input(model: nn.Module) -> tuple[Any, str]:
    """An input the model itself offers to trace with, and where it came from; ``(None, why)``
    when it offers none. Hugging Face models: ``dummy_inputs`` holding the ``main_input_name`` (one
    row of each), else, for ``pixel_values``, a batch of one image of the config's ``num_channels``
    and ``image_size``; an ``nn.Sequential`` whose first module is an ``nn.Linear``, an
    ``nn.Embedding`` or an ``nn.Conv1d``/``2d``/``3d``: one row of its input (a convolution's: one
    image of the smallest size it maps to an output)."""
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    dtype = p.dtype if p is not None and p.dtype.is_floating_point else torch.float32
    main = getattr(model, "main_input_name", None)
    try:
        dummy = getattr(model, "dummy_inputs", None)
    except Exception:  # a property of a model that cannot build it (no config value it reads)
        dummy = None
    if isinstance(dummy, Mapping) and dummy and all(isinstance(v, Tensor) for v in dummy.values()) \
            and (main is None or main in dummy):
        return {k: v.to(device) for k, v in _first_rows(dict(dummy)).items()}, "the model's dummy_inputs"
    cfg = getattr(model, "config", None)
    if main == "pixel_values" and cfg is not None:
        size, ch = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", None)
        size = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (tuple, list)) else None
        if size is not None and len(size) == 2 and isinstance(ch, int):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(1, ch, *size, generator=g).to(device, dtype)
            return {"pixel_values": x}, "pixel_values of the config's image_size and num_channels"
    if isinstance(model, nn.Sequential) and len(model):
        first = model[0]
        if isinstance(first, nn.Linear):
            g = torch.Generator().manual_seed(0)
            return torch.randn(1, first.in_features, generator=g).to(device, first.weight.dtype), \
                "one row of the first nn.Linear's input"
        if isinstance(first, nn.Embedding):
            return torch.zeros(1, 2, dtype=torch.long, device=device), "two tokens of the first nn.Embedding"
        if isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            # the smallest input the convolution maps to at least one output position per axis (the
            # trace runs in eval mode, so a batch norm after it needs no second value)
            pad = first.padding if isinstance(first.padding, tuple) else (0,) * len(first.kernel_size)
            size = [max(1, (k - 1) * d + 1 - 2 * q) for k, d, q in zip(first.kernel_size, first.dilation, pad)]
            g = torch.Generator().manual_seed(0)
            return torch.randn(1, first.in_channels, *size, generator=g).to(device, first.weight.dtype), \
                "one smallest image of the first convolution's input"
    return None, ("the model offers no input to trace (no Hugging Face dummy_inputs or image config, not an "
                  "nn.Sequential starting with nn.Linear, nn.Embedding or a convolution)")


def trace_at_construction(model: nn.Module | None, example_input, params: Iterable[Tensor]) -> tuple[
        Observation | None, str]:
    """The observation the optimizer routes by, made once when it is built: ``(observation, "")``,
    or ``(None, why nothing could be traced)``. Traced: ``example_input`` if given, else what the
    model offers (:func:`offered_input`); a torch.compile'd model through its original module
    (``_orig_mod``), and compiled submodules run eagerly for the trace. An offered input the model
    refuses is no error (the fallback is taken and named); ``example_input`` the model refuses is
    the caller's error and propagates."""
    if model is None:
        return None, "parameters without their model"
    target = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    given = example_input is not None
    if given:
        x, source = example_input, "example_input"
    else:
        x, why = offered_input(target)
        if x is None:
            return None, why
        source = why
    params = list(params)
    with _dynamo_off():
        try:
            obs = observe(target, x, params)
        except Exception as e:
            if given:
                raise
            return None, f"{source} could not be run ({type(e).__name__}: {str(e)[:120]})"
    if not obs.complete:
        return None, f"the traced forward could not be followed ({obs.failure})"
    if source != "example_input":
        obs.source = source
    return obs, ""


def describe_use(obs: Observation, p: Tensor) -> str:
    """A short text of what the observation saw ``p`` do (for a route's reason)."""
    role = obs.role(p)
    if role == "matrix":
        return f"matrix operand of {obs.first_call(p, 'matrix')}"
    if role == "lookup":
        return f"table read by {obs.first_call(p, 'lookup')}"
    if role == "elementwise":
        return f"combined with activations by {re.sub('^__|__$', '', obs.first_call(p, 'elementwise'))}"
    return "not used"


__all__ = ["Observation", "observe", "offered_input", "trace_at_construction", "describe_use", "MATRIX_PRODUCTS",
           "LOOKUPS"]
