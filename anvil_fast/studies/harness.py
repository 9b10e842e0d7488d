"""Differential testing of anyone's orthogonalization: a callable ``f(X) -> Y`` judged against the math it declares.

Every optimizer library ships a bf16 Newton-Schulz / Polar Express kernel. Given one, as a callable on
a batch ``[chunk, rows, cols]`` or on one matrix (``per_matrix``; by default seen from its first call),
and the math it declares -- a
:class:`DeclaredMath`: per-step coefficients, normalization and orientation rule, as
:mod:`anvil_ref.polar` runs them in float64 -- the harness runs it on the package's input families
(:mod:`anvil_fast.studies.families`) and reports, per (implementation, shape, family):

``err``        its relative error against the same math in float64 (:func:`reference`)
``floor``      the float64 result rounded once to bf16: no bf16 output can do better
``eager``      the harness's plain eager bf16 runs of the same math in each evaluation form the field
               writes (:data:`FORMS`: fused, unfused, Horner, compiled; on CUDA the field's code
               compiled there, :data:`INDUCTOR_FORMS`; or the Gram form it declares, in its
               declared dtype; :func:`eager_declared`); ``k`` its error over the largest of them
``bound``      the derived bound of the fused eager error for that math
               (:func:`anvil_fast.core.tolerances.declared_roundings`; the well-conditioned family)
``polar``      its error against the exact polar factor ``U V^T`` (float64 SVD), next to ``math``, the
               float64 math's own
``math z``     on the ``spectrum`` family (:func:`spectrum_input`: inputs of known singular values),
               the largest deviation of its output's singular values from the declared map beyond
               every eager form's, in standard errors (:func:`math_statistic`)
``lifted``     on the ``spectrum`` family: its error against the declared math when it runs with every
               tensor torch dispatches promoted to float64 (:func:`lifted_run`), where that run
               reaches its arithmetic (pure PyTorch, eager or compiled: the lift stands
               torch.compile down, :func:`compiler_eager`, and runs the Python source); ``-`` where it does not (a Triton kernel that
               rounds inside, a fast path that refuses float64; an implementation whose Gram torch
               never sees is not lifted at all): the probe alone judges its math. It runs again on
               the probe's matrices of norm near eps / margin, unscaled (the eps and the
               normalization's kind), and records the dtypes the run casts to; where it finds the
               declared math at both scales, a ``math z`` past its limit is the implementation's
               rounding (a finding), not its math
``sv``         min / mean / max of its output's singular values divided by their RMS
``exploded``   outputs whose top singular value passes the math's explosion threshold
               (:func:`anvil_fast.core.tolerances.exploded_sigma`), next to the eager runs'
``gram``       the side of the largest square product it formed, seen through torch's dispatcher
               (:class:`GramRecorder`; not seen for Triton kernels), next to the one its orientation
               rule forms
``ms``         median time per call on CUDA (after a warm-up call per shape, :func:`warm_up`)

and three verdicts (:func:`anvil_fast.core.tolerances.orthogonalizer_clauses`, :data:`VERDICT_RULE`),
every failed clause naming its value and its limit: **math** (the spectrum probe, the lifted run, the Gram side) and
**safety** (non-finite, vacuous, an explosion its eager math does not have: on the same matrices, or as
often on more draws of the probe, :data:`anvil_fast.core.tolerances.EXPLOSION_DRAWS`) FAIL; **rounding** (``err``
over the largest eager form's, beyond twice plus one bf16 rounding) is a finding, as is a math that
explodes in bf16 in its own eager run. Undeclared math (``math=None``) gets safety only, verdict
``unjudged`` unless that fails.

The public place is :mod:`anvil_fast.testing`; from another project's test::

    from anvil_fast.testing import assert_orthogonalizer
    assert_orthogonalizer(my_newton_schulz, coeffs=[(3.4445, -4.7750, 2.0315)], steps=5,
                          normalization="frobenius", margin=1.0, eps=1e-7, transpose_when="tall")

raises :class:`OrthogonalizerMismatch` (an AssertionError) naming every failed clause, with the
table. The command line is ``python -m anvil_fast.studies.difftest --impl package.module:function
...`` or ``--adapter NAME`` (:mod:`anvil_fast.studies.adapters`), with ``--json``, ``--resume``,
``--time-budget-s`` and ``--cache-dir``; both share :data:`DEFAULT_FAMILIES` and :data:`DEFAULT_SHAPES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import linecache
import math
import platform
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from anvil_ref import polar as P
from anvil_ref.maps import MapsLike, load_maps
from anvil_ref.provenance import source_commit

from anvil_fast.core import tolerances as T
from .families import FAMILIES, WELL_CONDITIONED, make_matrix, rel_errs

#: Families whose polar-factor error is reported: full rank, singular values away from 0 relative to
#: the top one or decaying smoothly (on the others the polar factor is set by directions the input
#: barely has, which no bf16 output can follow).
POLAR_FAMILIES = ("gaussian", "well_conditioned", "decaying")
#: The harness's own family: inputs with known singular values, where the math verdict is measured
#: (:func:`spectrum_input`; declared math only).
SPECTRUM = "spectrum"
#: Every family the harness can run: the probe and the differential tests' families.
HARNESS_FAMILIES = (SPECTRUM,) + FAMILIES
#: The families of a default judgement, the API's and the command line's: every one but ``huge``
#: (2^100: its squares overflow fp32, so a bf16 norm is inf there in most of the field's code; ask for it).
DEFAULT_FAMILIES = tuple(f for f in HARNESS_FAMILIES if f != "huge")
#: The family of the timed calls (CUDA, ``time_reps``).
TIMED_FAMILY = "gaussian"
#: Shapes of a default judgement (small, so that the spectrum probe holds SPECTRUM_MIN_COUNT matrices
#: of each; the probe is most of a judgement's time: minutes on a CPU, several times that for a
#: function of one matrix, called once per matrix).
DEFAULT_SHAPES = ((2, 48, 32), (2, 32, 48), (2, 32, 32))
#: The seed step between the draws of :meth:`_Cache.eager_wide` (a prime far from the seeds a judgement
#: is asked for, so that no draw repeats a judged one).
WIDE_SEED_STRIDE = 1_000_003
#: Matrix products whose shapes :class:`GramRecorder` records.
PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul"})

VERDICT_RULE = (
    "verdicts (anvil_fast/core/tolerances.py, orthogonalizer_clauses): math = where the implementation runs with "
    f"every tensor lifted to float64, its output within {T.LIFT_RTOL:g} of the float64 math (far above eps and at "
    "norms near it) and no cast to another half dtype than the declared one; where it does not, the spectrum probe's "
    f"singular values within {T.MATH_Z:g} standard errors of the declared map beyond every eager form's (and the "
    "float64 math's; past it with the lift clean: a rounding finding); the Gram on the declared side; safety = finite, not vacuous (zero, the identity, the input), no explosion "
    "where the same math in eager bf16 does not explode (on the same matrices, or on up to "
    f"{T.EXPLOSION_DRAWS} more draws of them as often: one-sided p >= {T.EXPLOSION_ALPHA:g}); rounding = err <= "
    f"{T.FACTOR:g} x the larger eager form's + 2**{math.log2(T.ATOL):g}, else a finding (k = err / eager). "
    "FAIL = a math or safety clause fails; finding = a rounding clause or the math's own bf16 behaviour; "
    "unjudged = no math declared (safety judged)")


class OrthogonalizerMismatch(AssertionError):
    """An implementation failed the harness's rule; the message holds the table of every row."""


#: The dtypes an orthogonalization can declare it iterates in (:attr:`DeclaredMath.dtype`).
ITERATION_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class DeclaredMath:
    """What an orthogonalization declares it computes (:mod:`anvil_ref.polar`): the per-step
    coefficients, the normalization (:data:`anvil_ref.polar.NORMALIZATIONS`) with its margin and
    eps, and the orientation rule (:data:`anvil_ref.polar.ORIENTATIONS`); ``restarts``: it evaluates
    the steps in the Gram form (the polynomial accumulated on the short side's Gram, ``X`` re-formed
    before each step of ``restarts``, 0-based), whose eager run is then its baseline (:data:`GRAM_FORM`):
    every restart schedule is the same math, so the declared one names the evaluation form only, and
    a different schedule shows in the rounding and safety verdicts, never the math's."""

    coeffs: tuple[tuple[float, float, float], ...]
    normalization: str = "frobenius"
    margin: float = 1.0
    eps: float = 1e-7
    transpose_when: str = "tall"
    restarts: tuple[int, ...] | None = None
    #: the dtype it iterates in (:data:`ITERATION_DTYPES`): its eager runs iterate in it too, and a cast
    #: to a half dtype other than it is a FAIL (float32 code that rounds a product to bf16 included)
    dtype: str = "bfloat16"

    def __post_init__(self):
        object.__setattr__(self, "coeffs", load_maps(self.coeffs))
        if self.normalization not in P.NORMALIZATIONS:
            raise ValueError(f"normalization: expected one of {P.NORMALIZATIONS}, got {self.normalization!r}")
        if self.dtype not in ITERATION_DTYPES:
            raise ValueError(f"dtype: expected one of {ITERATION_DTYPES}, got {self.dtype!r}")
        if self.restarts is not None:
            object.__setattr__(self, "restarts", tuple(int(v) for v in self.restarts))
        if self.transpose_when not in P.ORIENTATIONS:
            raise ValueError(f"transpose_when: expected one of {P.ORIENTATIONS}, got {self.transpose_when!r}")
        for name in ("margin", "eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        if self.margin == 0 and self.eps == 0:
            raise ValueError("margin and eps are both 0: the normalization would divide by zero")

    @classmethod
    def of(cls, coeffs: MapsLike, *, steps: int | None = None, cycle: bool = False, **kw) -> "DeclaredMath":
        """From a map set (a name, a JSON file or triples, :func:`anvil_ref.maps.load_maps`) and a
        number of ``steps``: the triples in order, then the last one repeated (``cycle``: the set
        repeated from its start) until ``steps``; fewer steps than triples take the first ones."""
        maps_ = load_maps(coeffs)
        if steps is not None:
            if not (isinstance(steps, int) and steps >= 1):
                raise ValueError(f"steps: expected a positive integer, got {steps!r}")
            maps_ = tuple(maps_[i % len(maps_)] if cycle else maps_[min(i, len(maps_) - 1)] for i in range(steps))
        return cls(maps_, **kw)

    def describe(self) -> str:
        norm = {"frobenius": f"X/({self.margin:g}||X||_F+{self.eps:g})",
                "frobenius_clamp": f"X/max({self.margin:g}||X||_F,{self.eps:g})",
                "aol": f"AOL rows (eps {self.eps:g})"}[self.normalization]
        return f"{len(self.coeffs)} steps, {norm}, transpose when {self.transpose_when}"

    def composite_max(self) -> float:
        return P.composite_max(maps=self.coeffs, top=P.spectrum_top(normalization=self.normalization,
                                                                    margin=self.margin))

    def exploded_sigma(self) -> float:
        return T.exploded_sigma(self.composite_max())

    def flat_slips(self, *, delta: float = 1e-3, limit: float | None = None) -> list[tuple[int, str, float]]:
        """The coefficient slips no output can show: (step, coefficient, effect) for every coefficient a
        change of ``delta`` (raised or lowered) moves the declared composite map by at most ``limit``
        (default ``LIFT_RTOL``) at every singular value in ``(0, top]``: a contracting cascade
        (Polar Express's eight steps) converges the early steps' cubic and quintic terms away, so such
        a slip computes the declared function within the lifted run's limit, and where the change is
        float64's rounding no test can separate the two.
        ``effect``: the largest change, on a log grid of 4001 singular values from 1e-12 to the top
        (float64: below ~1e-14 it is rounding)."""
        limit = T.LIFT_RTOL if limit is None else limit
        top = P.spectrum_top(normalization=self.normalization, margin=self.margin)
        sigma = np.concatenate([np.geomspace(1e-12, top, 4001), [top]])
        with np.errstate(over="ignore", invalid="ignore"):
            base = P.composite(sigma, maps=self.coeffs)
            flat = []
            for step in range(len(self.coeffs)):
                for k, name in enumerate("abc"):
                    effect = 0.0
                    for sign in (1.0, -1.0):
                        maps_ = [list(t) for t in self.coeffs]
                        maps_[step][k] += sign * delta
                        moved = P.composite(sigma, maps=maps_)
                        # a map that overflows at a singular value either way says nothing there; one
                        # that overflows on one side only moved without bound
                        both = ~np.isfinite(moved) & ~np.isfinite(base)
                        diff = np.where(both, 0.0, np.abs(np.where(np.isfinite(moved), moved, np.inf) -
                                                          np.where(np.isfinite(base), base, np.inf)))
                        effect = max(effect, float(np.nan_to_num(diff, nan=np.inf).max()))
                    if effect <= limit:
                        flat.append((step + 1, name, effect))
        return flat

    def forms(self, device: str | torch.device = "cpu") -> tuple[str, ...]:
        """The eager forms it is compared with on ``device``: the Gram form where it declares restarts,
        else FORMS and, on CUDA with a Frobenius normalization, INDUCTOR_FORMS."""
        if self.restarts is not None:
            return GRAM_FORMS
        cuda = torch.device(device).type == "cuda"
        return FORMS + (INDUCTOR_FORMS if cuda and self.normalization != "aol" and _inductor_ok() else ())

    def to_json(self) -> dict:
        return {"coeffs": [list(t) for t in self.coeffs], "normalization": self.normalization,
                "margin": self.margin, "eps": self.eps, "transpose_when": self.transpose_when,
                "restarts": None if self.restarts is None else list(self.restarts), "dtype": self.dtype}


@dataclass
class Implementation:
    """A callable to judge: ``fn`` takes a batch ``[chunk, rows, cols]`` of ``input_dtype`` (one
    matrix ``[rows, cols]`` when ``per_matrix``) and returns its orthogonalization, any float dtype;
    ``math`` is what it declares (None: undeclared). ``per_matrix=None``: decided by
    :meth:`settle` from one call on a batch (a function written for one matrix, as torch's Muon and
    the original Muon write it, raises or returns another shape there, and is then called one
    matrix at a time). ``fn`` always gets a copy of the harness's input: one that works in place
    (``X /= ...`` after a cast that is a no-op) cannot change what the other columns read."""

    name: str
    fn: Callable[[Tensor], Tensor]
    math: DeclaredMath | None
    per_matrix: bool | None = False
    input_dtype: torch.dtype = torch.float32
    note: str = ""
    #: its Gram side recorded (:class:`GramRecorder`, in a call of its own with torch.compile stood
    #: down, :func:`compiler_eager`); off where its source cannot run under a dispatch mode
    observe: bool = True
    #: how :meth:`settle` decided to call it, when it decided one matrix at a time (each row says it)
    called: str = ""

    def prepare(self, x: Tensor) -> Tensor:
        """What ``fn`` is given for ``x``: a copy in ``input_dtype``."""
        return x.to(self.input_dtype, copy=True)

    def run(self, x: Tensor) -> Tensor:
        """``fn`` on an input :meth:`prepare` made (per matrix or on the batch)."""
        if self.per_matrix:
            return torch.stack([self.fn(m) for m in x.unbind(0)])
        return self.fn(x)

    def __call__(self, x: Tensor) -> Tensor:
        return self.run(self.prepare(x))

    def settle(self, x: Tensor) -> None:
        """``per_matrix=None``: call ``fn`` once on the batch ``x``; where it raises or returns another
        shape and one matrix of it works, it is called one matrix at a time from then on (``called``
        says why); else on batches (the rows report what the batch call does)."""
        if self.per_matrix is not None:
            return
        with torch.no_grad():
            try:
                y = self.fn(self.prepare(x))
                if isinstance(y, Tensor) and tuple(y.shape) == tuple(x.shape):
                    self.per_matrix = False
                    return
                why = f"returned {tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__} for a batch"
            except Exception as exc:  # noqa: BLE001 -- any refusal of a batch is what is decided on
                why = f"a batch raised {type(exc).__name__}"
            try:
                y = self.fn(self.prepare(x[0]))
                one = isinstance(y, Tensor) and tuple(y.shape) == tuple(x.shape[1:])
            except Exception:  # noqa: BLE001
                one = False
        self.per_matrix = one
        if one:
            self.called = f"called one matrix at a time ({why}; per_matrix=True says so and skips this check)"


class GramRecorder(TorchDispatchMode):
    """Records the output shape of every matrix product (:data:`PRODUCTS`) torch dispatches while
    active: the largest square one is the Gram an iteration forms. Products inside a Triton kernel are
    not seen."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ in PRODUCTS and isinstance(out, Tensor) and out.ndim >= 2:
            self.shapes.append(tuple(out.shape))
        return out

    def gram_side(self) -> int | None:
        """The side of the largest square product seen (None: none seen)."""
        sides = [s[-1] for s in self.shapes if s[-1] == s[-2]]
        return max(sides) if sides else None


def compiler_eager():
    """A context in which every ``torch.compile``'d function runs its Python source eagerly
    (``torch.compiler.set_stance("force_eager")``). The harness's dispatch modes (:class:`GramRecorder`,
    :class:`Lift`) run under it: dynamo does not trace under a dispatch mode, and a function compiled
    with ``fullgraph=True`` that is called under one is left unable to run at all (every later call
    raises "found no compiled frames"), so a compiled implementation would FAIL for the harness's
    looking, not for its own arithmetic."""
    stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _gram_side_of(impl: Implementation, x: Tensor):
    rec = GramRecorder()
    with compiler_eager(), rec:
        impl(x)
    return rec.gram_side()


def run_impl(impl: Implementation, x: Tensor, *, seed: int = 0, record: bool = True,
             chunk: int | None = None) -> tuple[Tensor, int | None]:
    """``impl(x)`` with torch's global generators seeded with ``seed`` (a stochastic rounding inside
    draws the same numbers on every call) and, with ``record``, the Gram side it formed; ``chunk``:
    call it on batches of that many matrices (a compiled function then sees one shape). The Gram side
    is recorded in a call of its own on one matrix (on the first batch where that call raises: code
    that indexes the batch), under :func:`compiler_eager` (the products of the source show it); the
    output is the unobserved calls' (compiled where the implementation compiles)."""
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    parts = [x] if chunk is None or chunk >= x.shape[0] else list(x.split(chunk))
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        side = None
        if record:
            torch.manual_seed(seed)
            try:
                side = _gram_side_of(impl, parts[0][:1])
            except Exception:  # noqa: BLE001 -- code that needs more than one matrix (it indexes the batch)
                torch.manual_seed(seed)
                side = _gram_side_of(impl, parts[0])
        torch.manual_seed(seed)
        ys = [impl(part) for part in parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return y, side


#: Where an exception comes from the compiler stack (dynamo, inductor, Triton's compiler) rather than
#: from the implementation's own code: a file of its traceback or its class's module under one of these.
_COMPILER_PATHS = ("/torch/_dynamo/", "/torch/_inductor/", "/triton/")
_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "triton")


