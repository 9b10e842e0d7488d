"""The paper's training section, generated from the run JSONs of ``python -m papers.train`` kept
under results/train/ (any depth; a run's size, role and setup are read from its JSON).

Three kinds of evidence, each its own tables:

* the tuning protocol (papers/protocol.py): its sweep (``role: sweep``), the contenders at the
  chosen learning rates at the sweep's horizon (the sweep's runs at the chosen point) and at the
  protocol's horizon (``role: tuned``), their paired differences and the comparison anchor;
* comparisons at fixed learning rates (``role: fixed``, and the JSONs of format 1): ANVIL's
  configurations against each other, at the drop-in's own rates, one table per size;
* lone timings (``role: timing``): time per step and the optimizer's share, for the tuned
  contenders (their training runs shared the GPU, so their own timings are not compared).

A contender that could not run where the runs were made leaves a ``role: absent`` JSON; its row
says why. Without any run JSON every table says so (generated text, not a failure) and the figures
are left out. The statistics and the rules are papers/stats.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from anvil_ref.constants import RAIL_RULE, RAIL_SCALED_REFERENCE_STEPS
from anvil_ref.rails import rail_steps
from papers import protocol as P
from papers import stats as S
from papers.markdown import md_table
from papers.svg import Series, line_plot

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results" / "train"
FORMATS = (1, 2)  # papers.train.FORMAT and the one before it (not imported: building the paper must not need torch)

#: The comparison anchor, a published fact and no measurement of this package: modded-nanogpt's
#: optimization benchmark (a GPT of 12 layers and width 768 on FineWeb, fixed architecture, data and
#: batch, minimizing the steps to a target validation loss). Its numbers live in papers/data/anchor.json beside the place
#: they were read from, so a reader checks them there and not in code.
ANCHOR_FILE = Path(__file__).resolve().parent / "data" / "anchor.json"
_ANCHOR = json.loads(ANCHOR_FILE.read_text())
ANCHOR_TARGET_LOSS = float(_ANCHOR["target_loss"])
ANCHOR_MUON_STEPS = int(_ANCHOR["muon_steps"])
ANCHOR_ADAM_STEPS = int(_ANCHOR["adam_steps"])
ANCHOR_SOURCE = _ANCHOR["source"]

#: The contenders' order in tables and figures.
ORDER = ("adamw", "muon", "dion", "normuon", "anvil", "anvil_lean", "anvil_no_equalizer", "anvil_one_rail",
         "anvil_decoupled", "anvil_rails_scaled", "anvil_faithful", "anvil_gram_side", "anvil_derived",
         "anvil_polar", "anvil_nesterov", "anvil_defaults")
#: The tuned contenders' pairs: (a, b, question).
PAIRS_TUNED = (
    ("anvil", "muon", "ANVIL vs torch Muon"),
    ("anvil", "dion", "ANVIL vs dion's Muon"),
    ("anvil", "adamw", "ANVIL vs AdamW"),
    ("dion", "muon", "dion's Muon vs torch Muon"),
    ("muon", "adamw", "torch Muon vs AdamW"),
    ("anvil", "normuon", "ANVIL vs dion's NorMuon"),
    ("normuon", "dion", "dion's NorMuon vs dion's Muon"),
    ("anvil_lean", "anvil", "bf16 rails vs fp32 rails"),
    ("anvil_no_equalizer", "anvil", "ablation: no equalizer vs ANVIL"),
    ("anvil_one_rail", "anvil", "ablation: one rail (w = 1) vs twin rails"),
    ("anvil_decoupled", "anvil", "ablation: decoupled vs sign-gated decay"),
    ("anvil_rails_scaled", "anvil", "ablation: rails scaled to the run vs the record's steps"),
    ("anvil_derived", "anvil", "ablation: maps anvil_express vs ANVIL's"),
    ("anvil_polar", "anvil", "ablation: maps Polar Express (paper, 6) vs ANVIL's"),
)
#: The fixed-rate comparisons' pairs.
PAIRS_FIXED = (
    ("anvil", "anvil_faithful", "SAFE vs FAITHFUL"),
    ("anvil_gram_side", "anvil", "Gram-side cascade vs SAFE"),
    ("anvil_derived", "anvil", "derived map set (anvil_express) vs ANVIL_MAPS"),
    ("anvil_polar", "anvil", "Polar Express coefficients vs ANVIL_MAPS"),
    ("anvil_nesterov", "anvil", "plain Nesterov vs the record's twin rails"),
    ("anvil_lean", "anvil", "bf16 rails vs fp32 rails"),
)
LEVEL_TXT = f"{S.LEVEL:.0%}"
BUDGETS = (0.25, 0.5)  # fractions of the run's steps at which the loss is also reported
NO_RUNS = ("*(no training run yet: results/train/ holds no run JSON of {what}; "
           "`python -m papers.train` writes them, see its module docstring)*")


# ------------------------------------------------------------------------------------- loading
def _normalize(r: dict) -> dict:
    """A record of either format with the fields of the newer one (format 1: runs one at a time,
    no clipping, the ``sweep`` flag for the role)."""
    if r.get("format") == 1:
        r = {**r, "role": "sweep1" if r.get("sweep") else "fixed", "clip": None, "jobs": 1, "timing_comparable": True}
    return r


def load(folder: Path = RUNS) -> list[dict]:
    out = []
    if not folder.is_dir():
        return out
    for p in sorted(folder.rglob("*.json")):
        r = json.loads(p.read_text())
        if isinstance(r, dict) and r.get("format") in FORMATS and "contender" in r:
            out.append(_normalize(r))
    return out


def _key(n: str) -> tuple:
    return (ORDER.index(n) if n in ORDER else 99, n)


def _sizes(runs: list[dict]) -> list[str]:
    order = ("tiny", "small", "medium")
    return sorted({r["size"] for r in runs}, key=lambda s: (order.index(s) if s in order else 9, s))


def _curve(r: dict) -> tuple[list[float], list[float]]:
    return [c["step"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]]


def _final(r: dict) -> float:
    v = r["final_val_loss"]
    return v if math.isfinite(v) and not r.get("diverged") else math.inf


def _sorted(by: dict[str, list[dict]]) -> dict[str, list[dict]]:
    return {n: sorted(by[n], key=lambda r: r["seed"]) for n in sorted(by, key=_key)}


def absent(runs: list[dict], size: str) -> dict[str, str]:
    """Contenders that left a ``role: absent`` record of ``size`` and no run: name -> why."""
    ran = {r["contender"] for r in runs if r["size"] == size and r.get("role") not in ("absent",)}
    return {r["contender"]: r["reason"] for r in runs
            if r.get("role") == "absent" and r["size"] == size and r["contender"] not in ran}


def groups(runs: list[dict], size: str) -> dict[str, list[dict]]:
    """Fixed-rate runs of ``size`` by contender, in :data:`ORDER`, seeds sorted; one setup (steps,
    batch, clipping) per size, else ValueError."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r["size"] == size and r.get("role") == "fixed":
            by.setdefault(r["contender"], []).append(r)
    setups = {(r["steps"], r["batch"], r["ctx"], r.get("clip")) for rs in by.values() for r in rs}
    if len(setups) > 1:
        raise ValueError(f"results/train: the size-{size} fixed-rate runs mix setups (steps, batch, ctx, clip) "
                         f"{sorted(setups, key=str)}; a comparison needs one (keep other runs outside results/train)")
    return _sorted(by)


