"""anvil_fast.optim.device_step: the drop-in's one-process step decided on the device, and its kernels
(anvil_fast.kernels.nonfinite's check, anvil_fast.kernels.adam's table kernel).

Each test holds the device-decided step against something it does not compute itself: the host's
float64 formulas of the scalars (anvil_fast.kernels.bank_scalars / anvil_fast.kernels.adam.adam_row), the other
way of reading the gradients (in place vs through the buffers), anvil_ref.storage's rounding spec
of the lean rails, a twin that never saw a refused step, and torch's own isfinite."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import anvil_fast
from anvil_fast.models import gpt
import anvil_ref.storage as S
from anvil_fast.kernels.adam import adam_block_table, adam_row, adam_table_, adam_update_
from anvil_fast.kernels.bank_scalars import ADAM_COLUMNS, BankScalarStaging
from anvil_fast.optim.device_step import NonFiniteUpdateError, NonFiniteUpdateWarning
from anvil_fast.optim.dropin import NonFiniteGradientWarning
from anvil_fast.optim.entry import ANVIL
from anvil_fast.kernels.nonfinite import AddressCheck, BufferCheck, check_addresses, check_buffers
from anvil_fast.optim.optimizer import NonFiniteGradientError
from anvil_ref.rails import rail_scalars

from tests.helpers import cuda_block_bound
from tests.test_dropin import TinyLM


def _bits(t):
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().reshape(-1).view(ints)


def _fixed_grads(model, seed, *, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype)


# ----------------------------------------------------------------------------------------------- the scalars
@pytest.mark.parametrize("rails", ["nesterov", "record"])
def test_device_scalars_are_the_host_formulas(rails):
    """After a step, the staging buffer the kernels read holds exactly what the host's float64
    formulas give for the same hyper-parameters and step counts (AnvilAndAdam._bank_fields and
    anvil_fast.kernels.adam.adam_row, packed by BankScalarStaging)."""
    torch.manual_seed(0)
    m = TinyLM()
    kw = {"rails": "record", "total_steps": 9} if rails == "record" else {"momentum": 0.9, "fast_weight": 0.4}
    opt = ANVIL(m, lr=0.0173, adam_lr=0.0031, weight_decay=1.7, adam_weight_decay=0.013, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.37 * s))
    m.gain.requires_grad_(True)
    for step in range(3):
        _fixed_grads(m, step)
        if step == 2:
            m.gain.grad = None  # an Adam row without a gradient: inactive
        opt.step()
        sched.step()
    inner = opt.inner
    got = inner.staging.buffer.clone()
    # the host's computation, for the values the last step used
    host = BankScalarStaging([inner.param_cfgs[l].chunk_size for l in inner.bank_labels], "cpu",
                             adam_rows=len(inner.adam_labels))
    g_anvil, g_adam = opt.param_groups
    lr = g_anvil["lr"]  # the scheduler moved it after the step: undo one factor
    lr_used = 0.0173 / (1 + 0.37 * 2)
    assert lr != lr_used
    if rails == "record":
        mom, fb, fw = rail_scalars(2, 9)
    else:
        mom, fb, fw = 0.9, 0.9, 0.4
    fields, lrs = [], []
    for l in inner.bank_labels:
        cfg = inner.param_cfgs[l]
        fields.append((mom, cfg.wd_mul * 1.7 * lr_used, fb, fw))
        lrs.append([cfg.lr_mul * mm * lr_used for mm in cfg.per_matrix_lr_mul])
    table = np.zeros((len(inner.adam_labels), len(ADAM_COLUMNS)))
    alr = 0.0031 / (1 + 0.37 * 2)
    for l in inner.adam_labels:
        cfg = inner.param_cfgs[l]
        active = not (l == "gain")
        table[inner.adam_row[l]] = adam_row(lr=alr * cfg.lr_mul, beta1=0.9, beta2=0.95, eps=1e-10,
                                            weight_decay=0.013, wd_mul=cfg.wd_mul, step=3, active=active)
    want = torch.from_numpy(host.pack(fields, lrs, table))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert int(opt.state[m.gain]["step"]) == 2 and int(opt.state[m.lm_head.weight]["step"]) == 3


def _count_sends(eng) -> list:
    """A list that grows by one each time ``eng.upload()`` writes the inbox into a pinned slot."""
    sent = []

    class Slot:  # the pinned slots' host view, counting what upload() writes through it
        def __init__(self, a):
            self.a = a

        def __setitem__(self, k, v):
            sent.append(1)
            self.a[k] = v

    eng._slot_np = [Slot(a) for a in eng._slot_np]
    return sent


def test_the_inbox_is_sent_when_its_bytes_change_and_only_then():
    """A step whose hyper-parameters and gradient state equal the last step's issues no copy of the
    inbox (the device holds those bytes); a changed lr or a parameter without gradient is sent before
    the step that uses it."""
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, lr=0.02, momentum=0.9)
    eng = opt.engine
    hyper = list(anvil_fast.optim.device_step.HYPER)
    sent = _count_sends(eng)
    for step in range(2):
        _fixed_grads(m, step)
        opt.step()
    assert len(sent) == 1  # the first step's inbox; the second's was the same
    _fixed_grads(m, 2)
    opt.step()
    assert len(sent) == 1
    assert torch.equal(eng.inbox, torch.from_numpy(eng._inbox_np))
    opt.param_groups[0]["lr"] = 0.013
    _fixed_grads(m, 3)
    opt.step()
    assert len(sent) == 2 and float(eng.hyper[hyper.index("lr")]) == 0.013
    _fixed_grads(m, 4)
    m.gain.grad = None
    opt.step()
    assert len(sent) == 3 and torch.equal(eng.inbox, torch.from_numpy(eng._inbox_np))


def test_record_rails_move_the_groups_every_step_and_send_no_inbox():
    """rails='record': the device reads the rails from its table at its own count, so the steps whose
    groups changed only in the rails (every step of the schedule's warm-up) send no inbox and hand
    nothing over but the rails; the groups and the inner optimizer still show the step's rails, a
    changed lr is still sent, and the run's weights are those of a twin that hands everything over
    at every step."""
    from anvil_ref.rails import rail_scalars

    def run(rails_on_device: bool):
        torch.manual_seed(0)
        m = TinyLM()
        opt = ANVIL(m, lr=0.02, rails="record", total_steps=6)
        eng = opt.engine
        sent = _count_sends(eng)
        if not rails_on_device:  # the twin: every step's groups handed over in full
            real = opt._apply_groups
            opt._apply_groups = lambda taken, every_step, rails_on_device=False: real(taken, every_step=every_step)
        for step in range(5):
            _fixed_grads(m, step)
            if step == 3:
                opt.param_groups[0]["lr"] = 0.013
            opt.step()
            want = rail_scalars(step, 6)
            g = opt.param_groups[0]
            assert (g["momentum"], g["fast_beta"], g["fast_weight"]) == tuple(want)
            assert opt.inner.param_cfgs[next(iter(opt.inner.banks))].momentum == want.momentum
        return [p.detach().clone() for p in m.parameters()], len(sent)

    lean, n_lean = run(True)
    full, n_full = run(False)
    assert n_lean == 2  # the first step's inbox and the new lr's
    assert n_full == 5 and all(torch.equal(a, b) for a, b in zip(lean, full))


# ----------------------------------------------------------------------------------------------- semantics
def test_a_step_without_any_gradient_runs_and_counts_nothing():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, rails="record", total_steps=2)
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()  # every .grad is None
    assert opt.taken_steps == 0 and opt.skipped_steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    for s in range(2):
        _fixed_grads(m, s)
        opt.step()
    assert opt.taken_steps == 2
    _fixed_grads(m, 5)
    with pytest.raises(ValueError, match="total_steps=2"):
        opt.step()


def _explosive(model):
    """Gradients whose FAITHFUL cascade overflows: finite in bf16, but their Gram is not."""
    _fixed_grads(model, 0)
    model.blocks[0].q.weight.grad.fill_(3.0e38)


def test_faithful_nonfinite_update_is_refused_and_named():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, bank_config="faithful")
    label = next(l for l, names in opt.banks.items() if "blocks.0.q.weight" in names)
    w_q = m.blocks[0].q.weight.detach().clone()
    _explosive(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    msgs = [str(w.message) for w in caught if issubclass(w.category, NonFiniteUpdateWarning)]
    assert len(msgs) == 1 and label in msgs[0] and "faithful" in msgs[0], msgs
    # the count per bank: the one refused matrix in its bank, none elsewhere
    assert opt.refused_updates == {l: int(l == label) for l in opt.banks}, opt.refused_updates
    # the update was not applied: the guard's zero update leaves the sign-aligned decay alone
    bank = opt.inner.banks[label]
    decay = float(bank.eff_wd) * float(bank.eff_lr.max())
    assert torch.all((m.blocks[0].q.weight - w_q).abs() <= w_q.abs() * (decay + 2 ** -23))  # + one fp32 rounding
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert all(torch.isfinite(v).all() for st in opt.inner.param_states.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    # a count of the run so far: the rails took the huge gradient, so the next step's FAITHFUL cascade
    # overflows on the same matrix again and the count goes to 2
    _fixed_grads(m, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteUpdateWarning)
        opt.step()
    assert opt.refused_updates == {l: 2 * int(l == label) for l in opt.banks}, opt.refused_updates


def test_faithful_nonfinite_update_raises_with_nonfinite_raise():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, bank_config="faithful", nonfinite="raise")
    _explosive(m)
    with pytest.raises(NonFiniteUpdateError, match="faithful"):
        opt.step()
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_safe_takes_the_same_gradients_without_a_refusal():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m)  # SAFE: the prescale keeps the Gram finite
    _explosive(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteUpdateWarning)
        opt.step()
        assert opt.refused_updates == dict.fromkeys(opt.banks, 0)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_lean_rails_are_bf16_rounded_as_specified():
    """rails_dtype=bf16: the rails are stored in bf16, each update rounded by
    anvil_ref.storage.stochastic_round_bf16 with the step's bits (first step: rail step 1)."""
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, rails_dtype=torch.bfloat16, momentum=0.9, fast_beta=0.8)
    w = m.blocks[1].fc1.weight
    st = opt.state[w]
    assert st["fast_rail"].dtype == torch.bfloat16 and st["slow_rail"].dtype == torch.bfloat16
    _fixed_grads(m, 3)
    g = w.grad.detach().clone()
    opt.step()
    label = next(l for l, names in opt.banks.items() if "blocks.1.fc1.weight" in names)
    first = [f for n, _, f, _ in next(b for b in opt.matrix_banks if b.label == label).plan.members
             if n == "blocks.1.fc1.weight"][0]
    gb = g.bfloat16().float()
    fast = torch.lerp(torch.zeros_like(gb), gb, torch.tensor(1 - 0.8))  # from zero rails
    slow = torch.lerp(torch.zeros_like(gb), gb, torch.tensor(1 - 0.98))
    idx = first * w.numel() + np.arange(w.numel()).reshape(w.shape)
    for rail, v, salt in (("fast_rail", fast, 0), ("slow_rail", slow, 1)):
        want = S.stochastic_round_bf16(v.numpy(), step=1, salt=salt, index=idx)
        assert np.array_equal(st[rail].float().numpy(), want), rail
    # unbiased: the stored rails stay within one bf16 ulp of the fp32 ones
    assert torch.all((st["slow_rail"].float() - slow).abs() <= slow.abs() * 2 ** -7 + 1e-45)


