"""anvil_fast.optim.replicated_adam: the small Adam parameters on flat buffers (one all-reduce and one
fused pass per dtype), through the fast optimizer."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.parallel.comms import LocalComms
from anvil_fast.optim.optimizer import AnvilAndAdam
from tests import optimizer_cases as C


def _opt(log=None):
    comms = C.RecordingComms(LocalComms(), log) if log is not None else None
    return AnvilAndAdam(C.make_params(), C.TABLE, C.SCATTER, C.WORK, comms=comms, bank_config="faithful")


def test_flat_buffers_hold_values_and_moments_as_views():
    ps = dict(C.make_params())
    want = {l: ps[f"model.{l}"].data.clone() for l in ("scalars", "gates")}
    opt = _opt()
    rep = opt.replicated
    assert [g.dtype for g in rep.groups] == [torch.float32, torch.bfloat16]  # one group per dtype
    for g in rep.groups:
        for label, p, span in zip(g.labels, g.params, g.spans):
            assert p.data.data_ptr() == g.param[span].data_ptr()
            assert torch.equal(p.data, want[label])  # re-pointing copied bits exactly
            assert opt.param_states[label]["exp_avg"].data_ptr() == g.exp_avg[span].data_ptr()
            assert torch.all(g.segment[span] == opt.adam_row[label])
    rep.check_views(opt.param_states)
    opt.params["gates"].data = opt.params["gates"].data.clone()
    with pytest.raises(RuntimeError, match="gates: its parameter no longer lives"):
        rep.check_views(opt.param_states)


def test_one_all_reduce_per_dtype_and_only_on_adam_steps():
    log = []
    opt = _opt(log)
    C.accumulate(opt.params, {l: g for l, g in C.gradients(0).items() if l in C.DENSE})
    opt.step(do_adam=False)
    flat = {g.grad.data_ptr() for g in opt.replicated.groups}
    assert not [x for op, x in log if op == "all_reduce"]
    opt.step(do_adam=True)
    reduces = [x for op, x in log if op == "all_reduce"]
    assert sorted(reduces) == sorted(flat)


def test_parameter_without_gradient_is_left_alone():
    opt = _opt()
    g = C.gradients(0)
    C.accumulate(opt.params, {l: g[l] for l in C.DENSE})
    opt.step(do_adam=True)  # every replicated parameter has moments now
    C.accumulate(opt.params, {l: g[l] for l in C.DENSE if l != "gates"})
    st = opt.param_states["gates"]
    before = [opt.params["gates"].data.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
    assert all(torch.count_nonzero(t) > 0 for t in before)
    opt.step(do_adam=True)
    after = [opt.params["gates"].data, st["exp_avg"], st["exp_avg_sq"]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert st["step"] == 1 and opt.param_states["scalars"]["step"] == 2
    C.accumulate(opt.params, {"gates": g["gates"]})  # a gradient again: it moves, its step count goes on
    opt.step(do_adam=True)
    assert not torch.equal(opt.params["gates"].data, before[0]) and st["step"] == 2


def test_inactive_member_of_a_group_is_masked():
    """Two fp32 parameters in one flat group, one without a gradient: the fused pass runs over
    both, and the inactive row must leave the other's value and moments exactly as they were."""
    table = {n: {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.99]} for n in ("a", "b")}
    ps = []
    gen = torch.Generator().manual_seed(101)
    for n, shape in (("a", (5,)), ("b", (3,))):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.label = n
        ps.append((n, p))
    opt = AnvilAndAdam(ps, table)
    assert len(opt.replicated.groups) == 1
    for p in opt.params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step(do_adam=True)
    b = opt.params["b"]
    before = [b.data.clone(), opt.param_states["b"]["exp_avg"].clone(), opt.param_states["b"]["exp_avg_sq"].clone()]
    opt.params["a"].grad = torch.randn(5, generator=gen)
    opt.step(do_adam=True)
    after = [b.data, opt.param_states["b"]["exp_avg"], opt.param_states["b"]["exp_avg_sq"]]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert opt.param_states["a"]["step"] == 2 and opt.param_states["b"]["step"] == 1
