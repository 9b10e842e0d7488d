"""The overlapped training step: each reduce-scatter launched from the backward pass.

:class:`OverlappedStep` drives the schedule of one :class:`~anvil_fast.optim.optimizer.AnvilAndAdam`
step over a model that states where its forward reads which parameters (``wait_points()``, as
:class:`~anvil_fast.models.banked_gpt.BankedGPT` does):

* each sharded parameter's ``register_post_accumulate_grad_hook`` marks it ready; reduce-scatters
  are launched strictly in the optimizer's ``scatter_order`` (a label launches when it and every
  label before it is ready), so every rank enqueues the same collectives in the same order and
  the schedule is the optimizer's own;
* after the backward pass, :meth:`OverlappedStep.step` runs the optimizer's host part and its device
  part with those reduces (``body(..., launched=...)``): the updates and all-gathers of phases 2-3;
* the all-gathers complete either at the step's end (``wait="end"``) or in a forward pre-hook of
  the module that reads the parameter (``wait="prehook"``: the next forward's first layers start
  while later gathers are still in flight). On NCCL every wait is a stream wait, not a host block.

The arithmetic is the non-overlapped schedule's (:func:`sequential_step`: backward, then
:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.step_from_buffers`): the same collectives on the same
gradients, the same updates; only their launch times differ. Which gradients a step reads and
which it keeps is the optimizer's rule (:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.step_labels`,
:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.release_grads`), here as in ``AnvilAndAdam.step``.
:func:`comm_only` is a step's collectives alone, for the studies that time them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from anvil_ref.config import ConfigError

from anvil_fast.parallel.comms import Handle

WAIT_MODES = ("prehook", "end")


def make_optimizer(model, *, comms=None, compile_banks: bool | None = None, work_order: str = "backward",
                   graphs: bool = False):
    """AnvilAndAdam over a model's labelled parameters with its schedule (untied embeddings): the
    model states ``labelled()``, ``param_table()``, ``scatter_order()`` and ``work_order(order)``
    (:class:`~anvil_fast.models.banked_gpt.BankedGPT`); ``graphs``: the bank updates replayed as CUDA graphs."""
    from anvil_fast.core.bank import anvil_bank_update
    from .optimizer import AnvilAndAdam

    opt = AnvilAndAdam(model.labelled(), model.param_table(), model.scatter_order(), model.work_order(work_order),
                       comms=comms, tie_embeddings=False,
                       bank_update=functools.partial(anvil_bank_update, compile=compile_banks))
    if graphs:
        opt.use_cuda_graphs()
    return opt


class OverlappedStep:
    """Launch each sharded gradient's reduce-scatter from the backward pass and finish the step
    after it (module docstring). Call :meth:`begin` before the backward pass and :meth:`step` after
    it (it first waits any gather no forward waited); :meth:`wait_all` before reading the
    parameters outside a forward pass (evaluation, checkpoints). With gradient accumulation, call
    :meth:`begin` before the *last* micro-batch's backward pass only: a reduce launched from an
    earlier one would carry a partial sum, so a second backward pass after :meth:`begin` is refused."""

    def __init__(self, opt, model, *, wait: str = "prehook"):
        if wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {WAIT_MODES}, got {wait!r}")
        if opt.check_finite:
            raise ConfigError("OverlappedStep: check_finite needs every gradient before the first reduce; "
                              "the overlapped schedule launches them during the backward pass")
        if opt.tied and not opt.split_embed:
            raise ConfigError("OverlappedStep: tied embed/lm_head reduce as one sum at the end of the backward "
                              "pass; untie them (tie_embeddings=False or copy_lm_state_to_embed)")
        self.opt, self.wait = opt, wait
        self.sharded = [l for l in opt.scatter_order if opt.param_cfgs[l].comms == "sharded"]
        self.deferred = frozenset(self.sharded) if wait == "prehook" else frozenset()
        self.do_adam = True
        self._armed = False
        self._queue: list[str] = []
        self._next = 0
        self._ready: set[str] = set()
        self._launched: dict[str, tuple[Handle, Tensor]] = {}
        self._gathers: dict[str, Handle] = {}
        self._hooks = [opt.params[l].register_post_accumulate_grad_hook(functools.partial(self._on_grad, l))
                       for l in self.sharded]
        if wait == "prehook":
            for module, labels in model.wait_points():
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, labels)))

    def remove(self) -> None:
        """Take the hooks off (the parameters are left as they are; :meth:`wait_all` first)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _pre_forward(self, labels: Sequence[str], module, args) -> None:
        for l in labels:
            h = self._gathers.pop(l, None)
            if h is not None:
                h.wait()

    def wait_all(self) -> None:
        for h in self._gathers.values():
            h.wait()
        self._gathers = {}

    def begin(self, do_adam: bool = True) -> None:
        """Before the backward pass: which gradients this step reads (Adam's only when ``do_adam``)."""
        self.do_adam = bool(do_adam)
        self._queue = self.opt.step_labels(self.do_adam, self.sharded)
        self._next, self._ready, self._launched = 0, set(), {}
        self._armed = True

    def _on_grad(self, label: str, param: Tensor) -> None:
        if not self._armed:
            return  # a backward pass before begin(): an earlier micro-batch, accumulating only
        if label in self._ready:
            raise RuntimeError(f"OverlappedStep: {label!r} received a second gradient after begin(); its reduce "
                               "already left with the first. Call begin() before the last micro-batch's backward "
                               "pass only")
        self._ready.add(label)
        self._launch_ready()

    def _launch_ready(self, *, final: bool = False) -> None:
        # strictly in scatter_order, so that every rank enqueues the same collectives in the same order
        q, params = self._queue, self.opt.params
        while self._next < len(q):
            l = q[self._next]
            if l not in self._ready:
                if not final:
                    return
                if params[l].grad is None:  # never reached this step: not read, not launched
                    self._next += 1
                    continue
            self._launched[l] = self.opt.launch_reduce(l, params[l].grad)
            self._next += 1

    def step(self) -> None:
        """After the backward pass: the rest of the step on the reduces already in flight."""
        opt = self.opt
        if not self._armed:
            raise RuntimeError("OverlappedStep.step() without begin() before the backward pass")
        self._armed = False
        self.wait_all()  # a gather no forward waited still reads the shard this step updates
        self._launch_ready(final=True)  # labels whose hook did not run (no use this step, kept grads)
        grads = opt.step_grads(self.do_adam)
        with torch.no_grad():
            plan = opt.prepare(grads, self.do_adam, deferred=self.deferred)
            self._gathers = opt.body(plan, grads, deferred=self.deferred, launched=self._launched)
        opt.release_grads(self.do_adam)
        self._launched = {}


