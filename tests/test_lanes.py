"""anvil_fast.optim.lanes: the banks' side streams of one process.

On CPU: which bank goes to which lane, the launch order without streams, and AnvilAndAdam's ``lanes``
argument (what it accepts and what it resolves to). On a GPU (gpu marker): AnvilAndAdam's step with
its banks on lanes and Adam beside them writes the same bits as the step with every update on the
main stream, eagerly, with the banks' graphs and with the whole step captured."""

from __future__ import annotations

import functools

import pytest
import torch

from anvil_fast.optim.lanes import MAX_LANES, bank_work, make_lanes, plan_lanes, run_on_lanes
from anvil_fast.optim.optimizer import AnvilAndAdam
from anvil_fast.parallel.comms import NullComms
from anvil_ref.config import ConfigError
from tests import optimizer_cases as C
from tests.test_graphs import _assert_same_state, _run_schedule


def test_plan_lanes_gives_the_largest_work_first_to_the_least_loaded_lane():
    # sorted: 5 (lane 0), 3 (lane 1), 3 (lane 1: 3 < 5), 1 (lane 0: 5 < 6)
    assert plan_lanes([5, 1, 3, 3], 2) == [[0, 1], [2, 3]]
    # ties keep the given order, and a tie of loads goes to the first lane
    assert plan_lanes([2, 2, 2, 2], 2) == [[0, 2], [1, 3]]
    assert plan_lanes([4, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    # never more lanes than works, never fewer than one
    assert plan_lanes([7], 4) == [[0]]
    assert plan_lanes([1, 2, 3], 0) == [[2, 1, 0]]
    assert plan_lanes([], 3) == [[]]
    # every work in exactly one lane
    works = [bank_work(s) for s in [(72, 256, 768), (24, 768, 768), (24, 3072, 768), (8, 8, 8)]]
    plan = plan_lanes(works, MAX_LANES)
    assert sorted(i for lane in plan for i in lane) == list(range(len(works)))


def test_bank_work_is_the_cascade_size():
    assert bank_work((24, 3072, 768)) == 24 * 3072 * 768 * 768
    assert bank_work((6, 384, 1536)) == bank_work((6, 1536, 384))


def test_lanes_on_the_cpu_are_one_lane_on_the_current_stream_in_plan_order():
    lanes = make_lanes(["a", "b", "c"], [1.0, 3.0, 2.0], 4, torch.device("cpu"))
    assert len(lanes) == 1 and lanes[0].stream is None and lanes[0].banks == ["b", "c", "a"]
    with pytest.raises(ValueError, match="3 items but 2 works"):
        make_lanes(["a", "b", "c"], [1.0, 2.0], 2, torch.device("cpu"))
    seen = []
    run_on_lanes(lanes, seen.append, torch.device("cpu"), then=lambda: seen.append("main"))
    assert seen == ["b", "c", "a", "main"]


def _opt(device="cpu", **kw):
    from anvil_fast.core.bank import anvil_bank_update

    return AnvilAndAdam(C.make_params(0, device=device), C.TABLE, C.SCATTER, C.WORK, bank_config="faithful",
                        bank_update=functools.partial(anvil_bank_update, compile=False), **kw)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_lanes_refuses_what_is_not_a_count(bad):
    with pytest.raises(ConfigError, match="lanes must be None or an int >= 1"):
        _opt(lanes=bad)


def test_lanes_need_one_process():
    with pytest.raises(ConfigError, match="lanes=2 runs the banks on side streams of one process; with 2 ranks"):
        _opt(lanes=2, comms=NullComms(2, 0))
    # None and 1 keep the comms schedule's launch order on several ranks
    assert _opt(comms=NullComms(2, 0)).bank_lanes is None
    assert _opt(lanes=1, comms=NullComms(2, 0)).bank_lanes is None


def test_lanes_resolve_to_the_main_stream_on_the_cpu():
    assert _opt().bank_lanes is None
    assert _opt(lanes=3).bank_lanes is None


def test_the_lanes_branch_writes_the_sequential_bits_on_the_cpu():
    # The lanes' phase 2 (every bank first, then Adam, the replicated pass and the sparse update, then
    # the gathers) with two lanes on the current stream: the same bits as the launch order of the
    # comms schedule, with plan changes, Adam-free steps, the sparse update and the tied embeddings.
    from anvil_fast.optim.lanes import Lane

    seq, laned = _opt(lanes=1), _opt(lanes=1)
    laned.bank_lanes = [Lane(None, ["mlp_bank"]), Lane(None, ["vo_bank", "qk_bank"])]
    log = []
    for t, (do_adam, dropped) in enumerate(SCHEDULE):
        if t == 3:
            for opt in (seq, laned):
                opt.copy_lm_state_to_embed()  # untied from here on
        for opt in (seq, laned):
            C.set_hyper(opt, t)
            C.accumulate(opt.params, {l: g for l, g in C.gradients(t).items() if l in C.DENSE and l not in dropped})
            ve = C.gradients(t)["value_embeds"]
            opt.step(do_adam, C.ValueEmbedSparse(opt, ve, log) if do_adam else None)
        _assert_same_state(seq, laned, f"step {t}")
    assert ("sparse", "update") in log


# ------------------------------------------------------------------ on a GPU
# plan changes (vo_bank without a gradient at step 2, lm_head at steps 3-4) and Adam-free steps
SCHEDULE = [(True, set()), (False, {"gates"}), (True, {"vo_bank", "gates"}), (False, {"lm_head"}),
            (True, {"lm_head"}), (True, set())]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "bank_graphs", "step_graph"])
