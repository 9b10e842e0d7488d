"""``anvil_fast.ANVIL``: ANVIL + Adam for any model, as a ``torch.optim.Optimizer``.

Give it a model (or its named parameters) and it sorts the parameters the way the record does by
hand:

* **banks (ANVIL)**: 2-D hidden matrices. Matrices of equal shape and dtype are stacked into one
  bank ``[n, rows, cols]``; each model parameter becomes a view of its bank (so the model reads the
  bank, zero-copy, and ``state_dict`` still holds the parameter under its own name). In
  torch.distributed the bank is padded with frozen zero matrices to a multiple of the world size
  (as the record pads its qk and vo banks) and sharded by matrix.
* **Adam**: everything else -- 0-D and 1-D parameters (scalars, norms, biases), embedding tables
  (the weights of ``nn.Embedding``/``nn.EmbeddingBag``), and output heads (a 2-D parameter of a
  module named ``lm_head``, ``head``, ``classifier``, ``fc_out`` or ``output_layer``, or with a
  dimension equal to an embedding's vocabulary size). Large ones (``numel >= shard_min_numel`` and a
  first dimension the world size divides) are sharded, the rest replicated on flat buffers.
* A parameter no rule covers (3-D and higher, or a dtype other than float32/bfloat16 for a bank) is
  refused with an error naming it; ``adam=[names]`` or ``anvil=[names]`` decide explicitly.

bf16 matrices get the seed's storage (bf16 parameter + uint16 mantissa = an exact fp32 master).
float32 matrices stay float32: the parameter itself is the master, split exactly into those halves
around every update (``allow_fp32_banks`` of :class:`~anvil_fast.optimizer.AnvilAndAdam`).

It behaves like a ``torch.optim.Optimizer``: two ``param_groups`` (``kind`` "anvil" and "adam")
whose ``lr`` (and ``momentum``, ``weight_decay``, ``betas``, ...) LR schedulers and you may change
between steps, ``zero_grad``, ``step(closure)``, ``state_dict``/``load_state_dict``. It runs on CPU
(plain torch, no Triton needed), on one GPU, and under torch.distributed (initialize the process
group first and do **not** wrap the model in DDP: the optimizer averages the gradients itself,
with reduce-scatters and all-gathers; start every rank from the same weights). ``step()`` leaves
``.grad`` as it found it; Adam runs every step.

Example (a ten-line training loop)::

    import torch, anvil_fast
    model = MyTransformer().cuda()
    opt = anvil_fast.ANVIL(model, lr=0.02, adam_lr=0.008)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 1000)
    for step, (x, y) in zip(range(1000), loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from anvil_ref.config import ConfigError
from anvil_ref.constants import ADAM_DEFAULTS, ANVIL_DEFAULTS

from .optimizer import AnvilAndAdam, NonFiniteGradientError

#: Module names (last component) whose 2-D weights are output heads, hence Adam.
HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")
BANK_DTYPES = (torch.bfloat16, torch.float32)


def _named(params) -> tuple[list[tuple[str, Tensor]], dict[str, str]]:
    """(name, param) pairs, deduplicated by identity, and name -> kind of the owning module."""
    kinds: dict[str, str] = {}
    if isinstance(params, nn.Module):
        for mname, mod in params.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                full = f"{mname}.{pname}" if mname else pname
                if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                    kinds[full] = "embedding"
        pairs = list(params.named_parameters())
    else:
        items = list(params)
        if items and isinstance(items[0], dict):
            raise TypeError("ANVIL takes a model, named parameters or parameters, not param groups "
                            "(it builds its own 'anvil' and 'adam' groups)")
        pairs = [it if isinstance(it, tuple) else (f"param{i}", it) for i, it in enumerate(items)]
    seen, out = set(), []
    for name, p in pairs:
        if not isinstance(p, Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(p).__name__}")
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out, kinds


def _matches(name: str, rule) -> bool:
    if rule is None:
        return False
    if callable(rule):
        return bool(rule(name))
    return name in set(rule)


class ANVIL(torch.optim.Optimizer):
    """ANVIL for hidden matrices + Adam for the rest (module docstring).

    Args:
        params: an ``nn.Module``, its ``named_parameters()``, or plain parameters.
        lr: ANVIL's learning rate (default 0.023, the record's).
        adam_lr: Adam's learning rate (default 0.008).
        momentum: the Nesterov lookahead (and, unless ``fast_beta`` is given, the fast rail's beta).
        fast_beta, fast_weight: the twin rails (default: fast_beta = momentum, fast_weight = 1, i.e.
            plain Nesterov momentum; the record engages fast_beta 0.85, fast_weight 0.4385).
        beta2: the lane-energy equalizer's decay (0.9).
        weight_decay: ANVIL's sign-aligned decay (2.25, scaled by lr twice as in the seed).
        adam_betas, adam_eps, adam_weight_decay: Adam's (0.9, 0.95), 1e-10, 0.005 (cautious decay
            scaled by lr^2 as in the seed).
        adam, anvil: names (or a predicate on names) forced onto Adam / into banks.
        head_names: module names whose 2-D weights count as output heads.
        shard_min_numel: Adam parameters at least this large are sharded (when divisible).
        comms: a :class:`~anvil_fast.comms.Comms`, a process group, or None (default group if
            torch.distributed is initialized, else one process).
        check_finite: refuse a step whose gradients hold NaN/inf (naming the parameter) before
            anything is written.
        bank_config, maps: the bank update's cascade configuration and map set.
        cuda_graphs: replay each step's device part as one CUDA graph (one capture per set of
            parameters with gradients). None: on CUDA wherever capture is valid (else off, with the
            reason in a warning); True: required (raises the reason); False: off.
        compile: run the bank update's element-wise phases through torch.compile (None: on CUDA).
    """

    def __init__(self, params, lr: float = ANVIL_DEFAULTS["lr"], adam_lr: float = ADAM_DEFAULTS["lr"], *,
                 momentum: float = ANVIL_DEFAULTS["momentum"], fast_beta: float | None = None,
                 fast_weight: float = 1.0, beta2: float = ANVIL_DEFAULTS["beta2"],
                 weight_decay: float = ANVIL_DEFAULTS["weight_decay"], adam_betas: Sequence[float] = (0.9, 0.95),
                 adam_eps: float = ADAM_DEFAULTS["eps"], adam_weight_decay: float = ADAM_DEFAULTS["weight_decay"],
                 adam: Iterable[str] | Any = None, anvil: Iterable[str] | Any = None,
                 head_names: Sequence[str] = HEAD_NAMES, shard_min_numel: int = 1 << 16, comms: Any = None,
                 check_finite: bool = False, bank_config: Any = None, maps: Any = None, cuda_graphs: bool | None = None,
                 compile: bool | None = None):
        named, kinds = _named(params)
        if not named:
            raise ValueError("ANVIL got no parameters that require gradients")
        adam_rule = list(adam) if adam is not None and not callable(adam) else adam
        anvil_rule = list(anvil) if anvil is not None and not callable(anvil) else anvil
        names = [n for n, _ in named]
        for rule, what in ((adam_rule, "adam"), (anvil_rule, "anvil")):
            if rule is not None and not callable(rule):
                unknown = [n for n in rule if n not in names]
                if unknown:
                    raise ValueError(f"{what}=: unknown parameter names {unknown}")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        vocab = {p.shape[0] for n, p in named if kinds.get(n) == "embedding" and p.ndim == 2}

        # ---- classify (no parameter is touched until every one is classified)
        bank_members: dict[tuple, list[tuple[str, Tensor]]] = {}
        adam_params: list[tuple[str, Tensor]] = []
        for name, p in named:
            module = name.rsplit(".", 1)[0] if "." in name else ""
            last = module.rsplit(".", 1)[-1]
            is_head = p.ndim == 2 and (last in head_names or bool(vocab & set(p.shape)))
            if _matches(name, anvil_rule):
                if p.ndim != 2:
                    raise ConfigError(f"{name}: anvil= needs a 2-D matrix, got shape {tuple(p.shape)}")
                kind = "bank"
            elif _matches(name, adam_rule) or p.ndim < 2 or kinds.get(name) == "embedding" or is_head:
                kind = "adam"
            elif p.ndim == 2:
                kind = "bank"
            else:
                raise ConfigError(f"{name}: no rule covers a parameter of shape {tuple(p.shape)} (ANVIL banks "
                                  "2-D matrices; Adam takes scalars, vectors, embeddings and heads); pass "
                                  f"adam=[{name!r}] to use Adam for it")
            if kind == "bank":
                if p.dtype not in BANK_DTYPES:
                    raise ConfigError(f"{name}: no rule covers a {p.dtype} matrix (banks are bfloat16 or float32); "
                                      f"convert it or pass adam=[{name!r}]")
                if 0 in p.shape:
                    raise ConfigError(f"{name}: an empty matrix {tuple(p.shape)} cannot be banked")
                bank_members.setdefault((tuple(p.shape), p.dtype), []).append((name, p))
            else:
                if not p.dtype.is_floating_point:
                    raise ConfigError(f"{name}: Adam needs a floating-point parameter, got {p.dtype}")
                adam_params.append((name, p))

        # ---- the table (the world size decides padding and sharding)
        from .comms import resolve_comms

        self.comms = resolve_comms(comms)
        ws = self.comms.world_size
        betas = [float(b) for b in adam_betas]
        table: dict[str, dict] = {}
        inner_named: list[tuple[str, Tensor]] = []
        self._banks: list[dict] = []
        plan = []
        for (shape, dtype), members in bank_members.items():
            n = len(members)
            n_pad = -(-n // ws) * ws
            label = f"bank_{shape[0]}x{shape[1]}_{str(dtype).split('.')[-1]}"
            plan.append((label, shape, dtype, members, n, n_pad))
            table[label] = {"optim": "anvil", "comms": "sharded", "reshape": (n_pad, *shape),
                            "frozen_matrices": tuple(range(n, n_pad))}
        for name, p in adam_params:
            sharded = ws > 1 and p.ndim >= 1 and p.shape[0] % ws == 0 and p.numel() >= shard_min_numel
            if ws == 1 and p.numel() >= shard_min_numel and p.ndim >= 1:
                sharded = True  # one process: a big tensor updates in place, without the flat-buffer copy
            table[name] = {"optim": "adam", "comms": "sharded" if sharded else "replicated", "adam_betas": betas}
        clash = sorted({l for l, *_ in plan} & {n for n, _ in adam_params})
        if clash:
            raise ConfigError(f"parameter names {clash} collide with generated bank labels; rename them")

        # ---- build the banks (from here on parameters are re-pointed)
        device = devices.pop()
        with torch.no_grad():
            for label, shape, dtype, members, n, n_pad in plan:
                storage = torch.zeros((n_pad, *shape), dtype=dtype, device=device)
                for i, (_, p) in enumerate(members):
                    storage[i].copy_(p.data)
                for i, (_, p) in enumerate(members):
                    p.data = storage[i]
                bank = nn.Parameter(storage.view(n_pad * shape[0], shape[1]), requires_grad=True)
                bank.label = label
                self._banks.append(dict(label=label, param=bank, members=members))
                inner_named.append((label, bank))
        for name, p in adam_params:
            p.label = name
            inner_named.append((name, p))
        size = {l: math.prod(t["reshape"]) if "reshape" in t else 0 for l, t in table.items()}
        order = sorted((l for l in table if table[l]["optim"] == "anvil"), key=lambda l: -size[l]) + \
            [n for n, _ in adam_params if table[n]["comms"] == "sharded"] + \
            [n for n, _ in adam_params if table[n]["comms"] == "replicated"]
        anvil_defaults = dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay)
        adam_defaults = dict(lr=adam_lr, eps=adam_eps, weight_decay=adam_weight_decay)
        bank_update = None
        if compile is not None and plan:
            import functools

            from .bank import anvil_bank_update

            bank_update = functools.partial(anvil_bank_update, compile=compile)
        self.inner = AnvilAndAdam(inner_named, table, order, order, adam_defaults, anvil_defaults, bank_update,
                                  comms=self.comms, check_finite=False, tie_embeddings=False,
                                  allow_fp32_banks=True, bank_config=bank_config, maps=maps)
        self._adam_named = adam_params
        self.check_finite = bool(check_finite)

        groups = []
        bank_params = [p for b in self._banks for _, p in b["members"]]
        if bank_params:
            groups.append(dict(params=bank_params, kind="anvil", lr=lr, momentum=momentum, fast_beta=fast_beta,
                               fast_weight=fast_weight, beta2=beta2, weight_decay=weight_decay))
        if adam_params:
            groups.append(dict(params=[p for _, p in adam_params], kind="adam", lr=adam_lr, betas=tuple(betas),
                               eps=adam_eps, weight_decay=adam_weight_decay))
        super().__init__(groups, dict(lr=lr))
        self._slots = None
        if cuda_graphs is None:
            from .graphs import capture_unsupported_reason

            reason = capture_unsupported_reason(self.inner)
            if reason is None:
                self.inner.capture_step(strict=False)
            elif self.inner.device.type == "cuda":
                import warnings

                warnings.warn(f"ANVIL: CUDA graphs are off ({reason}); the step runs eagerly", stacklevel=2)
        elif cuda_graphs:
            self.inner.capture_step()

    # ------------------------------------------------------------------ introspection
    @property
    def banks(self) -> dict[str, list[str]]:
        """Bank label -> the names of its member matrices, in bank order."""
        return {b["label"]: [n for n, _ in b["members"]] for b in self._banks}

    @property
    def adam_names(self) -> dict[str, str]:
        """Adam parameter name -> "sharded" or "replicated"."""
        return {n: self.inner.param_cfgs[n].comms for n, _ in self._adam_named}

    # ------------------------------------------------------------------ step
    def _sync_hyperparameters(self) -> None:
        for group in self.param_groups:
            if group["kind"] == "anvil":
                vals = dict(lr=group["lr"], momentum=group["momentum"], beta2=group["beta2"],
                            weight_decay=group["weight_decay"], fast_weight=group["fast_weight"],
                            fast_beta=group["momentum"] if group["fast_beta"] is None else group["fast_beta"])
                bad = {k: v for k, v in vals.items() if not math.isfinite(float(v))}
                if bad or not 0 <= vals["momentum"] <= 1 or not 0 <= vals["beta2"] <= 1:
                    raise ValueError(f"anvil param_group: bad hyper-parameters {vals}")
                for b in self._banks:
                    cfg = self.inner.param_cfgs[b["label"]]
                    cfg.lr, cfg.momentum, cfg.weight_decay = float(vals["lr"]), float(vals["momentum"]), \
                        float(vals["weight_decay"])
                    cfg.beta2 = float(vals["beta2"])
                    self.inner.banks[b["label"]].beta2 = cfg.beta2
                self.inner.set_rails(vals["fast_beta"], vals["fast_weight"])
            else:
                b1, b2 = (float(x) for x in group["betas"])
                if not (0 <= b1 < 1 and 0 <= b2 < 1) or not group["eps"] > 0 or not math.isfinite(group["lr"]):
                    raise ValueError(f"adam param_group: bad hyper-parameters lr={group['lr']} betas={group['betas']} "
                                     f"eps={group['eps']}")
                for name, _ in self._adam_named:
                    cfg = self.inner.param_cfgs[name]
                    cfg.lr, cfg.adam_betas = float(group["lr"]), (b1, b2)
                    cfg.eps, cfg.weight_decay = float(group["eps"]), float(group["weight_decay"])

    def _check_finite(self) -> None:
        names = [n for b in self._banks for n, p in b["members"] if p.grad is not None] + \
                [n for n, p in self._adam_named if p.grad is not None]
        params = dict((n, p) for b in self._banks for n, p in b["members"]) | dict(self._adam_named)
        dev = self.inner.device
        flags = torch.stack([(~torch.isfinite(params[n].grad)).any() for n in names]).float() if names else \
            torch.zeros(0, device=dev)
        self.comms.all_reduce_sum_now(flags)
        bad = [names[i] for i in flags.nonzero().flatten().tolist()]
        if bad:
            raise NonFiniteGradientError(f"non-finite gradient (NaN or inf) in {', '.join(bad)}; nothing was updated")

    @torch.no_grad()
    def step(self, closure=None):
        """One ANVIL + Adam step from the parameters' ``.grad`` (left as they are)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for b in self._banks:
            for name, p in b["members"]:
                if p.grad is not None and (p.grad.shape != p.shape or p.grad.dtype != p.dtype):
                    raise ValueError(f"{name}: gradient {p.grad.dtype} {tuple(p.grad.shape)} does not match the "
                                     f"parameter's {p.dtype} {tuple(p.shape)}")
        if self.check_finite:
            self._check_finite()
        self._sync_hyperparameters()
        self._copy_grads_and_step()
        return loss

    def _grad_slots(self) -> list:
        """(name, parameter, its slot in the inner optimizer's persistent gradient buffer, label), once."""
        if self._slots is None:
            bufs = self.inner.grad_buffers()
            slots = []
            for b in self._banks:
                view = bufs[b["label"]].view(self.inner.param_cfgs[b["label"]].reshape)
                slots += [(name, p, view[i], b["label"]) for i, (name, p) in enumerate(b["members"])]
            slots += [(n, p, bufs[n], n) for n, p in self._adam_named]
            self._slots = slots
        return self._slots

    def _copy_grads(self) -> list[str]:
        """Every ``.grad`` into the persistent buffers (one ``_foreach_copy_`` per dtype pair; a
        bank's copy is also the cast to bf16); returns the inner labels with a gradient. A bank
        member without a gradient counts as a zero gradient."""
        groups: dict[tuple, tuple[list, list]] = {}
        read: dict[str, None] = {}
        missing = []
        for name, p, dst, label in self._grad_slots():
            g = p.grad
            if g is None:
                missing.append((dst, label))
                continue
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:  # copy_ would broadcast or cast
                raise ValueError(f"{name}: gradient {g.dtype} {tuple(g.shape)} on {g.device} does not match the "
                                 f"parameter's {p.dtype} {tuple(p.shape)} on {p.device}; nothing was updated")
            d, s = groups.setdefault((dst.dtype, g.dtype), ([], []))
            d.append(dst)
            s.append(g)
            read[label] = None
        for dst, label in missing:
            if label in read and label in self.inner.banks:
                dst.zero_()
        for d, s in groups.values():
            torch._foreach_copy_(d, s)
        return list(read)

    def _copy_grads_and_step(self) -> None:
        """:meth:`_copy_grads`, then the inner step from the buffers (one CUDA-graph replay when
        ``cuda_graphs``)."""
        self.inner.step_from_buffers(self._copy_grads(), do_adam=True)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state (this rank's shards) and the param groups' hyper-parameters."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        inner = self.inner.state_dict()
        inner["pending_grads"] = {}  # Adam runs every step here: .grad belongs to the caller
        return {"anvil": inner, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups")
        if groups is None or "anvil" not in state_dict or len(groups) != len(self.param_groups):
            raise ValueError("not an anvil_fast.ANVIL state dict (or one with different param groups)")
        for g, saved in zip(self.param_groups, groups):
            if g["kind"] != saved.get("kind"):
                raise ValueError(f"param group kinds differ: {g['kind']} vs {saved.get('kind')}")
        kept = {n: p.grad for n, p in self._adam_named}
        self.inner.load_state_dict(state_dict["anvil"])
        for n, p in self._adam_named:  # .grad belongs to the caller, not to the checkpoint
            p.grad = kept[n]
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items()})


__all__ = ["ANVIL", "HEAD_NAMES"]
