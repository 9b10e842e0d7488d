"""The symmetric Gram kernels (anvil_fast.gram): exactness against float64, exact symmetry, every size,
bad input.

Without CUDA the Triton kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), with the two interpreter work-arounds of anvil_fast/_triton.py, whose probes are
tested here too. With CUDA the same tests run the compiled kernels (and the gpu-marked ones add the
native-only cases: 64-bit offsets, production tile sizes).

The exactness check: with fp32 accumulation of exact bf16 products, the kernels' result is the exact
product up to fp32 summation error (~1e-7 relative), then rounded once to bf16; so it must equal the
float64 product rounded to bf16 in all but a few entries that sit at a rounding boundary, and never be
more than one bf16 ulp away.
"""

from __future__ import annotations

import math

import pytest
import torch

from anvil_fast import gram as G
from anvil_fast._triton import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = G.TileConfig(32, 32, 16, 4, 1) if interpreting() else None  # 16-deep K: several K steps on CPU


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def assert_rounded_exact(y: torch.Tensor, exact: torch.Tensor, what: str, scale: torch.Tensor | None = None) -> None:
    """y (bf16) equals exact (float64) rounded to bf16 except at rounding boundaries: within one bf16
    ulp, plus the fp32 accumulation error (2**-20 of ``scale``, the sum of the terms' magnitudes)
    where the result cancels."""
    y64, ex = y.double().cpu(), exact.double().cpu()
    assert torch.isfinite(y64).all(), f"{what}: non-finite output (an unwritten element?)"
    ref = ex.to(torch.bfloat16).double()
    same = (y64 == ref).double().mean().item()
    slack = 0.0 if scale is None else 2.0 ** -20 * scale.double().cpu()
    worst = (((y64 - ex).abs() - slack).clamp_min(0) / _bf16_ulp(ex)).max().item()
    assert same >= 0.99, f"{what}: only {same:.4f} of entries equal the rounded float64 result"
    assert worst <= 1.0, f"{what}: an entry is {worst:.2f} bf16 ulps from the exact value"


def poisoned(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)


