"""The bank updates as CUDA graphs, and the check that what a graph baked is still what it updates.

A captured CUDA graph replays its kernels on the *addresses* it saw at capture. For a bank update
that is exactly right as long as every tensor the update touches (the bank's persistent gradient
buffer, rails, lane energy, mantissa, the parameter slice, the device scalars and the cascade's
workspace) is allocated once and only ever written in place -- which
:class:`~anvil_fast.optimizer.AnvilAndAdam` guarantees for its own buffers. What it cannot prevent
is someone rebinding a parameter (``param.data = ...``, ``model.to(...)``,
``load_state_dict(..., assign=True)``): the graph would then keep updating the old memory while the
model reads the new, silently. :class:`BankUpdateGraphs` therefore records every baked address and,
before each replay, compares them with the optimizer's live ones
(:meth:`AnvilAndAdam.live_bank_state`, the same definition the banks were built from), raising
:class:`StaleGraphError` naming the bank and the tensor.

Capture runs each update ``warmup`` times on a side stream first (so torch.compile and Triton have
compiled and autotuned), then captures once; the warm-up runs change the state they update, so that
state is saved before and restored after, bit for bit: capturing changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: AnvilBank fields whose storage a captured update reads or writes.
BANK_TENSORS = ("grad", "velocity", "lane_energy", "mantissa", "p_slice", "momentum", "eff_wd",
                "fast_beta", "fast_weight", "eff_lr", "guard_trips")


class StaleGraphError(RuntimeError):
    """A captured bank update would write memory the optimizer or model no longer uses."""


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

    Use it as the optimizer's ``bank_update`` (:meth:`AnvilAndAdam.use_cuda_graphs` does both).
    ``check=True`` compares the baked addresses with the live ones before every replay (a few
    microseconds of host time per bank; the host runs ahead of the GPU anyway).
    """

    def __init__(self, opt, update: Callable[[Any], None] | None = None, *, warmup: int = 2, check: bool = True):
        if opt.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the optimizer's tensors on a CUDA device, got {opt.device}")
        if isinstance(update, BankUpdateGraphs):
            update = update.update
        if update is None:
            from .bank import anvil_bank_update as update
        self.opt, self.update, self.check = opt, update, check
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.baked: dict[str, dict[str, int]] = {}
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        for label, bank in opt.banks.items():
            saved = {k: v.clone() for k, v in bank.mutated().items()}
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(max(1, warmup)):
                    update(bank)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread keeps querying its events while we capture; in
            # the default global mode those queries invalidate the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                update(bank)
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


__all__ = ["BankUpdateGraphs", "StaleGraphError", "baked_addresses", "check_addresses", "BANK_TENSORS"]
