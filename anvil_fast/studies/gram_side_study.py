"""The Gram-side cascade's error study: which restart schedule the GRAM_SIDE configuration uses.

    python -m anvil_fast.studies.gram_side_study [--out papers/data/gram_side_study.md] [--seed 0] [--maps NAME]
    python -m anvil_fast.studies.gram_side_study --schedules anvil_fast/core/gram_side_schedules.json

Error of every restart schedule (none, one before each map, two) against the float64 cascade on a
few spectra, next to SAFE's standard bf16 cascade; :func:`choose_schedule` states the rule that
picks the schedule: ANVIL_MAPS' is the default (:data:`anvil_fast.core.gram_side.GRAM_SIDE_RESTARTS`).
A schedule belongs to a map set (a map with a larger slope at 0 amplifies the rounding of the Gram
more between restarts), so ``--schedules`` runs the study on every map set the package names and
writes the table GRAM_SIDE takes its schedules from (:func:`anvil_fast.core.gram_side.studied_restarts`).
CPU, about two minutes per map set.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import Tensor

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.constants import ANVIL_MAPS
from anvil_ref.maps import MapsLike, load_maps
from anvil_ref.progress import Progress

from anvil_fast.core.cascade import GRAM_SIDE, SAFE, fast_cascade, fast_gram_side
from .difftest import rel_err
from anvil_fast.core.gram_side import cascade_flops, eager_gram_side_cascade, uses_gram_side
from .near_rank1 import top_singular_value
from anvil_fast.core.tolerances import RHO, exploded_sigma


#: Study inputs: (name, family, shape). Four single matrices (Gaussian and a geometric spectrum, tall
#: and square), a near-rank-1 batch on a tall shape small enough for a CPU run (aspect 4, like the banks
#: the dispatch picks), and two power-law batches at the smallest short side the dispatch sends to the
#: Gram side on CUDA (GRAM_SIDE_MIN_SHORT = 384). The power laws (singular value i proportional to
#: i^-p) are the spectra of a small GPT's momentum in training: its 384-wide banks' matrices have
#: stable rank 1.1-1.3 and singular values falling from 1 to 1e-4 as about i^-1.4.
STUDY_INPUTS = (
    ("Gaussian 2816x768", "gaussian", (1, 2816, 768)),
    ("sv 1..1e-3, 2816x768", "geometric", (1, 2816, 768)),
    ("Gaussian 768x768", "gaussian", (1, 768, 768)),
    ("sv 1..1e-3, 768x768", "geometric", (1, 768, 768)),
    ("near-rank-1 8x1024x256", "near_rank1", (8, 1024, 256)),
    ("sv i^-1.4, 2x1536x384", "power_law_1.4", (2, 1536, 384)),
    ("sv i^-1, 2x1536x384", "power_law_1", (2, 1536, 384)),
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
    to 1e-3, random singular vectors), "power_law_<p>" (singular value i, from 1, equal to i^-p; random
    singular vectors) or "near_rank1" (:func:`anvil_fast.studies.near_rank1.near_rank1`)."""
    b, m, n = shape
    g = torch.Generator().manual_seed(seed)
    if family == "gaussian":
        return torch.randn(shape, generator=g)
    if family == "geometric" or family.startswith("power_law_"):
        k = min(m, n)
        if family == "geometric":
            s = torch.logspace(0.0, -3.0, k, dtype=torch.float64)
        else:
            s = torch.arange(1, k + 1, dtype=torch.float64) ** -float(family[len("power_law_"):])
        u = torch.linalg.qr(torch.randn(b, m, k, generator=g, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(b, n, k, generator=g, dtype=torch.float64))[0]
        return ((u * s) @ v.mT).float()
    if family == "near_rank1":
        from .near_rank1 import near_rank1

        return near_rank1(b, m, n, seed=seed)
    raise ValueError(f"family: expected 'gaussian', 'geometric', 'power_law_<p>' or 'near_rank1', got {family!r}")


def choose_schedule(rows: list[dict]) -> tuple[int, ...] | None:
    """The rule: among schedules with no exploded output and an error at most SAFE's + STUDY_ALLOWANCE
    on every dispatched input, the fewest restarts; ties by the smallest worst excess over SAFE.
    ``rows``: the study's schedule rows ({"restarts", "excess_max", "exploded"}). None if none
    qualifies (the map set then has no Gram side: its banks run the standard cascade)."""
    ok = [r for r in rows if r["exploded"] == 0 and r["excess_max"] <= STUDY_ALLOWANCE]
    if not ok:
        return None
    best = min(ok, key=lambda r: (len(r["restarts"]), r["excess_max"]))
    return tuple(best["restarts"])


def study(inputs=STUDY_INPUTS, schedules=None, *, maps: MapsLike = ANVIL_MAPS, seed: int = 0, progress=None,
          r_precision: bool = True) -> dict:
    """Error vs the float64 cascade (max over matrices of the relative Frobenius error) of SAFE and of
    the Gram side for every schedule (run on every input, whatever the dispatch rule), on CPU (torch
    fallback: fp32 products of bf16 operands, one rounding each, the fast path's own arithmetic),
    plus the count of exploded outputs (top singular value above the maps' explosion threshold,
    :func:`anvil_fast.core.tolerances.exploded_sigma` of their composite's maximum: 1.1 for ANVIL_MAPS;
    dispatched inputs) and the R-in-fp32 variant of the chosen schedule, all with the map set ``maps``."""
    import anvil_ref as R_
    from anvil_ref.polar import composite_max, spectrum_top


    maps_ = load_maps(maps)
    schedules = study_schedules(len(maps_)) if schedules is None else [tuple(s) for s in schedules]
    margin = GRAM_SIDE.margin()
    limit = exploded_sigma(composite_max(maps=maps_, top=spectrum_top(normalization="frobenius", margin=margin)))
    data = []
    for name, fam, shape in inputs:
        x = study_input(fam, shape, seed=seed)
        data.append((name, x, R_.cascade(x.bfloat16(), maps=maps_, margin=margin)))

    def measure(label, fn):
        errs, boom = [], 0
        for name, x, ref in data:
            y = fn(x)
            errs.append(rel_err(y, ref))
            if uses_gram_side(x.shape):
                boom += int((top_singular_value(y.reshape(-1, *y.shape[-2:])) > limit).sum())
        if progress:
            progress(f"{label}: " + " ".join(f"{e:.4g}" for e in errs))
        return errs, boom

    safe_errs, safe_boom = measure("safe", lambda x: fast_cascade(x, maps=maps_, config=SAFE, backend="torch"))
    rows = []
    for sched in schedules:
        errs, boom = measure(str(sched), lambda x, s=sched: fast_gram_side(x, restarts=s, maps=maps_, backend="torch"))
        excess = [e - s for e, s, (_, x, _) in zip(errs, safe_errs, data) if uses_gram_side(x.shape)]
        rows.append({"restarts": list(sched), "errors": errs, "excess_max": max(excess), "exploded": boom})
    chosen = choose_schedule(rows)
    res = {"inputs": [n for n, _, _ in inputs], "safe": {"errors": safe_errs, "exploded": safe_boom},
           "schedules": rows, "chosen": None if chosen is None else list(chosen), "allowance": STUDY_ALLOWANCE,
           "exploded_sigma": limit, "dispatched": [uses_gram_side(x.shape) for _, x, _ in data],
           "flops_2816x768": {"standard": cascade_flops(2816, 768, maps=len(maps_))["standard"],
                              **{str(tuple(r["restarts"])): cascade_flops(
                                  2816, 768, maps=len(maps_), restarts=r["restarts"])["gram_side"] for r in rows}}}
    if r_precision and chosen is not None:
        r32, r32_boom = measure(f"{chosen} R fp32", lambda x: eager_gram_side_cascade(
            x, restarts=chosen, maps=maps_, margin=margin, gemm="fp32", r_fp32=True))
        r16, r16_boom = measure(f"{chosen} eager", lambda x: eager_gram_side_cascade(
            x, restarts=chosen, maps=maps_, margin=margin, gemm="fp32"))
        res["r_precision"] = {"bf16": {"errors": r16, "exploded": r16_boom},
                              "fp32": {"errors": r32, "exploded": r32_boom}}
    return res


def _sched(s) -> str:
    return "none (the standard cascade)" if s is None else "none" if not s else "before map " + ", ".join(map(str, s))


def study_markdown(res: dict, command: str) -> str:
    f = res["flops_2816x768"]
    n_maps = len(res["maps"]) if "maps" in res else len(ANVIL_MAPS)
    head = ["configuration", *res["inputs"], "exploded", "FLOPs vs SAFE, 2816x768", "768x768"]
    lines = [f"<!-- generated by `{command}` -->", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda es: [f"{e:.4f}" if e < 10 else f"{e:.2g}" if math.isfinite(e) else "inf" for e in es]  # noqa: E731
    lines.append("| SAFE (standard bf16) | " + " | ".join(fmt(res["safe"]["errors"]))
                 + f" | {res['safe']['exploded']} | 1 | 1 |")
    for r in res["schedules"]:
        mark = "**" if r["restarts"] == res["chosen"] else ""
        ratio = f["standard"] / f[str(tuple(r["restarts"]))]
        square = 1 / cascade_flops(768, 768, maps=n_maps, restarts=r["restarts"])["ratio"]
        lines.append(f"| {mark}Gram side, restart {_sched(r['restarts'])}{mark} | " + " | ".join(fmt(r["errors"]))
                     + f" | {r['exploded']} | {1 / ratio:.2f} | {square:.2f} |")
    c = res["chosen"]
    for key, label in (("bf16", "R in bf16, eager"), ("fp32", "R in fp32, eager")):
        if "r_precision" not in res:
            break
        e = res["r_precision"][key]
        lines.append(f"| Gram side, restart {_sched(c)}, {label} | " + " | ".join(fmt(e["errors"]))
                     + f" | {e['exploded']} | | |")
    lines += ["", "Relative Frobenius error against the float64 cascade of the same bf16 input (max over the "
              "input's matrices)" + (f", maps `{res['maps_name']}`" if res.get("maps_name") else "") + "; CPU, fp32 "
              "products of bf16 operands rounded once (the fast path's torch fallback); SAFE's normalization for "
              "every row. *exploded*: outputs with a top singular value above "
              f"{res.get('exploded_sigma', 1.1):.4g} (1.1 times the maps' largest value on the normalized spectrum) "
              "or a non-finite entry. FLOPs: `anvil_fast.core.gram_side.cascade_flops` (symmetric products at "
              "(T+1)/(2T) of a full one).", "",
              "Rule: among schedules with no exploded output and an error at most SAFE's + "
              f"{res['allowance']:.2e} (one bf16 rounding's worst RMS, 2^-8/sqrt(3)) on every input the dispatch "
              "sends to the Gram side (" + ", ".join(n for n, d in zip(res["inputs"], res["dispatched"]) if d)
              + "; the square inputs are shown, not judged), the fewest restarts, then the smallest worst excess. "
              f"Chosen: restart {_sched(c)}."]
    return "\n".join(lines) + "\n"


def named_map_sets() -> dict[str, object]:
    """Every map set the package names: ANVIL_MAPS ("anvil") and anvil_ref/map_sets/*.json, by name."""
    from anvil_ref.maps import MAP_SETS_DIR

    return {"anvil": ANVIL_MAPS, **{p.stem: p.stem for p in sorted(MAP_SETS_DIR.glob("*.json"))}}


def schedule_entry(name: str, res: dict) -> dict:
    """One map set's line of the schedule table: its coefficients, the chosen schedule and the rows
    the rule chose it from."""
    return {"name": name, "maps": [list(t) for t in load_maps(named_map_sets().get(name, name))],
            "restarts": res["chosen"], "exploded_sigma": res["exploded_sigma"], "safe": res["safe"],
            "schedules": [{k: r[k] for k in ("restarts", "excess_max", "exploded")} for r in res["schedules"]]}


def schedules_table(*, seed: int = 0, progress=None, names=None) -> dict:
    """The study on every named map set (or ``names``): the table :data:`GRAM_SIDE_SCHEDULES_FILE` holds."""
    sets = named_map_sets()
    entries = []
    for name in (names or list(sets)):
        res = study(maps=sets[name], seed=seed, r_precision=False,
                    progress=None if progress is None else (lambda line, n=name: progress(f"{n} {line}")))
        entries.append(schedule_entry(name, res))
    return {"rule": "choose_schedule: no exploded output and an error at most SAFE's + allowance on every "
                    "dispatched input; the fewest restarts, then the smallest worst excess",
            "allowance": STUDY_ALLOWANCE, "inputs": [n for n, _, _ in STUDY_INPUTS],
            "seed": seed, "map_sets": entries}


def schedules_markdown(doc: dict, command: str) -> str:
    """The schedule table for the paper: per map set, its first map's slope at 0, the schedule chosen,
    and what ANVIL_MAPS' schedule would give those maps."""
    from anvil_fast.core.gram_side import GRAM_SIDE_RESTARTS

    lines = [f"<!-- generated by `{command}` -->", "",
             "| map set | maps | a of map 1 | schedule chosen | its worst error over SAFE's | "
             f"ANVIL's schedule ({_sched(GRAM_SIDE_RESTARTS)}) on them: worst error over SAFE's, exploded |",
             "|---|---:|---:|---|---:|---|"]
    for e in doc["map_sets"]:
        rows = {tuple(r["restarts"]): r for r in e["schedules"]}
        mine = rows.get(tuple(e["restarts"])) if e["restarts"] is not None else None
        anvil = rows.get(GRAM_SIDE_RESTARTS)
        lines.append(f"| `{e['name']}` | {len(e['maps'])} | {e['maps'][0][0]:.3f} | {_sched(e['restarts'])} | "
                     + ("-" if mine is None else f"{mine['excess_max']:+.4f}") + " | "
                     + ("-" if anvil is None else f"{anvil['excess_max']:+.4f}, {anvil['exploded']}") + " |")
    lines += ["", f"Rule and inputs as in the table above (allowance {doc['allowance']:.2e}); the exploded count "
              "is over the inputs the dispatch sends to the Gram side, against each map set's own threshold "
              "(1.1 times its largest value on the normalized spectrum). A map set without a schedule runs the "
              "standard cascade under GRAM_SIDE."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.gram_side_study",
                                 description="The Gram-side cascade's error study: error vs the float64 cascade over restart "
                                 "schedules and spectra (CPU, about two minutes per map set).")
    ap.add_argument("--out", default=None, help="write the Markdown table here (and the numbers next to it as .json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--maps", default=None, help="the map set to study (a name or a maps file; default ANVIL_MAPS)")
    ap.add_argument("--schedules", default=None, metavar="JSON",
                    help="study every map set the package names and write the schedule table GRAM_SIDE reads "
                         "(anvil_fast/core/gram_side_schedules.json); with --out, its Markdown table there")
    ap.add_argument("--from-json", default=None,
                    help="re-render the table from a stored study (the .json that --out or --schedules writes) "
                         "instead of running it")
    add_progress_flags(ap)
    a = ap.parse_args(argv)
    if a.schedules and a.maps:
        ap.error("--schedules studies every named map set: drop --maps")
    if a.schedules or (a.from_json and "map_sets" in json.loads(Path(a.from_json).read_text())):
        if a.from_json:
            doc = json.loads(Path(a.from_json).read_text())
            cmd = doc.pop("generated_by")
        else:
            n = len(named_map_sets())
            with Progress(n * (len(study_schedules()) + 1), "gram_side_study", enabled=a.progress) as bar:
                doc = schedules_table(seed=a.seed, progress=lambda s: bar.update(advance=1, label=s))
            cmd = f"python -m anvil_fast.studies.gram_side_study --schedules {a.schedules}" + \
                (f" --out {a.out}" if a.out else "") + (f" --seed {a.seed}" if a.seed else "")
            Path(a.schedules).write_text(json.dumps({"generated_by": cmd, **doc}, indent=1) + "\n")
        md = schedules_markdown(doc, cmd)
        print(md)
        if a.out:
            Path(a.out).write_text(md)
        return 0
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        cmd = res.pop("generated_by")
    else:
        maps = ANVIL_MAPS if a.maps is None else a.maps
        with Progress(len(study_schedules(len(load_maps(maps)))) + 3, "gram_side_study", enabled=a.progress) as bar:
            # one line per measured schedule in a pipe: its label and its errors
            res = study(maps=maps, seed=a.seed, progress=lambda s: bar.update(advance=1, label=s))
        if a.maps is not None:
            res = {"maps_name": a.maps, "maps": [list(t) for t in load_maps(maps)], **res}
        cmd = "python -m anvil_fast.studies.gram_side_study" + (f" --out {a.out}" if a.out else "") + \
            (f" --seed {a.seed}" if a.seed else "") + (f" --maps {a.maps}" if a.maps else "")
    md = study_markdown(res, cmd)
    print(md)
    if a.out:
        out = Path(a.out)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps({"generated_by": cmd, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
