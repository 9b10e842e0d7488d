"""The bank updates as CUDA graphs, and the check that what a graph baked is still what it updates.

A captured CUDA graph replays its kernels on the *addresses* it saw at capture. For a bank update
that is exactly right as long as every tensor the update touches (the bank's persistent gradient
buffer, rails, lane energy, mantissa, the parameter slice, the device scalars and the cascade's
workspace) is allocated once and only ever written in place -- which
:class:`~anvil_fast.optim.optimizer.AnvilAndAdam` guarantees for its own buffers. What it cannot prevent
is someone rebinding a parameter (``param.data = ...``, ``model.to(...)``,
``load_state_dict(..., assign=True)``): the graph would then keep updating the old memory while the
model reads the new, silently. :class:`BankUpdateGraphs` therefore records every baked address and,
before each replay, compares them with the optimizer's live ones
(:meth:`AnvilAndAdam.live_bank_state`, the same definition the banks were built from), raising
:class:`StaleGraphError` naming the bank and the tensor.

Capture runs each update ``warmup`` times on a side stream first (so torch.compile and Triton have
compiled and autotuned), then captures once; the warm-up runs change the state they update, so that
state is saved before and restored after, bit for bit: capturing changes nothing.

:class:`StepGraph` captures a whole optimizer step's device part instead
(:meth:`AnvilAndAdam.body <anvil_fast.optim.optimizer.AnvilAndAdam.body>`: fp32 bank split/join, bank
updates, Adam, the replicated flat pass, comms), one graph per :class:`~anvil_fast.optim.optimizer.StepPlan`
(which gradients the step reads, whether Adam runs). A step then costs its host part (checks, Adam
step counts, one scalar upload) and one replay. The host-to-device scalar copy stays outside the
graph: it reads one of several pinned host buffers in rotation (:mod:`.bank_scalars`), and a graph
would bake just one of them, forcing the host to wait for each replay before refilling it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from anvil_fast.kernels.capture import capture

#: AnvilBank fields whose storage a captured update reads or writes.
BANK_TENSORS = ("grad", "velocity", "lane_energy", "mantissa", "p_slice", "momentum", "eff_wd",
                "fast_beta", "fast_weight", "eff_lr", "guard_trips")


class StaleGraphError(RuntimeError):
    """A captured bank update would write memory the optimizer or model no longer uses."""


class GraphUnsupported(RuntimeError):
    """CUDA-graph capture is not valid for this optimizer; the message says why."""


def capture_unsupported_reason(opt) -> str | None:
    """Why a CUDA graph of ``opt``'s step would be invalid, or None when capture is valid."""
    if opt.device.type != "cuda":
        return f"CUDA graphs need the optimizer's tensors on a CUDA device, got {opt.device}"
    backend = getattr(opt.comms, "backend", None)
    if backend is not None and opt.world_size > 1 and backend != "nccl":
        return (f"the process group's backend is {backend!r}; only NCCL collectives can be captured in a "
                "CUDA graph")
    return None


def baked_addresses(opt, label: str) -> dict[str, int]:
    """The addresses a capture of bank ``label`` bakes: the bank's tensors and the live state."""
    bank = opt.banks[label]
    out = {}
    for name in BANK_TENSORS:
        t = getattr(bank, name, None)
        if t is not None:
            out[f"bank.{name}"] = t.data_ptr()
    for name, t in opt.live_bank_state(label).items():
        out[f"live.{name}"] = t.data_ptr()
    ws = getattr(bank, "workspace", None)
    if ws is not None:
        for name, t in sorted(vars(ws).items() if hasattr(ws, "__dict__") else []):
            if isinstance(t, torch.Tensor):
                out[f"workspace.{name}"] = t.data_ptr()
            elif t is not None and hasattr(t, "__dict__"):  # NormPartials: the fused normalization's buffers
                for sub, u in sorted(vars(t).items()):
                    if isinstance(u, torch.Tensor):
                        out[f"workspace.{name}.{sub}"] = u.data_ptr()
    return out


def check_addresses(opt, label: str, baked: dict[str, int]) -> None:
    """Raise :class:`StaleGraphError` if any address baked for ``label`` differs from the live one."""
    now = baked_addresses(opt, label)
    stale = sorted(k for k in baked if now.get(k) != baked[k])
    if stale:
        raise StaleGraphError(
            f"bank {label!r}: the captured update's {', '.join(stale)} no longer match the live tensors "
            "(a parameter or state tensor was rebound, e.g. by param.data = ..., model.to(...) or "
            "load_state_dict(assign=True)); recapture with opt.use_cuda_graphs()")


