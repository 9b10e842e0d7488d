"""A training step on several ranks with the communication hidden behind the backward pass.

``python -m anvil_fast.train_step --device cuda --worlds 1,2`` (also ``python -m anvil_fast.bench
train_step``): forward + backward + :class:`~anvil_fast.optimizer.AnvilAndAdam` step of a GPT whose
hidden matrices live in banks (:class:`BankedGPT`, a size of :mod:`anvil_fast.gpt`; GPT-2 small by
default), on one process per rank (:func:`anvil_fast.distributed.spawn`: NCCL on CUDA, gloo on CPU),
at the same *global* batch at every world size (per-rank batch = global / world).

Why banks of layer groups: a parameter's gradient is complete only after the backward pass of its
last use, so a bank holding every layer's matrices (the seed's) is ready at the very end of the
backward pass and nothing can hide behind it. :class:`BankedGPT` keeps one attention bank
(``q, k, v, o`` per layer) and one MLP bank (``fc`` and ``proj^T`` per layer) per group of
``group_layers`` consecutive layers, so the last group's banks are ready while the backward pass
still runs through the earlier groups.

:class:`OverlappedStep` drives the schedule:

* each sharded parameter's ``register_post_accumulate_grad_hook`` marks it ready; reduce-scatters
  are launched strictly in the optimizer's ``scatter_order`` (a label launches when it and every
  label before it is ready), so every rank enqueues the same collectives in the same order and
  the schedule is the optimizer's own;
* after the backward pass, :meth:`OverlappedStep.step` runs the optimizer's host part and its device
  part with those reduces (``body(..., launched=...)``): the updates and all-gathers of phases 2-3;
* the all-gathers complete either at the step's end (``wait="end"``) or in a forward pre-hook of
  the module that reads the parameter (``wait="prehook"``: the next forward's first layers start
  while later gathers are still in flight). On NCCL every wait is a stream wait, not a host block.

The arithmetic is the non-overlapped schedule's (backward, then
:meth:`~anvil_fast.optimizer.AnvilAndAdam.step_from_buffers`): the same collectives on the same
gradients, the same updates; only their launch times differ. The benchmark checks it bit for bit
on the same gradients (:func:`paired_check`).

Per world size the table reports (per step in steady state, slowest rank): the overlapped step
(both waits), the non-overlapped step, the step with communication skipped
(:class:`~anvil_fast.comms.NullComms`: the same shards and kernels, nothing moved), the collectives
alone (the same reduce-scatters, all-reduce and all-gathers, in order, no compute), and
``hidden = (t_nocomm + t_comm - t_step) / t_comm``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from anvil_ref.config import ConfigError
from anvil_ref.constants import EMBED_LABEL, LM_HEAD_LABEL

from .bench.common import emit_table, median_ms, timer
from .comms import Handle
from .gpt import SIZES, GPTConfig

WAIT_MODES = ("prehook", "end")
#: The run's defaults on CUDA and for the CPU smoke run (``size``, ``global_batch``, ``group_layers``).
CUDA_DEFAULTS = dict(size="gpt2small", global_batch=16, group_layers=4)
CPU_DEFAULTS = dict(size="tiny", global_batch=4, group_layers=1)
WORK_ORDERS = ("backward", "forward", "mixed")
NORMS_LABEL = "norms"
POS_LABEL = "pos"
#: Seconds a rank may wait in a collective (the first step compiles the bank updates).
GPU_TIMEOUT_S = 900.0
CPU_TIMEOUT_S = 300.0


# ------------------------------------------------------------------------------------------ model
class _Embed(nn.Module):
    def __init__(self, wte: Tensor, wpe: Tensor):
        super().__init__()
        self.wte, self.wpe = nn.Parameter(wte), nn.Parameter(wpe)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.wte) + self.wpe[: idx.shape[1]]


class _Group(nn.Module):
    """``layers`` consecutive pre-norm blocks whose matrices are two banks."""

    def __init__(self, cfg: GPTConfig, first: int, layers: int, attn: Tensor, mlp: Tensor):
        super().__init__()
        self.cfg, self.first, self.layers = cfg, first, layers
        self.attn_bank, self.mlp_bank = nn.Parameter(attn), nn.Parameter(mlp)

    def forward(self, x: Tensor, norms: Tensor) -> Tensor:
        d, nh = self.cfg.n_embd, self.cfg.n_head
        A = self.attn_bank.view(4 * self.layers, d, d)
        M = self.mlp_bank.view(2 * self.layers, 4 * d, d)
        b, t, _ = x.shape
        for j in range(self.layers):
            n = norms[2 * (self.first + j): 2 * (self.first + j) + 2]
            # the residual stream and the norms stay fp32; the matmuls run in the banks' bf16
            h = F.layer_norm(x, (d,), n[0, 0], n[0, 1]).to(A.dtype)
            q, k, v = F.linear(h, A[4 * j: 4 * j + 3].reshape(3 * d, d)).split(d, dim=-1)
            q, k, v = (z.view(b, t, nh, d // nh).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + F.linear(y, A[4 * j + 3]).float()
            h = F.layer_norm(x, (d,), n[1, 0], n[1, 1]).to(M.dtype)
            x = x + (F.gelu(F.linear(h, M[2 * j])) @ M[2 * j + 1]).float()
        return x


class _Head(nn.Module):
    def __init__(self, lm_head: Tensor):
        super().__init__()
        self.lm_head = nn.Parameter(lm_head)

    def forward(self, x: Tensor, norm: Tensor) -> Tensor:
        h = F.layer_norm(x, (x.shape[-1],), norm[0], norm[1])
        return F.linear(h.to(torch.bfloat16), self.lm_head.to(torch.bfloat16))


class BankedGPT(nn.Module):
    """The package GPT's architecture (:mod:`anvil_fast.gpt`, untied head, no biases) with its
    matrices in bf16 banks of ``group_layers`` layers (module docstring). Parameters and labels:

    ======================  =========================  ====================================
    ``attn_bank{g}``        [4 G d, d], bank [4G, d, d]  q, k, v, o of each layer (ANVIL)
    ``mlp_bank{g}``         [8 G d, d], bank [2G, 4d, d] fc and proj^T of each layer (ANVIL)
    ``embed``, ``pos``      [vocab, d], [ctx, d]        sharded Adam, fp32
    ``lm_head``             [vocab, d]                  sharded Adam, fp32, untied
    ``norms``               [2 L + 1, 2, d]             LayerNorm gains and biases, replicated Adam
    ======================  =========================  ====================================
    """

    def __init__(self, cfg: GPTConfig, *, group_layers: int, seed: int = 0):
        super().__init__()
        if not isinstance(group_layers, int) or group_layers < 1 or cfg.n_layer % group_layers:
            raise ValueError(f"group_layers must be a positive divisor of n_layer={cfg.n_layer}, got {group_layers!r}")
        self.cfg, self.group_layers = cfg, group_layers
        d, L, G = cfg.n_embd, cfg.n_layer, group_layers
        g = torch.Generator().manual_seed(seed)
        proj_std = 0.02 / math.sqrt(2 * L)

        def normal(shape, std):
            return std * torch.randn(shape, generator=g)

        self.tok = _Embed(normal((cfg.vocab, d), 0.02), normal((cfg.ctx, d), 0.02))
        groups = []
        for first in range(0, L, G):
            attn = normal((4 * G, d, d), 0.02)
            attn[3::4] *= proj_std / 0.02
            mlp = normal((2 * G, 4 * d, d), 0.02)
            mlp[1::2] *= proj_std / 0.02
            groups.append(_Group(cfg, first, G, attn.reshape(4 * G * d, d).to(torch.bfloat16),
                                 mlp.reshape(8 * G * d, d).to(torch.bfloat16)))
        self.groups = nn.ModuleList(groups)
        norms = torch.zeros(2 * L + 1, 2, d)
        norms[:, 0] = 1.0
        self.norms = nn.Parameter(norms)
        self.head = _Head(normal((cfg.vocab, d), 0.02))
        for label, p in self.labelled():
            p.label = label
        for i, grp in enumerate(self.groups):
            grp.attn_bank.reshape = (4 * G, d, d)
            grp.mlp_bank.reshape = (2 * G, 4 * d, d)

    def labelled(self) -> list[tuple[str, nn.Parameter]]:
        """(label, parameter) in the order the optimizer lists them."""
        out = [(EMBED_LABEL, self.tok.wte), (POS_LABEL, self.tok.wpe)]
        for i, grp in enumerate(self.groups):
            out += [(f"attn_bank{i}", grp.attn_bank), (f"mlp_bank{i}", grp.mlp_bank)]
        return out + [(NORMS_LABEL, self.norms), (LM_HEAD_LABEL, self.head.lm_head)]

    def param_table(self) -> dict[str, dict]:
        anvil = {"optim": "anvil", "comms": "sharded"}
        adam = {"optim": "adam", "comms": "sharded", "adam_betas": [0.9, 0.95]}
        small = {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.95], "wd_mul": 0.0}
        return {label: anvil if "bank" in label else small if label == NORMS_LABEL else adam
                for label, _ in self.labelled()}

    def scatter_order(self) -> list[str]:
        """The order the backward pass completes the gradients in: the head first, then the groups
        from the last (MLP before attention), the norms, the embeddings last."""
        banks = [f"{k}_bank{i}" for i in reversed(range(len(self.groups))) for k in ("mlp", "attn")]
        return [LM_HEAD_LABEL, *banks, NORMS_LABEL, POS_LABEL, EMBED_LABEL]

    def work_order(self, order: str = "backward") -> list[str]:
        """The updates' order, the replicated norms last (their all-reduce is launched after the
        backward pass). ``backward``: as the reduces land, so no update waits for a reduce behind
        another, but the last gathers (the embeddings') are the first the next forward pass reads;
        ``forward``: as the next forward pass reads the parameters, so with pre-hook waits the last
        gathers (lm_head's) hide behind that forward, at the price of waiting for the last reduce
        (embed's) before the first update; ``mixed``: lm_head and the later half of the groups as
        their reduces land, then the embeddings (whose reduce has landed meanwhile), then the
        earlier groups in forward order, so that the last gather is a middle group's, read only
        after the first groups' forward."""
        if order not in WORK_ORDERS:
            raise ValueError(f"work order must be one of {WORK_ORDERS}, got {order!r}")
        n = len(self.groups)
        if order == "backward":
            land = [l for l in self.scatter_order() if l != NORMS_LABEL]
        elif order == "forward":
            land = [EMBED_LABEL, POS_LABEL, *(f"{k}_bank{i}" for i in range(n) for k in ("attn", "mlp")), LM_HEAD_LABEL]
        else:
            half = n - n // 2  # the groups from here on are updated as their reduces land
            late = [f"{k}_bank{i}" for i in reversed(range(half, n)) for k in ("mlp", "attn")]
            early = [f"{k}_bank{i}" for i in range(half) for k in ("attn", "mlp")]
            land = [LM_HEAD_LABEL, *late, EMBED_LABEL, POS_LABEL, *early]
        return land + [NORMS_LABEL]

    def wait_points(self) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """(module, labels its forward reads): where a forward pre-hook waits for the gathers."""
        out = [(self.tok, (EMBED_LABEL, POS_LABEL))]
        out += [(grp, (f"attn_bank{i}", f"mlp_bank{i}")) for i, grp in enumerate(self.groups)]
        return out + [(self.head, (LM_HEAD_LABEL,))]

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        if idx.shape[1] > self.cfg.ctx:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the context {self.cfg.ctx}")
        x = self.tok(idx)
        for grp in self.groups:
            x = grp(x, self.norms)
        logits = self.head(x, self.norms[-1])
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_optimizer(model: BankedGPT, *, comms=None, compile_banks: bool | None = None, work_order: str = "backward",
                   graphs: bool = False):
    """AnvilAndAdam over the model's labelled parameters with its schedule (untied embeddings);
    ``graphs``: the bank updates replayed as CUDA graphs."""
    from .bank import anvil_bank_update
    from .optimizer import AnvilAndAdam

    opt = AnvilAndAdam(model.labelled(), model.param_table(), model.scatter_order(), model.work_order(work_order),
                       comms=comms, tie_embeddings=False,
                       bank_update=functools.partial(anvil_bank_update, compile=compile_banks))
    if graphs:
        opt.use_cuda_graphs()
    return opt


# ------------------------------------------------------------------------------------- the driver
class OverlappedStep:
    """Launch each sharded gradient's reduce-scatter from the backward pass and finish the step
    after it (module docstring). Call :meth:`begin` before the backward pass and :meth:`step` after
    it (it first waits any gather no forward waited); :meth:`wait_all` before reading the
    parameters outside a forward pass (evaluation, checkpoints). With gradient accumulation, call
    :meth:`begin` before the *last* micro-batch's backward pass only: a reduce launched from an
    earlier one would carry a partial sum, so a second backward pass after :meth:`begin` is refused."""

    def __init__(self, opt, model: BankedGPT, *, wait: str = "prehook"):
        if wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {WAIT_MODES}, got {wait!r}")
        if opt.check_finite:
            raise ConfigError("OverlappedStep: check_finite needs every gradient before the first reduce; "
                              "the overlapped schedule launches them during the backward pass")
        if opt.tied and not opt.split_embed:
            raise ConfigError("OverlappedStep: tied embed/lm_head reduce as one sum at the end of the backward "
                              "pass; untie them (tie_embeddings=False or copy_lm_state_to_embed)")
        self.opt, self.wait = opt, wait
        self.sharded = [l for l in opt.scatter_order if opt.param_cfgs[l].comms == "sharded"]
        self.deferred = frozenset(self.sharded) if wait == "prehook" else frozenset()
        self.do_adam = True
        self._armed = False
        self._queue: list[str] = []
        self._next = 0
        self._ready: set[str] = set()
        self._launched: dict[str, tuple[Handle, Tensor]] = {}
        self._gathers: dict[str, Handle] = {}
        self._hooks = [opt.params[l].register_post_accumulate_grad_hook(functools.partial(self._on_grad, l))
                       for l in self.sharded]
        if wait == "prehook":
            for module, labels in model.wait_points():
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, labels)))

    def remove(self) -> None:
        """Take the hooks off (the parameters are left as they are; :meth:`wait_all` first)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _pre_forward(self, labels: Sequence[str], module, args) -> None:
        for l in labels:
            h = self._gathers.pop(l, None)
            if h is not None:
                h.wait()

    def wait_all(self) -> None:
        for h in self._gathers.values():
            h.wait()
        self._gathers = {}

    def begin(self, do_adam: bool = True) -> None:
        """Before the backward pass: which gradients this step reads (Adam's only when ``do_adam``)."""
        self.do_adam = bool(do_adam)
        cfgs = self.opt.param_cfgs
        self._queue = [l for l in self.sharded if self.do_adam or cfgs[l].optim == "anvil"]
        self._next, self._ready, self._launched = 0, set(), {}
        self._armed = True

    def _on_grad(self, label: str, param: Tensor) -> None:
        if not self._armed:
            return  # a backward pass before begin(): an earlier micro-batch, accumulating only
        if label in self._ready:
            raise RuntimeError(f"OverlappedStep: {label!r} received a second gradient after begin(); its reduce "
                               "already left with the first. Call begin() before the last micro-batch's backward "
                               "pass only")
        self._ready.add(label)
        self._launch_ready()

    def _launch_ready(self, *, final: bool = False) -> None:
        # strictly in scatter_order, so that every rank enqueues the same collectives in the same order
        q, params = self._queue, self.opt.params
        while self._next < len(q):
            l = q[self._next]
            if l not in self._ready:
                if not final:
                    return
                if params[l].grad is None:  # never reached this step: not read, not launched
                    self._next += 1
                    continue
            self._launched[l] = self.opt.launch_reduce(l, params[l].grad)
            self._next += 1

    def step(self) -> None:
        """After the backward pass: the rest of the step on the reduces already in flight."""
        opt = self.opt
        if not self._armed:
            raise RuntimeError("OverlappedStep.step() without begin() before the backward pass")
        self._armed = False
        self.wait_all()  # a gather no forward waited still reads the shard this step updates
        self._launch_ready(final=True)  # labels whose hook did not run (no use this step, kept grads)
        grads = {l: opt.params[l].grad for l in opt.labels if opt.params[l].grad is not None
                 and (self.do_adam or opt.param_cfgs[l].optim == "anvil")}
        with torch.no_grad():
            plan = opt.prepare(grads, self.do_adam, deferred=self.deferred)
            self._gathers = opt.body(plan, grads, deferred=self.deferred, launched=self._launched)
        for label, cfg in opt.param_cfgs.items():
            if cfg.optim == "adam" and not self.do_adam:
                continue  # kept: the next backward accumulates into it (AnvilAndAdam.step's rule)
            opt.params[label].grad = None
        self._launched = {}


def sequential_step(opt, do_adam: bool = True) -> None:
    """The non-overlapped schedule: after the backward pass, the gradients into the persistent
    buffers and :meth:`~anvil_fast.optimizer.AnvilAndAdam.step_from_buffers`."""
    bufs = opt.grad_buffers()
    labels = [l for l in opt.labels if opt.params[l].grad is not None and (do_adam or opt.param_cfgs[l].optim == "anvil")]
    with torch.no_grad():
        for l in labels:
            bufs[l].copy_(opt.params[l].grad)
        opt.step_from_buffers(labels, do_adam=do_adam)
    for label, cfg in opt.param_cfgs.items():
        if cfg.optim == "adam" and not do_adam:
            continue
        opt.params[label].grad = None


# --------------------------------------------------------------------------------------- training
def batch(cfg: GPTConfig, *, step: int, global_batch: int, seq: int, world: int, rank: int,
          device) -> tuple[Tensor, Tensor]:
    """This rank's share of the step's global batch (rows ``rank * global / world`` on), drawn
    from a generator seeded by the step alone, so every world size trains on the same tokens."""
    check_batch(global_batch, world)
    g = torch.Generator().manual_seed(1_000 + step)
    tokens = torch.randint(cfg.vocab, (global_batch, seq + 1), generator=g)
    per = global_batch // world
    mine = tokens[rank * per: (rank + 1) * per].to(device)
    return mine[:, :-1], mine[:, 1:]


def check_batch(global_batch: int, world: int) -> None:
    if not isinstance(global_batch, int) or not isinstance(world, int) or world < 1 or global_batch < 1:
        raise ValueError(f"global batch and world size must be positive ints, got {global_batch!r}, {world!r}")
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not divisible by the world size {world}: every rank "
                         "needs the same per-rank batch (global / world)")


