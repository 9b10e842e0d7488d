"""anvil_fast: the Triton / torch.compile path of ANVIL, tested against anvil_ref.

Start with the drop-in optimizer: ``opt = anvil_fast.ANVIL(model)`` (its docstring holds a training
loop; ``opt.describe()`` prints the plan).

The package is seven layer packages, bottom first (:data:`LAYERS`). A module imports its own
package and the layers below it, never one above (``tests/test_layout.py`` reads every import):

* ``kernels``: what the GPU executes -- the Triton kernels, their launch configurations and the
  machinery they share. Nothing of the package below it.
* ``core``: one bank's update as the seed orders it, built from kernels, and the forms it is judged
  against (eager bf16, plain matmuls, the tolerance table).
* ``parallel``: collectives and a process launcher; no optimizer code, so an optimizer's schedule and a
  study's ranks share them.
* ``optim``: the optimizers a user constructs (the ``ANVIL`` factory, its two front-ends and their
  one base, ``AnvilAndAdam``) and everything one of their steps runs.
* ``models``: the package's GPTs, for the layers above; no optimizer imports a model.
* ``bench``: ``python -m anvil_fast.bench <command>``: tables of time and memory, never a test.
* ``studies``: ``python -m anvil_fast.studies.<name>``: command lines that measure a property
  (errors, scaling, the cost model); their numbers reach the paper through ``papers/``.

The library is ``kernels`` to ``models``: it never imports a benchmark, a study or a command line,
and every ``python -m`` entry lives in ``bench`` or ``studies``. The reference of each concept is the
same-named ``anvil_ref`` module; the rules both share (orientation, lane reduction, fp32 split/join,
constants) are imported from ``anvil_ref``, never restated.

Outside the layers, two facades: this package (its lazy names below) and ``anvil_fast.testing``, the
public testing API (``assert_orthogonalizer``: anyone's orthogonalization judged from a pytest suite,
over ``studies.harness``); no library module imports either.

Which module owns which concept:

=============================  ==========================================================================
module                         concept
=============================  ==========================================================================
**kernels**
``kernels.backend``            what every kernel shares: ``use_triton`` (the one ``backend=`` rule),
                               ``to_bf16`` / ``from_bf16``, the SM count, the interpreter's probes and
                               work-arounds
``kernels.compiled``           whether a function runs through ``torch.compile``
``kernels.capture``            the one warm-up-then-capture sequence of a CUDA graph
``kernels.streams``            the one fork of work onto side streams and its join (``run_forked``)
``kernels.precompile``         a pass whose Triton launches are recorded, their kernels compiled on a pool
                               of threads (the captures' first step compiles side by side)
``kernels.timing``             the package's timers (CUDA events on a GPU, the wall clock elsewhere;
                               graph replays for the tuner)
``kernels.gram``               the symmetric Gram kernels' entry points (``XXT``, ``XTX``,
                               ``ba_plus_cAA``, ``aX_plus_mm``, ``sym_aX_plus_mm``)
``kernels.gram_kernels``       their Triton code, one lower-tile loop for every symmetric kernel
``kernels.gram_tune``          launch configurations (``TileConfig``, ``ProblemKey``), the per-shape tuner
``kernels.normalize``          SAFE's Frobenius normalization from per-block partials
``kernels.rails``              twin-rail momentum + Nesterov lookahead (element-wise kernel)
``kernels.equalizer``          ``equalize``: the lane-energy equalizer and SAFE's guard
``kernels.update``             ``sign_aligned_update`` on the bf16 + mantissa or fp32 master (SAFE: one
                               Triton kernel; FAITHFUL: compiled); the fp32 split/join
``kernels.adam``               Adam's kernels (one tensor, flat buffers, many tensors through address
                               tables)
``kernels.transpose``          the tied embedding's tiled transposes
``kernels.plus_identity``      ``plus_identity_``: the Gram side's start of its polynomial, ``a I + B`` in place (its diagonal)
``kernels.nonfinite``          the non-finite gradient check on the device (address tables or buffers)
``kernels.bank_scalars``       every per-step scalar in one device buffer, one host-to-device copy per step
``kernels.step_scalars``       the device-decided step's scalars (the staging buffer, masks, counters) in one launch
**core**
``core.cascade``               the cascade (normalization + Gram kernels + maps), ``CascadeConfig`` (SAFE,
                               FAITHFUL, GRAM_SIDE) and both drivers: the standard one and the Gram side's
``core.gram_side``             the Gram-side cascade's own parts: restart schedules (per map set, the study's:
                               ``gram_side_schedules.json``), dispatch rule by bank shape, eager form; the one
                               FLOP count of a map and a cascade (``map_flops``)
``core.bank``                  ``AnvilBank``, ``anvil_bank_update``: one bank's update (rails, cascade,
                               equalizer, update, in the seed's order)
``core.eager``                 the seed's math in eager bf16 torch (the difftest's second floor)
``core.plain``                 the benchmark's baseline: the seed's update with library matmuls
``core.tolerances``            THE tolerance table of fast against reference (its derivations inside)
**parallel**
``parallel.comms``             the collectives (NCCL, gloo, one process)
``parallel.distributed``       a launcher of ranks for tests and studies, and replica digests
**optim**
``optim.frontend``             ``AnvilFrontend``: the front-ends' one base (param groups, hyperparameter
                               checks, describe, step counters, state-dict hooks)
``optim.entry``                ``ANVIL``: the factory that picks the drop-in or the FSDP2 front-end
``optim.dropin``               ``DropInAnvil``: the drop-in optimizer's construction and step engine
``optim.plan``                 the drop-in's plan: routes and their reasons (classify), banks (plan_routes),
                               the banks built over the parameters (build_banks)
``optim.contract``             the drop-in's torch.optim contract: state dicts, ``opt.state`` views, copies
``optim.fsdp``                 ``FSDPAnvil``: the FSDP2 (``fully_shard``) front-end: owner ranks, all-to-all exchange,
                               resharding checkpoints (``torch.distributed.checkpoint``)
``optim.roles``                what each parameter does in a traced forward (matrix operand, table, input
                               or output layer, orientation): the facts the drop-in routes by
``optim.optimizer``            ``AnvilAndAdam``: the seed's optimizer over a labelled table (classify ->
                               plan -> build state), its comms schedule and step
``optim.replicated_adam``      the replicated Adam parameters on flat buffers
``optim.graphs``               the bank updates and the whole step as CUDA graphs, and their staleness check
``optim.lanes``                the banks' side streams on one process: which bank on which stream, and their
                               launch beside the main stream's work (AnvilAndAdam and the device step)
``optim.device_step``          the drop-in's one-process step decided on the device: gradients read in
                               place, the non-finite verdict, the scalars, banks on side streams, Adam,
                               one graph launch
``optim.overlap``              a step whose reduce-scatters are launched from the backward pass
                               (``OverlappedStep``) and the sequential step it is checked against
**models**
``models.gpt``                 the package's GPT (benchmarks, training harness)
``models.banked_gpt``          the GPT whose matrices are views of ANVIL's banks (``BankedGPT``)
**bench**
``bench.common``               peaks, the element-wise bytes, a table writer, a graphed call
``bench.bank``                 one bank update next to the seed's compiled update, against the roofline
``bench.optimizer``            one ``AnvilAndAdam`` step on GPT-2 small's layout next to Muon + AdamW
``bench.dropin``               the drop-in's step on the package's GPT, its floor and phase shares
``bench.peers``                the drop-in's step next to every installed peer, each in its own process
``bench.fsdp``                 ANVIL on an FSDP2 GPT at several rank counts
**studies**
``studies.difftest``           per-component error next to the bf16 floors; with ``--impl`` /
                               ``--adapter``, anyone's orthogonalization (``harness``)
``studies.families``           the differential tests' input families (``make_matrix``) and error measure
``studies.harness``            anyone's orthogonalization judged against the math it declares
``studies.adapters``           the other libraries' orthogonalizations and the package's own, each with
                               its declared math, for ``harness``
``studies.field_examples``     the field's Newton-Schulz and Polar Express written as the field writes
                               them, and the mutation set of slips the harness must catch
``studies.near_rank1``         the near-rank-1 study (SAFE's headroom under bf16, measured)
``studies.gram_side_study``    the Gram side's error study (its schedule for each map set)
``studies.tail``               the explosion tail at large counts, decided by certified bounds of the
                               top singular value (eigvalsh only between them)
``studies.scaling``            equivalence and step time of the optimizer step at several ranks
``studies.train_step``         forward + backward + step at several ranks, each reduce-scatter launched
                               from the backward pass, checked bit for bit against the sequential step
``studies.study_runs``         the JSON records the multi-rank studies write beside their tables (schema)
``studies.cost_measure``       the cost model's measurements: pieces of a step timed on this machine
``studies.cost_model``         the step at any world size from pieces timed on one GPU, validated against
                               measured runs' JSON records (``measure``, ``predict``)
=============================  ==========================================================================

Where new work goes:

* a kernel: a module of ``kernels`` named after its concept, taking its helpers from ``backend`` and
  offering ``backend="auto" | "triton" | "torch"`` through ``backend.use_triton``, its plain-torch
  form next to it; its reference in ``anvil_ref``; its test ``tests/test_<concept>.py`` with the
  ``triton_dev`` fixture and bounds from ``core.tolerances`` (``tests/README.md``).
* a front-end: a sibling of ``optim.dropin`` and ``optim.fsdp`` on ``optim.frontend``'s base.
* a benchmark: a module of ``bench`` with ``add_args``, ``run`` and ``SUMMARY``, registered with
  one line in ``anvil_fast.bench.COMMANDS``; timers from ``kernels.timing``, FLOPs from
  ``core.gram_side.map_flops``. A table, never a timed test.
* a study (a command line that measures a property, like ``difftest`` or ``near_rank1``): a module
  of ``studies`` with ``main(argv)`` and ``if __name__ == "__main__"``, writing JSON beside its table;
  its numbers reach the paper through ``papers/`` generators, never by hand.
"""

