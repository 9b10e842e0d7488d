"""The package's timers: every study, benchmark and the tuner measure time through these.

* :func:`timer`: one call's ms -- CUDA events on a GPU (the host waits for the end event), the
  wall clock elsewhere;
* :func:`median_ms`: the median of ``n`` :func:`timer` samples after ``warmup`` untimed calls (a
  sample may be several back-to-back calls, for a step whose tail overlaps the next);
* :func:`call_times`: each call's device ms and host ms of a run of calls that are not synchronized
  between them (or, with ``synchronize``, each issued with the device idle; or, with ``lead_ms``,
  each issued while the device is still busy, as a training loop's host runs ahead of its
  backward pass), for a step whose host part is a result of its own;
* :func:`busy`: keep the device busy for a given time (a sleep kernel), so the host can run ahead;
* :func:`do_bench_ms`: ``triton.testing.do_bench`` (L2 flushed between repetitions, the median),
  for kernels timed against the roofline.

The tuner's kernel time (:func:`anvil_fast.kernels.gram_tune.time_us`) is :func:`median_ms` of the replays
of a CUDA graph it captures. Only torch is imported here (triton on first use of
:func:`do_bench_ms`), so the library's timing needs no benchmark module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


def median_ms(fn: Callable[[], object], *, n: int, warmup: int, device, calls: int = 1,
              barrier: bool = True) -> float:
    """Median ms per call of ``n`` :func:`timer` samples of ``fn`` after ``warmup`` untimed calls;
    each sample is ``calls`` back-to-back calls (no synchronization between them, so the host runs
    ahead and a call's tail overlaps the next) divided by ``calls``. With ``barrier``, under an
    initialized process group every rank then waits for the others, so all time the same count."""
    timed = timer(device)
    for _ in range(warmup):
        fn()
    if calls == 1:
        sample = fn
    else:
        def sample():
            for _ in range(calls):
                fn()
    times = sorted(timed(sample) / calls for _ in range(n))
    if barrier:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    return times[len(times) // 2]


class CallTimes(NamedTuple):
    """Per call of a run: device ms (CUDA events around the call; on CPU the host's) and host ms
    (the wall clock until the call returned)."""

    device_ms: list[float]
    host_ms: list[float]


_CYCLES_PER_MS: dict[int, float] = {}


def busy(ms: float, device) -> None:
    """Queue ``ms`` milliseconds of device work on the current stream (``torch.cuda._sleep``, its
    cycles per ms measured once per device) and return at once: the host is then ``ms`` ahead."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"busy: needs a CUDA device, got {dev}")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _CYCLES_PER_MS:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # the first launch loads the kernel; time the second
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        _CYCLES_PER_MS[idx] = cycles / max(s.elapsed_time(e), 1e-3)
    torch.cuda._sleep(max(1, int(ms * _CYCLES_PER_MS[idx])))


def call_times(fn: Callable[[], object], device, *, n: int | None = None, rep_ms: float | None = None,
               min_calls: int = 1, max_calls: int = 10000, between: Callable[[], object] | None = None,
               synchronize_each: bool = False, lead_ms: float | None = None) -> CallTimes:
    """Time a run of calls of ``fn``: ``n`` of them, or (``n`` None) at least ``min_calls`` and
    then more until ``rep_ms`` have passed (``max_calls`` at most). The device is idle at the
    run's start and the host waits for it at the end; ``between()`` runs before every call after
    the first, outside the timed part; ``synchronize_each``: the device idle before every call too
    (the host time is then the time to issue the call).

    ``lead_ms`` (CUDA only): before every call, :func:`busy` queues ``lead_ms`` of device work
    ahead of the call's start event, so a call whose host part takes less than ``lead_ms`` is
    wholly queued before the device reaches it. Its device time then excludes the host's issue
    time (a CUDA graph's launch, many small kernels' launches), which an idle device waits out:
    the step's time in a training loop whose host runs ahead of the device."""
    if (n is None) == (rep_ms is None):
        raise ValueError("call_times: give n or rep_ms, not both")
    cuda = torch.device(device).type == "cuda"
    if lead_ms is not None and (not cuda or synchronize_each or not lead_ms > 0):
        raise ValueError(f"call_times: lead_ms needs a CUDA device, a value > 0 and no synchronize_each; got "
                         f"lead_ms={lead_ms} on {torch.device(device)} (synchronize_each={synchronize_each})")
    synchronize(device)
    host: list[float] = []
    pairs = []
    t_end = None if rep_ms is None else time.perf_counter() + rep_ms / 1e3

    def more() -> bool:
        if n is not None:
            return len(host) < n
        return len(host) < min_calls or (time.perf_counter() < t_end and len(host) < max_calls)

    while more():
        if host and between is not None:
            between()
        if synchronize_each:
            synchronize(device)
        if lead_ms is not None:
            busy(lead_ms, device)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        fn()
        host.append(1e3 * (time.perf_counter() - t0))
        if cuda:
            b.record()
            pairs.append((a, b))
    synchronize(device)
    return CallTimes([a.elapsed_time(b) for a, b in pairs] if cuda else list(host), host)


def do_bench_ms(fn: Callable[[], object], *, rep_ms: float, warmup: int) -> float:
    """Median ms of ``fn()`` over ``rep_ms`` of repetitions after ``warmup`` ms
    (``triton.testing.do_bench``: CUDA events, L2 flushed between repetitions)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median"))


__all__ = ["synchronize", "timer", "median_ms", "CallTimes", "busy", "call_times", "do_bench_ms"]
