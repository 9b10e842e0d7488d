"""anvil_fast.replicated_adam: the small Adam parameters on flat buffers (one all-reduce and one
fused pass per dtype), through the fast optimizer."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.comms import LocalComms
from anvil_fast.optimizer import AnvilAndAdam
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
    C.accumulate(opt.params, {l: g[l] for l in C.DENSE if l != "gates"})
    before = opt.params["gates"].data.clone()
    m0 = opt.param_states["gates"]["exp_avg"].clone()
    opt.step(do_adam=True)
    assert torch.equal(opt.params["gates"].data, before) and torch.equal(opt.param_states["gates"]["exp_avg"], m0)
    assert opt.param_states["gates"]["step"] == 0 and opt.param_states["scalars"]["step"] == 1
    C.accumulate(opt.params, {"gates": g["gates"]})  # now it has one: it moves, its step count starts
    opt.step(do_adam=True)
    assert not torch.equal(opt.params["gates"].data, before) and opt.param_states["gates"]["step"] == 1
