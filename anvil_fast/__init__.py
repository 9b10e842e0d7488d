"""anvil_fast: the Triton / torch.compile path of ANVIL, tested against anvil_ref.

Start with the drop-in optimizer: ``opt = anvil_fast.ANVIL(model)`` (its docstring holds a training
loop; ``opt.describe()`` prints the plan).

Which module owns which concept:

===================  ==========================================================================
module               concept
===================  ==========================================================================
``dropin``           ``ANVIL``: the drop-in ``torch.optim.Optimizer`` (routing, banks, step policy)
``optimizer``        ``AnvilAndAdam``: the seed's optimizer over a labelled table, comms schedule
``bank``             ``AnvilBank``, ``anvil_bank_update``: one bank's update
``cascade``          the cascade (normalization + Gram kernels + maps), ``CascadeConfig``
``gram``             the symmetric Gram kernels (``XXT``, ``XTX``, ...)
``rails``            twin-rail momentum + Nesterov lookahead
``equalizer``        the lane-energy equalizer (SAFE's guard)
``update``           the sign-aligned decay update on the fp32 master
``adam``             Adam's kernels; ``replicated_adam``: the flat-buffer replicated Adam
``comms``            the collectives (NCCL, gloo, one process)
``fsdp``             ``ANVIL`` on FSDP2 (``fully_shard``) models: owner ranks, resharding checkpoints
``graphs``           the bank updates as CUDA graphs
``gpt``              the package's GPT (benchmarks, training harness)
``bench``            ``python -m anvil_fast.bench``: the benchmarks
===================  ==========================================================================
"""

import importlib

# Imported on first use, so ``import anvil_fast`` stays light (no Triton, no compile).
_LAZY = {"ANVIL": ".dropin", "StaleParameterError": ".dropin", "NonFiniteGradientWarning": ".dropin",
         "NonFiniteGradientError": ".optimizer", "AnvilAndAdam": ".optimizer",
         # the bank update and its parts (anvil_fast.bank, .cascade, .gram)
         "AnvilBank": ".bank", "anvil_bank_update": ".bank",
         "fast_cascade": ".cascade", "CascadeConfig": ".cascade", "SAFE": ".cascade", "FAITHFUL": ".cascade",
         "XXT": ".gram", "XTX": ".gram", "ba_plus_cAA": ".gram", "aX_plus_mm": ".gram"}
_SUBMODULES = ("dropin", "optimizer", "bank", "cascade", "gram", "rails", "equalizer", "update", "adam",
               "replicated_adam", "comms", "fsdp", "graphs", "gpt", "bench")

__all__ = list(_LAZY) + list(_SUBMODULES)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'anvil_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
