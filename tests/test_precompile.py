"""anvil_fast.kernels.precompile: a pass whose Triton launches are recorded, not made, and compiled on a
pool of threads. On the CPU: what is recorded and what a compile receives (through a stand-in
``compile_one``), the per-function lock, failures left to the real run, the switch, and that the
Gram tuner decides nothing in a recording pass. On the GPU: after a recording pass the real warm-up
compiles nothing, and a drop-in stepped with it equals one stepped without, bit for bit, on the tiny GPT and on two
models it was not written for."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from anvil_fast.kernels import precompile as PC
from anvil_fast.kernels.backend import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton")


def _add(x, y, n, B):  # a kernel's body: only compiled on the GPU test's device
    pass


def _scale(x, n, B):
    pass


def _jit(fn):
    """A JITFunction whatever TRITON_INTERPRET says (the interpreter's decorator makes another class)."""
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


@needs_triton
def test_a_recording_pass_records_launches_and_hands_each_to_the_pool_as_specs():
    add, scale = _jit(_add), _jit(_scale)
    x = torch.zeros(64, dtype=torch.bfloat16)
    got = []

    def compile_one(fn, args, kwargs, grid):
        got.append((fn, args, kwargs, grid, threading.current_thread().name))

    ran = []

    def body():
        add[(4,)](x, x[1:], 63, B=16)
        ran.append("torch ops run")
        scale[(1, 2)](x, 64, B=32)

    report = PC.precompiled(body, device="cpu", workers=2, compile_one=compile_one)
    assert ran == ["torch ops run"]
    assert (report.launches, report.compiled, report.failed) == (2, 2, [])
    by_fn = {fn: (args, kwargs, grid, thread) for fn, args, kwargs, grid, thread in got}
    args, kwargs, grid, thread = by_fn[add]
    assert grid == (4,) and kwargs == {"B": 16} and args[2] == 63 and thread.startswith("anvil-precompile")
    # tensors travel as specs: dtype, address (hence alignment), shape and strides; no tensor is kept
    assert all(isinstance(a, PC.Spec) for a in args[:2])
    assert (args[0].dtype, args[0].data_ptr(), args[0].shape, args[0].stride()) == (torch.bfloat16, x.data_ptr(), (64,), (1,))
    assert args[1].data_ptr() == x.data_ptr() + 2 and args[1].shape == (63,)
    assert by_fn[scale][2] == (1, 2) and by_fn[scale][1] == {"B": 32}
    assert not PC.recording()  # the pass has ended
    from triton.runtime.jit import JITFunction

    assert JITFunction.run is not PC._recording_run  # and no launch outside a pass goes through its wrapping


@needs_triton
def test_the_wrapping_lasts_as_long_as_the_passes_and_a_failing_pass_ends_too():
    from triton.runtime.jit import JITFunction

    before = JITFunction.run
    seen = []

    def body():
        seen.append(JITFunction.run is PC._recording_run)
        raise ValueError("the step failed")

    with pytest.raises(ValueError, match="the step failed"):
        PC.precompiled(body, device="cpu", compile_one=lambda *a: None)
    assert seen == [True] and JITFunction.run is before and PC._passes == 0
    # two passes on two threads at once share one wrapping, taken off when the second ends
    inside, release = threading.Event(), threading.Event()

    def long_body():
        inside.set()
        release.wait(5)

    t = threading.Thread(target=lambda: PC.precompiled(long_body, device="cpu", compile_one=lambda *a: None))
    t.start()
    inside.wait(5)
    PC.precompiled(lambda: seen.append(JITFunction.run is PC._recording_run), device="cpu", compile_one=lambda *a: None)
    assert seen[-1] is True and JITFunction.run is PC._recording_run  # the other pass still runs
    release.set()
    t.join(5)
    assert JITFunction.run is before and PC._passes == 0


@needs_triton
def test_a_spec_specializes_as_its_tensor():
    """What Triton derives from an argument (its type and alignment) is the same for the tensor, its
    spec, and a host-side tensor descriptor holding either."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        pytest.skip("this Triton specializes in Python (no native_specialize_impl)")
    x = torch.zeros(4096, dtype=torch.bfloat16)
    try:
        native_specialize_impl(BaseBackend, x, False, True, True)
    except TypeError as exc:  # a private function: another Triton may take other arguments
        pytest.skip(f"this Triton's native_specialize_impl takes other arguments: {exc}")
    for t in (x, x[1:], x[8:], x.float()[4:]):
        for align in (True, False):
            assert native_specialize_impl(BaseBackend, PC.Spec(t), False, True, align) == \
                native_specialize_impl(BaseBackend, t, False, True, align)
    y = x[:64 * 64].view(64, 64)
    d = TensorDescriptor(y, [64, 64], [64, 1], [32, 32])
    ds = PC.spec_of(d)
    assert isinstance(ds.base, PC.Spec) and ds.block_shape == [32, 32]
    assert native_specialize_impl(BaseBackend, ds, False, True, True) == native_specialize_impl(BaseBackend, d, False, True, True)
    assert PC.spec_of(3) == 3 and PC.spec_of("x") == "x"


@needs_triton
def test_one_function_compiles_on_one_thread_at_a_time_and_different_ones_overlap():
    fns = [_jit(_add), _jit(_scale)]
    busy = {id(f): 0 for f in fns}
    most = {id(f): 0 for f in fns}
    together = [0]
    lock = threading.Lock()

    def compile_one(fn, args, kwargs, grid):
        with lock:
            busy[id(fn)] += 1
            most[id(fn)] = max(most[id(fn)], busy[id(fn)])
            together[0] = max(together[0], sum(busy.values()))
        time.sleep(0.05)
        with lock:
            busy[id(fn)] -= 1

    x = torch.zeros(16)

    def body():
        for _ in range(4):
            for f in fns:
                f[(1,)](x, 16, B=16)

    report = PC.precompiled(body, device="cpu", workers=4, compile_one=compile_one)
    assert report.launches == report.compiled == 8
    assert most == {id(f): 1 for f in fns}  # its caches are filled by one thread at a time
    assert together[0] == 2  # while the other function compiles beside it


@needs_triton
def test_a_failed_compile_is_reported_and_left_to_the_real_run():
    add = _jit(_add)

    def compile_one(fn, args, kwargs, grid):
        if kwargs["B"] == 32:
            raise RuntimeError("ptxas died\nmore text")

    x = torch.zeros(16)
    report = PC.precompiled(lambda: [add[(1,)](x, 16, B=b) for b in (16, 32)], device="cpu",
                            compile_one=compile_one)
    assert report.launches == 2 and report.compiled == 1
    assert report.failed == ["_add: RuntimeError: ptxas died"]


@needs_triton
def test_the_switch_and_a_nested_pass_run_nothing(monkeypatch):
    ran = []
    monkeypatch.setenv(PC.ENV, "0")
    assert PC.precompiled(lambda: ran.append(1), device="cpu") is None and ran == []
    monkeypatch.setenv(PC.ENV, "1")
    inner = []
    PC.precompiled(lambda: inner.append(PC.precompiled(lambda: ran.append(2), device="cpu")), device="cpu",
                   compile_one=lambda *a: None)
    assert inner == [None] and ran == []  # a pass inside a pass does not run its function


@needs_triton
def test_the_gram_tuner_decides_nothing_in_a_recording_pass(monkeypatch):
    """The tuner reads its candidates' results on the host: in a recording pass their launches would
    be skipped, so it answers the default there, remembers nothing, and tunes in the real run."""
    from anvil_fast.kernels import gram_tune as GT
    from anvil_fast.kernels.gram import default_config

    monkeypatch.setattr(GT, "tuning_enabled", lambda: True)
    monkeypatch.setattr(GT, "table_enabled", lambda: False)
    key = GT.ProblemKey("XXT", 1024, 1024, 4096, 4, None)
    default = default_config("gram", 1024, 4096, 4, sms=132)
    tuned = []

    def fake_tune(kind, key, launch, out, reference, **kw):
        tuned.append(key)
        return reference, {"kind": kind, "key": key, "results": [], "chosen": reference}

    monkeypatch.setattr(GT, "tune", fake_tune)
    GT.reset()
    out = torch.zeros(1)
    seen = []
    PC.precompiled(lambda: seen.append(GT.choose("gram", key, None, out, default)), device="cpu",
                   compile_one=lambda *a: None)
    assert seen == [default] and tuned == [] and key not in GT._CHOICES
    assert GT.choose("gram", key, None, out, default) == default and tuned == [key]  # the real run tunes
    GT.reset()


# ------------------------------------------------------------------------------------------ GPU
def _model(seed=0):
    from anvil_fast.models import gpt

    m = gpt.build("tiny", seed=seed, device=torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(1)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype)
    return m


def _our_jit_functions():
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import anvil_fast.kernels as kernels

    out = []
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"anvil_fast.kernels.{info.name}")
        out += [v for v in vars(mod).values() if isinstance(v, JITFunction)]
    return out


@pytest.mark.gpu
@needs_triton
def test_after_the_recording_pass_the_real_warm_up_compiles_nothing(monkeypatch):
    """The drop-in's capture with its in-memory kernels forgotten: the recording pass compiles what the
    step launches, so the warm-up and the capture that follow compile no kernel of their own."""
    knobs = pytest.importorskip("triton.knobs", reason="this Triton has no jit_post_compile_hook to count compiles")

    from anvil_fast.kernels import capture as CAP
    from anvil_fast.optim.entry import ANVIL

    fns = _our_jit_functions()
    if not fns or not all(hasattr(f, "device_caches") for f in fns):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    for f in fns:
        f.device_caches.clear()  # compiled again from Triton's disk cache: the pass is what is measured
    compiled = []
    reports = []
    real = CAP.precompiled

    def spy(fn, **kw):
        r = real(fn, **kw)
        reports.append(r)
        monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *a, **k: compiled.append(a))
        return r

    monkeypatch.setattr(CAP, "precompiled", spy)
    model = _model()
    opt = ANVIL(model)
    opt.step()
    torch.cuda.synchronize()
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert reports and reports[0] is not None and reports[0].launches > 0 and reports[0].failed == []
    assert compiled == []


@pytest.mark.gpu
@needs_triton
def test_a_step_with_the_recording_pass_equals_one_without(monkeypatch):
    from anvil_fast.optim.entry import ANVIL

    params = []
    for switch in ("0", "1"):
        monkeypatch.setenv(PC.ENV, switch)
        model = _model()
        opt = ANVIL(model)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def _conv_net():
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _odd_mlp():
    nn = torch.nn
    return nn.Sequential(nn.Linear(37, 96), nn.GELU(), nn.Linear(96, 200), nn.GELU(), nn.Linear(200, 200),
                         nn.GELU(), nn.Linear(200, 11))


#: models the drop-in was not written for: a convolutional net (4-D weights, a stem convolution) and an MLP of
#: odd widths (banks of shapes no kernel was tuned on), each with its input and a classification target
FOREIGN = {"conv_net": (_conv_net, lambda g: torch.randn(4, 3, 12, 12, generator=g, device="cuda"), 10),
           "odd_mlp": (_odd_mlp, lambda g: torch.randn(8, 37, generator=g, device="cuda"), 11)}


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", list(FOREIGN))
def test_a_foreign_model_trains_the_same_with_and_without_the_recording_pass(monkeypatch, name):
    from anvil_fast.optim.entry import ANVIL

    build, batch, classes = FOREIGN[name]
    # cuDNN's default convolution backward accumulates with atomics, so two runs of one model give
    # different gradients whatever the switch; its deterministic algorithms make the step's input the same
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    params = []
    for switch in ("0", "1"):
        monkeypatch.setenv(PC.ENV, switch)
        torch.manual_seed(0)
        model = build().cuda()
        opt = ANVIL(model)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            x = batch(g)
            y = torch.randint(0, classes, (x.shape[0],), generator=g, device="cuda")
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.isfinite(p).all() for p in params[0])
    assert all(torch.equal(a, b) for a, b in zip(*params))
