"""The paper's table of other libraries' orthogonalizations (section 6.1), rendered from the JSON the
harness writes (``python -m anvil_fast.studies.difftest --adapter ... --json``, :mod:`anvil_fast.studies.harness`).

The H200 run's JSON files (:data:`H200_DIR`, one per run of :data:`RUNS`, each under ten minutes and
resumable) are read where present, else the CPU run's (:data:`CPU_DIR`, small shapes). Per (adapter,
shape): the error against its own math in float64 on the Gaussian family next to the eager bf16 runs
of that math (``k``: the error over the largest eager form's), the math verdict's deviation on the
spectrum probe, the safety clauses, the verdicts over every family, and the findings written as
findings (:func:`findings`): an implementation that rounds more than its sibling with the same
math, a math that explodes in bf16 (its own eager run explodes too), a rounding past a form's eager.
A FAIL is a math or safety clause; nothing else is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The H200 run's JSON files (written by :data:`RUNS`, run from the repository root).
H200_DIR = "results/h200_orthogonalizers"
#: The CPU run's (small shapes): what the table shows until the H200's exist.
CPU_DIR = "results/cpu_orthogonalizers"
#: The bank shapes of the record.
SHAPES = ("4x256x768", "4x768x768", "2x2816x768", "2x768x3072", "1x4096x4096")
#: The H200 runs: (JSON name, adapters, shapes), each well under ten minutes with its compilations
#: in the warm-up; run each again (``--resume``) until its JSON says ``"complete": true``.
_EAGER = ("torch-muon,dion-muon,dion-polar-express,dion-normuon,heavyball-ns5,heavyball-msign,"
          "pytorch-optimizer-original,pytorch-optimizer-quintic,pytorch-optimizer-polar-express,"
          "pytorch-optimizer-polar-express-safer,pytorch-optimizer-gram-ns,field-muon-newton-schulz,"
          "field-muon-newton-schulz-fused,field-polar-express,gram-newton-schulz,gram-newton-schulz-standard")
_TRITON = ("dion-newton-schulz-triton,dion-newton-schulz-triton-fast,dion-polar-express-triton,dion-normuon-triton,"
           "gram-newton-schulz-quack")
_EMERGING = ",".join(f"emerging-{k}" for k in ("simple", "quintic", "polar-express", "cans", "aol", "deepseekv4"))
_EMERGING_SYRK = ",".join(f"emerging-{k}-syrk" for k in ("simple", "quintic", "polar-express", "cans", "aol",
                                                          "deepseekv4"))
_ANVIL = ("anvil-safe,anvil-faithful,anvil-gram-side,anvil-safe-anvil-express,anvil-safe-anvil-optimal,"
          "anvil-safe-anvil-polished,anvil-safe-muon-jordan5,anvil-safe-polar-express-nanogpt5,"
          "anvil-safe-polar-express-paper6")
RUNS = tuple((f"{group}_{shape.replace('x', '_')}.json", adapters, shape)
             for group, adapters in (("eager", _EAGER), ("triton", _TRITON), ("emerging", _EMERGING),
                                     ("emerging_syrk", _EMERGING_SYRK), ("anvil", _ANVIL))
             for shape in SHAPES)
#: Seconds after which a run starts no new (adapter, shape) (the rest waits for its --resume).
BUDGET_S = 300


def command(name: str, adapters: str, shape: str) -> str:
    """One H200 run's command line (repository root; the JSON under results/, its copy in ``$OUT``, the
    compilers' caches in the ignored ``.compile_cache``, kept on a warm machine between runs)."""
    return (f"PYTHONPATH=.peers/dion python -m anvil_fast.studies.difftest --adapter {adapters} --shapes {shape} "
            f"--time-reps 10 --time-budget-s {BUDGET_S} --cache-dir .compile_cache --resume --no-progress "
            f"--json {H200_DIR}/{name}; cp {H200_DIR}/{name} $OUT/")


COMMAND = command(*RUNS[0])
#: A kernel's error within this factor of the largest eager form's is "as accurate as its math allows"
#: (the harness's factor, anvil_fast.core.tolerances.FACTOR).
AS_ACCURATE = 2.0
#: Siblings (the same declared math) whose errors differ by at least this factor are a finding.
SIBLING_RATIO = 1.5


def load(path: Path | None = None, *, where: str | None = None) -> dict | None:
    """The rows of every JSON under the H200 directory (else the CPU one), merged; ``where``: that
    directory alone; ``path``: one file."""
    if path is not None:
        return json.loads(Path(path).read_text()) if Path(path).is_file() else None
    for d in ((where,) if where else (H200_DIR, CPU_DIR)):
        files = sorted((ROOT / d).glob("*.json"))
        if files:
            parts = [json.loads(f.read_text()) for f in files]
            out = {"source": d, "device": parts[0].get("device", "?"), "torch": parts[0].get("torch", "?"),
                   "generated_by": [p.get("generated_by", "") for p in parts],
                   "complete": all(p.get("complete", True) for p in parts), "implementations": {},
                   "unavailable": {}, "rows": []}
            for p in parts:
                out["implementations"].update(p.get("implementations", {}))
                out["unavailable"].update(p.get("unavailable", {}))
                out["rows"] += p.get("rows", [])
            for n in out["implementations"]:
                out["unavailable"].pop(n, None)
            return out
    return None


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


