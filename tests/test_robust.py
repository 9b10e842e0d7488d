"""The robust certificate (derive_maps.robust): the two rounding models (scalar for diagonal inputs,
cross-talk for general ones) held against independent computations (mpmath evaluations of the
scalar model, float64 simulations of a stage with the kernels' rounding bounds, the real bf16
cascade), two-sided refusals, the falsification search against every shipped certificate, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

from anvil_fast.core.cascade import fast_cascade
from anvil_fast.core.eager import eager_bf16_cascade
from anvil_ref.constants import ANVIL_MAPS, BF16_UNIT_ROUNDOFF, FROBENIUS_MARGIN, SAFE_MARGIN_SLACK
from derive_maps.errors import DeriveMapsError, parse_real
from derive_maps.falsify import ADVERSARIAL, FALSIFIER_2X2, padded, search
from derive_maps.frontier import CLASSES, DATA, exact_set
from derive_maps.robust import (RoundingModel, _input_interval, cross_frame, reached, resolution_floor,
                                resolution_limits, robust_envelope, robust_verdict, rounding_model, safe_u)
from derive_maps.stage_errors import stage_bound

SEED_U = 1 / Fraction(FROBENIUS_MARGIN)
WIDE_SLACK = Fraction(1, 64)
U = "1/1.05"

#: Sets of a frontier certified under a scalar model of every rounding (each relative to the value it
#: carries, no cross-talk): (n maps, l) -> safety headroom h of exact_set(n, l, U, h), no cushion.
SCALAR_SETS = {(7, "1/100"): Fraction(1, 128), (6, "1/1000"): Fraction(3, 256), (5, "1/300"): Fraction(3, 256),
               (4, "1/100"): Fraction(3, 256)}


def diagonal_model():
    return rounding_model("safe", rows=768, cols=768, inputs="diagonal")


def _iterate_only(delta: float) -> RoundingModel:
    return RoundingModel(delta_x=delta, delta_gram=0.0, delta_b=0.0, gamma_b=0.0, gamma_y=0.0, delta0=0.0)


def _cascade(x: torch.Tensor, maps, u) -> torch.Tensor:
    """The package's eager SAFE-order bf16 cascade at the total margin 1/u (fp32 products)."""
    return eager_bf16_cascade(x, maps=maps, margin=float(1 / parse_real(u, "u")), fp32_trace=True, prescale=True,
                              gemm="fp32")


def _mp_output(maps, x, e, m: RoundingModel):
    """The scalar model's output for input x and one perturbation sequence, in mpmath (30 digits):
    written from the module docstring's equations, independently of the interval code. ``e`` is an
    array [stages, 6] of numbers in [-1, 1] scaling (Gram, delta_b, gamma_b, gamma_y, delta_x); e0
    scales the first iterate's rounding."""
    dA = (1 + m.delta_gram) * (1 + m.gamma_gram) - 1
    with mpmath.workdps(30):
        s = mpmath.mpf(float(x)) * (1 + mpmath.mpf(float(e[0][5])) * m.delta_x)
        for (a, b, c), (eA, eB, gB, gY, eX, _) in zip(maps, e):
            a, b, c = mpmath.mpf(a), mpmath.mpf(b), mpmath.mpf(c)
            t = s * s * (1 + mpmath.mpf(float(eA)) * dA)
            h = (b * t + c * t * t) * (1 + mpmath.mpf(float(eB)) * m.delta_b) \
                + mpmath.mpf(float(gB)) * m.gamma_b * (abs(b) * t + abs(c) * t * t)
            y = s * (a + h) + mpmath.mpf(float(gY)) * m.gamma_y * (abs(a) + abs(h)) * abs(s)
            s = y * (1 + mpmath.mpf(float(eX)) * m.delta_x)
            if abs(s) > 1e40:
                return mpmath.inf
        return s


# ---------------------------------------------------------------------------------------------
# The scalar model (diagonal inputs).

