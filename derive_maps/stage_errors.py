"""Measured per-stage rounding errors of the fast SAFE cascade, against the robust certificate's model.

The cross-talk model (:mod:`derive_maps.robust`) bounds how far one stage of the bf16 cascade can
move the singular values: ``|sigma_i(X') - |p|(sigma(X))_i| <= eps`` (both sorted), with ``eps``
from :func:`derive_maps.robust.weyl_eps`. This measures it: the normalization, then every map, run
with the fast path's own kernels (:func:`anvil_fast.kernels.gram.XTX`/``XXT``, ``ba_plus_cAA``,
``aX_plus_mm``, the SAFE normalization) on a bf16 bank, each stage compared with the float64
application of the same map to the *same* bf16 input (stage-local error: earlier roundings are not
counted twice), and ``eps`` evaluated with that input's own norms (``||X||_F``, ``||X X^T||_F``,
``||X||_2``, ``||h(X X^T)||_F``, ``||p(X)||_F``, computed in float64 and widened by a relative 1e-12):

* trace: ``|d_fast^2 / d_64^2 - 1|`` (``d = margin sqrt(tr) + eps``, the squared ratio is the trace's
  relative error plus the model's roundings of sqrt, margin and product), against ``delta0``;
* stage k: the largest sorted singular-value difference of the bf16 output against the float64 one
  (absolute), against the model's ``eps`` (worst ratio over the bank's matrices).

``python -m derive_maps.stage_errors`` prints the table on the available device.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN
from anvil_ref.progress import Progress

from .intervals import DTYPE
from .robust import RoundingModel, rounding_model, weyl_eps


@dataclass(frozen=True)
class StageError:
    stage: int              #: 0: the normalization's trace; k >= 1: map k
    measured: float         #: worst over the bank's matrices (of measured / bound: the one reported)
    bound: float            #: the model's bound for the same matrix

    def as_dict(self) -> dict:
        return asdict(self)


def _widen(x: np.ndarray) -> tuple:
    x = np.asarray(x, dtype=np.float64)
    return (x * (1 - 1e-12)).astype(DTYPE), (x * (1 + 1e-12)).astype(DTYPE)


def stage_bound(X: Tensor, coeffs, model: RoundingModel, *, tall: bool) -> np.ndarray:
    """The model's ``eps`` for one stage on each matrix of the float64 bank ``X`` (its own norms)."""
    a, b, c = (float(v) for v in coeffs)
    A = X.mT @ X if tall else X @ X.mT
    hA = b * A + c * (A @ A)
    P = a * X + (X @ hA if tall else hA @ X)
    nrm = lambda M: torch.linalg.matrix_norm(M).cpu().numpy()  # noqa: E731
    e = weyl_eps(coeffs, model, nsq=_widen(nrm(X) ** 2), AF=_widen(nrm(A)),
                 X2=_widen(torch.linalg.matrix_norm(X, ord=2).cpu().numpy()), hAF=_widen(nrm(hA)), pF=_widen(nrm(P)))
    return e[1].astype(np.float64)


def _gram64(X: Tensor, tall: bool) -> Tensor:
    return X.mT @ X if tall else X @ X.mT


def measure(x: Tensor, *, maps=ANVIL_MAPS, model: RoundingModel | None = None, backend: str = "auto",
            slack: float | None = None) -> list[StageError]:
    """Per-stage measured errors and bounds for the bank ``x`` ([batch, rows, cols], cast to bf16);
    ``model`` defaults to SAFE's for general ``rows x cols`` matrices."""
    from anvil_fast.core.cascade import SAFE, CascadeWorkspace, is_tall, normalize_workspace
    from anvil_fast.kernels.gram import XTX, XXT, aX_plus_mm, ba_plus_cAA
    from anvil_fast.kernels.backend import use_triton

    if x.ndim != 3:
        raise ValueError(f"x: expected a bank [batch, rows, cols], got shape {tuple(x.shape)}")
    X0 = x.to(torch.bfloat16).contiguous()
    batch, rows, cols = X0.shape
    model = model or rounding_model("safe", rows=rows, cols=cols)
    cfg = SAFE if slack is None else dataclasses.replace(SAFE, margin_slack=slack)
    margin = cfg.margin(FROBENIUS_MARGIN)
    tall = is_tall(X0.shape)
    ws = CascadeWorkspace.for_shape(tuple(X0.shape), X0.device)
    ws.X.copy_(X0)
    normalize_workspace(ws, cfg, margin=FROBENIUS_MARGIN, eps=FROBENIUS_EPS, backend=backend, compile=False,
                        partials_ready=False)
    if use_triton(ws.X, backend):
        d_fast = ws.partials.d.double().flatten()
    else:
        s = ws.scale.float()
        xf = X0.float() * s
        d_fast = (xf.square().sum(dim=(-2, -1), keepdim=True).sqrt() * torch.tensor(margin, dtype=torch.float32)
                  + FROBENIUS_EPS * s).double().flatten()
    s64 = ws.scale.double()
    x64 = X0.double() * s64
    d64 = (x64.square().sum(dim=(-2, -1)).sqrt() * margin + FROBENIUS_EPS * s64.flatten())
    out = [StageError(0, float((d_fast.square() / d64.square() - 1).abs().max()), model.delta0)]
    gram = XTX if tall else XXT
    X = ws.X.clone()
    for k, (a, b, c) in enumerate(maps, start=1):
        A = gram(X, backend=backend)
        B = ba_plus_cAA(A, alpha=c, beta=b, backend=backend)
        C = aX_plus_mm(X, X, B, a=a, backend=backend) if tall else aX_plus_mm(X, B, X, a=a, backend=backend)
        X64 = X.double()
        A64 = _gram64(X64, tall)
        B64 = b * A64 + c * (A64 @ A64)
        Y64 = a * X64 + (X64 @ B64 if tall else B64 @ X64)
        s_ex = torch.linalg.svdvals(Y64).cpu().numpy()
        s_fast = torch.linalg.svdvals(C.double()).cpu().numpy()
        measured = np.abs(s_fast - s_ex).max(1)
        bound = stage_bound(X64, (a, b, c), model, tall=tall)
        i = int(np.argmax(np.divide(measured, bound, out=np.full_like(measured, np.inf), where=bound > 0)))
        out.append(StageError(k, float(measured[i]), float(bound[i])))
        X = C
    return out


def main(argv=None) -> int:
    from anvil_fast.studies.near_rank1 import near_rank1
    p = argparse.ArgumentParser(prog="python -m derive_maps.stage_errors", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=768, help="matrix rows")
    p.add_argument("--cols", type=int, default=768, help="matrix columns")
    p.add_argument("--batch", type=int, default=8, help="matrices per bank")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    add_progress_flags(p)
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    banks = {"random": torch.randn(a.batch, a.rows, a.cols, generator=g),
             "near_rank1": near_rank1(a.batch, a.rows, a.cols, seed=1)}
    lines = [f"{'bank':>11} | stage | measured   | model bound"]
    with Progress(len(banks), "stage errors", enabled=a.progress) as bar:
        for name, x in banks.items():
            bar.update(label=f"stage errors: {name} bank")
            for r in measure(x.to(a.device)):
                lines.append(f"{name:>11} | {r.stage:5d} | {r.measured:10.3g} | {r.bound:10.3g}")
            bar.update(advance=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
