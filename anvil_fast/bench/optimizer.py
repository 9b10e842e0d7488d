"""``python -m anvil_fast.bench optimizer``: one full optimizer step for a GPT-2-small parameter set
laid out in banks as the seed's model does, side by side in one run with PyTorch's own
``torch.optim.Muon`` (hidden matrices) + fused ``torch.optim.AdamW`` (the rest) on the same
parameters. A table, never a timed test.

The layout (:func:`gpt2_small_layout`; assumed from the seed's model, modded-nanogpt
track_1_short/model/gpt.py, scaled to GPT-2 small: 12 layers, width 768, vocab 50304):

=============  ==================  =====================================================================
``qk_bank``    [72, 256, 768]      per layer 6 head groups of [Q; K] rows (head_dim 128, the seed's heads)
``vo_bank``    [24, 768, 768]      per layer V and O
``mlp_bank``   [24, 3072, 768]     per layer c_fc and c_proj, both stored [hidden, width] (the seed's
                                   [slots, 2, hidden, width]); GPT-2's 4x hidden size (the seed cuts
                                   it to 2816); odd matrices (c_proj) at 2x LR as in the seed
``embed``      [50304, 768]        sharded Adam, tied to lm_head until untied
``lm_head``    [768, 50304]        sharded Adam (the seed's transposed CastedLinearT layout)
``scalars``..  5 small tensors     replicated Adam (~0.1k elements)
=============  ==================  =====================================================================

Banks are bf16 (the seed's storage), Adam parameters fp32: 123.6M distinct weights while embed and
lm_head are tied (GPT-2 small's 124M, less its position embeddings), 162.2M elements updated once
they are untied. Every first dimension is divisible by 8, as the seed's 8-GPU sharding needs.

Measured variants (one GPU, world size 1; each the median of ``triton.testing.do_bench``, CUDA
events, L2 flushed between repetitions, after a warm-up that includes compilation and capture):

* ``anvil_fast``: :class:`~anvil_fast.optim.optimizer.AnvilAndAdam` with the bank updates in CUDA graphs,
  an Adam step (``do_adam=True``) with untied embeddings -- the same parameter updates as the
  baseline -- and, for reference, the same step with every update on the main stream
  (``lanes=1``: the banks one after another, then Adam), the tied Adam step, the non-Adam step (ANVIL
  only; the seed alternates the two) and the Adam step without CUDA graphs. By default one process
  runs its banks on side streams with Adam beside them (:mod:`anvil_fast.optim.lanes`);
* ``baseline``: ``torch.optim.Muon`` (its defaults: 5 Newton-Schulz steps, nesterov) on the 120
  hidden matrices as 2-D bf16 parameters + ``torch.optim.AdamW(fused=True)`` on the rest.

The floor of the fast step: the banks' cascade FLOPs as the fast path executes them
(:func:`anvil_fast.bench.common.executed_flops`: the standard cascade with its symmetric kernels, or the
Gram side on the banks whose configuration takes it) at the bf16 matmul peak measured in the same run, plus the bytes the
step must move at the measured copy bandwidth: per bank element the element-wise phases' bytes
(:data:`anvil_fast.bench.common.ELEMENTWISE_BYTES`, 44 B) + 4 B for the gradient's copy into the bank's
persistent buffer; per Adam element 28 B (p, m, v read and written, g read, fp32). The two terms are
added, as for phases that run one after another (``lanes=1``); where the memory-bound phases run beside
the matmuls (the default's lanes) the step may come in under the sum, and "floor / measured" past 100%
says by how much they overlapped.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from anvil_ref.constants import ADAM_DEFAULTS, EMBED_LABEL, LM_HEAD_LABEL, RAIL_FAST_BETA, RAIL_FAST_WEIGHT

from anvil_fast.kernels.timing import do_bench_ms
from anvil_fast.bench.common import ELEMENTWISE_BYTES, executed_flops, measure_peaks

#: do_bench's warm-up per variant (ms).
WARMUP_MS = 100

#: label -> (shape, bank reshape or None, dtype, table entry)
Layout = dict[str, tuple[tuple[int, ...], tuple[int, int, int] | None, torch.dtype, dict]]

#: One line for ``python -m anvil_fast.bench --help``.
SUMMARY = "one AnvilAndAdam step on a GPT-2-small layout vs torch Muon + fused AdamW (GPU)"


def gpt2_small_layout(*, n_layer: int = 12, width: int = 768, vocab: int = 50304, heads: int = 6,
                      head_dim: int = 128, hidden: int = 3072) -> Layout:
    """The seed-style bank layout of a GPT-2-small parameter set (module docstring)."""
    qk, vo, mlp = (n_layer * heads, 2 * head_dim, width), (2 * n_layer, width, width), (2 * n_layer, hidden, width)
    anvil = {"optim": "anvil", "comms": "sharded"}
    adam_big = {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95], "wd_mul": 150.0}
    small = {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.99], "wd_mul": 0.0}
    return {
        "qk_bank": ((qk[0] * qk[1], width), qk, torch.bfloat16, anvil),
        "vo_bank": ((vo[0] * vo[1], width), vo, torch.bfloat16, anvil),
        "mlp_bank": ((mlp[0] * mlp[1], width), mlp, torch.bfloat16, anvil),
        EMBED_LABEL: ((vocab, width), None, torch.float32, adam_big),
        LM_HEAD_LABEL: ((width, vocab), None, torch.float32, adam_big),
        "scalars": ((2 * n_layer + 8,), None, torch.float32, {**small, "lr_mul": 5.0}),
        "resid_lambdas": ((n_layer, 2), None, torch.float32, small),
        "post_lambdas": ((n_layer, 2), None, torch.float32, small),
        "smear_gate": ((1, 12), None, torch.float32, small),
        "skip_gates": ((n_layer, 4), None, torch.float32, small),
    }


#: The comms schedule of the benchmark: reduces of the big tensors first; work in the same order
#: after the replicated pass, so each wait finds the reduce launched earliest.
SCATTER = ["lm_head", "embed", "mlp_bank", "vo_bank", "qk_bank", "scalars", "resid_lambdas", "post_lambdas",
           "smear_gate", "skip_gates"]
WORK = ["scalars", "resid_lambdas", "post_lambdas", "smear_gate", "skip_gates", "lm_head", "embed", "mlp_bank",
        "vo_bank", "qk_bank"]


def make_params(layout: Layout, device, *, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """The layout's parameters with the seed's attributes (label, reshape); embed = lm_head^T."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for label, (shape, reshape, dtype, _) in layout.items():
        p = torch.nn.Parameter((0.02 * torch.randn(shape, device=device, generator=g)).to(dtype))
        p.label = label
        if reshape is not None:
            p.reshape = reshape
        out.append((label, p))
    d = dict(out)
    if EMBED_LABEL in d and LM_HEAD_LABEL in d:
        with torch.no_grad():
            d[EMBED_LABEL].copy_(d[LM_HEAD_LABEL].T)
    return out


