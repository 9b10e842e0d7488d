"""Where the drop-in's first step spends its wall time (CUDA): construction and the first ``opt.step()``.

    python tools/first_step.py --size small --out DIR

Builds the package's GPT with gradients as ``python -m anvil_fast.bench dropin`` does, then profiles
(cProfile) ``anvil_fast.ANVIL(model)`` and its first step, each synchronized; prints their wall
seconds, the second step's (the compiled and captured step), and the functions with the most
cumulative and own time, and writes the profile to ``DIR/first_step.prof``. Run it with empty
``TRITON_CACHE_DIR`` / ``TORCHINDUCTOR_CACHE_DIR`` folders for a cold start (``tools/h200_session.sh``'s
warmup stage does): the lines then say what the warm-up goal has to cut (compilation, the Gram
kernels' tuning, the capture).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch


#: Where a cold first step's time goes, as (label, the end of the function's file path, its name): each
#: row is that function's cumulative time (calls inside it included, so rows overlap: a Triton compile's
#: ptxas is inside its compile). cProfile sees the main thread only: the compiles of the captures'
#: recording pass run on its pool's threads (anvil_fast/kernels/precompile.py), so their time shows in
#: the pass's own line, not in these rows.
PHASES = (
    ("Triton compiles (triton.compiler.compile)", "triton/compiler/compiler.py", "compile"),
    ("  of them ptxas (make_cubin)", "triton/backends/nvidia/compiler.py", "make_cubin"),
    ("Triton launchers built (gcc)", "triton/runtime/build.py", "compile_module_from_src"),
    ("torch.compile's frames (dynamo, inductor)", "torch/_dynamo/convert_frame.py", "_compile"),
    ("  of them waiting for inductor's compile workers", "torch/_inductor/async_compile.py", "_wait_futures"),
    ("CUDA graph captures (torch.cuda.graph's exit)", "torch/cuda/graphs.py", "__exit__"),
    ("the Gram kernels' tile choices (gram_tune.choose)", "anvil_fast/kernels/gram_tune.py", "choose"),
)


def phases(stats: pstats.Stats, table=PHASES) -> list[tuple[str, float, int]]:
    """(label, cumulative seconds, calls) of every row of ``table`` found in ``stats`` (a function
    found under several line numbers adds up)."""
    out = []
    for label, path, name in table:
        ct, calls = 0.0, 0
        for (filename, _line, func), (_cc, nc, _tt, cum, _callers) in stats.stats.items():
            if func == name and filename.replace("\\", "/").endswith(path):
                ct, calls = ct + cum, calls + nc
        out.append((label, ct, calls))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=35, help="rows of each profile table")
    ap.add_argument("--device", default="cuda", help="cuda (what it is for), or cpu to check the tool itself")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("tools/first_step.py needs CUDA (or --device cpu)")
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    from anvil_fast.bench.dropin import _model, _set_grads
    from anvil_fast.optim.entry import ANVIL

    dev = torch.device(a.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    model = _model(a.size, dev)
    _set_grads(model, dev)
    sync()
    t_model = time.monotonic() - t0

    # the captures' recording pass: its wall time and what its threads compiled
    from anvil_fast.kernels import capture as CAP

    passes = []
    real_pass = CAP.precompiled

    def timed_pass(fn, **kw):
        t = time.monotonic()
        report = real_pass(fn, **kw)
        passes.append((time.monotonic() - t, report))
        return report

    CAP.precompiled = timed_pass
    prof = cProfile.Profile()
    times = {}
    prof.enable()
    t = time.monotonic()
    opt = ANVIL(model)
    sync()
    times["construction"] = time.monotonic() - t
    t = time.monotonic()
    opt.step()
    sync()
    times["first step"] = time.monotonic() - t
    prof.disable()
    t = time.monotonic()
    opt.step()
    sync()
    times["second step"] = time.monotonic() - t
    prof.dump_stats(str(out / "first_step.prof"))
    print(f"{a.size}: imports and model {t_model:.1f} s; " + "; ".join(f"{k} {v:.2f} s" for k, v in times.items()))
    CAP.precompiled = real_pass
    for i, (secs, r) in enumerate(passes):
        what = ("off" if r is None else f"{r.launches} launches recorded, {r.compiled} compiled, "
                f"{len(r.failed)} failed{': ' + '; '.join(r.failed) if r.failed else ''}")
        print(f"recording pass {i + 1} (precompile, in the first step): {secs:.2f} s, {what}")
    print("by phase (cumulative seconds of the main thread; rows overlap, see PHASES):")
    for label, ct, calls in phases(pstats.Stats(prof)):
        print(f"  {label:<52} {ct:7.2f} s  {calls:5d} calls")
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
        lines = [line for line in buf.getvalue().splitlines() if line.strip()]
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        print(f"by {key} time (construction and first step):")
        print("\n".join(line[:200] for line in lines[start:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
