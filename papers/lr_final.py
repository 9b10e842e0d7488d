"""The learning rate at the final horizon: how far the rate each contender chose at the tuning
horizon sits from the best rate of its factor-2 neighbours at the final horizon.

The runs are ``python -m papers.train --tuned-from results/train/protocol --lr NAME=VALUE`` at the
protocol's final horizon and seeds (results/train_lr_final/, any depth; outside results/train so
that the training section's fixed-rate tables never mix them in): every value the protocol chose
except ``lr``, which moves by a power of 2. The chosen rate's own column is the protocol's horizon
runs, with any other seed run here at the chosen rate (the held-out seeds of a contender whose best
rate is its chosen one); where the chosen rate was rerun here on every seed of :data:`SELECT_SEEDS`
(beside the neighbours, on their device), that rerun is the column. A run here whose setup (steps,
batch, clipping, warm-up, evaluation, corpus, data order, other hyperparameters) differs from the
protocol's horizon runs is refused with the difference named.

The best rate is picked on :data:`SELECT_SEEDS`; the comparison at each contender's best rate pairs
seeds by number, so it reuses the seeds the pick was made on (the text says so).
"""

from __future__ import annotations

import math
from pathlib import Path

from papers import protocol as P
from papers import stats as S
from papers import training as T
from papers.markdown import md_table

FOLDER = T.ROOT / "results" / "train_lr_final"
#: the seeds every cell of the grid is compared on (the protocol's first three horizon seeds)
SELECT_SEEDS = (0, 1, 2)
#: the run fields that must equal the chosen rate's run of the same contender (and seed: data order)
SETUP = ("size", "steps", "batch", "ctx", "clip", "warmup_steps", "eval_every", "val_windows", "lr_schedule")
PEERS = ("muon", "dion", "normuon", "adamw")
#: the fewest seeds outside SELECT_SEEDS a held-out comparison is made on (a t interval needs 2)
MIN_HELD_OUT = 2


def load(folder: Path = FOLDER) -> list[dict]:
    return T.load(folder)


def _origin(r: dict) -> str:
    return f"{r['environment']['device']} at {(r.get('commit') or 'no commit')[:7]}"


def grid(proto_runs: list[dict], runs: list[dict]) -> dict[str, dict[int, dict[int, dict]]]:
    """``{contender: {k: {seed: run}}}``: the run at ``lr = chosen * 2**k`` (``k = 0``: the chosen rate's
    column, :func:`_chosen_column`), for the contenders with at least one neighbour run, in the training section's
    order. ValueError on a run of another setup, a rate off the factor-2 grid or a repeated run."""
    chosen = P.chosen_of(proto_runs)
    base = T.tuned_groups(proto_runs, horizon="long")
    out: dict[str, dict[int, dict[int, dict]]] = {}
    for r in runs:
        n, where = r["contender"], f"results/train_lr_final: {r['contender']} seed {r['seed']} lr {r['hparams'].get('lr')}"
        if n not in chosen or n not in base:
            raise ValueError(f"{where}: the protocol has no chosen rate or horizon run of {n}")
        ref = next((b for b in base[n] if b["seed"] == r["seed"]), base[n][0])
        diff = [f for f in SETUP if r.get(f) != ref.get(f)]
        diff += [f"hparams.{k}" for k in sorted(set(r["hparams"]) | set(ref["hparams"]))
                 if k != "lr" and r["hparams"].get(k) != ref["hparams"].get(k)]
        if r["corpus"]["sha256"] != ref["corpus"]["sha256"]:
            diff.append("corpus")
        if ref["seed"] == r["seed"] and r.get("batches_sha256") != ref.get("batches_sha256"):
            diff.append("batches_sha256 (the data order)")
        if diff:
            raise ValueError(f"{where}: differs from the protocol's horizon run in {', '.join(diff)}")
        k = math.log2(r["hparams"]["lr"] / chosen[n][0])
        if abs(k - round(k)) > 1e-6:
            raise ValueError(f"{where}: lr is not the chosen {chosen[n][0]:g} times a power of 2")
        cell = out.setdefault(n, {}).setdefault(round(k), {})
        if r["seed"] in cell:
            raise ValueError(f"{where}: two runs of the same seed")
        cell[r["seed"]] = r
    for n in out:
        out[n][0] = _chosen_column(n, out[n].get(0, {}), {b["seed"]: b for b in base[n]})
    return {n: dict(sorted(out[n].items())) for n in sorted(out, key=T._key)}


