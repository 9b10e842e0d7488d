"""anvil_fast.kernels.capture: the one warm-up-then-capture sequence (its order of stream waits, warm-ups
and the capture, checked on the CPU against a recording stand-in for torch.cuda), and that the
package's CUDA graphs are captured through it."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import pytest
import torch

from anvil_fast.kernels import capture as CAP

ROOT = Path(__file__).resolve().parents[1]


class _Recorder:
    def __init__(self):
        self.log: list[tuple] = []
        self.current = "main"

    def stream_obj(self, name):
        rec = self

        class S:
            def wait_stream(self, other):
                rec.log.append(("wait", name, other.name))

        s = S()
        s.name = name
        return s


def _fake_cuda(monkeypatch, rec: _Recorder):
    main = rec.stream_obj("main")
    made = []

    def Stream(device=None):
        s = rec.stream_obj(f"side{len(made)}")
        made.append(device)
        return s

    @contextlib.contextmanager
    def stream(s):
        prev, rec.current = rec.current, s.name
        yield
        rec.current = prev

    class Graph:
        def replay(self):
            rec.log.append(("replay",))

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        rec.log.append(("capture", pool, capture_error_mode))
        prev, rec.current = rec.current, "capturing"
        yield
        rec.current = prev
        rec.log.append(("captured",))

    class Generator:  # the device's default generator: a state object it can swap
        def __init__(self):
            self.state = "user's"

        def clone_state(self):
            rec.log.append(("clone", self.state))
            g = Generator()
            g.state = f"copy of {self.state}"
            return g

        def graphsafe_set_state(self, other):
            rec.log.append(("set", other.state))
            self.state = other.state

    monkeypatch.setattr(torch.cuda, "default_generators", (Generator(), Generator()))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return made


def test_warm_up_on_a_side_stream_then_one_capture(monkeypatch):
    rec = _Recorder()
    made = _fake_cuda(monkeypatch, rec)
    g = CAP.capture(lambda: rec.log.append(("run", rec.current)), warmup=3, pool="P",
                    capture_error_mode="thread_local", device="cuda:1")
    assert rec.log == [("wait", "side0", "main"), ("run", "side0"), ("run", "side0"), ("run", "side0"),
                       ("wait", "main", "side0"), ("clone", "user's"), ("capture", "P", "thread_local"),
                       ("run", "capturing"), ("captured",)]
    assert made == ["cuda:1"] and hasattr(g, "replay")
    rec.log.clear()
    shared = rec.stream_obj("shared")
    CAP.capture(lambda: rec.log.append(("run", rec.current)), warmup=0, side=shared)
    assert rec.log == [("wait", "shared", "main"), ("wait", "main", "shared"), ("clone", "user's"),
                       ("capture", None, "global"), ("run", "capturing"), ("captured",)]
    assert made == ["cuda:1"]  # a given side stream is used, none made


def test_precompile_is_one_pass_on_the_side_stream_before_the_warm_ups(monkeypatch):
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)
    side = rec.stream_obj("shared")
    side.device = "cuda:1"
    passes = []
    monkeypatch.setattr(CAP, "precompiled", lambda fn, device: passes.append((device, rec.current)) or fn())
    CAP.capture(lambda: rec.log.append(("run", rec.current)), warmup=2, side=side, precompile=True)
    assert passes == [("cuda:1", "shared")]
    assert [e for e in rec.log if e[0] == "run"] == [("run", "shared")] * 3 + [("run", "capturing")]
    rec.log.clear()
    CAP.capture(lambda: rec.log.append(("run", rec.current)), warmup=2, side=side)  # off by default
    assert len(passes) == 1


def test_the_optimizers_captures_take_the_precompile_pass():
    """Every capture of an optimizer's step undoes its warm-up's effects, so each takes the pass."""
    for path in ("anvil_fast/optim/device_step.py", "anvil_fast/optim/graphs.py"):
        text = (ROOT / path).read_text()
        calls = text.count("capture(") - text.count("def capture(") - text.count("_capture(")
        assert calls >= 1 and text.count("precompile=True") == calls, path


def test_a_failed_capture_puts_the_generator_back(monkeypatch):
    """torch leaves the capture device's default generator in capture mode when a capture fails; the
    helper swaps in the state copied before the capture (device 1 here, the current one), then lets
    the error through."""
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)

    def host_read():
        if rec.current == "capturing":
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        CAP.capture(host_read, warmup=1)
    assert rec.log[-3:] == [("clone", "user's"), ("capture", None, "global"), ("set", "copy of user's")]
    assert [g.state for g in torch.cuda.default_generators] == ["user's", "copy of user's"]


class _DiesInACycle:
    """An object kept alive only by a reference cycle: the cyclic collector destroys it, whenever it runs."""

    def __init__(self, log, rec):
        self.me, self.log, self.rec = self, log, rec

    def __del__(self):
        self.log.append(("destroyed", self.rec.current))


def _churn() -> None:
    junk = [[] for _ in range(50_000)]  # container allocations past any collector threshold
    del junk


def test_the_collector_is_paused_for_the_capture_alone(monkeypatch):
    """Inside the capture the collector is off (a dead cycle holding an old CUDA graph would be
    destroyed there, which a capture does not permit); during the warm-ups and after it is on; a
    capture that fails turns it back on; a collector the caller had turned off stays off."""
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)
    assert gc.isenabled()
    CAP.capture(lambda: rec.log.append(("run", rec.current, gc.isenabled())), warmup=1)
    assert [e for e in rec.log if e[0] == "run"] == [("run", "side0", True), ("run", "capturing", False)]
    assert gc.isenabled()

    def fails():
        if rec.current == "capturing":
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError):
        CAP.capture(fails, warmup=0)
    assert gc.isenabled()
    gc.disable()
    try:
        CAP.capture(lambda: None, warmup=0)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_object_dead_in_a_cycle_is_not_destroyed_mid_capture(monkeypatch):
    """The case itself: an object that died in a reference cycle just before a capture whose body
    allocates enough for the collector to run is destroyed after the capture, not inside it."""
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)
    log: list[tuple] = []
    fake_graph = torch.cuda.graph

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        _DiesInACycle(log, rec)  # dies as the capture begins: young, so the next collection takes it
        with fake_graph(*args, **kwargs):
            yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    CAP.capture(_churn, warmup=0)
    gc.collect()
    assert log == [("destroyed", "main")]  # after the capture (its first collection), not "capturing"


@pytest.mark.gpu
def test_a_graph_dead_in_a_cycle_does_not_break_a_capture(monkeypatch):
    """A CUDA graph destroyed inside another capture (cudaGraphExecDestroy) invalidates that capture;
    one held by a cycle that dies as a capture begins (an optimizer built and dropped) waits for the
    collector, which the capture pauses: the new graph captures and replays."""
    x = torch.zeros(4, device="cuda")
    old = [CAP.capture(lambda: x.add_(1), warmup=1)]
    real = torch.cuda.graph

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        with real(*args, **kwargs):
            holder = {"graph": old.pop()}
            holder["me"] = holder
            del holder  # the old graph now lives only in a dead cycle
            yield

    monkeypatch.setattr(torch.cuda, "graph", graph)

    def body():
        x.add_(1)
        _churn()

    g = CAP.capture(body, warmup=0)
    before = x.clone()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before + 1)
    gc.collect()


@pytest.mark.gpu
def test_a_failed_capture_leaves_the_random_stream_where_it_was():
    from anvil_fast.kernels.gram_tune import time_us

    x = torch.ones(8, device="cuda")
    torch.cuda.manual_seed(5)
    expected = torch.randn(32, device="cuda")
    torch.cuda.manual_seed(5)
    with pytest.raises(RuntimeError):
        CAP.capture(lambda: float(x.sum()), warmup=1)  # a host read: not capturable
    assert torch.equal(torch.randn(32, device="cuda"), expected)
    torch.cuda.manual_seed(6)
    expected = torch.randn(32, device="cuda")
    torch.cuda.manual_seed(6)
    assert time_us(lambda: float(x.sum())) > 0  # the timer's capture fails too, and it times eager calls
    assert torch.equal(torch.randn(32, device="cuda"), expected)


def test_every_warm_up_then_capture_goes_through_the_helper():
    """Only anvil_fast.kernels.capture makes a graph, apart from gram_tune.time_us, whose graph holds
    back-to-back calls after one eager call on the current stream (no side-stream warm-up); both
    capture inside generator_kept with the collector paused."""
    makers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "anvil_fast").rglob("*.py")
                    if "torch.cuda.CUDAGraph()" in p.read_text())
    assert makers == ["anvil_fast/kernels/capture.py", "anvil_fast/kernels/gram_tune.py"], makers
    for name in makers:  # each keeps the user's generator through a failed capture
        assert "with collector_paused(), generator_kept(), torch.cuda.graph(" in (ROOT / name).read_text(), name
    for name in ("optim/graphs.py", "optim/device_step.py", "bench/common.py"):
        assert "capture(" in (ROOT / "anvil_fast" / name).read_text(), name
