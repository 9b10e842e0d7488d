"""anvil_fast: the Triton / torch.compile path of ANVIL, tested against anvil_ref.

Start with the drop-in optimizer: ``opt = anvil_fast.ANVIL(model)`` (its docstring holds a training
loop; ``opt.describe()`` prints the plan).

Which module owns which concept (the reference of each is the same-named ``anvil_ref`` module; the
rules both share -- orientation, lane reduction, fp32 split/join, constants -- are imported from
``anvil_ref``, never restated):

======================  ============================================================================"""

import importlib

# Imported on first use, so ``import anvil_fast`` stays light (no Triton, no compile).
_LAZY = {"ANVIL": ".dropin", "StaleParameterError": ".dropin", "NonFiniteGradientWarning": ".dropin",
         "NonFiniteGradientError": ".optimizer", "AnvilAndAdam": ".optimizer",
         # the bank update and its parts (anvil_fast.bank, .cascade, .gram)
         "AnvilBank": ".bank", "anvil_bank_update": ".bank",
         "fast_cascade": ".cascade", "CascadeConfig": ".cascade", "SAFE": ".cascade", "FAITHFUL": ".cascade",
         "GRAM_SIDE": ".cascade",
         "XXT": ".gram", "XTX": ".gram", "ba_plus_cAA": ".gram", "aX_plus_mm": ".gram"}
_SUBMODULES = ("dropin", "optimizer", "bank", "bank_scalars", "replicated_adam", "comms", "distributed", "graphs",
               "rails", "cascade", "normalize", "gram", "gram_tune", "equalizer", "update", "adam", "transpose",
               "tolerances", "difftest", "near_rank1", "safety", "eager", "plain", "scaling", "gpt", "bench",
               "gram_side", "gram_side_study", "train_step", "cost_model", "fsdp")

__all__ = list(_LAZY) + list(_SUBMODULES)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'anvil_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
