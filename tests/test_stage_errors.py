"""Measured per-stage errors of the fast SAFE cascade stay inside the robust certificate's cross-talk
model (derive_maps.stage_errors): every sorted singular value of a stage's bf16 output within the
model's Weyl bound of the float64 map of the same input; small bf16 banks on the CPU (2 x 2 blocks
among them), the bank shapes on a GPU."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from anvil_fast.studies.near_rank1 import near_rank1
from derive_maps.falsify import FALSIFIER_2X2
from derive_maps.frontier import exact_set
from derive_maps.robust import RoundingModel, rounding_model
from derive_maps.stage_errors import measure, stage_bound


def _banks(rows, cols, batch, device):
    g = torch.Generator().manual_seed(rows * 10007 + cols)
    return {"random": torch.randn(batch, rows, cols, generator=g).to(device),
            "near_rank1": near_rank1(batch, rows, cols, seed=rows + cols).to(device)}


def _check(errors, n_maps=6):
    assert [e.stage for e in errors] == list(range(n_maps + 1))
    for e in errors:
        assert 0 <= e.measured <= e.bound, e
    # the measurement sees the roundings (a stage error of exactly 0 would mean it compared a tensor
    # with itself)
    assert max(e.measured for e in errors[1:]) > 1e-5


@pytest.mark.parametrize("rows,cols", [(64, 48), (48, 64), (48, 48), (2, 2), (2, 8)])
def test_stage_errors_within_the_model_cpu(rows, cols):
    for x in _banks(rows, cols, 2 if rows > 2 else 32, "cpu").values():
        _check(measure(x, backend="torch"))


def test_stage_errors_within_the_model_triton_interpreter():
    for x in _banks(32, 24, 1, "cpu").values():
        _check(measure(x, backend="triton"))


def test_the_falsifier_stays_inside_the_cross_talk_model():
    # the 2 x 2 input that breaks a scalar model: its first stage moves the top singular value by
    # 1.1% (a relative 2^-8 per rounding would allow 0.8%), inside the Weyl bound of the block
    maps = exact_set(7, "1/100", "1/1.05", Fraction(1, 128))
    errs = measure(torch.tensor(FALSIFIER_2X2)[None], maps=maps, backend="torch", slack=0.0)
    _check(errs, n_maps=7)
    assert errs[1].measured > 0.01


def test_the_check_can_fail():
    # a model without the bf16 roundings is violated by the same measurement
    none = RoundingModel(delta_x=0.0, delta_gram=0.0, delta_b=0.0, gamma_b=0.0, gamma_y=0.0, delta0=0.0,
                         singular_values=48)
    errors = measure(_banks(48, 48, 2, "cpu")["random"], backend="torch", model=none)
    assert any(e.measured > e.bound for e in errors[1:])


def test_stage_bound_is_about_the_roundings():
    m = rounding_model("safe", rows=2, cols=2)
    # a rank-1 2 x 2 matrix of top singular value s: at s = 1 the map (2, -1.5, 0.5) gives p = 1,
    # h = -1, and the bound is its own rounding plus the Gram's and B's carried through: 1 to 5 units
    for s in (0.5, 1.0):
        X = torch.tensor([[[s, 0.0], [0.0, 0.0]]], dtype=torch.float64)
        b = stage_bound(X, (2.0, -1.5, 0.5), m, tall=False)
        p = s * (2.0 - 1.5 * s * s + 0.5 * s ** 4)
        assert m.delta_x * p <= b[0] <= 5 * m.delta_x * max(p, s)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(768, 768), (256, 768), (768, 256), (2816, 768)])
def test_stage_errors_within_the_model_gpu(rows, cols):
    for x in _banks(rows, cols, 8, "cuda").values():
        _check(measure(x))