def _chosen_column(n: str, own: dict[int, dict], protocol: dict[int, dict]) -> dict[int, dict]:
    """The chosen rate's column. Runs made here at the chosen rate on every selection seed are the whole
    column (a rerun beside the neighbours, on their device and commit); otherwise the protocol's horizon
    runs, with any other seed run here added (held-out seeds). A partial rerun of the protocol's seeds
    would mix the two: ValueError."""
    if all(s in own for s in SELECT_SEEDS):
        return own
    overlap = sorted(set(own) & set(protocol))
    if overlap:
        raise ValueError(f"results/train_lr_final: {n} at its chosen rate reruns the protocol's seeds {overlap} but "
                         f"not all of {list(SELECT_SEEDS)}: rerun every selection seed (the column is then the "
                         "rerun's) or only seeds the protocol did not run")
    return {**protocol, **own}


def _select_mean(cell: dict[int, dict]) -> float | None:
    """The mean final loss over :data:`SELECT_SEEDS` (None if the cell lacks one of them)."""
    if not all(s in cell for s in SELECT_SEEDS):
        return None
    return sum(T._final(cell[s]) for s in SELECT_SEEDS) / len(SELECT_SEEDS)


def best(row: dict[int, dict[int, dict]]) -> int:
    """The factor exponent with the lowest mean final loss over :data:`SELECT_SEEDS` (ties: the
    chosen rate, then the lower rate)."""
    means = {k: m for k, c in row.items() if (m := _select_mean(c)) is not None}
    return min(means, key=lambda k: (means[k], k != 0, k))


def _factor(k: int) -> str:
    return f"x{2 ** k:g}" if k >= 0 else f"x1/{2 ** -k:g}"


def _paired(a: dict[int, dict], b: dict[int, dict], *, held_out: bool = False) -> dict:
    """``a`` minus ``b`` paired over the seeds both have (``held_out``: only those outside
    :data:`SELECT_SEEDS`, which the pick of the best rate did not see), with ``seeds``."""
    seeds = sorted(s for s in set(a) & set(b) if not held_out or s not in SELECT_SEEDS)
    if not seeds:
        return {"n": 0, "seeds": [], "mean": math.nan, "sd": math.nan, "lo": math.nan, "hi": math.nan}
    return {**S.paired([T._final(a[s]) for s in seeds], [T._final(b[s]) for s in seeds]), "seeds": seeds}


def _origins(g: dict[str, dict[int, dict[int, dict]]]) -> str:
    def of(cells) -> str:
        return ", ".join(sorted({_origin(r) for c in cells for r in c.values()}))
    return (f"the chosen rate (x1): {of(row[0] for row in g.values())}; "
            f"the other rates: {of(c for row in g.values() for k, c in row.items() if k)}")


def devices_text(proto_runs: list[dict], runs: list[dict]) -> str:
    """Whether the grid's chosen-rate column and its other columns ran on the same device(s)."""
    if not runs:
        return "no run was made"
    g = grid(proto_runs, runs)

    def devices(chosen: bool) -> set[str]:
        return {r["environment"]["device"] for row in g.values() for k, c in row.items() if (k == 0) == chosen
                for r in c.values()}
    a, b = devices(True), devices(False)
    if a == b and len(a) == 1:
        return f"every run of the grid ran on one device ({next(iter(a))})"
    return (f"the chosen rate's runs ran on {', '.join(sorted(a))} and the other rates' on {', '.join(sorted(b))} "
            "(the caption names the commits too); the device's part is not controlled; " + held_devices_text(proto_runs, runs))


