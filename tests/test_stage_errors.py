"""Measured per-stage errors of the fast SAFE cascade stay inside the robust certificate's rounding
model (derive_maps.stage_errors): small bf16 banks on the CPU, the bank shapes on a GPU."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.near_rank1 import near_rank1
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


@pytest.mark.parametrize("rows,cols", [(64, 48), (48, 64), (48, 48)])
def test_stage_errors_within_the_model_cpu(rows, cols):
    for x in _banks(rows, cols, 2, "cpu").values():
        _check(measure(x, backend="torch"))


def test_stage_errors_within_the_model_triton_interpreter():
    for x in _banks(32, 24, 1, "cpu").values():
        _check(measure(x, backend="triton"))


def test_the_check_can_fail():
    # a model without the bf16 roundings is violated by the same measurement
    none = RoundingModel(delta_x=0.0, delta_gram=0.0, delta_b=0.0, gamma_b=0.0, gamma_y=0.0, delta0=0.0)
    errors = measure(_banks(48, 48, 2, "cpu")["random"], backend="torch", model=none)
    assert any(e.measured > e.bound for e in errors[1:])


def test_stage_bound_is_about_the_roundings():
    m = rounding_model("safe")
    b = stage_bound([0.5, 1.0], (2.0, -1.5, 0.5), m)
    # at least the output's own rounding, at most a few units of it (h = -1 at s = 1: |h| / (a + h) = 1)
    assert (b >= m.delta_x).all() and (b <= 5 * m.delta_x).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(768, 768), (256, 768), (768, 256), (2816, 768)])
def test_stage_errors_within_the_model_gpu(rows, cols):
    for x in _banks(rows, cols, 8, "cuda").values():
        _check(measure(x))