def compiler_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the compiler stack (:data:`_COMPILER_PATHS`, :data:`_COMPILER_MODULES`)."""
    if any(c.__module__.startswith(_COMPILER_MODULES) for c in type(exc).__mro__):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and any(p in frames[-1].filename.replace("\\", "/") for p in _COMPILER_PATHS)


def raised(exc: BaseException, limit: int = 160) -> str:
    """``raised Type: first line`` of ``exc``, with the innermost frame of the code it ran: dynamo's
    "from user code" frames where it names them, else the traceback's innermost frame outside torch."""
    text = str(exc)
    head = f"raised {type(exc).__name__}: {(text.splitlines() or [''])[0][:limit]}"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text.split("from user code:")[-1]) \
        if "from user code:" in text else []
    if not frames:
        frames = [(f.filename, str(f.lineno), f.name) for f in traceback.extract_tb(exc.__traceback__)
                  if "/torch/" not in f.filename.replace("\\", "/")]
    if frames:
        path, line, name = frames[-1]
        base = path.replace("\\", "/").rsplit("/", 1)[-1]
        head += f" (at {base}:{line} in {name})"
    return head


#: torch.compile's recompile limit while the harness judges: it calls an implementation at more distinct
#: inputs than a training step does (each family's batch, the spectrum probe's, one matrix for the Gram
#: side, the lift's float64), and a compiled function of the field stopped at torch's default (8 per
#: function) would FAIL for the harness's variety of inputs, not for its own.
JUDGE_RECOMPILE_LIMIT = 64


def _dynamo_config(**values):
    """``torch._dynamo.config`` patched with those of ``values`` this torch has (a context)."""
    cfg = importlib.import_module("torch._dynamo").config
    return cfg.patch(**{k: v for k, v in values.items() if hasattr(cfg, k)})


def _recompile_room():
    """The recompile limit at least :data:`JUDGE_RECOMPILE_LIMIT` (a context)."""
    cfg = importlib.import_module("torch._dynamo").config
    return _dynamo_config(recompile_limit=max(getattr(cfg, "recompile_limit", 0), JUDGE_RECOMPILE_LIMIT))


# ------------------------------------------------------------------------------ the implementation lifted to float64

#: Floating dtypes the lift promotes to float64.
_LOW = (torch.bfloat16, torch.float16, torch.float32)


