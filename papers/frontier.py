"""The maps-versus-accuracy frontier in the write-up: a table, a figure and the sentences that
answer "can 5 robust maps match ANVIL_MAPS?", all from papers/data/frontier.json (written by
``python -m derive_maps.frontier``)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
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


def eval_frac(s: str) -> float:
    num, _, den = s.partition("/")
    return float(num) / float(den or 1)


def figure() -> str:
    d = load()
    series = []
    ls = sorted({r["l"] for r in d["rows"]}, key=lambda s: -eval_frac(s))
    for l in ls:
        rows = [r for r in d["rows"] if r["l"] == l]
        ex = [(r["n_maps"], math.log10(r["exact"]["max_abs_log_certified"])) for r in rows
              if not r["exact"]["floor_limited"]]
        if ex:
            series.append(Series(f"exact, l = {l}", [x for x, _ in ex], [y for _, y in ex]))
        for cls in d["classes"]:
            rb = [(r["n_maps"], math.log10(r["robust"][cls]["max_abs_log_certified"])) for r in rows
                  if r["robust"][cls] is not None and r["robust"][cls]["max_abs_log_certified"] > 0]
            if rb:
                series.append(Series(f"bf16-robust ({cls}), l = {l}", [x for x, _ in rb], [y for _, y in rb],
                                     dashed=True))
    anvil = math.log10(d["anvil"]["max_abs_log_certified"][ANVIL_INTERVAL_L])
    ys = [y for s in series for y in s.y]
    return line_plot(series, title="Best certified max|log F| on [l, 1/1.05] (dotted: ANVIL_MAPS, l = 1/300; "
                                   "certificates at the rounding floor left out)",
                     xlabel="number of maps", ylabel="log10 max|log F| (certified)",
                     ylim=(math.floor(min(ys)) - 0.5, math.ceil(max(ys)) + 0.5), hlines=(anvil,),
                     legend="lower left")


def _short(d: dict, cls: str) -> str:
    """A class's name in prose: its words up to the parenthesis."""
    return d["classes"][cls]["words"].split(" (")[0]


def _robust_phrase(d: dict, rb: dict | None, cls: str) -> str:
    if rb is None:
        return f"none of the family passes for {_short(d, cls)}"
    return (f"for {_short(d, cls)} the best five maps that pass reach {rb['max_abs_log_certified']:.3g} "
            f"($h = {rb['headroom']}$, cushion ${rb['cushion']}$, $F'(0) = {rb['tail_gain']:.1f}$)")


def _why(c: dict) -> str:
    """A refusal's reason, short."""
    r = c["reason"]
    if "blow" in r:
        return "it may blow up" if r.startswith("may") else "it blows up"
    if "resolution" in r:
        return f"l = {ANVIL_INTERVAL_L} lies below the class's resolution"
    if "on [0, u]" in r:
        return f"its output may reach {c['robust_max_certified']:.4g}"
    return f"its output may fall to {c['robust_min_certified']:.4g}"


def _certified(rb: dict) -> str:
    """A certified max|log F| in prose, its floor said as such."""
    v = f"{rb['max_abs_log_certified']:.3g}"
    return f"at most {v} (the certifier's floor)" if rb.get("floor_limited") else v


def _anvil_verdicts(d: dict) -> str:
    """ANVIL_MAPS' robust checks, one clause per margin slack."""
    out = []
    for slack, per in d["anvil"]["robust"].items():
        name = "at the seed's margin" if Fraction(slack) == 0 else f"with a slack of ${slack}$"
        got = []
        for cls, c in per.items():
            if c["passed"]:
                got.append(f"is certified for {_short(d, cls)} (output in [{c['robust_min_certified']:.4g}, "
                           f"{c['robust_max_certified']:.4g}])")
            else:
                got.append(f"is refused for {_short(d, cls)} ({_why(c)})")
        out.append(f"{name} it " + " and ".join(got))
    return "; ".join(out)


