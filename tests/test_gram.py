"""The symmetric Gram kernels (anvil_fast.kernels.gram): exactness against float64, exact symmetry, every size,
bad input.

Without CUDA the Triton kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), with the two interpreter work-arounds of anvil_fast/kernels/backend.py, whose probes are
tested here too. With CUDA the same tests run the compiled kernels (and the gpu-marked ones add the
native-only cases: 64-bit offsets, production tile sizes).

The exactness check: with fp32 accumulation of exact bf16 products, the kernels' result is the exact
product up to fp32 summation error (~1e-7 relative), then rounded once to bf16; so it must equal the
float64 product rounded to bf16 in all but a few entries that sit at a rounding boundary, and never be
more than one bf16 ulp away.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from anvil_fast.kernels import gram as G
from anvil_fast.kernels import backend as T
from anvil_fast.kernels.backend import interpreting, triton_available

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


def _all_ops_exact(X: torch.Tensor, cfg_sym, cfg_mm, what: str) -> None:
    """XXT, XTX, ba_plus_cAA, sym_aX_plus_mm and both orientations of aX_plus_mm of X against float64."""
    x64 = X.double().cpu()
    ax = x64.abs()
    for fn, exact, scale in ((G.XXT, x64 @ x64.mT, ax @ ax.mT), (G.XTX, x64.mT @ x64, ax.mT @ ax)):
        n = exact.shape[-1]
        A = poisoned((*X.shape[:-2], n, n))
        fn(X, out=A, backend="triton", config=cfg_sym)
        assert_rounded_exact(A, exact, f"{fn.__name__} {what}", scale=scale)
        assert torch.equal(A, A.mT), f"{fn.__name__} {what}: not exactly symmetric"
        S = (A.float() / A.float().diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]).bfloat16()
        s64 = S.double().cpu()
        B = poisoned(tuple(S.shape))
        G.ba_plus_cAA(S, alpha=1.4, beta=-3.3, out=B, backend="triton", config=cfg_sym)
        assert_rounded_exact(B, -3.3 * s64 + 1.4 * s64 @ s64, f"ba_plus_cAA {what}",
                             scale=3.3 * s64.abs() + 1.4 * s64.abs() @ s64.abs())
        assert torch.equal(B, B.mT), f"ba_plus_cAA {what}: not exactly symmetric"
        b64 = B.double().cpu()
        # sym_aX_plus_mm (the Gram side's Q A): the lower triangle of a*S + B@S, mirrored
        P = poisoned(tuple(S.shape))
        G.sym_aX_plus_mm(S, B, S, a=0.7, out=P, backend="triton", config=cfg_sym)
        lower = lambda m: torch.tril(m) + torch.tril(m, -1).mT  # noqa: E731
        assert_rounded_exact(P, lower(0.7 * s64 + b64 @ s64), f"sym_aX_plus_mm {what}",
                             scale=lower(0.7 * s64.abs() + b64.abs() @ s64.abs()))
        assert torch.equal(P, P.mT), f"sym_aX_plus_mm {what}: not exactly symmetric"
        tall = fn is G.XTX
        C = poisoned(tuple(X.shape))
        if tall:
            G.aX_plus_mm(X, X, B, a=2.8, out=C, backend="triton", config=cfg_mm)
        else:
            G.aX_plus_mm(X, B, X, a=2.8, out=C, backend="triton", config=cfg_mm)
        exact_c = 2.8 * x64 + (x64 @ b64 if tall else b64 @ x64)
        scale_c = 2.8 * ax + (ax @ b64.abs() if tall else b64.abs() @ ax)
        assert_rounded_exact(C, exact_c, f"aX_plus_mm {what} ({'tall' if tall else 'wide'})", scale=scale_c)


@pytest.mark.parametrize("per_sm", [0, 2], ids=["grid", "persistent"])
@pytest.mark.parametrize("kernel", ["v1", "ptr", "tma"])
@pytest.mark.parametrize("shape", [(2, 64, 96), (3, 70, 45)], ids=["even", "odd"])
def test_every_kernel_path_is_exact_and_symmetric(monkeypatch, shape, kernel, per_sm):
    # The three kernel paths (and the persistent grid, which walks several tiles per program) on an
    # exactly tiled shape (no masks; TMA descriptors where asked) and a ragged one (masked pointer
    # path; TMA falls back to it). Descriptor creation is counted to check which path ran.
    made = []
    real = G._descriptor
    monkeypatch.setattr(G, "_descriptor", lambda t, b: made.append(tuple(b)) or real(t, b))
    g = torch.Generator().manual_seed(sum(shape) + per_sm)
    X = torch.randn(shape, generator=g).bfloat16().to(DEV)
    cfg_sym = G.TileConfig(32, 32, 16, 4, 1, kernel=kernel, per_sm=per_sm)
    cfg_mm = G.TileConfig(32, 32, 16, 4, 1, 2, kernel=kernel, per_sm=per_sm)
    _all_ops_exact(X, cfg_sym, cfg_mm, f"{kernel} {shape}")
    even = all(d % 32 == 0 for d in shape[1:])
    assert bool(made) == (kernel == "tma" and even), made
    if made:  # XXT: X + out; XTX: X + out; ba_plus_cAA: 3 views of A + out (twice); sym_aX_plus_mm: L, R,
        # X + out (twice); aX_plus_mm: 4 (twice)
        assert len(made) == 2 + 2 + 2 * 4 + 2 * 4 + 2 * 4


def test_bad_kernel_name_is_refused():
    with pytest.raises(G.GramInputError, match="config.kernel"):
        G.XXT(torch.randn(4, 6, generator=torch.Generator().manual_seed(101)).bfloat16(), backend="triton" if DEV == "cuda" or interpreting() else "auto",
              config=G.TileConfig(32, 32, 32, 4, 1, kernel="cublas"))


def test_tuner_drops_failures_and_disagreements_and_keeps_the_fastest():
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    ref, slow, fast, ulp, wrong, boom = (T(32, 32, 32, 4, 1, kernel="v1"), T(64, 64, 64, 4, 3), T(64, 64, 64, 4, 3, kernel="tma"),
                                         T(128, 128, 64, 8, 4), T(128, 128, 64, 4, 3), T(64, 64, 128, 4, 3))
    truth = torch.randn(8, 8, generator=torch.Generator().manual_seed(102))
    out = torch.zeros(8, 8)
    last = []

    def launch(cfg):
        last.append(cfg)
        if cfg == boom:
            raise RuntimeError("out of shared memory")
        y = truth.clone()
        if cfg == wrong:
            y[3, 4] += 10.0 * truth.abs().max()
        if cfg == ulp:
            y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(float("inf")))
        out.copy_(y)

    times = {ref: 10.0, slow: 8.0, fast: 5.0, ulp: 6.0, wrong: 1.0}
    timer = lambda fn: (fn(), times[last[-1]])[1]  # noqa: E731
    best, rec = GT.tune("gram", GT.ProblemKey("XXT", 64, 64, 64, 1, None), launch, out, ref,
                        cands=[slow, fast, ulp, wrong, boom], timer=timer, sync=lambda: None)
    assert best == fast
    by = {cfg: (us, note) for cfg, us, note in rec["results"]}
    assert by[wrong][0] is None and by[wrong][1].startswith("REJECTED")
    assert by[boom][0] is None and "FAILED RuntimeError" in by[boom][1]
    assert by[ulp][0] == 6.0 and "1 entries differ" in by[ulp][1]
    assert by[slow] == (8.0, "bitwise") and by[ref][0] == 10.0


def test_tuner_caches_per_key_and_steps_aside_when_disabled(monkeypatch):
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    calls = []
    monkeypatch.setattr(GT, "tune", lambda kind, key, launch, out, default: calls.append(key) or
                        (T(64, 64, 64, 4, 3, kernel="tma"), {"kind": kind, "key": key, "results": [],
                                                            "chosen": default}))
    monkeypatch.setattr(GT, "_CHOICES", {})
    monkeypatch.setattr(GT, "RECORDS", [])
    default = T(32, 32, 32, 4, 1, kernel="v1")
    out = torch.zeros(2)
    big = GT.ProblemKey("XXT", 768, 768, 768, 8, None)
    for _ in range(2):
        assert GT.choose("gram", big, None, out, default).kernel == "tma"
    assert calls == [big] and len(GT.RECORDS) == 1
    # a few microseconds of work: not worth tuning
    assert GT.choose("gram", GT.ProblemKey("XXT", 96, 96, 96, 4, None), None, out, default) == default and calls == [big]
    monkeypatch.setenv("ANVIL_FAST_TUNE", "0")
    assert GT.choose("gram", GT.ProblemKey("XXT", 768, 768, 768, 16, None), None, out, default) == default and calls == [big]


def test_tuner_candidates_fit_the_problem(monkeypatch):
    from anvil_fast.kernels import gram_tune as GT

    big = GT.candidates("gram", GT.ProblemKey("XXT", 768, 768, 768, 64, 0), 132)
    assert any(c.kernel == "tma" and c.per_sm for c in big) and all(c.kernel != "cublas" for c in big)
    # 300 is not a multiple of any tile: no TMA; 4 matrices of 3 x 3 tiles: no persistent grid
    odd = GT.candidates("gram", GT.ProblemKey("XXT", 300, 300, 200, 4, 0), 132)
    assert odd and all(c.kernel == "ptr" and not c.per_sm for c in odd)
    tiny = GT.candidates("ba_plus_cAA", GT.ProblemKey("ba_plus_cAA", 17, 17, 17, 3, 0), 132)
    assert tiny and all(c.BLOCK_M == 64 for c in tiny)
    mm = GT.candidates("mm_add", GT.ProblemKey("mm_add", 2816, 768, 768, 24, 0), 132)
    assert all(c.kernel != "cublas" for c in mm) and any(c.kernel == "tma" for c in mm)  # bit-reproducible default
    monkeypatch.setenv("ANVIL_FAST_TUNE_CUBLAS", "1")
    assert GT.candidates("mm_add", GT.ProblemKey("mm_add", 2816, 768, 768, 24, 0), 132)[-1].kernel == "cublas"
    assert not [c for c in GT.candidates("ba_plus_cAA", GT.ProblemKey("ba_plus_cAA", 768, 768, 768, 64, 0), 132)
                if c.BLOCK_M == 128 and c.num_warps == 4]


def test_torch_fallback_has_the_kernel_semantics():
    X = torch.randn(2, 50, 30, generator=torch.Generator().manual_seed(103)).bfloat16()
    A = G.XXT(X, backend="torch")
    assert_rounded_exact(A, X.double() @ X.double().mT, "XXT torch")
    assert torch.equal(A, A.mT)
    B = G.ba_plus_cAA(A / 30, alpha=2.0, beta=-1.0, backend="torch")
    a = (A / 30).double()
    assert_rounded_exact(B, -a + 2.0 * a @ a, "ba_plus_cAA torch")


@pytest.mark.parametrize("kernel", ["v1", "ptr"])
def test_batches_beyond_the_launch_limit_are_sliced(monkeypatch, kernel):
    # v1 slices the batch axis of its 2-D grid; the current kernels slice so the flattened
    # (matrix, tile) index stays below _MAX_TILES_PER_LAUNCH. Count the launches to see it happen.
    from anvil_fast.kernels import gram_kernels as K

    monkeypatch.setattr(T, "MAX_GRID_Y", 2)
    monkeypatch.setattr(G, "_MAX_TILES_PER_LAUNCH", 2)  # 32-tiles of a 20-wide Gram: 1 tile per matrix
    name = "_gram_kernel_v1" if kernel == "v1" else "_gram_kernel"
    real, launches = getattr(K, name), []

    class Count:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(K, name, Count())
    X = torch.randn(5, 20, 12, generator=torch.Generator().manual_seed(104)).bfloat16().to(DEV)
    out = poisoned((5, 20, 20))
    cfg = G.TileConfig(32, 32, 16, 4, 1, kernel=kernel)
    G.XXT(X, out=out, backend="triton", config=cfg)
    assert len(launches) == 3, launches
    assert_rounded_exact(out, X.double().cpu() @ X.double().cpu().mT, "sliced batch")


def test_the_v1_loop_and_launch_are_written_once():
    # The lower-tile kernels run one K loop (_lower_tile_product_v1), every v1-style kernel launches
    # through _launch_v1 (its batch slicing), and the grid limit is defined in backend alone.
    import ast
    from pathlib import Path

    src = Path(G.__file__).parent
    kernels = {f.name: f for f in ast.parse((src / "gram_kernels.py").read_text()).body
               if isinstance(f, ast.FunctionDef)}
    for name in ("_gram_kernel_v1", "_ba_plus_caa_kernel_v1", "_sym_mm_add_kernel_v1"):
        body = list(ast.walk(kernels[name]))
        assert not any(isinstance(n, ast.For) for n in body), name
        assert "_lower_tile_product_v1" in {n.func.id for n in body if isinstance(n, ast.Call)
                                            and isinstance(n.func, ast.Name)}, name
    gram = list(ast.walk(ast.parse((src / "gram.py").read_text())))
    launched = {n.args[0].attr for n in gram if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id == "_launch_v1"}
    assert launched == {"_gram_kernel_v1", "_ba_plus_caa_kernel_v1", "_mm_add_kernel_v1", "_sym_mm_add_kernel_v1"}
    assert not launched & {n.value.attr for n in gram if isinstance(n, ast.Subscript)
                           and isinstance(n.value, ast.Attribute)}
    limits = sorted(p.name for p in src.parent.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
                    if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and "GRID_Y" in t.id for t in n.targets))
    assert limits == ["backend.py"]
    assert "triton" not in (src.parent / "core" / "gram_side.py").read_text()  # the Gram side's product is a Gram kernel


def test_interpreter_probes_are_consistent():
    from anvil_fast.kernels import backend as T
    from anvil_fast.kernels import gram_kernels as K

    if not interpreting():
        assert not T.dot_f32() and not T.round_fix()
        return
    # The probes ran real kernels; the work-arounds they switch on give exact results (above), and
    # without them the kernel is wrong exactly when the probe says the interpreter is broken.
    X = torch.randn(1, 32, 32, generator=torch.Generator().manual_seed(105)).bfloat16()
    exact = X.double() @ X.double().mT
    out = torch.empty(1, 32, 32, dtype=torch.bfloat16)
    K._gram_kernel[(1,)](X, out, 32, 32, X.stride(0), X.stride(1), X.stride(2), out.stride(0), out.stride(1),
                         out.stride(2), 1, 1, BLOCK=32, BLOCK_K=32, TRANS=False, EVEN=True, TMA=False, DOT_F32=False,
                         ROUND_FIX=True)
    native_err = ((out.double() - exact).norm() / exact.norm()).item()
    assert (native_err > 1e-2) == T.interpreter_bf16_dot_is_broken()


def test_empty_and_zero_sized():
    X = torch.zeros(0, 4, 3, dtype=torch.bfloat16, device=DEV)
    assert G.XXT(X, backend="triton").shape == (0, 4, 4)
    Z = torch.zeros(2, 4, 0, dtype=torch.bfloat16, device=DEV)
    assert torch.equal(G.XXT(Z, backend="triton"), torch.zeros(2, 4, 4, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("call,match", [
    (lambda: G.XXT(torch.randn(4, 4, generator=torch.Generator().manual_seed(106))), "bfloat16"),
    (lambda: G.XXT(torch.randn(4, generator=torch.Generator().manual_seed(107)).bfloat16()), "at least 2 dims"),
    (lambda: G.XXT(torch.randn(4, 6, generator=torch.Generator().manual_seed(108)).bfloat16().mT), "contiguous"),
    (lambda: G.XXT([[1.0]]), "torch.Tensor"),
    (lambda: G.XXT(torch.randn(4, 6, generator=torch.Generator().manual_seed(109)).bfloat16(), out=torch.empty(6, 6, dtype=torch.bfloat16)), r"shape \(4, 4\)"),
    (lambda: G.XXT(torch.randn(4, 6, generator=torch.Generator().manual_seed(110)).bfloat16(), out=torch.empty(4, 4)), "bfloat16"),
    (lambda: G.ba_plus_cAA(torch.randn(4, 5, generator=torch.Generator().manual_seed(111)).bfloat16(), alpha=1.0, beta=1.0), "square"),
    (lambda: G.ba_plus_cAA(torch.randn(4, 4, generator=torch.Generator().manual_seed(112)).bfloat16(), alpha=math.nan, beta=1.0), "finite"),
    (lambda: G.aX_plus_mm(torch.randn(3, 5, generator=torch.Generator().manual_seed(113)).bfloat16(), torch.randn(3, 4, generator=torch.Generator().manual_seed(114)).bfloat16(), torch.randn(3, 5, generator=torch.Generator().manual_seed(115)).bfloat16(),
                          a=1.0), "do not chain"),
    (lambda: G.XXT(torch.randn(4, 6, generator=torch.Generator().manual_seed(116)).bfloat16(), backend="cuda"), "backend"),
])
def test_bad_input_is_refused_clearly(call, match):
    with pytest.raises(G.GramInputError, match=match):
        call()


def test_out_overlapping_the_input_is_refused():
    A = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(117)).bfloat16()
    with pytest.raises(G.GramInputError, match="overlap"):
        G.ba_plus_cAA(A, alpha=1.0, beta=1.0, out=A)


@pytest.mark.gpu
def test_gpu_production_tiles_and_sizes():
    for shape in [(3, 256, 768), (2, 768, 768), (2, 2816, 768), (5, 300, 200), (1, 1000, 130)]:
        X = torch.randn(shape, generator=torch.Generator().manual_seed(118)).to("cuda").bfloat16()
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
# short384: the Gram side's square products at 384 (the small GPT's banks, where training on the GPU had
# updates refused with the Gram side from that short side)
@pytest.mark.parametrize("shape", [(2, 256, 768), (3, 300, 200), (2, 384, 1536)], ids=["even", "odd", "short384"])
def test_gpu_every_tuner_candidate_is_exact(shape):
    # The tuner may pick any candidate for some shape: each one (all tile sizes, warps, stages, TMA,
    # persistent grids, cuBLAS for aX_plus_mm) must be exact and symmetric, here compiled for the GPU.
    from anvil_fast.kernels import gram_tune as GT

    X = torch.randn(shape, generator=torch.Generator().manual_seed(119)).to("cuda").bfloat16()
    # A ragged shape never gets TMA candidates (gram_tune.candidates): there, the pointer ones.
    usable = (lambda c: True) if shape[1] % 128 == 0 else (lambda c: c.kernel != "tma")
    default_mm = G.TileConfig(64, 128, 64, 4, 4, kernel="v1")
    for cfg in filter(usable, GT.SYM_CANDIDATES):
        _all_ops_exact(X, cfg, default_mm, f"{cfg.describe()} {shape}")
    default_sym = G.TileConfig(64, 64, 128, 4, 3, kernel="v1")
    for cfg in filter(usable, GT.MM_CANDIDATES):
        _all_ops_exact(X, default_sym, cfg, f"{cfg.describe()} {shape}")


@pytest.mark.gpu
def test_gpu_tuner_records_and_reuses_its_choice():
    from anvil_fast.kernels import gram_tune as GT

    GT.reset()
    X = torch.randn(8, 768, 768, generator=torch.Generator().manual_seed(120)).to("cuda").bfloat16()
    A = G.XXT(X)
    x64 = X.double()
    assert_rounded_exact(A, x64 @ x64.mT, "tuned XXT", scale=x64.abs() @ x64.abs().mT)
    assert torch.equal(A, A.mT)
    assert len(GT.RECORDS) == 1
    rec = GT.RECORDS[0]
    timed = [(cfg, us) for cfg, us, _ in rec["results"] if us is not None]
    assert rec["chosen"] in [cfg for cfg, _ in timed]
    assert any(cfg.kernel != "v1" for cfg, _ in timed), GT.report_lines()
    G.XXT(X)
    assert len(GT.RECORDS) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["v1", "ptr", "tma"])
def test_gpu_64bit_offsets(kernel):
    # 2**31 + a bit elements in one batch: element offsets of the last matrices exceed int32.
    rows, cols = 1024, 1024
    batch = 2 ** 31 // (rows * cols) + 2
    X = torch.empty(batch, rows, cols, dtype=torch.bfloat16, device="cuda")
    X[-2:].normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    X[:-2].zero_()
    out = torch.empty(batch, rows, rows, dtype=torch.bfloat16, device="cuda")
    out[-2:].fill_(float("nan"))
    G.XXT(X, out=out, config=G.TileConfig(128, 128, 64, 8, 4, kernel=kernel))
    last = X[-2:].double()
    assert_rounded_exact(out[-2:], last @ last.mT, "64-bit offsets", scale=last.abs() @ last.abs().mT)
    del X, out
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ shipped tuning decisions
def _record(GT, cfg, note="bitwise", source="tuned", key=None):
    key = key or GT.ProblemKey("XXT", 768, 768, 256, 6, 0)
    v1 = G.TileConfig(64, 64, 128, 4, 3, kernel="v1")
    return {"kind": "gram", "key": key, "chosen": cfg, "source": source,
            "results": [(v1, 20.0, "bitwise"), (cfg, 10.0, note)]}


def test_a_shipped_decision_is_taken_only_for_its_device_triton_and_kernels(tmp_path, monkeypatch):
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    cfg = T(128, 128, 64, 8, 4, kernel="tma")
    key = GT.ProblemKey("XXT", 768, 768, 256, 6, 0)
    entries = GT.table_entries([_record(GT, cfg, key=key)], "NVIDIA H200")
    assert len(entries) == 1 and entries[0]["us"] == 10.0 and entries[0]["v1_us"] == 20.0
    path = tmp_path / "gram_tuned.json"
    path.write_text(json.dumps({"generated_by": "a test", "entries": entries}))
    assert GT.table_decision(key, "NVIDIA H200", path) == (cfg, "NVIDIA H200")
    # the index is not part of it
    assert GT.table_decision(key._replace(device=3), "NVIDIA H200", path) == (cfg, "NVIDIA H200")
    assert GT.table_decision(key, "NVIDIA H100 80GB HBM3", path) is None
    assert GT.table_decision(key._replace(batch=12), "NVIDIA H200", path) is None
    assert GT.table_decision(key, None, path) is None
    for field, other in (("triton", "0.0.1"), ("kernels", "0" * 16)):
        stale = tmp_path / f"stale_{field}.json"
        stale.write_text(json.dumps({"entries": [dict(entries[0], **{field: other})]}))
        assert GT.table_decision(key, "NVIDIA H200", stale) is None


def test_a_device_without_decisions_takes_those_of_its_architecture(tmp_path, monkeypatch):
    """A decision made on one device serves another of the same architecture (compute capability, SM
    count, shared memory per SM) where that one has none of its own; its own always win, another
    architecture's never serve, and an entry that names no architecture serves its own device alone."""
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    hopper, ampere = "sm_90, 132 SMs, 233472 B shared per SM", "sm_80, 108 SMs, 167936 B shared per SM"
    key = GT.ProblemKey("XXT", 768, 768, 256, 6, 0)
    other = key._replace(op="XTX")
    h100, h100b, h200 = T(128, 128, 64, 8, 4, kernel="tma"), T(64, 64, 128, 4, 3, kernel="ptr"), \
        T(128, 128, 64, 4, 3, kernel="tma")
    entries = (GT.table_entries([_record(GT, h100, key=key), _record(GT, h100, key=other)], "NVIDIA H100 80GB HBM3",
                                hopper)
               + GT.table_entries([_record(GT, h100b, key=key)], "NVIDIA H800", hopper)
               + GT.table_entries([_record(GT, h200, key=key)], "NVIDIA H200"))  # (no architecture named)
    assert [e.get("arch") for e in entries] == [hopper, hopper, hopper, None]
    path = tmp_path / "gram_tuned.json"
    path.write_text(json.dumps({"generated_by": "a test", "entries": entries[::-1]}))
    # its own decision first, with or without an architecture
    assert GT.table_decision(key, "NVIDIA H200", path, arch=hopper) == (h200, "NVIDIA H200")
    assert GT.table_decision(key, "NVIDIA H200", path) == (h200, "NVIDIA H200")
    # none of its own: the first device name of its architecture, in sorted order
    assert GT.table_decision(other, "NVIDIA H200", path, arch=hopper) == (h100, "NVIDIA H100 80GB HBM3")
    assert GT.table_decision(key, "NVIDIA GH200", path, arch=hopper) == (h100, "NVIDIA H100 80GB HBM3")
    # another architecture, no architecture, or an entry that names none: tuned here
    assert GT.table_decision(other, "NVIDIA A100", path, arch=ampere) is None
    assert GT.table_decision(other, "NVIDIA H200", path) is None
    assert GT.table_decision(other, "NVIDIA H200", path, arch=hopper.replace("132", "114")) is None
    for field, stale in (("triton", "0.0.1"), ("kernels", "0" * 16)):
        old = tmp_path / f"old_{field}.json"
        old.write_text(json.dumps({"entries": [dict(entries[1], **{field: stale})]}))
        assert GT.table_decision(other, "NVIDIA H200", old, arch=hopper) is None


