"""anvil_fast.kernels.timing: the package's one set of timers, and the sites that time through it."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest
import torch

import anvil_fast
from anvil_fast.kernels import timing

ROOT = Path(anvil_fast.__file__).parent


def test_median_ms_of_back_to_back_calls_on_cpu():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    ms = timing.median_ms(fn, n=3, warmup=2, device="cpu", calls=4)
    assert len(calls) == 2 + 3 * 4
    assert 1.5 <= ms <= 50.0  # per call, not per sample of 4


def test_call_times_counts_and_keeps_between_out_of_the_timed_part():
    order = []
    dev, host = timing.call_times(lambda: order.append("call"), "cpu", n=3, between=lambda: (order.append("between"),
                                                                                          time.sleep(0.02)))
    assert order == ["call", "between", "call", "between", "call"]
    assert len(dev) == len(host) == 3 and dev == host and max(host) < 15.0
    dev, host = timing.call_times(lambda: None, "cpu", rep_ms=1.0, min_calls=5)
    assert len(host) >= 5
    with pytest.raises(ValueError, match="n or rep_ms"):
        timing.call_times(lambda: None, "cpu", n=2, rep_ms=1.0)



def test_a_lead_needs_a_cuda_device_and_a_positive_time():
    with pytest.raises(ValueError, match="lead_ms needs a CUDA device"):
        timing.call_times(lambda: None, "cpu", n=2, lead_ms=1.0)
    with pytest.raises(ValueError, match="CUDA device"):
        timing.busy(1.0, "cpu")


@pytest.mark.gpu
def test_a_lead_hides_the_host_issue_time_of_a_host_bound_call():
    # 400 tiny launches: the host needs far longer to issue them than the device to run them, so
    # from an idle device the events span the host's issue time; with the host ahead they span the
    # device work alone, which is a small fraction of it
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.zeros(16, device="cuda")

    def many():
        for _ in range(400):
            x.add_(1.0)

    many()
    idle = timing.call_times(many, "cuda", n=10)
    ahead = timing.call_times(many, "cuda", n=10, lead_ms=4 * max(idle.host_ms) + 1.0)
    idle_ms, ahead_ms = sorted(idle.device_ms)[5], sorted(ahead.device_ms)[5]
    assert ahead_ms < 0.5 * idle_ms, (idle_ms, ahead_ms, idle.host_ms)
    # busy() queues about the time asked for
    t = timing.timer("cuda")(lambda: timing.busy(2.0, "cuda"))
    assert 1.5 <= t <= 3.0, t

def test_timing_imports_only_torch():
    tree = ast.parse((ROOT / "kernels" / "timing.py").read_text())
    top = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
           for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
           for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert top <= {"__future__", "time", "collections", "typing", "torch"}, top


def _sources():
    return {p: p.read_text() for p in ROOT.rglob("*.py")}


def test_no_module_keeps_a_timer_of_its_own():
    # per-call CUDA events and perf_counter timing loops live in timing.py; the exceptions time
    # something else: the marks splitting one training step into its phases (cost_measure), the
    # lifetime of a whole benchmark process (wall seconds); a site built on these may keep a name of
    # its own (bench.fsdp._time_steps, bench.dropin.time_fn)
    for path, src in _sources().items():
        if path.name == "timing.py":
            continue
        for name in ("bench_ms", "do_bench_ms", "median_ms", "timer", "call_times"):
            assert not re.search(rf"^def {name}\(", src, re.M), (path, name)
        events = src.count("torch.cuda.Event(enable_timing=True)")
        assert events == (1 if path.name == "cost_measure.py" else 0), (path, events)
    assert "anvil_fast.bench" not in (ROOT / "kernels" / "timing.py").read_text()


def test_one_flop_count_and_one_comm_only():
    srcs = _sources()
    defs = {name: [p.name for p, s in srcs.items() if re.search(rf"^def {name}\(", s, re.M)]
            for name in ("map_flops", "cascade_flops", "comm_only", "_comm_only")}
    assert defs == {"map_flops": ["gram_side.py"], "cascade_flops": ["gram_side.py"], "comm_only": ["overlap.py"],
                    "_comm_only": []}
    from anvil_fast.bench import common
    from anvil_fast.core.gram_side import map_flops

    f = map_flops((2, 256, 768))
    assert common.flops((2, 256, 768)) == (common.MAPS_PER_CASCADE * f.plain, common.MAPS_PER_CASCADE * f.executed)


def test_no_module_reaches_into_the_optimizers_step_pieces():
    repo = ROOT.parent
    files = [p for d in ("anvil_fast", "tests", "tools", "papers", "derive_maps") for p in (repo / d).rglob("*.py")]
    for p in files:
        src = p.read_text()
        for name in ("_launch_gather", "_anvil_update", "_adam_update(", "_grads_read"):
            assert f".{name}" not in src, (p, name)


def test_comm_only_runs_the_step_collectives_on_one_process():
    from anvil_fast.models.banked_gpt import BankedGPT
    from anvil_fast.parallel.comms import LocalComms
    from anvil_fast.models.gpt import SIZES
    from anvil_fast.optim.overlap import comm_only, make_optimizer

    class Counting(LocalComms):
        def __init__(self):
            super().__init__()
            self.log = []

        def reduce_scatter_avg(self, out, inp):
            self.log.append("rs")
            return super().reduce_scatter_avg(out, inp)

        def all_reduce_avg(self, t):
            self.log.append("ar")
            return super().all_reduce_avg(t)

        def all_gather(self, out, inp):
            self.log.append("ag")
            return super().all_gather(out, inp)

    model = BankedGPT(SIZES["tiny"], group_layers=1)
    comms = Counting()
    opt = make_optimizer(model, comms=comms, compile_banks=False)
    sharded = sum(opt.param_cfgs[l].comms == "sharded" for l in opt.labels)
    for first in (True, False):
        comms.log = []
        comm_only(opt, replicated_first=first)()
        rs_ag = ["rs"] * sharded + ["ar"] * (not first)
        assert comms.log == (["ar"] if first else []) + rs_ag + ["ag"] * sharded
