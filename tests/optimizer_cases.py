"""Shared fixtures of the fast optimizer's tests: a small model with every kind of parameter, its
gradients, a row-sparse update, a comms recorder, and the bridge to anvil_ref's reference step.

The model: a wide bank (qk: 8 x 12), a square bank (vo: 8 x 8), a tall bank (mlp: 20 x 8, matrix 2
frozen, odd matrices at 2x LR), replicated Adam parameters of two dtypes (fp32 ``scalars``, bf16
``gates``), sharded Adam ``lm_head``/``embed`` (tied until untied), and a sharded Adam
``value_embeds`` updated through a :class:`~anvil_fast.optim.optimizer.SparseUpdate`. Every bank has 8
matrices and every sharded first dimension is a multiple of 8, so the same model shards over 1, 2,
4 or 8 ranks.
"""

from __future__ import annotations

import numpy as np
import torch

import anvil_ref as A
from anvil_ref import ParamSpec, ReferenceAnvilAndAdam
from anvil_fast.parallel.comms import Comms

TABLE = {
    "qk_bank": {"optim": "anvil", "comms": "sharded"},
    "vo_bank": {"optim": "anvil", "comms": "sharded", "lr_mul": 0.7},
    "mlp_bank": {"optim": "anvil", "comms": "sharded", "wd_mul": 0.5},
    "scalars": {"optim": "adam", "comms": "replicated", "adam_betas": [0.9, 0.99], "lr_mul": 5.0, "wd_mul": 0.0},
    "gates": {"optim": "adam", "comms": "replicated", "adam_betas": [0.8, 0.95]},
    "value_embeds": {"optim": "adam", "comms": "sharded", "adam_betas": [0.75, 0.95], "lr_mul": 2.0},
    "lm_head": {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95], "wd_mul": 150.0},
    "embed": {"optim": "adam", "comms": "sharded", "adam_betas": [0.5, 0.95], "wd_mul": 150.0},
}
SHAPES = {"qk_bank": (64, 12), "vo_bank": (64, 8), "mlp_bank": (160, 8), "scalars": (6,), "gates": (3, 4),
          "value_embeds": (16, 8), "lm_head": (8, 40), "embed": (40, 8)}
RESHAPES = {"qk_bank": (8, 8, 12), "vo_bank": (8, 8, 8), "mlp_bank": (8, 20, 8)}
FROZEN = {"mlp_bank": frozenset({2})}
DTYPES = {"scalars": torch.float32, "lm_head": torch.float32, "embed": torch.float32, "value_embeds": torch.float32}
# The two orders differ, and value_embeds sits inside each (its hooks run there).
SCATTER = ["lm_head", "embed", "mlp_bank", "value_embeds", "scalars", "vo_bank", "gates", "qk_bank"]
WORK = ["scalars", "qk_bank", "value_embeds", "vo_bank", "gates", "embed", "mlp_bank", "lm_head"]
DENSE = [l for l in SHAPES if l != "value_embeds"]


def make_params(seed: int = 0, device="cpu") -> list[tuple[str, torch.nn.Parameter]]:
    """The model's parameters (seed attributes set; embed = lm_head^T), identical for equal seeds."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for label, shape in SHAPES.items():
        t = (torch.randn(shape, generator=g) * 0.1).to(DTYPES.get(label, torch.bfloat16))
        p = torch.nn.Parameter(t.to(device))
        p.label = label
        if label in RESHAPES:
            p.reshape = RESHAPES[label]
        if label in FROZEN:
            p.frozen_matrices = FROZEN[label]
        out[label] = p
    with torch.no_grad():
        out["embed"].copy_(out["lm_head"].T)
    return [(f"model.{l}", p) for l, p in out.items()]


def quantize(t: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``t`` rounded to ``bits`` significant bits: sums of up to 2**(8 - bits) equal such values are
    exact in bf16, so an average over that many ranks of identical gradients is exact."""
    m, e = torch.frexp(t.double())
    return torch.ldexp(torch.round(m * 2 ** bits) / 2 ** bits, e).to(t.dtype)


