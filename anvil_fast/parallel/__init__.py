"""anvil_fast.parallel: the collectives (NCCL, gloo, one process) and a process launcher.

No optimizer code: ``comms`` is what an optimizer's schedule calls, ``distributed`` starts ranks for
tests and studies and compares their replicas.
"""
