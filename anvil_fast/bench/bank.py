"""``python -m anvil_fast.bench bank``: one ANVIL bank update on bf16 banks, side by side in one run
with the baselines (the seed's update with a torch.compile'd plain-matmul cascade, eagerly launched
and captured in a CUDA graph), against the roofline measured in the same run. Also prints every
per-shape tuning decision of :mod:`anvil_fast.kernels.gram_tune` (each candidate's time, made during the
warm-up, outside every timed region) and a phase table: each phase of the update captured alone,
and one map's kernels next to cuBLAS; then the Gram-side table (GRAM_SIDE next to SAFE,
:func:`gram_side_rows`).

Method: the bf16 matmul peak (8192^3, random data) and the device-to-device copy bandwidth are
measured first (:func:`anvil_fast.bench.common.measure_peaks`); every timing is the median of
``triton.testing.do_bench`` after a warm-up that includes compilation and graph capture. FLOPs are
counted per bank (:func:`anvil_fast.bench.common.flops`): ``plain`` = the full matmuls of the math,
``exec`` = what the symmetric kernels execute (lower-triangular tiles only). The roofline floor of
the fast path is the matmul phase's ``exec / peak`` plus the element-wise phases' bytes
(:data:`anvil_fast.bench.common.ELEMENTWISE_BYTES`) over the bandwidth; the matmul phase's own
traffic overlaps its compute.

The banks step with the record's rail scalars at the top of the momentum schedule
(:mod:`anvil_ref.constants`); the rates are small so that repeated updates stay finite.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from typing import Callable

import torch

from anvil_ref.constants import ANVIL_DEFAULTS, RAIL_BETA_MAX, RAIL_FAST_BETA, RAIL_FAST_WEIGHT

from anvil_fast.core.gram_side import map_flops
from anvil_fast.kernels.timing import do_bench_ms
from anvil_fast.bench.common import ELEMENTWISE_BYTES, flops, graphed, kernel_us, measure_peaks

SHAPES = ((8, 256, 768), (8, 768, 768), (8, 2816, 768), (64, 768, 768), (24, 2816, 768))
#: do_bench's warm-up per measurement (ms).
WARMUP_MS = 50

#: One line for ``python -m anvil_fast.bench --help``.
SUMMARY = "one bank update vs the seed's compiled update, against the roofline (GPU)"


def _bench(fn: Callable[[], object], *, rep_ms: int) -> float:
    return do_bench_ms(fn, rep_ms=rep_ms, warmup=WARMUP_MS)


def _make_bank(shape, config, seed=0):
    from anvil_fast.core.bank import AnvilBank

    g = torch.Generator(device="cuda").manual_seed(seed)
    p = (0.02 * torch.randn(shape, device="cuda", generator=g)).bfloat16()
    bank = AnvilBank.create("bench", p, beta2=ANVIL_DEFAULTS["beta2"], config=config)
    bank.grad.copy_(torch.randn(shape, device="cuda", generator=g))
    bank.set_scalars(momentum=RAIL_BETA_MAX, eff_wd=1e-4, fast_beta=RAIL_FAST_BETA, fast_weight=RAIL_FAST_WEIGHT,
                     eff_lr=1e-4)
    return bank


def bank_rows(shapes, *, rep_ms: int) -> list[dict]:
    from anvil_fast.core.bank import anvil_bank_update
    from anvil_fast.core.cascade import FAITHFUL, SAFE, cascade_workspace
    from anvil_fast.core.plain import plain_bank_update, plain_cascade
    from anvil_fast.kernels.rails import twin_rail

    from anvil_ref.progress import Progress

    rows = []
    bar = Progress(len(shapes), "bench bank")
    for shape in shapes:
        bar.update(label=f"bench bank: {'x'.join(map(str, shape))}")
        t0 = time.time()
        r = {"shape": shape}
        plain_bank = _make_bank(shape, FAITHFUL)
        r["plain"] = _bench(lambda: plain_bank_update(plain_bank), rep_ms=rep_ms)
        r["plain_graph"] = _bench(graphed(lambda: plain_bank_update(plain_bank)), rep_ms=rep_ms)
        r["plain_casc_graph"] = _bench(graphed(lambda: plain_cascade(plain_bank)), rep_ms=rep_ms)
        for cfg in (SAFE, FAITHFUL):
            bank = _make_bank(shape, cfg)
            upd = lambda b=bank: anvil_bank_update(b)  # noqa: E731
            if cfg is SAFE:
                r["fast"] = _bench(upd, rep_ms=rep_ms)

                def casc(b=bank):
                    ws = b.workspace
                    ready = twin_rail(b.grad, b.velocity, momentum=b.momentum, fast_beta=b.fast_beta,
                                      fast_weight=b.fast_weight, x_out=ws.X, prescale=b.config.prescale,
                                      fused=b.config.triton_elementwise, partials=ws.partials)
                    cascade_workspace(ws, maps=b.maps, config=b.config, split=b.split_baddbmm, partials_ready=ready)
                r["fast_casc_graph"] = _bench(graphed(casc), rep_ms=rep_ms)
                try:  # the breakdown must never cost the main table
                    r.update(_phases(bank, rep_ms=rep_ms))
                except Exception as e:  # pragma: no cover - reported in the log
                    print(f"  phases of {shape} failed: {type(e).__name__}: {e}", flush=True)
            r[f"{cfg.name}_graph"] = _bench(graphed(upd), rep_ms=rep_ms)
            del bank
        del plain_bank
        torch.cuda.empty_cache()
        r["wall_s"] = time.time() - t0
        rows.append(r)
        print(f"  measured {shape} in {r['wall_s']:.1f} s", flush=True)
        bar.update(advance=1)
    bar.close()
    return rows


def _phases(bank, *, rep_ms: int) -> dict:
    """Graphed time of each phase of the SAFE update alone (rails, cascade = normalization + maps,
    equalizer + update) and of one map's three kernels against cuBLAS doing the same job."""
    from anvil_ref.cascade import is_tall

    from anvil_fast.core.bank import equalize_and_update
    from anvil_fast.core.cascade import cascade_workspace
    from anvil_fast.kernels.gram import XTX, XXT, aX_plus_mm, ba_plus_cAA
    from anvil_fast.kernels.rails import twin_rail

    b, ws = bank, bank.workspace
    r = {}
    kw = dict(momentum=b.momentum, fast_beta=b.fast_beta, fast_weight=b.fast_weight, x_out=ws.X,
              prescale=b.config.prescale, fused=b.config.triton_elementwise, partials=ws.partials)
    ready = twin_rail(b.grad, b.velocity, **kw)
    r["ph_rails"] = _bench(graphed(lambda: twin_rail(b.grad, b.velocity, **kw)), rep_ms=rep_ms)
    r["ph_casc"] = _bench(graphed(lambda: cascade_workspace(ws, maps=b.maps, config=b.config,
                                                             split=b.split_baddbmm, partials_ready=ready)),
                          rep_ms=rep_ms)

    r["ph_post"] = _bench(graphed(lambda: equalize_and_update(b, ws.X, ws)), rep_ms=rep_ms)
    # One map's kernels on a normalized iterate (ws.X holds the cascade's output: orthogonal-ish).
    X, A, B, C = ws.X, ws.A, ws.B, ws.C
    tall = is_tall(X.shape)
    gram = XTX if tall else XXT
    gram(X, out=A)
    ba_plus_cAA(A, alpha=1.9, beta=-4.8, out=B)
    r["k_gram"] = kernel_us(lambda: gram(X, out=A))
    r["k_gram_cublas"] = kernel_us(lambda: torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT))
    r["k_baa"] = kernel_us(lambda: ba_plus_cAA(A, alpha=1.9, beta=-4.8, out=B))
    r["k_baa_cublas"] = kernel_us(lambda: torch.baddbmm(A, A, A, beta=-4.8, alpha=1.9))
    if tall:
        r["k_axb"] = kernel_us(lambda: aX_plus_mm(X, X, B, a=3.4, out=C))
        r["k_axb_cublas"] = kernel_us(lambda: torch.baddbmm(X, X, B, beta=3.4, out=C))
    else:
        r["k_axb"] = kernel_us(lambda: aX_plus_mm(X, B, X, a=3.4, out=C))
        r["k_axb_cublas"] = kernel_us(lambda: torch.baddbmm(X, B, X, beta=3.4, out=C))
    return r


