"""Symmetric Gram kernels of the cascade: ``XXT``, ``XTX``, ``ba_plus_cAA``, and the fused ``aX_plus_mm``
and ``sym_aX_plus_mm``.

All take bf16 tensors of shape ``[..., rows, cols]`` (the leading dimensions are a batch), accumulate
in fp32 and round once to bf16 into an ``out=`` buffer::

    XXT(X, out=A)                        A = X X^T                   (N = rows, K = cols)
    XTX(X, out=A)                        A = X^T X                   (N = cols, K = rows)
    ba_plus_cAA(A, alpha=c, beta=b, out=B)   B = b*A + c*(A @ A)     (A symmetric N x N)
    aX_plus_mm(X, L, R, a=a, out=C)      C = a*X + L @ R             (one rounding)
    sym_aX_plus_mm(X, L, R, a=a, out=C)  C = a*X + L @ R             (exactly symmetric result, N x N)

Why the kernels look the way they do (the kernels themselves, with the reasons for their form, are
in :mod:`anvil_fast.kernels.gram_kernels`):

* The four symmetric outputs are computed on the lower-triangular tiles only and each off-diagonal
  tile is stored twice, as itself and transposed. That skips ``(T-1)/(2T)`` of the tiles' FLOPs (5/12
  for T = 6, i.e. a 768-wide Gram with 128-tiles) and makes the output *exactly* symmetric: every
  element is written once, from one fp32 accumulator.
* Offsets are formed in int64, so a batch whose total size exceeds 2**31 elements addresses
  correctly.
* Any size works (not only multiples of the block sizes): the pointer path masks partial tiles;
  exact tilings (``EVEN``) drop the masks and may use TMA descriptors.
* ``aX_plus_mm`` exists because the obvious forms both make an extra pass over X: ``baddbmm(X, ...,
  out=C)`` first copies X into C (the seed's "defensive copy") and the seed's split path writes
  ``X @ B`` and then re-reads it for ``C += a*X``. Reading the X tile in the GEMM's epilogue costs one
  read of X and nothing else. It also rounds once (as ``baddbmm`` does) where the split path rounds
  twice.
* Which tiles, warps, pipeline depth, pointer or TMA loads, and one-tile-per-program or persistent
  grid: chosen per problem shape at the first call on a GPU by :mod:`anvil_fast.kernels.gram_tune`, which
  times a short candidate list and cross-checks each candidate against the v1 kernels (``config=``
  pins one; ``ANVIL_FAST_GRAM=v1`` restores the first kernels, ``ANVIL_FAST_TUNE=0`` skips tuning).
  Every candidate computes the same fp32 sums of the same bf16 products and rounds once.
* ``DOT_F32`` widens bf16 tiles to fp32 right before ``tl.dot`` and ``ROUND_FIX`` rounds fp32 to bf16
  on the bits; both are only on under Triton's CPU interpreter, whose bf16 dot is broken and whose
  fp32 -> bf16 cast truncates (see :mod:`anvil_fast.kernels.backend`).

Where Triton cannot run (no CUDA tensor, no Triton, or ``backend="torch"``), a plain-torch version
with the same semantics runs: fp32 products of the bf16 operands, the lower triangle mirrored, one
rounding to bf16.

Bad input raises :class:`GramInputError` (a ``ValueError``) saying what was wrong and what was
expected: non-tensors, wrong dtype, fewer than 2 dimensions, non-contiguous tensors, devices that
differ, and ``out`` buffers of the wrong shape / dtype or overlapping an input.
"""

from __future__ import annotations

import functools
import math
import os
import torch
from torch import Tensor

from .backend import dot_f32, interpreting, matrix_slices, num_sms, round_fix, triton_available, use_triton
from .gram_tune import ProblemKey, TileConfig, choose


class GramInputError(ValueError):
    """Bad input to a Gram kernel (message: what was wrong, what was expected)."""


KERNELS = ("ptr", "tma", "v1", "cublas")

# Current kernels: a 1-D grid over (matrix, tile) pairs, sliced so the index stays int32 (v1 kernels:
# a 2-D grid, the batch on axis 1, sliced by matrix_slices).
_MAX_TILES_PER_LAUNCH = 2 ** 31 - 1

if triton_available():
    import triton

    from . import gram_kernels as K


