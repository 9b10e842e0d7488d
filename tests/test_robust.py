"""The robust certificate (derive_maps.robust): refusals, passes, soundness against independent
mpmath evaluations of sampled perturbation sequences, the derived rounding model, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import mpmath
import numpy as np
import pytest

from anvil_fast.cascade import SAFE_MARGIN_SLACK
from anvil_ref.constants import ANVIL_MAPS, BF16_UNIT_ROUNDOFF, FROBENIUS_MARGIN
from derive_maps.errors import DeriveMapsError
from derive_maps.robust import (RoundingModel, _input_interval, reached, robust_envelope, robust_verdict,
                                rounding_model, safe_u)

SEED_U = 1 / Fraction(FROBENIUS_MARGIN)
WIDE_SLACK = Fraction(1, 64)


def _iterate_only(delta: float) -> RoundingModel:
    return RoundingModel(delta_x=delta, delta_gram=0.0, delta_b=0.0, gamma_b=0.0, gamma_y=0.0, delta0=0.0)


def _mp_output(maps, x, e, m: RoundingModel):
    """The model's output for input x and one perturbation sequence, in mpmath (30 digits): written
    from the module docstring's equations, independently of the interval code. ``e`` is an array
    [stages, 5] of numbers in [-1, 1] scaling (delta_gram, delta_b, gamma_b, gamma_y, delta_x); e0
    scales the first iterate's rounding."""
    with mpmath.workdps(30):
        s = mpmath.mpf(float(x)) * (1 + mpmath.mpf(float(e[0][5])) * m.delta_x)
        for (a, b, c), (eA, eB, gB, gY, eX, _) in zip(maps, e):
            a, b, c = mpmath.mpf(a), mpmath.mpf(b), mpmath.mpf(c)
            t = s * s * (1 + mpmath.mpf(float(eA)) * m.delta_gram)
            h = (b * t + c * t * t) * (1 + mpmath.mpf(float(eB)) * m.delta_b) \
                + mpmath.mpf(float(gB)) * m.gamma_b * (abs(b) * t + abs(c) * t * t)
            y = s * (a + h) + mpmath.mpf(float(gY)) * m.gamma_y * (abs(a) + abs(h)) * abs(s)
            s = y * (1 + mpmath.mpf(float(eX)) * m.delta_x)
            if abs(s) > 1e40:
                return mpmath.inf
        return s


def test_faithful_setting_is_refused():
    # the seed's margin without slack under FAITHFUL's rounding model (bf16 Gram-diagonal trace)
    v = robust_verdict(ANVIL_MAPS, rounding_model("faithful"), l=None, u=SEED_U)
    assert not v.passed
    assert v.headroom.blown_up and v.headroom.f_max_reached >= 1e49  # a perturbation sequence reaches it
    assert "blows up" in v.reason


def test_seed_margin_has_no_room_for_a_tenth_of_a_bf16_unit():
    # ANVIL_MAPS' headroom above the Frobenius bound is less than one rounding: a relative 1e-4
    # (1/39 of a bf16 unit) on the iterates already reaches an output above 20
    e = robust_envelope(ANVIL_MAPS, 0, SEED_U, _iterate_only(1e-4))
    assert e.f_max_reached > 20
    assert not robust_verdict(ANVIL_MAPS, _iterate_only(1e-4), l=None, u=SEED_U).passed


def test_wide_margin_passes_and_brackets():
    v = robust_verdict(ANVIL_MAPS, rounding_model("safe"), l="1/300", u=safe_u(WIDE_SLACK))
    assert v.passed, v.reason
    h = v.headroom
    assert not h.blown_up
    assert 1 < h.f_max_reached <= h.f_max_certified <= 1 + 2 ** -5
    # the bracket is tight: the certified bound is within 25% of the reached headroom
    assert h.headroom_certified <= 1.25 * h.headroom_reached
    assert np.isfinite(v.envelope.max_abs_log_certified)


def test_safe_slack_is_refused_under_the_worst_case_model():
    # SAFE's slack 2^-7 covers the typical roundings (see tests/test_near_rank1.py), not every
    # per-element alignment of the worst case
    assert not robust_verdict(ANVIL_MAPS, rounding_model("safe"), l=None, u=safe_u(SAFE_MARGIN_SLACK)).passed


