"""anvil_ref: the float64 reference of ANVIL's math -- the specification the fast path is tested against.

ANVIL is the matrix optimizer of NanoGPT speedrun record #360 (twin-rail momentum, a six-map quintic
cascade after Frobenius normalization, a lane-energy equalizer, sign-aligned decay), paired with
Adam for the non-matrix parameters. This package restates every equation of it in plain NumPy
float64, one function per equation with the equation in its docstring. It never imports anvil_fast,
Triton or torch.compile; torch is optional (tensors are accepted and returned, computed in float64
on the CPU).

Modules, in the order the update applies them:

=================  =============================================================================
``constants``      ANVIL_MAPS, rail betas and engage step, margin and eps, defaults (defined once)
``rails``          twin-rail momentum, Nesterov lookahead, the rail schedule (``rail_scalars``)
``cascade``        Frobenius normalization, the quintic maps, ``composite``, ``cascade``
``gram_side``      the same maps on the short side with restarts, ``gram_side_cascade``
``polar``          the polar factor and any declared odd-quintic iteration (coefficients of any
                   length, Frobenius / clamped / AOL normalization, orientation rule): ``quintic_iteration``
``equalizer``      the lane-energy equalizer
``update``         effective rates, per-matrix multipliers, sign-aligned decay
``storage``        the fast path's bf16 + uint16-mantissa storage of an fp32 master
``adam``           Adam with bias correction and cautious decay
``config``         the per-parameter table and the schedule orders (shared with anvil_fast)
``optimizer``      ``ReferenceAnvilAndAdam``: one whole step over a labelled parameter table
``maps``           map sets by name or from JSON (``python -m derive_maps`` writes them)
``dropin``         ``DropinReference``: the drop-in optimizer's specification, routing from the
                   model and the user's arguments alone, then the math above per matrix (reads an
                   ``nn.Module``, so it needs torch)
=================  =============================================================================

Command-line plumbing, kept here because every package of the project (anvil_fast, derive_maps,
papers, tools/) imports anvil_ref and nothing below it: ``progress`` (a bar in a terminal, a line per
stage in a pipe), ``cli_args`` (argument types that refuse bad values in one argparse line) and
``provenance`` (the commit a measuring command's record names).

Where the seed's comments and its code disagree
-----------------------------------------------
The seed is the record's optimizer source (its ``AnvilAndAdam``, ``_rail_equalizer``, ...), whose
names this package's docstrings cite; where its comments and code disagree the code is the
specification. Every such place found, and the choice made:

1. **Equalizer lanes.** ``_rail_equalizer``'s docstring says lanes are "reduced over red_dim, the
   longer matrix dimension", and ``_init_state`` says the lane energy is "reduced along the longer
   dimension". The code (``red_dim = -1 if rows >= cols else -2``; lane shape ``[..., rows, 1]`` when
   rows >= cols) reduces over the *shorter* (or equal) dimension: one energy per entry of the longer
   dimension. Choice: the code (:func:`anvil_ref.equalizer.reduction_axis`).
2. **Square matrices in the cascade.** The comment on the second branch says "Wide"; the test is
   ``is_tall = rows > cols``, so square matrices take the ``X X^T``, left-multiplied branch. Choice:
   the code (:func:`anvil_ref.cascade.is_tall`). Same matrix in exact arithmetic.
3. **"Cautious" decay in ANVIL vs Adam.** Both are called cautious; ANVIL's mask is
   ``gate * p >= 0`` on the slow rail (zero counts as aligned) and Adam's is ``update * p > 0``
   (strict). Choice: each as coded (:mod:`anvil_ref.update`, :mod:`anvil_ref.adam`).
4. **Rail state before set_rails.** The class comment says rail 0's beta is scheduled by
   get_rail_beta; the constructor initialises ``fast_beta, fast_weight = 0.0, 1.0``, so a step taken
   before the first ``set_rails`` uses beta 0 (the fast rail is the raw gradient). Choice: the code
   (``ReferenceAnvilAndAdam`` starts the same way).
5. **Gate timing.** The decay is "gated on the slow rail (a denoised gradient estimate)"; the code
   passes ``bank.velocity[1]`` after ``anvil_cascade`` has updated it in place, i.e. the slow rail
   *including* this step's gradient. Choice: the code.
6. **Replicated ANVIL banks.** The class docstring lists 'replicated' as a comms mode for any
   parameter; for an ANVIL parameter the code launches no reduce and then skips it, so a replicated
   bank is silently never updated. Choice: refuse it with a clear error
   (:func:`anvil_ref.config.build_param_config`) rather than reproduce a silent no-op.
7. **Order checks.** The docstring says each order must "contain every parameter label exactly
   once"; the code compares sets, which lets duplicates through. Choice: the docstring's rule (an
   order with a duplicate is refused), since a duplicated label would launch a second reduce.
8. **reset().** Its docstring says it resets "velocity/lane state and split_embed state"; the code
   also zeroes every bank's mantissa, which truncates the fp32 masters to their bf16 halves.
   Choice: the code (the reference truncates its float64 masters to bf16).

Return types: every math function returns the kind it was given (NumPy float64 array, or CPU
``torch.float64`` tensor for torch input); see :mod:`anvil_ref._arrays`. Bad input (wrong rank,
mismatched shapes, non-finite values, unknown labels) raises :class:`ReferenceInputError` saying
what was wrong; zero matrices give documented finite results (the cascade and the equalizer return
zero).
"""

