"""anvil_fast.optim.graphs: bank updates as CUDA graphs, and the check that baked addresses are live.

On CPU: the address bookkeeping (what a capture bakes; a rebound parameter or state tensor is
detected and named). On a GPU (gpu marker): capture changes nothing, replays equal the eager
updates bit for bit over several steps, and a rebound parameter stops the replay with an error."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.optim.graphs import (BankUpdateGraphs, GraphUnsupported, StaleGraphError, baked_addresses,
                               capture_unsupported_reason, check_addresses, step_tensors)
from anvil_ref.config import ConfigError
from anvil_fast.optim.optimizer import AnvilAndAdam
from tests import optimizer_cases as C


def _opt(device="cpu", seed=0):
    import functools

    from anvil_fast.core.bank import anvil_bank_update

    # compile=False: graphs of the eager update (Triton kernels + torch ops); the compiled update's
    # capture runs in the optimizer benchmark and the scaling measurements
    return AnvilAndAdam(C.make_params(seed, device=device), C.TABLE, C.SCATTER, C.WORK, bank_config="faithful",
                        bank_update=functools.partial(anvil_bank_update, compile=False))


def test_baked_addresses_detect_rebinding():
    opt = _opt()
    baked = {l: baked_addresses(opt, l) for l in opt.bank_labels}
    assert {"bank.grad", "bank.eff_lr", "live.p_slice", "live.velocity", "workspace.X"} <= set(baked["qk_bank"])
    for l in opt.bank_labels:
        check_addresses(opt, l, baked[l])
    C.accumulate(opt.params, {l: g for l, g in C.gradients(0).items() if l in C.DENSE})
    opt.step(do_adam=True)
    opt.load_state_dict(opt.state_dict())  # in place: still the same memory
    for l in opt.bank_labels:
        check_addresses(opt, l, baked[l])
    opt.params["vo_bank"].data = opt.params["vo_bank"].data.clone()  # e.g. model.to() or assign=True
    with pytest.raises(StaleGraphError, match="bank 'vo_bank'.*live.p_slice"):
        check_addresses(opt, "vo_bank", baked["vo_bank"])
    opt.param_states["mlp_bank"]["velocity"] = opt.param_states["mlp_bank"]["velocity"].clone()
    with pytest.raises(StaleGraphError, match="mlp_bank.*live.velocity"):
        check_addresses(opt, "mlp_bank", baked["mlp_bank"])


def test_graphs_need_cuda():
    with pytest.raises(RuntimeError, match="CUDA graphs need"):
        BankUpdateGraphs(_opt())


@pytest.mark.gpu
def test_replays_equal_eager_updates_bitwise():
    eager, graphed = _opt("cuda"), _opt("cuda")
    before = {l: v.clone() for l, v in graphed.param_states["qk_bank"].items() if isinstance(v, torch.Tensor)}
    graphs = graphed.use_cuda_graphs()
    for k, v in before.items():  # capture (with its warm-up runs) changed nothing
        assert torch.equal(graphed.param_states["qk_bank"][k], v)
    for t in range(4):
        for opt in (eager, graphed):
            C.set_hyper(opt, t)
            C.accumulate(opt.params, {l: g for l, g in C.gradients(t, device="cuda").items() if l in C.DENSE})
            opt.step(do_adam=t % 2 == 1)
    for l in eager.labels:
        assert torch.equal(eager.params[l].data, graphed.params[l].data), l
    graphs.check_all()
    graphed.params["qk_bank"].data = graphed.params["qk_bank"].data.clone()
    C.accumulate(graphed.params, {l: g for l, g in C.gradients(9, device="cuda").items() if l in C.DENSE})
    with pytest.raises(StaleGraphError, match="qk_bank"):
        graphed.step(do_adam=False)


# ------------------------------------------------------------------ the step from persistent buffers
# A schedule with plan changes (vo_bank has no gradient at step 2, gates none at steps 1-2, so none
# on the Adam step 2; lm_head none at steps 3-4) and Adam-free steps (1 and 3; the Adam gradients
# of those steps are kept and accumulate as backward() would).
SCHEDULE = [(True, set()), (False, {"gates"}), (True, {"vo_bank", "gates"}), (False, {"lm_head"}),
            (True, {"lm_head"})]


def _fp32_banks(params):
    """The same model with its banks as float32 masters (the drop-in's layout for fp32 models)."""
    for _, p in params:
        if p.label in C.RESHAPES:
            p.data = p.data.float()
    return params


def _twins(device, fp32_banks):
    import functools

    from anvil_fast.core.bank import anvil_bank_update

    def make():
        params = C.make_params(0, device=device)
        if fp32_banks:
            params = _fp32_banks(params)
        return AnvilAndAdam(params, C.TABLE, C.SCATTER, C.WORK, bank_config="faithful", allow_fp32_banks=fp32_banks,
                            bank_update=functools.partial(anvil_bank_update, compile=False))
    return make(), make()


def _run_schedule(eager, buffered, device, *, steps=SCHEDULE, graphed=False) -> list[tuple]:
    """Step both twins through ``steps`` and compare them after each; returns each step's plan as
    the test sees it: (do_adam, the labels whose gradient the step reads). Adam gradients of a
    step without Adam stay and accumulate into the next one, so two schedule entries can share a
    plan."""
    bufs = buffered.grad_buffers()
    plans = []
    for t, (do_adam, dropped) in enumerate(steps):
        for opt in (eager, buffered):
            C.set_hyper(opt, t)
        C.accumulate(eager.params, {l: g for l, g in C.gradients(t, device=device).items()
                                    if l in C.DENSE and l not in dropped})
        read = [l for l in eager.labels if eager.params[l].grad is not None
                and (do_adam or eager.param_cfgs[l].optim == "anvil")]
        plans.append((do_adam, tuple(read)))
        for l in read:  # what the eager step reads, copied (with the bank cast) into the buffers
            bufs[l].copy_(eager.params[l].grad)
        eager.step(do_adam=do_adam)
        buffered.step_from_buffers(read, do_adam=do_adam)
        _assert_same_state(eager, buffered, f"step {t}")
        assert all(p.grad is None for p in buffered.params.values()), "step_from_buffers never writes .grad"
    return plans


def _assert_same_state(a, b, where):
    for l in a.labels:
        assert torch.equal(a.params[l].data.view(torch.int16 if a.params[l].element_size() == 2 else torch.int32),
                           b.params[l].data.view(torch.int16 if b.params[l].element_size() == 2 else torch.int32)), \
            f"{where}: {l}"
        for k, v in a.param_states[l].items():
            w = b.param_states[l][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w) or (v.dtype.is_floating_point and torch.equal(v.view(torch.int32), w.view(torch.int32))), \
                    f"{where}: {l}.{k}"
            else:
                assert v == w, f"{where}: {l}.{k} {v} != {w}"


@pytest.mark.parametrize("fp32_banks", [False, True], ids=["bf16_banks", "fp32_banks"])
def test_step_from_buffers_equals_step_bitwise(fp32_banks):
    eager, buffered = _twins("cpu", fp32_banks)
    _run_schedule(eager, buffered, "cpu")
    # the schedule really exercised what it claims: Adam steps without some gradients
    assert eager.param_states["scalars"]["step"] == 3
    assert eager.param_states["gates"]["step"] == 2 and eager.param_states["lm_head"]["step"] == 2


def test_grad_buffers_are_persistent_and_bank_buffers_are_the_banks_own():
    opt, _ = _twins("cpu", True)
    a, b = opt.grad_buffers(), opt.grad_buffers()
    assert set(a) == set(opt.labels) and all(a[l] is b[l] for l in a)
    for l in opt.bank_labels:  # one process: the copy into the buffer is the only pass (and the cast)
        assert a[l].dtype == torch.bfloat16 and a[l].data_ptr() == opt.banks[l].grad.data_ptr()
        assert tuple(a[l].shape) == tuple(opt.params[l].shape)
    flat = {g.dtype: g.grad for g in opt.replicated.groups}
    for l in opt.replicated_labels:
        g = flat[opt.params[l].dtype]
        assert g.data_ptr() <= a[l].data_ptr() < g.data_ptr() + g.numel() * g.element_size()


def test_step_from_buffers_refuses_unknown_labels():
    opt, _ = _twins("cpu", False)
    with pytest.raises(ConfigError, match="unknown labels \\['nope'\\]"):
        opt.step_from_buffers(["qk_bank", "nope"])


def test_step_capture_needs_cuda_with_reason():
    opt, _ = _twins("cpu", False)
    with pytest.raises(GraphUnsupported, match="CUDA graphs need the optimizer's tensors on a CUDA device, got cpu"):
        opt.capture_step()
    assert capture_unsupported_reason(opt) is not None


def test_capture_refuses_gloo():
    opt, _ = _twins("cpu", False)
    opt.device, opt.world_size = torch.device("cuda", 0), 2  # what capture_unsupported_reason reads

    class Gloo:
        backend = "gloo"
    opt.comms = Gloo()
    assert "'gloo'" in capture_unsupported_reason(opt) and "NCCL" in capture_unsupported_reason(opt)


def test_step_tensors_cover_everything_a_step_writes():
    """Saving and restoring step_tensors() must undo a step: run one, restore, compare."""
    opt, twin = _twins("cpu", True)
    bufs = opt.grad_buffers()
    twin.grad_buffers()
    saved = {k: t.clone() for k, t in step_tensors(opt).items()}
    C.set_hyper(opt, 0)
    for l, g in C.gradients(0).items():
        if l in C.DENSE:
            bufs[l].copy_(g)
    steps = {l: st.get("step") for l, st in opt.param_states.items()}
    opt.step_from_buffers([l for l in opt.labels if l in C.DENSE])
    for k, t in step_tensors(opt).items():
        t.copy_(saved[k])
    for l, s in steps.items():  # host state is the caller's business (StepGraph never runs prepare twice)
        if s is not None:
            opt.param_states[l]["step"] = s
    _assert_same_state(twin, opt, "restored")


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_banks", [False, True], ids=["bf16_banks", "fp32_banks"])
def test_step_graph_replays_equal_eager_steps_bitwise(fp32_banks):
    eager, graphed = _twins("cuda", fp32_banks)
    sg = graphed.capture_step(max_plans=len(SCHEDULE) + 3)  # room for every plan and the beta2 change
    # changing lr/momentum/rails every step (through the pinned scalar buffer), a plan change and
    # Adam-free steps; then the first plan again (replayed, not recaptured)
    steps = SCHEDULE + [(True, set()), (False, set())]
    n_plans = len(set(_run_schedule(eager, graphed, "cuda", steps=steps)))
    assert 3 <= n_plans < len(steps)
    assert sg.captures == n_plans and sg.replays == len(steps) and sg.eager_steps == 0
    # the equalizer's decay is baked into the kernels: a change is a new capture, not a stale replay
    for opt in (eager, graphed):
        for bank in opt.banks.values():
            bank.beta2 = 0.8
    _run_schedule(eager, graphed, "cuda", steps=[(True, set())])
    assert sg.captures == n_plans + 1
    # a rebound parameter stops the replay before anything is written
    bufs = graphed.grad_buffers()
    before = graphed.param_states["qk_bank"]["velocity"].clone()
    graphed.params["qk_bank"].data = graphed.params["qk_bank"].data.clone()
    with pytest.raises(StaleGraphError, match="param.qk_bank"):
        graphed.step_from_buffers([l for l in graphed.labels if l in C.DENSE])
    assert torch.equal(graphed.param_states["qk_bank"]["velocity"], before)
    assert graphed.param_states["scalars"]["step"] == eager.param_states["scalars"]["step"]
    del bufs


@pytest.mark.gpu
def test_step_graph_falls_back_to_eager_past_max_plans():
    eager, graphed = _twins("cuda", False)
    sg = graphed.capture_step(max_plans=1)
    _run_schedule(eager, graphed, "cuda")
    # only step 0's plan (Adam, every gradient) was captured; the four other plans ran eagerly
    assert sg.captures == 1 and sg.replays == 1 and sg.eager_steps == 4


def test_a_step_from_buffers_is_prepare_then_run_over_one_set_of_buffers():
    """grad_buffers() is one read-only mapping (no copy per call); prepare_from_buffers runs the
    checks, then a step graph's address check before the first write (the scalar upload), then
    names the graph's key; run_prepared hands that key to the graph's run, without a GPU."""
    opt, _ = _twins("cpu", True)
    a, b = opt.grad_buffers(), opt.grad_buffers()
    assert all(a[l] is b[l] is opt.built_grad_buffers[l] for l in opt.labels)
    with pytest.raises(TypeError):
        a["gates"] = torch.zeros(1)
    calls = []

    class Graph:
        def before_write(self, plan):
            calls.append("before_write")

        def key(self, plan):
            calls.append("key")
            return "K"

        def run(self, plan, key, grads):
            calls.append(("run", key, sorted(grads)))
            return {}

    stage = opt.stage_bank_scalars
    opt.stage_bank_scalars = lambda *args, **kw: (calls.append("stage"), stage(*args, **kw))[1]
    opt.step_graph = Graph()
    prepared = opt.prepare_from_buffers(opt.labels)
    assert calls == ["before_write", "stage", "key"] and prepared.key == "K"
    assert all(prepared.grads[l] is a[l] for l in prepared.grads)
    opt.run_prepared(prepared)
    assert calls[-1] == ("run", "K", sorted(opt.labels))


def test_step_graph_address_check_names_rebound_tensors():
    """The StepGraph's check before replay, without a GPU: bookkeeping of a captured plan."""
    from anvil_fast.optim.graphs import StepGraph, step_addresses

    opt, _ = _twins("cpu", True)
    opt.grad_buffers()
    plan = opt.plan_of({l: opt.grad_buffers()[l] for l in opt.labels}, True)
    sg = StepGraph.__new__(StepGraph)  # what __init__ + a capture record (capture itself needs CUDA)
    sg.opt, sg.baked, sg._signatures = opt, {plan: step_addresses(opt)}, {}
    sg._signatures[plan] = sg._signature()
    sg.check_plan(plan)
    opt.load_state_dict(opt.state_dict())  # in place: nothing rebound
    sg.check_plan(plan)
    sg.check_plan("a key never captured")  # nothing baked, nothing to check
    opt.params["gates"].data = opt.params["gates"].data.clone()  # leaves the flat buffer
    with pytest.raises(StaleGraphError, match="param.gates"):
        sg.check_plan(plan)
    opt.params["gates"].data = opt.replicated.groups[1].param[opt.replicated.groups[1].spans[0]].view(3, 4)
    sg.check_plan(plan)
    opt.param_states["mlp_bank"]["velocity"] = opt.param_states["mlp_bank"]["velocity"].clone()
    with pytest.raises(StaleGraphError, match="state.mlp_bank.velocity"):
        sg.check_plan(plan)


def test_fp32_split_join_are_the_bit_halves():
    """split_fp32_/join_fp32_ against anvil_fast.kernels.update's shift-and-mask definition, on bit
    patterns covering signs, zeros, subnormals, infinities and NaN payloads."""
    from anvil_fast.kernels.update import join_fp32, join_fp32_, split_fp32, split_fp32_

    g = torch.Generator().manual_seed(5)
    raw = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 7, 5), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0, -2 ** 31, 1, 0x7F800000, -8388608, 0x7FC00001, 0x0000FFFF, -1, 0x7F7FFFFF],
                           dtype=torch.int32)
    raw.view(-1)[:special.numel()] = special
    master = raw.view(torch.float32)
    hi = torch.empty(master.shape, dtype=torch.bfloat16)
    lo = torch.empty(master.shape, dtype=torch.uint16)
    split_fp32_(master, hi, lo)
    want_hi, want_lo = split_fp32(master)
    assert torch.equal(hi.view(torch.int16), want_hi) and torch.equal(lo.view(torch.int16), want_lo)
    back = torch.empty_like(master)
    join_fp32_(hi, lo, back)
    assert torch.equal(back.view(torch.int32), raw)
    assert torch.equal(join_fp32(want_hi, want_lo).view(torch.int32), raw)


