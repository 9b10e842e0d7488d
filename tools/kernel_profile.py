"""Where one graphed drop-in step's device time goes, kernel by kernel and stream by stream (CUDA only).

    python tools/kernel_profile.py --size small --out DIR

Builds the drop-in ``anvil_fast.ANVIL`` (``--variant``, defaults) on the package's GPT as ``python -m
anvil_fast.bench dropin`` does, takes ``--warmup`` steps, then records ``--steps`` steps under
``torch.profiler`` (CUPTI reports each kernel of a graph replay) and prints:

* per kernel name: device time per step and launches per step (their sum exceeds the step's span
  where the banks' side streams overlap);
* one step's timeline (the ``--show``-th recorded step): each stream's kernel count, busy time and
  first start / last end from the step's first kernel, then every kernel with its start, duration,
  stream and grid. Kernels that run one after another on the main stream before the side streams
  start, and those after the last bank kernel, are the step's serial head and tail.

* the step's two phases: the matmul kernels (:data:`MATMUL_KERNELS`) and every other kernel, each
  phase's busy time as the union of its kernels' intervals over all streams, the time both run at once,
  and the matmul phase's rate: the cascade FLOPs the drop-in's banks execute at that size
  (:func:`anvil_fast.bench.common.executed_flops`, each bank's default configuration on CUDA) over the
  phase's busy time (``--peak-tflops``: also as a share of that peak).

The Chrome trace is written to ``DIR/trace_<size>.json``. Device times under the profiler are those
of the profiled run: a ratio between kernels of one run is what it measures, not a benchmark.

    python tools/kernel_profile.py --from-log LOG --size medium [--peak-tflops T]

prints the phase lines of a stored log's timeline (no GPU needed).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith("Optimizer.step")]


def per_kernel(events: list, steps: int) -> list[tuple[str, float, float]]:
    """(name, us per step, launches per step), largest first."""
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        a = agg[e.name[:90]]
        a[0] += 1
        a[1] += e.device_time
    return sorted(((k, t / steps, n / steps) for k, (n, t) in agg.items()), key=lambda r: -r[1])


def timeline(trace: dict, per_step: int, show: int) -> list[str]:
    """One step's kernels from the Chrome trace: per stream, then each kernel in start order."""
    ev = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"
                 and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    step = ev[show * per_step:(show + 1) * per_step]
    if not step:
        return [f"no step {show} in the trace ({len(ev)} device events, {per_step} per step)"]
    t0 = step[0]["ts"]
    out = [f"step {show}: {len(step)} device events, span {max(e['ts'] + e['dur'] for e in step) - t0:.1f} us"]
    streams = collections.defaultdict(list)
    for e in step:
        streams[e["args"].get("stream")].append(e)
    for s, es in streams.items():
        out.append(f"  stream {s}: {len(es)} kernels, busy {sum(e['dur'] for e in es):.1f} us, "
                   f"from {es[0]['ts'] - t0:.1f} to {max(e['ts'] + e['dur'] for e in es) - t0:.1f} us")
    out.append("  start us  dur us  stream  kernel  grid")
    for e in step:
        out.append(f"  {e['ts'] - t0:8.1f} {e['dur']:7.1f}  {e['args'].get('stream')}  {e['name'][:70]}  "
                   f"{e['args'].get('grid')}")
    return out


#: The kernels of the cascade's matrix products (each also under its ``_v1`` name): the Gram matrix, the
#: symmetric products and ``a X + B X``. Every other kernel of the step is element-wise or a reduction.
MATMUL_KERNELS = ("_gram_kernel", "_sym_product_kernel", "_mm_add_kernel", "_sym_mm_add_kernel")


def _is_matmul(name: str) -> bool:
    return name.startswith(MATMUL_KERNELS)


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def timeline_events(log_text: str) -> list[tuple[float, float, str]]:
    """``(start us, duration us, kernel name)`` of the timeline a log of this tool prints."""
    lines = log_text.splitlines()
    try:
        i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("start us  dur us"))
    except StopIteration:
        raise ValueError("no timeline in the log (its header line 'start us  dur us  stream  kernel  grid')") from None
    out = []
    for ln in lines[i + 1:]:
        parts = ln.split()
        try:
            out.append((float(parts[0]), float(parts[1]), parts[3]))
        except (IndexError, ValueError):
            break
    return out


