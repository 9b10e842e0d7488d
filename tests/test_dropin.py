"""anvil_fast.ANVIL: the drop-in optimizer for any model (CPU here; two ranks in
tests/test_distributed.py; the GPU session runs the gpu-marked tests).

Models the drop-in was not designed around are used on purpose: the package's GPT with d_model equal
to its context, an nn.Sequential, a small conv net, a per-expert 3-D weight."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import anvil_fast
from anvil_fast.models import gpt
from anvil_fast.optim import dropin as D
from anvil_fast.optim.dropin import DropInAnvil
from anvil_fast.optim.entry import ANVIL
from anvil_fast.optim.optimizer import NonFiniteGradientError
from anvil_ref.rails import rail_scalars
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


@pytest.mark.parametrize("kwargs", [{}, {"rails": "record", "total_steps": 10}, {"rails_dtype": torch.bfloat16}],
                         ids=["defaults", "record_rails", "lean_state"])
@pytest.mark.parametrize("with_scheduler", [False, True], ids=["alone", "lr_scheduler"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_dropped_optimizer_is_freed_without_the_collector(kwargs, with_scheduler, device):
    """``del opt`` frees the drop-in, its engine and its state at once: nothing of it sits in a
    reference cycle, which only Python's cyclic collector would free, whenever it next runs. On CUDA
    that collection destroys the step's CUDA graphs, and inside a capture (the user's, torch.compile's)
    a destroyed graph breaks the capture."""
    import gc
    import weakref

    import torch._dynamo  # noqa: F401  (its first import, from inside torch.optim, keeps the caller's frames in a cycle)

    model = TinyLM().to(device)
    opt = ANVIL(model, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if with_scheduler else None
    _train(model, opt, 4, sched)  # on CUDA: the step captured and replayed
    if device == "cuda":
        assert opt.engine.graphs, "the CUDA case is meant to hold a captured step"
    refs = [weakref.ref(o) for o in (opt, opt.inner, opt.engine)]
    was = gc.isenabled()
    gc.disable()
    try:
        del opt, sched
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        if was:
            gc.enable()


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
    state, next to the same step with the eager-bf16 bank update (anvil_fast/core/tolerances.py's rule): the
    banks' fp32 masters are the model's parameters themselves."""
    import copy

    from anvil_fast.studies.difftest import rel_err
    from anvil_fast.core import tolerances as TOL

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
    opt._apply_hyperparameters()
    grads = {b.label: torch.cat([p.grad.reshape(-1, b.plan.cols) for _, p, _, _ in b.plan.members]).double()
             for b in opt.matrix_banks}
    ref = C.to_reference(inner, extra_pending={n: p.grad for n, p in opt.adam_params})
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


def _gpt_batch(seed, vocab=256, t=33):
    return torch.randint(0, vocab, (4, t), generator=torch.Generator().manual_seed(seed))


def _gpt_step(model, opt, x):
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _state_tensors(opt):
    """Every tensor of the optimizer's state, by key (for bitwise twin comparisons)."""
    out = {}
    for label, st in opt.inner.param_states.items():
        for k, v in st.items():
            out[f"{label}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_bitwise_same(m1, m2, o1, o2):
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), n
    s1, s2 = _state_tensors(o1), _state_tensors(o2)
    assert s1.keys() == s2.keys()
    for k in s1:
        if isinstance(s1[k], torch.Tensor):
            assert torch.equal(_bits(s1[k]), _bits(s2[k])), k
        else:
            assert s1[k] == s2[k], k


