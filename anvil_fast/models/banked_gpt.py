"""A GPT whose hidden matrices live in banks of layer groups, for the multi-rank training step.

:class:`BankedGPT` is a size of :mod:`anvil_fast.models.gpt` (GPT-2 small by default in
:mod:`anvil_fast.studies.train_step`) with its matrices in bf16 banks, labelled for
:class:`~anvil_fast.optim.optimizer.AnvilAndAdam`; :func:`batch` draws a rank's share of a global batch.

Why banks of layer groups: a parameter's gradient is complete only after the backward pass of its
last use, so a bank holding every layer's matrices (the seed's) is ready at the very end of the
backward pass and nothing can hide behind it. :class:`BankedGPT` keeps one attention bank
(``q, k, v, o`` per layer) and one MLP bank (``fc`` and ``proj^T`` per layer) per group of
``group_layers`` consecutive layers, so the last group's banks are ready while the backward pass
still runs through the earlier groups.

A model module: it states its parameters, their optimizer table and its orders
(:meth:`BankedGPT.param_table`, :meth:`~BankedGPT.scatter_order`, :meth:`~BankedGPT.work_order`),
and imports no optimizer; :func:`anvil_fast.optim.overlap.make_optimizer` builds the optimizer from them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from anvil_ref.constants import EMBED_LABEL, LM_HEAD_LABEL

from .gpt import GPTConfig

#: The training-step studies' model and batch on CUDA and for the CPU smoke run (``size``,
#: ``global_batch``, ``group_layers``): :mod:`anvil_fast.studies.train_step`'s defaults, which
#: :mod:`anvil_fast.studies.cost_model` measures.
CUDA_DEFAULTS = dict(size="gpt2small", global_batch=16, group_layers=4)
CPU_DEFAULTS = dict(size="tiny", global_batch=4, group_layers=1)
WORK_ORDERS = ("backward", "forward", "mixed")
NORMS_LABEL = "norms"
POS_LABEL = "pos"


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
    """The package GPT's architecture (:mod:`anvil_fast.models.gpt`, untied head, no biases) with its
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


__all__ = ["CUDA_DEFAULTS", "CPU_DEFAULTS", "BankedGPT", "WORK_ORDERS", "NORMS_LABEL", "POS_LABEL", "batch", "check_batch"]
