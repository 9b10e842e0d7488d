"""The drop-in's step on one process, decided on the device: one graph launch, no host sync.

:class:`DeviceStep` runs a whole :class:`anvil_fast.ANVIL` step of one process (every bank and
Adam) so that the host never waits for the device. What a step does, in launch order (with CUDA
graphs, everything after step 0 is one replay):

0. (host) The inbox: this step's hyper-parameters as doubles (the param groups' values) and each
   gradient's state -- in the ``in_place`` read its address (0: no gradient), in the ``buffers``
   read a has-gradient flag after the gradients were copied into the banks' bf16 buffers (the
   FAITHFUL configuration's compiled rails on CUDA read those), in the ``transient`` read (the
   CPU's) a has-gradient flag alone -- written into one of several pinned buffers in rotation and
   moved to the device in one copy, or not at all when its bytes equal the last ones sent.
1. The check (:mod:`anvil_fast.kernels.nonfinite`): one flag per parameter, set where its gradient holds
   a NaN or an infinity as the step reads it (a bank's gradient as the bf16 it travels in: an fp32
   value past bf16's range counts as infinite).
2. The scalars (:func:`derive_scalars`): ``ok`` = no flag set; a matrix is *active* when it has a
   gradient and ``ok``; every bank's rates from the hyper-parameters (the record schedule's rails
   from a device table indexed by the device's count of taken steps); Adam's rows, inactive where
   there is no gradient or not ``ok``, their bias corrections from the device step counts; the
   counters (taken, skipped) advance by ``ok``. On CUDA one Triton launch does it
   (:func:`anvil_fast.kernels.step_scalars.derive_scalars_triton`), the torch function elsewhere.
3. The banks (:func:`anvil_fast.core.bank.anvil_bank_update`), on ``lanes`` side streams: banks are
   independent, so many small ones fill the GPU together instead of one after another. Each
   kernel that writes state is masked by the active matrices, so an inactive matrix -- a member
   without a gradient, or every matrix on a refused step -- keeps its weights, rails and lane
   energy bit for bit. The cascade's workspace is taken per update (from the caching allocator, or
   a CUDA graph's pool): banks on one stream reuse the same blocks. In the ``transient`` read a
   bank's bf16 gradient is likewise taken for its update alone: the members' ``.grad`` cast into
   one ``[chunk, rows, cols]`` tensor (the CPU's rails are torch operations over one tensor, and
   the cast to bf16 is itself a new tensor, so this one copy cannot be avoided there; the Triton
   rails read the members through a table of addresses instead), freed when the bank is done; the
   banks run one after another, so the step's transient memory is the largest bank's workspace
   and gradient, and the optimizer holds no gradient copy between steps.
4. Adam on the main stream, concurrently: one launch per dtype over every Adam parameter
   (``in_place``: :func:`anvil_fast.kernels.adam.adam_table_`; ``transient``: one update per
   parameter from its ``.grad``), its rows masked as above.
5. The status (the counters, the flags of the last refused step, every matrix's guard refusals)
   copied to page-locked host memory, inside the step's graph (:func:`host_status_buffer`). The
   host reads it at a later step once the device has finished (an event query, never a wait), and
   then warns: a refused step (non-finite gradient) with a
   :class:`~anvil_fast.optim.dropin.NonFiniteGradientWarning`, a refused matrix update with a
   :class:`NonFiniteUpdateWarning` naming its bank and the configuration. ``taken_steps`` and
   ``skipped_steps`` read it with a wait. On the CPU everything is synchronous and the warning
   comes from the step itself. ``nonfinite="raise"`` waits for the status after every step (the
   one host sync it costs) and raises.

Equal to the host-decided step: the same kernels with the same inputs (the scalars are the same
float64 formulas evaluated on the device, so the same fp32 values; the one exception is Adam's
``beta**t``, CUDA's ``pow`` being within 2 ulp of the host's: an fp32 step size can differ from
the host's only where the float64 value lies within ~2**-52 relative of an fp32 rounding boundary).
"""

from __future__ import annotations

import functools
import math
import mmap
import warnings
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from anvil_fast.kernels.adam import adam_block_table, adam_table_
from anvil_fast.kernels.bank_scalars import ADAM_COLUMNS, ALIGN, BANK_FIELDS
from anvil_fast.kernels.capture import capture
from anvil_fast.kernels.nonfinite import AddressCheck, BufferCheck, check_addresses, check_buffers

from .lanes import MAX_LANES, bank_work, make_lanes, run_on_lanes

#: How the step reads the gradients (:class:`DeviceStep`).
GRAD_READS = ("in_place", "buffers", "transient")
#: The hyper-parameters in the inbox, as doubles, in this order.
HYPER = ("lr", "momentum", "fast_beta", "fast_weight", "weight_decay",
         "adam_lr", "adam_beta1", "adam_beta2", "adam_eps", "adam_weight_decay")