# ---------------------------------------------------------------------------------------- routing
def test_gpt_with_d_model_equal_to_context_banks_every_hidden_matrix():
    """tiny GPT: n_embd = ctx = 64, so the position embedding's row count equals every hidden size;
    heads are found by identity and name, never by size."""
    m = gpt.build("tiny")
    assert m.cfg.n_embd == m.cfg.ctx == 64
    opt = ANVIL(m)
    banked = {n for ns in opt.banks.values() for n in ns}
    hidden = {f"blocks.{i}.{k}.weight" for i in range(2) for k in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert banked == hidden
    reasons = {e.name: e.reason for e in opt.plan}
    assert reasons["wpe.weight"] == reasons["wte.weight"] == "embedding"
    assert reasons["lm_head.weight"] == "output head"
    assert reasons["blocks.0.ln1.weight"] == "scalar/vector"
    # lr reaches the banks: a different lr gives different matrices after one step
    m2 = gpt.build("tiny")
    opt2 = ANVIL(m2, lr=0.5 * opt.param_groups[0]["lr"])
    x = _gpt_batch(0)
    _gpt_step(m, opt, x)
    _gpt_step(m2, opt2, x)
    assert not torch.equal(m.blocks[0].mlp.fc.weight, m2.blocks[0].mlp.fc.weight)


def test_tied_head_is_caught_by_identity():
    m = gpt.build("tiny", tie_embeddings=True)
    opt = ANVIL(m)
    entry = {e.name: e for e in opt.plan}["wte.weight"]  # lm_head.weight is the same tensor
    assert entry.route == "adam" and entry.reason == "embedding"
    assert "lm_head.weight" not in {e.name for e in opt.plan}


def test_sequential_classifier_is_visible_and_fixable():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    text = ANVIL(seq).describe()  # traced at construction on one row of the first nn.Linear's input
    line = next(l for l in text.splitlines() if l.startswith("4.weight"))
    assert "adam (sharded)" in line and "output layer" in line  # one process: every Adam parameter its own state
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = ANVIL(seq, anvil=["4.weight"])
    entry = {e.name: e for e in opt.plan}["4.weight"]
    assert entry.route == "bank_3x16_float32" and entry.reason == "anvil="
    line = next(l for l in opt.describe().splitlines() if l.startswith("4.weight"))
    assert "bank_3x16_float32" in line and line.rstrip().endswith("anvil=")
    assert opt.banks == {"bank_16x16_float32": ["2.weight"], "bank_3x16_float32": ["4.weight"]}


def test_no_bank_warns():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10)

    with pytest.warns(UserWarning, match="no parameter was banked.*describe"):
        ANVIL(Heads())


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.classifier = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        h = torch.relu(self.c2(h)) + h
        h = torch.relu(self.c3(h)) + h
        return self.classifier(h.mean((2, 3)))


def test_conv_net_flattens_its_kernels_and_trains():
    torch.manual_seed(0)
    net = ConvNet()
    opt = ANVIL(net, lr=0.02, adam_lr=0.01)
    reasons = {e.name: (e.route, e.reason, e.bank_shape) for e in opt.plan}
    assert reasons["c1.weight"] == ("bank_8x27_float32", "conv (flattened)", (1, 8, 27))
    assert reasons["c2.weight"] == ("bank_8x72_float32", "conv (flattened)", (2, 8, 72))
    assert reasons["classifier.weight"][:2] == ("adam", "output head")
    assert net.c2.weight.shape == (8, 8, 3, 3)  # still the model's shape, a view of the bank
    bank = opt.inner.params["bank_8x72_float32"]
    assert net.c3.weight.data_ptr() == bank.data_ptr() + 8 * 72 * bank.element_size()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 5, (16,), generator=g)
    losses, c2 = [], net.c2.weight.detach().clone()
    for _ in range(15):
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(c2, net.c2.weight)


class Experts(nn.Module):
    def __init__(self, e=4, d=8, h=12):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(e, h, d, generator=torch.Generator().manual_seed(1)) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(e, d, h, generator=torch.Generator().manual_seed(2)) / h ** 0.5)
        self.bad = None

    def forward(self, x):  # x [e, n, d]
        return torch.relu(x @ self.w_in.transpose(1, 2)) @ self.w_out.transpose(1, 2)


def test_expert_stack_is_a_bank_of_its_matrices():
    m = Experts()
    opt = ANVIL(m, io_layers="anvil")  # both stacks are this model's input and output layers
    e = {x.name: x for x in opt.plan}
    assert (e["w_in"].route, e["w_in"].reason, e["w_in"].bank_shape, e["w_in"].slots) == \
        ("bank_12x8_float32", "stack", (4, 12, 8), (0, 4))
    assert tuple(opt.state[m.w_in]["fast_rail"].shape) == (4, 12, 8)
    assert tuple(opt.state[m.w_in]["lane_energy"].shape) == (4, 12, 1)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(4))
    before = m.w_out.detach().clone()
    (m(x) ** 2).mean().backward()
    opt.step()
    assert not torch.equal(before, m.w_out)
    # the rails hold the gradient's EMA: nonzero exactly where this step's gradient was
    assert torch.count_nonzero(opt.state[m.w_in]["slow_rail"]) > 0


