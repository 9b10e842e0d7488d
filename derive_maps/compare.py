"""Side-by-side comparison of map sets on the ANVIL interval: certified envelope, certified
``max |log F|``, certified headroom, and the bf16 envelope *measured* on two suites of inputs
(:mod:`derive_maps.bf16`: 64 to 768 rows; 2 x 2 and 8 x 8, ill-conditioned among them).

Every set is judged in the ANVIL cascade (Frobenius margin 1.05, so ``sigma in [1/300, 1/1.05]``),
including the Polar Express and Muon sets, which were designed for other normalizations.
"""

from __future__ import annotations

from .anvil_kind import ANVIL_L, ANVIL_U
from .bf16 import DEFAULT_SHAPES, QUICK_SHAPES, SMALL_SEEDS, SMALL_SHAPES, bf16_envelope
from .errors import check_maps
from .progress import Progress
from .sets import BAND, certificate
from .tables import Table, interval, pct, sig


def resolve(name_or_path: str):
    """A map set by name (``anvil``, a file in anvil_ref/map_sets) or JSON path."""
    return check_maps(name_or_path)


def certified_inputs(name_or_path: str) -> tuple[str, str] | None:
    """``(class, words)`` of the inputs a JSON set's bf16 certificate is limited to
    (:func:`anvil_ref.maps.certified_class`), or None (a name without a file, or a set naming none)."""
    import json
    import os
    from pathlib import Path

    from anvil_ref.maps import MAP_SETS_DIR, certified_class
    s = os.fspath(name_or_path)
    path = Path(s) if (s.endswith(".json") or os.sep in s) else MAP_SETS_DIR / f"{s}.json"
    if not path.is_file():
        return None
    return certified_class(json.loads(path.read_text()), f"maps file {path}")


def compare_rows(sets: dict, *, bf16: bool = True, quick: bool = False, l: str = ANVIL_L,
                 u: str = ANVIL_U, band: float = BAND, progress: bool | None = None) -> list[dict]:
    """One dict per set: its certificate, and its bf16 envelope if ``bf16``."""
    rows = []
    with Progress(len(sets), "compare", enabled=progress) as bar:
        for i, (name, maps) in enumerate(sets.items()):
            bar.update(i, label=f"compare: {name}")
            maps = check_maps(maps)
            row = dict(name=name, n_maps=len(maps), certified=certificate(maps, l=l, u=u, band=band))
            if bf16:
                lf, uf = float(eval_frac(l)), float(eval_frac(u))
                for key, kw in (("bf16", dict(shapes=QUICK_SHAPES, seeds=(0,)) if quick else {}),
                                ("bf16_small", dict(shapes=SMALL_SHAPES, seeds=SMALL_SEEDS[:2] if quick else SMALL_SEEDS))):
                    e = bf16_envelope(maps, l=lf, u=uf, **kw)
                    row[key] = dict(lo=round(e.lo, 6), hi=round(e.hi, 6), max_abs_log=round(e.max_abs_log, 6),
                                    matrices=e.matrices, input_range=[round(e.input_lo, 6), round(e.input_hi, 6)])
            rows.append(row)
            bar.update(i + 1)
    return rows


def eval_frac(s: str):
    from .errors import parse_real
    return parse_real(s, "value")


def _rows_range(shapes) -> str:
    """``"64 to 768"``: the row counts of a suite."""
    r = sorted(m for m, _ in shapes)
    return f"{r[0]} to {r[-1]}"


def _small_names() -> str:
    return " and ".join(f"{m} x {n}" for m, n in SMALL_SHAPES)


