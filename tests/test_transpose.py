"""anvil_fast.kernels.transpose: the tied embedding's transpose_add / transpose_copy.

The Triton kernel runs here through the CPU interpreter (``backend="triton"``; conftest sets
TRITON_INTERPRET=1 without CUDA), and must equal torch's ``dst.add_(src.T)`` / ``dst.copy_(src.T)``
bit for bit (one fp32 add, one rounding). What only the GPU covers: the compiled kernel's shared-
memory transpose and native bf16 cast (the same tests run there with the gpu marker)."""

from __future__ import annotations

import os

import pytest
import torch

from anvil_fast.kernels.transpose import transpose_add, transpose_copy

# CPU: the kernel through the interpreter (conftest sets TRITON_INTERPRET=1 when there is no CUDA)
DEV = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                    reason="the CPU kernel runs only in Triton's interpreter")),
       pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(70, 130), (64, 64), (1, 5), (129, 65)])
def test_kernel_equals_torch_bitwise(device, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    src = torch.randn(shape, generator=g).to(dtype).to(device)
    dst = torch.randn(shape[::-1], generator=g).to(dtype).to(device)
    want_add = dst.clone().add_(src.T)
    got = dst.clone()
    transpose_add(src, got, backend="triton")
    assert torch.equal(got, want_add)
    out = torch.full(shape[::-1], float("nan"), dtype=dtype, device=device)  # every element written
    transpose_copy(src, out, backend="triton")
    assert torch.equal(out, src.T)


@pytest.mark.parametrize("device", DEV)
def test_strided_operands_and_mixed_dtypes(device):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(40, 100, generator=g).to(device)
    src = big[:, 10:70]  # row stride 100
    dst_big = torch.zeros(60, 80, device=device)
    dst = dst_big[:, 5:45]  # row stride 80
    transpose_copy(src, dst, backend="triton")
    assert torch.equal(dst, src.T) and torch.count_nonzero(dst_big[:, :5]) == 0
    acc = torch.randn(60, 40, generator=g).bfloat16().to(device)
    want = acc.clone().add_(src.T)  # fp32 source into a bf16 destination: one rounding
    transpose_add(src, acc, backend="triton")
    assert torch.equal(acc, want)


def test_cpu_fallback_is_torch():
    src, dst = torch.randn(3, 4, generator=torch.Generator().manual_seed(101)), torch.randn(4, 3, generator=torch.Generator().manual_seed(102))
    want = dst + src.T
    transpose_add(src, dst)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("src,dst,match", [
    (torch.zeros(3, 4), torch.zeros(3, 4), "dst must be src transposed"),
    (torch.zeros(3, 4, 1), torch.zeros(4, 3), "dst must be src transposed"),
    (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(4, 3, dtype=torch.int32), "floating-point"),
])
def test_bad_input(src, dst, match):
    for f in (transpose_add, transpose_copy):
        with pytest.raises(ValueError, match=match):
            f(src, dst)
