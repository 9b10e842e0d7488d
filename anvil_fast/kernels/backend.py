"""What every Triton kernel of the package shares: where Triton can run (:func:`use_triton`, the one
dispatch rule), the bf16 conversions (:func:`to_bf16`, :func:`from_bf16`), the SM count, the batch
slices of grid axis 1 (:func:`matrix_slices`), and three bugs of Triton's CPU interpreter that the
kernels work around soundly.

Imported by the kernel modules only; ``import anvil_fast`` never imports Triton. A new kernel module
takes its helpers from here (``from .backend import from_bf16, round_fix, to_bf16, use_triton, ...``)
and offers ``backend="auto" | "triton" | "torch"`` through :func:`use_triton`.

The interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors with NumPy. Under triton 3.9 three
of its bf16 operations are wrong (each checked at run time by the probes below, on every test run):

1. ``tl.dot`` on bf16 operands returns garbage (relative error ~1e9-1e10), while fp16 and fp32
   operands are right (:func:`interpreter_bf16_dot_is_broken`, a 32 x 32 product both ways).
2. ``x.to(tl.bfloat16)`` from fp32 truncates (rounds toward zero; ``fp_downcast_rounding="rtne"`` is
   ignored) where compiled Triton rounds to nearest even (:func:`interpreter_bf16_cast_truncates`).
3. ``x.to(tl.float32)`` from bf16 is wrong for bf16 subnormals (below 2**-126: e.g. -6.06e-39
   widens to -3.67e-40), where the exact widening is the bf16 pattern as the high half of the fp32
   one (:func:`interpreter_bf16_widen_is_wrong`).

The kernels take three switches. ``DOT_F32`` widens every bf16 tile to fp32 right before ``tl.dot``:
bf16 -> fp32 is exact and both paths accumulate in fp32, so the product is the same real number up
to fp32 summation order. ``ROUND_FIX`` rounds fp32 to bf16 on the bit pattern (round to nearest
even, the GPU's rounding). ``WIDEN_FIX`` (the element-wise kernels of :mod:`anvil_fast.kernels.rails` and
:mod:`anvil_fast.kernels.normalize`, whose tests feed subnormals) widens on the bit pattern; the Gram
kernels' interpreter tests use normal-range inputs and do not take it. Everything else the
kernels do (index math, masks, 64-bit offsets, the mirrored stores, the epilogues, bf16 loads) is
the very same code. Each switch is on only under the
interpreter and only while its probe finds the bug, so a fixed interpreter tests the native path.
What only a GPU run covers: the native bf16 ``tl.dot`` lowering (wgmma), the native cast, real
layouts / pipelining (``num_warps``, ``num_stages``), and offsets past 2**31 elements (too large
for a CI machine's memory).
"""

from __future__ import annotations

import functools
import os

BACKENDS = ("auto", "triton", "torch")

#: SM count assumed where no CUDA device can be asked (the interpreter, a CPU-only host): small, so
#: persistent grids and size heuristics stay small and fast on the CPU interpreter.
FALLBACK_SMS = 4
#: CUDA's limit on grid dimension 1, where the element-wise kernels and the v1 Gram kernels put the
#: matrix index: larger batches launch in slices of this many matrices (:func:`matrix_slices`).
MAX_GRID_Y = 65535


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def interpreter_bf16_dot_is_broken() -> bool:
    """Run a 32 x 32 bf16 product through the interpreter with and without widening; True when the
    native bf16 ``tl.dot`` is wrong (relative error > 1e-2) while the widened one is right."""
    if not (triton_available() and interpreting()):
        return False
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    ref = a.double() @ b.double()
    errs = []
    for widen in (False, True):
        c = torch.empty(32, 32, dtype=torch.float32)
        _probe_dot[(1,)](a, b, c, N=32, DOT_F32=widen)
        errs.append(float((c.double() - ref).norm() / ref.norm()))
    if errs[1] > 1e-5:
        raise RuntimeError(f"Triton interpreter: even the widened fp32 tl.dot is wrong (rel. error {errs[1]:.3g})")
    return errs[0] > 1e-2