def test_device_arch_names_what_a_decision_depends_on():
    from types import SimpleNamespace

    from anvil_fast.kernels import gram_tune as GT

    props = SimpleNamespace(major=9, minor=0, multi_processor_count=132, shared_memory_per_multiprocessor=233472)
    assert GT.device_arch(props) == "sm_90, 132 SMs, 233472 B shared per SM"
    assert GT.device_arch(SimpleNamespace(**dict(vars(props), multi_processor_count=114))) != GT.device_arch(props)
    assert GT.device_arch(SimpleNamespace(**dict(vars(props), minor=9))) != GT.device_arch(props)


def test_a_decision_of_a_sibling_device_is_reported_as_such(monkeypatch):
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    shipped = T(64, 64, 128, 4, 3, kernel="tma")
    monkeypatch.setattr(GT, "_device_name", lambda out: "NVIDIA H200")
    monkeypatch.setattr(GT, "_device_arch", lambda out: "sm_90")
    monkeypatch.setattr(GT, "table_decision", lambda key, name, path=None, arch=None:
                        (shipped, "NVIDIA H100 80GB HBM3") if arch == "sm_90" else None)
    monkeypatch.setattr(GT, "tune", lambda *a, **k: pytest.fail("a shipped decision was there"))
    monkeypatch.setattr(GT, "_CHOICES", {})
    monkeypatch.setattr(GT, "RECORDS", [])
    big = GT.ProblemKey("XXT", 768, 768, 768, 8, None)
    assert GT.choose("gram", big, None, torch.zeros(2), T(32, 32, 32, 4, 1, kernel="v1")) == shipped
    assert GT.RECORDS[-1]["made_on"] == "NVIDIA H100 80GB HBM3"
    assert "made on NVIDIA H100 80GB HBM3: the same architecture" in GT.report_lines()[-1]


