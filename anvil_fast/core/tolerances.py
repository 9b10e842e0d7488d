"""THE tolerance table of the fast path (anvil_fast) against the reference (anvil_ref). One place.

Every bf16 component is judged against two floors measured on the same input (anvil_fast.studies.difftest):

* ``floor`` -- the float64 reference rounded to the output's precision (bf16): what any
  implementation that rounds its output once must lose, about ``2**-8 / sqrt(3) ~ 2.3e-3`` relative;
* ``eager`` -- a plain eager-torch bf16 implementation of the same math (anvil_fast.core.eager): what the
  seed's roundings lose with library matmuls.

Rule for bf16 components: ``fast <= FACTOR * eager + ATOL`` (fast against eager, any backend), plus the
two checks below that can fail when fast and eager share a bug (``check_row``).

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

Adam (anvil_fast.kernels.adam, the fast optimizer's sharded and replicated Adam; fp32 moments), in fp32 ulps
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

The rule has two sides. ``fast <= FACTOR * eager + ATOL`` alone cannot see a bug that the fast path and
the eager one share (both import anvil_ref.constants), so every bf16 component is also judged
**fast against eager** by shared bits where both run the same backend, and **eager against the float64
reference** by a bound counted from its bf16 roundings:

* Same backend (CPU: plain torch or Triton's interpreter, and the eager torch functions): the fast
  output's share of elements bit-identical to eager's is at least SAME_BITS[component]. The
  momentum lookahead and the equalizer are element-wise with the same fp32 operations in the same
  order: SAME_BITS = 1 (measured 1.0 on every family and shape). The cascade's symmetric Gram and
  fused ``a*X + X@B`` sum in another order than the library matmul, and a different last bit in one
  map moves many elements of the next: SAME_BITS = 0.5 (measured, CPU, 8 families x 3 shapes x 2
  configurations: 0.63-1.0, 1.0 on most rows). A fast-only slip (a wrong
  coefficient, a dropped tile) leaves well under half the bits the same. The share falls with the
  matrix size, since every product sums longer rows in another order and each differing last bit
  spreads through the later maps, so the cascade's check holds only up to SAME_BITS_CASCADE_MAX_DIM
  rows and columns (SAFE on CPU, the third map's c raised by 1% as the slip: at 2x48x32 the honest
  share is 0.78-1.0 and the slip's 0.26-0.35; at 4x96x96 the honest share is already 0.44-0.63;
  at 2x256x768 and 2x768x768 it is 0.30-0.63 and the slip's 0.09-0.49, the two ranges overlap).
  Larger cascades are judged by the factor rule, the explosion cap and eager against float64.
  Across backends (GPU fast against CPU or cuBLAS eager) only the factor rule above applies.
* Eager against float64. One bf16 rounding of a value with a log-uniform mantissa has relative RMS
  error ``2**-8/sqrt(3) * sqrt(3/(8 ln 2)) ~ 1.66e-3`` (the measured ``floor``, 1.6-1.9e-3) and at most
  ``RHO = 2**-8/sqrt(3) ~ 2.26e-3`` (mantissa near 1); its worst case is ``2**-8``. Roundings are
  zero-mean and independent, so n of them add in quadrature.

  - momentum: the lookahead is computed in fp32 (<= ~6 fp32 ulps of the largest term; the rails row)
    and rounded once to bf16, so eager's rounding differs from the floor's only where the fp32 value
    lies within those ulps of a bf16 rounding boundary (a share ~2**-14 of the elements), each by one
    bf16 ulp: ``eager <= floor + MOMENTUM_FP32_SLACK`` with MOMENTUM_FP32_SLACK = 2**-12 (~1/7 of
    the floor; measured: eager == floor to 3 digits on every family). A coefficient off by 0.1%
    adds ~1e-3 and fails.
  - equalizer: the input V is exact bf16; eager rounds the per-lane scale (<= 2**-8 relative,
    taken at its worst case since a matrix has only a few dozen lanes) and the product (one
    rounding, like the floor's): ``eager <= sqrt(floor**2 + 2**-16)`` (= 4.3e-3 at floor 1.7e-3;
    measured 2.2-3.4e-3, every family). A wrong EMA weight or gain floor moves every lane and fails.
  - cascade, on the WELL_CONDITIONED family only (singular values of X/d away from 0, where the
    composite's slope F'(0) ~ 643 amplifies roundings): the output path carries
    ``n = CASCADE_ROUNDINGS`` roundings -- the bf16 cast of X, the normalized X, FAITHFUL's rescaled
    first Gram, and per map the Gram A, the polynomial B and the new X (21; 27 with the split
    ``a*X + X@B``, one more per map), each reaching the output with gain <= 1 (the maps contract
    toward the fixed point), so ``eager <= sqrt(n) * RHO`` (= 0.0104; measured 0.0037-0.0048 on
    24x40 .. 96x64). That Frobenius bound is loose against a systematic slip (+1% on every map's c
    raises eager's error only from ~2.8x to ~3.8x the floor), so the cascade also bounds the *mean
    singular-value error* (anvil_fast.studies.difftest.mean_singular_value_error): in units of its standard
    deviation for one rounding of the output (the floor measures as N(0, 1) there: |t| <= 2.1 over 30
    matrices), n roundings of gain <= 1 give a standard deviation <= sqrt(n); the bound is four of
    them, ``eager_sv <= 4 * sqrt(n)`` (18.3 for n = 21). Measured eager: <= 6.5 on 40x24, 24x40,
    32x32 (CPU tests), <= 10.4 on 96x64 and 96x96; with +1% on every map's c: 27-36 on those
    three shapes, 64-146 on the larger ones; a dropped map: far beyond.
    The unit shrinks like ``1/sqrt(rows*cols)`` while a rounding of the Gram's diagonal moves ``t`` by
    ~``RHO/sqrt(k)``, so on larger matrices the Gram roundings dominate and the unit no longer counts
    them (measured eager, CPU: 47 / 38 on 256x768 SAFE / FAITHFUL; 241 / 2020 on 2816x768, where
    FAITHFUL's split ``a*X + X@B`` shifts the mean singular value by 0.55%, a bias of the seed's
    arithmetic the size of +1% on c). The singular-value bound therefore applies to matrices of at
    most CASCADE_SV_MAX_DIM rows and columns (the CPU tests' shapes); larger ones keep the Frobenius
    bound (measured 0.0044-0.0050; FAITHFUL 2816x768, split: 0.0107 against sqrt(27) * RHO = 0.0117). (A wrong margin does not show
    on well-conditioned input, by design: F ~ 1 over the whole interval whatever d is; it shows at the
    interval's top end, tests/test_near_rank1.py.)

The Gram-side cascade (``gram_side`` configuration on banks it dispatches, anvil_fast.core.gram_side) is
judged by the factor rule against its own eager bf16 version (anvil_fast.core.gram_side.eager_gram_side_cascade:
the same products with library matmuls) and, on WELL_CONDITIONED input, eager against float64 with its
own rounding count, :func:`gram_side_roundings`: the bf16 cast of X, the normalized X_1 and its Gram
(3); per map the polynomial B (1) and, where the next map needs it, ``P = Q A`` and ``A = Q P`` (2);
per segment (the start and each restart) R's first ``a I + B`` (1), per later map of the segment R's
update (1); per restart ``X_0 R`` and its Gram (2); the output ``X_0 R`` (1): 26 for any schedule of
ANVIL's six maps (a restart removes three roundings and adds three). Unlike the standard cascade's
iterates, R's roundings are not contracted by later maps (the output is X_0 R, not a map of a
re-formed Gram), so "gain <= 1" is an assumption here, held up by the measurements (CPU, 4x64x24,
4x24x64, 2x96x32, 2x128x48, 3x64x24, 3x24x64, 8x48x16, the default restart before map 4): eager on
well-conditioned input 0.0065-0.0089 (seeds 0-5) against ``sqrt(26) * RHO`` = 0.0115. Two checks of the standard
cascade do not apply to it:

* shared bits: the output is one product with R, and R differs from eager's after the first
  rounding that differs anywhere upstream (nothing re-forms a Gram from X to pull the two back
  together), so an output element matches eager's bits only by chance (measured 0.01-0.28 against
  SAME_BITS 0.5). The Gram side's own kernel (the symmetric ``a Y + B Y``) is instead checked against
  its torch fallback under Triton's interpreter element by element (tests/test_gram_side.py: >= 99%
  identical, the rest one ulp apart, the share an fp32 summation order predicts).
* the mean singular-value error: its premise (roundings that average out of the mean because every
  later map contracts them) fails for R, and the Gram side shifts the mean singular value by 5-32
  units of one output rounding (default schedule; seeds 0-5 on 3x64x24, 3x24x64, 8x48x16), 30-71
  with a restart before map 3 or 5, against ``4 * sqrt(26)`` = 20.4 -- the size of the +1% on c the
  check exists to catch, so it cannot tell the two apart here. A wrong coefficient or map is caught
  instead by anvil_ref.gram_side's float64 equality with anvil_ref.cascade (to ~1e-13), the eager
  Frobenius bound above and the factor rule (tests/test_gram_side.py: five maps instead of six fail it).

The fast cascade is also held to the float64 reference on *every* input, by a bound that only an
explosion can break (the factor rule cannot see one where the eager seed explodes too). The input is
divided by ``FROBENIUS_MARGIN * ||X||_F``, so its singular values lie in ``[0, 1/FROBENIUS_MARGIN]``,
where the composite of ANVIL_MAPS stays below 1 + 4.1e-4 (``python -m derive_maps facts``); the bf16
roundings of the output path move a singular value by about ``sqrt(CASCADE_ROUNDINGS_SPLIT) * 2**-8``
(2%) at most. An output whose top singular value exceeds EXPLODED_SIGMA = 1.1 has therefore left the
maps' range: it has *exploded* (anvil_fast.studies.near_rank1 counts such outputs). Below it every singular
value is <= EXPLODED_SIGMA, so ``||y||_F <= EXPLODED_SIGMA * sqrt(k)`` (k = min(rows, cols)) and

    ||y - ref||_F / ||ref||_F <= 1 + EXPLODED_SIGMA * sqrt(k) / ||ref||_F     (cascade_error_cap)

(absolute where ref is zero: ``EXPLODED_SIGMA * sqrt(k)``). A cascade row whose error passes that cap
on a matrix has exploded there, whatever eager did.

Declared iterations (anvil_fast.studies.harness: anyone's orthogonalization, judged against the math it
declares -- coefficients of any number of steps, a normalization, an orientation rule --
:mod:`anvil_ref.polar`) take the cascade's rule with three quantities derived for their math:

* **Their roundings and gains** (:func:`declared_roundings`). The output path of the harness's eager
  bf16 version of a declared iteration (anvil_fast.studies.harness.eager_declared) rounds the cast of X and
  the normalized Z_0 (AOL also its first Gram, from which the row scales come: 3), and per step k the
  Gram A_k, the polynomial B_k = b A_k + c A_k^2 and the iterate Z_k. The cascade's count above gives
  each of them gain <= 1, true of maps that contract toward their fixed point (ANVIL's, on
  well-conditioned input) but not of others: Muon's quintic oscillates (|p'| > 1 at its output), the
  first Polar Express maps have slopes up to 8, and a step whose ``a + b s^2 + c s^4`` cancels
  magnifies the error of its B (measured, CPU, 48x32 well-conditioned: Muon's eager 0.021-0.025
  against ``sqrt(17) * RHO`` = 0.0093). So every rounding is carried to the output to first order,
  through the float64 singular values s of the iterates (those of Z_0,
  :func:`anvil_ref.polar.normalized_singular_values`, mapped by the scalar maps):

  - the later maps ``G_j = p_K o ... o p_{j+1}`` act on a perturbation E of Z_j, in Z_j's singular
    basis, by their Frechet derivative: the divided difference ``D- = (G(s_i) - G(s_l)) / (s_i - s_l)``
    on E's symmetric part, ``D+ = (G(s_i) + G(s_l)) / (s_i + s_l)`` on its antisymmetric part,
    ``G'(s_i)`` on the diagonal and ``G(s_l) / s_l`` on the rows or columns beyond min(rows, cols);
  - a rounding of Z_j (the cast, Z_0, every iterate) is an isotropic perturbation of relative RMS
    RHO: its output variance is RHO**2 times the mean of those squared weights, times
    ``||Z_j||_F**2 / ||Y||_F**2``;
  - a rounding of B_k or A_k is a symmetric perturbation M (entries of RMS ``RHO ||B_k||_F / k'`` and
    ``RHO ||A_k||_F / k'``, k' the side of the Gram the orientation rule forms) that reaches Z_k as
    ``M Z_{k-1}``: in the eigenbasis of A_k, A's through ``dB = b dA + c (A dA + dA A)``, weights
    ``b + c (l_i + l_l)`` (l the eigenvalues of A_k); in the singular basis its entries are
    ``M_il t_l`` (t the singular values of Z_{k-1}), symmetric part ``M_il (t_i + t_l) / 2``,
    antisymmetric part ``M_il (t_l - t_i) / 2``;
  - independent roundings add in quadrature: the output's relative RMS error is at most
    ``RHO * sqrt(n)``, n the sum of those variances in units of RHO**2, the largest over a batch's
    matrices. This n takes the place of CASCADE_ROUNDINGS in :func:`eager_bound`, on WELL_CONDITIONED
    input as there (elsewhere near-zero singular values make first-order gains meaningless). A map set
    that contracts gets fewer than its count of unit gains (ANVIL_MAPS, 48x32 well-conditioned: n = 7.9
    against 21); Muon's quintic gets 74-161 (32x32 .. 96x64). Checked two ways (CPU, 4x48x32, seeds
    0-3): the model simulated in float64 (every one of those sites perturbed by an independent relative
    Gaussian of RMS RHO) gives 0.028-0.030 for Muon's maps, the bound 0.027-0.030; and the eager bf16
    measures 0.73-0.85 of the bound for Muon's, the modded-nanogpt quintic, Polar Express, ANVIL's and
    DeepSeek-V4's maps on 48x32, 32x32 and 96x64 (RHO is the RMS rounding of a mantissa near 1; the
    average mantissa's is 0.73 RHO). Above DECLARED_PAIRS_MAX singular values the sums run over that
    many, evenly spaced in rank, scaled to all of them (single indices by k / k', ordered pairs by
    k (k - 1) / (k' (k' - 1))): on 768 well-conditioned singular values 128 of them give n within 0.4%
    of the exact sums (ANVIL_MAPS and Muon's quintic, CPU).
  - the mean singular-value check and the shared bits do not apply: the first assumes gain <= 1, and
    the second needs the implementation's own operation order, which the harness does not know.

* **Their explosion threshold** (:func:`exploded_sigma`). Not every declared composite stays near 1:
  Muon's rises to ~1.2. An output whose iteration has not exploded has every singular value at most
  ``F_max = max F`` over the normalized spectrum ``[0, anvil_ref.polar.spectrum_top]`` plus what rounding
  moves it; EXPLODED_SIGMA's 10% room above ANVIL's 1 + 4.1e-4 becomes
  ``EXPLODED_SIGMA * max(1, F_max)`` (for ANVIL_MAPS 1.1004, within 0.05% of EXPLODED_SIGMA), the top
  singular value beyond which an output counts as exploded, and the sigma of its error cap
  (:func:`cascade_error_cap`).

* **Conformance.** A row whose implementation did not do what it declares -- an output of another
  shape than its input, or (observed through torch's dispatcher, :class:`anvil_fast.studies.harness.GramRecorder`)
  a Gram on another side than its orientation rule forms -- fails whatever its errors: a dropped
  transpose forms the long side's Gram, the same matrix in exact arithmetic and at bf16 an error
  indistinguishable from the declared one's, so only the products it forms show it.

Anyone's orthogonalizer: three verdicts (:func:`orthogonalizer_clauses`, every failed clause with its
value and its limit). The cascade's rule ``fast <= FACTOR * eager + ATOL`` against one eager form cannot
judge another library's code: the field writes the same math in several evaluation forms, and they
round differently (measured, CPU, 2x48x32 Gaussian, Muon's quintic: fused ``baddbmm`` 0.0154, the
field's unfused ``B = b*A + c*A@A; X = a*X + B@X`` 0.0372, 2.0-2.4x; heavyball's Horner form with its
scalars added in bf16 2.9-3.1x its fused sibling), while a 1e-3 slip of one coefficient moves one
matrix's output by 0.003-0.0075, under any form's bf16 noise. So:

* **the math** (FAIL): on the ``spectrum`` family (16384 matrices of known singular values: a top
  value in [0.2, 1] or [0.9, 1] of the Frobenius norm and three decades below it, or rank 1 to 4;
  random scales, an eighth near eps) each output singular value ``u_i^T Y v_i`` minus the declared
  composite ``F`` at that point is a residual whose rounding part is nearly zero-mean and whose slip
  part is not. The residuals are compared, matrix by matrix, with those of the eager runs of the same
  math in every form (:data:`anvil_fast.studies.harness.FORMS`, on CUDA with the field's code compiled
  there, :data:`anvil_fast.studies.harness.INDUCTOR_FORMS`; or the declared Gram form in its dtype) and of the float64 math itself (0): per log-spaced bin of the normalized singular value
  (the mean), and along each coefficient's, the margin's and eps's sensitivity direction (a matched
  filter weighted by the inverse variance of the eager residuals). Each statistic's distance from
  the hull of the forms' values is measured in standard errors estimated from the spread of the
  per-matrix sums (a matrix's points share its norm's rounding), taken as Student's t with one degree
  of freedom fewer than the matrices summed and stated as the normal deviate of the same tail
  probability (at a large shape the probe holds few matrices: 4 at 4096x4096); FAIL above MATH_Z. The part of the
  deviation along margin and eps within what bf16 and fp16 arithmetic do to them (:func:`scale_rounding`,
  :func:`eps_rounding`) is removed first, from the implementation's residuals and from every form's alike
  (removed from one side only, an implementation identical to a form would differ from it by the
  removed part); matrices on which an eager form explodes are left to safety. What it cannot see: a
  slip whose effect on the output is smaller than the forms' rounding biases differ. Polar Express's
  step 1 (coefficients 8-22, its slips contracted by the four steps after it) is such a case: its b
  and c slips by 1e-3 pass (tests/test_harness.py).
* **the safety** (FAIL, every family): a non-finite output; a vacuous one (zero where the math's output,
  in the output's and the declared dtype, is not; the identity or the input returned, cosine above
  1 - VACUOUS_GAP where the math's is below 1 - 10 VACUOUS_GAP, on matrices that did not explode); an
  explosion (exploded_sigma, the error cap) where no eager form of the same math explodes. Where one
  does, it is a finding about the math in bf16, not a FAIL.
* **the rounding** (a finding): ``err > FACTOR * max(eager forms) + ATOL``, reported as ``k`` = err over
  the largest eager form's: an implementation that rounds more than the field's eager code of its
  own math is worth knowing, and is not wrong.
"""

