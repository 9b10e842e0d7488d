"""Differential testing of anyone's orthogonalization: a callable ``f(X) -> Y`` judged against the math it declares.

Every optimizer library ships a bf16 Newton-Schulz / Polar Express kernel. Given one, as a callable on
a batch ``[chunk, rows, cols]`` (or on one matrix, ``per_matrix=True``), and the math it declares -- a
:class:`DeclaredMath`: per-step coefficients, normalization and orientation rule, as
:mod:`anvil_ref.polar` runs them in float64 -- the harness runs it on the package's input families
(:mod:`anvil_fast.studies.families`) and reports, per (implementation, shape, family):

``err``        its relative error against the same math in float64 (:func:`reference`)
``floor``      the float64 result rounded once to bf16: no bf16 output can do better
``eager``      the harness's plain eager bf16 run of the same math (:func:`eager_declared`): what that
               math loses in bf16 with library matmuls, the "as accurate as its math allows" mark
``bound``      the derived bound of eager's error for that math (:func:`anvil_fast.core.tolerances.declared_roundings`;
               applied on the well-conditioned family)
``polar``      its error against the exact polar factor ``U V^T`` (float64 SVD), next to ``math``, the
               float64 math's own: where the second is as large as the first, the math (not the rounding)
               limits it
``sv``         min / mean / max of its output's singular values divided by their RMS (a polar factor: 1/1/1)
``exploded``   outputs whose top singular value passes the math's explosion threshold
               (:func:`anvil_fast.core.tolerances.exploded_sigma`; on the near-rank-1 family the inputs are
               :func:`anvil_fast.studies.near_rank1.near_rank1`'s)
``gram``       the side of the largest square product it formed, seen through torch's dispatcher
               (:class:`GramRecorder`; not seen for Triton kernels), next to the one its orientation
               rule forms
``ms``         median time per call on CUDA

and the verdict of the package's one rule, :func:`anvil_fast.core.tolerances.check_row` (:data:`VERDICT_RULE`):
``ok``, or ``FAIL`` where it errs by more than twice the eager bf16 run of its own math plus one bf16
rounding, explodes, or does not do what it declares (another output shape, a Gram on the other side).
Undeclared math (``math=None``) gets the polar, singular-value and explosion columns (the explosion
threshold then is EXPLODED_SIGMA, ANVIL's: a map set that peaks higher, like Muon's quintic at ~1.2,
counts there; declare the math for its own), verdict ``unjudged`` (``FAIL`` where an output is not
finite or has another shape).

From another project's test::

    import anvil_fast.studies.harness as H
    H.assert_orthogonalizer(my_newton_schulz, coeffs=[(3.4445, -4.7750, 2.0315)] * 5,
                            normalization="frobenius_clamp", margin=1.0, eps=1e-7, transpose_when="tall")

raises :class:`OrthogonalizerMismatch` (an AssertionError) with the table when a row fails. The
command line is ``python -m anvil_fast.studies.difftest --impl package.module:function ...`` or
``--adapter NAME`` (:mod:`anvil_fast.studies.adapters`), with ``--json``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from anvil_ref import polar as P
from anvil_ref.maps import MapsLike, load_maps

from anvil_fast.core import tolerances as T
from .families import FAMILIES, WELL_CONDITIONED, make_matrix, rel_errs

#: Families whose polar-factor error is reported: full rank, singular values away from 0 relative to
#: the top one or decaying smoothly (on the others the polar factor is set by directions the input
#: barely has, which no bf16 output can follow).
POLAR_FAMILIES = ("gaussian", "well_conditioned", "decaying")
#: The families of a default judgement (every family of the package).
DEFAULT_FAMILIES = FAMILIES
#: Shapes of a default judgement on the CPU (small: seconds per implementation).
DEFAULT_SHAPES = ((2, 48, 32), (2, 32, 48), (2, 32, 32))
#: Matrix products whose shapes :class:`GramRecorder` records.
PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul"})

VERDICT_RULE = (
    f"verdict: ok = within anvil_fast/core/tolerances.py's rule for a declared iteration: err <= {T.FACTOR:g} eager "
    f"+ 2**{math.log2(T.ATOL):g} (eager: the same math in plain eager bf16), err <= its explosion cap "
    "1 + sigma_x sqrt(k) / ||ref|| (sigma_x = exploded_sigma), eager <= bound on well-conditioned input, output "
    "shape and Gram side as declared; FAIL = outside; unjudged = no math declared (FAIL if not finite)")


class OrthogonalizerMismatch(AssertionError):
    """An implementation failed the harness's rule; the message holds the table of every row."""