def test_four_dim_parameter_without_rule_is_refused_with_a_hint():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3, 4, 5))

    odd = Odd()
    with pytest.raises(ConfigError, match=r"w: no rule covers a parameter of shape \(2, 3, 4, 5\).*adam=\['w'\]"):
        ANVIL(odd)
    with pytest.warns(UserWarning, match="no parameter was banked"):
        assert ANVIL(Odd(), adam=["w"]).adam_names == {"w": "sharded"}
    opt = ANVIL(Odd(), anvil=["w"])
    assert {e.name: e.bank_shape for e in opt.plan}["w"] == (1, 2, 60)


def test_split_rows_banks_each_row_block():
    m = gpt.build("tiny")
    qkv = m.blocks[0].attn.qkv.weight
    opt = ANVIL(m, split_rows={"blocks.0.attn.qkv.weight": 3, "blocks.1.attn.qkv.weight": 3})
    assert opt.banks["bank_64x64_float32"] == ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
                                               "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight"]
    e = {x.name: x for x in opt.plan}
    assert e["blocks.1.attn.qkv.weight"].slots == (4, 7) and e["blocks.1.attn.proj.weight"].slots == (7, 8)
    assert e["blocks.0.attn.qkv.weight"].reason == "matrix, split_rows=3"
    bank = opt.inner.params["bank_64x64_float32"]
    assert qkv.data_ptr() == bank.data_ptr() and qkv.shape == (192, 64)
    assert opt.inner.param_cfgs["bank_64x64_float32"].reshape == (8, 64, 64)
    with pytest.raises(ConfigError, match="5 blocks"):
        ANVIL(gpt.build("tiny"), split_rows={"blocks.0.attn.qkv.weight": 5})
    with pytest.raises(ConfigError, match="goes to Adam"):
        ANVIL(gpt.build("tiny"), split_rows={"wte.weight": 2})


@pytest.mark.parametrize("convention, expected", [("seed", {"bank_256x64_float32": 2.0, "bank_64x256_float32": 1.0}),
                                                  ("match_rms_adamw", {"bank_256x64_float32": 3.2,
                                                                       "bank_64x256_float32": 3.2,
                                                                       "bank_64x64_float32": 1.6})])
def test_lr_scale_conventions(convention, expected):
    """seed: max(1, rows/cols)**0.5 (256x64: 2); match_rms_adamw: 0.2 * sqrt(max(rows, cols))
    (256: 3.2, 64: 1.6): values worked by hand."""
    from anvil_ref.update import shape_lr_multiplier

    opt = ANVIL(gpt.build("tiny"), lr_scale=convention)
    assert shape_lr_multiplier(256, 64, convention=convention) == expected["bank_256x64_float32"]
    for label, want in expected.items():
        assert opt.inner.param_cfgs[label].lr_mul == pytest.approx(want, rel=1e-15), label
    with pytest.raises(ValueError, match="lr_scale"):
        ANVIL(gpt.build("tiny"), lr_scale="muon")
    with pytest.raises(ValueError, match="convention"):
        shape_lr_multiplier(4, 4, convention="muon")


