"""Deliberate bugs in the drop-in, the optimizer and Adam, each with the tests that must fail on it
(assertion failures), for tools/mutants.py. Each entry: ``file``, the exact ``old`` text (it occurs
once), its ``new`` text, and ``tests`` (pytest node ids)."""

T = "tests/test_dropin_reference.py::"
RUN = T + "test_steps_match_the_reference_with_every_value_changed_mid_run"

MUTANTS = [
    dict(name="dropin: fast_beta ignored", file="anvil_fast/dropin.py",
         old='fast_beta=group["momentum"] if group["fast_beta"] is None else group["fast_beta"])',
         new='fast_beta=group["momentum"])',
         tests=[RUN]),
    dict(name="dropin: Adam weight decay dropped", file="anvil_fast/dropin.py",
         old='cfg.eps, cfg.weight_decay = float(group["eps"]), float(group["weight_decay"])',
         new='cfg.eps, cfg.weight_decay = float(group["eps"]), 0.0',
         tests=[RUN]),
    dict(name="dropin: stale gradient for a bank member without .grad", file="anvil_fast/dropin.py",
         old='b["grad"].zero_()  # members without a gradient count as zero gradient',
         new='pass',
         tests=[T + "test_members_without_gradient_count_as_zero_in_their_bank"]),
    dict(name="dropin: step(closure) returns None", file="anvil_fast/dropin.py",
         old="        return loss\n",
         new="        return None\n",
         tests=[T + "test_step_returns_the_closures_loss"]),
    dict(name="dropin: a beta2 change not pushed to the banks", file="anvil_fast/dropin.py",
         old='self.inner.banks[b["label"]].beta2 = cfg.beta2',
         new='pass',
         tests=[RUN]),
    dict(name="dropin: the non-finite verdict not shared across ranks", file="anvil_fast/dropin.py",
         old="self.comms.all_reduce_sum_now(flags)",
         new="pass",
         tests=[T + "test_dropin_two_ranks_against_one_process"]),
    dict(name="optimizer: replicated tied lm_head loses embed's gradient", file="anvil_fast/optimizer.py",
         old="""                and self.param_cfgs[LM_HEAD_LABEL].comms == "replicated":
            transpose_add(embed.grad, lm.grad)""",
         new="""                and self.param_cfgs[LM_HEAD_LABEL].comms == "replicated":
            pass""",
         tests=[T + "test_anvil_and_adam_with_maps_and_a_replicated_tied_lm_head"]),
    dict(name="adam: the Triton kernel's cautious-decay gate > becomes >=", file="anvil_fast/adam.py",
         old="u = u + tl.where(u * p > 0, p * eff_wd, 0.0)",
         new="u = u + tl.where(u * p >= 0, p * eff_wd, 0.0)",
         tests=[T + "test_adam_through_the_triton_kernel"]),
    dict(name="adam: the torch path's cautious-decay gate > becomes >=", file="anvil_fast/adam.py",
         old="u = u + torch.where(u * pf > 0, pf * eff_wd, torch.zeros((), dtype=torch.float32))",
         new="u = u + torch.where(u * pf >= 0, pf * eff_wd, torch.zeros((), dtype=torch.float32))",
         tests=[RUN]),
    dict(name="routing: tall/wide learning-rate scale swapped", file="anvil_ref/update.py",
         old="return max(1.0, rows / cols) ** 0.5",
         new="return max(1.0, cols / rows) ** 0.5",
         tests=[RUN]),
    dict(name="routing: a default head name lost", file="anvil_fast/dropin.py",
         old='HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output_layer")',
         new='HEAD_NAMES = ("lm_head", "classifier", "fc_out", "output_layer")',
         tests=[T + "test_drop_in_routes_like_the_reference", T + "test_default_head_names_are_the_specifications"]),
]