from __future__ import annotations

import math

FACTOR = 2.0
ATOL = 2.0 ** -8
RAILS_ULPS = 2
UPDATE_ULPS = 2
LANE_ENERGY_ULPS = 32
ADAM_MOMENT_ULPS = 3
ADAM_ULPS = 10
ADAM_BF16_ULPS = 1

BF16_COMPONENTS = ("momentum", "cascade", "equalizer")

#: Share of fast-path output elements bit-identical to the eager path's on the same backend.
SAME_BITS = {"momentum": 1.0, "cascade": 0.5, "equalizer": 1.0}
#: the cascade's shared-bits check applies to matrices of at most this many rows and columns (above)
SAME_BITS_CASCADE_MAX_DIM = 64
#: Worst relative RMS error of one bf16 rounding (mantissa near 1): 2**-8 / sqrt(3).
RHO = 2.0 ** -8 / 3.0 ** 0.5
MOMENTUM_FP32_SLACK = 2.0 ** -12
#: bf16 roundings on the cascade's output path (fused ``a*X + X@B``; the split form adds one per map).
CASCADE_ROUNDINGS = 21
CASCADE_ROUNDINGS_SPLIT = 27
#: Standard deviations allowed to the cascade's mean singular-value error.
CASCADE_SV_SIGMAS = 4.0
#: Largest rows / cols for which that error is judged (see above: beyond, Gram roundings dominate it).
CASCADE_SV_MAX_DIM = 128
#: Top singular value of the cascade's output beyond which it has exploded (see above).
EXPLODED_SIGMA = 1.1
#: Singular values over whose pairs :func:`declared_roundings` sums exactly (see above).
DECLARED_PAIRS_MAX = 256
#: The math verdict (anyone's orthogonalizer, below): the largest deviation of the spectrum probe's
#: singular values from the declared map, beyond every eager form's, in standard errors. Measured on
#: the CPU (2x24x16, 16384 matrices): the mutation set's 1e-3 slips raising a coefficient of Muon's
#: quintic from 10 (step 1's c) up (those lowering one of step 1's stay inside the eager forms' hull:
#: the lifted run below sees them); the field's code in tests/test_harness.py below it, as is every
#: adapter of the stored CPU table (results/cpu_orthogonalizers, 2x48x32 and 2x32x48;
#: tests/test_orthogonalizers.py holds it).
MATH_Z = 6.0
#: The lifted run (anvil_fast.studies.harness.lifted_run): the implementation with every tensor torch
#: dispatches promoted to float64, on LIFT_COUNT of the spectrum probe's matrices scaled by
#: 2^LIFT_SCALE_EXP. Float64 leaves no rounding to hide a slip in, so its output is held to the
#: declared math by LIFT_RTOL: above float64's own rounding of the iteration (the field's code and the
#: package's measure 1e-15 to 1e-14) and of an eps wherever and whatever it is (at most 2^-7 over a norm
#: of at least 2^(LIFT_SCALE_EXP - 4): below 1e-7), below the smallest change a 1e-3 slip of one
#: coefficient makes on these inputs (measured in tests/test_harness.py). The run counts only where
#: its output has no part beyond LIFT_OFF off the normalized input's singular basis: an exact run of an
#: odd matrix polynomial has none (1e-14 measured), a rounding the lift does not reach (a Triton
#: kernel's bf16 store, a buffer made before the call) puts its own noise there (1e-7 for fp32,
#: 1e-3 for bf16). The same run on the probe's matrices of norm near eps / margin, at their own scale
#: (up to LIFT_COUNT of them), holds the normalization to the same LIFT_RTOL where its eps and its kind
#: (plus eps or a clamp at eps) set the scale: a slip there moves the output by a large fraction of
#: itself (eps 1e-5 for 1e-7, a clamp for a sum: measured in tests/test_harness.py), a faithful one by
#: float64's rounding. Where the lift reaches an implementation and finds its math the declared one at
#: both scales, with the casts of the declared dtype, a deviation of the probe's is that
#: implementation's rounding (an evaluation form whose roundings lean another way than every eager
#: form's: ``a X + b (A X) + c (A (A X))`` does, by -0.003 at singular values near 0.005), reported
#: under rounding; where the lift does not reach, the probe's deviation is a math FAIL.
LIFT_COUNT = 16
LIFT_SCALE_EXP = 24
LIFT_RTOL = 1e-6
LIFT_OFF = 1e-9
#: The iteration dtypes a math declares (DeclaredMath.dtype): a lifted run that casts to one of these
#: other than the declared one iterates in another precision than it says (a math FAIL). One that casts
#: to neither is not judged for it: it may round to bf16 by bit operations (heavyball's stochastic
#: rounding) or be handed its input in the declared dtype.
HALF_DTYPES = ("bfloat16", "float16")
#: The math verdict compares the implementation with the hull of the float64 math (0) and the eager
#: forms' mean deviations (FORMS: fused, unfused, Horner, compiled, Horner after an fp32 normalization;
#: on CUDA also the field's code compiled there, INDUCTOR_FORMS; or the Gram form it declares, in its
#: declared dtype): rounding biases the singular values where the composite bends (second order in the
#: rounding), each form its own way. MATH_BIAS_FACTOR scales that hull about 0; 1: the hull itself
#: (measured: heavyball's stochastic rounding and every CPU adapter inside it; 3 cost the first two
#: steps' 1e-3 slips their detection).
MATH_BIAS_FACTOR = 1.0
#: The normalization as bf16 arithmetic applies it is not a slip: ``clamp_min(eps)`` or ``+ eps`` on a
#: bf16 norm rounds eps to bf16 (1e-7 becomes 1.0012e-7), and ``norm * margin`` on a bf16 norm rounds
#: to bf16 with a relative error that is not zero-mean (bf16 norms times 1.02: +3.3e-4 on average over
#: 4096 random matrices). The math verdict removes the part of the deviation along the margin and eps
#: directions inside the hull of {exact, bf16, fp16} arithmetic (:func:`scale_rounding`,
#: :func:`eps_rounding`), widened by MATH_SCALE_SLACK, before it judges.
MATH_SCALE_SLACK = 2.0 ** -12


