"""anvil_fast.kernels.step_scalars: the device step's scalars in one Triton launch, held to the torch
function that specifies them (anvil_fast.optim.device_step.derive_scalars; on CUDA its compiled form,
which the step ran before) bit for bit, on every state it writes."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.models import gpt
from anvil_fast.optim import device_step as DS
from anvil_fast.optim.entry import ANVIL

triton = pytest.importorskip("triton")
from anvil_fast.kernels.step_scalars import derive_scalars_triton  # noqa: E402


def _engine(dev: str, *, rails: str, lean: bool):
    torch.manual_seed(0)
    m = gpt.build("tiny").to(dev)
    # powers of two as Adam's betas on the interpreter: its pow stand-in is exact there
    betas = (0.9, 0.95) if dev == "cuda" else (0.5, 0.25)
    kw = {"rails": "record", "total_steps": 5} if rails == "record" else {"momentum": 0.87, "fast_beta": 0.61, "fast_weight": 0.3}
    opt = ANVIL(m, lr=0.021, adam_lr=0.0037, weight_decay=1.3, adam_betas=betas, cuda_graphs=False,
                rails_dtype=torch.bfloat16 if lean else torch.float32, **kw)
    return m, opt


def _grads(m, seed):
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)


def _args(opt):
    eng = opt.engine
    return (eng.hyper, eng.has, eng.flags, eng.counters, eng.last_bad, eng.adam_steps, opt.inner.rail_step,
            eng.bank_active, opt.inner.staging.buffer, eng.lr_coef, eng.wd_coef, eng.adam_lr_mul, eng.adam_wd_mul,
            eng.inactive_row, eng.gather, eng.record, len(eng.banks), eng.n_mat, eng.lean)


def _written(opt) -> dict:
    eng = opt.engine
    return {"staging": opt.inner.staging.buffer, "status": eng.status, "adam_steps": eng.adam_steps,
            "bank_active": eng.bank_active, "rail_step": opt.inner.rail_step}


def _both_ways(opt, triton_dev) -> tuple[dict, dict]:
    """The state before, and what the torch scalars write from it (compiled on CUDA, as the step runs
    them there); the one launch, run from the same state, must write the same bits."""
    before = {k: v.clone() for k, v in _written(opt).items()}
    ref = torch.compile(DS.derive_scalars, dynamic=False, fullgraph=True) if triton_dev == "cuda" else DS.derive_scalars
    ref(*_args(opt))
    want = {k: v.clone() for k, v in _written(opt).items()}
    for k, v in _written(opt).items():
        v.copy_(before[k])
    derive_scalars_triton(*_args(opt))
    for k, v in _written(opt).items():
        assert torch.equal(v, want[k]), (k, v, want[k])
    return before, want


@pytest.mark.filterwarnings("ignore::anvil_fast.optim.dropin.NonFiniteGradientWarning")
@pytest.mark.parametrize("bad", [False, True], ids=["taken", "refused"])
@pytest.mark.parametrize("lean", [False, True], ids=["fp32_rails", "bf16_rails"])
@pytest.mark.parametrize("rails", ["nesterov", "record"])
def test_one_launch_writes_what_the_torch_scalars_write(triton_dev, rails, lean, bad):
    """From one engine state (two steps taken and one refused, an Adam row without a gradient, a bank
    member without one, and on the refused case a flag set), the kernel and the torch function write the same bits
    into the staging buffer, the status (counters, last refused flags), Adam's step counts, the
    active masks and the lean rails' step."""
    m, opt = _engine(triton_dev, rails=rails, lean=lean)
    for s in range(3):
        _grads(m, s)
        if s == 1:  # a refused step: the status keeps its flags until the next refusal
            next(m.parameters()).grad.view(-1)[0] = float("nan")
        opt.step()
    _grads(m, 7)
    eng = opt.engine
    params = dict(m.named_parameters())
    params[eng.names[0]].grad = None  # a bank member
    params[eng.names[-1]].grad = None  # an Adam parameter
    eng.collect()
    eng.upload()
    eng.check()
    if bad:
        eng.flags[len(eng.flags) // 2] = 1
    before, want = _both_ways(opt, triton_dev)
    # the case did what it says: the counters moved, and a refusal left every row and matrix inactive
    taken, skipped = want["status"][:2].tolist()
    assert (taken, skipped) == ((2, 2) if bad else (3, 1))
    assert bool(before["status"][2:2 + len(opt.engine.names)].any())  # an earlier refusal's flags
    assert bool(want["bank_active"].any()) != bad
    assert not torch.equal(want["staging"], before["staging"]) or bad


def test_a_conv_net_under_a_scheduler(triton_dev):
    """A model the package was not built around (convolutions banked, two Linear layers) whose
    learning rates a scheduler moves every step: the same bits as the torch scalars."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.Flatten(),
                            torch.nn.Linear(8 * 4 * 4, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5)).to(triton_dev)
    betas = (0.9, 0.95) if triton_dev == "cuda" else (0.5, 0.25)
    opt = ANVIL(m, lr=0.02, adam_betas=betas, cuda_graphs=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    for s in range(3):
        _grads(m, s)
        opt.step()
        sched.step()
    _grads(m, 9)
    eng = opt.engine
    eng.collect()
    eng.upload()
    eng.check()
    before, want = _both_ways(opt, triton_dev)
    assert eng.n_mat > 0 and eng.n_adam > 0 and not torch.equal(want["staging"], before["staging"])


def test_bad_arguments_are_named(triton_dev):
    _, opt = _engine(triton_dev, rails="nesterov", lean=False)
    args = list(_args(opt))
    args[5] = args[5].float()  # adam_steps in the wrong dtype
    with pytest.raises(ValueError, match="adam_steps must be a contiguous torch.float64"):
        derive_scalars_triton(*args)
    args = list(_args(opt))
    args[17] = args[17] + 1  # one matrix too many
    with pytest.raises(ValueError, match="sizes disagree"):
        derive_scalars_triton(*args)
