"""anvil_fast.kernels.backend: the one dispatch rule every kernel module follows, the SM count and its
fallback, and the size heuristic that reads it."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.kernels import backend as T
from anvil_fast.kernels import gram as G


class _MyInputError(ValueError):
    pass


def test_use_triton_follows_the_backend():
    t = torch.zeros(2)
    assert T.use_triton(t, "torch") is False
    assert T.use_triton(t, "auto") is False  # CPU tensors take torch unless a caller insists
    if T.triton_available() and T.interpreting():
        assert T.use_triton(t, "triton") is True


@pytest.mark.parametrize("backend", ["cuda", "Triton", "", None])
def test_use_triton_refuses_an_unknown_backend_with_the_callers_error(backend):
    with pytest.raises(_MyInputError, match=r"backend: expected one of 'auto', 'triton', 'torch'"):
        T.use_triton(torch.zeros(2), backend, error=_MyInputError)


def test_use_triton_refuses_triton_where_it_cannot_run():
    with pytest.raises(ValueError, match="Triton cannot run on a meta tensor"):
        T.use_triton(torch.zeros(2, device="meta"), "triton")


def test_every_kernel_entry_point_takes_the_same_backend_keyword():
    from anvil_fast.kernels.adam import adam_update_
    from anvil_fast.kernels.transpose import transpose_copy

    src = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="backend"):
        transpose_copy(src, torch.zeros(3, 2), backend="cuda")
    table = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="backend"):
        adam_update_(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), table, 0, backend="gpu")
    with pytest.raises(G.GramInputError, match="backend"):
        G.XXT(torch.zeros(2, 3, dtype=torch.bfloat16), backend="cuda")


def test_num_sms_falls_back_without_a_device(monkeypatch):
    T.num_sms.cache_clear()
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        assert T.num_sms(None) == T.FALLBACK_SMS
    finally:
        T.num_sms.cache_clear()


def test_default_config_reads_the_sm_count(monkeypatch):
    # 8 matrices of 768 x 768: 6 x 7 / 2 lower 128-tiles each, 168 in all. Fewer than two waves of
    # 132 SMs -> the small tiles; more than two waves of 64 SMs -> the large ones.
    monkeypatch.setattr(G, "interpreting", lambda: False)
    small = G.default_config("gram", 768, 768, 8, sms=132)
    large = G.default_config("gram", 768, 768, 8, sms=64)
    assert (small.BLOCK_M, large.BLOCK_M) == (64, 128)
    assert small.kernel == large.kernel == "v1"