def held_devices_text(proto_runs: list[dict], runs: list[dict]) -> str:
    """Where the held-out comparison's runs ran: the device most of them ran on, and each contender's seeds
    that ran elsewhere."""
    c = at_best(proto_runs, runs)
    if not c["held"]:
        return "no comparison on seeds the pick did not use was made"
    held = {n: {s: r["environment"]["device"] for s, r in cell.items() if s not in SELECT_SEEDS}
            for n, (_, cell) in c["cells"].items() if n == c["ref"] or n in c["held"]}
    counts: dict[str, int] = {}
    for d in (d for per in held.values() for d in per.values()):
        counts[d] = counts.get(d, 0) + 1
    main = max(counts, key=lambda d: (counts[d], d))
    name = {n: "ANVIL" if n == c["ref"] else T.PEER_NAMES.get(n, n) for n in held}
    others = [f"{name[n]}'s seed{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))} ({dev})"
              for n, per in held.items() for dev in sorted(set(per.values()) - {main})
              for ss in [sorted(s for s, d in per.items() if d == dev)]]
    return (f"on the seeds the pick did not use, the runs at the best rates ran on {main}"
            + (f", except {T._names(others)}" if others else ", every one"))


def table_grid(proto_runs: list[dict], runs: list[dict]) -> str:
    if not runs:
        return "*(no run of the final horizon's learning-rate neighbours yet: results/train_lr_final/ is empty)*"
    g = grid(proto_runs, runs)
    ks = sorted({k for row in g.values() for k in row})
    steps = next(iter(g.values()))[0][SELECT_SEEDS[0]]["steps"]
    rows = []
    for n, row in g.items():
        b = best(row)
        cells = []
        for k in ks:
            m = _select_mean(row[k]) if k in row else None
            cells.append("-" if k not in row else f"({len(row[k])} seeds)" if m is None
                         else f"**{m:.4f}**" if k == b else f"{m:.4f}")
        chosen = row[0][SELECT_SEEDS[0]]["hparams"]["lr"]
        sel = {s: row[b][s] for s in SELECT_SEEDS}
        gain = _paired(sel, {s: row[0][s] for s in SELECT_SEEDS})
        rows.append([n, f"{chosen:g}", *cells, f"{_factor(b)} ({chosen * 2 ** b:g})",
                     "-" if b == 0 else S.fmt_interval(gain)])
    seeds = ", ".join(map(str, SELECT_SEEDS))
    return (md_table(["contender", "chosen lr", *(_factor(k) for k in ks), f"best at {steps:,} steps",
                      "best - chosen"], rows)
            + f"\n\nMean final validation loss over seeds {seeds} at {steps:,} steps, each column the chosen `lr` times "
            f"its factor, every other value as chosen; bold: the lowest of the row. Last column: the best rate's final "
            f"loss minus the chosen rate's, paired over seeds {seeds}, mean [{T.LEVEL_TXT} t interval]. Runs: "
            f"{_origins(g)}.")


def at_best(proto_runs: list[dict], runs: list[dict], ref: str = "anvil") -> dict:
    """Each contender at its best rate (every seed run there) and ``ref`` minus each peer, paired over
    the seeds both have (``tests``) and over those of them the pick did not use (``held``: the peers
    with at least :data:`MIN_HELD_OUT` such seeds), each with p and Holm p over its peers."""
    g = grid(proto_runs, runs)
    cells = {n: (k, row[k]) for n, row in g.items() for k in (best(row),)}
    peers = [n for n in PEERS if n in cells and ref in cells]
    held = [(n, pd) for n in peers if (pd := _paired(cells[ref][1], cells[n][1], held_out=True))["n"] >= MIN_HELD_OUT]
    return {"ref": ref, "cells": cells, "tests": T._family_tests([(n, _paired(cells[ref][1], cells[n][1])) for n in peers]),
            "held": T._family_tests(held)}


