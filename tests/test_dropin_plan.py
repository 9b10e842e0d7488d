"""The drop-in's plan is decided when the optimizer is built: what torch.optim's and Hugging Face's
habits do to it before, during and after training (a state-dict round trip before the first
forward, a scheduler built first, copies of the model, the record rails after a reload, a Trainer
run through accelerate), on models of the kinds users bring (an MLP, LSTM and GRU language models,
weight-normed, grouped and depthwise convolutions, compiled models)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from anvil_fast.optim.entry import ANVIL


def _mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias), nn.ReLU(),
                         nn.Linear(32, 4, bias=bias))


def _plan(opt):
    return [(e.name, e.route, e.slots, e.transposed) for e in opt.plan]


def _train(model, opt, steps, seed=1, sched=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def test_a_state_dict_round_trip_before_the_first_forward_changes_nothing():
    m1, m2 = _mlp(), _mlp()
    o1, o2 = ANVIL(m1), ANVIL(m2)
    o2.load_state_dict(o2.state_dict())  # what accelerate's AcceleratedOptimizer does at prepare()
    assert _plan(o1) == _plan(o2)
    routes = {e.name: e.route for e in o1.plan}
    assert routes["0.weight"] == routes["4.weight"] == "adam"  # traced at construction: input, output layer
    _train(m1, o1, 3)
    _train(m2, o2, 3)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert _plan(o1) == _plan(o2)


def test_copies_of_the_model_never_touch_the_optimizer():
    m = _mlp()
    opt = ANVIL(m)
    for mod in m.modules():
        assert not (mod._forward_hooks or mod._forward_pre_hooks or mod._state_dict_hooks), mod
    ema = copy.deepcopy(m)  # an EMA or teacher copy made before training
    blob = pickle.dumps(m)
    assert b"DropInAnvil" not in blob and b"AnvilAndAdam" not in blob
    plan = _plan(opt)
    _train(m, opt, 2)
    assert _plan(opt) == plan
    assert not any(torch.equal(p, q) for p, q in zip(ema.parameters(), m.parameters()) if p.ndim == 2)
    # the copy's parameters have memory of their own, not the banks'
    bank_ptrs = {b.param.untyped_storage().data_ptr() for b in opt.matrix_banks}
    assert not {p.untyped_storage().data_ptr() for p in ema.parameters()} & bank_ptrs
    # and an optimizer copied with its model updates the copy
    m2, o2 = copy.deepcopy((m, opt))
    _train(m, opt, 1, seed=5)
    _train(m2, o2, 1, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sched", ["LambdaLR", "OneCycleLR"])
def test_a_scheduler_built_before_the_first_forward_keeps_its_groups(sched, bias):
    m = _mlp(bias=bias)
    opt = ANVIL(m)
    n = len(opt.param_groups)
    if sched == "LambdaLR":
        s = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1 - t / 10] * n)
    else:
        s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01][:n], total_steps=10)
    _train(m, opt, 4, sched=s)
    assert len(opt.param_groups) == n and all("initial_lr" in g for g in opt.param_groups)
    assert opt.param_groups[0]["lr"] != s.base_lrs[0] or sched == "OneCycleLR"


def test_record_rails_after_load_state_dict_show_and_save_the_right_values():
    kw = dict(rails="record", total_steps=20)
    m1 = _mlp()
    o1 = ANVIL(m1, **kw)
    _train(m1, o1, 5)
    m2 = _mlp(seed=3)
    m2.load_state_dict(m1.state_dict())
    o2 = ANVIL(m2, **kw)
    o2.load_state_dict(o1.state_dict())
    keys = ("momentum", "fast_beta", "fast_weight")
    assert [o2.param_groups[0][k] for k in keys] == [o1.param_groups[0][k] for k in keys]
    for _ in range(3):
        _train(m1, o1, 1, seed=7)
        _train(m2, o2, 1, seed=7)
        assert [o2.param_groups[0][k] for k in keys] == [o1.param_groups[0][k] for k in keys]
        assert o2.state_dict()["param_groups"][0]["momentum"] == o1.state_dict()["param_groups"][0]["momentum"]
    assert o1.param_groups[0]["momentum"] != _fresh_record_momentum(kw)  # the values move along the schedule
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def _fresh_record_momentum(kw):
    from anvil_ref.rails import rail_scalars

    return rail_scalars(0, kw["total_steps"]).momentum


# ------------------------------------------------------------------ Hugging Face Trainer through accelerate
def test_hf_trainer_with_accelerate_keeps_the_traced_plan(tmp_path):
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=3, pad_token_id=0,
                      max_position_embeddings=32)
    model = LlamaForSequenceClassification(cfg)
    opt = ANVIL(model, lr=0.02, adam_lr=0.01)
    plan = _plan(opt)
    routes = {e.name: (e.route, e.reason) for e in opt.plan}
    assert routes["score.weight"][0] == "adam" and "output layer" in routes["score.weight"][1]
    assert routes["model.layers.0.mlp.up_proj.weight"][0].startswith("bank_")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(1, 64, (6,), generator=g), "labels": torch.tensor(i % 3)} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True)
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    assert _plan(opt) == plan  # the round trip accelerate makes changed nothing
    assert opt.taken_steps == 3
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight)


# ------------------------------------------------------------------ recurrent, weight-normed, grouped layers
class RNNLM(nn.Module):
    def __init__(self, kind, vocab=40, d=16, h=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = getattr(nn, kind)(d, h, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(h, vocab)  # a name no head list has

    def forward(self, x):
        return self.decoder(self.rnn(self.emb(x))[0])


@pytest.mark.parametrize("kind,gates", [("LSTM", 4), ("GRU", 3)])
def test_lstm_and_gru_language_models_bank_one_matrix_per_gate(kind, gates):
    torch.manual_seed(0)
    m = RNNLM(kind)
    x = torch.randint(0, 40, (4, 9), generator=torch.Generator().manual_seed(2))
    opt = ANVIL(m, example_input=x[:, :-1])
    e = {x.name: x for x in opt.plan}
    for layer in (0, 1):
        for w in ("ih", "hh"):
            r = e[f"rnn.weight_{w}_l{layer}"]
            assert r.route.startswith("bank_24x") and r.slots[1] - r.slots[0] == gates, r
            assert "one matrix per gate" in r.reason
    assert e["decoder.weight"].route == e["emb.weight"].route == "adam"
    losses = []
    for _ in range(4):
        loss = nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # a gate's matrix is the weight's rows [i*h, (i+1)*h): the bank is the weight
    bank = next(b for b in opt.matrix_banks if "rnn.weight_hh_l0" in [n for n, *_ in b.plan.members])
    first = e["rnn.weight_hh_l0"].slots[0]
    view = bank.param.view(bank.plan.n_pad, 24, 24)
    assert torch.equal(view[first + 1], m.rnn.weight_hh_l0[24:48])


def test_a_model_of_adam_only_matrices_warns_that_nothing_is_banked():
    torch.manual_seed(0)
    m = RNNLM("LSTM")
    with pytest.warns(UserWarning, match="no parameter was banked"):
        ANVIL(m, adam=lambda n: n.startswith("rnn."), example_input=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("api", ["weight_norm", "parametrizations"])
def test_a_weight_norm_gain_is_not_banked(api):
    torch.manual_seed(0)
    wn = nn.utils.parametrizations.weight_norm if api == "parametrizations" else nn.utils.weight_norm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), wn(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 4))
    for kw in ({}, {"io_layers": "anvil"}):
        opt = ANVIL(m if not kw else copy.deepcopy(m), **kw)
        e = {x.name: x for x in opt.plan}
        g = next(n for n in e if n.endswith(("weight_g", "original0")))
        v = next(n for n in e if n.endswith(("weight_v", "original1")))
        assert e[g].route == "adam" and "a vector, not a matrix" in e[g].reason, e[g]
        assert e[v].route.startswith("bank_16x16")


class ConvNet(nn.Module):
    """A stem, a grouped and a depthwise convolution, a pointwise one, and an output layer named
    ``proj`` (no head name)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pointwise = nn.Conv2d(32, 32, 1)
        self.up = nn.ConvTranspose2d(32, 32, 2, stride=2, groups=2)
        self.proj = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.pointwise(torch.relu(self.depthwise(torch.relu(self.grouped(torch.relu(self.stem(x))))))))
        return self.proj(self.up(h).mean((2, 3)))