def _descriptor(t2d: Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, block)


# ------------------------------------------------------------------------------------------------
# Launch configurations

def kernel_mode() -> str:
    """``ANVIL_FAST_GRAM``: ``auto`` (default: current kernels, tuned per shape) or ``v1`` (the first
    kernels with their size heuristic; the fallback if a new kernel misbehaves on some GPU)."""
    mode = os.environ.get("ANVIL_FAST_GRAM", "auto")
    if mode not in ("auto", "v1"):
        raise ValueError(f"ANVIL_FAST_GRAM: expected 'auto' or 'v1', got {mode!r}")
    return mode


def default_config(kind: str, n: int, k: int, batch: int, *, sms: int) -> TileConfig:
    """The untuned configuration (``kind``: "gram", "ba_plus_cAA", "sym_mm_add" or "mm_add"; ``n`` the
    output's larger side, ``k`` the reduction length): v1's size heuristic from the first H200 sweep
    (NOTES.md), used where no tuning runs (CUDA-graph capture of a shape never called before,
    ``ANVIL_FAST_TUNE=0``). ``sms``: the device's SM count (:func:`anvil_fast.kernels.backend.num_sms`); a
    problem with fewer 128-tiles than two waves over them takes the small tiles. Under the
    interpreter, small current-kernel tiles keep CPU tests fast."""
    if interpreting():
        return TileConfig(32, 32, 32, 4, 1)
    tiles128 = math.ceil(n / 128)
    small = n <= 256 or batch * tiles128 * (tiles128 + 1) // 2 < 2 * sms
    if kind == "mm_add":
        cfg = TileConfig(64, 128, 64, 4, 4) if small else TileConfig(128, 256, 64, 8, 3)
    else:
        cfg = TileConfig(64, 64, 128, 4, 3) if small else TileConfig(128, 128, 64, 8, 4)
    return cfg._replace(kernel="v1")


def _grid(total: int, cfg: TileConfig, t: Tensor) -> int:
    if cfg.per_sm <= 0:
        return total
    return max(1, min(total, cfg.per_sm * num_sms(t.device.index if t.is_cuda else None)))


