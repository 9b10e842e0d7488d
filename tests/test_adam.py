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
