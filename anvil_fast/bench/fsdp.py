"""``python -m anvil_fast.bench fsdp``: what ANVIL's FSDP2 path costs per optimizer step.

Spawns ``--worlds`` ranks (NCCL on GPUs when there are enough, else gloo on the CPU), shards a GPT
of ``--size`` with ``fully_shard`` (one unit per block and the root), sets fixed seeded gradients and
times ``opt.step()`` with its phases (:attr:`anvil_fast.optim.fsdp.FSDPAnvil.timings`, which synchronize
the device between phases): ``exchange`` is both all-to-alls, ``update`` the owners' bank updates
and Adam, ``prepare`` the gradient flags and their all-reduce. ``MB/step`` is what all ranks send
(measured, and the formula of :meth:`~anvil_fast.optim.fsdp.FSDPAnvil.comm_bytes`); ``single ms`` is the
single-process drop-in's step on one device for the same model. On a CPU the times are an
indication only (gloo, and the ranks share the cores).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch

from anvil_fast.kernels.timing import call_times
from anvil_ref.progress import Progress

WARMUP = 3


def _grads(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype) for n, p in model.named_parameters()}


def _time_steps(opt, set_grads, steps: int, device: torch.device) -> float:
    """Mean seconds of ``steps`` calls of ``opt.step()``, each issued with the device idle and its
    gradients set outside the timed part (:func:`anvil_fast.kernels.timing.call_times`: the step's span on
    the device by CUDA events, the wall clock on CPU), after the warm-up steps."""
    for _ in range(WARMUP):  # first-step allocations, lazy initializations, CUDA graph captures
        set_grads()
        opt.step()
    set_grads()
    dev, _ = call_times(opt.step, device, n=steps, between=set_grads, synchronize_each=True)
    return sum(dev) / steps / 1e3


def _rank(rank: int, world: int, folder: str, size: str, dtype_name: str, steps: int, backend: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from anvil_fast.models import gpt
    from anvil_fast.optim.entry import ANVIL
    from anvil_fast.optim.fsdp import shard_rows
    from anvil_fast.parallel.distributed import leave_rank

    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh(device.type, (world,))
    model = gpt.build(size, device=device).to(dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ANVIL(model)
    whole = _grads(model, 0)

    def set_grads():
        for n, p in model.named_parameters():
            lo, hi = shard_rows(p.shape[0], world, rank)
            p.grad = DTensor.from_local(whole[n][lo:hi].to(device), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())

    step_s = _time_steps(opt, set_grads, steps, device)
    opt.timings = {}
    for _ in range(steps):
        set_grads()
        opt.step()
    phases = {k: v / steps for k, v in opt.timings.items()}
    sent = torch.tensor([float(opt.last_step_bytes)], device=device)
    dist.all_reduce(sent)
    if rank == 0:
        torch.save(dict(step=step_s, phases=phases, sent=sent.item(), formula=opt.comm_bytes()),
                   os.path.join(folder, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def single_process_step(size: str, dtype: torch.dtype, steps: int, device: torch.device) -> float:
    from anvil_fast.models import gpt
    from anvil_fast.parallel.comms import LocalComms
    from anvil_fast.optim.entry import ANVIL

    model = gpt.build(size, device=device).to(dtype)
    opt = ANVIL(model, comms=LocalComms())
    whole = _grads(model, 0)

    def set_grads():
        for n, p in model.named_parameters():
            p.grad = whole[n].to(device)

    return _time_steps(opt, set_grads, steps, device)


def measure(world: int, size: str, dtype: str, steps: int, backend: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="anvil_bench_fsdp_") as folder:
        mp.start_processes(_rank, args=(world, folder, size, dtype, steps, backend), nprocs=world, join=True,
                           start_method="spawn")
        return torch.load(os.path.join(folder, "result.pt"), weights_only=False)


SUMMARY = "ANVIL on an FSDP2 (fully_shard) GPT: step time, its phases and bytes per step at several rank counts"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--size", default="tiny", help="anvil_fast.models.gpt size (default: %(default)s)")
    ap.add_argument("--worlds", default="1,2", help="comma-separated rank counts (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the model's dtype (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per measurement (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1 or args.steps < 1:
        print(f"anvil_fast.bench fsdp: --worlds needs comma-separated positive counts and --steps >= 1, got "
              f"--worlds {args.worlds!r} --steps {args.steps}")
        return 2
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= max(worlds) else "gloo"
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    single = single_process_step(args.size, getattr(torch, args.dtype), args.steps, device) * 1e3
    print(f"ANVIL on FSDP2: GPT {args.size}, {args.dtype}, {backend} ({'GPUs' if backend == 'nccl' else 'CPU'}), "
          f"mean of {args.steps} steps; single-process drop-in step {single:.2f} ms")
    print(f"{'ranks':>5} {'step ms':>9} {'exchange ms':>12} {'update ms':>10} {'prepare ms':>11} "
          f"{'MB/step':>8} {'formula MB':>11}")
    bar = Progress(len(worlds), "bench fsdp")
    for w in worlds:
        bar.update(label=f"bench fsdp: {w} rank(s)")
        r = measure(w, args.size, args.dtype, args.steps, backend)
        bar.update(advance=1)
        ph = r["phases"]
        print(f"{w:>5} {r['step'] * 1e3:>9.2f} {ph.get('exchange', 0) * 1e3:>12.2f} {ph.get('update', 0) * 1e3:>10.2f} "
              f"{ph.get('prepare', 0) * 1e3:>11.2f} {r['sent'] / 1e6:>8.3f} {r['formula'] / 1e6:>11.3f}")
    bar.close()
    return 0