def make_grads(params, *, seed: int = 1, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=params[0][1].device).manual_seed(seed)
    return {l: (scale * torch.randn(p.shape, device=p.device, generator=g)).to(p.dtype) for l, p in params}


def table_of(layout: Layout) -> dict[str, dict]:
    return {label: entry for label, (_, _, _, entry) in layout.items()}


def n_params(layout: Layout, *, tied: bool = False) -> int:
    """Elements of all the layout's tensors (``tied``: counting the tied embed/lm_head pair once)."""
    return sum(math.prod(shape) for label, (shape, *_) in layout.items() if not (tied and label == LM_HEAD_LABEL))


# ---------------------------------------------------------------------------------------------
def _bench(fn: Callable[[], object], rep_ms: int) -> float:
    return do_bench_ms(fn, rep_ms=rep_ms, warmup=WARMUP_MS)


def fast_optimizer(layout: Layout, device, *, comms=None, graphs: bool = True, untie: bool = True, seed: int = 0,
                   lanes: int | None = None):
    from anvil_fast.optim.optimizer import AnvilAndAdam

    params = make_params(layout, device, seed=seed)
    opt = AnvilAndAdam(params, table_of(layout), SCATTER, WORK, comms=comms, lanes=lanes)
    opt.set_rails(RAIL_FAST_BETA, RAIL_FAST_WEIGHT)
    if graphs:
        opt.use_cuda_graphs()
    if untie:
        opt.copy_lm_state_to_embed()
    return opt, params


def step_fn(opt, params, grads, do_adam: bool) -> Callable[[], None]:
    pairs = [(p, grads[l]) for l, p in params]

    def run():
        for p, g in pairs:
            p.grad = g
        opt.step(do_adam=do_adam)
    return run


def baseline(layout: Layout, device, seed: int = 0):
    """torch.optim.Muon on every hidden matrix (2-D bf16 parameters) + fused AdamW on the rest."""
    muon_params, adam_params, grads = [], [], []
    g = torch.Generator(device=device).manual_seed(seed)
    for label, (shape, reshape, dtype, _) in layout.items():
        if reshape is not None:
            for _ in range(reshape[0]):
                p = torch.nn.Parameter((0.02 * torch.randn(reshape[1:], device=device, generator=g)).to(dtype))
                muon_params.append(p)
        else:
            adam_params.append(torch.nn.Parameter((0.02 * torch.randn(shape, device=device, generator=g)).to(dtype)))
    for p in muon_params + adam_params:
        p.grad = (1e-3 * torch.randn(p.shape, device=device, generator=g)).to(p.dtype)
        grads.append(p.grad)
    muon = torch.optim.Muon(muon_params, lr=0.02, weight_decay=0.0)
    adamw = torch.optim.AdamW(adam_params, lr=ADAM_DEFAULTS["lr"], betas=ADAM_DEFAULTS["betas"],
                                  eps=ADAM_DEFAULTS["eps"], weight_decay=0.0, fused=True)

    def run():
        muon.step()
        adamw.step()
    return run, sum(p.numel() for p in muon_params + adam_params)