def _tma_views_ok(*views: Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides and an int32 row coordinate."""
    for v in views:
        if v.data_ptr() % 16 or (v.stride(0) * v.element_size()) % 16 or v.shape[0] >= 2 ** 31:
            return False
    return True


def _slices(nbatch: int, per_matrix: int):
    step = max(1, min(nbatch, _MAX_TILES_PER_LAUNCH // max(1, per_matrix)))
    for s in range(0, nbatch, step):
        yield s, min(nbatch, s + step)


def _int32_steps_ok(cfg: TileConfig, *strides: int) -> bool:
    # The pointer path advances by BLOCK_K * stride in int32 arithmetic.
    return all(cfg.BLOCK_K * s < 2 ** 31 for s in strides)


# ------------------------------------------------------------------------------------------------
# Checks

def _check_tensor(name: str, t: object, *, min_ndim: int = 2) -> Tensor:
    if not isinstance(t, torch.Tensor):
        raise GramInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise GramInputError(f"{name}: expected dtype torch.bfloat16, got {t.dtype}")
    if t.ndim < min_ndim:
        raise GramInputError(f"{name}: expected shape [..., rows, cols] (at least 2 dims), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise GramInputError(f"{name}: expected a contiguous tensor (strides {t.stride()} for shape "
                             f"{tuple(t.shape)}); call .contiguous() first")
    return t


def _overlaps(a: Tensor, b: Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
    b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _check_out(out: Tensor | None, shape: tuple[int, ...], like: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=like.device)
    _check_tensor("out", out)
    if tuple(out.shape) != tuple(shape):
        raise GramInputError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise GramInputError(f"out: expected device {like.device}, got {out.device}")
    for name, t in inputs.items():
        if _overlaps(out, t):
            raise GramInputError(f"out: must not overlap the input {name} (the kernel reads {name} while writing out)")
    return out


def _same_device(**ts: Tensor) -> None:
    devs = {n: t.device for n, t in ts.items()}
    if len(set(devs.values())) > 1:
        raise GramInputError(f"inputs on different devices: {devs}")


def _symmetrize_lower(g: Tensor) -> Tensor:
    return g.tril() + g.tril(-1).mT


# ------------------------------------------------------------------------------------------------
# Launches: run one kernel call with one configuration (the tuner calls these with each candidate)

def _launch_v1(kernel, grid0: int, tensors: tuple[Tensor, ...], args: tuple, cfg: TileConfig, **blocks) -> None:
    """A v1 kernel on the [batch, ., .] ``tensors`` (its pointer arguments, in order; ``args``: the
    rest, strides included, which a slice of the batch keeps) over the grid (grid0, matrices), the
    batch in slices that grid axis 1 can hold."""
    for s, e in matrix_slices(tensors[0].shape[0]):
        kernel[(grid0, e - s)](*(t[s:e] for t in tensors), *args, **blocks, DOT_F32=dot_f32(), ROUND_FIX=round_fix(),
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_gram(x3: Tensor, o3: Tensor, n: int, k: int, transpose: bool, cfg: TileConfig) -> None:
    rows, cols = x3.shape[1], x3.shape[2]
    sxn, sxk = (x3.stride(2), x3.stride(1)) if transpose else (x3.stride(1), x3.stride(2))
    if cfg.kernel == "v1" or not _int32_steps_ok(cfg, sxk):
        t = triton.cdiv(n, cfg.BLOCK_M)
        _launch_v1(K._gram_kernel_v1, t * (t + 1) // 2, (x3, o3), (n, k, x3.stride(0), sxn, sxk, *o3.stride()), cfg,
                   BLOCK=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K)
        return
    bl, bk = cfg.BLOCK_M, cfg.BLOCK_K
    t = triton.cdiv(n, bl)
    tt = t * (t + 1) // 2
    even = n % bl == 0 and k % bk == 0
    for s, e in _slices(x3.shape[0], tt):
        xs, os_ = x3[s:e], o3[s:e]
        total = (e - s) * tt
        xa, oa, tma = xs, os_, False
        if cfg.kernel == "tma" and even:
            xv, ov = xs.reshape(-1, cols), os_.reshape(-1, n)
            if _tma_views_ok(xv, ov):
                xa, oa, tma = _descriptor(xv, [bk, bl] if transpose else [bl, bk]), _descriptor(ov, [bl, bl]), True
        K._gram_kernel[(_grid(total, cfg, xs),)](
            xa, oa, n, k, xs.stride(0), sxn, sxk, os_.stride(0), os_.stride(1), os_.stride(2), tt, total,
            BLOCK=bl, BLOCK_K=bk, TRANS=transpose, EVEN=even, TMA=tma, DOT_F32=dot_f32(), ROUND_FIX=round_fix(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_sym_product(l3: Tensor, r3: Tensor, x3: Tensor, o3: Tensor, n: int, alpha: float, beta: float,
                        scaled: bool, cfg: TileConfig) -> None:
    """``ba_plus_cAA`` (``scaled``: ``alpha * (A @ A) + beta * A`` with ``l3``, ``r3`` and ``x3`` all A)
    or ``sym_aX_plus_mm`` (``beta * X + L @ R``; ``alpha`` unused): one tiling for both."""
    if cfg.kernel == "v1" or not _int32_steps_ok(cfg, l3.stride(2), r3.stride(1)):
        t = triton.cdiv(n, cfg.BLOCK_M)
        if scaled:
            _launch_v1(K._ba_plus_caa_kernel_v1, t * (t + 1) // 2, (x3, o3),
                       (n, alpha, beta, *x3.stride(), *o3.stride()), cfg, BLOCK=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K)
        else:
            _launch_v1(K._sym_mm_add_kernel_v1, t * (t + 1) // 2, (l3, r3, x3, o3),
                       (n, n, beta, *l3.stride(), *r3.stride(), *x3.stride(), *o3.stride()), cfg,
                       BLOCK=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K)
        return
    bl, bk = cfg.BLOCK_M, cfg.BLOCK_K
    t = triton.cdiv(n, bl)
    tt = t * (t + 1) // 2
    even = n % bl == 0 and n % bk == 0
    for s, e in _slices(x3.shape[0], tt):
        ls, rs, xs, os_ = l3[s:e], r3[s:e], x3[s:e], o3[s:e]
        total = (e - s) * tt
        la, ra, xa, oa, tma = ls, rs, xs, os_, False
        if cfg.kernel == "tma" and even:
            lv, rv, xv, ov = (v.reshape(-1, n) for v in (ls, rs, xs, os_))
            if _tma_views_ok(lv, rv, xv, ov):
                la, ra, xa = _descriptor(lv, [bl, bk]), _descriptor(rv, [bk, bl]), _descriptor(xv, [bl, bl])
                oa, tma = _descriptor(ov, [bl, bl]), True
        K._sym_product_kernel[(_grid(total, cfg, xs),)](
            la, ra, xa, oa, n, alpha, beta, *ls.stride(), *rs.stride(), *xs.stride(), *os_.stride(), tt, total,
            BLOCK=bl, BLOCK_K=bk, EVEN=even, TMA=tma, SCALED=scaled, DOT_F32=dot_f32(), ROUND_FIX=round_fix(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_mm_add(x3: Tensor, l3: Tensor, r3: Tensor, o3: Tensor, m: int, n: int, k: int, a: float,
                   cfg: TileConfig) -> None:
    if cfg.kernel == "cublas":
        # baddbmm copies X into the output and lets cuBLAS compute a*X + L@R in its fp32 epilogue:
        # one rounding, as the fused kernel. Reduced-precision split-K reductions would add a bf16
        # rounding of partial sums, so they are switched off for this call.
        mm = torch.backends.cuda.matmul
        prev = mm.allow_bf16_reduced_precision_reduction
        mm.allow_bf16_reduced_precision_reduction = False
        try:
            torch.baddbmm(x3, l3, r3, beta=a, out=o3)
        finally:
            mm.allow_bf16_reduced_precision_reduction = prev
        return
    if cfg.kernel == "v1" or not _int32_steps_ok(cfg, l3.stride(2), r3.stride(1)):
        grid0 = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
        _launch_v1(K._mm_add_kernel_v1, grid0, (l3, r3, x3, o3),
                   (m, n, k, a, *l3.stride(), *r3.stride(), *x3.stride(), *o3.stride()), cfg,
                   BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M)
        return
    bm, bn, bk = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    per_mat = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    even = m % bm == 0 and n % bn == 0 and k % bk == 0
    for s, e in _slices(x3.shape[0], per_mat):
        xs, ls, rs, os_ = x3[s:e], l3[s:e], r3[s:e], o3[s:e]
        total = (e - s) * per_mat
        la, ra, xa, oa, tma = ls, rs, xs, os_, False
        if cfg.kernel == "tma" and even:
            lv, rv, xv, ov = ls.reshape(-1, k), rs.reshape(-1, n), xs.reshape(-1, n), os_.reshape(-1, n)
            if _tma_views_ok(lv, rv, xv, ov):
                la, ra = _descriptor(lv, [bm, bk]), _descriptor(rv, [bk, bn])
                xa, oa, tma = _descriptor(xv, [bm, bn]), _descriptor(ov, [bm, bn]), True
        K._mm_add_kernel[(_grid(total, cfg, xs),)](
            la, ra, xa, oa, m, n, k, a,
            ls.stride(0), ls.stride(1), ls.stride(2), rs.stride(0), rs.stride(1), rs.stride(2),
            xs.stride(0), xs.stride(1), xs.stride(2), os_.stride(0), os_.stride(1), os_.stride(2), total,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.GROUP_M, EVEN=even, TMA=tma,
            DOT_F32=dot_f32(), ROUND_FIX=round_fix(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _choose(kind: str, key: ProblemKey, config: TileConfig | None, launch, out: Tensor, n: int, k: int,
            batch: int) -> TileConfig:
    """The configuration of this call: the caller's, else v1's heuristic (``ANVIL_FAST_GRAM=v1``),
    else the tuned one for this shape (tuned now if it is new; see :mod:`anvil_fast.kernels.gram_tune`)."""
    if config is not None:
        if config.kernel not in KERNELS or (config.kernel == "cublas" and kind != "mm_add"):
            raise GramInputError(f"config.kernel: expected one of {KERNELS} ('cublas' only for aX_plus_mm), "
                                 f"got {config.kernel!r}")
        return config
    default = default_config(kind, n, k, batch, sms=num_sms(out.device.index if out.is_cuda else None))
    if interpreting() or kernel_mode() == "v1":
        return default
    return choose(kind, key, launch, out, default)


# ------------------------------------------------------------------------------------------------
# Public functions

def _gram(X: Tensor, out: Tensor | None, transpose: bool, backend: str, config: TileConfig | None) -> Tensor:
    name = "XTX" if transpose else "XXT"
    X = _check_tensor(f"{name}: X", X)
    rows, cols = X.shape[-2], X.shape[-1]
    n, k = (cols, rows) if transpose else (rows, cols)
    out = _check_out(out, (*X.shape[:-2], n, n), X, {"X": X})
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    if not use_triton(X, backend, error=GramInputError):
        xf = X.float()
        g = xf.mT @ xf if transpose else xf @ xf.mT
        return out.copy_(_symmetrize_lower(g))
    x3 = X.reshape(-1, rows, cols)
    o3 = out.view(-1, n, n)
    launch = functools.partial(_launch_gram, x3, o3, n, k, transpose)
    cfg = _choose("gram", ProblemKey(name, n, n, k, x3.shape[0], X.device.index), config, launch, o3, n, k, x3.shape[0])
    launch(cfg)
    return out


def XXT(X: Tensor, *, out: Tensor | None = None, backend: str = "auto", config: TileConfig | None = None) -> Tensor:
    """``out = X @ X^T`` for bf16 ``X`` of shape ``[..., m, n]``; ``out`` is ``[..., m, m]`` bf16,
    exactly symmetric, fp32-accumulated and rounded once."""
    return _gram(X, out, False, backend, config)


def XTX(X: Tensor, *, out: Tensor | None = None, backend: str = "auto", config: TileConfig | None = None) -> Tensor:
    """``out = X^T @ X`` for bf16 ``X`` of shape ``[..., m, n]``; ``out`` is ``[..., n, n]`` bf16,
    exactly symmetric, fp32-accumulated and rounded once."""
    return _gram(X, out, True, backend, config)


def ba_plus_cAA(A: Tensor, *, alpha: float, beta: float, out: Tensor | None = None, backend: str = "auto",
                config: TileConfig | None = None) -> Tensor:
    """``out = beta*A + alpha*(A @ A)`` for a symmetric bf16 ``A`` of shape ``[..., n, n]`` (the
    seed's call is ``ba_plus_cAA(A, alpha=c, beta=b, out=B)``). Computed in fp32, rounded once; the
    lower triangle is computed and mirrored, so for a non-symmetric ``A`` the result is the lower
    triangle of the formula, mirrored."""
    A = _check_tensor("ba_plus_cAA: A", A)
    if A.shape[-1] != A.shape[-2]:
        raise GramInputError(f"ba_plus_cAA: A must be square [..., n, n], got {tuple(A.shape)}")
    alpha, beta = _finite_float("alpha", alpha), _finite_float("beta", beta)
    out = _check_out(out, tuple(A.shape), A, {"A": A})
    n = A.shape[-1]
    if out.numel() == 0:
        return out
    if not use_triton(A, backend, error=GramInputError):
        af = A.float()
        return out.copy_(_symmetrize_lower(alpha * (af @ af) + beta * af))
    a3 = A.reshape(-1, n, n)
    o3 = out.view(-1, n, n)
    # The tuner's candidates run with these alpha/beta too (outputs are compared, not only timed).
    launch = functools.partial(_launch_sym_product, a3, a3, a3, o3, n, alpha, beta, True)
    key = ProblemKey("ba_plus_cAA", n, n, n, a3.shape[0], A.device.index)
    cfg = _choose("ba_plus_cAA", key, config, launch, o3, n, n, a3.shape[0])
    launch(cfg)
    return out


def aX_plus_mm(X: Tensor, L: Tensor, R: Tensor, *, a: float, out: Tensor | None = None, backend: str = "auto",
               config: TileConfig | None = None) -> Tensor:
    """``out = a*X + L @ R`` (bf16 ``L`` ``[..., m, k]``, ``R`` ``[..., k, n]``, ``X`` ``[..., m, n]``),
    fp32 accumulation and one rounding: the cascade's map step (tall: ``L = X``, ``R = B``; wide:
    ``L = B``, ``R = X``) without the extra pass over X that ``baddbmm`` or ``bmm`` + ``add_`` make."""
    X = _check_tensor("aX_plus_mm: X", X)
    L = _check_tensor("aX_plus_mm: L", L)
    R = _check_tensor("aX_plus_mm: R", R)
    _same_device(X=X, L=L, R=R)
    a = _finite_float("a", a)
    m, k, n = L.shape[-2], L.shape[-1], R.shape[-1]
    if R.shape[-2] != k or tuple(X.shape[-2:]) != (m, n):
        raise GramInputError(f"aX_plus_mm: shapes do not chain: L {tuple(L.shape)} @ R {tuple(R.shape)} "
                             f"must give X's {tuple(X.shape)}")
    if not (X.shape[:-2] == L.shape[:-2] == R.shape[:-2]):
        raise GramInputError(f"aX_plus_mm: batch dimensions differ: X {tuple(X.shape[:-2])}, "
                             f"L {tuple(L.shape[:-2])}, R {tuple(R.shape[:-2])}")
    out = _check_out(out, tuple(X.shape), X, {"X": X, "L": L, "R": R})
    if out.numel() == 0:
        return out
    if not use_triton(X, backend, error=GramInputError):
        return out.copy_(a * X.float() + L.float() @ R.float())
    x3, l3, r3 = X.reshape(-1, m, n), L.reshape(-1, m, k), R.reshape(-1, k, n)
    o3 = out.view(-1, m, n)
    launch = functools.partial(_launch_mm_add, x3, l3, r3, o3, m, n, k, a)
    # Which operand is X (L is X: tall, R is X: wide) changes nothing in the kernel; m, n, k do.
    key = ProblemKey("mm_add", m, n, k, x3.shape[0], X.device.index)
    cfg = _choose("mm_add", key, config, launch, o3, max(m, n), k, x3.shape[0])
    launch(cfg)
    return out


def sym_aX_plus_mm(X: Tensor, L: Tensor, R: Tensor, *, a: float, out: Tensor | None = None,
                   backend: str = "auto", config: TileConfig | None = None) -> Tensor:
    """``out = a*X + L @ R`` for square bf16 ``[..., n, n]`` operands whose exact result is symmetric
    (the Gram side's ``Q A`` and ``Q (Q A)``, :mod:`anvil_fast.core.gram_side`): the lower triangle is
    computed (fp32 accumulation, one rounding) and mirrored, so ``out`` is exactly symmetric. For a
    non-symmetric result it is the formula's lower triangle, mirrored. Tiles, walk and tuning are
    ``ba_plus_cAA``'s (square tiles, the tuner's symmetric candidates; ``config`` as there)."""
    X = _check_tensor("sym_aX_plus_mm: X", X)
    L = _check_tensor("sym_aX_plus_mm: L", L)
    R = _check_tensor("sym_aX_plus_mm: R", R)
    _same_device(X=X, L=L, R=R)
    n = X.shape[-1]
    if not (tuple(X.shape) == tuple(L.shape) == tuple(R.shape)) or X.shape[-2] != n:
        raise GramInputError(f"sym_aX_plus_mm: expected three square [..., n, n] operands of one shape, got "
                             f"X {tuple(X.shape)}, L {tuple(L.shape)}, R {tuple(R.shape)}")
    a = _finite_float("a", a)
    out = _check_out(out, tuple(X.shape), X, {"X": X, "L": L, "R": R})
    if out.numel() == 0:
        return out
    if not use_triton(X, backend, error=GramInputError):
        return out.copy_(_symmetrize_lower(a * X.float() + L.float() @ R.float()))
    x3, l3, r3 = (t.reshape(-1, n, n) for t in (X, L, R))
    o3 = out.view(-1, n, n)
    launch = functools.partial(_launch_sym_product, l3, r3, x3, o3, n, 1.0, a, False)
    key = ProblemKey("sym_mm_add", n, n, n, x3.shape[0], X.device.index)
    cfg = _choose("sym_mm_add", key, config, launch, o3, n, n, x3.shape[0])
    launch(cfg)
    return out


def _finite_float(name: str, v: object) -> float:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise GramInputError(f"{name}: expected a real number, got {type(v).__name__}") from None
    if not math.isfinite(f):
        raise GramInputError(f"{name}: expected a finite number, got {f}")
    return f