SHAPES = [(2, 70, 45), (1, 45, 70), (3, 33, 33), (1, 64, 96), (2, 1, 17), (1, 17, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gram_kernels_equal_rounded_float64_and_are_exactly_symmetric(shape):
    g = torch.Generator().manual_seed(sum(shape))
    X = torch.randn(shape, generator=g).bfloat16().to(DEV)
    x64 = X.double().cpu()
    for fn, exact, n in ((G.XXT, x64 @ x64.mT, shape[1]), (G.XTX, x64.mT @ x64, shape[2])):
        out = poisoned((*shape[:-2], n, n))
        res = fn(X, out=out, backend="triton", config=SMALL)
        assert res is out
        ax = x64.abs()
        assert_rounded_exact(out, exact, fn.__name__, scale=ax @ ax.mT if fn is G.XXT else ax.mT @ ax)
        assert torch.equal(out, out.mT), f"{fn.__name__}: not exactly symmetric"


@pytest.mark.parametrize("n", [17, 32, 70])
def test_ba_plus_caa_equals_rounded_float64(n):
    g = torch.Generator().manual_seed(n)
    X = torch.randn(2, n, 2 * n, generator=g).bfloat16().to(DEV)
    A = G.XXT(X, backend="triton", config=SMALL)
    A = (A.float() / A.float().diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]).bfloat16()
    a64 = A.double().cpu()
    b, c = -6.095026865488, 3.905234618423
    out = poisoned(tuple(A.shape))
    G.ba_plus_cAA(A, alpha=c, beta=b, out=out, backend="triton", config=SMALL)
    assert_rounded_exact(out, b * a64 + c * (a64 @ a64), "ba_plus_cAA",
                         scale=abs(b) * a64.abs() + abs(c) * a64.abs() @ a64.abs())
    assert torch.equal(out, out.mT)


@pytest.mark.parametrize("m,k,n", [(70, 45, 45), (45, 45, 70), (33, 33, 100)])
def test_ax_plus_mm_equals_rounded_float64(m, k, n):
    g = torch.Generator().manual_seed(m * n)
    X = torch.randn(2, m, n, generator=g).bfloat16().to(DEV)
    L = torch.randn(2, m, k, generator=g).bfloat16().to(DEV)
    R = torch.randn(2, k, n, generator=g).bfloat16().to(DEV)
    out = poisoned(tuple(X.shape))
    cfg = G.TileConfig(32, 32, 16, 4, 1, 2) if interpreting() else None
    G.aX_plus_mm(X, L, R, a=3.923798038567, out=out, backend="triton", config=cfg)
    x, l_, r = X.double().cpu(), L.double().cpu(), R.double().cpu()
    assert_rounded_exact(out, 3.923798038567 * x + l_ @ r, "aX_plus_mm", scale=3.93 * x.abs() + l_.abs() @ r.abs())


def test_torch_fallback_has_the_kernel_semantics():
    X = torch.randn(2, 50, 30).bfloat16()
    A = G.XXT(X, backend="torch")
    assert_rounded_exact(A, X.double() @ X.double().mT, "XXT torch")
    assert torch.equal(A, A.mT)
    B = G.ba_plus_cAA(A / 30, alpha=2.0, beta=-1.0, backend="torch")
    a = (A / 30).double()
    assert_rounded_exact(B, -a + 2.0 * a @ a, "ba_plus_cAA torch")


def test_batches_beyond_the_grid_limit_are_sliced(monkeypatch):
    monkeypatch.setattr(G, "_MAX_GRID_Y", 2)
    X = torch.randn(5, 20, 12).bfloat16().to(DEV)
    out = poisoned((5, 20, 20))
    G.XXT(X, out=out, backend="triton", config=SMALL)
    assert_rounded_exact(out, X.double().cpu() @ X.double().cpu().mT, "sliced batch")


def test_interpreter_probes_are_consistent():
    from anvil_fast import _triton as T

    if not interpreting():
        assert not T.dot_f32() and not T.round_fix()
        return
    # The probes ran real kernels; the work-arounds they switch on give exact results (above), and
    # without them the kernel is wrong exactly when the probe says the interpreter is broken.
    X = torch.randn(1, 32, 32).bfloat16()
    exact = X.double() @ X.double().mT
    out = torch.empty(1, 32, 32, dtype=torch.bfloat16)
    G._gram_kernel[(1, 1)](X, out, 32, 32, X.stride(0), X.stride(1), X.stride(2), out.stride(0), out.stride(1),
                           out.stride(2), BLOCK=32, BLOCK_K=32, DOT_F32=False, ROUND_FIX=True)
    native_err = ((out.double() - exact).norm() / exact.norm()).item()
    assert (native_err > 1e-2) == T.interpreter_bf16_dot_is_broken()


def test_empty_and_zero_sized():
    X = torch.zeros(0, 4, 3, dtype=torch.bfloat16, device=DEV)
    assert G.XXT(X, backend="triton").shape == (0, 4, 4)
    Z = torch.zeros(2, 4, 0, dtype=torch.bfloat16, device=DEV)
    assert torch.equal(G.XXT(Z, backend="triton"), torch.zeros(2, 4, 4, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("call,match", [
    (lambda: G.XXT(torch.randn(4, 4)), "bfloat16"),
    (lambda: G.XXT(torch.randn(4).bfloat16()), "at least 2 dims"),
    (lambda: G.XXT(torch.randn(4, 6).bfloat16().mT), "contiguous"),
    (lambda: G.XXT([[1.0]]), "torch.Tensor"),
    (lambda: G.XXT(torch.randn(4, 6).bfloat16(), out=torch.empty(6, 6, dtype=torch.bfloat16)), r"shape \(4, 4\)"),
    (lambda: G.XXT(torch.randn(4, 6).bfloat16(), out=torch.empty(4, 4)), "bfloat16"),
    (lambda: G.ba_plus_cAA(torch.randn(4, 5).bfloat16(), alpha=1.0, beta=1.0), "square"),
    (lambda: G.ba_plus_cAA(torch.randn(4, 4).bfloat16(), alpha=math.nan, beta=1.0), "finite"),
    (lambda: G.aX_plus_mm(torch.randn(3, 5).bfloat16(), torch.randn(3, 4).bfloat16(), torch.randn(3, 5).bfloat16(),
                          a=1.0), "do not chain"),
    (lambda: G.XXT(torch.randn(4, 6).bfloat16(), backend="cuda"), "backend"),
])
def test_bad_input_is_refused_clearly(call, match):
    with pytest.raises(G.GramInputError, match=match):
        call()


def test_out_overlapping_the_input_is_refused():
    A = torch.randn(2, 8, 8).bfloat16()
    with pytest.raises(G.GramInputError, match="overlap"):
        G.ba_plus_cAA(A, alpha=1.0, beta=1.0, out=A)


@pytest.mark.gpu
def test_gpu_production_tiles_and_sizes():
    for shape in [(3, 256, 768), (2, 768, 768), (2, 2816, 768), (5, 300, 200), (1, 1000, 130)]:
        X = torch.randn(shape, device="cuda").bfloat16()
        x64 = X.double()
        tall = shape[1] > shape[2]
        A = (G.XTX if tall else G.XXT)(X)
        ax = x64.abs()
        assert_rounded_exact(A, x64.mT @ x64 if tall else x64 @ x64.mT, f"gram {shape}",
                             scale=ax.mT @ ax if tall else ax @ ax.mT)
        assert torch.equal(A, A.mT)
        S = (A.float() / A.float().diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]).bfloat16()
        B = G.ba_plus_cAA(S, alpha=1.4, beta=-3.3)
        s64 = S.double()
        assert_rounded_exact(B, -3.3 * s64 + 1.4 * s64 @ s64, f"ba_plus_cAA {shape}",
                             scale=3.3 * s64.abs() + 1.4 * s64.abs() @ s64.abs())
        C = G.aX_plus_mm(X, X, B, a=2.8) if tall else G.aX_plus_mm(X, B, X, a=2.8)
        b64 = B.double()
        exact = 2.8 * x64 + (x64 @ b64 if tall else b64 @ x64)
        scale = 2.8 * x64.abs() + (x64.abs() @ b64.abs() if tall else b64.abs() @ x64.abs())
        assert_rounded_exact(C, exact, f"aX_plus_mm {shape}", scale=scale)


@pytest.mark.gpu
def test_gpu_64bit_offsets():
    # 2**31 + a bit elements in one batch: element offsets of the last matrices exceed int32.
    rows, cols = 1024, 1024
    batch = 2 ** 31 // (rows * cols) + 2
    X = torch.empty(batch, rows, cols, dtype=torch.bfloat16, device="cuda")
    X[-2:].normal_()
    X[:-2].zero_()
    out = torch.empty(batch, rows, rows, dtype=torch.bfloat16, device="cuda")
    out[-2:].fill_(float("nan"))
    G.XXT(X, out=out)
    last = X[-2:].double()
    assert_rounded_exact(out[-2:], last @ last.mT, "64-bit offsets", scale=last.abs() @ last.abs().mT)
    del X, out
    torch.cuda.empty_cache()