def _round_rel(v: float, dtype) -> float:
    import torch

    return float(torch.tensor(v, dtype=torch.float64).to(dtype).double()) / v - 1.0 if v else 0.0


def eps_rounding(eps: float) -> tuple[float, float]:
    """The relative changes of eps that bf16 or fp16 arithmetic makes of it, and none: (lo, hi) of
    their hull, widened by MATH_SCALE_SLACK."""
    import torch

    vals = [0.0] + [_round_rel(eps, d) for d in (torch.bfloat16, torch.float16) if eps >= 2.0 ** -14 or d is torch.bfloat16]
    return min(vals) - MATH_SCALE_SLACK, max(vals) + MATH_SCALE_SLACK


def scale_rounding(margin: float, eps: float = 0.0) -> tuple[float, float]:
    """The mean relative change of ``norm * margin`` when a bf16 (or fp16) norm is multiplied by the
    margin and the product rounded (norms log-uniform: every mantissa of a binade, weighted 1/n), and
    none, in units of the margin itself: (lo, hi) of their hull, widened by MATH_SCALE_SLACK."""
    import numpy as np

    vals = [0.0]
    for bits in (8, 11):  # bf16, fp16 significands
        n = 1.0 + np.arange(2 ** (bits - 1)) / 2 ** (bits - 1)
        p = n * margin
        e = np.floor(np.log2(p))
        q = np.round(p / 2.0 ** e * 2 ** (bits - 1)) / 2 ** (bits - 1) * 2.0 ** e
        w = 1.0 / n
        vals.append(float(np.sum(w * (q / p - 1.0)) / np.sum(w)) * margin)
    return min(vals) - MATH_SCALE_SLACK * margin, max(vals) + MATH_SCALE_SLACK * margin