class Lift(TorchDispatchMode):
    """While active, every op torch dispatches runs in float64: floating tensor arguments below
    float64 are promoted and a floating ``dtype`` argument below float64 becomes float64, so a casting
    ``G.bfloat16()``, a buffer ``torch.empty(..., dtype=torch.bfloat16)`` and every product become
    float64 ones. ``low``: ops that still returned a tensor below float64 (in place into a tensor made
    before the lift, say): the run did not stay in float64. ``casts``: the dtypes below float64 the run
    asked for (a cast's or a factory's ``dtype``), the precision it would have run in. Arithmetic torch
    does not dispatch (a Triton kernel, NumPy) is not reached; :func:`lifted_run` tells such a run by
    its output."""

    def __init__(self):
        super().__init__()
        self.low: list[str] = []
        self.casts: set[str] = set()
        #: computations outside torch's dispatcher inside the lifted call (:func:`_counting_outside`)
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def up(t):
            return t.double() if isinstance(t, Tensor) and t.dtype in _LOW else t

        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") in _LOW:
            self.casts.add(str(kwargs["dtype"]).replace("torch.", ""))
            kwargs["dtype"] = torch.float64
        # a tensor the op writes (in place, out=) is left as it is: a promoted copy would take the write
        # and the tensor itself keep its old values
        written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        args = tuple(v if a.name in written else tree_map(up, v) for a, v in zip(func._schema.arguments, args))
        kwargs = {k: v if k in written else tree_map(up, v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", "aten") not in ("aten", "prims"):
            self.kernels += 1  # a library's own operator (torch.library): its arithmetic is its kernel's

        def low(out):
            return any(isinstance(o, Tensor) and o.dtype in _LOW for o in (out if isinstance(out, (tuple, list)) else (out,)))

        if low(out) and not written and any(a.name == "dtype" and a.kwarg_only for a in func._schema.arguments):
            out = func(*args, **{**kwargs, "dtype": torch.float64})  # a factory's default dtype
        if low(out):
            self.low.append(func._overloadpacket.__name__)
        return out


@dataclass(frozen=True)
class Lifted:
    """The implementation run under :class:`Lift` (:func:`lifted_run`). ``err``: its output against the
    declared math in float64 (largest relative Frobenius error; None where the lift did not reach its
    arithmetic, ``why_not`` says why); ``off``: the part of its output off the singular basis of the
    normalized input (relative; an exact run of any odd matrix polynomial has none, a rounding
    somewhere the lift does not reach puts some there; where the output is within LIFT_OFF of the
    declared math, the bound ``err / (1 - err)`` on it, not measured); ``coeffs``: where ``err`` is past
    LIFT_RTOL, the dtype whose rounding of every declared coefficient explains the output ("" none)."""

    err: float | None
    off: float
    why_not: str = ""
    coeffs: str = ""
    #: the same on the probe's matrices of norm near eps / margin, at their own scale (None: not run,
    #: the math declares no eps or the probe holds none of them): there the eps and the normalization's
    #: kind set the scale, which the scaled run above leaves out
    eps_err: float | None = None
    #: the dtypes below float64 the run asked for (:attr:`Lift.casts`), sorted
    casts: tuple[str, ...] = ()
    #: where ``off`` is past LIFT_OFF with every operation run by torch in float64 and no Triton kernel
    #: launched (no rounding left to put it there: not a matrix polynomial of its input, a math FAIL):
    #: that limit, else None
    not_polynomial: float | None = None


def lift_input(x: Tensor) -> Tensor:
    """The lifted run's input from the spectrum probe's batch ``x``: its first LIFT_COUNT matrices (full
    rank with a top singular value near the norm, and low rank: the first step's coefficients show)
    scaled by 2^LIFT_SCALE_EXP (exact), where an eps in the normalization, whichever its placement or
    value up to bf16's 2^-7, moves the output by less than LIFT_RTOL / 10."""
    return x[:T.LIFT_COUNT] * 2.0 ** T.LIFT_SCALE_EXP


def lift_eps_input(x: Tensor, math_: DeclaredMath) -> Tensor | None:
    """The lifted run's second input from the spectrum probe's batch ``x`` (:func:`spectrum_input`):
    up to LIFT_COUNT of its last matrices, those of norm near eps / margin, unscaled; None where the
    math declares no eps (the probe then holds none)."""
    n = min(T.LIFT_COUNT, int(round(int(x.shape[0]) * SPECTRUM_EPS_SHARE))) if math_.eps > 0 else 0
    return x[-n:] if n else None


@contextlib.contextmanager
def _counting_outside(lift: "Lift"):
    """Count into ``lift.kernels`` what computes outside torch's dispatcher inside the block: Triton
    kernel launches and tensors handed to NumPy (``Tensor.numpy``); :class:`Lift` counts a library's
    own operators (not ``aten``). The lift does not reach the arithmetic there, so a rounding there is
    no slip of the code's math."""
    patched = []
    try:
        from triton.runtime.jit import JITFunction

        patched.append((JITFunction, "run"))
    except Exception:  # noqa: BLE001 -- no Triton: nothing to count there
        pass
    patched.append((Tensor, "numpy"))
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def counting(fn):
        def counted(*args, **kwargs):
            lift.kernels += 1
            return fn(*args, **kwargs)
        return counted

    for owner, name, fn in originals:
        setattr(owner, name, counting(fn))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _lift_call(impl: Implementation, x: Tensor, seed: int) -> tuple[Tensor | None, Lift, str]:
    """``impl`` on ``x`` under :class:`Lift`: its output (None where the lift did not reach its
    arithmetic), the lift, and why not."""
    xin = impl.prepare(x)
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    lift = Lift()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), compiler_eager(), lift, \
                _counting_outside(lift):
            torch.manual_seed(seed)
            y = impl.run(xin)
    except Exception as exc:  # noqa: BLE001 -- a refusal of float64 is a fact about the run, not a verdict
        return None, lift, f"raised {type(exc).__name__} in float64"
    if not isinstance(y, Tensor) or tuple(y.shape) != tuple(x.shape):
        return None, lift, "returned another shape in float64"
    if lift.low:
        return None, lift, (f"wrote into a tensor of a lower dtype made before the call "
                            f"({', '.join(sorted(set(lift.low)))})")
    if y.dtype != torch.float64:
        return None, lift, f"returned {str(y.dtype).replace('torch.', '')}: computed outside torch's dispatcher"
    if not torch.isfinite(y).all():
        return None, lift, "not finite in float64"
    return y, lift, ""


def _off_spectral(y: Tensor, x: Tensor, math_: DeclaredMath) -> float:
    """||y - u diag(u^T y v) v^T|| / ||y||, largest over the batch, with u, v the singular vectors of
    the declared normalization of x (float64, oriented as declared)."""
    flip = P.transposes(tuple(x.shape), transpose_when=math_.transpose_when)
    z = x.double().cpu()
    yo = y.double().cpu()
    if flip:
        z, yo = z.mT, yo.mT
    z0 = torch.as_tensor(P.normalize(z, normalization=math_.normalization, margin=math_.margin, eps=math_.eps))
    u, _, vh = torch.linalg.svd(z0, full_matrices=False)
    d = (u.mT @ yo @ vh.mT).diagonal(dim1=-2, dim2=-1)
    rest = yo - (u * d[..., None, :]) @ vh
    return float((rest.flatten(1).norm(dim=1) / yo.flatten(1).norm(dim=1).clamp_min(1e-300)).max())


def lifted_run(impl: Implementation, x: Tensor, math_: DeclaredMath, *, seed: int = 0,
               eps_x: Tensor | None = None) -> Lifted:
    """``impl`` on ``x`` (:func:`lift_input`) under :class:`Lift`, compared with the declared math in
    float64: a coefficient slip far below bf16's noise stands out against float64's. The lift reaches
    the run where its output is float64, no op returned a lower dtype, and the output has no part off
    the input's singular basis beyond LIFT_OFF (an exact run of the declared kind of math has none).
    ``eps_x`` (:func:`lift_eps_input`): where given, ``impl`` is lifted on it too and compared at its
    own scale, where the eps and the normalization's kind set the scale (``eps_err``)."""
    y, lift, why = _lift_call(impl, x, seed)
    if y is None:
        return Lifted(None, math.nan, why)
    x64 = impl.prepare(x).double()
    err = float(rel_errs(y, reference(x64, math_)).max())
    # the declared math's output r has no part off the basis, so y's is at most ||y - r|| / ||y||,
    # err / (1 - err): within LIFT_OFF, that bound decides what the SVD would (the float64 SVDs on the
    # host are the lifted run's costly part at the bank shapes)
    bound = err / (1 - err) if err < 1 else math.inf
    off = bound if bound <= T.LIFT_OFF else _off_spectral(y, x64, math_)
    if not off <= T.LIFT_OFF:
        if not lift.kernels:
            # every operation ran in torch, in float64, and nothing ran outside it (no Triton kernel, no
            # NumPy): no rounding left to put a part off the basis, so the output is not a matrix
            # polynomial of its input
            return Lifted(None, off, f"its float64 output is off its input's singular basis by {off:.2g} with every "
                                     "operation run by torch in float64 and nothing outside it: not a matrix "
                                     "polynomial of its input", not_polynomial=T.LIFT_OFF)
        return Lifted(None, off, f"its float64 output is off its input's singular basis by {off:.2g}: a rounding the "
                                 f"lift does not reach ({lift.kernels} call(s) outside torch's own operators: Triton kernels, "
                                 "NumPy, a library's operators)")
    coeffs = ""
    if not err <= T.LIFT_RTOL:
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            held = dataclasses.replace(math_, coeffs=tuple(tuple(float(torch.tensor(c).to(dt)) for c in t)
                                                           for t in math_.coeffs))
            if float(rel_errs(y, reference(x64, held)).max()) <= T.LIFT_RTOL:
                coeffs = str(dt).replace("torch.", "")
                break
    casts = set(lift.casts)
    eps_err = None
    if eps_x is not None:
        ye, lift_e, why = _lift_call(impl, eps_x, seed)
        if ye is None:
            return Lifted(None, off, f"at norms near eps: {why}", coeffs)
        casts |= lift_e.casts
        eps_err = float(rel_errs(ye, reference(impl.prepare(eps_x).double(), math_)).max())
    return Lifted(err, off, "", coeffs, eps_err, tuple(sorted(casts)))


# ------------------------------------------------------------------------------ the same math, float64

def _device_iteration(x: Tensor, math_: DeclaredMath) -> Tensor:
    """:func:`anvil_ref.polar.quintic_iteration` in torch float64 on x's device (the same equations;
    tests/test_harness.py holds the two equal): the reference where NumPy on the host would be slow."""
    z = x.double()
    flip = P.transposes(tuple(z.shape), transpose_when=math_.transpose_when)
    if flip:
        z = z.mT
    if math_.normalization == "aol":
        z = z * (z @ z.mT).abs().sum(-1).clamp_min(math_.eps).rsqrt()[..., :, None]
    else:
        nrm = z.square().sum(dim=(-2, -1), keepdim=True).sqrt() * math_.margin
        z = z / (nrm + math_.eps if math_.normalization == "frobenius" else nrm.clamp_min(math_.eps))
    for a, b, c in math_.coeffs:
        g = z @ z.mT
        z = a * z + (b * g + c * (g @ g)) @ z
    return z.mT if flip else z


def reference(x: Tensor, math_: DeclaredMath) -> Tensor:
    """The declared math of ``x`` in float64, on x's device: :func:`anvil_ref.polar.quintic_iteration`
    on the CPU, its torch form on CUDA."""
    if x.device.type == "cpu":
        return P.quintic_iteration(x, coeffs=math_.coeffs, normalization=math_.normalization, margin=math_.margin,
                                   eps=math_.eps, transpose_when=math_.transpose_when)
    return _device_iteration(x, math_)


def polar_factor(x: Tensor) -> Tensor:
    """:func:`anvil_ref.polar.polar_factor` of ``x`` (float64), on x's device."""
    if x.device.type == "cpu":
        return P.polar_factor(x)
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    keep = (s > max(x.shape[-2:]) * 2.0 ** -52 * s[..., :1]).double()
    return (u * keep[..., None, :]) @ vh


# ------------------------------------------------------------------------------ the same math, eager bf16

#: The dtype the eager runs iterate in (:attr:`DeclaredMath.dtype`; set by :func:`eager_declared`).
_DT = [torch.bfloat16]


def _mm(x: Tensor, y: Tensor) -> Tensor:
    # CPU: the model of a bf16 GEMM with fp32 accumulation (its bits do not depend on which bf16 kernel
    # the BLAS picks, anvil_fast.core.eager.GEMMS); CUDA: the library's bf16 GEMM, as the implementations use
    return (x.float() @ y.float()).to(_DT[0]) if x.device.type == "cpu" else x @ y


def _addmm(beta: float, c: Tensor, x: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
    """``beta*c + alpha*(x @ y)`` rounded once to bf16 (fp32 accumulation)."""
    if c.device.type == "cpu" or alpha == 0:
        return (beta * c.float() + alpha * (x.float() @ y.float())).to(_DT[0])
    return torch.baddbmm(c, x, y, beta=beta, alpha=alpha)


#: The evaluation forms of one step an implementation can write (:func:`eager_declared`):
#: ``fused`` rounds ``B = b A + c A^2`` and ``Z = a Z + B Z`` once each (``torch.baddbmm`` /
#: ``addmm`` with beta and alpha, a fused epilogue), after the normalization in fp32; ``unfused``
#: writes them as the field's eager code does, ``B = b*A + c*A@A; X = a*X + B@X``, every product,
#: scaling and sum rounded to bf16, after a normalization by the bf16 norm; ``horner`` as
#: heavyball writes it, ``Y = c*A; Y += b I; Y = Y@A; Y += a I; X = Y@X``, each rounded (and b and a
#: with them where the device rounds a Python scalar added to a bf16 tensor, :func:`scalar_rounded`:
#: the CPU does, CUDA adds it in fp32); ``compiled`` as torch.compile
#: turns the unfused code into kernels (dion's and heavyball's compiled steps): the normalization in
#: fp32 rounded once, each product rounded once, and each line's element-wise part (``b*A + c*AA``,
#: ``a*X + BX``) computed in fp32 and rounded once, a rounding bias of its own (Muon's step 1 b and
#: c slips need 16384 probe matrices to stand past the hull it widens); ``horner-fp32`` Horner after
#: the fp32 normalization (heavyball normalizes the fp32 input, then rounds it to bf16): which of the
#: two normalizations precedes the steps moves the probe's singular values past the other's hull.
FORMS = ("fused", "unfused", "horner", "compiled", "horner-fp32")
#: On CUDA, one form more: the field's unfused code (``X / (||X||_F margin + eps)`` of the bf16
#: matrix, ``B = b*A + c*(A@A); X = a*X + B@X``) compiled by torch.compile on that device, the bits
#: dion's and any compiled Muon produce there. The ``compiled`` emulation matches what Inductor makes
#: of that code on the CPU and not what it makes on CUDA (its fusions there round differently), so
#: on CUDA the compiler itself runs it (tools/probe_forms.py measures each form's distance).
#: ``inductor-prescaled`` is the same with ``B = b*A + c*A@A``, c scaling A before the product, as
#: Keller Jordan's Muon and modded-nanogpt write it (Python reads ``c*A@A`` as ``(c*A)@A``).
INDUCTOR_FORM = "inductor"
INDUCTOR_FORMS = (INDUCTOR_FORM, "inductor-prescaled")
#: The Gram form (:meth:`DeclaredMath.forms`): ``R = X X^T``; per step ``Z = b R + c R^2`` and the
#: accumulated ``Q = a Q + Q Z`` (``Z + a I`` first), ``R`` carried as ``a (a R + R Z) + Z (a R + R Z)``;
#: at a restart and at the end ``X = Q X`` (dion's and Dao AI Lab's gram-newton-schulz, pytorch-optimizer's
#: gram NS, the package's GRAM_SIDE), each product rounded once to bf16.
GRAM_FORM = "gram"
#: The Gram forms: ``gram`` adds ``a I`` in the iteration's dtype (``Z + a * I``, ``diagonal().add_(a)``),
#: ``gram-a32`` in fp32 (a fused epilogue), at the first step and after a restart; later steps take a as
#: ``addmm``'s beta, unrounded, as dion's and gram-newton-schulz's code does. A Gram form that builds
#: ``P = a*I + b*R + c*R@R`` with ``I`` in bf16 at every step runs each step's a rounded to bf16
#: (Muon's 3.4445 becomes 3.4375, a slip of 7e-3); its lifted run builds ``I`` in float64 and finds the
#: declared math, so the probe's deviation is reported as that code's rounding.
GRAM_FORMS = (GRAM_FORM, "gram-a32")


_SCALAR_ROUNDED: dict[tuple[str, torch.dtype], bool] = {}


def scalar_rounded(device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch, adding a Python scalar to a ``dtype`` tensor on ``device`` (``y.add_(b)``,
    ``y + b``), rounds the scalar to ``dtype`` first (the CPU's kernels) or adds it in fp32 (CUDA's
    opmath): measured once per device type on values where the two differ, not assumed."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point dtype, got {dtype}")
    key = (torch.device(device).type, dtype)
    if key not in _SCALAR_ROUNDED:
        y = torch.linspace(-3.0, 3.0, 4097, device=device).to(dtype)
        b = -6.8946  # not a bf16 or fp16 number
        t = y.clone()
        t.add_(b)
        _SCALAR_ROUNDED[key] = bool((t == (y.float() + torch.tensor(b).to(dtype).float()).to(dtype)).all())
    return _SCALAR_ROUNDED[key]


def _bf(v: float, device="cpu") -> float:
    # a scalar as torch adds it to a tensor of the iteration's dtype on ``device`` (``y.add_(b)``,
    # ``y + b``): rounded to that dtype first where the device does so (scalar_rounded); a
    # multiplication keeps it in fp32
    return float(torch.tensor(v, dtype=torch.float64).to(_DT[0])) if scalar_rounded(device, _DT[0]) else float(v)


def _ew(x: Tensor) -> Tensor:
    # one element-wise bf16 operation's result: computed in fp32, rounded once (torch's bf16 arithmetic)
    return x.to(_DT[0])


def eager_declared(x: Tensor, math_: DeclaredMath, form: str = "fused", *, chunk: int | None = None) -> Tensor:
    """The declared math in plain eager bf16 (the ``eager`` columns): ``x`` cast to bf16 (clamped to its
    finite range), oriented, normalized in fp32 after an exact power-of-two prescale (eps scaled alike:
    nothing over- or underflows, nothing extra is rounded; AOL's row sums from the bf16 first Gram) and
    rounded to bf16 (``unfused`` and ``horner``: divided by the norm rounded to bf16, times the margin
    and plus eps each rounded, as the field's code does); then per step ``A = Z Z^T`` (one product, fp32
    accumulation, rounded once) and, in the ``form`` of :data:`FORMS`, ``B = b A + c A^2`` and
    ``Z = a Z + B Z``: ``fused``, each one product with fp32 accumulation rounded once to bf16;
    ``unfused``, ``c*(A@A)``, ``b*A``, their sum, ``B@Z``, ``a*Z`` and that sum each rounded to bf16;
    ``compiled``, ``A@A`` and ``B@Z`` rounded, each line's element-wise part in fp32 rounded once;
    ``horner``, ``(a I + (b I + c A) A) Z`` with every operation rounded; INDUCTOR_FORMS (CUDA) the
    field's code compiled, called on batches of ``chunk`` matrices. Returns bf16 of x's shape."""
    if form not in FORMS + GRAM_FORMS + INDUCTOR_FORMS:
        raise ValueError(f"form: expected one of {FORMS + GRAM_FORMS + INDUCTOR_FORMS}, got {form!r}")
    if form in INDUCTOR_FORMS and (math_.normalization == "aol" or math_.restarts is not None):
        raise ValueError(f"form {form!r}: the field's compiled code normalizes by the Frobenius norm and has no "
                         f"restarts; got normalization {math_.normalization!r}, restarts {math_.restarts!r}")
    if chunk is not None and not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk: expected a positive number of matrices or None, got {chunk!r}")
    dt = getattr(torch, math_.dtype)
    old, _DT[0] = _DT[0], dt
    try:
        return _eager(x, math_, form, dt, chunk)
    finally:
        _DT[0] = old


def _eager(x: Tensor, math_: DeclaredMath, form: str, dt: torch.dtype, chunk: int | None = None) -> Tensor:
    if x.ndim == 2:
        return _eager(x[None], math_, form, dt, chunk)[0]
    bf_max = torch.finfo(torch.bfloat16).max
    X = x.float().clamp(-bf_max, bf_max)
    flip = P.transposes(tuple(X.shape), transpose_when=math_.transpose_when)
    if form in INDUCTOR_FORMS:  # the field's code casts inside the compiled function (its input fp32)
        Z = _inductor(X.mT if flip else X, math_, chunk, prescaled=form != INDUCTOR_FORM)
        return Z.mT if flip else Z
    # bf16 input as the field casts it; an fp16 iteration normalizes the fp32 input first
    X = X.bfloat16() if dt == torch.bfloat16 else X
    Z = X.mT.contiguous() if flip else X
    zf = Z.float()
    amax = zf.abs().amax(dim=(-2, -1), keepdim=True)
    s = torch.exp2(-torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))).clamp(-126, 126))
    zf = zf * s
    if math_.normalization == "aol":
        A = _mm(zf.bfloat16(), zf.bfloat16().mT)
        r = A.float().abs().sum(-1).clamp_min(math_.eps * s[..., 0] ** 2).rsqrt()
        Z = (zf * r[..., :, None]).to(dt)
    elif form in ("fused", "compiled", "horner-fp32"):
        nrm = zf.square().sum(dim=(-2, -1), keepdim=True).sqrt() * math_.margin
        d = nrm + math_.eps * s if math_.normalization == "frobenius" else torch.maximum(nrm, math_.eps * s)
        Z = (zf / d).to(dt)
    else:  # as the field writes it: the norm of the bf16 matrix a bf16 number, times the margin, plus eps
        nrm = _ew(zf.square().sum(dim=(-2, -1), keepdim=True).sqrt()).float()
        if math_.margin != 1.0:
            nrm = _ew(nrm * math_.margin).float()
        eps = torch.tensor(math_.eps).bfloat16().float() * s
        d = _ew(nrm + eps).float() if math_.normalization == "frobenius" else torch.maximum(nrm, eps)
        Z = (zf / d).to(dt)
    eye = torch.eye(Z.shape[-2], dtype=torch.float32, device=Z.device)
    if form in GRAM_FORMS:
        Z = _gram_form(Z, math_.coeffs, set(math_.restarts or ()), eye, round_a=form == GRAM_FORM)
        return Z.mT if flip else Z
    for a, b, c in math_.coeffs:
        A = _mm(Z, Z.mT)
        if form == "fused":
            B = _addmm(b, A, A, A, alpha=c)
            Z = _addmm(a, Z, B, Z)
        elif form == "unfused":
            B = _ew(_ew(b * A.float()).float() + _ew(c * _mm(A, A).float()).float())
            Z = _ew(_ew(a * Z.float()).float() + _mm(B, Z).float())
        elif form == "compiled":
            B = _ew(b * A.float() + c * _mm(A, A).float())
            Z = _ew(a * Z.float() + _mm(B, Z).float())
        else:  # horner(-fp32): Z = (a I + (b I + c A) A) Z, the scalars added as the device adds them
            Y = _ew(_ew(c * A.float()).float() + _bf(b, Z.device) * eye)
            Y = _ew(_mm(Y, A).float() + _bf(a, Z.device) * eye)
            Z = _mm(Y, Z)
    return Z.mT if flip else Z


