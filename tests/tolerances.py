"""THE tolerance table of the fast path (anvil_fast) against the reference (anvil_ref). One place.

Every bf16 component is judged against two floors measured on the same input (anvil_fast.difftest):

* ``floor`` -- the float64 reference rounded to the output's precision (bf16): what any
  implementation that rounds its output once must lose, about ``2**-8 / sqrt(3) ~ 2.3e-3`` relative;
* ``eager`` -- a plain eager-torch bf16 implementation of the same math (anvil_fast.eager): what the
  seed's roundings lose with library matmuls.

Rule for bf16 components: ``fast <= FACTOR * eager + ATOL``.

* FACTOR = 2: the fast path makes the same roundings as the eager one, in a different summation
  order (tiles, split-K order, fp32 accumulation of tensor cores), so its error is a draw from the
  same distribution; a factor 2 absorbs the spread between two draws of the same error (the observed
  ratio fast/eager is 0.8-1.3, NOTES.md) and still catches a missing rounding-free step, a wrong
  coefficient or a dropped tile (errors of 1e-2 and up).
* ATOL = 2**-8 (one bf16 rounding, worst-case relative): covers inputs where the eager error happens to
  be tiny (the zero family, where both are 0, or a single matrix on which eager is lucky) and the one
  extra rounding a fused epilogue may place differently (``a*X + X@B`` rounded once where the seed's
  split path rounds twice, or vice versa).

fp32 components are judged in ulps of fp32 against the exact result rounded to fp32:

Ulps are counted at the *largest term* that entered the result, not at the result: where the
result cancels (a rail crossing zero, a decayed weight near zero) its own ulp is tiny and any fp32
implementation, the seed's included, is "wrong" by thousands of its ulps (measured: up to ~5000).

* rails: a lerp ``a + w (b - a)`` makes three fp32 roundings, each <= 0.5 ulp of a quantity no
  larger than ``max(|a|, |b|)``, so <= 1.5 ulps of ``max(|v|, |g|)``; fused multiply-adds in compiled
  code only remove roundings. RAILS_ULPS = 2.
* update (the fp32 master): ``W - W*on*wd*lr - U*lr`` is four roundings after the exact ``W*on``:
  ``*wd``, ``*lr`` (each 0.5 ulp of a term <= |W| wd lr), ``U*lr`` (0.5 ulp of that term) and the two
  subtractions (0.5 ulp of their results, <= the largest term): <= ~1.5 ulps of the largest term.
  UPDATE_ULPS = 2. (The fraction bit-identical to anvil_ref.storage.store is reported, not asserted:
  it is a property of the seed's formula, ~75-85% on random data, and the eager seed has the same.)
* lane energy (equalizer EMA, fp32), in ulps of max(E, P): one lerp (<= 1.5 ulps, as the rails) on
  a lane power P that is itself an fp32 mean of L squares. Torch and Inductor reduce in blocks and
  trees, so the sum sees at most a few dozen sequential roundings (<= ~0.5 ulp each) for L <= 4096;
  LANE_ENERGY_ULPS = 32 bounds that with room (measured: <= 2, NOTES.md).

Adam (anvil_fast.adam, the fast optimizer's sharded and replicated Adam; fp32 moments), in fp32 ulps
of the largest term that entered an element, ``max(|p|, |p| * eff_wd, T)`` with
``T = step_size * max(|m|, |g|) / (sqrt(v') + eps)``, the size of the update before ``m'`` cancels:

* moments: ``m' = m*b1 + g*(1 - b1)`` is a lerp (<= 1.5 ulps of ``max(|m|, |g|)``, as the rails) on a
  gradient that may carry one rounding of its own (the tied ``lm_head.grad += embed.grad^T`` in the
  parameter's dtype: 0.5 ulp); ``v'`` adds two non-negative terms (no cancellation; <= 1.5 ulps of
  ``max(v, g^2)`` plus 2 x 0.5 from the squared gradient's rounding). ADAM_MOMENT_ULPS = 3.
* parameter: ``u = m' / (sqrt(v') + eps) * step_size`` carries m''s absolute error (<= 2 ulps of
  ``max(|m|, |g|)``, at most 4 ulps of T after scaling, since two values' ulps differ by <= 2x per
  binade crossed) plus <= 3 relative roundings (sqrt of a 1.5-ulp v': 1.25; +eps, /, *: 0.5 each);
  the cautious decay adds two roundings (<= 1 ulp of ``max(|u|, |p| eff_wd)``) and ``p - u`` one
  (0.5 ulp of the largest term): <= ~9.5 ulps. ADAM_ULPS = 10 (measured, CPU fallback, 4e5 random
  elements at steps 1-50: <= 3.2).
* bf16 parameters: the fp32 result above (<= 10 fp32 ulps = 0.0002 bf16 ulps) rounded once to
  bf16 (0.5 bf16 ulp): within ADAM_BF16_ULPS = 1 bf16 ulp of the largest term, against the exact value.
"""

