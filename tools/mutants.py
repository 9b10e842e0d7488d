"""Mutation check of the tests: apply one deliberate bug at a time and show that the tests meant to
catch it fail by an assertion (a test must be able to fail).

    python tools/mutants.py              # baseline, then every mutant; a table; exit 1 unless all caught
    python tools/mutants.py -k adam      # only mutants whose name contains "adam"
    python tools/mutants.py --list       # the mutants and their tests, nothing run

How it works:

* The tree is copied once into a scratch folder (never the working tree, which others may be
  testing at the same time); each mutant's edits are applied there and undone afterwards.
* **Baseline first**: every test named by the selected mutants runs on the unmutated copy. If any
  fails, errors or does not import the copy's own packages, the tool stops (exit 2): a broken
  environment would otherwise mark every mutant caught.
* Each mutant runs **only its own tests**. It counts as **CAUGHT** only when one of them fails by an
  assertion: an ``AssertionError`` (a failed ``assert``, ``pytest.raises``' ``match``) or pytest's
  ``Failed`` (``pytest.raises`` that did not raise, ``pytest.fail``). A collection error, an import
  error, any other exception, or a timeout is **ERROR** (reported with what happened); no failure at
  all is **SURVIVED**.

Adding a mutant: append a :class:`Mutant` to ``MUTANTS`` -- a name, the file, the exact old text
(found exactly once in that file), the new text, and the pytest node ids (files or
``file::test``) that must catch it; ``also`` holds further ``(file, old, new)`` edits of the same
mutant when one bug spans files.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Seconds one pytest run (a mutant's tests, or the baseline) may take before it counts as ERROR.
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    also: tuple[tuple[str, str, str], ...] = field(default=())

    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.path, self.old, self.new), *self.also]


def M(name, path, old, new, *tests, also=()) -> Mutant:
    return Mutant(name, path, old, new, tuple(tests), tuple(also))


_C_PLUS_1PCT = "ANVIL_MAPS = tuple((a, b, 1.01 * c) for a, b, c in ANVIL_MAPS)  # mutant\n"

DROPIN_REF = "tests/test_dropin_reference.py::"
DROPIN_RUN = DROPIN_REF + "test_steps_match_the_reference_with_every_value_changed_mid_run"

MUTANTS: list[Mutant] = [
    # ---- anvil_ref, the specification
    M("ref rails: wrong sign in EMA", "anvil_ref/rails.py", "return like(beta * v_ + (1.0 - beta) * g_, g)",
      "return like(beta * v_ - (1.0 - beta) * g_, g)", "tests/test_rails.py"),
    M("ref rails: schedule off-by-one (warmup)", "anvil_ref/rails.py", "return beta_min + (step / warmup_steps)",
      "return beta_min + ((step + 1) / warmup_steps)", "tests/test_rails.py"),
    M("ref rails: schedule off-by-one (cooldown)", "anvil_ref/rails.py", "((step - cooldown_start) / cooldown_steps)",
      "((step - cooldown_start + 1) / cooldown_steps)", "tests/test_rails.py"),
    M("ref rails: engage off-by-one", "anvil_ref/rails.py", "if step < engage_step:", "if step <= engage_step:",
      "tests/test_rails.py"),
    M("ref cascade: swapped orientation", "anvil_ref/cascade.py", "return shape[-2] > shape[-1]",
      "return shape[-2] < shape[-1]", "tests/test_cascade.py"),
    M("ref cascade: square takes tall branch", "anvil_ref/cascade.py", "return shape[-2] > shape[-1]",
      "return shape[-2] >= shape[-1]", "tests/test_cascade.py"),
    M("ref cascade: wrong sign in map", "anvil_ref/cascade.py", "poly = b * a_ + c * (a_ @ a_)",
      "poly = b * a_ - c * (a_ @ a_)", "tests/test_cascade.py"),
    M("ref equalizer: axis swapped", "anvil_ref/equalizer.py", "return -1 if shape[-2] >= shape[-1] else -2",
      "return -2 if shape[-2] >= shape[-1] else -1", "tests/test_equalizer.py"),
    M("ref update: strict decay gate", "anvil_ref/update.py", "return like((g * p_ >= 0).astype(np.float64), p)",
      "return like((g * p_ > 0).astype(np.float64), p)", "tests/test_update.py"),
    M("ref update: wrong update sign", "anvil_ref/update.py", "return like(p_ - p_ * aligned * wd * lr - u * lr, p)",
      "return like(p_ - p_ * aligned * wd * lr + u * lr, p)", "tests/test_update.py"),
    M("ref adam: bias-correction off-by-one", "anvil_ref/adam.py",
      "return lr * (math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step))",
      "return lr * (math.sqrt(1.0 - beta2 ** (step + 1)) / (1.0 - beta1 ** (step + 1)))", "tests/test_adam.py"),
    M("ref adam: gate non-strict", "anvil_ref/adam.py", "u = u + p_ * (u * p_ > 0) * eff_wd",
      "u = u + p_ * (u * p_ >= 0) * eff_wd", "tests/test_adam.py"),
    M("ref storage: split shift", "anvil_ref/storage.py", "return Halves(_out((bits >> 16).astype(np.uint16), master),",
      "return Halves(_out((bits >> 15).astype(np.uint16), master),", "tests/test_storage.py"),
    M("ref optimizer: tied grad not added", "anvil_ref/optimizer.py",
      "pending[LM_HEAD_LABEL] = pending[LM_HEAD_LABEL] + pending[EMBED_LABEL].T",
      "pending[LM_HEAD_LABEL] = pending[LM_HEAD_LABEL]", "tests/test_optimizer.py"),
    M("ref optimizer: adam grads dropped", "anvil_ref/optimizer.py", "            self.pending_grads = pending\n            return",
      "            self.pending_grads = {}\n            return", "tests/test_optimizer.py"),
    M("ref optimizer: gate on fast rail", "anvil_ref/optimizer.py", "p_new = sign_aligned_update(p, u, rails.v_slow,",
      "p_new = sign_aligned_update(p, u, rails.v_fast,", "tests/test_optimizer.py"),
    M("ref config: shape multiplier transposed", "anvil_ref/config.py",
      "lr_mul = shape_lr_multiplier(rows, cols, convention=convention) * lr_mul",
      "lr_mul = shape_lr_multiplier(cols, rows, convention=convention) * lr_mul", "tests/test_update.py", "tests/test_optimizer.py"),
    # ---- the map coefficients: +1% on every c where the fast and the eager cascade read them (a bug
    # both share, the reference not), and in the constants themselves (everything shares it)
    M("+1% on every map's c (fast and eager)", "anvil_fast/core/eager.py", "_BF16_MAX = torch.finfo(torch.bfloat16).max\n",
      _C_PLUS_1PCT + "_BF16_MAX = torch.finfo(torch.bfloat16).max\n",
      "tests/test_cascade.py::test_fast_cascade_matches_reference", "tests/test_difftest.py",
      also=(("anvil_fast/core/cascade.py", "@dataclass(frozen=True)\nclass CascadeConfig:",
             _C_PLUS_1PCT + "@dataclass(frozen=True)\nclass CascadeConfig:"),)),
    M("+1% on every map's c (anvil_ref.constants)", "anvil_ref/constants.py",
      "    (2.256537145403, -2.166840097229, 0.929501253245),\n)",
      "    (2.256537145403, -2.166840097229, 0.929501253245),\n)\n" + _C_PLUS_1PCT,
      "tests/test_cascade.py", "tests/test_maps.py", "tests/test_gram.py", "tests/test_certify.py"),
    # ---- the fast path's element-wise kernels (Triton's CPU interpreter)
    M("fast lerp: wrong base of the large-weight branch", "anvil_fast/kernels/rails.py", "tl.fma(-(1.0 - w), d, b))",
      "tl.fma(-(1.0 - w), d, a))", "tests/test_rails.py"),
    M("fast rails: SAFE clamp dropped", "anvil_fast/kernels/rails.py", "CLAMP=bool(prescale),", "CLAMP=False,",
      "tests/test_rails.py"),
    M("fast norm: block factor inverted", "anvil_fast/kernels/normalize.py", "f = _exp2i(_floor_log2(pa, LIMIT) - e)",
      "f = _exp2i(e - _floor_log2(pa, LIMIT))", "tests/test_normalize.py"),
    M("fast norm: exponent off by one", "anvil_fast/kernels/normalize.py",
      "e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127",
      "e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126", "tests/test_normalize.py"),
    M("fast equalizer: guard bound", "anvil_fast/kernels/equalizer.py", "ok = pre <= bound  #", "ok = pre <= 10 * bound  #",
      "tests/test_equalizer.py"),
    M("fast equalizer: EMA weight", "anvil_fast/kernels/equalizer.py",
      "GUARD_NORM_RATIO * math.sqrt(min(rows, cols)), 1 - float(beta2),",
      "GUARD_NORM_RATIO * math.sqrt(min(rows, cols)), float(beta2),", "tests/test_equalizer.py"),
    M("fast equalizer: lane index", "anvil_fast/kernels/equalizer.py", "lane = inner // cols if LANE_IS_ROW else inner % cols",
      "lane = inner % cols if LANE_IS_ROW else inner // cols", "tests/test_equalizer.py"),
    # ---- the equalizer's gains, applied by the update
    M("fast update: the gains on the other lanes", "anvil_fast/kernels/update.py",
      "g = gain.unsqueeze(-1) if lanes_are_rows else gain.unsqueeze(-2)",
      "g = gain.unsqueeze(-2) if lanes_are_rows else gain.unsqueeze(-1)",
      "tests/test_update.py", "tests/test_bank.py::test_update_applies_the_equalizer_gains_as_the_equalizer_does"),
    M("fast update: the gains' bf16 rounding dropped under torch.compile", "anvil_fast/kernels/update.py",
      "scaled = _bf16_rounded(update.float() * g.float())",
      "scaled = (update.float() * g.float()).to(torch.bfloat16).float()", "tests/test_update.py"),
    # ---- the Gram side's start of its polynomial
    M("plus_identity_: the kernel's diagonal stride off by one", "anvil_fast/kernels/plus_identity.py",
      "i.to(tl.int64) * (n + 1)", "i.to(tl.int64) * n", "tests/test_plus_identity.py"),
    M("plus_identity_: a rounded to bf16 before the add", "anvil_fast/kernels/plus_identity.py",
      "diag.copy_(diag.float() + a)", "diag.add_(a)", "tests/test_plus_identity.py"),
    M("gram side: Q made before B's last reader ran", "anvil_fast/core/cascade.py",
      "out=B, backend=backend)\n        if not fresh:\n",
      "out=B, backend=backend)\n        if fresh:\n            plus_identity_(B, a, backend=backend)\n"
      "        if not fresh:\n", "tests/test_gram_side.py",
      also=(("anvil_fast/core/cascade.py", "Rk, B = plus_identity_(B, a, backend=backend), Rk", "Rk, B = B, Rk"),)),
    M("gram side: P = Q A as a full product", "anvil_fast/core/cascade.py",
      "sym_aX_plus_mm(A, B, A, a=a, out=P, backend=backend)", "aX_plus_mm(A, B, A, a=a, out=P, backend=backend)",
      "tests/test_gram_side.py"),
    M("gram side: R's update mirrored", "anvil_fast/core/cascade.py",
      "aX_plus_mm(Rk, Rk, B, a=a, out=R2, backend=backend) if tall", "sym_aX_plus_mm(Rk, Rk, B, a=a, out=R2, backend=backend) if tall",
      "tests/test_gram_side.py"),
    # ---- the benchmarks' floor
    M("bench floor: the standard cascade's FLOPs on a bank that runs the Gram side", "anvil_fast/bench/common.py",
      "    if sched is not None:\n        return c * cascade_flops", "    if False:\n        return c * cascade_flops",
      "tests/test_bench_common.py", "tests/test_bench_optimizer.py", "tests/test_bench_dropin.py"),
    # ---- a Gram kernel
    M("gram kernel: alpha and beta swapped in b*A + c*A@A", "anvil_fast/kernels/gram_kernels.py",
      "            val = alpha * acc + beta * xij.to(tl.float32)\n",
      "            val = beta * acc + alpha * xij.to(tl.float32)\n",
      "tests/test_gram.py"),
    # ---- the Gram-side cascade
    M("ref gram side: R not reset at a restart", "anvil_ref/gram_side.py",
      "            ak = gram(x0)\n            r = np.broadcast_to(np.eye(ak.shape[-1]), ak.shape).copy()\n",
      "            ak = gram(x0)\n", "tests/test_gram_side.py"),
    M("fast gram side: a*P dropped from Q (Q A), v1 kernel", "anvil_fast/kernels/gram_kernels.py",
      "val = acc + alpha * xij.to(tl.float32)", "val = acc", "tests/test_gram_side.py", "tests/test_gram.py"),
    M("fast gram side: a*P dropped from Q (Q A), tuned kernel", "anvil_fast/kernels/gram_kernels.py",
      "            val = acc + beta * xij.to(tl.float32)\n", "            val = acc\n", "tests/test_gram_side.py",
      "tests/test_gram.py"),
    M("fast gram side: the tuned kernel's R panel advanced along the wrong axis", "anvil_fast/kernels/gram_kernels.py",
      "                pa += BLOCK_K * slk\n                pb += BLOCK_K * srk\n",
      "                pa += BLOCK_K * slk\n                pb += BLOCK_K * srn\n", "tests/test_gram.py"),
    # ---- Adam
    M("fast adam kernel: gate > turned into >=", "anvil_fast/kernels/adam.py",
      "u = u + tl.where(u * p > 0, p * eff_wd, 0.0)", "u = u + tl.where(u * p >= 0, p * eff_wd, 0.0)",
      "tests/test_adam.py"),
    M("fast adam torch path: gate > turned into >=", "anvil_fast/kernels/adam.py",
      "u = u + torch.where(u * pf > 0, pf * eff_wd,", "u = u + torch.where(u * pf >= 0, pf * eff_wd,",
      "tests/test_adam.py"),
    M("fast adam: bias correction off-by-one", "anvil_fast/kernels/adam.py", "bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step",
      "bias1, bias2 = 1 - beta1 ** (step + 1), 1 - beta2 ** (step + 1)", "tests/test_adam.py"),
    # ---- the optimizer
    M("optimizer: the replicated tied lm_head loses embed's gradient", "anvil_fast/optim/optimizer.py",
      "                and self.param_cfgs[LM_HEAD_LABEL].comms == \"replicated\":\n            transpose_add(embed, lm)",
      "                and self.param_cfgs[LM_HEAD_LABEL].comms == \"replicated\":\n            pass",
      "tests/test_optimizer_api.py"),
    M("optimizer: the sharded tied lm_head loses embed's gradient", "anvil_fast/optim/optimizer.py",
      "            if label == LM_HEAD_LABEL and tied_now and do_adam and embed is not None:\n"
      "                transpose_add(embed, g)",
      "            if label == LM_HEAD_LABEL and tied_now and do_adam and embed is not None:\n"
      "                pass", "tests/test_optimizer.py", "tests/test_optimizer_api.py"),
    M("optimizer: per-matrix lr multiplier dropped", "anvil_fast/optim/optimizer.py",
      "lrs.append([cfg.lr_mul * m * cfg.lr for m in cfg.per_matrix_lr_mul])",
      "lrs.append([cfg.lr_mul * cfg.lr for m in cfg.per_matrix_lr_mul])", "tests/test_optimizer.py"),
    M("optimizer: Adam lr without its multiplier", "anvil_fast/optim/optimizer.py",
      "row = adam_row(lr=cfg.lr * cfg.lr_mul, beta1=b1, beta2=b2, eps=cfg.eps, weight_decay=cfg.weight_decay,",
      "row = adam_row(lr=cfg.lr, beta1=b1, beta2=b2, eps=cfg.eps, weight_decay=cfg.weight_decay,",
      "tests/test_optimizer.py"),
    M("optimizer: maps= not passed to the banks", "anvil_fast/optim/optimizer.py",
      'extra = {} if maps is None else {"maps": maps}', "extra = {}", "tests/test_optimizer_api.py"),
    # ---- the benchmark's baseline
    M("plain: the slow rail's beta for the fast rail", "anvil_fast/core/plain.py",
      "velocity[0].lerp_(grad_chunk, 1 - fast_beta_t.to(grad_chunk.dtype))",
      "velocity[0].lerp_(grad_chunk, 1 - RAIL_SLOW_BETA)", "tests/test_plain.py"),
    M("plain: the first Gram not rescaled", "anvil_fast/core/plain.py", "    A = (A.float() / d.square()).bfloat16()",
      "    A = (A.float() / d).bfloat16()", "tests/test_plain.py"),
    # ---- comms
    # ---- the drop-in (tests/test_dropin_reference.py builds its reference from the user's arguments alone)
    M("dropin: fast_beta ignored", "anvil_fast/optim/optimizer.py",
      'fast_beta = anvil["momentum"] if anvil["fast_beta"] is None else anvil["fast_beta"]', 'fast_beta = anvil["momentum"]',
      DROPIN_RUN),
    M("dropin: Adam weight decay dropped", "anvil_fast/optim/optimizer.py",
      'cfg.eps, cfg.weight_decay = float(adam["eps"]), float(adam["weight_decay"])',
      'cfg.eps, cfg.weight_decay = float(adam["eps"]), 0.0', DROPIN_RUN),
    M("device step (transient): a bank gradient checked in fp32, not as the bf16 it travels in",
      "anvil_fast/optim/device_step.py",
      "n.to(torch.bfloat16).float() if self.check_bf16[i] else n.float()", "n.float()",
      "tests/test_dropin_memory.py::test_transient_read_equals_buffers_bit_for_bit"),
    M("device step (transient): a member's gradient left out of its bank", "anvil_fast/optim/device_step.py",
      "            if g is not None:\n                buf[first:first + count].view(g.shape).copy_(g)",
      "            if g is not None and first:\n                buf[first:first + count].view(g.shape).copy_(g)",
      "tests/test_dropin_memory.py::test_transient_read_equals_buffers_bit_for_bit"),
    M("device step (transient): the bank's gradient kept after its update", "anvil_fast/optim/device_step.py",
      "bank.grad = None  # freed here", "pass  # freed here",
      "tests/test_dropin_memory.py::test_cpu_fp32_model_holds_adamw_memory",
      "tests/test_dropin_memory.py::test_transient_read_keeps_nothing_between_steps"),
    M("device step (transient): the step's gradients referred to past it", "anvil_fast/optim/device_step.py",
      "            self._grads = []  # the step holds", "            pass  # the step holds",
      "tests/test_dropin_memory.py::test_cpu_fp32_model_holds_adamw_memory"),
    M("device step: a matrix without a gradient counted active", "anvil_fast/optim/device_step.py",
      "bank_active.copy_(has[:n_mat] * ok)", "bank_active.copy_(torch.ones_like(has[:n_mat]) * ok)",
      DROPIN_REF + "test_members_without_gradient_are_untouched",
      "tests/test_dropin.py::test_member_without_grad_is_untouched_inside_a_bank"),
    M("device step: a stale gradient buffer of a member without .grad checked", "anvil_fast/optim/device_step.py",
      "check_buffers(self.buffer_check, self.flags, mask=self.has.index_select(0, self.param_first))",
      "check_buffers(self.buffer_check, self.flags)",
      "tests/test_dropin.py::test_a_member_without_grad_after_a_skipped_nan_step_does_not_skip_again[buffers]"),
    M("dropin: step(closure) returns None", "anvil_fast/optim/dropin.py",
      "            self._engine_step()\n            return loss\n", "            self._engine_step()\n            return None\n",
      DROPIN_REF + "test_step_returns_the_closures_loss"),
    M("device step: a refused step counted as taken", "anvil_fast/optim/device_step.py",
      "    counters[0:1].add_(ok)\n", "    counters[0:1].add_(1)\n",
      "tests/test_device_step.py::test_nan_step_twin_on_the_in_place_read",
      "tests/test_dropin.py::test_nonfinite_step_is_skipped_and_the_run_continues_as_a_twin_that_never_saw_it"),
    M("device step: Adam rows active on a refused step", "anvil_fast/optim/device_step.py",
      "    active = has[n_mat:] * ok\n", "    active = has[n_mat:] * 1\n",
      "tests/test_device_step.py::test_nan_step_twin_on_the_in_place_read"),
    M("device step: the record schedule one step ahead", "anvil_fast/optim/device_step.py",
      "t = counters[0:1].clamp(0, record.shape[0] - 1)", "t = (counters[0:1] + 1).clamp(0, record.shape[0] - 1)",
      "tests/test_device_step.py::test_device_scalars_are_the_host_formulas"),
    M("device step: the Adam bias correction's square root dropped", "anvil_fast/optim/device_step.py",
      "lr_row * (torch.pow(bias2, torch.full_like(bias2, 0.5)) / torch.where(on, bias1, 1))",
      "lr_row * (bias2 / torch.where(on, bias1, 1))",
      "tests/test_device_step.py::test_device_scalars_are_the_host_formulas"),
    M("rails kernel: an inactive matrix's fast rail written", "anvil_fast/kernels/rails.py",
      "            tl.store(v0_ptr + offs, v0, mask=m & on)\n", "            tl.store(v0_ptr + offs, v0, mask=m)\n",
      "tests/test_device_step.py::test_in_place_read_leaves_a_member_without_gradient_untouched"),
    M("check kernel: a bank's fp32 gradient not checked as bf16", "anvil_fast/kernels/nonfinite.py",
      "self.cast_bf16 = dtype, bool(cast_bf16) and dtype == torch.float32", "self.cast_bf16 = dtype, False",
      "tests/test_device_step.py::test_check_flags_exactly_the_nonfinite_gradients"),
    M("lean rails: both rails draw the same bits", "anvil_fast/kernels/rails.py",
      "            tl.store(v1_ptr + offs, _stochastic_bf16(v1, key1, idx), mask=m & on)",
      "            tl.store(v1_ptr + offs, _stochastic_bf16(v1, key0, idx), mask=m & on)",
      "tests/test_device_step.py::test_in_place_read_equals_the_buffers_read"),
    M("lean rails: the torch path rounds to nearest", "anvil_fast/kernels/rails.py",
      "        velocity[1].copy_(torch.where(on, _stochastic_bf16_torch(v1, sr_step, 1, index), velocity[1]))",
      "        velocity[1].copy_(torch.where(on, v1.bfloat16(), velocity[1]))",
      "tests/test_device_step.py::test_lean_rails_are_bf16_rounded_as_specified"),
    M("adam table kernel: every parameter reads the first table row", "anvil_fast/kernels/adam.py",
      "        row = tl.load(meta_ptr + 2 * j + 1).to(tl.int64)\n", "        row = tl.load(meta_ptr + 2 * j + 1).to(tl.int64) * 0\n",
      "tests/test_device_step.py::test_adam_table_kernel_is_the_per_parameter_kernel"),
    M("equalizer: a non-finite FAITHFUL update applied", "anvil_fast/core/bank.py",
      "finite_only=not cfg.guard, backend=backend, apply=not defer)",
      "finite_only=not cfg.guard, backend=backend, apply=not defer) if cfg.guard else v",
      "tests/test_device_step.py::test_faithful_nonfinite_update_is_refused_and_named"),
    M("dropin: a beta2 change not pushed to the banks", "anvil_fast/optim/optimizer.py",
      "                bank.beta2 = cfg.beta2\n", "                pass\n", DROPIN_RUN),
    M("dropin: a default head name lost", "anvil_fast/optim/plan.py",
      'HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")',
      'HEAD_NAMES = ("lm_head", "classifier", "fc_out", "output_layer")',
      DROPIN_REF + "test_drop_in_routes_like_the_reference", DROPIN_REF + "test_default_head_names_are_the_specifications"),
    M("roles: x @ W read as [out, in]", "anvil_fast/optim/roles.py",
      "        return (not k.swapped) if right else k.swapped\n", "        return k.swapped\n",
      "tests/test_dropin_roles.py::test_observe_sees_tables_products_orientation_and_io_layers"),
    M("ref config: a transposed matrix's lr scale of its stored shape", "anvil_ref/config.py",
      "rows, cols = (reshape[-1], reshape[-2]) if transposed else (reshape[-2], reshape[-1])",
      "rows, cols = (reshape[-2], reshape[-1])",
      "tests/test_dropin_roles.py::test_conv1d_weights_are_banked_transposed_with_linear_lr_scale"),
    M("dropin: a loaded state tensor written reversed", "anvil_fast/optim/contract.py",
      "                    live[key].copy_(v.to(live[key].device))",
      "                    live[key].copy_(v.to(live[key].device).flip(0))",
      "tests/test_dropin_contract.py::test_state_dict_round_trip_is_deterministic_and_leaves_the_saved_dict_alone"),
    M("optimizer: the non-finite verdict not shared across ranks", "anvil_fast/optim/optimizer.py",
      "            self.comms.all_reduce_sum_now(flags)  # every rank refuses together\n", "            pass\n",
      DROPIN_REF + "test_dropin_two_ranks_skip_a_step_nan_on_one_rank"),
    M("ref update: tall/wide learning-rate scale swapped", "anvil_ref/update.py",
      "return max(1.0, rows / cols) ** 0.5", "return max(1.0, cols / rows) ** 0.5", DROPIN_RUN),
    M("comms: gloo average not divided", "anvil_fast/parallel/comms.py", "        return lambda: t.div_(n)",
      "        return lambda: None", "tests/test_distributed.py::test_two_gloo_ranks"),
    M("comms: local reduce-scatter skips the copy", "anvil_fast/parallel/comms.py",
      "        _check_rs(out, inp, 1)\n        if out.data_ptr() != inp.data_ptr():\n            out.copy_(inp.view(out.shape))",
      "        _check_rs(out, inp, 1)\n        if False:\n            out.copy_(inp.view(out.shape))",
      "tests/test_comms.py"),
    M("cost model: a ring collective moves every byte w - 1 times", "anvil_fast/studies/cost_model.py",
      "s * ab.alpha_ms + s / world * nbytes / (ab.bw_gbs * 1e6)", "s * ab.alpha_ms + s * nbytes / (ab.bw_gbs * 1e6)",
      "tests/test_cost_model.py::test_ring_formula_for_known_alpha_beta"),
    M("cost model: an update does not wait for its reduce-scatter", "anvil_fast/studies/cost_model.py",
      "compute_t = max(compute_t, rs_done[l]) + p.update_ms", "compute_t = compute_t + p.update_ms",
      "tests/test_cost_model.py::test_schedule_timeline_by_hand"),
    M("train step: Adam gradients reduced on a step without Adam", "anvil_fast/optim/overlap.py",
      "self._queue = self.opt.step_labels(self.do_adam, self.sharded)",
      "self._queue = list(self.sharded)",
      "tests/test_train_step.py::test_overlapped_equals_sequential_on_two_gloo_ranks"),
    M("train step: the reduces launched from the backward pass are launched again", "anvil_fast/optim/optimizer.py",
      "                pending[label] = launched[label]\n                continue\n",
      "                pass\n", "tests/test_train_step.py::test_each_reduce_is_launched_once_per_step"),
    # ---- the peers benchmark (tests/test_bench_peers.py: fake contenders with known answers)
    M("bench peers: AdamW alone counted as the fastest peer", "anvil_fast/bench/peers.py",
      'if r.get("kind") == "peer" and r.get("status") == "ok" and r.get(key) is not None:',
      'if r.get("kind") != "anvil" and r.get("status") == "ok" and r.get(key) is not None:',
      "tests/test_bench_peers.py::test_the_fastest_peer_is_a_peer_that_ran"),
    M("bench peers: a cleared gradient not handed back", "anvil_fast/bench/peers.py",
      "            if p.grad is None:\n                p.grad = g.clone()\n            else:\n                p.grad.copy_(g)",
      "            if p.grad is not None:\n                p.grad.copy_(g)",
      "tests/test_bench_peers.py::test_every_step_sees_the_fixed_gradient"),
    M("bench peers: singular values over their mean, not their RMS", "anvil_fast/bench/peers.py",
      "rms = float(s.square().mean().sqrt())", "rms = float(s.mean())",
      "tests/test_bench_peers.py::test_spread_of_a_written_out_matrix"),
    M("bench peers: the box kills the process but not its children", "anvil_fast/bench/peers.py",
      "                os.killpg(proc.pid, signal.SIGKILL)", "                proc.kill()",
      "tests/test_bench_peers.py::test_the_box_kills_the_process_and_its_children"),
    # ---- derive_maps: interval arithmetic and certification
    M("intervals: addition not rounded outward", "derive_maps/intervals.py",
      "return _down(a[0] + b[0]), _up(a[1] + b[1])", "return a[0] + b[0], a[1] + b[1]",
      "tests/test_intervals.py"),
    M("certify: a box counts as done with 100x the tolerance", "derive_maps/certify.py",
      "done = (ub <= amax + DTYPE(tol_hi)) & (lb >= amin - DTYPE(tol_lo))",
      "done = (ub <= amax + DTYPE(100 * tol_hi)) & (lb >= amin - DTYPE(100 * tol_lo))", "tests/test_certify.py"),
    # ---- the harness (anyone's orthogonalization): each check the three planted bugs need
    M("harness: the math verdict's limit loosened tenfold", "anvil_fast/core/tolerances.py", "MATH_Z = 6.0\n",
      "MATH_Z = 60.0\n", "tests/test_harness.py::test_a_slipped_coefficient_in_torch_muon_fails_the_math",
      "tests/test_harness.py::test_a_wrong_margin_in_pytorch_optimizer_fails"),
    M("harness: orientation not judged", "anvil_fast/core/tolerances.py",
      "    if not row.conforms:\n        if note.startswith", "    if False:\n        if note.startswith",
      "tests/test_harness.py::test_a_dropped_transpose_in_torch_muon_fails"),
    M("harness: declared gains dropped", "anvil_fast/core/tolerances.py", "            n += iid(j) + (n_a + n_b) / out_sq",
      "            n += 1.0", "tests/test_polar.py"),
    M("ref polar: the clamp read as an additive eps", "anvil_ref/polar.py",
      "d = np.maximum(margin * np.sqrt(np.square(z_).sum(axis=(-2, -1), keepdims=True)), eps)",
      "d = margin * np.sqrt(np.square(z_).sum(axis=(-2, -1), keepdims=True)) + eps", "tests/test_polar.py"),
    M("certify: the lower bound's tolerance scaled by the upper value", "derive_maps/certify.py",
      "tol_hi, tol_lo = _own_tolerance(amax, rtol), _own_tolerance(amin, rtol)\n        else:",
      "tol_hi, tol_lo = _own_tolerance(amax, rtol), _own_tolerance(amax, rtol)\n        else:",
      "tests/test_certify.py::test_lower_bound_survives_a_large_value_elsewhere"),
    M("robust: the iterate's rounding left out of the cross-talk bound", "derive_maps/robust.py",
      "eX = iv_mul_pos(_c(m.delta_x), iv_add(YF, eY))", "eX = iv_mul_pos(_c(0.0), iv_add(YF, eY))",
      "tests/test_robust.py::test_weyl_bound_holds_under_the_kernels_rounding_bounds"),
    M("robust: the verdict checks the maximum only", "derive_maps/robust.py",
      "if e_env is not None and e_env.f_min_certified < lo_limit:", "if False:",
      "tests/test_robust.py::test_the_low_end_is_certified_and_refused_when_it_collapses"),
    # ---- the explosion tail's certified screen
    M("tail: the upper bound's root taken once too few", "anvil_fast/studies/tail.py",
      "upper = torch.exp(log_scale / (2 * p))", "upper = torch.exp(log_scale / p)",
      "tests/test_tail.py::test_the_bounds_hold_the_exact_top_singular_value"),
    M("tail: the undecided band counted as below the limit", "anvil_fast/studies/tail.py",
      "    if exact:\n", "    if False:\n",
      "tests/test_tail.py::test_count_past_equals_the_exact_count_including_the_undecided_band"),
    # ---- the final horizon's rate check
    M("lr_final: the best rate picked on any seeds a cell has", "papers/lr_final.py",
      "    if not all(s in cell for s in SELECT_SEEDS):\n        return None\n"
      "    return sum(T._final(cell[s]) for s in SELECT_SEEDS) / len(SELECT_SEEDS)",
      "    return sum(T._final(r) for r in cell.values()) / len(cell)",
      "tests/test_lr_final.py::test_best_is_the_lowest_mean_over_the_selection_seeds"),
    M("lr_final: the held-out comparison keeps the selection seeds", "papers/lr_final.py",
      "if not held_out or s not in SELECT_SEEDS", "if True",
      "tests/test_lr_final.py::test_the_held_out_comparison_leaves_out_the_selection_seeds"),
    M("lr_final: a partial rerun merged into the protocol's column", "papers/lr_final.py",
      "    if overlap:\n", "    if False:\n",
      "tests/test_lr_final.py::test_the_chosen_rate_column_is_the_protocols_plus_new_seeds_or_a_whole_rerun"),
    M("lr_final: the data order not compared", "papers/lr_final.py",
      "r.get(\"batches_sha256\") != ref.get(\"batches_sha256\")", "False",
      "tests/test_lr_final.py::test_a_run_of_another_setup_is_refused_by_name"),
    M("lr_final: the held-out devices read off the selection seeds", "papers/lr_final.py",
      "for s, r in cell.items() if s not in SELECT_SEEDS}", "for s, r in cell.items() if s in SELECT_SEEDS}",
      "tests/test_lr_final.py::test_the_held_out_devices_name_every_seed_run_elsewhere"),
    # ---- provenance and the measuring tools
    M("provenance: any repository's commit recorded", "anvil_ref/provenance.py",
      "    if not top or Path(top).resolve() != PROJECT_ROOT:", "    if not top:",
      "tests/test_provenance.py"),
    M("provenance: a tree that differs from HEAD recorded as HEAD", "anvil_ref/provenance.py",
      '    if _git("status", "--porcelain", "--untracked-files=no") != "":', "    if False:",
      "tests/test_provenance.py"),
    M("paper: the optimizer floor's note trusts any logged floor", "papers/data_tables.py",
      "    if abs(logged - standard) > 0.005 * standard:", "    if False:",
      "tests/test_papers.py::test_the_optimizer_floor_note_reads_the_logged_floor_and_counts_the_defaults"),
    M("kernel_profile: phases summed, not unioned", "tools/kernel_profile.py",
      "        elif b > end:\n            total += b - end\n            end = b",
      "        else:\n            total += b - a\n            end = max(end, b)",
      "tests/test_cli.py::test_kernel_profile_splits_a_step_into_its_matmul_and_other_phases"),
    M("h200_session: STAGES_ELSEWHERE on every card", "tools/h200_session.sh",
      '[[ "$card" != *H200* ]]', "true",
      "tests/test_h200_session.py"),
]


_PROBE = r'''
"""pytest plugin of tools/mutants.py: how each test failed, and where the packages were imported from."""
import json, os

import pytest

_out = {"failures": [], "errors": [], "modules": {}}


def pytest_sessionstart(session):
    for name in ("anvil_ref", "anvil_fast", "derive_maps"):
        try:
            mod = __import__(name)
            _out["modules"][name] = os.path.abspath(mod.__file__)
        except Exception as exc:  # an import error is the environment's failure, recorded
            _out["modules"][name] = f"import failed: {exc!r}"


def pytest_collectreport(report):
    if report.failed:
        _out["errors"].append({"test": report.nodeid, "what": "collection error"})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    exc = call.excinfo
    if call.when == "call" and exc is not None and (exc.errisinstance(AssertionError)
                                                    or exc.errisinstance(pytest.fail.Exception)):
        _out["failures"].append({"test": item.nodeid, "what": exc.typename})
        item.session.shouldstop = "an assertion caught the mutant"
    else:
        what = f"{call.when}: {exc.typename}: {str(exc.value)[:160]}" if exc is not None else call.when
        _out["errors"].append({"test": item.nodeid, "what": what})


def pytest_sessionfinish(session, exitstatus):
    _out["exitstatus"] = int(exitstatus)
    with open(os.environ["ANVIL_MUTANT_REPORT"], "w") as f:
        json.dump(_out, f)
'''


def _pytest(work: pathlib.Path, tests, timeout: float) -> tuple[dict | None, str, float]:
    report = work / "_mutant_report.json"
    report.unlink(missing_ok=True)
    env = {**os.environ, "ANVIL_MUTANT_REPORT": str(report), "PYTHONPATH": str(work)}
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_mutant_probe",
                            *tests], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        tail = (r.stdout + r.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s", time.monotonic() - t0
    dt = time.monotonic() - t0
    if not report.exists():
        return None, tail, dt
    return json.loads(report.read_text()), tail, dt


def classify(res: dict | None, tail: str) -> tuple[str, str]:
    """(verdict, detail) of one mutant's run: CAUGHT by an assertion, ERROR, or SURVIVED."""
    if res is None:
        return "ERROR", tail.strip().splitlines()[-1] if tail.strip() else "no report"
    if res["failures"]:
        f = res["failures"][0]
        return "CAUGHT", f"{f['test']} ({f['what']})"
    if res["errors"]:
        e = res["errors"][0]
        return "ERROR", f"{e['test']}: {e['what']}"
    if res.get("exitstatus", 0) not in (0, 5):
        return "ERROR", f"pytest exit status {res['exitstatus']}"
    return "SURVIVED", ""


