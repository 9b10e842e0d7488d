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

The Chrome trace is written to ``DIR/trace_<size>.json``. Device times under the profiler are those
of the profiled run: a ratio between kernels of one run is what it measures, not a benchmark.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--variant", default="anvil", help="a variant of python -m anvil_fast.bench dropin")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--show", type=int, default=5, help="which recorded step's timeline to print")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/kernel_profile.py needs CUDA")
        return 2
    from torch.profiler import ProfilerActivity, profile

    from anvil_fast.bench.dropin import _model, _set_grads, make_variant

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
    print("\n".join(timeline(json.loads(path.read_text()), per_step, min(a.show, a.steps - 1))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