#: An output is vacuous where its cosine with the identity or the input is above 1 - VACUOUS_GAP on a
#: matrix where the float64 math's own is below 1 - 10 VACUOUS_GAP (or an output is zero where the
#: math's is not).
VACUOUS_GAP = 1e-3


def gram_side_roundings(n_maps: int, restarts: tuple[int, ...]) -> int:
    """bf16 roundings on the Gram-side cascade's output path (module docstring) for a schedule."""
    r = len(restarts)
    a_updates = sum(1 for k in range(1, n_maps) if k + 1 not in restarts)
    return 3 + n_maps + 2 * a_updates + (1 + r) + (n_maps - 1 - r) + 2 * r + 1


def bf16_bound(eager: float) -> float:
    return FACTOR * eager + ATOL


def eager_bound(component: str, *, floor: float, roundings: int = CASCADE_ROUNDINGS) -> float:
    """The largest relative error of the eager bf16 path against float64 (second side of the rule;
    the cascade's holds on WELL_CONDITIONED input only)."""
    if component == "momentum":
        return floor + MOMENTUM_FP32_SLACK
    if component == "equalizer":
        return (floor ** 2 + 2.0 ** -16) ** 0.5
    if component == "cascade":
        return roundings ** 0.5 * RHO
    raise ValueError(f"eager_bound: unknown bf16 component {component!r}; expected one of {BF16_COMPONENTS}")


