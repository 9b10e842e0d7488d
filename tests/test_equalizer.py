"""anvil_ref.equalizer: the lane-energy equalizer as the seed's code does it."""

from __future__ import annotations

import numpy as np
import pytest

import anvil_ref as A
from anvil_ref.equalizer import equalize, lane_energy_shape, lane_gain, lane_power, reduction_axis


def test_reduction_axis_is_the_shorter_dimension():
    assert reduction_axis((5, 3)) == -1  # tall: average over columns, one lane per row
    assert reduction_axis((3, 5)) == -2  # wide: average over rows, one lane per column
    assert reduction_axis((4, 4)) == -1  # square: rows >= cols
    assert lane_energy_shape((2, 5, 3)) == (2, 5, 1)
    assert lane_energy_shape((2, 3, 5)) == (2, 1, 5)


def test_lane_power_by_hand():
    v = np.array([[1.0, 3.0], [2.0, 0.0], [0.0, 4.0]])  # tall: per row
    np.testing.assert_allclose(lane_power(v), [[5.0], [2.0], [8.0]])
    np.testing.assert_allclose(lane_power(v.T), [[5.0, 2.0, 8.0]])


def test_equalize_one_step_by_hand():
    v = np.array([[1.0, 3.0], [2.0, 0.0], [0.0, 4.0]])
    e = np.array([[1.0], [2.0], [4.0]])
    out, e_new = equalize(v, e, beta2=0.5)
    p = np.array([[5.0], [2.0], [8.0]])
    np.testing.assert_allclose(e_new, 0.5 * e + 0.5 * p)
    g = 1 / np.sqrt(e_new)
    scaled = v * g
    np.testing.assert_allclose(out, scaled * np.linalg.norm(v) / np.linalg.norm(scaled), rtol=1e-14)


@pytest.mark.parametrize("shape", [(3, 40, 12), (3, 12, 40), (2, 16, 16)])
def test_frobenius_norm_is_kept(shape):
    rng = np.random.default_rng(0)
    v = rng.standard_normal(shape) * rng.uniform(0.1, 10, (shape[0], 1, 1))
    e = rng.uniform(0.0, 2.0, lane_energy_shape(shape))
    out, _ = equalize(v, e, beta2=0.9)
    np.testing.assert_allclose(np.linalg.norm(out, axis=(-2, -1)), np.linalg.norm(v, axis=(-2, -1)), rtol=1e-13)


@pytest.mark.parametrize("shape", [(2, 30, 8), (2, 8, 30)])
def test_equal_lane_rms_when_energy_equals_power(shape):
    rng = np.random.default_rng(1)
    v = rng.standard_normal(shape) * rng.uniform(0.1, 5.0, lane_energy_shape(shape))  # lanes of unequal size
    e = lane_power(v)  # the EMA then stays at the current power for any beta2
    out, e_new = equalize(v, e, beta2=0.37)
    np.testing.assert_allclose(e_new, e, rtol=1e-14)
    rms = np.sqrt(lane_power(out))
    np.testing.assert_allclose(rms, np.broadcast_to(rms.mean(axis=(-2, -1), keepdims=True), rms.shape), rtol=1e-12)


def test_zero_update_gives_zero_and_decays_energy():
    e = np.full((4, 1), 3.0)
    out, e_new = equalize(np.zeros((4, 2)), e, beta2=0.9)
    assert np.all(out == 0.0)
    np.testing.assert_allclose(e_new, 0.9 * e)


def test_gain_floor():
    np.testing.assert_allclose(lane_gain(np.array([0.0, 4.0])), [1e5, 0.5])
    assert A.LANE_ENERGY_FLOOR == 1e-10


def test_bad_input():
    with pytest.raises(A.ReferenceInputError, match="one entry per lane"):
        equalize(np.ones((5, 3)), np.ones((1, 3)), beta2=0.9)  # the wide shape for a tall matrix
    with pytest.raises(A.ReferenceInputError, match="non-finite"):
        equalize(np.array([[np.inf, 1.0]]), np.ones((1, 2)), beta2=0.9)
    with pytest.raises(A.ReferenceInputError, match="matrix"):
        reduction_axis((3,))


# =================================================================================================
# anvil_fast vs anvil_ref (owner: the anvil_fast helper). The fast equalizer (anvil_fast/equalizer.py),
# unguarded (FAITHFUL) and guarded (SAFE), on tall / wide / square banks: bf16 output within
# tests/tolerances.py, lane energy within LANE_ENERGY_ULPS.

@pytest.mark.parametrize("config", ["safe", "faithful"])
@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (2, 32, 32)])
def test_fast_equalizer_matches_reference(config, shape):
    import torch

    from anvil_fast import difftest as D
    from anvil_fast.cascade import get_config
    from tests.tolerances import check

    v = A.cascade(torch.randn(shape), margin=1.05)
    row, _ = D.equalizer_row(v, shape, "gaussian", get_config(config), compile=False)
    assert check("equalizer", fast=row.fast, eager=row.eager, floor=row.floor, ulps=row.ulps), D.format_table([row])
