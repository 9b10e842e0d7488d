"""anvil_fast.optim: the optimizers users construct, and what runs one of their steps.

``optimizer.AnvilAndAdam`` (the seed's optimizer over a labelled table) and its parts (replicated
Adam, the step as CUDA graphs, the one-process device step); the front-ends ``frontend`` (their one
base and the ``ANVIL`` factory), ``dropin`` and ``fsdp``; ``roles`` (what a parameter does in a
traced forward); ``overlap`` (a step whose reduce-scatters are launched from the backward pass).
Imports kernels, core and parallel; never a model, a benchmark or a study.
"""