def gradients(step: int, *, rank: int = 0, exact: bool = False, device="cpu", labels=None) -> dict[str, torch.Tensor]:
    """This backward pass's gradient for every label (float32, then cast by the caller). With
    ``exact`` the gradient does not depend on the rank and is quantized (see :func:`quantize`);
    otherwise each rank's differs (data parallelism)."""
    g = torch.Generator().manual_seed(1000 * step + (0 if exact else 7 * rank + 1))
    out = {}
    for label in labels or SHAPES:
        t = torch.randn(SHAPES[label], generator=g)
        out[label] = (quantize(t) if exact else t).to(device)
    return out


def accumulate(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
    """What backward() does to ``.grad``: set it, or add into the kept one (in the parameter's dtype)."""
    for label, g in grads.items():
        p = params[label]
        g = g.to(p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad += g


class ValueEmbedSparse:
    """A SparseUpdate for ``value_embeds`` (gradient held outside ``.grad``): launch = reduce-scatter,
    update = wait + Adam on the shard + start the gather, finish = wait the gather. Appends its calls
    to ``log``."""

    def __init__(self, opt, grad: torch.Tensor, log: list | None = None):
        self.opt, self.grad, self.log = opt, grad, log if log is not None else []
        self.param = opt.params["value_embeds"]

    def launch(self):
        self.log.append(("sparse", "launch"))
        cfg = self.opt.param_cfgs["value_embeds"]
        g = self.grad.to(self.param.dtype).contiguous()
        if self.opt.world_size == 1:
            self.chunk, self.h = g, None
        else:
            self.chunk = torch.empty_like(g[:cfg.chunk_size])
            self.h = self.opt.comms.reduce_scatter_avg(self.chunk, g)

    def update(self):
        self.log.append(("sparse", "update"))
        if self.h is not None:
            self.h.wait()
        self.opt.adam_update_shard(self.param, self.chunk)
        self.gather = self.opt.comms.all_gather(self.param.data, self.opt._param_shard("value_embeds"))

    def finish(self):
        self.log.append(("sparse", "finish"))
        self.gather.wait()


class RecordingComms(Comms):
    """Wraps a Comms and logs every collective as (op, data_ptr of its output/input tensor)."""

    def __init__(self, inner: Comms, log: list):
        self.inner, self.log = inner, log
        self.world_size, self.rank, self.backend = inner.world_size, inner.rank, inner.backend

    def reduce_scatter_avg(self, out, inp):
        self.log.append(("reduce_scatter", inp.data_ptr()))
        return self.inner.reduce_scatter_avg(out, inp)

    def all_reduce_avg(self, t):
        self.log.append(("all_reduce", t.data_ptr()))
        return self.inner.all_reduce_avg(t)

    def all_gather(self, out, inp):
        self.log.append(("all_gather", out.data_ptr()))
        return self.inner.all_gather(out, inp)

    def all_reduce_sum_now(self, t):
        return self.inner.all_reduce_sum_now(t)


# ------------------------------------------------------------------ the bridge to anvil_ref
def master64(opt, label: str) -> np.ndarray:
    """A parameter's exact master as float64 (a bf16 bank: bf16 parameter joined with its mantissa)."""
    p, cfg = opt.params[label], opt.param_cfgs[label]
    if cfg.optim == "anvil" and p.dtype == torch.bfloat16:
        assert opt.world_size == 1, "the mantissa of other ranks' matrices is not here"
        return A.join_fp32(p.data.view(cfg.reshape).cpu(), opt.param_states[label]["mantissa"].cpu()
                           ).double().reshape(p.shape).numpy()
    return p.data.double().cpu().numpy()


def to_reference(opt, *, extra_pending: dict | None = None, margin: float = A.FROBENIUS_MARGIN) -> ReferenceAnvilAndAdam:
    """A reference optimizer in exactly the fast optimizer's current state (one process): masters,
    rails, lane energies, moments, step counts, configs, rails scalars, untie state, and the kept
    Adam gradients (``opt``'s ``.grad`` of Adam parameters plus ``extra_pending``) as pending."""
    assert opt.world_size == 1
    params = {l: ParamSpec(master64(opt, l), opt.param_cfgs[l].reshape, opt.param_cfgs[l].frozen_matrices)
              for l in opt.labels}
    ref = ReferenceAnvilAndAdam(params, opt.param_table, adam_defaults=opt.adam_defaults,
                                anvil_defaults=opt.anvil_defaults, margin=margin)
    for l, st in opt.param_states.items():
        if opt.param_cfgs[l].optim == "anvil":
            ref.state[l] = dict(velocity=st["velocity"].double().cpu().numpy(),
                                lane_energy=st["lane_energy"].double().cpu().numpy())
        else:
            ref.state[l] = dict(step=int(st["step"]), exp_avg=st["exp_avg"].double().cpu().numpy(),
                                exp_avg_sq=st["exp_avg_sq"].double().cpu().numpy())
        for k in ("lr", "momentum"):
            setattr(ref.param_cfgs[l], k, getattr(opt.param_cfgs[l], k))
    ref.pending_grads = {l: opt.params[l].grad.double().cpu().numpy() for l in opt.adam_labels
                         if opt.params[l].grad is not None}
    for l, g in (extra_pending or {}).items():
        ref.pending_grads[l] = g.double().cpu().numpy()
    ref.fast_beta, ref.fast_weight, ref.split_embed = opt.fast_beta, opt.fast_weight, opt.split_embed
    return ref


def set_hyper(opt, step: int) -> None:
    """The record's per-step schedule (rails, momentum) and a decaying lr, as a training loop sets them."""
    opt.set_rail_scalars(A.rail_scalars(step, 40, engage_step=3))
    for cfg in opt.param_cfgs.values():
        cfg.lr = cfg.initial_lr * (1.0 - 0.02 * step)


def eager_bank_update(bank) -> None:
    """The bank update as plain eager torch (anvil_fast.core.eager: the seed's roundings with library
    matmuls): the "eager" floor of anvil_fast/core/tolerances.py for a whole optimizer step. Same fields
    read and written as anvil_fast.core.bank.anvil_bank_update."""
    from anvil_fast.core.eager import eager_bf16_cascade, eager_equalizer, eager_rails, eager_update

    cfg = bank.config
    look, v0, v1 = eager_rails(bank.grad, bank.velocity[0], bank.velocity[1], momentum=float(bank.momentum),
                               fast_beta=float(bank.fast_beta), fast_weight=float(bank.fast_weight))
    u = eager_bf16_cascade(look, maps=bank.maps, margin=cfg.margin(), fp32_trace=cfg.fp32_trace,
                           prescale=cfg.prescale, split=False if cfg.fused_axb else None)
    v, e = eager_equalizer(u, bank.lane_energy, beta2=bank.beta2)
    p, m = eager_update(bank.p_slice, bank.mantissa, v, v1, eff_wd=bank.eff_wd, eff_lr=bank.eff_lr)
    bank.velocity[0].copy_(v0)
    bank.velocity[1].copy_(v1)
    bank.lane_energy.copy_(e)
    bank.p_slice.copy_(p)
    if m is not None:
        bank.mantissa.copy_(m)


def adam_terms(cfg, p_old: np.ndarray, g: np.ndarray, m_old: np.ndarray, v_old: np.ndarray, step: int) -> np.ndarray:
    """The largest term entering each element of an Adam step (float64): |p|, |p * eff_wd| and
    T = step_size * max(|m|, |g|) / (sqrt(v') + eps), the size the update has before m' cancels.
    An fp32 implementation's error is bounded in ulps of this (anvil_fast/core/tolerances.py, ADAM_ULPS)."""
    b1, b2 = cfg.adam_betas
    lr = cfg.lr * cfg.lr_mul
    ss = A.adam_step_size(lr=lr, beta1=b1, beta2=b2, step=step)
    v_new = b2 * v_old + (1 - b2) * g * g
    t = ss * np.maximum(np.abs(m_old), np.abs(g)) / (np.sqrt(v_new) + cfg.eps)
    eff_wd = lr * lr * cfg.weight_decay * cfg.wd_mul
    return np.maximum.reduce([np.abs(p_old), np.abs(p_old) * eff_wd, t])


def ulp(x: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """The ulp at |x| of a binary format with ``mantissa_bits`` explicit bits (fp32: 23, bf16: 7)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126)))
    return np.exp2(e - mantissa_bits)


def sync_optimizer(dst, src) -> None:
    """``dst`` takes ``src``'s parameters, state and gradients, bit for bit (one process each)."""
    for label, p in src.params.items():
        dst.params[label].data.copy_(p.data)
    dst.load_state_dict(src.state_dict())  # also the kept Adam gradients
    for label in src.bank_labels:  # ANVIL gradients are not part of a state dict
        g = src.params[label].grad
        dst.params[label].grad = None if g is None else g.clone()
