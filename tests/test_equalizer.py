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
# anvil_fast vs anvil_ref (owner: the anvil_fast helper). The fast equalizer (anvil_fast/kernels/equalizer.py),
# unguarded (FAITHFUL) and guarded (SAFE), on tall / wide / square banks: bf16 output within
# anvil_fast/core/tolerances.py, lane energy within LANE_ENERGY_ULPS.

@pytest.mark.parametrize("config", ["safe", "faithful"])
@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (2, 32, 32)])
def test_fast_equalizer_matches_reference(config, shape):
    import torch

    from anvil_fast.studies import difftest as D
    from anvil_fast.core.cascade import get_config
    from anvil_fast.core.tolerances import check_row

    v = A.cascade(torch.randn(shape, generator=torch.Generator().manual_seed(1)), margin=1.05)
    row, _ = D.equalizer_row(v, shape, "gaussian", get_config(config), compile=False)
    assert check_row(row, same_backend=True), D.format_table([row])


# The Triton equalizer (SAFE on CUDA): on CPU in Triton's interpreter and on CUDA (the triton_dev
# fixture of tests/conftest.py).
@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (2, 32, 32), (2, 130, 3)])
def test_triton_equalizer_matches_reference(shape, triton_dev):
    import torch

    from anvil_fast.studies import difftest as D
    from anvil_fast.core.cascade import SAFE
    from anvil_fast.core.tolerances import check_row

    v = A.cascade(torch.randn(shape, generator=torch.Generator().manual_seed(1)), margin=1.05)
    row, _ = D.equalizer_row(v, shape, "gaussian", SAFE, compile=False, backend="triton", device=triton_dev)
    assert check_row(row, same_backend=triton_dev == "cpu"), D.format_table([row])


def _equalize_both(v, energy, dev, *, guard=True):
    import torch

    from anvil_fast.kernels.equalizer import equalize as fast_equalize

    red = reduction_axis(v.shape)
    out = []
    for fused_, backend in ((True, "triton"), (False, "torch")):
        vf, ef = v.clone().to(dev if fused_ else "cpu"), energy.clone().to(dev if fused_ else "cpu")
        trips = torch.zeros(v.shape[0], dtype=torch.int32, device=vf.device) if guard else None
        fast_equalize(vf, ef, beta2=0.95, red_dim=red, guard_trips=trips, compile=False, fused=fused_, backend=backend)
        out.append((vf.cpu(), ef.cpu(), None if trips is None else trips.cpu()))
    return out


@pytest.mark.parametrize("guard", [True, False])
def test_triton_equalizer_equals_the_torch_one_up_to_summation_order(guard, triton_dev):
    # Same operations; the fp32 sums run in another order, so a gain may round to the neighbouring
    # bf16 value: V within two bf16 roundings, the lane energy within LANE_ENERGY_ULPS (one lerp),
    # the guard's verdicts identical (matrix 1 is scaled past the bound, matrix 2 holds a NaN).
    import torch

    from anvil_fast.studies.difftest import err_ulps
    from anvil_fast.core.tolerances import LANE_ENERGY_ULPS

    shape = (4, 96, 40)
    v = A.cascade(torch.randn(shape, generator=torch.Generator().manual_seed(2)), margin=1.05).bfloat16()
    energy = v.float().square().mean(dim=-1, keepdim=True) * 1.5
    if guard:
        v[1] *= 8
        v[2, 3, 4] = float("nan")
    (va, ea, ta), (vb, eb, tb) = _equalize_both(v, energy, triton_dev, guard=guard)
    if guard:
        assert ta.tolist() == tb.tolist() == [0, 1, 1, 0]
        assert not va[1:3].any(), "a refused matrix gets a zero update"
        assert torch.equal(ea[1:3], energy[1:3]), "a refused matrix keeps its lane energy"
    ok = [0, 3] if guard else [0, 1, 2, 3]
    assert err_ulps(ea[ok], eb[ok].double(), torch.maximum(ea[ok].abs(), eb[ok].abs())) <= LANE_ENERGY_ULPS
    diff = (va[ok].float() - vb[ok].float()).abs()
    assert bool((diff <= 2 * torch.finfo(torch.bfloat16).eps * vb[ok].float().abs()).all())


def test_triton_equalizer_does_not_depend_on_the_bank_size(triton_dev):
    # The reason for the kernels: a matrix's result must not depend on how many matrices share its
    # bank (the sharded optimizer equals the one-process run bit for bit only then).
    import torch

    from anvil_fast.kernels.equalizer import equalize as fast_equalize

    shape = (4, 40, 24)
    v = A.cascade(torch.randn(shape, generator=torch.Generator().manual_seed(3)), margin=1.05).bfloat16().to(triton_dev)
    e = v.float().square().mean(dim=-1, keepdim=True)
    whole, we, wt = v.clone(), e.clone(), torch.zeros(4, dtype=torch.int32, device=v.device)
    fast_equalize(whole, we, beta2=0.9, red_dim=-1, guard_trips=wt, fused=True, backend="triton")
    for s in (slice(0, 1), slice(1, 4)):
        part, pe, pt = v[s].clone(), e[s].clone(), torch.zeros(s.stop - s.start, dtype=torch.int32, device=v.device)
        fast_equalize(part, pe, beta2=0.9, red_dim=-1, guard_trips=pt, fused=True, backend="triton")
        assert torch.equal(part, whole[s]) and torch.equal(pe, we[s])


def test_fast_equalizer_has_the_reference_name_and_keyword_only_beta2():
    import inspect

    from anvil_fast.kernels import equalizer as FE
    from anvil_ref import equalizer as RE

    for fn in (FE.equalize, RE.equalize):
        assert inspect.signature(fn).parameters["beta2"].kind == inspect.Parameter.KEYWORD_ONLY, fn.__module__


def test_fast_equalizer_defaults_to_the_reference_lane_rule():
    # A wide bank: lanes are columns (reduction over rows, axis -2); the default must pick it.
    import torch

    from anvil_fast.kernels.equalizer import equalize as fast_equalize

    v = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(41)).bfloat16()
    e = torch.ones(2, 1, 5)
    by_default, explicit = v.clone(), v.clone()
    e1, e2 = e.clone(), e.clone()
    fast_equalize(by_default, e1, beta2=0.5, compile=False)
    fast_equalize(explicit, e2, beta2=0.5, red_dim=reduction_axis(v.shape), compile=False)
    assert reduction_axis(v.shape) == -2
    assert torch.equal(by_default, explicit) and torch.equal(e1, e2)
    ref_v, ref_e = equalize(v.double().numpy(), e.double().numpy(), beta2=0.5)
    np.testing.assert_allclose(e1.double().numpy(), ref_e, rtol=1e-6)
