"""Adapters: the real orthogonalization functions of other libraries (and the package's own), each as
an :class:`anvil_fast.studies.harness.Implementation` with the math it declares.

Each adapter imports its library only when asked for, and says why it cannot run where it cannot
(:class:`Unavailable`: not installed, not importable, needs CUDA, no such function in this version).
The declared math is read from the library's own constants where it exports them (torch's
``DEFAULT_A/B/C``, dion's ``_POLAR_EXPRESS_COEFFS``, emerging-optimizers' coefficient table,
heavyball's ``ABC_LIST_STABLE``, pytorch-optimizer's ``NS_COEFFICIENTS``, gram-newton-schulz's
``ns_coefficients``), else from the function's
source as written (dion's and heavyball's quintic: local lists), as the ``note`` of each says.

Compilation (``compile``: "auto", "yes", "no"): a library that compiles its function
(``torch.compile``: dion; heavyball's ``max-autotune-no-cudagraphs``) runs compiled under "yes"; under
"auto" dion's runs compiled on CUDA and every one runs its uncompiled original on the CPU (the same
operations; compiling takes ~20 s per shape on two cores), and heavyball's runs uncompiled everywhere
(its autotuning compiles for minutes per shape), through heavyball's own switch
(``heavyball.utils.compile_mode = None``). Inductor's fusions change where a compiled function
rounds (dion's Polar Express on CPU: up to 0.04 apart from its original, elementwise).

``python -m anvil_fast.studies.difftest --list-adapters`` lists them and whether each can run here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from anvil_ref.constants import FROBENIUS_EPS
from anvil_ref.maps import available_map_sets, load_maps

from .harness import DeclaredMath, Implementation

COMPILE = ("auto", "yes", "no")


class Unavailable(RuntimeError):
    """An adapter that cannot run here; the message says why."""


@dataclass(frozen=True)
class Adapter:
    name: str
    library: str  #: the pip / source name whose absence makes it unavailable
    summary: str
    build: Callable[[str, str], Implementation]  #: (device type, compile) -> Implementation
    cuda_only: bool = False


def _import(module: str, library: str, *, hint: str = ""):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(f"{library} not installed ({module}: {exc}){hint}") from None
    except Exception as exc:  # a library that imports but fails at import time here
        raise Unavailable(f"{library} not importable ({module}: {type(exc).__name__}: {exc}){hint}") from None


def _attr(mod, name: str, library: str):
    if not hasattr(mod, name):
        raise Unavailable(f"{library}: {mod.__name__} has no {name} in this version")
    return getattr(mod, name)


def _uncompiled(fn, device: str, compile: str, *, compiled_on_cuda: bool):
    """``fn`` (a torch.compile'd or heavyball-decorated function) or its original, by the policy of
    the module docstring."""
    run_compiled = compile == "yes" or (compile == "auto" and compiled_on_cuda and device == "cuda")
    if run_compiled:
        return fn
    for attr in ("_torchdynamo_orig_callable", "__wrapped__"):
        if hasattr(fn, attr):
            return getattr(fn, attr)
    return fn


# ---------------------------------------------------------------------------------------- torch

def _torch_muon(device: str, compile: str) -> Implementation:
    mod = _import("torch.optim._muon", "torch")
    fn = _attr(mod, "_zeropower_via_newtonschulz", f"torch {torch.__version__}")
    abc = (mod.DEFAULT_A, mod.DEFAULT_B, mod.DEFAULT_C)
    steps, eps = mod.DEFAULT_NS_STEPS, mod.EPS
    m = DeclaredMath.of([abc], steps=steps, normalization="frobenius_clamp", margin=1.0, eps=eps, transpose_when="tall")
    return Implementation("torch-muon", lambda x: fn(x, abc, steps, eps), m, per_matrix=True,
                          note=f"torch {torch.__version__} torch.optim._muon._zeropower_via_newtonschulz "
                               "(DEFAULT_A/B/C, DEFAULT_NS_STEPS, EPS; one matrix per call)")


# ---------------------------------------------------------------------------------------- dion
# dion/muon.py and dion/newton_schulz_triton.py: the quintic as their functions list it (local
# variables); dion/polar_express.py exports _POLAR_EXPRESS_COEFFS.
DION_QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
DION_AOL_QUINTIC = ((4.6051, -9.6552, 5.6769), (4.7505, -6.0861, 2.1790), (2.7763, -2.3190, 0.5523),
                    (2.4231, -2.2861, 0.8193))
_DION_HINT = " (dion is not on PyPI: put its source on PYTHONPATH)"


def _dion(module: str, func: str, *, coeffs, normalization, margin, eps, compiled: bool, name: str):
    def build(device: str, compile: str) -> Implementation:
        _import("dion", "dion", hint=_DION_HINT)
        mod = _import(module, "dion", hint=_DION_HINT)
        fn = _attr(mod, func, "dion")
        if compiled:
            fn = _uncompiled(fn, device, compile, compiled_on_cuda=True)
        cs = getattr(mod, coeffs) if isinstance(coeffs, str) else coeffs
        m = DeclaredMath(tuple(tuple(t) for t in cs), normalization=normalization, margin=margin, eps=eps,
                         transpose_when="tall")
        return Implementation(name, lambda x: fn(x, eps), m, note=f"dion {module}.{func}"
                              + (f" ({coeffs})" if isinstance(coeffs, str) else " (its quintic as listed in it)"))
    return build


# ---------------------------------------------------------------------------------------- emerging-optimizers
EMERGING_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")
#: num_ns_steps of emerging-optimizers' Muon (its default), except DeepSeek-V4's ten-step schedule
EMERGING_STEPS = {"deepseekv4": 10}
_EMERGING_HINT = " (emerging-optimizers needs Python >= 3.12)" if sys.version_info < (3, 12) else ""


def _emerging(kind: str, syrk: bool):
    def build(device: str, compile: str) -> Implementation:
        mu = _import("emerging_optimizers.orthogonalized_optimizers.muon_utils", "emerging-optimizers",
                     hint=_EMERGING_HINT)
        utils = _import("emerging_optimizers.utils", "emerging-optimizers", hint=_EMERGING_HINT)
        table = _attr(mu, "_COEFFICIENT_SETS", "emerging-optimizers")
        if kind not in table:
            raise Unavailable(f"emerging-optimizers: no coefficient type {kind!r} in this version")
        steps = EMERGING_STEPS.get(kind, 5)
        cycle = kind not in ("polar_express", "cans", "deepseekv4")  # its "repeat_last" types
        m = DeclaredMath.of(table[kind], steps=steps, cycle=cycle, normalization="frobenius_clamp", margin=1.0,
                            eps=1e-7, transpose_when="tall")

        def fn(x: Tensor) -> Tensor:
            # its Muon's default fp32_matmul_prec="medium": the iteration in bf16
            with utils.fp32_matmul_precision("medium"):
                return mu.newton_schulz(x, steps, coefficient_type=kind, use_syrk=syrk)

        return Implementation(f"emerging-{kind.replace('_', '-')}" + ("-syrk" if syrk else ""), fn, m, per_matrix=syrk,
                              note=f"emerging_optimizers newton_schulz(steps={steps}, coefficient_type={kind!r}"
                                   + (", use_syrk=True" if syrk else "") + ") under fp32_matmul_precision('medium')")
    return build


# ---------------------------------------------------------------------------------------- heavyball
# heavyball/utils.py zeropower_via_newtonschulz5: the quintic as listed in it (a local list)
HEAVYBALL_QUINTIC = DION_QUINTIC


def _heavyball(fn, device: str, compile: str):
    """``fn`` under heavyball's own switch: ``heavyball.utils.compile_mode = None`` runs its decorated
    functions (and the stochastic rounding they call) uncompiled; "yes" keeps its compile mode."""
    hu = importlib.import_module("heavyball.utils")
    if compile == "yes":
        return fn

    def run(*args, **kw):
        old, hu.compile_mode = hu.compile_mode, None
        try:
            return fn(*args, **kw)
        finally:
            hu.compile_mode = old
    return run


def _heavyball_ns5(device: str, compile: str) -> Implementation:
    hu = _import("heavyball.utils", "heavyball")
    fn = _heavyball(_attr(hu, "zeropower_via_newtonschulz5", "heavyball"), device, compile)
    m = DeclaredMath(HEAVYBALL_QUINTIC, normalization="frobenius_clamp", margin=1.0, eps=1e-7, transpose_when="tall")
    return Implementation("heavyball-ns5", lambda x: fn(x, 5), m, observe=compile != "yes",
                          note="heavyball.utils.zeropower_via_newtonschulz5 (stochastic rounding to bf16, seeded)")


def _heavyball_msign(device: str, compile: str) -> Implementation:
    hu = _import("heavyball.utils", "heavyball")
    fn = _heavyball(_attr(hu, "msign", "heavyball"), device, compile)
    m = DeclaredMath.of(_attr(hu, "ABC_LIST_STABLE", "heavyball"), steps=10, normalization="frobenius_clamp",
                        margin=1.0, eps=1e-7, transpose_when="tall")
    return Implementation("heavyball-msign", lambda x: fn(x, 10), m, observe=compile != "yes",
                          note="heavyball.utils.msign (Polar Express, ABC_LIST_STABLE, 10 steps; stochastic rounding)")


# ---------------------------------------------------------------------------------------- pytorch-optimizer
PTO_WEIGHTS = ("original", "quintic", "polar_express", "polar_express_safer")


def _pto_ns5(weights: str):
    def build(device: str, compile: str) -> Implementation:
        mx = _import("pytorch_optimizer.optimizer.utils.matrix", "pytorch-optimizer")
        fn = _attr(mx, "zero_power_via_newton_schulz_5", "pytorch-optimizer")
        table = _attr(mx, "NS_COEFFICIENTS", "pytorch-optimizer")
        if weights not in table:
            raise Unavailable(f"pytorch-optimizer: no weights {weights!r} in this version")
        m = DeclaredMath.of(table[weights], steps=5, normalization="frobenius_clamp", margin=1.0, eps=1e-7,
                            transpose_when="tall")
        return Implementation(f"pytorch-optimizer-{weights.replace('_', '-')}",
                              lambda x: fn(x, num_steps=5, weights=weights), m,
                              note=f"pytorch_optimizer zero_power_via_newton_schulz_5(num_steps=5, weights={weights!r})")
    return build


def _pto_gram(device: str, compile: str) -> Implementation:
    mx = _import("pytorch_optimizer.optimizer.utils.matrix", "pytorch-optimizer")
    fn = _attr(mx, "zero_power_via_gram_newton_schulz", "pytorch-optimizer")
    m = DeclaredMath.of(mx.NS_COEFFICIENTS["original"], steps=5, normalization="frobenius_clamp", margin=1.0, eps=1e-7,
                        transpose_when="tall", restarts=(2,), dtype="float16")  # its defaults
    return Implementation("pytorch-optimizer-gram-ns", lambda x: fn(x, num_steps=5), m,
                          note="pytorch_optimizer zero_power_via_gram_newton_schulz (defaults: fp16, restart at step 2)")


# ---------------------------------------------------------------------------------------- dion's NorMuon

def _dion_normuon(triton: bool):
    def build(device: str, compile: str) -> Implementation:
        _import("dion", "dion", hint=_DION_HINT)
        mod = _import("dion.normuon", "dion", hint=_DION_HINT)
        pe = _import("dion.polar_express", "dion", hint=_DION_HINT)
        cls = _attr(mod, "NorMuon", "dion")
        opt = cls([torch.nn.Parameter(torch.zeros(8, 8, device=device))], use_triton=triton)
        fn = opt._newton_schulz_func  # the orthogonalization its step runs
        if not triton:
            fn = _uncompiled(fn, device, compile, compiled_on_cuda=True)
        eps = opt.defaults["epsilon"]
        m = DeclaredMath(tuple(tuple(t) for t in pe._POLAR_EXPRESS_COEFFS), normalization="frobenius", margin=1.02,
                         eps=eps, transpose_when="tall")
        name = "dion-normuon" + ("-triton" if triton else "")
        return Implementation(name, lambda x: fn(x, epsilon=torch.tensor(eps)), m,
                              note=f"dion.normuon.NorMuon(use_triton={triton})'s orthogonalization "
                                   f"({fn.__name__ if hasattr(fn, '__name__') else fn}, epsilon={eps:g})")
    return build


# ---------------------------------------------------------------------------------------- Dao AI Lab's gram-newton-schulz

def _gns(kind: str, kernels: bool):
    """gram_newton_schulz's GramNewtonSchulz (restarted Gram form, reset before step 3) or
    StandardNewtonSchulz, Polar Express's coefficients over 1.05^(1, 3, 5), normalized in fp32 and
    iterated in fp16; its pure-torch backend (``ns_use_kernels=False``) anywhere, its quack kernels
    (CUDA) with ``kernels``; compiled as it compiles by default on CUDA, uncompiled on the CPU under
    "auto"."""
    def build(device: str, compile: str) -> Implementation:
        g = _import("gram_newton_schulz", "gram-newton-schulz")
        if kernels:
            _import("quack.gemm_interface", "quack (gram-newton-schulz's kernels)")
        run_compiled = compile == "yes" or (compile == "auto" and device == "cuda")
        kw = {} if run_compiled else {"compile_kwargs": None}
        cls = _attr(g, "GramNewtonSchulz" if kind == "gram" else "StandardNewtonSchulz", "gram-newton-schulz")
        obj = cls(ns_use_kernels=kernels, **kw)
        coeffs = tuple(tuple(float(v) for v in t) for t in obj.ns_coefficients)
        restarts = tuple(obj.gram_newton_schulz_reset_iterations) if kind == "gram" else None
        m = DeclaredMath(coeffs, normalization="frobenius", margin=1.0, eps=obj.ns_epsilon, transpose_when="tall",
                         restarts=restarts, dtype="float16")
        name = "gram-newton-schulz" + ("" if kind == "gram" else "-standard") + ("-quack" if kernels else "")
        return Implementation(name, obj, m,
                              note=f"gram_newton_schulz.{cls.__name__}(ns_use_kernels={kernels}"
                                   + ("" if run_compiled else ", compile_kwargs=None") + "): fp16 iteration"
                                   + (", reset before step 3" if kind == "gram" else ""))
    return build


# ---------------------------------------------------------------------------------------- the field's code as written

def _field(name: str):
    def build(device: str, compile: str) -> Implementation:
        from . import field_examples as E

        return Implementation(f"field-{name.replace('_', '-')}", getattr(E, name), DeclaredMath.of(**E.DECLARED[name]),
                              note=f"anvil_fast.studies.field_examples.{name} (the field's code as it writes it)",
                              observe=not name.endswith("_compiled"))
    return build


# ---------------------------------------------------------------------------------------- the package's own

def _anvil(config: str, maps: str = "anvil"):
    def build(device: str, compile: str) -> Implementation:
        from anvil_fast.core.cascade import CONFIGS, fast_cascade, fast_gram_side, restarts_of

        cfg = CONFIGS[config]
        comp = {"auto": None, "yes": True, "no": False}[compile]
        # the Gram side declares its form: restarts before the maps of its schedule for these maps (1-based there)
        sched = restarts_of(cfg, maps)
        restarts = None if sched is None else tuple(k - 1 for k in sched)
        m = DeclaredMath(load_maps(maps), normalization="frobenius", margin=cfg.margin(), eps=FROBENIUS_EPS,
                         transpose_when="tall", restarts=restarts)
        if config == "gram_side":
            fn = lambda x: fast_gram_side(x, maps=maps, compile=comp)  # noqa: E731  (on every shape)
        else:
            fn = lambda x: fast_cascade(x, maps=maps, config=cfg, compile=comp)  # noqa: E731
        suffix = "" if maps == "anvil" else f"-{maps.replace('_', '-')}"
        return Implementation(f"anvil-{config.replace('_', '-')}{suffix}", fn, m, observe=device == "cpu",
                              note=f"anvil_fast.core.cascade {'fast_gram_side' if config == 'gram_side' else 'fast_cascade'}"
                                   f"(config={config}, maps={maps!r})")
    return build


def _registry() -> dict[str, Adapter]:
    out: list[Adapter] = [
        Adapter("torch-muon", "torch", "torch.optim.Muon's Newton-Schulz (quintic x5, one matrix per call)", _torch_muon),
        Adapter("dion-muon", "dion", "dion.muon.zeropower_via_newtonschulz5 (compiled)",
                _dion("dion.muon", "zeropower_via_newtonschulz5", coeffs=DION_QUINTIC, normalization="frobenius",
                      margin=1.0, eps=1e-7, compiled=True, name="dion-muon")),
        Adapter("dion-newton-schulz-triton", "dion", "dion's Triton Newton-Schulz", cuda_only=True,
                build=_dion("dion.newton_schulz_triton", "newton_schulz_triton", coeffs=DION_QUINTIC,
                            normalization="frobenius", margin=1.0, eps=1e-7, compiled=False,
                            name="dion-newton-schulz-triton")),
        Adapter("dion-newton-schulz-triton-fast", "dion", "dion's Triton Newton-Schulz with AOL rescaling (4 steps)",
                cuda_only=True,
                build=_dion("dion.newton_schulz_triton", "newton_schulz_triton_fast", coeffs=DION_AOL_QUINTIC,
                            normalization="aol", margin=1.0, eps=1e-7, compiled=False,
                            name="dion-newton-schulz-triton-fast")),
        Adapter("dion-polar-express", "dion", "dion.polar_express.polar_express (compiled)",
                _dion("dion.polar_express", "polar_express", coeffs="_POLAR_EXPRESS_COEFFS", normalization="frobenius",
                      margin=1.02, eps=1e-6, compiled=True, name="dion-polar-express")),
        Adapter("dion-polar-express-triton", "dion", "dion.polar_express.polar_express_triton (compiled, Triton)",
                cuda_only=True,
                build=_dion("dion.polar_express", "polar_express_triton", coeffs="_POLAR_EXPRESS_COEFFS",
                            normalization="frobenius", margin=1.02, eps=1e-6, compiled=True,
                            name="dion-polar-express-triton")),
    ]
    out += [Adapter("dion-normuon", "dion", "the orthogonalization dion's NorMuon runs (polar_express, compiled)",
                    _dion_normuon(False)),
            Adapter("dion-normuon-triton", "dion", "the orthogonalization dion's NorMuon(use_triton=True) runs",
                    _dion_normuon(True), cuda_only=True),
            Adapter("gram-newton-schulz", "gram-newton-schulz",
                    "Dao AI Lab's GramNewtonSchulz, pure-torch backend (fp16, restarted Gram form)", _gns("gram", False)),
            Adapter("gram-newton-schulz-standard", "gram-newton-schulz",
                    "Dao AI Lab's StandardNewtonSchulz, pure-torch backend (fp16)", _gns("standard", False)),
            Adapter("gram-newton-schulz-quack", "gram-newton-schulz",
                    "Dao AI Lab's GramNewtonSchulz on its quack kernels", _gns("gram", True), cuda_only=True),
            Adapter("field-muon-newton-schulz", "anvil",
                    "Muon's Newton-Schulz as Keller Jordan's Muon and modded-nanogpt write it (unfused)",
                    _field("muon_newton_schulz")),
            Adapter("field-muon-newton-schulz-fused", "anvil", "the same, each step fused (baddbmm)",
                    _field("muon_newton_schulz_fused")),
            Adapter("field-muon-newton-schulz-compiled", "anvil", "the unfused steps under torch.compile",
                    _field("muon_newton_schulz_compiled")),
            Adapter("field-muon-newton-schulz-horner", "anvil",
                    "the same quintic in Horner form, normalized in fp32 (as heavyball writes it)",
                    _field("muon_newton_schulz_horner")),
            Adapter("field-muon-newton-schulz-expanded", "anvil",
                    "the same quintic as the polynomial reads, X = a*X + b*A@X + c*A@A@X",
                    _field("muon_newton_schulz_expanded")),
            Adapter("field-polar-express", "anvil", "Polar Express as its reference code writes it",
                    _field("polar_express"))]
    for kind in EMERGING_TYPES:
        out.append(Adapter(f"emerging-{kind.replace('_', '-')}", "emerging-optimizers", f"emerging-optimizers newton_schulz, {kind!r}",
                           _emerging(kind, False)))
    for kind in EMERGING_TYPES:
        out.append(Adapter(f"emerging-{kind.replace('_', '-')}-syrk", "emerging-optimizers",
                           f"emerging-optimizers newton_schulz, {kind!r}, Triton SYRK", _emerging(kind, True),
                           cuda_only=True))
    out += [Adapter("heavyball-ns5", "heavyball", "heavyball zeropower_via_newtonschulz5", _heavyball_ns5),
            Adapter("heavyball-msign", "heavyball", "heavyball msign (Polar Express, 10 steps)", _heavyball_msign)]
    for w in PTO_WEIGHTS:
        out.append(Adapter(f"pytorch-optimizer-{w.replace('_', '-')}", "pytorch-optimizer",
                           f"pytorch-optimizer zero_power_via_newton_schulz_5, weights {w!r}", _pto_ns5(w)))
    out.append(Adapter("pytorch-optimizer-gram-ns", "pytorch-optimizer",
                       "pytorch-optimizer zero_power_via_gram_newton_schulz (fp16)", _pto_gram))
    for cfg in ("safe", "faithful", "gram_side"):
        out.append(Adapter(f"anvil-{cfg.replace('_', '-')}", "anvil", f"the package's {cfg.upper()} cascade",
                           _anvil(cfg)))
    for maps in available_map_sets():
        if maps != "anvil":
            out.append(Adapter(f"anvil-safe-{maps.replace('_', '-')}", "anvil", f"SAFE with the map set {maps!r}",
                               _anvil("safe", maps)))
    return {a.name: a for a in out}


ADAPTERS: dict[str, Adapter] = _registry()


def build(name: str, *, device="cpu", compile: str = "auto") -> Implementation:
    """The named adapter's Implementation; raises :class:`Unavailable` saying why it cannot run here
    (ValueError for an unknown name or compile policy)."""
    if name not in ADAPTERS:
        raise ValueError(f"adapter: unknown {name!r}; known: {', '.join(ADAPTERS)}")
    if compile not in COMPILE:
        raise ValueError(f"compile: expected one of {COMPILE}, got {compile!r}")
    a = ADAPTERS[name]
    dev = torch.device(device).type
    if a.cuda_only and dev != "cuda":
        raise Unavailable(f"{name} needs CUDA (Triton kernels)")
    return a.build(dev, compile)


def load(names, *, device="cpu", compile: str = "auto") -> tuple[list[Implementation], dict[str, str]]:
    """The Implementations of ``names`` that can run here, and for the others why not."""
    impls, missing = [], {}
    for n in names:
        try:
            impls.append(build(n, device=device, compile=compile))
        except Unavailable as exc:
            missing[n] = str(exc)
    return impls, missing


def listing(*, device="cpu") -> str:
    """One line per adapter: name, whether it can run here (or why not), what it is."""
    lines = []
    for n, a in ADAPTERS.items():
        try:
            build(n, device=device)
            state = "available"
        except Unavailable as exc:
            state = f"unavailable: {exc}"
        lines.append(f"{n:<40} {a.summary}\n{'':<40} {state}")
    return "\n".join(lines)
