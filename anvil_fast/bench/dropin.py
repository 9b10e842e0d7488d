"""``python -m anvil_fast.bench dropin``: the optimizer step of the drop-in ``anvil_fast.ANVIL`` on the
package's GPT (:func:`anvil_fast.models.gpt.build`, fp32 parameters), side by side in one run with
``torch.optim.Muon`` (the blocks' 2-D weights, the matrices ANVIL banks) + fused ``torch.optim.AdamW``
(the rest) and with fused AdamW alone.

Method: every variant gets a fresh model of the same seed and the same seeded random gradients,
set once; after ``--warmup`` steps (compilation, autotuning, graph capture), ``opt.step()`` alone
is timed step by step with CUDA events until ``--rep-ms`` of steps have run; the table shows the
median (and the median host time of one call, which exceeds the device time when the step is
launch-bound). The floor is the bytes the step must move at the copy bandwidth measured in the same
run plus the cascade's executed FLOPs at the measured bf16 peak (:func:`anvil_fast.bench.common.measure_peaks`,
:func:`anvil_fast.bench.common.executed_flops`: the standard cascade's or, on a bank that takes it, the Gram
side's): per bank element the non-finite check's read of the gradient,
the bank update's element-wise bytes (:data:`anvil_fast.bench.common.ELEMENTWISE_BYTES`, which count a
bf16 gradient; an fp32 one read in place adds 2 B; the lean rails take 10 B less), and, where the
gradients are read through buffers, their copy; per Adam element 4 B of check and 28 B of Adam. The
phase table times each phase of the default ANVIL step alone (eagerly, and captured in a CUDA graph
where it can be), with its share of the whole device part.

``--device cpu`` runs a tiny model with every variant that exists on CPU, quickly, so a test can run
the command end to end; its times mean nothing.

``--memory`` times nothing: it counts the bytes of every tensor each optimizer holds after two
steps and ``zero_grad(set_to_none=True)`` (:func:`anvil_fast.bench.common.held_storages`: state,
workspaces, gradient buffers, tables, a gradient it still refers to; each storage once; the
parameters excluded) against ``torch.optim.AdamW``'s on
the same model, split by what holds them, and the transient memory of one step of the
``"transient"`` read (the largest bank's cascade workspace and bf16 gradient, taken for one
update and freed). On the CPU it runs the ``small`` GPT (fp32) by default, ``--sizes`` to choose.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch

from anvil_ref.constants import ADAM_DEFAULTS
from anvil_ref.progress import Progress

from anvil_fast.models.gpt import GPTConfig
from anvil_fast.kernels.timing import call_times
from anvil_fast.bench.common import ELEMENTWISE_BYTES, executed_flops, graphed, held_storages, measure_peaks

VARIANTS = ("anvil", "anvil_graphs", "anvil_eager", "anvil_lean", "muon_adamw", "adamw")
VARIANT_NAMES = {"anvil": "ANVIL, default arguments", "anvil_graphs": "ANVIL, cuda_graphs=True",
                 "anvil_eager": "ANVIL, cuda_graphs=False", "anvil_lean": "ANVIL, rails_dtype=bf16 (lean state)",
                 "muon_adamw": "torch Muon + fused AdamW", "adamw": "fused AdamW alone"}
#: The CPU smoke mode's model: one block, width unequal to the context length.
SMOKE = GPTConfig(n_layer=1, n_embd=32, n_head=2, ctx=16)
GRAD_SCALE = 1e-3

#: One line for ``python -m anvil_fast.bench --help``.
SUMMARY = "the drop-in ANVIL's step on the package's GPT vs Muon + AdamW and AdamW alone (--device cpu: smoke run)"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default=None, help="comma-separated GPT sizes (default small,medium; cpu: smoke; "
                                                  "a size with -bf16, small-bf16, has bf16 parameters)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rep-ms", type=float, default=None, help="timed steps per variant, in ms (default 500; cpu 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; cpu 1)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--no-phases", action="store_true", help="skip the phase table")
    ap.add_argument("--memory", action="store_true",
                    help="count the bytes each optimizer holds (vs AdamW's) instead of timing (module docstring)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step of each ANVIL variant (torch.profiler: ops, launches, host time)")


def _model(size: str, device):
    from anvil_fast.models.gpt import build

    return build(SMOKE if size == "smoke" else size, seed=0, device=device)


def _set_grads(model, device, seed: int = 1) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        p.grad = GRAD_SCALE * torch.randn(p.shape, device=device, generator=g, dtype=p.dtype)


def _hidden(name: str, p) -> bool:
    return p.ndim == 2 and name.startswith("blocks.")


def make_variant(name: str, model, device) -> Callable[[], object]:
    """The variant's optimizer over ``model``; returns its ``step``."""
    fused = dict(fused=True) if device.type == "cuda" else {}
    if name.startswith("anvil"):
        from anvil_fast.optim.entry import ANVIL

        kw = {"anvil_graphs": dict(cuda_graphs=True), "anvil_eager": dict(cuda_graphs=False),
              "anvil_lean": dict(rails_dtype=torch.bfloat16)}.get(name, {})
        return ANVIL(model, **kw)
    if name == "muon_adamw":
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"torch.optim.Muon needs torch >= 2.9, this is {torch.__version__}")
        named = list(model.named_parameters())
        muon = torch.optim.Muon([p for n, p in named if _hidden(n, p)], lr=0.02, weight_decay=0.0)
        adamw = torch.optim.AdamW([p for n, p in named if not _hidden(n, p)], lr=ADAM_DEFAULTS["lr"],
                                  betas=ADAM_DEFAULTS["betas"], eps=ADAM_DEFAULTS["eps"], weight_decay=0.0, **fused)

        class Both:
            def step(self):
                muon.step()
                adamw.step()
        return Both()
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=ADAM_DEFAULTS["lr"], betas=ADAM_DEFAULTS["betas"],
                                 eps=ADAM_DEFAULTS["eps"], weight_decay=0.0, **fused)
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")