@dataclass(frozen=True)
class DeclaredMath:
    """What an orthogonalization declares it computes (:mod:`anvil_ref.polar`): the per-step
    coefficients, the normalization (:data:`anvil_ref.polar.NORMALIZATIONS`) with its margin and
    eps, and the orientation rule (:data:`anvil_ref.polar.ORIENTATIONS`)."""

    coeffs: tuple[tuple[float, float, float], ...]
    normalization: str = "frobenius"
    margin: float = 1.0
    eps: float = 1e-7
    transpose_when: str = "tall"

    def __post_init__(self):
        object.__setattr__(self, "coeffs", load_maps(self.coeffs))
        if self.normalization not in P.NORMALIZATIONS:
            raise ValueError(f"normalization: expected one of {P.NORMALIZATIONS}, got {self.normalization!r}")
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

    def to_json(self) -> dict:
        return {"coeffs": [list(t) for t in self.coeffs], "normalization": self.normalization,
                "margin": self.margin, "eps": self.eps, "transpose_when": self.transpose_when}


@dataclass
class Implementation:
    """A callable to judge: ``fn`` takes a batch ``[chunk, rows, cols]`` of ``input_dtype`` (one
    matrix ``[rows, cols]`` when ``per_matrix``) and returns its orthogonalization, any float dtype;
    ``math`` is what it declares (None: undeclared)."""

    name: str
    fn: Callable[[Tensor], Tensor]
    math: DeclaredMath | None
    per_matrix: bool = False
    input_dtype: torch.dtype = torch.float32
    note: str = ""
    #: run under :class:`GramRecorder` (off for compiled functions: dynamo does not trace under a
    #: dispatch mode)
    observe: bool = True

    def __call__(self, x: Tensor) -> Tensor:
        x = x.to(self.input_dtype)
        if self.per_matrix:
            return torch.stack([self.fn(m) for m in x.unbind(0)])
        return self.fn(x)


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


