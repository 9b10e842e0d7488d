"""anvil_ref.cascade: Frobenius normalization, the quintic maps, the composite and the cascade."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

import anvil_ref as A
from anvil_ref.cascade import cascade, composite, frobenius_normalize, gram, is_tall, quintic, quintic_map
from tests.helpers import exact_cascade_spectrum, matrix_with_spectrum

U64 = np.finfo(np.float64).eps / 2  # unit roundoff of binary64


def lipschitz_of_composite(maps) -> float:
    """max |F'| over [0, 1/margin] on a fine grid (for ANVIL_MAPS it is F'(0) = prod a_k ~ 643)."""
    s = np.linspace(0.0, 1.0 / A.FROBENIUS_MARGIN, 100_001)
    return float(np.max(np.abs(np.gradient(composite(s, maps=maps), s))))


def reference_tolerance(n: int, maps=A.ANVIL_MAPS) -> float:
    """Bound on ||cascade(X) - U F(S/d) V^T||_2 from float64 rounding: each map does 3 products of
    inner dimension <= n, each entry with relative error <= n*u (Higham's gamma_n); 3 per map, K maps,
    plus forming X itself, and the chain amplifies input errors by at most max|F'|."""
    k = len(maps)
    return (3 * k + 1) * n * U64 * lipschitz_of_composite(maps) * 4


# ------------------------------------------------------------------ hand-derived cases
def test_quintic_and_composite_by_hand():
    assert quintic(0.5, (1.0, 2.0, 4.0)) == 0.5 + 2 * 0.125 + 4 * 0.03125
    # composite applies the maps in order: p2(p1(s))
    p1, p2 = (2.0, 0.0, 0.0), (1.0, 1.0, 0.0)
    assert composite(0.25, maps=[p1, p2]) == 0.5 + 0.125
    assert composite(0.25, maps=[p2, p1]) == 2 * (0.25 + 0.25 ** 3)


def test_cascade_one_by_one_matrix_by_hand():
    # X = [[3]]: ||X||_F = 3, d = 1.05*3 + 1e-6, one cubic map s -> 1.5 s - 0.5 s^3.
    out = cascade(np.array([[3.0]]), maps=[(1.5, -0.5, 0.0)])
    s = 3.0 / (1.05 * 3.0 + 1e-6)
    assert out.shape == (1, 1)
    assert out[0, 0] == pytest.approx(1.5 * s - 0.5 * s ** 3, rel=1e-15)


def test_frobenius_normalize_by_hand():
    x = np.array([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])  # ||X||_F = 5
    np.testing.assert_allclose(frobenius_normalize(x), x / (1.05 * 5 + 1e-6), rtol=1e-15)
    np.testing.assert_allclose(frobenius_normalize(x, margin=2.0, eps=0.0), x / 10.0, rtol=1e-15)


def test_gram_orientation():
    x = np.arange(6.0).reshape(3, 2)  # tall: X^T X is 2 x 2
    assert is_tall(x.shape) and not is_tall(x.T.shape) and not is_tall((4, 4))
    np.testing.assert_array_equal(gram(x), x.T @ x)
    np.testing.assert_array_equal(gram(x.T), x.T @ x)  # wide: X X^T of the 2 x 3 matrix
    sq = np.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(gram(sq), sq @ sq.T)  # square takes the wide branch (seed: rows > cols)


def test_quintic_map_sides():
    """Tall right-multiplies X (B acts on the columns' space), wide left-multiplies."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3)) * 0.1
    a, b, c = 1.0, 2.0, 3.0
    g = x.T @ x
    np.testing.assert_allclose(quintic_map(x, (a, b, c)), a * x + x @ (b * g + c * g @ g), rtol=1e-14)
    y = x.T
    h = y @ y.T
    np.testing.assert_allclose(quintic_map(y, (a, b, c)), a * y + (b * h + c * h @ h) @ y, rtol=1e-14)


def test_zero_matrix_is_finite_zero():
    out = cascade(np.zeros((2, 4, 3)))
    assert np.all(out == 0.0)


# ------------------------------------------------------------------ against mpmath at 50 digits
CASES = [
    ("tall", (1, 48, 12), None),
    ("wide", (1, 12, 48), None),
    ("square", (1, 24, 24), None),
    ("batched", (3, 40, 20), None),
    ("rank-deficient", (2, 30, 20), 7),
]


@pytest.mark.parametrize("name,shape,rank", CASES, ids=[c[0] for c in CASES])
def test_cascade_equals_exact_composite_on_singular_values(name, shape, rank):
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # stable across runs, unlike hash()
    batch, m, n = shape
    r = rank or min(m, n)
    xs, exps = [], []
    for _ in range(batch):
        s = np.exp(rng.uniform(math.log(1e-3), 0.0, r))
        x, u, s, v = matrix_with_spectrum(rng, m, n, s)
        f = exact_cascade_spectrum(s, A.ANVIL_MAPS, margin=A.FROBENIUS_MARGIN, eps=A.FROBENIUS_EPS)
        xs.append(x)
        exps.append((u * f) @ v.T)
    out = cascade(np.stack(xs))
    tol = reference_tolerance(max(m, n))
    for i in range(batch):
        err = np.linalg.norm(out[i] - exps[i], 2)
        assert err <= tol, f"{name}[{i}]: ||err||_2 = {err:.3e} > {tol:.3e}"
    if rank:
        # the null space stays null: singular values beyond the rank stay ~0 (F(0) = 0)
        sv = np.linalg.svd(out, compute_uv=False)
        assert np.all(sv[:, rank:] < tol) and np.all(sv[:, rank - 1] > 0.1)


def test_cascade_catches_wrong_margin():
    """The exact-composite comparison is sharp enough to see a 0.1% change of the margin."""
    rng = np.random.default_rng(7)
    x, u, s, v = matrix_with_spectrum(rng, 20, 10, np.linspace(1.0, 0.9, 10))
    exp = (u * exact_cascade_spectrum(s, A.ANVIL_MAPS, margin=1.05, eps=1e-6)) @ v.T
    err = np.linalg.norm(cascade(x, margin=1.05 * 1.001) - exp, 2)
    assert err > 100 * reference_tolerance(20)


def test_torch_in_torch_out():
    x = torch.randn(2, 6, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(101))
    out = cascade(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.shape == x.shape
    np.testing.assert_allclose(out.numpy(), cascade(x.double().numpy()), rtol=0, atol=0)


def test_named_map_set_equals_constant():
    x = np.random.default_rng(3).standard_normal((8, 5))
    np.testing.assert_array_equal(cascade(x, maps="anvil"), cascade(x, maps=A.ANVIL_MAPS))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad,match", [
    (np.ones(4), "at least 2 dimensions"),
    (np.array([[1.0, np.nan]]), "non-finite"),
    (np.array([[np.inf, 1.0]]), "non-finite"),
    (np.zeros((3, 0)), "at least one row"),
    ("abc", "expected a real array"),
])
def test_cascade_bad_input(bad, match):
    with pytest.raises(A.ReferenceInputError, match=match):
        cascade(bad)


@pytest.mark.parametrize("maps,match", [
    ([], "at least one"),
    ([(1.0, 2.0)], "triple"),
    ([(1.0, float("nan"), 0.0)], "finite"),
    ("no_such_set", "unknown map set"),
])
def test_cascade_bad_maps(maps, match):
    with pytest.raises(A.ReferenceInputError, match=match):
        cascade(np.eye(3), maps=maps)


def test_cascade_bad_normalization():
    with pytest.raises(A.ReferenceInputError, match="divide by zero"):
        cascade(np.eye(2), margin=0.0, eps=0.0)


# =================================================================================================
# anvil_fast vs anvil_ref (owner: the anvil_fast helper). The fast cascade (anvil_fast/core/cascade.py)
# in both configurations, tall / wide / square, within anvil_fast/core/tolerances.py of the reference run with
# the configuration's margin. Near-rank-1 behaviour: tests/test_near_rank1.py; the Triton kernels:
# tests/test_gram.py; full harness: anvil_fast.studies.difftest.

@pytest.mark.parametrize("family", ["gaussian", "well_conditioned"])
@pytest.mark.parametrize("config", ["safe", "faithful"])
@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (2, 32, 32)])
def test_fast_cascade_matches_reference(config, shape, family):
    from anvil_fast.studies import difftest as D
    from anvil_fast.core.tolerances import check_row

    row, _ = D.cascade_row(shape, family, config, compile=False)
    assert check_row(row, same_backend=True), D.format_table([row])


def test_eager_bf16_cascade_with_a_cubic_map():
    """A map with c = 0 (a cubic) must not go through a bf16 baddbmm with alpha = 0, which torch's
    CPU build gets wrong for matrices 32 or more wide."""
    from anvil_fast.core.eager import eager_bf16_cascade

    x = torch.randn(2, 64, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(102))
    maps = [(1.5, -0.5, 0.0)] * 8  # Newton-Schulz cubic
    out = eager_bf16_cascade(x, maps=maps).double()
    ref = torch.as_tensor(cascade(x, maps=maps))
    assert torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.05  # bf16 rounding over 8 maps; the bug gives O(1)


# ------------------------------------------------------------------ a bank run as parts on streams
def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.contiguous().view(torch.int16)


@pytest.mark.parametrize("config,maps", [("safe", None), ("gram_side", None), ("faithful", None),
                                         ("safe", "polar_express_nanogpt5")])
def test_fast_cascade_on_streams_is_the_whole_bank_bit_for_bit(triton_dev, config, maps):
    """The bank run as parts of consecutive matrices (each on its own CUDA stream on a GPU, one after another
    on the CPU) writes the one-stream result bit for bit: part counts that divide the chunk, that do not,
    and one past it; tall, wide and square banks (the tall one of aspect 3 runs the Gram side under
    GRAM_SIDE). A part that read another's rows or scale changes bits; five maps leave the result in the
    other buffer than six, so a split that returned the wrong one of the whole's buffers is seen too."""
    from anvil_fast.core.cascade import fast_cascade
    from anvil_ref.constants import ANVIL_MAPS

    maps = ANVIL_MAPS if maps is None else maps

    big = triton_dev == "cuda"
    shapes = [(5, 1152, 384), (5, 256, 768), (4, 256, 256)] if big else [(5, 96, 32), (5, 24, 40), (4, 32, 32)]
    backend = "auto" if big else "triton"
    for shape in shapes:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(31)).to(triton_dev)
        x[1] *= 1e-3  # matrices of other scales: a part that normalized with another's scale is seen
        whole = fast_cascade(x, config=config, maps=maps, backend=backend)
        assert torch.isfinite(whole.float()).all()
        for n in (2, 3, 6):
            y = fast_cascade(x, config=config, maps=maps, backend=backend, streams=n)
            assert torch.equal(_bits(y), _bits(whole)), (config, shape, n)