def _apply(work: pathlib.Path, m: Mutant) -> dict[pathlib.Path, str]:
    saved = {}
    for path, old, new in m.edits():
        p = work / path
        src = saved.get(p, p.read_text())
        cur = p.read_text()
        if cur.count(old) != 1:
            raise SystemExit(f"mutant {m.name!r}: the old text is not found exactly once in {path}")
        saved.setdefault(p, src)
        p.write_text(cur.replace(old, new))
    return saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/mutants.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only mutants whose name contains this (case-insensitive)")
    ap.add_argument("--list", action="store_true", help="print the mutants and their tests; run nothing")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per pytest run (default %(default)s)")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if a.k.lower() in m.name.lower()]
    if not chosen:
        ap.error(f"argument -k: no mutant name contains {a.k!r} (--list shows them)")
    if a.list:
        for m in chosen:
            print(f"{m.name}\n    {' '.join(m.tests)}")
        return 0
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="anvil_mutants_") as tmp:
        work = pathlib.Path(tmp) / "tree"
        shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache"))
        (work / "_mutant_probe.py").write_text(_PROBE)
        for m in chosen:  # every edit applies to the unmutated tree
            for path, old, _ in m.edits():
                if (work / path).read_text().count(old) != 1:
                    raise SystemExit(f"mutant {m.name!r}: the old text is not found exactly once in {path}")
        tests = sorted({t for m in chosen for t in m.tests})
        # the baseline runs every chosen mutant's tests at once: minutes, so say what is running
        print(f"baseline: {len(tests)} test targets on the unmutated tree ...", file=sys.stderr, flush=True)
        res, tail, dt = _pytest(work, tests, a.timeout)
        where = (res or {}).get("modules", {})
        wrong = {k: v for k, v in where.items() if not str(v).startswith(str(work))}
        if res is None or res["failures"] or res["errors"] or res.get("exitstatus") != 0 or wrong:
            print(f"BASELINE FAILED ({dt:.0f} s): the unmutated tree does not pass its mutants' tests, so no "
                  "mutant can be judged.")
            if wrong:
                print(f"packages imported from outside the scratch copy {work}: {wrong}")
            print(tail)
            return 2
        print(f"baseline: {len(tests)} test targets pass unmutated ({dt:.0f} s)\n", flush=True)
        width = max(len(m.name) for m in chosen)
        print(f"{'mutant':<{width}}  {'result':<8}  {'s':>5}  caught by / what happened")
        print("-" * (width + 60))
        counts = {"CAUGHT": 0, "SURVIVED": 0, "ERROR": 0}
        for m in chosen:
            saved = _apply(work, m)
            try:
                res, tail, dt = _pytest(work, m.tests, a.timeout)
            finally:
                for p, src in saved.items():
                    p.write_text(src)
            verdict, detail = classify(res, tail)
            counts[verdict] += 1
            print(f"{m.name:<{width}}  {verdict:<8}  {dt:>5.0f}  {detail}", flush=True)
    print(f"\n{len(chosen)} mutants: {counts['CAUGHT']} caught, {counts['SURVIVED']} survived, "
          f"{counts['ERROR']} errors; {time.monotonic() - t_start:.0f} s in all")
    return 0 if counts["CAUGHT"] == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
