"""anvil_fast.studies: command lines that measure a property and write it down.

Each study is ``python -m anvil_fast.studies.<name>`` with ``main(argv)``: the differential test
against the bf16 floors (``difftest``) and for anyone's orthogonalization (``harness``, ``adapters``),
the near-rank-1 and Gram-side error studies, the scaling and train-step measurements and the cost
model that reads their JSON. The top layer: nothing in the package imports a study.
"""
