"""The banks' side streams on one process ("lanes" here are CUDA streams, not the equalizer's lanes of
a matrix): which bank's update runs on which stream, and the launch of every bank on its lane with
the main stream's own work beside them.

Banks are independent: a bank update reads and writes only its own buffers (gradient, rails, lane
energy, parameter slice, workspace) and the step's scalar table, which the main stream has written
before the lanes fork from it. So on one GPU several banks' updates, and the Adam updates on the main
stream, may run at once: small banks fill the GPU together instead of one after another, and the
memory-bound Adam pass runs under the compute-bound cascades. Every kernel is the one a single stream
would run, on the same inputs, so the results are the same bits; only the order in time changes.

Two steps use it: the drop-in's device-decided step (:class:`anvil_fast.optim.device_step.DeviceStep`)
and :class:`anvil_fast.optim.optimizer.AnvilAndAdam` on one process (with several ranks the launch
order of the latter is the comms schedule, so its banks stay on the main stream there).

Which lane: the banks sorted by their work, largest first (``chunk * rows * cols * min(rows, cols)``,
the cascade's FLOPs up to a constant), each to the lane with the least work so far (:func:`plan_lanes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from anvil_fast.kernels.streams import run_forked

#: Side streams of the banks (at most this many run concurrently).
MAX_LANES = 4


@dataclass
class Lane:
    """One stream (None: the current stream) and the banks it updates, in order."""

    stream: Any
    banks: list


def bank_work(shape: Sequence[int]) -> int:
    """A bank's share of the cascade's work, ``chunk * rows * cols * min(rows, cols)`` (``shape``:
    ``[chunk, rows, cols]``)."""
    chunk, rows, cols = (int(s) for s in shape[-3:])
    return chunk * rows * cols * min(rows, cols)


def plan_lanes(works: Sequence[float], n_lanes: int) -> list[list[int]]:
    """Indices into ``works`` per lane: largest work first (ties in the given order), each to the lane
    with the least work so far (the first such lane on a tie). ``n_lanes`` is capped by the number of
    works (an empty lane would be a stream with nothing to do) and is at least 1."""
    n = max(1, min(int(n_lanes), len(works)))
    plan: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for i in sorted(range(len(works)), key=lambda i: -works[i]):
        k = load.index(min(load))
        plan[k].append(i)
        load[k] += works[i]
    return plan


def make_lanes(items: Sequence[Any], works: Sequence[float], n_lanes: int, device: torch.device) -> list[Lane]:
    """:func:`plan_lanes` of ``items`` as :class:`Lane` objects, each with its own CUDA stream where
    there is more than one lane on a CUDA ``device`` (else one lane on the current stream)."""
    if len(items) != len(works):
        raise ValueError(f"make_lanes: {len(items)} items but {len(works)} works")
    plan = plan_lanes(works, n_lanes if device.type == "cuda" else 1)
    side = device.type == "cuda" and len(plan) > 1
    return [Lane(torch.cuda.Stream(device=device) if side else None, [items[i] for i in idx]) for idx in plan]


def run_on_lanes(lanes: Sequence[Lane], update: Callable[[Any], None], device: torch.device, *,
                 on_lanes: bool = True, then: Callable[[], None] | None = None) -> None:
    """``update(bank)`` for every bank, each lane's on its stream after the current ("main") stream's
    work so far; ``then()`` on the main stream meanwhile; then the main stream waits for every lane
    (:func:`anvil_fast.kernels.streams.run_forked`). ``on_lanes=False``: everything on the current
    stream, in lane order, then ``then()``."""
    jobs = [(lane.stream if on_lanes else None, functools.partial(update, bank))
            for lane in lanes for bank in lane.banks]
    run_forked(jobs, device, then=then)


__all__ = ["MAX_LANES", "Lane", "bank_work", "plan_lanes", "make_lanes", "run_on_lanes"]