# ---------------------------------------------------------------------------------- the protocol
def protocol(runs: list[dict]) -> P.Protocol | None:
    return P.of_records(runs)


def tuned_groups(runs: list[dict], *, horizon: str) -> dict[str, list[dict]]:
    """The protocol's contenders at their chosen rates: ``horizon="long"``, the horizon runs;
    ``"short"``, the sweep's runs at the chosen point (the tuning horizon); ``"equal_time"``, the
    equal-time runs (each contender at its own step count)."""
    p = protocol(runs)
    if p is None:
        return {}
    chosen = P.chosen_of(runs)
    core = p.core()
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("role") not in ("sweep", "tuned", "equal_time") or P._core(r.get("protocol") or {}) != core:
            continue
        n = r["contender"]
        if n not in chosen or tuple(r["hparams"].get(k) for k in P.KEYS) != chosen[n]:
            continue
        if (horizon == "long" and r["role"] == "tuned" and r["steps"] == p.steps) or (
                horizon == "short" and r["role"] == "sweep" and r["steps"] == p.tune_steps) or (
                horizon == "equal_time" and r["role"] == "equal_time"):
            by.setdefault(n, []).append(r)
    return _sorted(by)


def timings(runs: list[dict], size: str) -> dict[str, dict]:
    """Lone timing records (``role: timing``) of ``size`` by contender."""
    return {r["contender"]: r["timing"] for r in runs if r.get("role") == "timing" and r["size"] == size
            and r.get("timing_comparable") and r.get("timing")}


def target(g: dict[str, list[dict]]) -> float | None:
    """The target loss of a comparison: the highest final validation loss among the AdamW seeds,
    so that every AdamW seed reaches it within its run (None without a finished AdamW seed)."""
    finals = [_final(r) for r in g.get("adamw", [])]
    finals = [v for v in finals if math.isfinite(v)]
    return max(finals) if finals else None


def _step_s(rs: list[dict]) -> float | None:
    t = [r["timing"]["step_s"] for r in rs if r.get("timing") and r.get("timing_comparable", True)]
    return sum(t) / len(t) if t else None