def test_faithful_setting_is_refused():
    # the seed's margin without slack under FAITHFUL's rounding model (bf16 Gram-diagonal trace)
    v = robust_verdict(ANVIL_MAPS, rounding_model("faithful", rows=768, cols=768, inputs="diagonal"), l=None,
                       u=SEED_U)
    assert not v.passed
    assert v.headroom.blown_up and v.headroom.f_max_reached >= 1e49  # a perturbation sequence reaches it
    assert "blows up" in v.reason
    # and for general inputs the cross-talk of every stage only adds to it
    assert not robust_verdict(ANVIL_MAPS, rounding_model("faithful", rows=2, cols=2), l=None, u=SEED_U).passed


def test_seed_margin_has_no_room_for_a_tenth_of_a_bf16_unit():
    # ANVIL_MAPS' headroom above the Frobenius bound is less than one rounding: a relative 1e-4
    # (1/39 of a bf16 unit) on the iterates already reaches an output above 20
    e = robust_envelope(ANVIL_MAPS, 0, SEED_U, _iterate_only(1e-4))
    assert e.f_max_reached > 20
    assert not robust_verdict(ANVIL_MAPS, _iterate_only(1e-4), l=None, u=SEED_U).passed


def test_wide_margin_passes_and_brackets():
    v = robust_verdict(ANVIL_MAPS, diagonal_model(), l="1/300", u=safe_u(WIDE_SLACK))
    assert v.passed, v.reason
    h, e = v.headroom, v.envelope
    assert not h.blown_up and h.converged and e.converged
    assert 1 < h.f_max_reached <= h.f_max_certified <= 1 + 2 ** -5
    # the bracket is tight: the certified bound is within 25% of the reached headroom
    assert h.headroom_certified <= 1.25 * h.headroom_reached
    # two-sided: the minimum on [l, u] is certified too, and bracketed
    assert 1 / (1 + 2 ** -5) <= e.f_min_certified <= e.f_min_reached < 1
    assert np.isfinite(e.max_abs_log_certified)


def test_safe_slack_is_refused_under_the_worst_case_model():
    # SAFE's slack 2^-7 covers the typical roundings (see tests/test_near_rank1.py), not every
    # per-element alignment of the worst case
    assert not robust_verdict(ANVIL_MAPS, diagonal_model(), l=None, u=safe_u(SAFE_MARGIN_SLACK)).passed


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
    m = diagonal_model()
    u = safe_u(WIDE_SLACK)
    e = robust_envelope(ANVIL_MAPS, "1/300", u, m)
    rng = np.random.default_rng(7)
    # the certificate's input interval is widened by the trace and by eps (MIN_NORM); sample it all
    xs = np.geomspace(e.x_lo, e.x_hi, 300)
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
    for m, u in ((diagonal_model(), None), (rounding_model("safe", rows=2, cols=2), safe_u(Fraction(1, 4)))):
        xs = np.array([0.01, 0.3, 0.7])
        frame = cross_frame(ANVIL_MAPS, u, m) if m.cross_talk else None
        r_lo, r_hi = reached(ANVIL_MAPS, xs, m, frame)
        for x, lo, hi in zip(xs, r_lo, r_hi):
            e = robust_envelope(ANVIL_MAPS, Fraction(x) * (1 - Fraction(1, 10 ** 12)), Fraction(x), m,
                                margin_u=u, cells=4, pieces=4)
            assert e.f_min_certified <= float(lo) <= float(hi) <= e.f_max_certified


# ---------------------------------------------------------------------------------------------
# The cross-talk model (general inputs).