from ._arrays import ReferenceInputError
from .adam import AdamResult, adam_moments, adam_step_size, adam_update
from .cascade import cascade, composite, frobenius_normalize, frobenius_scale, gram, is_tall, quintic, quintic_map
from .config import ConfigError, ParamConfig, build_param_config, check_labels, check_order
from .constants import *  # noqa: F401,F403  (the constants are part of the public API)
from .constants import __all__ as _constants_all
from .gram_side import gram_side_cascade
from .polar import polar_factor, quintic_iteration
from .equalizer import EqualizeResult, equalize, lane_energy_shape, lane_gain, lane_power, reduction_axis
from .maps import available_map_sets, load_maps, validate_maps
from .optimizer import ParamSpec, ReferenceAnvilAndAdam
from .rails import RailScalars, RailSteps, TwinRailResult, blend_rails, ema, nesterov_lookahead, rail_beta, rail_scalars, rail_steps, twin_rail
from .storage import Halves, bf16_truncate, join_fp32, round_to_fp32, split_fp32, store
from .update import (
    decay_mask,
    effective_lrs,
    effective_weight_decay,
    per_matrix_lr_multipliers,
    shape_lr_multiplier,
    sign_aligned_update,
)

__version__ = "0.5.9"

__all__ = list(_constants_all) + [
    "ReferenceInputError", "ConfigError",
    "AdamResult", "adam_moments", "adam_step_size", "adam_update",
    "cascade", "composite", "frobenius_normalize", "frobenius_scale", "gram", "is_tall", "quintic",
    "quintic_map", "gram_side_cascade", "polar_factor", "quintic_iteration",
    "ParamConfig", "build_param_config", "check_labels", "check_order",
    "EqualizeResult", "equalize", "lane_energy_shape", "lane_gain", "lane_power", "reduction_axis",
    "available_map_sets", "load_maps", "validate_maps",
    "ParamSpec", "ReferenceAnvilAndAdam",
    "RailScalars", "RailSteps", "rail_steps", "TwinRailResult", "blend_rails", "ema", "nesterov_lookahead", "rail_beta",
    "rail_scalars", "twin_rail",
    "Halves", "bf16_truncate", "join_fp32", "round_to_fp32", "split_fp32", "store",
    "decay_mask", "effective_lrs", "effective_weight_decay", "per_matrix_lr_multipliers",
    "shape_lr_multiplier", "sign_aligned_update",
]