def test_lean_rails_state_dict_round_trip_continues_bitwise():
    import io

    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, rails_dtype=torch.bfloat16)
    for s in range(2):
        _fixed_grads(m, s)
        opt.step()
    buf = io.BytesIO()
    torch.save({"m": m.state_dict(), "o": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    m2 = TinyLM()
    opt2 = ANVIL(m2, rails_dtype=torch.bfloat16)
    m2.load_state_dict(ck["m"])
    opt2.load_state_dict(ck["o"])
    for mm, oo in ((m, opt), (m2, opt2)):
        for s in range(2, 4):
            _fixed_grads(mm, s)
            oo.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(_bits(a), _bits(b))


# ----------------------------------------------------------------------------------------------- the two reads
def _run(model, opt, steps, *, nan_at=None, idle=None):
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            _fixed_grads(model, s)
            if s == nan_at:
                model.blocks[0].fc1.weight.grad[1, 2] = float("nan")
            if idle is not None and s >= 1:
                dict(model.named_parameters())[idle].grad = None
            opt.step()
        out.append(opt.skipped_steps)
    return [w for w in caught if issubclass(w.category, NonFiniteGradientWarning)], out


@pytest.mark.parametrize("lean", [False, True], ids=["fp32_rails", "bf16_rails"])
def test_in_place_read_equals_the_buffers_read(triton_dev, lean):
    """The address-table read (Triton: the check, the rails, Adam in one launch) against the copy
    into the banks' buffers: every bank's weights and state bit for bit, with a NaN step, a member
    without a gradient and a scheduler on the way; Adam within the fp32 kernels' ulps (the CPU
    buffers path runs torch's arithmetic, the interpreter Triton's)."""
    torch.manual_seed(0)
    a = TinyLM().to(triton_dev)
    b = copy.deepcopy(a)
    kw = dict(lr=0.02, rails_dtype=torch.bfloat16 if lean else torch.float32, cuda_graphs=False)
    oa, ob = ANVIL(a, grad_read="in_place", **kw), ANVIL(b, grad_read="buffers", **kw)
    wa, _ = _run(a, oa, 5, nan_at=2, idle="blocks.1.q.weight")
    wb, _ = _run(b, ob, 5, nan_at=2, idle="blocks.1.q.weight")
    assert len(wa) == len(wb) == 1 and "blocks.0.fc1.weight" in str(wa[0].message)
    assert oa.taken_steps == ob.taken_steps == 4 and oa.skipped_steps == ob.skipped_steps == 1
    for label in oa.inner.bank_labels:
        for k, v in oa.inner.param_states[label].items():
            assert torch.equal(_bits(v), _bits(ob.inner.param_states[label][k])), (label, k)
        assert torch.equal(_bits(oa.inner.params[label]), _bits(ob.inner.params[label])), label
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=2 ** -20, atol=1e-9, msg=n)


def test_in_place_read_leaves_a_member_without_gradient_untouched(triton_dev):
    torch.manual_seed(0)
    m = TinyLM().to(triton_dev)
    opt = ANVIL(m, grad_read="in_place", cuda_graphs=False)
    _run(m, opt, 2)
    idle = m.blocks[1].q.weight
    label = next(l for l, names in opt.banks.items() if "blocks.1.q.weight" in names)
    keep = {k: v.clone() for k, v in opt.state[idle].items()}
    keep_w, keep_gain = idle.detach().clone(), m.gain.detach().clone()
    _fixed_grads(m, 9)
    idle.grad = None
    m.gain.grad = None
    opt.step()
    assert torch.equal(_bits(idle), _bits(keep_w)) and torch.equal(m.gain, keep_gain)
    for k, v in opt.state[idle].items():
        assert torch.equal(_bits(v), _bits(keep[k])), k
    assert opt.state[m.blocks[0].q.weight]["fast_rail"].abs().sum() > 0  # the members with a gradient moved
    assert label in opt.banks


def test_in_place_read_refuses_a_strided_gradient(triton_dev):
    torch.manual_seed(0)
    m = TinyLM().to(triton_dev)
    opt = ANVIL(m, grad_read="in_place", cuda_graphs=False)
    _fixed_grads(m, 0)
    w = m.blocks[0].fc1.weight
    w.grad = torch.randn(w.shape[::-1], device=triton_dev).t()  # the right shape, transposed strides
    before = w.detach().clone()
    with pytest.raises(ValueError, match="blocks.0.fc1.weight.*contiguous"):
        opt.step()
    assert torch.equal(w, before)
    with pytest.raises(ValueError, match="grad_read"):
        ANVIL(TinyLM(), grad_read="copy")


def test_nan_step_twin_on_the_in_place_read(triton_dev):
    """A step with a NaN leaves everything as a twin that never saw it."""
    torch.manual_seed(0)
    a = TinyLM().to(triton_dev)
    b = copy.deepcopy(a)
    oa = ANVIL(a, grad_read="in_place", cuda_graphs=False, rails="record", total_steps=6)
    ob = ANVIL(b, grad_read="in_place", cuda_graphs=False, rails="record", total_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        for s in range(5):
            _fixed_grads(a, s)
            if s == 3:
                a.lm_head.weight.grad[0, 0] = float("inf")
            oa.step()
            if s != 3:
                _fixed_grads(b, s)
                ob.step()
    assert oa.skipped_steps == 1 and ob.skipped_steps == 0 and oa.taken_steps == ob.taken_steps == 4
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(p), _bits(q))
    for p, q in zip(a.parameters(), b.parameters()):
        for k, v in oa.state[p].items():
            assert torch.equal(_bits(v), _bits(ob.state[q][k])), k
    assert oa.inner.rail_step.item() == ob.inner.rail_step.item()


def test_nonfinite_raise_on_the_in_place_read_writes_nothing(triton_dev):
    torch.manual_seed(0)
    m = TinyLM().to(triton_dev)
    opt = ANVIL(m, grad_read="in_place", cuda_graphs=False, nonfinite="raise")
    _run(m, opt, 1)
    before = [p.detach().clone() for p in m.parameters()]
    _fixed_grads(m, 4)
    m.blocks[1].fc2.weight.grad[0, 1] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="blocks.1.fc2.weight"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


# ----------------------------------------------------------------------------------------------- kernels
def test_check_flags_exactly_the_nonfinite_gradients(triton_dev):
    """anvil_fast.kernels.nonfinite against torch.isfinite of the gradients as the step reads them (a bank's
    fp32 gradient in bf16: 3.3962e38 is finite in fp32 and inf in bf16)."""
    dev = triton_dev
    g = torch.Generator().manual_seed(0)
    vals = [torch.randn(5000, generator=g) for _ in range(6)]
    vals[1][4097] = float("nan")
    vals[2][7] = float("-inf")
    vals[3][10] = 3.3962e38   # rounds to inf in bf16
    vals[4][10] = 3.0e38      # finite in bf16 too
    ts = [v.to(dev) for v in vals]
    for cast in (True, False):
        flags = torch.zeros(6, dtype=torch.int32, device=dev)
        chk = AddressCheck([t.numel() for t in ts], list(range(6)), dev, dtype=torch.float32, cast_bf16=cast)
        addr = torch.tensor([t.data_ptr() for t in ts[:5]] + [0], dtype=torch.int64, device=dev)
        check_addresses(chk, addr, flags)
        read = [t.bfloat16().float() if cast else t for t in ts]
        want = [int(not torch.isfinite(r).all()) for r in read[:5]] + [0]  # address 0: not read
        assert flags.tolist() == want, (cast, flags.tolist())
    bf = [t.bfloat16() for t in ts]
    flags = torch.zeros(6, dtype=torch.int32, device=dev)
    check_buffers(BufferCheck(bf, dev), flags, mask=torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int32, device=dev))
    assert flags.tolist() == [0, 1, 1, 1, 0, 0]


