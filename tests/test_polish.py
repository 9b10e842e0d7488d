"""derive_maps.polish: the joint minimax polish finds the known optimum and never makes a set worse."""

import math

import pytest

from anvil_ref.constants import ANVIL_MAPS
from derive_maps.certify import certify_envelope
from derive_maps.errors import DeriveMapsError
from derive_maps.polar_express import greedy
from derive_maps.polish import polish

L, U = "1e-2", "1"


@pytest.fixture(scope="module")
def optimum():
    """The greedy composition of three quintics on [1e-2, 1], log-centred: optimal (Polar Express
    Thm 4.1) for max |log F| and, rescaled, for max |F - 1|."""
    g = greedy(l=L, u=U, n_maps=3, final_recentre="geometric")
    return g.maps, certify_envelope(g.maps, L, U).max_abs_log_attained


def _perturbed(maps, eps=1e-3):
    return tuple(tuple(v * (1 + eps * (-1) ** (i + j)) for j, v in enumerate(m)) for i, m in enumerate(maps))


def test_recovers_the_optimum_from_a_perturbed_start(optimum):
    maps, e_star = optimum
    start = _perturbed(maps)
    r = polish(start, L, U, max_iter=80)
    assert r.start_error > 5 * e_star
    assert r.converged
    assert abs(r.error - e_star) <= 1e-9 * e_star
    # and the certificate of the result agrees
    e = certify_envelope(r.maps, L, U)
    assert e.max_abs_log_certified <= e_star * (1 + 2e-3)


def test_absolute_objective_reaches_tanh_of_the_log_optimum(optimum):
    # max |F - 1| and max |log F| have the same optimal shape: ratio (1+E)/(1-E) = exp(2 E_log),
    # i.e. E_abs = tanh(E_log).
    maps, e_star = optimum
    r = polish(_perturbed(maps), L, U, objective="abs", max_iter=80)
    assert abs(r.error - math.tanh(e_star)) <= 1e-9


def test_the_optimum_is_left_alone(optimum):
    maps, e_star = optimum
    r = polish(maps, L, U, max_iter=10)
    assert r.iterations == 1 and r.converged and r.maps == maps


def test_from_anvil_maps_monotone_and_deterministic():
    a = polish(ANVIL_MAPS, "1/300", "1/1.05", max_iter=8)
    b = polish(ANVIL_MAPS, "1/300", "1/1.05", max_iter=8)
    assert a.maps == b.maps and a.history == b.history
    accepted = [h["actual"] for h in a.history if h["rho"] > 0.01]
    assert accepted == sorted(accepted, reverse=True)
    assert a.error < 0.5 * a.start_error
    assert a.start_error == pytest.approx(6.5902e-4, rel=1e-4)   # ANVIL's true worst, not 4.0e-4


def test_target_stops_early():
    r = polish(ANVIL_MAPS, "1/300", "1/1.05", max_iter=50, target=3e-4)
    assert r.converged and 2e-4 < r.error <= 3e-4


@pytest.mark.parametrize("kwargs, match", [
    (dict(objective="rel"), "objective"),
    (dict(dps=5), "dps"),
    (dict(sub=-1), "sub"),
    (dict(rtol=0), "rtol"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(DeriveMapsError, match=match):
        polish(ANVIL_MAPS, "1/300", "1/1.05", **kwargs)


def test_log_objective_needs_a_positive_composite():
    with pytest.raises(DeriveMapsError, match="log F is undefined"):
        polish([(-1.0, 0.0, 0.0)], L, U)
