"""A float64 reference of the drop-in ``anvil_fast.ANVIL``, built from the user's arguments alone.

Nothing here reads the optimizer under test: the routing (which parameter is a matrix, how it is
viewed as matrices, their rows/cols and learning-rate scale; which parameter goes to Adam) is
constructed from the model and the keyword arguments by the drop-in specification's rules, and each
step is anvil_ref's math per matrix:

    rails   = twin_rail(g, v_fast, v_slow; momentum, fast_beta, fast_weight)     (anvil_ref.rails)
    U       = cascade(rails.lookahead; maps)                                     (anvil_ref.cascade)
    U', E'  = equalize(U, E; beta2)                                              (anvil_ref.equalizer)
    P'      = sign_aligned_update(P, U', v_slow'; eff_lr = lr * scale(rows, cols),
                                  eff_wd = weight_decay * lr)                    (anvil_ref.update)

and Adam is ``anvil_ref.adam.adam_update`` with lr = adam_lr, the group's betas, eps and weight
decay. Grouping matrices into banks does not change this math (the drop-in has no per-bank
multiplier), so the reference works per parameter, each a stack of its matrices.

Storage: a matrix's master is an exact fp32 value (an fp32 parameter itself, or a bf16 parameter
joined with its mantissa, which starts at zero), held here in float64 without rounding; an Adam
parameter is stored in its own dtype, so a bf16 one is rounded to bf16 (to nearest) after each step.

A parameter without a gradient is not touched (the specification), also when other matrices of
its bank have one.

Group values live in :attr:`DropinReference.groups` (``"anvil"`` and ``"adam"``, the keys of the
drop-in's param_groups); a test changes them in both places between steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from anvil_ref.adam import adam_update
from anvil_ref.cascade import cascade
from anvil_ref.config import ConfigError
from anvil_ref.constants import ADAM_DEFAULTS, ANVIL_DEFAULTS, ANVIL_MAPS
from anvil_ref.equalizer import equalize, lane_energy_shape
from anvil_ref.maps import load_maps
from anvil_ref.rails import rail_scalars, twin_rail
from anvil_ref.update import sign_aligned_update

#: The specification's default ``head_names``, written from its text rather than imported from the
#: optimizer under test, so that a change of the optimizer's default shows up as a routing difference.
SPEC_HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")
SPEC_ADAM_BETAS = (0.9, 0.95)
MATRIX_DTYPES = (torch.float32, torch.bfloat16)
COMPILED_PREFIX = "_orig_mod."


@dataclass(frozen=True)
class Route:
    """One parameter's route: ``kind`` "matrix" or "adam", the spec's reason, and for matrices the
    stack ``[n, rows, cols]`` its value is viewed as (after any split_rows), stored transposed when
    ``transposed`` (the layer reads each matrix as ``[in, out]``)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    reason: str
    stack: tuple[int, int, int] | None = None
    transposed: bool = False


def _rule(rule) -> Callable[[str], bool]:
    if rule is None:
        return lambda name: False
    if callable(rule):
        return lambda name: bool(rule(name))
    names = set(rule)
    return lambda name: name in names


