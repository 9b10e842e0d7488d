"""Benchmarks of the fast path: ``python -m anvil_fast.bench <command>`` (a table, never a test).

Commands (each registered in :data:`COMMANDS` as ``name -> (add_arguments, run)``; add one there):

``bank``   one ANVIL bank update on bf16 banks, side by side in one run with the baselines
           (the seed's update with a torch.compile'd plain-matmul cascade, eagerly launched and
           captured in a CUDA graph), against the roofline measured in the same run. Also prints
           every per-shape tuning decision of :mod:`anvil_fast.gram_tune` (each candidate's time,
           made during the warm-up, outside every timed region) and a phase table: each phase of the
           update captured alone, and one map's kernels next to cuBLAS.
``optimizer`` one full AnvilAndAdam step on a GPT-2-small bank layout next to torch.optim.Muon +
           fused AdamW (:mod:`anvil_fast.bench_optimizer`).
``dropin`` the drop-in ``anvil_fast.ANVIL``'s step on the package's GPT (small, medium) next to
           torch.optim.Muon + fused AdamW and fused AdamW alone, with its floor and phase shares
           (:mod:`anvil_fast.bench_dropin`; ``--device cpu`` is a smoke run).

Method (METHOD.md of the device notes): the bf16 matmul peak (8192^3, random data) and the
device-to-device copy bandwidth are measured first; every timing is the median of
``triton.testing.do_bench`` (CUDA events; L2 flushed between repetitions) after a warm-up that
includes compilation and graph capture. FLOPs are counted per bank: ``plain`` = the full
matmuls of the math (per map ``4 k^2 K + 2 k^3`` for ``k = min(rows, cols)``, ``K = max``), ``exec`` =
what the symmetric kernels execute (lower-triangular tiles only). The roofline floor of the fast
path is the matmul phase's ``exec / peak`` plus the element-wise phases' bytes over the bandwidth
(rails 20 B, normalization 4 B -- read and write X, its partials come from the rails --, equalizer 6 B,
update 14 B per element; the matmul phase's own traffic overlaps its compute).
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
ELEMENTWISE_BYTES = 20 + 4 + 6 + 14


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
                    ready = rails_lookahead(b.grad, b.velocity, b.momentum, b.fast_beta, b.fast_weight, x_out=ws.X,
                                            prescale=b.config.prescale, fused=b.config.triton_elementwise,
                                            partials=ws.partials)
                    cascade_workspace(ws, maps=b.maps, config=b.config, split=b.split_baddbmm, partials_ready=ready)
                r["fast_casc_graph"] = _bench(_graphed(casc), rep_ms=rep_ms)
                try:  # the breakdown must never cost the main table
                    r.update(_phases(bank, rep_ms=rep_ms))
                except Exception as e:  # pragma: no cover - reported in the log
                    print(f"  phases of {shape} failed: {type(e).__name__}: {e}", flush=True)
            r[f"{cfg.name}_graph"] = _bench(_graphed(upd), rep_ms=rep_ms)
            del bank
        del plain_bank
        torch.cuda.empty_cache()
        r["wall_s"] = time.time() - t0
        rows.append(r)
        print(f"  measured {shape} in {r['wall_s']:.1f} s", flush=True)
    return rows


def _phases(bank, *, rep_ms: int) -> dict:
    """Graphed time of each phase of the SAFE update alone (rails, cascade = normalization + maps,
    equalizer + update) and of one map's three kernels against cuBLAS doing the same job."""
    from .cascade import cascade_workspace, is_tall
    from .equalizer import rail_equalizer
    from .gram import XTX, XXT, aX_plus_mm, ba_plus_cAA
    from .gram_tune import _time_us
    from .rails import rails_lookahead
    from .update import sign_aligned_decay_update

    b, ws = bank, bank.workspace
    r = {}
    kw = dict(prescale=b.config.prescale, fused=b.config.triton_elementwise, partials=ws.partials)
    ready = rails_lookahead(b.grad, b.velocity, b.momentum, b.fast_beta, b.fast_weight, x_out=ws.X, **kw)
    r["ph_rails"] = _bench(_graphed(lambda: rails_lookahead(
        b.grad, b.velocity, b.momentum, b.fast_beta, b.fast_weight, x_out=ws.X, **kw)), rep_ms=rep_ms)
    r["ph_casc"] = _bench(_graphed(lambda: cascade_workspace(ws, maps=b.maps, config=b.config,
                                                             split=b.split_baddbmm, partials_ready=ready)),
                          rep_ms=rep_ms)

    def post():
        v = rail_equalizer(ws.X, b.lane_energy, b.beta2, b.red_dim, guard_trips=b.guard_trips,
                           fused=b.config.triton_elementwise, work=ws.equalizer)
        sign_aligned_decay_update(b.p_slice, b.mantissa, v, b.eff_wd, b.eff_lr, b.velocity[1])
    r["ph_post"] = _bench(_graphed(post), rep_ms=rep_ms)
    # One map's kernels on a normalized iterate (ws.X holds the cascade's output: orthogonal-ish).
    X, A, B, C = ws.X, ws.A, ws.B, ws.C
    tall = is_tall(X.shape)
    gram = XTX if tall else XXT
    gram(X, out=A)
    ba_plus_cAA(A, alpha=1.9, beta=-4.8, out=B)
    r["k_gram"] = _time_us(lambda: gram(X, out=A))
    r["k_gram_cublas"] = _time_us(lambda: torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT))
    r["k_baa"] = _time_us(lambda: ba_plus_cAA(A, alpha=1.9, beta=-4.8, out=B))
    r["k_baa_cublas"] = _time_us(lambda: torch.baddbmm(A, A, A, beta=-4.8, alpha=1.9))
    if tall:
        r["k_axb"] = _time_us(lambda: aX_plus_mm(X, X, B, a=3.4, out=C))
        r["k_axb_cublas"] = _time_us(lambda: torch.baddbmm(X, X, B, beta=3.4, out=C))
    else:
        r["k_axb"] = _time_us(lambda: aX_plus_mm(X, B, X, a=3.4, out=C))
        r["k_axb_cublas"] = _time_us(lambda: torch.baddbmm(X, B, X, beta=3.4, out=C))
    return r


