"""anvil_fast.graphs: bank updates as CUDA graphs, and the check that baked addresses are live.

On CPU: the address bookkeeping (what a capture bakes; a rebound parameter or state tensor is
detected and named). On a GPU (gpu marker): capture changes nothing, replays equal the eager
updates bit for bit over several steps, and a rebound parameter stops the replay with an error."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.graphs import BankUpdateGraphs, StaleGraphError, baked_addresses, check_addresses
from anvil_fast.optimizer import AnvilAndAdam
from tests import optimizer_cases as C


def _opt(device="cpu", seed=0):
    import functools

    from anvil_fast.bank import anvil_bank_update

    # compile=False: graphs of the eager update (Triton kernels + torch ops); the compiled update's
    # capture runs in the optimizer benchmark and the scaling measurements
    return AnvilAndAdam(C.make_params(seed, device=device), C.TABLE, C.SCATTER, C.WORK, bank_config="faithful",
                        bank_update=functools.partial(anvil_bank_update, compile=False))


def test_baked_addresses_detect_rebinding():
    opt = _opt()
    baked = {l: baked_addresses(opt, l) for l in opt.bank_labels}
    assert {"bank.grad", "bank.eff_lr", "live.p_slice", "live.velocity", "workspace.X"} <= set(baked["qk_bank"])
    for l in opt.bank_labels:
        check_addresses(opt, l, baked[l])
    C.accumulate(opt.params, {l: g for l, g in C.gradients(0).items() if l in C.DENSE})
    opt.step(do_adam=True)
    opt.load_state_dict(opt.state_dict())  # in place: still the same memory
    for l in opt.bank_labels:
        check_addresses(opt, l, baked[l])
    opt.params["vo_bank"].data = opt.params["vo_bank"].data.clone()  # e.g. model.to() or assign=True
    with pytest.raises(StaleGraphError, match="bank 'vo_bank'.*live.p_slice"):
        check_addresses(opt, "vo_bank", baked["vo_bank"])
    opt.param_states["mlp_bank"]["velocity"] = opt.param_states["mlp_bank"]["velocity"].clone()
    with pytest.raises(StaleGraphError, match="mlp_bank.*live.velocity"):
        check_addresses(opt, "mlp_bank", baked["mlp_bank"])


def test_graphs_need_cuda():
    with pytest.raises(RuntimeError, match="CUDA graphs need"):
        BankUpdateGraphs(_opt())


@pytest.mark.gpu
def test_replays_equal_eager_updates_bitwise():
    eager, graphed = _opt("cuda"), _opt("cuda")
    before = {l: v.clone() for l, v in graphed.param_states["qk_bank"].items() if isinstance(v, torch.Tensor)}
    graphs = graphed.use_cuda_graphs()
    for k, v in before.items():  # capture (with its warm-up runs) changed nothing
        assert torch.equal(graphed.param_states["qk_bank"][k], v)
    for t in range(4):
        for opt in (eager, graphed):
            C.set_hyper(opt, t)
            C.accumulate(opt.params, {l: g for l, g in C.gradients(t, device="cuda").items() if l in C.DENSE})
            opt.step(do_adam=t % 2 == 1)
    for l in eager.labels:
        assert torch.equal(eager.params[l].data, graphed.params[l].data), l
    graphs.check_all()
    graphed.params["qk_bank"].data = graphed.params["qk_bank"].data.clone()
    C.accumulate(graphed.params, {l: g for l, g in C.gradients(9, device="cuda").items() if l in C.DENSE})
    with pytest.raises(StaleGraphError, match="qk_bank"):
        graphed.step(do_adam=False)
