"""The replicated Adam parameters as flat buffers: one all-reduce and one fused Adam launch per dtype.

The replicated parameters are the many small ones (scalars, lambdas, gates, norms, biases). Updated
one by one they would cost an all-reduce and a kernel launch each, every launch far shorter than
its own overhead. Here, at construction, each parameter's ``.data`` and its two fp32 moments are
re-pointed to slices of flat buffers (one set per parameter dtype; bitwise copies, so nothing
changes value); per Adam step the gradients are copied into a flat gradient buffer (one
``_foreach_copy_``), that buffer is averaged with one all-reduce, and one kernel
(:func:`anvil_fast.kernels.adam.fused_adam_`) updates every element, reading its parameter's scalars from
the optimizer's Adam table through a per-element row index (``segment``).

Invariants the rest of the optimizer relies on:

* Nothing rebinds a replicated parameter's ``.data`` or its moments afterwards; state loading copies
  in place (:meth:`AnvilAndAdam.load_state_dict`). :meth:`check_views` verifies it.
* The segment ids (table rows) are fixed at construction and identical on every rank.
* A parameter without a gradient this step has an inactive row: its stale slice of the flat
  gradient is reduced but never read, and its value and moments do not change (as the seed's
  per-parameter path skips it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from anvil_fast.kernels.adam import fused_adam_
from anvil_fast.parallel.comms import Comms, Handle


@dataclass
class FlatGroup:
    """The replicated parameters of one dtype, end to end in the optimizer's order."""

    dtype: torch.dtype
    labels: list[str]
    params: list[Tensor]
    param: Tensor  #: every member's .data is a view of this
    grad: Tensor  #: the all-reduce buffer
    exp_avg: Tensor  #: fp32
    exp_avg_sq: Tensor  #: fp32
    segment: Tensor  #: int32 per element: the member's row in the Adam table
    spans: list[slice] = field(default_factory=list)


class ReplicatedAdam:
    """Owns the flat buffers of the replicated Adam parameters.

    Args:
        members: ``(label, param, state, row)`` for each replicated parameter, in optimizer order;
            ``state`` holds ``exp_avg``/``exp_avg_sq`` (re-pointed here), ``row`` its table row.
        device: the parameters' device.
        comms: the optimizer's :class:`~anvil_fast.parallel.comms.Comms`.
    """

    def __init__(self, members: list[tuple[str, Tensor, dict, int]], device: torch.device, comms: Comms):
        self.comms = comms
        self.groups: list[FlatGroup] = []
        self._handles: list[Handle] = []
        self.active: set[str] = set()
        with torch.no_grad():
            for dtype in dict.fromkeys(p.dtype for _, p, _, _ in members):
                mine = [m for m in members if m[1].dtype == dtype]
                n = sum(p.numel() for _, p, _, _ in mine)
                g = FlatGroup(dtype=dtype, labels=[m[0] for m in mine], params=[m[1] for m in mine],
                              param=torch.empty(n, dtype=dtype, device=device),
                              grad=torch.zeros(n, dtype=dtype, device=device),
                              exp_avg=torch.empty(n, dtype=torch.float32, device=device),
                              exp_avg_sq=torch.empty(n, dtype=torch.float32, device=device),
                              segment=torch.empty(n, dtype=torch.int32, device=device))
                off = 0
                for label, p, state, row in mine:
                    span = slice(off, off + p.numel())
                    off += p.numel()
                    g.spans.append(span)
                    g.param[span].copy_(p.data.reshape(-1))
                    g.exp_avg[span].copy_(state["exp_avg"].reshape(-1))
                    g.exp_avg_sq[span].copy_(state["exp_avg_sq"].reshape(-1))
                    g.segment[span] = row
                    p.data = g.param[span].view(p.shape)
                    state["exp_avg"] = g.exp_avg[span].view(p.shape)
                    state["exp_avg_sq"] = g.exp_avg_sq[span].view(p.shape)
                self.groups.append(g)

    @property
    def labels(self) -> list[str]:
        return [label for g in self.groups for label in g.labels]

    def check_views(self, states: dict[str, dict]) -> None:
        """Raise if a member's ``.data`` or moments were rebound away from the flat buffers."""
        for g in self.groups:
            for label, p, span in zip(g.labels, g.params, g.spans):
                st = states[label]
                for name, t, flat in (("parameter", p.data, g.param), ("exp_avg", st["exp_avg"], g.exp_avg),
                                      ("exp_avg_sq", st["exp_avg_sq"], g.exp_avg_sq)):
                    if t.data_ptr() != flat[span].data_ptr():
                        raise RuntimeError(f"{label}: its {name} no longer lives in ReplicatedAdam's flat "
                                           "buffer (it was rebound; load state with copy_, never by assignment)")

    def grad_views(self) -> dict[str, Tensor]:
        """label -> the member's slice of its flat gradient buffer, in the parameter's shape (a
        gradient copied there needs no further copy before the all-reduce)."""
        return {label: g.grad[span].view(p.shape)
                for g in self.groups for label, p, span in zip(g.labels, g.params, g.spans)}

    @torch.no_grad()
    def launch_reduce(self, active: set[str], grads=None) -> None:
        """Copy the active members' gradients (``grads``: label -> tensor; None: each ``.grad``)
        into the flat buffers, one ``_foreach_copy_`` per dtype, skipping any that already lie
        there (:meth:`grad_views`), and start one all-reduce per dtype."""
        if self._handles:
            raise RuntimeError("ReplicatedAdam.launch_reduce called twice without update()")
        self.active = set(active)
        for g in self.groups:
            dst, src = [], []
            for label, p, span in zip(g.labels, g.params, g.spans):
                if label not in self.active:
                    continue
                s = p.grad if grads is None else grads[label]
                d = g.grad[span]
                if s.data_ptr() != d.data_ptr():
                    dst.append(d.view(p.shape))
                    src.append(s)
            if dst:
                torch._foreach_copy_(dst, src)
            self._handles.append(self.comms.all_reduce_avg(g.grad))

    def discard_pending(self) -> None:
        """Forget the reduces :meth:`launch_reduce` started, for a step that stopped before its
        :meth:`update` (an error in the step, or a capture that failed): the next step starts anew."""
        self._handles = []

    @torch.no_grad()
    def update(self, table: Tensor) -> None:
        """Wait for the reduces, then one fused Adam pass per dtype (rows of inactive members are 0)."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()
        if not self.active:
            return
        for g in self.groups:
            if any(label in self.active for label in g.labels):
                fused_adam_(g.param, g.grad, g.exp_avg, g.exp_avg_sq, g.segment, table)


__all__ = ["ReplicatedAdam", "FlatGroup"]