def test_only_tuned_bit_identical_triton_choices_are_shipped():
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    tma = T(128, 128, 64, 8, 4, kernel="tma")
    recs = [_record(GT, tma), _record(GT, tma, note="3 entries differ, max |diff| 0.01"),
            _record(GT, tma, source="shipped"), _record(GT, T(0, 0, 0, 0, 0, kernel="cublas"))]
    assert [e["config"] for e in GT.table_entries(recs, "NVIDIA H200")] == [list(tma)]


def test_choose_takes_a_shipped_decision_without_tuning_and_fresh_tunes(monkeypatch):
    from anvil_fast.kernels import gram_tune as GT

    T = G.TileConfig
    shipped, tuned = T(64, 64, 128, 4, 3, kernel="tma"), T(128, 128, 64, 8, 4, kernel="ptr")
    calls = []
    monkeypatch.setattr(GT, "tune", lambda kind, key, launch, out, default: calls.append(key) or
                        (tuned, {"kind": kind, "key": key, "results": [], "chosen": tuned}))
    monkeypatch.setattr(GT, "_device_name", lambda out: "NVIDIA H200")
    monkeypatch.setattr(GT, "_device_arch", lambda out: "sm_90, 132 SMs, 233472 B shared per SM")
    monkeypatch.setattr(GT, "table_decision", lambda key, name, path=None, arch=None:
                        (shipped, name) if name == "NVIDIA H200" else None)
    monkeypatch.setattr(GT, "_CHOICES", {})
    monkeypatch.setattr(GT, "RECORDS", [])
    default = T(32, 32, 32, 4, 1, kernel="v1")
    big = GT.ProblemKey("XXT", 768, 768, 768, 8, None)
    assert GT.choose("gram", big, None, torch.zeros(2), default) == shipped and calls == []
    assert GT.RECORDS[-1]["source"] == "shipped" and "(shipped decision)" in GT.report_lines()[-1]
    monkeypatch.setattr(GT, "_CHOICES", {})
    monkeypatch.setenv("ANVIL_FAST_TUNE", "fresh")
    assert GT.choose("gram", big, None, torch.zeros(2), default) == tuned and calls == [big]
    assert GT.RECORDS[-1]["source"] == "tuned"