def run_impl(impl: Implementation, x: Tensor, *, seed: int = 0, record: bool = True,
             chunk: int | None = None) -> tuple[Tensor, int | None]:
    """``impl(x)`` with torch's global generators seeded with ``seed`` (a stochastic rounding inside
    draws the same numbers on every call) and, with ``record``, the Gram side it formed; ``chunk``:
    call it on batches of that many matrices (a compiled function then sees one shape)."""
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    parts = [x] if chunk is None or chunk >= x.shape[0] else list(x.split(chunk))
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        rec = GramRecorder() if record else None
        with rec if rec is not None else contextlib.nullcontext():
            ys = [impl(part) for part in parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return y, None if rec is None else rec.gram_side()


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

def _mm(x: Tensor, y: Tensor) -> Tensor:
    # CPU: the model of a bf16 GEMM with fp32 accumulation (its bits do not depend on which bf16 kernel
    # the BLAS picks, anvil_fast.core.eager.GEMMS); CUDA: the library's bf16 GEMM, as the implementations use
    return (x.float() @ y.float()).bfloat16() if x.device.type == "cpu" else x @ y


def _addmm(beta: float, c: Tensor, x: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
    """``beta*c + alpha*(x @ y)`` rounded once to bf16 (fp32 accumulation)."""
    if c.device.type == "cpu" or alpha == 0:
        return (beta * c.float() + alpha * (x.float() @ y.float())).bfloat16()
    return torch.baddbmm(c, x, y, beta=beta, alpha=alpha)


def eager_declared(x: Tensor, math_: DeclaredMath) -> Tensor:
    """The declared math in plain eager bf16 (the ``eager`` column): ``x`` cast to bf16 (clamped to its
    finite range), oriented, normalized in fp32 after an exact power-of-two prescale (eps scaled alike:
    nothing over- or underflows, nothing extra is rounded; AOL's row sums from the bf16 first Gram) and
    rounded to bf16; then per step ``A = Z Z^T``, ``B = b A + c A^2`` and ``Z = a Z + B Z``, each one
    product with fp32 accumulation rounded once to bf16. Returns bf16 of x's shape."""
    bf_max = torch.finfo(torch.bfloat16).max
    X = x.float().clamp(-bf_max, bf_max).bfloat16()
    if X.ndim == 2:
        return eager_declared(x[None], math_)[0]
    flip = P.transposes(tuple(X.shape), transpose_when=math_.transpose_when)
    Z = X.mT.contiguous() if flip else X
    zf = Z.float()
    amax = zf.abs().amax(dim=(-2, -1), keepdim=True)
    s = torch.exp2(-torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))).clamp(-126, 126))
    zf = zf * s
    if math_.normalization == "aol":
        A = _mm(zf.bfloat16(), zf.bfloat16().mT)
        r = A.float().abs().sum(-1).clamp_min(math_.eps * s[..., 0] ** 2).rsqrt()
        Z = (zf * r[..., :, None]).bfloat16()
    else:
        nrm = zf.square().sum(dim=(-2, -1), keepdim=True).sqrt() * math_.margin
        d = nrm + math_.eps * s if math_.normalization == "frobenius" else torch.maximum(nrm, math_.eps * s)
        Z = (zf / d).bfloat16()
    for a, b, c in math_.coeffs:
        A = _mm(Z, Z.mT)
        B = _addmm(b, A, A, A, alpha=c)
        Z = _addmm(a, Z, B, Z)
    return Z.mT if flip else Z


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
    """One (implementation, shape, family): the columns of the module docstring. The fields ``fast``,
    ``eager``, ``floor``, ``cap_ratio``, ``roundings``, ``conforms`` and ``well_conditioned`` are what
    :func:`anvil_fast.core.tolerances.check_row` reads."""

    impl: str
    shape: tuple[int, ...]
    family: str
    fast: float = math.nan  #: error against the same math in float64
    floor: float = math.nan
    eager: float = math.nan
    bound: float = math.nan
    roundings: float | None = None  #: the gain-weighted rounding count of the bound (well-conditioned rows)
    polar: float = math.nan
    math_polar: float = math.nan
    sv_min: float = math.nan
    sv_mean: float = math.nan
    sv_max: float = math.nan
    top_sv: float = math.nan
    exploded: int = 0
    count: int = 0
    sigma_x: float = T.EXPLODED_SIGMA
    cap_ratio: float | None = None
    gram_seen: int | None = None
    gram_declared: int | None = None
    conforms: bool = True
    note: str = ""
    ms: float | None = None
    declared: bool = True
    well_conditioned: bool = False
    device: str = "cpu"
    # what check_row reads of a difftest row, and has no meaning here
    component: str = field(default="cascade", repr=False)
    ulps: float | None = field(default=None, repr=False)
    same_bits: float | None = field(default=None, repr=False)
    eager_sv: float | None = field(default=None, repr=False)

    @property
    def config(self) -> str:
        return self.impl

    def verdict(self) -> str:
        """"ok", "FAIL" or "unjudged" (:data:`VERDICT_RULE`)."""
        if not self.declared:
            return "FAIL" if not self.conforms or not self.top_sv < math.inf else "unjudged"
        return "ok" if T.check_row(self, same_backend=False) else "FAIL"

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("component", "ulps", "same_bits", "eager_sv"):
            d.pop(k)
        d["shape"] = list(self.shape)
        d["verdict"] = self.verdict()
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _input(family: str, shape: tuple[int, int, int], *, seed: int, count: int, device) -> Tensor:
    if family == "near_rank1":
        from .near_rank1 import near_rank1

        return near_rank1(max(count, shape[0]), shape[1], shape[2], seed=seed, device=device)
    return make_matrix(family, shape, seed=seed, device=device)