def test_nonfinite_labels_on_buffers():
    """NaN, +inf and -inf anywhere in a gradient are found, in bf16 bank buffers and fp32/bf16 Adam
    buffers alike; finite gradients (including the largest finite values, alone) are not."""
    opt, _ = _twins("cpu", True)
    bufs = opt.grad_buffers()
    for l, g in C.gradients(0).items():
        bufs[l].copy_(g)
    grads = {l: bufs[l] for l in opt.labels}
    assert opt.nonfinite_labels(grads) == []
    bufs["gates"].view(-1)[0] = torch.finfo(torch.bfloat16).max
    bufs["scalars"].view(-1)[-1] = -torch.finfo(torch.float32).max
    assert opt.nonfinite_labels(grads) == []
    bufs["mlp_bank"].view(-1)[17] = float("nan")
    bufs["gates"].view(-1)[5] = float("-inf")
    bufs["lm_head"].view(-1)[-1] = float("inf")
    assert opt.nonfinite_labels(grads) == ["mlp_bank", "gates", "lm_head"]
    assert opt.nonfinite_labels({l: grads[l] for l in ("qk_bank", "gates")}) == ["gates"]
    assert opt.nonfinite_labels({}) == []


@pytest.mark.gpu
def test_failed_capture_restores_state_and_steps_eagerly():
    eager, graphed = _twins("cuda", True)
    real = graphed.bank_update

    def syncing(bank):  # a host read inside the update: not capturable
        float(bank.grad.float().sum())
        real(bank)
    graphed.bank_update = syncing
    sg = graphed.capture_step(strict=False)
    torch.cuda.manual_seed(11)
    expected = torch.randn(64, device="cuda")  # the user's random stream, with no capture tried
    torch.cuda.manual_seed(11)
    with pytest.warns(RuntimeWarning, match="capturing the step failed"):
        _run_schedule(eager, graphed, "cuda")
    assert sg.captures == 0 and sg.eager_steps == len(SCHEDULE) and "failed" in sg.off_reason
    # a failed capture leaves the device's generator usable, where it was
    assert torch.equal(torch.randn(64, device="cuda"), expected)


def test_dropin_refuses_a_broadcastable_gradient_before_writing():
    """The drop-in copies gradients into the persistent buffers with copy_, which would broadcast a
    [1, n] gradient over an [m, n] parameter: it is refused, naming the parameter, nothing written."""
    from anvil_fast.optim.entry import ANVIL
    from anvil_fast.models.gpt import GPTConfig, build

    m = build(GPTConfig(n_layer=1, n_embd=16, n_head=2, ctx=8), seed=0)
    opt = ANVIL(m, bank_config="faithful", compile=False)
    g = torch.Generator().manual_seed(3)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for bad_name, bad in (("wte.weight", torch.ones(1, 16)), ("blocks.0.mlp.fc.weight", torch.ones(1, 16)),
                          ("ln_f.weight", torch.ones(16, dtype=torch.float64))):
        p = dict(m.named_parameters())[bad_name]
        good = p.grad.data
        p.grad.data = bad  # torch refuses p.grad = bad; .grad.data slips through
        with pytest.raises(ValueError, match=f"{bad_name}: gradient .* does not match"):
            opt.step()
        p.grad.data = good
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    opt.step()
    assert not torch.equal(before["blocks.0.mlp.fc.weight"], m.blocks[0].mlp.fc.weight)