def _simulated_stage(X: np.ndarray, coeffs, m: RoundingModel, rng, aligned: bool) -> np.ndarray:
    """One stage of the cascade on the float64 matrix X (wide/square: A = X X^T, Y = a X + B X) with
    every rounding replaced by a perturbation at the bound the kernels promise: |E| = delta |M| at
    each bf16 rounding, gamma times the absolute terms at each fp32 sum; signs random, or aligned
    with the top singular vectors (pushing the largest singular value up)."""
    a, b, c = coeffs
    U_, _, Vt = np.linalg.svd(X)

    def signs(shape, left, right):
        if aligned:
            return np.sign(np.outer(left, right)) + (np.outer(left, right) == 0)
        return rng.choice([-1.0, 1.0], size=shape)

    def sym(S):
        return np.triu(S) + np.triu(S, 1).T
    u1, v1 = U_[:, 0], Vt[0]
    A = X @ X.T
    absXX = np.abs(X) @ np.abs(X).T
    At = A + sym(signs(A.shape, u1, u1)) * (m.delta_gram * np.abs(A)) \
        + sym(signs(A.shape, u1, u1)) * ((1 + m.delta_gram) * m.gamma_gram * absXX)
    Bf = b * At + c * At @ At + sym(signs(A.shape, u1, u1)) * m.gamma_b * (abs(c) * np.abs(At) @ np.abs(At)
                                                                             + abs(b) * np.abs(At))
    Bt = Bf + sym(signs(A.shape, u1, u1)) * m.delta_b * np.abs(Bf)
    Yf = a * X + Bt @ X + signs(X.shape, u1, v1) * m.gamma_y * (abs(a) * np.abs(X) + np.abs(Bt) @ np.abs(X))
    return Yf + signs(X.shape, u1, v1) * m.delta_x * np.abs(Yf)


@pytest.mark.parametrize("m_rows,n_cols", [(2, 2), (2, 8), (3, 5), (8, 8)])
def test_weyl_bound_holds_under_the_kernels_rounding_bounds(m_rows, n_cols):
    # the bound of one stage, evaluated with the matrix's own norms, against a float64 simulation of
    # the stage with every rounding at its bound: never exceeded, and not vacuous
    model = rounding_model("safe", rows=m_rows, cols=n_cols)
    rng = np.random.default_rng(m_rows * 100 + n_cols)
    worst = 0.0
    for trial in range(60):
        k = min(m_rows, n_cols)
        t = np.sort(np.exp(rng.uniform(np.log(1e-3), 0, k)))[::-1]
        Q1 = np.linalg.qr(rng.standard_normal((m_rows, k)))[0]
        Q2 = np.linalg.qr(rng.standard_normal((n_cols, k)))[0]
        X = (Q1 * t) @ Q2.T
        X = X / (1.05 * np.linalg.norm(X))
        # the maps of ANVIL_MAPS and of a greedy set, and a pure scaling (b = c = 0: B = 0, so the
        # iterate's own rounding, u ||Y||_F, is all there is)
        for coeffs in (ANVIL_MAPS[0], ANVIL_MAPS[2], exact_set(4, "1/100", U)[0], (1.5, 0.0, 0.0)):
            s_in = np.linalg.svd(X, compute_uv=False)
            p = np.sort(np.abs(s_in * (coeffs[0] + s_in ** 2 * (coeffs[1] + coeffs[2] * s_in ** 2))))[::-1]
            bound = float(stage_bound(torch.as_tensor(X)[None], coeffs, model, tall=False)[0])
            for aligned in (False, True):
                Y = _simulated_stage(X, coeffs, model, rng, aligned)
                err = float(np.abs(np.linalg.svd(Y, compute_uv=False) - p).max())
                assert err <= bound, (trial, coeffs, aligned, err, bound)
                worst = max(worst, err / bound)
    assert worst > 0.05