def test_safe_headroom_matches_mpmath_brute_force():
    m = _iterate_only(2e-3)
    u = safe_u(SAFE_MARGIN_SLACK)
    e = robust_envelope(ANVIL_MAPS, 0, u, m)
    assert not e.blown_up and e.f_max_reached <= e.f_max_certified
    rng = np.random.default_rng(20261201)
    xs = np.concatenate([[e.argmax], e.argmax * (1 + rng.uniform(-1e-3, 1e-3, 7)),
                         rng.uniform(0, float(u), 8)])
    xs = np.clip(xs, 0, float(u))
    best = -np.inf
    for x in xs:
        for _ in range(40):
            seq = rng.choice([-1.0, 1.0], size=(len(ANVIL_MAPS), 6))
            best = max(best, float(_mp_output(ANVIL_MAPS, x, seq, m)))
    assert best <= e.f_max_certified
    # the brute force finds a headroom of the size reported (its samples are not the extremes)
    assert best - 1 >= 0.5 * (e.f_max_reached - 1)


def test_outward_rounding_brackets_a_dense_sample():
    m = rounding_model("safe")
    u = safe_u(WIDE_SLACK)
    e = robust_envelope(ANVIL_MAPS, "1/300", u, m)
    rng = np.random.default_rng(7)
    xs = np.geomspace(1 / 300, float(u), 300)
    vals = []
    for x in xs:
        seq = rng.uniform(-1, 1, size=(len(ANVIL_MAPS), 6))
        corner = rng.random(seq.shape) < 0.5       # half the perturbations at their extremes
        seq[corner] = np.sign(seq[corner])
        vals.append(float(_mp_output(ANVIL_MAPS, x, np.clip(seq, -1, 1), m)))
    vals = np.array(vals)
    assert vals.min() >= e.f_min_certified and vals.max() <= e.f_max_certified
    # and the sample spreads over a good part of the certified envelope
    assert vals.max() - vals.min() >= 0.25 * (e.f_max_certified - e.f_min_certified)


def test_reached_lies_inside_the_enclosure_at_points():
    m = rounding_model("safe")
    xs = np.array([0.01, 0.3, 0.9])
    r_lo, r_hi = reached(ANVIL_MAPS, xs, m)
    for x, lo, hi in zip(xs, r_lo, r_hi):
        e = robust_envelope(ANVIL_MAPS, Fraction(x) * (1 - Fraction(1, 10 ** 12)), Fraction(x), m)
        assert e.f_min_certified <= float(lo) <= float(hi) <= e.f_max_certified


def test_rounding_model_derivation():
    s, f = rounding_model("safe"), rounding_model("faithful")
    assert s.delta_x == BF16_UNIT_ROUNDOFF and s.delta_b == BF16_UNIT_ROUNDOFF
    assert BF16_UNIT_ROUNDOFF < s.delta_gram < 1.02 * BF16_UNIT_ROUNDOFF  # + gamma_768 of the fp32 sum
    assert 0 < s.delta0 < 1e-5                     # fp32 trace: a few dozen fp32 roundings
    assert f.delta0 > BF16_UNIT_ROUNDOFF           # bf16 diagonal: a whole bf16 unit
    assert f.delta_x > 2 * BF16_UNIT_ROUNDOFF      # the split a X + X B rounds twice
    # longer fp32 sums, larger gamma
    assert rounding_model("safe", rows=2816, cols=768).delta_gram > s.delta_gram
    with pytest.raises(DeriveMapsError, match="config"):
        rounding_model("fast")
    with pytest.raises(DeriveMapsError, match="delta_x"):
        RoundingModel(delta_x=-1e-3, delta_gram=0, delta_b=0, gamma_b=0, gamma_y=0, delta0=0)


def test_trace_widens_the_input_interval():
    d0 = 1e-3
    lo, hi = _input_interval(Fraction(1, 300), SEED_U, d0)
    # x = sigma / sqrt(tr (1 + e)): the end moves to u / sqrt(1 - d0) and l to l / sqrt(1 + d0)
    assert Fraction(*hi.as_integer_ratio()) ** 2 * (1 - Fraction(d0)) >= SEED_U ** 2
    assert Fraction(*lo.as_integer_ratio()) ** 2 * (1 + Fraction(d0)) <= Fraction(1, 300) ** 2


def test_bad_input_is_refused():
    with pytest.raises(DeriveMapsError, match="interval"):
        robust_envelope(ANVIL_MAPS, "1", "0.5", rounding_model())
    with pytest.raises(DeriveMapsError, match="model"):
        robust_envelope(ANVIL_MAPS, 0, "1/2", 0.01)


def test_cli_refuses_faithful_and_prints_json():
    r = subprocess.run([sys.executable, "-m", "derive_maps", "robust", "anvil", "--config", "faithful"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "refused" in r.stdout and "blows up" in r.stdout
    r = subprocess.run([sys.executable, "-m", "derive_maps", "robust", "anvil", "--slack", "1/64", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"]["passed"] and d["verdict"]["headroom"]["f_max_certified"] < 1 + 2 ** -5
