"""anvil_ref.storage: the bf16 parameter + uint16 mantissa model of an fp32 master."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import anvil_ref as A
from anvil_ref.storage import bf16_truncate, join_fp32, round_to_fp32, split_fp32, store


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


CLASSES = {
    "normal": np.array([1.0, -3.5, 1.2345678e30, -7.1e-30], dtype=np.float32),
    "subnormal": np.array([1e-40, -1e-45, 1.17e-38], dtype=np.float32),
    "zero": np.array([0.0], dtype=np.float32),
    "negative zero": np.array([-0.0], dtype=np.float32),
    "infinity": np.array([np.inf, -np.inf], dtype=np.float32),
    "nan": np.array([0x7FC00001, 0xFFBF1234], dtype=np.uint32).view(np.float32),
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_split_join_round_trip_bitwise(name):
    x = CLASSES[name]
    hi, lo = split_fp32(x)
    assert hi.dtype == lo.dtype == np.uint16
    np.testing.assert_array_equal(bits(join_fp32(hi, lo)), bits(x))
    np.testing.assert_array_equal((hi.astype(np.uint32) << 16) | lo, bits(x))


def test_split_join_round_trip_many_patterns():
    """Every high half (65536 bf16 patterns, all classes) with 16 low halves each, plus 2^20 random
    patterns: join(split(w)) reproduces every bit."""
    hi = np.repeat(np.arange(65536, dtype=np.uint32), 16)
    lo = np.tile(np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF] + list(range(2, 13)), dtype=np.uint32), 65536)
    rnd = np.random.default_rng(0).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    pats = np.concatenate([(hi << 16) | lo, rnd])
    h, l_ = split_fp32(pats.view(np.float32))
    np.testing.assert_array_equal(bits(join_fp32(h, l_)), pats)


def test_truncation_not_rounding():
    # 1 + 2^-7 + 2^-8 + 2^-9: bf16 keeps 7 mantissa bits. Rounding gives 1 + 2^-6, truncation 1 + 2^-7.
    x = np.array([1 + 2**-7 + 2**-8 + 2**-9, -(1 + 2**-7 + 2**-8 + 2**-9)], dtype=np.float32)
    np.testing.assert_array_equal(bf16_truncate(x), np.array([1 + 2**-7, -(1 + 2**-7)], dtype=np.float32))
    rounded = torch.from_numpy(x).bfloat16().float().numpy()
    assert np.all(np.abs(rounded) == np.float32(1 + 2**-6))  # torch's cast rounds: a different value
    hi, _ = split_fp32(x)
    np.testing.assert_array_equal(hi, (bits(bf16_truncate(x)) >> 16).astype(np.uint16))


def test_torch_tensors_and_bf16_parameter():
    w = torch.randn(4, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(101))
    hi, lo = split_fp32(w)
    assert hi.dtype == torch.uint16 and lo.dtype == torch.uint16
    p_bf16 = hi.view(torch.bfloat16)  # the model reads the high half as its bf16 weight
    assert torch.equal(join_fp32(p_bf16, lo), w)
    assert torch.equal(p_bf16.float(), torch.from_numpy(bf16_truncate(w.numpy())))


def test_store_rounds_to_nearest_fp32_then_splits():
    x64 = np.array([1 + 2**-24 + 2**-30, 1 + 2**-24, 1 + 3 * 2**-24])  # above tie, tie to even, tie to even
    r = round_to_fp32(x64)
    np.testing.assert_array_equal(r, np.array([1 + 2**-23, 1.0, 1 + 2 * 2**-23], dtype=np.float32))
    hi, lo = store(x64)
    np.testing.assert_array_equal(bits(join_fp32(hi, lo)), bits(r))


def test_bad_input():
    with pytest.raises(A.ReferenceInputError, match="float32"):
        split_fp32(np.ones(3, dtype=np.float64))
    with pytest.raises(A.ReferenceInputError, match="uint16"):
        join_fp32(np.ones(3, dtype=np.int32), np.ones(3, dtype=np.uint16))
    with pytest.raises(A.ReferenceInputError, match="does not match"):
        join_fp32(np.ones(3, dtype=np.uint16), np.ones(2, dtype=np.uint16))
