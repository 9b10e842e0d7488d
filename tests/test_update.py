"""anvil_ref.update: effective rates, per-matrix multipliers and the sign-aligned decay update."""

from __future__ import annotations

import math

import numpy as np
import pytest

import anvil_ref as A
from anvil_ref.update import (
    decay_mask,
    effective_lrs,
    effective_weight_decay,
    per_matrix_lr_multipliers,
    shape_lr_multiplier,
    sign_aligned_update,
)


def test_shape_multiplier():
    assert shape_lr_multiplier(2816, 768) == pytest.approx(math.sqrt(2816 / 768))
    assert shape_lr_multiplier(256, 768) == 1.0
    assert shape_lr_multiplier(768, 768) == 1.0
    with pytest.raises(A.ReferenceInputError):
        shape_lr_multiplier(0, 3)


def test_per_matrix_multipliers():
    assert per_matrix_lr_multipliers("mlp_bank", 6) == (1.0, 2.0, 1.0, 2.0, 1.0, 2.0)
    assert per_matrix_lr_multipliers("mlp_bank", 4, frozen={1, 2}) == (1.0, 0.0, 0.0, 2.0)
    assert per_matrix_lr_multipliers("qk_bank", 3, frozen={0}) == (0.0, 1.0, 1.0)
    with pytest.raises(A.ReferenceInputError, match="outside"):
        per_matrix_lr_multipliers("mlp_bank", 4, frozen={4})


def test_effective_rates():
    assert effective_weight_decay(lr=0.02, weight_decay=2.25, wd_mul=0.5) == pytest.approx(0.5 * 2.25 * 0.02)
    lrs = effective_lrs(lr=0.02, lr_mul=3.0, per_matrix=(1.0, 2.0, 0.0))
    assert lrs.shape == (3, 1, 1)
    np.testing.assert_allclose(lrs.ravel(), [0.06, 0.12, 0.0])


def test_decay_mask_counts_zero_as_aligned():
    np.testing.assert_array_equal(decay_mask(np.array([1.0, -1.0, 0.0, 2.0]), np.array([2.0, 3.0, -5.0, 0.0])),
                                  [1.0, 0.0, 1.0, 1.0])


def test_sign_aligned_update_by_hand():
    p = np.array([[[1.0, -1.0], [2.0, 0.0]], [[4.0, 4.0], [-2.0, 1.0]]])
    gate = np.array([[[1.0, 1.0], [-1.0, 5.0]], [[-1.0, 1.0], [-3.0, 0.0]]])
    u = np.array([[[0.5, 0.5], [-1.0, 2.0]], [[1.0, -1.0], [0.0, 0.0]]])
    lr = np.array([0.1, 0.2])[:, None, None]
    wd = 0.5
    expected = np.array([
        [[1 - 1 * 0.5 * 0.1 - 0.5 * 0.1, -1 - 0.5 * 0.1],  # aligned; not aligned
         [2 + 1.0 * 0.1, 0 - 2.0 * 0.1]],  # not aligned; p = 0
        [[4 - 1.0 * 0.2, 4 - 4 * 0.5 * 0.2 + 1.0 * 0.2],  # not aligned; aligned
         [-2 - (-2) * 0.5 * 0.2, 1 - 1 * 0.5 * 0.2]],  # aligned (both negative); gate 0
    ])
    np.testing.assert_allclose(sign_aligned_update(p, u, gate, eff_lr=lr, eff_wd=wd), expected, rtol=1e-15)


def test_frozen_matrix_does_not_move():
    rng = np.random.default_rng(0)
    p, u, g = (rng.standard_normal((3, 4, 5)) for _ in range(3))
    lrs = effective_lrs(lr=0.1, lr_mul=1.0, per_matrix=per_matrix_lr_multipliers("mlp_bank", 3, frozen={1}))
    out = sign_aligned_update(p, u, g, eff_lr=lrs, eff_wd=3.0)
    np.testing.assert_array_equal(out[1], p[1])
    assert not np.allclose(out[0], p[0])


def test_bad_input():
    with pytest.raises(A.ReferenceInputError, match="does not match"):
        sign_aligned_update(np.ones((2, 2)), np.ones((2, 3)), np.ones((2, 2)), eff_lr=0.1, eff_wd=0.1)
    with pytest.raises(A.ReferenceInputError, match="broadcast"):
        sign_aligned_update(np.ones((2, 2, 2)), np.ones((2, 2, 2)), np.ones((2, 2, 2)),
                            eff_lr=np.ones((3, 1, 1)), eff_wd=0.1)
    with pytest.raises(A.ReferenceInputError, match="non-finite"):
        sign_aligned_update(np.ones((2, 2)), np.full((2, 2), np.nan), np.ones((2, 2)), eff_lr=0.1, eff_wd=0.1)


