"""The explosion tail at large counts: how many outputs of an orthogonalization have a top singular
value past EXPLODED_SIGMA, over millions of near-low-rank inputs at the bank shapes.

Deciding "sigma_max > limit" exactly takes an eigen-decomposition per matrix, which at 768 columns
costs far more than the cascade that made the matrix. A certified screen decides almost all of them
with matrix products alone. For the Gram ``G = Y^T Y`` (the smaller side, float64) and ``p = 2^s``,

    lambda_max(G)^p  <=  trace(G^p)  <=  n * lambda_max(G)^p,

so ``U = trace(G^p)^(1/(2p))`` bounds sigma_max from above and ``U / n^(1/(2p))`` from below
(:func:`top_singular_bounds`: ``s`` squarings of G, each renormalized by its trace so nothing
overflows, and the logarithms of those traces summed). Where ``U <= limit`` the matrix is below the
limit; where the lower bound is above it, past; only matrices between the two (at ``s = 8``, ``n = 768``:
a band 1.3% wide under U) get :func:`torch.linalg.eigvalsh` (:func:`count_past`). The bounds hold up to
float64 rounding of the products (relative ~1e-16 per product; ``s`` products).

    python -m anvil_fast.studies.tail --seconds 60 [--shapes 1536x384,3072x768] [--forms fast,eager,safe] [--no-progress]

Inputs (:func:`near_low_rank`): rank 1 to 4 with singular values down to 2^-8 of the first, plus (7 in
10 of them) Gaussian noise 2^-20 to 2^-6 of the RMS, the whole scaled by 2^-4 to 2^4: the inputs on
which the Gram side's rare explosions were found (NOTES, "The Gram side's rare explosions on the
spectrum probe"). Forms: ``fast`` the Gram side as shipped (``fast_gram_side``), ``eager`` its eager
bf16 Gram form (the harness's), ``safe`` SAFE's standard cascade.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
from torch import Tensor

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.progress import Progress

from anvil_fast.core.tolerances import EXPLODED_SIGMA
from anvil_fast.studies.harness import _grams as _gram  # the smaller Gram in float64, zero where not finite
from anvil_ref.provenance import source_commit

#: Squarings of the Gram in :func:`top_singular_bounds` (p = 256: the bounds' ratio is n^(1/512),
#: 1.3% at n = 768).
SQUARINGS = 8
SHAPES = ((1536, 384), (384, 1536), (1152, 384), (3072, 768))
FORMS = ("fast", "eager", "safe")


def top_singular_bounds(y: Tensor, *, squarings: int = SQUARINGS) -> tuple[Tensor, Tensor]:
    """``(lower, upper)`` float64 bounds of each matrix's top singular value (both inf where y is not
    finite, both 0 where it is zero): upper = trace(G^p)^(1/(2p)), lower = upper / n^(1/(2p)),
    p = 2^squarings."""
    if squarings < 0:
        raise ValueError(f"squarings must be >= 0, got {squarings}")
    g, finite = _gram(y)
    n = g.shape[-1]
    log_scale = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
    for j in range(squarings + 1):
        # g holds G^(2^j) divided by its trace so far, so its entries stay within [0, 1] whatever G's scale;
        # log_scale gathers the traces divided out: log trace(G^(2^j)) after step j
        t = torch.diagonal(g, dim1=-2, dim2=-1).sum(-1)
        zero = t <= 0
        t = torch.where(zero, torch.ones_like(t), t)
        log_scale = torch.where(zero, torch.full_like(t, -math.inf), log_scale * 2 + torch.log(t))
        if j < squarings:
            g = g / t[:, None, None]
            g = g @ g
    p = 2.0 ** squarings
    upper = torch.exp(log_scale / (2 * p))
    lower = upper / n ** (1 / (2 * p))
    inf = torch.full_like(upper, math.inf)
    return torch.where(finite, lower, inf), torch.where(finite, upper, inf)


def count_past(y: Tensor, limit: float = EXPLODED_SIGMA, *, squarings: int = SQUARINGS) -> dict:
    """How many matrices of ``y`` have a top singular value past ``limit`` (a non-finite matrix counts
    as past): ``past``, ``nonfinite``, ``exact`` (matrices the bounds left undecided, decided by
    eigvalsh), ``max_upper`` (the largest finite upper bound)."""
    lower, upper = top_singular_bounds(y, squarings=squarings)
    nonfinite = torch.isinf(upper)
    past = (lower > limit) | nonfinite
    open_ = ~past & (upper > limit)
    exact = int(open_.sum())
    if exact:
        g, _ = _gram(y.reshape(-1, *y.shape[-2:])[open_])
        top = torch.linalg.eigvalsh(g)[..., -1].clamp_min(0).sqrt()
        past[open_] = top > limit
    fin = upper[~nonfinite]
    return {"past": int(past.sum()), "nonfinite": int(nonfinite.sum()), "exact": exact,
            "max_upper": float(fin.max()) if fin.numel() else 0.0}


def near_low_rank(batch: int, m: int, n: int, *, generator: torch.Generator, device) -> Tensor:
    """The module docstring's inputs, float32."""
    g = generator
    r = torch.randint(1, 5, (batch, 1, 1), device=device, generator=g)
    s = torch.exp2(-8 * torch.rand(batch, 1, 4, device=device, generator=g))
    s[..., 0] = 1
    s = s * (torch.arange(4, device=device)[None, None] < r)
    u = torch.randn(batch, m, 4, device=device, generator=g)
    v = torch.randn(batch, n, 4, device=device, generator=g)
    x = (u * s) @ v.mT
    rms = x.norm(dim=(-2, -1), keepdim=True) / (m * n) ** 0.5
    tau = torch.exp2(-20 + 14 * torch.rand(batch, 1, 1, device=device, generator=g)) * rms
    noisy = torch.rand(batch, 1, 1, device=device, generator=g) < 0.7
    x = x + tau * torch.randn(batch, m, n, device=device, generator=g) * noisy
    return x * torch.exp2(8 * torch.rand(batch, 1, 1, device=device, generator=g) - 4)