@pytest.mark.slow
def test_scalar_model_is_falsified_by_a_two_by_two_input():
    # The scalar model certifies the seven-map l = 1/100 set of SCALAR_SETS at the margin 1.05 for
    # diagonal inputs (where every rounding is relative to the value it carries), but the 2 x 2
    # FALSIFIER_2X2 (normalized singular values 0.883, 0.358) explodes in the package's own bf16
    # cascade, alone and padded into bank shapes: a rounding moves every singular value by
    # u ||M||_F, not u sigma_i. The cross-talk model refuses the set for 2 x n blocks.
    maps = exact_set(7, "1/100", U, SCALAR_SETS[(7, "1/100")])
    u = Fraction(20, 21)
    x = torch.tensor(FALSIFIER_2X2)
    s_in = torch.linalg.svdvals(x.double()) / (1.05 * torch.linalg.matrix_norm(x.double()))
    assert torch.allclose(s_in, torch.tensor([0.8826, 0.3580], dtype=torch.float64), atol=1e-3)
    scalar = robust_verdict(maps, diagonal_model(), l="1/100", u=u)
    assert scalar.passed and scalar.headroom.f_max_certified < 1.02
    out = torch.linalg.svdvals(_cascade(x, maps, u).double())
    assert out.max() > 100 * scalar.headroom.f_max_certified
    for shape in ((256, 768), (768, 256)):
        big = padded(x, shape, at=(3, 5))
        y_eager = _cascade(big, maps, u)
        y_fast = fast_cascade(big, maps=maps, margin=1.05 / (1 + SAFE_MARGIN_SLACK), backend="torch")
        # zero rows and columns change nothing: the block comes out bit for bit (a tall bank takes the
        # Gram of the columns: the block's transpose in the square orientation), the rest stays 0
        alone = _cascade(x, maps, u) if shape[0] <= shape[1] else _cascade(x.T.contiguous(), maps, u).T
        assert torch.equal(y_eager[3:5, 5:7], alone)
        assert torch.equal(y_fast[3:5, 5:7], y_eager[3:5, 5:7])
        assert int(torch.count_nonzero(y_fast)) <= 4
    assert float(torch.linalg.svdvals(_cascade(padded(x, (256, 768), at=(3, 5)), maps, u)[3:5, 5:7].double()).max()) > 100
    two = robust_verdict(maps, rounding_model("safe", rows=2, cols=768), l="1/100", u=u)
    assert not two.passed


def test_the_low_end_is_certified_and_refused_when_it_collapses():
    # Diagonal inputs: the scalar-model sets of SCALAR_SETS flip a sign (six maps, l = 1/1000) or
    # collapse (five maps, l = 1/300) in the real cascade: cancellation in the first map, whose
    # p(x)/x nearly vanishes in the middle of the interval. A two-sided certificate contains what
    # the cascade gives there and refuses both sets.
    u = Fraction(20, 21)
    for (n, l), want in (((6, "1/1000"), 0.0), ((5, "1/300"), 0.9)):
        maps = exact_set(n, l, U, SCALAR_SETS[(n, l)])
        t2 = np.geomspace(float(Fraction(l)) * 1.2, 0.67, 4096)
        x = torch.zeros(t2.size, 2, 2, dtype=torch.float64)
        x[:, 0, 0], x[:, 1, 1] = 1.0, torch.as_tensor(t2)
        y = _cascade(x, maps, u).double()
        s_in = (torch.stack([x[:, 0, 0], x[:, 1, 1]], 1).to(torch.bfloat16).double()
                / (1.05 * torch.linalg.matrix_norm(x.to(torch.bfloat16).double())[:, None]))
        inside = ((s_in >= float(Fraction(l))) & (s_in <= float(u))).all(1)
        diag = torch.stack([y[:, 0, 0], y[:, 1, 1]], 1)[inside]
        signed_min = float(diag.min())
        assert signed_min < want, (n, l, signed_min)          # a sign flip / a collapse, measured
        v = robust_verdict(maps, diagonal_model(), l=l, u=u)
        assert not v.passed and "on [l, u]" in v.reason
        # the model reaches below the limit, and its certified minimum holds what the cascade gives
        assert v.envelope.f_min_reached < v.lo_limit
        assert v.envelope.f_min_certified <= signed_min


def test_envelopes_of_collapsing_sets_finish():
    # the low side is decided once the model reaches 0 or below, and the work is bounded: the
    # envelopes of the l = 1/1000 scalar-model sets (which flip signs) and of the four-map l = 1/300
    # set come back in seconds, converged, with a minimum the model reaches
    u = Fraction(20, 21)
    for (n, l), h in (((6, "1/1000"), "3/256"), ((4, "1/300"), "5/128")):
        maps = exact_set(n, l, U, h)
        e = robust_envelope(maps, l, u, diagonal_model(), margin_u=u)
        assert e.converged and e.cells < 10_000
        assert e.f_min_certified <= e.f_min_reached < 0.1
        assert (e.f_min_reached < 0) == (n == 6)