def _eager_max(r: dict) -> float | None:
    forms = [r.get(k) for k in ("eager", "eager_unfused", "eager_horner") if r.get(k) is not None]
    return max(forms) if forms else None


def classify(e: dict) -> str:
    """The plain statement of the last column, from the entry's numbers."""
    g, sp = e["families"].get("gaussian"), e["families"].get("spectrum")
    words = []
    if g and g.get("fast") is not None and _eager_max(g):
        k = g["fast"] / _eager_max(g)
        words.append("as accurate as its math allows" if k <= AS_ACCURATE else
                     f"finding: rounds {k:.1f}x its form's eager")
        if g.get("polar") is not None and g.get("math_polar") is not None:
            words.append("its math limits it" if g["math_polar"] >= 0.5 * g["polar"] else "its rounding limits it")
    for r in e["families"].values():
        for f in (r.get("verdicts") or {}).get("findings", []):
            if f.startswith("the math explodes"):
                words.append(f"finding: the math explodes in bf16 on {r['family']}")
                break
    if sp and sp.get("math_z") is not None:
        words.append(f"math within {sp['math_z']:.1f} standard errors" if sp["verdict"] != "FAIL" or
                     not (sp.get("verdicts") or {}).get("math") else f"FAIL: math off along {sp['math_clause']}")
    bad = [f"{f} ({'; '.join((r.get('verdicts') or {}).get('math', []) + (r.get('verdicts') or {}).get('safety', []))})"
           for f, r in e["families"].items() if r["verdict"] == "FAIL"]
    if bad:
        words.append("FAIL on " + ", ".join(bad))
    return "; ".join(dict.fromkeys(words)) or "-"


def findings(data: dict) -> list[str]:
    """The findings of the run, each a sentence: siblings with the same math that round differently,
    maths that explode in bf16, FAILs."""
    out = []
    maths = {n: json.dumps(i.get("math"), sort_keys=True) for n, i in data.get("implementations", {}).items()
             if i.get("math") is not None}
    by = {(r["impl"], tuple(r["shape"]), r["family"]): r for r in data["rows"]}
    shapes = sorted({tuple(r["shape"]) for r in data["rows"]})
    names = list(dict.fromkeys(r["impl"] for r in data["rows"]))
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a not in maths or maths.get(a) != maths.get(b):
                continue
            for s in shapes:
                ra, rb = by.get((a, s, "gaussian")), by.get((b, s, "gaussian"))
                if not ra or not rb or not ra.get("fast") or not rb.get("fast"):
                    continue
                hi, lo = (ra, rb) if ra["fast"] >= rb["fast"] else (rb, ra)
                if hi["fast"] >= SIBLING_RATIO * lo["fast"]:
                    out.append(f"Finding: {hi['impl']} rounds {hi['fast'] / lo['fast']:.1f}x more than its sibling "
                               f"{lo['impl']} with the same math (error {hi['fast']:.3g} against {lo['fast']:.3g} at "
                               f"{'x'.join(map(str, s))}, Gaussian input); its largest eager form rounds "
                               f"{_f(_eager_max(hi))}: a property of its evaluation form, not of its math.")
    seen = set()
    for r in data["rows"]:
        for f in (r.get("verdicts") or {}).get("findings", []):
            if f.startswith("the math explodes") and (r["impl"], r["family"]) not in seen:
                seen.add((r["impl"], r["family"]))
                out.append(f"Finding: the math of {r['impl']} explodes in bf16 on {r['family']} input "
                           f"({'x'.join(map(str, r['shape']))}: {f[len('the math explodes in bf16: '):]}); the "
                           "eager bf16 run of the same declared math explodes as well, so it is the math, not a "
                           "slip of the implementation.")
    for r in data["rows"]:
        if r["verdict"] == "FAIL":
            v = r.get("verdicts") or {}
            out.append(f"FAIL: {r['impl']} at {'x'.join(map(str, r['shape']))}, {r['family']}: "
                       + "; ".join(v.get("math", []) + v.get("safety", [])) + ".")
    return out


