"""``anvil_fast.ANVIL`` on an FSDP2 model (anvil_fast/fsdp.py) against the single-process drop-in.

Ranks are spawned with gloo on the CPU (NCCL on two GPUs for the gpu-marked versions), as in
tests/test_dropin_reference.py. Every run sets fixed, seeded gradients on ``.grad`` (each rank its
rows of the same whole gradient, so no averaging rounds anything) and compares with the
single-process ANVIL given the whole gradients: equal bit for bit, because each owner runs the same
bank update on the same bf16 gradient (the per-matrix arithmetic of the faithful cascade does not
depend on the bank's other matrices) and Adam is element-wise. A three-layer tiny GPT gives banks
of three matrices on two ranks (owners hold two and one: no padding).

Checkpoints: torch.distributed.checkpoint saves on two ranks and loads on one, and the reverse;
the continued runs equal the uninterrupted single-process run bit for bit.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from anvil_fast.dropin import ANVIL, plan_routes, classify, named_parameters_of
from anvil_fast import gpt
from anvil_fast.fsdp import assign_owners, shard_rows
from anvil_ref.config import ConfigError
from tests.test_dropin_reference import spawn_with_timeout

KW = dict(lr=0.031, adam_lr=0.02, momentum=0.9, fast_beta=0.7, fast_weight=0.6, beta2=0.8, weight_decay=1.5,
          adam_betas=(0.8, 0.9), adam_eps=1e-8, adam_weight_decay=0.3)
STEPS, SAVE_AT, CHANGE_AT = 20, 10, 7
SPAWN_TIMEOUT_S = 300
COLLECTIVE_TIMEOUT_S = 60
N_LAYER = 3  # banks of three matrices: two ranks own two and one


def make_model(dtype=torch.float32, seed=0):
    return gpt.build("tiny", seed=seed, n_layer=N_LAYER).to(dtype)


def whole_gradients(model, t: int) -> dict[str, torch.Tensor]:
    """Step t's whole gradient of every parameter (seeded by t; the parameter's dtype)."""
    g = torch.Generator().manual_seed(1000 + t)
    return {n: (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype) for n, p in model.named_parameters()}


def change_groups(opt, t: int) -> None:
    if t == CHANGE_AT:
        for g in opt.param_groups:
            g.update(dict(lr=0.017, momentum=0.8, weight_decay=3.0) if g["kind"] == "anvil" else
                     dict(lr=0.025, betas=(0.6, 0.8), weight_decay=0.5))


def single_process_run(dtype=torch.float32, steps=STEPS) -> dict[str, torch.Tensor]:
    model = make_model(dtype)
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    for t in range(steps):
        change_groups(opt, t)
        for n, p in model.named_parameters():
            p.grad = whole_gradients(model, t)[n]
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ in the spawned ranks
def _init(rank: int, world: int, folder: str, backend: str = "gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous_{world}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _sharded_model(dtype, device, seed=0):
    from torch.distributed.fsdp import fully_shard

    model = make_model(dtype, seed=seed).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _set_grads(model, t: int) -> None:
    """Each rank's rows of step t's whole gradients, as DTensors like the parameters."""
    from torch.distributed.tensor import DTensor

    whole = whole_gradients(make_model(next(model.parameters()).dtype), t)
    for n, p in model.named_parameters():
        lo, hi = shard_rows(p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank())
        local = whole[n][lo:hi].to(p.to_local().device)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride())


def _run(model, opt, start: int, end: int) -> None:
    for t in range(start, end):
        change_groups(opt, t)
        _set_grads(model, t)
        opt.step()


def _whole(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def _shards(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}


def _rank_train(rank: int, world: int, folder: str, backend: str, load_from: str | None, save_to: str | None) -> None:
    """A run from scratch to SAVE_AT (saving a DCP checkpoint and a torch.save'd optimizer state
    there) and on to STEPS; or, with ``load_from``, a fresh model and optimizer loaded from that
    checkpoint at SAVE_AT, continued to STEPS."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _init(rank, world, folder, backend)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    out: dict = {}
    if load_from is None:
        model = _sharded_model(torch.float32, device)
        opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
        out["owner"], out["type"] = dict(opt.owner), type(opt).__name__
        out["describe"] = opt.describe()
        _run(model, opt, 0, SAVE_AT)
        if save_to:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(folder, save_to))
            torch.save(opt.state_dict(), os.path.join(folder, f"{save_to}_raw{rank}.pt"))
    else:
        model = _sharded_model(torch.float32, device, seed=5)  # other weights: all must come from the checkpoint
        opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(folder, load_from))
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        out["taken_after_load"] = opt.taken_steps
        raw = os.path.join(folder, f"{load_from}_raw0.pt")
        try:  # the other world size's torch.save'd shards: refused
            opt.load_state_dict(torch.load(raw, weights_only=False))
            out["raw_load"] = "accepted"
        except Exception as e:  # noqa: BLE001  (the message is the result)
            out["raw_load"] = f"{type(e).__name__}: {e}"
    _run(model, opt, SAVE_AT, STEPS)
    opt.timings = {}
    _run(model, opt, STEPS, STEPS)  # (no step: timings are exercised by the benchmark)
    out["whole"], out["shards"] = _whole(model), _shards(model)
    out["bytes"], out["comm_bytes"] = opt.last_step_bytes, opt.comm_bytes()
    torch.save(out, os.path.join(folder, f"train_w{world}_r{rank}_{load_from or 'scratch'}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def spawn_in(folder: str, fn, world: int, *args) -> None:
    """Run ``fn(rank, world, folder, *args)`` on ``world`` spawned processes sharing ``folder``; fail
    (after stopping them) past SPAWN_TIMEOUT_S or when a rank died."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, folder, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AssertionError(f"the {world} ranks did not finish within {SPAWN_TIMEOUT_S} s (a hang)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise AssertionError(f"a rank failed: {e}") from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def train(folder, world, backend="gloo", load_from=None, save_to=None) -> list[dict]:
    spawn_in(folder, _rank_train, world, backend, load_from, save_to)
    return [torch.load(os.path.join(folder, f"train_w{world}_r{r}_{load_from or 'scratch'}.pt"), weights_only=False)
            for r in range(world)]