def train(model: BankedGPT, opt, *, mode: str, steps: int, global_batch: int, seq: int, world: int, rank: int,
          first_step: int = 0, adam_every: int = 1, fixed_data: bool = False) -> Callable[[int], None]:
    """``steps`` training steps in ``mode`` (``sequential`` or a :data:`WAIT_MODES` entry); Adam on
    steps where ``t % adam_every == adam_every - 1``. Returns the one-step function ``one(t)``;
    ``fixed_data``: every step reads step 0's batch (for timing: no batch drawn and copied inside a
    timed step)."""
    dev = next(model.parameters()).device
    driver = None if mode == "sequential" else OverlappedStep(opt, model, wait=mode)
    data = {}

    def one(t: int) -> None:
        key = 0 if fixed_data else t
        if key not in data:
            data.clear()
            data[key] = batch(model.cfg, step=key, global_batch=global_batch, seq=seq, world=world, rank=rank,
                              device=dev)
        x, y = data[key]
        do_adam = t % adam_every == adam_every - 1
        if driver is not None:
            driver.begin(do_adam)
        loss = model(x, y)
        loss.backward()
        if driver is None:
            sequential_step(opt, do_adam)
        else:
            driver.step()

    for t in range(first_step, first_step + steps):
        one(t)
    if driver is not None:
        driver.wait_all()
    one.driver = driver
    return one


