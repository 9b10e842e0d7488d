"""anvil_ref.optimizer: the reference step over a labelled parameter table (seed semantics minus comms)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import anvil_ref as A
from anvil_ref import ParamSpec, ReferenceAnvilAndAdam

TABLE = {
    "qk_bank": {"optim": "anvil", "comms": "sharded"},
    "mlp_bank": {"optim": "anvil", "comms": "sharded", "wd_mul": 0.5},
    "scalars": {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.99], "lr_mul": 5.0, "wd_mul": 0.0},
    "lm_head": {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95], "wd_mul": 150.0},
    "embed": {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95], "wd_mul": 150.0},
    "unused_entry": {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.9]},
}
SHAPES = {"qk_bank": (32, 12), "mlp_bank": (80, 8), "scalars": (5,), "lm_head": (8, 30), "embed": (30, 8)}
RESHAPES = {"qk_bank": (4, 8, 12), "mlp_bank": (4, 20, 8)}  # wide 8x12 matrices; tall 20x8


def make(seed=0, **kw):
    rng = np.random.default_rng(seed)
    vals = {k: rng.standard_normal(s) * 0.1 for k, s in SHAPES.items()}
    vals["embed"] = vals["lm_head"].T.copy()
    params = {k: ParamSpec(v, RESHAPES.get(k), {2} if k == "mlp_bank" else ()) for k, v in vals.items()}
    opt = ReferenceAnvilAndAdam(params, TABLE, **kw)
    opt.set_rails(0.85, 0.4385)
    for cfg in opt.param_cfgs.values():
        if cfg.optim == "anvil":
            cfg.momentum = 0.9
    return opt


def grads(seed):
    rng = np.random.default_rng(1000 + seed)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


# ------------------------------------------------------------------ configuration
def test_config_multipliers():
    opt = make()
    qk, mlp = opt.param_cfgs["qk_bank"], opt.param_cfgs["mlp_bank"]
    assert qk.lr_mul == 1.0 and qk.per_matrix_lr_mul == (1.0, 1.0, 1.0, 1.0)
    assert mlp.lr_mul == pytest.approx(math.sqrt(20 / 8))
    assert mlp.per_matrix_lr_mul == (1.0, 2.0, 0.0, 2.0)  # odd x2, index 2 frozen
    assert opt.param_cfgs["scalars"].lr == A.ADAM_DEFAULTS["lr"] and qk.lr == A.ANVIL_DEFAULTS["lr"]


# ------------------------------------------------------------------ one step, composed by hand
def expected_bank(opt, label, g, v_fast, v_slow, energy):
    cfg = opt.param_cfgs[label]
    p = opt.params[label].reshape(cfg.reshape)
    r = A.twin_rail(g.reshape(cfg.reshape), v_fast, v_slow, momentum=0.9, fast_beta=0.85, fast_weight=0.4385)
    u, e = A.equalize(A.cascade(r.lookahead), energy, beta2=A.ANVIL_DEFAULTS["beta2"])
    shape_mult = max(1.0, cfg.reshape[1] / cfg.reshape[2]) ** 0.5
    mults = np.array([0.0 if k in cfg.frozen_matrices else (2.0 if label == "mlp_bank" and k % 2 else 1.0)
                      for k in range(cfg.reshape[0])])
    lr = A.ANVIL_DEFAULTS["lr"]
    eff_lr = (TABLE[label].get("lr_mul", 1.0) * shape_mult * mults * lr)[:, None, None]
    eff_wd = TABLE[label].get("wd_mul", 1.0) * A.ANVIL_DEFAULTS["weight_decay"] * lr
    aligned = (r.v_slow * p >= 0)
    return (p - p * aligned * eff_wd * eff_lr - u * eff_lr).reshape(opt.params[label].shape), r, e


def expected_adam(opt, label, g, m, v, t):
    b1, b2 = TABLE[label]["adam_betas"]
    lr = A.ADAM_DEFAULTS["lr"] * TABLE[label].get("lr_mul", 1.0)
    return A.adam_update(opt.params[label], g, m, v, step=t, lr=lr, beta1=b1, beta2=b2,
                         eps=A.ADAM_DEFAULTS["eps"], weight_decay=A.ADAM_DEFAULTS["weight_decay"],
                         wd_mul=TABLE[label].get("wd_mul", 1.0))


def test_one_adam_step_composed_by_hand():
    opt = make()
    g = grads(0)
    z = {k: np.zeros(s) for k, s in SHAPES.items()}
    exp = {}
    for label in ("qk_bank", "mlp_bank"):
        cfg = opt.param_cfgs[label]
        zero_v = np.zeros(cfg.reshape)
        exp[label], _, _ = expected_bank(opt, label, g[label], zero_v, zero_v, np.zeros(A.lane_energy_shape(cfg.reshape)))
    exp["scalars"] = expected_adam(opt, "scalars", g["scalars"], z["scalars"], z["scalars"], 1).p
    lm_grad = g["lm_head"] + g["embed"].T  # tied: embed's gradient is added, transposed
    exp["lm_head"] = expected_adam(opt, "lm_head", lm_grad, z["lm_head"], z["lm_head"], 1).p
    exp["embed"] = exp["lm_head"].T
    opt.step(g, do_adam=True)
    for k in SHAPES:
        np.testing.assert_allclose(opt.params[k], exp[k], rtol=1e-13, atol=1e-15, err_msg=k)
    assert opt.state["embed"]["step"] == 0  # embed's own Adam does not run while tied
    # the frozen matrix (mlp_bank index 2) did not move at all
    np.testing.assert_array_equal(opt.params["mlp_bank"].reshape(4, 20, 8)[2],
                                  make().params["mlp_bank"].reshape(4, 20, 8)[2])


def test_adam_gradients_are_kept_between_adam_steps():
    opt, ref = make(), make()
    g0, g1 = grads(0), grads(1)
    opt.step(g0, do_adam=False)
    # ANVIL moved, Adam did not
    assert not np.array_equal(opt.params["qk_bank"], ref.params["qk_bank"])
    np.testing.assert_array_equal(opt.params["scalars"], ref.params["scalars"])
    opt.step(g1, do_adam=True)
    # Adam saw g0 + g1 in one update (step count 1)
    ref.step({k: g0[k] + g1[k] for k in ("scalars", "lm_head", "embed")}, do_adam=True)
    for k in ("scalars", "lm_head", "embed"):
        np.testing.assert_allclose(opt.params[k], ref.params[k], rtol=1e-14, err_msg=k)
    assert opt.state["scalars"]["step"] == 1


def test_bank_state_over_two_steps():
    opt = make()
    g0, g1 = grads(0), grads(1)
    opt.step(g0, do_adam=False)
    st = opt.state["mlp_bank"]
    exp, r, e = expected_bank(opt, "mlp_bank", g1["mlp_bank"], st["velocity"][0], st["velocity"][1], st["lane_energy"])
    opt.step(g1, do_adam=False)
    np.testing.assert_allclose(opt.params["mlp_bank"], exp, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(opt.state["mlp_bank"]["velocity"][1], r.v_slow, rtol=1e-14)
    np.testing.assert_allclose(opt.state["mlp_bank"]["lane_energy"], e, rtol=1e-14)


def test_untie_copies_moments_transposed_and_then_updates_independently():
    opt = make()
    opt.step(grads(0), do_adam=True)
    opt.copy_lm_state_to_embed()
    lm, em = opt.state["lm_head"], opt.state["embed"]
    assert em["step"] == lm["step"] == 1
    np.testing.assert_array_equal(em["exp_avg"], lm["exp_avg"].T)
    np.testing.assert_array_equal(em["exp_avg_sq"], lm["exp_avg_sq"].T)
    before = {k: opt.params[k].copy() for k in ("lm_head", "embed")}
    m_e, v_e = em["exp_avg"], em["exp_avg_sq"]
    m_l, v_l = lm["exp_avg"], lm["exp_avg_sq"]
    g = grads(1)
    exp_embed = expected_adam(opt, "embed", g["embed"], m_e, v_e, 2).p
    exp_lm = expected_adam(opt, "lm_head", g["lm_head"], m_l, v_l, 2).p  # no embed gradient added now
    opt.step(g, do_adam=True)
    np.testing.assert_allclose(opt.params["embed"], exp_embed, rtol=1e-13)
    np.testing.assert_allclose(opt.params["lm_head"], exp_lm, rtol=1e-13)
    assert not np.allclose(opt.params["embed"], opt.params["lm_head"].T)
    assert not np.array_equal(before["embed"], opt.params["embed"])


def test_reset():
    opt = make()
    opt.step(grads(0), do_adam=True)
    opt.copy_lm_state_to_embed()
    opt.reset()
    assert not opt.split_embed
    for label in ("qk_bank", "mlp_bank"):
        assert np.all(opt.state[label]["velocity"] == 0) and np.all(opt.state[label]["lane_energy"] == 0)
        w32 = opt.params[label].astype(np.float32)
        assert np.all(w32.astype(np.float64) == opt.params[label])  # exactly representable
        assert np.all(w32.view(np.uint32) & 0xFFFF == 0)  # the mantissa half is zero: a bf16 value
    assert opt.state["scalars"]["step"] == 1  # Adam state is not reset (as in the seed)


def test_state_dict_round_trip_continues_identically():
    a = make()
    a.step(grads(0), do_adam=False)
    a.step(grads(1), do_adam=True)
    a.step(grads(2), do_adam=False)  # leaves pending Adam gradients
    sd = a.state_dict()
    b = make(seed=5)  # different initial values: everything must come from the state dict
    b.load_state_dict(sd)
    for t in range(3, 6):
        a.step(grads(t), do_adam=t % 2 == 1)
        b.step(grads(t), do_adam=t % 2 == 1)
    for k in SHAPES:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)
    a.params["scalars"][0] = 123.0
    assert sd["params"]["scalars"][0] != 123.0  # a deep copy


def test_from_named_parameters_reads_seed_attributes():
    params = []
    for name, shape in SHAPES.items():
        p = torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16))
        p.label = name
        if name in RESHAPES:
            p.reshape = RESHAPES[name]
        params.append((name, p))
    params[1][1].frozen_matrices = frozenset({3})
    opt = ReferenceAnvilAndAdam.from_named_parameters(params, TABLE)
    assert opt.param_cfgs["mlp_bank"].per_matrix_lr_mul == (1.0, 2.0, 1.0, 0.0)
    np.testing.assert_array_equal(opt.params["qk_bank"], params[0][1].double().detach().numpy())


# ------------------------------------------------------------------ bad input
def test_bad_gradients_leave_the_optimizer_unchanged():
    opt = make()
    sd = opt.state_dict()
    g = grads(0)
    for bad, match in [({**g, "nope": np.zeros(3)}, "unknown label"),
                       ({**g, "scalars": np.zeros(4)}, "does not match"),
                       ({**g, "mlp_bank": np.full(SHAPES["mlp_bank"], np.nan)}, "non-finite")]:
        with pytest.raises(A.ReferenceInputError, match=match):
            opt.step(bad, do_adam=True)
    after = opt.state_dict()
    for k in SHAPES:
        np.testing.assert_array_equal(after["params"][k], sd["params"][k])
        np.testing.assert_array_equal(after["state"]["qk_bank"]["velocity"], sd["state"]["qk_bank"]["velocity"])


def spec(label):
    return ParamSpec(np.zeros(SHAPES[label]), RESHAPES.get(label))


@pytest.mark.parametrize("params,table,kw,match", [
    ({"nope": ParamSpec(np.zeros(3))}, TABLE, {}, "no entry in param_table"),
    ({"qk_bank": ParamSpec(np.zeros((32, 12)))}, TABLE, {}, "needs a reshape"),
    ({"qk_bank": ParamSpec(np.zeros((32, 12)), (4, 8, 11))}, TABLE, {}, "holds"),
    ({"qk_bank": spec("qk_bank")}, {"qk_bank": {"optim": "anvil", "comms": "replicated"}}, {}, "sharded"),
    ({"scalars": spec("scalars")}, {"scalars": {"optim": "sgd", "comms": "replicated"}}, {}, "optim"),
    ({"scalars": spec("scalars")}, {"scalars": {"optim": "adam", "comms": "replicated"}}, {}, "adam_betas"),
    ({"scalars": spec("scalars")}, TABLE, {"work_order": ["scalars", "scalars"]}, "duplicated"),
    ({"scalars": spec("scalars"), "lm_head": spec("lm_head")}, TABLE, {"scatter_order": ["scalars"]}, "missing"),
    ({"scalars": spec("scalars")}, TABLE, {"scatter_order": ["scalars", "embed"]}, "unknown"),
    ({"lm_head": spec("lm_head"), "embed": ParamSpec(np.zeros((8, 30)))}, TABLE, {}, "transposes"),
])
def test_bad_configuration(params, table, kw, match):
    with pytest.raises(A.ConfigError, match=match):
        ReferenceAnvilAndAdam(params, table, **kw)


def test_duplicate_labels_from_named_parameters():
    a, b = torch.zeros(3), torch.zeros(3)
    a.label = b.label = "scalars"
    with pytest.raises(A.ConfigError, match="more than one"):
        ReferenceAnvilAndAdam.from_named_parameters([("a", a), ("b", b)], TABLE)
    c = torch.zeros(3)
    with pytest.raises(A.ConfigError, match="no .label"):
        ReferenceAnvilAndAdam.from_named_parameters([("c", c)], TABLE)