class _Cache:
    """Per (shape, family): the input, its polar factor and singular values; per declared math: the
    float64 result, the eager bf16 result and the bound. Shared by every implementation judged in one call."""

    def __init__(self, *, seed: int, device, count: int):
        self.seed, self.device, self.count = seed, torch.device(device), count
        self.store: dict = {}

    def get(self, key, make):
        if key not in self.store:
            self.store[key] = make()
        return self.store[key]

    def x(self, shape, family):
        return self.get(("x", shape, family), lambda: _input(family, shape, seed=self.seed, count=self.count,
                                                               device=self.device))

    def polar(self, shape, family):
        return self.get(("polar", shape, family), lambda: polar_factor(self.x(shape, family)))

    def ref(self, shape, family, m: DeclaredMath):
        return self.get(("ref", shape, family, m), lambda: reference(self.x(shape, family), m))

    def eager(self, shape, family, m: DeclaredMath):
        return self.get(("eager", shape, family, m), lambda: eager_declared(self.x(shape, family), m))

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


def judge_one(impl: Implementation, shape, family: str, cache: _Cache, *, time_reps: int = 0) -> Row:
    """One row (module docstring)."""
    shape = tuple(int(v) for v in shape)
    x = cache.x(shape, family)
    m = impl.math
    dev = cache.device.type
    row = Row(impl.name, shape, family, count=int(x.shape[0]), declared=m is not None,
              well_conditioned=family in WELL_CONDITIONED, device=dev)
    if m is not None:
        row.gram_declared = P.gram_side(shape, transpose_when=m.transpose_when)
        row.sigma_x = m.exploded_sigma()
    try:
        try:
            y, row.gram_seen = run_impl(impl, x, seed=cache.seed, record=impl.observe, chunk=shape[0])
        except Exception:
            if not impl.observe:
                raise
            y, row.gram_seen = run_impl(impl, x, seed=cache.seed, record=False, chunk=shape[0])  # not observable
            row.note = "products not observable (it fails under a dispatch mode)"
    except Exception as exc:  # a crash is a failure of the row, reported, not of the whole table
        row.conforms, row.note = False, f"raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
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
    if family in POLAR_FAMILIES or min(shape[1:]) <= EXACT_SV_MAX:
        s = singular_values(y)
        row.sv_min, row.sv_mean, row.sv_max = sv_range(s)
        top = torch.where(torch.isnan(s[:, -1]), torch.full_like(s[:, -1], math.inf), s[:, -1]).cpu()
    else:
        top = top_singular_values(y)
    row.top_sv = float(top.max())
    row.exploded = int((top > row.sigma_x).sum())
    if family in POLAR_FAMILIES:
        pf = cache.polar(shape, family)
        row.polar = float(rel_errs(y, pf).max())
    if m is not None:
        ref = cache.ref(shape, family, m)
        row.fast = float(rel_errs(y, ref).max())
        row.floor = float(rel_errs(ref.bfloat16(), ref).max())
        row.eager = float(rel_errs(cache.eager(shape, family, m), ref).max())
        k = min(shape[1:])
        norms = ref.detach().double().reshape(-1, *ref.shape[-2:]).flatten(1).norm(dim=1).cpu()
        caps = torch.tensor([T.cascade_error_cap(float(n), k, sigma=row.sigma_x) for n in norms], dtype=torch.float64)
        row.cap_ratio = float((rel_errs(y, ref) / caps).max()) if torch.isfinite(norms).all() else math.inf
        if family in POLAR_FAMILIES:
            row.math_polar = float(rel_errs(ref, cache.polar(shape, family)).max())
        if row.well_conditioned:
            row.roundings = cache.roundings(shape, family, m)
            row.bound = T.eager_bound("cascade", floor=row.floor, roundings=row.roundings)
    if time_reps and dev == "cuda" and family == DEFAULT_FAMILIES[0]:
        from anvil_fast.kernels.timing import median_ms

        with torch.no_grad():
            row.ms = median_ms(lambda: impl(x), n=time_reps, warmup=2, device=x.device)
    return row


