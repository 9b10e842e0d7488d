"""The drop-in's torch.optim contract: its state dict in torch's format (saved and loaded by
position, checked before anything is written, a saved plan adopted by name, the label-keyed format
``anvil_fast.ANVIL/1`` still loaded), the live ``opt.state[p]`` views, and copies (deepcopy,
pickle, torch.save rebuild the optimizer from its parameters, arguments, plan and state dict).
:class:`TorchContract` holds these methods for :class:`anvil_fast.optim.dropin.DropInAnvil`, which
supplies the plan, the banks and the inner optimizer they read (:func:`anvil_fast.optim.entry.ANVIL`'s
docstring, "State dict" and "Copies").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from anvil_ref.config import ConfigError

from .frontend import check_hyperparameters

STATE_FORMAT = "anvil_fast.ANVIL/2"
#: The format of the state dicts keyed by bank label (still loaded: :meth:`DropInAnvil.load_state_dict`).
LEGACY_STATE_FORMAT = "anvil_fast.ANVIL/1"
#: The key of the first saved param group that holds the optimizer-wide values (a state dict's
#: top-level keys beyond "state" and "param_groups" do not survive torch.distributed.checkpoint).
EXTRAS_KEY = "anvil_fast"


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


class TorchContract:
    """The state-dict and copy methods of :class:`anvil_fast.optim.dropin.DropInAnvil` (module
    docstring)."""

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


__all__ = ["TorchContract", "STATE_FORMAT", "LEGACY_STATE_FORMAT", "EXTRAS_KEY", "merged_state_keys"]
