"""One ANVIL bank's update on the fast path: :class:`AnvilBank` and :func:`anvil_bank_update`
(seed: ``AnvilBank`` and ``anvil_bank_update``).

An :class:`AnvilBank` holds every tensor the update reads or writes. Each is allocated once and only
ever written in place, and every per-step hyper-parameter is a device tensor (0-D for momentum,
eff_wd, fast_beta, fast_weight; ``[chunk, 1, 1]`` for eff_lr), so

* changing lr, momentum, weight decay or the rails never recompiles anything, and
* ``anvil_bank_update(bank)`` can be captured in a CUDA graph once and replayed every step (the
  graph bakes the addresses; refresh the scalars in place with :meth:`AnvilBank.set_scalars`
  or your own copy into them, outside the graph).

The update, in the seed's order::

    twin_rail         twin rails + Nesterov lookahead -> bf16 X         (SAFE: Triton; FAITHFUL: compiled)
    cascade           normalization + Gram kernels + maps on the workspace (Triton; FAITHFUL: compiled normalize)
    equalize          lane-energy equalizer (+ guard in SAFE)            (SAFE: Triton, its gains applied by
                                                                        the update; FAITHFUL: compiled)
    decay + update    sign-aligned decay on the fp32 master             (SAFE: Triton; FAITHFUL: compiled;
                                                                        in place: the float32 parameter,
                                                                        or bf16 p + mantissa)

On a machine without CUDA or Triton the same code runs with plain-torch kernels, eagerly (see
:mod:`anvil_fast.kernels.gram` and :mod:`anvil_fast.kernels.compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from anvil_ref.constants import ANVIL_MAPS, SPLIT_BADDBMM_MIN_ROWS
from anvil_ref.equalizer import lane_energy_shape, reduction_axis
from anvil_ref.maps import load_maps

from .cascade import DEFAULT_CONFIG, CascadeConfig, CascadeWorkspace, cascade_workspace, get_config
from anvil_fast.kernels.equalizer import defers_application, equalize
from anvil_fast.kernels.rails import twin_rail
from anvil_fast.kernels.update import sign_aligned_update


@dataclass(eq=False)
class AnvilBank:
    """One ANVIL bank's update on this rank: every tensor :func:`anvil_bank_update` reads or writes.

    Build one with :meth:`AnvilBank.create`. Field by field (``chunk`` matrices of ``rows x cols``):
    """

    label: str
    grad: Tensor | None  #: [chunk, rows, cols] bf16: this rank's (reduce-scattered) gradient; never written
    velocity: Tensor  #: [2, chunk, rows, cols] fp32 (bf16: the lean state): fast (0) and slow (1) rail
    lane_energy: Tensor  #: fp32 [chunk, rows, 1] if rows >= cols else [chunk, 1, cols]
    mantissa: Tensor | None  #: [chunk, rows, cols] uint16: low halves of the fp32 masters (None: p_slice is fp32)
    p_slice: Tensor  #: [chunk, rows, cols] bf16 view of the parameter (high halves), or the fp32 parameter itself
    momentum: Tensor  #: 0-D fp32: Nesterov lookahead (the scheduled rail beta)
    eff_wd: Tensor  #: 0-D fp32: wd_mul * weight_decay * lr
    fast_beta: Tensor  #: 0-D fp32: the fast rail's beta
    fast_weight: Tensor  #: 0-D fp32: the fast rail's weight in the blend
    eff_lr: Tensor  #: [chunk, 1, 1] fp32: lr_mul * per-matrix multiplier * lr
    beta2: float  #: the equalizer's EMA decay (a Python float, as in the seed: changing it recompiles)
    split_baddbmm: bool  #: the seed's two-kernel a*X + X@B (rows > SPLIT_BADDBMM_MIN_ROWS)
    red_dim: int  #: -1 if rows >= cols else -2
    config: CascadeConfig = DEFAULT_CONFIG
    maps: tuple = ANVIL_MAPS
    guard_trips: Tensor | None = None  #: [chunk] int32: how often the guard refused each matrix's update
    #: the cascade's buffers; None with ``persistent_workspace=False``: taken from the caching allocator
    #: (or a CUDA graph's pool) for the update and returned after it
    workspace: CascadeWorkspace | None = field(default=None, repr=False)
    persistent_workspace: bool = True
    #: int64 [chunk] device table of each matrix's gradient address (read in place by the rails
    #: kernel instead of ``grad``); dtype of those gradients
    grad_ptrs: Tensor | None = None
    grad_dtype: torch.dtype | None = None
    active: Tensor | None = None  #: int32 [chunk] device mask: 0 leaves a matrix and all its state as it is
    rail_step: Tensor | None = None  #: 0-D int device step whose bits seed the lean rails' stochastic rounding
    first: int = 0  #: this chunk's first matrix in its bank (the lean rails' element index)

    def mutated(self) -> dict[str, Tensor]:
        """What the update writes (besides its workspace)."""
        out = {"velocity": self.velocity, "lane_energy": self.lane_energy, "p_slice": self.p_slice}
        if self.mantissa is not None:
            out["mantissa"] = self.mantissa
        if self.guard_trips is not None:
            out["guard_trips"] = self.guard_trips
        return out

    @property
    def chunk_shape(self) -> tuple[int, int, int]:
        return tuple(self.p_slice.shape)  # type: ignore[return-value]

    def set_scalars(self, *, momentum: float | None = None, eff_wd: float | None = None,
                    fast_beta: float | None = None, fast_weight: float | None = None, eff_lr=None) -> None:
        """Write new per-step values into the device scalars in place (addresses unchanged). For a
        CUDA-graph replay do this outside the graph; the optimizer may instead stage all banks'
        scalars in one host-to-device copy into views of one buffer."""
        for name, val in (("momentum", momentum), ("eff_wd", eff_wd), ("fast_beta", fast_beta),
                          ("fast_weight", fast_weight)):
            if val is not None:
                getattr(self, name).fill_(float(val))
        if eff_lr is not None:
            lr = torch.as_tensor(eff_lr, dtype=torch.float32).reshape(-1)
            if lr.numel() not in (1, self.eff_lr.shape[0]):
                raise ValueError(f"{self.label}: eff_lr needs 1 or {self.eff_lr.shape[0]} values (one per matrix), "
                                 f"got {lr.numel()}")
            self.eff_lr.copy_(lr.reshape(-1, 1, 1).expand_as(self.eff_lr))

    @classmethod
    def create(cls, label: str, p_slice: Tensor, *, beta2: float, config: CascadeConfig | str = DEFAULT_CONFIG,
               maps=ANVIL_MAPS, velocity: Tensor | None = None, lane_energy: Tensor | None = None,
               mantissa: Tensor | None = None, grad: Tensor | None = None, scalars: dict[str, Tensor] | None = None,
               eff_lr: Tensor | None = None, rails_dtype: torch.dtype = torch.float32,
               persistent_workspace: bool = True, grad_buffer: bool = True, transposed: bool = False) -> "AnvilBank":
        """A bank over ``p_slice`` ([chunk, rows, cols], updated in place): bf16 (the seed's storage,
        with a uint16 ``mantissa`` holding the fp32 masters' low halves) or float32 (the parameter is
        its own master; no mantissa). State tensors and scalars not given are allocated (zeros;
        scalars momentum/eff_wd/fast_beta 0, fast_weight 1, eff_lr 0 -- set them with
        :meth:`set_scalars`). Given ones are checked and used as they are (the optimizer passes views
        of its own state and of its one scalar staging buffer). ``rails_dtype`` bf16: the lean state
        (rails rounded stochastically). ``grad_buffer=False``: no bf16 gradient buffer (the caller
        sets ``grad_ptrs`` so the rails read gradients in place). ``transposed``: the bank stores each
        matrix as the transpose of the one it acts as (an ``[in, out]`` weight), so the equalizer's lanes
        are those of the stored transposes (:func:`anvil_ref.equalizer.reduction_axis`)."""
        if not isinstance(p_slice, torch.Tensor) or p_slice.dtype not in (torch.bfloat16, torch.float32) \
                or p_slice.ndim != 3:
            raise ValueError(f"{label}: p_slice must be a [chunk, rows, cols] bf16 or float32 tensor, got "
                             f"{getattr(p_slice, 'dtype', type(p_slice))} {tuple(getattr(p_slice, 'shape', ()))}")
        if not p_slice.is_contiguous():
            raise ValueError(f"{label}: p_slice must be contiguous (it is updated in place)")
        if not 0.0 <= float(beta2) <= 1.0:
            raise ValueError(f"{label}: beta2 must lie in [0, 1], got {beta2}")
        if rails_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{label}: rails_dtype must be torch.float32 or torch.bfloat16, got {rails_dtype}")
        shape, dev = tuple(p_slice.shape), p_slice.device
        chunk, rows, cols = shape
        red = reduction_axis(shape, transposed=transposed)
        lane_shape = lane_energy_shape(shape, transposed=transposed)
        f32 = dict(dtype=torch.float32, device=dev)

        def given(name, t, want_shape, want_dtype):
            if t is None:
                return None
            if tuple(t.shape) != tuple(want_shape) or t.dtype != want_dtype or t.device != dev:
                raise ValueError(f"{label}: {name} must be {want_dtype} {tuple(want_shape)} on {dev}, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
            return t

        velocity = given("velocity", velocity, (2, *shape), rails_dtype)
        lane_energy = given("lane_energy", lane_energy, lane_shape, torch.float32)
        if p_slice.dtype == torch.float32:
            if mantissa is not None:
                raise ValueError(f"{label}: a float32 p_slice is its own master; pass no mantissa")
        else:
            mantissa = given("mantissa", mantissa, shape, torch.uint16)
            if mantissa is None:
                mantissa = torch.zeros(shape, dtype=torch.uint16, device=dev)
        grad = given("grad", grad, shape, torch.bfloat16)
        sc = dict(scalars or {})
        for k in sc:
            if k not in ("momentum", "eff_wd", "fast_beta", "fast_weight"):
                raise ValueError(f"{label}: unknown scalar {k!r}")
            given(k, sc[k], (), torch.float32)
        cfg = get_config(config)
        if grad is None and grad_buffer:
            grad = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        return cls(
            label=label,
            grad=grad,
            velocity=velocity if velocity is not None else torch.zeros((2, *shape), dtype=rails_dtype, device=dev),
            lane_energy=lane_energy if lane_energy is not None else torch.zeros(lane_shape, **f32),
            mantissa=mantissa,
            p_slice=p_slice,
            momentum=sc.get("momentum", torch.zeros((), **f32)),
            eff_wd=sc.get("eff_wd", torch.zeros((), **f32)),
            fast_beta=sc.get("fast_beta", torch.zeros((), **f32)),
            fast_weight=sc.get("fast_weight", torch.ones((), **f32)),
            eff_lr=given("eff_lr", eff_lr, (chunk, 1, 1), torch.float32) if eff_lr is not None
            else torch.zeros((chunk, 1, 1), **f32),
            beta2=float(beta2),
            split_baddbmm=rows > SPLIT_BADDBMM_MIN_ROWS,
            red_dim=red,
            config=cfg,
            maps=load_maps(maps),
            guard_trips=torch.zeros((chunk,), dtype=torch.int32, device=dev),
            workspace=CascadeWorkspace.for_shape(shape, dev) if persistent_workspace else None,
            persistent_workspace=bool(persistent_workspace),
        )


def anvil_bank_update(bank: AnvilBank, *, backend: str = "auto", compile: bool | None = None) -> None:
    """One bank's ANVIL update, from ``bank.grad`` (or the gradients ``bank.grad_ptrs`` points at;
    the body a CUDA graph captures). Writes ``bank.mutated()`` and the workspace, nothing else.
    With ``bank.active`` set, a matrix whose entry is 0 is left as it is, state included."""
    ws = bank.workspace
    if ws is None:
        # Taken for this update only: banks updated one after another on a stream reuse the same
        # blocks, so the cascade's memory is the largest bank's, not the sum (inside a CUDA graph,
        # from the graph's pool).
        ws = CascadeWorkspace.for_shape(tuple(bank.p_slice.shape), bank.p_slice.device)
        if bank.persistent_workspace:
            bank.workspace = ws
    cfg = bank.config
    active = bank.active
    # 1. Twin-rail Nesterov momentum -> the cascade's bf16 input (clamped to bf16's range in SAFE)
    #    (SAFE on CUDA: one Triton kernel that also leaves the normalization's block partials)
    ready = twin_rail(bank.grad, bank.velocity, momentum=bank.momentum, fast_beta=bank.fast_beta,
                      fast_weight=bank.fast_weight, x_out=ws.X, prescale=cfg.prescale, fused=cfg.triton_elementwise,
                      partials=ws.partials if cfg.triton_elementwise else None, grad_ptrs=bank.grad_ptrs,
                      grad_dtype=bank.grad_dtype, active=active, sr_step=bank.rail_step, first=bank.first,
                      backend=backend, compile=compile)
    # 2. The cascade
    v = cascade_workspace(ws, maps=bank.maps, config=cfg, split=bank.split_baddbmm, backend=backend, compile=compile,
                          partials_ready=ready)
    # 3 and 4
    equalize_and_update(bank, v, ws, backend=backend, compile=compile)


def equalize_and_update(bank: AnvilBank, v: Tensor, ws: CascadeWorkspace, *, backend: str = "auto",
                        compile: bool | None = None) -> None:
    """The bank update's last two steps on the cascade output ``v`` (held in ``ws``)."""
    cfg, active = bank.config, bank.active
    # 3. Equalize per-lane update energy (guarded in SAFE; in FAITHFUL only non-finite updates are
    #    refused, so no NaN or inf reaches the weights or the lane energy)
    #    (with the Triton kernels and the guard, the gains are applied by step 4 as it reads v)
    defer = defers_application(v, fused=cfg.triton_elementwise, guard=cfg.guard, backend=backend)
    v = equalize(v, bank.lane_energy, beta2=bank.beta2, red_dim=bank.red_dim, guard_trips=bank.guard_trips,
                 compile=compile, fused=cfg.triton_elementwise, work=ws.equalizer, active=active,
                 finite_only=not cfg.guard, backend=backend, apply=not defer)
    # 4. Sign-aligned decay + update on the fp32 master, gated on the slow rail after this step
    sign_aligned_update(bank.p_slice, bank.mantissa, v, gate=bank.velocity[1], eff_lr=bank.eff_lr,
                        eff_wd=bank.eff_wd, active=None if active is None else active.reshape(-1, 1, 1),
                        equalizer=ws.equalizer if defer else None, red_dim=bank.red_dim, compile=compile,
                        fused=cfg.triton_elementwise, backend=backend)