def cascade_error_cap(ref_norm: float, k: int, *, sigma: float = EXPLODED_SIGMA) -> float:
    """The largest error against float64 of a cascade output that has not exploded: relative
    ``1 + sigma * sqrt(k) / ref_norm``, or absolute ``sigma * sqrt(k)`` where the reference (Frobenius
    norm ``ref_norm``) is zero; ``sigma``: the explosion threshold (EXPLODED_SIGMA, or a declared
    iteration's :func:`exploded_sigma`)."""
    cap = sigma * k ** 0.5
    return 1.0 + cap / ref_norm if ref_norm > 0 else cap


def exploded_sigma(composite_max: float) -> float:
    """The top singular value beyond which the output of a declared iteration whose composite
    reaches at most ``composite_max`` on its normalized spectrum has exploded (module docstring)."""
    return EXPLODED_SIGMA * max(1.0, float(composite_max))


def _frechet(maps, s, t, *, left: bool):
    """Squared first-order weights of the singular-value function ``G = maps`` at singular values ``s``
    (module docstring), as (diagonal [k], off-diagonal [k, k] with a zero diagonal, complement [k]):
    on iid entries (``left`` False) or on entries ``M_il t_l`` with M symmetric (``left``: the form
    of a rounded Gram or polynomial): ``D-`` on the symmetric part, ``D+`` on the antisymmetric part,
    ``G'`` on the diagonal, ``G(s)/s`` on each complement row."""
    import numpy as np

    from anvil_ref.cascade import composite
    from anvil_ref.polar import composite_slope

    if maps:
        g, dg, dg0 = composite(s, maps=maps), composite_slope(s, maps=maps), composite_slope(0.0, maps=maps)
    else:
        g, dg, dg0 = s, np.ones_like(s), 1.0
    si, sl = s[:, None], s[None, :]
    diff, summ = si - sl, si + sl
    minus = np.where(diff != 0, (g[:, None] - g[None, :]) / np.where(diff != 0, diff, 1.0), dg[:, None])
    plus = np.where(summ != 0, (g[:, None] + g[None, :]) / np.where(summ != 0, summ, 1.0), dg0)
    ratio = np.where(s > 0, g / np.where(s > 0, s, 1.0), dg0)
    if left:  # E_il = M_il t_l: symmetric part M_il (t_i + t_l)/2, antisymmetric part M_il (t_l - t_i)/2
        ti, tl = t[:, None], t[None, :]
        off = np.square(minus * (ti + tl) / 2 + plus * (tl - ti) / 2)
        diag, comp = np.square(dg * t), np.square(ratio * t)
    else:  # iid entries: the symmetric and antisymmetric parts each carry half an entry's variance
        off = (np.square(minus) + np.square(plus)) / 2
        diag, comp = np.square(dg), np.square(ratio)
    np.fill_diagonal(off, 0.0)
    return diag, off, comp


def _thin(s, cap: int):
    """At most ``cap`` of the singular values ``s``, evenly spaced in rank."""
    import numpy as np

    k = s.shape[-1]
    return s if k <= cap else s[np.round(np.linspace(0, k - 1, cap)).astype(int)]


