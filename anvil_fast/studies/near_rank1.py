"""The near-rank-1 study: how often each cascade path explodes on rank-1-plus-noise input, and why.

Input: ``u v^T + noise * N(0, 1)`` with Gaussian u, v (entries of the rank-1 part ~ 1) and
``noise = 1e-4``, so ``sigma_max / ||X||_F = 1 - O(1e-8)``: after the normalization the top singular
value sits at the end of the maps' interval, ``1 / margin`` (see anvil_fast/core/cascade.py).

Paths (rows of the table):

``fp64``             the cascade in float64 (torch matmuls; the reference's math)
``eager-bf16``       anvil_fast.core.eager.eager_bf16_cascade: the seed in eager torch (cuBLAS on a GPU)
``fast-faithful``    anvil_fast.core.cascade with FAITHFUL (the seed's roundings, Triton Gram kernels)
``+fp32-trace``      FAITHFUL with the trace from the fp32 sum of squares (ablation)
``+slack``           FAITHFUL with the margin widened by SAFE_MARGIN_SLACK (ablation)
``fast-safe``        anvil_fast.core.cascade with SAFE (the default)
``fast-gram-side``   anvil_fast.core.cascade with GRAM_SIDE (the Gram side on shapes its dispatch rule picks,
                     else SAFE)

Columns: how many outputs have top singular value > 1.1 ("exploded") or a non-finite entry; the
largest and the median top singular value; and the mechanism -- ``dtr``, the relative error of the
seed's trace (sum of the bf16-rounded Gram diagonal) against the exact ``||X||_F^2`` of the bf16 X:
the explosion rate among inputs whose trace rounded down by more than 1e-4 (``dtr < -1e-4``, so
sigma_max/d is pushed past 1/margin by > 5e-5) against the rest.

``python -m anvil_fast.studies.near_rank1 --count 500`` (``--help`` for shapes and device).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch
from torch import Tensor

from anvil_ref.cli_args import add_progress_flags, check_device, name_list, positive_int, shape_list
from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN, SAFE_MARGIN_SLACK

from anvil_fast.core.cascade import FAITHFUL, GRAM_SIDE, SAFE, fast_cascade
from anvil_fast.core.eager import eager_bf16_cascade
from anvil_fast.core.tolerances import EXPLODED_SIGMA

NOISE = 1e-4
#: Top singular value above which an output counts as exploded (anvil_fast/core/tolerances.py derives it).
EXPLODED = EXPLODED_SIGMA
#: The paths of the table, in its order (:func:`paths` builds them).
PATHS = ("fp64", "eager-bf16", "fast-faithful", "+fp32-trace", "+slack", "fast-safe", "fast-gram-side")
ABLATIONS = {
    "+fp32-trace": dataclasses.replace(FAITHFUL, name="faithful+fp32trace", fp32_trace=True),
    "+slack": dataclasses.replace(FAITHFUL, name="faithful+slack", margin_slack=SAFE_MARGIN_SLACK),
}


def near_rank1(count: int, m: int, n: int, *, seed: int = 0, noise: float = NOISE, device="cpu") -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, m, 1, generator=g) * torch.randn(count, 1, n, generator=g)
    return (x + noise * torch.randn(count, m, n, generator=g)).to(device)


def cascade_in(x: Tensor, dtype: torch.dtype, *, margin: float = FROBENIUS_MARGIN, eps: float = FROBENIUS_EPS) -> Tensor:
    """The cascade's math in one floating-point type (float64: the reference on any device)."""
    X = x.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    gram = (lambda z: z.mT @ z) if tall else (lambda z: z @ z.mT)
    d = X.square().sum(dim=(-2, -1), keepdim=True).sqrt() * margin + eps
    X = X / d
    for a, b, c in ANVIL_MAPS:
        A = gram(X)
        B = b * A + c * (A @ A)
        X = a * X + (X @ B if tall else B @ X)
    return X


def top_singular_value(y: Tensor) -> Tensor:
    """sigma_max per matrix (float64; inf where y has a non-finite entry), via the smaller Gram."""
    yd = y.double()
    finite = torch.isfinite(yd).flatten(1).all(dim=1)
    yd = torch.where(finite[:, None, None], yd, torch.zeros((), dtype=yd.dtype, device=yd.device))
    g = yd.mT @ yd if yd.shape[-2] > yd.shape[-1] else yd @ yd.mT
    s = torch.linalg.eigvalsh(g)[..., -1].clamp_min(0).sqrt()
    return torch.where(finite, s, torch.full_like(s, math.inf)).cpu()


def trace_error(x: Tensor) -> Tensor:
    """Relative error of the seed's trace (bf16-rounded Gram diagonal, summed in fp32) against the
    exact sum of squares of the bf16 X."""
    X = x.to(torch.bfloat16)
    tall = X.shape[-2] > X.shape[-1]
    A = X.mT @ X if tall else X @ X.mT
    tr = A.diagonal(dim1=-2, dim2=-1).float().sum(-1).double()
    exact = X.double().square().sum(dim=(-2, -1))
    return (tr / exact - 1).cpu()


