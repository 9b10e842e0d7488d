"""The paper's training section, generated from the run JSONs of ``python -m papers.train`` kept
under results/train/ (any depth; a run's size and whether it is a sweep are read from its JSON).

Without any run JSON every table says so (generated text, not a failure) and the figure is left
out. The statistics and the rule for "no measurable difference" are papers/stats.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from papers import stats as S
from papers.svg import Series, line_plot

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results" / "train"
FORMAT = 1  # papers.train.FORMAT (not imported: building the paper must not need torch)

#: The comparison anchor, a published fact and no measurement of this package: modded-nanogpt's
#: optimization benchmark (github.com/KellerJordan/modded-nanogpt, the optimization track: a 124M
#: GPT on FineWeb, fixed architecture, data and batch, minimizing the steps to validation loss
#: 3.28), where tuned Muon needs 3,250 steps and Adam(W) 5,625.
ANCHOR_TARGET_LOSS = 3.28
ANCHOR_MUON_STEPS = 3250
ANCHOR_ADAM_STEPS = 5625
ANCHOR_SOURCE = "modded-nanogpt optimization benchmark (github.com/KellerJordan/modded-nanogpt)"

#: The contenders' order in tables and the figure.
ORDER = ("adamw", "muon", "anvil", "anvil_faithful", "anvil_gram_side", "anvil_derived", "anvil_polar",
         "anvil_nesterov", "anvil_defaults")
#: The pairs the verdict table answers: (a, b, question).
PAIRS = (
    ("anvil", "anvil_faithful", "SAFE vs FAITHFUL"),
    ("anvil_gram_side", "anvil", "Gram-side cascade vs SAFE"),
    ("anvil_derived", "anvil", "derived map set (anvil_express) vs ANVIL_MAPS"),
    ("anvil_polar", "anvil", "Polar Express coefficients vs ANVIL_MAPS"),
    ("anvil_nesterov", "anvil", "plain Nesterov vs the record's twin rails"),
    ("anvil", "muon", "ANVIL vs Muon"),
    ("anvil", "adamw", "ANVIL vs AdamW"),
    ("muon", "adamw", "Muon vs AdamW"),
)
BUDGETS = (0.25, 0.5)  # fractions of the run's steps at which the loss is also reported
NO_RUNS = ("*(no training run yet: results/train/ holds no run JSON of {what}; "
           "`python -m papers.train` writes them, see its module docstring)*")


def load(folder: Path = RUNS) -> list[dict]:
    out = []
    if not folder.is_dir():
        return out
    for p in sorted(folder.rglob("*.json")):
        r = json.loads(p.read_text())
        if isinstance(r, dict) and r.get("format") == FORMAT and "contender" in r:
            out.append(r)
    return out


def _sizes(runs: list[dict]) -> list[str]:
    order = ("tiny", "small", "medium")
    return sorted({r["size"] for r in runs}, key=lambda s: (order.index(s) if s in order else 9, s))


def _curve(r: dict) -> tuple[list[float], list[float]]:
    return [c["step"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]]


def _final(r: dict) -> float:
    v = r["final_val_loss"]
    return v if math.isfinite(v) and not r.get("diverged") else math.inf


def groups(runs: list[dict], size: str) -> dict[str, list[dict]]:
    """Main (non-sweep) runs of ``size`` by contender, in :data:`ORDER`, seeds sorted."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r["size"] == size and not r.get("sweep"):
            by.setdefault(r["contender"], []).append(r)
    setups = {(r["steps"], r["batch"], r["ctx"]) for rs in by.values() for r in rs}
    if len(setups) > 1:
        raise ValueError(f"results/train: the size-{size} runs mix step counts / batches {sorted(setups)}; "
                         f"a comparison needs one setup (keep other runs outside results/train)")
    key = {n: i for i, n in enumerate(ORDER)}
    return {n: sorted(by[n], key=lambda r: r["seed"]) for n in sorted(by, key=lambda n: (key.get(n, 99), n))}


def target(g: dict[str, list[dict]]) -> float | None:
    """The target loss: the AdamW runs' mean final validation loss (None without a finished AdamW run)."""
    finals = [_final(r) for r in g.get("adamw", []) if math.isfinite(_final(r))]
    return S.summary(finals)["mean"] if finals else None  # a diverged AdamW seed sets no target


def _mean_curve(rs: list[dict]) -> tuple[list[float], list[float]]:
    return S.mean_curve([_curve(r) for r in rs if not r.get("diverged")] or [_curve(rs[0])])


