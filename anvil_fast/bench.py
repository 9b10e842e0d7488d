"""Benchmarks of the fast path: ``python -m anvil_fast.bench <command>`` (a table, never a test).

Commands (each registered in :data:`COMMANDS` as ``name -> (add_arguments, run)``; add one there):

``bank``   one ANVIL bank update on bf16 banks, side by side in one run with the baselines
           (the seed's update with a torch.compile'd plain-matmul cascade, eagerly launched and
           captured in a CUDA graph), against the roofline measured in the same run.
           ``--sweep`` also times a few tile configurations of each kernel per shape.
``optimizer`` one full AnvilAndAdam step on a GPT-2-small bank layout next to torch.optim.Muon +
           fused AdamW (:mod:`anvil_fast.bench_optimizer`).

Method (METHOD.md of the device notes): the bf16 matmul peak (8192^3, random data) and the
device-to-device copy bandwidth are measured first; every timing is the median of
``triton.testing.do_bench`` (CUDA events; L2 flushed between repetitions) after a warm-up that
includes compilation and graph capture. FLOPs are counted per bank: ``plain`` = the full
matmuls of the math (per map ``4 k^2 K + 2 k^3`` for ``k = min(rows, cols)``, ``K = max``), ``exec`` =
what the symmetric kernels execute (lower-triangular tiles only). The roofline floor of the fast
path is the matmul phase's ``exec / peak`` plus the element-wise phases' bytes over the bandwidth
(rails 20 B, normalization 8 B, equalizer 6 B, update 14 B per element; the matmul phase's own
traffic overlaps its compute).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Callable

import torch

SHAPES = ((8, 256, 768), (8, 768, 768), (8, 2816, 768), (64, 768, 768), (24, 2816, 768))
ELEMENTWISE_BYTES = 20 + 8 + 6 + 14


def _bench(fn: Callable[[], object], *, rep_ms: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def measure_peaks() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s on 8192^3 random data, device-to-device copy GB/s counting read + write)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms_c = _bench(lambda: dst.copy_(src))
    gbs = 2 * src.numel() / ms_c / 1e6
    del a, b, src, dst
    return tflops, gbs


def flops(shape, block: int = 128) -> tuple[float, float]:
    """(plain, executed-by-symmetric-kernels) FLOPs of one bank's cascade."""
    c, m, n = shape
    k, K = min(m, n), max(m, n)
    t = math.ceil(k / block)
    f = t * (t + 1) / 2 / (t * t)
    plain = 6 * (4 * k * k * K + 2 * k ** 3) * c
    execd = 6 * (f * (2 * k * k * K + 2 * k ** 3) + 2 * k * k * K) * c
    return plain, execd


def _make_bank(shape, config, seed=0):
    from .bank import AnvilBank

    g = torch.Generator(device="cuda").manual_seed(seed)
    p = (0.02 * torch.randn(shape, device="cuda", generator=g)).bfloat16()
    bank = AnvilBank.create("bench", p, beta2=0.9, config=config)
    bank.grad.copy_(torch.randn(shape, device="cuda", generator=g))
    bank.set_scalars(momentum=0.93, eff_wd=1e-4, fast_beta=0.85, fast_weight=0.4385, eff_lr=1e-4)
    return bank