def test_the_shipped_decisions_are_for_these_kernels():
    """Every entry of the shipped file names a Triton candidate the tuner offers (never cuBLAS) and the
    kernels' current digest: an edit of gram.py or gram_kernels.py makes the file stale, and then a
    fresh process tunes every key again (slow, correct); run tools/gram_tuned_table.py on the device
    again after such an edit."""
    from anvil_fast.kernels import gram_tune as GT

    if not GT.TUNED_FILE.is_file():
        pytest.skip("no shipped decisions (tools/gram_tuned_table.py writes them on a GPU)")
    data = json.loads(GT.TUNED_FILE.read_text())
    assert data["generated_by"].startswith("tools/gram_tuned_table.py")
    offered = {tuple(c) for c in GT.SYM_CANDIDATES + GT.MM_CANDIDATES if c.kernel != "cublas"}
    for e in data["entries"]:
        cfg = G.TileConfig(*e["config"])
        assert cfg.kernel != "cublas" and (tuple(cfg) in offered or cfg.kernel == "v1"), e
        assert e.get("arch"), f"{e}: no architecture (a device without decisions cannot take this one)"
        assert e["kernels"] == GT.kernels_digest(), (
            f"{GT.TUNED_FILE.name} was made for other kernels ({e['kernels']}, now {GT.kernels_digest()}): "
            "run tools/gram_tuned_table.py on the GPU it names")