def test_resolution_floor_refuses_the_low_end_at_once():
    # a bf16 iterate with two singular values moves each by up to u ||Z||_F: an input singular
    # value below that may become 0, whatever the maps
    m = rounding_model("safe", rows=2, cols=2)
    floor = resolution_floor(m, U)
    assert BF16_UNIT_ROUNDOFF / 1.05 <= floor <= 1.0001 * BF16_UNIT_ROUNDOFF / 1.05
    v = robust_verdict(ANVIL_MAPS, m, l="1/300", u=SEED_U)
    assert not v.passed and "reaches 0" in v.reason and v.headroom is None
    assert resolution_floor(diagonal_model(), U) == 0.0
    lim = resolution_limits(m)
    assert lim["iterate"] == BF16_UNIT_ROUNDOFF and lim["gram"] == math.sqrt(BF16_UNIT_ROUNDOFF)


def test_a_frame_that_blows_up_refuses_every_input():
    # at the seed's margin the top singular value may leave [-1e50, 1e50]; under cross-talk that
    # leaves no other singular value bounded
    m = rounding_model("safe", rows=2, cols=2)
    assert cross_frame(ANVIL_MAPS, SEED_U, m).blown
    e = robust_envelope(ANVIL_MAPS, "1/10", SEED_U, m)
    assert e.blown_up and not math.isfinite(e.f_max_certified)
    v = robust_verdict(ANVIL_MAPS, m, l=None, u=SEED_U)
    assert not v.passed and "blow up" in v.reason


# ---------------------------------------------------------------------------------------------
# The falsification search, against every certificate the package ships.

def _shipped():
    d = json.loads((DATA / "frontier.json").read_text())
    for r in d["rows"]:
        for cls, rb in r["robust"].items():
            if rb is not None and rb["passed"]:
                maps = tuple(tuple(float.fromhex(v) for v in m) for m in rb["maps_hex"])
                yield f"{r['n_maps']} maps, l = {r['l']}, {cls}", maps, r["l"], r["u"], cls, rb
    for slack, per in d["anvil"]["robust"].items():
        for cls, c in per.items():
            if c["passed"]:
                u = safe_u(Fraction(slack))
                yield f"ANVIL_MAPS slack {slack}, {cls}", ANVIL_MAPS, "1/300", f"{u.numerator}/{u.denominator}", cls, c


