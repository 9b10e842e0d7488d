"""anvil_fast.ANVIL: the drop-in optimizer for any model (CPU here; two ranks in
tests/test_distributed.py; the GPU session runs the gpu-marked test)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

import anvil_fast
from anvil_fast.dropin import ANVIL
from anvil_fast.optimizer import NonFiniteGradientError
from anvil_ref.config import ConfigError
from tests import optimizer_cases as C


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5, -1) @ h
        return x + a + self.fc2(torch.relu(self.fc1(h)))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h) * self.gain


def _data(seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (8, 12), generator=g)


def _train(model, opt, steps, sched=None):
    x = _data().to(next(model.parameters()).device)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_grouping_rules():
    torch.manual_seed(0)
    m = TinyLM()
    opt = anvil_fast.ANVIL(m)
    assert opt.banks == {
        "bank_64x16_float32": ["blocks.0.fc1.weight", "blocks.1.fc1.weight"],
        "bank_16x64_float32": ["blocks.0.fc2.weight", "blocks.1.fc2.weight"],
        "bank_16x16_float32": ["blocks.0.q.weight", "blocks.0.k.weight", "blocks.1.q.weight", "blocks.1.k.weight"]}
    adam = opt.adam_names
    assert set(adam) == {n for n, _ in m.named_parameters()} - {n for ns in opt.banks.values() for n in ns}
    assert {"emb.weight", "lm_head.weight", "gain", "blocks.0.ln.weight", "blocks.1.fc2.bias"} <= set(adam)
    assert [g["kind"] for g in opt.param_groups] == ["anvil", "adam"]
    assert isinstance(opt, torch.optim.Optimizer)
    # every bank member is a view of its bank (the model reads the bank)
    bank = opt.inner.params["bank_16x16_float32"]
    q = dict(m.named_parameters())["blocks.1.q.weight"]
    assert q.data.untyped_storage().data_ptr() == bank.data.untyped_storage().data_ptr()


def test_trains_with_an_lr_scheduler_and_matches_the_inner_step():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, lr=0.02, adam_lr=0.01, bank_config="faithful")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 50)
    losses = _train(m, opt, 20, sched)
    assert losses[-1] < 0.5 * losses[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * (1 - 20 / 50))
    assert opt.inner.param_cfgs["bank_16x16_float32"].lr == pytest.approx(0.02 * (1 - 19 / 50))  # the last step's
    assert opt.inner.param_cfgs["gain"].lr == pytest.approx(0.01 * (1 - 19 / 50))


def test_step_is_the_reference_step():
    """One drop-in step on an fp32 model against ReferenceAnvilAndAdam (Adam every step) from the same
    state, next to the same step with the eager-bf16 bank update (tests/tolerances.py's rule): the
    banks' fp32 masters are the model's parameters themselves."""
    import copy

    from anvil_fast.difftest import rel_err
    from tests import tolerances as TOL

    torch.manual_seed(1)
    m = TinyLM()
    m_eager = copy.deepcopy(m)
    kw = dict(bank_config="faithful", momentum=0.9, fast_beta=0.85, fast_weight=0.4385)
    opt, opt_eager = ANVIL(m, **kw), ANVIL(m_eager, **kw)
    opt_eager.inner.bank_update = C.eager_bank_update
    _train(m, opt, 2)
    C.sync_optimizer(opt_eager.inner, opt.inner)
    x = _data(3)
    for model in (m, m_eager):
        nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    inner = opt.inner
    opt._sync_hyperparameters()
    grads = {b["label"]: torch.cat([p.grad for _, p in b["members"]]).double() for b in opt._banks}
    ref = C.to_reference(inner, extra_pending={n: p.grad for n, p in opt._adam_named})
    before = {l: C.master64(inner, l) for l in inner.labels}
    opt.step()
    opt_eager.step()
    ref.step(grads, do_adam=True)
    for l in inner.bank_labels:
        cfg = inner.param_cfgs[l]
        d_ref = torch.from_numpy(ref.params[l] - before[l]).reshape(cfg.reshape)
        e = rel_err(torch.from_numpy(C.master64(inner, l) - before[l]).reshape(cfg.reshape), d_ref)
        e_eager = rel_err(torch.from_numpy(C.master64(opt_eager.inner, l) - before[l]).reshape(cfg.reshape), d_ref)
        assert e <= TOL.bf16_bound(e_eager), (l, e, e_eager)
    for l in inner.adam_labels:  # fp32 Adam: the exact bounds are checked in tests/test_optimizer.py
        np.testing.assert_allclose(C.master64(inner, l), ref.params[l], rtol=1e-5, atol=1e-7, err_msg=l)


def test_bf16_model_banks_share_storage_and_keep_mantissas():
    torch.manual_seed(0)
    m = TinyLM().to(torch.bfloat16)
    opt = ANVIL(m)
    losses = _train(m, opt, 10)
    assert losses[-1] < losses[0]
    mant = opt.inner.param_states["bank_16x16_bfloat16"]["mantissa"]
    assert torch.count_nonzero(mant.view(torch.int16)) > 0  # the fp32 master's low halves are kept


def test_step_leaves_grads_and_state_dict_round_trip():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, lr=0.01)
    _train(m, opt, 3)
    x = _data()
    nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    opt.step()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    opt.zero_grad()
    after = _train(m, opt, 3)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    torch.manual_seed(7)
    m2 = TinyLM()
    opt2 = ANVIL(m2, lr=0.5)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert opt2.param_groups[0]["lr"] == 0.01
    for n, p in m2.named_parameters():
        p.grad = grads[n].clone()
    opt2.step()
    opt2.zero_grad()
    after2 = _train(m2, opt2, 3)
    assert after == after2
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n


def test_bad_input_and_nonfinite_gradient():
    conv = nn.Sequential(nn.Conv1d(3, 4, 3), nn.Linear(4, 4))
    before = [p.data.clone() for p in conv.parameters()]
    with pytest.raises(ConfigError, match="0.weight: no rule covers a parameter of shape \\(4, 3, 3\\)"):
        ANVIL(conv)
    assert all(torch.equal(a, p.data) for a, p in zip(before, conv.parameters()))  # nothing re-pointed
    opt = ANVIL(conv, adam=["0.weight"])
    assert "0.weight" in opt.adam_names
    half = nn.Linear(4, 4).half()
    with pytest.raises(ConfigError, match="no rule covers a torch.float16 matrix"):
        ANVIL(half)
    with pytest.raises(ValueError, match="unknown parameter names"):
        ANVIL(nn.Linear(4, 4), adam=["nope"])
    with pytest.raises(TypeError, match="param groups"):
        ANVIL([{"params": list(nn.Linear(2, 2).parameters())}])
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, check_finite=True)
    x = _data()
    nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    m.blocks[1].fc1.weight.grad[0, 0] = float("inf")
    state = [p.data.clone() for p in m.parameters()]
    with pytest.raises(NonFiniteGradientError, match="blocks.1.fc1.weight"):
        opt.step()
    assert all(torch.equal(a, p.data) for a, p in zip(state, m.parameters()))


@pytest.mark.gpu
def test_one_gpu_with_cuda_graphs():
    torch.manual_seed(0)
    m = TinyLM().cuda()
    m2 = TinyLM().cuda()
    m2.load_state_dict(m.state_dict())
    a = ANVIL(m, cuda_graphs=False, compile=False)  # the captured path is the point here, not Inductor (covered by the bench)
    b = ANVIL(m2, cuda_graphs=True, compile=False)
    la, lb = _train(m, a, 5), _train(m2, b, 5)
    assert la == lb and la[-1] < la[0]
