"""anvil_fast.kernels.streams: the fork of work onto side streams and its join."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.kernels.streams import run_forked, side_streams


def test_jobs_without_a_stream_run_in_order_on_the_cpu_and_then_runs_last():
    seen = []
    out = run_forked([(None, lambda: seen.append("a") or 1), (None, lambda: seen.append("b") or 2)],
                     torch.device("cpu"), then=lambda: seen.append("then"))
    assert out == [1, 2] and seen == ["a", "b", "then"]


def test_a_job_that_raises_stops_the_rest_and_propagates():
    seen = []

    def bad():
        raise KeyError("job")

    with pytest.raises(KeyError, match="job"):
        run_forked([(None, bad), (None, lambda: seen.append("after"))], torch.device("cpu"),
                   then=lambda: seen.append("then"))
    assert seen == []


def test_side_streams_need_a_cuda_device():
    with pytest.raises(ValueError, match="streams need a CUDA device"):
        side_streams(torch.device("cpu"), 2)


@pytest.mark.gpu
def test_side_streams_are_made_once_and_forked_work_is_joined():
    dev = torch.device("cuda")
    s = side_streams(dev, 2)
    assert side_streams(dev, 2) is s and len({id(x) for x in s}) == 2
    x = torch.randn(2048, 2048, device=dev)
    ref = [x @ x @ x, (x * 2) @ x]
    outs = [torch.empty_like(x) for _ in range(2)]
    # the inputs are written on the main stream just before the fork: each job must see them
    x.mul_(1.0)
    res = run_forked([(s[0], lambda: torch.matmul(x @ x, x, out=outs[0])),
                      (s[1], lambda: torch.matmul(x * 2, x, out=outs[1]))], dev)
    assert len(res) == 2
    # read on the main stream without a synchronization: the join orders it after both jobs
    assert torch.allclose(outs[0], ref[0], rtol=1e-3, atol=1e-1) and torch.allclose(outs[1], ref[1], rtol=1e-3)
