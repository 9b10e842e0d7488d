"""Running the optimizer on several processes: a small launcher and replica fingerprints.

:func:`spawn` starts ``world_size`` processes (``torch.multiprocessing`` with the *spawn* method),
each of which joins a process group through a ``file://`` rendezvous in a fresh temporary folder
(no port to pick, nothing left behind), runs ``fn(rank, world_size, *args)`` and hands its return
value back to the caller (through ``torch.save`` files; ``mp.spawn`` returns nothing). With NCCL,
rank r uses ``cuda:r``. It is what the tests and the scaling measurements (:mod:`.scaling`) use; a
training script would use ``torchrun`` instead, and :class:`~anvil_fast.optim.optimizer.AnvilAndAdam`
works the same under either.

:func:`replica_digest` hashes the exact bytes of a list of tensors, so ranks can compare their
replicas bit for bit by exchanging 64 hex characters instead of the tensors.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: NVLink multicast stays off on the lent machines (device README): set in every child too.
#: Seconds a rank waits in a collective before failing (spawn's default): far above any step of the
#: tests and the CPU scaling run (well under a second), far below gloo's 30-minute default.
SPAWN_TIMEOUT_S = 120.0

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank: int, fn: Callable, world_size: int, backend: str, folder: str, threads: int, timeout: float,
            args: tuple) -> None:
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    if threads:
        torch.set_num_threads(threads)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout), **kwargs)
    # No barrier on failure: the other ranks may be blocked in a collective, and a barrier here would
    # hang this rank too and hide its traceback; raising lets the launcher stop them all.
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(folder, f"result{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def leave_rank() -> None:
    """End a spawned rank's process once its result is on disk and its process group is destroyed,
    without the interpreter's teardown: there, gloo's worker threads can still hold work whose
    tensors are freed while the interpreter is being torn down, and the process then aborts
    (SIGABRT, "terminate called without an active exception") after the rank's work is done, which
    the launcher reports as a failed rank. Nothing of the rank is lost: its streams are flushed here
    and its result was saved before the barrier."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or detached stream has nothing left to write
            pass
    os._exit(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          threads: int = 1, timeout: float = SPAWN_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes joined in one process
    group; return the ranks' return values, in rank order. ``fn`` must be importable (a
    module-level function). ``threads``: torch CPU threads per process (0: leave the default).
    ``timeout``: seconds a collective (and the rendezvous) may wait for the other ranks before the
    rank fails -- a deadlock then ends the run with an error instead of waiting out the backend's
    default (30 minutes for gloo)."""
    if not timeout > 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"NCCL with {world_size} ranks needs {world_size} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="anvil_spawn_") as folder:
        mp.start_processes(_worker, args=(fn, world_size, backend, folder, threads, float(timeout), args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(folder, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


def replica_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' exact bytes (dtype, shape and contents), in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def all_digests(tensors: Iterable[torch.Tensor]) -> list[str]:
    """Every rank's :func:`replica_digest` of its ``tensors`` (a collective: all ranks call it)."""
    mine = replica_digest(tensors)
    out: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


__all__ = ["spawn", "replica_digest", "all_digests", "NO_MULTICAST"]