# ---------------------------------------------------------------------------------------- step semantics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_member_without_grad_is_untouched_inside_a_bank(dtype):
    torch.manual_seed(0)
    m = TinyLM().to(dtype)
    opt = ANVIL(m, lr=0.02)
    _train(m, opt, 3)  # rails, lane energy and mantissas are all nonzero now
    x = _data(5)
    nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    idle, moving = m.blocks[1].q.weight, m.blocks[0].q.weight  # one bank: q, k, q, k
    label = "bank_16x16_" + str(dtype).split(".")[-1]
    assert opt.banks[label][2] == "blocks.1.q.weight"
    idle.grad = None
    m.gain.grad = None
    st = opt.inner.param_states[label]
    live = {"velocity": st["velocity"][:, 2], "lane_energy": st["lane_energy"][2]}
    if dtype == torch.bfloat16:
        live["mantissa"] = st["mantissa"][2]
    else:  # a float32 matrix is its own master: no mantissa is kept
        assert "mantissa" not in st
    keep = {k: v.clone() for k, v in live.items()}
    keep_w, keep_moving, keep_gain = idle.detach().clone(), moving.detach().clone(), m.gain.detach().clone()
    gain_step = int(opt.inner.param_states["gain"]["step"])
    assert torch.count_nonzero(keep["velocity"]) > 0 and torch.count_nonzero(keep["lane_energy"]) > 0
    opt.step()
    assert torch.equal(_bits(idle), _bits(keep_w))
    for k, v in live.items():
        assert torch.equal(_bits(v), _bits(keep[k])), k
    assert not torch.equal(moving, keep_moving)
    assert torch.equal(m.gain, keep_gain) and opt.inner.param_states["gain"]["step"] == gain_step


def _nan_twin_run(steps, bad, **kw):
    """Model A sees every batch; at the steps in ``bad`` one gradient entry is poisoned (so the step
    is skipped); twin B never sees those batches. Returns both (model, opt) and A's warnings."""
    torch.manual_seed(0)
    a = TinyLM()
    b = TinyLM()
    b.load_state_dict(a.state_dict())
    oa, ob = ANVIL(a, lr=0.02, adam_lr=0.01, **kw), ANVIL(b, lr=0.02, adam_lr=0.01, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps + len(bad)):
            x = _data(20 + i)
            for model, opt in ((a, oa), (b, ob)):
                if i in bad and model is b:
                    continue
                nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
                if i in bad:
                    p, val = bad[i]
                    dict(model.named_parameters())[p].grad.view(-1)[3] = val
                opt.step()
                opt.zero_grad()
    return a, b, oa, ob, caught


@pytest.mark.parametrize("grad_read", ["buffers", "transient"])
def test_a_member_without_grad_after_a_skipped_nan_step_does_not_skip_again(grad_read):
    """With persistent buffers, the slot of a bank member without .grad is cleared, so the NaN an
    earlier (skipped) step copied there cannot trip the check again; the transient read keeps none."""
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, lr=0.02, grad_read=grad_read)
    x = _data(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            if i == 0:
                m.blocks[1].q.weight.grad[0, 0] = float("nan")
            else:
                m.blocks[1].q.weight.grad = None
            opt.step()
            opt.zero_grad()
    skipped = [w for w in caught if issubclass(w.category, D.NonFiniteGradientWarning)]
    assert len(skipped) == 1 and opt.skipped_steps == 1 and opt.taken_steps == 1
    assert torch.isfinite(m.blocks[1].q.weight).all()


@pytest.mark.parametrize("kw", [{}, {"rails": "record", "total_steps": 5}, {"rails_dtype": torch.bfloat16}],
                         ids=["nesterov", "record", "lean_state"])
def test_nonfinite_step_is_skipped_and_the_run_continues_as_a_twin_that_never_saw_it(kw):
    bad = {2: ("blocks.0.fc1.weight", float("nan")), 4: ("emb.weight", float("inf"))}
    a, b, oa, ob, caught = _nan_twin_run(5, bad, **kw)
    _assert_bitwise_same(a, b, oa, ob)
    msgs = [str(w.message) for w in caught if issubclass(w.category, D.NonFiniteGradientWarning)]
    assert len(msgs) == 2 and "blocks.0.fc1.weight" in msgs[0] and "emb.weight" in msgs[1], msgs
    assert oa.skipped_steps == 2 and ob.skipped_steps == 0
    assert oa.taken_steps == ob.taken_steps == 5
    if "rails" in kw:
        assert oa.param_groups[0]["momentum"] == rail_scalars(4, 5).momentum


def test_nonfinite_raise_names_the_parameter_and_writes_nothing():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, nonfinite="raise")
    _train(m, opt, 1)
    x = _data()
    nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    m.blocks[1].fc1.weight.grad[0, 0] = float("inf")
    params, state = [p.data.clone() for p in m.parameters()], _state_tensors(opt)
    with pytest.raises(NonFiniteGradientError, match="blocks.1.fc1.weight"):
        opt.step()
    assert all(torch.equal(a, p.data) for a, p in zip(params, m.parameters()))
    after = _state_tensors(opt)
    assert all(torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k] for k, v in state.items())
    assert opt.inner.params["bank_64x16_float32"].grad is None  # nothing left behind
    with pytest.raises(ValueError, match="nonfinite"):
        ANVIL(TinyLM(), nonfinite="ignore")