# =================================================================================================
# anvil_fast vs anvil_ref (owner: the anvil_fast helper). The fast sign-aligned decay + update on the
# bf16 parameter + uint16 mantissa (anvil_fast/kernels/update.py): the fp32 master within UPDATE_ULPS of the
# exact result (ulps of the largest term), and the int32 join/split bit-exact against
# anvil_ref.storage for every high half.

def test_fast_update_matches_reference():
    import torch

    from anvil_fast.studies import difftest as D
    from anvil_fast.core.cascade import SAFE
    from anvil_fast.core.tolerances import check

    row = D.update_row(torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(101)), (3, 40, 24), "gaussian", SAFE, compile=False)
    assert check("update", fast=row.fast, eager=row.eager, floor=row.floor), D.format_table([row])


def test_triton_update_matches_reference(triton_dev):
    # SAFE's update as the bank runs it where Triton runs: the kernel, judged by the same rule
    import torch

    from anvil_fast.studies import difftest as D
    from anvil_fast.core.cascade import SAFE
    from anvil_fast.core.tolerances import check

    u = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(101))
    row = D.update_row(u, (3, 40, 24), "gaussian", SAFE, device=triton_dev, compile=False, backend="triton")
    assert check("update", fast=row.fast, eager=row.eager, floor=row.floor), D.format_table([row])


def test_fast_master_join_split_is_bit_exact():
    import torch

    from anvil_fast.kernels import update as F
    from anvil_ref.storage import join_fp32

    hi = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for lo_val in (0, 1, 0x7FFF, 0x8000, 0xFFFF, 12345):
        lo = torch.full_like(hi, lo_val - (65536 if lo_val >= 32768 else 0))
        w = F.join_fp32(hi, lo)
        assert torch.equal(w.view(torch.int32), join_fp32(hi.view(torch.uint16), lo.view(torch.uint16)).view(torch.int32))
        h2, l2 = F.split_fp32(w)
        assert torch.equal(h2, hi) and torch.equal(l2, lo)


def test_fast_update_has_the_reference_name_and_keyword_only_gate_and_rates():
    # eff_lr and eff_wd (and update and gate) have the same type: passed by position a swap would run.
    import inspect

    import torch

    from anvil_fast.kernels import update as F
    from anvil_ref import update as RU

    for fn in (F.sign_aligned_update, RU.sign_aligned_update):
        kinds = {n: p.kind for n, p in inspect.signature(fn).parameters.items()}
        assert kinds["eff_lr"] == kinds["eff_wd"] == inspect.Parameter.KEYWORD_ONLY, fn.__module__
    assert inspect.signature(F.sign_aligned_update).parameters["gate"].kind == inspect.Parameter.KEYWORD_ONLY
    p, m = torch.zeros(1, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 2, dtype=torch.uint16)
    u = g = torch.zeros(1, 2, 2)
    with pytest.raises(TypeError):
        F.sign_aligned_update(p, m, u, g, torch.zeros(1, 1, 1), torch.zeros(()))


# The equalizer's gains applied by the update (SAFE's Triton path leaves them to it): bf16(update * gain[lane])
# where the guard passed, 0 where it failed, with the bf16 rounding written on the bits so that torch.compile
# keeps it. Judged against torch's own bf16 multiply (eager, the equalizer's plain form) bit for bit.

def _eq_case(shape, red_dim, seed):
    import torch
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    chunk, rows, cols = shape
    lanes = rows if red_dim == -1 else cols
    # wide exponents, so products round at ties, overflow bf16 and land in its subnormals
    v = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-140, 120, shape, generator=g).float())).bfloat16()
    gain = (torch.rand((chunk, lanes), generator=g) * 4).bfloat16()
    ok = torch.tensor([1, 0, 1][:chunk], dtype=torch.int32)
    # the guard passes only finite updates: matrix 1 (refused) holds a NaN and an inf
    v[1, 0, 0], v[1, 1, 1] = float("nan"), float("inf")
    applied = torch.where(ok.reshape(-1, 1, 1) != 0, v * (gain.unsqueeze(-1) if red_dim == -1 else gain.unsqueeze(-2)),
                          torch.zeros((), dtype=torch.bfloat16))
    return v, SimpleNamespace(gain=gain, ok=ok), applied


