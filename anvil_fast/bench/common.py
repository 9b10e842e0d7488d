"""What every benchmark of :mod:`anvil_fast.bench` shares: the measured peaks, the cascade's FLOP
count, the element-wise bytes of a bank update, and the timers.

Timers: :func:`bench_ms` is ``triton.testing.do_bench`` (CUDA events, L2 flushed between
repetitions, the median); :func:`graphed` turns a step into the replay of a CUDA graph of it;
:func:`kernel_us` is the tuner's own timer (:func:`anvil_fast.gram_tune.time_us`), so a kernel's time
in a benchmark table is the quantity the tuner compared when it chose the kernel's configuration.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, NamedTuple

import torch

from anvil_ref.constants import ANVIL_MAPS

from ..capture import capture
from ..gram_tune import time_us as kernel_us

#: Bytes per element the element-wise phases of one bank update move: rails 20 B, normalization
#: 4 B (read and write X; its partials come from the rails), equalizer 6 B, update 14 B.
ELEMENTWISE_BYTES = 20 + 4 + 6 + 14

#: The cascade's number of maps (each one Gram, one ``b*A + c*A@A`` and one ``a*X + X@B``): the
#: record's, ``len(ANVIL_MAPS)``.
MAPS_PER_CASCADE = len(ANVIL_MAPS)

#: The symmetric kernels' square tile side, which sets how many tiles of a Gram they execute.
SYMMETRIC_BLOCK = 128


def bench_ms(fn: Callable[[], object], *, rep_ms: float, warmup: int) -> float:
    """Median ms of ``fn()`` over ``rep_ms`` of repetitions after ``warmup`` ms (``do_bench``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median"))


def timer(device) -> Callable[[Callable[[], object]], float]:
    """A function that runs ``fn()`` once and returns its ms: CUDA events on a GPU (the host waits
    for the end event), the wall clock elsewhere."""
    if torch.device(device).type == "cuda":
        def timed(fn):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
    else:
        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
    return timed


def median_ms(fn: Callable[[], object], *, n: int, warmup: int, device) -> float:
    """Median ms of ``n`` timed runs of ``fn`` (:func:`timer`) after ``warmup`` untimed ones. Under an
    initialized process group every rank then waits for the others, so all time the same count."""
    import torch.distributed as dist

    timed = timer(device)
    for _ in range(warmup):
        fn()
    times = sorted(timed(fn) for _ in range(n))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return times[len(times) // 2]


def emit_table(lines: list[str], out: str | None) -> None:
    """Print a table and, with ``out``, write it there too (folders created)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """The replay of a CUDA graph of one ``fn()`` (warmed up three times on a side stream first, as
    capture requires)."""
    return capture(fn, warmup=3).replay


def measure_peaks() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s on 8192^3 random data, device-to-device copy GB/s counting read + write)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, rep_ms=200, warmup=50)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms_c = bench_ms(lambda: dst.copy_(src), rep_ms=200, warmup=50)
    gbs = 2 * src.numel() / ms_c / 1e6
    del a, b, src, dst
    return tflops, gbs


class MapFlops(NamedTuple):
    """FLOPs of one map's three products over a bank ``[c, m, n]`` (``k = min(m, n)``,
    ``K = max(m, n)``): the full products of the math (``plain``) and what the symmetric kernels
    execute (``executed``: lower tiles of the ``k x k`` outputs only)."""

    gram: tuple[float, float]
    baa: tuple[float, float]
    axb: tuple[float, float]

    @property
    def plain(self) -> float:
        return self.gram[0] + self.baa[0] + self.axb[0]

    @property
    def executed(self) -> float:
        return self.gram[1] + self.baa[1] + self.axb[1]


def map_flops(shape, *, block: int = SYMMETRIC_BLOCK) -> MapFlops:
    """The one FLOP count of the benchmarks: per map, Gram ``2 k^2 K``, ``A@A`` ``2 k^3`` (both
    symmetric: ``t (t + 1) / 2`` of ``t^2`` tiles executed, ``t = ceil(k / block)``) and ``X@B``
    ``2 k^2 K`` (a full product), times the bank's ``c`` matrices."""
    c, m, n = shape
    k, K = min(m, n), max(m, n)
    t = math.ceil(k / block)
    lower = t * (t + 1) / 2 / (t * t)
    gram, baa, axb = 2 * k * k * K * c, 2 * k ** 3 * c, 2 * k * k * K * c
    return MapFlops((gram, lower * gram), (baa, lower * baa), (axb, axb))


def flops(shape, *, block: int = SYMMETRIC_BLOCK) -> tuple[float, float]:
    """(plain, executed-by-symmetric-kernels) FLOPs of one bank's cascade (:func:`map_flops` per map)."""
    f = map_flops(shape, block=block)
    return MAPS_PER_CASCADE * f.plain, MAPS_PER_CASCADE * f.executed


__all__ = ["ELEMENTWISE_BYTES", "MAPS_PER_CASCADE", "SYMMETRIC_BLOCK", "bench_ms", "timer", "median_ms", "emit_table", "graphed", "kernel_us",
           "measure_peaks", "MapFlops", "map_flops", "flops"]