class BankUpdateGraphs:
    """One CUDA graph per bank of ``opt``, replayed in place of ``update(bank)``.

    :meth:`AnvilAndAdam.use_cuda_graphs` builds it as the optimizer's ``bank_graphs``, which
    :meth:`AnvilAndAdam.update_bank` then replays.
    ``check=True`` compares the baked addresses with the live ones before every replay (a few
    microseconds of host time per bank; the host runs ahead of the GPU anyway).
    """

    def __init__(self, opt, update: Callable[[Any], None] | None = None, *, warmup: int = 2, check: bool = True):
        if opt.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the optimizer's tensors on a CUDA device, got {opt.device}")
        if update is None:
            from anvil_fast.core.bank import anvil_bank_update as update
        self.opt, self.update, self.check = opt, update, check
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.baked: dict[str, dict[str, int]] = {}
        side = torch.cuda.Stream()  # one side stream for every bank's warm-up
        # Graphs that share a memory pool may reuse each other's transient blocks, which is safe only if
        # they never run at once: one pool per lane (its banks replay one after another on its stream,
        # in the order captured here); every bank in one pool where the banks run on one stream.
        lanes = getattr(opt, "bank_lanes", None)
        for labels in ([lane.banks for lane in lanes] if lanes else [list(opt.banks)]):
            pool = torch.cuda.graph_pool_handle()
            for label in labels:
                bank = opt.banks[label]
                saved = {k: v.clone() for k, v in bank.mutated().items()}
                # thread_local: NCCL's watchdog thread keeps querying its events while we capture; in
                # the default global mode those queries invalidate the capture
                graph = capture(lambda bank=bank: update(bank), warmup=max(1, warmup), pool=pool,
                                capture_error_mode="thread_local", side=side, precompile=True)
                for k, v in bank.mutated().items():
                    v.copy_(saved[k])
                self.graphs[label] = graph
                self.baked[label] = baked_addresses(opt, label)
        torch.cuda.synchronize()

    def check_all(self) -> None:
        """Check every bank's baked addresses against the live ones."""
        for label, baked in self.baked.items():
            check_addresses(self.opt, label, baked)

    def __call__(self, bank) -> None:
        if self.check:
            check_addresses(self.opt, bank.label, self.baked[bank.label])
        self.graphs[bank.label].replay()


def step_tensors(opt) -> dict[str, torch.Tensor]:
    """Every tensor a step's device part may write (parameters, optimizer state, the banks'
    gradient buffers, the fp32 banks' halves, the replicated flat buffers, the persistent gradient
    buffers and reduce chunks), by name."""
    out = {}
    for label, p in opt.params.items():
        out[f"param.{label}"] = p.data
        for k, v in opt.param_states[label].items():
            if isinstance(v, torch.Tensor):
                out[f"state.{label}.{k}"] = v
    for label, bank in opt.banks.items():
        for k, v in bank.mutated().items():
            out[f"bank.{label}.{k}"] = v
        if bank.grad is not None:
            out[f"bank.{label}.grad"] = bank.grad
    out["rail_step"] = opt.rail_step
    if opt.replicated is not None:
        for g in opt.replicated.groups:
            name = str(g.dtype).split(".")[-1]
            for k in ("param", "grad", "exp_avg", "exp_avg_sq"):
                out[f"flat.{name}.{k}"] = getattr(g, k)
    for label, t in (opt.built_grad_buffers or {}).items():
        out[f"grad_buffer.{label}"] = t
    for label, t in opt.reduce_chunks.items():
        out[f"reduce_chunk.{label}"] = t
    return out


def step_addresses(opt) -> dict[str, int]:
    """The addresses a capture of the whole step bakes (:func:`step_tensors`, the banks' own
    tensors and workspaces, the scalar buffer, the replicated segment ids)."""
    out = {k: t.data_ptr() for k, t in step_tensors(opt).items()}
    for label in opt.banks:
        out.update({f"{label}.{k}": v for k, v in baked_addresses(opt, label).items()})
    out["scalars"] = opt.staging.buffer.data_ptr()
    if opt.replicated is not None:
        for g in opt.replicated.groups:
            out[f"flat.{str(g.dtype).split('.')[-1]}.segment"] = g.segment.data_ptr()
    return out


