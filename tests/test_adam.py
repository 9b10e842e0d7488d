"""anvil_ref.adam: Adam with bias correction and cautious decay, as the seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

import anvil_ref as A
from anvil_ref.adam import adam_step_size, adam_update


def test_step_size_bias_correction_first_steps():
    assert adam_step_size(lr=0.1, beta1=0.9, beta2=0.99, step=1) == pytest.approx(0.1 * math.sqrt(0.01) / 0.1)
    assert adam_step_size(lr=0.1, beta1=0.9, beta2=0.99, step=2) == pytest.approx(
        0.1 * math.sqrt(1 - 0.99 ** 2) / (1 - 0.9 ** 2))
    with pytest.raises(A.ReferenceInputError, match="starts at 1"):
        adam_step_size(lr=0.1, beta1=0.9, beta2=0.99, step=0)


def test_first_step_by_hand():
    # t = 1: m = 0.1 g, v = 0.01 g^2, eta = lr * 0.1 / 0.1 = lr, u = lr * 0.1 g / (0.1 |g| + eps)
    p, g = np.array([1.0, 1.0, -1.0]), np.array([2.0, -2.0, 0.0])
    r = adam_update(p, g, np.zeros(3), np.zeros(3), step=1, lr=0.5, beta1=0.9, beta2=0.99, eps=1e-8,
                    weight_decay=0.2, wd_mul=3.0)
    u = 0.5 * 0.1 * g / (0.1 * np.abs(g) + 1e-8)
    decay = 0.5 * 0.5 * 0.2 * 3.0
    # u*p > 0 only for the first entry (0.5 * 1); the third has u = 0 (not > 0, so no decay)
    expected = p - (u + p * np.array([1.0, 0.0, 0.0]) * decay)
    np.testing.assert_allclose(r.p, expected, rtol=1e-14)
    np.testing.assert_allclose(r.exp_avg, 0.1 * g)
    np.testing.assert_allclose(r.exp_avg_sq, 0.01 * g * g)


def test_many_steps_against_unrolled_sums():
    """m_t, v_t as explicit weighted sums of the gradients; p_t by accumulating the updates."""
    rng = np.random.default_rng(0)
    gs = rng.standard_normal((12, 4))
    b1, b2, lr, eps, wd = 0.5, 0.95, 0.01, 1e-10, 0.005
    p0 = rng.standard_normal(4)
    p, m, v = p0.copy(), np.zeros(4), np.zeros(4)
    for t in range(1, 13):
        p, m, v = adam_update(p, gs[t - 1], m, v, step=t, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    # independent unrolled computation
    q = p0.copy()
    for t in range(1, 13):
        mt = sum((1 - b1) * b1 ** (t - i) * gs[i - 1] for i in range(1, t + 1))
        vt = sum((1 - b2) * b2 ** (t - i) * gs[i - 1] ** 2 for i in range(1, t + 1))
        u = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * mt / (np.sqrt(vt) + eps)
        u = u + q * (u * q > 0) * lr * lr * wd
        q = q - u
    np.testing.assert_allclose(m, mt, rtol=1e-13)
    np.testing.assert_allclose(v, vt, rtol=1e-13)
    np.testing.assert_allclose(p, q, rtol=1e-13)


def test_off_by_one_in_step_count_is_visible():
    p, g = np.ones(2), np.array([1.0, -1.0])
    kw = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    r1 = adam_update(p, g, np.zeros(2), np.zeros(2), step=1, **kw)
    r2 = adam_update(p, g, np.zeros(2), np.zeros(2), step=2, **kw)
    assert np.all(np.abs(r1.p - r2.p) > 1e-3)


def test_bad_input():
    kw = dict(step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    with pytest.raises(A.ReferenceInputError, match="does not match"):
        adam_update(np.ones(3), np.ones(4), np.zeros(3), np.zeros(3), **kw)
    with pytest.raises(A.ReferenceInputError, match="non-finite"):
        adam_update(np.ones(3), np.array([1.0, np.nan, 0.0]), np.zeros(3), np.zeros(3), **kw)
    with pytest.raises(A.ReferenceInputError, match="< 1"):
        adam_update(np.ones(3), np.ones(3), np.zeros(3), np.zeros(3), **{**kw, "beta1": 1.0})
    with pytest.raises(A.ReferenceInputError, match="eps"):
        adam_update(np.ones(3), np.ones(3), np.zeros(3), np.zeros(3), **{**kw, "eps": 0.0})


# =================================================================================================
# Fast path: anvil_fast.kernels.adam (the Triton kernel through the interpreter, and the CPU fallback)
# against anvil_ref.adam.adam_update, within anvil_fast/core/tolerances.py's Adam rows
# =================================================================================================
import torch  # noqa: E402

from anvil_fast.kernels.adam import adam_row, adam_update_, fused_adam_  # noqa: E402
from anvil_fast.core import tolerances as TOL


def _fast_ulp(x, bits):
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126)))
    return np.exp2(e - bits)


HYPER = [dict(lr=0.04, beta1=0.9, beta2=0.99, eps=1e-10, weight_decay=0.5, wd_mul=3.0, step=1),
         dict(lr=0.008, beta1=0.5, beta2=0.95, eps=1e-8, weight_decay=0.005, wd_mul=150.0, step=7)]


_INTERP = __import__("os").environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("device,backend", [
    ("cpu", "auto"),  # the plain-torch fallback
    pytest.param("cpu", "triton", marks=pytest.mark.skipif(not _INTERP, reason="CPU kernel: interpreter only")),
    pytest.param("cuda", "auto", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_adam_matches_reference(device, backend, dtype):
    rng = np.random.default_rng(3)
    n = 3000
    seg = rng.integers(0, 3, n)
    p64 = rng.standard_normal(n) * 0.1
    p = torch.from_numpy(p64).to(dtype)
    g = torch.from_numpy(rng.standard_normal(n)).to(dtype)
    m = torch.from_numpy(rng.standard_normal(n) * 0.1).float()
    v = torch.from_numpy(rng.random(n) * 0.1).float()
    rows = [adam_row(**h) for h in HYPER] + [adam_row(**HYPER[0], active=False)]
    table = torch.tensor(rows, dtype=torch.float32)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    p, g, m, v, table = (t.to(device) for t in (p, g, m, v, table))
    fused_adam_(p, g, m, v, torch.from_numpy(seg).int().to(device), table, backend=backend)
    p, g, m, v = (t.cpu() for t in (p, g, m, v))
    for k, h in enumerate(HYPER):
        sel = seg == k
        # the reference on the fp32-rounded scalars the kernel reads, so only the pass itself is judged
        r = adam_update(p0.double().numpy()[sel], g.double().numpy()[sel], m0.double().numpy()[sel],
                        v0.double().numpy()[sel], step=h["step"], lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                        eps=h["eps"], weight_decay=h["weight_decay"], wd_mul=h["wd_mul"])
        gg, mm, vv, pp = (t.double().numpy()[sel] for t in (g, m0, v0, p0))
        ss = adam_step_size(lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], step=h["step"])
        t_big = ss * np.maximum(np.abs(mm), np.abs(gg)) / (np.sqrt(r.exp_avg_sq) + h["eps"])
        terms = np.maximum.reduce([np.abs(pp), np.abs(pp) * h["lr"] ** 2 * h["weight_decay"] * h["wd_mul"], t_big])
        err = np.abs(p.double().numpy()[sel] - r.p)
        if dtype == torch.bfloat16:
            assert np.all(err <= TOL.ADAM_BF16_ULPS * _fast_ulp(terms, 7))
        else:
            assert np.all(err <= TOL.ADAM_ULPS * _fast_ulp(terms, 23)), (err / _fast_ulp(terms, 23)).max()
        for got, want, sc in ((m, r.exp_avg, np.maximum(np.abs(mm), np.abs(gg))),
                              (v, r.exp_avg_sq, np.maximum(vv, gg ** 2))):
            assert np.all(np.abs(got.double().numpy()[sel] - want) <= TOL.ADAM_MOMENT_ULPS * _fast_ulp(sc, 23))
    off = seg == 2  # the inactive row changes nothing
    assert torch.equal(p[off], p0[off]) and torch.equal(m[off], m0[off]) and torch.equal(v[off], v0[off])


@pytest.mark.parametrize("device,backend", [
    ("cpu", "auto"),  # the plain-torch fallback
    pytest.param("cpu", "triton", marks=pytest.mark.skipif(not _INTERP, reason="CPU kernel: interpreter only")),
    pytest.param("cuda", "auto", marks=pytest.mark.gpu)])
def test_fast_adam_single_row_equals_fused_and_cautious_decay_is_strict(device, backend):
    h = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.2, wd_mul=3.0, step=1)
    table = torch.tensor([adam_row(**h)], dtype=torch.float32, device=device)
    p = torch.tensor([1.0, 1.0, -1.0, 0.5], device=device)
    g = torch.tensor([2.0, -2.0, 0.0, 1.0], device=device)
    m, v = torch.zeros(4, device=device), torch.zeros(4, device=device)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    adam_update_(p, g, m, v, table, 0, backend=backend)
    fused_adam_(p2, g, m2, v2, torch.zeros(4, dtype=torch.int32, device=device), table, backend=backend)
    assert torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2)
    p = p.cpu()
    assert p[2] == -1.0  # g = 0: u = 0, u * p = 0 is not > 0, no decay
    r = adam_update(np.array([1.0, 1.0, -1.0, 0.5]), g.cpu().double().numpy(), np.zeros(4), np.zeros(4), **h)
    np.testing.assert_allclose(p.double().numpy(), r.p, rtol=1e-6)


def test_fast_adam_bad_input():
    table = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="grad has 3 elements"):
        adam_update_(torch.zeros(4), torch.zeros(3), torch.zeros(4), torch.zeros(4), table, 0)
    with pytest.raises(ValueError, match="moments must be float32"):
        adam_update_(torch.zeros(4), torch.zeros(4), torch.zeros(4).double(), torch.zeros(4), table, 0)
    with pytest.raises(ValueError, match="segment must be int32"):
        fused_adam_(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4).long(), table)