def metrics(g: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender: seeds, finals, losses at the budgets, per-seed steps to the target."""
    tgt = target(g)
    out = {}
    for n, rs in g.items():
        steps = rs[0]["steps"]
        m = {"seeds": [r["seed"] for r in rs], "final": [_final(r) for r in rs],
             "budgets": {f: [S.loss_at(*_curve(r), f * steps) if not r.get("diverged") else math.inf for r in rs]
                         for f in BUDGETS},
             "step_s": _step_s(rs),
             "opt_share": (sum(r["timing"]["opt_share"] for r in rs if r.get("timing")) /
                           max(1, sum(1 for r in rs if r.get("timing")))) if any(r.get("timing") for r in rs) else None}
        if tgt is not None:
            m["to_target"] = [S.steps_to_target(*_curve(r), tgt) if not r.get("diverged") else math.inf for r in rs]
        out[n] = m
    return out


def pair(g: dict[str, list[dict]], a: str, b: str, metric) -> tuple[list[float], list[float], list[int]] | str:
    """Per-seed values of ``metric(record)`` of a and b on the seeds both ran, checked to be paired
    (same initial weights and batches); a sentence instead when they are not."""
    ra, rb = {r["seed"]: r for r in g[a]}, {r["seed"]: r for r in g[b]}
    seeds = sorted(set(ra) & set(rb))
    for s in seeds:
        x, y = ra[s], rb[s]
        if x.get("batches_sha256") != y.get("batches_sha256") or x["curve"][0]["val_loss"] != y["curve"][0]["val_loss"]:
            return f"not paired: seed {s} differs in its batches or initial weights"
    return [metric(ra[s]) for s in seeds], [metric(rb[s]) for s in seeds], seeds


def _num(v: float | None, fmt: str) -> str:
    if v is None:
        return "-"
    return "not reached" if math.isinf(v) else "-" if math.isnan(v) else format(v, fmt)


def _lrs(r: dict) -> str:
    hp = r.get("hparams", {})
    return ", ".join(f"{k}={hp[k]:g}" for k in P.KEYS if k in hp) or "(the drop-in's defaults)"


def _caption(g: dict[str, list[dict]], size: str, extra: str) -> str:
    r0 = next(iter(g.values()))[0]
    clip = r0.get("clip")
    jobs = max(r.get("jobs", 1) for rs in g.values() for r in rs)
    return (f"Size `{size}` ({r0['model']['n_params'] / 1e6:.1f}M parameters), {r0['steps']} steps of "
            f"{r0['batch']} x {r0['ctx']} bytes, "
            + (f"gradient norm clipped to {clip:g}" if clip else "no gradient clipping")
            + f", validation every {r0.get('eval_every', '?')} steps on {r0.get('val_windows', '?')} fixed windows, "
            f"{r0['environment']['device']}, torch {r0['environment']['torch']}"
            + (f", up to {jobs} runs at once on the device" if jobs > 1 else "")
            + f"; corpus sha256 `{r0['corpus']['sha256'][:16]}` ({r0['corpus']['train_bytes']:,} train bytes); "
            + _commits_text(g) + f". Mean ± sample std [min, max] over seeds. {extra}")


def _commits_text(g: dict[str, list[dict]]) -> str:
    """The commits the runs of a table name, or how many name none (runs written before the JSON
    carried its commit; their call's command.txt under results/train/logs says what ran)."""
    rs = [r for runs in g.values() for r in runs]
    full = _full_commits({r.get("commit") for r in rs})
    named = sorted({full[r["commit"]][:7] for r in rs if r.get("commit")})
    missing = sum(1 for r in rs if not r.get("commit"))
    parts = [f"commit {', '.join(named)}"] if named else []
    if missing:
        parts.append(f"{missing} run(s) name no commit (written before run JSONs recorded one; "
                     "results/train/logs/command.txt names the calls)")
    return "; ".join(parts)


def table_results(g: dict[str, list[dict]], size: str, *, lone: dict[str, dict] | None = None,
                  missing: dict[str, str] | None = None, what: str = "") -> str:
    """A comparison's table: losses at the budgets and at the end, steps to the target (per seed,
    and their paired ratio to AdamW's), time per step (``lone``: from lone timing records; else the
    runs' own, when they ran alone)."""

    if not g:
        return NO_RUNS.format(what=what or f"size {size}")
    m = metrics(g)
    tgt = target(g)
    r0 = next(iter(g.values()))[0]
    tok = r0["batch"] * r0["ctx"]
    header = ["contender", "learning rates", "seeds"] + [
        f"val loss at step {f * r0['steps']:g} ({f * r0['steps'] * tok / 1e6:.2f}M tokens)" for f in BUDGETS] + [
        f"final val loss ({r0['steps'] * tok / 1e6:.2f}M tokens)"] + (
        ["steps to target", "ratio to AdamW (per seed)"] if tgt is not None else []) + ["ms / step", "optimizer share"]
    rows = []
    for n, rs in g.items():
        x = m[n]
        ratio = "-"
        if tgt is not None and n != "adamw" and "adamw" in g:
            pr = pair(g, n, "adamw", lambda r: S.steps_to_target(*_curve(r), tgt) if not r.get("diverged") else math.inf)
            if isinstance(pr, str):
                ratio = pr
            else:
                q = S.paired_ratio(pr[0], pr[1])
                ratio = S.fmt_interval(q, 2, signed=False) if math.isfinite(q["ratio"]) else "not reached"
        if lone is not None:
            tm = lone.get(n)
            step_s, share = (tm["step_s"], tm["opt_share"]) if tm else (None, None)
        else:
            step_s, share = x["step_s"], x["opt_share"]
        rows.append([n, _lrs(rs[0]), len(rs)] + [S.fmt_spread(x["budgets"][f]) for f in BUDGETS] + [
            S.fmt_spread(x["final"])] + ([S.fmt_spread(x["to_target"], 0), ratio] if tgt is not None else []) + [
            _num(None if step_s is None else step_s * 1e3, ".1f"),
            _num(None if share is None else share * 100, ".0f") + ("%" if share is not None else "")])
    for n, why in sorted((missing or {}).items(), key=lambda kv: _key(kv[0])):
        if n not in g:
            rows.append([n, "-", 0] + ["-"] * len(BUDGETS) + [f"absent: {why}"] + ["-"] * (len(header) - 4 - len(BUDGETS)))
    timing = ("ms / step and optimizer share: lone timing runs (`--timing-only`), not these runs"
              if lone is not None else "ms / step and optimizer share: a window of synchronized steps before each run")
    extra = ((f"Target: the highest final validation loss among the AdamW seeds ({tgt:.4f}), which every AdamW "
              "seed reaches within its run; steps to target per seed (linear between evaluations); ratio: geometric "
              f"mean over seeds of (steps of the contender / steps of AdamW on the same seed) [{LEVEL_TXT} t interval]. "
              if tgt is not None else "") + timing + ".")
    return md_table(header, rows) + "\n\n" + _caption(g, size, extra)


#: The families over which :func:`table_paired` adjusts its p-values (Holm): the paper's question
#: (ANVIL against each peer), the peers among themselves, and ANVIL's variants against ANVIL.
FAMILIES = ("ANVIL vs peers", "between peers", "variants of ANVIL")


def family(a: str, b: str, ref: str = "anvil") -> str:
    """The family of the comparison ``a`` vs ``b`` (:data:`FAMILIES`)."""
    if a == ref and not b.startswith(ref):
        return FAMILIES[0]
    if a.startswith(ref + "_") and b == ref:
        return FAMILIES[2]
    return FAMILIES[1]


def _paired_rows(g: dict[str, list[dict]], label: str, pairs) -> list[list]:
    """One row per pair present: the per-seed differences, their interval, the paired t test's p
    and its Holm adjustment within the pair's family (:func:`family`) at this horizon, the verdicts."""
    found = []
    for a, b, q in pairs:
        if a not in g or b not in g:
            continue
        pr = pair(g, a, b, _final)
        found.append((a, b, q, pr, None if isinstance(pr, str) else S.paired(pr[0], pr[1])))
    adjusted = {}
    for fam in FAMILIES:
        members = [i for i, (a, b, *_rest) in enumerate(found) if family(a, b) == fam]
        ps = [S.paired_p(found[i][4]) if found[i][4] is not None else math.nan for i in members]
        adjusted.update(zip(members, S.holm(ps)))
    rows = []
    for i, (a, b, q, pr, pd) in enumerate(found):
        if pd is None:
            rows.append([label, q, "-", "-", pr, "-", "-", family(a, b), "-", "-"])
            continue
        rows.append([label, q, len(pr[2]), ", ".join(f"{v:+.4f}" for v in pd["diffs"]), S.fmt_interval(pd),
                     S.paired_verdict(pd, (a, b)), S.verdict(pr[0], pr[1], (a, b)), family(a, b),
                     S.fmt_p(S.paired_p(pd)), S.fmt_p(adjusted[i])])
    return rows


def table_paired(runs: list[dict]) -> str:
    """Paired differences of the final validation loss (a - b, per seed) of the tuned contenders,
    at the protocol's horizon and at the sweep's, with the t test's p-values, raw and adjusted by
    Holm within each family of comparisons at each horizon."""

    p = protocol(runs)
    rows = []
    if p is not None:
        rows += _paired_rows(tuned_groups(runs, horizon="long"), f"{p.steps}", PAIRS_TUNED)
        rows += _paired_rows(tuned_groups(runs, horizon="short"), f"{p.tune_steps}", PAIRS_TUNED)
    if not rows:
        return NO_RUNS.format(what="two tuned contenders")
    return md_table(["steps", "question (a vs b)", "paired seeds", "a - b per seed", f"mean a - b [{LEVEL_TXT} t interval]",
                     "paired verdict", "spread rule", "family", "p", "Holm p"], rows) + (
        f"\n\nPaired verdict: the {LEVEL_TXT} t interval of the per-seed differences wholly below 0 says a is lower, "
        "wholly above 0 that b is lower, else it holds 0; it holds the chance of a false \"lower\" at "
        f"{1 - S.LEVEL:.0%} per comparison. p: the paired t test's two-sided p-value (`papers.stats.paired_p`); "
        "Holm p: Holm's adjustment of the p-values of the row's family at the row's horizon "
        f"(`papers.stats.holm`; families: {', '.join(FAMILIES)}), which holds the chance of any false \"lower\" "
        f"in the family at {1 - S.LEVEL:.0%}: a difference is claimed in the text where its Holm p is below "
        f"{1 - S.LEVEL:.2f}. Spread rule: |mean a - mean b| <= the larger sample std "
        "over seeds of the two is \"no measurable difference\". Below 2 seeds on either side: \"not enough seeds\". "
        f"At {p.tune_steps if p else '-'} steps the seeds are the tuning seeds, the ones the rates were chosen on, so "
        "those rows favour each contender's own choice and carry no verdict in the text.")


#: The equal-time verdict where the times per step are not measurably different.
SAME_SPEED = "same time per step within the spread"


def _equal_time(ra: list[dict], rb: list[dict]) -> tuple[list[float], list[float], float] | str | None:
    """Per-seed losses of both at the training time the faster-finishing contender needs for its
    whole run (time = step x measured time per step); :data:`SAME_SPEED` when the two times per step
    are not measurably different (the rule of papers/stats.py over the seeds' timings), since then
    equal time is equal steps and a ranking would rank timing noise."""
    ta, tb = _step_s(ra), _step_s(rb)
    if ta is None or tb is None:
        return None
    per_a = [r["timing"]["step_s"] for r in ra if r.get("timing")]
    per_b = [r["timing"]["step_s"] for r in rb if r.get("timing")]
    if S.verdict(per_a, per_b) == S.NO_DIFFERENCE:
        return SAME_SPEED
    t = min(ra[0]["steps"] * ta, rb[0]["steps"] * tb)

    def at(rs, ts):
        return [S.loss_at(*_curve(r), min(r["steps"], t / ts)) if not r.get("diverged") else math.inf for r in rs]
    return at(ra, ta), at(rb, tb), t


def table_verdicts(runs: list[dict]) -> str:
    """The fixed-rate comparisons' pairs: the spread rule and the paired interval at equal steps,
    the spread rule at equal training time."""

    rows = []
    for size in _sizes(runs):
        g = groups(runs, size)
        m = metrics(g)
        for a, b, q in PAIRS_FIXED:
            if a not in g or b not in g:
                continue
            d = S.summary(m[a]["final"])["mean"] - S.summary(m[b]["final"])["mean"]
            eq = _equal_time(g[a], g[b])
            at_steps = S.verdict(m[a]["final"], m[b]["final"], (a, b))
            pr = pair(g, a, b, _final)
            paired_s = pr if isinstance(pr, str) else (
                S.fmt_interval(S.paired(pr[0], pr[1])) + "; " + S.paired_verdict(S.paired(pr[0], pr[1]), (a, b)))
            if eq == SAME_SPEED:
                at_time = f"{at_steps} ({SAME_SPEED})"
            else:
                at_time = S.verdict(eq[0], eq[1], (a, b)) + f" (at {eq[2]:.1f} s)" if eq else "-"
            rows.append([size, q, f"{d:+.4f}" if math.isfinite(d) else "-", paired_s, at_steps, at_time])
    if not rows:
        return NO_RUNS.format(what="any pair of fixed-rate contenders")
    return md_table(["size", "question (a vs b)", "final loss, mean a - mean b", f"paired a - b [{LEVEL_TXT} t interval]; verdict",
                     "spread rule, equal steps", "spread rule, equal training time"], rows) + (
        "\n\nSpread rule: |mean a - mean b| <= the larger sample std over seeds of the two is \"no measurable "
        "difference\"; below 2 seeds on either side, \"not enough seeds\". Equal training time: both at the time "
        "the faster of the two needs for its whole run, from the measured time per step; where the two times per "
        "step differ by no more than their spread over seeds (the same rule), equal time is equal steps.")


def _cell(s: P.Search, v: float, best: float | None) -> str:
    loss = s.means.get(v)
    txt = f"{v:g}: " + ("-" if loss is None else "diverged" if math.isinf(loss) else f"{loss:.4f}")
    return f"**{txt}**" if v == best else txt


def table_sweep(runs: list[dict]) -> str:
    """Each tuned contender's two searches: every value tried with its mean final loss, the
    chosen one in bold, and whether it lies strictly inside its grid."""

    p = protocol(runs)
    if p is None:
        return NO_RUNS.format(what="a protocol's sweep")
    res = P.results_of(p, runs)
    rows = []
    for n in sorted(p.tuned, key=_key):
        t = P.tuning(p, n, res)
        for i, key in enumerate(P.KEYS):
            s = t.searches[i] if i < len(t.searches) else None
            if s is None:
                rows.append([n, key, f"(after {P.KEYS[i - 1]})", "-", "not run"])
                continue
            where = ("not finished" if s.best is None else "yes" if s.inside else
                     f"no: at the {s.edge} end of the grid extended once there")
            ext = f" (extended: {', '.join(s.extended)} end)" if s.extended else ""
            rows.append([n, key, " · ".join(_cell(s, v, s.best) for v in s.values) + ext,
                         "-" if s.best is None else f"{s.best:g}", where])
    size = p.size
    for n, why in absent(runs, size).items():
        if n in p.tuned or n in P.Protocol().tuned:
            rows.append([n, "-", f"absent: {why}", "-", "-"])
    return md_table(["contender", "coordinate", f"values tried: mean final val loss over seeds "
                     f"{', '.join(map(str, p.tune_seeds))} ({p.tune_steps} steps)", "chosen", "strictly inside"], rows)


def table_contenders(runs: list[dict]) -> str:
    """Each tuned contender's description and hyper-parameters as a run at its chosen rates
    recorded them (the horizon's runs, else the sweep's), and the absent ones."""

    p = protocol(runs)
    g = tuned_groups(runs, horizon="long") or tuned_groups(runs, horizon="short")
    rows = [[n, rs[0]["description"], rs[0]["hparams_text"]] for n, rs in g.items()]
    size = p.size if p else "small"
    for n, why in absent(runs, size).items():
        if n not in g and (p is None or n in p.long or n in P.Protocol().long):
            rows.append([n, "-", f"absent: {why}"])
    if not rows:
        return NO_RUNS.format(what="a tuned contender")
    return md_table(["contender", "optimizer", "hyper-parameters (as run)"], sorted(rows, key=lambda r: _key(r[0])))


def _chosen_text(runs: list[dict]) -> str:
    ch = P.chosen_of(runs)
    return "; ".join(f"{n}: lr {lr:g}, adam_lr {a:g}, weight_decay {w:g}"
                     for n, (lr, a, w) in sorted(ch.items(), key=lambda kv: _key(kv[0])))


def table_data_seen(runs: list[dict]) -> str:
    """The horizon runs against the corpus: the epochs of the train split they read, and where
    their validation loss was lowest (a run that reads its data several times may pass its best
    validation loss before its last step; the rise from that minimum to the final value is the
    part of the final loss that repeating the data cost, under this validation split)."""
    g = tuned_groups(runs, horizon="long")
    if not g:
        return "*(no horizon run yet: results/train/ holds no run JSON of the tuned contenders at the final horizon)*"
    rows = []
    for n, rs in g.items():
        best = []
        rise = []
        for r in rs:
            c = [q for q in r["curve"] if q.get("val_loss") is not None and math.isfinite(q["val_loss"])]
            if not c:
                continue
            m = min(c, key=lambda q: q["val_loss"])
            best.append(m["step"])
            rise.append(c[-1]["val_loss"] - m["val_loss"])
        ep = rs[0].get("epochs")
        rows.append([n, len(rs), f"{rs[0]['tokens_seen'] / 1e6:.2f}M", "-" if ep is None else f"{ep:.2f}",
                     f"{min(best)}-{max(best)}" if best else "-",
                     f"{sum(rise) / len(rise):.4f} [{min(rise):.4f}, {max(rise):.4f}]" if rise else "-"])
    cap = ("Per contender over its seeds: tokens and epochs of the train split read by the last step; the steps "
           "at which the validation loss was lowest (evaluations every "
           f"{next(iter(g.values()))[0].get('eval_every', '?')} steps); final minus lowest validation loss, mean [min, max].")
    return md_table(["contender", "seeds", "tokens seen", "epochs", "step of the lowest val loss",
                     "final - lowest val loss"], rows) + "\n\n" + cap


def equal_time_groups(runs: list[dict]) -> dict[str, list[dict]]:
    """The protocol's equal-time runs (``role: equal_time``) at their contenders' chosen rates."""
    return tuned_groups(runs, horizon="equal_time")


def pair_prefix(ra: list[dict], rb: list[dict], metric) -> tuple[list[float], list[float], list[int]] | str:
    """Per-seed values of ``metric`` for runs of different lengths on the seeds both ran, checked to be
    paired: the same initial weights (the same validation loss at step 0) and the same data seed. Step
    s's batch depends on the data seed and s alone (papers/corpus.py ``step_seed``), so the shorter
    run's batches are the longer run's first ones; their ``batches_sha256`` (over all steps) differ."""
    xa, xb = {r["seed"]: r for r in ra}, {r["seed"]: r for r in rb}
    seeds = sorted(set(xa) & set(xb))
    for s in seeds:
        x, y = xa[s], xb[s]
        if x.get("data_seed") != y.get("data_seed") or x["curve"][0]["val_loss"] != y["curve"][0]["val_loss"]:
            return f"not paired: seed {s} differs in its data seed or initial weights"
    return [metric(xa[s]) for s in seeds], [metric(xb[s]) for s in seeds], seeds


def table_equal_time(runs: list[dict]) -> str:
    """Each equal-time contender at the step count whose lone time fits the time reference's horizon,
    with its complete schedule over it, against the reference's horizon runs: final validation loss
    and the paired difference (reference - contender, per seed)."""
    p = protocol(runs)
    g = equal_time_groups(runs)
    ref = tuned_groups(runs, horizon="long").get(p.time_reference) if p else None
    if not g or not ref:
        return "*(no equal-time run yet: results/train/ holds no `role: equal_time` run JSON beside the reference's horizon runs)*"
    lone = timings(runs, p.size)
    rt = lone.get(p.time_reference)

    def row(n, rs, diff):
        tm = lone.get(n)
        secs = rs[0]["steps"] * tm["step_s"] if tm else None
        ep = rs[0].get("epochs")
        return [n, f"{rs[0]['steps']:,}", _num(None if tm is None else tm["step_s"] * 1e3, ".2f"),
                _num(secs, ".1f"), "-" if ep is None else f"{ep:.2f}", len(rs), S.fmt_spread([_final(r) for r in rs])] + diff

    rows = [row(p.time_reference, ref, ["-", "-", "-"])]
    for n, rs in g.items():
        pr = pair_prefix(ref, rs, _final)
        if isinstance(pr, str):
            rows.append(row(n, rs, [pr, "-", "-"]))
            continue
        pd = S.paired(pr[0], pr[1])
        rows.append(row(n, rs, [", ".join(f"{v:+.4f}" for v in pd["diffs"]), S.fmt_interval(pd),
                                S.paired_verdict(pd, (p.time_reference, n))]))
    cap = (f"Steps: {p.time_reference}'s horizon ({p.steps:,} steps) for it, for the others the step count whose time at "
           "their own lone time per step (`--timing-only`) fits its time, each with its complete schedule (warm-up and "
           f"decay to 0 over that count); train time: steps x lone time per step (the runs themselves shared the device). "
           f"Last columns: {p.time_reference} - contender, final validation loss per seed, its {LEVEL_TXT} t interval and "
           "the paired verdict. Epochs: of the train split, read by the last step.")
    return md_table(["contender", "steps", "lone ms / step", "train time s", "epochs", "seeds", "final val loss",
                     f"{p.time_reference} - contender per seed", f"mean [{LEVEL_TXT} t interval]", "paired verdict"],
                    rows) + "\n\n" + cap


#: The files a training run executes: the package and the training modules of papers/. Between the
#: protocol's commits from :data:`SAME_CODE_FROM` on, none of them changed (tests/test_papers.py checks it
#: with git where the history is present); the two commits before differ in the package and are
#: compared by their fingerprints (results/train/logs/fingerprint/).
RUN_CODE = ("anvil_fast", "anvil_ref", "papers/train.py", "papers/contenders.py", "papers/protocol.py",
            "papers/corpus.py", "papers/runner.py")
SAME_CODE_FROM = "9b7ed7a"


#: The peers the summary sets ANVIL against, in order.
SUMMARY_PEERS = ("muon", "dion", "normuon", "adamw")
#: What the text calls a difference: a Holm-adjusted p below this (the level's complement).
CLAIM_P = 1 - S.LEVEL
PEER_NAMES = {"muon": "torch's Muon", "dion": "dion's Muon", "normuon": "dion's NorMuon", "adamw": "AdamW"}


def _family_tests(items: list[tuple[str, dict]]) -> dict[str, dict]:
    """``{name: paired dict + "p" + "holm"}`` for one family of paired comparisons."""
    ps = [S.paired_p(pd) for _, pd in items]
    return {n: {**pd, "p": p, "holm": h} for (n, pd), p, h in zip(items, ps, S.holm(ps))}


def comparison(runs: list[dict]) -> dict | None:
    """The tuned comparison's results that the summary and the answer quote: ``ref`` against each
    peer at the final horizon (``final``: paired final loss with p and Holm p over the peers), in
    steps to AdamW's target (``target``, ``to_adamw``: ratios to AdamW's steps; ``to_peer``: ref's
    steps over each peer's, per seed), at equal time (``equal``, Holm over the peers) and ref's
    variants against ref (``variants``, Holm over the variants). None before the horizon runs."""
    p = protocol(runs)
    g = tuned_groups(runs, horizon="long")
    ref = p.time_reference if p else "anvil"
    if not p or ref not in g:
        return None
    out = {"ref": ref, "steps": p.steps, "seeds": len(g[ref])}
    items = []
    for n in SUMMARY_PEERS:
        pr = pair(g, ref, n, _final) if n in g else "absent"
        if not isinstance(pr, str):
            items.append((n, S.paired(pr[0], pr[1])))
    out["final"] = _family_tests(items)
    tgt = target(g)
    out["target"] = tgt
    out["to_adamw"], out["to_peer"] = {}, {}
    if tgt is not None:
        def to_target(r):
            return S.steps_to_target(*_curve(r), tgt) if not r.get("diverged") else math.inf
        logs = []
        for n in (ref, *SUMMARY_PEERS):
            if n != "adamw" and n in g and "adamw" in g:
                pr = pair(g, n, "adamw", to_target)
                if not isinstance(pr, str):
                    out["to_adamw"][n] = S.paired_ratio(pr[0], pr[1])
            if n != ref and n in g:
                pr = pair(g, ref, n, to_target)
                if not isinstance(pr, str):
                    out["to_peer"][n] = S.paired_ratio(pr[0], pr[1])
                    # the ratio's test: the paired t test on the log steps (Holm over the peers below)
                    if math.isfinite(out["to_peer"][n]["ratio"]):
                        logs.append((n, S.paired([math.log(v) for v in pr[0]], [math.log(v) for v in pr[1]])))
        for n, t in _family_tests(logs).items():
            out["to_peer"][n].update(p=t["p"], holm=t["holm"])
    eq = equal_time_groups(runs)
    items, steps = [], {}
    for n in SUMMARY_PEERS:
        if n in eq:
            pr = pair_prefix(g[ref], eq[n], _final)
            if not isinstance(pr, str):
                items.append((n, S.paired(pr[0], pr[1])))
                steps[n] = eq[n][0]["steps"]
    out["equal"] = {n: {**v, "steps": steps[n]} for n, v in _family_tests(items).items()}
    items, labels = [], {}
    for a, b, q in PAIRS_TUNED:
        if b == ref and a.startswith(ref + "_") and a in g:
            pr = pair(g, a, b, _final)
            if not isinstance(pr, str):
                items.append((a, S.paired(pr[0], pr[1])))
                labels[a] = q.removeprefix("ablation: ")
    out["variants"] = {a: {**v, "label": labels[a]} for a, v in _family_tests(items).items()}
    return out


def _holm_text(t: dict) -> str:
    return f"p {S.fmt_p(t['p'])}, Holm p {S.fmt_p(t['holm'])}"


def _side(t: dict) -> int:
    """-1: a (the row's first contender) lower with Holm p below CLAIM_P, +1: higher, 0: neither."""
    if not math.isfinite(t["holm"]) or t["holm"] >= CLAIM_P:
        return 0
    return -1 if t["mean"] < 0 else 1


def _names(ns, detail=None, *, possessive: bool = False) -> str:
    """``name, name and name``, each followed by `` (detail(name))`` where ``detail`` is given;
    ``possessive``: "AdamW's (...)"."""
    items = [PEER_NAMES.get(n, n) + ("'s" if possessive else "") + (f" ({detail(n)})" if detail else "") for n in ns]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def table_summary(runs: list[dict]) -> str:
    """What the tuned comparison says, as generated sentences (:func:`comparison`): ANVIL against
    each peer at the final horizon, in steps to AdamW's target and to the peers', at equal time, and
    its variants. Every number is read from the tables above it; p-values are adjusted by Holm
    within each bullet's family."""
    c = comparison(runs)
    if c is None:
        return "*(no horizon run of the tuned contenders yet)*"
    ref, out = c["ref"], []
    if c["final"]:
        out.append(f"- **Final validation loss at {c['steps']:,} steps**, {ref} minus each peer, mean [{LEVEL_TXT} t "
                   "interval] (paired t test; Holm over the peers): " + "; ".join(
                       f"{n} {S.fmt_interval(t)} ({_holm_text(t)}, {t['n']} seeds)" for n, t in c["final"].items()) + ".")
    if c["to_adamw"]:
        out.append(f"- **Steps to AdamW's target** ({c['target']:.4f}, AdamW's highest final loss over its seeds, so "
                   "AdamW's own ratio is at most 1), as a ratio to AdamW's steps on the same seed: "
                   + "; ".join(f"{n} {S.fmt_interval(q, 2, signed=False)}" for n, q in c["to_adamw"].items()
                               if math.isfinite(q["ratio"])) + ".")
    if c["to_peer"]:
        out.append(f"- **The same steps, {ref} over each peer** on the same seed (geometric mean [{LEVEL_TXT} t "
                   "interval]; t test on the log steps, Holm over the peers): " + "; ".join(
                       f"{n} {S.fmt_interval(q, 2, signed=False)} (p {S.fmt_p(q.get('p', math.nan))}, Holm p "
                       f"{S.fmt_p(q.get('holm', math.nan))})" for n, q in c["to_peer"].items() if math.isfinite(q["ratio"])) +
                   ". These steps are read off runs scheduled for the whole horizon, mid-decay, not runs "
                   "scheduled to end at the target.")
    if c["equal"]:
        out.append(f"- **At equal time** ({ref}'s {c['steps']:,} steps), {ref} minus each peer (Holm over the peers): "
                   + "; ".join(f"{n} at {t['steps']:,} steps {S.fmt_interval(t)} ({_holm_text(t)})"
                               for n, t in c["equal"].items()) + ".")
    if c["variants"]:
        v = c["variants"]
        below = sum(1 for t in v.values() if t["mean"] < 0)
        out.append(f"- **Variants of {ref}** (the lean state and the ablations, {len(v)} pairs, variant minus {ref}; "
                   f"Holm over the {len(v)}): " + "; ".join(f"{t['label']} {S.fmt_interval(t)} ({_holm_text(t)})"
                                                             for t in v.values()) +
                   f". {below} of {len(v)} variants end lower than {ref} in the mean.")
    return "\n".join(out)


def verdict_clauses(tests: dict[str, dict], detail) -> str:
    """``lower than X's (...); not distinguishable from Y's (...); higher than Z's (...)`` over a family of
    paired tests (``detail(name)`` in the brackets): a side is stated only where Holm p < CLAIM_P."""
    parts = []
    for side, words in ((-1, "lower than"), (0, "not distinguishable from"), (1, "higher than")):
        ns = [n for n, t in tests.items() if _side(t) == side]
        if ns:
            parts.append(f"{words} {_names(ns, detail, possessive=True)}")
    return "; ".join(parts)


def answer(runs: list[dict]) -> str:
    """The comparison's answer in a few generated sentences (section 1 and the end of section 8):
    a difference is stated only where its Holm-adjusted p is below :data:`CLAIM_P`."""
    c = comparison(runs)
    if c is None:
        return "The tuned comparison has no horizon run yet."
    ref = "ANVIL" if c["ref"] == "anvil" else c["ref"]
    f = c["final"]
    lower = [n for n, t in f.items() if _side(t) < 0]
    level = [n for n, t in f.items() if _side(t) == 0]
    text = (f"With every contender tuned by one protocol and trained {c['steps']:,} steps on {c['seeds']} held-out "
            f"seeds (the small GPT of section 8), {ref}'s final validation loss ({ref} minus the peer, mean "
            f"[{LEVEL_TXT} t interval], Holm-adjusted p over the {len(f)} peers) is "
            + verdict_clauses(f, lambda n: f"{S.fmt_interval(f[n])}, Holm p {S.fmt_p(f[n]['holm'])}") + ".")
    alone = [n for n in level if f[n]["p"] < CLAIM_P]
    if alone:
        text += (f" Against {_names(alone)} the interval alone excludes 0 (p " + ", ".join(
            S.fmt_p(f[n]["p"]) for n in alone) + f"), which the adjustment over the {len(f)} peers does not keep.")
    muon_family = [n for n in f if n != "adamw"]
    if muon_family and not any(_side(f[n]) < 0 for n in muon_family):
        text += f" {ref} does not train measurably better than the Muon-family peers here"
        text += "; it does beat AdamW." if "adamw" in lower else "."
    faster = [n for n, q in c["to_peer"].items() if q.get("holm", math.nan) < CLAIM_P and q["ratio"] < 1]
    if faster:
        text += (f" It reaches AdamW's target (AdamW's highest final loss) in fewer steps than "
                 + _names(faster, lambda n: f"{S.fmt_interval(c['to_peer'][n], 2, signed=False)} of its steps, "
                                               f"Holm p {S.fmt_p(c['to_peer'][n]['holm'])}")
                 + " on the same seeds, steps read off runs scheduled for the whole horizon.")
    v = c["variants"]
    if v:
        better = [t["label"] for t in v.values() if _side(t) > 0]
        worse = [t["label"] for t in v.values() if _side(t) < 0]
        if not better:
            text += (f" None of its {len(v)} variant{'s' if len(v) > 1 else ''} ends measurably higher than {ref} "
                     f"(Holm over the {len(v)}), so "
                     "these runs give no evidence that the parts they change help at this horizon")
            text += (": " + ", ".join(worse) + " even ends lower." if worse else ".")
        else:
            text += f" Changing {', '.join(better)} ends measurably higher than {ref}."
    return text


#: The package version at each commit the protocol's runs name (``anvil_ref.__version__`` there):
#: written by ``python -m papers.training versions`` from git, checked by tests/test_papers.py.
VERSIONS = Path(__file__).resolve().parent / "data" / "train_versions.json"


def _full_commits(commits) -> dict[str, str]:
    """Each recorded commit -> the longest recorded commit it is a prefix of (a run that named its commit
    by a short hash and one that named the same commit in full are one commit)."""
    cs = [c for c in commits if c]
    return {c: max((d for d in cs if d.startswith(c)), key=len) for c in cs}


def run_commits(runs: list[dict]) -> list[str]:
    """The distinct commits (in full where any run gives it in full) the protocol's runs name."""
    cs = {r.get("commit") for r in runs if r.get("role") in ("sweep", "tuned", "timing", "equal_time")}
    return sorted(set(_full_commits(cs).values()))


def versions_of(commits, *, cwd: Path | None = None) -> dict[str, str]:
    """``{commit: anvil_ref.__version__ at that commit}``, read with git (``git show``)."""
    import re
    import subprocess

    out = {}
    for c in commits:
        src = subprocess.run(["git", "show", f"{c}:anvil_ref/__init__.py"], cwd=cwd or ROOT, capture_output=True,
                             text=True, check=True).stdout
        m = re.search(r'^__version__ = "([^"]+)"', src, re.M)
        out[c] = m.group(1) if m else "unversioned"
    return out


def write_versions(runs: list[dict], path: Path = VERSIONS) -> dict[str, str]:
    v = versions_of(run_commits(runs))
    path.write_text(json.dumps({"generated_by": "python -m papers.training versions (git show <commit>:"
                                "anvil_ref/__init__.py for each commit the protocol's runs name); do not edit",
                                "versions": v}, indent=1) + "\n")
    return v


def stored_versions(path: Path = VERSIONS) -> dict[str, str]:
    return json.loads(path.read_text())["versions"] if path.is_file() else {}


def table_provenance(runs: list[dict]) -> str:
    """The commits the protocol's runs record (each run JSON names the commit of the tree it ran from),
    with the package version at each (:data:`VERSIONS`)."""
    full = _full_commits({r.get("commit") for r in runs})
    versions = stored_versions()
    by: dict[tuple, int] = {}
    for r in runs:
        if r.get("role") not in ("sweep", "tuned", "timing", "equal_time"):
            continue
        k = (full.get(r.get("commit")) or "not recorded", r.get("role"), r.get("steps"))
        by[k] = by.get(k, 0) + 1
    if not by:
        return "*(no run of the protocol yet)*"
    rows = [[f"`{c[:12]}`" if c != "not recorded" else c, versions.get(c, "-"), role, f"{steps:,}" if steps else "-", k]
            for (c, role, steps), k in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0, kv[0][0]))]
    return md_table(["commit", "package version", "role", "steps", "runs"], rows)