def _field_source(math_: DeclaredMath, *, prescaled: bool = False) -> str:
    """The field's unfused code for ``math_`` as a compiled Muon writes it (INDUCTOR_FORMS): the
    coefficients literals in the function's body. Literals compile into the kernels as constants;
    the same numbers passed at run time (a tensor, or floats torch.compile turns dynamic on a
    recompile) compile into different kernels that round differently, so each map set gets a function
    of its own."""
    n = "n * %r" % float(math_.margin) if math_.margin != 1.0 else "n"
    d = f"({n}).clamp(min={float(math_.eps)!r})" if math_.normalization == "frobenius_clamp" else f"{n} + {float(math_.eps)!r}"
    coeffs = [tuple(float(v) for v in t) for t in math_.coeffs]
    return ("def field(G):\n"
            f"    X = G.to(torch.{math_.dtype})\n"
            "    n = X.norm(dim=(-2, -1), keepdim=True)\n"
            f"    X = X / ({d})\n"
            f"    for a, b, c in {coeffs!r}:\n"
            "        A = X @ X.mT\n"
            f"        B = b * A + {'c * A @ A' if prescaled else 'c * (A @ A)'}\n"
            "        X = a * X + B @ X\n"
            "    return X\n")


_COMPILED: dict = {}


def _inductor_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _inductor(Z: Tensor, math_: DeclaredMath, chunk: int | None = None, *, prescaled: bool = False) -> Tensor:
    """INDUCTOR_FORMS on the oriented fp32 ``Z`` (cast to the declared dtype inside, unscaled: the
    field's code does not prescale; Inductor may fuse the cast into the norm), in batches of ``chunk``
    matrices as the implementation is called (the batch decides which GEMM kernels run, and with them
    the rounding); compiled once per declared math (:func:`_field_source`), per shape as torch.compile
    does."""
    fn = _field_function(math_, prescaled=prescaled)
    parts = [Z] if chunk is None or chunk >= Z.shape[0] else list(Z.split(chunk))
    # a recompile limit hit would run the code eagerly, silently, and the hull would lose the form
    with torch.no_grad(), _dynamo_config(fail_on_recompile_limit_hit=True):
        return torch.cat([fn(p) for p in parts])


def _field_function(math_: DeclaredMath, *, prescaled: bool = False) -> Callable[[Tensor], Tensor]:
    """:func:`_field_source`'s function, compiled by torch.compile (once per source). Its source is
    registered with ``linecache`` under its file name: torch.compile before 2.13 wraps a function
    whose source file it cannot find in one shared frame, so that every such function would count
    against one recompile limit (8) and the ninth run eagerly."""
    src = _field_source(math_, prescaled=prescaled)
    if src not in _COMPILED:
        name = f"<anvil_fast.studies.harness field code {len(_COMPILED)}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        scope: dict = {"torch": torch}
        exec(compile(src, name, "exec"), scope)
        _COMPILED[src] = torch.compile(scope["field"])
    return _COMPILED[src]


def _gram_form(X: Tensor, coeffs, restarts: set, eye: Tensor, round_a: bool = True) -> Tensor:
    R = _mm(X, X.mT)
    Q = None
    n = len(coeffs)
    for i, (a, b, c) in enumerate(coeffs):
        if i in restarts and i != 0 and Q is not None:
            X = _mm(Q, X)
            R = _mm(X, X.mT)
            Q = None
        Zp = _addmm(b, R, R, R, alpha=c)
        # a I: a in the iteration's dtype (``a * I`` of that dtype), or in fp32
        aI = (float(torch.tensor(a, dtype=torch.float64).to(_DT[0])) if round_a else a) * eye
        Q = _ew(Zp.float() + aI) if Q is None else _addmm(a, Q, Q, Zp)
        if i < n - 1 and i + 1 not in restarts:
            RZ = _addmm(a, R, R, Zp)
            R = _addmm(a, RZ, Zp, RZ)
    return _mm(Q, X)


# ------------------------------------------------------------------------------ the math, seen through known singular values

#: Matrices of the ``spectrum`` probe per shape: SPECTRUM_MIN_COUNT, at most as many as fit
#: SPECTRUM_MAX_ELEMENTS elements (large shapes: fewer matrices, each with many points), at least the
#: shape's batch. The top of the normalized range, where a first step's coefficients show, has one
#: point per matrix: 16384 matrices see a 1e-3 slip raising any coefficient of Muon's quintic at 10 or
#: more standard errors with the compiled form in the hull (tests/test_harness.py's mutation set; 4096
#: saw step 1's b and c at 5). A slip lowering step 1's a, b or c moves the output the way the forms'
#: rounding does (it shrinks it), inside their hull: no count of matrices separates the two (the
#: lifted run, which leaves no rounding, does).
SPECTRUM_MIN_COUNT, SPECTRUM_MAX_ELEMENTS = 16384, 2 ** 26
#: The probe's matrices reach an implementation in batches of about this many elements.
SPECTRUM_CHUNK_ELEMENTS = 2 ** 17
#: The share of the probe's matrices whose Frobenius norm is within a factor 4 of eps x margin^-1
#: (where eps and the normalization's kind decide the scale), and the range of the others' scales.
SPECTRUM_EPS_SHARE, SPECTRUM_SCALE_EXP = 0.125, 4.0
#: The probe's bins: log-spaced in the normalized singular value, each with at least this many points.
SPECTRUM_BINS, SPECTRUM_BIN_MIN = 16, 48
#: A residual beyond this (a singular value off the map by more than the map's whole range) marks an
#: exploded matrix (:func:`math_statistic`).
MATH_WILD = 10.0
#: The sensitivity direction of a relative change of eps (:func:`sensitivities`).
EPS_DIRECTION = "eps (relative)"
#: The sensitivity direction of a change of the margin.
MARGIN_DIRECTION = "margin"


@dataclass
class Spectrum:
    """The ``spectrum`` probe of one shape: float32 inputs ``x``; per matrix, the float64 SVD of the
    declared normalization of x (oriented as declared, then oriented back): ``u``, ``v`` (columns:
    singular vectors) and ``key`` (its singular values), so that the declared math's output is
    ``u diag(F(key)) v^T`` with F the composite of the declared steps."""

    x: Tensor
    u: Tensor
    v: Tensor
    key: Tensor
    #: per matrix: the declared normalization's scale d (Z_0 = X / d) and ||X||_F (float64; NaN for AOL)
    d: Tensor
    nrm: Tensor


