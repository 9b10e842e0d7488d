"""anvil_fast.core.plain, the benchmark's baseline: the seed's bank update with library matmuls. On CPU,
uncompiled, it must be the eager seed chain (anvil_fast.core.eager) bit for bit, and it must stay within the
table's rule of the float64 reference."""

from __future__ import annotations

import pytest
import torch

import anvil_ref as R
from anvil_fast.core.bank import AnvilBank
from anvil_fast.core.cascade import FAITHFUL
from anvil_fast.studies.difftest import rel_err
from anvil_fast.core.eager import eager_bf16_cascade, eager_equalizer, eager_rails, eager_update
from anvil_fast.core.plain import plain_bank_update, plain_cascade
from anvil_fast.core.tolerances import bf16_bound


def _bank(shape, seed):
    g = torch.Generator().manual_seed(seed)
    p = (0.02 * torch.randn(shape, generator=g)).bfloat16()
    bank = AnvilBank.create("bank", p, beta2=0.9, config=FAITHFUL)
    bank.grad.copy_(torch.randn(shape, generator=g))
    bank.velocity.copy_(0.1 * torch.randn((2, *shape), generator=g))
    bank.lane_energy.fill_(0.01)
    bank.mantissa.copy_(torch.randint(0, 2 ** 16, shape, generator=g).to(torch.uint16))
    bank.set_scalars(momentum=0.93, eff_wd=0.023 * 2.25 * 0.023, fast_beta=0.85, fast_weight=0.4385,
                     eff_lr=[0.023 * (1 + i % 2) for i in range(shape[0])])
    return bank


@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40)])
def test_plain_bank_update_is_the_eager_seed_chain(shape):
    bank = _bank(shape, seed=4)
    b = {k: getattr(bank, k).clone() for k in ("grad", "velocity", "lane_energy", "p_slice", "mantissa")}
    plain_bank_update(bank, compile=False)
    sc = dict(momentum=float(bank.momentum), fast_beta=float(bank.fast_beta), fast_weight=float(bank.fast_weight))
    look, v0, v1 = eager_rails(b["grad"], b["velocity"][0], b["velocity"][1], **sc)
    assert torch.equal(bank.velocity[0], v0) and torch.equal(bank.velocity[1], v1)
    v, e = eager_equalizer(eager_bf16_cascade(look), b["lane_energy"], beta2=0.9)
    assert torch.equal(bank.lane_energy, e)
    p, m = eager_update(b["p_slice"], b["mantissa"], v, v1, eff_wd=bank.eff_wd, eff_lr=bank.eff_lr)
    assert torch.equal(bank.p_slice, p) and torch.equal(bank.mantissa, m)


def test_plain_cascade_within_the_rule_of_the_reference():
    # both sides: plain against the eager seed by the factor rule, and the float64 reference's own
    # rails and cascade (a wrong rail beta or a dropped rescale shows even if eager shared it)
    bank = _bank((3, 40, 24), seed=5)
    grad, vel = bank.grad.clone(), bank.velocity.clone()
    y = plain_cascade(bank, compile=False)
    ref = R.twin_rail(grad, vel[0], vel[1], momentum=float(bank.momentum), fast_beta=float(bank.fast_beta),
                      fast_weight=float(bank.fast_weight))
    casc = R.cascade(ref.lookahead, margin=FAITHFUL.margin())
    look, _, _ = eager_rails(grad, vel[0], vel[1], momentum=float(bank.momentum), fast_beta=float(bank.fast_beta),
                             fast_weight=float(bank.fast_weight))
    e = rel_err(eager_bf16_cascade(look), casc)
    assert rel_err(y, casc) <= bf16_bound(e), (rel_err(y, casc), e)


@pytest.mark.gpu
def test_compiled_plain_bank_update_on_cuda_within_the_rule():
    # the benchmark's configuration: compiled, CUDA; cuBLAS sums in another order than the eager CPU
    # chain, so the factor rule against the float64 step, not bits
    bank = _bank((2, 768, 768), seed=6)
    b = {k: getattr(bank, k).clone() for k in ("grad", "velocity", "lane_energy", "p_slice", "mantissa")}
    cuda = AnvilBank.create("bank", b["p_slice"].cuda(), beta2=0.9, config=FAITHFUL, velocity=b["velocity"].cuda(),
                            lane_energy=b["lane_energy"].cuda(), mantissa=b["mantissa"].cuda(),
                            grad=b["grad"].cuda())
    cuda.set_scalars(momentum=0.93, eff_wd=float(bank.eff_wd), fast_beta=0.85, fast_weight=0.4385,
                     eff_lr=bank.eff_lr.flatten().tolist())
    plain_bank_update(cuda, compile=True)
    plain_bank_update(bank, compile=False)
    w0 = R.join_fp32(b["p_slice"], b["mantissa"]).double()
    step = lambda bk: (R.join_fp32(bk.p_slice.cpu(), bk.mantissa.cpu()).double() - w0)  # noqa: E731
    ref = R.twin_rail(b["grad"], b["velocity"][0], b["velocity"][1], momentum=0.93, fast_beta=0.85, fast_weight=0.4385)
    eq = R.equalize(R.cascade(ref.lookahead, margin=FAITHFUL.margin()), b["lane_energy"], beta2=0.9)
    w_ref = R.sign_aligned_update(w0, eq.v, ref.v_slow, eff_lr=bank.eff_lr.double(), eff_wd=float(bank.eff_wd))
    e_cpu, e_gpu = rel_err(step(bank), w_ref - w0), rel_err(step(cuda), w_ref - w0)
    assert e_gpu <= bf16_bound(e_cpu), (e_gpu, e_cpu)
