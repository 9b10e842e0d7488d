"""anvil_ref.rails: twin-rail momentum, the lookahead and the rail schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import anvil_ref as A
from anvil_ref.rails import blend_rails, ema, nesterov_lookahead, rail_beta, rail_scalars, twin_rail


# ------------------------------------------------------------------ one step, by hand
def test_ema_by_hand():
    np.testing.assert_allclose(ema(np.array([1.0, -2.0]), np.array([3.0, 4.0]), beta=0.75),
                               [0.75 * 1 + 0.25 * 3, 0.75 * -2 + 0.25 * 4], rtol=1e-15)


def test_blend_and_lookahead_by_hand():
    assert blend_rails(np.array([2.0]), np.array([10.0]), fast_weight=0.25)[0] == pytest.approx(0.5 + 7.5)
    assert nesterov_lookahead(np.array([4.0]), np.array([8.0]), momentum=0.75)[0] == pytest.approx(1 + 6)


def test_twin_rail_one_step_by_hand():
    g, v0, v1 = np.array([[1.0]]), np.array([[2.0]]), np.array([[-4.0]])
    r = twin_rail(g, v0, v1, momentum=0.5, fast_beta=0.5, fast_weight=0.25, slow_beta=0.75)
    fast = 0.5 * 2 + 0.5 * 1  # 1.5
    slow = 0.75 * -4 + 0.25 * 1  # -2.75
    blend = 0.25 * fast + 0.75 * slow
    assert r.v_fast[0, 0] == pytest.approx(fast)
    assert r.v_slow[0, 0] == pytest.approx(slow)
    assert r.lookahead[0, 0] == pytest.approx(0.5 * 1 + 0.5 * blend)


def test_twin_rail_default_slow_beta_is_the_constant():
    r = twin_rail(np.ones((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), momentum=0.0, fast_beta=0.0, fast_weight=1.0)
    assert r.v_slow[0, 0] == pytest.approx(1 - A.RAIL_SLOW_BETA)


# ------------------------------------------------------------------ many steps, unrolled
def test_twin_rail_matches_closed_form_over_many_steps():
    """v_t = (1 - beta) sum_{i<=t} beta^(t-i) g_i for a rail started at zero, with the schedule's
    changing fast beta folded in as a product; the lookahead of the last step from the two sums."""
    rng = np.random.default_rng(0)
    gs = rng.standard_normal((30, 3, 2))
    betas_f = [0.85 + 0.003 * t for t in range(30)]  # a changing fast beta
    beta_s, w, mu = 0.98, 0.4385, 0.9
    v0 = v1 = np.zeros((3, 2))
    for t in range(30):
        r = twin_rail(gs[t], v0, v1, momentum=mu, fast_beta=betas_f[t], fast_weight=w, slow_beta=beta_s)
        v0, v1 = r.v_fast, r.v_slow
    fast = sum((1 - betas_f[i]) * np.prod(betas_f[i + 1:]) * gs[i] for i in range(30))
    slow = sum((1 - beta_s) * beta_s ** (29 - i) * gs[i] for i in range(30))
    np.testing.assert_allclose(v0, fast, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(v1, slow, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(r.lookahead, (1 - mu) * gs[-1] + mu * (w * fast + (1 - w) * slow),
                               rtol=1e-13, atol=1e-15)


def test_inputs_not_modified_and_torch_roundtrip():
    g = torch.randn(2, 3, generator=torch.Generator().manual_seed(101))
    v0, v1 = torch.randn(2, 3, generator=torch.Generator().manual_seed(102)), torch.randn(2, 3, generator=torch.Generator().manual_seed(103))
    copies = [t.clone() for t in (g, v0, v1)]
    r = twin_rail(g, v0, v1, momentum=0.9, fast_beta=0.8, fast_weight=0.5)
    assert all(torch.equal(a, b) for a, b in zip((g, v0, v1), copies))
    assert isinstance(r.lookahead, torch.Tensor) and r.lookahead.dtype == torch.float64


# ------------------------------------------------------------------ the schedule
def test_rail_beta_warmup_flat_cooldown():
    total = 1000
    assert rail_beta(0, total) == 0.85
    assert rail_beta(120, total) == pytest.approx(0.85 + 0.5 * 0.08)
    assert rail_beta(239, total) == pytest.approx(0.85 + 239 / 240 * 0.08)
    assert rail_beta(240, total) == 0.93  # first flat step
    assert rail_beta(950, total) == 0.93  # cool-down starts *after* total - 50
    assert rail_beta(951, total) == pytest.approx(0.93 - 0.08 / 50)
    assert rail_beta(975, total) == pytest.approx(0.89)
    assert rail_beta(1000, total) == pytest.approx(0.85)


def test_rail_beta_short_run_warmup_wins():
    # total 100 < 240 + 50: the warm-up branch is taken first, as in the record's code.
    assert rail_beta(90, 100) == pytest.approx(0.85 + 90 / 240 * 0.08)


def test_rail_scalars_engage_step():
    total = 2000
    before = rail_scalars(A.RAIL_ENGAGE_STEP - 1, total)
    at = rail_scalars(A.RAIL_ENGAGE_STEP, total)
    assert before == (0.93, 0.93, 1.0)
    assert at == (0.93, A.RAIL_FAST_BETA, A.RAIL_FAST_WEIGHT)
    early = rail_scalars(10, total)
    assert early.momentum == early.fast_beta == pytest.approx(0.85 + 10 / 240 * 0.08) and early.fast_weight == 1.0
    late = rail_scalars(total, total)
    assert late == (pytest.approx(0.85), A.RAIL_FAST_BETA, A.RAIL_FAST_WEIGHT)


@pytest.mark.parametrize("step,total", [(-1, 10), (11, 10), (0, 0), (1.5, 10)])
def test_rail_beta_bad_steps(step, total):
    with pytest.raises(A.ReferenceInputError):
        rail_beta(step, total)


# ------------------------------------------------------------------ bad input
def test_rails_bad_input():
    with pytest.raises(A.ReferenceInputError, match="does not match"):
        ema(np.zeros(3), np.zeros(4), beta=0.5)
    with pytest.raises(A.ReferenceInputError, match="non-finite"):
        twin_rail(np.array([np.nan]), np.zeros(1), np.zeros(1), momentum=0.5, fast_beta=0.5, fast_weight=0.5)
    with pytest.raises(A.ReferenceInputError, match=r"\[0.0, 1.0\]"):
        ema(np.zeros(3), np.zeros(3), beta=1.5)


# =================================================================================================
# anvil_fast vs anvil_ref (owner: the anvil_fast helper). The fast twin rails + lookahead
# (anvil_fast/kernels/rails.py) on every input family: the bf16 lookahead within anvil_fast/core/tolerances.py of the
# reference and the fp32 rails within RAILS_ULPS of the largest term. Full harness: anvil_fast.studies.difftest.

@pytest.mark.parametrize("family", ["gaussian", "near_rank1", "zero", "huge", "tiny"])
def test_fast_rails_match_reference(family):
    from anvil_fast.studies import difftest as D
    from anvil_fast.core.cascade import SAFE
    from anvil_fast.core.tolerances import check_row

    row, _ = D.momentum_row((2, 24, 40), family, SAFE, compile=False)
    assert check_row(row, same_backend=True), D.format_table([row])


# The fused Triton rails (anvil_fast.kernels.rails, SAFE on CUDA), on CPU in Triton's interpreter and on CUDA
# (the triton_dev fixture of tests/conftest.py; ROUND_FIX / WIDEN_FIX stand in for the interpreter's
# wrong bf16 casts, anvil_fast/kernels/backend.py).
@pytest.mark.parametrize("family", ["gaussian", "near_rank1", "zero", "huge", "tiny"])
def test_fused_rails_match_reference(family, triton_dev):
    from anvil_fast.studies import difftest as D
    from anvil_fast.core.cascade import SAFE
    from anvil_fast.core.tolerances import check_row

    row, _ = D.momentum_row((2, 24, 40), family, SAFE, compile=False, backend="triton", device=triton_dev)
    assert check_row(row, same_backend=triton_dev == "cpu"), D.format_table([row])


def _rails_inputs(shape, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(shape, generator=g).bfloat16()
    vel = torch.randn((2, *shape), generator=g)
    f32 = dict(dtype=torch.float32, device=dev)
    scalars = [torch.tensor(v, **f32) for v in (0.95, 0.9, 0.4385)]  # momentum, fast beta, fast weight
    return grad, vel, scalars


def _run_rails(grad, vel, scalars, *, fused, prescale=True, with_partials=True):
    dev = scalars[0].device
    from anvil_fast.kernels.normalize import NormPartials
    from anvil_fast.kernels.rails import twin_rail as fast_twin_rail

    shape = tuple(grad.shape)
    v = vel.clone().to(dev)
    x = torch.empty(shape, dtype=torch.bfloat16, device=dev)
    p = NormPartials.for_shape(shape, dev) if with_partials else None
    mu, fb, w = scalars
    wrote = fast_twin_rail(grad.to(dev), v, momentum=mu, fast_beta=fb, fast_weight=w, x_out=x, prescale=prescale,
                           fused=fused, partials=p, backend="triton" if fused else "torch", compile=False)
    assert wrote == (fused and with_partials)
    return v.cpu(), x.cpu(), p


@pytest.mark.parametrize("shape", [(3, 37, 301), (2, 64, 64), (1, 1, 5)])
def test_fused_rails_equal_the_torch_rails_and_leave_the_partials_of_x(shape, triton_dev):
    # Same formula as torch's lerp (fused multiply-add, as torch's vectorized CPU lerp): the rails
    # agree to one fp32 rounding of the largest term, X to one bf16 rounding, and the partials are
    # those block_partials computes from the X written.
    from anvil_fast.studies.difftest import err_ulps
    from anvil_fast.kernels.normalize import NormPartials, block_partials
    from anvil_fast.kernels.rails import PRESCALE_EXP_LIMIT

    grad, vel, sc = _rails_inputs(shape, triton_dev, seed=sum(shape))
    vf, xf, pf = _run_rails(grad, vel, sc, fused=True)
    vt, xt, _ = _run_rails(grad, vel, sc, fused=False)
    big = torch.maximum(vel.abs(), grad.float().abs()[None])
    assert err_ulps(vf, vt, big) <= 1
    ulp = torch.finfo(torch.bfloat16).eps * xt.float().abs()
    assert bool(((xf.float() - xt.float()).abs() <= ulp).all())
    p2 = NormPartials.for_shape(shape, triton_dev)
    block_partials(xf.to(triton_dev), p2, limit=PRESCALE_EXP_LIMIT)
    assert torch.equal(pf.amax, p2.amax) and torch.equal(pf.sumsq, p2.sumsq)


def test_fused_rails_clamp_huge_and_keep_nan_where_it_is(triton_dev):
    shape = (2, 16, 300)
    grad, vel, sc = _rails_inputs(shape, triton_dev)
    grad[0, 3, 7] = float("nan")
    # matrix 1: lookahead values between bf16's largest finite value and fp32's, which a plain cast
    # rounds to inf
    grad[1] = torch.finfo(torch.bfloat16).max
    vel[:, 1] = 3.4e38
    v, x, p = _run_rails(grad, vel, sc, fused=True)
    assert torch.isfinite(x[1]).all(), "SAFE clamps the lookahead to bf16's finite range"
    assert float(x[1].float().abs().max()) == torch.finfo(torch.bfloat16).max
    nan = torch.isnan(x[0])
    assert nan.sum() == 1 and nan[3, 7], "a NaN gradient element stays one NaN element of X"
    assert torch.isnan(p.amax[0, 0]) and not torch.isnan(p.amax[0, 1]) and not torch.isnan(p.amax[1]).any()
    _, x_noclamp, _ = _run_rails(grad, vel, sc, fused=True, prescale=False, with_partials=False)
    _, x_torch, _ = _run_rails(grad, vel, sc, fused=False, prescale=False, with_partials=False)
    assert torch.isinf(x_noclamp[1]).all() and torch.isinf(x_torch[1]).all()  # what the clamp prevents


def test_fused_rails_check_their_input(triton_dev):
    grad, vel, sc = _rails_inputs((2, 8, 8), triton_dev)
    with pytest.raises(ValueError, match="velocity"):
        _run_rails(grad, vel[:, :, :, :4], sc, fused=True)
    with pytest.raises(ValueError, match="grad"):
        _run_rails(grad.half(), vel, sc, fused=True)
    from anvil_fast.kernels.backend import use_triton

    with pytest.raises(ValueError, match="backend"):
        use_triton(grad, "cuda")


def test_fast_twin_rail_has_the_reference_name_and_keyword_only_rates():
    import inspect

    from anvil_fast.kernels import rails as FR
    from anvil_ref import rails as RR

    for fn in (FR.twin_rail, RR.twin_rail):
        params = inspect.signature(fn).parameters
        assert all(params[k].kind == inspect.Parameter.KEYWORD_ONLY for k in ("momentum", "fast_beta", "fast_weight"))