@pytest.mark.parametrize("convert", ["bf16", "double"])
def test_changed_parameter_storage_is_refused(convert):
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m)
    _train(m, opt, 1)
    m.to(torch.bfloat16) if convert == "bf16" else m.double()
    x = _data()
    nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(D.StaleParameterError, match="blocks.0.q.weight .and 18 more.*storage changed.*new ANVIL"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_rebinding_one_parameter_is_refused():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m)
    m.blocks[0].k.weight.data = m.blocks[0].k.weight.data.clone()
    with pytest.raises(D.StaleParameterError, match=r"^blocks.0.k.weight: .*new memory"):
        opt.step()
    opt = ANVIL(m)
    m.gain.data = m.gain.data.clone()
    with pytest.raises(D.StaleParameterError, match=r"^gain: "):
        opt.step()


def test_record_rails_follow_the_schedule_and_stop_at_total_steps():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, rails="record", total_steps=3)
    for t in range(3):
        _train(m, opt, 1)
        want = rail_scalars(t, 3)
        g = opt.param_groups[0]
        assert (g["momentum"], g["fast_beta"], g["fast_weight"]) == tuple(want)
        assert opt.inner.param_cfgs["bank_16x16_float32"].momentum == want.momentum
        assert (opt.inner.fast_beta, opt.inner.fast_weight) == (want.fast_beta, want.fast_weight)
    with pytest.raises(ValueError, match="total_steps=3"):
        _train(m, opt, 1)
    with pytest.raises(ValueError, match="total_steps"):
        ANVIL(TinyLM(), rails="record")
    with pytest.raises(ValueError, match="rails"):
        ANVIL(TinyLM(), rails="twin")


def test_nesterov_default_uses_the_group_values():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m, momentum=0.9)
    opt.param_groups[0]["fast_weight"] = 0.5
    _train(m, opt, 1)
    assert (opt.inner.fast_beta, opt.inner.fast_weight) == (0.9, 0.5)
    assert opt.inner.param_cfgs["bank_16x16_float32"].momentum == 0.9


# ---------------------------------------------------------------------------------------- torch.optim behaviour
@pytest.mark.parametrize("kw", [{}, {"rails": "record", "total_steps": 8}, {"rails_dtype": torch.bfloat16}],
                         ids=["nesterov", "record", "lean_state"])
def test_checkpoint_resumes_bitwise_through_weights_only_load(kw):
    torch.manual_seed(0)
    m = TinyLM().to(torch.bfloat16)
    opt = ANVIL(m, **kw)
    _train(m, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    after = _train(m, opt, 3)
    buf.seek(0)
    ck = torch.load(buf)  # weights_only=True, torch's default
    torch.manual_seed(5)
    m2 = TinyLM().to(torch.bfloat16)
    opt2 = ANVIL(m2, **kw)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert _train(m2, opt2, 3) == after
    _assert_bitwise_same(m, m2, opt, opt2)


def test_momentum_cycling_schedulers():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01], total_steps=10)
    for _ in range(4):
        _train(m, opt, 1, sched)
    anvil_g, adam_g = opt.param_groups
    assert 0.85 <= anvil_g["momentum"] < 0.95
    _train(m, opt, 1)
    assert opt.inner.param_cfgs["bank_16x16_float32"].momentum == anvil_g["momentum"]
    assert adam_g["betas"] == (adam_g["momentum"], 0.95)
    assert opt.inner.param_cfgs["gain"].adam_betas == (adam_g["momentum"], 0.95)
    m = TinyLM()
    opt = ANVIL(m)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=[0.001, 0.001], max_lr=[0.02, 0.01], step_size_up=3)
    _train(m, opt, 2, sched)
    assert opt.param_groups[0]["momentum"] != 0.95  # CyclicLR's base/max momentum are 0.8/0.9
    _train(m, opt, 1)
    assert opt.inner.param_cfgs["gain"].adam_betas[0] == opt.param_groups[1]["momentum"]


