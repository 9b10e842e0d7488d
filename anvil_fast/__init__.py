"""anvil_fast: the Triton / torch.compile path of ANVIL (symmetric Gram kernels, the compiled
cascade, the bf16 + mantissa update, the full optimizer). Tested against anvil_ref."""
