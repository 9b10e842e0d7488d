"""``anvil_fast.ANVIL`` on an FSDP2 model (anvil_fast/optim/fsdp.py) against the single-process drop-in.

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

from anvil_fast.optim.dropin import DropInAnvil, plan_routes, classify, named_parameters_of
from anvil_fast.optim.entry import ANVIL
from anvil_fast.models import gpt
from anvil_fast.core import tolerances as TOL
from anvil_fast.optim.fsdp import assign_owners, shard_rows
from anvil_fast.parallel.distributed import leave_rank

KW = dict(lr=0.031, adam_lr=0.02, momentum=0.9, fast_beta=0.7, fast_weight=0.6, beta2=0.8, weight_decay=1.5,
          adam_betas=(0.8, 0.9), adam_eps=1e-8, adam_weight_decay=0.3)
STEPS, SAVE_AT, CHANGE_AT = 20, 10, 7
SPAWN_TIMEOUT_S = 300
COLLECTIVE_TIMEOUT_S = 60
#: Banks of three matrices (two ranks own two and one); a width and vocabulary that two ranks split
#: unevenly (63 rows: 32 and 31), so shards of odd byte counts cross the all-to-alls.
SIZE = dict(n_layer=3, n_embd=63, n_head=3, vocab=255)


def make_model(dtype=torch.float32, seed=0):
    return gpt.build("tiny", seed=seed, **SIZE).to(dtype)


def whole_gradients(model, t: int) -> dict[str, torch.Tensor]:
    """Step t's whole gradient of every parameter (seeded by t; the parameter's dtype)."""
    g = torch.Generator().manual_seed(1000 + t)
    return {n: (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype) for n, p in model.named_parameters()}


def change_groups(opt, t: int) -> None:
    if t == CHANGE_AT:
        for g in opt.param_groups:
            g.update(dict(lr=0.017, momentum=0.8, weight_decay=3.0) if g["kind"] == "anvil" else
                     dict(lr=0.025, betas=(0.6, 0.8), weight_decay=0.5))


#: The last single_process_run's rails per banked parameter (fast, slow), in the parameter's shape.
SINGLE_RAILS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def single_process_run(dtype=torch.float32, device="cpu", steps=STEPS):
    """The single-process drop-in's weights after ``steps`` steps, and per banked matrix the length
    of its path, the sum over steps of ||P' - P|| (float64; the scale of the GPU bound)."""
    model = make_model(dtype).to(device)
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    banked = {n for ns in opt.banks.values() for n in ns}
    path = dict.fromkeys(banked, 0.0)
    for t in range(steps):
        change_groups(opt, t)
        whole = whole_gradients(model, t)
        for n, p in model.named_parameters():
            p.grad = whole[n].to(device)
        before = {n: p.detach().double().clone() for n, p in model.named_parameters() if n in banked}
        opt.step()
        for n, p in model.named_parameters():
            if n in banked:
                path[n] += (p.detach().double() - before[n]).norm().item()
    rails = {n: (opt.state[p]["fast_rail"].cpu().reshape(p.shape), opt.state[p]["slow_rail"].cpu().reshape(p.shape))
             for n, p in model.named_parameters() if n in banked}
    SINGLE_RAILS.clear()
    SINGLE_RAILS.update(rails)
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, path


