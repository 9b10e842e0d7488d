"""anvil_fast.kernels.normalize: the fused SAFE normalization (block partials -> per-matrix s, d -> X s / d)
against float64 and against the plain-torch ``_normalize`` it replaces on CUDA.

Every test takes the ``triton_dev`` fixture (tests/conftest.py): on CPU the kernels run in Triton's
interpreter (``ROUND_FIX`` / ``WIDEN_FIX`` stand in for its wrong bf16 casts, see
anvil_fast/kernels/backend.py), on CUDA natively (``pytest -m gpu``). What only the GPU run covers: the
native casts, the compiled reductions' order, and the kernels' speed (``python -m anvil_fast.bench``)."""

from __future__ import annotations

import math

import pytest
import torch

LIMIT = 126


def _mods():
    from anvil_fast.kernels import normalize as N
    from anvil_fast.core.cascade import SAFE, _normalize

    return N, SAFE, _normalize


def _x(shape, dev, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).bfloat16().to(dev)


def _partials64(x: torch.Tensor, block: int):
    """float64 per-block max|x| and sum((x 2**-e_b)**2), e_b = floor(log2 max|x|) clamped."""
    chunk = x.shape[0]
    flat = x.reshape(chunk, -1).double().cpu()
    nb = -(-flat.shape[1] // block)
    amax, ss = torch.zeros(chunk, nb, dtype=torch.float64), torch.zeros(chunk, nb, dtype=torch.float64)
    for c in range(chunk):
        for b in range(nb):
            v = flat[c, b * block:(b + 1) * block]
            a = float(v.abs().max())
            e = LIMIT * -1 if a == 0 else max(-LIMIT, min(LIMIT, math.floor(math.log2(a))))
            amax[c, b], ss[c, b] = a, float(((v * 2.0 ** -e) ** 2).sum())
    return amax, ss


@pytest.mark.parametrize("shape", [(3, 37, 301), (2, 64, 64), (1, 1, 1), (2, 5, 4097)])
def test_block_partials_are_exact_max_and_accurate_sums(shape, triton_dev):
    dev = triton_dev
    N, _, _ = _mods()
    x = _x(shape, dev, seed=sum(shape))
    p = N.NormPartials.for_shape(tuple(shape), dev)
    N.block_partials(x, p, limit=LIMIT)
    amax, ss = _partials64(x, N.NORM_BLOCK)
    assert torch.equal(p.amax.double().cpu(), amax)  # max of bf16 values: exact
    # fp32 sum of <= 4096 terms in [0, 4): relative error <= ~12 * 2**-24 even summed serially
    assert torch.allclose(p.sumsq.double().cpu(), ss, rtol=2 ** -20, atol=0)


@pytest.mark.parametrize("case", ["gaussian", "huge", "tiny", "mixed_blocks", "zero"])
def test_fused_normalization_matches_plain_torch(case, triton_dev):
    # The same math as anvil_fast.core.cascade._normalize; only tr's fp32 summation order differs, so s is
    # bit-identical, d agrees to a few fp32 ulps, and X to one bf16 rounding where d's last bit
    # tips it (the tolerance: |X| < 2, one bf16 ulp there is 2**-7).
    N, SAFE, normalize = _mods()
    dev = triton_dev
    shape = (3, 48, 200)
    x = {"gaussian": lambda: _x(shape, dev),
         "huge": lambda: _x(shape, dev, scale=2.0 ** 120),
         "tiny": lambda: _x(shape, dev, scale=2.0 ** -120),
         "zero": lambda: torch.zeros(shape, dtype=torch.bfloat16, device=dev)}.get(case, lambda: None)()
    if case == "mixed_blocks":  # blocks whose own exponents differ by ~2**60 inside one matrix
        x = _x(shape, dev).float()
        x.view(3, -1)[:, :N.NORM_BLOCK] *= 2.0 ** -60
        x.view(3, -1)[:, N.NORM_BLOCK:] *= 2.0 ** 30
        x = x.bfloat16()
    margin, eps = SAFE.margin(), 1e-7
    xa, sa = x.clone(), torch.ones(3, 1, 1, device=dev)
    p = N.NormPartials.for_shape(shape, dev)
    N.block_partials(xa, p, limit=LIMIT)
    N.normalize_from_partials(xa, sa, p, margin=margin, eps=eps, limit=LIMIT)
    xb, sb = x.clone().cpu(), torch.ones(3, 1, 1)
    normalize(xb, None, sb, True, True, margin, eps)
    assert torch.equal(sa.cpu(), sb)
    # float64 d from the float64 trace of the prescaled X
    xs = x.double().cpu() * sb.double()
    d64 = xs.square().sum(dim=(-2, -1), keepdim=True).sqrt() * margin + eps * sb.double()
    assert torch.allclose(p.d.double().cpu(), d64, rtol=2 ** -20, atol=0)
    assert torch.isfinite(xa).all()
    diff = (xa.float().cpu() - xb.float()).abs()
    assert float(diff.max()) <= 2.0 ** -7
    assert float((diff > 0).double().mean()) <= 0.01
    if case == "zero":
        assert not xa.any() and torch.isfinite(p.d).all()


def test_nan_in_one_matrix_stays_in_that_matrix(triton_dev):
    N, SAFE, _ = _mods()
    dev = triton_dev
    shape = (2, 16, 300)
    x = _x(shape, dev)
    x[0, 3, 7] = float("nan")
    clean = x[1].clone()
    s = torch.ones(2, 1, 1, device=dev)
    p = N.NormPartials.for_shape(shape, dev)
    N.block_partials(x, p, limit=LIMIT)
    assert torch.isnan(p.amax[0]).any() and not torch.isnan(p.amax[1]).any()
    N.normalize_from_partials(x, s, p, margin=SAFE.margin(), eps=1e-7, limit=LIMIT)
    assert torch.isnan(x[0]).all(), "a NaN must reach the guard (the whole matrix), not vanish"
    ref, sr = clean[None].cpu().clone(), torch.ones(1, 1, 1)
    _mods()[2](ref, None, sr, True, True, SAFE.margin(), 1e-7)
    assert float((x[1].float().cpu() - ref[0].float()).abs().max()) <= 2.0 ** -7


def test_partials_checks_shapes(triton_dev):
    N, _, _ = _mods()
    dev = triton_dev
    x = _x((2, 8, 8), dev)
    with pytest.raises(ValueError, match="partials"):
        N.block_partials(x, N.NormPartials.for_shape((3, 8, 8), dev), limit=LIMIT)
    with pytest.raises(ValueError, match="bf16"):
        N.block_partials(x.float(), N.NormPartials.for_shape((2, 8, 8), dev), limit=LIMIT)


def test_launches_sliced_over_the_matrix_axis_give_the_same_bits(triton_dev, monkeypatch):
    # CUDA limits grid axis 1 (the matrix index) to 65535: the element-wise kernels launch in slices
    # of that many matrices. With the limit lowered to 2, five matrices take three launches.
    from anvil_fast.kernels import backend as T
    from anvil_fast.kernels.equalizer import EqualizerWork
    from anvil_fast.kernels.equalizer import equalize as fast_equalize

    N, SAFE, _ = _mods()
    shape = (5, 24, 40)
    x = _x(shape, triton_dev)
    outs = []
    for limit in (65535, 2):
        monkeypatch.setattr(T, "MAX_GRID_Y", limit)
        xs, s = x.clone(), torch.ones(5, 1, 1, device=triton_dev)
        p = N.NormPartials.for_shape(shape, triton_dev)
        N.block_partials(xs, p, limit=LIMIT)
        N.normalize_from_partials(xs, s, p, margin=SAFE.margin(), eps=1e-7, limit=LIMIT)
        e = xs.float().square().mean(dim=-2, keepdim=True)
        trips = torch.zeros(5, dtype=torch.int32, device=triton_dev)
        fast_equalize(xs, e, beta2=0.9, red_dim=-2, guard_trips=trips, fused=True, work=EqualizerWork.for_shape(shape, triton_dev),
                       backend="triton")
        outs.append((xs, p.amax, p.sumsq, s, e))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
