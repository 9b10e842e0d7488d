"""anvil_fast: the Triton / torch.compile path of ANVIL, tested against anvil_ref.

Start with the drop-in optimizer: ``opt = anvil_fast.ANVIL(model)`` (its docstring holds a training
loop; ``opt.describe()`` prints the plan).

Which module owns which concept (the reference of each is the same-named ``anvil_ref`` module; the
rules both share -- orientation, lane reduction, fp32 split/join, constants -- are imported from
``anvil_ref``, never restated):

======================  ===================================================================================
module                  concept
======================  ===================================================================================
**optimizers**
``entry``               ``ANVIL``: the factory, the drop-in or the FSDP2 front-end by the parameters
``frontend``            ``AnvilFrontend``: both front-ends' base (param groups and their checks, the hand-over
                        of their values, ``describe``'s table, step counters, state-dict hooks)
``dropin``              ``DropInAnvil``: the drop-in ``torch.optim.Optimizer`` (classify -> plan -> build banks)
``roles``               what each parameter does in a traced forward (matrix operand, table, input or
                        output layer, orientation): the facts the drop-in routes by
``optimizer``           ``AnvilAndAdam``: the seed's optimizer over a labelled table (classify -> plan ->
                        build state), its comms schedule and step graph
``bank``                ``AnvilBank``, ``anvil_bank_update``: one bank's update (rails, cascade, equalizer,
                        update, in the seed's order)
``bank_scalars``        every per-step scalar in one device buffer, one host-to-device copy per step
``replicated_adam``     the replicated Adam parameters on flat buffers
``comms``               the collectives (NCCL, gloo, one process); ``distributed``: a launcher
``fsdp``                ``FSDPAnvil``: ANVIL on FSDP2 (``fully_shard``) models: owner ranks, all-to-all exchange,
                        resharding checkpoints (``torch.distributed.checkpoint``)
``device_step``         the drop-in's one-process step decided on the device: gradients read in place,
                        the non-finite verdict, the scalars, banks on side streams, Adam, one graph launch
``graphs``              the bank updates and the whole step as CUDA graphs, and their staleness check
``capture``             the one warm-up-then-capture sequence of every CUDA graph (side stream, pool, error mode)
**the update's parts**
``rails``               twin-rail momentum + Nesterov lookahead (Triton element-wise kernel)
``cascade``             the cascade (normalization + Gram kernels + maps), ``CascadeConfig`` (SAFE, FAITHFUL,
                        GRAM_SIDE) and both drivers: the standard one and the Gram side's
``gram_side``           the Gram-side cascade's own parts: restart schedule, dispatch rule by bank shape,
                        eager form, FLOP count
``normalize``           SAFE's Frobenius normalization from per-block partials (Triton)
``gram``                the symmetric Gram kernels' entry points (``XXT``, ``XTX``, ``ba_plus_cAA``,
                        ``aX_plus_mm``, ``sym_aX_plus_mm``); ``gram_kernels``: their Triton code; ``gram_tune``: the
                        launch configurations (``TileConfig``, ``ProblemKey``) and the per-shape tuner
``equalizer``           ``equalize``: the lane-energy equalizer and SAFE's guard (Triton)
``update``              ``sign_aligned_update`` on the bf16 + mantissa master; the fp32 split/join
``adam``                Adam's kernels (one tensor, flat buffers, many tensors through address tables);
                        ``transpose``: the tied embedding's tiled transposes
``nonfinite``           the non-finite gradient check on the device (address tables or buffers)
**shared machinery**
``_triton``             what every kernel shares: ``use_triton`` (the one ``backend=`` rule), ``to_bf16`` /
                        ``from_bf16``, the SM count, the interpreter's probes and work-arounds
``_compile``            whether a function runs through ``torch.compile``
``tolerances``          THE tolerance table of fast against reference (its derivations inside)
**studies and baselines**
``difftest``            ``python -m anvil_fast.difftest``: per-component error next to the bf16 floors; with
                        ``--impl`` / ``--adapter``, anyone's orthogonalization (``harness``)
``families``            the differential tests' input families (``make_matrix``) and error measure (``rel_err``)
``harness``             anyone's orthogonalization judged against the math it declares (``assert_orthogonalizer``,
                        ``judge``): errors next to its eager bf16 floor, polar factor, explosions, Gram side
``adapters``            the other libraries' orthogonalizations (torch, dion, emerging-optimizers, heavyball,
                        pytorch-optimizer) and the package's own, each with its declared math, for ``harness``
``near_rank1``          ``python -m anvil_fast.near_rank1``: the near-rank-1 study (SAFE's headroom under bf16,
                        measured; ``derive_maps.robust`` certifies the maps under worst-case rounding models)
``gram_side_study``     ``python -m anvil_fast.gram_side_study``: the Gram side's error study (its schedule)
``eager``               the seed's math in eager bf16 torch (the difftest's second floor)
``plain``               the benchmark's baseline: the seed's update with library matmuls
``scaling``             ``python -m anvil_fast.scaling``: equivalence and step time at several ranks
``train_step``          ``python -m anvil_fast.train_step``: forward + backward + step at several ranks, each
                        reduce-scatter launched from the backward pass (``overlap.OverlappedStep``)
``banked_gpt``          the GPT with its matrices in banks of layer groups (``BankedGPT``), and its batches
``overlap``             the overlapped step's driver (``OverlappedStep``), ``sequential_step`` and a step's
                        collectives alone (``comm_only``), for the multi-rank studies and training loops
``study_runs``          the JSON record a multi-rank study writes beside its table, which ``cost_model`` reads
``timing``              the package's timers (CUDA events / wall clock per call, medians, ``do_bench``)
``cost_model``          ``python -m anvil_fast.cost_model measure|predict``: the step at any world size from
                        pieces timed on one GPU, validated against measured runs
``cost_measure``        the cost model's timings on this machine (the pieces of a step, the collectives)
``gpt``                 the package's GPT (benchmarks, training harness)
``bench/``              ``python -m anvil_fast.bench bank|optimizer|dropin|peers|fsdp``: the
                        benchmarks; ``bench.common``: peaks, bytes and FLOPs per bank (the count is
                        ``gram_side.map_flops``), the table writer
======================  ===================================================================================

Where new work goes:

* a kernel: a module named after its concept, taking its helpers from ``_triton`` and offering
  ``backend="auto" | "triton" | "torch"`` through ``_triton.use_triton``, its plain-torch form next
  to it; its reference in ``anvil_ref``; its test ``tests/test_<concept>.py`` with the ``triton_dev``
  fixture and bounds from ``tolerances`` (``tests/README.md``).
* a benchmark: a module of ``bench/`` with ``add_args``, ``run`` and ``SUMMARY``, registered with
  one line in ``anvil_fast.bench.COMMANDS``; peaks and FLOPs from ``bench.common``, timers from
  ``timing``. A table,
  never a timed test.
* a study (a CLI that measures a property, like ``difftest`` or ``near_rank1``): a module here with
  ``main(argv)`` and ``if __name__ == "__main__"``; its numbers reach the paper through
  ``papers/`` generators, never by hand.
"""

