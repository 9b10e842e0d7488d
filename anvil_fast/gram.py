"""Symmetric Gram kernels of the cascade: ``XXT``, ``XTX``, ``ba_plus_cAA``, and the fused ``aX_plus_mm``.

All take bf16 tensors of shape ``[..., rows, cols]`` (the leading dimensions are a batch), accumulate
in fp32 and round once to bf16 into an ``out=`` buffer::

    XXT(X, out=A)                        A = X X^T                   (N = rows, K = cols)
    XTX(X, out=A)                        A = X^T X                   (N = cols, K = rows)
    ba_plus_cAA(A, alpha=c, beta=b, out=B)   B = b*A + c*(A @ A)     (A symmetric N x N)
    aX_plus_mm(X, L, R, a=a, out=C)      C = a*X + L @ R             (one rounding)

Why the kernels look the way they do:

* The three symmetric outputs are computed on the lower-triangular tiles only (a 1-D grid over the
  ``T(T+1)/2`` tiles of a ``T x T`` tiling, decoded with a square root) and each off-diagonal tile is
  stored twice, as itself and transposed. That skips ``(T-1)/(2T)`` of the tiles' FLOPs (5/12 for
  T = 6, i.e. a 768-wide Gram with 128-tiles) and makes the output *exactly* symmetric: diagonal
  tiles copy their lower triangle onto their upper one in registers (``tl.where`` with the
  transposed accumulator), so no element is written twice and no write depends on another
  program.
* Batch and row offsets are formed in int64 before being multiplied by strides, so a batch whose
  total size exceeds 2**31 elements addresses correctly.
* Every load is masked, so any size works (not only multiples of the block sizes); masked-off
  operand entries are zero and do not change the dot product.
* ``aX_plus_mm`` exists because the obvious forms both make an extra pass over X: ``baddbmm(X, ...,
  out=C)`` first copies X into C (the seed's "defensive copy") and the seed's split path writes
  ``X @ B`` and then re-reads it for ``C += a*X``. Reading the X tile in the GEMM's epilogue costs one
  read of X and nothing else. It also rounds once (as ``baddbmm`` does) where the split path rounds
  twice.
* ``DOT_F32`` widens bf16 tiles to fp32 right before ``tl.dot`` and ``ROUND_FIX`` rounds fp32 to bf16
  on the bits; both are only on under Triton's CPU interpreter, whose bf16 dot is broken and whose
  fp32 -> bf16 cast truncates (see :mod:`anvil_fast._triton`).

Where Triton cannot run (no CUDA tensor, no Triton, or ``backend="torch"``), a plain-torch version
with the same semantics runs: fp32 products of the bf16 operands, the lower triangle mirrored, one
rounding to bf16.

Bad input raises :class:`GramInputError` (a ``ValueError``) saying what was wrong and what was
expected: non-tensors, wrong dtype, fewer than 2 dimensions, non-contiguous tensors, devices that
differ, and ``out`` buffers of the wrong shape / dtype or overlapping an input.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._triton import dot_f32, interpreting, round_fix, triton_available


class GramInputError(ValueError):
    """Bad input to a Gram kernel (message: what was wrong, what was expected)."""


class TileConfig(NamedTuple):
    """Launch parameters of one kernel call. BLOCK_N is ignored by the symmetric kernels (square
    tiles, BLOCK_M x BLOCK_M)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8


# Largest grid dimension 1 (the batch axis) CUDA accepts; larger batches are launched in slices.
_MAX_GRID_Y = 65535

