"""The Gram-side cascade on bf16 banks (reference: :mod:`anvil_ref.gram_side`; configuration:
:data:`anvil_fast.cascade.GRAM_SIDE`).

For a tall bank (rows m > cols n) every map of the standard cascade re-forms the Gram and the
product ``X B`` on the long side. The same maps run on the short side: with ``Q = a I + B`` and
``B = b A + c A^2`` (``ba_plus_cAA``), per matrix and after SAFE's normalization (unchanged: fp32
trace, prescale, margin slack, and the equalizer's guard after the cascade)::

    A = XTX(X_0)                                        X_0: the normalized X_1
    for map k = 1 .. K (a, b, c):
        if k is in the restart schedule:                X = X_0 R,  A = XTX(X),  X_0 <- X,  R <- I
        B = ba_plus_cAA(A, alpha=c, beta=b)             B = b A + c A^2          (symmetric kernel)
        R = a I + B       (first map after a (re)start)  |  R <- a R + R B        (aX_plus_mm)
        if map k + 1 needs A:
            P = a A + B A                               P = Q A                  (aX_plus_mm)
            A = a P + B P                               A = Q Q A = Q A Q        (symmetric output)
    output X_0 R                                        (aX_plus_mm with a = 0)

Wide banks take the mirrored form (``XXT``, ``R <- a R + B R``, output ``R X_0``), as the reference.

Why these forms. ``Q A Q`` is written ``Q (Q A)`` -- the same matrix in exact arithmetic, because Q is
a polynomial in A and commutes with it -- so both products are ``a Y + B Y``: one fused kernel with
one rounding each, and ``Q`` itself is never formed. The second product's result is symmetric, so
it runs on lower tiles only and mirrors them (:func:`sym_aX_plus_mm`): ~(T-1)/(2T) of its FLOPs
saved and ``A`` stays exactly symmetric, which ``ba_plus_cAA`` assumes. ``R`` is a product of
commuting polynomials in ``A_1``, also symmetric in exact arithmetic, but a rounded ``R`` carries
the drift the restarts exist to remove; it is kept as computed (bf16, see the study's R column).
The final ``X_0 R`` uses ``aX_plus_mm`` with ``a = 0``: one read of X_0 more than a bare GEMM, so
that every product of the path is the same tuned one-rounding kernel.

Dispatch (:func:`uses_gram_side`): the short side pays only when ``max(m, n) / min(m, n)`` is large.
Per matrix, counting a symmetric product of T tiles as (T+1)/(2T) of a full one, the standard cascade
costs ``K (3 m n^2 + n^3)``-ish FLOPs and the Gram side ``(3 + 3 r) m n^2`` (r restarts) plus ~5 n^3
per map (:func:`cascade_flops`): with one restart, 1.51x fewer for the 2816 x 768 banks, 1.31x more
for a square bank. GRAM_SIDE_MIN_ASPECT is the threshold; the bank benchmark
(``python -m anvil_fast.bench bank``, its Gram-side table) measures where it pays on a GPU.

Where Triton cannot run, the same operations run as plain torch with the same roundings (fp32
products of bf16 operands, one rounding per product), as SAFE does.

``python -m anvil_fast.gram_side study`` runs the error study that picks the default schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN
from anvil_ref.gram_side import check_restarts
from anvil_ref.maps import MapsLike, load_maps

from ._triton import dot_f32, interpreting, num_sms, round_fix, triton_available, use_triton
from .cascade import CascadeConfig, CascadeWorkspace, get_config, is_tall, normalize_workspace
from .tolerances import RHO
from .gram import XTX, XXT, GramInputError, _check_out, _check_tensor, _same_device, _symmetrize_lower, \
    aX_plus_mm, ba_plus_cAA, default_config

#: The Gram side runs where ``max(rows, cols) / min(rows, cols) >= GRAM_SIDE_MIN_ASPECT``; square-ish
#: banks keep the standard cascade (no FLOP saving there, see the module docstring). Set from the
#: bank benchmark's GPU numbers.
GRAM_SIDE_MIN_ASPECT: float = 2.0


def uses_gram_side(shape, *, min_aspect: float = GRAM_SIDE_MIN_ASPECT) -> bool:
    """Dispatch rule: whether a bank of ``shape`` ([..., rows, cols]) runs the Gram side."""
    m, n = int(shape[-2]), int(shape[-1])
    return min(m, n) > 0 and max(m, n) >= min_aspect * min(m, n)


# ------------------------------------------------------------------------------------------------
# The symmetric-output fused product

if triton_available():
    import triton
    import triton.language as tl

    from .gram_kernels import _lower_tile, _store_symmetric_v1

    @triton.jit
    def _sym_mm_add_kernel(L, R, X, C, N, K, alpha, slb, slm, slk, srb, srk, srn, sxb, sxm, sxn, scb, scm, scn,
                           BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                           ROUND_FIX: tl.constexpr):
        # C[b] = alpha*X + L @ R on lower tiles only, each stored as itself and mirrored: the caller
        # guarantees the exact result is symmetric (Q (Q A) with Q a polynomial in A).
        i, j = _lower_tile(tl.program_id(0))
        bat = tl.program_id(1).to(tl.int64)
        L += bat * slb
        R += bat * srb
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
            a = tl.load(L + rows64[:, None] * slm + kk64[None, :] * slk,
                        mask=(rows[:, None] < N) & (kk[None, :] < K), other=0.0)
            b = tl.load(R + kk64[:, None] * srk + cols64[None, :] * srn,
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        mask = (rows[:, None] < N) & (cols[None, :] < N)
        xij = tl.load(X + rows64[:, None] * sxm + cols64[None, :] * sxn, mask=mask, other=0.0)
        val = acc + alpha * xij.to(tl.float32)
        _store_symmetric_v1(C, val, rows, cols, N, scm, scn, BLOCK, ROUND_FIX)


_MAX_GRID_Y = 65535


def sym_aX_plus_mm(X: Tensor, L: Tensor, R: Tensor, *, a: float, out: Tensor | None = None,
                   backend: str = "auto") -> Tensor:
    """``out = a*X + L @ R`` for square bf16 ``[..., n, n]`` operands whose exact result is symmetric:
    the lower triangle is computed (fp32 accumulation, one rounding) and mirrored, so ``out`` is
    exactly symmetric. For a non-symmetric result it is the formula's lower triangle, mirrored."""
    X = _check_tensor("sym_aX_plus_mm: X", X)
    L = _check_tensor("sym_aX_plus_mm: L", L)
    R = _check_tensor("sym_aX_plus_mm: R", R)
    _same_device(X=X, L=L, R=R)
    n = X.shape[-1]
    if not (tuple(X.shape) == tuple(L.shape) == tuple(R.shape)) or X.shape[-2] != n:
        raise GramInputError(f"sym_aX_plus_mm: expected three square [..., n, n] operands of one shape, got "
                             f"X {tuple(X.shape)}, L {tuple(L.shape)}, R {tuple(R.shape)}")
    a = float(a)
    if not math.isfinite(a):
        raise GramInputError(f"a: expected a finite number, got {a}")
    out = _check_out(out, tuple(X.shape), X, {"X": X, "L": L, "R": R})
    if out.numel() == 0:
        return out
    if not use_triton(X, backend, error=GramInputError):
        return out.copy_(_symmetrize_lower(a * X.float() + L.float() @ R.float()))
    x3, l3, r3, o3 = (t.reshape(-1, n, n) for t in (X, L, R, out))
    cfg = default_config("ba_plus_cAA", n, n, x3.shape[0], sms=num_sms(X.device.index if X.is_cuda else None))
    t = triton.cdiv(n, cfg.BLOCK_M)
    for s in range(0, x3.shape[0], _MAX_GRID_Y):
        e = s + _MAX_GRID_Y
        xs, ls, rs, os_ = x3[s:e], l3[s:e], r3[s:e], o3[s:e]
        _sym_mm_add_kernel[(t * (t + 1) // 2, xs.shape[0])](
            ls, rs, xs, os_, n, n, a, ls.stride(0), ls.stride(1), ls.stride(2), rs.stride(0), rs.stride(1),
            rs.stride(2), xs.stride(0), xs.stride(1), xs.stride(2), os_.stride(0), os_.stride(1), os_.stride(2),
            BLOCK=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, DOT_F32=dot_f32(), ROUND_FIX=round_fix(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ------------------------------------------------------------------------------------------------
# The cascade

@dataclass
class GramSideWork:
    """The Gram side's square buffers (n = the bank's short side): P = Q A, and R's ping-pong pair."""

    P: Tensor
    R: Tensor
    R2: Tensor

    @classmethod
    def for_workspace(cls, ws: CascadeWorkspace) -> "GramSideWork":
        sq = tuple(ws.A.shape)
        return cls(*(torch.empty(sq, dtype=torch.bfloat16, device=ws.A.device) for _ in range(3)))


def _apply_r(x0: Tensor, r: Tensor, out: Tensor, tall: bool, backend: str) -> None:
    if tall:
        aX_plus_mm(x0, x0, r, a=0.0, out=out, backend=backend)
    else:
        aX_plus_mm(x0, r, x0, a=0.0, out=out, backend=backend)


def gram_side_workspace(ws: CascadeWorkspace, *, maps: MapsLike = ANVIL_MAPS, config: CascadeConfig | str = "gram_side",
                        margin: float = FROBENIUS_MARGIN, eps: float = FROBENIUS_EPS, backend: str = "auto",
                        compile: bool | None = None, partials_ready: bool = False) -> Tensor:
    """The Gram-side cascade of ``ws.X`` (module docstring) with the configuration's restart
    schedule; same contract as :func:`anvil_fast.cascade.cascade_workspace` (returns the buffer,
    ``ws.X`` or ``ws.C``, that holds the result)."""
    cfg = get_config(config)
    if cfg.gram_side is None:
        raise ValueError(f"config {cfg.name!r} has no Gram-side restart schedule (gram_side=None)")
    maps_ = load_maps(maps)
    sched = check_restarts(cfg.gram_side, len(maps_))
    X0, C, A, B = ws.X, ws.C, ws.A, ws.B
    if ws.gram_side is None or tuple(ws.gram_side.R.shape) != tuple(A.shape):
        ws.gram_side = GramSideWork.for_workspace(ws)
    P, Rk, R2 = ws.gram_side.P, ws.gram_side.R, ws.gram_side.R2
    tall = is_tall(X0.shape)
    gram = XTX if tall else XXT
    normalize_workspace(ws, cfg, margin=margin, eps=eps, backend=backend, compile=compile,
                        partials_ready=partials_ready)
    gram(X0, out=A, backend=backend)
    fresh = True
    for k, (a, b, c) in enumerate(maps_, start=1):
        if k in sched:
            _apply_r(X0, Rk, C, tall, backend)
            X0, C = C, X0
            gram(X0, out=A, backend=backend)
            fresh = True
        ba_plus_cAA(A, alpha=c, beta=b, out=B, backend=backend)
        if fresh:
            Rk.copy_(B)
            # Q = a I + B, the diagonal added in fp32 and rounded once: a bf16 tensor's in-place
            # ``add_(a)`` first rounds the scalar a to bf16, a bias of up to 2**-9 on every eigenvalue
            # of Q that the accumulated R never loses (measured: 3x the error with one restart).
            diag = Rk.diagonal(dim1=-2, dim2=-1)
            diag.copy_(diag.float() + a)
            fresh = False
        else:
            aX_plus_mm(Rk, Rk, B, a=a, out=R2, backend=backend) if tall else \
                aX_plus_mm(Rk, B, Rk, a=a, out=R2, backend=backend)
            Rk, R2 = R2, Rk
        if k < len(maps_) and k + 1 not in sched:
            aX_plus_mm(A, B, A, a=a, out=P, backend=backend)
            sym_aX_plus_mm(P, B, P, a=a, out=A, backend=backend)
    _apply_r(X0, Rk, C, tall, backend)
    return C


def fast_gram_side(x: Tensor, *, restarts=None, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                   eps: float = FROBENIUS_EPS, backend: str = "auto", compile: bool | None = None) -> Tensor:
    """The Gram-side cascade of ``x`` ([..., rows, cols], any float dtype, cast to bf16 as
    :func:`anvil_fast.cascade.fast_cascade` does) whatever its shape (no dispatch rule), with
    ``restarts`` (default: GRAM_SIDE's schedule). Returns a new bf16 tensor of x's shape."""
    from .cascade import GRAM_SIDE, CascadeWorkspace, _safe_cast

    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2 or 0 in x.shape[-2:]:
        raise ValueError(f"x: expected a floating-point tensor [..., rows, cols] with rows, cols >= 1, got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}")
    cfg = GRAM_SIDE if restarts is None else dataclasses.replace(GRAM_SIDE, gram_side=tuple(restarts))
    lead = x.shape[:-2]
    x3 = x.reshape(-1, *x.shape[-2:])
    ws = CascadeWorkspace.for_shape(tuple(x3.shape), x.device)
    _safe_cast(x3, ws.X, True)
    y = gram_side_workspace(ws, maps=maps, config=cfg, margin=margin, eps=eps, backend=backend, compile=compile)
    return y.reshape(*lead, *y.shape[-2:])


# ------------------------------------------------------------------------------------------------
# The eager bf16 version (the difftest's floor for this path, and the study's R-precision variant)

def eager_gram_side_cascade(x: Tensor, *, restarts=None, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                            eps: float = FROBENIUS_EPS, gemm: str = "library", r_fp32: bool = False) -> Tensor:
    """The Gram-side cascade in plain eager torch with SAFE's normalization (as
    :func:`anvil_fast.eager.eager_bf16_cascade` with ``fp32_trace=True, prescale=True``): library
    matmuls (``gemm="library"``) or fp32 products of the bf16 operands (``"fp32"``), every product
    rounded once to bf16, ``Q (Q A)`` as two ``baddbmm`` without symmetrization. ``r_fp32``: keep R
    in fp32 (products with R in fp32, one rounding of the output) to measure what bf16 R costs.
    ``restarts``: default GRAM_SIDE's schedule."""
    from .cascade import GRAM_SIDE_RESTARTS
    from .eager import _BF16_MAX, _addmm, _gram, _mm

    restarts = GRAM_SIDE_RESTARTS if restarts is None else restarts
    maps_ = load_maps(maps)
    sched = check_restarts(restarts, len(maps_))
    lead = x.shape[:-2]
    X = x.reshape(-1, *x.shape[-2:]).float().clamp(-_BF16_MAX, _BF16_MAX).bfloat16()
    tall = X.size(-2) > X.size(-1)
    xf = X.float()
    s = torch.exp2(-torch.floor(torch.log2(xf.abs().amax(dim=(-2, -1), keepdim=True))).clamp(-126, 126))
    xf = xf * s
    d = xf.square().sum(dim=(-2, -1), keepdim=True).sqrt() * margin + eps * s
    X0 = (xf / d).bfloat16()
    A = _gram(X0, tall, gemm)
    eye = torch.eye(A.shape[-1], device=A.device)

    def apply_r(x0, r):
        if r_fp32:
            return (x0.float() @ r if tall else r @ x0.float()).bfloat16()
        return _mm(x0, r, gemm) if tall else _mm(r, x0, gemm)

    Rk = None
    for k, (a, b, c) in enumerate(maps_, start=1):
        if k in sched:
            X0 = apply_r(X0, Rk)
            A = _gram(X0, tall, gemm)
            Rk = None
        B = _addmm(b, A, c, A, A, gemm) if c != 0 else (A.float() * b).bfloat16()
        if Rk is None:
            Rk = B.float() + a * eye
            Rk = Rk if r_fp32 else Rk.bfloat16()
        elif r_fp32:
            Rk = a * Rk + (Rk @ B.float() if tall else B.float() @ Rk)
        else:
            Rk = _addmm(a, Rk, 1.0, Rk, B, gemm) if tall else _addmm(a, Rk, 1.0, B, Rk, gemm)
        if k < len(maps_) and k + 1 not in sched:
            P = _addmm(a, A, 1.0, B, A, gemm)
            A = _addmm(a, P, 1.0, B, P, gemm)
    Y = apply_r(X0, Rk)
    return Y.reshape(*lead, *Y.shape[-2:])


# ------------------------------------------------------------------------------------------------
# FLOPs

def cascade_flops(m: int, n: int, *, maps: int = len(ANVIL_MAPS), restarts=None, block: int = 128) -> dict[str, float]:
    """FLOPs of one matrix's cascade, standard and Gram side (``restarts``: default GRAM_SIDE's),
    with a symmetric product of T = ceil(k / block) tiles costing (T+1)/(2T) of a full one. Returns
    {"standard", "gram_side", "ratio"} (ratio = standard / gram_side)."""
    from .cascade import GRAM_SIDE_RESTARTS

    sched = GRAM_SIDE_RESTARTS if restarts is None else tuple(restarts)
    big, k = max(m, n), min(m, n)
    t = math.ceil(k / block)
    sym = (t + 1) / (2 * t)
    gram = 2 * big * k * k * sym
    sq = 2 * k ** 3
    standard = maps * (gram + sq * sym + 2 * big * k * k)
    # per map: B (sym); R update (full) except after a (re)start; P (full) and A (sym) unless the
    # next map restarts or this is the last; per restart: X_0 R (full) and its Gram; final X_0 R.
    starts = 1 + len(sched)
    updates = maps - 1 - len(sched)
    gs = gram + maps * sq * sym + (maps - starts) * sq + updates * (sq + sq * sym) \
        + len(sched) * (2 * big * k * k + gram) + 2 * big * k * k
    return {"standard": standard, "gram_side": gs, "ratio": standard / gs}


# ------------------------------------------------------------------------------------------------
# The error study that picks the default restart schedule

#: Study inputs: (name, family, shape). The issue's four inputs (one matrix each) and a near-rank-1
#: batch on a tall shape small enough for a CPU run (aspect 4, like the banks the dispatch picks).
STUDY_INPUTS = (
    ("Gaussian 2816x768", "gaussian", (1, 2816, 768)),
    ("sv 1..1e-3, 2816x768", "geometric", (1, 2816, 768)),
    ("Gaussian 768x768", "gaussian", (1, 768, 768)),
    ("sv 1..1e-3, 768x768", "geometric", (1, 768, 768)),
    ("near-rank-1 8x1024x256", "near_rank1", (8, 1024, 256)),
)
#: The rule's allowance: a schedule qualifies when, on every input the dispatch sends to the Gram side,
#: its error exceeds SAFE's by at most one bf16 rounding's worst relative RMS error
#: (anvil_fast.tolerances.RHO = 2**-8/sqrt(3): two bf16 paths of equal accuracy differ by about that
#: much on one draw), and no output explodes.
STUDY_ALLOWANCE = RHO


def study_schedules(n_maps: int = len(ANVIL_MAPS)) -> list[tuple[int, ...]]:
    """No restart, one restart before each map 2..K, and every pair."""
    singles = [(j,) for j in range(2, n_maps + 1)]
    pairs = [(i, j) for i in range(2, n_maps + 1) for j in range(i + 1, n_maps + 1)]
    return [()] + singles + pairs


def study_input(family: str, shape, *, seed: int = 0) -> Tensor:
    """A float32 batch of the study's family: "gaussian", "geometric" (singular values geometric from 1
    to 1e-3, random singular vectors) or "near_rank1" (:func:`anvil_fast.near_rank1.near_rank1`)."""
    b, m, n = shape
    g = torch.Generator().manual_seed(seed)
    if family == "gaussian":
        return torch.randn(shape, generator=g)
    if family == "geometric":
        k = min(m, n)
        s = torch.logspace(0.0, -3.0, k, dtype=torch.float64)
        u = torch.linalg.qr(torch.randn(b, m, k, generator=g, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(b, n, k, generator=g, dtype=torch.float64))[0]
        return ((u * s) @ v.mT).float()
    if family == "near_rank1":
        from .near_rank1 import near_rank1

        return near_rank1(b, m, n, seed=seed)
    raise ValueError(f"family: expected 'gaussian', 'geometric' or 'near_rank1', got {family!r}")


def choose_schedule(rows: list[dict]) -> tuple[int, ...]:
    """The rule: among schedules with no exploded output and an error at most SAFE's + STUDY_ALLOWANCE
    on every dispatched input, the fewest restarts; ties by the smallest worst excess over SAFE.
    ``rows``: the study's schedule rows ({"restarts", "excess_max", "exploded"}). Raises if none
    qualifies."""
    ok = [r for r in rows if r["exploded"] == 0 and r["excess_max"] <= STUDY_ALLOWANCE]
    if not ok:
        raise RuntimeError(f"no restart schedule is within SAFE's error + {STUDY_ALLOWANCE:.3g} on every input")
    best = min(ok, key=lambda r: (len(r["restarts"]), r["excess_max"]))
    return tuple(best["restarts"])


def study(inputs=STUDY_INPUTS, schedules=None, *, seed: int = 0, progress=None) -> dict:
    """Error vs the float64 cascade (max over matrices of the relative Frobenius error) of SAFE and of
    the Gram side for every schedule (run on every input, whatever the dispatch rule), on CPU (torch
    fallback: fp32 products of bf16 operands, one rounding each, the fast path's own arithmetic),
    plus the count of exploded outputs (top singular value > anvil_fast.near_rank1.EXPLODED;
    dispatched inputs) and the R-in-fp32 variant of the chosen schedule."""
    import anvil_ref as R_

    from .cascade import GRAM_SIDE, SAFE, fast_cascade
    from .difftest import rel_err
    from .near_rank1 import EXPLODED, top_singular_value

    schedules = study_schedules() if schedules is None else [tuple(s) for s in schedules]
    margin = GRAM_SIDE.margin()
    data = []
    for name, fam, shape in inputs:
        x = study_input(fam, shape, seed=seed)
        data.append((name, x, R_.cascade(x.bfloat16(), margin=margin)))

    def measure(label, fn):
        errs, boom = [], 0
        for name, x, ref in data:
            y = fn(x)
            errs.append(rel_err(y, ref))
            if uses_gram_side(x.shape):
                boom += int((top_singular_value(y.reshape(-1, *y.shape[-2:])) > EXPLODED).sum())
        if progress:
            progress(f"{label}: " + " ".join(f"{e:.4g}" for e in errs))
        return errs, boom

    safe_errs, safe_boom = measure("safe", lambda x: fast_cascade(x, config=SAFE, backend="torch"))
    rows = []
    for sched in schedules:
        errs, boom = measure(str(sched), lambda x, s=sched: fast_gram_side(x, restarts=s, backend="torch"))
        excess = [e - s for e, s, (_, x, _) in zip(errs, safe_errs, data) if uses_gram_side(x.shape)]
        rows.append({"restarts": list(sched), "errors": errs, "excess_max": max(excess), "exploded": boom})
    chosen = choose_schedule(rows)
    r32, r32_boom = measure(f"{chosen} R fp32", lambda x: eager_gram_side_cascade(
        x, restarts=chosen, margin=margin, gemm="fp32", r_fp32=True))
    r16, r16_boom = measure(f"{chosen} eager", lambda x: eager_gram_side_cascade(
        x, restarts=chosen, margin=margin, gemm="fp32"))
    return {"inputs": [n for n, _, _ in inputs], "safe": {"errors": safe_errs, "exploded": safe_boom},
            "schedules": rows, "chosen": list(chosen), "allowance": STUDY_ALLOWANCE,
            "dispatched": [uses_gram_side(x.shape) for _, x, _ in data],
            "r_precision": {"bf16": {"errors": r16, "exploded": r16_boom},
                            "fp32": {"errors": r32, "exploded": r32_boom}},
            "flops_2816x768": {"standard": cascade_flops(2816, 768)["standard"],
                               **{str(tuple(r["restarts"])):
                                  cascade_flops(2816, 768, restarts=r["restarts"])["gram_side"] for r in rows}}}


def study_markdown(res: dict, command: str) -> str:
    def sched(s):
        return "none" if not s else "before map " + ", ".join(map(str, s))
    f = res["flops_2816x768"]
    head = ["configuration", *res["inputs"], "exploded", "FLOPs vs SAFE, 2816x768", "768x768"]
    lines = [f"<!-- generated by `{command}` -->", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda es: [f"{e:.4f}" if e < 10 else f"{e:.2g}" if math.isfinite(e) else "inf" for e in es]  # noqa: E731
    lines.append("| SAFE (standard bf16) | " + " | ".join(fmt(res["safe"]["errors"]))
                 + f" | {res['safe']['exploded']} | 1 | 1 |")
    for r in res["schedules"]:
        mark = "**" if r["restarts"] == res["chosen"] else ""
        ratio = f["standard"] / f[str(tuple(r["restarts"]))]
        square = 1 / cascade_flops(768, 768, restarts=r["restarts"])["ratio"]
        lines.append(f"| {mark}Gram side, restart {sched(r['restarts'])}{mark} | " + " | ".join(fmt(r["errors"]))
                     + f" | {r['exploded']} | {1 / ratio:.2f} | {square:.2f} |")
    c = res["chosen"]
    for key, label in (("bf16", "R in bf16, eager"), ("fp32", "R in fp32, eager")):
        e = res["r_precision"][key]
        lines.append(f"| Gram side, restart {sched(c)}, {label} | " + " | ".join(fmt(e["errors"]))
                     + f" | {e['exploded']} | | |")
    lines += ["", "Relative Frobenius error against the float64 cascade of the same bf16 input (max over the "
              "input's matrices); CPU, fp32 products of bf16 operands rounded once (the fast path's torch "
              "fallback); SAFE's normalization for every row. *exploded*: outputs with a top singular value "
              "above 1.1 or a non-finite entry. FLOPs: `anvil_fast.gram_side.cascade_flops` (symmetric "
              "products at (T+1)/(2T) of a full one).", "",
              "Rule: among schedules with no exploded output and an error at most SAFE's + "
              f"{res['allowance']:.2e} (one bf16 rounding's worst RMS, 2^-8/sqrt(3)) on every input the dispatch "
              "sends to the Gram side (" + ", ".join(n for n, d in zip(res["inputs"], res["dispatched"]) if d)
              + "; the square inputs are shown, not judged), the fewest restarts, then the smallest worst excess. "
              f"Chosen: restart {sched(c)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.gram_side",
                                 description="The Gram-side cascade's error study (CPU, a few minutes).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("study", help="error vs the float64 cascade over restart schedules and spectra")
    st.add_argument("--out", default=None, help="write the Markdown table here (and the numbers next to it as .json)")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--from-json", default=None,
                    help="re-render the table from a stored study (the .json that --out writes) instead of running it")
    a = ap.parse_args(argv)
    if a.from_json:
        import json
        from pathlib import Path

        res = json.loads(Path(a.from_json).read_text())
        cmd = res.pop("generated_by")
    else:
        res = study(seed=a.seed, progress=lambda s: print(s, file=sys.stderr, flush=True))
        cmd = "python -m anvil_fast.gram_side study" + (f" --out {a.out}" if a.out else "") + \
            (f" --seed {a.seed}" if a.seed else "")
    md = study_markdown(res, cmd)
    print(md)
    if a.out:
        import json
        from pathlib import Path

        out = Path(a.out)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps({"generated_by": cmd, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
