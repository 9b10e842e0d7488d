"""The Gram-side cascade's error study: which restart schedule the GRAM_SIDE configuration uses.

    python -m anvil_fast.studies.gram_side_study [--out papers/data/gram_side_study.md] [--seed 0]

Error of every restart schedule (none, one before each map, two) against the float64 cascade on a
few spectra, next to SAFE's standard bf16 cascade; :func:`choose_schedule` states the rule that
picks the default (:data:`anvil_fast.core.gram_side.GRAM_SIDE_RESTARTS`). CPU, a few minutes.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import Tensor

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.constants import ANVIL_MAPS
from anvil_ref.progress import Progress

from anvil_fast.core.cascade import GRAM_SIDE, SAFE, fast_cascade, fast_gram_side
from .difftest import rel_err
from anvil_fast.core.gram_side import cascade_flops, eager_gram_side_cascade, uses_gram_side
from .near_rank1 import EXPLODED, top_singular_value
from anvil_fast.core.tolerances import RHO


#: Study inputs: (name, family, shape). Four single matrices (Gaussian and a geometric spectrum, tall
#: and square) and a near-rank-1 batch on a tall shape small enough for a CPU run (aspect 4, like the
#: banks the dispatch picks).
STUDY_INPUTS = (
    ("Gaussian 2816x768", "gaussian", (1, 2816, 768)),
    ("sv 1..1e-3, 2816x768", "geometric", (1, 2816, 768)),
    ("Gaussian 768x768", "gaussian", (1, 768, 768)),
    ("sv 1..1e-3, 768x768", "geometric", (1, 768, 768)),
    ("near-rank-1 8x1024x256", "near_rank1", (8, 1024, 256)),
)
#: The rule's allowance: a schedule qualifies when, on every input the dispatch sends to the Gram side,
#: its error exceeds SAFE's by at most one bf16 rounding's worst relative RMS error
#: (anvil_fast.core.tolerances.RHO = 2**-8/sqrt(3): two bf16 paths of equal accuracy differ by about that
#: much on one draw), and no output explodes.
STUDY_ALLOWANCE = RHO


def study_schedules(n_maps: int = len(ANVIL_MAPS)) -> list[tuple[int, ...]]:
    """No restart, one restart before each map 2..K, and every pair."""
    singles = [(j,) for j in range(2, n_maps + 1)]
    pairs = [(i, j) for i in range(2, n_maps + 1) for j in range(i + 1, n_maps + 1)]
    return [()] + singles + pairs


def study_input(family: str, shape, *, seed: int = 0) -> Tensor:
    """A float32 batch of the study's family: "gaussian", "geometric" (singular values geometric from 1
    to 1e-3, random singular vectors) or "near_rank1" (:func:`anvil_fast.studies.near_rank1.near_rank1`)."""
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
    plus the count of exploded outputs (top singular value > anvil_fast.studies.near_rank1.EXPLODED;
    dispatched inputs) and the R-in-fp32 variant of the chosen schedule."""
    import anvil_ref as R_


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
              "above 1.1 or a non-finite entry. FLOPs: `anvil_fast.core.gram_side.cascade_flops` (symmetric "
              "products at (T+1)/(2T) of a full one).", "",
              "Rule: among schedules with no exploded output and an error at most SAFE's + "
              f"{res['allowance']:.2e} (one bf16 rounding's worst RMS, 2^-8/sqrt(3)) on every input the dispatch "
              "sends to the Gram side (" + ", ".join(n for n, d in zip(res["inputs"], res["dispatched"]) if d)
              + "; the square inputs are shown, not judged), the fewest restarts, then the smallest worst excess. "
              f"Chosen: restart {sched(c)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.gram_side_study",
                                 description="The Gram-side cascade's error study: error vs the float64 cascade over restart "
                                 "schedules and spectra (CPU, a few minutes).")
    ap.add_argument("--out", default=None, help="write the Markdown table here (and the numbers next to it as .json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-json", default=None,
                    help="re-render the table from a stored study (the .json that --out writes) instead of running it")
    add_progress_flags(ap)
    a = ap.parse_args(argv)
    if a.from_json:
        import json
        from pathlib import Path

        res = json.loads(Path(a.from_json).read_text())
        cmd = res.pop("generated_by")
    else:
        with Progress(len(study_schedules()) + 3, "gram_side_study", enabled=a.progress) as bar:
            # one line per measured schedule in a pipe: its label and its errors
            res = study(seed=a.seed, progress=lambda s: bar.update(advance=1, label=s))
        cmd = "python -m anvil_fast.studies.gram_side_study" + (f" --out {a.out}" if a.out else "") + \
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