def test_add_param_group_routes_a_vector_to_adam_and_refuses_other_values():
    opt = ANVIL(TinyLM())
    extra = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 2 and any(p is extra for p in opt.param_groups[1]["params"])
    assert {e.name: e.route for e in opt.plan}[f"param{len(opt.plan) - 1}"] == "adam"
    with pytest.raises(ValueError, match="adam_lr=0.5 differs from the adam group's"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "adam_lr": 0.5})


@pytest.mark.parametrize("key, value, match", [("lr", -0.1, "Invalid lr"), ("momentum", 1.0, "Invalid momentum"),
                                               ("beta2", 1.5, "Invalid beta2"), ("weight_decay", -1, "weight_decay"),
                                               ("adam_eps", -1e-8, "Invalid eps"),
                                               ("adam_lr", float("nan"), "Invalid lr"),
                                               ("adam_betas", (0.9, 1.0), "beta parameter at index 1"),
                                               ("fast_beta", 1.2, "fast_beta")])
def test_hyperparameters_validated_at_construction(key, value, match):
    m = TinyLM()
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match=match):
        ANVIL(m, **{key: value})
    assert before == [p.data_ptr() for p in m.parameters()]  # nothing re-pointed


def test_hyperparameters_validated_at_step_before_anything_is_written():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m)
    x = _data()
    nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.param_groups[1]["lr"] = -1.0
    params = [p.data.clone() for p in m.parameters()]
    with pytest.raises(ValueError, match="Invalid lr in the adam group"):
        opt.step()
    assert all(torch.equal(a, p.data) for a, p in zip(params, m.parameters()))
    assert all(p.grad is not None for p in m.parameters())


def test_state_views_are_the_live_state():
    torch.manual_seed(0)
    m = TinyLM()
    opt = ANVIL(m)
    _train(m, opt, 2)
    w = m.blocks[0].fc2.weight
    st = opt.state[w]
    assert set(st) == {"fast_rail", "slow_rail", "lane_energy"}  # a float32 matrix is its own master
    assert st["fast_rail"].shape == (16, 64) and st["lane_energy"].shape == (1, 64)
    vel = opt.inner.param_states["bank_16x64_float32"]["velocity"]
    assert torch.equal(st["slow_rail"], vel[1, 0]) and st["slow_rail"].data_ptr() == vel[1, 0].data_ptr()
    assert set(opt.state[m.gain]) == {"step", "exp_avg", "exp_avg_sq"} and opt.state[m.gain]["step"] == 2
    _train(m, opt, 1)
    assert opt.state[m.gain]["step"] == 3