from __future__ import annotations

FACTOR = 2.0
ATOL = 2.0 ** -8
RAILS_ULPS = 2
UPDATE_ULPS = 2
LANE_ENERGY_ULPS = 32
ADAM_MOMENT_ULPS = 3
ADAM_ULPS = 10
ADAM_BF16_ULPS = 1

BF16_COMPONENTS = ("momentum", "cascade", "equalizer")


def bf16_bound(eager: float) -> float:
    return FACTOR * eager + ATOL


def check(component: str, *, fast: float, eager: float, floor: float, ulps: float | None = None) -> bool:
    """The rule for one row of anvil_fast.difftest (``fast``/``eager``/``floor`` as it reports them;
    for "update" they are ulps of the fp32 master; ``ulps``: the row's fp32 side result -- the rails
    for "momentum", the lane energy for "equalizer")."""
    if fast != fast or fast == float("inf"):
        return False  # a non-finite fast result never passes
    if component == "update":
        return fast <= UPDATE_ULPS
    if component not in BF16_COMPONENTS:
        raise ValueError(f"unknown component {component!r}")
    side = {"momentum": RAILS_ULPS, "equalizer": LANE_ENERGY_ULPS}.get(component)
    if ulps is not None and side is not None and not ulps <= side:
        return False
    return fast <= bf16_bound(eager)


# ---------------------------------------------------------------------------------------------
# drop-in: anvil_fast.ANVIL against the float64 reference tests/dropin_reference.py, over a run of
# fixed, seeded gradients (tests/test_dropin_reference.py). The trajectories are independent, so the
# bounds are per step, on what each step adds:
#
# * Adam (fp32): elementwise, accumulated over the run from ADAM_ULPS and ADAM_MOMENT_ULPS (the
#   moments' errors carried through their EMAs into the update); the test's AdamBound does the sum.
#   Measured: <= 9% of that bound. Adam's decay moves a weight by adam_lr**2 * adam_weight_decay of
#   itself per step (1.2e-4 with the test's values; 3e-7 with the defaults 0.008, 0.005), against a
#   bound of a few 1e-6 relative: dropping the decay fails.
# * rails (fp32 EMAs of bf16-exact gradients): elementwise, RAILS_ULPS per step, summed (RailBound).
# * a matrix's weight step P' - P against the reference's, relative in the Frobenius norm
#   (anvil_fast.difftest.rel_err). The step is eff_lr * U plus the fp32-exact decay; U's error is the
#   bf16 cascade and equalizer's. On well-conditioned input (the test's gradients: singular values
#   within a factor ~13) count worst-case roundings of 2**-8 (one bf16 rounding, relative): each of
#   the 6 maps rounds its Gram product, its polynomial and its output (3), the equalizer its gain and
#   output (2), and an earlier map's error passes a later map with gain <= 1 near the maps' fixed
#   point: 20 * 2**-8 = 0.078. Measured (eager and fast alike): <= 0.006. A wrong rail beta, a
#   stale gradient or a lost beta2 change moves a step by 0.1 or more.
# * lane energy (fp32 EMA of the bf16 update's lane powers): a lane power is a mean of squares, so its
#   relative error is at most twice the update's (plus its square): DROPIN_LANE_ENERGY_REL =
#   2 * DROPIN_STEP_REL + DROPIN_STEP_REL**2.
DROPIN_STEP_REL = 20 * 2.0 ** -8
DROPIN_LANE_ENERGY_REL = 2 * DROPIN_STEP_REL + DROPIN_STEP_REL ** 2
