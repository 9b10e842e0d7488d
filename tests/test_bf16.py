"""derive_maps.bf16: the bf16-realized envelope measures what it says."""

import numpy as np
import pytest

from derive_maps.bf16 import QUICK_SHAPES, bf16_envelope, spectrum, test_matrix as make_matrix
from derive_maps.errors import DeriveMapsError

L, U = 1 / 300, 1 / 1.05


@pytest.mark.parametrize("kind", ["spread", "near_rank1", "flat"])
@pytest.mark.parametrize("k", [64, 256, 768])
def test_spectra_fit_the_cascade_normalization(kind, k):
    t = spectrum(kind, k, l=L, u=U)
    assert t.shape == (k,)
    assert np.all(np.diff(t) <= 0)
    assert abs(np.sum(t ** 2) - U * U) <= 1e-12
    assert t.min() >= 1.15 * L * (1 - 1e-12) and t.max() <= U
    if kind == "near_rank1" and k == 64:
        assert t[0] >= 0.999 * U


def test_matrix_has_the_prescribed_singular_values():
    X, t = make_matrix((96, 40), "spread", 3, l=L, u=U)
    import torch
    s = torch.linalg.svdvals(X).numpy()
    assert np.allclose(s, t, rtol=1e-12, atol=0)


def test_identity_maps_return_the_input_spectrum():
    # With p(s) ~ s the cascade only normalizes and rounds to bf16: the measured output range is
    # the (bf16-rounded) input range, to bf16 accuracy. (b = c = 2^-100 rather than 0: torch 2.13's
    # CPU bf16 baddbmm with alpha = 0 returns its input unscaled, or NaN, for matrices >= 32 wide.)
    tiny = 2.0 ** -100
    e = bf16_envelope([(1.0, tiny, tiny)], shapes=QUICK_SHAPES, seeds=(0,))
    assert e.matrices == len(QUICK_SHAPES) * 3
    assert e.lo == pytest.approx(e.input_lo, rel=2e-2)
    assert e.hi == pytest.approx(e.input_hi, rel=1e-2)
    assert e.input_hi > 0.99 * U


def test_anvil_maps_in_bf16():
    e = bf16_envelope("anvil", shapes=QUICK_SHAPES, seeds=(0,))
    # the exact composite is within 6.6e-4 of 1; bf16 rounding of the last maps dominates
    assert 0.99 < e.lo < 0.9993 and 1.0004 < e.hi < 1.01
    assert set(e.per_kind) == {"spread", "near_rank1", "flat"}


def test_bad_kind():
    with pytest.raises(DeriveMapsError, match="spectrum kind"):
        spectrum("sparse", 10, l=L, u=U)
