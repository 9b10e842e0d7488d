"""anvil_fast.kernels: the Triton kernels and the machinery every one of them shares.

The bottom layer: it imports torch, Triton and anvil_ref, nothing else of the package. Each module is
one concept's kernels with its plain-torch form beside it (``backend="auto" | "triton" | "torch"``
through ``backend.use_triton``); ``gram_tune`` picks the Gram kernels' launch configurations per
shape; ``capture`` and ``timing`` are the package's one CUDA-graph capture sequence and its one timer;
``bank_scalars`` is the per-step scalar buffer the kernels read on the device. The module map is in
:mod:`anvil_fast`.
"""
