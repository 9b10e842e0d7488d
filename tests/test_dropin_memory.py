"""The drop-in's memory on the CPU and its ``"transient"`` gradient read: an fp32 model's optimizer
holds AdamW's bytes (the rails in place of the moments), no gradient copy and no workspace between
steps, and steps bit for bit as the read through persistent buffers does. Counts of bytes, not times."""

from __future__ import annotations

import warnings

import pytest
import torch

from anvil_fast.bench.common import held_storages
from anvil_fast.models.gpt import GPTConfig, build
from anvil_fast.optim.dropin import NonFiniteGradientWarning
from anvil_fast.optim.entry import ANVIL

#: Two blocks, every bank of several matrices and several shapes; small enough for a quick CPU step.
CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, ctx=32)


def _grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn(p.shape, generator=g, dtype=p.dtype)


def _held(opt, model) -> dict[str, int]:
    ps = list(model.parameters())
    return held_storages(opt, exclude=ps + [p.grad for p in ps if p.grad is not None])


def test_cpu_fp32_model_holds_adamw_memory():
    """Every byte the drop-in holds after two steps and ``zero_grad`` (state, tables, anything a step
    left behind, a gradient it still refers to), against AdamW's on the same model: at most 1.05x. The same count sees the persistent
    buffers of the ``"buffers"`` read (per-bank workspaces and bf16 gradient copies), so it is able
    to fail."""
    counts = {}
    for name, make in (("adamw", lambda m: torch.optim.AdamW(m.parameters())), ("anvil", ANVIL),
                       ("buffers", lambda m: ANVIL(m, grad_read="buffers"))):
        m = build(CFG, seed=0)
        opt = make(m)
        for s in range(2):
            _grads(m, s)
            opt.step()
        opt.zero_grad(set_to_none=True)  # a gradient the optimizer still refers to counts as held
        counts[name] = sum(held_storages(opt, exclude=list(m.parameters())).values())
    assert counts["anvil"] <= 1.05 * counts["adamw"], counts
    assert counts["buffers"] > 1.5 * counts["adamw"], counts


def test_transient_read_keeps_nothing_between_steps():
    m = build(CFG, seed=0)
    opt = ANVIL(m)
    assert opt.grad_read == "transient"
    _grads(m, 0)
    opt.step()
    for label, bank in opt.inner.banks.items():
        assert bank.grad is None and bank.workspace is None, label
    assert opt.inner.replicated is None  # every Adam parameter keeps its own state: no flat gradient buffer
    assert not [p for p in _held(opt, m) if "grad" in p or "workspace" in p]


def _state_tensors(opt) -> list[tuple[str, torch.Tensor]]:
    out = []
    for label, st in sorted(opt.inner.param_states.items()):
        out += [(f"{label}.{k}", v) for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("lean", [False, True], ids=["fp32_rails", "bf16_rails"])
def test_transient_read_equals_buffers_bit_for_bit(lean):
    """The same steps through both reads: plain steps, a step where a banked member and an Adam
    parameter have no gradient, strided gradients, a step refused for an fp32 gradient past bf16's
    range in a bank (finite in fp32, infinite as the bf16 it travels in) and one for a NaN in an Adam
    gradient. Weights and every state tensor equal bit for bit, and the same steps are refused."""
    kw = dict(rails_dtype=torch.bfloat16) if lean else {}
    ma, mb = build(CFG, seed=0), build(CFG, seed=0)
    oa, ob = ANVIL(ma, grad_read="transient", **kw), ANVIL(mb, grad_read="buffers", **kw)
    member = "blocks.0.attn.qkv.weight"
    adam = "wte.weight"
    assert any(member == n for b in oa.matrix_banks for n, *_ in b.plan.members)
    assert adam in dict(oa.adam_params)
    warned = {}
    for step in range(7):
        for m in (ma, mb):
            _grads(m, step)
            named = dict(m.named_parameters())
            if step == 2:
                named[member].grad = None
                named[adam].grad = None
            if step == 3:
                g = named["blocks.1.ln2.bias"].grad
                named["blocks.1.ln2.bias"].grad = torch.stack([g, g], 1)[:, 0]  # strided (an Adam parameter)
                g = named["blocks.1.mlp.fc.weight"].grad
                named["blocks.1.mlp.fc.weight"].grad = g.t().contiguous().t()  # strided (a bank member)
            if step == 4:
                named[member].grad[0, 0] = 3.4e38  # finite in fp32, rounds to inf in bf16
            if step == 5:
                named[adam].grad[1, 1] = float("nan")
        for name, opt in (("a", oa), ("b", ob)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            warned[name, step] = sum(issubclass(w.category, NonFiniteGradientWarning) for w in caught)
        for (na, pa), (nb, pb) in zip(ma.named_parameters(), mb.named_parameters()):
            assert torch.equal(pa.detach().view(torch.uint8), pb.detach().view(torch.uint8)), (step, na)
        sa, sb = _state_tensors(oa), _state_tensors(ob)
        assert [k for k, _ in sa] == [k for k, _ in sb]
        for (k, ta), (_, tb) in zip(sa, sb):
            assert ta.shape == tb.shape and torch.equal(ta.reshape(-1).view(torch.uint8),
                                                        tb.reshape(-1).view(torch.uint8)), (step, k)
        assert warned["a", step] == warned["b", step], step
    assert warned["a", 4] == 1 and warned["a", 5] == 1 and oa.skipped_steps == ob.skipped_steps == 2


def test_transient_read_is_the_one_process_cpu_read():
    m = build(CFG, seed=0)
    with pytest.raises(ValueError, match="grad_read must be None or one of"):
        ANVIL(m, grad_read="copy")