def declared_roundings(maps, sigmas, *, normalization: str = "frobenius", long_side: int, gram_side: int) -> float:
    """The gain-weighted rounding count ``n`` of a declared iteration (module docstring): ``maps`` its
    (a, b, c) triples, ``sigmas`` the float64 singular values of its normalized input Z_0 (one row per
    matrix, ``[..., k]``), ``normalization`` one of :data:`anvil_ref.polar.NORMALIZATIONS`,
    ``long_side`` the matrices' larger dimension and ``gram_side`` the side of the Gram its orientation
    rule forms. The largest over the matrices; NaN where a matrix's output is zero (no relative error
    is defined)."""
    import numpy as np

    from anvil_ref.cascade import composite
    from anvil_ref.maps import load_maps
    from anvil_ref.polar import NORMALIZATIONS

    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
    maps_ = load_maps(maps)
    s0 = np.asarray(sigmas, dtype=np.float64)
    s0 = s0.reshape(-1, s0.shape[-1])
    k = s0.shape[-1]
    worst = 0.0
    for s_full in s0:
        s = _thin(s_full, DECLARED_PAIRS_MAX)
        kk = s.shape[-1]
        # sums over the kk kept singular values stand for sums over all k: single indices scale by
        # k / kk, ordered pairs of distinct ones by k (k - 1) / (kk (kk - 1))
        s1, s2 = k / kk, (k * (k - 1) / (kk * (kk - 1)) if kk > 1 else 0.0)
        stages = [s]  # singular values of Z_0 .. Z_K
        for triple in maps_:
            stages.append(composite(stages[-1], maps=[triple]))
        out_sq = np.square(stages[-1]).sum() * s1
        if not out_sq > 0:
            return float("nan")

        def iid(j):  # relative output variance of one isotropic relative rounding of Z_j, per RHO**2
            diag, off, comp = _frechet(maps_[j:], stages[j], stages[j], left=False)
            total = s1 * diag.sum() + s2 * off.sum() + (long_side - k) * s1 * comp.sum()
            return total / (long_side * k) * np.square(stages[j]).sum() * s1 / out_sq

        n = (3 if normalization == "aol" else 2) * iid(0)
        for j in range(1, len(stages)):
            a, b, c = maps_[j - 1]
            prev = stages[j - 1]
            lam = prev ** 2  # the nonzero eigenvalues of A_j; its other gram_side - k are zero
            diag, off, comp = _frechet(maps_[j:], stages[j], prev, left=True)
            spread = s1 * diag.sum() + s2 * off.sum() + (gram_side - k) * s1 * comp.sum()
            # B's rounding: entries of variance RHO^2 ||B||_F^2 / k'^2, in A's eigenbasis
            n_b = s1 * np.square(b * lam + c * lam ** 2).sum() / gram_side ** 2 * spread
            # A's: variance RHO^2 ||A||_F^2 / k'^2, reaching B through b + c (l_i + l_l)
            wa = (s1 * (np.square(b + 2 * c * lam) * diag).sum()
                  + s2 * (np.square(b + c * (lam[:, None] + lam[None, :])) * off).sum()
                  + (gram_side - k) * s1 * (np.square(b + c * lam) * comp).sum())
            n_a = s1 * np.square(lam).sum() / gram_side ** 2 * wa
            n += iid(j) + (n_a + n_b) / out_sq
        worst = max(worst, float(n))
    return worst


def cascade_sv_bound(roundings: int = CASCADE_ROUNDINGS) -> float:
    """Bound on anvil_fast.studies.difftest.mean_singular_value_error of the eager cascade (WELL_CONDITIONED)."""
    return CASCADE_SV_SIGMAS * roundings ** 0.5


def check_eager(component: str, *, eager: float, floor: float, eager_sv: float | None = None,
                well_conditioned: bool = False, shape: tuple[int, ...] | None = None, split: bool = False,
                roundings: int | None = None, sv: bool = True) -> bool:
    """Eager against float64: momentum and equalizer on every input, the cascade on WELL_CONDITIONED
    input (its Frobenius error with ``split``'s rounding count, or ``roundings`` where given (the Gram
    side), and, with ``sv`` (not for the Gram side, see above), its mean singular-value error for
    matrices of ``shape`` no larger than CASCADE_SV_MAX_DIM; ``shape`` None: judged)."""
    if eager != eager or eager == float("inf"):
        return False
    if component == "cascade":
        if not well_conditioned:
            return True
        if sv and (shape is None or max(shape[-2:]) <= CASCADE_SV_MAX_DIM):
            if eager_sv is None or not eager_sv <= cascade_sv_bound():
                return False
        n = roundings if roundings is not None else CASCADE_ROUNDINGS_SPLIT if split else CASCADE_ROUNDINGS
        return eager <= eager_bound(component, floor=floor, roundings=n)
    return eager <= eager_bound(component, floor=floor)


def check_row(row, *, same_backend: bool = True) -> bool:
    """Both sides of the rule for one anvil_fast.studies.difftest row: ``check`` (fast against eager by the
    factor rule, and the fp32 side results), the cascade's explosion cap against float64 (its
    ``cap_ratio``: the largest over matrices of error / cascade_error_cap, <= 1), the share of identical bits where fast and eager run on
    the same backend (``same_backend``: CPU), and eager against float64 (bf16 components)."""
    if getattr(row, "conforms", True) is False:
        return False  # not what it declares: another output shape, or another Gram side (module docstring)
    if not check(row.component, fast=row.fast, eager=row.eager, floor=row.floor, ulps=row.ulps):
        return False
    cap_ratio = getattr(row, "cap_ratio", None)
    if cap_ratio is not None and not cap_ratio <= 1.0:
        return False  # exploded against float64 (cascade_error_cap), even where eager did too
    if row.component == "update":
        return True
    # a declared iteration's own gain-weighted count (declared_roundings), else the Gram side's
    roundings = getattr(row, "roundings", None)
    if roundings is None and row.component == "cascade":
        roundings = _gram_side_roundings(row)
    bits_apply = row.component != "cascade" or max(row.shape[-2:]) <= SAME_BITS_CASCADE_MAX_DIM
    if (same_backend and roundings is None and bits_apply and row.same_bits is not None
            and not row.same_bits >= SAME_BITS[row.component]):
        return False
    # the eager cascade of anvil_fast.studies.difftest splits ``a*X + X@B`` where the seed does (FAITHFUL, more
    # than SPLIT_BADDBMM_MIN_ROWS rows); SAFE fuses it
    from anvil_ref.constants import SPLIT_BADDBMM_MIN_ROWS

    split = row.config == "faithful" and row.shape[-2] > SPLIT_BADDBMM_MIN_ROWS
    if roundings is not None:
        return check_eager(row.component, eager=row.eager, floor=row.floor, well_conditioned=row.well_conditioned,
                           roundings=roundings, sv=False)
    return check_eager(row.component, eager=row.eager, floor=row.floor, eager_sv=row.eager_sv,
                       well_conditioned=row.well_conditioned, shape=tuple(row.shape), split=split)


def _gram_side_roundings(row) -> int | None:
    """The Gram side's rounding count when ``row`` is a cascade row the Gram side ran, else None."""
    from anvil_ref.constants import ANVIL_MAPS

    from .cascade import CONFIGS, gram_side_schedule

    cfg = CONFIGS.get(row.config)
    sched = None if cfg is None else gram_side_schedule(cfg, row.shape, device=getattr(row, "device", None))
    if sched is None:
        return None
    return gram_side_roundings(len(ANVIL_MAPS), sched)


