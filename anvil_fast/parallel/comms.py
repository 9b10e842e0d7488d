"""The optimizer's communication layer: three collectives behind one interface, on NCCL, gloo, a
single process, or none at all (for timing).

:class:`~anvil_fast.optim.optimizer.AnvilAndAdam` never calls ``torch.distributed`` itself; it asks a
:class:`Comms` for

* ``reduce_scatter_avg(out, inp)``: ``out`` = this rank's slice of the average of ``inp`` over ranks,
* ``all_reduce_avg(t)``: ``t`` = the average of ``t`` over ranks, in place,
* ``all_gather(out, inp)``: every rank's ``inp`` laid end to end in ``out`` (``inp`` may be this
  rank's slice of ``out`` itself, as the seed's in-place bank gathers are),

each of which returns a :class:`Handle` at once. ``Handle.wait()`` is the only way to complete one.

Why a layer instead of ``dist.*(..., async_op=True).get_future()`` as in the seed:

* gloo's work objects on older torch have no ``get_future``, and gloo has no ``ReduceOp.AVG`` before
  recent versions; both backends have ``Work.wait()`` and ``SUM``. On NCCL, ``wait()`` makes the
  current CUDA stream wait for the collective's stream (no host block), so launching order is the
  comms schedule (NCCL runs one stream in enqueue order); on gloo it blocks until the data is there.
  The average on gloo is SUM followed by one division at ``wait()``, on the same tensor.
* A single process needs no process group: :class:`LocalComms` makes the sharded code path the
  world-size-1 case of itself (a reduce-scatter is a copy, a gather of the whole is nothing).
* :class:`NullComms` keeps a chosen world size and rank but moves nothing: the same step with the
  communication left out, for measuring how much of it the schedule hides (anvil_fast.studies.scaling). Its results
  are wrong by design; never train with it.

Every handle is idempotent (waiting twice is harmless), so a deferred gather can be waited by
whoever reads the parameter first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor collectives (the old names warn); torch 2.9-2.12 only have the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """A launched collective. ``wait()`` completes it (NCCL: a stream wait; gloo: a host wait) and
    then runs its finishing step (e.g. gloo's division for an average) exactly once."""

    __slots__ = ("_work", "_then", "_done")

    def __init__(self, work=None, then: Callable[[], None] | None = None):
        self._work, self._then, self._done = work, then, False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._then is not None:
            self._then()
        self._done = True
        self._work = self._then = None

    @property
    def done(self) -> bool:
        """True once :meth:`wait` has run (not whether the device finished)."""
        return self._done


DONE = Handle()
DONE._done = True


class Comms:
    """Interface (see module docstring). ``world_size`` and ``rank`` decide how banks are sharded."""

    world_size: int = 1
    rank: int = 0
    backend: str = "local"

    def reduce_scatter_avg(self, out: Tensor, inp: Tensor) -> Handle:
        raise NotImplementedError

    def all_reduce_avg(self, t: Tensor) -> Handle:
        raise NotImplementedError

    def all_gather(self, out: Tensor, inp: Tensor) -> Handle:
        raise NotImplementedError

    def all_reduce_sum_now(self, t: Tensor) -> None:
        """Blocking SUM all-reduce of a small tensor (the non-finite check's flags)."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{type(self).__name__}(backend={self.backend}, world_size={self.world_size}, rank={self.rank})"

    __repr__ = describe


def _check_rs(out: Tensor, inp: Tensor, world_size: int) -> None:
    if inp.numel() != out.numel() * world_size or inp.dtype != out.dtype:
        raise ValueError(f"reduce_scatter: input {tuple(inp.shape)} {inp.dtype} is not {world_size} x "
                         f"output {tuple(out.shape)} {out.dtype}")


def _check_ag(out: Tensor, inp: Tensor, world_size: int) -> None:
    if out.numel() != inp.numel() * world_size or inp.dtype != out.dtype:
        raise ValueError(f"all_gather: output {tuple(out.shape)} {out.dtype} is not {world_size} x "
                         f"input {tuple(inp.shape)} {inp.dtype}")


class LocalComms(Comms):
    """One process: a reduce-scatter is a copy, an all-reduce and the gather of the whole are nothing."""

    def __init__(self):
        self.world_size, self.rank, self.backend = 1, 0, "local"

    def reduce_scatter_avg(self, out: Tensor, inp: Tensor) -> Handle:
        _check_rs(out, inp, 1)
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.view(out.shape))
        return DONE

    def all_reduce_avg(self, t: Tensor) -> Handle:
        return DONE

    def all_gather(self, out: Tensor, inp: Tensor) -> Handle:
        _check_ag(out, inp, 1)
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.view(out.shape))
        return DONE

    def all_reduce_sum_now(self, t: Tensor) -> None:
        return None


class NullComms(Comms):
    """No communication at all, for a chosen ``world_size`` and ``rank``: the step computes on this
    rank's shards exactly as a real rank would, but reductions and gathers move nothing (the shard
    keeps whatever the buffer held). For timing the schedule without its communication only."""

    def __init__(self, world_size: int = 1, rank: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.world_size, self.rank, self.backend = world_size, rank, "null"

    def reduce_scatter_avg(self, out, inp):
        _check_rs(out, inp, self.world_size)
        return DONE

    def all_reduce_avg(self, t):
        return DONE

    def all_gather(self, out, inp):
        _check_ag(out, inp, self.world_size)
        return DONE

    def all_reduce_sum_now(self, t):
        return None


class DistComms(Comms):
    """torch.distributed on a process group (the default group unless one is given), NCCL or gloo.

    NCCL averages with ``ReduceOp.AVG`` inside the collective. Other backends sum and divide once at
    ``wait()`` (gloo has no AVG before recent torch versions); the division is on this rank's own
    result, so every rank that holds the same reduced tensor divides the same bits the same way.
    """

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistComms needs an initialized torch.distributed process group "
                               "(dist.init_process_group); for one process use LocalComms")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        self._native_avg = self.backend == "nccl"

    def _avg_op(self):
        return dist.ReduceOp.AVG if self._native_avg else dist.ReduceOp.SUM

    def _divide(self, t: Tensor) -> Callable[[], None] | None:
        if self._native_avg or self.world_size == 1:
            return None
        n = self.world_size
        return lambda: t.div_(n)

    def reduce_scatter_avg(self, out: Tensor, inp: Tensor) -> Handle:
        _check_rs(out, inp, self.world_size)
        work = _reduce_scatter_tensor(out, inp, op=self._avg_op(), group=self.group, async_op=True)
        return Handle(work, self._divide(out))

    def all_reduce_avg(self, t: Tensor) -> Handle:
        work = dist.all_reduce(t, op=self._avg_op(), group=self.group, async_op=True)
        return Handle(work, self._divide(t))

    def all_gather(self, out: Tensor, inp: Tensor) -> Handle:
        _check_ag(out, inp, self.world_size)
        work = _all_gather_tensor(out, inp, group=self.group, async_op=True)
        return Handle(work)

    def all_reduce_sum_now(self, t: Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)


def resolve_comms(comms=None) -> Comms:
    """A :class:`Comms` from what the caller gave: a Comms (as is), a process group (DistComms on
    it), or None (DistComms on the default group when torch.distributed is initialized, else
    LocalComms)."""
    if isinstance(comms, Comms):
        return comms
    if comms is not None:
        return DistComms(comms)
    if dist.is_available() and dist.is_initialized():
        return DistComms()
    return LocalComms()


__all__ = ["Handle", "DONE", "Comms", "LocalComms", "NullComms", "DistComms", "resolve_comms"]
