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