import importlib

#: The layer packages, bottom first: a module imports only its own package and those before it.
LAYERS = ("kernels", "core", "parallel", "optim", "models", "bench", "studies")

# Imported on first use, so ``import anvil_fast`` stays light (no Triton, no compile).
_LAZY = {"ANVIL": ".optim.entry", "AnvilFrontend": ".optim.frontend",
         "HEAD_NAMES": ".optim.plan", "StaleParameterError": ".optim.dropin",
         "NonFiniteGradientWarning": ".optim.frontend",
         "NonFiniteGradientError": ".optim.optimizer", "AnvilAndAdam": ".optim.optimizer",
         "NonFiniteUpdateWarning": ".optim.device_step", "NonFiniteUpdateError": ".optim.device_step",
         # the bank update and its parts
         "AnvilBank": ".core.bank", "anvil_bank_update": ".core.bank",
         "fast_cascade": ".core.cascade", "CascadeConfig": ".core.cascade", "SAFE": ".core.cascade",
         "FAITHFUL": ".core.cascade", "GRAM_SIDE": ".core.cascade",
         "XXT": ".kernels.gram", "XTX": ".kernels.gram", "ba_plus_cAA": ".kernels.gram",
         "aX_plus_mm": ".kernels.gram"}

__all__ = ["LAYERS"] + list(_LAZY) + list(LAYERS)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in LAYERS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'anvil_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
