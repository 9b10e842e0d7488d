"""The paper's table of other libraries' orthogonalizations (section 6.1), rendered from the JSON the
harness writes (``python -m anvil_fast.studies.difftest --adapter ... --json``, :mod:`anvil_fast.studies.harness`),
kept under results/ (:data:`SOURCE`).

Per (adapter, shape), from its rows: the error against its own math in float64 on the
well-conditioned family next to the plain eager bf16 run of that math and the derived bound; the
error against the exact polar factor on the Gaussian family next to the float64 math's own; the
singular-value range there; the explosions on the near-rank-1 family; the median time per call; the
verdict of the harness's rule over every family measured. The last column states, by fixed rules on
those numbers (:func:`classify`), whether the kernel is as accurate as its math allows, whether its
math limits it, and whether it explodes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The H200 run's JSON (written by :data:`COMMAND`, run from the repository root).
SOURCE = "results/h200_orthogonalizers/orthogonalizers.json"
#: The adapters of the paper's run: every one the harness has (``all``), on the bank shapes.
SHAPES = "4x256x768,4x768x768,2x2816x768,2x768x3072,1x4096x4096"
FAMILIES = "gaussian,well_conditioned,near_rank1"
COMMAND = (f"python -m anvil_fast.studies.difftest --adapter all --shapes {SHAPES} --families {FAMILIES} "
           f"--near-rank1-count 8 --time-reps 10 --time-limit 200 --no-progress --json {SOURCE}")
#: A kernel's error against its own math within this factor of the eager bf16 run counts as "as
#: accurate as its math allows" (the harness's own factor, anvil_fast.core.tolerances.FACTOR).
AS_ACCURATE = 2.0
#: Its math limits it where the float64 math's own distance from the polar factor is at least this
#: share of the kernel's.
MATH_SHARE = 0.5


def load(path: Path | None = None) -> dict | None:
    p = ROOT / SOURCE if path is None else path
    return json.loads(p.read_text()) if p.is_file() else None


def _f(v, fmt=".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def summarize(data: dict) -> list[dict]:
    """One entry per (adapter, shape), in the run's order."""
    out: dict[tuple, dict] = {}
    for r in data["rows"]:
        key = (r["impl"], "x".join(map(str, r["shape"][1:])))
        e = out.setdefault(key, {"impl": key[0], "shape": key[1], "verdicts": [], "families": {}})
        e["families"][r["family"]] = r
        e["verdicts"].append(r["verdict"])
    return list(out.values())


def classify(e: dict) -> str:
    """The plain statement of the last column, from the entry's numbers."""
    wc, g, nr = (e["families"].get(f) for f in ("well_conditioned", "gaussian", "near_rank1"))
    words = []
    if wc and wc.get("fast") is not None and wc.get("eager"):
        ratio = wc["fast"] / wc["eager"]
        words.append("as accurate as its math allows" if ratio <= AS_ACCURATE else
                     f"{ratio:.1f}x the bf16 error of its math")
        if wc.get("bound") is not None and wc["eager"] > wc["bound"]:
            words.append(f"its math magnifies bf16 rounding past the first-order bound ({_f(wc['eager'])} > "
                         f"{_f(wc['bound'])})")
    if g and g.get("polar") is not None and g.get("math_polar") is not None:
        if g["math_polar"] >= MATH_SHARE * g["polar"]:
            words.append(f"its math limits it ({_f(g['math_polar'], '.2g')} from the polar factor in float64)")
        else:
            words.append("its rounding limits it")
    if nr and nr.get("exploded"):
        words.append(f"explodes on {nr['exploded']}/{nr['count']} near-rank-1 inputs")
    if any(v == "FAIL" for v in e["verdicts"]):
        bad = [f for f, r in e["families"].items() if r["verdict"] == "FAIL"]
        words.append("FAIL on " + ", ".join(bad))
    return "; ".join(words) or "-"


def table(data: dict | None = None) -> str:
    data = load() if data is None else data
    if data is None:
        return f"*(no data yet: `{SOURCE}` is written by `{COMMAND}`)*"
    head = ("| adapter | shape | err vs its math (well-cond.) | eager bf16 of its math | derived bound | "
            "err vs polar (Gaussian) | its math vs polar | sv min/mean/max | exploded (near-rank-1) | ms | "
            "verdict | what limits it |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for e in summarize(data):
        wc, g, nr = (e["families"].get(f) or {} for f in ("well_conditioned", "gaussian", "near_rank1"))
        sv = "-" if g.get("sv_mean") is None else f"{g['sv_min']:.2f}/{g['sv_mean']:.2f}/{g['sv_max']:.2f}"
        ok = sum(v == "ok" for v in e["verdicts"])
        exploded = "-" if not nr else f"{nr['exploded']}/{nr['count']}"
        lines.append(f"| {e['impl']} | {e['shape']} | {_f(wc.get('fast'))} | {_f(wc.get('eager'))} | "
                     f"{_f(wc.get('bound'))} | {_f(g.get('polar'))} | {_f(g.get('math_polar'))} | {sv} | "
                     f"{exploded} | {_f(g.get('ms'), '.3f')} | {ok}/{len(e['verdicts'])} ok | {classify(e)} |")
    notes = [f"*Generated from `{SOURCE}` ({data.get('device', '?')}, torch {data.get('torch', '?')}), "
             f"written by `{data.get('generated_by', COMMAND)}`"
             + ("" if data.get("complete", True) else "; the run stopped at its time limit before every row") + ".*"]
    if data.get("unavailable"):
        notes.append("*Not run there: " + "; ".join(f"{k} ({v})" for k, v in sorted(data["unavailable"].items())) + ".*")
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes)


def values(data: dict | None = None) -> dict[str, str]:
    data = load() if data is None else data
    return {"peers_command": f"`{COMMAND}`",
            "peers_adapters": "no adapters yet" if data is None else str(len(data.get("implementations", {})))}


def tables() -> dict:
    return {"peers": table}
