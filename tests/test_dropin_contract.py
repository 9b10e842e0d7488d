"""The drop-in keeps torch.optim.Optimizer's contract: copies and pickling, the state dict's format,
its hooks and torch.distributed.checkpoint's helpers, loading by position, torch's errors and
warnings for bad parameter lists, and the behaviours torch's generic optimizer tests check, each
said here in the package's own words."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import anvil_fast
from anvil_fast.optim.dropin import DropInAnvil
from anvil_fast.optim.entry import ANVIL
from anvil_ref.config import ConfigError

DATA = Path(__file__).resolve().parent / "data"


class Small(nn.Module):
    """The model of tests/data/dropin_state_anvil1.pt (same names, shapes and initialization)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.up = nn.Linear(8, 16)
        self.head = nn.Linear(8, 12, bias=False)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        h = self.emb(x)
        h = h + self.b(torch.relu(self.a(h))) + self.up(h)[..., :8]
        return self.head(h) * self.gain


def _small(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Small().to(dtype)


def _ids(seed=1):
    return torch.randint(0, 12, (4, 6), generator=torch.Generator().manual_seed(seed))


def _train(m, opt, steps, seed=1):
    x = _ids(seed)
    out = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _same(m1, m2):
    return all(torch.equal(_bits(p), _bits(q)) for p, q in zip(m1.parameters(), m2.parameters()))


# ------------------------------------------------------------------ 9: copies
def test_deepcopy_of_model_and_optimizer_trains_the_copy_and_leaves_the_original():
    m = _small(dtype=torch.bfloat16)
    opt = ANVIL(m, rails="record", total_steps=20)
    _train(m, opt, 3)
    m2, opt2 = copy.deepcopy((m, opt))
    assert opt2.taken_steps == 3 and opt2 is not opt
    frozen = [p.detach().clone() for p in m.parameters()]
    after_copy = _train(m2, opt2, 3)
    assert all(torch.equal(a, p) for a, p in zip(frozen, m.parameters()))  # the original is untouched
    assert not _same(m, m2)
    assert _train(m, opt, 3) == after_copy and _same(m, m2)  # and continues as the copy did, bit for bit


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_and_torch_save_round_trip(how):
    m = _small()
    opt = ANVIL(m, adam=lambda n: n == "up.weight")  # a lambda in the arguments
    _train(m, opt, 2)
    if how == "pickle":
        m2, opt2 = pickle.loads(pickle.dumps((m, opt)))
    else:
        buf = io.BytesIO()
        torch.save((m, opt), buf)
        buf.seek(0)
        m2, opt2 = torch.load(buf, weights_only=False)
    assert {e.name: e.route for e in opt2.plan} == {e.name: e.route for e in opt.plan}
    assert _train(m2, opt2, 2) == _train(m, opt, 2) and _same(m, m2)


# ------------------------------------------------------------------ 10: hooks
def test_every_state_dict_hook_fires_in_order():
    opt = ANVIL(_small())
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post") or {**sd, "mark": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load_pre", sd.pop("mark"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = opt.state_dict()
    assert sd["mark"] == 1
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", ("load_pre", 1), "load_post"]


# ------------------------------------------------------------------ 11: torch's format
def test_state_dict_is_in_torchs_format():
    m = _small()
    opt = ANVIL(m)
    _train(m, opt, 1)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    flat = [i for g in sd["param_groups"] for i in g["params"]]
    assert flat == list(range(len(flat))) and set(sd["state"]) == set(flat)
    groups = {g["kind"]: g for g in sd["param_groups"]}
    assert groups["anvil"]["param_names"] == ["a.weight", "b.weight", "up.weight"]
    assert set(groups["adam"]["param_names"]) == {"emb.weight", "up.bias", "head.weight", "gain"}
    by_name = dict(zip([n for g in sd["param_groups"] for n in g["param_names"]], flat))
    # a float32 matrix is its own master: its rails and lanes only (a bf16 one keeps a mantissa too)
    assert set(sd["state"][by_name["a.weight"]]) == {"fast_rail", "slow_rail", "lane_energy"}
    assert sd["state"][by_name["gain"]]["step"] == 1
    extras = sd["param_groups"][0]["anvil_fast"]
    assert extras["taken_steps"] == 1 and extras["format"] == "anvil_fast.ANVIL/2"
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)  # tensors and plain containers only


def test_get_and_set_optimizer_state_dict_of_torch_distributed_checkpoint():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    m = _small()
    opt = ANVIL(m, rails="record", total_steps=20)
    _train(m, opt, 2)
    osd = get_optimizer_state_dict(m, opt)
    assert "a.weight" in osd["state"] and "gain" in osd["state"]
    model_sd = copy.deepcopy(m.state_dict())
    osd = copy.deepcopy(osd)
    after = _train(m, opt, 2)
    m2 = _small(seed=5)
    opt2 = ANVIL(m2, rails="record", total_steps=20)
    m2.load_state_dict(model_sd)
    set_optimizer_state_dict(m2, opt2, osd)
    assert opt2.taken_steps == 2  # the optimizer-wide values travel in the first param group
    assert _train(m2, opt2, 2) == after and _same(m, m2)


def test_torch_distributed_checkpoint_save_and_load_of_the_state_dict(tmp_path):
    """dcp.load hands the non-tensor values of an int-keyed state back under the key's string ("3"
    beside 3): load_state_dict merges them (the one-process step keeps Adam's step as a 0-D tensor,
    which dcp returns in place; the merge itself is tested with a hand-made re-keyed dict)."""
    import torch.distributed.checkpoint as dcp

    m = _small()
    opt = ANVIL(m, rails="record", total_steps=20)
    _train(m, opt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # single process: no process group
        dcp.save({"model": m.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
        after = _train(m, opt, 2)
        m2 = _small(seed=6)
        opt2 = ANVIL(m2, rails="record", total_steps=20)
        sd = {"model": m2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(sd, checkpoint_id=str(tmp_path))
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    assert opt2.state[m2.gain]["step"] == 2 and opt2.taken_steps == 2
    assert _train(m2, opt2, 2) == after and _same(m, m2)


def test_loads_by_position_into_a_wrapped_model_and_one_built_from_parameters():
    m = _small()
    opt = ANVIL(m)
    _train(m, opt, 2)
    sd, model_sd = copy.deepcopy(opt.state_dict()), copy.deepcopy(m.state_dict())
    after = _train(m, opt, 2)
    for build in ("wrapped", "parameters"):
        m2 = _small(seed=3)
        m2.load_state_dict(model_sd)
        if build == "wrapped":
            opt2 = ANVIL(nn.Sequential(m2))  # every name gains a "0." prefix
            assert opt2.plan[0].name.startswith("0.")
        else:
            opt2 = ANVIL(m2.parameters())
        opt2.load_state_dict(sd)
        assert _train(m2, opt2, 2) == after and _same(m, m2), build


def test_a_state_dict_of_another_plan_is_refused_before_anything_is_written():
    m = _small()
    opt = ANVIL(m)
    _train(m, opt, 1)
    sd = opt.state_dict()
    other = ANVIL(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="routes its parameters differently"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="not an anvil_fast.ANVIL state dict"):
        opt.load_state_dict(torch.optim.AdamW(m.parameters()).state_dict())
    sd["state"][0]["fast_rail"] = sd["state"][0]["fast_rail"][:1]
    before = {k: v.clone() for k, v in opt.state[m.a.weight].items()}
    with pytest.raises(ValueError, match=r"a.weight.fast_rail: saved torch.float32 \(1, 8\), expected torch.float32 "
                                         r"\(8, 8\)"):
        opt.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in opt.state[m.a.weight].items())


def test_a_state_dict_routing_otherwise_is_adopted_by_name():
    """Saved by an optimizer built with example_input= (its trace moved layers to Adam), loaded by one
    built without it (fc banked by the fallback): the loading optimizer takes the saved plan."""
    from tests.test_dropin_roles import ResNetLike, _images

    torch.manual_seed(0)
    m = ResNetLike()
    opt = ANVIL(m, example_input=_images())
    y = torch.arange(4)
    for _ in range(2):
        nn.functional.cross_entropy(m(_images()), y).backward()
        opt.step()
        opt.zero_grad()
    assert {e.name: e.route for e in opt.plan}["fc.weight"] == "adam"
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(m.state_dict())
    torch.manual_seed(1)
    m2 = ResNetLike()
    m2.load_state_dict(msd)
    with pytest.warns(UserWarning, match="example_input="):
        opt2 = ANVIL(m2)  # not traced: fc banked
    assert {e.name: e.route for e in opt2.plan}["fc.weight"] != "adam"
    opt2.load_state_dict(sd)
    assert {e.name: e.route for e in opt2.plan} == {e.name: e.route for e in opt.plan}
    for model, o in ((m, opt), (m2, opt2)):
        nn.functional.cross_entropy(model(_images(1)), y).backward()
        o.step()
    assert _same(m, m2)


def test_a_state_dict_of_the_label_keyed_format_still_loads():
    """tests/data/dropin_state_anvil1.pt: a bf16 Small after 3 steps with rails="record",
    total_steps=10, saved in the format anvil_fast.ANVIL/1 (state keyed by bank label and Adam name,
    the inner anvil_fast.AnvilAndAdam/1 dict under "anvil"), kept as data since the package writes
    torch's format now. Its tensors land in the live state unchanged, and training continues as a
    twin that never stopped."""
    ck = torch.load(DATA / "dropin_state_anvil1.pt", weights_only=True)
    old = ck["optim"]
    assert old["format"] == "anvil_fast.ANVIL/1" and old["anvil"]["format"] == "anvil_fast.AnvilAndAdam/1"
    m = _small(seed=9, dtype=torch.bfloat16)
    m.load_state_dict(ck["model"])
    opt = ANVIL(m, rails="record", total_steps=10)
    opt.load_state_dict(old)
    assert opt.banks == ck["banks"] and opt.taken_steps == 3
    vel = old["anvil"]["state"]["bank_8x8_bfloat16"]["velocity"]
    assert torch.equal(opt.state[m.b.weight]["slow_rail"], vel[1, 1])
    assert torch.equal(opt.state[m.b.weight]["mantissa"], old["anvil"]["state"]["bank_8x8_bfloat16"]["mantissa"][1])
    assert opt.state[m.gain]["step"] == old["anvil"]["state"]["gain"]["step"] == 3
    twin = _small(dtype=torch.bfloat16)  # the run that wrote the file, continued without saving
    t_opt = ANVIL(twin, rails="record", total_steps=10)
    _train(twin, t_opt, 3)
    assert _same(twin, m)
    assert _train(m, opt, 2, seed=4) == _train(twin, t_opt, 2, seed=4) and _same(twin, m)


def test_float32_matrix_state_without_or_with_a_mantissa_loads():
    """A float32 matrix is its own master: a saved "mantissa" entry it has no use for is ignored."""
    m = _small()
    opt = ANVIL(m)
    _train(m, opt, 1)
    sd = opt.state_dict()
    live = set(opt.state[m.a.weight])
    if "mantissa" in live:  # this engine keeps one: a dict without it must name what is missing
        del sd["state"][0]["mantissa"]
        with pytest.raises(ValueError, match="a.weight: saved state"):
            opt.load_state_dict(sd)
    else:
        sd["state"][0]["mantissa"] = torch.zeros(8, 8, dtype=torch.uint16)
        opt.load_state_dict(sd)


# ------------------------------------------------------------------ 12: parameter lists as torch reads them
def test_bare_tensor_duplicates_and_mixed_names_as_torch():
    w = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable"):
        ANVIL(w)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = ANVIL([w, w, nn.Parameter(torch.randn(4))])
    assert len([p for g in opt.param_groups for p in g["params"]]) == 2
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        ANVIL([("w", w), nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        ANVIL([w * 2])
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        ANVIL([w], lr=torch.tensor([0.01, 0.01]))


def test_a_non_contiguous_adam_parameter_is_accepted():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 10)
            self.scale = nn.Parameter(torch.randn(10, 2)[:, 0])  # non-contiguous, as torch's tests make them
            self.table = nn.Parameter(torch.randn(6, 5).t())  # 2-D, non-contiguous

    m = M()
    assert not m.scale.is_contiguous() and not m.table.is_contiguous()
    value = m.table.detach().clone()
    opt = ANVIL(m, adam=["table"])
    assert torch.equal(m.table, value)
    m.scale.grad = torch.ones(10)
    m.table.grad = torch.ones(5, 6)
    m.lin.weight.grad = torch.ones(10, 5)
    opt.step()
    assert not torch.equal(m.table, value)


# ------------------------------------------------------------------ 13: meta models
def test_a_meta_model_is_refused_with_the_fix():
    with torch.device("meta"):
        m = Small()
    with pytest.raises(ConfigError, match="meta device.*to_empty"):
        ANVIL(m)
    m.to_empty(device="cpu")
    for p in m.parameters():
        nn.init.normal_(p, std=0.1)
    _train(m, ANVIL(m), 1)


# ------------------------------------------------------------------ 14
def test_head_names_is_importable_from_the_package():
    assert anvil_fast.HEAD_NAMES == ("lm_head", "head", "classifier", "fc_out", "output_layer")
    assg = inspect.signature(DropInAnvil).parameters["head_names"].default
    assert assg is anvil_fast.HEAD_NAMES


# ------------------------------------------------------------------ torch's generic optimizer checks, in our words
def test_closure_loss_is_returned_and_steps_go_downhill():
    w = nn.Parameter(torch.randn(10, 5, generator=torch.Generator().manual_seed(0)))
    b = nn.Parameter(torch.randn(10, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(5, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = ANVIL([w, b], lr=0.02, adam_lr=0.05)

    def closure():
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(20):
        assert isinstance(opt.step(closure), torch.Tensor)
    assert closure().item() < first


def test_steps_without_any_gradient_change_nothing():
    m = _small()
    opt = ANVIL(m)
    _train(m, opt, 1)
    before = [p.detach().clone() for p in m.parameters()]
    state = {k: v.clone() for k, v in opt.state[m.a.weight].items()}
    opt.step()  # every .grad is None
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert all(torch.equal(state[k], v) for k, v in opt.state[m.a.weight].items())


def test_state_dict_round_trip_is_deterministic_and_leaves_the_saved_dict_alone():
    m = _small()
    opt = ANVIL(m)
    _train(m, opt, 2)
    sd = opt.state_dict()
    kept = copy.deepcopy(sd)
    m2 = _small(seed=4)
    m2.load_state_dict(m.state_dict())
    opt2 = ANVIL(m2)
    opt2.load_state_dict(sd)
    _assert_same_dict(opt.state_dict(), opt2.state_dict())
    _assert_same_dict(sd, kept)
    _train(m, opt, 1)
    _assert_same_dict(sd, kept)  # copies, not the live tensors


def _assert_same_dict(a, b, where="sd"):
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_dict(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_dict(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), where
    else:
        assert a == b, where


def test_lr_schedulers_see_both_groups_and_profile_hooks_run():
    m = _small()
    opt = ANVIL(m)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    h = register_optimizer_step_post_hook(lambda o, a, k: seen.append(type(o).__name__))
    try:
        _train(m, opt, 2)
        sched.step()
    finally:
        h.remove()
    assert seen == ["DropInAnvil", "DropInAnvil"]  # the class anvil_fast.ANVIL built
    assert [g["lr"] for g in opt.param_groups] == [0.023 * 0.5, 0.008 * 0.5]
    assert "DropInAnvil" in repr(opt)


def test_the_step_runs_torchs_wrapper_exactly_when_a_hook_or_profiler_would_see_it(monkeypatch):
    """The step skips torch.optim's per-call profiler range and hook loops when nothing would see them
    (lean_step), and runs them, as torch does, when a hook is registered or a profiler is on: instance
    pre-hooks (which may replace the arguments) and post-hooks, a profiler's Optimizer.step range; always
    without autograd, the closure with it, the caller's grad mode restored."""
    m = _small()
    opt = ANVIL(m)
    ranges = []
    real = torch.autograd.profiler.record_function
    monkeypatch.setattr(torch.autograd.profiler, "record_function", lambda name, *a: ranges.append(name) or real(name, *a))
    calls = []
    x = _ids()

    def closure():
        calls.append(("closure grad", torch.is_grad_enabled()))
        loss = nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
        calls.append(("after grad", torch.is_grad_enabled()))
    with torch.no_grad():
        opt.step(closure)
        calls.append(("after no_grad", torch.is_grad_enabled()))
    assert calls == [("closure grad", True), ("after grad", True), ("closure grad", True), ("after no_grad", False)]
    assert ranges == []  # no hook, no profiler: torch's range and hook loops were not run

    calls.clear()
    # torch's hook contract: the arguments it returns replace the step's (the optimizer first)
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre") or ((o,), {"closure": closure}))
    post = opt.register_step_post_hook(lambda o, a, k: calls.append(("post", tuple(k))))
    before = opt.taken_steps
    assert opt.step() is not None  # the pre-hook's closure ran: torch's wrapper passed its arguments on
    assert opt.taken_steps == before + 1
    assert calls == ["pre", ("closure grad", True), ("post", ("closure",))]
    assert ranges == ["Optimizer.step#DropInAnvil.step"]
    pre.remove()
    post.remove()

    opt.zero_grad()
    _train(m, opt, 1)  # no hook: the lean path, which the profiler below must not be confused by
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(m, opt, 1)
    names = [e.name for e in prof.events()]
    assert "Optimizer.step#DropInAnvil.step" in names


def test_parameters_that_need_no_gradient_are_held_and_left_alone():
    """torch's optimizers hold parameters given without requires_grad: a step leaves them as they are."""
    ps = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = ANVIL(ps)
    kept = [p.clone() for p in ps]
    assert opt.step(lambda: torch.tensor([1.0])).item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(kept, ps))
    with pytest.raises(ValueError, match="empty parameter list"):
        ANVIL([])


def test_entries_a_hook_puts_into_opt_state_travel_as_torchs_do():
    opt = ANVIL(_small())
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("note", 1))
    sd = opt.state_dict()
    assert sd["state"]["note"] == 1
    opt.state.pop("note")
    opt.load_state_dict(sd)
    assert opt.state["note"] == 1


def test_a_state_re_keyed_by_the_checkpoint_library_is_merged_back():
    """torch.distributed.checkpoint returns the non-tensor values of an int-keyed state under the
    key's string; the loader merges "3" into 3 (here a dict with an int step, as the several-rank
    path keeps it)."""
    from anvil_fast.optim.dropin import merged_state_keys

    m_ = torch.zeros(2)
    state = {3: {"exp_avg": m_}, "3": {"step": 7}, 4: {"exp_avg": m_, "step": 1}, "note": {"k": 1}}
    out = merged_state_keys(state)
    assert out == {3: {"exp_avg": m_, "step": 7}, 4: {"exp_avg": m_, "step": 1}, "note": {"k": 1}}