def _step_s(rs: list[dict]) -> float | None:
    t = [r["timing"]["step_s"] for r in rs if r.get("timing")]
    return sum(t) / len(t) if t else None


def metrics(g: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender: finals, losses at the budgets, per-seed and mean-curve steps to the target."""
    tgt = target(g)
    out = {}
    for n, rs in g.items():
        steps = rs[0]["steps"]
        m = {"final": [_final(r) for r in rs],
             "budgets": {f: [S.loss_at(*_curve(r), f * steps) if not r.get("diverged") else math.inf for r in rs]
                         for f in BUDGETS},
             "step_s": _step_s(rs),
             "opt_share": (sum(r["timing"]["opt_share"] for r in rs if r.get("timing")) /
                           max(1, sum(1 for r in rs if r.get("timing")))) if any(r.get("timing") for r in rs) else None}
        if tgt is not None:
            m["to_target"] = [S.steps_to_target(*_curve(r), tgt) if not r.get("diverged") else math.inf for r in rs]
            m["to_target_mean_curve"] = S.steps_to_target(*_mean_curve(rs), tgt)
        out[n] = m
    return out


def _num(v: float | None, fmt: str) -> str:
    if v is None:
        return "-"
    return "not reached" if math.isinf(v) else format(v, fmt)


def table_results(runs: list[dict], size: str) -> str:
    g = groups(runs, size)
    if not g:
        return NO_RUNS.format(what=f"size {size}")
    m = metrics(g)
    tgt = target(g)
    base = m.get("adamw", {}).get("to_target_mean_curve")
    r0 = next(iter(g.values()))[0]
    tok = r0["batch"] * r0["ctx"]
    header = ["contender", "hyper-parameters", "seeds"] + [
        f"val loss at {f * r0['steps'] * tok / 1e6:.2f}M tokens (step {f * r0['steps']:g})" for f in BUDGETS] + [
        f"final val loss ({r0['steps'] * tok / 1e6:.2f}M tokens)", "steps to target (per seed)", "steps to target (seed-mean curve)", "ratio to AdamW",
        "ms / step", "optimizer share"]
    rows = []
    for n, rs in g.items():
        x = m[n]
        ratio = (x["to_target_mean_curve"] / base) if tgt is not None and base and math.isfinite(base) else None
        rows.append([n, rs[0]["hparams_text"], len(rs)] + [S.fmt_spread(x["budgets"][f]) for f in BUDGETS] + [
            S.fmt_spread(x["final"]), S.fmt_spread(x["to_target"], 0) if tgt is not None else "-",
            _num(x.get("to_target_mean_curve"), ".0f"), _num(ratio, ".2f"),
            _num(None if x["step_s"] is None else x["step_s"] * 1e3, ".1f"),
            _num(None if x["opt_share"] is None else x["opt_share"] * 100, ".0f") + ("%" if x["opt_share"] is not None else "")])
    from papers.build import md_table  # papers.build imports this module at call time, not at import

    cap = (f"Size `{size}` ({r0['model']['n_params'] / 1e6:.1f}M parameters), {r0['steps']} steps of "
           f"{r0['batch']} x {r0['ctx']} bytes, validation every {r0.get('eval_every', '?')} steps on "
           f"{r0.get('val_windows', '?')} fixed windows, {r0['environment']['device']}, torch {r0['environment']['torch']}; "
           f"corpus sha256 `{r0['corpus']['sha256'][:16]}` ({r0['corpus']['train_bytes']:,} train bytes). "
           f"Mean ± sample std [min, max] over seeds. Target: AdamW's mean final validation loss"
           + (f" ({tgt:.4f})." if tgt is not None else " (no AdamW run)."))
    return md_table(header, rows) + "\n\n" + cap


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
    from papers.build import md_table

    rows = []
    for size in _sizes(runs):
        g = groups(runs, size)
        m = metrics(g)
        for a, b, q in PAIRS:
            if a not in g or b not in g:
                continue
            d = S.summary(m[a]["final"])["mean"] - S.summary(m[b]["final"])["mean"]
            eq = _equal_time(g[a], g[b])
            at_steps = S.verdict(m[a]["final"], m[b]["final"], (a, b))
            if eq == SAME_SPEED:
                at_time = f"{at_steps} ({SAME_SPEED})"
            else:
                at_time = S.verdict(eq[0], eq[1], (a, b)) + f" (at {eq[2]:.1f} s)" if eq else "-"
            rows.append([size, q, f"{d:+.4f}" if math.isfinite(d) else "-", at_steps, at_time])
    if not rows:
        return NO_RUNS.format(what="any pair of contenders")
    return md_table(["size", "question", "final loss, mean a - mean b", "at equal steps", "at equal training time"],
                    rows) + ("\n\nRule: |mean a - mean b| <= the larger sample std over seeds of the two is "
                             "\"no measurable difference\"; below 2 seeds on either side, \"not enough seeds\". "
                             "Equal training time: both at the time the faster of the two needs for its whole run, "
                             "from the measured time per step; where the two times per step differ by no more than "
                             "their spread over seeds (the same rule), equal time is equal steps.")


def table_sweeps(runs: list[dict]) -> str:
    from papers.build import md_table

    rows = sorted(((r["size"], r["contender"], float(r["hparams"]["lr"]), r["seed"], _final(r))
                   for r in runs if r.get("sweep")))
    if not rows:
        return NO_RUNS.format(what="a learning-rate sweep")
    best: dict[tuple, tuple] = {}
    for size, n, lr, _, loss in rows:
        if (size, n) not in best or loss < best[(size, n)][1]:
            best[(size, n)] = (lr, loss)
    return md_table(["size", "contender", "lr", "seed", "final val loss", "best"],
                    [[s, n, f"{lr:g}", sd, _num(v, ".4f"), "yes" if best[(s, n)][0] == lr else ""]
                     for s, n, lr, sd, v in rows])


def table_anchor(runs: list[dict]) -> str:
    from papers.build import md_table

    rows = [[ANCHOR_SOURCE, f"124M GPT, FineWeb, target {ANCHOR_TARGET_LOSS:g}", "Muon / Adam",
             f"{ANCHOR_MUON_STEPS:,} / {ANCHOR_ADAM_STEPS:,}", f"{ANCHOR_MUON_STEPS / ANCHOR_ADAM_STEPS:.2f}"]]
    for size in _sizes(runs):
        g = groups(runs, size)
        tgt = target(g)
        if tgt is None:
            continue
        m = metrics(g)
        base = m["adamw"]["to_target_mean_curve"]
        r0 = g["adamw"][0]
        for n in g:
            if n == "adamw":
                continue
            s = m[n]["to_target_mean_curve"]
            rows.append([f"this package, size {size}", f"{r0['model']['n_params'] / 1e6:.1f}M GPT, stdlib bytes, "
                         f"target {tgt:.4f}", f"{n} / adamw", f"{_num(s, '.0f')} / {base:.0f}",
                         _num(s / base if math.isfinite(s) else math.inf, ".2f")])
    return md_table(["source", "model, data, target", "optimizers", "steps to target", "ratio"], rows)


def figure_loss(runs: list[dict], size: str = "small") -> str | None:
    g = groups(runs, size)
    if not g:
        return None
    series, lo, hi = [], math.inf, -math.inf
    for i, (n, rs) in enumerate(g.items()):
        st, ls = _mean_curve(rs)
        pts = [(s, v) for s, v in zip(st, ls) if s > 0 and math.isfinite(v)]
        if not pts:
            continue
        series.append(Series(f"{n} ({len(rs)} seeds)", [p[0] for p in pts], [p[1] for p in pts], dashed=i % 2 == 1))
        lo, hi = min(lo, min(p[1] for p in pts)), max(hi, max(p[1] for p in pts))
    if not series:
        return None
    pad = 0.05 * (hi - lo) if hi > lo else 0.05
    return line_plot(series, title=f"Validation loss, size {size} (mean over seeds)", xlabel="step",
                     ylabel="validation loss (nats / byte)", ylim=(lo - pad, hi + pad), legend="upper right")


def values() -> dict[str, str]:
    return {"anchor_target": f"{ANCHOR_TARGET_LOSS:g}", "anchor_muon_steps": f"{ANCHOR_MUON_STEPS:,}",
            "anchor_adam_steps": f"{ANCHOR_ADAM_STEPS:,}",
            "anchor_ratio": f"{ANCHOR_MUON_STEPS / ANCHOR_ADAM_STEPS:.2f}"}


def tables() -> dict:
    return {"train_small": lambda: table_results(load(), "small"),
            "train_medium": lambda: table_results(load(), "medium"),
            "train_verdicts": lambda: table_verdicts(load()),
            "train_sweeps": lambda: table_sweeps(load()),
            "train_anchor": lambda: table_anchor(load())}


def figures() -> dict:
    return {"train_loss": lambda: figure_loss(load(), "small")}
