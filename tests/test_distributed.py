"""The fast optimizer under torch.distributed: two gloo processes on CPU (in CI), two NCCL
processes on two GPUs (gpu marker), one session each (process start-up dominates the cost).

What a session checks, on the model of tests/optimizer_cases.py (every kind of parameter):

* the comms layer on a real process group (averages, in-place gathers, idempotent handles);
* with rank-independent gradients whose average is exact (quantized), the sharded run is the
  single-process run bit for bit -- parameters and every rank's shard of the state -- over 8 steps
  with Adam/non-Adam steps, the sparse update, deferred gathers and the untie;
* with each rank's own gradients: one step from a common state equals the reference step on the
  mean gradient within anvil_fast/core/tolerances.py (the single-process fast step on the rounded mean is the
  "other draw" for the banks), and after 20 steps every rank's replica is bitwise identical;
* checkpoint on two ranks: save, load into a fresh model/optimizer, continue: bit-identical;
* a non-finite gradient on one rank makes every rank refuse the step (no hang, nothing written);
* the drop-in ANVIL on two ranks (padded banks, sharded Adam): identical replicas.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch

from anvil_fast.parallel.distributed import all_digests, replica_digest, spawn
from tests import optimizer_cases as C

WORLD = 2


def _opt(comms, device, compile_banks, params=None):
    from anvil_fast.core.bank import anvil_bank_update
    from anvil_fast.optim.optimizer import AnvilAndAdam

    update = None if compile_banks else functools.partial(anvil_bank_update, compile=False)
    return AnvilAndAdam(params or C.make_params(device=device), C.TABLE, C.SCATTER, C.WORK, comms=comms,
                        bank_config="faithful", bank_update=update)


def _drive(opt, t, grads, pending):
    """One training-loop step: hyper-parameters, backward (accumulate), untie at t == 5, step."""
    C.set_hyper(opt, t)
    C.accumulate(opt.params, {l: grads[l] for l in C.DENSE})
    pending["ve"] = grads["value_embeds"] if pending.get("ve") is None else pending["ve"] + grads["value_embeds"]
    do_adam = t % 2 == 1
    if t == 5:
        opt.copy_lm_state_to_embed()
    sparse = C.ValueEmbedSparse(opt, pending["ve"]) if do_adam else None
    handles = opt.step(do_adam, sparse, deferred_labels={"qk_bank", "embed"} if t % 3 == 0 else ())
    for h in handles.values():
        h.wait()
    if do_adam:
        pending["ve"] = None


def _shard(opt, label, full):
    cfg = opt.param_cfgs[label]
    lo, hi = opt.rank * cfg.chunk_size, (opt.rank + 1) * cfg.chunk_size
    return full[:, lo:hi] if full.dim() > 1 and full.shape[0] == 2 and cfg.optim == "anvil" else full[lo:hi]


def _state_equal(dist_opt, single) -> dict[str, bool]:
    out = {}
    for label, st in dist_opt.param_states.items():
        cfg = dist_opt.param_cfgs[label]
        for k, v in st.items():
            s = single.param_states[label][k]
            if isinstance(v, torch.Tensor):
                if cfg.comms == "sharded":
                    lo, hi = dist_opt.rank * cfg.chunk_size, (dist_opt.rank + 1) * cfg.chunk_size
                    s = s[:, lo:hi] if k == "velocity" else s[lo:hi]
                out[f"{label}.{k}"] = torch.equal(v, s)
            else:
                out[f"{label}.{k}"] = v == s
    return out


def _session(rank: int, world: int, device: str, compile_banks: bool) -> dict:
    import anvil_ref as A
    from anvil_fast.parallel.comms import DistComms, LocalComms
    from anvil_fast.studies.difftest import rel_err
    from anvil_fast.optim.optimizer import NonFiniteGradientError
    from anvil_fast.core import tolerances as TOL

    if device == "cuda":
        device = f"cuda:{rank}"
    res: dict = {}
    # ---- 1. the comms layer on a real group
    c = DistComms()
    x = (torch.arange(8, dtype=torch.float32) * 0.5 + 4 * rank).to(torch.bfloat16).to(device)
    o = torch.empty(4, dtype=torch.bfloat16, device=device)
    h = c.reduce_scatter_avg(o, x)
    h.wait()
    h.wait()
    res["rs"] = o.float().cpu()
    y = torch.full((5,), float(rank + 1), device=device)
    c.all_reduce_avg(y).wait()
    res["ar"] = y.cpu()
    full = torch.zeros(6, device=device)
    full[3 * rank:3 * rank + 3] = rank + 1.0
    c.all_gather(full, full[3 * rank:3 * rank + 3]).wait()
    res["ag"] = full.cpu()

    # ---- 2. exact gradients: sharded == single process, bit for bit
    dist_opt = _opt(None, device, compile_banks)
    single = _opt(LocalComms(), device, compile_banks)
    pd, ps = {}, {}
    for t in range(8):
        g = C.gradients(t, exact=True, device=device)
        _drive(dist_opt, t, g, pd)
        _drive(single, t, g, ps)
    res["exact_params_equal"] = {l: torch.equal(dist_opt.params[l].data, single.params[l].data) for l in dist_opt.labels}
    res["exact_state_equal"] = _state_equal(dist_opt, single)
    init = dict(C.make_params(device=device))
    res["exact_params_rel"] = {l: float((dist_opt.params[l].data.double() - single.params[l].data.double()).norm() /
                                        (single.params[l].data.double() - init[f"model.{l}"].data.double()).norm())
                               for l in dist_opt.labels}

    # ---- 3. each rank's own gradients, one Adam step from the common state (no kept gradients at
    #         t = 8: step 7 was an Adam step). Two ranks average as round(g0 + g1) / 2 in the
    #         parameter's dtype on both backends (NCCL's premultiplied AVG gives the same bits: the
    #         halving is exact), so the single-process run fed that average must match bit for bit;
    #         and that same single-process step must match the reference (float64, same gradient)
    #         within anvil_fast/core/tolerances.py, next to the eager-bf16 floor.
    t = 8
    per_rank = [C.gradients(t, rank=r, device=device) for r in range(world)]
    avg = {l: (per_rank[0][l].to(dist_opt.params[l].dtype) + per_rank[1][l].to(dist_opt.params[l].dtype)) / 2
           for l in C.DENSE}
    eager = _opt(LocalComms(), device, compile_banks)
    for opt in (single, dist_opt, eager):
        C.set_hyper(opt, t)
    C.accumulate(single.params, avg)
    C.sync_optimizer(eager, single)
    eager.bank_update = C.eager_bank_update
    ref = C.to_reference(single)
    ref.set_rail_scalars(A.rail_scalars(t, 40, engage_step=3))
    before = {l: C.master64(single, l) for l in single.labels}
    bank_grads = {l: single.params[l].grad.double().cpu() for l in single.bank_labels}
    C.accumulate(dist_opt.params, {l: per_rank[rank][l] for l in C.DENSE})
    for opt in (single, dist_opt, eager):
        opt.step(do_adam=True)
    ref.step(bank_grads, do_adam=True)  # Adam's gradients: single's .grad (the average), as pending
    res["random_params_equal"] = {l: torch.equal(dist_opt.params[l].data, single.params[l].data) for l in C.DENSE}
    res["random_params_rel"] = {l: float((dist_opt.params[l].data.double() - single.params[l].data.double()).norm() /
                                         (single.params[l].data.double() - torch.from_numpy(before[l]).to(device)
                                          .reshape(single.params[l].shape)).norm()) for l in C.DENSE}
    res["random_state_equal"] = _state_equal(dist_opt, single)
    errs = {}
    for label in single.bank_labels:
        cfg = single.param_cfgs[label]
        d_ref = torch.from_numpy(ref.params[label] - before[label]).reshape(cfg.reshape)
        e_fast = rel_err(torch.from_numpy(C.master64(single, label) - before[label]).reshape(cfg.reshape), d_ref)
        e_eager = rel_err(torch.from_numpy(C.master64(eager, label) - before[label]).reshape(cfg.reshape), d_ref)
        errs[label] = (e_fast, TOL.bf16_bound(e_eager))
    res["random_step_bank_errors"] = errs

    # ---- 4. 20 steps with each rank's gradients: replicas bitwise identical
    for t in range(9, 21):
        _drive(dist_opt, t, C.gradients(t, rank=rank, device=device), pd)
    res["replica_digests"] = all_digests([p.data for p in dist_opt.params.values()])

    # ---- 5. checkpoint on two ranks: save, load into fresh objects, continue
    buf = io.BytesIO()
    torch.save({"params": {l: p.data for l, p in dist_opt.params.items()}, "opt": dist_opt.state_dict(),
                "pending": dict(pd)}, buf)
    for t in range(21, 25):
        _drive(dist_opt, t, C.gradients(t, rank=rank, device=device), pd)
    want = replica_digest([p.data for p in dist_opt.params.values()] +
                          [v for st in dist_opt.param_states.values() for v in st.values() if isinstance(v, torch.Tensor)])
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    fresh = _opt(None, device, compile_banks, params=C.make_params(seed=9, device=device))
    for l, p in fresh.params.items():
        p.data.copy_(ck["params"][l])
    fresh.load_state_dict(ck["opt"])
    pf = dict(ck["pending"])
    for t in range(21, 25):
        _drive(fresh, t, C.gradients(t, rank=rank, device=device), pf)
    got = replica_digest([p.data for p in fresh.params.values()] +
                         [v for st in fresh.param_states.values() for v in st.values() if isinstance(v, torch.Tensor)])
    res["checkpoint_continue_equal"] = got == want

    # ---- 6. a non-finite gradient on rank 1 only: every rank refuses, nothing written
    C.accumulate(dist_opt.params, {l: g for l, g in C.gradients(30, rank=rank, device=device).items() if l in C.DENSE})
    if rank == 1:
        dist_opt.params["vo_bank"].grad.view(-1)[5] = float("nan")
    dist_opt.check_finite = True
    snap = replica_digest([p.data for p in dist_opt.params.values()])
    try:
        dist_opt.step(do_adam=True)
        res["nonfinite"] = "not raised"
    except NonFiniteGradientError as e:
        res["nonfinite"] = str(e)
    res["nonfinite_unchanged"] = replica_digest([p.data for p in dist_opt.params.values()]) == snap

    # ---- 7. the drop-in on two ranks
    res["dropin_digests"], res["dropin_layout"] = _dropin(rank, device)

    # ---- 8. the step from persistent buffers (captured in CUDA graphs on NCCL) equals the step
    #         from .grad, bit for bit, with each rank's own gradients, a plan change and Adam-free steps
    res["buffers_equal"] = _buffers_session(rank, device, compile_banks)
    return res


def _buffers_session(rank, device, compile_banks) -> dict[str, bool]:
    eager, buffered = _opt(None, device, compile_banks), _opt(None, device, compile_banks)
    if device.startswith("cuda"):
        buffered.capture_step()
    bufs = buffered.grad_buffers()
    for t in range(5):
        do_adam = t % 2 == 0
        for opt in (eager, buffered):
            C.set_hyper(opt, t)
        C.accumulate(eager.params, {l: g for l, g in C.gradients(t, rank=rank, device=device).items()
                                    if l in C.DENSE and not (t >= 3 and l in ("gates", "vo_bank"))})
        read = [l for l in eager.labels if eager.params[l].grad is not None
                and (do_adam or eager.param_cfgs[l].optim == "anvil")]
        for l in read:
            bufs[l].copy_(eager.params[l].grad)
        eager.step(do_adam=do_adam)
        buffered.step_from_buffers(read, do_adam=do_adam)
    out = {f"param.{l}": torch.equal(eager.params[l].data, buffered.params[l].data) for l in eager.labels}
    for l, st in eager.param_states.items():
        for k, v in st.items():
            w = buffered.param_states[l][k]
            out[f"{l}.{k}"] = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
    return out


def _dropin(rank, device):
    from anvil_fast.optim.entry import ANVIL

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.LayerNorm(16), torch.nn.Linear(16, 64)).to(device)
    opt = ANVIL(model, lr=0.02, adam_lr=0.01, adam=["7.weight"], shard_min_numel=512, bank_config="faithful",
                compile=False)  # 7: the output layer, by index in a Sequential
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(4):
        x = torch.randint(0, 64, (8, 5), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    layout = {"banks": opt.banks, "reshape": {l: opt.inner.param_cfgs[l].reshape for l in opt.banks},
              "adam": opt.adam_names}
    return all_digests([p.data for p in model.parameters()]), layout


def _check(res: list[dict], bitwise: bool = True) -> None:
    """The assertions on the ranks' results (shared by the gloo and NCCL sessions). ``bitwise``:
    sharded == single process bit for bit (gloo on CPU, and NCCL on GPUs since the SAFE equalizer's
    reductions no longer depend on the bank's size: tools/chunk_independence.py); otherwise within
    2**-5 of the step's movement. The bitwise result is printed either way."""
    # comms: bf16 values x = 0.5 k + 4 r; the average of the two ranks is exact here
    for r, out in enumerate(res):
        k = torch.arange(4 * r, 4 * r + 4, dtype=torch.float32)
        assert torch.equal(out["rs"], 0.5 * k + 2.0)
        assert torch.equal(out["ar"], torch.full((5,), 1.5))
        assert torch.equal(out["ag"], torch.tensor([1.0, 1, 1, 2, 2, 2]))
    for out in res:
        print("sharded == single, bitwise:", all(out["exact_params_equal"].values()), all(out["random_params_equal"].values()),
              "max rel. diff:", max(out["exact_params_rel"].values()), max(out["random_params_rel"].values()))
        if not bitwise:
            assert max(out["exact_params_rel"].values()) <= 2.0 ** -5, out["exact_params_rel"]
            assert max(out["random_params_rel"].values()) <= 2.0 ** -5, out["random_params_rel"]
            continue
        assert all(out["exact_params_equal"].values()), out["exact_params_equal"]
        assert all(out["exact_state_equal"].values()), {k: v for k, v in out["exact_state_equal"].items() if not v}
        assert all(out["random_params_equal"].values()), out["random_params_equal"]
        assert all(out["random_state_equal"].values()), {k: v for k, v in out["random_state_equal"].items() if not v}
    for out in res:
        for label, (e, bound) in out["random_step_bank_errors"].items():
            assert e <= bound, (label, e, bound)
    assert len(set(res[0]["replica_digests"])) == 1
    assert all(out["checkpoint_continue_equal"] for out in res)
    for out in res:
        assert "non-finite gradient" in out["nonfinite"] and "vo_bank" in out["nonfinite"], out["nonfinite"]
        assert out["nonfinite_unchanged"]
    assert len(set(res[0]["dropin_digests"])) == 1
    for out in res:
        assert all(out["buffers_equal"].values()), {k: v for k, v in out["buffers_equal"].items() if not v}
    layout = res[0]["dropin_layout"]
    assert list(layout["banks"].values()) == [["1.weight", "3.weight", "5.weight"]]
    assert next(iter(layout["reshape"].values())) == (4, 16, 16)  # padded to a multiple of 2 ranks
    assert layout["adam"]["0.weight"] == "sharded" and layout["adam"]["7.weight"] == "sharded"
    assert layout["adam"]["6.weight"] == "replicated"


@pytest.fixture(scope="module")
def gloo_results():
    return spawn(_session, WORLD, "cpu", False, backend="gloo")


@pytest.mark.distributed
def test_two_gloo_ranks(gloo_results):
    _check(gloo_results)


@pytest.mark.gpu
@pytest.mark.distributed
def test_two_nccl_ranks():
    if torch.cuda.device_count() < WORLD:
        pytest.skip("needs two GPUs")
    _check(spawn(_session, WORLD, "cuda", False, backend="nccl"), bitwise=True)


def _one_rank_stays_away(rank, world_size, away_s):
    import time

    import torch.distributed as dist

    if rank == 0:
        dist.barrier()  # rank 1 reaches the launcher's closing barrier only after away_s
    else:
        time.sleep(away_s)
    return rank


@pytest.mark.distributed
def test_a_stuck_collective_fails_within_the_timeout():
    # without spawn's timeout rank 0 would wait for rank 1 (away_s) and the run would pass; with it,
    # rank 0's barrier fails after 3 s and the launcher raises
    import time

    t0 = time.monotonic()
    with pytest.raises(Exception, match="Timed out"):
        spawn(_one_rank_stays_away, WORLD, 60.0, backend="gloo", timeout=3.0)
    assert time.monotonic() - t0 < 45.0


def test_spawn_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout"):
        spawn(_one_rank_stays_away, WORLD, 0.0, timeout=0)