def paths(device) -> dict:
    p = {"fp64": lambda x: cascade_in(x, torch.float64),
         "eager-bf16": lambda x: eager_bf16_cascade(x),
         "fast-faithful": lambda x: fast_cascade(x, config=FAITHFUL)}
    for name, cfg in ABLATIONS.items():
        p[name] = (lambda c: (lambda x: fast_cascade(x, config=c)))(cfg)
    p["fast-safe"] = lambda x: fast_cascade(x, config=SAFE)
    p["fast-gram-side"] = lambda x: fast_cascade(x, config=GRAM_SIDE)
    return p


def study(shapes, count: int, *, batch: int = 100, seed: int = 0, device="cpu", only=None,
          progress: bool | None = None) -> list[dict]:
    """The table's rows; ``only``: a subset of :data:`PATHS` (an unknown name is an error);
    ``progress``: as anvil_ref.progress.Progress's ``enabled`` (None: a bar in a terminal, a line per
    shape and batch in a pipe)."""
    from anvil_ref.progress import Progress

    unknown = sorted(set(only or ()) - set(PATHS))
    if unknown:
        raise ValueError(f"only: unknown paths {unknown}; expected a subset of {PATHS}")
    rows = []
    starts = range(0, count, batch)
    with Progress(len(shapes) * len(starts), "near_rank1", enabled=progress) as bar:
        for i, (m, n) in enumerate(shapes):
            sig = {k: [] for k in paths(device) if only is None or k in only}
            dtr = []
            for j, start in enumerate(starts):
                bar.update(i * len(starts) + j, label=f"near_rank1: {m}x{n}, inputs {start}..{min(start + batch, count)} "
                                                      f"of {count}")
                b = min(batch, count - start)
                x = near_rank1(b, m, n, seed=seed + 1000 * start + m * 7 + n, device=device)
                dtr.append(trace_error(x))
                for name, fn in paths(device).items():
                    if name in sig:
                        sig[name].append(top_singular_value(fn(x)))
            dtr_t = torch.cat(dtr)
            down = dtr_t < -1e-4
            for name, parts in sig.items():
                s = torch.cat(parts)
                bad = s > EXPLODED
                rows.append(dict(shape=f"{m}x{n}", path=name, count=len(s), exploded=int(bad.sum()),
                                 nonfinite=int((~torch.isfinite(s)).sum()), max=float(s.max()),
                                 median=float(s.median()),
                                 rate_down=float(bad[down].double().mean()) if down.any() else float("nan"),
                                 rate_rest=float(bad[~down].double().mean()) if (~down).any() else float("nan"),
                                 frac_down=float(down.double().mean())))
        bar.update(len(shapes) * len(starts))
    return rows


def format_rows(rows) -> str:
    head = (f"{'shape':<10} {'path':<14} {'exploded':>9} {'nonfinite':>9} {'max sigma':>11} {'median':>8} "
            f"{'P(dtr<-1e-4)':>12} {'rate|down':>9} {'rate|rest':>9}")
    out = [head, "-" * len(head)]
    tot: dict[str, list[int]] = {}
    for r in rows:
        out.append(f"{r['shape']:<10} {r['path']:<14} {r['exploded']:>5}/{r['count']:<4}{r['nonfinite']:>8} "
                   f"{r['max']:>11.4g} {r['median']:>8.5f} {r['frac_down']:>12.3f} {r['rate_down']:>9.3f} "
                   f"{r['rate_rest']:>9.3f}")
        t = tot.setdefault(r["path"], [0, 0, 0])
        t[0] += r["exploded"]
        t[1] += r["count"]
        t[2] += r["nonfinite"]
    out.append("totals: " + "; ".join(f"{k} {v[0]}/{v[1]} exploded ({v[2]} non-finite)" for k, v in tot.items()))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.near_rank1", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=shape_list(2, form="ROWSxCOLS"), default="256x768,768x768,2816x768,96x96",
                    help="comma-separated ROWSxCOLS (default: %(default)s)")
    ap.add_argument("--count", type=positive_int, default=500, help="inputs per shape (default: %(default)s)")
    ap.add_argument("--batch", type=positive_int, default=100, help="inputs per call (default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device (default: %(default)s)")
    ap.add_argument("--paths", type=name_list(PATHS, what="path"), default=None,
                    help="comma-separated subset of: " + ", ".join(PATHS) + " (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: %(default)s)")
    add_progress_flags(ap)
    a = ap.parse_args(argv)
    check_device(ap, a.device)
    t0 = time.time()
    rows = study(a.shapes, a.count, batch=a.batch, seed=a.seed, device=a.device, only=a.paths, progress=a.progress)
    print(format_rows(rows))
    print(f"device {a.device}, noise {NOISE}, exploded = top singular value > {EXPLODED}; {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
