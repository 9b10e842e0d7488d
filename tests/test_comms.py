"""anvil_fast.parallel.comms in one process: LocalComms (the world-size-1 schedule), NullComms (the timing
stand-in), handles, and the choice of backend. The process-group backends (gloo here, NCCL on the
GPU machine) are exercised in tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.parallel.comms import DONE, Handle, LocalComms, NullComms, resolve_comms


def test_local_comms_is_the_world_size_one_case():
    c = LocalComms()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(101))
    out = torch.empty(4, 3)
    c.reduce_scatter_avg(out, x).wait()
    assert torch.equal(out, x)
    y = x.clone()
    c.all_reduce_avg(y).wait()
    assert torch.equal(y, x)
    full = torch.randn(6, generator=torch.Generator().manual_seed(102))
    before = full.clone()
    c.all_gather(full, full).wait()  # in place: nothing to do
    assert torch.equal(full, before)
    with pytest.raises(ValueError, match="not 1 x"):
        c.reduce_scatter_avg(torch.empty(3), torch.empty(4))


def test_null_comms_moves_nothing_but_checks_shapes():
    c = NullComms(world_size=4, rank=3)
    out = torch.full((2,), 7.0)
    c.reduce_scatter_avg(out, torch.ones(8)).wait()
    assert torch.equal(out, torch.full((2,), 7.0))
    with pytest.raises(ValueError, match="not 4 x"):
        c.all_gather(torch.empty(7), torch.empty(2))
    with pytest.raises(ValueError, match="outside world_size"):
        NullComms(world_size=2, rank=2)


def test_handle_runs_its_finish_once():
    calls = []

    class Work:
        def wait(self):
            calls.append("work")

    h = Handle(Work(), lambda: calls.append("then"))
    assert not h.done
    h.wait()
    h.wait()
    assert calls == ["work", "then"] and h.done and DONE.done


def test_resolve_comms_without_a_process_group():
    assert isinstance(resolve_comms(None), LocalComms)
    n = NullComms(2, 0)
    assert resolve_comms(n) is n