def test_adam_table_kernel_is_the_per_parameter_kernel(triton_dev):
    dev = triton_dev
    g = torch.Generator().manual_seed(1)
    shapes = [(3000,), (17, 5), (1,)]
    rows = [2, 0, 1]
    table = torch.tensor([adam_row(lr=1e-3 * (r + 1), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, wd_mul=1.0,
                                   step=3) for r in range(3)], dtype=torch.float32, device=dev)
    table[1, 7] = 0.0  # an inactive row
    ps = [torch.randn(s, generator=g).to(dev) for s in shapes]
    gs = [torch.randn(s, generator=g).to(dev) for s in shapes]
    ms = [torch.randn(s, generator=g).to(dev) for s in shapes]
    vs = [torch.rand(s, generator=g).to(dev) for s in shapes]
    ref = [t.clone() for t in ps], [t.clone() for t in ms], [t.clone() for t in vs]
    for i in range(3):
        if i != 1:  # parameter 1 has no gradient: untouched
            adam_update_(ref[0][i], gs[i], ref[1][i], ref[2][i], table, rows[i], backend="triton")
    blocks, meta = adam_block_table([p.numel() for p in ps], rows, dev)
    addresses = torch.tensor([[p.data_ptr(), m.data_ptr(), v.data_ptr()] for p, m, v in zip(ps, ms, vs)],
                             dtype=torch.int64, device=dev)
    gaddr = torch.tensor([gs[0].data_ptr(), 0, gs[2].data_ptr()], dtype=torch.int64, device=dev)
    adam_table_(blocks, addresses, gaddr, meta, table, bf16=False)
    for got, want in zip((ps, ms, vs), ref):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("locked", [True, False], ids=["status_in_graph", "status_after_replay"])