def sequential_step(opt, do_adam: bool = True) -> None:
    """The non-overlapped schedule: after the backward pass, the gradients into the persistent
    buffers and :meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.step_from_buffers`."""
    bufs = opt.grad_buffers()
    grads = opt.step_grads(do_adam)
    with torch.no_grad():
        for l, g in grads.items():
            bufs[l].copy_(g)
        opt.step_from_buffers(list(grads), do_adam=do_adam)
    opt.release_grads(do_adam)


def comm_only(opt, *, replicated_first: bool) -> Callable[[], None]:
    """The collectives of one step of ``opt`` with every gradient present (untied), same buffers
    and order, without compute: the sharded reduce-scatters in ``scatter_order`` (inputs in the
    dtype each gradient travels in), the replicated all-reduce, then the all-gathers in
    ``work_order``. ``replicated_first``: the all-reduce before the reduce-scatters, as
    :meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.step` launches it (phase 0); else after them, as
    :class:`OverlappedStep` launches it once the backward pass is over."""
    comms = opt.comms
    inputs = {l: torch.zeros(opt.params[l].shape, dtype=(opt.banks[l].grad.dtype if l in opt.banks
              else opt.params[l].dtype), device=opt.device) for l in opt.labels if opt.param_cfgs[l].comms == "sharded"}
    outs = {l: (opt.banks[l].grad if l in opt.banks else
                torch.empty_like(inputs[l][:opt.param_cfgs[l].chunk_size])) for l in inputs}

    def all_reduce():
        return [] if opt.replicated is None else [comms.all_reduce_avg(g.grad) for g in opt.replicated.groups]

    def run():
        hs = all_reduce() if replicated_first else []
        for l in opt.scatter_order:
            if l in inputs:
                src = inputs[l].view(opt.param_cfgs[l].reshape) if l in opt.banks else inputs[l]
                hs.append(comms.reduce_scatter_avg(outs[l], src))
        if not replicated_first:
            hs += all_reduce()
        for h in hs:
            h.wait()
        gs = [opt.launch_gather(l) for l in opt.work_order if l in inputs]
        for h in gs:
            h.wait()
    return run


__all__ = ["WAIT_MODES", "make_optimizer", "OverlappedStep", "sequential_step", "comm_only"]
