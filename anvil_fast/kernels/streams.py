"""Work forked onto side streams and joined back: :func:`run_forked`, the one fork/join of the package.

Two callers: the banks' lanes (:mod:`anvil_fast.optim.lanes`: several banks at once) and a cascade split
into parts of consecutive matrices (:func:`anvil_fast.core.cascade.cascade_workspace` with ``streams``:
one bank's parts at once). Both need the same three things, in this order: every side stream waits for
the current stream's work so far (the fork), the jobs run, and the current stream waits for every side
stream it forked (the join) -- also when a job raises, because a CUDA-graph capture ends on its stream
only with every forked stream joined back. Inside a capture the fork and the join are the graph's edges,
so the same code captures and runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Side streams handed out by :func:`side_streams`, per (device index, count).
_STREAMS: dict[tuple[int, int], list] = {}


def side_streams(device: torch.device, n: int) -> list:
    """``n`` CUDA streams on ``device``, made once per (device, n) and handed out again on every call (a
    captured graph keeps no stream, but an eager caller should not create streams per call)."""
    if device.type != "cuda":
        raise ValueError(f"side_streams: streams need a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, int(n))
    if key not in _STREAMS:
        _STREAMS[key] = [torch.cuda.Stream(device=index) for _ in range(int(n))]
    return _STREAMS[key]


def run_forked(jobs: Sequence[tuple[Any, Callable[[], Any]]], device: torch.device, *,
               then: Callable[[], None] | None = None) -> list:
    """``fn()`` for every ``(stream, fn)`` of ``jobs``, in order: where ``stream`` is None on the current
    stream, else on ``stream`` after the current stream's work so far; then ``then()`` on the current
    stream meanwhile; then the current stream waits for every stream used. Returns the results in
    ``jobs``' order. Jobs on one stream run in their order; a stream given twice is forked once."""
    main = torch.cuda.current_stream(device) if device.type == "cuda" else None
    forked: list = []
    results = []
    try:
        for stream, fn in jobs:
            if stream is None:
                results.append(fn())
                continue
            if not any(stream is s for s in forked):
                stream.wait_stream(main)
                forked.append(stream)
            with torch.cuda.stream(stream):
                results.append(fn())
        if then is not None:
            then()
    except BaseException:
        # Join what was forked before the error propagates: a CUDA graph capture that a job broke
        # ends on its stream only with every forked stream joined back (the generator it held is put
        # back by anvil_fast.kernels.capture.generator_kept). A join that the broken capture refuses as
        # well changes nothing for the caller.
        for stream in forked:
            try:
                main.wait_stream(stream)
            except RuntimeError:
                pass
        raise
    for stream in forked:
        main.wait_stream(stream)
    return results


__all__ = ["side_streams", "run_forked"]
