"""Every per-step scalar the optimizer's kernels read, in one device buffer refreshed by one
host-to-device copy per step (seed: ``BankScalarStaging``, ``stage_bank_scalars``).

Why: the bank updates read ``momentum``, ``eff_wd``, ``fast_beta``, ``fast_weight`` (0-D) and
``eff_lr`` (one per matrix) as *device tensors*, so a change of learning rate or rail beta neither
recompiles a ``torch.compile``'d update nor invalidates a captured CUDA graph: the graph reads the
buffer's current contents. Writing each scalar with its own ``fill_`` would be one tiny H2D copy
(and one sync point for pageable memory) per scalar per bank; here the host fills a pinned buffer
and one ``copy_(non_blocking=True)`` moves everything. The Adam scalar table (one row per Adam
parameter: betas, eps, step size, decay, active flag) rides in the same copy.

Layout: every field starts on a 16-byte boundary (4 fp32 slots), because Inductor guards on input
alignment and would otherwise copy (or recompile for) a misaligned 0-D view.

Host buffers rotate over :data:`SLOTS` pinned buffers, each reused only after the event recorded
after its last upload has completed, so the host never overwrites bytes a pending copy still reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

#: fp32 slots per field (16 bytes): keeps every view 16-byte aligned.
ALIGN = 4
#: The four 0-D bank fields, in their order inside a bank's record.
BANK_FIELDS = ("momentum", "eff_wd", "fast_beta", "fast_weight")
#: The Adam table's columns (one row per Adam parameter).
ADAM_COLUMNS = ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size", "eff_wd", "active")
#: Pinned host buffers in rotation: deeper than the host's run-ahead of the device in steps.
SLOTS = 4


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BankScalarStaging:
    """One device buffer holding, for bank i, its four 0-D fields and its ``[chunk, 1, 1]`` eff_lr,
    and optionally an ``[adam_rows, 8]`` Adam table; :meth:`upload` refreshes all of it in one copy.

    Args:
        chunk_sizes: matrices per bank on this rank.
        device: where the kernels run.
        adam_rows: rows of the Adam table (0: none).
    """

    def __init__(self, chunk_sizes: Sequence[int], device: torch.device | str, adam_rows: int = 0):
        self.device = torch.device(device)
        self.chunk_sizes = [int(c) for c in chunk_sizes]
        self.adam_rows = int(adam_rows)
        # the buffer's layout, read by the device step's gather table (anvil_fast.optim.device_step)
        self.field_offsets: list[int] = []  #: per bank: where its four fields start
        self.lr_offsets: list[int] = []  #: per bank: where its per-matrix learning rates start
        off = 0
        for c in self.chunk_sizes:
            if c < 1:
                raise ValueError(f"every bank needs at least one matrix per rank, got chunk size {c}")
            self.field_offsets.append(off)
            off += len(BANK_FIELDS) * ALIGN
            self.lr_offsets.append(off)
            off += _pad(c)
        self.adam_offset = off  #: where the Adam table starts
        off += self.adam_rows * len(ADAM_COLUMNS)  # 8 columns: rows stay 32-byte aligned
        self.numel = max(off, ALIGN)
        self.buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        pin = self.device.type == "cuda"
        self._host = [torch.zeros(self.numel, dtype=torch.float32, pin_memory=pin) for _ in range(SLOTS)]
        self._events = [torch.cuda.Event() if pin else None for _ in range(SLOTS)]
        self._next = 0
        self.uploads = 0  #: how many uploads so far (tests count H2D copies with it)

    # ------------------------------------------------------------------ views
    def scalars(self, i: int) -> dict[str, Tensor]:
        """Bank i's four 0-D device views (``AnvilBank`` fields)."""
        o = self.field_offsets[i]
        return {name: self.buffer[o + k * ALIGN] for k, name in enumerate(BANK_FIELDS)}

    def eff_lr(self, i: int) -> Tensor:
        """Bank i's ``[chunk, 1, 1]`` device view of per-matrix effective learning rates."""
        o, c = self.lr_offsets[i], self.chunk_sizes[i]
        return self.buffer[o:o + c].view(c, 1, 1)

    def adam_table(self) -> Tensor:
        """The ``[adam_rows, 8]`` device view of the Adam table (columns :data:`ADAM_COLUMNS`)."""
        o = self.adam_offset
        return self.buffer[o:o + self.adam_rows * len(ADAM_COLUMNS)].view(self.adam_rows, len(ADAM_COLUMNS))

    # ------------------------------------------------------------------ upload
    def pack(self, fields: Sequence[Sequence[float]], eff_lrs: Sequence[Sequence[float]],
             adam_table: np.ndarray | None = None) -> np.ndarray:
        """The buffer's new contents as a float32 array (host side only; rounding to fp32 happens
        here, once per value, from the Python doubles the caller computed)."""
        if len(fields) != len(self.chunk_sizes) or len(eff_lrs) != len(self.chunk_sizes):
            raise ValueError(f"expected {len(self.chunk_sizes)} banks, got {len(fields)} field records "
                             f"and {len(eff_lrs)} eff_lr lists")
        out = np.zeros(self.numel, dtype=np.float64)
        for i, (f, lrs) in enumerate(zip(fields, eff_lrs)):
            if len(f) != len(BANK_FIELDS):
                raise ValueError(f"bank {i}: expected {len(BANK_FIELDS)} fields {BANK_FIELDS}, got {len(f)}")
            if len(lrs) != self.chunk_sizes[i]:
                raise ValueError(f"bank {i}: expected {self.chunk_sizes[i]} eff_lr values, got {len(lrs)}")
            o = self.field_offsets[i]
            out[o:o + len(BANK_FIELDS) * ALIGN:ALIGN] = f
            out[self.lr_offsets[i]:self.lr_offsets[i] + len(lrs)] = lrs
        if adam_table is not None:
            t = np.asarray(adam_table, dtype=np.float64)
            if t.shape != (self.adam_rows, len(ADAM_COLUMNS)):
                raise ValueError(f"adam_table: expected shape {(self.adam_rows, len(ADAM_COLUMNS))}, got {t.shape}")
            out[self.adam_offset:self.adam_offset + t.size] = t.ravel()
        return out.astype(np.float32)

    def upload(self, fields: Sequence[Sequence[float]], eff_lrs: Sequence[Sequence[float]],
               adam_table: np.ndarray | None = None) -> None:
        """Refresh the device buffer with one host-to-device copy (asynchronous on CUDA). Without an
        ``adam_table`` the table keeps its previous contents."""
        values = self.pack(fields, eff_lrs, adam_table)
        host, event = self._host[self._next], self._events[self._next]
        self._next = (self._next + 1) % SLOTS
        if event is not None:
            event.synchronize()  # the copy that last read this slot has finished
        if adam_table is None and self.adam_rows:
            # keep the table's current device contents: copy only the bank part
            n = self.adam_offset
            host[:n].copy_(torch.from_numpy(values[:n]))
            self.buffer[:n].copy_(host[:n], non_blocking=event is not None)
        else:
            host.copy_(torch.from_numpy(values))
            self.buffer.copy_(host, non_blocking=event is not None)
        if event is not None:
            event.record()
        self.uploads += 1


__all__ = ["BankScalarStaging", "BANK_FIELDS", "ADAM_COLUMNS", "ALIGN", "SLOTS"]