def phase_lines(events: list[tuple[float, float, str]], *, flop: float | None = None,
                peak_tflops: float | None = None) -> list[str]:
    """The step's matmul and other phases (module docstring) from ``(start, duration, name)`` events."""
    mm = [(a, a + d) for a, d, n in events if _is_matmul(n)]
    other = [(a, a + d) for a, d, n in events if not _is_matmul(n)]
    b_mm, b_other, b_all = _busy(mm), _busy(other), _busy(mm + other)
    out = [f"phases: matmul kernels busy {b_mm:.1f} us, other kernels busy {b_other:.1f} us (each the union over "
           f"streams), both at once {b_mm + b_other - b_all:.1f} us, anything running {b_all:.1f} us"]
    if flop is not None and b_mm > 0:
        rate = flop / (b_mm * 1e-6) / 1e12
        out.append(f"matmul phase: {flop / 1e12:.3f} TFLOP executed per step, {rate:.0f} TFLOP/s over its busy time"
                   + (f", {100 * rate / peak_tflops:.0f}% of {peak_tflops:g} TFLOP/s" if peak_tflops else ""))
    return out


def dropin_flop(size: str) -> float:
    """Cascade FLOPs per step of the default drop-in's banks on the package's GPT of ``size``, each bank
    at the configuration it gets on CUDA (built on the CPU, where a bank's configuration may differ: the
    banks' shapes do not depend on the device). A profiled run counts its own optimizer's instead
    (:func:`anvil_fast.bench.dropin.cascade_flop`)."""
    from anvil_fast import ANVIL
    from anvil_fast.bench.common import executed_flops
    from anvil_fast.models import gpt

    opt = ANVIL(gpt.build(size))
    inner = opt.inner
    return sum(executed_flops(tuple(inner.banks[b].p_slice.shape), None, "cuda") for b in inner.bank_labels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--variant", default="anvil", help="a variant of python -m anvil_fast.bench dropin")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--show", type=int, default=5, help="which recorded step's timeline to print")
    ap.add_argument("--out", default=".")
    ap.add_argument("--from-log", default=None, help="print the phase lines of this stored log's timeline (no GPU)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's measured bf16 matmul peak")
    a = ap.parse_args(argv)
    if a.from_log:
        try:
            events = timeline_events(Path(a.from_log).read_text())
        except (OSError, ValueError) as e:
            print(f"tools/kernel_profile.py --from-log {a.from_log}: {e}", file=sys.stderr)
            return 2
        print(f"{a.from_log}, size {a.size}:")
        print("\n".join(phase_lines(events, flop=dropin_flop(a.size), peak_tflops=a.peak_tflops)))
        return 0
    if not torch.cuda.is_available():
        print("tools/kernel_profile.py needs CUDA")
        return 2
    from torch.profiler import ProfilerActivity, profile

    from anvil_fast.bench.dropin import _model, _set_grads, cascade_flop, make_variant

    dev = torch.device("cuda")
    model = _model(a.size, dev)
    _set_grads(model, dev)
    opt = make_variant(a.variant, model, dev)
    for _ in range(a.warmup):
        opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            opt.step()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    rows = per_kernel(events, a.steps)
    print(f"{a.size} {a.variant}: {len(events) / a.steps:.0f} device events per step, kernel time "
          f"{sum(t for _, t, _ in rows):.1f} us per step (summed over streams)")
    for name, t, n in rows[:45]:
        print(f"{t:9.1f} us/step {n:6.1f}/step  {name}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trace_{a.size}.json"
    prof.export_chrome_trace(str(path))
    per_step = round(len(events) / a.steps)
    lines = timeline(json.loads(path.read_text()), per_step, min(a.show, a.steps - 1))
    print("\n".join(lines))
    print("\n".join(phase_lines(timeline_events("\n".join(lines)), flop=cascade_flop(opt), peak_tflops=a.peak_tflops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