def table_anchor(runs: list[dict]) -> str:

    rows = [[ANCHOR_SOURCE, f"12-layer width-768 GPT, FineWeb, target {ANCHOR_TARGET_LOSS:g}",
             "Muon + aux AdamW / plain Adam", f"{ANCHOR_MUON_STEPS:,} / {ANCHOR_ADAM_STEPS:,}",
             f"{ANCHOR_MUON_STEPS / ANCHOR_ADAM_STEPS:.2f} (of the two steps counts; no seeds)"]]
    g = tuned_groups(runs, horizon="long")
    tgt = target(g)
    if tgt is not None:
        m = metrics(g)
        r0 = g["adamw"][0]
        for n in g:
            if n == "adamw" or n.startswith("anvil_"):  # the peers and ANVIL; its variants are in the paired table
                continue
            pr = pair(g, n, "adamw", lambda r: S.steps_to_target(*_curve(r), tgt) if not r.get("diverged") else math.inf)
            if isinstance(pr, str):
                ratio = pr
            else:
                q = S.paired_ratio(pr[0], pr[1])
                ratio = S.fmt_interval(q, 2, signed=False) if math.isfinite(q["ratio"]) else "not reached"
            mean_c = S.summary(m[n]["to_target"])["mean"]
            mean_a = S.summary(m["adamw"]["to_target"])["mean"]
            rows.append([f"this package, size {r0['size']}, tuned", f"{r0['model']['n_params'] / 1e6:.1f}M GPT, stdlib bytes, "
                         f"{r0['steps']} steps, target {tgt:.4f}", f"{n} / adamw",
                         f"{_num(mean_c, '.0f')} / {_num(mean_a, '.0f')}", ratio])
    return md_table(["source", "model, data, target", "optimizers", "steps to target (mean over seeds)",
                     f"ratio (per seed, geometric mean [{LEVEL_TXT} t interval])"], rows)