def comparison_table(rows: list[dict], *, title: str | None = None) -> Table:
    has_bf16 = any("bf16" in r for r in rows)
    cols = ["map set", "maps", "certified envelope", "certified max|log F|", "headroom (band)"]
    if has_bf16:
        cols += [f"bf16 envelope, measured ({_rows_range(DEFAULT_SHAPES)} rows)", "measured max|log|",
                 f"bf16 envelope, measured ({_small_names()})"]
    out = []
    for r in rows:
        c = r["certified"]
        if c["headroom_certified"] is None:
            head = "none (F may reach 0)"
        else:
            head = pct(c["headroom_certified"], 3)
            if c.get("headroom_upper") is None:
                head = ">= " + head          # in the band all the way to the search limit
            head += f" ({sig(c['headroom_band'], 3)})"
        row = [r["name"], str(r["n_maps"]), interval(*c["envelope_certified"], decimals=8),
               sig(c["max_abs_log_certified"], 4), head]
        if has_bf16:
            b, bs = r.get("bf16"), r.get("bf16_small")
            row += [interval(b["lo"], b["hi"], 5) if b else "-", sig(b["max_abs_log"], 3) if b else "-",
                    ("-" if not bs else interval(bs["lo"], bs["hi"], 5) if bs["hi"] < 10 else
                     f"[{bs['lo']:.5f}, {bs['hi']:.3g}] (explodes)")]
        out.append(row)
    l, u = rows[0]["certified"]["interval"] if rows else (ANVIL_L, ANVIL_U)
    notes = [f"Certified on sigma in [{l}, {u}] by interval branch and bound (bounds rounded outward).",
             "Headroom: F certified inside |log F| <= band on [u, u (1 + headroom)]; band = max(0.01, the "
             "set's own certified max|log F|).",
             ]
    if has_bf16:
        from .robust import resolution_limits, rounding_model
        m = next((r["bf16"]["matrices"] for r in rows if "bf16" in r), 0)
        ms = next((r["bf16_small"]["matrices"] for r in rows if "bf16_small" in r), 0)
        lim = resolution_limits(rounding_model("safe", rows=2, cols=2))
        notes.append(f"bf16 envelopes are measurements, not bounds: the extreme singular values of "
                     f"anvil_fast.core.eager.eager_bf16_cascade (CPU) over {m} seeded test matrices of "
                     f"{_rows_range(DEFAULT_SHAPES)} rows and over {ms} of {_small_names()}, normalized spectra in "
                     "[1.15 l, u] (derive_maps.bf16); "
                     "other inputs can do worse (python -m derive_maps robust certifies).")
        notes.append(f"Resolution: one bf16 rounding of an iterate moves every singular value by up to u ||X||_F, "
                     f"so singular values below {sig(lim['iterate'], 3)} of the largest are not resolved; a bf16 Gram "
                     f"resolves them down to {sig(lim['gram'], 3)} of the largest (sqrt u). The near-rank-1 matrices "
                     "of the small suite put singular values at 1.15 l next to one at about u: at or below both.")
    where = "the ANVIL interval" if (l, u) == (ANVIL_L, ANVIL_U) else f"[{l}, {u}]"
    return Table(title or f"Map sets compared on {where}", cols, out, notes)


#: The requirements an ANVIL-kind map set is held to, judged against the "anvil" row.
GOAL_MAX_ABS_LOG = 2.5e-5
GOAL_HEADROOM = 0.01


def criteria(rows: list[dict]) -> list[dict]:
    """For every row other than ``anvil``: is it certified better than ANVIL_MAPS in exact arithmetic
    (its certified bound below the value ANVIL_MAPS certainly attains), within the 2.5e-5 goal, with
    certified headroom >= 1% in the 0.01 band, and with a measured bf16 envelope inside ANVIL's?"""
    base = next((r for r in rows if r["name"] == "anvil"), None)
    if base is None:
        return []
    out = []
    for r in rows:
        if r["name"] == "anvil":
            continue
        c = r["certified"]
        d = dict(name=r["name"],
                 exact_better=c["max_abs_log_certified"] < base["certified"]["max_abs_log_attained"],
                 within_goal=c["max_abs_log_certified"] <= GOAL_MAX_ABS_LOG,
                 headroom=c["headroom_band"] is not None and c["headroom_band"] <= 0.01
                 and c["headroom_certified"] >= GOAL_HEADROOM)
        if "bf16" in r and "bf16" in base:
            d["bf16_lo"] = r["bf16"]["lo"] >= base["bf16"]["lo"]
            d["bf16_hi"] = r["bf16"]["hi"] <= base["bf16"]["hi"]
        d["all"] = all(v for k, v in d.items() if k != "name")
        out.append(d)
    return out


def criteria_table(rows: list[dict]) -> Table:
    crit = criteria(rows)
    has_bf16 = any("bf16_lo" in c for c in crit)
    cols = ["map set", "exact: better than ANVIL_MAPS", f"max|log F| <= {GOAL_MAX_ABS_LOG:g}",
            "headroom >= 1%"]
    if has_bf16:
        cols += ["measured bf16 low end >= ANVIL's", "measured bf16 high end <= ANVIL's"]
    cols.append("all")
    yn = {True: "yes", False: "no"}
    body = [[c["name"], yn[c["exact_better"]], yn[c["within_goal"]], yn[c["headroom"]]]
            + ([yn[c["bf16_lo"]], yn[c["bf16_hi"]]] if has_bf16 else []) + [yn[c["all"]]] for c in crit]
    base = next(r for r in rows if r["name"] == "anvil")
    return Table("ANVIL-kind requirements, each set against ANVIL_MAPS", cols, body,
                 ["exact: the set's certified max|log F| is below the value ANVIL_MAPS certainly attains "
                  f"({sig(base['certified']['max_abs_log_attained'], 4)}); headroom in the band |log F| <= 0.01; "
                  f"measured bf16: on the suite of {_rows_range(DEFAULT_SHAPES)} rows (a measurement of those "
                  "matrices)."])
