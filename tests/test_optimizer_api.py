"""AnvilAndAdam's less travelled public API: ``maps=``, the replicated tied lm_head, and the errors
for parameters on several devices, non-float parameters and a label used twice."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import anvil_ref as A
from anvil_fast.core.bank import anvil_bank_update
from anvil_fast.optim.optimizer import AnvilAndAdam
from anvil_ref.config import ConfigError
from anvil_ref.maps import load_maps
from tests import optimizer_cases as C
from anvil_fast.core import tolerances as TOL

BANK_SHAPE, BANK_RESHAPE = (32, 12), (4, 8, 12)


def _bank_params(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter((0.1 * torch.randn(BANK_SHAPE, generator=g)).bfloat16())
    p.label, p.reshape = "qk_bank", BANK_RESHAPE
    return [("w", p)], torch.randn(BANK_SHAPE, generator=g).bfloat16()


def _bank_opt(maps=None, seed=3):
    params, grad = _bank_params(seed)
    table = {"qk_bank": {"optim": "anvil", "comms": "sharded"}}
    kw = {} if maps is None else {"maps": maps}
    opt = AnvilAndAdam(params, table, bank_update=functools.partial(anvil_bank_update, compile=False),
                       bank_config="faithful", **kw)
    opt.set_rail_scalars(A.rail_scalars(0, 40, engage_step=3))
    params[0][1].grad = grad
    return opt, params[0][1]


def test_maps_reach_the_banks_and_only_them():
    # a step with maps=M equals, bit for bit, a default optimizer whose bank was handed M directly,
    # and differs from the default maps' step
    other = "muon_jordan5"
    opt_m, p_m = _bank_opt(maps=other)
    assert opt_m.banks["qk_bank"].maps == load_maps(other)
    opt_d, p_d = _bank_opt()
    opt_x, p_x = _bank_opt()
    opt_x.banks["qk_bank"].maps = load_maps(other)
    for opt in (opt_m, opt_d, opt_x):
        opt.step(do_adam=False)
    assert torch.equal(p_m.data, p_x.data)
    assert not torch.equal(p_m.data, p_d.data)


def _tied(comms):
    g = torch.Generator().manual_seed(11)
    embed = torch.nn.Parameter(0.1 * torch.randn(40, 8, generator=g))
    lm = torch.nn.Parameter(embed.detach().T.contiguous().clone())
    embed.label, lm.label = "embed", "lm_head"
    row = {"optim": "adam", "comms": comms, "adam_betas": [0.5, 0.95], "wd_mul": 150.0}
    table = {"embed": dict(row), "lm_head": dict(row)}
    return AnvilAndAdam([("embed", embed), ("lm_head", lm)], table), embed, lm, g


@pytest.mark.parametrize("comms", ["replicated", "sharded"])
def test_tied_lm_head_adds_embeds_gradient(comms):
    # the tied pair: lm_head takes Adam on lm_head.grad + embed.grad^T, embed follows as its transpose;
    # checked against anvil_ref.adam in float64, within the table's ADAM_ULPS, over three steps
    opt, embed, lm, g = _tied(comms)
    assert opt.tied and opt.param_cfgs["lm_head"].comms == comms
    cfg = opt.param_cfgs["lm_head"]
    b1, b2 = cfg.adam_betas
    p = lm.detach().double().numpy().copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    for step in (1, 2, 3):
        g_lm, g_embed = torch.randn(8, 40, generator=g), torch.randn(40, 8, generator=g)
        lm.grad, embed.grad = g_lm.clone(), g_embed.clone()
        g_eff = g_lm.double().numpy() + g_embed.double().numpy().T
        terms = C.adam_terms(cfg, p, g_eff, m, v, step)
        ref = A.adam_update(p, g_eff, m, v, step=step, lr=cfg.lr * cfg.lr_mul, beta1=b1, beta2=b2, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, wd_mul=cfg.wd_mul)
        opt.step(do_adam=True)
        err = np.abs(lm.detach().double().numpy() - ref.p)
        assert np.all(err <= TOL.ADAM_ULPS * C.ulp(terms, 23)), (step, float((err / C.ulp(terms, 23)).max()))
        # without embed's gradient the step would move by a visibly different amount
        alone = A.adam_update(p, g_lm.double().numpy(), m, v, step=step, lr=cfg.lr * cfg.lr_mul, beta1=b1,
                              beta2=b2, eps=cfg.eps, weight_decay=cfg.weight_decay, wd_mul=cfg.wd_mul)
        assert np.abs(alone.p - ref.p).max() > 100 * TOL.ADAM_ULPS * C.ulp(terms, 23).max()
        assert torch.equal(embed.data, lm.data.T)
        p, m, v = ref.p, ref.exp_avg, ref.exp_avg_sq


def test_parameters_on_two_devices_are_refused():
    a = torch.nn.Parameter(torch.zeros(4, 4))
    b = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))
    a.label, b.label = "x", "y"
    table = {k: {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.95]} for k in ("x", "y")}
    with pytest.raises(ConfigError, match="one device"):
        AnvilAndAdam([("a", a), ("b", b)], table)


def test_non_float_parameters_are_refused():
    a = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int32), requires_grad=False)
    a.label = "x"
    with pytest.raises(ConfigError, match="floating point"):
        AnvilAndAdam([("a", a)], {"x": {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.95]}})


def test_a_label_used_twice_is_refused():
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    a.label = b.label = "x"
    with pytest.raises(ConfigError, match="more than one parameter"):
        AnvilAndAdam([("a", a), ("b", b)], {"x": {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.95]}})


# ---- the constructor's steps, each alone: classify (read and check), plan (rows), build (state)

def _labelled(label, shape, dtype=torch.float32, reshape=None):
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.label = label
    if reshape is not None:
        p.reshape = reshape
    return p


_TABLE = {"qk_bank": {"optim": "anvil", "comms": "sharded"},
          "embed": {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95]},
          "lm_head": {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95]},
          "gain": {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.99]}}


def _classify(named, **kw):
    from anvil_fast.optim.optimizer import classify_params

    args = dict(scatter_order=None, work_order=None, adam_defaults=A.ADAM_DEFAULTS, anvil_defaults=A.ANVIL_DEFAULTS,
                world_size=1, rank=0, allow_fp32_banks=False, tie_embeddings=None)
    return classify_params(named, _TABLE, **{**args, **kw})


def test_classify_reads_labels_orders_and_the_tied_pair_without_allocating():
    named = [("b", _labelled("qk_bank", (32, 12), torch.bfloat16, BANK_RESHAPE)), ("h", _labelled("lm_head", (4, 16))),
             ("e", _labelled("embed", (16, 4))), ("g", _labelled("gain", (3,)))]
    c = _classify(named, work_order=["gain", "embed", "lm_head", "qk_bank"])
    assert c.labels == ["qk_bank", "lm_head", "embed", "gain"] == c.scatter_order
    assert c.work_order == ["gain", "embed", "lm_head", "qk_bank"]
    assert c.names == {"qk_bank": "b", "lm_head": "h", "embed": "e", "gain": "g"}
    assert c.tied and c.device == torch.device("cpu") and c.param_cfgs["qk_bank"].reshape == BANK_RESHAPE
    assert not _classify(named, tie_embeddings=False).tied


@pytest.mark.parametrize("named,kw,match", [
    ([("b", _labelled("qk_bank", (32, 12), torch.float32, BANK_RESHAPE))], {}, "allow_fp32_banks=True"),
    ([("h", _labelled("lm_head", (4, 16))), ("e", _labelled("embed", (4, 16)))], {}, "2-D transposes"),
    ([("g", _labelled("gain", (3,)))], {"tie_embeddings": True}, "needs both"),
    ([("g", _labelled("gain", (3,))), ("m", _labelled("embed", (16, 4)).to("meta"))], {"tie_embeddings": False},
     "one device"),
])
def test_classify_refuses_before_anything_is_built(named, kw, match):
    for _, p in named:
        if getattr(p, "label", None) is None:  # .to() returns a new tensor without the attribute
            p.label = "embed"
    with pytest.raises(ConfigError, match=match):
        _classify(named, **kw)


def test_plan_rows_and_new_state_follow_the_parameters_order():
    from anvil_fast.optim.optimizer import new_param_states, plan_rows

    named = [("g", _labelled("gain", (3,))), ("b", _labelled("qk_bank", (32, 12), torch.bfloat16, BANK_RESHAPE)),
             ("e", _labelled("embed", (16, 4)))]
    c = _classify(named)
    rows = plan_rows(c.labels, c.param_cfgs)
    assert rows.adam_labels == ["gain", "embed"] and rows.adam_row == {"gain": 0, "embed": 1}
    assert rows.replicated_labels == ["gain"] and rows.bank_labels == ["qk_bank"]
    st = new_param_states(c.params, c.param_cfgs, c.device)
    assert st["qk_bank"]["velocity"].shape == (2, *BANK_RESHAPE) and st["qk_bank"]["mantissa"].dtype == torch.uint16
    assert st["qk_bank"]["lane_energy"].shape == (4, 1, 12)  # 8 x 12 matrices are wide: one lane per column
    assert st["gain"]["exp_avg"].shape == (3,) and st["embed"]["step"] == 0


def test_a_step_updates_its_banks_through_the_captured_graphs_once_they_exist():
    """``bank_update`` stays the eager ``f(bank)``; once ``bank_graphs`` is set (use_cuda_graphs on a
    GPU) every step checks its baked addresses first and replays it instead."""
    opt, p = _bank_opt()
    calls = []

    class Replays:
        def check_all(self):
            calls.append("check")

        def __call__(self, bank):
            calls.append(bank.label)
            opt.bank_update(bank)

    before = p.detach().clone()
    opt.bank_graphs = Replays()
    opt.step(do_adam=False)
    assert calls == ["check", "qk_bank"]
    assert not torch.equal(before, p.detach())
    twin, q = _bank_opt()
    twin.step(do_adam=False)
    assert torch.equal(q.detach(), p.detach())  # the replay is the eager update's twin here