@pytest.mark.parametrize("red_dim", [-1, -2])
@pytest.mark.parametrize("master", ["fp32", "bf16+mantissa"])
@pytest.mark.parametrize("device,compile", [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=pytest.mark.gpu)],
                         ids=["eager", "compiled", "cuda"])
@pytest.mark.parametrize("shape", [(3, 24, 40), (3, 32, 32)], ids=["wide", "square"])
def test_fast_update_applies_equalizer_gains_bit_for_bit(red_dim, master, device, compile, shape):
    import torch
    from types import SimpleNamespace

    from anvil_fast.kernels.update import sign_aligned_update

    if compile:
        torch._dynamo.reset()
    v, work, applied = _eq_case(shape, red_dim, seed=17 + red_dim)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g)
    gate = torch.randn(shape, generator=g)
    rates = dict(eff_lr=torch.tensor([0.02, 0.03, 0.05]).reshape(3, 1, 1), eff_wd=torch.tensor(0.1))
    v, applied, w, gate = (t.to(device) for t in (v, applied, w, gate))
    work = SimpleNamespace(gain=work.gain.to(device), ok=work.ok.to(device))
    rates = {k: t.to(device) for k, t in rates.items()}
    if master == "fp32":
        a, b = w.clone(), w.clone()
        sign_aligned_update(a, None, v, gate=gate, **rates, equalizer=work, red_dim=red_dim, compile=compile)
        sign_aligned_update(b, None, applied, gate=gate, **rates, compile=compile)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert torch.isfinite(a[1]).all()  # the refused matrix: decay only, no NaN from its update
    else:
        from anvil_fast.kernels.update import split_fp32_

        pa, ma = (torch.empty(shape, dtype=dt, device=device) for dt in (torch.bfloat16, torch.uint16))
        split_fp32_(w, pa, ma)
        pb, mb = pa.clone(), ma.clone()
        sign_aligned_update(pa, ma, v, gate=gate, **rates, equalizer=work, red_dim=red_dim, compile=compile)
        sign_aligned_update(pb, mb, applied, gate=gate, **rates, compile=compile)
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16)) and torch.equal(ma, mb)


def test_fast_update_equalizer_bad_input():
    import torch
    from types import SimpleNamespace

    from anvil_fast.kernels.update import sign_aligned_update

    shape = (3, 24, 40)
    v, work, _ = _eq_case(shape, -1, seed=1)
    w, gate = torch.zeros(shape), torch.zeros(shape)
    rates = dict(eff_lr=torch.zeros(3, 1, 1), eff_wd=torch.tensor(0.0))
    with pytest.raises(ValueError, match="red_dim"):
        sign_aligned_update(w, None, v, gate=gate, **rates, equalizer=work, red_dim=None)
    with pytest.raises(ValueError, match="gains of shape"):  # lanes of the other orientation
        sign_aligned_update(w, None, v, gate=gate, **rates, equalizer=work, red_dim=-2)
    with pytest.raises(ValueError, match="bf16 cascade output"):
        sign_aligned_update(w, None, v.float(), gate=gate, **rates, equalizer=work, red_dim=-1)
    with pytest.raises(ValueError, match="int32 verdicts"):
        sign_aligned_update(w, None, v, gate=gate, **rates, equalizer=SimpleNamespace(gain=work.gain, ok=work.ok.bool()),
                            red_dim=-1)


# The Triton update kernel (fused=True, SAFE where Triton runs) against the torch functions it replaces, bit for
# bit: in the interpreter (NumPy, one rounding per operation) against the eager functions; on CUDA against their
# torch.compile form, which is what it replaces there (both let the compiler contract a multiply into the next
# subtraction). Every storage form, with and without the equalizer's gains and the active mask, on shapes that
# leave partial tiles, with the values that break a careless bit form: signed zeros, subnormals, infinities, NaN,
# products that round at bf16 ties or overflow.