def test_graphed_in_place_step_is_the_eager_step_and_one_replay(locked, monkeypatch):
    """On CUDA: the captured step (one replay, banks on side streams) equals the eager device part
    bit for bit over steps with a scheduler, a NaN step and a member without a gradient; the NaN
    warning arrives at a later step or when skipped_steps is read. Both ways of bringing the status
    to the host: copied by the graph into memory the driver locked, and (where it refuses) copied
    after each replay into torch's pinned memory."""
    from anvil_fast.optim import device_step

    if not locked:
        monkeypatch.setattr(device_step, "host_status_buffer", lambda n, device_index: None)
    torch.manual_seed(0)
    a = gpt.build("tiny").cuda()
    b = copy.deepcopy(a)
    oa, ob = ANVIL(a), ANVIL(b, cuda_graphs=False)
    assert oa.grad_read == "in_place" and oa.engine.use_graphs and len(oa.engine.lanes) > 1
    assert oa.engine._status_in_graph == ob.engine._status_in_graph == locked
    for opt in (oa, ob):
        opt._sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(8):
            for model, opt in ((a, oa), (b, ob)):
                _fixed_grads(model, s)
                if s == 3:
                    model.blocks[0].mlp.fc.weight.grad[0, 0] = float("nan")
                if s >= 5:
                    model.blocks[1].attn.qkv.weight.grad = None
                opt.step()
                opt._sched.step()
        assert oa.skipped_steps == ob.skipped_steps == 1
    assert sum(issubclass(w.category, NonFiniteGradientWarning) for w in caught) == 2
    assert oa.engine.captures == 1 and oa.engine.replays == 8
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(p), _bits(q))