def test_shipped_certificates_hold_against_the_falsification_search():
    shipped = list(_shipped())
    assert len(shipped) >= 4
    classes = {c for *_, c, _ in shipped}
    assert classes == set(CLASSES)            # every class has certified sets
    falsifier = torch.tensor(FALSIFIER_2X2, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    for name, maps, l, u, cls, cert in shipped:
        kind = CLASSES[cls][0]["inputs"]
        for block in CLASSES[cls][1]:
            f = search(maps, u=u, l=l, inputs=kind, block=block, budget=256, rounds=1, seed=11)
            assert not f.violations(cert["robust_max_certified"], cert["robust_min_certified"]), name
        if kind == "general":
            # the falsifier and its neighbourhood (rotations by up to 3e-3 rad)
            ang = (torch.rand(64, 2, generator=g, dtype=torch.float64) - 0.5) * 6e-3
            c, s = torch.cos(ang), torch.sin(ang)
            R1 = torch.stack([torch.stack([c[:, 0], -s[:, 0]], 1), torch.stack([s[:, 0], c[:, 0]], 1)], 1)
            R2 = torch.stack([torch.stack([c[:, 1], -s[:, 1]], 1), torch.stack([s[:, 1], c[:, 1]], 1)], 1)
            y = _cascade(R1 @ falsifier @ R2, maps, u)
            assert float(torch.linalg.svdvals(y.double()).max()) <= cert["robust_max_certified"], name


def test_the_search_finds_what_the_scalar_model_misses():
    # the search is able to fail a certificate: seeded with the known adversarial 2 x 2 inputs, it
    # breaks the scalar model's envelope of the seven-map l = 1/100 set of SCALAR_SETS
    maps = exact_set(7, "1/100", U, SCALAR_SETS[(7, "1/100")])
    env = robust_envelope(maps, 0, Fraction(20, 21), diagonal_model())
    f = search(maps, u=U, l="1/100", inputs="general", block=(2, 2), budget=256, rounds=1,
               seeds=ADVERSARIAL[(2, 2)], seed=3)
    assert f.violations(env.f_max_certified)
    assert not f.violations(float("inf"), 0.0)             # the violation is the max, not a flip


# ---------------------------------------------------------------------------------------------
# The derived model, input checks, the CLI.

def test_rounding_model_derivation():
    s, f = rounding_model("safe", rows=768, cols=768), rounding_model("faithful", rows=768, cols=768)
    assert s.delta_x == BF16_UNIT_ROUNDOFF and s.delta_b == BF16_UNIT_ROUNDOFF == s.delta_gram
    assert 0 < s.gamma_gram < 0.05 * BF16_UNIT_ROUNDOFF            # gamma_768 of the fp32 sums
    assert 0 < s.delta0 < 1e-5                     # fp32 trace: a few dozen fp32 roundings
    assert f.delta0 > BF16_UNIT_ROUNDOFF           # bf16 diagonal: a whole bf16 unit
    assert f.delta_x > 2 * BF16_UNIT_ROUNDOFF      # the split a X + X B rounds twice
    assert s.singular_values == 768 and rounding_model("safe", rows=2, cols=768).singular_values == 2
    d = diagonal_model()
    assert d.singular_values == 1 and d.gamma_gram == 0 and d.gamma_b < s.gamma_b
    # longer fp32 sums, larger gamma
    assert rounding_model("safe", rows=2816, cols=768).gamma_gram > s.gamma_gram
    # eps at the low end: 1e-6 / (1.05 min_norm)
    assert math.isclose(rounding_model(min_norm=1e-2).delta_eps, 1e-6 / 1.05e-2, rel_tol=1e-9)
    with pytest.raises(DeriveMapsError, match="config"):
        rounding_model("fast")
    with pytest.raises(DeriveMapsError, match="inputs"):
        rounding_model(inputs="sparse")
    with pytest.raises(DeriveMapsError, match="delta_x"):
        RoundingModel(delta_x=-1e-3, delta_gram=0, delta_b=0, gamma_b=0, gamma_y=0, delta0=0)
    with pytest.raises(DeriveMapsError, match="singular_values"):
        RoundingModel(delta_x=0, delta_gram=0, delta_b=0, gamma_b=0, gamma_y=0, delta0=0, singular_values=0)


def test_trace_and_eps_widen_the_input_interval():
    d0, de = 1e-3, 1e-3
    lo, hi = _input_interval(Fraction(1, 300), SEED_U, d0, de)
    # x = sigma / sqrt(tr (1 + e)): the end moves to u / sqrt(1 - d0) and l to l / sqrt(1 + d0),
    # and eps divides l by up to 1 + de
    assert Fraction(*hi.as_integer_ratio()) ** 2 * (1 - Fraction(d0)) >= SEED_U ** 2
    assert (Fraction(*lo.as_integer_ratio()) * (1 + Fraction(de))) ** 2 * (1 + Fraction(d0)) <= Fraction(1, 300) ** 2


def test_bad_input_is_refused():
    with pytest.raises(DeriveMapsError, match="interval"):
        robust_envelope(ANVIL_MAPS, "1", "0.5", rounding_model())
    with pytest.raises(DeriveMapsError, match="model"):
        robust_envelope(ANVIL_MAPS, 0, "1/2", 0.01)
    with pytest.raises(DeriveMapsError, match="margin_u"):
        robust_envelope(ANVIL_MAPS, 0, "1/2", rounding_model(), margin_u="1/3")


def test_cli_refuses_faithful_and_prints_json():
    r = subprocess.run([sys.executable, "-m", "derive_maps", "robust", "anvil", "--config", "faithful",
                        "--inputs", "diagonal"], capture_output=True, text=True)
    assert r.returncode == 1 and "refused" in r.stdout and "blows up" in r.stdout
    r = subprocess.run([sys.executable, "-m", "derive_maps", "robust", "anvil", "--slack", "1/64", "--inputs",
                        "diagonal", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    v = d["verdict"]
    assert v["passed"] and v["headroom"]["f_max_certified"] < 1 + 2 ** -5
    assert v["envelope"]["f_min_certified"] > 1 / (1 + 2 ** -5)
    assert "diagonal" in d["covers"]
    r = subprocess.run([sys.executable, "-m", "derive_maps", "robust", "anvil", "--rows", "0"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "rows" in r.stderr
