"""The one warm-up-then-capture sequence of the package's CUDA graphs: :func:`capture`.

A graph's capture needs its work warmed up first, on a side stream (lazy initializations, the
allocator's first blocks, autotuning must not happen inside the capture, and torch requires a
non-default stream for warm-up work that a capture follows); the side stream waits for the
current stream before and the current stream for it after, so the warm-up sees what was queued
before it and the capture sees the warm-up's writes.

A capture that fails (a host read, an unjoined stream) must not leave the process broken: torch
registers the device's default CUDA generator with every capture and ends its capture mode only
when the capture ends well, so after a failed one every later random draw on that device raises
("Offset increment outside graph capture"). :func:`capture` puts back a copy of the generator's
state taken before the capture (:func:`generator_kept`), so the user's random stream continues as if
nothing had been tried.

Python's cyclic garbage collector must not run during a capture: an object that died in a reference
cycle (an optimizer built and dropped earlier, holding its own CUDA graphs) is destroyed whenever the
collector next runs, and a CUDA graph destroyed mid-capture calls ``cudaGraphExecDestroy``, which a
capture does not permit: torch warns "operation not permitted when stream is capturing (function
reset)" and the capture being made fails at its next launch ("operation failed due to a previous
error during capture"). torch's ``torch.cuda.graph`` no longer collects before a capture (unless
``torch.compiler.config.force_cudagraph_gc``), so every capture of the package runs with the
collector paused (:func:`collector_paused`); what died is collected after it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .precompile import precompiled


def capture(fn: Callable[[], Any], *, warmup: int, pool: Any = None, capture_error_mode: str = "global",
            side: Any = None, device: Any = None, precompile: bool = False) -> "torch.cuda.CUDAGraph":
    """``fn()`` run ``warmup`` times on a side stream (``side``, or a new stream on ``device``: None
    is the current device), then captured once into a new CUDA graph (memory ``pool``: None, a
    pool of its own; ``capture_error_mode`` as :class:`torch.cuda.graph`'s), which is returned,
    not replayed. ``precompile``: before the warm-up, one more pass of ``fn`` whose Triton kernels
    compile side by side (:func:`anvil_fast.kernels.precompile.precompiled`); only for a caller that
    undoes the warm-up's effects, since that pass computes with its kernels' launches skipped."""
    main = torch.cuda.current_stream(device)
    if side is None:
        side = torch.cuda.Stream(device=device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if precompile:
            precompiled(fn, device=side.device)
        for _ in range(warmup):
            fn()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), generator_kept(), torch.cuda.graph(graph, pool=pool,
                                                                capture_error_mode=capture_error_mode):
        fn()
    return graph


@contextlib.contextmanager
def generator_kept() -> Iterator[None]:
    """Around a capture on the current device: if it fails, the device's default CUDA generator gets
    back a copy of its state from before (enter this before :class:`torch.cuda.graph`, so the copy
    goes back after the capture has ended)."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    before = generator.clone_state()  # a state of its own, outside any capture
    try:
        yield
    except BaseException:
        generator.graphsafe_set_state(before)
        raise


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (module docstring), back as it was after, on an
    error too (a collector the caller had turned off stays off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = ["capture", "collector_paused", "generator_kept"]