def table_best(proto_runs: list[dict], runs: list[dict]) -> str:
    if not runs:
        return "*(no run of the final horizon's learning-rate neighbours yet)*"
    c = at_best(proto_runs, runs)
    ref, rows = c["ref"], []
    for n, (k, cell) in c["cells"].items():
        t, h = c["tests"].get(n), c["held"].get(n)
        lr = next(iter(cell.values()))["hparams"]["lr"]
        rows.append([n, f"{lr:g} ({_factor(k)})", ", ".join(map(str, sorted(cell))),
                     S.fmt_spread([T._final(cell[s]) for s in sorted(cell)]),
                     "-" if t is None else S.fmt_interval(t), "-" if t is None else S.fmt_p(t["p"]),
                     "-" if t is None else S.fmt_p(t["holm"]),
                     "-" if h is None else ", ".join(map(str, h["seeds"])),
                     "-" if h is None else S.fmt_interval(h), "-" if h is None else S.fmt_p(h["holm"])])
    sel = ", ".join(map(str, SELECT_SEEDS))
    return (md_table(["contender", "lr (factor)", "seeds", "final val loss", f"{ref} - contender",
                      "p", "Holm p", f"seeds not in {sel}", f"{ref} - contender there", "Holm p there"], rows)
            + f"\n\nEach contender at the rate the table above marks best; final validation loss mean ± sample std "
            f"[min, max] over its seeds; {ref} minus the contender paired over the seeds both have, mean "
            f"[{T.LEVEL_TXT} t interval], two-sided paired t test, Holm over the {len(c['tests'])} peers. The last "
            f"three columns: the same over the seeds the pick of the best rates did not use (at least {MIN_HELD_OUT}; "
            f"Holm over the {len(c['held'])} peers that have them).")


def headline(proto_runs: list[dict], runs: list[dict]) -> str:
    """One generated sentence: where each contender's best rate at the final horizon lies and what
    ``ref`` against each peer at those rates says (a difference stated only where Holm p < CLAIM_P)."""
    if not runs:
        return "(no run of the final horizon's learning-rate neighbours yet)"
    c = at_best(proto_runs, runs)
    ref = c["ref"]
    if ref not in c["cells"]:
        return f"(no run of {ref}'s learning-rate neighbours yet)"
    def name(n: str) -> str:
        return "ANVIL" if n == ref else T.PEER_NAMES.get(n, n)
    moved = [f"{_factor(k)} for {name(n)}" for n, (k, _) in c["cells"].items() if k]
    kept = [name(n) for n, (k, _) in c["cells"].items() if not k]
    steps = next(iter(c["cells"][ref][1].values()))["steps"]
    out = (f"At {steps:,} steps, of each contender's factor-2 neighbours (mean final loss over seeds "
           f"{', '.join(map(str, SELECT_SEEDS))}), the chosen rate stays best for "
           f"{T._names(kept) if kept else 'none of them'}"
           + (f"; the best is the chosen rate {moved[0]}" + "".join(
               f"{', ' if i < len(moved) - 1 else ' and '}{m}" for i, m in enumerate(moved[1:], 1)) if moved else "")
           + ". ")
    t = c["tests"]
    out += "At those rates ANVIL's final validation loss is " + _verdicts(t) + "."
    if c["held"]:
        out += (f" On the seeds the pick did not use ({', '.join(map(str, sorted({s for h in c['held'].values() for s in h['seeds']})))}), "
                f"it is {_verdicts(c['held'])}.")
    return out


def _verdicts(t: dict[str, dict]) -> str:
    return T.verdict_clauses(t, lambda n: f"{S.fmt_interval(t[n])}, Holm p {S.fmt_p(t[n]['holm'])}, {t[n]['n']} seeds")


def values() -> dict[str, str]:
    return {"lr_final_headline": headline(T.load(), load()),
            "lr_final_select_seeds": ", ".join(map(str, SELECT_SEEDS)),
            "lr_final_devices": devices_text(T.load(), load())}


def tables() -> dict:
    return {"lr_final_grid": lambda: table_grid(T.load(), load()),
            "lr_final_best": lambda: table_best(T.load(), load())}