def test_the_host_status_buffer_is_locked_once_and_unlocked_after_its_keeper_goes(monkeypatch):
    """host_status_buffer's bookkeeping with a stand-in for the CUDA runtime (the GPU test below has the
    driver): one page-aligned lock per buffer; a collected keeper's mapping waits, still locked, and the
    next buffer's making syncs the device and unlocks it; a refused lock gives None (the step then
    copies after each replay)."""
    import gc
    from types import SimpleNamespace

    from anvil_fast.optim import device_step

    calls = []
    runtime = SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: calls.append(("lock", ptr, size)) or 0,
                              cudaHostUnregister=lambda ptr: calls.append(("unlock", ptr)) or 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(device_step, "_RETIRED", [])
    host, keeper = device_step.host_status_buffer(3000, 1)
    ptr = host.data_ptr()
    assert host.numel() == 3000 and host.dtype == torch.int32 and host.tolist() == [0] * 3000
    assert calls == [("lock", ptr, 3 * 4096)] and ptr % 4096 == 0
    host[:] = 7  # (the memory is the process's own)
    del host, keeper
    gc.collect()
    assert [r[:2] for r in device_step._RETIRED] == [(1, ptr)] and calls[-1][0] == "lock"
    other, _keeper = device_step.host_status_buffer(1, 1)
    assert calls[1:] == [("sync", 1), ("unlock", ptr), ("lock", other.data_ptr(), 4096)]
    assert device_step._RETIRED == []
    runtime.cudaHostRegister = lambda ptr, size, flags: 2  # (cudaErrorMemoryAllocation)
    assert device_step.host_status_buffer(4, 1) is None


