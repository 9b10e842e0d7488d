"""The maps-versus-accuracy frontier in the write-up: a table, a figure and the sentence that
answers "can 5 robust maps match ANVIL_MAPS?", all from papers/data/frontier.json (written by
``python -m derive_maps.frontier``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from papers.svg import Series, line_plot

DATA = Path(__file__).resolve().parent / "data"
ANVIL_INTERVAL_L = "1/300"


def load() -> dict:
    return json.loads((DATA / "frontier.json").read_text())


def _row(d: dict, n: int, l: str) -> dict:
    for r in d["rows"]:
        if r["n_maps"] == n and r["l"] == l:
            return r
    raise KeyError(f"frontier.json has no row for {n} maps on [{l}, u]")


def table() -> str:
    from papers.data_tables import include_markdown
    return include_markdown("frontier.md")


def figure() -> str:
    d = load()
    series = []
    ls = sorted({r["l"] for r in d["rows"]}, key=lambda s: -eval_frac(s))
    for i, l in enumerate(ls):
        rows = [r for r in d["rows"] if r["l"] == l]
        ex = [(r["n_maps"], math.log10(r["exact"]["max_abs_log_certified"])) for r in rows]
        rb = [(r["n_maps"], math.log10(r["robust"]["max_abs_log_certified"])) for r in rows if r["robust"]]
        series.append(Series(f"exact, l = {l}", [x for x, _ in ex], [y for _, y in ex]))
        if rb:
            series.append(Series(f"bf16-robust, l = {l}", [x for x, _ in rb], [y for _, y in rb], dashed=True))
    anvil = math.log10(d["anvil"]["max_abs_log_certified"][ANVIL_INTERVAL_L])
    ys = [y for s in series for y in s.y]
    return line_plot(series, title="Best certified max|log F| on [l, 1/1.05] (dotted: ANVIL_MAPS, l = 1/300)",
                     xlabel="number of maps", ylabel="log10 max|log F| (certified)",
                     ylim=(math.floor(min(ys)) - 0.5, math.ceil(max(ys)) + 0.5), hlines=(anvil,),
                     legend="lower left")


def eval_frac(s: str) -> float:
    num, _, den = s.partition("/")
    return float(num) / float(den or 1)


def values() -> dict[str, str]:
    d = load()
    l = ANVIL_INTERVAL_L
    anvil = d["anvil"]["max_abs_log_certified"][l]
    r5, r6 = _row(d, 5, l), _row(d, 6, l)
    ex5 = r5["exact"]["max_abs_log_certified"]
    rb5 = r5["robust"]
    rb6 = r6["robust"]
    if rb5 is not None and rb5["max_abs_log_certified"] <= anvil:
        answer = (f"Yes: on $[1/300, 1/1.05]$ a five-map set certified under the bf16 rounding model reaches "
                  f"max|log F| = {rb5['max_abs_log_certified']:.3g}, against ANVIL_MAPS' {anvil:.3g}.")
    else:
        robust5 = ("no five-map set of the family passes the robust certificate" if rb5 is None else
                   f"the best five-map set that passes the robust certificate reaches "
                   f"{rb5['max_abs_log_certified']:.3g} (headroom $h = {rb5['headroom']}$, "
                   f"$F'(0) = {rb5['tail_gain']:.1f}$)")
        answer = (f"No. On $[1/300, 1/1.05]$ ANVIL_MAPS' certified max|log F| is {anvil:.3g}; the best five maps "
                  f"reach {ex5:.3g} even in exact arithmetic (a factor {ex5 / anvil:.1f} short), and {robust5}.")
    lows = [r for r in d["rows"] if r["n_maps"] == 5 and r["robust"] and eval_frac(r["l"]) > eval_frac(l)
            and r["robust"]["max_abs_log_certified"] <= d["anvil"]["max_abs_log_certified"][r["l"]]]
    for r in lows:
        answer += (f" On the shorter interval $[{r['l']}, 1/1.05]$ they can: a robust five-map set reaches "
                   f"{r['robust']['max_abs_log_certified']:.3g} there (ANVIL_MAPS: "
                   f"{d['anvil']['max_abs_log_certified'][r['l']]:.3g}) with $F'(0) = {r['robust']['tail_gain']:.1f}$, "
                   f"at the price of certifying nothing about the singular values in $[{l}, {r['l']}]$.")
    if rb6 is not None:
        answer += (f" Six maps that pass the robust certificate do much better than ANVIL_MAPS: "
                   f"{rb6['max_abs_log_certified']:.3g} (headroom $h = {rb6['headroom']}$, "
                   f"$F'(0) = {rb6['tail_gain']:.1f}$ against ANVIL_MAPS' {d['anvil']['tail_gain']:.1f}).")
    def verdict(c: dict) -> str:
        if c["blown_up"]:
            if c["robust_max_reached"] >= 1e50:
                return "blows up (a perturbation sequence of the model drives the output past $10^{50}$)"
            return "may blow up (its enclosure leaves $[-10^{50}, 10^{50}]$)"
        return (f"stays below {c['robust_max_certified']:.4g}" + ("" if c["passed"] else
                f", above its limit {c['limit']:.4g}: refused"))
    return {
        "frontier_answer": answer,
        "frontier_eps": f"{d['eps']:g}",
        "frontier_h_max": d["h_max"],
        "frontier_bisect_steps": str(d["bisect_steps"]),
        "frontier_delta": f"{d['model']['delta_x']:.4g}",
        "frontier_delta0": f"{d['model']['delta0']:.3g}",
        "frontier_anvil_seed": verdict(d["anvil"]["robust_seed_margin"]),
        "frontier_anvil_safe": verdict(d["anvil"]["robust_safe_slack"]),
    }