def format_phases(rows, tflops: float, gbs: float) -> str:
    head = (f"{'shape':<14} {'rails':>6} {'casc':>6} {'eq+upd':>6} | {'gram':>6} {'cuBLAS':>6} {'TF/s':>4} | "
            f"{'baa':>6} {'cuBLAS':>6} {'TF/s':>4} | {'axb':>6} {'cuBLAS':>6} {'TF/s':>4} | {'maps':>6} {'other':>6}")
    lines = [head, "-" * len(head)]
    for r in (r for r in rows if "k_gram" in r):
        c, m, n = r["shape"]
        k, K = min(m, n), max(m, n)
        t = math.ceil(k / 128)
        f = t * (t + 1) / 2 / (t * t)
        g_fl, baa_fl, axb_fl = f * 2 * k * k * K * c, f * 2 * k ** 3 * c, 2 * k * k * K * c
        maps_ms = 6 * (r["k_gram"] + r["k_baa"] + r["k_axb"]) / 1000
        lines.append(
            f"{'x'.join(map(str, r['shape'])):<14} {r['ph_rails']:>6.3f} {r['ph_casc']:>6.3f} {r['ph_post']:>6.3f} | "
            f"{r['k_gram']:>6.1f} {r['k_gram_cublas']:>6.1f} {g_fl / r['k_gram'] / 1e6:>4.0f} | "
            f"{r['k_baa']:>6.1f} {r['k_baa_cublas']:>6.1f} {baa_fl / r['k_baa'] / 1e6:>4.0f} | "
            f"{r['k_axb']:>6.1f} {r['k_axb_cublas']:>6.1f} {axb_fl / r['k_axb'] / 1e6:>4.0f} | "
            f"{maps_ms:>6.3f} {r['safe_graph'] - maps_ms:>6.3f}")
    lines.append("Phases of the SAFE update, each captured alone (ms): rails = twin rails + lookahead + clamp "
                 "(+ the normalization's block partials when fused), casc = normalization (+ prescale) + 6 maps, eq+upd = guarded equalizer + mantissa update. One map's kernels "
                 "(us, CUDA-graph replays, tuned configuration) next to cuBLAS doing the same product (full Gram "
                 "bmm; baddbmm for b*A + c*A@A and for a*X + X@B, which first copies X); TF/s = FLOPs the "
                 "kernel executes (lower tiles only for the symmetric ones). maps = 6 x (gram + baa + axb) in ms; "
                 "other = safe+G - maps (element-wise phases, first normalization, launch gaps).")
    return "\n".join(lines)


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


def _bank_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")


def _bank_run(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("anvil_fast.bench bank: needs a CUDA device (timings come only from GPU runs)")
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    tflops, gbs = measure_peaks()
    import triton

    from .gram import kernel_mode
    from .gram_tune import report_lines, tuning_enabled

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"bf16 8192^3 matmul {tflops:.0f} TFLOP/s, copy {gbs:.0f} GB/s (read + write); "
          f"kernels {kernel_mode()}, tuning {'on' if tuning_enabled() else 'off'}", flush=True)
    rows = bank_rows(shapes, rep_ms=a.rep_ms)
    for part in (lambda: "\n".join(report_lines()), lambda: format_phases(rows, tflops, gbs),
                 lambda: format_bank(rows, tflops, gbs)):
        try:
            print(part(), flush=True)
        except Exception as e:  # pragma: no cover - one failing table must not hide the others
            print(f"table failed: {type(e).__name__}: {e}", flush=True)
    return 0


def _optimizer_args(ap: argparse.ArgumentParser) -> None:
    from .bench_optimizer import add_args

    add_args(ap)


def _optimizer_run(a: argparse.Namespace) -> int:
    from .bench_optimizer import run

    return run(a)


def _dropin_args(ap: argparse.ArgumentParser) -> None:
    from .bench_dropin import add_args

    add_args(ap)


def _dropin_run(a: argparse.Namespace) -> int:
    from .bench_dropin import run

    return run(a)


#: name -> (add_arguments(parser), run(namespace) -> exit code)
COMMANDS: dict[str, tuple[Callable, Callable]] = {"bank": (_bank_args, _bank_run),
                                                  "optimizer": (_optimizer_args, _optimizer_run),
                                                  "dropin": (_dropin_args, _dropin_run),
                                                  "train_step": __import__("anvil_fast.train_step", fromlist=["COMMAND"]).COMMAND}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (add, _) in COMMANDS.items():
        add(sub.add_parser(name))
    a = ap.parse_args(argv)
    return COMMANDS[a.command][1](a)


if __name__ == "__main__":
    sys.exit(main())