def _graphed(fn: Callable[[], object]) -> Callable[[], None]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bank_rows(shapes, *, rep_ms: int) -> list[dict]:
    from .bank import anvil_bank_update
    from .cascade import FAITHFUL, SAFE, cascade_workspace
    from .plain import plain_bank_update, plain_cascade
    from .rails import rails_lookahead

    rows = []
    for shape in shapes:
        t0 = time.time()
        r = {"shape": shape}
        plain_bank = _make_bank(shape, FAITHFUL)
        r["plain"] = _bench(lambda: plain_bank_update(plain_bank), rep_ms=rep_ms)
        r["plain_graph"] = _bench(_graphed(lambda: plain_bank_update(plain_bank)), rep_ms=rep_ms)
        r["plain_casc_graph"] = _bench(_graphed(lambda: plain_cascade(plain_bank)), rep_ms=rep_ms)
        for cfg in (SAFE, FAITHFUL):
            bank = _make_bank(shape, cfg)
            upd = lambda b=bank: anvil_bank_update(b)  # noqa: E731
            if cfg is SAFE:
                r["fast"] = _bench(upd, rep_ms=rep_ms)

                def casc(b=bank):
                    ws = b.workspace
                    rails_lookahead(b.grad, b.velocity, b.momentum, b.fast_beta, b.fast_weight, x_out=ws.X,
                                    scale_out=ws.scale, prescale=b.config.prescale)
                    cascade_workspace(ws, maps=b.maps, config=b.config, split=b.split_baddbmm)
                r["fast_casc_graph"] = _bench(_graphed(casc), rep_ms=rep_ms)
            r[f"{cfg.name}_graph"] = _bench(_graphed(upd), rep_ms=rep_ms)
            del bank
        del plain_bank
        torch.cuda.empty_cache()
        r["wall_s"] = time.time() - t0
        rows.append(r)
        print(f"  measured {shape} in {r['wall_s']:.1f} s", flush=True)
    return rows


def format_bank(rows, tflops: float, gbs: float) -> str:
    head = (f"{'shape':<14} {'plain':>7} {'plain+G':>7} {'safe':>7} {'safe+G':>7} {'faith+G':>7} {'xG':>5} "
            f"{'cascG pl':>8} {'cascG fa':>8} {'xcasc':>5} {'TF/s':>5} {'TF/s ex':>7} {'floor':>6} {'%floor':>6}  limit")
    lines = [head, "-" * len(head)]
    for r in rows:
        c, m, n = r["shape"]
        plain_f, exec_f = flops(r["shape"])
        t = r["safe_graph"]
        mm_ms = exec_f / (tflops * 1e9)
        ew_ms = ELEMENTWISE_BYTES * c * m * n / (gbs * 1e6)
        floor = mm_ms + ew_ms
        limit = "matmul" if mm_ms > ew_ms else "memory"
        if t < 0.05 + floor * 1.3 and c * m * n < 4e6:
            limit += "+launch"
        lines.append(
            f"{'x'.join(map(str, r['shape'])):<14} {r['plain']:>7.3f} {r['plain_graph']:>7.3f} {r['fast']:>7.3f} "
            f"{t:>7.3f} {r['faithful_graph']:>7.3f} {r['plain_graph'] / t:>5.2f} {r['plain_casc_graph']:>8.3f} "
            f"{r['fast_casc_graph']:>8.3f} {r['plain_casc_graph'] / r['fast_casc_graph']:>5.2f} "
            f"{plain_f / t / 1e9:>5.0f} {exec_f / t / 1e9:>7.0f} {floor:>6.3f} {100 * floor / t:>5.0f}%  "
            f"{limit} (mm {mm_ms:.3f} ms, elementwise {ew_ms:.3f} ms)")
    lines.append("ms per bank update (median). plain = seed update with a torch.compile'd plain-matmul cascade; "
                 "+G = captured in a CUDA graph; safe = anvil_fast default (SAFE), faith = FAITHFUL; "
                 "xG = plain+G / safe+G; cascG = rails + cascade alone, graphed (pl = plain, fa = fast SAFE); "
                 "TF/s = plain-math FLOPs / safe+G time, TF/s ex = executed FLOPs / time; floor = roofline "
                 f"(matmul at {tflops:.0f} TFLOP/s + element-wise bytes at {gbs:.0f} GB/s).")
    return "\n".join(lines)


SWEEP = {
    "gram": [(64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3)],
    "mm_add": [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
               (128, 64, 64, 4, 4)],
}


