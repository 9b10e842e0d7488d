"""anvil_fast.kernels.bank_scalars: every per-step scalar in one buffer, refreshed by one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anvil_fast.kernels.bank_scalars import ADAM_COLUMNS, ALIGN, BANK_FIELDS, BankScalarStaging


def test_layout_views_and_upload():
    s = BankScalarStaging([3, 1, 6], "cpu", adam_rows=2)
    views = [s.scalars(i) for i in range(3)]
    lrs = [s.eff_lr(i) for i in range(3)]
    for v in views:
        assert set(v) == set(BANK_FIELDS)
        for t in v.values():
            assert t.dim() == 0 and t.data_ptr() % (4 * ALIGN) == 0
    assert [tuple(x.shape) for x in lrs] == [(3, 1, 1), (1, 1, 1), (6, 1, 1)]
    assert all(x.data_ptr() % 16 == 0 for x in lrs)
    ptrs = sorted((t.data_ptr(), t.numel()) for v in views for t in v.values())
    ptrs += sorted((x.data_ptr(), x.numel()) for x in lrs) + [(s.adam_table().data_ptr(), s.adam_table().numel())]
    spans = sorted((p, p + 4 * n) for p, n in ptrs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two views overlap
    fields = [(0.9, 0.1, 0.85, 0.4), (0.8, 0.2, 0.5, 1.0), (0.7, 0.3, 0.25, 0.5)]
    eff = [[1.0, 2.0, 0.0], [0.5], [0.1 * k for k in range(6)]]
    table = np.arange(2 * len(ADAM_COLUMNS), dtype=np.float64).reshape(2, -1) / 7
    s.upload(fields, eff, table)
    for i, f in enumerate(fields):
        for name, val in zip(BANK_FIELDS, f):
            assert float(views[i][name]) == np.float32(val)
        assert np.array_equal(lrs[i].flatten().numpy(), np.float32(eff[i]))
    assert np.array_equal(s.adam_table().numpy(), table.astype(np.float32))
    s.upload(fields[::-1], eff, None)  # no table: the table keeps its values
    assert np.array_equal(s.adam_table().numpy(), table.astype(np.float32))
    assert float(views[0]["momentum"]) == np.float32(0.7) and s.uploads == 2


@pytest.mark.parametrize("args,match", [
    (([(0.9, 0.1, 0.85)], [[1.0]]), "expected 4 fields"),
    (([(0.9, 0.1, 0.85, 0.4)], [[1.0, 2.0]]), "expected 1 eff_lr"),
    (([], []), "expected 1 banks"),
])
def test_bad_input(args, match):
    s = BankScalarStaging([1], "cpu")
    with pytest.raises(ValueError, match=match):
        s.upload(*args)
    with pytest.raises(ValueError, match="at least one matrix"):
        BankScalarStaging([0], "cpu")


@pytest.mark.gpu
def test_cuda_upload_is_one_async_copy_from_pinned_memory():
    s = BankScalarStaging([4], "cuda", adam_rows=1)
    assert all(h.is_pinned() for h in s._host)
    for k in range(10):  # more uploads than slots: slots are reused only after their copy retired
        s.upload([(k, 0.0, 0.0, 1.0)], [[float(k)] * 4], np.full((1, len(ADAM_COLUMNS)), k))
    torch.cuda.synchronize()
    assert float(s.scalars(0)["momentum"]) == 9 and float(s.adam_table()[0, 0]) == 9