# ------------------------------------------------------------------------------------------------
# Triton kernels (defined only when Triton imports; the module itself never needs it)

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_dot(A, B, C, N: tl.constexpr, DOT_F32: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(A + r[:, None] * N + r[None, :])
        b = tl.load(B + r[:, None] * N + r[None, :])
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        tl.store(C + r[:, None] * N + r[None, :], tl.dot(a, b))

    @triton.jit
    def _probe_cast(A, C, N: tl.constexpr, ROUND_FIX: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(C + r, _to_bf16(tl.load(A + r), ROUND_FIX))

    @triton.jit
    def _to_bf16(x, ROUND_FIX: tl.constexpr):
        # fp32 -> bf16, round to nearest even. ROUND_FIX does it on the bits (add 0x7FFF plus the
        # lowest kept bit, drop the low half): only under the interpreter, whose cast truncates.
        if ROUND_FIX:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def _lower_tile(pid):
        # pid -> (i, j) with i >= j, pid = i (i + 1) / 2 + j. The float estimate of i is exact for
        # the tile counts that occur (< 2**20); the two corrections make it exact regardless.
        i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
        i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
        i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
        return i, pid - i * (i + 1) // 2

    @triton.jit
    def _store_symmetric(C, val, rows, cols, N, scm, scn, BLOCK: tl.constexpr, ROUND_FIX: tl.constexpr):
        # val is the fp32 tile (i, j). Diagonal tiles (i == j) take their lower triangle for both
        # halves; off-diagonal tiles are also written transposed at (j, i).
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        valT = tl.trans(val)
        sym = tl.where(rows[:, None] >= cols[None, :], val, valT)
        mask = (rows[:, None] < N) & (cols[None, :] < N)
        tl.store(C + rows64[:, None] * scm + cols64[None, :] * scn, _to_bf16(sym, ROUND_FIX), mask=mask)
        # (i != j) written elementwise (a scalar bool mask trips the interpreter).
        off_diag = (rows[None, :] // BLOCK) != (cols[:, None] // BLOCK)
        mirror = (cols[:, None] < N) & (rows[None, :] < N) & off_diag
        tl.store(C + cols64[:, None] * scm + rows64[None, :] * scn, _to_bf16(valT, ROUND_FIX), mask=mirror)

    @triton.jit
    def _gram_kernel(X, C, N, K, sxb, sxn, sxk, scb, scm, scn,
                     BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                     ROUND_FIX: tl.constexpr):
        # C[b] = Y Y^T with Y[n, k] = X[b + n*sxn + k*sxk]: XXT is (sxn, sxk) = (row, col) strides,
        # XTX is (col, row) strides.
        i, j = _lower_tile(tl.program_id(0))
        bat = tl.program_id(1).to(tl.int64)
        X += bat * sxb
        C += bat * scb
        ar = tl.arange(0, BLOCK)
        ak = tl.arange(0, BLOCK_K)
        rows = i * BLOCK + ar
        cols = j * BLOCK + ar
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ak
            kk64 = kk.to(tl.int64)
            a = tl.load(X + rows64[:, None] * sxn + kk64[None, :] * sxk,
                        mask=(rows[:, None] < N) & (kk[None, :] < K), other=0.0)
            b = tl.load(X + kk64[:, None] * sxk + cols64[None, :] * sxn,
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        _store_symmetric(C, acc, rows, cols, N, scm, scn, BLOCK, ROUND_FIX)

    @triton.jit
    def _ba_plus_caa_kernel(A, C, N, alpha, beta, sab, sam, san, scb, scm, scn,
                            BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                     ROUND_FIX: tl.constexpr):
        # C[b] = beta*A + alpha*(A @ A), lower tiles only (A symmetric => C symmetric).
        i, j = _lower_tile(tl.program_id(0))
        bat = tl.program_id(1).to(tl.int64)
        A += bat * sab
        C += bat * scb
        ar = tl.arange(0, BLOCK)
        ak = tl.arange(0, BLOCK_K)
        rows = i * BLOCK + ar
        cols = j * BLOCK + ar
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            kk = k0 + ak
            kk64 = kk.to(tl.int64)
            a = tl.load(A + rows64[:, None] * sam + kk64[None, :] * san,
                        mask=(rows[:, None] < N) & (kk[None, :] < N), other=0.0)
            b = tl.load(A + kk64[:, None] * sam + cols64[None, :] * san,
                        mask=(kk[:, None] < N) & (cols[None, :] < N), other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        mask = (rows[:, None] < N) & (cols[None, :] < N)
        aij = tl.load(A + rows64[:, None] * sam + cols64[None, :] * san, mask=mask, other=0.0)
        val = alpha * acc + beta * aij.to(tl.float32)
        _store_symmetric(C, val, rows, cols, N, scm, scn, BLOCK, ROUND_FIX)

    @triton.jit
    def _mm_add_kernel(L, R, X, O, M, N, K, alpha,
                       slb, slm, slk, srb, srk, srn, sxb, sxm, sxn, sob, som, son,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIX: tl.constexpr):
        # O[b] = alpha*X[b] + L[b] @ R[b]; tiles in GROUP_M-row groups so neighbouring programs
        # share L's row panel and R's column panel in L2.
        pid = tl.program_id(0)
        bat = tl.program_id(1).to(tl.int64)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pm = first_m + (pid % per_group) % gsize
        pn = (pid % per_group) // gsize
        L += bat * slb
        R += bat * srb
        X += bat * sxb
        O += bat * sob
        rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        ak = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ak
            kk64 = kk.to(tl.int64)
            a = tl.load(L + rows64[:, None] * slm + kk64[None, :] * slk,
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(R + kk64[:, None] * srk + cols64[None, :] * srn,
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(X + rows64[:, None] * sxm + cols64[None, :] * sxn, mask=mask, other=0.0)
        val = alpha * x.to(tl.float32) + acc
        tl.store(O + rows64[:, None] * som + cols64[None, :] * son, _to_bf16(val, ROUND_FIX), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launch configurations

def default_config(kind: str, n: int, k: int, batch: int) -> TileConfig:
    """Tile sizes by problem size (``kind``: "gram", "ba_plus_cAA" or "mm_add"; ``n`` the output's
    larger side, ``k`` the reduction length). From the H200 sweep of ``python -m anvil_fast.bench
    bank --sweep`` (NOTES.md): 128-tiles with 4 stages for the symmetric kernels and 128 x 256 tiles
    for the GEMM on large banks; 64-tiles with a 128-deep K step where the grid would not cover the
    132 SMs. Under the interpreter, small tiles keep CPU tests fast."""
    if interpreting():
        return TileConfig(32, 32, 32, 4, 1)
    tiles128 = math.ceil(n / 128)
    small = n <= 256 or batch * tiles128 * (tiles128 + 1) // 2 < 2 * 132
    if kind == "mm_add":
        return TileConfig(64, 128, 64, 4, 4) if small else TileConfig(128, 256, 64, 8, 3)
    return TileConfig(64, 64, 128, 4, 3) if small else TileConfig(128, 128, 64, 8, 4)


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


def _use_triton(t: Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise GramInputError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    runnable = triton_available() and (t.is_cuda or (interpreting() and t.device.type == "cpu"))
    if backend == "triton":
        if not runnable:
            raise GramInputError(f"backend='triton': Triton cannot run on a {t.device.type} tensor here "
                                 "(needs CUDA, or TRITON_INTERPRET=1 for CPU tensors)")
        return True
    return triton_available() and t.is_cuda


def _batch_slices(nbatch: int):
    for s in range(0, nbatch, _MAX_GRID_Y):
        yield s, min(nbatch, s + _MAX_GRID_Y)


def _symmetrize_lower(g: Tensor) -> Tensor:
    return g.tril() + g.tril(-1).mT


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
    if not _use_triton(X, backend):
        xf = X.float()
        g = xf.mT @ xf if transpose else xf @ xf.mT
        return out.copy_(_symmetrize_lower(g))
    x3 = X.reshape(-1, rows, cols)
    o3 = out.view(-1, n, n)
    cfg = config or default_config("gram", n, k, x3.shape[0])
    t = triton.cdiv(n, cfg.BLOCK_M)
    sxn, sxk = (x3.stride(2), x3.stride(1)) if transpose else (x3.stride(1), x3.stride(2))
    for s, e in _batch_slices(x3.shape[0]):
        xs, os_ = x3[s:e], o3[s:e]
        _gram_kernel[(t * (t + 1) // 2, e - s)](
            xs, os_, n, k, xs.stride(0), sxn, sxk, os_.stride(0), os_.stride(1), os_.stride(2),
            BLOCK=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, DOT_F32=dot_f32(), ROUND_FIX=round_fix(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
    if not _use_triton(A, backend):
        af = A.float()
        return out.copy_(_symmetrize_lower(alpha * (af @ af) + beta * af))
    a3 = A.reshape(-1, n, n)
    o3 = out.view(-1, n, n)
    cfg = config or default_config("ba_plus_cAA", n, n, a3.shape[0])
    t = triton.cdiv(n, cfg.BLOCK_M)
    for s, e in _batch_slices(a3.shape[0]):
        as_, os_ = a3[s:e], o3[s:e]
        _ba_plus_caa_kernel[(t * (t + 1) // 2, e - s)](
            as_, os_, n, alpha, beta, as_.stride(0), as_.stride(1), as_.stride(2),
            os_.stride(0), os_.stride(1), os_.stride(2),
            BLOCK=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, DOT_F32=dot_f32(), ROUND_FIX=round_fix(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
    if not _use_triton(X, backend):
        return out.copy_(a * X.float() + L.float() @ R.float())
    x3, l3, r3 = X.reshape(-1, m, n), L.reshape(-1, m, k), R.reshape(-1, k, n)
    o3 = out.view(-1, m, n)
    cfg = config or default_config("mm_add", max(m, n), k, x3.shape[0])
    grid0 = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    for s, e in _batch_slices(x3.shape[0]):
        xs, ls, rs, os_ = x3[s:e], l3[s:e], r3[s:e], o3[s:e]
        _mm_add_kernel[(grid0, e - s)](
            ls, rs, xs, os_, m, n, k, a,
            ls.stride(0), ls.stride(1), ls.stride(2), rs.stride(0), rs.stride(1), rs.stride(2),
            xs.stride(0), xs.stride(1), xs.stride(2), os_.stride(0), os_.stride(1), os_.stride(2),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
            DOT_F32=dot_f32(), ROUND_FIX=round_fix(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _finite_float(name: str, v: object) -> float:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise GramInputError(f"{name}: expected a real number, got {type(v).__name__}") from None
    if not math.isfinite(f):
        raise GramInputError(f"{name}: expected a finite number, got {f}")
    return f


def gram_flops(rows: int, cols: int, batch: int, block: int) -> tuple[int, int]:
    """(FLOPs of the full Gram ``2*rows*cols*min...``, FLOPs the symmetric kernel executes) for one
    ``XXT`` / ``XTX`` of a batch of ``rows x cols`` matrices (n = the smaller side)."""
    n, k = min(rows, cols), max(rows, cols)
    t = math.ceil(n / block)
    full = 2 * n * n * k * batch
    return full, full * (t * (t + 1) // 2) // (t * t)
