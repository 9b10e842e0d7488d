"""A first run's Triton kernels compiled side by side instead of one after another.

A cold first step reaches each of its Triton kernels in launch order and compiles it there, on the
host thread: Triton's passes, ptxas and the launcher's gcc build, some thirty times in a row.
:func:`precompiled` runs a function once with every Triton launch *recorded* instead of made, hands
each recorded launch to a pool of threads that compiles its kernel (``JITFunction.run(...,
warmup=True)``) and loads it (its launcher built), and waits for them. Triton's compiler releases the
GIL in its passes and runs ptxas and gcc as subprocesses, so the threads overlap; the kernels and their
caches are Triton's own, so the runs that follow find every kernel compiled and launch the same
binaries they would have compiled themselves.

What the recording pass computes is discarded: its Triton launches are skipped, and the torch
operations between them still run, on whatever the skipped kernels would have written. So a caller
runs it only where it also runs a warm-up whose effects it undoes (the optimizer's captures save and
restore the step's state around theirs: :func:`anvil_fast.kernels.capture.capture`'s ``precompile``).
Code that would launch kernels to read their results on the host (the Gram kernels' tuner) asks
:func:`recording` first and leaves its decision to the real run.

Each recorded tensor travels as a :class:`Spec`: only what Triton specializes a kernel on (its dtype,
its address, hence its alignment; its shape and strides), so the pass holds no memory of the run. One
lock per kernel function: its caches are filled by one thread at a time. A compile that fails here is
left to the real run, which compiles it again there and raises if it must. ``ANVIL_FAST_PRECOMPILE=0``
turns the recording off (every kernel then compiles where it is first launched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

#: ``0`` turns the recording pass off.
ENV = "ANVIL_FAST_PRECOMPILE"
#: Threads compiling at once (each mostly waits on a compiler subprocess or runs Triton's passes).
MAX_WORKERS = 16

_local = threading.local()  # .recorder: this thread's active Recorder
_patch_lock = threading.Lock()
_original: list = []  # the JITFunction.run a pass wraps (set at the first pass)
_passes = 0  # passes going on (on any thread): JITFunction.run is wrapped while this is above 0


def enabled() -> bool:
    """Whether :func:`precompiled` records (``ANVIL_FAST_PRECOMPILE`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip() != "0"


class Spec:
    """A tensor argument as Triton's specialization sees it, without the tensor: its dtype, address,
    shape and strides (a kernel is specialized on its pointers' dtype and 16-byte alignment)."""

    __slots__ = ("dtype", "shape", "_ptr", "_strides")

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self._ptr, self._strides = int(t.data_ptr()), tuple(t.stride())

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self) -> int:
        return len(self.shape)


def spec_of(arg: Any) -> Any:
    """``arg`` with every tensor replaced by its :class:`Spec` (a tensor, or a dataclass holding one as
    ``base``, as Triton's host-side tensor descriptors do); anything else unchanged."""
    if isinstance(arg, torch.Tensor):
        return Spec(arg)
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor) and dataclasses.is_dataclass(arg):
        return dataclasses.replace(arg, base=Spec(base))
    return arg


@dataclass
class Report:
    """What one recording pass did: ``launches`` recorded, ``compiled`` (kernels compiled and loaded
    by the pool, a cached one counted too), ``failed`` ("kernel: error" of each compile left to the
    real run)."""

    launches: int = 0
    compiled: int = 0
    failed: list[str] = field(default_factory=list)


class Recorder:
    """The launches of one pass on one thread, compiled on ``pool`` as they come."""

    def __init__(self, pool: ThreadPoolExecutor, device: torch.device, compile_one: Callable):
        self.pool, self.device, self.compile_one = pool, device, compile_one
        self.futures: list[tuple[str, Future]] = []
        self.locks: dict[int, threading.Lock] = {}
        self.report = Report()

    def record(self, fn, args: tuple, kwargs: dict, grid) -> None:
        self.report.launches += 1
        lock = self.locks.setdefault(id(fn), threading.Lock())
        args = tuple(spec_of(a) for a in args)
        kwargs = {k: spec_of(v) for k, v in kwargs.items()}
        name = getattr(fn, "__name__", repr(fn))
        self.futures.append((name, self.pool.submit(self._compile, fn, args, kwargs, grid, lock)))

    def _compile(self, fn, args, kwargs, grid, lock) -> None:
        # the pool's threads start on device 0: Triton compiles for, and loads onto, the current device
        with lock, (torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()):
            self.compile_one(fn, args, kwargs, grid)

    def wait(self) -> Report:
        for name, fut in self.futures:
            exc = fut.exception()
            if exc is None:
                self.report.compiled += 1
            else:
                self.report.failed.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        self.futures.clear()
        return self.report


def _compile_and_load(fn, args: tuple, kwargs: dict, grid) -> None:
    """Compile ``fn`` for these arguments into its own caches (Triton's warm-up call: no launch) and
    load the binary with its launcher, which a launch would otherwise build on first use."""
    kernel = _original[0](fn, *args, grid=grid, warmup=True, **kwargs)
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()


def _recording_run(self, *args, **kwargs):
    """``JITFunction.run`` while a pass is on: the recording thread's launches are recorded; every other
    call (other threads, warm-up calls) goes through unchanged."""
    rec = getattr(_local, "recorder", None)
    if rec is None or kwargs.get("warmup", True):
        return _original[0](self, *args, **kwargs)
    grid = kwargs.pop("grid", None)
    kwargs.pop("warmup")
    rec.record(self, args, kwargs, grid)
    return None


def _install() -> bool:
    """Wrap ``JITFunction.run`` for the length of a pass (passes on several threads share one wrapping,
    taken off when the last ends), so that no launch outside a pass pays for it. False where this Triton
    has no ``JITFunction.run`` to wrap."""
    global _passes
    with _patch_lock:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return False
        if _passes == 0:
            original = getattr(JITFunction, "run", None)
            if original is None:
                return False
            _original[:] = [original]
            JITFunction.run = _recording_run
        _passes += 1
        return True


def _uninstall() -> None:
    global _passes
    with _patch_lock:
        _passes -= 1
        if _passes == 0:
            from triton.runtime.jit import JITFunction

            if JITFunction.run is _recording_run:  # (never over a wrapping someone made since)
                JITFunction.run = _original[0]


def recording() -> bool:
    """Whether this thread is in a recording pass (its Triton launches skipped): code that would read
    its kernels' results on the host (a tuner) must not decide anything there."""
    return getattr(_local, "recorder", None) is not None


def precompiled(fn: Callable[[], Any], *, device: torch.device | int | None = None,
                workers: int | None = None, compile_one: Callable = _compile_and_load) -> Report | None:
    """Run ``fn()`` once with its Triton launches recorded, not made, their kernels compiled and loaded
    on ``workers`` threads (default: the CPUs, at most :data:`MAX_WORKERS`) while it runs; return when
    every compile has ended. None (and nothing run) where it is off (:func:`enabled`), already
    recording on this thread, or Triton's launch cannot be wrapped. ``compile_one(fn, args, kwargs,
    grid)`` is replaceable for tests."""
    if not enabled() or getattr(_local, "recorder", None) is not None:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    n = workers or max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    if not _install():
        return None
    try:
        with ThreadPoolExecutor(n, thread_name_prefix="anvil-precompile") as pool:
            rec = Recorder(pool, device, compile_one)
            _local.recorder = rec
            try:
                fn()
            finally:
                _local.recorder = None
            return rec.wait()
    finally:
        _uninstall()