def test_banks_on_lanes_write_the_main_stream_steps_bits(mode):
    main, laned = _opt("cuda", lanes=1), _opt("cuda")
    assert main.bank_lanes is None
    assert laned.bank_lanes is not None and len(laned.bank_lanes) == 3  # one lane per bank of the model
    assert len({lane.stream for lane in laned.bank_lanes}) == 3
    if mode == "step_graph":
        # the buffered twin's step from copies of the eager twin's gradients, compared after every step
        laned.capture_step(max_plans=len(SCHEDULE))
        _run_schedule(main, laned, "cuda", steps=SCHEDULE)
        return
    if mode == "bank_graphs":
        laned.use_cuda_graphs()
    for t, (do_adam, dropped) in enumerate(SCHEDULE):
        grads = {l: g for l, g in C.gradients(t, device="cuda").items() if l in C.DENSE and l not in dropped}
        for opt in (main, laned):
            C.set_hyper(opt, t)
            C.accumulate(opt.params, grads)
            opt.step(do_adam=do_adam)
        _assert_same_state(main, laned, f"{mode}, step {t}")


def test_a_step_that_stops_in_a_lane_leaves_no_reduce_pending():
    # With the banks before Adam, an update that raises stops the step after the replicated reduce was
    # launched and before its update: the next step must start anew, not find that reduce pending.
    from anvil_fast.core.bank import anvil_bank_update
    from anvil_fast.optim.lanes import Lane

    opt = _opt(lanes=1)
    opt.bank_lanes = [Lane(None, ["mlp_bank"]), Lane(None, ["vo_bank", "qk_bank"])]
    real = functools.partial(anvil_bank_update, compile=False)
    failed = []

    def once(bank):
        if not failed:
            failed.append(bank.label)
            raise RuntimeError("a bank update failed")
        real(bank)

    opt.bank_update = once
    C.accumulate(opt.params, {l: g for l, g in C.gradients(0).items() if l in C.DENSE})
    with pytest.raises(RuntimeError, match="a bank update failed"):
        opt.step(do_adam=True)
    assert failed == ["mlp_bank"] and not opt.replicated._handles
    opt.step(do_adam=True)  # the gradients are still there: the step runs whole
    assert all(p.grad is None for p in opt.params.values())
