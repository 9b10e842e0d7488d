"""anvil_fast.testing: judge anyone's orthogonalization from a test suite, as ``torch.testing`` judges tensors.

A stable facade over the package's harness (``anvil_fast.studies.harness``, its adapters and
examples); another project imports it in its pytest suite::

    from anvil_fast.testing import assert_orthogonalizer

    def test_my_newton_schulz():
        assert_orthogonalizer(my_newton_schulz, coeffs=[(3.4445, -4.7750, 2.0315)], steps=5,
                              normalization="frobenius", margin=1.0, eps=1e-7, transpose_when="tall")

``assert_orthogonalizer`` raises :class:`OrthogonalizerMismatch` (an ``AssertionError``) naming every
failed clause -- its verdict, its value and its limit -- and the table of every row. Three verdicts
per row (``anvil_fast/core/tolerances.py``, ``orthogonalizer_clauses``):

* **math** (FAIL): on the ``spectrum`` family, inputs of known singular values, two measurements.
  The lifted run: the function called with every tensor torch dispatches promoted to float64
  (``Lift``), its output against the declared math in float64 within ``LIFT_RTOL``: any 1e-3 slip of
  any coefficient of any step, raised or lowered, stands far past it, where the lift reaches the
  arithmetic (pure PyTorch, eager or compiled; a Triton kernel that rounds inside, it does not, and
  the row says so), unless the declared map is flat in that coefficient (a slip that moves it by at
  most ``LIFT_RTOL`` at every singular value, as in the early steps of Polar Express's eight:
  the row's ``limits`` name each such coefficient, :meth:`DeclaredMath.flat_slips`, since no output
  can show it). It runs twice: on matrices scaled far above eps (the coefficients, the margin,
  the steps) and on the probe's matrices of norm near eps / margin at their own scale (the eps and
  the normalization's kind); a cast to a half dtype other than the declared one is a FAIL too. Where
  it reaches the arithmetic and finds the declared math, the probe's deviation is the function's
  rounding (a finding); where it does not reach, the probe judges. The probe: the output's singular
  values against the declared composite map, averaged over thousands of points (a 1e-3 slip raising any coefficient of any step of Muon's
  quintic is seen where the probe holds thousands of matrices; one lowering a coefficient of its
  first step shrinks the output as the eager forms' bf16 rounding does and stays inside their hull,
  unseen by the probe; its standard errors come from the spread over matrices and are read through
  Student's t, so at the largest shapes, where few matrices fit, it sees gross slips only); the Gram
  on the declared side;
* **safety** (FAIL, every family): a non-finite output, a vacuous one (zero, the identity, the input),
  an explosion where the same math in eager bf16 does not explode (on the same matrices, or as often on
  up to :data:`anvil_fast.core.tolerances.EXPLOSION_DRAWS` more draws of the input);
* **rounding** (a finding, not a FAIL): the error against the float64 math over the largest eager bf16
  run of it in the field's evaluation forms (:data:`FORMS`: fused ``baddbmm``, unfused
  ``B = b*A + c*A@A; X = a*X + B@X``, Horner, ...; on CUDA also :data:`INDUCTOR_FORMS`), and a
  probe deviation of a function the lifted run found exact (``X = a*X + b*A@X + c*A@A@X`` has one).

The command line shares these defaults (:data:`DEFAULT_FAMILIES`, :data:`DEFAULT_SHAPES`):
``python -m anvil_fast.studies.difftest --impl package.module:function --coeffs ...``.
:data:`MUTANTS` is the set of slips the harness must catch, each a function that FAILs against
:data:`MUON_MATH`; :data:`FIELD_EXAMPLES` are correct code of the field that must pass.
"""

from anvil_fast.studies.field_examples import (DECLARED as FIELD_EXAMPLES, MUON_MATH, MUTANTS, POLAR_EXPRESS_MATH,
                                               muon_newton_schulz, muon_newton_schulz_compiled,
                                               muon_newton_schulz_expanded, muon_newton_schulz_fused,
                                               muon_newton_schulz_horner, polar_express)
from anvil_fast.studies.harness import (DEFAULT_FAMILIES, DEFAULT_SHAPES, FORMS, HARNESS_FAMILIES, INDUCTOR_FORMS,
                                        ITERATION_DTYPES, SPECTRUM,
                                        DeclaredMath, Implementation, Lift, Lifted, OrthogonalizerMismatch, Row,
                                        assert_orthogonalizer, callable_name, eager_declared, format_table, judge,
                                        lifted_run, reference, summary)

__all__ = ["assert_orthogonalizer", "judge", "OrthogonalizerMismatch", "DeclaredMath", "Implementation", "Row",
           "DEFAULT_FAMILIES", "DEFAULT_SHAPES", "HARNESS_FAMILIES", "ITERATION_DTYPES", "SPECTRUM", "FORMS", "INDUCTOR_FORMS", "reference",
           "eager_declared", "format_table", "summary", "callable_name", "Lift", "Lifted", "lifted_run", "MUTANTS", "MUON_MATH",
           "POLAR_EXPRESS_MATH", "FIELD_EXAMPLES", "muon_newton_schulz", "muon_newton_schulz_fused",
           "muon_newton_schulz_compiled", "muon_newton_schulz_horner", "muon_newton_schulz_expanded",
           "polar_express"]