@pytest.mark.parametrize("text", ["{not json", json.dumps({"rows": []}), json.dumps({"entries": [{"config": [1]}]}),
                                  json.dumps({"entries": [{"device": "d", "triton": "t", "kernels": "k", "op": "XXT",
                                                           "m": 1, "n": 1, "k": 1, "batch": 1,
                                                           "config": [0, 0, 0, 0, 0, 8, "cublas", 0]}]})])
def test_a_broken_decisions_file_warns_and_every_key_is_tuned(tmp_path, text):
    from anvil_fast.kernels import gram_tune as GT

    path = tmp_path / "gram_tuned.json"
    path.write_text(text)
    with pytest.warns(RuntimeWarning, match="not a table of tuning decisions"):
        assert GT.table_decision(GT.ProblemKey("XXT", 768, 768, 256, 6, 0), "NVIDIA H200", path) is None


@pytest.mark.parametrize("kernel,per_sm", [("ptr", 0), ("ptr", 2), ("tma", 0), ("tma", 2)])
@pytest.mark.parametrize("shape", [(3, 64, 64), (2, 70, 70)], ids=["even", "odd"])
def test_sym_aX_plus_mm_paths_give_the_v1_bits(shape, kernel, per_sm):
    # The tuned kernel's pointer and TMA paths, one tile per program or a persistent walk, sum the
    # same products in the same K order as the v1 kernel: with the same tiles, the same bits (the
    # tuner relies on it to choose among them by time alone).
    g = torch.Generator().manual_seed(sum(shape) + per_sm)
    S = torch.randn(shape, generator=g)
    S = ((S + S.mT) / 8).bfloat16().to(DEV)
    B = (S.float() @ S.float() * 0.3).bfloat16()
    v1 = G.sym_aX_plus_mm(S, B, S, a=0.7, backend="triton", config=G.TileConfig(32, 32, 16, 4, 1, kernel="v1"))
    got = G.sym_aX_plus_mm(S, B, S, a=0.7, backend="triton",
                           config=G.TileConfig(32, 32, 16, 4, 1, kernel=kernel, per_sm=per_sm))
    assert torch.equal(got.view(torch.int16), v1.view(torch.int16))


def test_the_tuned_table_tool_keeps_other_devices_and_drops_stale_kernels():
    """tools/gram_tuned_table.py's merge: this device's run replaces its own entries, another device's
    stay when made for the current kernels, and an entry for other kernel sources is dropped (it can
    never match again, and the shipped-decisions test would reject the file)."""
    from tools.gram_tuned_table import merged_entries

    def entry(device, kernels, op="XXT", m=768):
        return {"device": device, "triton": "3.6.0", "kernels": kernels, "op": op, "m": m, "n": m, "k": 768,
                "batch": 6, "config": [128, 128, 64, 4, 3, 8, "ptr", 0]}

    old = [entry("H200", "old"), entry("H200", "new", m=256), entry("H100", "new"), entry("H100", "old"),
           entry("A100", "new", op="mm_add")]
    mine = [entry("H100", "new", m=384)]
    entries, kept, dropped = merged_entries(old, mine, "new")
    assert (kept, dropped) == (2, 2)
    assert sorted((e["device"], e["kernels"], e["op"], e["m"]) for e in entries) == [
        ("A100", "new", "mm_add", 768), ("H100", "new", "XXT", 384), ("H200", "new", "XXT", 256)]
    assert [e["device"] for e in entries] == ["A100", "H100", "H200"]