@pytest.mark.parametrize("kw", [{}, {"rails_dtype": torch.bfloat16}], ids=["fp32_rails", "lean_state"])
def test_grad_scaler_on_cpu_matches_the_unscaled_run(kw):
    """Scaling by a power of two and unscaling is exact here, so both runs agree bit for bit."""
    torch.manual_seed(0)
    a = TinyLM()
    b = TinyLM()
    b.load_state_dict(a.state_dict())
    oa, ob = ANVIL(a, **kw), ANVIL(b, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for i in range(3):
        x = _data(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            la = nn.functional.cross_entropy(a(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
            lb = nn.functional.cross_entropy(b(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        scaler.scale(la).backward()
        scaler.step(oa)
        scaler.update()
        lb.backward()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    assert scaler.get_scale() == 2.0 ** 10
    _assert_bitwise_same(a, b, oa, ob)


def test_torch_compiled_model():
    torch.manual_seed(0)
    eager = TinyLM()
    model = TinyLM()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend="aot_eager")
    x = _data()
    compiled(x[:, :-1])  # traced before the optimizer re-points the parameters into banks
    opt = ANVIL(compiled)
    assert "_orig_mod" not in opt.describe()
    assert set(opt.banks) == {"bank_64x16_float32", "bank_16x64_float32", "bank_16x16_float32"}
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(compiled(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # the compiled forward reads the banks: after the steps it equals the eager module's (aot_eager
    # runs the same aten ops eagerly, so bit for bit)
    assert torch.equal(compiled(x[:, :-1]), model(x[:, :-1]))
    assert not torch.equal(model(x[:, :-1]), eager(x[:, :-1]))  # and the steps did change the weights


def test_cuda_graphs_default_is_off_on_cpu_and_true_is_refused():
    import warnings as W

    with W.catch_warnings():
        W.simplefilter("error")
        W.filterwarnings("ignore", message="ANVIL: the model could not be traced")  # TinyLM offers no input
        opt = ANVIL(TinyLM())
    assert opt.inner.step_graph is None and not opt.engine.use_graphs
    with pytest.raises(ValueError, match="CUDA device"):
        ANVIL(TinyLM(), cuda_graphs=True)


def test_dir_lists_the_optimizer():
    assert "ANVIL" in dir(anvil_fast) and "ANVIL" in anvil_fast.__all__
    assert anvil_fast.ANVIL is ANVIL and anvil_fast.StaleParameterError is D.StaleParameterError


def test_bad_input():
    half = nn.Linear(4, 4).half()
    with pytest.raises(ConfigError, match="weight: a torch.float16 matrix cannot be banked.*adam=\\['weight'\\]"):
        ANVIL(half)
    with pytest.raises(ValueError, match="unknown parameter names"):
        ANVIL(nn.Linear(4, 4), adam=["nope"])
    with pytest.raises(TypeError, match="param-group dicts"):
        ANVIL([{"params": list(nn.Linear(2, 2).parameters())}])
    with pytest.raises(ConfigError, match="anvil= needs a parameter with ndim >= 2"):
        ANVIL(nn.Linear(2, 2), anvil=["bias"])
    plain = ANVIL(list(nn.Linear(3, 5).parameters()))
    assert plain.banks == {"bank_5x3_float32": ["param0"]} and plain.adam_names == {"param1": "sharded"}


def _two_rank_session(rank, world_size):
    """On each rank: its own data; step 2 has a NaN on rank 1 only; step 3 leaves blocks.1.q.weight
    (a member of a bank split over both ranks) without a gradient."""
    from anvil_fast.parallel.distributed import all_digests

    torch.manual_seed(0)
    m = TinyLM()
    # faithful: with SAFE under TRITON_INTERPRET=1 a child was seen to abort at exit (SIGABRT, 3 in ~30 runs)
    opt = ANVIL(m, lr=0.02, adam_lr=0.01, shard_min_numel=512, bank_config="faithful", compile=False)
    idle = m.blocks[1].q.weight
    out = {"warnings": []}
    for i in range(4):
        x = _data(40 + 10 * i + rank)
        nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        if i == 2 and rank == 1:
            m.blocks[0].fc1.weight.grad[1, 1] = float("nan")
        if i == 3:
            idle.grad = None
            before = idle.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        out["warnings"] += [str(w.message) for w in caught if issubclass(w.category, D.NonFiniteGradientWarning)]
        opt.zero_grad()
    out["idle_unchanged"] = torch.equal(_bits(before), _bits(idle))
    out["skipped"], out["taken"] = opt.skipped_steps, opt.taken_steps
    out["digests"] = all_digests([p.data for p in m.parameters()])
    out["chunk"] = opt.inner.param_cfgs["bank_16x16_float32"].chunk_size
    return out


@pytest.mark.distributed
def test_two_ranks_skip_together_and_leave_gradless_members_alone():
    from anvil_fast.parallel.distributed import spawn

    res = spawn(_two_rank_session, 2)
    for out in res:
        assert out["chunk"] == 2  # blocks.1.q.weight (matrix 2) lives on rank 1
        assert out["skipped"] == 1 and out["taken"] == 3
        assert len(out["warnings"]) == 1 and "blocks.0.fc1.weight" in out["warnings"][0]
        assert "on at least one rank" in out["warnings"][0]
        assert out["idle_unchanged"]
    assert len(set(res[0]["digests"])) == 1


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"rails_dtype": torch.bfloat16}], ids=["fp32_rails", "lean_state"])
def test_one_gpu_default_graphs_match_eager(kw):
    torch.manual_seed(0)
    m = TinyLM().cuda()
    m2 = TinyLM().cuda()
    m2.load_state_dict(m.state_dict())
    a = ANVIL(m, compile=False, cuda_graphs=False, **kw)  # the captured path is the point here, not Inductor
    b = ANVIL(m2, compile=False, **kw)  # cuda_graphs=None: captured on CUDA
    assert not a.engine.use_graphs and b.engine.use_graphs
    la, lb = _train(m, a, 5), _train(m2, b, 5)
    assert la == lb and la[-1] < la[0]
    assert b.engine.replays == 5 and b.engine.captures == 1


@pytest.mark.gpu
def test_one_gpu_graphs_follow_a_beta2_change():
    torch.manual_seed(0)
    m = TinyLM().cuda()
    m2 = TinyLM().cuda()
    m2.load_state_dict(m.state_dict())
    a = ANVIL(m, compile=False, cuda_graphs=False)
    b = ANVIL(m2, compile=False, cuda_graphs=True)
    la, lb = _train(m, a, 2), _train(m2, b, 2)
    for opt in (a, b):
        opt.param_groups[0]["beta2"] = 0.5
    la, lb = la + _train(m, a, 3), lb + _train(m2, b, 3)
    assert la == lb
    assert b.inner.banks["bank_16x16_float32"].beta2 == 0.5
    assert b.engine.captures == 2  # one capture per beta2 value


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"rails_dtype": torch.bfloat16}], ids=["fp32_rails", "lean_state"])
def test_grad_scaler_fp16_autocast_on_cuda(kw):
    torch.manual_seed(0)
    m = gpt.build("tiny", device="cuda")
    opt = ANVIL(m, **kw)
    scaler = torch.amp.GradScaler("cuda")
    losses = []
    x = _gpt_batch(0).cuda()  # one batch, so the loss must fall (random bytes hold nothing else to learn)
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = m(x[:, :-1], x[:, 1:])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and opt.skipped_steps == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"rails_dtype": torch.bfloat16}], ids=["fp32_rails", "lean_state"])
def test_default_step_on_cuda_compiles_nothing_through_inductor(monkeypatch, kw):
    # The default (SAFE) step runs Triton kernels only: no torch.compile'd function, so a first step never
    # pays Dynamo's tracing and Inductor's code generation. Twins that other tests compiled are hidden.
    import anvil_fast.kernels.compiled as C

    def refuse(fn, *a, **k):
        raise AssertionError(f"the default step compiled {getattr(fn, '__qualname__', fn)} through torch.compile")

    monkeypatch.setattr(C, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", refuse)
    m = gpt.build("tiny", device="cuda")
    opt = ANVIL(m, **kw)
    x = _gpt_batch(0).cuda()
    losses = [_gpt_step(m, opt, x) for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"rails_dtype": torch.bfloat16}], ids=["fp32_rails", "lean_state"])
def test_inductor_compiled_model_on_cuda(kw):
    m = gpt.build("tiny", device="cuda")
    compiled = torch.compile(m)
    opt = ANVIL(compiled, **kw)
    assert "_orig_mod" not in opt.describe()
    x = _gpt_batch(0).cuda()  # one batch, so the loss must fall (random bytes hold nothing else to learn)
    losses = [_gpt_step(compiled, opt, x) for _ in range(10)]
    assert losses[-1] < losses[0]


def _examples():
    """The training loops of ANVIL's docstring and of the README's "Use it" section."""
    from pathlib import Path

    doc = ANVIL.__doc__.split("Example (a complete training loop)::", 1)[1].split("**Routing**", 1)[0]
    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    use = readme.split("## Use it", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    import textwrap

    return {"docstring": textwrap.dedent(doc), "readme": use}


@pytest.mark.parametrize("where", ["docstring", "readme"])
def test_documented_training_loop_runs(where, capsys):
    code = _examples()[where]
    assert "opt.step()" in code and "describe()" in code
    code = code.replace("range(1000)", "range(2)").replace("range(100)", "range(2)")
    exec(compile(code, f"<{where} example>", "exec"), {})
    assert "bank_192x64_float32" in capsys.readouterr().out