def judge(impls: Implementation | Sequence[Implementation], *, shapes=DEFAULT_SHAPES, families=DEFAULT_FAMILIES,
          seed: int = 0, device="cpu", near_rank1_count: int = 8, time_reps: int = 0, progress: bool | None = None,
          time_limit: float | None = None, checkpoint: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Every row for every implementation, shape and family (same inputs for all implementations).
    ``near_rank1_count``: inputs of the near-rank-1 family per shape; ``time_reps``: timed calls per
    shape on CUDA (0: none); ``time_limit``: seconds after which no new row is started (the rows done
    are returned); ``checkpoint``: called with the rows so far after every row (a run that is
    stopped from outside keeps what it measured)."""
    from anvil_ref.progress import Progress

    impls = [impls] if isinstance(impls, Implementation) else list(impls)
    bad = sorted(set(families) - set(FAMILIES))
    if bad:
        raise ValueError(f"families: unknown {bad}; expected a subset of {FAMILIES}")
    shapes = [tuple(s) for s in shapes]
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"shapes: expected (chunk, rows, cols) of positive integers, got {s!r}")
    cache = _Cache(seed=seed, device=device, count=near_rank1_count)
    cases = [(i, s, f) for s in shapes for f in families for i in impls]
    rows, t0 = [], time.monotonic()
    with Progress(len(cases), "harness", enabled=progress) as bar:
        for n, (impl, s, f) in enumerate(cases):
            if time_limit is not None and time.monotonic() - t0 > time_limit:
                break
            bar.update(n, label=f"harness: {impl.name} {'x'.join(map(str, s))} {f} ({n + 1}/{len(cases)})")
            rows.append(judge_one(impl, s, f, cache, time_reps=time_reps))
            if checkpoint is not None:
                checkpoint(rows)  # after every row: one implementation's compilation can outlast a run's box
            if n + 1 == len(cases) or cases[n + 1][1] != s:  # this shape is done
                cache.store = {k: v for k, v in cache.store.items() if k[1] != s}
        bar.update(len(cases))
    return rows


def _g(v, fmt=".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def format_table(rows: list[Row]) -> str:
    head = (f"{'impl':<26} {'shape':<12} {'family':<16} {'err':>9} {'floor':>8} {'eager':>8} {'bound':>8} "
            f"{'polar':>8} {'math':>8} {'sv min/mean/max':>17} {'exploded':>9} {'gram':>9} {'ms':>8} {'verdict':>9}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        sv = "-" if math.isnan(r.sv_mean) else f"{r.sv_min:.2f}/{r.sv_mean:.2f}/{r.sv_max:.2f}"
        gram = "-" if r.gram_declared is None and r.gram_seen is None else f"{_g(r.gram_seen, 'd')}/{_g(r.gram_declared, 'd')}"
        lines.append(f"{r.impl:<26} {'x'.join(map(str, r.shape)):<12} {r.family:<16} {_g(r.fast):>9} {_g(r.floor):>8} "
                     f"{_g(r.eager):>8} {_g(r.bound):>8} {_g(r.polar):>8} {_g(r.math_polar):>8} {sv:>17} "
                     f"{r.exploded:>4}/{r.count:<4} {gram:>9} {_g(r.ms):>8} {r.verdict():>9}  {r.note}")
    lines.append("err: relative Frobenius error against the same math in float64 (max over matrices); floor: the "
                 "float64 result rounded to bf16; eager: the same math in plain eager bf16; bound: eager's derived bound "
                 "(well-conditioned input); polar / math: the implementation's and the float64 math's error against the "
                 "exact polar factor; sv: singular values / their RMS; exploded: top singular value > the math's "
                 "explosion threshold; gram: side of the largest square product seen / declared; ms: median per call "
                 "(CUDA)")
    lines.append(VERDICT_RULE)
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts = {v: 0 for v in ("ok", "FAIL", "unjudged")}
    for r in rows:
        counts[r.verdict()] += 1
    return f"{len(rows)} rows: " + ", ".join(f"{n} {v}" for v, n in counts.items())


def to_json(rows: list[Row], *, command: str, impls: Sequence[Implementation] = (), unavailable: dict | None = None,
            meta: dict | None = None) -> dict:
    """The rows and what produced them, as the paper's generator (papers/orthogonalizers.py) reads them."""
    dev = rows[0].device if rows else "cpu"
    out = {"generated_by": command, "device": torch.cuda.get_device_name(0) if dev == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "verdict_rule": VERDICT_RULE,
           "implementations": {i.name: {"math": None if i.math is None else i.math.to_json(),
                                        "describe": "undeclared" if i.math is None else i.math.describe(),
                                        "note": i.note} for i in impls},
           "unavailable": dict(unavailable or {}), "rows": [r.to_json() for r in rows]}
    out.update(meta or {})
    return out


def resolve(spec: str) -> Callable:
    """``package.module:function`` (or ``package.module:Class.method``) -> the callable."""
    if ":" not in spec:
        raise ValueError(f"--impl: expected package.module:function, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
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


def assert_orthogonalizer(fn: Callable[[Tensor], Tensor], *, coeffs: MapsLike | None = None, steps: int | None = None,
                          normalization: str = "frobenius", margin: float = 1.0, eps: float = 1e-7,
                          transpose_when: str = "tall", shapes=DEFAULT_SHAPES,
                          families: Sequence[str] = ("gaussian", "well_conditioned", "near_rank1", "decaying", "zero"),
                          seed: int = 0, per_matrix: bool = False, input_dtype: torch.dtype = torch.float32,
                          device="cpu", near_rank1_count: int = 8, name: str | None = None) -> list[Row]:
    """Judge ``fn`` (module docstring) and raise :class:`OrthogonalizerMismatch` with the table if a
    row fails; returns the rows. ``coeffs`` (with ``steps``, :meth:`DeclaredMath.of`), ``normalization``,
    ``margin``, ``eps`` and ``transpose_when`` declare its math; ``coeffs=None``: undeclared (only
    explosions and the output's shape are judged)."""
    m = None if coeffs is None else DeclaredMath.of(coeffs, steps=steps, normalization=normalization, margin=margin,
                                                     eps=eps, transpose_when=transpose_when)
    impl = Implementation(name or getattr(fn, "__name__", "fn"), fn, m, per_matrix=per_matrix, input_dtype=input_dtype)
    rows = judge(impl, shapes=shapes, families=families, seed=seed, device=device, near_rank1_count=near_rank1_count,
                 progress=False)
    if any(r.verdict() == "FAIL" for r in rows):
        raise OrthogonalizerMismatch(f"{impl.name} fails the harness's rule:\n" + format_table(rows) + "\n" + summary(rows))
    return rows


def write_json(data: dict, path: str) -> None:
    text = json.dumps(data, indent=1, sort_keys=False, default=float) + "\n"
    if path == "-":
        print(text, end="")
    else:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