def sweep_rows(shapes, *, rep_ms: int) -> list[str]:
    from .gram import XTX, XXT, TileConfig, aX_plus_mm, ba_plus_cAA

    out = []
    for shape in shapes:
        c, m, n = shape
        tall = m > n
        k = min(m, n)
        X = torch.randn(shape, device="cuda").bfloat16()
        A = torch.empty(c, k, k, device="cuda", dtype=torch.bfloat16)
        Bm = torch.empty_like(A)
        C = torch.empty_like(X)
        gram = XTX if tall else XXT
        gram(X, out=A)
        A.div_(A.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None])
        res = {}
        res["gram cuBLAS"] = _bench(lambda: torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT), rep_ms=rep_ms)
        res["baa cuBLAS"] = _bench(lambda: torch.baddbmm(A, A, A, beta=-2.0, alpha=1.5), rep_ms=rep_ms)
        res["axb cuBLAS baddbmm"] = _bench(
            lambda: torch.baddbmm(X, X, Bm, beta=2.0, out=C) if tall else torch.baddbmm(X, Bm, X, beta=2.0, out=C),
            rep_ms=rep_ms)
        res["axb cuBLAS bmm+add"] = _bench(
            lambda: (torch.bmm(X, Bm, out=C) if tall else torch.bmm(Bm, X, out=C)).add_(X, alpha=2.0), rep_ms=rep_ms)
        for cfg in SWEEP["gram"]:
            tc = TileConfig(cfg[0], cfg[1], cfg[2], cfg[3], cfg[4])
            res[f"gram {cfg}"] = _bench(lambda: gram(X, out=A, config=tc), rep_ms=rep_ms)
            res[f"baa {cfg}"] = _bench(lambda: ba_plus_cAA(A, alpha=1.5, beta=-2.0, out=Bm, config=tc), rep_ms=rep_ms)
        for cfg in SWEEP["mm_add"]:
            tc = TileConfig(*cfg)
            if tall:
                res[f"axb {cfg}"] = _bench(lambda: aX_plus_mm(X, X, Bm, a=2.0, out=C, config=tc), rep_ms=rep_ms)
            else:
                res[f"axb {cfg}"] = _bench(lambda: aX_plus_mm(X, Bm, X, a=2.0, out=C, config=tc), rep_ms=rep_ms)
        res["gram default"] = _bench(lambda: gram(X, out=A), rep_ms=rep_ms)
        res["baa default"] = _bench(lambda: ba_plus_cAA(A, alpha=1.5, beta=-2.0, out=Bm), rep_ms=rep_ms)
        res["axb default"] = _bench(
            lambda: aX_plus_mm(X, X, Bm, a=2.0, out=C) if tall else aX_plus_mm(X, Bm, X, a=2.0, out=C), rep_ms=rep_ms)
        line = f"{'x'.join(map(str, shape))}: " + "; ".join(f"{k} {v * 1000:.1f}us" for k, v in res.items())
        out.append(line)
        print(line, flush=True)
    return out


def _bank_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    ap.add_argument("--sweep", action="store_true", help="also time tile configurations of each kernel")
    ap.add_argument("--sweep-shapes", default=None, help="shapes for --sweep (default: --shapes)")


def _bank_run(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("anvil_fast.bench bank: needs a CUDA device (timings come only from GPU runs)")
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    tflops, gbs = measure_peaks()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 8192^3 matmul {tflops:.0f} TFLOP/s, "
          f"copy {gbs:.0f} GB/s (read + write)", flush=True)
    if a.sweep:
        sshapes = shapes if not a.sweep_shapes else [tuple(int(v) for v in s.split("x")) for s in a.sweep_shapes.split(",")]
        sweep_rows(sshapes, rep_ms=max(50, a.rep_ms // 2))
    rows = bank_rows(shapes, rep_ms=a.rep_ms)
    print(format_bank(rows, tflops, gbs))
    return 0


def _optimizer_args(ap: argparse.ArgumentParser) -> None:
    from .bench_optimizer import add_args

    add_args(ap)


def _optimizer_run(a: argparse.Namespace) -> int:
    from .bench_optimizer import run

    return run(a)


#: name -> (add_arguments(parser), run(namespace) -> exit code)
COMMANDS: dict[str, tuple[Callable, Callable]] = {"bank": (_bank_args, _bank_run),
                                                  "optimizer": (_optimizer_args, _optimizer_run)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (add, _) in COMMANDS.items():
        add(sub.add_parser(name))
    a = ap.parse_args(argv)
    return COMMANDS[a.command][1](a)


if __name__ == "__main__":
    sys.exit(main())