def test_workspace_parts_are_views_of_consecutive_matrices():
    from anvil_fast.core.cascade import CascadeWorkspace

    ws = CascadeWorkspace.for_shape((5, 8, 12), "cpu")
    parts = ws.parts(2)
    assert [p.X.shape[0] for p in parts] == [3, 2]
    assert ws.parts(2) is parts  # made once
    for p, lo in zip(parts, (0, 3)):
        for mine, whole in ((p.X, ws.X), (p.C, ws.C), (p.A, ws.A), (p.B, ws.B), (p.scale, ws.scale),
                            (p.partials.d, ws.partials.d), (p.partials.sumsq, ws.partials.sumsq)):
            assert mine.data_ptr() == whole[lo].data_ptr() and mine.shape[1:] == whole.shape[1:]
    assert len(ws.parts(9)) == 5  # capped by the chunk
    assert all(p.gram_side is None for p in parts)
    from anvil_fast.core.gram_side import GramSideWork
    ws.gram_side = GramSideWork.for_workspace(ws)
    again = ws.parts(2)  # made anew so that the parts view the Gram side's buffers too
    assert again is not parts and again[1].gram_side.R.data_ptr() == ws.gram_side.R[3].data_ptr()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_fast_cascade_refuses_what_is_not_a_stream_count(bad):
    from anvil_fast.core.cascade import fast_cascade

    with pytest.raises(ValueError, match="streams: expected an int >= 1"):
        fast_cascade(torch.randn(2, 8, 8), streams=bad, backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["safe", "gram_side"])
def test_fast_cascade_on_streams_captured_in_a_graph(config):
    """The split cascade captured in a CUDA graph (the fork and the join as the graph's edges) and
    replayed on new input writes the one-stream eager result of that input bit for bit."""
    from anvil_fast.core.cascade import fast_cascade
    from anvil_fast.kernels.capture import capture

    shape = (6, 1152, 384) if config == "gram_side" else (6, 768, 768)
    x = torch.randn(shape, device="cuda")
    out = {}

    def run():
        out["y"] = fast_cascade(x, config=config, streams=2)

    graph = capture(run, warmup=2, device=x.device)
    x.copy_(torch.randn(shape, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out["y"]), _bits(fast_cascade(x, config=config))), config