def spectrum_chunk(shape) -> int:
    """The batch the probe's matrices reach the implementation in: SPECTRUM_CHUNK_ELEMENTS elements'
    worth (at least the shape's batch; one compilation more for a compiled function, in its warm-up)."""
    b, m, n = shape
    return max(b, min(spectrum_count(shape), SPECTRUM_CHUNK_ELEMENTS // (m * n)))


def spectrum_count(shape) -> int:
    b, m, n = shape
    want = max(SPECTRUM_MIN_COUNT, b)
    return max(b, min(want, SPECTRUM_MAX_ELEMENTS // (m * n)))


@dataclass
class SpectrumBasis:
    """What the ``spectrum`` probe of one shape and seed shares across declared maths: the random
    orthogonal ``u``, ``v`` (two float64 QR factorizations per matrix, the probe's costly part), the
    unit-norm singular values ``s`` and the scales (float64, CPU), and the generator's state after
    them, from which a math's eps-scaled tail is drawn (:func:`spectrum_input`)."""

    u: Tensor
    v: Tensor
    s: Tensor
    scale: Tensor
    state: Tensor
    #: device -> (u, v) there, made once
    placed: dict = dataclasses.field(default_factory=dict)

    def on(self, device) -> tuple[Tensor, Tensor]:
        key = str(torch.device(device))
        if key not in self.placed:
            self.placed[key] = (self.u.to(device), self.v.to(device))
        return self.placed[key]


def spectrum_basis(shape, *, seed: int, count: int | None = None) -> SpectrumBasis:
    """The math-independent part of :func:`spectrum_input` (its first draws, in its order)."""
    b, m, n = (int(v) for v in shape)
    k = min(m, n)
    cnt = spectrum_count(shape) if count is None else count
    g = torch.Generator().manual_seed(seed + 7919)
    f64 = dict(dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(cnt, m, k, generator=g, **f64))[0]
    v = torch.linalg.qr(torch.randn(cnt, n, k, generator=g, **f64))[0]
    i = torch.arange(cnt)[:, None]
    # full rank (i % 4 == 0, 1): a top value in [0.2, 1] (i % 4 == 1: in [0.9, 1], where a first
    # step's coefficients show), the rest log-uniform over three decades filling the norm; low rank:
    # rank 1 (i % 4 == 2) or 2 to 4 with uniform weights (i % 4 == 3)
    lo = torch.where(i % 4 == 1, 0.9, 0.2).double()
    top = lo + (1 - lo) * torch.rand(cnt, 1, generator=g, **f64)
    rest = torch.exp(torch.rand(cnt, k - 1, generator=g, **f64) * math.log(1e-3))
    rest = rest * ((1 - top.square()) / rest.square().sum(-1, keepdim=True).clamp_min(1e-300)).sqrt()
    full = torch.cat([top, rest], dim=-1)
    rank = torch.where(i % 4 == 2, 1, 2 + torch.randint(0, 3, (cnt, 1), generator=g))
    low = torch.rand(cnt, k, generator=g, **f64) * (torch.arange(k)[None, :] < rank)
    low = low / low.square().sum(-1, keepdim=True).sqrt()
    s = torch.where(i % 4 < 2, full, low)
    s = s.sort(dim=-1, descending=True).values  # unit Frobenius norm
    scale = torch.exp2((2 * torch.rand(cnt, 1, generator=g, **f64) - 1) * SPECTRUM_SCALE_EXP)
    return SpectrumBasis(u, v, s, scale, g.get_state())


def spectrum_input(shape, math_: DeclaredMath, *, seed: int, device, count: int | None = None,
                   basis: SpectrumBasis | None = None) -> Spectrum:
    """The probe's matrices (the math verdict, :mod:`anvil_fast.core.tolerances`): full-rank
    matrices with a top singular value in [0.2, 1] of the Frobenius norm and the rest log-uniform over
    three decades, filling the norm, and matrices of rank 1 to 4; random orthogonal U, V; an overall scale 2^U(-4, 4) (every matrix's bf16 norm rounds differently) or,
    for SPECTRUM_EPS_SHARE of them, a norm near eps / margin (where eps and the normalization's kind
    set the scale). ``basis``: :func:`spectrum_basis` of the same shape, seed and count, made once for
    every math judged there (the same numbers as without it)."""
    basis = spectrum_basis(shape, seed=seed, count=count) if basis is None else basis
    u, v, s, scale = basis.u, basis.v, basis.s, basis.scale.clone()
    cnt = int(u.shape[0])
    g = torch.Generator()
    g.set_state(basis.state)
    f64 = dict(dtype=torch.float64)
    n_eps = int(round(cnt * SPECTRUM_EPS_SHARE)) if math_.eps > 0 else 0
    if n_eps:
        at = math_.eps ** 0.5 if math_.normalization == "aol" else math_.eps / math_.margin
        scale[-n_eps:] = at * torch.exp2((2 * torch.rand(n_eps, 1, generator=g, **f64) - 1) * 2)
    x = ((u * (s * scale)[:, None, :]) @ v.mT).float()
    x64 = x.double()
    nrm = x64.square().sum(dim=(-2, -1)).sqrt()
    if math_.normalization == "aol":  # the row scaling changes the singular vectors: an SVD of Z_0
        flip = P.transposes(tuple(x64.shape), transpose_when=math_.transpose_when)
        z = x64.mT if flip else x64
        z0 = torch.as_tensor(P.normalize(z, normalization="aol", margin=math_.margin, eps=math_.eps))
        u, key, vh = torch.linalg.svd(z0, full_matrices=False)
        v = vh.mT
        if flip:
            u, v = v, u
        d = torch.full_like(nrm, math.nan)
    else:  # X / d scales every singular value alike (u, v: exact to the float32 rounding of x)
        d = nrm * math_.margin + math_.eps if math_.normalization == "frobenius" else \
            torch.maximum(nrm * math_.margin, torch.full_like(nrm, math_.eps))
        key = s * scale / d[:, None]
    keep = key > 0  # a low-rank matrix's zero singular values carry no point
    key = torch.where(keep, key, torch.full_like(key, math.nan))
    ud, vd = (u.to(device), v.to(device)) if math_.normalization == "aol" else basis.on(device)
    return Spectrum(x.to(device), ud, vd, key.to(device), d, nrm)


def projections(y: Tensor, sp: Spectrum) -> Tensor:
    """``u_i^T y v_i`` per matrix and point (float64): the output's singular value at each singular
    pair of the declared normalized input (NaN where y is not finite)."""
    yd = y.detach().double().to(sp.u.device)
    t = ((sp.u.mT @ yd) * sp.v.mT).sum(-1)
    finite = torch.isfinite(yd).flatten(1).all(dim=1)
    return torch.where(finite[:, None], t, torch.full_like(t, math.nan))


def sensitivities(sp: Spectrum, math_: DeclaredMath) -> tuple[list[str], np.ndarray]:
    """Per point, the float64 change of the declared output's singular value F(key) per unit change of
    each coefficient of each step (a, b, c), of the margin and of eps (central differences of the
    composite; the normalization's scale through d): the directions a slip of one of them moves the
    output. Returns their names and an array [directions, points]."""
    from anvil_ref.cascade import composite
    from anvil_ref.polar import composite_slope

    key = sp.key.cpu().double().numpy()
    maps_ = [list(t) for t in math_.coeffs]
    names, rows = [], []
    for j, triple in enumerate(maps_):
        for i, letter in enumerate("abc"):
            h = 1e-6 * max(1.0, abs(triple[i]))
            up = [list(t) for t in maps_]
            dn = [list(t) for t in maps_]
            up[j][i] += h
            dn[j][i] -= h
            rows.append((composite(key, maps=[tuple(t) for t in up]) - composite(key, maps=[tuple(t) for t in dn])) / (2 * h))
            names.append(f"step {j + 1} {letter}")
    if math_.normalization != "aol":
        slope = composite_slope(key, maps=math_.coeffs)
        nrm = sp.nrm.cpu().numpy()[:, None]
        d = sp.d.cpu().numpy()[:, None]
        scaled = (nrm * math_.margin >= math_.eps) if math_.normalization == "frobenius_clamp" else np.ones_like(d, bool)
        rows.append(np.where(scaled, -slope * key * nrm / d, 0.0))  # d(key)/d(margin) = -key ||X|| / d
        names.append(MARGIN_DIRECTION)
        rows.append(np.where(scaled & (math_.normalization == "frobenius_clamp"), 0.0, -slope * key / d)
                    * math_.eps)  # per relative change of eps
        names.append(EPS_DIRECTION)
    return names, np.stack([np.broadcast_to(r, key.shape).reshape(-1) for r in rows])


def _bins(key: np.ndarray) -> list[np.ndarray]:
    """Indices of the points in each bin: log-spaced edges in ``key``, merged from the top down until
    each holds at least SPECTRUM_BIN_MIN points."""
    ok = np.isfinite(key) & (key > 0)
    lk = np.log(np.where(ok, key, 1.0))
    lo, hi = lk[ok].min(), lk[ok].max() + 1e-12
    idx = np.where(ok, np.minimum(((lk - lo) / (hi - lo) * SPECTRUM_BINS).astype(int), SPECTRUM_BINS - 1), -1)
    groups, cur = [], []
    for b in range(SPECTRUM_BINS - 1, -1, -1):
        cur.append(np.flatnonzero(idx == b))
        if sum(len(c) for c in cur) >= SPECTRUM_BIN_MIN:
            groups.append(np.concatenate(cur))
            cur = []
    if cur and groups:
        groups[-1] = np.concatenate([groups[-1]] + cur)
    return groups[::-1]


@dataclass
class MathStat:
    """The math verdict's measurement (:func:`math_statistic`): ``z`` the largest deviation of the
    implementation's singular values from the eager bf16 run of the declared math closest to it, in
    standard errors; ``clause`` where (a direction such as ``step 3 c``, or a bin ``sigma in [lo, hi)``);
    ``shift`` the mean deviation there (absolute, in singular value) or the slip it amounts to along
    that direction; ``form`` the eager form it was compared with; ``points``."""

    z: float
    clause: str
    shift: float
    form: str
    points: int
    #: the matrices whose points the clause's statistic sums (its standard error has one fewer degrees of freedom)
    matrices: int = 0


def normal_equivalent(t: float, dof: int) -> float:
    """The normal deviate with the upper tail probability of Student's t with ``dof`` degrees of
    freedom at ``t``: a statistic whose standard error is estimated from the spread of ``dof + 1``
    per-matrix sums follows t, not the normal law, and at a large shape the probe holds few matrices
    (4 at 4096x4096; a bin of the smallest singular values may hold 4 at 2816x768), where a t of 14 is
    as likely as a normal deviate of 3.4. MATH_Z applies to this deviate. Never above ``t``; ``t``
    itself where the tail underflows (``dof`` in the thousands, where the two laws agree)."""
    if dof < 1:
        return 0.0  # one matrix: no spread to estimate a standard error from
    if not math.isfinite(t) or t <= 0:
        return t
    from scipy.special import ndtri_exp
    from scipy.stats import t as student

    log_tail = float(student.logsf(t, dof))
    if not math.isfinite(log_tail):
        return t
    return min(t, float(-ndtri_exp(log_tail)))


def math_statistic(r_impl: Tensor, r_forms: dict[str, Tensor], key: Tensor, names: list[str],
                   sens: np.ndarray, *, margin: float = 1.0, eps: float = 1e-7) -> MathStat:
    """The implementation's residuals ``r_impl`` (``[matrices, points]``: its singular values minus the
    float64 math's) against each eager form's, paired matrix by matrix, two ways: per bin of ``key``
    (the mean difference) and along each sensitivity direction (a matched filter: the weighted
    projection of the differences on the output change a slip of that coefficient makes, weights the
    inverse of the eager residuals' variance in the bin). Each in standard errors estimated from the
    spread of the per-matrix sums (a matrix's points share its norm's rounding, so they are not
    independent), as a normal deviate (:func:`normal_equivalent`, with one degree of freedom fewer
    than the matrices the statistic sums). The largest |z| of a form, the smallest over the forms."""
    kk = key.cpu().double().numpy()
    ok = np.isfinite(kk) & (kk > 0)
    ri = r_impl.cpu().double().numpy()
    rf = {f: r.cpu().double().numpy() for f, r in r_forms.items()}
    # a matrix on which the same math explodes in eager bf16 (a residual past the map's own range, or
    # not finite) is the safety verdict's, not a measurement of the map: left out for everyone
    wild = np.zeros(kk.shape[0], dtype=bool)
    for r in rf.values():
        wild |= ~(np.abs(np.where(ok, r, 0.0)) <= MATH_WILD).all(axis=1)
    ok &= ~wild[:, None]
    npts = int(ok.sum())
    if not np.isfinite(ri[ok]).all():
        return MathStat(math.inf, "output not finite", math.inf, "-", npts)
    if npts < 2:
        return MathStat(0.0, "no point where the math stays finite in bf16", 0.0, "-", npts)
    flat_ok = ok.reshape(-1)
    groups = _bins(np.where(ok, kk, np.nan).reshape(-1))
    mats = np.broadcast_to(np.arange(kk.shape[0])[:, None], kk.shape).reshape(-1)
    pooled = np.zeros(kk.size)
    for gi in groups:
        pooled[gi] = np.mean([r.reshape(-1)[gi].var() for r in rf.values()])
    w = np.where(flat_ok, 1.0 / np.maximum(pooled, pooled[flat_ok].max() * 1e-12 + 1e-300), 0.0)
    sens_full = np.zeros((len(names), kk.size))
    sens_full[:, :] = np.nan_to_num(sens)
    sens_full[:, ~flat_ok] = 0.0

    def tstat(per_point: np.ndarray, sel: np.ndarray) -> tuple[float, float, int]:
        """(sum, its standard error, the matrices summed) of per_point over the points sel, clustered
        by matrix."""
        sums = np.bincount(mats[sel], weights=per_point[sel], minlength=kk.shape[0])
        used = np.bincount(mats[sel], minlength=kk.shape[0]) > 0
        c = sums[used]
        if len(c) < 2:
            return float(c.sum()), math.inf, len(c)
        return float(c.sum()), float(math.sqrt(len(c) * c.var(ddof=1))), len(c)

    all_pts = np.flatnonzero(flat_ok)
    # the normalization's scale as bf16 arithmetic applies it: the part of the residuals along the
    # margin and eps directions up to their rounding allowance is removed (fitted, clipped to it), from
    # the implementation's and from each eager form's alike, so that all are compared on one footing
    nuisance = {MARGIN_DIRECTION: T.scale_rounding(margin, eps), EPS_DIRECTION: T.eps_rounding(eps)}

    def scale_removed(r_flat: np.ndarray) -> np.ndarray:
        for name, jv in zip(names, sens_full):
            if name in nuisance:
                den = float(np.sum(w * jv * jv))
                if den > 0:
                    shift = float(np.sum(w * jv * r_flat)) / den
                    lo, hi = nuisance[name]
                    r_flat = r_flat - float(np.clip(shift, lo, hi)) * jv
        return r_flat

    ri_flat = scale_removed(np.where(flat_ok, ri.reshape(-1), 0.0))
    rf_flat = {f: scale_removed(np.where(flat_ok, r.reshape(-1), 0.0)) for f, r in rf.items()}
    worst = MathStat(0.0, "-", 0.0, "-", npts)

    def judge(stat: Callable[[np.ndarray], tuple[float, float, int]], clause: str, unit: float, allow: float = 0.0):
        # the implementation's value against the hull of the forms' (the float64 math: 0): its
        # distance from the nearest, in standard errors of the difference
        nonlocal worst
        tot_i, se_i, n_mat = stat(ri_flat)
        vals = {"float64": (0.0, 0.0, n_mat)} | {f: stat(r) for f, r in rf_flat.items()}
        lo_f = min(vals, key=lambda f: vals[f][0])
        hi_f = max(vals, key=lambda f: vals[f][0])
        # an implementation that rounds up to MATH_BIAS_FACTOR times as much as an eager form may carry up
        # to that many times its rounding bias (the hull scaled about the float64 math's 0)
        lo, hi = T.MATH_BIAS_FACTOR * vals[lo_f][0] - allow, T.MATH_BIAS_FACTOR * vals[hi_f][0] + allow
        if lo <= tot_i <= hi:
            return
        near = lo_f if tot_i < lo else hi_f
        excess = lo - tot_i if tot_i < lo else tot_i - hi
        se = math.sqrt(se_i ** 2 + (T.MATH_BIAS_FACTOR * vals[near][1]) ** 2)
        # the forms' sums run over the same matrices: n_mat - 1 degrees of freedom (Welch's count for
        # the two variances together lies between that and twice it: the cautious end)
        z = normal_equivalent(excess / se, n_mat - 1) if se > 0 else math.inf
        if z > worst.z:
            worst = MathStat(z, clause, (tot_i - vals[near][0]) / unit, near, npts, n_mat)

    for gi in groups:  # per bin: the mean residual
        judge(lambda r, gi=gi: tstat(r, gi), f"sigma in [{kk.reshape(-1)[gi].min():.3g}, {kk.reshape(-1)[gi].max():.3g}]",
              len(gi))
    for name, jv in zip(names, sens_full):  # along each slip's direction
        wj = w * jv
        norm = float(np.sum(wj * jv))
        if norm <= 0:
            continue
        judge(lambda r, wj=wj: tstat(wj * r, all_pts), name, norm)
    return worst


# ------------------------------------------------------------------------------ measures

#: Above this many singular values :func:`singular_values` takes the eigenvalues in float32 (of the
#: float64 Gram: about 1e-7 relative, against ~1e-2 that the columns report) and :func:`top_singular_values`
#: iterates powers: float64 eigenvalues of a 4096-wide Gram take seconds per call on a GPU.
EXACT_SV_MAX = 1024
#: Power iterations of :func:`top_singular_values` above EXACT_SV_MAX (a lower bound of the top
#: singular value, which converges fastest where it matters: an exploded output's top singular value
#: stands apart from the rest).
POWER_ITERATIONS = 64


def _grams(y: Tensor) -> tuple[Tensor, Tensor]:
    yd = y.detach().double().reshape(-1, *y.shape[-2:])
    finite = torch.isfinite(yd).flatten(1).all(dim=1)
    yd = torch.where(finite[:, None, None], yd, torch.zeros((), dtype=yd.dtype, device=yd.device))
    return (yd.mT @ yd if yd.shape[-2] > yd.shape[-1] else yd @ yd.mT), finite


def singular_values(y: Tensor) -> Tensor:
    """Singular values of each matrix (float64, ascending, on y's device; NaN rows where y is not
    finite), from the eigenvalues of the smaller Gram (float32 ones above EXACT_SV_MAX)."""
    g, finite = _grams(y)
    ev = torch.linalg.eigvalsh(g if g.shape[-1] <= EXACT_SV_MAX else g.float()).double()
    s = ev.clamp_min(0).sqrt()
    return torch.where(finite[:, None], s, torch.full_like(s, math.nan))


def top_singular_values(y: Tensor) -> Tensor:
    """The top singular value of each matrix (float64, on the CPU; inf where y is not finite):
    exact up to EXACT_SV_MAX, else POWER_ITERATIONS power iterations on the Gram."""
    g, finite = _grams(y)
    if g.shape[-1] <= EXACT_SV_MAX:
        top = torch.linalg.eigvalsh(g)[..., -1]
    else:
        v = torch.ones(g.shape[:-1], dtype=g.dtype, device=g.device)[..., None]
        for _ in range(POWER_ITERATIONS):
            v = g @ v
            v = v / v.norm(dim=-2, keepdim=True).clamp_min(1e-300)
        top = (v.mT @ g @ v)[..., 0, 0]
    top = top.clamp_min(0).sqrt()
    return torch.where(finite, top, torch.full_like(top, math.inf)).cpu()


def sv_range(s: Tensor) -> tuple[float, float, float]:
    """min / mean / max over a batch of singular values divided by each matrix's RMS (NaN where a
    matrix is zero or not finite)."""
    rms = s.square().mean(dim=-1, keepdim=True).sqrt()
    r = (s / rms).cpu()
    if not torch.isfinite(r).all():
        return math.nan, math.nan, math.nan
    return float(r.min()), float(r.mean()), float(r.max())


@dataclass
class Row:
    """One (implementation, shape, family): the columns of the module docstring and its three verdicts
    (:meth:`verdicts`), each clause with its value and its limit."""

    impl: str
    shape: tuple[int, ...]
    family: str
    fast: float = math.nan  #: error against the same math in float64
    floor: float = math.nan
    eager: float = math.nan  #: the fused eager form's error (FORMS)
    eager_unfused: float = math.nan  #: the unfused eager form's error
    eager_horner: float = math.nan  #: the Horner eager form's error
    bound: float = math.nan
    roundings: float | None = None  #: the gain-weighted rounding count of the bound (well-conditioned rows)
    polar: float = math.nan
    math_polar: float = math.nan
    sv_min: float = math.nan
    sv_mean: float = math.nan
    sv_max: float = math.nan
    top_sv: float = math.nan
    exploded: int = 0
    eager_top_sv: float = math.nan  #: the largest top singular value of the eager forms' outputs
    eager_exploded: int = 0  #: matrices on which an eager form exploded
    #: where it exploded and its eager forms did not on the same matrices: their explosions on more draws
    #: of the probe (:meth:`_Cache.eager_wide`), of ``eager_wide_count`` matrices; None: not drawn
    eager_wide_exploded: int | None = None
    eager_wide_count: int = 0
    nonfinite: int = 0  #: matrices whose output is not finite
    vacuous: str = ""  #: what a vacuous output equals ("zero", "identity", "the input"), else ""
    count: int = 0
    sigma_x: float = T.EXPLODED_SIGMA
    cap_ratio: float | None = None
    eager_cap_ratio: float | None = None
    gram_seen: int | None = None
    gram_declared: int | None = None
    conforms: bool = True
    #: spectrum rows: the math statistic (MathStat's fields)
    math_z: float | None = None
    math_clause: str = ""
    math_shift: float | None = None
    math_form: str = ""
    math_points: int = 0
    math_matrices: int = 0  #: the matrices the worst clause's statistic sums
    #: spectrum rows: the lifted run (:class:`Lifted`): its error against the float64 math (None where
    #: the lift did not reach its arithmetic, ``lift_note`` says why), its part off the input's singular
    #: basis, and the dtype of coefficients that explains its output
    lift_err: float | None = None
    lift_off: float | None = None
    lift_note: str = ""
    lift_coeffs: str = ""
    #: the lifted run at norms near eps (:attr:`Lifted.eps_err`), the dtypes below float64 it asked for
    #: (comma-separated) and the iteration dtype the math declares (every declared row has it; a stored
    #: row without it was judged before the lift ran at two scales: ``--resume`` measures it again)
    lift_eps_err: float | None = None
    lift_casts: str = ""
    #: the limit its lifted output's part off the input's singular basis passed (:attr:`Lifted.not_polynomial`)
    lift_not_polynomial: float | None = None
    #: whether the lifted run of the same implementation at this shape (its spectrum row, judged first)
    #: found the declared math: then an explosion just past the threshold is its rounding's
    math_exact: bool | None = None
    declared_dtype: str = ""
    #: the coefficients a 1e-3 slip of moves the declared map by at most LIFT_RTOL at every singular
    #: value (:meth:`DeclaredMath.flat_slips`), each with that largest change: the verdicts may not see them
    flat_slips: str = ""
    note: str = ""
    ms: float | None = None
    declared: bool = True
    well_conditioned: bool = False
    device: str = "cpu"
    #: the machine that judged the row (the GPU's name, or the CPU's): a table resumed on another
    #: machine names each part's (:func:`device_names`)
    device_name: str = ""

    @property
    def config(self) -> str:
        return self.impl

    def rounding_ratio(self) -> float:
        """Its error over the larger eager form's (the form it may have been written in)."""
        forms = [v for v in (self.eager, self.eager_unfused, self.eager_horner) if v == v]
        e = max(forms) if forms else math.nan
        return self.fast / e if e and e == e and e > 0 else math.nan

    def verdicts(self) -> dict[str, list[str]]:
        """``{"math": [...], "rounding": [...], "safety": [...], "findings": [...], "limits": [...]}``: the
        failed clauses of each verdict, every one naming its value and its limit
        (:func:`anvil_fast.core.tolerances.orthogonalizer_clauses`), the findings (reported, never a
        FAIL) and what the declared math keeps the verdicts from seeing (reported, no verdict changes)."""
        return T.orthogonalizer_clauses(self)

    def verdict(self) -> str:
        """"ok", "finding", "FAIL" or "unjudged" (:data:`VERDICT_RULE`)."""
        v = self.verdicts()
        if v["math"] or v["safety"]:
            return "FAIL"
        if not self.declared:
            return "unjudged"
        return "finding" if v["rounding"] or v["findings"] else "ok"

    def failures(self) -> list[str]:
        v = self.verdicts()
        return v["math"] + v["safety"]

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["verdict"] = self.verdict()
        d["verdicts"] = self.verdicts()
        d["rounding_ratio"] = self.rounding_ratio()
        return _finite(d)


def _finite(d):
    if isinstance(d, dict):
        return {k: _finite(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_finite(v) for v in d]
    return None if isinstance(d, float) and not math.isfinite(d) else d


def row_from_json(d: dict) -> Row:
    """A row written by :meth:`Row.to_json` (``--resume``)."""
    names = {f.name for f in dataclasses.fields(Row)}
    kw = {k: (math.nan if v is None and isinstance(getattr(Row, k, None), float) else v)
          for k, v in d.items() if k in names}
    kw["shape"] = tuple(kw["shape"])
    return Row(**kw)


def _input(family: str, shape: tuple[int, int, int], *, seed: int, count: int, device) -> Tensor:
    if family == "near_rank1":
        from .near_rank1 import near_rank1

        return near_rank1(max(count, shape[0]), shape[1], shape[2], seed=seed, device=device)
    return make_matrix(family, shape, seed=seed, device=device)


#: The share of a GPU's memory the shared entries of one judging call may hold there (:class:`_Cache`).
#: At 4096x4096 each declared math's spectrum probe holds about 2.8 GB (its float64 singular bases,
#: the float64 result, the eager forms), and a table line judges ten or more maths: unbounded, one line
#: held 54 GB of an 80 GB card. Beyond the share the least recently used entries are dropped and made
#: again when asked for (the same bits: each is a deterministic function of its key).
CACHE_DEVICE_SHARE = 0.125


def _device_bytes(v, device: torch.device, seen: set | None = None) -> int:
    """Bytes of the tensors in ``v`` (tensors, sequences, dicts, dataclasses) on ``device``'s kind of
    memory, each storage once."""
    seen = set() if seen is None else seen
    if isinstance(v, Tensor):
        if v.device.type != device.type:
            return 0
        st = v.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(v, dict):
        return sum(_device_bytes(x, device, seen) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_device_bytes(x, device, seen) for x in v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return sum(_device_bytes(getattr(v, f.name), device, seen) for f in dataclasses.fields(v))
    return 0


def _chunk(x: Tensor, shape, family: str) -> int:
    """The batch an implementation and its eager forms are called in on ``x`` (the spectrum probe's
    matrices in chunks of :func:`spectrum_chunk`, any other family's one batch of the shape's)."""
    return min(spectrum_chunk(shape), int(x.shape[0])) if family == SPECTRUM else shape[0]


class _Cache:
    """Per (shape, family): the input, its polar factor and singular values; per declared math: the
    float64 result, the eager bf16 results and the bound; the spectrum probe. Shared by every
    implementation judged in one call. ``budget``: the bytes its entries may hold on its device
    (default: :data:`CACHE_DEVICE_SHARE` of a GPU's memory, no bound on the host; None: no bound);
    past it the least recently used entries go."""

    def __init__(self, *, seed: int, device, count: int, spectrum_count: int | None = None,
                 seconds: dict | None = None, budget: int | None = -1):
        self.seed, self.device, self.count, self.spectrum_count = seed, torch.device(device), count, spectrum_count
        self.store: dict = {}  # least recently used first
        #: (implementation, shape) -> whether its spectrum row's lifted run found the declared math
        self.exact: dict[tuple, bool] = {}
        #: wall seconds spent making each kind of entry (an eager form by its name), synchronized on CUDA
        self.seconds = {} if seconds is None else seconds
        self._inner: list[float] = []
        if budget == -1:
            budget = (int(torch.cuda.get_device_properties(self.device).total_memory * CACHE_DEVICE_SHARE)
                      if self.device.type == "cuda" else None)
        self.budget = budget
        #: entries dropped for the budget, and made again after that
        self.dropped = 0

    def get(self, key, make):
        if key in self.store:
            self.store[key] = self.store.pop(key)  # the most recent last
            return self.store[key]
        with self.timed(key[4] if key[0] == "eager" else key[0]):
            value = make()
        self.store[key] = value
        self._bound(keep=key)
        return value

    def _bound(self, *, keep) -> None:
        """Drop the least recently used entries until those left hold at most ``budget`` bytes on the
        device (``keep``, the entry just made, stays whatever its size). Their holders keep what
        they already have: an entry dropped is only made again on its next ``get``."""
        if self.budget is None:
            return
        sizes = {k: _device_bytes(v, self.device) for k, v in self.store.items()}
        total = sum(sizes.values())
        for k in list(self.store):
            if total <= self.budget:
                break
            if k == keep or not sizes[k]:
                continue
            total -= sizes[k]
            del self.store[k]
            self.dropped += 1

    @contextlib.contextmanager
    def timed(self, what: str):
        """Adds the block's wall seconds to ``seconds[what]``, less those of the timed blocks inside it
        (each second counted once)."""
        t0 = time.monotonic()
        self._inner.append(0.0)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            total = time.monotonic() - t0
            inner = self._inner.pop()
            self.seconds[what] = self.seconds.get(what, 0.0) + total - inner
            if self._inner:
                self._inner[-1] += total

    def spectrum(self, shape, m: DeclaredMath) -> Spectrum:
        count = None if self.spectrum_count is None else max(shape[0], self.spectrum_count)
        # the random bases once per shape, whatever maths are judged there
        basis = self.get(("basis", shape, count), lambda: spectrum_basis(shape, seed=self.seed, count=count))
        return self.get(("spectrum", shape, "spectrum", m), lambda: spectrum_input(
            shape, m, seed=self.seed, device=self.device, count=count, basis=basis))

    def x(self, shape, family, m: DeclaredMath | None = None):
        if family == SPECTRUM:
            return self.spectrum(shape, m).x
        return self.get(("x", shape, family), lambda: _input(family, shape, seed=self.seed, count=self.count,
                                                               device=self.device))

    def polar(self, shape, family):
        return self.get(("polar", shape, family), lambda: polar_factor(self.x(shape, family)))

    def ref(self, shape, family, m: DeclaredMath):
        return self.get(("ref", shape, family, m), lambda: reference(self.x(shape, family, m), m))

    def eager(self, shape, family, m: DeclaredMath, form: str = "fused"):
        # in the batches the implementation is called in (judge_one), which the INDUCTOR_FORM mirrors
        x = self.x(shape, family, m)
        chunk = _chunk(x, shape, family)
        return self.get(("eager", shape, family, m, form), lambda: eager_declared(x, m, form, chunk=chunk))

    def eager_wide(self, shape, family, m: DeclaredMath, sigma: float, *, exploded: int, count: int) -> tuple[int, int]:
        """The eager forms' explosions (top singular value past ``sigma`` in any form) on up to
        :data:`~anvil_fast.core.tolerances.EXPLOSION_DRAWS` more draws (within
        :data:`~anvil_fast.core.tolerances.EXPLOSION_WIDE_ELEMENTS` entries) of ``family``'s inputs at
        ``shape`` (seeds ``seed + WIDE_SEED_STRIDE * d``, d = 1, 2, ...), as (explosions, matrices).
        The draws stop once the test of an implementation that exploded on ``exploded`` of ``count``
        matrices can no longer fall below its level (more draws only lower the p-value through their
        count, which is then at its largest). Nothing of the draws is kept but the counts."""
        entries = count * shape[-2] * shape[-1]
        draws = max(1, min(T.EXPLOSION_DRAWS, T.EXPLOSION_WIDE_ELEMENTS // max(entries, 1)))

        def make():
            hits = seen = 0
            most = draws * count + count  # the eager sample at the end: every draw and the row's own
            for d in range(1, draws + 1):
                seed = self.seed + WIDE_SEED_STRIDE * d
                if family == SPECTRUM:
                    n = None if self.spectrum_count is None else max(shape[0], self.spectrum_count)
                    x = spectrum_input(shape, m, seed=seed, device=self.device, count=n).x
                else:
                    x = _input(family, shape, seed=seed, count=self.count, device=self.device)
                chunk = _chunk(x, shape, family)
                tops = torch.stack([_top(eager_declared(x, m, f, chunk=chunk), shape, family)
                                    for f in m.forms(self.device)])
                hits += int((tops > sigma).any(dim=0).sum())
                seen += int(x.shape[0])
                if hits and T.explosion_excess_p(exploded, count, hits, most) >= T.EXPLOSION_ALPHA:
                    break
            return hits, seen
        return self.get(("wide", shape, family, m, float(sigma), int(exploded), int(count)), make)

    def residuals(self, shape, m: DeclaredMath, y: Tensor) -> Tensor:
        sp = self.spectrum(shape, m)
        g = self.get(("g", shape, SPECTRUM, m), lambda: torch.as_tensor(
            __import__("anvil_ref.cascade", fromlist=["composite"]).composite(
                sp.key.cpu().numpy(), maps=m.coeffs)))
        return projections(y, sp).cpu() - g

    def sens(self, shape, m: DeclaredMath):
        return self.get(("sens", shape, SPECTRUM, m), lambda: sensitivities(self.spectrum(shape, m), m))

    def input_sv(self, shape, family):
        """Singular values of the input, descending, float64 NumPy (for the bounds)."""
        return self.get(("sv", shape, family), lambda: singular_values(self.x(shape, family)).flip(-1).cpu().numpy())

    def roundings(self, shape, family, m: DeclaredMath):
        def make():
            x = self.x(shape, family)
            if m.normalization == "aol":
                s = P.normalized_singular_values(x.cpu(), normalization=m.normalization, margin=m.margin, eps=m.eps,
                                                 transpose_when=m.transpose_when)
            else:  # the Frobenius normalizations scale every singular value alike
                nrm = x.double().square().sum(dim=(-2, -1)).sqrt().cpu().numpy()[:, None] * m.margin
                s = self.input_sv(shape, family) / (nrm + m.eps if m.normalization == "frobenius"
                                                    else np.maximum(nrm, m.eps))
            return T.declared_roundings(m.coeffs, s, normalization=m.normalization, long_side=max(shape[1:]),
                                        gram_side=P.gram_side(shape, transpose_when=m.transpose_when))
        return self.get(("roundings", shape, family, m), make)


def _top(y: Tensor, shape, family, s: Tensor | None = None) -> Tensor:
    """The top singular value per matrix (inf where not finite): from ``s`` (:func:`singular_values` of
    y, when the caller has them: one eigendecomposition, not two) or measured here."""
    if s is not None or family in POLAR_FAMILIES or min(shape[1:]) <= EXACT_SV_MAX:
        s = singular_values(y) if s is None else s
        return torch.where(torch.isnan(s[:, -1]), torch.full_like(s[:, -1], math.inf), s[:, -1]).cpu()
    return top_singular_values(y)


def _cosines(y: Tensor, t: Tensor) -> Tensor:
    """Per matrix <y, t> / (||y|| ||t||) (float64; 0 where either is zero)."""
    a = y.detach().double().reshape(-1, *y.shape[-2:]).flatten(1)
    b = t.detach().double().to(a.device).reshape(-1, *t.shape[-2:]).flatten(1)
    den = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(den > 0, (a * b).sum(1) / den.clamp_min(1e-300), torch.zeros_like(den)).cpu()


def vacuous(y: Tensor, ref: Tensor, x: Tensor, *, top: Tensor | None = None, sigma: float = math.inf,
            dtype: torch.dtype | None = None) -> str:
    """What a vacuous output is (all zero where the math's, rounded to the output's dtype, is not;
    "underflow" where such zeros come only on inputs that are zero in every entry once cast to the
    declared iteration ``dtype``; the
    identity or the input returned, up to scale: cosine above 1 - VACUOUS_GAP on a matrix that has not
    exploded (``top`` <= ``sigma``: an explosion is its own clause) where the math's own output's is
    below 1 - 10 VACUOUS_GAP), else ""."""
    yd = y.detach().double().reshape(-1, *y.shape[-2:])
    rd = ref.detach().double().reshape(-1, *ref.shape[-2:])
    if not torch.isfinite(yd).all():
        return ""
    yn = yd.flatten(1).norm(dim=1).cpu()
    rn = rd.flatten(1).norm(dim=1).cpu()
    rn_out = rn
    for dt in (y.dtype, dtype):  # the math's output as the output's dtype and the declared iteration's hold it
        if dt is not None and dt.is_floating_point:
            rn_out = torch.minimum(rn_out, ref.detach().to(dt).double().reshape(rd.shape).flatten(1).norm(dim=1).cpu())
    zero = (yn == 0) & (rn_out > 0)
    if dtype is not None and dtype.is_floating_point and bool(zero.any()):
        # an input whose every entry rounds to zero in the declared iteration dtype (float16's range
        # ends near 6e-8): code that casts before it normalizes gets a zero matrix there, a property
        # of that evaluation form and the dtype, not a vacuous output
        gone = (x.detach().reshape(yd.shape).to(dtype) == 0).flatten(1).all(dim=1).cpu()
        if not bool((zero & ~gone).any()):
            return "underflow"
    if bool(zero.any()):
        return "zero"
    calm = torch.ones_like(yn, dtype=torch.bool) if top is None else (top.cpu() <= sigma)
    eye = torch.eye(*yd.shape[-2:], dtype=torch.float64, device=yd.device).expand_as(yd)
    for name, t in (("the identity", eye), ("the input", x.reshape(yd.shape))):
        cy, cr = _cosines(yd, t), _cosines(rd, t)
        hit = calm & (cy > 1 - T.VACUOUS_GAP) & ((cr < 1 - 10 * T.VACUOUS_GAP) | (rn == 0))
        if bool(hit.any()):
            return name
    return ""


def judge_one(impl: Implementation, shape, family: str, cache: _Cache, *, time_reps: int = 0) -> Row:
    """One row (module docstring)."""
    shape = tuple(int(v) for v in shape)
    m = impl.math
    x = cache.x(shape, family, m)
    dev = cache.device.type
    chunk = _chunk(x, shape, family)
    row = Row(impl.name, shape, family, count=int(x.shape[0]), declared=m is not None,
              well_conditioned=family in WELL_CONDITIONED, device=dev, device_name=device_name(cache.device))
    if m is not None:
        row.gram_declared = P.gram_side(shape, transpose_when=m.transpose_when)
        row.sigma_x = m.exploded_sigma()
        row.declared_dtype = m.dtype
    row.note = impl.called
    unobserved = []  # the recording raised: no Gram side seen, which says nothing of where it is formed

    def call():
        try:
            return run_impl(impl, x, seed=cache.seed, record=impl.observe, chunk=chunk), ""
        except Exception as exc:
            if not impl.observe:
                raise
            out = run_impl(impl, x, seed=cache.seed, record=False, chunk=chunk)  # not observable
            unobserved.append(exc)
            return out, f"products not observable (under the harness's dispatch mode it {raised(exc, 80)})"

    try:
        with cache.timed("implementation"):
            try:
                (y, row.gram_seen), why = call()
            except Exception as exc:
                if not compiler_error(exc):
                    raise
                # the compiler's state of this process, after the other inputs the harness gave it, not the
                # implementation: compiled afresh, the row judges what it computes (and says so); a second
                # raise is its own and FAILs
                importlib.import_module("torch._dynamo").reset()
                (y, row.gram_seen), why = call()
                why = "; ".join(w for w in (why, f"compiled afresh: torch.compile {raised(exc, 80)} on this "
                                                  "input after the harness's other inputs") if w)
        row.note = "; ".join(w for w in (row.note, why) if w)
    except Exception as exc:  # a crash is a failure of the row, reported, not of the whole table
        row.conforms, row.note = False, raised(exc)
        row.fast = math.inf
        return row
    if not isinstance(y, Tensor) or tuple(y.shape) != tuple(x.shape):
        row.conforms = False
        row.note = f"returned shape {tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__}, expected {tuple(x.shape)}"
        row.fast = math.inf
        return row
    if m is not None and row.gram_seen is not None and row.gram_seen != row.gram_declared:
        row.conforms = False
        row.note = (f"formed a {row.gram_seen}x{row.gram_seen} Gram; transpose when {m.transpose_when} forms "
                    f"{row.gram_declared}x{row.gram_declared}")
    row.nonfinite = int((~torch.isfinite(y.detach().reshape(y.shape[0], -1)).all(dim=1)).sum())
    s = None
    if family in POLAR_FAMILIES or min(shape[1:]) <= EXACT_SV_MAX:
        s = singular_values(y)
        row.sv_min, row.sv_mean, row.sv_max = sv_range(s)
    top = _top(y, shape, family, s)
    row.top_sv = float(top.max())
    row.exploded = int((top > row.sigma_x).sum())
    if family in POLAR_FAMILIES:
        pf = cache.polar(shape, family)
        row.polar = float(rel_errs(y, pf).max())
    if m is not None:
        ref = cache.ref(shape, family, m)
        eagers = {f: cache.eager(shape, family, m, f) for f in m.forms(dev)}
        # what depends only on the declared math and the input (the eager forms' errors, the floor, the
        # caps), once per math: every implementation of the same math at this shape shares it
        fast_errs = rel_errs(y, ref)
        form_errs = {f: cache.get(("errs", shape, family, m, f), lambda f=f: rel_errs(eagers[f], ref)) for f in eagers}
        row.fast = float(fast_errs.max())
        row.floor = cache.get(("floor", shape, family, m), lambda: float(rel_errs(ref.bfloat16(), ref).max()))
        errs = {f: float(e.max()) for f, e in form_errs.items()}
        row.eager = errs.get("fused", errs.get(GRAM_FORM, math.nan))
        row.eager_unfused = errs.get("unfused", math.nan)
        row.eager_horner = errs.get("horner", math.nan)
        etop = torch.stack([cache.get(("etop", shape, family, m, f), lambda f=f: _top(eagers[f], shape, family))
                            for f in m.forms(dev)])
        row.eager_top_sv = float(etop.max())
        row.eager_exploded = int((etop > row.sigma_x).any(dim=0).sum())
        if row.exploded and not row.nonfinite and not row.eager_exploded and row.exploded <= T.EXPLOSION_OWN_MAX:
            row.eager_wide_exploded, row.eager_wide_count = cache.eager_wide(
                shape, family, m, row.sigma_x, exploded=row.exploded, count=row.count)
        row.vacuous = vacuous(y, ref, x, top=top, sigma=row.sigma_x, dtype=getattr(torch, m.dtype))

        def caps_of():
            k = min(shape[1:])
            norms = ref.detach().double().reshape(-1, *ref.shape[-2:]).flatten(1).norm(dim=1).cpu()
            caps = torch.tensor([T.cascade_error_cap(float(n), k, sigma=row.sigma_x) for n in norms],
                                dtype=torch.float64)
            return caps if torch.isfinite(norms).all() else None

        caps = cache.get(("caps", shape, family, m), caps_of)
        if caps is not None:
            row.cap_ratio = float((fast_errs / caps).max())
            row.eager_cap_ratio = max(float((e / caps).max()) for e in form_errs.values())
        else:
            row.cap_ratio = math.inf
        if family in POLAR_FAMILIES:
            row.math_polar = cache.get(("math_polar", shape, family, m),
                                       lambda: float(rel_errs(ref, cache.polar(shape, family)).max()))
        if row.well_conditioned and m.restarts is None:  # the bound counts the standard form's roundings
            row.roundings = cache.roundings(shape, family, m)
            row.bound = T.eager_bound("cascade", floor=row.floor, roundings=row.roundings)
        if family == SPECTRUM:
            names, sens = cache.sens(shape, m)
            forms = {f: cache.get(("res", shape, family, m, f), lambda f=f: cache.residuals(shape, m, eagers[f]))
                     for f in m.forms(dev)}
            st = math_statistic(cache.residuals(shape, m, y), forms, cache.spectrum(shape, m).key, names, sens,
                                margin=m.margin, eps=m.eps)
            row.math_z, row.math_clause, row.math_shift = float(st.z), st.clause, float(st.shift)
            row.math_form, row.math_points, row.math_matrices = st.form, st.points, st.matrices
            row.flat_slips = cache.get(("flat", m), lambda: ", ".join(
                f"step {step} {name} ({effect:.1g})" for step, name, effect in m.flat_slips()))
            if impl.observe and row.gram_seen is None and not unobserved:
                # its Gram is formed where torch does not dispatch (a Triton kernel), which the lift cannot
                # reach either; lifting it would only compile and autotune that kernel for float64
                row.lift_note = "its Gram is formed outside torch's dispatcher (a kernel): not lifted"
            else:
                with cache.timed("lift"):
                    lf = lifted_run(impl, lift_input(x), m, seed=cache.seed, eps_x=lift_eps_input(x, m))
                row.lift_err, row.lift_note, row.lift_coeffs = lf.err, lf.why_not, lf.coeffs
                row.lift_off = lf.off if lf.off == lf.off else None
                row.lift_not_polynomial = lf.not_polynomial
                row.lift_eps_err, row.lift_casts = lf.eps_err, ",".join(lf.casts)
            cache.exact[(impl.name, shape)] = T.lifted_exact(row)
        row.math_exact = cache.exact.get((impl.name, shape))
    else:
        row.vacuous = vacuous(y, torch.ones_like(y, dtype=torch.float64), x) if family != "zero" else ""
    if time_reps and dev == "cuda" and family == TIMED_FAMILY:
        from anvil_fast.kernels.timing import median_ms

        xin = impl.prepare(x)  # the copy made once: the calls alone are timed
        with torch.no_grad():
            row.ms = median_ms(lambda: impl.run(xin), n=time_reps, warmup=2, device=x.device)
    return row


def warm_up(impl: Implementation, shape, cache: _Cache) -> float:
    """One call of ``impl`` on a batch of ``shape`` before any row of that shape is timed or judged:
    where it compiles or autotunes per shape (torch.compile, Triton's autotuner), that happens here,
    outside the rows. Returns its seconds (inf where it raised: the rows report the error)."""
    t0 = time.monotonic()
    try:
        x = cache.x(tuple(shape), "gaussian")
        impl.settle(x)
        run_impl(impl, x, seed=cache.seed, record=False, chunk=shape[0])
        sc = spectrum_chunk(shape)
        if cache.spectrum_count is not None:
            sc = min(sc, max(shape[0], cache.spectrum_count))
        if impl.math is not None and sc != shape[0]:  # the probe's batch
            run_impl(impl, x[:1].expand(sc, *x.shape[1:]).contiguous(), seed=cache.seed, record=False)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
    except Exception:
        return math.inf
    return time.monotonic() - t0


def judge(impls: Implementation | Sequence[Implementation], *, shapes=DEFAULT_SHAPES, families=DEFAULT_FAMILIES,
          seed: int = 0, device="cpu", near_rank1_count: int = 8, time_reps: int = 0, progress: bool | None = None,
          time_limit: float | None = None, checkpoint: Callable[[list[Row]], None] | None = None,
          done: Sequence[Row] = (), warmups: dict | None = None, spectrum_count: int | None = None,
          seconds: dict | None = None, cache_bytes: int | None = -1) -> list[Row]:
    """Every row for every implementation, shape and family (same inputs for all implementations),
    shape by shape, implementation by implementation (each one's first call at a shape, the warm-up,
    outside its rows: :func:`warm_up`). ``near_rank1_count``: inputs of the near-rank-1 family per
    shape; ``time_reps``: timed calls per shape on CUDA (0: none); ``time_limit``: seconds after which
    no new implementation is started at a shape (the rows done are returned); ``checkpoint``: called
    with the rows so far after every row; ``done``: rows of an earlier run (``--resume``), kept and not
    measured again; ``warmups``: filled with the warm-up seconds per "impl shape"; ``spectrum_count``:
    matrices of the spectrum probe per shape (default :func:`spectrum_count`: fewer see less); ``seconds``:
    filled with the wall seconds per phase (the implementation's calls, its warm-ups, and each kind of
    shared entry: the probe, the float64 results, each eager form), where a run's time goes;
    ``cache_bytes``: the bound on those shared entries' bytes on the device (:class:`_Cache`'s
    ``budget``; the default bounds them on a GPU alone); the rows do not depend on it."""
    from anvil_ref.progress import Progress

    impls = [impls] if isinstance(impls, Implementation) else list(impls)
    families = list(families)
    bad = sorted(set(families) - set(HARNESS_FAMILIES))
    if bad:
        raise ValueError(f"families: unknown {bad}; expected a subset of {HARNESS_FAMILIES}")
    shapes = [tuple(int(v) for v in s) for s in shapes]
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"shapes: expected (chunk, rows, cols) of positive integers, got {s!r}")
    cache = _Cache(seed=seed, device=device, count=near_rank1_count, spectrum_count=spectrum_count, seconds=seconds,
                   budget=cache_bytes)
    have = {(r.impl, tuple(r.shape), r.family): r for r in done}
    rows = list(done)
    warmups = {} if warmups is None else warmups

    def fams(impl):
        return [f for f in families if not (f == SPECTRUM and impl.math is None)]

    todo = [(s, i) for s in shapes for i in impls if any((i.name, s, f) not in have for f in fams(i))]
    total = sum(len(fams(i)) for s, i in todo)
    t0, n = time.monotonic(), 0
    with Progress(max(total, 1), "harness", enabled=progress) as bar, _recompile_room():
        for j, (s, impl) in enumerate(todo):
            if j and time_limit is not None and time.monotonic() - t0 > time_limit:
                break  # (the first always runs: every run makes progress)
            with cache.timed("warm-up"):
                warmups[f"{impl.name} {'x'.join(map(str, s))}"] = warm_up(impl, s, cache)
            for f in fams(impl):
                if (impl.name, s, f) in have:
                    continue
                bar.update(n, label=f"harness: {impl.name} {'x'.join(map(str, s))} {f} ({n + 1}/{total})")
                rows.append(judge_one(impl, s, f, cache, time_reps=time_reps))
                n += 1
                if checkpoint is not None:
                    checkpoint(rows)  # after every row: a run stopped from outside keeps what it measured
            if j + 1 == len(todo) or todo[j + 1][0] != s:  # this shape is done
                cache.store = {k: v for k, v in cache.store.items() if k[1] != s}
        bar.update(max(total, 1))
    return rows


def _g(v, fmt=".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def format_table(rows: list[Row]) -> str:
    head = (f"{'impl':<26} {'shape':<10} {'family':<16} {'err':>8} {'eager':>8} {'unfused':>8} {'k':>5} "
            f"{'floor':>8} {'polar':>7} {'math':>7} {'math z':>7} {'lifted':>8} {'sv min/mean/max':>17} {'exploded':>9} "
            f"{'gram':>7} {'ms':>7} {'verdict':>9}  clauses")
    lines = [head, "-" * len(head)]
    for r in rows:
        sv = "-" if math.isnan(r.sv_mean) else f"{r.sv_min:.2f}/{r.sv_mean:.2f}/{r.sv_max:.2f}"
        gram = "-" if r.gram_declared is None and r.gram_seen is None else f"{_g(r.gram_seen, 'd')}/{_g(r.gram_declared, 'd')}"
        v = r.verdicts()
        clauses = "; ".join(v["math"] + v["safety"] + v["rounding"] + v["findings"] + v["limits"] +
                            ([r.note] if r.note else []))
        lines.append(f"{r.impl:<26} {'x'.join(map(str, r.shape)):<10} {r.family:<16} {_g(r.fast):>8} {_g(r.eager):>8} "
                     f"{_g(r.eager_unfused):>8} {_g(r.rounding_ratio(), '.2f'):>5} {_g(r.floor):>8} {_g(r.polar):>7} "
                     f"{_g(r.math_polar):>7} {_g(r.math_z, '.2f'):>7} {_g(r.lift_err, '.2g'):>8} {sv:>17} {r.exploded:>4}/{r.count:<4} {gram:>7} "
                     f"{_g(r.ms):>7} {r.verdict():>9}  {clauses}")
    lines.append("err: relative Frobenius error against the same math in float64 (max over matrices); eager / unfused: "
                 "the same math in plain eager bf16, fused and unfused form; k: err / the larger of the two; floor: the "
                 "float64 result rounded to bf16; polar / math: the implementation's and the float64 math's error "
                 "against the exact polar factor; math z: the spectrum probe's largest deviation from the declared "
                 "map, in standard errors; lifted: its error against the float64 math when run with every tensor "
                 "in float64 (- where that run does not reach its arithmetic); sv: singular values / their RMS; exploded: top singular value > the "
                 "math's explosion threshold; gram: side of the largest square product seen / declared; ms: median "
                 "per call (CUDA)")
    lines.append(VERDICT_RULE)
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts = {v: 0 for v in ("ok", "finding", "FAIL", "unjudged")}
    for r in rows:
        counts[r.verdict()] += 1
    return f"{len(rows)} rows: " + ", ".join(f"{n} {v}" for v, n in counts.items())


def device_name(device) -> str:
    """The name of the machine a row is judged on: the GPU's (``torch.cuda.get_device_name``), else
    the CPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def device_names(rows: Sequence[Row]) -> dict[str, int]:
    """Rows per machine that judged them, in first-seen order (a stored row without a name: "")."""
    out: dict[str, int] = {}
    for r in rows:
        out[r.device_name] = out.get(r.device_name, 0) + 1
    return out


def to_json(rows: list[Row], *, command: str, impls: Sequence[Implementation] = (), unavailable: dict | None = None,
            meta: dict | None = None) -> dict:
    """The rows and what produced them (the command, the commit of the last run, the versions, the
    machines with their rows' counts), as the paper's generator (papers/orthogonalizers.py) reads them."""
    dev = rows[0].device if rows else "cpu"
    out = {"generated_by": command, "commit": source_commit(),
           "device": device_name(torch.device("cuda", 0) if dev == "cuda" else "cpu"),
           "devices": device_names(rows),
           "torch": torch.__version__, "python": platform.python_version(), "verdict_rule": VERDICT_RULE,
           "implementations": {i.name: {"math": None if i.math is None else i.math.to_json(),
                                        "describe": "undeclared" if i.math is None else i.math.describe(),
                                        "note": i.note} for i in impls},
           "unavailable": dict(unavailable or {}), "rows": [r.to_json() for r in rows]}
    out.update(meta or {})
    return out


def resolve(spec: str) -> Callable:
    """``package.module:function`` (or ``package.module:Class.method``), or ``path/to/file.py:function``
    (a script that is not on the import path, imported from its file) -> the callable."""
    if ":" not in spec:
        raise ValueError(f"--impl: expected package.module:function or path/to/file.py:function, got {spec!r}")
    # rsplit: a Windows path keeps its drive's colon
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        obj = _import_file(mod_name)
    else:
        try:
            obj = importlib.import_module(mod_name)
        except ImportError as exc:
            raise ValueError(f"--impl: cannot import {mod_name!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--impl: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--impl: {spec!r} is not callable")
    return obj


def _import_file(path: str):
    """The module of a Python file, imported under a name of its own (its stem and a hash of its full
    path, so two files of one name do not replace each other), registered in ``sys.modules`` so that
    a function in it pickles and torch.compile finds its globals."""
    import hashlib
    import importlib.util
    import os
    import sys

    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"--impl: no file {path!r}")
    name = f"{os.path.splitext(os.path.basename(full))[0]}_{hashlib.sha256(full.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"--impl: importing {path!r} raised {type(exc).__name__}: {exc}") from None
    return module


def callable_name(fn: Callable) -> str:
    """A name for ``fn`` in a table: its qualified name; a lambda, a partial or a callable object by
    where it was written (``<lambda> at tests/test_x.py:12``), the function a partial wraps."""
    import functools
    import inspect
    import os

    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)})"
    try:  # a decorator's wrapper (functools.wraps): the function it wraps (inspect refuses a cycle)
        inner = inspect.unwrap(fn)
    except ValueError:
        inner = fn
    if inner is not fn and callable(inner):
        return callable_name(inner)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    if "<lambda>" in name or "<locals>" in name:
        code = getattr(fn, "__code__", None)
        if code is not None:
            where = code.co_filename
            try:
                where = os.path.relpath(where)
            except ValueError:
                pass
            # a wrapper that renamed itself (``run.__name__ = f.__name__``) goes by that name
            base = getattr(fn, "__name__", None) or name.rsplit(".", 1)[-1]
            return f"{base} at {where}:{code.co_firstlineno}"
    return name


def assert_orthogonalizer(fn: Callable[[Tensor], Tensor], *, coeffs: MapsLike | None = None, steps: int | None = None,
                          cycle: bool = False, normalization: str = "frobenius", margin: float = 1.0,
                          eps: float = 1e-7, transpose_when: str = "tall", restarts: Sequence[int] | None = None,
                          dtype: str = "bfloat16", shapes=DEFAULT_SHAPES,
                          families: Sequence[str] = DEFAULT_FAMILIES, seed: int = 0, per_matrix: bool | None = None,
                          input_dtype: torch.dtype = torch.float32, device="cpu", near_rank1_count: int = 8,
                          name: str | None = None, spectrum_count: int | None = None) -> list[Row]:
    """Judge ``fn`` (module docstring) and raise :class:`OrthogonalizerMismatch` naming every failed
    clause (its verdict, value and limit) and the table if a row FAILs; returns the rows (findings
    do not raise: read them with ``row.verdicts()``). ``coeffs`` (with ``steps``, ``cycle``,
    :meth:`DeclaredMath.of`), ``normalization``, ``margin``, ``eps``, ``transpose_when``, ``restarts`` (the
    Gram form's) and ``dtype`` (the iteration's) declare its math (:class:`DeclaredMath`); ``coeffs=None``:
    undeclared (only safety is judged). ``per_matrix``: True for a function of
    one matrix ``[rows, cols]``, False for one of a batch, None (default) decided from one call on a
    batch (:meth:`Implementation.settle`; the rows then say so)."""
    m = None if coeffs is None else DeclaredMath.of(coeffs, steps=steps, cycle=cycle, normalization=normalization,
                                                     margin=margin, eps=eps, transpose_when=transpose_when,
                                                     restarts=None if restarts is None else tuple(restarts), dtype=dtype)
    impl = Implementation(name or callable_name(fn), fn, m, per_matrix=per_matrix, input_dtype=input_dtype)
    rows = judge(impl, shapes=shapes, families=families, seed=seed, device=device, near_rank1_count=near_rank1_count,
                 progress=False, spectrum_count=spectrum_count)
    failed = [r for r in rows if r.verdict() == "FAIL"]
    if failed:
        clauses = [f"  {'x'.join(map(str, r.shape))} {r.family}: {c}" for r in failed for c in r.failures()]
        raise OrthogonalizerMismatch(f"{impl.name} fails the harness:\n" + "\n".join(clauses) + "\n\n"
                                     + format_table(rows) + "\n" + summary(rows))
    return rows


def write_json(data: dict, path: str) -> None:
    text = json.dumps(data, indent=1, sort_keys=False, default=float) + "\n"
    if path == "-":
        print(text, end="")
    else:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