class StepGraph:
    """The device part of :meth:`AnvilAndAdam.step_from_buffers` as CUDA graphs, one per plan.

    On a step whose plan has a graph: the host part runs (checks, Adam step counts, the scalar
    upload), the baked addresses are compared with the live ones (``check=True``;
    :class:`StaleGraphError` before anything is written), and the graph replays. A plan met for
    the first time is captured then (warm-up runs on a side stream, every mutated tensor saved and
    restored bit for bit, then the capture, then the replay), up to ``max_plans`` plans; past that
    the step runs eagerly. A change of a bank's ``beta2`` counts as a new plan. Deferred gathers and sparse updates are not captured (use ``step``).
    Raises :class:`GraphUnsupported` where capture is not valid (:func:`capture_unsupported_reason`),
    and, with ``strict``, when a capture fails; without ``strict`` a failed capture (state restored)
    warns and turns the graphs off (:attr:`off_reason`).
    """

    def __init__(self, opt, *, warmup: int = 2, check: bool = True, max_plans: int = 4, strict: bool = True):
        reason = capture_unsupported_reason(opt)
        if reason is not None:
            raise GraphUnsupported(reason)
        self.update = opt.bank_update
        self.opt, self.warmup, self.check, self.max_plans = opt, max(1, int(warmup)), bool(check), int(max_plans)
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self.baked: dict[Any, dict[str, int]] = {}
        self._signatures: dict[Any, tuple[int, ...]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = self.captures = self.eager_steps = 0
        self.strict = bool(strict)
        self.off_reason: str | None = None  #: why the graphs were turned off after a failed capture

    def _signature(self) -> tuple[int, ...]:
        # What a user or a checkpoint load can rebind: parameters and optimizer-state entries.
        # Everything else a graph bakes is owned by the optimizer and never reallocated.
        opt = self.opt
        return tuple(p.data_ptr() for p in opt.params.values()) + \
            tuple(v.data_ptr() for st in opt.param_states.values() for v in st.values() if isinstance(v, torch.Tensor))

    def check_plan(self, key) -> None:
        """Raise :class:`StaleGraphError` if an address baked for ``key`` (:meth:`key`) is no longer
        live (a cheap signature of the rebindable tensors first; the full comparison names them)."""
        baked = self.baked.get(key)
        if baked is None or self._signature() == self._signatures[key]:
            return
        now = step_addresses(self.opt)
        stale = sorted(k for k in baked if now.get(k) != baked[k]) or ["parameter or state tensors"]
        if stale:
            raise StaleGraphError(
                f"the captured optimizer step's {', '.join(stale[:6])}{' ...' if len(stale) > 6 else ''} no "
                "longer match the live tensors (a parameter or state tensor was rebound, e.g. by param.data = "
                "..., model.to(...) or load_state_dict(assign=True)); build a new optimizer or call "
                "capture_step() again")

    def _capture(self, key, plan, grads) -> bool:
        """Capture ``plan``; on failure restore the state, then raise (``strict``) or warn and turn
        the graphs off (every later step runs eagerly). Returns whether a graph was captured."""
        opt = self.opt
        saved = {k: t.clone() for k, t in step_tensors(opt).items()}
        main = torch.cuda.current_stream()
        try:
            # thread_local: NCCL's watchdog thread keeps querying its events while we capture; in
            # the default global mode those queries invalidate the capture
            graph = capture(lambda: opt.body(plan, grads, bank_update=self.update), warmup=self.warmup,
                            pool=self.pool, capture_error_mode="thread_local", precompile=True)
        except Exception as exc:
            main.synchronize()
            self.off_reason = f"capturing the step failed: {type(exc).__name__}: {exc}"
            if self.strict:
                raise GraphUnsupported(self.off_reason) from exc
            warnings.warn(f"{self.off_reason}; the optimizer steps eagerly from now on", RuntimeWarning, stacklevel=3)
            return False
        finally:
            for k, t in step_tensors(opt).items():
                if k in saved:  # (a reduce chunk first allocated by the warm-up holds nothing yet)
                    t.copy_(saved[k])
            del saved
        self.graphs[key] = graph
        self.baked[key] = step_addresses(opt)
        self._signatures[key] = self._signature()
        self.captures += 1
        return True

    def key(self, plan) -> tuple:
        """What a graph bakes besides addresses: the plan, and each bank's equalizer decay (a
        Python float the kernels take as a constant, so a change needs its own capture)."""
        return plan, tuple(b.beta2 for b in self.opt.banks.values())

    def before_write(self, plan) -> None:
        """The optimizer's host part calls this after its checks and before its first write
        (:meth:`AnvilAndAdam.prepare_from_buffers`): with ``check``, the addresses baked for the
        plan's graph against the live ones (:meth:`check_plan`)."""
        if self.check:
            self.check_plan(self.key(plan))

    def run(self, plan, key, grads) -> dict:
        """The device part of a prepared step: the replay of its plan's graph (captured on the
        plan's first step; eager past ``max_plans`` or after a failed capture)."""
        opt = self.opt
        if key not in self.graphs and (self.off_reason is not None or len(self.graphs) >= self.max_plans
                                       or not self._capture(key, plan, grads)):
            self.eager_steps += 1
            return opt.body(plan, grads)
        self.graphs[key].replay()
        self.replays += 1
        return {}


__all__ = ["BankUpdateGraphs", "StepGraph", "GraphUnsupported", "capture_unsupported_reason", "step_tensors",
           "step_addresses", "StaleGraphError", "baked_addresses", "check_addresses", "BANK_TENSORS"]
