"""anvil_fast.models: the package's GPTs (the plain one and the banked one the overlapped step drives).

Library code for benchmarks, studies and training; the optimizers never import them.
"""
