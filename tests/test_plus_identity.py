"""plus_identity_: ``Q = a I + Q`` in place for batches of square bf16 matrices (the Gram side's start of
its polynomial), the Triton kernel against the torch operations it replaces, bit for bit, and against
the definition (Q unchanged off the diagonal, bf16(fp32(Q_ii) + fp32(a)) on it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anvil_fast.kernels.plus_identity import plus_identity_


def _b(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # wide exponents: diagonals where a dominates, where B_ii dominates, and ties of the rounding
    return (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 6, shape, generator=g).float())).bfloat16()


@pytest.mark.parametrize("shape", [(3, 5, 5), (2, 300, 300), (1, 1, 1), (2, 3, 33, 33)])
@pytest.mark.parametrize("a", [3.4445, -4.7750, 1.0, 2.0 ** -20])
def test_kernel_equals_the_torch_operations(shape, a, triton_dev):
    B = _b(shape, seed=len(shape) * 100 + shape[-1])
    want = plus_identity_(B.clone(), a, backend="torch")
    got = plus_identity_(B.to(triton_dev), a, backend="triton")
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


def test_matches_the_definition():
    n = 40
    B = _b((4, n, n), seed=9)
    a = 3.4445  # not a bf16 number: rounding it to bf16 first would move every diagonal entry's value
    Q = plus_identity_(B.clone(), a)
    off = ~torch.eye(n, dtype=torch.bool).expand(4, n, n)
    assert torch.equal(Q[off].view(torch.int16), B[off].view(torch.int16))
    d32 = B.diagonal(dim1=-2, dim2=-1).float().numpy() + np.float32(a)  # fp32 sum of fp32 operands
    assert torch.equal(Q.diagonal(dim1=-2, dim2=-1), torch.from_numpy(d32).bfloat16())
    # and it is not the bf16 tensor's own add_ (a rounded to bf16 first)
    assert not torch.equal(Q.diagonal(dim1=-2, dim2=-1), B.diagonal(dim1=-2, dim2=-1) + torch.tensor(a).bfloat16())


def test_bad_input():
    B = torch.zeros(2, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="square"):
        plus_identity_(torch.zeros(2, 4, 5, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="bf16"):
        plus_identity_(B.float(), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        plus_identity_(torch.zeros(2, 4, 8, dtype=torch.bfloat16)[..., :4], 1.0)
    with pytest.raises(ValueError, match="must be a tensor"):
        plus_identity_([[1.0]], 1.0)
    for bad in (float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="finite number"):
            plus_identity_(B, bad)
    assert torch.equal(B, torch.zeros_like(B))  # refused calls left Q alone