#: Pinned inbox buffers in rotation: deeper than the host's run-ahead in steps.
INBOX_SLOTS = 4
#: Counters at the head of the status buffer: taken steps, skipped steps.
COUNTERS = 2


#: Locked status mappings whose step is gone, as (device index, address, mapping): unlocked at the next
#: :func:`host_status_buffer` call, after a device sync. Not when collected: a collection may fall inside
#: a CUDA graph capture, where the sync would invalidate it.
_RETIRED: list[tuple[int, int, object]] = []


def _unlock_retired() -> None:
    while _RETIRED:
        device_index, ptr, _mapping = _RETIRED.pop()
        torch.cuda.synchronize(device_index)  # a replay still in flight may be writing into it
        torch.cuda.cudart().cudaHostUnregister(ptr)


class _Keeper:
    """What keeps a :func:`host_status_buffer` alive: its collection retires the mapping."""

    def __init__(self, array: np.ndarray):
        self.array = array


def host_status_buffer(n: int, device_index: int) -> tuple[Tensor, _Keeper] | None:
    """``n`` int32 of page-locked host memory a CUDA graph on device ``device_index`` may copy into,
    and what keeps it alive; None where the driver refuses to lock it.

    Why not ``torch.zeros(pin_memory=True)``: torch's caching host allocator records an event on
    every asynchronous copy into its blocks, and a capture cannot hold that record, so the status copy
    would have to be launched after each replay (a second launch and its dispatch, host time on every
    step). An anonymous page-aligned mapping locked with ``cudaHostRegister`` is pinned memory the
    allocator does not own: the copy becomes a node of the step's graph. Once the returned keeper is
    collected, the mapping waits in :data:`_RETIRED` for the next call, which unlocks it."""
    _unlock_retired()
    size = max(mmap.PAGESIZE, -(-4 * n // mmap.PAGESIZE) * mmap.PAGESIZE)
    mem = mmap.mmap(-1, size)
    arr = np.frombuffer(mem, dtype=np.int32, count=n)
    ptr = arr.ctypes.data
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    except (AttributeError, RuntimeError):  # a torch without the binding
        return None
    if int(err) != 0:
        return None

    keeper = _Keeper(arr)
    # (the mapping, held here, outlives its lock; list.append is safe inside a collection)
    weakref.finalize(keeper, _RETIRED.append, (device_index, ptr, mem))
    return torch.from_numpy(arr), keeper


class NonFiniteUpdateWarning(RuntimeWarning):
    """A matrix's update came out non-finite (or, in SAFE, exploded) and was not applied."""


class NonFiniteUpdateError(ValueError):
    """``nonfinite="raise"``: a matrix's update came out non-finite (or exploded)."""


def derive_scalars(hyper: Tensor, has: Tensor, flags: Tensor, counters: Tensor, last_bad: Tensor,
                   adam_steps: Tensor, rail_step: Tensor, bank_active: Tensor, out_values: Tensor,
                   lr_coef: Tensor, wd_coef: Tensor, adam_lr_mul: Tensor, adam_wd_mul: Tensor, inactive: Tensor,
                   gather: Tensor, record: Tensor | None, n_bank: int, n_mat: int, lean: bool) -> None:
    """Step 2 of the module docstring, on the device, with the host's float64 formulas
    (:meth:`AnvilAndAdam._bank_fields`, :func:`anvil_fast.kernels.adam.adam_row`) in the same order of
    operations. ``out_values`` is the staging buffer (fp32) the banks and Adam read; ``gather``
    maps each of its positions to the derived values (the last one is a zero for the padding)."""
    f64 = torch.float64
    ok = (flags.sum() == 0).to(torch.int32)
    okf = ok.to(f64)
    lr, mom, fb, fw, wd = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
    alr, b1, b2, eps, awd = hyper[5], hyper[6], hyper[7], hyper[8], hyper[9]
    if record is not None:
        t = counters[0:1].clamp(0, record.shape[0] - 1).to(torch.int64)
        rs = record.index_select(0, t)[0].to(f64)  # a gather, not an index: no value reaches the host
        mom, fb, fw = rs[0], rs[1], rs[2]
    # banks: the four fields (momentum, wd_mul * weight_decay * lr, fast_beta, fast_weight), eff_lr
    ones = torch.ones(n_bank, dtype=f64, device=hyper.device)
    fields = torch.stack([ones * mom, wd_coef * wd * lr, ones * fb, ones * fw], dim=1)
    eff_lr = lr_coef * lr
    bank_active.copy_(has[:n_mat] * ok)
    # Adam rows: (beta1, 1 - beta1, beta2, 1 - beta2, eps, lr * (bias2 ** 0.5 / bias1), lr * lr * wd * wd_mul, 1)
    active = has[n_mat:] * ok
    steps = adam_steps + active.to(f64)
    lr_row = alr * adam_lr_mul
    bias1 = 1 - torch.pow(b1.expand_as(steps), steps)
    bias2 = 1 - torch.pow(b2.expand_as(steps), steps)
    on = active != 0
    step_size = torch.where(on, lr_row * (torch.pow(bias2, torch.full_like(bias2, 0.5)) / torch.where(on, bias1, 1)), 0)
    eff_wd = lr_row * lr_row * awd * adam_wd_mul
    n = steps.shape[0]
    row = torch.stack([b1.expand(n), 1 - b1.expand(n), b2.expand(n), 1 - b2.expand(n), eps.expand(n), step_size,
                       eff_wd, torch.ones_like(step_size)], dim=1)
    row = torch.where(on[:, None], row, inactive)
    src = torch.cat([fields.reshape(-1), eff_lr, row.reshape(-1), torch.zeros(1, dtype=f64, device=hyper.device)])
    out_values.copy_(src.index_select(0, gather).to(out_values.dtype))
    adam_steps.copy_(steps)
    last_bad.copy_(torch.where(ok != 0, last_bad, flags))
    counters[0:1].add_(ok)
    counters[1:2].add_(1 - ok)
    if lean:
        rail_step.add_(ok.to(rail_step.dtype))


@functools.lru_cache(maxsize=None)
def _scalars_fn(cuda: bool):
    """Who derives the scalars: one Triton launch on CUDA, else :func:`derive_scalars` (compiled on
    CUDA without Triton)."""
    if not cuda:
        return derive_scalars
    from anvil_fast.kernels.backend import triton_available

    if triton_available():
        from anvil_fast.kernels.step_scalars import derive_scalars_triton

        return derive_scalars_triton
    from anvil_fast.kernels.compiled import maybe_compiled

    return maybe_compiled(derive_scalars, True)


class DeviceStep:
    """The device-decided step of a one-process :class:`~anvil_fast.optim.dropin.DropInAnvil` (module docstring).

    Args:
        opt: the drop-in (its ``inner`` :class:`~anvil_fast.optim.optimizer.AnvilAndAdam`, banks, Adam
            parameters and param groups).
        grad_read: ``"in_place"``, ``"buffers"`` or ``"transient"`` (CPU only) (:data:`GRAD_READS`).
        cuda_graphs: capture the device part (CUDA only).
        lanes: side streams for the banks (CUDA only; 1: the main stream).
        record: the record schedule's ``[total_steps, 3]`` table (momentum, fast_beta, fast_weight)
            or None.
    """

    def __init__(self, opt, *, grad_read: str, cuda_graphs: bool, lanes: int = MAX_LANES,
                 record: np.ndarray | None = None, warmup: int = 2, max_graphs: int = 4):
        if grad_read not in GRAD_READS:
            raise ValueError(f"grad_read must be one of {GRAD_READS}, got {grad_read!r}")
        inner = opt.inner
        self.inner, self.grad_read = inner, grad_read  # not the drop-in itself: a cycle would outlive a `del`
        dev = self.device = inner.device
        self.cuda = dev.type == "cuda"
        if grad_read == "transient" and self.cuda:
            raise ValueError("grad_read='transient' runs on the CPU (a CUDA graph would bake the addresses of "
                             "buffers that live for one update); on CUDA use 'in_place' or 'buffers'")
        self.lean = inner.rails_dtype == torch.bfloat16
        # ---- who is who: bank matrices (grouped by gradient dtype), then Adam parameters (same)
        self.names: list[str] = []  # one flag per parameter, in this order
        self.params: list[Tensor] = []
        bank_order = sorted(opt.matrix_banks, key=lambda b: b.plan.dtype != torch.float32)
        self.banks = bank_order
        self.mat_flag: list[int] = []  # per bank matrix (inbox order): its parameter's flag
        self.members: list[tuple[Tensor, int, int, int, int]] = []  # (param, flag, matrix offset, count, stride)
        off = 0
        self._bank_off: dict[str, int] = {}
        for b in bank_order:
            self._bank_off[b.label] = off
            stride = b.plan.rows * b.plan.cols
            self.mat_flag += [0] * b.plan.n_pad  # padding matrices never have a gradient
            for name, p, first, count in b.plan.members:
                f = len(self.names)
                self.names.append(name)
                self.params.append(p)
                self.members.append((p, f, off + first, count, stride))
                self.mat_flag[off + first:off + first + count] = [f] * count
            off += b.plan.n_pad
        self.n_mat = off
        adam = sorted(opt.adam_params, key=lambda np_: np_[1].dtype != torch.float32)
        self.adam = adam
        self.adam_flag = []
        for name, p in adam:
            self.adam_flag.append(len(self.names))
            self.names.append(name)
            self.params.append(p)
        self.n_adam = len(adam)
        n_flags = len(self.names)
        # ---- device buffers
        i32, i64, f64 = (dict(dtype=d, device=dev) for d in (torch.int32, torch.int64, torch.float64))
        self.flags = torch.zeros(n_flags, **i32)
        self.status = torch.zeros(COUNTERS + n_flags + self.n_mat, **i32)
        self.counters = self.status[:COUNTERS]
        self.last_bad = self.status[COUNTERS:COUNTERS + n_flags]
        trips = self.status[COUNTERS + n_flags:]
        self.bank_active = torch.zeros(self.n_mat, **i32)
        self.adam_steps = torch.tensor([float(inner.param_states[n]["step"]) for n, _ in adam], **f64)
        for j, (n, _) in enumerate(adam):  # the state's step count is the device's, a 0-D view
            inner.param_states[n]["step"] = self.adam_steps[j]
        n_addr = self.n_mat + self.n_adam
        self._hyper_bytes = 8 * len(HYPER)
        nbytes = self._hyper_bytes + 8 * n_addr + 4 * n_addr
        self.inbox = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        self.hyper = self.inbox[:self._hyper_bytes].view(torch.float64)
        self.addr = self.inbox[self._hyper_bytes:self._hyper_bytes + 8 * n_addr].view(torch.int64)
        self.has = self.inbox[self._hyper_bytes + 8 * n_addr:].view(torch.int32)
        self._inbox_np = np.zeros(nbytes, dtype=np.uint8)
        self._hyper_np = self._inbox_np[:self._hyper_bytes].view(np.float64)
        self._addr_np = self._inbox_np[self._hyper_bytes:self._hyper_bytes + 8 * n_addr].view(np.int64)
        self._has_np = self._inbox_np[self._hyper_bytes + 8 * n_addr:].view(np.int32)
        pin = self.cuda
        self._slots = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(INBOX_SLOTS if pin else 1)]
        self._slot_np = [s.numpy() for s in self._slots]
        self._slot_events = [None] * len(self._slots)
        self._next_slot = 0
        self._sent: np.ndarray | None = None  # the inbox's bytes as last sent to the device
        # ---- the banks read their masks, addresses and guard counters from these buffers
        for b in bank_order:
            bank = inner.banks[b.label]
            o, n = self._bank_off[b.label], b.plan.n_pad
            bank.active = self.bank_active[o:o + n]
            trips[o:o + n].copy_(bank.guard_trips)
            bank.guard_trips = trips[o:o + n]
            if grad_read == "in_place":
                bank.grad_ptrs = self.addr[o:o + n]
                bank.grad_dtype = b.plan.dtype
        # ---- constants of the scalars
        cfgs = inner.param_cfgs
        lr_coef, wd_coef = [], []
        for b in bank_order:
            cfg = cfgs[b.label]
            lr_coef += [cfg.lr_mul * m for m in cfg.per_matrix_lr_mul]  # the host's (lr_mul * m) * lr
            wd_coef.append(cfg.wd_mul)
        self.lr_coef = torch.tensor(lr_coef, **f64)
        self.wd_coef = torch.tensor(wd_coef, **f64)
        #: an inactive Adam row (anvil_fast.kernels.adam.adam_row(active=False)): eps 1 keeps masked lanes finite
        self.inactive_row = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], **f64)
        #: each parameter's first entry of ``has`` (its has-gradient flag)
        self.param_first = torch.tensor([moff for _, _, moff, _, _ in self.members] +
                                        [self.n_mat + j for j in range(self.n_adam)], **i64)
        self.adam_lr_mul = torch.tensor([cfgs[n].lr_mul for n, _ in adam], **f64)
        self.adam_wd_mul = torch.tensor([cfgs[n].wd_mul for n, _ in adam], **f64)
        self.record = None if record is None else torch.tensor(np.asarray(record, dtype=np.float32), device=dev)
        self.gather = self._gather_index()
        # ---- the check and Adam launch tables
        self._build_reads(opt)
        # ---- lanes
        self.lanes = make_lanes([inner.banks[b.label] for b in bank_order],
                                [bank_work((b.plan.n_pad, b.plan.rows, b.plan.cols)) for b in bank_order], lanes, dev)
        # ---- graphs and host state
        self.use_graphs = bool(cuda_graphs) and self.cuda
        self.warmup, self.max_graphs = max(1, int(warmup)), int(max_graphs)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.replays = self.captures = 0
        # where the driver locks a mapping, the status copy is the graph's last node; else it is launched
        # after each replay into torch's pinned memory
        self._device_index = (dev.index if dev.index is not None else torch.cuda.current_device()) if pin else None
        locked = host_status_buffer(self.status.numel(), self._device_index) if pin else None
        self._status_in_graph = locked is not None
        if locked is not None:
            self._status_host, self._status_keeper = locked
        else:
            self._status_host = torch.zeros(self.status.shape, dtype=torch.int32, pin_memory=pin)
        self._status_event = torch.cuda.Event() if pin else None
        self._event_stream: tuple | None = None  # (current stream's id triple, its Stream object)
        self._status_np = self.status.numpy() if not pin else None  # a view: the CPU's status is the host's
        self._status_host_np = self._status_host.numpy()
        self._status_pending = False
        self._key: tuple | None = None  # the gradient state the inbox holds
        self._hyper_key: tuple | None = None
        self.attempted = 0  #: steps launched (taken + skipped, some maybe not yet reported)
        self._remember(np.zeros(self.status.shape, dtype=np.int64))

    # ------------------------------------------------------------------ construction helpers
    def _gather_index(self) -> Tensor:
        """For each position of the staging buffer, where its value is in :func:`derive_scalars`'
        concatenation [bank fields (4 per bank), eff_lr (one per matrix), Adam rows (8 each), 0]."""
        staging = self.inner.staging
        n_bank = len(self.banks)
        zero = 4 * n_bank + self.n_mat + 8 * self.n_adam
        idx = np.full(staging.numel, zero, dtype=np.int64)
        order = {l: i for i, l in enumerate(self.inner.bank_labels)}
        off = 0
        for k, b in enumerate(self.banks):
            i = order[b.label]
            fo, lo = staging.field_offsets[i], staging.lr_offsets[i]
            for f in range(len(BANK_FIELDS)):
                idx[fo + f * ALIGN] = 4 * k + f
            n = b.plan.n_pad
            idx[lo:lo + n] = 4 * n_bank + off + np.arange(n)
            off += n
        base = staging.adam_offset
        for j, (name, _) in enumerate(self.adam):
            row = self.inner.adam_row[name]
            idx[base + row * len(ADAM_COLUMNS):base + (row + 1) * len(ADAM_COLUMNS)] = \
                4 * n_bank + self.n_mat + 8 * j + np.arange(len(ADAM_COLUMNS))
        return torch.tensor(idx, dtype=torch.int64, device=self.device)

    def _build_reads(self, opt) -> None:
        inner, dev = self.inner, self.device
        self.addr_checks: list[tuple[AddressCheck, slice]] = []
        self.adam_groups: list[tuple[Tensor, Tensor, Tensor, slice, bool]] = []
        self.buffer_check = None
        if self.grad_read == "in_place":
            # banks: one check group per gradient dtype (fp32 gradients checked as the bf16 they travel in)
            start = 0
            for dtype in (torch.float32, torch.bfloat16):
                mats = [b for b in self.banks if b.plan.dtype == dtype]
                n = sum(b.plan.n_pad for b in mats)
                if n:
                    numels = [b.plan.rows * b.plan.cols for b in mats for _ in range(b.plan.n_pad)]
                    chk = AddressCheck(numels, self.mat_flag[start:start + n], dev, dtype=dtype, cast_bf16=True)
                    self.addr_checks.append((chk, slice(start, start + n)))
                start += n
            start = 0
            for dtype in dict.fromkeys(p.dtype for _, p in self.adam):
                group = [(j, n, p) for j, (n, p) in enumerate(self.adam) if p.dtype == dtype]
                j0 = group[0][0]
                sl = slice(self.n_mat + j0, self.n_mat + j0 + len(group))
                chk = AddressCheck([p.numel() for _, _, p in group], [self.adam_flag[j] for j, _, _ in group], dev,
                                   dtype=dtype, cast_bf16=False)
                self.addr_checks.append((chk, sl))
                if dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"{group[0][1]}: the in-place gradient read supports float32 and bfloat16 "
                                     f"Adam parameters, got {dtype}")
                st = inner.param_states
                addresses = torch.tensor([[p.data_ptr(), st[n]["exp_avg"].data_ptr(), st[n]["exp_avg_sq"].data_ptr()]
                                          for _, n, p in group], dtype=torch.int64, device=dev)
                blocks, meta = adam_block_table([p.numel() for _, _, p in group],
                                                [inner.adam_row[n] for _, n, _ in group], dev)
                self.adam_groups.append((blocks, addresses, meta, sl, dtype == torch.bfloat16))
                for _, n, p in group:
                    if not (p.is_contiguous() and st[n]["exp_avg"].is_contiguous()):
                        raise ValueError(f"{n}: the in-place gradient read needs contiguous parameters and moments")
        elif self.grad_read == "transient":
            # id of a bank's AnvilBank -> ([chunk, rows, cols], [(member's index in self.params, first, count)])
            self.assembly = {}
            k = 0
            for b in self.banks:
                members = []
                for _, _, first, count in b.plan.members:
                    members.append((k, first, count))
                    k += 1
                self.assembly[id(inner.banks[b.label])] = ((b.plan.n_pad, b.plan.rows, b.plan.cols), members)
            #: per parameter: whether its check rounds the norm to bf16 (a bank member's gradient
            #: travels in bf16, so one past bf16's range is infinite there)
            self.check_bf16 = [True] * len(self.members) + [False] * self.n_adam
            self._grads: list[Tensor | None] = []
        else:
            bufs = inner.grad_buffers()
            slots = {id(p): dst for _, p, dst, *_ in opt.grad_slots()}
            self.buffer_check = BufferCheck([slots[id(p)] for p in self.params], dev)
            self.grad_bufs = bufs

    # ------------------------------------------------------------------ the host part
    def collect(self, *, refill: bool = False) -> bool:
        """Fill the inbox's gradient part (``refill``: its gradient state too, as when the addresses
        change); returns False when no parameter has a gradient."""
        if refill:
            self._key = None
        grads = [p.grad for p in self.params]
        if self.grad_read == "in_place":
            try:  # read every step: map over the C method, the generator's per-item frame only where one is None
                key = tuple(map(Tensor.data_ptr, grads))
            except TypeError:
                key = tuple(0 if g is None else g.data_ptr() for g in grads)
        else:
            key = tuple(g is not None for g in grads)
        if key != self._key:
            self._validate(grads)
            self._fill_gradient_state(grads)
            self._key = key
        if not any(key):
            return False
        if self.grad_read == "buffers":
            self._copy_into_buffers(grads)
        elif self.grad_read == "transient":
            self._grads = grads
        return True

    def _validate(self, grads: Sequence[Tensor | None]) -> None:
        for name, p, g in zip(self.names, self.params, grads):
            if g is None:
                continue
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(f"{name}: gradient {g.dtype} {tuple(g.shape)} on {g.device} does not match "
                                 f"the parameter's {p.dtype} {tuple(p.shape)} on {p.device}; nothing was updated")
            if g.is_sparse:
                raise ValueError(f"{name}: sparse gradients are not supported; nothing was updated")
            if self.grad_read == "in_place" and not g.is_contiguous():
                raise ValueError(f"{name}: the step reads gradients in place and needs them contiguous (got strides "
                                 f"{g.stride()}); nothing was updated")

    def _fill_gradient_state(self, grads: Sequence[Tensor | None]) -> None:
        addr, has = self._addr_np, self._has_np
        addr[:] = 0
        has[:] = 0
        for (p, f, moff, count, stride), g in zip(self.members, grads):
            if g is None:
                continue
            has[moff:moff + count] = 1
            if self.grad_read == "in_place":
                addr[moff:moff + count] = g.data_ptr() + stride * g.element_size() * np.arange(count, dtype=np.int64)
        for j, g in enumerate(grads[len(self.members):]):
            if g is not None:
                has[self.n_mat + j] = 1
                if self.grad_read == "in_place":
                    addr[self.n_mat + j] = g.data_ptr()

    def _copy_into_buffers(self, grads: Sequence[Tensor | None]) -> None:
        pairs: dict[tuple, tuple[list, list]] = {}
        for dst, g in zip(self.buffer_check.grads, grads):
            if g is None:
                continue
            d, s = pairs.setdefault((dst.dtype, g.dtype), ([], []))
            d.append(dst)
            s.append(g)
        for d, s in pairs.values():
            torch._foreach_copy_(d, s)

    def load_hyper(self) -> None:
        """The inbox's hyper-parameters (:data:`HYPER`) from the values the inner optimizer holds
        (:meth:`~anvil_fast.optim.optimizer.AnvilAndAdam.hyperparameters`), for the following steps."""
        values = self.inner.hyperparameters()
        self._hyper_np[:] = values

    def upload(self) -> None:
        """The inbox to the device: through the next pinned slot, asynchronously; nothing when the
        device's inbox already holds these bytes (it is written here only, so the bytes last sent are
        what it holds): with unchanged hyper-parameters and gradient addresses a step issues no copy."""
        if self._sent is not None and self._inbox_np.data == self._sent.data:
            return
        k = self._next_slot
        self._next_slot = (k + 1) % len(self._slots)
        ev = self._slot_events[k]
        if ev is not None:
            ev.synchronize()  # the copy that last read this pinned slot is done (4 steps ago)
        self._slot_np[k][:] = self._inbox_np
        self.inbox.copy_(self._slots[k], non_blocking=self.cuda)
        if self.cuda:
            if ev is None:
                ev = self._slot_events[k] = torch.cuda.Event()
            ev.record()
        if self._sent is None:
            self._sent = self._inbox_np.copy()
        else:
            self._sent[:] = self._inbox_np

    # ------------------------------------------------------------------ the device part
    def check(self) -> None:
        """Step 1: one flag per parameter whose gradient holds a NaN or an infinity."""
        self.flags.zero_()
        if self.grad_read == "in_place":
            for chk, sl in self.addr_checks:
                check_addresses(chk, self.addr[sl], self.flags)
        elif self.grad_read == "transient":
            self._check_transient()
        else:
            check_buffers(self.buffer_check, self.flags, mask=self.has.index_select(0, self.param_first))

    def _check_transient(self) -> None:
        # The buffer check's verdict without the buffers: the infinity norm of each .grad where it
        # is, a bank member's rounded to bf16 as its cast would round it (rounding is monotone, so
        # bf16(max |g|) is infinite exactly when some bf16(g) is); NaN propagates through the norm.
        ids = [i for i, g in enumerate(self._grads) if g is not None]
        if not ids:
            return
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in ids:
            by_dtype.setdefault(self._grads[i].dtype, []).append(i)
        order, norms = [], []
        for group in by_dtype.values():
            order += group
            norms += [n.to(torch.bfloat16).float() if self.check_bf16[i] else n.float()
                      for i, n in zip(group, torch._foreach_norm([self._grads[i] for i in group], float("inf")))]
        bad = torch.stack(norms).isfinite().logical_not_().to(torch.int32)
        self.flags.index_copy_(0, torch.tensor(order, dtype=torch.int64, device=self.device), bad)

    def _bank_grad(self, bank) -> Tensor:
        """The bank's bf16 gradient for this update alone (``transient``): each member's ``.grad``
        cast into its matrices, zeros where a member has none and in the padding (those matrices
        are inactive, so their values are never used)."""
        shape, members = self.assembly[id(bank)]
        buf = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        for k, first, count in members:
            g = self._grads[k]
            if g is not None:
                buf[first:first + count].view(g.shape).copy_(g)
        return buf

    def update_banks(self, *, on_lanes: bool = True, then=None) -> None:
        """Step 3: every bank, each lane's on its side stream (``on_lanes=False``: all on the current
        stream, in lane order); ``then`` runs on the main stream before it waits for the lanes."""
        update = self.inner.bank_update
        if self.grad_read == "transient":
            inner_update = update

            def update(bank):
                bank.grad = self._bank_grad(bank)
                try:
                    inner_update(bank)
                finally:
                    bank.grad = None  # freed here: the next bank's gradient reuses the memory

        run_on_lanes(self.lanes, update, self.device, on_lanes=on_lanes, then=then)

    def device_part(self) -> None:
        inner = self.inner
        self.check()
        _scalars_fn(self.cuda)(self.hyper, self.has, self.flags, self.counters, self.last_bad, self.adam_steps,
                               inner.rail_step, self.bank_active, inner.staging.buffer, self.lr_coef, self.wd_coef,
                               self.adam_lr_mul, self.adam_wd_mul, self.inactive_row, self.gather, self.record,
                               len(self.banks), self.n_mat, self.lean)
        self.update_banks(then=self.update_adam)  # Adam on the main stream while the lanes run
        if self._status_in_graph:
            self._status_host.copy_(self.status, non_blocking=True)

    def update_adam(self) -> None:
        inner = self.inner
        table = inner.adam_table
        if self.grad_read == "in_place":
            for blocks, addresses, meta, sl, bf16 in self.adam_groups:
                adam_table_(blocks, addresses, self.addr[sl], meta, table, bf16=bf16)
            return
        if self.grad_read == "transient":
            grads = self._grads[len(self.members):]
            for (name, _), g in zip(self.adam, grads):
                if g is not None:  # without a gradient the row is inactive: nothing would change
                    inner.adam_update(name, g.contiguous())  # a strided .grad: a copy for this update alone
            return
        bufs = self.grad_bufs
        for name, _ in self.adam:
            if inner.param_cfgs[name].comms != "replicated":
                inner.adam_update(name, bufs[name])
        if inner.replicated is not None:
            inner.replicated.launch_reduce(set(inner.replicated_labels), bufs)
            inner.replicated.update(table)

    def mutated(self) -> dict[str, Tensor]:
        from .graphs import step_tensors

        out = dict(step_tensors(self.inner))
        out.update(status=self.status, adam_steps=self.adam_steps, bank_active=self.bank_active,
                   staging=self.inner.staging.buffer, flags=self.flags)
        return out

    def _graph_key(self) -> tuple:
        return tuple(b.beta2 for b in self.inner.banks.values())

    def _capture(self, key) -> torch.cuda.CUDAGraph:
        saved = {k: t.clone() for k, t in self.mutated().items()}
        try:
            # thread_local: see anvil_fast.optim.graphs
            graph = capture(self.device_part, warmup=self.warmup, pool=self.pool, capture_error_mode="thread_local",
                            device=self.device, precompile=True)
        finally:
            for k, t in self.mutated().items():
                if k in saved:
                    t.copy_(saved[k])
            del saved
        self.graphs[key] = graph
        self.captures += 1
        return graph

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """One step (the host part, then the device part as one replay where captured). Returns
        False when no parameter had a gradient (nothing launched, nothing counted)."""
        if not self.collect():
            return False
        self.upload()
        if self.use_graphs:
            key = self._graph_key()
            graph = self.graphs.get(key)
            if graph is None and len(self.graphs) < self.max_graphs:
                graph = self._capture(key)
            if graph is not None:
                graph.replay()
                self.replays += 1
            else:
                self.device_part()
        else:
            self.device_part()
        if self.grad_read == "transient":
            self._grads = []  # the step holds no gradient past itself (zero_grad(set_to_none=True) frees them)
        self.attempted += 1
        if self.cuda:
            if not self._status_in_graph:
                # outside the graph: a copy into the host allocator's memory would record its event
                # inside the capture; this is one more launch, never a wait
                self._status_host.copy_(self.status, non_blocking=True)
            self._status_event.record(self._current_stream())
            self._status_pending = True
        return True

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream, as a Stream object made once per stream (``Event.record()`` without
        one builds a new one on every call: host time on every step)."""
        ident = torch._C._cuda_getCurrentStream(self._device_index)
        if self._event_stream is None or self._event_stream[0] != ident:
            self._event_stream = (ident, torch.cuda.current_stream(self._device_index))
        return self._event_stream[1]

    # ------------------------------------------------------------------ the status
    def read_status(self, wait: bool) -> np.ndarray | None:
        """The status buffer once the last step's part of it is on the host (``wait``: block for
        it; else None while the device is still busy)."""
        if not self.cuda:
            return self._status_np.astype(np.int64)
        if self._status_pending:
            if not wait and not self._status_event.query():
                return None
            self._status_event.synchronize()
            self._status_pending = False
        return self._status_host_np.astype(np.int64)

    def news(self, wait: bool = False):
        """What happened since the last call: (newly skipped steps, names of the last skipped
        step's non-finite gradients, {bank label: newly refused matrix updates}); None when the
        status is not available yet without waiting."""
        st = self.read_status(wait)
        if st is None:
            return None
        # the common case, read every step: only the taken count moved (nothing skipped or refused);
        # one bytes comparison where the general path below costs the host a dozen NumPy calls
        if st[1:].tobytes() == self._seen_tail:
            self.seen[0] = st[0]
            return 0, [], {}
        skipped = int(st[1] - self.seen[1])
        names = []
        if skipped:
            bad = st[COUNTERS:COUNTERS + len(self.names)]
            names = [n for n, b in zip(self.names, bad) if b]
        trips = st[COUNTERS + len(self.names):] - self.seen[COUNTERS + len(self.names):]
        refused = {}
        for b in self.banks:
            o = self._bank_off[b.label]
            k = int(trips[o:o + b.plan.n_pad].sum())
            if k:
                refused[b.label] = k
        self._remember(st.copy())
        return skipped, names, refused

    def _remember(self, st: np.ndarray) -> None:
        """``st`` is the status as last reported (``seen``; its part after the taken count kept as
        bytes for :meth:`news`' comparison)."""
        self.seen = st
        self._seen_tail = st[1:].tobytes()

    def counts(self) -> tuple[int, int]:
        """(taken, skipped) steps, waiting for the device."""
        st = self.read_status(wait=True)
        return int(st[0]), int(st[1])

    def set_counts(self, taken: int, skipped: int) -> None:
        """Restore the counters (a loaded checkpoint) and forget what was reported."""
        self.counters.copy_(torch.tensor([taken, skipped], dtype=torch.int32))
        st = self.read_status(wait=True)
        st[:COUNTERS] = (taken, skipped)
        self._remember(st.copy())
        # every restored step counts as launched and reported, so the host's count of taken steps
        # (the record rails it writes into param_groups) starts from the restored one
        self.attempted = taken + skipped


__all__ = ["DeviceStep", "derive_scalars", "GRAD_READS", "HYPER", "NonFiniteUpdateWarning", "NonFiniteUpdateError"]