def check(component: str, *, fast: float, eager: float, floor: float, ulps: float | None = None) -> bool:
    """The rule for one row of anvil_fast.studies.difftest (``fast``/``eager``/``floor`` as it reports them;
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


#: An explosion of code whose lifted run found the declared math, with the top singular value past the
#: threshold by at most this many times the larger of the threshold's own excess over 1 and its eager
#: bf16 runs' top's, is its evaluation form's rounding near the threshold (a finding, as the rounding
#: clause's 2x): a Gram form rounded in another order than the eager Gram forms reaches 1.26 where they
#: reach 1.19 and the threshold is 1.255 (tests/test_harness.py); a wrong restart schedule reaches 3.
EXPLODED_ROUNDING = 2.0

#: An explosion is a rare event where a math's own bf16 evaluation explodes: the Gram form of ANVIL's
#: maps in eager bf16 explodes on about 1 in 100,000 of the spectrum probe's matrices at 2x48x32, the
#: Gram side's kernels as often (CPU, 100 draws of 16,384 each: 15 and 23 matrices, one-sided p 0.13;
#: results/cpu_gram_side_tail/). On one draw an implementation and its eager runs then explode on
#: different matrices of it by chance. So an implementation that explodes on ``k`` matrices of ``n``
#: where its eager runs explode on none of the same is compared with its eager runs on more of the
#: probe: up to EXPLOSION_DRAWS more draws of ``n`` matrices each (other seeds), and FAILs unless its
#: eager runs explode there too and the one-sided exact test that it explodes more often than they do
#: (:func:`explosion_excess_p`, the row's own draw counted in the eager sample) stays at or above
#: EXPLOSION_ALPHA. Past EXPLOSION_OWN_MAX explosions the row's own draw decides (p <= 2**-k < alpha
#: there): no more draws are made.
EXPLOSION_DRAWS = 32
EXPLOSION_ALPHA = 0.01
EXPLOSION_OWN_MAX = 6
#: Matrix entries those draws may hold in all (fewer draws where one holds more: at 2x48x32 the
#: spectrum probe's 16384 matrices take all 32; four 4096x4096 matrices, 16); the probe's random
#: bases are float64 QR factorizations on the host, the costly part of a draw at large shapes.
EXPLOSION_WIDE_ELEMENTS = 2 ** 30


def explosion_excess_p(k: int, n: int, j: int, m: int) -> float:
    """One-sided p-value that explosions happen more often in ``k`` of ``n`` matrices than in ``j`` of
    ``m``, conditional on their total (the exact test of two Poisson rates):
    ``P(K >= k)`` for ``K ~ Binomial(k + j, n / (n + m))``."""
    k, n, j, m = int(k), int(n), int(j), int(m)
    if min(k, n, j, m) < 0 or n == 0:
        raise ValueError(f"explosion_excess_p: expected counts >= 0 and n > 0, got k={k}, n={n}, j={j}, m={m}")
    t, q = k + j, n / (n + m)
    return min(1.0, sum(math.comb(t, i) * q ** i * (1 - q) ** (t - i) for i in range(k, t + 1)))


def lifted_exact(row) -> bool:
    """Whether ``row``'s lifted run reached its arithmetic and found the declared math: within
    LIFT_RTOL at both scales, a matrix polynomial of its input, casting to no half dtype but the declared one."""
    lift, lift_eps = getattr(row, "lift_err", None), getattr(row, "lift_eps_err", None)
    declared = getattr(row, "declared_dtype", "")
    halves = set(filter(None, getattr(row, "lift_casts", "").split(","))) & set(HALF_DTYPES)
    return (lift is not None and lift <= LIFT_RTOL and (lift_eps is None or lift_eps <= LIFT_RTOL)
            and getattr(row, "lift_not_polynomial", None) is None and bool(declared) and not halves - {declared})


def orthogonalizer_clauses(row) -> dict[str, list[str]]:
    """The three verdicts on anyone's orthogonalizer (module docstring, "Anyone's orthogonalizer") for
    one row of :mod:`anvil_fast.studies.harness`: the failed clauses of ``math`` and ``safety`` (each a
    FAIL), of ``rounding`` and the other ``findings`` (reported, never a FAIL), every clause naming its
    value and its limit; ``limits``: what the declared math keeps the verdicts from seeing (reported,
    no verdict changes)."""
    out: dict[str, list[str]] = {"math": [], "rounding": [], "safety": [], "findings": [], "limits": []}
    note = getattr(row, "note", "")
    if not row.conforms:
        if note.startswith("formed a"):
            out["math"].append(f"math: orientation: {note} (seen {row.gram_seen}, limit: the declared "
                               f"{row.gram_declared})")
        else:
            out["safety"].append(f"safety: {note} (limit: the declared shape, no exception)")
    if row.nonfinite:
        out["safety"].append(f"safety: output not finite on {row.nonfinite}/{row.count} matrices (limit 0)")
    if row.vacuous == "zero":
        out["safety"].append("safety: vacuous output: zero on a matrix where the math's output, in the output's "
                             "dtype, is not (limit: nonzero)")
    elif row.vacuous == "underflow":
        out["findings"].append(f"its output is zero on inputs that are zero in every entry once cast to "
                               f"{getattr(row, 'declared_dtype', '') or 'its iteration dtype'} (below its range): "
                               "it casts before it normalizes, where the declared math's eager run normalizes "
                               "first")
    elif row.vacuous:
        out["safety"].append(f"safety: vacuous output: {row.vacuous} (cosine > 1 - {VACUOUS_GAP:g} where the "
                             f"math's is < 1 - {10 * VACUOUS_GAP:g})")
    if not row.declared:
        return out
    lift = getattr(row, "lift_err", None)
    lifted_math = []  # the lifted run's math clauses
    if getattr(row, "lift_not_polynomial", None) is not None:
        lifted_math.append(f"math: run in float64 by torch alone (no Triton kernel, no NumPy), its output is off its input's "
                           f"singular basis by {row.lift_off:.3g} > {row.lift_not_polynomial:g}: not a matrix polynomial "
                           "of its input")
    if lift is not None and not lift <= LIFT_RTOL:
        if getattr(row, "lift_coeffs", ""):
            out["findings"].append(f"its coefficients are held in {row.lift_coeffs}: run in float64, its output is "
                                   f"the declared maps with every coefficient rounded to {row.lift_coeffs} "
                                   f"(off the declared math by {lift:.3g})")
        else:
            lifted_math.append(f"math: run in float64 (every tensor lifted), its output is off the declared math by "
                               f"{lift:.3g} > {LIFT_RTOL:g}")
    lift_eps = getattr(row, "lift_eps_err", None)
    if lift is not None and lift_eps is not None and not lift_eps <= LIFT_RTOL:
        lifted_math.append(f"math: run in float64 at norms near eps / margin, where the normalization's eps and kind "
                           f"set the scale, its output is off the declared math by {lift_eps:.3g} > {LIFT_RTOL:g}")
    casts = set(filter(None, getattr(row, "lift_casts", "").split(",")))
    declared_dtype = getattr(row, "declared_dtype", "")
    halves = casts & set(HALF_DTYPES)
    if lift is not None and declared_dtype and halves - {declared_dtype}:
        lifted_math.append(f"math: casts to {', '.join(sorted(halves - {declared_dtype}))} in its lifted run (limit: no "
                           f"half dtype but the declared iteration's, {declared_dtype})")
    out["math"].extend(lifted_math)
    # the lift reached its arithmetic and found its math the declared one, to float64's rounding: the
    # probe's deviation is then its rounding's (an evaluation form whose bf16 roundings lean another
    # way than every eager form's), reported, not a FAIL; where the lift did not reach, the probe judges
    # (declared_dtype: a row judged with the lift at both scales and its casts; a stored row of an older
    # rule has none)
    lifted_clean = lifted_exact(row)
    half = {"float16": "fp16", "float32": "fp32"}.get(declared_dtype, "bf16")  # how the clauses name its rounding
    if row.math_z is not None and not row.math_z <= MATH_Z:
        what = (f"singular values off the declared map along {row.math_clause}: {row.math_z:.1f} standard errors "
                f"> {MATH_Z:g} (shift {row.math_shift:.3g} beyond the {row.math_form} run, {row.math_points} points, "
                f"{row.math_matrices} matrices)")
        if lifted_clean:
            out["rounding"].append(f"rounding: its {half} rounding moves the {what}; run in float64 its math is the "
                                   f"declared one (within {LIFT_RTOL:g})")
        else:
            out["math"].append(f"math: {what}")
    if getattr(row, "flat_slips", ""):
        # a property of the declared math that bounds what the verdicts can see, not of the code: said
        # on every such row, and it changes no verdict
        out["limits"].append(f"the declared map is flat in some coefficients: a 1e-3 slip of {row.flat_slips} moves it "
                             f"by at most that at any singular value, within the lifted run's limit ({LIFT_RTOL:g}), "
                             "so the verdicts may not tell such a slip from the declared math (and none can where "
                             "the change is float64's rounding)")
    if row.exploded and not row.nonfinite:
        what = (f"top singular value {row.top_sv:.3g} > {row.sigma_x:.3g} on {row.exploded}/{row.count} matrices")
        exact = lifted_clean or bool(getattr(row, "math_exact", None))
        near = EXPLODED_ROUNDING * max(row.sigma_x - 1, (row.eager_top_sv - 1) if row.eager_top_sv == row.eager_top_sv
                                       else 0.0)
        # the eager forms' explosions on the wider draws (the row's own draw counted in their sample)
        j, m = getattr(row, "eager_wide_exploded", None), getattr(row, "eager_wide_count", 0)
        p = explosion_excess_p(row.exploded, row.count, j, m + row.count) if j is not None and m else None
        wide = (f"; on {m} more matrices of the probe its eager bf16 runs explode on {j} (one-sided p {p:.2g} that "
                f"it explodes more often, limit >= {EXPLOSION_ALPHA:g})") if p is not None else ""
        if row.eager_exploded:
            out["findings"].append(f"the math explodes in bf16: {what} (its eager bf16 runs: {row.eager_top_sv:.3g})")
        elif j and p >= EXPLOSION_ALPHA:
            out["findings"].append(f"the math explodes in bf16: {what}, where its eager bf16 runs stay at "
                                   f"{row.eager_top_sv:.3g} on the same matrices{wide}")
        elif exact and row.top_sv - 1 <= near:
            out["rounding"].append(f"rounding: its {half} rounding takes the top singular value to {row.top_sv:.3g}, past "
                                   f"the explosion threshold {row.sigma_x:.3g} on {row.exploded}/{row.count} matrices "
                                   f"where its eager bf16 runs reach {row.eager_top_sv:.3g}; run in float64 its math is "
                                   f"the declared one (an explosion FAILs past {1 + near:.3g})")
        else:
            out["safety"].append(f"safety: exploded: {what}, where its eager bf16 runs stay at "
                                 f"{row.eager_top_sv:.3g} (limit {row.sigma_x:.3g}){wide}")
    elif row.cap_ratio is not None and not row.cap_ratio <= 1.0 and not row.nonfinite:
        if row.eager_cap_ratio is not None and not row.eager_cap_ratio <= 1.0:
            out["findings"].append(f"the math exceeds its explosion cap in bf16: error / cap {row.cap_ratio:.3g} "
                                   f"(eager {row.eager_cap_ratio:.3g})")
        else:
            out["safety"].append(f"safety: error / explosion cap {row.cap_ratio:.3g} > 1 where its eager bf16 runs "
                                 f"reach {row.eager_cap_ratio if row.eager_cap_ratio is not None else float('nan'):.3g}")
    forms = [v for v in (row.eager, getattr(row, "eager_unfused", math.nan), getattr(row, "eager_horner", math.nan))
             if v == v]
    if forms and row.fast == row.fast and not row.nonfinite:
        e = max(forms)
        if not row.fast <= bf16_bound(e):
            out["rounding"].append(f"rounding: err {row.fast:.3g} = {row.fast / e if e > 0 else math.inf:.2f}x the "
                                   f"largest eager form's {e:.3g} (limit {FACTOR:g}x + 2^-8 = {bf16_bound(e):.3g})")
    if row.well_conditioned and row.bound == row.bound and not row.eager <= row.bound:
        out["findings"].append(f"its math magnifies bf16 rounding past the first-order bound: eager {row.eager:.3g} "
                               f"> {row.bound:.3g}")
    return out


# ---------------------------------------------------------------------------------------------
# drop-in: anvil_fast.ANVIL against the float64 reference anvil_ref/dropin.py, over a run of
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
#   (anvil_fast.studies.difftest.rel_err). The step is eff_lr * U plus the fp32-exact decay; U's error is the
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
