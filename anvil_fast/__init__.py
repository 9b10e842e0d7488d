"""anvil_fast: the Triton / torch.compile path of ANVIL (symmetric Gram kernels, the compiled
cascade, the bf16 + mantissa update, the full optimizer). Tested against anvil_ref."""

# The optimizers, imported on first use (``import anvil_fast`` stays light: no Triton, no compile).
_LAZY = {"ANVIL": ".dropin", "AnvilAndAdam": ".optimizer",
         # the bank update and its parts (anvil_fast.bank, .cascade, .gram)
         "AnvilBank": ".bank", "anvil_bank_update": ".bank",
         "fast_cascade": ".cascade", "CascadeConfig": ".cascade", "SAFE": ".cascade", "FAITHFUL": ".cascade",
         "XXT": ".gram", "XTX": ".gram", "ba_plus_cAA": ".gram", "aX_plus_mm": ".gram"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'anvil_fast' has no attribute {name!r}")