def test_grouped_and_depthwise_convolutions_are_banked_per_group():
    torch.manual_seed(0)
    m = ConvNet()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    opt = ANVIL(m, example_input=x)
    e = {x.name: x for x in opt.plan}
    assert e["grouped.weight"].bank_shape[1:] == (8, 36) and e["grouped.weight"].slots == (0, 4)
    assert "groups=4: one matrix per group" in e["grouped.weight"].reason
    assert e["depthwise.weight"].route == "adam" and "depthwise" in e["depthwise.weight"].reason
    assert e["pointwise.weight"].route.startswith("bank_32x32")
    up = e["up.weight"]  # [in 32, out/groups 16, 2, 2]: two groups, each [16 in, 16 * 4] stored [in, out]
    assert up.transposed and up.bank_shape[1:] == (16, 64) and up.slots[1] - up.slots[0] == 2
    assert e["stem.weight"].route == e["proj.weight"].route == "adam"
    # group i's matrix is the output channels [8 i, 8 (i + 1)) of the weight
    bank = next(b for b in opt.matrix_banks if "grouped.weight" in [n for n, *_ in b.plan.members])
    assert torch.equal(bank.param.view(-1, 8, 36)[2], m.grouped.weight[16:24].reshape(8, 36))
    nn.functional.cross_entropy(m(x), torch.tensor([0, 1])).backward()
    before = m.grouped.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, m.grouped.weight) and torch.isfinite(m.grouped.weight).all()