def _update_case(shape, seed, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    chunk, rows, cols = shape
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-130, 100, shape, generator=g).float())
    gate = torch.randn(shape, generator=g)
    flat_w, flat_gate = w.view(-1), gate.view(-1)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-42, -1e-42, 3.4e38])
    flat_w[:8], flat_gate[8:16] = specials, specials
    flat_gate[16:24] = 0.0
    u = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-140, 120, shape, generator=g).float()))
    rates = dict(eff_lr=torch.rand((chunk, 1, 1), generator=g) * 0.05, eff_wd=torch.tensor(0.7))
    active = torch.tensor([1, 0, 1][:chunk], dtype=torch.int32).reshape(chunk, 1, 1)
    return tuple(t.to(device) for t in (w, gate, u, active)), {k: t.to(device) for k, t in rates.items()}


@pytest.mark.parametrize("shape", [(3, 37, 200), (3, 16, 128), (2, 5, 3)], ids=["partial", "whole", "tiny"])
@pytest.mark.parametrize("master", ["fp32", "bf16+mantissa"])
@pytest.mark.parametrize("extras", ["plain", "active", "equalizer", "fp32-update", "bf16-gate"])
def test_triton_update_writes_the_torch_functions_bits(shape, master, extras, triton_dev):
    import torch
    from types import SimpleNamespace

    from anvil_fast.kernels.update import sign_aligned_update, split_fp32_

    (w, gate, u, active), rates = _update_case(shape, seed=sum(shape), device=triton_dev)
    kw = dict(gate=gate, **rates)
    if extras == "active":
        kw["active"] = active
    u = u.float() if extras == "fp32-update" else u.bfloat16()
    if extras == "bf16-gate":  # the rails stored in bf16 (the lean state)
        kw["gate"] = gate.bfloat16()
    if extras == "equalizer":
        chunk, rows, cols = shape
        red_dim = -1 if rows >= cols else -2
        lanes = rows if red_dim == -1 else cols
        gain = (torch.rand((chunk, lanes), generator=torch.Generator().manual_seed(5)) * 4).bfloat16().to(triton_dev)
        ok = torch.tensor([1, 0, 1][:chunk], dtype=torch.int32, device=triton_dev)
        u[1].view(-1)[:2] = torch.tensor([float("nan"), float("inf")], device=triton_dev)  # refused: no NaN through
        kw.update(equalizer=SimpleNamespace(gain=gain, ok=ok), red_dim=red_dim)
    compiled = triton_dev == "cuda"
    if compiled:
        torch._dynamo.reset()
    if master == "fp32":
        a, b = w.clone(), w.clone()
        sign_aligned_update(a, None, u, **kw, fused=True, backend="triton")
        sign_aligned_update(b, None, u, **kw, fused=False, compile=compiled)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert not torch.equal(a.view(torch.int32), w.view(torch.int32))
    else:
        pa, ma = (torch.empty(shape, dtype=dt, device=triton_dev) for dt in (torch.bfloat16, torch.uint16))
        split_fp32_(w, pa, ma)
        pb, mb, p0, m0 = pa.clone(), ma.clone(), pa.clone(), ma.clone()
        sign_aligned_update(pa, ma, u, **kw, fused=True, backend="triton")
        sign_aligned_update(pb, mb, u, **kw, fused=False, compile=compiled)
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16)) and torch.equal(ma, mb)
        assert not (torch.equal(pa.view(torch.int16), p0.view(torch.int16)) and torch.equal(ma, m0))
    if extras == "active":  # matrix 1 is inactive: its master kept bit for bit
        got = a[1] if master == "fp32" else torch.stack([pa[1].view(torch.int16), ma[1].view(torch.int16)])
        want = w[1] if master == "fp32" else torch.stack([p0[1].view(torch.int16), m0[1].view(torch.int16)])
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_triton_update_falls_back_where_its_kernel_does_not_fit():
    # a non-contiguous parameter runs the torch functions (same values), never a wrong stride in the kernel
    import torch

    from anvil_fast.kernels import update as F

    (w, gate, u, _), rates = _update_case((3, 16, 40), seed=2, device="cpu")
    base = torch.zeros(3, 40, 16)
    p = base.transpose(1, 2)
    p.copy_(w)
    q = w.clone()
    F.sign_aligned_update(p, None, u.bfloat16(), gate=gate, **rates, fused=True)  # auto: CPU tensors run torch
    F.sign_aligned_update(q, None, u.bfloat16(), gate=gate, **rates)
    assert torch.equal(p.contiguous().view(torch.int32), q.view(torch.int32))
    assert not F._fusable(p, None, u.bfloat16(), gate, rates["eff_lr"], rates["eff_wd"], None)
    assert F._fusable(q, None, u.bfloat16(), gate, rates["eff_lr"], rates["eff_wd"], None)