def time_fn(fn: Callable[[], object], device, *, rep_ms: float, warmup: int, min_calls: int = 5
            ) -> tuple[float, float, int]:
    """(median device ms per call from CUDA events (CPU: wall ms), median host ms per call, calls)
    of back-to-back calls for ``rep_ms`` after ``warmup`` untimed ones
    (:func:`anvil_fast.kernels.timing.call_times`)."""
    for _ in range(warmup):
        fn()
    dev, host = call_times(fn, device, rep_ms=rep_ms, min_calls=min_calls)
    return statistics.median(dev), statistics.median(host), len(host)


def cascade_flop(opt) -> float:
    """FLOPs one step of the drop-in ``opt`` executes in its banks' cascades, each bank at its own
    configuration on its own device (:func:`anvil_fast.bench.common.executed_flops`)."""
    inner = opt.inner
    return sum(executed_flops(tuple(inner.banks[b].p_slice.shape), inner.banks[b].config,
                              device=inner.banks[b].p_slice.device) for b in inner.bank_labels)


def floor_ms(opt, tflops: float, gbs: float) -> tuple[float, float]:
    """(memory ms, matmul ms) of one default ANVIL step (module docstring)."""
    inner, eng = opt.inner, opt.engine
    nbytes = 0.0
    lean = inner.rails_dtype == torch.bfloat16
    for label in inner.bank_labels:
        bank = inner.banks[label]
        chunk = tuple(bank.p_slice.shape)
        g = bank.p_slice.element_size()  # the gradient's bytes per element (the parameter's dtype)
        # the check and the rails read the gradient where it is (the rails' count assumes bf16)
        per = ELEMENTWISE_BYTES + g + (g - 2) - (10 if lean else 0)
        if eng is None or eng.grad_read != "in_place":
            per += g + 2  # the copy into the bf16 buffer
        nbytes += per * math.prod(chunk)
    fl = cascade_flop(opt)
    for label in inner.adam_labels:
        nbytes += (4 + 28) * inner.param_states[label]["exp_avg"].numel()  # the check, then Adam
    return nbytes / (gbs * 1e6), fl / (tflops * 1e9)


def phases(opt, device, *, rep_ms: float, warmup: int, min_calls: int = 5) -> list[tuple[str, float, float | None]]:
    """(phase, eager ms, graphed ms or None) for each phase of the default ANVIL step, each alone
    (:mod:`anvil_fast.optim.device_step`: host part, check, scalars, banks on one stream and on the lanes,
    Adam, and the whole device part)."""
    eng = opt.engine
    if eng is None:
        raise ValueError("the phase table is the one-process step's (anvil_fast.optim.device_step)")
    eng.collect()
    eng.upload()
    lanes = eng.lanes

    def host():
        eng.collect(refill=True)
        eng.upload()

    def one_stream():
        eng.update_banks(on_lanes=False)

    def on_lanes():
        eng.update_banks()

    state = {k: t.clone() for k, t in eng.mutated().items()}  # the phases below change the state

    rows = [("host part (inbox)", host, False), ("non-finite check", eng.check, True),
            ("scalars", lambda: None, False), (f"banks, one stream", one_stream, True),
            (f"banks, {len(lanes)} stream(s)", on_lanes, True), ("Adam", eng.update_adam, True),
            ("whole device part", eng.device_part, True)]
    out = []
    for name, fn, graphable in rows:
        if name == "scalars":
            continue
        eager = time_fn(fn, device, rep_ms=rep_ms, warmup=warmup, min_calls=min_calls)[0]
        graphed_ms = None
        if graphable and device.type == "cuda":
            graphed_ms = time_fn(graphed(fn), device, rep_ms=rep_ms, warmup=warmup)[0]
        out.append((name, eager, graphed_ms))
    for k, t in eng.mutated().items():
        t.copy_(state[k])
    return out