def named_parameters(params) -> tuple[list[tuple[str, Tensor]], dict[int, list[tuple[str, nn.Module]]]]:
    """``(name, parameter)`` pairs (first name wins for a shared tensor; compiled prefixes stripped;
    parameters not requiring grad left out) and, for a module, parameter id -> every (module name,
    module) owning it directly."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    if isinstance(params, nn.Module):
        for mname, mod in params.named_modules(remove_duplicate=False):
            for _, p in mod.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append((mname.replace(COMPILED_PREFIX, ""), mod))
        pairs = list(params.named_parameters())
    else:
        items = list(params)
        pairs = [it if isinstance(it, tuple) else (f"param{i}", it) for i, it in enumerate(items)]
    seen, out = set(), []
    for name, p in pairs:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((name.replace(COMPILED_PREFIX, ""), p))
    return out, owners


def matrix_stack(shape: Sequence[int], *, conv: bool, split: int) -> tuple[int, int, int]:
    """The ``[n, rows, cols]`` stack of a matrix-routed parameter: a convolution's weight is
    ``[d0, d1*d2*...]``, a 2-D parameter ``[d0, d1]``, a 3-D one ``d0`` matrices ``[d1, d2]``; then
    ``split`` equal row blocks per matrix."""
    if conv:
        n, rows, cols = 1, shape[0], math.prod(shape[1:])
    elif len(shape) == 2:
        n, rows, cols = 1, shape[0], shape[1]
    else:
        n, rows, cols = shape
    return n * split, rows // split, cols


def route_parameters(params, *, adam=None, anvil=None, head_names: Sequence[str] = SPEC_HEAD_NAMES,
                     split_rows: Mapping[str, int] | None = None) -> list[Route]:
    """The specification's routing, first matching rule wins (dropin_spec "Routing")."""
    named, owners = named_parameters(params)
    is_anvil, is_adam = _rule(anvil), _rule(adam)
    split_rows = dict(split_rows or {})
    embedding_ids = {id(m.weight) for ms in owners.values() for _, m in ms
                     if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    conv_ids = {id(m.weight) for ms in owners.values() for _, m in ms
                if isinstance(m, nn.modules.conv._ConvNd)}
    # weights stored [in, out]: transformers' Conv1D (by its class name) and transposed convolutions
    transposed_ids = {id(m.weight) for ms in owners.values() for _, m in ms
                      if (type(m).__name__ == "Conv1D" and m.weight.ndim == 2)
                      or (isinstance(m, nn.modules.conv._ConvNd) and m.transposed)}
    routes = []
    for name, p in named:
        shape = tuple(p.shape)
        mods = [mname for mname, _ in owners.get(id(p), [])] or [name.rsplit(".", 1)[0] if "." in name else ""]
        head = any(m.rsplit(".", 1)[-1] in head_names for m in mods)
        if is_anvil(name):
            if p.ndim < 2:
                raise ConfigError(f"{name}: anvil= needs ndim >= 2, got shape {shape}")
            kind, reason = "matrix", "anvil="
        elif is_adam(name):
            kind, reason = "adam", "adam="
        elif p.ndim < 2:
            kind, reason = "adam", "scalar/vector"
        elif id(p) in embedding_ids:
            kind, reason = "adam", "embedding"
        elif head:
            kind, reason = "adam", "output head"
        elif id(p) in conv_ids:
            kind, reason = "matrix", "conv (flattened)"
        elif id(p) in transposed_ids:
            kind, reason = "matrix", "Conv1D weight [in, out] (transposed)"
        elif p.shape[0] == 1 and not any(isinstance(m, nn.Linear) and m.weight is p
                                         for ms in owners.values() for _, m in ms):
            kind, reason = "adam", "broadcast table (leading dimension of size 1, not observed)"
        elif p.ndim == 2:
            kind, reason = "matrix", "matrix"
        elif p.ndim == 3:
            kind, reason = "matrix", "stack"
        else:
            raise ConfigError(f"{name}: no rule covers shape {shape}; pass adam=[{name!r}]")
        stack = None
        if kind == "matrix":
            if p.dtype not in MATRIX_DTYPES or 0 in shape:
                raise ConfigError(f"{name}: a matrix must be float32/bfloat16 and non-empty, got {p.dtype} {shape}")
            # a parameter forced by anvil= with ndim > 3 has no stack rule: flattened as a convolution
            k = int(split_rows.get(name, 1))
            n, rows, cols = matrix_stack(shape, conv=id(p) in conv_ids or p.ndim > 3, split=1)
            if rows % k:
                raise ConfigError(f"{name}: split_rows={k} does not divide {rows} rows")
            if k != 1 and id(p) in transposed_ids:
                raise ConfigError(f"{name}: split_rows= on a weight stored [in, out] would split its inputs")
            stack = (n * k, rows // k, cols)
        routes.append(Route(name, shape, kind, reason, stack, kind == "matrix" and id(p) in transposed_ids))
    return routes


def lr_scale(rows: int, cols: int, convention: str) -> float:
    """The per-matrix learning-rate scale of the specification."""
    if convention == "seed":
        return max(1.0, rows / cols) ** 0.5
    if convention == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"lr_scale: expected 'seed' or 'match_rms_adamw', got {convention!r}")


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().copy()


def _store(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """An Adam parameter as its storage holds it (round to nearest in its dtype)."""
    if dtype == torch.float64:
        return x
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).to(dtype).to(torch.float64).numpy()


class DropinReference:
    """The drop-in's float64 reference (module docstring); arguments as ``anvil_fast.ANVIL``'s
    (communication and performance arguments are accepted and do not change the math)."""

    def __init__(self, params, lr: float = ANVIL_DEFAULTS["lr"], adam_lr: float = ADAM_DEFAULTS["lr"], *,
                 momentum: float = ANVIL_DEFAULTS["momentum"], fast_beta: float | None = None,
                 fast_weight: float = 1.0, beta2: float = ANVIL_DEFAULTS["beta2"],
                 weight_decay: float = ANVIL_DEFAULTS["weight_decay"], adam_betas=SPEC_ADAM_BETAS,
                 adam_eps: float = ADAM_DEFAULTS["eps"], adam_weight_decay: float = ADAM_DEFAULTS["weight_decay"],
                 rails: str = "nesterov", total_steps: int | None = None, lr_scale: str = "seed",
                 adam=None, anvil=None, head_names: Sequence[str] = SPEC_HEAD_NAMES, split_rows=None,
                 nonfinite: str = "skip", maps=None, **_ignored: Any):
        # the specification's routing without a traced forward (the tests step from given
        # gradients and never run one): module types, names and shapes
        self.routes = route_parameters(params, adam=adam, anvil=anvil, head_names=head_names, split_rows=split_rows)
        named = dict(named_parameters(params)[0])
        self.maps = load_maps(ANVIL_MAPS if maps is None else maps)
        self.rails, self.total_steps, self.lr_scale, self.nonfinite = rails, total_steps, lr_scale, nonfinite
        self.groups = {
            "anvil": dict(lr=lr, momentum=momentum, fast_beta=fast_beta, fast_weight=fast_weight, beta2=beta2,
                          weight_decay=weight_decay),
            "adam": dict(lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps, weight_decay=adam_weight_decay),
        }
        self.values: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.state: dict[str, dict[str, Any]] = {}
        for r in self.routes:
            p = named[r.name]
            self.dtypes[r.name] = p.dtype
            if r.kind == "matrix":
                self.values[r.name] = _f64(p).reshape(r.stack)
                self.state[r.name] = dict(fast_rail=np.zeros(r.stack), slow_rail=np.zeros(r.stack),
                                          lane_energy=np.zeros(lane_energy_shape(r.stack, transposed=r.transposed)))
            else:
                self.values[r.name] = _f64(p)
                self.state[r.name] = dict(step=0, exp_avg=np.zeros(r.shape), exp_avg_sq=np.zeros(r.shape))
        self.taken_steps = 0
        self.skipped_steps = 0

    # ------------------------------------------------------------------ views
    def route(self, name: str) -> Route:
        return next(r for r in self.routes if r.name == name)

    def value(self, name: str) -> np.ndarray:
        """The parameter's value (float64) in its own shape."""
        return self.values[name].reshape(self.route(name).shape)

    # ------------------------------------------------------------------ one step
    def _matrix_step(self, r: Route, g: np.ndarray, hp: Mapping[str, float]) -> None:
        """One matrix step; a transposed parameter steps as the ``[out, in]`` stack it stores
        transposed (the same layer in nn.Linear's layout), and is stored back transposed."""
        st = self.state[r.name]
        t = (lambda x: np.ascontiguousarray(np.swapaxes(x, -1, -2))) if r.transposed else (lambda x: x)
        fast_beta = hp["momentum"] if hp["fast_beta"] is None else hp["fast_beta"]
        rails = twin_rail(t(g.reshape(r.stack)), t(st["fast_rail"]), t(st["slow_rail"]), momentum=hp["momentum"],
                          fast_beta=fast_beta, fast_weight=hp["fast_weight"])
        u = cascade(rails.lookahead, maps=self.maps)
        u, energy = equalize(u, t(st["lane_energy"]), beta2=hp["beta2"])
        n, rows, cols = r.stack
        eff_lr = hp["lr"] * (lr_scale(cols, rows, self.lr_scale) if r.transposed else lr_scale(rows, cols, self.lr_scale))
        self.values[r.name] = t(sign_aligned_update(t(self.values[r.name]), u, rails.v_slow, eff_lr=eff_lr,
                                                    eff_wd=hp["weight_decay"] * hp["lr"]))
        self.state[r.name] = dict(fast_rail=t(rails.v_fast), slow_rail=t(rails.v_slow), lane_energy=t(energy))

    def _adam_step(self, r: Route, g: np.ndarray, hp: Mapping[str, Any]) -> None:
        st = self.state[r.name]
        b1, b2 = hp["betas"]
        t = st["step"] + 1
        res = adam_update(self.values[r.name], g, st["exp_avg"], st["exp_avg_sq"], step=t, lr=hp["lr"],
                          beta1=b1, beta2=b2, eps=hp["eps"], weight_decay=hp["weight_decay"])
        self.values[r.name] = _store(res.p, self.dtypes[r.name] if self.dtypes[r.name] == torch.bfloat16
                                     else torch.float64)
        self.state[r.name] = dict(step=t, exp_avg=res.exp_avg, exp_avg_sq=res.exp_avg_sq)

    def step(self, grads: Mapping[str, torch.Tensor | None]) -> bool:
        """One drop-in step from ``name -> gradient`` (None or a missing name: no gradient, the
        parameter is not touched). Returns whether the step was taken (False: skipped for a
        non-finite gradient)."""
        g64 = {n: _f64(g) for n, g in grads.items() if g is not None}
        bad = sorted(n for n, g in g64.items() if not np.isfinite(g).all())
        if bad:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"non-finite gradient in {bad}")
            self.skipped_steps += 1
            return False
        if self.rails == "record":
            if self.total_steps is None or self.taken_steps >= self.total_steps:
                raise ValueError(f"rails='record': step {self.taken_steps} is past total_steps={self.total_steps}")
            s = rail_scalars(self.taken_steps, self.total_steps)
            self.groups["anvil"].update(momentum=s.momentum, fast_beta=s.fast_beta, fast_weight=s.fast_weight)
        for r in self.routes:
            if r.name not in g64:
                continue
            if r.kind == "matrix":
                self._matrix_step(r, g64[r.name], self.groups["anvil"])
            else:
                self._adam_step(r, g64[r.name], self.groups["adam"])
        self.taken_steps += 1
        return True


__all__ = ["DropinReference", "Route", "route_parameters", "matrix_stack", "lr_scale", "SPEC_HEAD_NAMES"]