# ------------------------------------------------------------------------------------- figures
def _mean_curve(rs: list[dict]) -> tuple[list[float], list[float]]:
    return S.mean_curve([_curve(r) for r in rs if not r.get("diverged")] or [_curve(rs[0])])


def figure_loss(g: dict[str, list[dict]], title: str) -> str | None:
    if not g:
        return None
    series, lo, hi = [], math.inf, -math.inf
    for i, (n, rs) in enumerate(g.items()):
        st, ls = _mean_curve(rs)
        pts = [(s, v) for s, v in zip(st, ls) if s > 0 and math.isfinite(v)]
        if not pts:
            continue
        series.append(Series(f"{n} ({len(rs)} seeds)", [p[0] for p in pts], [p[1] for p in pts], dashed=i % 2 == 1))
        lo = min(lo, min(p[1] for p in pts))
        # the top of the plot: each curve at a tenth of the run, so the later differences are visible
        tenth = [v for s, v in pts if s >= 0.1 * st[-1]]
        hi = max(hi, tenth[0] if tenth else pts[-1][1])
    if not series:
        return None
    pad = 0.05 * (hi - lo) if hi > lo else 0.05
    return line_plot(series, title=title, xlabel="step", ylabel="validation loss (nats / byte)",
                     ylim=(lo - pad, hi + pad), legend="upper right")