@functools.lru_cache(maxsize=None)
def interpreter_bf16_cast_truncates() -> bool:
    """True when the interpreter's fp32 -> bf16 cast differs from torch's round-to-nearest-even on
    random values (the native cast, without ROUND_FIX)."""
    if not (triton_available() and interpreting()):
        return False
    import torch

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    ok = []
    for fix in (False, True):
        c = torch.empty(1024, dtype=torch.bfloat16)
        _probe_cast[(1,)](x, c, N=1024, ROUND_FIX=fix)
        ok.append(bool((c == x.bfloat16()).all()))
    if not ok[1]:
        raise RuntimeError("Triton interpreter: the bit-level round-to-nearest-even cast is wrong")
    return not ok[0]


@functools.lru_cache(maxsize=None)
def interpreter_bf16_widen_is_wrong() -> bool:
    """True when the interpreter's bf16 -> fp32 widening differs from torch's (exact) one on bf16
    values that include subnormals (the native widening, without WIDEN_FIX)."""
    if not (triton_available() and interpreting()):
        return False
    import torch

    x = (torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 2.0 ** -128).bfloat16()
    ok = []
    for fix in (False, True):
        c = torch.empty(1024, dtype=torch.float32)
        _probe_widen[(1,)](x, c, N=1024, WIDEN_FIX=fix)
        ok.append(bool((c == x.float()).all()))
    if not ok[1]:
        raise RuntimeError("Triton interpreter: the bit-level bf16 -> fp32 widening is wrong")
    return not ok[0]


def widen_fix() -> bool:
    """The ``WIDEN_FIX`` switch for kernel launches (see the module docstring)."""
    return interpreting() and interpreter_bf16_widen_is_wrong()


def round_fix() -> bool:
    """The ``ROUND_FIX`` switch for kernel launches (see the module docstring)."""
    return interpreting() and interpreter_bf16_cast_truncates()


def dot_f32() -> bool:
    """The ``DOT_F32`` switch for kernel launches (see the module docstring)."""
    return interpreting() and interpreter_bf16_dot_is_broken()


def use_triton(t, backend: str, *, error: type[Exception] = ValueError) -> bool:
    """Whether a kernel runs its Triton path on ``t``: ``backend`` "auto" runs Triton on CUDA tensors
    (torch elsewhere), "triton" insists (on CUDA, or on CPU under the interpreter, which is how the
    tests run the kernels), "torch" never. An unknown ``backend``, or "triton" where it cannot run,
    raises ``error`` (each module passes its own input-error class) naming what was expected."""
    if backend not in BACKENDS:
        raise error(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not (triton_available() and (t.is_cuda or (interpreting() and t.device.type == "cpu"))):
            raise error(f"backend='triton': Triton cannot run on a {t.device.type} tensor here "
                        "(needs CUDA, or TRITON_INTERPRET=1 for CPU tensors)")
        return True
    return triton_available() and t.is_cuda


def matrix_slices(chunk: int):
    """(start, stop) ranges of at most MAX_GRID_Y matrices covering ``range(chunk)``: one launch each."""
    for s in range(0, chunk, MAX_GRID_Y):
        yield s, min(chunk, s + MAX_GRID_Y)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (None: device 0), asked from the
    device; :data:`FALLBACK_SMS` under the interpreter or without CUDA."""
    if interpreting():
        return FALLBACK_SMS
    import torch

    if not torch.cuda.is_available():
        return FALLBACK_SMS
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


# ------------------------------------------------------------------------------------------------
# Device functions shared by the kernels, and the probe kernels of the interpreter checks above.

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def from_bf16(x, WIDEN_FIX: tl.constexpr):
        # bf16 -> fp32 (exact). WIDEN_FIX does it on the bits (the high half of the fp32 pattern): only
        # under the interpreter, whose widening gets bf16 subnormals wrong.
        if WIDEN_FIX:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def to_bf16(x, ROUND_FIX: tl.constexpr):
        # fp32 -> bf16, round to nearest even. ROUND_FIX does it on the bits (add 0x7FFF plus the
        # lowest kept bit, drop the low half): only under the interpreter, whose cast truncates.
        if ROUND_FIX:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def _probe_dot(A, B, C, N: tl.constexpr, DOT_F32: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(A + r[:, None] * N + r[None, :])
        b = tl.load(B + r[:, None] * N + r[None, :])
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        tl.store(C + r[:, None] * N + r[None, :], tl.dot(a, b))

    @triton.jit
    def _probe_cast(A, C, N: tl.constexpr, ROUND_FIX: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(C + r, to_bf16(tl.load(A + r), ROUND_FIX))

    @triton.jit
    def _probe_widen(A, C, N: tl.constexpr, WIDEN_FIX: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(C + r, from_bf16(tl.load(A + r), WIDEN_FIX))