@pytest.mark.gpu
def test_the_host_status_buffer_is_pinned_takes_a_captured_copy_and_is_unlocked():
    """The status's host memory (anvil_fast.optim.device_step.host_status_buffer): pinned without
    torch's host allocator, so an asynchronous copy into it can be a node of a CUDA graph; the copy
    lands there at each replay; once its keeper is collected, the next buffer's making unlocks it
    (never the collection itself, which may fall inside a capture)."""
    import gc
    from types import SimpleNamespace

    from anvil_fast.optim import device_step
    from anvil_fast.optim.device_step import host_status_buffer

    got = host_status_buffer(5, torch.cuda.current_device())
    assert got is not None
    host, keeper = got
    assert host.is_pinned() and host.dtype == torch.int32 and host.numel() == 5
    src = torch.zeros(5, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (a capture's warm-up: the copy's first launch outside it)
        src.add_(1)
        host.copy_(src, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        src.add_(1)
        host.copy_(src, non_blocking=True)
    for k in (2, 3):  # (the capture itself runs nothing)
        graph.replay()
        torch.cuda.synchronize()
        assert host.tolist() == [k] * 5
    ptr = host.data_ptr()
    del graph, host, got, keeper
    gc.collect()
    assert ptr in [r[1] for r in device_step._RETIRED]  # (with any other step collected here)
    # the unlock goes through a stand-in for the binding that records the driver's answer (0: it knew
    # the pointer as locked)
    cudart, unlocked = torch.cuda.cudart(), []
    stand_in = SimpleNamespace(cudaHostRegister=cudart.cudaHostRegister,
                               cudaHostUnregister=lambda p: unlocked.append((p, int(cudart.cudaHostUnregister(p)))))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "cudart", lambda: stand_in)
        again = host_status_buffer(5, torch.cuda.current_device())
    assert (ptr, 0) in unlocked and all(code == 0 for _, code in unlocked)
    assert device_step._RETIRED == [] and again is not None


@pytest.mark.gpu
def test_fp32_model_state_is_at_adamw_memory():
    """An fp32 model's resident optimizer state on the GPU: the two fp32 rails per banked weight and
    Adam's two moments (AdamW's 8 bytes per parameter), plus the lane energies, counters and tables;
    no mantissa, no bf16 copy, no gradient buffer, no persistent workspace. ``memory_allocated`` counts
    the caching allocator's blocks, so each held storage is allowed its block's rounding
    (:func:`helpers.cuda_block_bound`), and 1 MiB more for device buffers no state holds (compiled
    kernels' and the graph's own); a bf16 copy or a mantissa of the banked weights (2 B each, 14 MiB
    on the small GPT) does not fit."""
    torch.manual_seed(0)
    m = gpt.build("small").cuda()
    _fixed_grads(m, 0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    opt = ANVIL(m)
    for s in range(3):
        opt.step()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() - base
    n = sum(p.numel() for p in m.parameters())
    sizes, lanes = _held_storages(opt)
    assert 8 * n + lanes <= sum(sizes) <= 8 * n + lanes + (1 << 20), (sum(sizes), 8 * n)
    bound = sum(cuda_block_bound(b) for b in sizes) + (1 << 20)
    assert resident <= bound, (resident, bound, 8 * n)


# ----------------------------------------------------------------------------------------------- memory
def _held_storages(opt) -> tuple[list[int], int]:
    """(the byte size of every storage the optimizer holds besides the parameters', each counted
    once; bytes of its lane energies)."""
    seen, sizes, lanes = set(), [], 0
    param_storage = {p.untyped_storage().data_ptr() for p in opt.inner.params.values()}

    def add(t):
        if not isinstance(t, torch.Tensor):
            return
        key = t.untyped_storage().data_ptr()
        if key in seen or key in param_storage:
            return
        seen.add(key)
        sizes.append(t.untyped_storage().nbytes())

    inner = opt.inner
    for st in inner.param_states.values():
        for k, v in st.items():
            add(v)
            if k == "lane_energy":
                lanes += v.untyped_storage().nbytes()
    for bank in inner.banks.values():
        for v in vars(bank).values():
            add(v)
    for v in vars(opt.engine).values():
        add(v)
    add(inner.staging.buffer)
    for g in (inner.replicated.groups if inner.replicated is not None else []):
        for k in ("param", "grad", "exp_avg", "exp_avg_sq", "segment"):
            add(getattr(g, k))
    for t in (inner.built_grad_buffers or {}).values():
        add(t)
    return sizes, lanes


def _held_bytes(opt) -> tuple[int, int]:
    """(bytes of every tensor the optimizer holds besides the parameters, bytes of its lane energies)."""
    sizes, lanes = _held_storages(opt)
    return sum(sizes), lanes


@pytest.mark.parametrize("lean", [False, True], ids=["fp32_rails", "bf16_rails"])
def test_in_place_state_is_the_rails_and_moments_alone(triton_dev, lean):
    """Reading gradients in place, an fp32 model's optimizer holds the two rails per banked weight
    (4 B each; 2 B in the lean state) and Adam's two fp32 moments per other parameter (AdamW's
    8 B), the lane energies, and tables of a few bytes per matrix and parameter: no mantissa, no
    bf16 copy, no gradient buffer, no persistent workspace (it is taken per update)."""
    torch.manual_seed(0)
    m = gpt.build("tiny").to(triton_dev)
    opt = ANVIL(m, grad_read="in_place", cuda_graphs=False, rails_dtype=torch.bfloat16 if lean else torch.float32)
    _fixed_grads(m, 0)
    opt.step()
    held, lanes = _held_bytes(opt)
    banked = sum(p.numel() for b in opt.matrix_banks for _, p, _, _ in b.plan.members)
    other = sum(p.numel() for _, p in opt.adam_params)
    rails = (4 if lean else 8) * banked
    small = 4096 + 64 * (len(opt.engine.names) + opt.engine.n_mat)  # inbox, status, tables, scalars
    assert rails + 8 * other + lanes <= held <= rails + 8 * other + lanes + small, (held, rails + 8 * other + lanes)
    assert all(b.workspace is None and b.grad is None and b.mantissa is None for b in opt.inner.banks.values())


@pytest.mark.slow
@pytest.mark.parametrize("rails", ["nesterov", "record"])
def test_compiled_scalars_equal_the_eager_ones(rails):
    """On CUDA without Triton the scalars run through torch.compile (in-place writes into views of one
    status buffer, a gather from the record table), and tests/test_step_scalars.py holds the Triton
    launch to that compiled form: the compiled function (Inductor's CPU backend here) writes what the
    eager one writes."""
    from anvil_fast.optim import device_step as DS

    torch.manual_seed(0)
    m = gpt.build("tiny")
    opt = ANVIL(m, **({"rails": "record", "total_steps": 5} if rails == "record" else {}))
    eng = opt.engine
    _fixed_grads(m, 0)
    opt.step()
    m.lm_head.weight.grad = None
    eng.collect()
    eng.upload()

    def args():
        return (eng.hyper, eng.has, eng.flags, eng.counters, eng.last_bad, eng.adam_steps, opt.inner.rail_step,
                eng.bank_active, opt.inner.staging.buffer, eng.lr_coef, eng.wd_coef, eng.adam_lr_mul, eng.adam_wd_mul,
                eng.inactive_row, eng.gather, eng.record, len(eng.banks), eng.n_mat, eng.lean)

    before = {k: v.clone() for k, v in eng.mutated().items()}
    DS.derive_scalars(*args())
    eager = {k: v.clone() for k, v in eng.mutated().items()}
    for k, v in eng.mutated().items():
        v.copy_(before[k])
    torch.compile(DS.derive_scalars, dynamic=False, fullgraph=True)(*args())
    for k, v in eng.mutated().items():
        assert torch.equal(v, eager[k]), k
    assert not torch.equal(eager["staging"], before["staging"])  # it did write something