def figure_sweep(runs: list[dict], key: str) -> str | None:
    """Mean final loss against the swept rate (log scale), one curve per tuned contender."""
    p = protocol(runs)
    if p is None:
        return None
    res = P.results_of(p, runs)
    series, lo = [], math.inf
    for i, n in enumerate(sorted(p.tuned, key=_key)):
        t = P.tuning(p, n, res)
        i = P.KEYS.index(key)
        s = t.searches[i] if i < len(t.searches) else None
        if s is None:
            continue
        pts = [(v, s.means[v]) for v in s.values if v in s.means and math.isfinite(s.means[v])]
        if pts:
            series.append(Series(n, [q[0] for q in pts], [q[1] for q in pts], dashed=i % 2 == 1))
            lo = min(lo, min(q[1] for q in pts))
    if not series:
        return None
    what = {"lr": "main learning rate (lr)", "adam_lr": "Adam side's learning rate (adam_lr)",
            "weight_decay": "weight decay of the matrices (weight_decay)"}[key]
    return line_plot(series, title=f"Sweep of the {what}, {p.tune_steps} steps, mean of seeds "
                     f"{', '.join(map(str, p.tune_seeds))}", xlabel=key, ylabel="final validation loss (nats / byte)",
                     logx=True, ylim=(lo - 0.01, lo + 0.25), legend="upper left")


