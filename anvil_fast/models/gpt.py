"""The package's GPT: a small decoder-only transformer used by the drop-in benchmark and the
training harness (``python -m papers.train``), so both measure the same model.

Pre-norm blocks (LayerNorm -> causal self-attention through ``scaled_dot_product_attention`` ->
residual; LayerNorm -> MLP with GELU, 4x hidden -> residual), learned token and position
embeddings, a final LayerNorm and an untied output head (``tie_embeddings=True`` ties it to the
token embedding, as GPT-2 does). Linear layers carry no bias. The attention's query, key and value
come from one fused projection ``attn.qkv`` ``[3 d, d]``, as in nanoGPT.

Initialization (GPT-2's): every weight normal with std 0.02, the residual projections
(``attn.proj``, ``mlp.proj``) with std ``0.02 / sqrt(2 n_layer)``, LayerNorm gains 1 and biases 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    ctx: int = 256
    vocab: int = 256
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("n_layer", "n_embd", "n_head", "ctx", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


#: The named sizes: ``tiny`` (CPU, CI), ``small`` (~11M parameters), ``medium`` (GPT-2-small's
#: layer count and width, ~85M without embeddings), ``gpt2small`` (GPT-2 small itself: medium's
#: blocks with a 1024-token context and the 50304-token vocabulary, 124M with tied embeddings),
#: ``gpt2medium`` (GPT-2 medium itself: 24 layers of width 1024, the same context and vocabulary, 355M
#: with tied embeddings).
SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_embd=64, n_head=2, ctx=64),
    "small": GPTConfig(n_layer=6, n_embd=384, n_head=6, ctx=256),
    "medium": GPTConfig(n_layer=12, n_embd=768, n_head=12, ctx=256),
    "gpt2small": GPTConfig(n_layer=12, n_embd=768, n_head=12, ctx=1024, vocab=50304),
    "gpt2medium": GPTConfig(n_layer=24, n_embd=1024, n_head=16, ctx=1024, vocab=50304),
}
#: A size's name with this suffix builds the same model, its weights rounded to bf16 parameters
#: (``small-bf16``): the training setups that keep no fp32 copy.
BF16_SUFFIX = "-bf16"
#: Every name :func:`build` takes.
SIZE_NAMES: tuple[str, ...] = tuple(SIZES) + tuple(n + BF16_SUFFIX for n in SIZES)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only GPT (module docstring). ``forward(idx)`` returns logits ``[b, t, vocab]``;
    ``forward(idx, targets)`` returns the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.ctx, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        proj_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue  # LayerNorm: nn.LayerNorm's own init (gain 1, bias 0)
            std = proj_std if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    @property
    def dummy_inputs(self) -> dict[str, Tensor]:
        """One short row of tokens, as Hugging Face models offer theirs: what ``anvil_fast.ANVIL(model)``
        traces to route each parameter by what it does."""
        return {"idx": torch.zeros(1, min(4, self.cfg.ctx), dtype=torch.long, device=self.wte.weight.device)}

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        b, t = idx.shape
        if t > self.cfg.ctx:
            raise ValueError(f"sequence length {t} exceeds the context {self.cfg.ctx}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(size: str | GPTConfig, *, seed: int = 0, device: torch.device | str = "cpu", **overrides) -> GPT:
    """A GPT of a named size (:data:`SIZE_NAMES`: :data:`SIZES`, each also with BF16_SUFFIX) or
    config, initialized from ``seed`` on the CPU (so every device gets the same weights), then moved
    to ``device`` (and, for a ``-bf16`` name, to bf16 parameters)."""
    dtype = None
    if isinstance(size, str):
        if size not in SIZE_NAMES:
            raise ValueError(f"unknown GPT size {size!r}; known: {', '.join(SIZE_NAMES)}")
        if size.endswith(BF16_SUFFIX):
            size, dtype = size[:-len(BF16_SUFFIX)], torch.bfloat16
        cfg = SIZES[size]
    else:
        cfg = size
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(seed)
        model = GPT(cfg)
    return model.to(device=device, dtype=dtype)


__all__ = ["GPT", "GPTConfig", "SIZES", "SIZE_NAMES", "BF16_SUFFIX", "build"]
