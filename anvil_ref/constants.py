"""The constants of ANVIL (record #360), defined once for the whole project.

Every other module -- anvil_fast, derive_maps, tests, papers -- imports these names from here;
none of them restates a value. The values are copied from the seed (the record's optimizer
source) and from the public facts about the record that the seed's README lists; each comment says
which.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# The cascade (seed: ANVIL_MAPS, FROBENIUS_MARGIN, FROBENIUS_EPS, SPLIT_BADDBMM_MIN_ROWS).

#: The six odd quintic maps ``p_k(s) = a*s + b*s**3 + c*s**5`` of record #360, as (a, b, c), in the
#: order they are applied. Frozen: these are the printed 12-decimal constants of the record, read as
#: IEEE binary64 numbers; they are not re-derivable from a principle (see derive_maps).
ANVIL_MAPS: tuple[tuple[float, float, float], ...] = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)

#: The cascade's input is divided by ``FROBENIUS_MARGIN * ||X||_F + FROBENIUS_EPS``.
FROBENIUS_MARGIN: float = 1.05
FROBENIUS_EPS: float = 1e-6

#: The fast path runs ``a*X + X@B`` as two kernels (bmm, then add) for matrices with more rows
#: than this (seed: true for mlp_bank's 2816 rows, false for 256 and 768). A performance switch
#: only: in exact arithmetic both forms are the same map.
SPLIT_BADDBMM_MIN_ROWS: int = 1024

# ---------------------------------------------------------------------------------------------
# Twin-rail momentum (seed: RAIL_FAST_BETA, RAIL_SLOW_BETA, RAIL_FAST_WEIGHT, RAIL_ENGAGE_STEP).

#: Fast rail's beta from the engage step on.
RAIL_FAST_BETA: float = 0.85
#: Slow rail's beta; the slow rail accumulates from step 0.
RAIL_SLOW_BETA: float = 0.98
#: The fast rail's weight in the blend from the engage step on (before it: 1.0).
RAIL_FAST_WEIGHT: float = 0.4385
#: First step at which the blend reads both rails.
RAIL_ENGAGE_STEP: int = 514

# The rail-beta schedule get_rail_beta (seed README, "public facts"): linear warm-up from
# RAIL_BETA_MIN to RAIL_BETA_MAX over RAIL_BETA_WARMUP_STEPS, flat, then a linear cool-down back to
# RAIL_BETA_MIN over the last RAIL_BETA_COOLDOWN_STEPS of the run.
RAIL_BETA_MIN: float = 0.85
RAIL_BETA_MAX: float = 0.93
RAIL_BETA_WARMUP_STEPS: int = 240
RAIL_BETA_COOLDOWN_STEPS: int = 50

# The rail schedule at other run lengths. The record fixes its schedule in absolute steps (engage
# RAIL_ENGAGE_STEP, warm-up RAIL_BETA_WARMUP_STEPS, cool-down RAIL_BETA_COOLDOWN_STEPS over the last
# steps of the run) and the package keeps that as its rule, RAIL_RULE = "absolute": these steps are
# what the record tuned, and the record's code reads them as steps at every length. The other rule,
# "scaled", stretches the three to the run: each is multiplied by total_steps /
# RAIL_SCALED_REFERENCE_STEPS and rounded (at least 1), so at the reference length both rules are the
# same schedule. The reference is the write-up's tuning horizon (papers/protocol.py TUNE_STEPS, which
# imports it), so the scaled rule keeps at every length the shape the learning rates were tuned with.
RAIL_RULES: tuple[str, ...] = ("absolute", "scaled")
RAIL_RULE: str = "absolute"
RAIL_SCALED_REFERENCE_STEPS: int = 1000

# ---------------------------------------------------------------------------------------------
# The lane-energy equalizer (seed: _rail_equalizer).

#: Floor under the lane energy before its inverse square root, and under the post-gain norm.
LANE_ENERGY_FLOOR: float = 1e-10

# ---------------------------------------------------------------------------------------------
# Per-matrix learning-rate multipliers (seed: AnvilAndAdam._build_param_cfg).

#: The bank whose odd-indexed matrices (its c_proj matrices) get ODD_MATRIX_LR_MUL.
MLP_BANK_LABEL: str = "mlp_bank"
ODD_MATRIX_LR_MUL: float = 2.0

#: Labels with tied-embedding semantics (seed: AnvilAndAdam.step).
EMBED_LABEL: str = "embed"
LM_HEAD_LABEL: str = "lm_head"
#: The label at whose places in scatter_order and work_order the row-sparse updates run (seed).
SPARSE_UPDATE_LABEL: str = "value_embeds"

# ---------------------------------------------------------------------------------------------
# Hyper-parameter defaults of the record's lineage: matrix lr 0.023, equalizer beta2 0.9, Adam lr
# 0.008 with eps 1e-10 (seed README); momentum 0.95 (overwritten every step by the rail schedule)
# and the weight decays 2.25 (ANVIL) and 0.005 (Adam) from the record's public training.py. Adam's
# betas (0.9, 0.95) are the drop-in's default for every Adam parameter: the seed's labelled table
# names betas per label instead, so AnvilAndAdam never reads this entry.

ANVIL_DEFAULTS: dict[str, float] = dict(lr=0.023, momentum=0.95, beta2=0.9, weight_decay=2.25)
ADAM_DEFAULTS: dict[str, float | tuple[float, float]] = dict(lr=0.008, eps=1e-10, weight_decay=0.005,
                                                             betas=(0.9, 0.95))

__all__ = [
    "ANVIL_MAPS", "FROBENIUS_MARGIN", "FROBENIUS_EPS", "SPLIT_BADDBMM_MIN_ROWS",
    "RAIL_FAST_BETA", "RAIL_SLOW_BETA", "RAIL_FAST_WEIGHT", "RAIL_ENGAGE_STEP",
    "RAIL_BETA_MIN", "RAIL_BETA_MAX", "RAIL_BETA_WARMUP_STEPS", "RAIL_BETA_COOLDOWN_STEPS",
    "RAIL_RULES", "RAIL_RULE", "RAIL_SCALED_REFERENCE_STEPS",
    "LANE_ENERGY_FLOOR", "MLP_BANK_LABEL", "ODD_MATRIX_LR_MUL", "EMBED_LABEL", "LM_HEAD_LABEL",
    "SPARSE_UPDATE_LABEL",
    "ANVIL_DEFAULTS", "ADAM_DEFAULTS",
]

# ---------------------------------------------------------------------------------------------
# Floating-point formats of the fast path (facts of IEEE binary32 and bfloat16, round to nearest).

#: Unit roundoff of bfloat16 (8 significand bits): a rounding moves a normal number by at most
#: this relative amount.
BF16_UNIT_ROUNDOFF: float = 2.0 ** -8
#: Unit roundoff of IEEE binary32 (24 significand bits).
FP32_UNIT_ROUNDOFF: float = 2.0 ** -24

__all__ += ["BF16_UNIT_ROUNDOFF", "FP32_UNIT_ROUNDOFF"]

# ---------------------------------------------------------------------------------------------
# The fast path's SAFE configuration, as the rounding model of derive_maps.robust reads it (the
# fast path's choices, not the seed's: anvil_fast.core.cascade and anvil_fast.kernels.normalize say why).

#: Relative widening of the Frobenius margin in SAFE: margin = FROBENIUS_MARGIN * (1 + slack).
SAFE_MARGIN_SLACK: float = 2.0 ** -7
#: Elements per block of one matrix in the fp32 trace's first level (a tree sum per block): the grain
#: of the normalization's partials, of the twin-rail kernel and of the scaling kernel (16 per thread
#: at 8 warps).
NORM_BLOCK: int = 4096
#: Block partials the trace's finalizing program reduces per step (per lane: ceil(blocks / this)
#: sequential adds, then a tree over the lanes).
NORM_REDUCE_BLOCK: int = 1024

#: The smallest input Frobenius norm the robust certificates of derive_maps.robust cover at their low
#: end: the normalization divides by ``FROBENIUS_MARGIN ||X||_F + FROBENIUS_EPS``, so the normalized
#: values of a matrix of norm ``f`` are smaller by the factor ``1 / (1 + FROBENIUS_EPS / (FROBENIUS_MARGIN f))``
#: than the interval's; below this norm that factor leaves the certificates' model.
MIN_NORM: float = 1e-3

__all__ += ["SAFE_MARGIN_SLACK", "NORM_BLOCK", "NORM_REDUCE_BLOCK", "MIN_NORM"]