def profile_step(step: Callable[[], object], device, *, rows: int = 20) -> str:
    """torch.profiler over one step: the ops by host time, and how many kernels were launched."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                     "cudaGraphLaunch", "cudaMemcpyAsync"))
    aten = sum(e.count for e in ev if e.key.startswith("aten::"))
    return (f"{aten} aten ops, {launches} launches/copies/graph launches\n"
            + ev.table(sort_by="self_cpu_time_total", row_limit=rows))


def format_phases(size: str, rows) -> str:
    whole = {n: (e, g) for n, e, g in rows}.get("whole device part")
    lines = [f"phases of the default ANVIL step, {size} (each alone, median ms; graphed = captured in one CUDA graph; "
             "the two bank rows are alternatives; share: of the whole device part, the last row)",
             "| phase | eager ms | share | graphed ms | share |", "|---|---:|---:|---:|---:|"]
    for name, e, g in rows:
        se = f"{e / whole[0]:.0%}" if whole else ""
        sg = f"{g / whole[1]:.0%}" if whole and g is not None and whole[1] else ""
        lines.append(f"| {name} | {e:.3f} | {se} | {'-' if g is None else f'{g:.3f}'} | {sg} |")
    return "\n".join(lines)


#: ``--memory``'s ANVIL variants (name, ANVIL keyword arguments), beside AdamW.
MEMORY_VARIANTS = (("ANVIL, default arguments", {}), ("ANVIL, grad_read='buffers'", {"grad_read": "buffers"}),
                   ("ANVIL, rails_dtype=bf16 (lean state)", {"rails_dtype": torch.bfloat16}))


def _kind(path: str) -> str:
    """What holds a storage, from its attribute path (:func:`held_storages`)."""
    if ".workspace" in path:
        return "workspace"
    if any(k in path for k in ("velocity", "lane_energy", "exp_avg", "mantissa", "['step']")):
        return "state"
    if any(k in path for k in ("grad", "_slots[", "reduce_chunks")) and "engine._slots" not in path:
        return "gradient buffers"
    return "tables"


def transient_bytes(opt) -> int:
    """Bytes one bank update of the ``"transient"`` read takes and frees: the largest bank's cascade
    workspace and bf16 gradient (the banks run one after another)."""
    from anvil_fast.core.cascade import CascadeWorkspace

    most = 0
    for bank in opt.inner.banks.values():
        shape = tuple(bank.p_slice.shape)
        ws = held_storages(CascadeWorkspace.for_shape(shape, bank.p_slice.device))
        most = max(most, sum(ws.values()) + 2 * math.prod(shape))
    return most


def memory_rows(size: str, device) -> list[tuple]:
    """(size, variant, held bytes, ratio to AdamW, {kind: bytes}, transient bytes or None) per variant."""
    from anvil_fast.optim.entry import ANVIL

    rows, adamw = [], None
    for name, kw in (("torch AdamW", None),) + MEMORY_VARIANTS:
        model = _model(size, device)
        _set_grads(model, device)
        ps = list(model.parameters())
        opt = torch.optim.AdamW(ps) if kw is None else ANVIL(model, **kw)
        for _ in range(2):
            opt.step()
        eng = getattr(opt, "engine", None)
        transient = transient_bytes(opt) if eng is not None and eng.grad_read == "transient" else None
        opt.zero_grad(set_to_none=True)  # a gradient the optimizer still refers to then counts as held
        held = held_storages(opt, exclude=ps)
        total = sum(held.values())
        adamw = total if kw is None else adamw
        kinds: dict[str, int] = {}
        for path, n in held.items():
            kinds[_kind(path)] = kinds.get(_kind(path), 0) + n
        rows.append((size, name, total, total / adamw, kinds, transient))
    return rows


def format_memory(rows, n_params: dict[str, int]) -> str:
    mib = 2 ** 20
    lines = ["| model | optimizer | held MiB | x AdamW | state | workspace | gradient buffers | tables | "
             "transient per step |", "|---|---|---|---|---|---|---|---|---|"]
    for size, name, total, ratio, kinds, transient in rows:
        cells = [f"{kinds.get(k, 0) / mib:.2f}" for k in ("state", "workspace", "gradient buffers", "tables")]
        lines.append(f"| {size} ({n_params[size] / 1e6:.2f}M fp32) | {name} | {total / mib:.2f} | {ratio:.3f} | "
                     + " | ".join(cells) + f" | {'-' if transient is None else f'{transient / mib:.2f}'} |")
    return "\n".join(lines)


def run_memory(a: argparse.Namespace, device) -> int:
    sizes = (a.sizes or ("small" if device.type == "cpu" else "small,medium")).split(",")
    rows, n_params = [], {}
    for size in sizes:
        n_params[size] = sum(p.numel() for p in _model(size, device).parameters())
        rows += memory_rows(size, device)
    print(format_memory(rows, n_params))
    return 0


def run(a: argparse.Namespace) -> int:
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("anvil_fast.bench dropin: needs a CUDA device (timings come only from GPU runs); "
              "--device cpu runs the smoke mode")
        return 2
    if a.memory:
        return run_memory(a, device)
    cpu = device.type == "cpu"
    sizes = (a.sizes or ("smoke" if cpu else "small,medium")).split(",")
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"anvil_fast.bench dropin: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        return 2
    rep_ms = a.rep_ms if a.rep_ms is not None else (20 if cpu else 500)
    warmup = a.warmup if a.warmup is not None else (1 if cpu else 10)
    min_calls = 2 if cpu else 5
    if cpu:
        tflops = gbs = None
        print(f"CPU smoke mode (torch {torch.__version__}): times are not measurements", flush=True)
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        tflops, gbs = measure_peaks()
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 8192^3 matmul "
              f"{tflops:.0f} TFLOP/s, copy {gbs:.0f} GB/s (read + write)", flush=True)
    table = []
    bar = Progress(len(sizes) * len(variants), "bench dropin")
    for size in sizes:
        results, floor = {}, None
        for v in variants:
            bar.update(label=f"bench dropin: {size} {v}")
            model = _model(size, device)
            _set_grads(model, device)
            try:
                opt = make_variant(v, model, device)
            except Exception as e:  # a variant that cannot exist here says why and the run goes on
                print(f"  {size} {v}: not run: {type(e).__name__}: {e}", flush=True)
                bar.update(advance=1)
                continue
            t0 = time.time()
            results[v] = time_fn(opt.step, device, rep_ms=rep_ms, warmup=warmup, min_calls=min_calls)
            print(f"  {size} {v}: {results[v][0]:.3f} ms ({results[v][2]} steps, {time.time() - t0:.1f} s)", flush=True)
            if a.profile and v.startswith("anvil"):
                print(f"profile of one step, {size} {v}:\n{profile_step(opt.step, device)}", flush=True)
            if v == "anvil":
                n = sum(p.numel() for p in model.parameters())
                print(f"  {size}: {n / 1e6:.1f}M parameters; banks "
                      + ", ".join(f"{l} x{len(m)}" for l, m in opt.banks.items()), flush=True)
                if tflops is not None:
                    floor = floor_ms(opt, tflops, gbs)
                if not a.no_phases:
                    try:  # the breakdown must never cost the main table
                        print(format_phases(size, phases(opt, device, rep_ms=rep_ms, warmup=warmup,
                                                         min_calls=min_calls)), flush=True)
                    except Exception as e:  # pragma: no cover - reported in the log
                        print(f"  phases of {size} failed: {type(e).__name__}: {e}", flush=True)
            del opt, model
            bar.update(advance=1)
            if not cpu:
                torch.cuda.empty_cache()
        table.append((size, results, floor))
    bar.close()
    print(format_table(table))
    return 0


def format_table(table) -> str:
    lines = ["| size | variant | ms/step | host ms | speed-up vs Muon+AdamW | / fused AdamW | floor ms (memory + matmul) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for size, results, floor in table:
        base, adamw = results.get("muon_adamw"), results.get("adamw")
        for v, (ms, host, _) in results.items():
            f = "" if floor is None or not v.startswith("anvil") else \
                f"{sum(floor):.3f} ({floor[0]:.3f} + {floor[1]:.3f})"
            lines.append(f"| {size} | {VARIANT_NAMES[v]} | {ms:.3f} | {host:.3f} | "
                         f"{'' if base is None else f'{base[0] / ms:.2f}x'} | "
                         f"{'' if adamw is None else f'{ms / adamw[0]:.2f}'} | {f} |")
    lines.append("ms/step: median over the timed steps (CUDA events around opt.step(); CPU: wall time); host ms: "
                 "median time of the call on the host; speed-up: Muon+AdamW's ms / this ms; / fused AdamW: this ms / "
                 "AdamW's (fused on CUDA only); floor: module docstring.")
    return "\n".join(lines)


__all__ = ["add_args", "run", "VARIANTS", "make_variant", "time_fn", "floor_ms", "phases"]
