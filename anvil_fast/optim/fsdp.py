"""``anvil_fast.ANVIL`` on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Under FSDP2 every parameter is a DTensor sharded by rows (``Shard(0)`` on a 1-D device mesh): rank r
holds rows ``[r * c, (r + 1) * c)`` of each parameter, ``c = ceil(rows / world)`` (the last ranks may
hold fewer, or none). An ANVIL update needs the whole matrix (its Gram products, its lane
energies), so ``ANVIL(model)`` on such a model builds an :class:`FSDPAnvil`:

* **Owners.** Each banked parameter (a matrix, or a stack of matrices) gets one owner rank
  (:func:`assign_owners`): within a bank, every parameter goes to the rank holding the fewest of
  that bank's matrices so far (ties: the least total update work, then the lowest rank). A bank of
  ``n`` single matrices thus leaves each rank ``floor(n / world)`` or ``ceil(n / world)`` of them,
  whatever ``n`` is: nothing is padded, a rank simply runs a smaller bank (a stack is never split,
  so a stack larger than ``ceil(n / world)`` makes its owner the heavier one). The owner keeps the
  parameter's whole fp32 master (bf16 parameter + mantissa, or the fp32 parameter), its rails and
  lane energies; the other ranks keep nothing of it but their FSDP shard.
* **A step** (:meth:`FSDPAnvil.step`): one all-reduce of per-parameter flags (has a gradient, is
  non-finite) so that every rank takes the same decision; one all-to-all carrying every banked
  gradient's shards to its owner, cast to bf16 first (the dtype the bank update reads anyway); the
  owners run an ordinary single-process :class:`~anvil_fast.optim.dropin.DropInAnvil` over the matrices they own
  and, element-wise, over every rank's own shards of the Adam parameters; one all-to-all carrying
  each updated matrix's rows back into every rank's shard. Adam needs no communication.
* **Cost per step** (:meth:`FSDPAnvil.comm_bytes`): each banked matrix crosses the wire twice, minus
  the owner's own rows: ``(world - 1) / world * numel * (2 + itemsize)`` bytes (the bf16 gradient
  to the owner, the weight back in its dtype), plus the flags' all-reduce (a few bytes per parameter).
  FSDP's own all-gather and reduce-scatter are unchanged.

The arithmetic of every matrix and Adam element is the single-process drop-in's (the owner runs the
same bank update on the same bf16 gradient; Adam is element-wise), so an FSDP2 run equals the
single-process run bit for bit where the bank update's result per matrix does not depend on which
other matrices share its bank (the tests check it).

**Checkpoints.** :meth:`FSDPAnvil.state_dict` expresses the state per parameter: rails, mantissas and
Adam moments as DTensors with the parameter's placement (the owner scatters its rows), lane
energies as plain tensors (the same on every rank), so ``torch.distributed.checkpoint`` saves it
once and loads it into an optimizer on any world size (:meth:`FSDPAnvil.load_state_dict` gathers
each matrix's state to its new owner and reads the matrices' weights from the model, so load the
model's state first). A state dict taken with ``torch.save`` on another world size is refused. The
layout is torch's, as the single-process drop-in's (state by position over the param groups, each
group's ``params`` and ``param_names``, the steps taken and skipped in the first group's
``"anvil_fast"`` entry), torch's four state-dict hooks run, and
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` / ``set_optimizer_state_dict``
work; the name-keyed format ``anvil_fast.ANVIL.fsdp/1`` still loads.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from anvil_ref.config import ConfigError
from anvil_ref.constants import ADAM_DEFAULTS, ANVIL_DEFAULTS

from anvil_fast.parallel.comms import LocalComms
from .dropin import (HEAD_NAMES, BankPlan, DropInAnvil, classify, holds_dtensors, merged_state_keys,
                     named_parameters_of, plan_routes, refuse_ddp_with_own_averaging, refuse_dtensors_in)
from .frontend import AnvilFrontend, check_options, hyperparameter_groups, lean_step

#: The format of :meth:`FSDPAnvil.state_dict` (torch's layout; held in the first param group's
#: ``"anvil_fast"`` entry), and the name-keyed one it still loads.
FSDP_FORMAT = "anvil_fast.ANVIL.fsdp/2"
FSDP_STATE_FORMAT = "anvil_fast.ANVIL.fsdp/1"
#: The ANVIL keyword arguments the owners' local optimizer receives unchanged.
_PASSED = ("momentum", "fast_beta", "fast_weight", "beta2", "weight_decay", "adam_betas", "adam_eps",
           "adam_weight_decay", "rails", "total_steps", "lr_scale", "bank_config", "maps", "cuda_graphs", "compile")


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def check_placement(name: str, p: Tensor):
    """The mesh of an FSDP2 parameter: a 1-D device mesh and ``Shard(0)``; anything else refused."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise ConfigError(f"{name}: a DTensor on a {mesh.ndim}-D device mesh {tuple(mesh.shape)}; ANVIL's FSDP2 "
                          "path takes parameters sharded on a 1-D mesh (fully_shard without HSDP or tensor "
                          "parallelism)")
    if tuple(p.placements) != (Shard(0),):
        raise ConfigError(f"{name}: placements {tuple(p.placements)}; ANVIL's FSDP2 path takes parameters sharded "
                          "by rows, placements (Shard(dim=0),) (fully_shard's default)")
    return mesh


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[lo, hi)`` of a dimension of ``rows`` under ``Shard(0)`` (torch.chunk's
    rule: chunks of ``ceil(rows / world)``, the last ones shorter or empty)."""
    c = -(-rows // world)
    lo = min(rows, rank * c)
    return lo, min(rows, lo + c)


def assign_owners(banks: Sequence[BankPlan], world: int) -> dict[str, int]:
    """Parameter name -> owner rank (module docstring): per bank, the rank with the fewest of its
    matrices so far, ties to the least total work (matrices x rows x cols x min(rows, cols), the
    Gram products' cost), then the lowest rank."""
    owner: dict[str, int] = {}
    work = [0] * world
    for b in banks:
        held = [0] * world
        per = b.rows * b.cols * min(b.rows, b.cols)
        for name, _, _, count in b.members:
            r = min(range(world), key=lambda r: (held[r], work[r], r))
            owner[name] = r
            held[r] += count
            work[r] += count * per
    return owner


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class FSDPAnvil(AnvilFrontend):
    """ANVIL on an FSDP2 model (module docstring), a sibling of the drop-in
    :class:`~anvil_fast.optim.dropin.DropInAnvil`. Built by
    ``anvil_fast.ANVIL(model, ...)`` when the model's parameters are DTensors; takes the same
    arguments (Adam runs on FSDP's shards, so ``shard_min_numel`` only picks which of the
    single-process Adam paths runs them; ``comms`` must be None: the mesh's group is used).
    ``opt.owner`` maps each banked parameter to its owner rank; ``opt.local`` is this rank's
    single-process ANVIL (None where a rank holds nothing to update)."""

    def __init__(self, params, lr: float = ANVIL_DEFAULTS["lr"], adam_lr: float = ADAM_DEFAULTS["lr"], *,
                 adam=None, anvil=None, head_names: Sequence[str] = HEAD_NAMES,
                 split_rows: Mapping[str, int] | None = None, nonfinite: str = "skip", shard_min_numel: int = 1 << 16,
                 comms: Any = None, **kw):
        unknown = sorted(set(kw) - set(_PASSED))
        if unknown:
            raise TypeError(f"ANVIL got unexpected keyword arguments {unknown}")
        d = {**DropInAnvil.__init__.__kwdefaults__, **kw}
        anvil_group, adam_group = hyperparameter_groups(
            lr, adam_lr, momentum=d["momentum"], fast_beta=d["fast_beta"], fast_weight=d["fast_weight"],
            beta2=d["beta2"], weight_decay=d["weight_decay"], adam_betas=d["adam_betas"], adam_eps=d["adam_eps"],
            adam_weight_decay=d["adam_weight_decay"])
        # checked here as the drop-in checks them: a rank without a local optimizer must refuse them too
        check_options(d["rails"], d["total_steps"], d["lr_scale"], nonfinite)
        if comms is not None:
            raise ConfigError("comms=: on an FSDP2 model ANVIL communicates on the parameters' device mesh; leave "
                              "comms=None")

        DTensor = _dtensor_type()
        named, module_owners = named_parameters_of(params)
        if not named:
            raise ValueError("ANVIL got no parameters that require gradients")
        plain = [n for n, p in named if not isinstance(p, DTensor)]
        if plain:
            raise ConfigError(f"{plain[0]} (and {len(plain) - 1} more) are plain tensors among DTensor parameters; "
                              "ANVIL's FSDP2 path needs every trainable parameter sharded (fully_shard the whole "
                              "model)")
        meshes = [check_placement(n, p) for n, p in named]
        mesh = meshes[0]
        if any(m != mesh for m in meshes[1:]):
            raise ConfigError("the parameters live on different device meshes; ANVIL's FSDP2 path needs one mesh")
        self.mesh, self.group = mesh, mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self._device = named[0][1].to_local().device
        for n, p in named:
            if p.ndim == 0:
                raise ConfigError(f"{n}: a 0-dim DTensor cannot be sharded by rows")
            lo, hi = shard_rows(p.shape[0], self.world, self.rank)
            if p.to_local().shape[0] != hi - lo:
                raise ConfigError(f"{n}: this rank holds {p.to_local().shape[0]} of its {p.shape[0]} rows, expected "
                                  f"{hi - lo} (Shard(0)'s chunks of ceil(rows / world)); a custom shard placement "
                                  "is not supported")

        routes = classify(named, module_owners, adam=adam, anvil=anvil, head_names=head_names)
        plan = plan_routes(routes, split_rows=split_rows, world_size=1, shard_min_numel=shard_min_numel)
        self.owner: dict[str, int] = assign_owners(plan.banks, self.world)
        self._plan = plan
        self.plan = plan.entries
        route = {r.name: r for r in routes}
        self._mat = [(n, p) for b in plan.banks for n, p, _, _ in b.members]
        self._adam = [(n, p) for n, p, _ in plan.adam]
        self._by_name = dict(self._mat + self._adam)
        self.rails, self.total_steps, self.nonfinite = d["rails"], d["total_steps"], nonfinite
        self.taken_steps = self.skipped_steps = 0
        self._adam_steps = {n: 0 for n, _ in self._adam}
        self.last_step_bytes = 0  #: payload bytes this rank sent to others in its last step (both all-to-alls)
        self._sent = 0
        self.timings: dict[str, float] | None = None  #: set to {} to record each phase's seconds (syncs)

        # this rank's single-process ANVIL: the whole matrices it owns (in their banked form, so the
        # routing rules give the same matrices) and its own shards of the Adam parameters
        full = self._to_owners([n for n, _ in self._mat], {n: p.to_local() for n, p in self._mat})
        local_named: list[tuple[str, Tensor]] = []
        self._local_mat: dict[str, nn.Parameter] = {}
        self._local_adam: dict[str, nn.Parameter] = {}
        for n, _ in self._mat:
            if n in full:
                r = route[n]
                shape = (r.rows, r.cols) if r.count == 1 else (r.count, r.rows, r.cols)
                self._local_mat[n] = nn.Parameter(full[n].reshape(shape).clone())
                local_named.append((n, self._local_mat[n]))
        for n, p in self._adam:
            if p.to_local().numel():
                self._local_adam[n] = nn.Parameter(p.to_local().detach().clone())
                local_named.append((n, self._local_adam[n]))
        self.local: DropInAnvil | None = None
        if local_named:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="ANVIL: no parameter was banked")
                warnings.filterwarnings("ignore", message="ANVIL: these parameters came without their model")
                self.local = DropInAnvil(local_named, lr, adam_lr, anvil=list(self._local_mat),
                                         adam=list(self._local_adam), head_names=(), nonfinite="raise",
                                         comms=LocalComms(), split_rows={n: k for n, k in (split_rows or {}).items()
                                                                         if n in self._local_mat},
                                         shard_min_numel=shard_min_numel, **kw)

        groups = []
        if self._mat:
            groups.append(dict(params=[p for _, p in self._mat], **anvil_group))
        if self._adam:
            groups.append(dict(params=[p for _, p in self._adam], **adam_group))
        self._install_groups(groups, lr, d["momentum"])

    # ------------------------------------------------------------------ introspection
    @property
    def banks(self) -> dict[str, list[str]]:
        return {b.label: [n for n, *_ in b.members] for b in self._plan.banks}

    @property
    def adam_names(self) -> dict[str, str]:
        """Adam parameter name -> "fsdp" (updated on FSDP's shards, no communication)."""
        return {n: "fsdp" for n, _ in self._adam}

    def _route_text(self, e) -> str:
        if e.route == "adam":
            return "adam (FSDP shard)"
        return f"{e.route} [{', '.join(map(str, e.bank_shape))}] owner rank {self.owner[e.name]}"

    def _plan_summary(self) -> list[str]:
        return [f"{len(self._plan.banks)} bank(s) holding {len(self._mat)} parameter(s), each updated whole on "
                f"its owner rank; {len(self._adam)} parameter(s) on Adam (FSDP shards); world size {self.world}; "
                f"{self.comm_bytes()} bytes exchanged per step"]

    def comm_bytes(self) -> int:
        """Bytes all ranks together send per step for the banked parameters (module docstring): every
        row not held by its owner, as a bf16 gradient and as a weight."""
        total = 0
        for n, p in self._mat:
            lo, hi = shard_rows(p.shape[0], self.world, self.owner[n])
            elsewhere = (p.shape[0] - (hi - lo)) * math.prod(p.shape[1:])
            total += elsewhere * (2 + p.dtype.itemsize)
        return total

    # ------------------------------------------------------------------ exchange
    def _all_to_all(self, send: list[list[Tensor]], recv: list[list[tuple[tuple[int, ...], torch.dtype]]]
                    ) -> list[list[Tensor]]:
        """Rank d receives ``send[d]`` (in order) from this rank; this rank receives from rank s the
        tensors ``recv[s]`` describes. One all-to-all of raw bytes (dtypes mixed; each piece padded to
        8 bytes so it can be viewed in its dtype where it lands)."""
        def padded(nbytes: int) -> int:
            return -(-nbytes // 8) * 8

        parts, in_splits = [], []
        for d, ts in enumerate(send):
            n = 0
            for t in ts:
                b = _bytes(t)
                parts.append(b)
                pad = padded(b.numel()) - b.numel()
                if pad:
                    parts.append(torch.zeros(pad, dtype=torch.uint8, device=self._device))
                n += padded(b.numel())
                if d != self.rank:
                    self._sent += b.numel()
            in_splits.append(n)
        out_splits = [sum(padded(math.prod(s) * dt.itemsize) for s, dt in specs) for specs in recv]
        inp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=self._device)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=self._device)
        if self.world == 1:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        res, off = [], 0
        for specs in recv:
            row = []
            for shape, dt in specs:
                nb = math.prod(shape) * dt.itemsize
                row.append(out[off:off + nb].view(dt).view(shape))
                off += padded(nb)
            res.append(row)
        return res

    def _rows(self, name: str, rank: int) -> tuple[int, int]:
        return shard_rows(self._shape(name)[0], self.world, rank)

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._params_by_name()[name].shape)

    def _params_by_name(self) -> dict[str, Tensor]:
        return self._by_name

    def _to_owners(self, keys: Sequence, pieces: Mapping) -> dict:
        """Every rank's rows of ``pieces[key]`` (a key is a parameter name or (name, field); the
        rows follow the parameter's sharding) -> the whole tensor at the parameter's owner."""
        name = (lambda k: k if isinstance(k, str) else k[0])
        send = [[] for _ in range(self.world)]
        for k in keys:
            send[self.owner[name(k)]].append(pieces[k])
        mine = [k for k in keys if self.owner[name(k)] == self.rank]
        recv = []
        for s in range(self.world):
            specs = []
            for k in mine:
                lo, hi = self._rows(name(k), s)
                specs.append(((hi - lo, *pieces[k].shape[1:]), pieces[k].dtype))
            recv.append(specs)
        got = self._all_to_all(send, recv)
        return {k: torch.cat([got[s][i] for s in range(self.world)]) for i, k in enumerate(mine)}

    def _from_owners(self, keys: Sequence, wholes: Mapping, dtypes: Mapping) -> dict:
        """The owner's ``wholes[key]`` (shaped like the parameter) -> every rank's own rows of it."""
        name = (lambda k: k if isinstance(k, str) else k[0])
        send = [[] for _ in range(self.world)]
        for k in keys:
            if self.owner[name(k)] == self.rank:
                for d in range(self.world):
                    lo, hi = self._rows(name(k), d)
                    send[d].append(wholes[k][lo:hi])
        recv = [[] for _ in range(self.world)]
        order = {s: [] for s in range(self.world)}
        for k in keys:
            lo, hi = self._rows(name(k), self.rank)
            recv[self.owner[name(k)]].append(((hi - lo, *self._shape(name(k))[1:]), dtypes[k]))
            order[self.owner[name(k)]].append(k)
        got = self._all_to_all(send, recv)
        return {k: got[s][i] for s in range(self.world) for i, k in enumerate(order[s])}

    # ------------------------------------------------------------------ step
    def _hand_over(self, values: Mapping[str, Mapping[str, Any]]) -> None:
        """The checked group values to the owners' drop-in (which hands them on to its kernels)."""
        if self.local is not None:
            for g in self.local.param_groups:
                g.update(values[g["kind"]])

    def _tick(self, phase: str, t0: float) -> float:
        import time

        if self.timings is None:
            return t0
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - t0
        return now

    @lean_step
    def step(self, closure=None):
        """One step (module docstring); returns the closure's loss."""
        import time

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = self._tick("prepare", time.perf_counter())
        self._sent = 0
        self._apply_groups(lambda: self.taken_steps, every_step=True)
        DTensor = _dtensor_type()
        entries = [(n, p, True) for n, p in self._mat] + [(n, p, False) for n, p in self._adam]
        local: dict[str, Tensor] = {}
        for n, p, banked in entries:
            g = p.grad
            if g is None:
                continue
            if not isinstance(g, DTensor) or tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype \
                    or tuple(g.placements) != tuple(p.placements):
                raise ValueError(f"{n}: gradient {type(g).__name__} {g.dtype} {tuple(g.shape)} does not match the "
                                 f"parameter's DTensor {p.dtype} {tuple(p.shape)} {tuple(p.placements)}; nothing "
                                 "was updated")
            g = g.to_local()
            local[n] = g.to(torch.bfloat16) if banked else g  # a bank reads its gradient in bf16
        # per parameter: has a gradient, has none, is non-finite here (its largest |value| is NaN or
        # inf: max-abs propagates both, and a finite gradient cannot overflow it); one fused pass per
        # dtype, one all-reduce (MAX: "has" and "has none" both 1 = the ranks disagree), one host sync
        has_here = torch.tensor([float(n in local) for n, _, _ in entries])
        by_dtype: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
        for i, (n, _, _) in enumerate(entries):
            if n in local and local[n].numel():
                by_dtype.setdefault(local[n].dtype, []).append((i, local[n]))
        parts, where, k = [], [None] * len(entries), 0
        for group in by_dtype.values():
            norms = torch.stack(torch._foreach_norm([t for _, t in group], ord=math.inf))
            parts.append((~torch.isfinite(norms)).float())
            for j, (i, _) in enumerate(group):
                where[i] = k + j
            k += len(group)
        parts.append(torch.zeros(1, device=self._device))  # the entries without a (non-empty) gradient
        order = torch.tensor([k if w is None else w for w in where], device=self._device)
        flags = torch.cat([torch.stack([has_here, 1 - has_here]).to(self._device), torch.cat(parts)[order][None]])
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        has, has_not, bad = flags.cpu().tolist()
        split = [entries[i][0] for i, (h, hn) in enumerate(zip(has, has_not)) if h and hn]
        if split:
            raise ValueError(f"{split[0]} has a gradient on some of the {self.world} ranks and none on others; the "
                             "ranks must agree on which parameters have gradients; nothing was updated")
        nonfinite = [entries[i][0] for i, b in enumerate(bad) if b]
        if nonfinite:
            self._skip_or_raise(nonfinite, world_size=self.world, stacklevel=3)
            return loss
        with_grad = [n for (n, _, _), h in zip(entries, has) if h]
        mats = [n for n, _ in self._mat if n in local]
        t0 = self._tick("prepare", t0)
        full = self._to_owners(mats, local)
        t0 = self._tick("exchange", t0)
        for n, t in self._local_mat.items():
            t.grad = full[n].reshape(t.shape).to(t.dtype) if n in full else None
        by_name = self._params_by_name()
        for n, t in self._local_adam.items():
            t.copy_(by_name[n].to_local())  # the model's shard is the value (it may have been loaded or edited)
            t.grad = local.get(n)
        if self.local is not None:
            self.local.step()
            for t in list(self._local_mat.values()) + list(self._local_adam.values()):
                t.grad = None
        t0 = self._tick("update", t0)
        wholes = {n: self._local_mat[n].detach().reshape(self._shape(n)) for n in mats if n in self._local_mat}
        back = self._from_owners(mats, wholes, {n: by_name[n].dtype for n in mats})
        for n in mats:
            by_name[n].to_local().copy_(back[n])
        t0 = self._tick("exchange", t0)
        for n in with_grad:
            if n in self._local_adam:
                by_name[n].to_local().copy_(self._local_adam[n])
            if n in self._adam_steps:
                self._adam_steps[n] += 1
        self.taken_steps += 1
        self.last_step_bytes = self._sent
        self._tick("update", t0)
        return loss

    # ------------------------------------------------------------------ state
    def _bank_slices(self, name: str) -> dict[str, Tensor]:
        """The owner's live state of a banked parameter, in its banked form [count, rows, cols]."""
        return self.local.banked_state(name)

    def _lane_shape(self, name: str) -> tuple[int, int, int]:
        e = next(e for e in self.plan if e.name == name)
        count, (rows, cols) = e.slots[1] - e.slots[0], e.bank_shape[1:]
        return (count, rows, 1) if rows >= cols else (count, 1, cols)

    def _dtensor(self, local: Tensor, like: Tensor):
        from torch.distributed.tensor import DTensor, Shard

        shape = tuple(like.shape)
        stride = tuple(torch.empty(shape, device="meta").stride())
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    def _names_in_groups(self) -> list[str]:
        by_id = {id(p): n for n, p in self._mat + self._adam}
        return [by_id[id(p)] for g in self.param_groups for p in g["params"]]

    def _state_dict(self) -> dict[str, Any]:
        """torch's format (as the drop-in's: ``"state"`` by position over the param groups,
        ``"params"`` and ``"param_names"`` in each group, the optimizer-wide values in the first
        group's ``"anvil_fast"`` entry) over :meth:`_named_state` (the base runs torch's state-dict
        hooks around it). Collective (every rank calls it)."""
        named = self._named_state()
        names = self._names_in_groups()
        groups, i = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n)),
                           "param_names": names[i:i + n]})
            i += n
        groups[0]["anvil_fast"] = {"format": FSDP_FORMAT, "taken_steps": named["taken_steps"],
                                   "skipped_steps": named["skipped_steps"]}
        return {"state": {k: named["state"][n] for k, n in enumerate(names)}, "param_groups": groups}

    def _load_state_dict(self, sd) -> None:
        """Restore :meth:`state_dict`'s output (by position, as torch does; or a name-keyed state
        dict of the format ``anvil_fast.ANVIL.fsdp/1``; the base runs torch's load hooks around
        it); then as :meth:`_load_named`. Collective."""
        if not (isinstance(sd, Mapping) and sd.get("format") == FSDP_STATE_FORMAT):
            sd = self._named_from_torch_format(sd)
        self._load_named(sd)

    def _named_from_torch_format(self, sd) -> dict[str, Any]:
        groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
        extras = groups[0].get("anvil_fast") if isinstance(groups, (list, tuple)) and groups and \
            isinstance(groups[0], Mapping) else None
        if not isinstance(extras, Mapping) or extras.get("format") != FSDP_FORMAT or \
                not isinstance(sd.get("state"), Mapping):
            fmt = extras.get("format") if isinstance(extras, Mapping) else (
                sd.get("format") if isinstance(sd, Mapping) else type(sd).__name__)
            raise ValueError(f"not an FSDP2 anvil_fast.ANVIL state dict (format {fmt!r}, expected {FSDP_FORMAT!r} in "
                             f"the first param group's 'anvil_fast' entry, or {FSDP_STATE_FORMAT!r})")
        if len(groups) != len(self.param_groups) or any(len(g["params"]) != len(h["params"])
                                                        for g, h in zip(groups, self.param_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        ids = [i for g in groups for i in g["params"]]
        name_of = dict(zip(ids, self._names_in_groups()))
        state = merged_state_keys(sd["state"])
        unknown = [k for k in state if k not in name_of]
        if unknown:
            raise ValueError(f"state dict: state entries {unknown[:4]} belong to no parameter of its param groups")
        return {"format": FSDP_STATE_FORMAT, "state": {name_of[k]: v for k, v in state.items()},
                "param_groups": [{k: v for k, v in g.items() if k not in ("params", "param_names", "anvil_fast")}
                                 for g in groups],
                "taken_steps": extras["taken_steps"], "skipped_steps": extras["skipped_steps"]}

    def __reduce_ex__(self, protocol):
        raise TypeError("an FSDP2 ANVIL is not copied or pickled (its parameters are shards across ranks): save "
                        "opt.state_dict() with torch.distributed.checkpoint and build a new optimizer to load it")

    @torch.no_grad()
    def _named_state(self) -> dict[str, Any]:
        """The state per parameter name, resharding-ready (module docstring): collective."""
        by_name = self._params_by_name()
        fields = ("fast_rail", "slow_rail", "mantissa")
        keys = [(n, f) for n, _ in self._mat for f in fields]
        wholes = {}
        for n in self._local_mat:
            sl = self._bank_slices(n)
            for f in fields:
                wholes[(n, f)] = sl[f].reshape(by_name[n].shape)
        dtypes = {(n, f): (torch.uint16 if f == "mantissa" else torch.float32) for n, f in keys}
        rows = self._from_owners(keys, wholes, dtypes)
        state: dict[str, dict[str, Any]] = {}
        for n, p in self._mat:
            st = {f: self._dtensor(rows[(n, f)].clone(), p) for f in fields}
            lane = (self._bank_slices(n)["lane_energy"].clone() if n in self._local_mat
                    else torch.empty(self._lane_shape(n), dtype=torch.float32, device=self._device))
            if self.world > 1:
                dist.broadcast(lane, src=dist.get_global_rank(self.group, self.owner[n]), group=self.group)
            st["lane_energy"] = lane
            state[n] = st
        for n, p in self._adam:
            if n in self._local_adam:
                ps = self.local.state[self._local_adam[n]]
                m, v = ps["exp_avg"].clone(), ps["exp_avg_sq"].clone()
            else:
                m = torch.zeros(p.to_local().shape, dtype=torch.float32, device=self._device)
                v = m.clone()
            state[n] = dict(step=self._adam_steps[n], exp_avg=self._dtensor(m, p), exp_avg_sq=self._dtensor(v, p))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"format": FSDP_STATE_FORMAT, "state": state, "param_groups": groups,
                "taken_steps": self.taken_steps, "skipped_steps": self.skipped_steps}

    @torch.no_grad()
    def _load_named(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`_named_state`'s output (from ``torch.distributed.checkpoint`` on any world
        size, or a ``torch.save``'d one of this world size, each rank its own file: DTensors do not
        record which rank saved them), then read the banked matrices' weights from the model (load
        the model first). Collective. Everything is checked before anything is written."""
        DTensor = _dtensor_type()
        sd = state_dict
        groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
        if not isinstance(sd, Mapping) or sd.get("format") != FSDP_STATE_FORMAT or groups is None \
                or len(groups) != len(self.param_groups):
            fmt = sd.get("format") if isinstance(sd, Mapping) else type(sd).__name__
            raise ValueError(f"not an FSDP2 anvil_fast.ANVIL state dict of this plan (format {fmt!r}, expected "
                             f"{FSDP_STATE_FORMAT!r} with {len(self.param_groups)} param groups)")
        for g, saved in zip(self.param_groups, groups):
            if g["kind"] != saved.get("kind"):
                raise ValueError(f"param group kinds differ: {g['kind']} vs {saved.get('kind')}")
        by_name = self._params_by_name()
        state = sd["state"]
        if set(state) != set(by_name):
            missing, extra = sorted(set(by_name) - set(state)), sorted(set(state) - set(by_name))
            raise ConfigError(f"state dict parameters differ from this optimizer's (missing {missing[:4]}, "
                              f"unknown {extra[:4]})")
        banked = {n for n, _ in self._mat}
        for n, p in by_name.items():
            want = {"fast_rail", "slow_rail", "mantissa", "lane_energy"} if n in banked else \
                {"step", "exp_avg", "exp_avg_sq"}
            if not isinstance(state[n], Mapping) or set(state[n]) != want:
                got = sorted(state[n]) if isinstance(state[n], Mapping) else type(state[n]).__name__
                raise ConfigError(f"{n}: saved state {got}, expected {sorted(want)} (a "
                                  f"{'banked matrix' if n in banked else 'Adam parameter'} here)")
            for f, v in state[n].items():
                if f == "step":
                    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                        raise ConfigError(f"{n}.step: {v!r}, expected an int >= 0")
                    continue
                want_dtype = torch.uint16 if f == "mantissa" else torch.float32
                if not isinstance(v, Tensor) or v.dtype != want_dtype:
                    raise ConfigError(f"{n}.{f}: saved {getattr(v, 'dtype', type(v).__name__)}, expected {want_dtype}")
                if f == "lane_energy":
                    if isinstance(v, DTensor) or tuple(v.shape) != self._lane_shape(n):
                        raise ConfigError(f"{n}.{f}: saved {tuple(v.shape)}, expected a plain tensor "
                                          f"{self._lane_shape(n)}")
                    continue
                if not isinstance(v, DTensor):
                    raise ConfigError(f"{n}.{f}: a {type(v).__name__}, expected a DTensor sharded like the parameter")
                if v.device_mesh.size() != self.world:
                    raise ConfigError(
                        f"{n}.{f} was saved on {v.device_mesh.size()} rank(s) and this optimizer runs on {self.world}: "
                        "a torch.save'd state dict holds one world size's shards; save and load with "
                        "torch.distributed.checkpoint (dcp.save(opt.state_dict()); dcp.load(sd := opt.state_dict()); "
                        "opt.load_state_dict(sd)), which reshards")
                if tuple(v.shape) != tuple(p.shape) or tuple(v.to_local().shape) != tuple(p.to_local().shape):
                    raise ConfigError(f"{n}.{f}: saved {tuple(v.shape)} (this rank's {tuple(v.to_local().shape)}), "
                                      f"expected {tuple(p.shape)} ({tuple(p.to_local().shape)})")
        # ---- write
        fields = ("fast_rail", "slow_rail", "mantissa")
        keys = [(n, f) for n, _ in self._mat for f in fields]
        got = self._to_owners(keys, {(n, f): state[n][f].to_local() for n, f in keys})
        for n in self._local_mat:
            live = self._bank_slices(n)
            for f in fields:
                if f == "mantissa" and live["own_master"]:
                    continue  # pull_weights below reads the whole float32 master from the model
                live[f].copy_(got[(n, f)].reshape(live[f].shape))
            live["lane_energy"].copy_(state[n]["lane_energy"])
        for n, _ in self._adam:
            self._adam_steps[n] = int(state[n]["step"])
            if n in self._local_adam:
                ps = self.local.state[self._local_adam[n]]
                ps["exp_avg"].copy_(state[n]["exp_avg"].to_local())
                ps["exp_avg_sq"].copy_(state[n]["exp_avg_sq"].to_local())
                if isinstance(ps["step"], Tensor):  # the one-process step's device count (a 0-D view)
                    ps["step"].fill_(self._adam_steps[n])
                else:
                    ps.write("step", self._adam_steps[n])
        self.pull_weights()
        for g, saved in zip(self.param_groups, groups):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        self.taken_steps = int(sd["taken_steps"])
        self.skipped_steps = int(sd["skipped_steps"])
        if self.local is not None:
            self.local.taken_steps, self.local.skipped_steps = self.taken_steps, self.skipped_steps

    @torch.no_grad()
    def pull_weights(self) -> None:
        """Read every banked matrix's weight from the model's shards into its owner (collective). A
        bf16 matrix's master is the model's bf16 value joined with the owner's mantissa. Needed
        after the model's weights were changed outside ``step`` (a loaded checkpoint)."""
        full = self._to_owners([n for n, _ in self._mat], {n: p.to_local() for n, p in self._mat})
        for n, t in self._local_mat.items():
            t.copy_(full[n].reshape(t.shape))


__all__ = ["FSDPAnvil", "FSDP_FORMAT", "FSDP_STATE_FORMAT", "assign_owners", "shard_rows", "check_placement", "holds_dtensors",
           "refuse_ddp_with_own_averaging", "refuse_dtensors_in"]