# -------------------------------------------------------------------------------------- values
#: The GPT sizes the estimate of the protocol's cost is stated for (anvil_fast.models.gpt.SIZES; no torch here).
ESTIMATE_SIZES = {"small": {"n_layer": 6, "n_embd": 384, "ctx": 256, "vocab": 256},
                  "medium": {"n_layer": 12, "n_embd": 768, "ctx": 256, "vocab": 256}}
ESTIMATE_JOBS = 8


def estimates(p: P.Protocol) -> dict[str, dict]:
    """The protocol's estimated cost (papers.protocol.estimate, no grid extended) at each size of
    :data:`ESTIMATE_SIZES` whose H200 training log exists."""
    out = {}
    for size, model in ESTIMATE_SIZES.items():
        log = P.train_log_of(size)
        if log.is_file() and P.BENCH_LOG.is_file():
            q = P.Protocol(**{**p.__dict__, "size": size})
            out[size] = P.estimate(q, P.planned(q), jobs=ESTIMATE_JOBS, model=model, logs=P.read_logs(log, size=size))
    return out


def values() -> dict[str, str]:
    runs = load()
    p = protocol(runs) or P.Protocol()
    # the contenders the protocol plans to run at equal time (p's own list holds those already run)
    declared = next((P.Protocol.from_json(r["protocol"]) for r in runs if r.get("role") == "sweep"), P.Protocol())
    est = estimates(p)
    g = tuned_groups(runs, horizon="long")
    jobs = max((r.get("jobs", 1) for rs in g.values() for r in rs), default=1)

    def e(size: str, key: str, fmt: str) -> str:
        return format(est[size][key], fmt) if size in est else "?"
    gs = tuned_groups(runs, horizon="short")

    def epochs(gg: dict[str, list[dict]]) -> str:
        ep = [r["epochs"] for rs in gg.values() for r in rs if r.get("epochs") is not None]
        return f"{ep[0]:.2f}" if ep else "?"

    def val_windows(gg: dict[str, list[dict]]) -> tuple[str, str]:
        """The final runs' validation windows: their count and their bytes (each ctx + 1 long)."""
        w = [(r["val_windows"], r["ctx"]) for rs in gg.values() for r in rs if r.get("val_windows")]
        return (str(w[0][0]), f"{w[0][0] * (w[0][1] + 1) / 1e3:.1f} kB") if w else ("?", "?")

    def train_mb(gg: dict[str, list[dict]]) -> str:
        tb = [r["train_tokens"] for rs in gg.values() for r in rs if r.get("train_tokens")]
        return f"{tb[0] / 1e6:.2f}" if tb else "?"
    vw, vb = val_windows(g or gs)
    return {"train_epochs_final": epochs(g), "train_epochs_tune": epochs(gs), "train_corpus_mb": train_mb(g or gs),
            "train_val_windows": vw, "train_val_bytes": vb,
            "anchor_target": f"{ANCHOR_TARGET_LOSS:g}", "anchor_muon_steps": f"{ANCHOR_MUON_STEPS:,}",
            "anchor_adam_steps": f"{ANCHOR_ADAM_STEPS:,}",
            "anchor_muon_runs": str(_ANCHOR["muon_runs"]), "anchor_adam_runs": str(_ANCHOR["adam_runs"]),
            "anchor_ratio": f"{ANCHOR_MUON_STEPS / ANCHOR_ADAM_STEPS:.2f}",
            "train_tune_steps": f"{p.tune_steps:,}", "train_tune_seeds": ", ".join(map(str, p.tune_seeds)),
            "train_steps": f"{p.steps:,}", "train_seeds": ", ".join(map(str, p.seeds)),
            "train_clip": f"{p.clip:g}" if p.clip else "off", "train_factor": f"{p.factor:g}",
            "train_grid": ", ".join(f"{p.factor:g}^{k}" if k else "1" for k in p.offsets),
            "train_lr_centers": ", ".join(f"{n} {v:g}" for n, v in p.lr_centers),
            "train_adam_center": f"{p.adam_center:g}",
            "train_wd_centers": ", ".join(f"{n} {v:g}" for n, v in p.wd_centers),
            "train_rail_rule": RAIL_RULE, "train_rail_reference": f"{RAIL_SCALED_REFERENCE_STEPS:,}",
            "train_rail_steps": "engage {}, warm-up {}, cool-down {}".format(*rail_steps(p.steps, RAIL_RULE)),
            "train_rail_steps_scaled": "engage {}, warm-up {}, cool-down {}".format(*rail_steps(p.steps, "scaled")),
            "train_equal_time": ", ".join(n for n in declared.equal_time if n != declared.time_reference),
            "train_time_reference": p.time_reference,
            "train_run_code": ", ".join(f"`{c}`" for c in RUN_CODE), "train_same_code_from": SAME_CODE_FROM,
            "train_tuned": ", ".join(p.tuned), "train_borrows": ", ".join(f"{a} (from {b})" for a, b in p.borrows),
            "train_chosen": _chosen_text(runs) or "(no sweep yet)",
            "train_jobs": ("no run yet" if not g else "one at a time in the runs below" if jobs == 1 else f"up to {jobs} at once in the runs below"),
            "train_estimate_jobs": str(ESTIMATE_JOBS),
            "train_estimate_small": e("small", "wall_s", ".0f"), "train_estimate_medium": e("medium", "wall_s", ".0f"),
            "train_estimate_fb_small_ms": e("small", "forward_backward_ms", ".1f"),
            "train_estimate_fb_medium_ms": e("medium", "forward_backward_ms", ".1f"),
            "train_matmul_efficiency": f"{P.MATMUL_EFFICIENCY:g}",
            "train_warmup": (f"1/{P.WARMUP_DIVISOR} of the run's steps ({p.tune_steps // P.WARMUP_DIVISOR} at "
                             f"{p.tune_steps:,} steps, {p.steps // P.WARMUP_DIVISOR} at {p.steps:,})"),
            "train_level": f"{S.LEVEL:.0%}", "train_answer": answer(runs), "train_claim_p": f"{CLAIM_P:.2f}",
            "train_run_versions": " and ".join(sorted(set(stored_versions().values()))) or "?",
            "package_version": _package_version()}