def forms(device) -> dict:
    from anvil_fast.core.cascade import CONFIGS, fast_cascade, fast_gram_side
    from anvil_fast.studies import adapters as A
    from anvil_fast.studies import harness as H

    impl = A._anvil("gram_side")(device, "auto")
    return {"fast": lambda x: fast_gram_side(x, maps="anvil"),
            "eager": lambda x: H.eager_declared(x, impl.math, form=H.GRAM_FORMS[0]),
            "safe": lambda x: fast_cascade(x, maps="anvil", config=CONFIGS["safe"])}


def run(shapes, names, *, seconds: float, batch: int | None, seed: int, device, squarings: int = SQUARINGS,
        progress: bool | None = None) -> list[dict]:
    """Each shape for ``seconds`` of fresh batches, every form on the same inputs: one row per (shape, form).
    ``progress``: as anvil_ref.progress.Progress's ``enabled``."""
    with Progress(len(shapes), "tail", enabled=progress) as bar:
        return _run(shapes, names, seconds=seconds, batch=batch, seed=seed, device=device, squarings=squarings,
                    bar=bar)


def _run(shapes, names, *, seconds, batch, seed, device, squarings, bar) -> list[dict]:
    fns = forms(device)
    rows = []
    for i, (m, n) in enumerate(shapes):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        b = batch or max(1, min(256, 2 ** 26 // (m * n)))
        acc = {f: {"past": 0, "nonfinite": 0, "exact": 0, "max_upper": 0.0} for f in names}
        count, t0 = 0, time.perf_counter()
        while count == 0 or time.perf_counter() - t0 < seconds:
            x = near_low_rank(b, m, n, generator=gen, device=device)
            count += b
            bar.update(i + min(1.0, (time.perf_counter() - t0) / seconds if seconds > 0 else 1.0),
                       label=f"{m}x{n}", detail=f"{count:,} matrices")
            for f in names:
                c = count_past(fns[f](x), squarings=squarings)
                a = acc[f]
                a["past"] += c["past"]
                a["nonfinite"] += c["nonfinite"]
                a["exact"] += c["exact"]
                a["max_upper"] = max(a["max_upper"], c["max_upper"])
        wall = time.perf_counter() - t0
        for f in names:
            rows.append({"shape": f"{m}x{n}", "form": f, "matrices": count, "wall_s": round(wall, 1),
                         "seed": seed, "limit": EXPLODED_SIGMA, **acc[f]})
            r = rows[-1]
            print(f"{r['shape']:>10} {f:>6}: {r['past']} of {count:,} past {EXPLODED_SIGMA} "
                  f"({r['nonfinite']} non-finite; {r['exact']} decided by eigvalsh; largest upper bound "
                  f"{r['max_upper']:.4f}; {wall:.0f} s for the shape)", flush=True)
    return rows


def _shape(s: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is ROWSxCOLS, got {s!r}") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"a shape's sides must be >= 1, got {s!r}")
    return m, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.tail", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--seconds", type=float, default=60.0, help="per shape (at least one batch)")
    ap.add_argument("--batch", type=int, default=None, help="matrices per batch (default: 2^26 entries, at most 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--squarings", type=int, default=SQUARINGS)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--json", default=None, help="write the rows here")
    add_progress_flags(ap)
    a = ap.parse_args(argv)
    try:
        shapes = [_shape(s) for s in a.shapes.split(",")]
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    names = a.forms.split(",")
    bad = [f for f in names if f not in FORMS]
    if bad:
        ap.error(f"--forms: unknown {bad}; known: {', '.join(FORMS)}")
    if a.squarings < 0 or a.seconds < 0 or (a.batch is not None and a.batch < 1):
        ap.error("--squarings and --seconds must be >= 0, --batch >= 1")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = run(shapes, names, seconds=a.seconds, batch=a.batch, seed=a.seed, device=device, squarings=a.squarings,
               progress=a.progress)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": "python -m anvil_fast.studies.tail " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "commit": source_commit(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