# ------------------------------------------------------------------ in the spawned ranks
def _init(rank: int, world: int, rendezvous: str, backend: str = "gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _sharded_model(dtype, device, seed=0):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # explicit: the default follows CUDA's presence
    model = make_model(dtype, seed=seed).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _set_grads(model, t: int) -> None:
    """Each rank's rows of step t's whole gradients, as DTensors like the parameters."""
    from torch.distributed.tensor import DTensor

    whole = whole_gradients(model, t)  # a DTensor's shape is the whole parameter's
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


def _rank_train(rank: int, world: int, folder: str, rendezvous: str, backend: str, dtype: torch.dtype, load_from: str | None,
                save_to: str | None) -> None:
    """A run from scratch to SAVE_AT (saving a DCP checkpoint and a torch.save'd optimizer state
    there) and on to STEPS; or, with ``load_from``, a fresh model and optimizer loaded from that
    checkpoint at SAVE_AT, continued to STEPS."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _init(rank, world, rendezvous, backend)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    out: dict = {}
    if load_from is None:
        model = _sharded_model(dtype, device)
        opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
        out["owner"], out["type"] = dict(opt.owner), type(opt).__name__
        out["describe"] = opt.describe()
        _run(model, opt, 0, SAVE_AT)
        if save_to:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(folder, save_to))
            torch.save(opt.state_dict(), os.path.join(folder, f"{save_to}_raw{rank}.pt"))
    else:
        model = _sharded_model(dtype, device, seed=5)  # other weights: all must come from the checkpoint
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
    out["whole"], out["shards"] = _whole(model), _shards(model)
    sd = opt.state_dict()  # collective: every rank takes it
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    by_name = {names[i]: st for i, st in sd["state"].items()}
    out["rails"] = {n: (st["fast_rail"].full_tensor().cpu(), st["slow_rail"].full_tensor().cpu())
                    for n, st in by_name.items() if "fast_rail" in st}
    out["adam_steps"] = {n: st["step"] for n, st in by_name.items() if "step" in st}
    out["taken"] = sd["param_groups"][0]["anvil_fast"]["taken_steps"]
    out["bytes"], out["comm_bytes"] = opt.last_step_bytes, opt.comm_bytes()
    torch.save(out, os.path.join(folder, f"train_w{world}_r{rank}_{load_from or 'scratch'}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def spawn_in(folder: str, fn, world: int, *args) -> None:
    """Run ``fn(rank, world, folder, rendezvous, *args)`` on ``world`` spawned processes sharing
    ``folder`` (``rendezvous``: a file of their own there); fail (after stopping them) past
    SPAWN_TIMEOUT_S or when a rank died."""
    import tempfile
    import time

    import torch.multiprocessing as mp

    rendezvous = os.path.join(tempfile.mkdtemp(dir=folder), "rendezvous")
    ctx = mp.start_processes(fn, args=(world, folder, rendezvous, *args), nprocs=world, join=False, start_method="spawn")
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


def train(folder, world, backend="gloo", dtype=torch.float32, load_from=None, save_to=None) -> list[dict]:
    spawn_in(folder, _rank_train, world, backend, dtype, load_from, save_to)
    return [torch.load(os.path.join(folder, f"train_w{world}_r{r}_{load_from or 'scratch'}.pt"), weights_only=False)
            for r in range(world)]


def _batch(t: int, device) -> torch.Tensor:
    return torch.randint(0, SIZE["vocab"], (2, 33), generator=torch.Generator().manual_seed(2000 + t)).to(device)


def _rank_backward(rank: int, world: int, folder: str, rendezvous: str, backend: str) -> None:
    """Training through FSDP2's own forward, backward and gradient reduce-scatter: every rank the
    same batch, so the averaged gradient is each rank's own, exactly (a sum of equal values halved)."""
    import torch.distributed as dist

    _init(rank, world, rendezvous, backend)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.use_deterministic_algorithms(True, warn_only=True)  # as the single-GPU run: no atomics in backward
    model = _sharded_model(torch.float32, device)
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    for t in range(BACKWARD_STEPS):
        x = _batch(t, device)
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save({"whole": _whole(model)}, os.path.join(folder, f"backward{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


BACKWARD_STEPS = 8


def _outcome(fn) -> str:
    try:
        fn()
        return "accepted"
    except Exception as e:  # noqa: BLE001  (the message is the result)
        return f"{type(e).__name__}: {e}"


def _rank_refusals(rank: int, world: int, folder: str, rendezvous: str) -> None:
    """Bad input on two ranks, each refused on every rank with a message (or, for a NaN on one rank,
    the step skipped on both)."""
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    from anvil_fast.parallel.comms import LocalComms

    _init(rank, world, rendezvous)
    out: dict = {}
    # a NaN in one rank's rows of a banked gradient: both ranks skip, nothing written
    model = _sharded_model(torch.float32, "cpu")
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    _set_grads(model, 0)
    if rank == 1:
        model.blocks[1].mlp.fc.weight.grad.to_local()[0, 0] = float("nan")
    before = _shards(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["nan"] = "; ".join(f"{w.category.__name__}: {w.message}" for w in caught)
    out["nan_unchanged"] = all(torch.equal(before[n], v) for n, v in _shards(model).items())
    out["skipped"] = opt.skipped_steps
    # a gradient on one rank only
    _set_grads(model, 1)
    if rank == 0:
        model.blocks[0].attn.proj.weight.grad = None
    out["one_rank_grad"] = _outcome(opt.step)
    # a state dict with a field missing, or of another dtype: refused before anything is written
    sd = opt.state_dict()
    name = [n for g in sd["param_groups"] for n in g["param_names"]].index("blocks.0.mlp.fc.weight")
    st = sd["state"][name]
    missing = {**sd, "state": {**sd["state"], name: {k: v for k, v in st.items() if k != "mantissa"}}}
    out["missing_field"] = _outcome(lambda: opt.load_state_dict(missing))
    recast = {**sd, "state": {**sd["state"], name: {**st, "slow_rail": st["slow_rail"].double()}}}
    out["wrong_dtype"] = _outcome(lambda: opt.load_state_dict(recast))
    # DDP's averaging and the drop-in's own
    plain = make_model()
    ddp = DistributedDataParallel(plain)
    out["ddp"] = _outcome(lambda: ANVIL(ddp, **KW, compile=False))
    out["ddp_local"] = _outcome(lambda: ANVIL(DistributedDataParallel(make_model()), **KW, compile=False,
                                              comms=LocalComms()))
    # placements other than Shard(0) on a 1-D mesh
    mesh = init_device_mesh("cpu", (world,))
    cols = nn.Linear(8, 6, bias=False)
    cols.weight = nn.Parameter(distribute_tensor(cols.weight.detach(), mesh, [Shard(1)]))
    out["shard1"] = _outcome(lambda: ANVIL(cols, compile=False))
    rep = nn.Linear(8, 6, bias=False)
    rep.weight = nn.Parameter(distribute_tensor(rep.weight.detach(), mesh, [Replicate()]))
    out["replicate"] = _outcome(lambda: ANVIL(rep, compile=False))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    two = nn.Linear(8, 6, bias=False)
    two.weight = nn.Parameter(distribute_tensor(two.weight.detach(), mesh2, [Replicate(), Shard(0)]))
    out["mesh2d"] = _outcome(lambda: ANVIL(two, compile=False))
    mixed = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 4, bias=False))
    mixed[0].weight = nn.Parameter(distribute_tensor(mixed[0].weight.detach(), mesh, [Shard(0)]))
    out["mixed"] = _outcome(lambda: ANVIL(mixed, compile=False))
    out["iterator"] = _outcome(lambda: ANVIL(iter(list(model.named_parameters())), compile=False))
    # the single-process drop-in's state dict into the FSDP2 optimizer, and one world size's
    # drop-in state into another's
    single = ANVIL(make_model(), **KW, compile=False, comms=LocalComms())
    out["plain_into_fsdp"] = _outcome(lambda: opt.load_state_dict(single.state_dict()))
    two_ranks = ANVIL(make_model(), **KW, compile=False)
    out["dropin_world"] = _outcome(lambda: two_ranks.load_state_dict(single.state_dict()))
    torch.save(out, os.path.join(folder, f"refusals{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


# ------------------------------------------------------------------ tests
def test_shard_rows_follow_torch_chunk():
    for rows in (1, 3, 7, 64, 65, 192):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(rows).chunk(world)
            for r in range(world):
                lo, hi = shard_rows(rows, world, r)
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(lo, hi)) == want, (rows, world, r)


def _tiny_plan(n_layer: int):
    model = gpt.build("tiny", n_layer=n_layer)
    named, owners = named_parameters_of(model)
    return plan_routes(classify(named, owners), world_size=1)


@pytest.mark.parametrize("n_layer,world", [(3, 2), (5, 2), (2, 4), (7, 3)])
def test_owners_hold_floor_or_ceil_of_each_bank(n_layer, world):
    """Banks of single matrices: each rank owns floor(n / world) or ceil(n / world) of every bank,
    whatever n (no padding), and the extra matrices of uneven banks do not all land on one rank."""
    plan = _tiny_plan(n_layer)
    owner = assign_owners(plan.banks, world)
    assert set(owner) == {n for b in plan.banks for n, *_ in b.members}
    total = [0] * world
    for b in plan.banks:
        held = [sum(owner[n] == r for n, *_ in b.members) for r in range(world)]
        assert sorted(set(held)) in ([n_layer // world], [n_layer // world, -(-n_layer // world)]), (b.label, held)
        for r in range(world):
            total[r] += held[r]
    assert max(total) - min(total) <= 1, total


def _check_equal(ref: dict, out: dict, world: int, where: str, path: dict | None = None) -> None:
    """Every rank's shards are its rows of the whole weights it reports, and the whole weights equal
    the single-process run's: bit for bit (``path`` None), or on a GPU, where a bank's kernels may
    be tuned per bank size (tools/chunk_independence.py), a banked matrix within the drop-in row of
    anvil_fast/core/tolerances.py: each step's error is at most DROPIN_STEP_REL of that step (the
    gradients are fixed, so errors add and do not feed back), hence at most DROPIN_STEP_REL times
    the path's length. Adam is element-wise: bit for bit everywhere."""
    for n, v in ref.items():
        got = out["whole"][n]
        if path is None or n not in path:
            assert torch.equal(got, v), (where, n)
        else:
            err = (got.double() - v.double()).norm().item()
            assert err <= TOL.DROPIN_STEP_REL * path[n], (where, n, err, path[n])
        lo, hi = shard_rows(v.shape[0], world, out["rank"])
        assert torch.equal(out["shards"][n], got[lo:hi]), (where, n)
    # the state: rails are element-wise EMAs of the fixed gradients (bit for bit everywhere), every
    # Adam parameter stepped each time
    assert set(out["rails"]) == set(SINGLE_RAILS), where
    for n, (fast, slow) in SINGLE_RAILS.items():
        assert torch.equal(out["rails"][n][0], fast) and torch.equal(out["rails"][n][1], slow), (where, n)
    assert out["taken"] == STEPS and set(out["adam_steps"].values()) == {STEPS}, where


def _expected_bytes(ref: dict, owner: dict, world: int, itemsize: int) -> int:
    """Every banked row held away from its owner crosses twice: bf16 gradient out, weight back."""
    total = 0
    for n, rank in owner.items():
        rows, cols = ref[n].shape[0], ref[n][0].numel()
        lo, hi = shard_rows(rows, world, rank)
        total += (rows - (hi - lo)) * cols * (2 + itemsize)
    return total


def _train_and_reshard(backend: str, dtype: torch.dtype, device: str, tmp_path) -> None:
    ref, path = single_process_run(dtype, device)
    path = path if device == "cuda" else None
    folder = str(tmp_path)
    res2 = train(folder, 2, backend, dtype, save_to="ck2")
    for r, out in enumerate(res2):
        assert out["type"] == "FSDPAnvil"
        _check_equal(ref, dict(out, rank=r), 2, f"2 ranks, rank {r}", path)
    assert res2[0]["owner"] == res2[1]["owner"]
    assert all(torch.equal(res2[0]["whole"][n], res2[1]["whole"][n]) for n in ref)
    measured = sum(out["bytes"] for out in res2)
    assert measured == res2[0]["comm_bytes"] == _expected_bytes(ref, res2[0]["owner"], 2, dtype.itemsize)
    # two ranks saved at SAVE_AT -> one rank loads and continues
    (one,) = train(folder, 1, backend, dtype, load_from="ck2")
    _check_equal(ref, dict(one, rank=0), 1, "saved on 2, loaded on 1", path)
    assert one["taken_after_load"] == SAVE_AT
    assert "saved on 2 rank(s)" in one["raw_load"] and "torch.distributed.checkpoint" in one["raw_load"], one["raw_load"]
    # one rank saved -> two ranks load and continue
    train(folder, 1, backend, dtype, save_to="ck1")
    res21 = train(folder, 2, backend, dtype, load_from="ck1")
    for r, out in enumerate(res21):
        _check_equal(ref, dict(out, rank=r), 2, f"saved on 1, loaded on 2, rank {r}", path)
        assert "saved on 1 rank(s)" in out["raw_load"], out["raw_load"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp_two_ranks_equal_one_process_and_checkpoints_reshard(dtype, tmp_path):
    """20 steps on 2 gloo ranks equal the single-process drop-in bit for bit (whole weights and
    every rank's shards), the bytes moved are the formula's; a DCP checkpoint taken at step 10 on 2
    ranks, loaded on 1 (and the reverse) into a differently initialized model, continues to the
    same weights; a torch.save'd state of the other world size is refused."""
    _train_and_reshard("gloo", dtype, "cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp_two_gpus_equal_one_gpu_and_checkpoints_reshard(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("ANVIL_FAST_TUNE", "0")  # one Gram kernel configuration for every bank size
    _train_and_reshard("nccl", dtype, "cuda", tmp_path)


def _backward(backend: str, device: str, tmp_path) -> None:
    model = make_model().to(device)
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # as the ranks: a CPU matmul's summation order follows the thread count
    if device == "cuda":  # an embedding's backward on CUDA adds with atomics unless told not to
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for t in range(BACKWARD_STEPS):
            x = _batch(t, device)
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    spawn_in(str(tmp_path), _rank_backward, 2, backend)
    for r in range(2):
        out = torch.load(os.path.join(tmp_path, f"backward{r}.pt"), weights_only=False)
        for n, p in model.named_parameters():
            assert torch.equal(out["whole"][n], p.detach().cpu()), (r, n)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_training_through_backward_equals_one_process(tmp_path):
    """FSDP2's own forward, backward and reduce-scatter (the same batch on both ranks) and the
    FSDP2 optimizer: the weights equal single-process training bit for bit."""
    _backward("gloo", "cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_two_gpus_training_through_backward(tmp_path, monkeypatch):
    """As on the CPU, bit for bit: the Gram kernels untuned (one configuration for every bank size;
    every configuration sums in the same K order), torch's deterministic algorithms on both sides."""
    monkeypatch.setenv("ANVIL_FAST_TUNE", "0")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (torch's requirement)
    _backward("nccl", "cuda", tmp_path)


def _rank_contract(rank: int, world: int, folder: str, rendezvous: str) -> None:
    """torch's state-dict contract on the FSDP2 path: the format, the four hooks, a name-keyed
    dict of format anvil_fast.ANVIL.fsdp/1, and torch.distributed.checkpoint's state-dict helpers."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    _init(rank, world, rendezvous)
    model = _sharded_model(torch.float32, "cpu")
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    _run(model, opt, 0, 3)
    sd = opt.state_dict()
    out = {"keys": sorted(sd), "ints": all(isinstance(k, int) for k in sd["state"]),
           "params": [g["params"] for g in sd["param_groups"]],
           "names": [g["param_names"] for g in sd["param_groups"]]}
    opt.load_state_dict(sd)
    out["calls"] = list(calls)
    named = opt._named_state()  # the name-keyed layout, as format anvil_fast.ANVIL.fsdp/1 wrote it
    assert named["format"] == "anvil_fast.ANVIL.fsdp/1"
    opt.load_state_dict(named)
    osd = get_optimizer_state_dict(model, opt)
    out["dcp_keys"] = sorted(osd["state"])[:3]
    set_optimizer_state_dict(model, opt, osd)
    out["taken"] = opt.taken_steps
    _run(model, opt, 3, 5)
    out["whole"] = _whole(model)
    torch.save(out, os.path.join(folder, f"contract_r{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_state_dict_keeps_torchs_contract(tmp_path):
    spawn_in(str(tmp_path), _rank_contract, 2)
    res = [torch.load(tmp_path / f"contract_r{r}.pt", weights_only=False) for r in range(2)]
    ref, _ = single_process_run(steps=5)
    for out in res:
        assert out["keys"] == ["param_groups", "state"] and out["ints"]
        flat = [i for ps in out["params"] for i in ps]
        assert flat == list(range(len(flat)))
        assert "blocks.0.attn.qkv.weight" in out["names"][0] and "wte.weight" in out["names"][1]
        assert out["calls"] == ["pre", "post", "load_pre", "load_post"]
        assert out["dcp_keys"] and all(isinstance(k, str) for k in out["dcp_keys"])
        assert out["taken"] == 3
        for n, w in ref.items():  # reloading three times changed nothing: still the uninterrupted run
            assert torch.equal(out["whole"][n], w), n


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_refusals_on_two_ranks(tmp_path):
    spawn_in(str(tmp_path), _rank_refusals, 2)
    for r in range(2):
        out = torch.load(os.path.join(tmp_path, f"refusals{r}.pt"), weights_only=False)
        assert out["nan"].startswith("NonFiniteGradientWarning") and "blocks.1.mlp.fc.weight" in out["nan"], out["nan"]
        assert out["nan_unchanged"] and out["skipped"] == 1
        assert out["one_rank_grad"].startswith("ValueError") and "gradient on some of the 2 ranks and none on others" in out["one_rank_grad"]
        assert out["missing_field"].startswith("ConfigError") and "mantissa" in out["missing_field"]
        assert out["wrong_dtype"].startswith("ConfigError") and "torch.float64" in out["wrong_dtype"]
        assert out["ddp"].startswith("ConfigError") and "DistributedDataParallel" in out["ddp"], out["ddp"]
        assert out["ddp_local"] == "accepted", out["ddp_local"]
        assert out["shard1"].startswith("ConfigError") and "Shard(dim=1)" in out["shard1"], out["shard1"]
        assert out["replicate"].startswith("ConfigError") and "Replicate()" in out["replicate"], out["replicate"]
        assert out["mesh2d"].startswith("ConfigError") and "2-D device mesh" in out["mesh2d"], out["mesh2d"]
        assert out["mixed"].startswith("ConfigError") and "plain tensors among DTensor" in out["mixed"], out["mixed"]
        assert out["iterator"].startswith("ConfigError") and "DTensors (FSDP2)" in out["iterator"], out["iterator"]
        assert out["plain_into_fsdp"].startswith("ValueError") and "not an FSDP2" in out["plain_into_fsdp"]
        assert out["dropin_world"].startswith("ConfigError") and "of 1 cannot be loaded by rank" in out["dropin_world"]


def test_the_factory_builds_the_drop_in_for_plain_tensors_and_both_are_front_ends():
    """anvil_fast.ANVIL is a plain function: a model of plain tensors gets the drop-in class (the
    FSDP2 front-end is its sibling, not its subclass), introspection of the drop-in's class sees its
    constructor's arguments, and nothing dispatches through __new__ or a registry."""
    import inspect

    import anvil_fast
    from anvil_fast.optim import dropin
    from anvil_fast.optim import entry
    from anvil_fast.optim.fsdp import FSDPAnvil, holds_dtensors
    from anvil_fast.optim.frontend import AnvilFrontend

    assert inspect.isfunction(anvil_fast.ANVIL) and anvil_fast.ANVIL is entry.ANVIL
    params = inspect.signature(DropInAnvil).parameters
    assert list(params)[:3] == ["params", "lr", "adam_lr"] and "nonfinite" in params and "split_rows" in params
    assert not issubclass(FSDPAnvil, DropInAnvil) and not issubclass(DropInAnvil, FSDPAnvil)
    assert issubclass(FSDPAnvil, AnvilFrontend) and issubclass(DropInAnvil, AnvilFrontend)
    assert "__new__" not in vars(DropInAnvil) and "__new__" not in vars(FSDPAnvil)
    assert not hasattr(dropin, "register_dtensor_path")
    model = make_model()
    assert not holds_dtensors(model) and not holds_dtensors(list(model.named_parameters()))
    opt = anvil_fast.ANVIL(model, compile=False)
    assert type(opt) is DropInAnvil and not isinstance(opt, FSDPAnvil) and isinstance(opt, AnvilFrontend)