def format_phases(rows, tflops: float, gbs: float) -> str:
    head = (f"{'shape':<14} {'rails':>6} {'casc':>6} {'eq+upd':>6} | {'gram':>6} {'cuBLAS':>6} {'TF/s':>4} | "
            f"{'baa':>6} {'cuBLAS':>6} {'TF/s':>4} | {'axb':>6} {'cuBLAS':>6} {'TF/s':>4} | {'maps':>6} {'other':>6}")
    lines = [head, "-" * len(head)]
    for r in (r for r in rows if "k_gram" in r):
        mf = map_flops(r["shape"])
        g_fl, baa_fl, axb_fl = mf.gram[1], mf.baa[1], mf.axb[1]
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


#: Gram-side rows of the bank table: the five bank shapes and GPT-2-small's MLP banks, both sides.
GRAM_SIDE_SHAPES = SHAPES + ((24, 3072, 768), (24, 768, 3072))


def gram_side_rows(shapes, *, rep_ms: int) -> list[dict]:
    """SAFE next to GRAM_SIDE per shape, graphed: the cascade phase (normalization + maps, after the
    rails) with the Gram side forced whatever the dispatch rule says, and the whole bank update with
    the dispatch rule (GRAM_SIDE's update is SAFE's where it does not pick the Gram side)."""
    from anvil_fast.core.bank import anvil_bank_update
    from anvil_fast.core.cascade import GRAM_SIDE, SAFE, cascade_workspace, gram_side_workspace
    from anvil_fast.core.gram_side import cascade_flops, uses_gram_side
    from anvil_fast.kernels.rails import twin_rail

    rows = []
    for shape in shapes:
        r = {"shape": shape, "dispatch": uses_gram_side(shape, device="cuda"), "flop_ratio": cascade_flops(*shape[-2:])["ratio"]}
        for cfg in (SAFE, GRAM_SIDE):
            b = _make_bank(shape, cfg)
            anvil_bank_update(b)  # allocates the workspace (and the Gram side's buffers) before capture
            ws = b.workspace
            ready = twin_rail(b.grad, b.velocity, momentum=b.momentum, fast_beta=b.fast_beta,
                              fast_weight=b.fast_weight, x_out=ws.X, prescale=cfg.prescale,
                              fused=cfg.triton_elementwise, partials=ws.partials)
            if cfg is SAFE:
                casc = lambda: cascade_workspace(ws, maps=b.maps, config=SAFE, partials_ready=ready)  # noqa: E731
            else:
                casc = lambda: gram_side_workspace(ws, maps=b.maps, config=GRAM_SIDE,  # noqa: E731
                                                   partials_ready=ready)
            r[f"{cfg.name}_casc"] = _bench(graphed(casc), rep_ms=rep_ms)
            r[f"{cfg.name}_update"] = _bench(graphed(lambda: anvil_bank_update(b)), rep_ms=rep_ms)
            del b, ws
        torch.cuda.empty_cache()
        rows.append(r)
    return rows


