"""anvil_fast.core: one bank's update built from the kernels, and the forms it is judged against.

The cascade (SAFE, FAITHFUL, GRAM_SIDE), the Gram side's driver, ``AnvilBank`` and its update in
the seed's order, the eager bf16 and plain-matmul forms of the same math, and the tolerance table of
fast against reference. Imports only :mod:`anvil_fast.kernels` below it.
"""