def values() -> dict[str, str]:
    from derive_maps.robust import resolution_floor, resolution_limits, rounding_model
    d = load()
    l = ANVIL_INTERVAL_L
    anvil = d["anvil"]["max_abs_log_certified"][l]
    r5, r6 = _row(d, 5, l), _row(d, 6, l)
    ex5 = r5["exact"]["max_abs_log_certified"]
    classes = d["classes"]
    robust5 = "; ".join(_robust_phrase(d, r5["robust"][c], c) for c in classes)
    best5 = [rb for rb in r5["robust"].values() if rb is not None]
    if best5 and min(rb["max_abs_log_certified"] for rb in best5) <= anvil:
        answer = (f"Yes: on $[1/300, 1/1.05]$ a five-map set certified under a bf16 rounding model reaches "
                  f"max|log F| = {min(rb['max_abs_log_certified'] for rb in best5):.3g}, against ANVIL_MAPS' "
                  f"{anvil:.3g}.")
    else:
        answer = (f"No. On $[1/300, 1/1.05]$ ANVIL_MAPS' certified max|log F| is {anvil:.3g}; the best five maps "
                  f"reach {ex5:.3g} even in exact arithmetic (a factor {ex5 / anvil:.1f} short), and {robust5}.")
    for r in d["rows"]:
        if r["n_maps"] != 5 or eval_frac(r["l"]) <= eval_frac(l):
            continue
        base = d["anvil"]["max_abs_log_certified"][r["l"]]
        ok = [(c, rb) for c, rb in r["robust"].items() if rb is not None and rb["max_abs_log_certified"] <= base]
        if ok:
            clauses = ", ".join(f"{_certified(rb)} for {_short(d, c)}" for c, rb in ok)
            answer += (f" On the shorter interval $[{r['l']}, 1/1.05]$ robust five-map sets reach {clauses} "
                       f"(ANVIL_MAPS: {base:.3g}), at the price of certifying nothing about the singular values "
                       f"in $[{l}, {r['l']}]$.")
    six = [(c, rb) for c, rb in r6["robust"].items() if rb is not None]
    if six:
        answer += " Six robust maps on $[1/300, 1/1.05]$: " + ", ".join(
            f"{rb['max_abs_log_certified']:.3g} for {_short(d, c)} ($F'(0) = {rb['tail_gain']:.1f}$)"
            for c, rb in six) + f" (ANVIL_MAPS' $F'(0)$: {d['anvil']['tail_gain']:.1f})."
    floor_rows = [f"{r['n_maps']} maps on $[{r['l']}, u]$" for r in d["rows"] if r["exact"]["floor_limited"]]
    two = rounding_model("safe", **{k: v for k, v in _class_args(d, "two").items()})
    lim = resolution_limits(rounding_model("safe", rows=2, cols=2))
    smallest_two = min((r["l"] for r in d["rows"] if r["robust"].get("two")), key=eval_frac, default=None)
    diag = d["classes"]["diagonal"]["model"]
    return {
        "frontier_answer": answer,
        "frontier_eps": f"{d['eps']:g}",
        "frontier_h_grid": ", ".join(d["h_grid"]),
        "frontier_cushions": ", ".join(d["cushions"]),
        "frontier_delta": f"{diag['delta_x']:.4g}",
        "frontier_delta0": f"{diag['delta0']:.3g}",
        "frontier_delta_eps": f"{diag['delta_eps']:.3g}",
        "frontier_anvil": _anvil_verdicts(d),
        "frontier_floor_rows": ", ".join(floor_rows) if floor_rows else "none",
        "frontier_resolution_iterate": f"{lim['iterate']:.3g}",
        "frontier_resolution_gram": f"{lim['gram']:.3g}",
        "frontier_floor_two": f"{resolution_floor(two, '1/1.05'):.3g}",
        "frontier_smallest_l_two": "no $l$ of the table" if smallest_two is None else f"$l = {smallest_two}$",
        "frontier_search_budget": str(d["search_budget"][0]),
        "frontier_class_diagonal": d["classes"]["diagonal"]["words"],
        "frontier_class_two": d["classes"]["two"]["words"],
        "frontier_min_norm": f"{diag['min_norm']:g}",
    }


def _class_args(d: dict, cls: str) -> dict:
    """The rounding_model arguments of a class, from the data's model (block shape by singular values)."""
    from derive_maps.frontier import CLASSES
    return CLASSES[cls][0]