def format_gram_side(rows) -> str:
    head = (f"{'shape':<14} {'aspect':>6} {'gram?':>5} {'FLOPs x':>7} | {'casc safe':>9} {'casc gram':>9} {'x':>5} | "
            f"{'upd safe':>8} {'upd gram':>8} {'x':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        c, m, n = r["shape"]
        lines.append(f"{'x'.join(map(str, r['shape'])):<14} {max(m, n) / min(m, n):>6.2f} "
                     f"{'yes' if r['dispatch'] else 'no':>5} {r['flop_ratio']:>7.2f} | {r['safe_casc']:>9.3f} "
                     f"{r['gram_side_casc']:>9.3f} {r['safe_casc'] / r['gram_side_casc']:>5.2f} | "
                     f"{r['safe_update']:>8.3f} {r['gram_side_update']:>8.3f} "
                     f"{r['safe_update'] / r['gram_side_update']:>5.2f}")
    lines.append("Gram side (GRAM_SIDE, anvil_fast.core.gram_side) next to SAFE, ms, graphed. casc = normalization + maps "
                 "after the rails, the Gram side forced on every shape; upd = whole bank update with the dispatch "
                 "rule (gram? = uses_gram_side); FLOPs x = SAFE's / the Gram side's (cascade_flops); x = SAFE / Gram "
                 "side. The dispatch threshold should sit where casc x crosses 1.")
    return "\n".join(lines)



# ====================================================================================== orthogonalizers side by side
def _layout_shapes(n_layer: int, width: int, hidden: int, heads: int, head_dim: int = 128):
    return ((n_layer * heads, 2 * head_dim, width), (2 * n_layer, width, width), (2 * n_layer, hidden, width))


#: The bank shapes of the GPT-2 small (12 x 768) and medium (24 x 1024) layouts
#: (:func:`anvil_fast.bench.optimizer.gpt2_small_layout`: [Q; K] head groups, V and O, the MLP pair).
PEER_SHAPES = _layout_shapes(12, 768, 3072, 6) + _layout_shapes(24, 1024, 4096, 8)
#: Matrices of a bank whose output is compared with float64 (every matrix of a smaller bank).
ACCURACY_MATRICES = 4
#: The inputs the accuracy columns average over: gaussian entries, and singular values (k+1)^-1.5
#: (a decaying spectrum, like a gradient's) with random singular vectors.
ACCURACY_FAMILIES = ("gaussian", "decaying")


def _family(shape, family: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    c, m, n = shape
    if family == "gaussian":
        return torch.randn(shape, device="cuda", generator=g)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(c, m, k, device="cuda", generator=g))
    v, _ = torch.linalg.qr(torch.randn(c, n, k, device="cuda", generator=g))
    s = torch.arange(1, k + 1, device="cuda", dtype=torch.float32).pow(-1.5)
    return (u * s) @ v.mT


#: The map set of the equal-work row: gram-newton-schulz runs five Polar Express iterations, so
#: the package's kernels on five Polar Express maps (modded-nanogpt's, reproduced in
#: ``anvil_ref/map_sets``) execute the same products; that row's time against gram-newton-schulz's
#: compares kernels at equal work, and its error columns say what the sixth map of ANVIL_MAPS buys.
EQUAL_WORK_MAPS = "polar_express_nanogpt5"
#: The parts of a bank run at once on their own streams in the default split rows (``fast_cascade(...,
#: streams=SPLIT_STREAMS)``: the same bits as the one-stream row, another schedule on the GPU);
#: ``--split-streams`` picks other counts.
SPLIT_STREAMS = 2


def anvil_row(config: str, streams: int = 1) -> str:
    """The orthogonalizers table's name of ANVIL's cascade in ``config`` (``"SAFE"``, ``"GRAM_SIDE"``),
    split over ``streams`` streams where that is more than one."""
    return f"anvil {config}" + (f", {streams} streams" if streams > 1 else "")


def parse_anvil_row(name: str) -> tuple[str, int] | None:
    """The configuration and stream count of an :func:`anvil_row` name; None for any other row."""
    m = re.fullmatch(r"anvil (SAFE|GRAM_SIDE)(?:, (\d+) streams)?", name)
    return None if m is None else (m.group(1), int(m.group(2) or 1))


def is_anvil_row(name: str) -> bool:
    """Whether a row of the orthogonalizers table runs ANVIL's maps (what a bank goal is judged by)."""
    return parse_anvil_row(name) is not None


#: The orthogonalizers table's rows that run ANVIL's maps by default: SAFE and GRAM_SIDE on one stream and
#: split over SPLIT_STREAMS; and its equal-work row (other maps: a comparison of kernels, never ANVIL's time).
ANVIL_ROWS = tuple(anvil_row(c, s) for s in (1, SPLIT_STREAMS) for c in ("SAFE", "GRAM_SIDE"))
EQUAL_WORK_ROW = f"anvil kernels, 5 maps ({EQUAL_WORK_MAPS})"


def orthogonalizers(split_streams: Sequence[int] = (SPLIT_STREAMS,)) -> dict[str, Callable]:
    """name -> a function of a bf16 bank [c, m, n] returning its orthogonalization (a new tensor):
    the package's SAFE and GRAM_SIDE cascades on one stream and split over each count of
    ``split_streams``, its kernels on :data:`EQUAL_WORK_MAPS` in the
    configuration a bank of that shape gets by default, and, where ``gram_newton_schulz`` imports (its
    CUDA kernels need ``quack-kernels`` on a Hopper or newer GPU), Dao AI Lab's ``GramNewtonSchulz`` and
    ``StandardNewtonSchulz`` with their defaults (Polar Express coefficients, fp16, the Gram
    iteration's restart at its default position, ``torch.compile(mode="reduce-overhead")``)."""
    from anvil_fast.core.cascade import GRAM_SIDE, SAFE, default_config_for, fast_cascade

    def anvil(cfg, streams=1):
        return lambda x: fast_cascade(x, config=cfg, streams=streams)

    def equal_work(x):
        return fast_cascade(x, maps=EQUAL_WORK_MAPS, config=default_config_for(tuple(x.shape), x.device))

    out = {anvil_row(c.name.upper(), s): anvil(c, s) for s in (1, *split_streams) for c in (SAFE, GRAM_SIDE)}
    out[EQUAL_WORK_ROW] = equal_work
    try:
        from gram_newton_schulz import GramNewtonSchulz, StandardNewtonSchulz
    except ImportError:
        return out
    out["gram-newton-schulz GramNewtonSchulz"] = GramNewtonSchulz()
    out["gram-newton-schulz StandardNewtonSchulz"] = StandardNewtonSchulz()
    return out


def _accuracy(y: torch.Tensor, x: torch.Tensor) -> dict:
    """Relative Frobenius distance of ``y`` from the polar factor of ``x`` (float64, per matrix,
    the mean), and the range of ``y``'s singular values over the matrices."""
    x64, y64 = x.double(), y.double()
    u, _, vh = torch.linalg.svd(x64, full_matrices=False)
    q = u @ vh
    err = ((y64 - q).norm(dim=(-2, -1)) / q.norm(dim=(-2, -1))).mean()
    sv = torch.linalg.svdvals(y64)
    return dict(err_polar=float(err), sigma_min=float(sv.min()), sigma_max=float(sv.max()))


def peer_rows(shapes, *, rep_ms: int, fns: dict[str, Callable] | None = None,
              split_streams: Sequence[int] = (SPLIT_STREAMS,)) -> list[dict]:
    """Per bank shape and orthogonalizer: the call's time (``do_bench``, median; each function as
    its library runs it: the package's cascades captured in a CUDA graph, gram-newton-schulz
    compiled with its own CUDA graphs) and its accuracy on :data:`ACCURACY_FAMILIES` (the first
    :data:`ACCURACY_MATRICES` matrices of a bank of each, from the same bf16 input for all)."""
    fns = orthogonalizers(split_streams) if fns is None else fns
    rows = []
    for shape in shapes:
        x = _family(shape, "gaussian").bfloat16()
        acc_in = {fam: _family((min(shape[0], ACCURACY_MATRICES), *shape[1:]), fam, seed=1).bfloat16()
                  for fam in ACCURACY_FAMILIES}
        for name, f in fns.items():
            r = {"shape": shape, "name": name}
            try:
                for fam, xa in acc_in.items():
                    r[fam] = _accuracy(f(xa).float(), xa.float())
                f(x)  # compilation, autotuning and workspaces outside the timed part
                if name.startswith("anvil"):  # the package's rows: captured, as its optimizers run them
                    r["ms"], r["mode"] = _bench(graphed(lambda: f(x)), rep_ms=rep_ms), "graphed"
                else:
                    r["ms"], r["mode"] = _bench(lambda: f(x), rep_ms=rep_ms), "its own compile"
            except Exception as e:  # one failing orthogonalizer must not hide the others
                r["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(r)
            print(f"  {'x'.join(map(str, shape))} {name}: " + (f"{r['ms']:.3f} ms" if "ms" in r else r["error"]),
                  flush=True)
        torch.cuda.empty_cache()
    return rows


def format_peers(rows) -> str:
    head = (f"{'shape':<14} {'orthogonalizer':<40} {'ms':>7} {'x SAFE':>6} | "
            + " | ".join(f"{fam + ' err':>13} {'sigma min..max':>14}" for fam in ACCURACY_FAMILIES))
    lines = [head, "-" * len(head)]
    safe = {r["shape"]: r.get("ms") for r in rows if r["name"] == ANVIL_ROWS[0]}
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            lines.append(f"{shape:<14} {r['name']:<40} failed: {r['error']}")
            continue
        ratio = f"{r['ms'] / safe[r['shape']]:>6.2f}" if safe.get(r["shape"]) else f"{'':>6}"
        cells = " | ".join(f"{r[fam]['err_polar']:>13.4f} {r[fam]['sigma_min']:>6.3f}..{r[fam]['sigma_max']:<6.3f}"
                           for fam in ACCURACY_FAMILIES)
        lines.append(f"{shape:<14} {r['name']:<40} {r['ms']:>7.3f} {ratio} | {cells}")
    lines.append("Orthogonalizers on the bank shapes of the GPT-2 small and medium layouts (the normalization and the "
                 "maps of one bf16 bank; no rails, equalizer or update; 'anvil kernels, 5 maps': the package's "
                 "kernels in the bank's default configuration on five Polar Express maps, gram-newton-schulz's "
                 "count), ms per call (median of do_bench; the package's cascades graphed, gram-newton-schulz as "
                 "it compiles itself); x SAFE = ms / SAFE's ms; "
                 "err = mean relative Frobenius distance from the polar factor UV^T (float64) over "
                 f"{ACCURACY_MATRICES} matrices of each input family; sigma = range of the output's singular values "
                 "(ANVIL's maps aim at a band around 1, not at 1: their err counts that band).")
    return "\n".join(lines)

def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                    help="shapes of the bank table ('' skips it; default: %(default)s)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    ap.add_argument("--peer-shapes", default=",".join("x".join(map(str, s)) for s in PEER_SHAPES),
                    help="shapes of the orthogonalizers' table (SAFE, GRAM_SIDE, gram-newton-schulz; '' skips it; "
                         "default: %(default)s)")
    ap.add_argument("--split-streams", default=str(SPLIT_STREAMS),
                    help="stream counts of the orthogonalizers' split rows, comma-separated (each a row of SAFE "
                         "and one of GRAM_SIDE, the bank run as that many parts at once; '' none; default: "
                         "%(default)s)")
    ap.add_argument("--gram-side-shapes", default=",".join("x".join(map(str, s)) for s in GRAM_SIDE_SHAPES),
                    help="shapes of the Gram-side table ('' skips it; default: %(default)s)")


def run(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("anvil_fast.bench bank: needs a CUDA device (timings come only from GPU runs)")
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    try:
        split = tuple(int(v) for v in a.split_streams.split(",") if v)
    except ValueError:
        split = (0,)
    if any(k < 2 for k in split):
        print(f"anvil_fast.bench bank: --split-streams: counts of at least 2 expected, got {a.split_streams!r}")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    tflops, gbs = measure_peaks()
    import triton

    from anvil_fast.kernels.gram import kernel_mode
    from anvil_fast.kernels.gram_tune import report_lines, tuning_enabled

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"bf16 8192^3 matmul {tflops:.0f} TFLOP/s, copy {gbs:.0f} GB/s (read + write); "
          f"kernels {kernel_mode()}, tuning {'on' if tuning_enabled() else 'off'}", flush=True)
    rows = bank_rows(shapes, rep_ms=a.rep_ms)
    gs_shapes = [tuple(int(v) for v in s.split("x")) for s in a.gram_side_shapes.split(",") if s]
    gs_rows = gram_side_rows(gs_shapes, rep_ms=a.rep_ms) if gs_shapes else []
    peer_shapes = [tuple(int(v) for v in s.split("x")) for s in a.peer_shapes.split(",") if s]
    p_rows = peer_rows(peer_shapes, rep_ms=a.rep_ms, split_streams=split) if peer_shapes else []
    for part in (lambda: "\n".join(report_lines()), lambda: format_phases(rows, tflops, gbs) if rows else "",
                 lambda: format_bank(rows, tflops, gbs) if rows else "",
                 lambda: format_gram_side(gs_rows) if gs_rows else "",
                 lambda: format_peers(p_rows) if p_rows else ""):
        try:
            print(part(), flush=True)
        except Exception as e:  # pragma: no cover - one failing table must not hide the others
            print(f"table failed: {type(e).__name__}: {e}", flush=True)
    return 0


__all__ = ["SHAPES", "add_args", "run", "bank_rows", "format_bank", "format_phases", "GRAM_SIDE_SHAPES",
           "gram_side_rows", "format_gram_side", "PEER_SHAPES", "EQUAL_WORK_MAPS", "orthogonalizers", "peer_rows",
           "format_peers", "SPLIT_STREAMS", "ANVIL_ROWS", "EQUAL_WORK_ROW", "anvil_row", "is_anvil_row"]