def paired_check(fresh: Callable[[], tuple[BankedGPT, object]], *, mode: str, steps: int, global_batch: int, seq: int,
                 world: int, rank: int,
                 on_start: Callable[[BankedGPT, OverlappedStep], None] | None = None) -> tuple[list, list]:
    """The overlapped schedule against the non-overlapped one on the *same* gradients: model A
    trains with :class:`OverlappedStep`; after each backward pass, B (the same initialization)
    gets a copy of A's gradients and takes :func:`sequential_step`. Sharing the gradients keeps the
    backward pass's own run-to-run variation (atomics in a GPU attention backward, for one) out of
    the comparison, which is then of the schedules alone. Adam on odd steps. Returns every rank's
    digests of A's and of B's parameters (a collective when distributed)."""
    from .distributed import all_digests, replica_digest

    ma, oa = fresh()
    mb, ob = fresh()
    driver = OverlappedStep(oa, ma, wait=mode)
    if on_start is not None:
        on_start(ma, driver)
    dev = next(ma.parameters()).device
    for t in range(steps):
        x, y = batch(ma.cfg, step=t, global_batch=global_batch, seq=seq, world=world, rank=rank, device=dev)
        do_adam = t % 2 == 1
        driver.begin(do_adam)
        ma(x, y).backward()
        with torch.no_grad():
            for (_, pa), (_, pb) in zip(ma.labelled(), mb.labelled()):
                pb.grad = None if pa.grad is None else pa.grad.detach().clone()
        driver.step()
        sequential_step(ob, do_adam)
    driver.wait_all()
    ta, tb = ([p.data for _, p in m.labelled()] for m in (ma, mb))
    if dist.is_initialized():
        return all_digests(ta), all_digests(tb)
    return [replica_digest(ta)], [replica_digest(tb)]