def table(data: dict | None = None) -> str:
    data = load() if data is None else data
    if data is None:
        return f"*(no data yet: `{H200_DIR}/*.json` is written by `{COMMAND}` and the other runs of the study)*"
    head = ("| adapter | shape | err vs its math (Gaussian) | eager fused | eager unfused | eager Horner | k | "
            "math z (spectrum) | err vs polar | its math vs polar | exploded (near-rank-1) | ms | verdicts | "
            "what it is |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for e in summarize(data):
        g = e["families"].get("gaussian") or {}
        sp = e["families"].get("spectrum") or {}
        nr = e["families"].get("near_rank1") or {}
        counts = {v: e["verdicts"].count(v) for v in ("ok", "finding", "FAIL", "unjudged") if v in e["verdicts"]}
        k = (g["fast"] / _eager_max(g)) if g.get("fast") is not None and _eager_max(g) else None
        exploded = "-" if not nr else f"{nr.get('exploded', 0)}/{nr.get('count', 0)}"
        lines.append(f"| {e['impl']} | {e['shape']} | {_f(g.get('fast'))} | {_f(g.get('eager'))} | "
                     f"{_f(g.get('eager_unfused'))} | {_f(g.get('eager_horner'))} | {_f(k, '.2f')} | "
                     f"{_f(sp.get('math_z'), '.1f')} | {_f(g.get('polar'))} | {_f(g.get('math_polar'))} | {exploded} | "
                     f"{_f(g.get('ms'), '.3f')} | {', '.join(f'{n} {v}' for v, n in counts.items())} | {classify(e)} |")
    gen = data.get("generated_by", "")
    gen = gen if isinstance(gen, list) else [gen]
    where = data.get("source", H200_DIR)
    notes = [f"*Generated from `{where}/*.json` ({data.get('device', '?')}, torch {data.get('torch', '?')}), "
             f"written by {len(gen)} run(s) of the study, e.g. `{gen[0] if gen else COMMAND}`"
             + ("" if data.get("complete", True) else "; some runs stopped at their time budget before every row")
             + (". These are the CPU run's small shapes: the H200 runs write the bank shapes" if where == CPU_DIR
                else "") + ".*"]
    if data.get("unavailable"):
        notes.append("*Not run there: " + "; ".join(f"{k} ({v})" for k, v in sorted(data["unavailable"].items())) + ".*")
    found = findings(data)
    if found:
        notes.append("\n".join(f"* {f}" for f in found))
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes)


def h200_progress() -> str:
    """How much of the H200 table exists: the runs of :data:`RUNS` with a JSON, and those complete."""
    have = [json.loads(p.read_text()) for name, _, _ in RUNS if (p := ROOT / H200_DIR / name).is_file()]
    done = sum(1 for d in have if d.get("complete"))
    return (f"{len(have)} of the {len(RUNS)} runs stored so far, {done} of them complete, that is with every "
            "(adapter, shape) of the run judged")


def cross_device(h200: dict | None = None, cpu: dict | None = None) -> str:
    """Each FAIL of the H200 table next to the same adapter's verdicts in the CPU run: the adapter reads
    its coefficients from its library, so the same code with the same declared math that is ok on the
    CPU and FAILs the math on the H200 points at the verdict's handling of the device's rounding, and is
    stated as such, not as a slip of the library."""
    h200 = load(where=H200_DIR) if h200 is None else h200
    cpu = load(where=CPU_DIR) if cpu is None else cpu
    if not h200 or not cpu:
        return "*(no H200 FAIL to set beside the CPU run)*"
    cpu_v: dict[str, list[str]] = {}
    for r in cpu["rows"]:
        cpu_v.setdefault(r["impl"], []).append(r["verdict"])
    out = []
    for r in h200["rows"]:
        if r["verdict"] != "FAIL":
            continue
        mine = cpu_v.get(r["impl"], [])
        math_only = bool((r.get("verdicts") or {}).get("math")) and not (r.get("verdicts") or {}).get("safety")
        shape = "x".join(map(str, r["shape"]))
        if mine and "FAIL" not in mine and math_only:
            out.append(f"* {r['impl']} ({shape}, {r['family']}, math z {r['math_z']:.1f} along {r['math_clause']}): "
                       f"the same adapter is ok on all {len(mine)} of its CPU rows; an open false alarm of the math "
                       "verdict on this device, not a finding about the library.")
        elif mine:
            out.append(f"* {r['impl']} ({shape}, {r['family']}): its CPU rows: "
                       + ", ".join(f"{v} {mine.count(v)}" for v in dict.fromkeys(mine)) + ".")
        else:
            out.append(f"* {r['impl']} ({shape}, {r['family']}): not in the CPU run.")
    return "\n".join(out) or "*(no FAIL in the H200 table)*"


def values(data: dict | None = None) -> dict[str, str]:
    data = load() if data is None else data
    return {"peers_command": f"`{COMMAND}`",
            "peers_runs": str(len(RUNS)), "peers_h200_progress": h200_progress(),
            "peers_adapters": "no adapters yet" if data is None else str(len(data.get("implementations", {})))}


def tables() -> dict:
    def at(where: str) -> str:
        data = load(where=where)
        return table(data) if data else f"*(no run in `{where}/` yet)*"
    return {"peers": table, "peers_cpu": lambda: at(CPU_DIR), "peers_h200": lambda: at(H200_DIR),
            "peers_cross_device": cross_device}
