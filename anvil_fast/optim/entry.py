"""``anvil_fast.ANVIL``: the optimizer a model calls for, a plain function.

A model of plain tensors gets the drop-in (:class:`anvil_fast.optim.dropin.DropInAnvil`); a model sharded
with FSDP2 (``fully_shard``: DTensor parameters) gets :class:`anvil_fast.optim.fsdp.FSDPAnvil`. Both are
:class:`anvil_fast.optim.frontend.AnvilFrontend` (``isinstance(opt, AnvilFrontend)`` holds for either).
This module sits above both, since the FSDP2 front-end's owners each run a drop-in (it imports
:mod:`anvil_fast.optim.dropin`), so the choice between them lives here and neither imports the other's
dispatch.
"""

from __future__ import annotations

from .dropin import DropInAnvil, holds_dtensors
from .fsdp import FSDPAnvil
from .frontend import AnvilFrontend


def ANVIL(params, *args, **kwargs) -> AnvilFrontend:
    """ANVIL for the hidden matrices + Adam for everything else, for any model.

    Example (a complete training loop)::

        import torch, anvil_fast
        model = anvil_fast.models.gpt.build("tiny")                 # any nn.Module
        opt = anvil_fast.ANVIL(model, lr=0.02, adam_lr=0.008)
        print(opt.describe())                                 # the plan: each parameter's route, and why
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 1000)
        for step in range(1000):
            x = torch.randint(0, 256, (8, 65))
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    **Routing**: by what a parameter does in the model, decided once, when the optimizer is built.
    The facts come from the owning module's type (``nn.Linear``, convolutions, ``nn.Embedding``,
    transformers' ``Conv1D``, ``nn.LSTM``/``nn.GRU``/``nn.RNN``, found by identity) and, for
    everything else, from one traced forward (:mod:`anvil_fast.optim.roles`; eval mode, no gradients,
    the random state untouched) on ``example_input=`` (a tensor, a tuple of positional arguments or a
    dict of keyword arguments), or, without it, on what the model offers
    (:func:`anvil_fast.optim.roles.offered_input`: a Hugging Face model's ``dummy_inputs``, or an image
    of its config's ``image_size``; the package's GPT; an ``nn.Sequential`` whose first module is an
    ``nn.Linear`` or ``nn.Embedding``). A torch.compile'd model is traced through its original
    module (``_orig_mod``; compiled submodules run eagerly for the trace). The plan (routes, banks,
    the param groups, their number and order) is then fixed: no hook is left on the model, so a
    state-dict round trip before the first forward (accelerate, the HF Trainer), a scheduler built
    first, or ``copy.deepcopy``/``pickle`` of the model change nothing. A model that cannot be
    traced is routed by the rules below without the trace (rule 9's fallbacks), with one
    UserWarning naming ``example_input=``; ``describe()`` says which. The first matching rule wins:

    1. ``anvil=`` (names, or a predicate on names) -> a matrix (refused for ndim < 2; ndim >= 4
       is flattened as a convolution weight is).
    2. ``adam=`` (names or predicate) -> Adam.
    3. ndim < 2 (scalars, norms, biases) -> Adam.
    4. a lookup table: the weight of an ``nn.Embedding``/``nn.EmbeddingBag`` (by identity, so an
       output head tied to an embedding is caught here too), or a parameter the trace saw indexed
       by an activation -> Adam.
    5. a parameter (ndim >= 2) of a module whose name's last component is in ``head_names``
       (default ``HEAD_NAMES``: lm_head, head, classifier, fc_out, output_layer) -> Adam.
    6. ``io_layers="adam"`` (default): the traced **output layers** (a product whose result is a model
       output up to casts, reshapes, scaling or a loss: ``lm_head``, resnet's ``fc``, a ``score`` or
       ``qa_outputs`` head under any name) and the **input layer** (the product applied to the
       model's input: a stem convolution, a patch embedding, an MLP's first layer) -> Adam. This is
       the Muon family's convention (Muon's authors keep the embedding and the head on AdamW, and
       torch.optim.Muon documents the same): an orthogonalized update suits a map between hidden
       spaces, whose every direction matters alike, not one whose input coordinates are pixels or
       features of unequal scale, nor logits. ``io_layers="anvil"`` banks them like the others.
    7. a column ``[n, 1, ...]`` (a per-output gain such as weight_norm's ``g``) -> Adam; then module
       types: a convolution weight (any ``_ConvNd``) ``[d0, d1, d2, ...]`` -> the matrix
       ``[d0, d1*d2*...]`` (a transposed convolution's ``[in, out*k]``, transposed), with ``groups=G``
       G matrices ``[d0/G, d1*d2*...]``, one per group, since each group maps its own input channels
       (a group's matrix of one row or column, a depthwise filter, -> Adam); an ``nn.Linear`` (or
       ``nn.MultiheadAttention`` projection) weight -> a matrix; a ``Conv1D`` weight ``[in, out]`` ->
       a matrix stored transposed; a recurrent layer's ``weight_ih``/``weight_hh`` -> one matrix per
       gate (LSTM 4, GRU 3: the gates act as separate layers, as a fused q, k, v does).
    8. the trace (plain Parameters of custom modules): a matrix operand of products only -> a matrix
       (2-D) or a stack (3-D: each ``[i]`` a matrix ``[d1, d2]``, e.g. per-expert weights), its
       orientation read off the product (``F.linear(x, W)``: ``[out, in]``; ``x @ W``: ``[in, out]``,
       transposed); combined with activations otherwise (a class token, a position table, a gain)
       -> Adam.
    9. not traced (or not used in the traced forward): a parameter whose first dimension is 1 (a
       broadcast table: ``[1, N, D]``, a ``[1, D]`` token) -> Adam; else ndim == 2 -> a matrix,
       ndim == 3 -> a stack; anything else -> ConfigError naming the parameter.

    ``describe()`` gives each parameter's rule and what the trace saw. A matrix stored transposed
    (``[in, out]``) is updated as the ``[out, in]`` matrix it acts as: the learning-rate shape
    scale and the equalizer's lanes are those of ``nn.Linear``'s layout (:mod:`anvil_ref.config`,
    ``transposed``); ``split_rows=`` refuses it (its rows are input features).

    Parameters with ``requires_grad=False`` at construction are left out (``frozen="leave"``: no
    memory for their state; a step at which one of them has a gradient raises ConfigError, since it
    would not train); ``frozen="include"`` plans them too, so gradual unfreezing trains them. Given
    parameters without their model (``model.parameters()``, ``model.named_parameters()``), the
    modules holding them are found among the live ``nn.Module`` objects, so module types and the
    trace count as for the model itself; parameters of no module are routed by
    shape (rule 9) with a UserWarning. Plain parameters are named ``param0, param1, ...``.
    Two Parameters over one memory (a tie by shared storage) and parameters on the meta device are
    refused at construction (each parameter is moved into a bank or buffer there). A matrix needs
    dtype float32 or bfloat16. ``split_rows={name: k}`` splits that parameter's
    matrices into k equal row blocks, each its own matrix (e.g. a fused qkv projection ``[3d, d]``
    with k=3, or per-head splitting). Matrices of equal ``(rows, cols, dtype, transposed)`` share one
    bank ``[n, rows, cols]``; each member parameter is a view of its bank. Under torch.distributed a
    bank is padded with frozen zero matrices to a multiple of the world size and sharded by
    matrix; Adam parameters with ``numel >= shard_min_numel`` (and a first dimension the world size
    divides) are sharded, the others replicated. A model with parameters of ndim >= 2 but no bank
    gets a UserWarning. bf16 matrices keep the seed's exact fp32 master (bf16 parameter + uint16
    mantissa); float32 matrices are their own master.

    **The update.** For a matrix ``P`` of ``rows x cols`` (as banked) with gradient ``G``, the
    rails and lane-energy equalizer of :mod:`anvil_ref` give the update ``U`` and the slow rail
    ``S``; then (:func:`anvil_ref.update.sign_aligned_update`)::

        eff_lr = lr * scale(rows, cols)
        eff_wd = weight_decay * lr
        P'     = P - P * [S * P >= 0] * eff_wd * eff_lr - U * eff_lr

    with ``lr_scale`` choosing ``scale`` (:func:`anvil_ref.update.shape_lr_multiplier`)::

        "seed" (default):  scale = max(1, rows / cols) ** 0.5      (the record's)
        "match_rms_adamw": scale = 0.2 * max(rows, cols) ** 0.5    (torch.optim.Muon's rule, so an
                                                                     AdamW learning rate transfers)

    Adam is :mod:`anvil_ref.adam`'s (the seed's) with ``adam_betas``, ``adam_eps``,
    ``adam_weight_decay`` and ``lr = adam_lr``.

    **Rails.** ``rails="nesterov"`` (default): every step uses the anvil group's ``momentum``,
    ``fast_beta`` (None: = momentum) and ``fast_weight`` (1.0: plain Nesterov momentum). It is the
    default because the record's schedule is tied to a run length and to an engage step tuned for the
    record's run. ``rails="record"`` (needs ``total_steps``, an int >= 1): before the t-th taken step
    (t = 0, 1, ...; skipped steps do not count) the anvil group's momentum, fast_beta and fast_weight
    are set to :func:`anvil_ref.rails.rail_scalars` ``(t, total_steps)`` (visible in
    ``param_groups``); a step after ``total_steps`` taken steps raises ValueError.

    **param_groups**: ``[anvil, adam]`` (a group without parameters is left out): anvil has
    ``kind="anvil", lr, momentum, fast_beta, fast_weight, beta2, weight_decay``; adam has
    ``kind="adam", lr, betas, eps, weight_decay``. Every value may change between steps (LR
    schedulers, you) and takes effect at the next step; values are validated at construction and
    at every step as torch's optimizers do (ValueError naming the value). ``defaults`` holds lr and
    momentum, so momentum-cycling schedulers (OneCycleLR, CyclicLR) work: they cycle the anvil
    group's momentum, and a ``momentum`` they write into the adam group is Adam's beta1.
    ``add_param_group({"params": [...]})`` (a layer unfrozen later) routes the added parameters by
    the same rules (module types, the construction's trace, which saw frozen parameters too) into
    the banks and the group of their kind, keeping every other parameter's state; since every bank
    runs with one set of values, the dict may name values (``lr``, ``adam_lr``, ...) only as the
    groups hold them (ValueError otherwise).

    **step(closure=None)** returns the closure's loss. Per step:

    * a parameter whose ``.grad`` is None is not touched (its weights and all its state, also inside
      a bank whose other members have gradients; Adam's step count does not advance for it);
    * non-finite gradients never reach the state: with ``nonfinite="skip"`` (default) a step whose
      gradients hold NaN/inf (on any rank) is skipped for every parameter (nothing written, no step
      counted), a :class:`NonFiniteGradientWarning` names the parameters and ``skipped_steps``
      counts; ``nonfinite="raise"`` raises :class:`NonFiniteGradientError` instead. The check reads
      the gradients as the step reads them (a bank's in bf16, so an fp32 gradient beyond bf16's
      range counts as infinite). On one process the verdict is the device's
      (:mod:`anvil_fast.optim.device_step`): the step never waits for the device; every kernel that
      writes state is masked by it, so a refused step leaves every weight and state tensor bit for
      bit as it was. On CUDA the warning therefore comes at a later step, or when ``skipped_steps``
      (or ``taken_steps``) is read, which waits for the device; ``nonfinite="raise"`` waits after
      every step (one host sync per step) and raises there. On the CPU, and on several ranks (one
      host sync), it comes from the step itself;
    * a matrix whose update comes out non-finite (FAITHFUL: the seed's cascade can overflow on
      rank-1-like input; SAFE's guard also refuses an exploded one) is not applied: that matrix
      only takes its sign-aligned decay, and a :class:`anvil_fast.optim.device_step.NonFiniteUpdateWarning`
      names the bank and the configuration (``nonfinite="raise"``:
      :class:`~anvil_fast.optim.device_step.NonFiniteUpdateError`); no NaN or inf reaches a weight or
      the lane energies. ``refused_updates`` counts them per bank over the run;
    * a step in which no parameter has a ``.grad`` does nothing and counts nothing;
    * a parameter whose storage, dtype or device changed since construction (``model.to(dtype)``,
      ``model.double()``, ``p.data = ...``) raises :class:`StaleParameterError`: build a new optimizer;
    * ``.grad`` is left as the caller gave it.

    Several ranks: initialize the process group first, start every rank from the same weights, do
    not wrap the model in DDP (the optimizer averages gradients itself; refused), and let the ranks
    agree on which parameters have gradients. A model sharded with FSDP2 (``fully_shard``: DTensor
    parameters) is taken as it is and gets :class:`anvil_fast.optim.fsdp.FSDPAnvil` (owner ranks update
    whole matrices; see that module).

    **torch.optim behaviour.** ``zero_grad``, LR schedulers, ``torch.amp.GradScaler``
    (``scaler.step(opt)``) and ``torch.compile(model)`` (before or after building; the
    ``_orig_mod.`` prefix is dropped from names) work. ``opt.state[p]`` is a live view of p's state:
    matrices ``fast_rail, slow_rail, lane_energy, mantissa`` in the banked shape (``[count, rows,
    cols]``, or ``[rows, cols]`` for one matrix; on several ranks only this rank's matrices), Adam
    ``step, exp_avg, exp_avg_sq`` (this rank's shard when sharded).

    **State dict**: torch's format. ``"state"`` maps each parameter's position over
    ``param_groups`` (the anvil group's parameters in bank order, then the adam group's) to copies
    of its state; ``"param_groups"`` holds each group's values with ``"params"`` (positions) and,
    where names were known, ``"param_names"``; the first group's ``"anvil_fast"`` entry holds the
    optimizer-wide values (format, world size and rank, the steps taken and skipped, and the plan:
    each position's route, orientation and reason), where torch.distributed.checkpoint keeps them.
    ``load_state_dict`` loads by position as torch does (a model wrapped in ``nn.Sequential`` or
    renamed loads), checks every tensor's shape and dtype before it writes anything, and copies into
    the live tensors. A state dict whose plan routes this optimizer's parameters (by name)
    differently is loaded by rebuilding this plan as it records it first (a checkpoint of an
    optimizer built with other routing arguments). torch's four state-dict hooks run;
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
    ``set_optimizer_state_dict`` work. State dicts of the format ``anvil_fast.ANVIL/1`` (keyed by
    bank label) load too. Only tensors and plain containers: ``torch.load(f)`` with
    ``weights_only=True`` loads it; a reload continues bit for bit.

    **Copies**: ``copy.deepcopy(opt)``, ``pickle`` and ``torch.save(opt)`` rebuild the optimizer
    from its parameters, arguments, plan and state dict (``copy.deepcopy((model, opt))`` gives an
    optimizer of the copied model); hooks are not copied, as torch's optimizers do not copy them.

    Args (the keyword arguments of :class:`~anvil_fast.optim.dropin.DropInAnvil`, whose signature
    ``inspect.signature`` reads; :class:`~anvil_fast.optim.fsdp.FSDPAnvil` takes those it names):
        params: an ``nn.Module`` (preferred: module types and names are known), its
            ``named_parameters()``, or plain parameters. Param-group dicts are refused.
        lr, adam_lr: ANVIL's and Adam's learning rates (0.023, 0.008: the record's).
        momentum, fast_beta, fast_weight: the rails (above).
        beta2: the lane-energy equalizer's decay (0.9).
        weight_decay: ANVIL's sign-aligned decay (2.25; scaled by lr twice, above).
        adam_betas, adam_eps, adam_weight_decay: Adam's ((0.9, 0.95), 1e-10, 0.005).
        rails, total_steps: "nesterov" or "record" (above).
        lr_scale: "seed" or "match_rms_adamw" (above).
        adam, anvil: names (or a predicate on names) forced onto Adam / onto the matrix route.
        head_names: module names whose parameters of ndim >= 2 are output heads.
        example_input: a forward's input, traced at construction (Routing).
        io_layers: "adam" (default) or "anvil": where the traced input and output layers go.
        frozen: "leave" (default) or "include": parameters frozen at construction (Routing).
        split_rows: ``{name: k}`` (above).
        nonfinite: "skip" or "raise" (above).
        shard_min_numel: Adam parameters at least this large are sharded (the others share flat
            buffers and one fused launch; reading gradients in place, one launch serves every Adam
            parameter where it lives, so none is put on the flat buffers).
        comms: a :class:`~anvil_fast.parallel.comms.Comms`, a process group, or None (the default group if
            torch.distributed is initialized, else one process).
        bank_config, maps: the bank update's cascade configuration and map set.
        cuda_graphs: None (default): on CUDA, replay each step's device part (the check, the
            scalars, every bank update, Adam) as one CUDA graph where capture is valid (off with a
            warning giving the reason where it is not, e.g. gloo; off on the CPU); True: capture or
            raise; False: off.
        compile: run the bank update's element-wise phases that have no Triton kernel through
            torch.compile (None: on CUDA). With the default ``bank_config`` (SAFE) on CUDA every phase
            is a Triton kernel and nothing is compiled, the lean state's included; FAITHFUL (the
            seed's form) and CPU tensors take the compiled or eager functions.
        rails_dtype: ``torch.float32`` (default: the seed's rails) or ``torch.bfloat16``, the lean
            state: both rails stored in bf16 (2 x 2 B per banked weight instead of 2 x 4 B), each
            update computed in fp32 and rounded stochastically
            (:func:`anvil_ref.storage.stochastic_round_bf16`: unbiased, and the same bits on every
            device and sharding).
        grad_read: how a one-process step reads the gradients: ``"in_place"`` (the kernels read
            each ``.grad`` where autograd wrote it, through device tables of addresses: no copy and
            no gradient buffer; SAFE and GRAM_SIDE on CUDA, the default there), ``"buffers"``
            (every ``.grad`` copied into the banks' persistent bf16 buffers first: FAITHFUL's
            compiled rails on CUDA read those) or ``"transient"`` (the CPU's, and its default: the
            check and Adam read each ``.grad`` where it is; a bank's gradients are cast to bf16 into
            a buffer that lives only for that bank's update, as does its cascade workspace, so the
            optimizer holds AdamW's memory on an fp32 model); None picks. In place, a gradient must
            be contiguous (autograd's always are; an assigned strided one is refused). On several
            ranks the gradients are reduced into the buffers.
    """

    if holds_dtensors(params):
        return FSDPAnvil(params, *args, **kwargs)
    return DropInAnvil(params, *args, **kwargs)


__all__ = ["ANVIL"]