def floor_ms(layout: Layout, tflops: float, gbs: float, *, world_size: int = 1, tied: bool = False,
             device="cuda") -> tuple[float, float, float]:
    """(matmul ms at the measured peak, memory ms at the measured bandwidth, their sum) for one
    Adam step of the fast path on this rank, each bank's FLOPs those of the configuration it gets
    on ``device`` (:func:`anvil_fast.bench.common.executed_flops`)."""
    fl, bank_bytes, adam_bytes = 0.0, 0.0, 0.0
    for label, (shape, reshape, _, entry) in layout.items():
        if reshape is not None:
            chunk = (reshape[0] // world_size, *reshape[1:])
            fl += executed_flops(chunk, None, device)
            bank_bytes += (ELEMENTWISE_BYTES + 4) * math.prod(chunk)
        else:
            n = math.prod(shape) // (world_size if entry["comms"] == "sharded" else 1)
            if not (tied and label == EMBED_LABEL):
                adam_bytes += 28 * n
    if tied:
        adam_bytes += 20 * math.prod(layout[EMBED_LABEL][0])  # transpose_add (12 B) + transpose_copy (8 B)
    mm = fl / (tflops * 1e12) * 1e3
    mem = (bank_bytes + adam_bytes) / (gbs * 1e9) * 1e3
    return mm, mem, mm + mem


def run(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("anvil_fast.bench optimizer: needs a CUDA device (timings come only from GPU runs)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    layout = gpt2_small_layout()
    tflops, gbs = measure_peaks()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 8192^3 matmul {tflops:.0f} TFLOP/s, "
          f"copy {gbs:.0f} GB/s (read + write); GPT-2-small layout, {n_params(layout, tied=True) / 1e6:.1f}M weights "
          f"tied, {n_params(layout) / 1e6:.1f}M untied", flush=True)
    rows = []
    t0 = time.time()
    base, n_base = baseline(layout, dev)
    base_ms = _bench(base, a.rep_ms)
    rows.append(("torch Muon + fused AdamW", base_ms, None))
    print(f"baseline measured ({n_base / 1e6:.1f}M parameters) at +{time.time() - t0:.0f} s", flush=True)
    del base
    opt, params = fast_optimizer(layout, dev, graphs=True, untie=True)
    grads = make_grads(params)
    print(f"fast optimizer built and captured at +{time.time() - t0:.0f} s", flush=True)
    rows.append(("anvil_fast, Adam step, untied, CUDA graphs", _bench(step_fn(opt, params, grads, True), a.rep_ms),
                 floor_ms(layout, tflops, gbs)))
    rows.append(("anvil_fast, ANVIL-only step (do_adam=False)", _bench(step_fn(opt, params, grads, False), a.rep_ms),
                 None))
    del opt, params
    opt, params = fast_optimizer(layout, dev, graphs=True, untie=True, lanes=1)
    rows.append(("anvil_fast, Adam step, untied, CUDA graphs, every update on the main stream (lanes=1)",
                 _bench(step_fn(opt, params, grads, True), a.rep_ms), floor_ms(layout, tflops, gbs)))
    del opt, params
    opt, params = fast_optimizer(layout, dev, graphs=True, untie=False)
    rows.append(("anvil_fast, Adam step, tied, CUDA graphs", _bench(step_fn(opt, params, grads, True), a.rep_ms),
                 floor_ms(layout, tflops, gbs, tied=True)))
    del opt, params
    opt, params = fast_optimizer(layout, dev, graphs=False, untie=True)
    rows.append(("anvil_fast, Adam step, untied, no graphs", _bench(step_fn(opt, params, grads, True), a.rep_ms),
                 floor_ms(layout, tflops, gbs)))
    print(f"all measured at +{time.time() - t0:.0f} s", flush=True)
    print(format_rows(rows, base_ms))
    mm, mem, _ = floor_ms(layout, tflops, gbs)
    print(f"floor of the untied Adam step: cascade matmuls {mm:.3f} ms at {tflops:.0f} TFLOP/s + memory {mem:.3f} ms "
          f"at {gbs:.0f} GB/s")
    return 0


def format_rows(rows, base_ms: float) -> str:
    lines = ["| step | ms | speed-up vs torch | floor ms (matmul + memory) | floor / measured |",
             "|---|---:|---:|---:|---:|"]
    for name, ms, floor in rows:
        f = "" if floor is None else f"{floor[2]:.3f} ({floor[0]:.3f} + {floor[1]:.3f})"
        r = "" if floor is None else f"{floor[2] / ms:.0%}"
        lines.append(f"| {name} | {ms:.3f} | {base_ms / ms:.2f}x | {f} | {r} |")
    return "\n".join(lines)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rep-ms", type=int, default=300, help="do_bench repetition time per variant")


__all__ = ["gpt2_small_layout", "make_params", "make_grads", "table_of", "SCATTER", "WORK", "fast_optimizer",
           "baseline", "floor_ms", "run", "add_args"]