def _package_version() -> str:
    from anvil_ref import __version__

    return __version__


def tables() -> dict:
    def tuned(horizon: str):
        runs = load()
        p = protocol(runs)
        size = p.size if p else "small"
        g = tuned_groups(runs, horizon=horizon)
        steps = (p.steps if horizon == "long" else p.tune_steps) if p else "?"
        return table_results(g, size, lone=timings(runs, size), missing=absent(runs, size),
                             what=f"the tuned contenders at {steps} steps")

    return {"train_contenders": lambda: table_contenders(load()),
            "train_sweep": lambda: table_sweep(load()),
            "train_tuned": lambda: tuned("long"),
            "train_tuned_short": lambda: tuned("short"),
            "train_paired": lambda: table_paired(load()),
            "train_anchor": lambda: table_anchor(load()),
            "train_data_seen": lambda: table_data_seen(load()),
            "train_provenance": lambda: table_provenance(load()),
            "train_equal_time_runs": lambda: table_equal_time(load()),
            "train_summary": lambda: table_summary(load()),
            "train_fixed_small": lambda: table_results(groups(load(), "small"), "small",
                                                       what="fixed-rate runs of size small"),
            "train_fixed_medium": lambda: table_results(groups(load(), "medium"), "medium",
                                                        what="fixed-rate runs of size medium"),
            "train_verdicts": lambda: table_verdicts(load())}


def figures() -> dict:
    def loss():
        runs = load()
        p = protocol(runs)
        g = tuned_groups(runs, horizon="long")
        return figure_loss(g, f"Validation loss, size {p.size if p else '?'}, tuned, {p.steps if p else '?'} steps "
                              "(mean over seeds)") if g else None

    return {"train_loss": loss,
            "train_sweep_lr": lambda: figure_sweep(load(), "lr"),
            "train_sweep_adam": lambda: figure_sweep(load(), "adam_lr"),
            "train_sweep_wd": lambda: figure_sweep(load(), "weight_decay")}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m papers.training",
                                 description="The training section's data that comes from git: `versions` writes "
                                             "papers/data/train_versions.json (the package version at every commit "
                                             "the protocol's runs name).")
    ap.add_argument("what", choices=["versions"])
    ap.parse_args(argv)
    for c, v in write_versions(load()).items():
        print(f"{c[:12]}  {v}")
    print(f"wrote {VERSIONS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
