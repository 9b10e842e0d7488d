"""Compile every tuning candidate of anvil_fast.kernels.gram for sm_90a on a machine WITHOUT a GPU and print
each kernel's registers, stack (spills), shared memory and instruction mix (wgmma, TMA, cp.async).

    python tools/gram_sm90_report.py [gram] [baa] [mm] [rails]

(``rails``: the element-wise kernels of anvil_fast.kernels.rails, anvil_fast.kernels.normalize and anvil_fast.kernels.equalizer.)

Why: the device time is scarce; compile errors, register spills and shared-memory overflows of a
candidate are visible before any GPU run. The kernels go through Triton's own JIT specialization
(``JITFunction.warmup`` with CPU tensors standing in for the device's), with the active driver
replaced by a stub that reports an sm_90 target; ptxas and cuobjdump are the ones shipped in
Triton's wheel. This relies on Triton internals (checked with triton 3.9 on CPU); the GPU machine's
Triton version may compile differently, so the GPU run remains the judge.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class _Sm90Stub:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def resources(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    ptx = kernel.asm["ptx"]
    pdl = " (launch_pdl)" if getattr(kernel.metadata, "launch_pdl", False) else ""
    return (f"regs {reg.group(1) if reg else '?'} stack {stack.group(1) if stack else '?'} "
            f"smem {kernel.metadata.shared // 1024} KB, wgmma {ptx.count('wgmma.mma_async')}, "
            f"TMA {ptx.count('cp.async.bulk.tensor')}, cp.async {ptx.count('cp.async.cg')}, "
            f"griddepcontrol {ptx.count('griddepcontrol')}{pdl}")


class _Compile:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles for sm_90a and prints the report."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def call(*args, **kw):
            t = time.time()
            name = self.fn.fn.__name__
            try:
                k = self.fn.warmup(*args, grid=grid, **kw)
                print(f"  {name:24s} TMA={kw.get('TMA', '-')!s:5} EVEN={kw.get('EVEN', '-')!s:5} "
                      f"w{kw['num_warps']} s{kw.get('num_stages', '-')} {time.time() - t:4.1f} s  {resources(k)}",
                      flush=True)
            except Exception as e:  # report and go on: the point is to see every candidate
                print(f"  {name:24s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return call


def elementwise() -> None:
    from anvil_fast.kernels import equalizer as EQ
    from anvil_fast.kernels import normalize as N
    from anvil_fast.kernels import rails as RL

    for mod, name in ((RL, "_rails_kernel"), (N, "_partials_kernel"), (N, "_finalize_kernel"), (N, "_scale_kernel"),
                      (EQ, "_lane_power_kernel"), (EQ, "_equalizer_stats_kernel"), (EQ, "_equalizer_apply_kernel")):
        setattr(mod, name, _Compile(getattr(mod, name)))
    shape = (24, 2816, 768)
    g = torch.empty(shape, dtype=torch.bfloat16)
    x = torch.empty_like(g)
    v = torch.empty((2, *shape))
    p = N.NormPartials.for_shape(shape, "cpu")
    s = [torch.empty(()) for _ in range(3)]
    RL._rails_fused(g, v, *s, x, True, p)
    N.block_partials(x, p, limit=RL.PRESCALE_EXP_LIMIT)
    N.normalize_from_partials(x, torch.empty(shape[0], 1, 1), p, margin=1.05, eps=1e-7, limit=RL.PRESCALE_EXP_LIMIT)
    for shp in (shape, (72, 256, 768)):  # tall (lanes = rows) and wide (lanes = columns)
        red = EQ.reduction_axis(shp)
        xv = torch.empty(shp, dtype=torch.bfloat16)
        work = EQ.EqualizerWork.for_shape(shp, "cpu")
        EQ._equalizer_fused(xv, torch.empty(work.lane_power.shape), 0.95, red, torch.zeros(shp[0], dtype=torch.int32),
                            work)


def main(which: list[str]) -> None:
    driver.set_active(_Sm90Stub())
    if "rails" in which:
        elementwise()
    from anvil_fast.kernels import gram as G
    from anvil_fast.kernels import gram_kernels as K
    from anvil_fast.kernels import gram_tune as GT

    G.use_triton = lambda t, backend, error=None: True  # CPU tensors stand in for CUDA ones; nothing is launched
    for name in ("_gram_kernel", "_sym_product_kernel", "_mm_add_kernel"):
        setattr(K, name, _Compile(getattr(K, name)))
    X = torch.empty(64, 768, 768, dtype=torch.bfloat16)
    A = torch.empty_like(X)
    Xt = torch.empty(24, 2816, 768, dtype=torch.bfloat16)
    At = torch.empty(24, 768, 768, dtype=torch.bfloat16)
    for cfg in GT.SYM_CANDIDATES if {"gram", "baa"} & set(which) else ():
        print(cfg.describe())
        if "gram" in which:
            G.XXT(X, out=A, config=cfg, backend="triton")
            G.XTX(Xt, out=At, config=cfg, backend="triton")
        if "baa" in which:
            G.ba_plus_cAA(A, alpha=1.0, beta=2.0, out=X, config=cfg, backend="triton")
            G.sym_aX_plus_mm(A, A, A, a=2.0, out=X, config=cfg, backend="triton")
    if "mm" in which:
        for cfg in GT.MM_CANDIDATES:
            if cfg.kernel == "cublas":
                continue
            print(cfg.describe())
            G.aX_plus_mm(Xt, Xt, At, a=2.0, out=torch.empty_like(Xt), config=cfg, backend="triton")
            G.aX_plus_mm(X, A, X, a=2.0, out=torch.empty_like(X), config=cfg, backend="triton")


#: What the report can compile, and what it compiles when given nothing.
GROUPS = ("gram", "baa", "mm", "rails")
DEFAULT_GROUPS = ("gram", "baa", "mm")


def parse_args(argv: list[str] | None = None) -> list[str]:
    import argparse

    ap = argparse.ArgumentParser(prog="python tools/gram_sm90_report.py", description=__doc__.split("\n\n")[0])
    # (no ``choices=``: argparse checks an empty ``nargs="*"`` list against them and refuses a bare call)
    ap.add_argument("groups", nargs="*", metavar="GROUP",
                    help=f"kernel groups to compile, any of: {', '.join(GROUPS)} (default: {' '.join(DEFAULT_GROUPS)})")
    groups = ap.parse_args(argv).groups
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"argument GROUP: invalid choice: {bad[0]!r} (choose from {', '.join(GROUPS)})")
    return groups or list(DEFAULT_GROUPS)


if __name__ == "__main__":
    main(parse_args())
