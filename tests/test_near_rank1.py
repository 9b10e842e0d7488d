"""Near-rank-1 input: the FAITHFUL configuration reproduces the seed's explosion, SAFE never explodes.

See anvil_fast/core/cascade.py (mechanism) and anvil_fast/studies/near_rank1.py (the full study). On CPU the fast
path runs with plain-torch kernels and the seed's eager bf16 cascade alongside; on GPU with the Triton
kernels and cuBLAS.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from anvil_fast.core.cascade import FAITHFUL, SAFE, fast_cascade
from anvil_fast.core.eager import eager_bf16_cascade
from anvil_fast.studies.near_rank1 import near_rank1, top_singular_value, trace_error
from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_MARGIN, SAFE_MARGIN_SLACK
from derive_maps.robust import RoundingModel, robust_envelope, safe_u


def _study(device, count, m, n, compile=None):
    x = near_rank1(count, m, n, seed=7, device=device)
    out = {"eager": eager_bf16_cascade(x), "faithful": fast_cascade(x, config=FAITHFUL, compile=compile),
           "safe": fast_cascade(x, config=SAFE, compile=compile)}
    return x, {k: top_singular_value(v) for k, v in out.items()}


def _check(x, sig, count):
    # the seed (eager) and FAITHFUL explode on a large share of the inputs (~40% measured)...
    for k in ("eager", "faithful"):
        assert (sig[k] > 1.1).sum() >= count // 8, f"{k}: expected explosions, got sigma_max {sig[k].tolist()}"
    # ... mostly where the bf16-rounded trace came out low (the mechanism)
    down = trace_error(x) < -1e-4
    bad = sig["faithful"] > 1.1
    assert bad[down].double().mean() > bad[~down].double().mean()
    # SAFE: finite, and every singular value at most ~1
    assert torch.isfinite(sig["safe"]).all()
    assert sig["safe"].max() <= 1.01, sig["safe"].max()


def test_faithful_explodes_safe_holds_cpu():
    x, sig = _study("cpu", 48, 64, 64)
    _check(x, sig, 48)


@pytest.mark.gpu
def test_faithful_explodes_safe_holds_gpu():
    for m, n in [(768, 768), (2816, 768), (96, 96)]:
        x, sig = _study("cuda", 64, m, n)
        _check(x, sig, 64)


def _iterate_only(delta: float) -> RoundingModel:
    return RoundingModel(delta_x=delta, delta_gram=0.0, delta_b=0.0, gamma_b=0.0, gamma_y=0.0, delta0=0.0)


def test_interval_analysis_supports_the_slack():
    # the numbers quoted in anvil_fast/core/cascade.py (the scalar model's certified bounds on [0, u])
    seed_u = 1 / Fraction(FROBENIUS_MARGIN)
    assert robust_envelope(ANVIL_MAPS, 0, seed_u, _iterate_only(0.0)).f_max_certified < 1.001
    # the seed's margin has no room for a 1e-4 perturbation: a perturbation sequence reaches > 20
    assert robust_envelope(ANVIL_MAPS, 0, seed_u, _iterate_only(1e-4)).f_max_reached > 20
    # SAFE's has room for ~one bf16 ulp per stage
    assert robust_envelope(ANVIL_MAPS, 0, safe_u(SAFE_MARGIN_SLACK), _iterate_only(4e-3)).f_max_certified < 1.0052
    # and the analysis can fail
    assert robust_envelope(ANVIL_MAPS, 0, safe_u(SAFE_MARGIN_SLACK), _iterate_only(8e-3)).f_max_reached > 1.1


@pytest.mark.parametrize("scale_exp", [100, -100])
def test_safe_is_finite_on_huge_and_tiny_scales(scale_exp):
    # against the float64 reference on the same input: at 2**100 the output is the unit-scale
    # cascade's; at 2**-100 ``eps`` dominates the normalization (d ~ eps), so the output is ~x / eps,
    # tiny but not zero -- an all-zero output fails both asserts
    import anvil_ref as R
    from anvil_fast.studies.difftest import rel_err
    from anvil_fast.core.tolerances import bf16_bound

    x = torch.randn(2, 24, 40, generator=torch.Generator().manual_seed(5)) * 2.0 ** scale_exp
    y = fast_cascade(x, config=SAFE)
    assert torch.isfinite(y.float()).all()
    ref = R.cascade(x.bfloat16(), margin=SAFE.margin())
    eager = eager_bf16_cascade(x, margin=SAFE.margin(), fp32_trace=True, prescale=True, split=False)
    assert float(y.double().norm()) > 0.5 * float(ref.norm()) > 0
    assert rel_err(y, ref) <= bf16_bound(rel_err(eager, ref)), (rel_err(y, ref), rel_err(eager, ref))
    if scale_exp > 0:  # the seed's bf16 Gram overflows (documented failure of FAITHFUL)
        assert not torch.isfinite(fast_cascade(x, config=FAITHFUL).float()).all()