# ------------------------------------------------------------------------------------------ ranks
def _config(size: str) -> GPTConfig:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    return SIZES[size]


def _steady_ms(fn, n: int, warmup: int, device, *, blocks: int = 3) -> float:
    """Per-step ms of ``n`` back-to-back calls of ``fn`` (no synchronization between them, so the
    host runs ahead and a step's tail overlaps the next as in training), the median of ``blocks``."""
    timed = timer(device)
    for _ in range(warmup):
        timed(fn)

    def block():
        for _ in range(n):
            fn()

    times = sorted(timed(block) / n for _ in range(blocks))
    if dist.is_initialized():
        dist.barrier()
    return times[len(times) // 2]


def _comm_only(opt) -> Callable[[], None]:
    """The collectives of one Adam step, same buffers and order, without compute: the sharded
    reduce-scatters in scatter_order, the replicated all-reduce, then the all-gathers in work_order."""
    comms = opt.comms
    inputs = {l: torch.zeros(opt.params[l].shape, dtype=(opt.banks[l].grad.dtype if l in opt.banks
              else opt.params[l].dtype), device=opt.device) for l in opt.labels if opt.param_cfgs[l].comms == "sharded"}
    outs = {l: (opt.banks[l].grad if l in opt.banks else
                torch.empty_like(inputs[l][:opt.param_cfgs[l].chunk_size])) for l in inputs}

    def run():
        hs = []
        for l in opt.scatter_order:
            if l in inputs:
                src = inputs[l].view(opt.param_cfgs[l].reshape) if l in opt.banks else inputs[l]
                hs.append(comms.reduce_scatter_avg(outs[l], src))
        if opt.replicated is not None:
            hs += [comms.all_reduce_avg(g.grad) for g in opt.replicated.groups]
        for h in hs:
            h.wait()
        gs = [opt._launch_gather(l) for l in opt.work_order if l in inputs]
        for h in gs:
            h.wait()
    return run


def _rank(rank: int, world: int, a: dict) -> dict:
    from .comms import LocalComms, NullComms

    dev = torch.device("cuda", rank) if a["device"] == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _config(a["size"])
    compile_banks = None if dev.type == "cuda" else False
    real = LocalComms() if world == 1 else None
    kw = dict(global_batch=a["global_batch"], seq=a["seq"], world=world, rank=rank)
    res: dict = {"world": world}

    def fresh(comms):
        model = BankedGPT(cfg, group_layers=a["group_layers"], seed=0).to(dev)
        return model, make_optimizer(model, comms=comms, compile_banks=compile_banks, work_order=a["work_order"],
                                     graphs=a["graphs"])

    # equivalence: each overlapped schedule against the non-overlapped one, on the same gradients
    res["digests"] = {mode: paired_check(lambda: fresh(real), mode=mode, steps=a["check_steps"], **kw)
                      for mode in WAIT_MODES}
    if a["n_time"] <= 0:
        return res
    # timing: every mode with communication, then without, then the collectives alone
    for mode in ("sequential", *WAIT_MODES):
        model, opt = fresh(real)
        one = train(model, opt, mode=mode, steps=1, fixed_data=True, **kw)
        t = iter(range(1, 10 ** 9))
        res[f"{mode}_ms"] = _steady_ms(lambda: one(next(t)), a["n_time"], a["warmup"], dev)
        if a["profile"] and mode == "prehook":
            res["profile"] = _profile(lambda: one(next(t)), a["profile"], world, rank, dev)
        if one.driver is not None:
            one.driver.wait_all()
        if mode == "end":
            res["comm_ms"] = median_ms(_comm_only(opt), n=a["n_time"], warmup=a["warmup"], device=dev) if world > 1 else 0.0
        del model, opt, one
    model, opt = fresh(NullComms(world, rank) if world > 1 else real)
    one = train(model, opt, mode="end", steps=1, fixed_data=True, **kw)
    t = iter(range(1, 10 ** 9))
    res["nocomm_ms"] = _steady_ms(lambda: one(next(t)), a["n_time"], a["warmup"], dev)
    if dev.type == "cuda":
        res["max_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    return res


def _profile(fn, folder: str, world: int, rank: int, device, steps: int = 3) -> str:
    """A torch.profiler trace of ``steps`` steps (chrome format, one file per rank and world size,
    for chrome://tracing or Perfetto: the NCCL kernels next to the backward's), and the top of its
    table by device time, returned as text."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"train_step_w{world}_rank{rank}.json"))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15)


# ------------------------------------------------------------------------------------------ table
def hidden_share(step_ms: float, nocomm_ms: float, comm_ms: float) -> float:
    """The share of the collectives' time that does not show in the step: ``(t_nocomm + t_comm -
    t_step) / t_comm`` (NaN without collectives)."""
    return (nocomm_ms + comm_ms - step_ms) / comm_ms if comm_ms > 0 else float("nan")


def _slowest(res: list[dict], key: str) -> float:
    return max(r[key] for r in res)


def table(results: dict[int, list[dict]], a: dict) -> tuple[list[str], bool]:
    lines = ["| ranks | per-rank batch | step ms, overlapped (wait in pre-hook) | step ms, overlapped (wait at "
             "step end) | step ms, not overlapped | step ms, comms skipped | collectives alone ms | hidden "
             "(pre-hook) | step / 1-rank step (pre-hook) | bitwise == not overlapped |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ok = True
    base = results.get(1, [{}])[0].get("prehook_ms")
    for w, res in results.items():
        d = res[0]["digests"]
        same = all(d[m][0] == d[m][1] and len(set(d[m][0])) == 1 for m in WAIT_MODES)
        ok &= same
        if "prehook_ms" not in res[0]:
            lines.append(f"| {w} | {a['global_batch'] // w} | | | | | | | | {'yes' if same else 'NO'} |")
            continue
        pre, end, seq = (_slowest(res, k) for k in ("prehook_ms", "end_ms", "sequential_ms"))
        noc, com = _slowest(res, "nocomm_ms"), _slowest(res, "comm_ms")
        hid = hidden_share(pre, noc, com)
        ratio = f"{pre / base:.2f}x" if base else ""
        lines.append(f"| {w} | {a['global_batch'] // w} | {pre:.2f} | {end:.2f} | {seq:.2f} | {noc:.2f} | {com:.2f} | "
                     f"{'' if math.isnan(hid) else f'{hid:.0%}'} | {ratio} | {'yes' if same else 'NO'} |")
    return lines, ok


#: the ``python -m anvil_fast.bench train_step`` one-line summary
SUMMARY = ("forward + backward + step of GPT-2 small at several ranks, each reduce-scatter launched from "
           "the backward pass")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: NCCL, one GPU per rank; cpu: gloo, a smoke run (tiny model, few steps)")
    ap.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    ap.add_argument("--size", default=None, choices=list(SIZES),
                    help="anvil_fast.gpt size (default: gpt2small on cuda, tiny on cpu)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step over all ranks (default: 16 on cuda, 4 on cpu)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the size's context)")
    ap.add_argument("--group-layers", type=int, default=None,
                    help="layers per bank (default: 4 on cuda, so 8 ranks divide every bank; 1 on cpu)")
    ap.add_argument("--work-order", choices=WORK_ORDERS, default="backward",
                    help="the updates' order (BankedGPT.work_order): as the reduces land, as the forward reads, "
                         "or mixed")
    ap.add_argument("--graphs", action="store_true", help="bank updates replayed as CUDA graphs (cuda only)")
    ap.add_argument("--check-steps", type=int, default=3, help="steps of the bitwise equivalence check")
    ap.add_argument("--n-time", type=int, default=None, help="timed steps per variant (default 20 cuda, 3 cpu; "
                    "0: equivalence only)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5 cuda, 1 cpu)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="also write a torch.profiler trace of 3 overlapped steps per rank here (and print rank 0's "
                         "top kernels)")
    ap.add_argument("--out", default="", help="also write the table (markdown) here")


def settings(a: argparse.Namespace) -> dict:
    """The run's settings with the device's defaults, refused early when inconsistent."""
    cuda = a.device == "cuda"
    d = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    s = dict(device=a.device, size=a.size or d["size"],
             global_batch=a.global_batch if a.global_batch is not None else d["global_batch"],
             group_layers=a.group_layers if a.group_layers is not None else d["group_layers"],
             check_steps=a.check_steps, n_time=a.n_time if a.n_time is not None else (20 if cuda else 3),
             warmup=a.warmup if a.warmup is not None else (5 if cuda else 1),
             work_order=a.work_order, graphs=bool(a.graphs), profile=a.profile)
    if s["graphs"] and not cuda:
        raise ValueError("--graphs needs --device cuda (CUDA graphs)")
    cfg = _config(s["size"])
    s["seq"] = a.seq if a.seq is not None else cfg.ctx
    try:
        worlds = [int(w) for w in a.worlds.split(",")]
    except ValueError:
        raise ValueError(f"--worlds: expected comma-separated ints, got {a.worlds!r}") from None
    if not 1 <= s["seq"] <= cfg.ctx:
        raise ValueError(f"--seq {s['seq']} must lie in [1, {cfg.ctx}] (the {s['size']} context)")
    if s["check_steps"] < 1 or s["n_time"] < 0 or s["warmup"] < 0:
        raise ValueError("--check-steps must be >= 1, --n-time and --warmup >= 0")
    G = s["group_layers"]
    if G < 1 or cfg.n_layer % G:
        raise ValueError(f"--group-layers {G} must divide n_layer={cfg.n_layer}")
    for w in worlds:
        check_batch(s["global_batch"], w)
        for what, n in (("attention bank matrices", 4 * G), ("MLP bank matrices", 2 * G), ("vocabulary", cfg.vocab),
                        ("context", cfg.ctx)):
            if n % w:
                raise ValueError(f"{w} ranks cannot shard the {what} ({n}): raise --group-layers or pick a world "
                                 f"size dividing {n}")
    s["worlds"] = worlds
    return s


def run(a: argparse.Namespace) -> int:
    from .distributed import spawn

    try:
        s = settings(a)
    except ValueError as e:
        print(f"anvil_fast.train_step: {e}", file=sys.stderr)
        return 2
    cuda = s["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        print("anvil_fast.train_step --device cuda: needs CUDA devices (--device cpu is the smoke run)", file=sys.stderr)
        return 2
    results = {}
    for w in s["worlds"]:
        if cuda and torch.cuda.device_count() < w:
            print(f"skipping {w} ranks: {torch.cuda.device_count()} GPU(s)", flush=True)
            continue
        t0 = time.time()
        results[w] = spawn(_rank, w, s, backend="nccl" if cuda else "gloo", threads=0 if cuda else 1,
                           timeout=GPU_TIMEOUT_S if cuda else CPU_TIMEOUT_S)
        print(f"{w} rank(s) measured in {time.time() - t0:.0f} s", flush=True)
    if not results:
        print("anvil_fast.train_step: no world size could run", file=sys.stderr)
        return 2
    cfg = _config(s["size"])
    dev = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
    mem = max((r.get("max_memory_gib", 0.0) for res in results.values() for r in res), default=0.0)
    command = getattr(a, "command_line", None) or "python -m anvil_fast.bench train_step " + " ".join(sys.argv[2:])
    lines = [f"<!-- generated by `{command}` -->",
             f"# Training step on {', '.join(map(str, results))} rank(s): forward + backward + AnvilAndAdam", "",
             f"Device: {dev}, torch {torch.__version__}. Model: BankedGPT `{s['size']}` ({cfg.n_layer} layers, width "
             f"{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}), banks of {s['group_layers']} layer(s), updates in "
             f"{s['work_order']} order, bank updates {'in CUDA graphs' if s['graphs'] else 'without CUDA graphs'}; global "
             f"batch {s['global_batch']} x {s['seq']} tokens at every world size; Adam every step; per step: "
             f"{s['n_time']} steps back to back (no sync between them), median of 3 such blocks after {s['warmup']} "
             "warm-up steps, slowest rank; collectives alone: median of single calls"
             + (f"; peak memory {mem:.1f} GiB per GPU" if mem else "") + ". Hidden = (comms skipped + collectives "
             f"alone - step) / collectives alone. Bitwise check: {s['check_steps']} steps (Adam on odd steps), every "
             "parameter of every rank, overlapped (both waits) against backward + step_from_buffers on the same gradients "
             "(paired_check).", ""]
    body, ok = table(results, s)
    emit_table(lines + body, a.out)
    for w, res in results.items():
        if "profile" in res[0]:
            print(f"profile, {w} rank(s), rank 0 (traces in {s['profile']}):\n{res[0]['profile']}")
    return 0 if ok else 1


#: ``python -m anvil_fast.bench train_step``'s (add_arguments, run)
COMMAND = (add_args, run)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.train_step", description=__doc__.split("\n\n")[0])
    add_args(ap)
    a = ap.parse_args(argv)
    a.command_line = "python -m anvil_fast.train_step " + " ".join(argv)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
