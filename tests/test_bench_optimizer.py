"""anvil_fast.bench.optimizer: the benchmark's layout and plumbing (timings come only from the GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from anvil_fast.bench import optimizer as B


def test_gpt2_small_layout():
    layout = B.gpt2_small_layout()
    assert 123e6 < B.n_params(layout, tied=True) < 124e6  # GPT-2 small's 124M less its 0.8M position embeddings
    for label, (shape, reshape, dtype, entry) in layout.items():
        if reshape is not None:
            assert dtype == torch.bfloat16 and math.prod(reshape) == math.prod(shape) and reshape[0] % 8 == 0
        elif entry["comms"] == "sharded":
            assert shape[0] % 8 == 0
    assert sorted(B.SCATTER) == sorted(layout) == sorted(B.WORK)


def test_tiny_layout_runs_on_cpu_and_floor_is_positive():
    layout = B.gpt2_small_layout(n_layer=1, width=16, vocab=64, heads=2, head_dim=8, hidden=32)
    opt, params = B.fast_optimizer(layout, "cpu", graphs=False, untie=True)
    grads = B.make_grads(params)
    before = {l: p.detach().clone() for l, p in params}
    B.step_fn(opt, params, grads, True)()
    assert all(not torch.equal(before[l], p) for l, p in params)
    run, n = B.baseline(layout, "cpu")
    run()
    assert n == B.n_params(layout)
    mm, mem, total = B.floor_ms(layout, 772.0, 4300.0)
    assert mm > 0 and mem > 0 and total == mm + mem
    assert B.floor_ms(layout, 772.0, 4300.0, world_size=2)[2] < total


def test_floor_counts_the_gram_side_on_the_banks_that_take_it():
    # GPT-2 small's MLP bank (24 x 3072 x 768: both MLP matrices of each layer) runs the Gram side on
    # CUDA by default; its matmul floor is the Gram side's count, the other banks' the standard one
    from anvil_fast.bench.common import flops
    from anvil_fast.core.gram_side import GRAM_SIDE_MIN_SHORT, cascade_flops

    layout = B.gpt2_small_layout()
    tfl = 700.0
    want_fl, standard_fl, gram_side_banks = 0.0, 0.0, 0
    for shape, reshape, _, _ in layout.values():
        if reshape is None:
            continue
        c, m, n = reshape
        standard_fl += flops(reshape)[1]
        if max(m, n) >= 2 * min(m, n) and min(m, n) >= GRAM_SIDE_MIN_SHORT:
            want_fl += c * cascade_flops(m, n)["gram_side"]
            gram_side_banks += 1
        else:
            want_fl += flops(reshape)[1]
    assert gram_side_banks == 1
    mm, _, _ = B.floor_ms(layout, tfl, 4300.0)
    assert mm == pytest.approx(want_fl / (tfl * 1e12) * 1e3, rel=1e-12)
    assert mm < standard_fl / (tfl * 1e12) * 1e3
    # the same layout as the CPU step would run it (SAFE everywhere): the standard count
    assert B.floor_ms(layout, tfl, 4300.0, device="cpu")[0] == pytest.approx(standard_fl / (tfl * 1e12) * 1e3, rel=1e-12)