# ------------------------------------------------------------------ add_param_group
def test_add_param_group_routes_unfrozen_layers_by_the_same_rules_and_keeps_the_state():
    m = _mlp()
    for p in m[2].parameters():
        p.requires_grad_(False)  # frozen at construction: left out of the plan
    opt = ANVIL(m)
    assert {e.name for e in opt.plan} == {"0.weight", "0.bias", "4.weight", "4.bias"}
    _train(m, opt, 2)
    ref = copy.deepcopy((m, opt))
    state = {k: v.clone() for k, v in opt.state[m[4].weight].items() if torch.is_tensor(v)}
    n_groups = len(opt.param_groups)
    for p in m[2].parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(m[2].parameters())})
    e = {x.name: x for x in opt.plan}
    # the same rules as a model traced with it: 2.weight a hidden matrix, 2.bias a vector
    assert e["2.weight"].route.startswith("bank_32x32") and e["2.bias"].route == "adam"
    assert e["0.weight"].route == e["4.weight"].route == "adam"
    assert len(opt.param_groups) == 2 >= n_groups and opt.taken_steps == 2
    assert any(p is m[2].weight for g in opt.param_groups for p in g["params"])
    assert all(torch.equal(v, opt.state[m[4].weight][k]) for k, v in state.items())
    _train(m, opt, 2)
    assert opt.taken_steps == 4
    # the parameters that were there train as they did before the addition (their state was kept)
    m_ref, o_ref = ref
    for p in m_ref[2].parameters():
        p.requires_grad_(True)
    o_ref.add_param_group({"params": list(m_ref[2].parameters())})
    _train(m_ref, o_ref, 2)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m_ref.parameters()))
    # a state dict round trip of the grown optimizer
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [m[2].weight]})
    extra = nn.Parameter(torch.randn(32, 32))
    with pytest.raises(ValueError, match="lr=0.5 differs from the anvil group's"):
        opt.add_param_group({"params": [extra], "lr": 0.5})
    with pytest.raises(ValueError, match="unknown keys \\['betas'\\]"):
        opt.add_param_group({"params": [extra], "betas": (0.9, 0.9)})