import importlib

# Imported on first use, so ``import anvil_fast`` stays light (no Triton, no compile).
_LAZY = {"ANVIL": ".entry", "AnvilFrontend": ".frontend",
          "HEAD_NAMES": ".dropin", "StaleParameterError": ".dropin", "NonFiniteGradientWarning": ".frontend",
         "NonFiniteGradientError": ".optimizer", "AnvilAndAdam": ".optimizer",
         "NonFiniteUpdateWarning": ".device_step", "NonFiniteUpdateError": ".device_step",
         # the bank update and its parts (anvil_fast.bank, .cascade, .gram)
         "AnvilBank": ".bank", "anvil_bank_update": ".bank",
         "fast_cascade": ".cascade", "CascadeConfig": ".cascade", "SAFE": ".cascade", "FAITHFUL": ".cascade",
         "GRAM_SIDE": ".cascade",
         "XXT": ".gram", "XTX": ".gram", "ba_plus_cAA": ".gram", "aX_plus_mm": ".gram"}
_SUBMODULES = ("entry", "frontend", "dropin", "roles", "optimizer", "bank", "bank_scalars", "replicated_adam",
               "comms", "distributed", "graphs", "capture", "rails", "cascade", "normalize", "gram", "gram_tune",
               "equalizer", "update", "adam", "transpose", "tolerances", "difftest", "near_rank1", "eager", "plain",
               "scaling", "gpt", "bench", "gram_side", "gram_side_study", "train_step", "banked_gpt", "overlap",
               "study_runs", "timing", "cost_model", "cost_measure", "fsdp", "device_step", "nonfinite", "families",
               "harness", "adapters")

__all__ = list(_LAZY) + list(_SUBMODULES)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'anvil_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
