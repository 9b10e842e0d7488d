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
"""

from __future__ import annotations

FACTOR = 2.0
ATOL = 2.0 ** -8
RAILS_ULPS = 2
UPDATE_ULPS = 2
LANE_ENERGY_ULPS = 32

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
