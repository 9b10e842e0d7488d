"""What one graphed drop-in step costs the host, and what its CUDA graph holds (CUDA only).

    python tools/graph_nodes.py --size small --out DIR

Builds the drop-in ``anvil_fast.ANVIL`` (defaults) on the package's GPT as ``python -m anvil_fast.bench
dropin`` does, with every CUDA graph in debug mode, takes ``--warmup`` steps, then:

* the host time of each part of ``opt.step()`` (median over ``--steps`` steps, each begun on an idle
  device so that no part waits on it; once for each way of waiting, ``--waits``: blocked in a
  synchronize, or polling an event, where the host thread stays awake; or ``none``: back to back, the
  gradients copied in again between steps, as ``bench peers`` times its host column, so that a part
  which waits on earlier steps' device work shows it): the whole call; the drop-in's storage check, report of earlier
  steps, param-group hand-over and engine call; the gradient collection, the upload of the inbox,
  the graph's replay (``cudaGraphLaunch``) and the engine's step (those and the status copy);
* the graph's nodes by kind (kernel, memcpy, memset, event record / wait, empty) and the kernels by
  name, read from CUDA's DOT dump of each captured graph (``DIR/graph_<i>.dot``).

The host time of a graph launch grows with its nodes; the table says which kernels there are most
of, that is, where fusing or batching removes nodes.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time
from pathlib import Path

import torch


def _debug_graphs() -> list:
    """Every torch.cuda.CUDAGraph made from here on in debug mode (so that it can dump its DOT)."""
    made = []
    base = torch.cuda.CUDAGraph

    class DebugGraph(base):
        # keep_graph=True: torch (2.8 on) instantiates the graph at capture end and frees its cudaGraph_t
        # unless it is kept, and debug_dump prints the kept one; the debug flag after __init__ (the C++
        # graph is built there, so a flag set in __new__ is lost with the object it was set on)
        def __new__(cls, keep_graph: bool = False, *a, **k):
            try:
                return super().__new__(cls, True, *a, **k)
            except TypeError:  # a torch without keep_graph
                return super().__new__(cls)

        def __init__(self, keep_graph: bool = False, *a, **k):
            try:
                super().__init__(True, *a, **k)
            except TypeError:
                super().__init__()
            self.enable_debug_mode()
            made.append(self)

    torch.cuda.CUDAGraph = DebugGraph
    return made


NODE = re.compile(r'"?(graph_\d+_node_\d+)"?\s*\[(.*?)\]\s*;', re.DOTALL)
SKIP = {"KERNEL", "label", "style", "shape", "record", "solid", "name", "func", "handle", "node"}


def parse_dot(text: str) -> tuple[collections.Counter, collections.Counter]:
    """(node kinds, kernel names) of a cudaGraphDebugDotPrint dump."""
    kinds, kernels = collections.Counter(), collections.Counter()
    for m in NODE.finditer(text):
        label = m.group(2)
        kind = re.search(r'label="\{?\s*([A-Z_]+)', label)
        k = kind.group(1) if kind else "?"
        kinds[k] += 1
        if k == "KERNEL":
            # the kernel's name (mangled or not): the longest identifier in the label
            names = [n for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]{5,}", label) if n not in SKIP]
            kernels[max(names, key=len)[:90] if names else "?"] += 1
    return kinds, kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=".")
    ap.add_argument("--waits", default="sync,spin", help="how each step waits for an idle device: sync, spin, "
                    "or none (back to back, as bench peers' host column; a comma list: one table each)")
    ap.add_argument("--variant", default="anvil", choices=("anvil", "anvil_lean"),
                    help="the drop-in's configuration (bench dropin's variants): defaults, or rails in bf16")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/graph_nodes.py needs CUDA")
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    made = _debug_graphs()
    from anvil_fast.bench.dropin import _model, _set_grads, make_variant

    dev = torch.device("cuda")
    model = _model(a.size, dev)
    _set_grads(model, dev)
    opt = make_variant(a.variant, model, dev)
    fixed = [p.grad.clone() for p in model.parameters()]
    for _ in range(a.warmup):
        opt.step()
    torch.cuda.synchronize()
    eng = opt.engine
    print(f"{a.size} ({a.variant}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, engine "
          f"{type(eng).__name__ if eng is not None else None}, graphs made {len(made)} (the tuner's among them), "
          f"use_graphs {getattr(eng, 'use_graphs', None)}", flush=True)

    # host time of each part: wrap the engine's parts with perf_counter
    parts = collections.defaultdict(list)

    def timed(obj, name, label):
        fn = getattr(obj, name)

        def wrapper(*x, **k):
            t = time.perf_counter()
            r = fn(*x, **k)
            parts[label].append(time.perf_counter() - t)
            return r
        setattr(obj, name, wrapper)

    # the drop-in's own host work around the engine (torch.optim's step wrapper is the rest of the total)
    timed(opt, "_check_storage", "drop-in: storage check (parameter addresses)")
    timed(opt, "_report", "drop-in: report (status of earlier steps)")
    timed(opt, "_apply_groups", "drop-in: param groups (hyper-parameters, rails)")
    timed(opt, "_engine_step", "drop-in: _engine_step (report, groups, engine.step)")
    if eng is not None:
        timed(eng, "collect", "collect (grads, addresses)")
        timed(eng, "upload", "upload (inbox to device)")
        for g in eng.graphs.values():
            timed(g, "replay", "graph replay (cudaGraphLaunch)")
        timed(eng, "step", "engine.step (all of the above + status copy)")
    def idle(wait: str) -> None:
        """Wait until the device is idle: ``sync`` blocks in cudaDeviceSynchronize (the host thread may
        sleep, and wake on a colder, slower core), ``spin`` polls an event from Python, so the thread
        stays on a running core, as it would while a training loop's host works ahead. ``none`` does not
        wait: it copies the gradients in again, as bench peers does between its timed steps."""
        if wait == "none":
            with torch.no_grad():
                for p, g in zip(model.parameters(), fixed):
                    p.grad.copy_(g)
            return
        if wait == "sync":
            torch.cuda.synchronize()
            return
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass
        torch.cuda.synchronize()  # (returns at once)

    for wait in a.waits.split(","):
        if wait not in ("sync", "spin", "none"):
            raise SystemExit(f"--waits: {wait!r} is not one of sync, spin, none")
        torch.cuda.synchronize()
        parts.clear()
        totals = []
        # from an idle device (sync, spin) no part of the host's work waits on the device (the upload's
        # pinned slot and the status event are free), so the times are the host's own
        for _ in range(a.steps):
            idle(wait)
            t = time.perf_counter()
            opt.step()
            totals.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        # the same steps with a step hook registered: the drop-in then runs torch.optim's own wrapper (its
        # profiler range and hook loops, lean_step), which a step without hooks skips; interleaved with the
        # plain steps above would disturb their parts, so after them, from an idle device as well
        plain = {k: statistics.median(v) for k, v in parts.items()}  # before the hooked steps add to them
        hooked = []
        handle = opt.register_step_pre_hook(lambda *_: None)
        for _ in range(a.steps):
            idle(wait)
            t = time.perf_counter()
            opt.step()
            hooked.append(time.perf_counter() - t)
        handle.remove()
        torch.cuda.synchronize()
        how = ("back to back, the gradients copied in between (bench peers' host column)" if wait == "none"
               else f"each from an idle device, waited for by {wait}")
        print(f"host us per step, median of {a.steps} ({how}):")
        print(f"  opt.step() total: {statistics.median(totals) * 1e6:.1f}")
        for k, v in plain.items():
            print(f"  {k}: {v * 1e6:.1f}")
        print(f"  opt.step() total with a step hook (torch.optim's wrapper): {statistics.median(hooked) * 1e6:.1f}",
              flush=True)
    # the step's own graphs (the tuner's timing graphs are debug-mode too, and not the step's)
    step_graphs = list(eng.graphs.values()) if eng is not None and getattr(eng, "graphs", None) else made
    for i, g in enumerate(step_graphs):
        path = out / f"graph_{i}.dot"
        try:
            g.debug_dump(str(path))
        except Exception as e:  # noqa: BLE001  (a graph not captured, or torch without the dump)
            print(f"graph {i}: no dump ({type(e).__name__}: {e})")
            continue
        kinds, kernels = parse_dot(path.read_text())
        print(f"graph {i}: {sum(kinds.values())} nodes: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
        for name, n in kernels.most_common(40):
            print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
