"""Triton kernels behind :mod:`anvil_fast.kernels.gram` (imported only where Triton imports).

Two generations live here:

* ``_gram_kernel``, ``_sym_product_kernel`` (``ba_plus_cAA`` and ``sym_aX_plus_mm``), ``_mm_add_kernel``
  -- the current kernels. One code path per kernel takes either raw pointers or TMA tensor
  descriptors (``TMA`` constexpr), and a 1-D grid of ``P`` programs walks the flattened (matrix,
  tile) list with stride ``P``: ``P`` = the tile count gives one tile per program, ``P`` = a multiple
  of the SM count gives a persistent grid. Both are the same compiled kernel.
* ``*_v1`` -- the first kernels (masked pointer loads, a 2-D (tile, matrix) grid), kept unchanged
  as the trusted reference of the launch-time tuner (:mod:`anvil_fast.kernels.gram_tune` cross-checks every
  candidate against them) and as the fallback ``ANVIL_FAST_GRAM=v1``. The lower-tile ones share
  one K loop, ``_lower_tile_product_v1``, which ``_sym_mm_add_kernel_v1`` (the Gram side's symmetric
  ``a X + L R``, :func:`anvil_fast.kernels.gram.sym_aX_plus_mm`) runs too.

Why the current kernels look the way they do (each point is a measured or counted cost of v1):

* TMA (``TMA=True``). Operand tiles are fetched by the copy engine straight into the swizzled
  shared-memory layout ``wgmma`` reads, with no per-element address arithmetic in the K loop (v1
  rebuilt a 64-bit address per element per K step). Descriptors are 2-D views ``[batch*rows,
  cols]`` of the contiguous batch: a tile that runs past a matrix's last row reads the next matrix's
  rows, which only reach output rows/cols >= N that are never stored, while the inner dimension is
  zero-filled by the hardware. Where the *reduction* index runs along descriptor rows (X^T X, the B
  operands of A@A and L@R) a partial K step would mix matrices, so the TMA path requires exact
  tiling (``EVEN``: every dimension a multiple of its block), which also lets the epilogue store
  whole tiles with TMA (a masked store cannot be expressed there).
* Pointer path (``TMA=False``). Base pointers are formed once in int64 (batches past 2**31
  elements) and advanced by ``BLOCK_K`` strides per K step; with ``EVEN`` the loads and stores carry
  no masks. Any size works without ``EVEN``: masked-off operands are zero.
* Symmetric outputs: only lower tiles (i >= j) are computed. Off-diagonal tiles are stored as
  themselves and transposed; a diagonal tile takes its lower triangle for both halves
  (``where(r >= c, v, v^T)``), so every element is written exactly once and the output is exactly
  symmetric. The branch is a scalar ``if`` so off-diagonal tiles never build the transposed select.
* ``DOT_F32`` / ``ROUND_FIX``: interpreter work-arounds (see :mod:`anvil_fast.kernels.backend`); off on GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backend import from_bf16, to_bf16


@triton.jit
def _lower_tile(pid):
    # pid -> (i, j) with i >= j, pid = i (i + 1) / 2 + j. The float estimate of i is exact for
    # the tile counts that occur (< 2**20); the two corrections make it exact regardless.
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    return i, pid - i * (i + 1) // 2


# ------------------------------------------------------------------------------------------------
# Current kernels


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _store_tile(C, v, b, ti, tj, N, scb, scm, scn, BLOCK: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr,
                ROUND_FIX: tl.constexpr):
    # The fp32 BLOCK x BLOCK tile v -> bf16 block (ti, tj) of matrix b of C.
    if TMA:
        C.store([b * N + ti * BLOCK, tj * BLOCK], to_bf16(v, ROUND_FIX))
    else:
        r = ti * BLOCK + tl.arange(0, BLOCK)
        c = tj * BLOCK + tl.arange(0, BLOCK)
        ptrs = C + b.to(tl.int64) * scb + r.to(tl.int64)[:, None] * scm + c.to(tl.int64)[None, :] * scn
        if EVEN:
            tl.store(ptrs, to_bf16(v, ROUND_FIX))
        else:
            tl.store(ptrs, to_bf16(v, ROUND_FIX), mask=(r[:, None] < N) & (c[None, :] < N))


@triton.jit
def _store_symmetric(C, val, b, i, j, N, scb, scm, scn, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                     TMA: tl.constexpr, ROUND_FIX: tl.constexpr):
    if i == j:
        ar = tl.arange(0, BLOCK)
        sym = tl.where(ar[:, None] >= ar[None, :], val, tl.trans(val))
        _store_tile(C, sym, b, i, i, N, scb, scm, scn, BLOCK, EVEN, TMA, ROUND_FIX)
    else:
        _store_tile(C, val, b, i, j, N, scb, scm, scn, BLOCK, EVEN, TMA, ROUND_FIX)
        _store_tile(C, tl.trans(val), b, j, i, N, scb, scm, scn, BLOCK, EVEN, TMA, ROUND_FIX)


@triton.jit(do_not_specialize=["TT", "total"])
def _gram_kernel(X, C, N, K, sxb, sxn, sxk, scb, scm, scn, TT, total,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, TRANS: tl.constexpr, EVEN: tl.constexpr,
                 TMA: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIX: tl.constexpr):
    # C[b] = Y Y^T, Y = X[b] (XXT, TRANS=False) or X[b]^T (XTX, TRANS=True); N = Y's rows, K = its
    # columns. Pointer path: Y[n, k] = X[b*sxb + n*sxn + k*sxk] for either orientation. TMA path:
    # X is a descriptor of [batch*N, K] (XXT, blocks [BLOCK, BLOCK_K]) or [batch*K, N] (XTX,
    # blocks [BLOCK_K, BLOCK]); C one of [batch*N, N] with blocks [BLOCK, BLOCK].
    # TT = lower tiles per matrix, total = batch * TT.
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        b = t // TT
        i, j = _lower_tile(t - b * TT)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        if TMA:
            for k0 in range(0, K, BLOCK_K):
                if TRANS:
                    ya = X.load([b * K + k0, i * BLOCK])
                    yb = X.load([b * K + k0, j * BLOCK])
                    acc = _dot(tl.trans(ya), yb, acc, DOT_F32)
                else:
                    ya = X.load([b * N + i * BLOCK, k0])
                    yb = X.load([b * N + j * BLOCK, k0])
                    acc = _dot(ya, tl.trans(yb), acc, DOT_F32)
        else:
            ar = tl.arange(0, BLOCK)
            ak = tl.arange(0, BLOCK_K)
            rows = i * BLOCK + ar
            cols = j * BLOCK + ar
            base = X + b.to(tl.int64) * sxb
            pa = base + rows.to(tl.int64)[:, None] * sxn + ak[None, :] * sxk
            pb = base + ak[:, None] * sxk + cols.to(tl.int64)[None, :] * sxn
            for k0 in range(0, K, BLOCK_K):
                if EVEN:
                    ya = tl.load(pa)
                    yb = tl.load(pb)
                else:
                    kk = k0 + ak
                    ya = tl.load(pa, mask=(rows[:, None] < N) & (kk[None, :] < K), other=0.0)
                    yb = tl.load(pb, mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
                acc = _dot(ya, yb, acc, DOT_F32)
                pa += BLOCK_K * sxk
                pb += BLOCK_K * sxk
        _store_symmetric(C, acc, b, i, j, N, scb, scm, scn, BLOCK, EVEN, TMA, ROUND_FIX)


@triton.jit(do_not_specialize=["TT", "total"])
def _sym_product_kernel(L, R, X, C, N, alpha, beta, slb, slm, slk, srb, srk, srn, sxb, sxm, sxn, scb, scm, scn,
                        TT, total, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                        TMA: tl.constexpr, SCALED: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIX: tl.constexpr):
    # C[b] = alpha*(L[b] @ R[b]) + beta*X[b] (SCALED: ba_plus_cAA, L = R = X = A) or X[b]*beta + L[b] @ R[b]
    # (sym_aX_plus_mm, beta = a) on lower tiles, each stored as itself and mirrored: the caller
    # guarantees the exact result is symmetric. Pointer path: strides per operand. TMA path:
    # descriptors of [batch*N, N] with blocks [BLOCK, BLOCK_K] (L: row panel of tile i), [BLOCK_K,
    # BLOCK] (R: column panel of tile j) and [BLOCK, BLOCK] (X: the epilogue's tile).
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        b = t // TT
        i, j = _lower_tile(t - b * TT)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        ar = tl.arange(0, BLOCK)
        rows = i * BLOCK + ar
        cols = j * BLOCK + ar
        if TMA:
            for k0 in range(0, N, BLOCK_K):
                acc = _dot(L.load([b * N + i * BLOCK, k0]), R.load([b * N + k0, j * BLOCK]), acc, DOT_F32)
            xij = X.load([b * N + i * BLOCK, j * BLOCK])
        else:
            ak = tl.arange(0, BLOCK_K)
            b64 = b.to(tl.int64)
            pa = L + b64 * slb + rows.to(tl.int64)[:, None] * slm + ak[None, :] * slk
            pb = R + b64 * srb + ak[:, None] * srk + cols.to(tl.int64)[None, :] * srn
            for k0 in range(0, N, BLOCK_K):
                if EVEN:
                    xa = tl.load(pa)
                    xb = tl.load(pb)
                else:
                    kk = k0 + ak
                    xa = tl.load(pa, mask=(rows[:, None] < N) & (kk[None, :] < N), other=0.0)
                    xb = tl.load(pb, mask=(kk[:, None] < N) & (cols[None, :] < N), other=0.0)
                acc = _dot(xa, xb, acc, DOT_F32)
                pa += BLOCK_K * slk
                pb += BLOCK_K * srk
            pe = X + b64 * sxb + rows.to(tl.int64)[:, None] * sxm + cols.to(tl.int64)[None, :] * sxn
            if EVEN:
                xij = tl.load(pe)
            else:
                xij = tl.load(pe, mask=(rows[:, None] < N) & (cols[None, :] < N), other=0.0)
        # each operation's sum written as its v1 kernel writes it, so the compiler forms the same
        # expression (and the same fused multiply-add, where it fuses) as there
        if SCALED:
            val = alpha * acc + beta * xij.to(tl.float32)
        else:
            val = acc + beta * xij.to(tl.float32)
        _store_symmetric(C, val, b, i, j, N, scb, scm, scn, BLOCK, EVEN, TMA, ROUND_FIX)


@triton.jit(do_not_specialize=["total"])
def _mm_add_kernel(L, R, X, O, M, N, K, alpha,
                   slb, slm, slk, srb, srk, srn, sxb, sxm, sxn, sob, som, son, total,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIX: tl.constexpr):
    # O[b] = alpha*X[b] + L[b] @ R[b]. Tiles of one matrix are consecutive and ordered in GROUP_M-row
    # groups, so programs running together share L's row panels and R's column panels in L2. TMA
    # path: descriptors of [batch*M, K] (L, blocks [BLOCK_M, BLOCK_K]), [batch*K, N] (R, blocks
    # [BLOCK_K, BLOCK_N]) and [batch*M, N] (X and O, blocks [BLOCK_M, BLOCK_N]).
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_mat = num_m * num_n
    per_group = GROUP_M * num_n
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        b = t // per_mat
        local = t - b * per_mat
        first_m = (local // per_group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pm = first_m + (local % per_group) % gsize
        pn = (local % per_group) // gsize
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TMA:
            for k0 in range(0, K, BLOCK_K):
                acc = _dot(L.load([b * M + pm * BLOCK_M, k0]), R.load([b * K + k0, pn * BLOCK_N]), acc, DOT_F32)
            x = X.load([b * M + pm * BLOCK_M, pn * BLOCK_N])
            O.store([b * M + pm * BLOCK_M, pn * BLOCK_N], to_bf16(alpha * x.to(tl.float32) + acc, ROUND_FIX))
        else:
            b64 = b.to(tl.int64)
            rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
            rows64 = rows.to(tl.int64)
            cols64 = cols.to(tl.int64)
            ak = tl.arange(0, BLOCK_K)
            pl = L + b64 * slb + rows64[:, None] * slm + ak[None, :] * slk
            pr = R + b64 * srb + ak[:, None] * srk + cols64[None, :] * srn
            for k0 in range(0, K, BLOCK_K):
                if EVEN:
                    a = tl.load(pl)
                    bb = tl.load(pr)
                else:
                    kk = k0 + ak
                    a = tl.load(pl, mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
                    bb = tl.load(pr, mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
                acc = _dot(a, bb, acc, DOT_F32)
                pl += BLOCK_K * slk
                pr += BLOCK_K * srk
            px = X + b64 * sxb + rows64[:, None] * sxm + cols64[None, :] * sxn
            po = O + b64 * sob + rows64[:, None] * som + cols64[None, :] * son
            if EVEN:
                x = tl.load(px)
                tl.store(po, to_bf16(alpha * x.to(tl.float32) + acc, ROUND_FIX))
            else:
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                x = tl.load(px, mask=mask, other=0.0)
                tl.store(po, to_bf16(alpha * x.to(tl.float32) + acc, ROUND_FIX), mask=mask)


# ------------------------------------------------------------------------------------------------
# v1 kernels: the fallback and the cross-check of the tuned kernels (see the module docstring)


@triton.jit
def _store_symmetric_v1(C, val, rows, cols, N, scm, scn, BLOCK: tl.constexpr, ROUND_FIX: tl.constexpr):
    # val is the fp32 tile (i, j). Diagonal tiles (i == j) take their lower triangle for both
    # halves; off-diagonal tiles are also written transposed at (j, i).
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    valT = tl.trans(val)
    sym = tl.where(rows[:, None] >= cols[None, :], val, valT)
    mask = (rows[:, None] < N) & (cols[None, :] < N)
    tl.store(C + rows64[:, None] * scm + cols64[None, :] * scn, to_bf16(sym, ROUND_FIX), mask=mask)
    # (i != j) written elementwise (a scalar bool mask trips the interpreter).
    off_diag = (rows[None, :] // BLOCK) != (cols[:, None] // BLOCK)
    mirror = (cols[:, None] < N) & (rows[None, :] < N) & off_diag
    tl.store(C + cols64[:, None] * scm + rows64[None, :] * scn, to_bf16(valT, ROUND_FIX), mask=mirror)

@triton.jit
def _lower_tile_product_v1(L, R, i, j, N, K, slm, slk, srk, srn, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_F32: tl.constexpr):
    # The K loop of the v1 lower-tile kernels: the fp32 tile (i, j) of L @ R, with L[n, k] =
    # L[n*slm + k*slk] (N x K) and R[k, n] = R[k*srk + n*srn] (K x N) for the matrix L and R point
    # at. Masked loads (zero outside), addresses rebuilt in int64 per K step. Returns the tile's row
    # and column indices and its sums.
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
        a = tl.load(L + rows64[:, None] * slm + kk64[None, :] * slk,
                    mask=(rows[:, None] < N) & (kk[None, :] < K), other=0.0)
        b = tl.load(R + kk64[:, None] * srk + cols64[None, :] * srn,
                    mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return rows, cols, acc


@triton.jit
def _gram_kernel_v1(X, C, N, K, sxb, sxn, sxk, scb, scm, scn,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 ROUND_FIX: tl.constexpr):
    # C[b] = Y Y^T with Y[n, k] = X[b + n*sxn + k*sxk]: XXT is (sxn, sxk) = (row, col) strides,
    # XTX is (col, row) strides.
    i, j = _lower_tile(tl.program_id(0))
    bat = tl.program_id(1).to(tl.int64)
    X += bat * sxb
    C += bat * scb
    rows, cols, acc = _lower_tile_product_v1(X, X, i, j, N, K, sxn, sxk, sxk, sxn, BLOCK, BLOCK_K, DOT_F32)
    _store_symmetric_v1(C, acc, rows, cols, N, scm, scn, BLOCK, ROUND_FIX)

@triton.jit
def _ba_plus_caa_kernel_v1(A, C, N, alpha, beta, sab, sam, san, scb, scm, scn,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 ROUND_FIX: tl.constexpr):
    # C[b] = beta*A + alpha*(A @ A), lower tiles only (A symmetric => C symmetric).
    i, j = _lower_tile(tl.program_id(0))
    bat = tl.program_id(1).to(tl.int64)
    A += bat * sab
    C += bat * scb
    rows, cols, acc = _lower_tile_product_v1(A, A, i, j, N, N, sam, san, sam, san, BLOCK, BLOCK_K, DOT_F32)
    mask = (rows[:, None] < N) & (cols[None, :] < N)
    aij = tl.load(A + rows.to(tl.int64)[:, None] * sam + cols.to(tl.int64)[None, :] * san, mask=mask, other=0.0)
    val = alpha * acc + beta * aij.to(tl.float32)
    _store_symmetric_v1(C, val, rows, cols, N, scm, scn, BLOCK, ROUND_FIX)

@triton.jit
def _mm_add_kernel_v1(L, R, X, O, M, N, K, alpha,
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
    tl.store(O + rows64[:, None] * som + cols64[None, :] * son, to_bf16(val, ROUND_FIX), mask=mask)


# ------------------------------------------------------------------------------------------------
# The Gram side's symmetric-output fused product (:func:`anvil_fast.kernels.gram.sym_aX_plus_mm`), on the v1 loop


@triton.jit
def _sym_mm_add_kernel_v1(L, R, X, C, N, K, alpha, slb, slm, slk, srb, srk, srn, sxb, sxm, sxn, scb, scm, scn,
                          BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIX: tl.constexpr):
    # C[b] = alpha*X + L @ R on lower tiles only, each stored as itself and mirrored: the caller
    # guarantees the exact result is symmetric (Q (Q A) with Q a polynomial in A).
    i, j = _lower_tile(tl.program_id(0))
    bat = tl.program_id(1).to(tl.int64)
    L += bat * slb
    R += bat * srb
    X += bat * sxb
    C += bat * scb
    rows, cols, acc = _lower_tile_product_v1(L, R, i, j, N, K, slm, slk, srk, srn, BLOCK, BLOCK_K, DOT_F32)
    mask = (rows[:, None] < N) & (cols[None, :] < N)
    xij = tl.load(X + rows.to(tl.int64)[:, None] * sxm + cols.to(tl.int64)[None, :] * sxn, mask=mask, other=0.0)
    val = acc + alpha * xij.to(tl.float32)
    _store_symmetric_v1(C, val, rows, cols, N, scm, scn, BLOCK, ROUND_FIX)
