"""The maps-versus-accuracy frontier, with and without the bf16 robustness constraint.

For ``n`` maps and an interval ``[l, u]`` (``u = 1/1.05``):

* **exact**: the greedy minimax composition (:func:`derive_maps.polar_express.greedy`, no cushion, no
  safety factor, recentred; optimal for the composition problem, Polar Express Theorem 4.1) on
  ``[l, u]``, certified with :func:`derive_maps.certify.certify_envelope` (a certificate at the
  interval arithmetic's rounding floor is flagged: ``floor_limited``, then it bounds the
  arithmetic's resolution, not the set's error, and such rows are not ordered among themselves);
* **robust**, per input class (:data:`CLASSES`: diagonal inputs, and matrices whose nonzero entries
  fit in a 2 x n block with n <= 768, zero-padded into a bank; both with ``||X||_F >= MIN_NORM`` and
  at most 2^22 entries: the words of each class are its model's ``covers()``): the same
  construction on ``[l, u (1 + h)]`` with the safety factor ``1 + h`` inside the loop (every map
  but the last is designed for stage values up to ``1 + h`` times its interval's end: a rounding
  at an inner stage pushes the value past that end) and a cushion ``c`` (each map is fitted on
  ``[max(l_k, c u_k), u_k]``: it keeps ``p(x)/x`` away from 0, the cancellation that lets a rounding
  flip or collapse a singular value in the middle of the interval), for the most accurate
  ``(h, c)`` of the grid :data:`H_GRID` x :data:`CUSHIONS` whose set passes the two-sided robust
  certificate (:func:`derive_maps.robust.robust_verdict`) under the SAFE rounding model of the
  class: no blow-up, the output at most ``exp(e) (1 + eps)`` on ``[0, u]`` and at least
  ``exp(-e) / (1 + eps)`` on ``[l, u]`` for every admissible perturbation, where ``e`` is the set's
  own certified exact ``max |log F|`` on ``[l, u]`` and ``eps = DEFAULT_EPS``. For each cushion the
  scan takes the smallest passing ``h`` (skipping the members less accurate than the best found:
  the error grows with ``h``); of those the smallest certified ``e`` wins. The search is
  over this two-parameter family: its value is an upper bound on the robust optimum, and every
  number reported is certified. Next to each certificate: what the falsification search
  (:mod:`derive_maps.falsify`) *measured* on the class (a measurement on the inputs it tried).

Each row also has the tail gain ``F'(0) = prod a_k`` (how much the cascade amplifies the smallest
singular directions). ``python -m derive_maps.frontier`` derives everything (tens of minutes on
two cores) and writes ``papers/data/frontier.json`` and ``frontier.md``; ``--check`` re-certifies
the stored sets and compares (``--maps 5``: only the five-map rows; :func:`same_certificate`);
``--recertify`` re-computes every certificate of the stored sets (:func:`recertify`); ``--export``
writes one robust set as a map-set JSON naming its class (:func:`export_set`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction
from pathlib import Path

from anvil_ref.constants import ANVIL_MAPS

from .anvil_kind import ANVIL_L, ANVIL_U
from .certify import certify_envelope
from .errors import DeriveMapsError, parse_real
from .polar_express import GreedySettings, greedy
from .progress import Progress
from .robust import DEFAULT_EPS, robust_verdict, rounding_model, safe_u
from .tables import dumps

GENERATED_BY = "python -m derive_maps.frontier"
N_MAPS = (4, 5, 6, 7)
LOWER_ENDS = ("1/1000", "1/300", "1/100", "1/30")
#: The family's safety headrooms and cushions.
H_GRID = ("0", "1/128", "1/64", "1/32", "1/8", "1/4")
CUSHIONS = ("0", "1/20", "1/10", "1/5")
MODEL_CONFIG = "safe"
#: The input classes a robust set is certified for: name -> (rounding_model arguments, the
#: falsification search's block shapes). A class's words are its model's
#: (:meth:`derive_maps.robust.RoundingModel.covers`: shape, norm floor, size limits), and
#: :func:`derive_maps.robust.class_membership` checks a given matrix against them.
CLASSES = {
    "diagonal": (dict(inputs="diagonal", rows=2816, cols=768), ((8, 8),)),
    "two": (dict(inputs="general", rows=2, cols=768), ((2, 2), (2, 8))),
}
#: The falsification search's budget per block shape (inputs, local-search rounds).
SEARCH_BUDGET = (2048, 2)
#: Slacks of ANVIL_MAPS' margin checked in the ANVIL row (0: the seed's margin).
ANVIL_SLACKS = ("0", "1/128", "1/64")
DATA = Path(__file__).resolve().parent.parent / "papers" / "data"


def tail_gain(maps) -> float:
    """``F'(0) = prod_k a_k``."""
    return math.prod(float(m[0]) for m in maps)


def exact_set(n: int, l: str, u: str, h: Fraction | str = Fraction(0), cushion: Fraction | str = "0"):
    """The greedy minimax set of ``n`` maps on ``[l, u (1 + h)]``, safety factor ``1 + h`` inside the
    loop, cushion ``cushion``."""
    h = parse_real(h, "h")
    c = parse_real(cushion, "cushion")
    ud = parse_real(u, "u") * (1 + h)
    g = greedy(GreedySettings(l=l, u=f"{ud.numerator}/{ud.denominator}", n_maps=n,
                              cushion=f"{c.numerator}/{c.denominator}",
                              safety=f"{(1 + h).numerator}/{(1 + h).denominator}", safety_mode="inside",
                              recentre="arithmetic", recentre_when="always", final_recentre="geometric"), dps=40)
    return g.maps


def class_model(cls: str):
    """The SAFE rounding model of an input class of :data:`CLASSES`."""
    return rounding_model(MODEL_CONFIG, **CLASSES[cls][0])


def class_words(cls: str) -> str:
    """What the class covers, in words (its model's :meth:`~derive_maps.robust.RoundingModel.covers`)."""
    return class_model(cls).covers()


def robust_check(maps, l: str, u: str, cls: str = "diagonal", *, exact=None) -> dict:
    """Certified exact error on [l, u] and the two-sided robust certificate of the class
    (:func:`derive_maps.robust.robust_verdict`, the verdict rule the CLI applies too). ``exact``: the
    exact certificate on [l, u], if already computed."""
    uf = parse_real(u, "u")
    exact = certify_envelope(maps, l, uf) if exact is None else exact
    e = exact.max_abs_log_certified
    v = robust_verdict(maps, class_model(cls), l=l, u=uf, exact=exact)
    if v.headroom is None and not math.isfinite(e):
        return dict(max_abs_log_certified=e, floor_width=exact.floor_width, passed=False, reason=v.reason)
    h, env = v.headroom, v.envelope
    return dict(max_abs_log_certified=e, floor_width=exact.floor_width, passed=v.passed, reason=v.reason,
                hi_limit=v.hi_limit,
                lo_limit=v.lo_limit, blown_up=None if h is None else h.blown_up,
                robust_max_certified=None if h is None else h.f_max_certified,
                robust_max_reached=None if h is None else h.f_max_reached,
                robust_min_certified=None if env is None else env.f_min_certified,
                robust_min_reached=None if env is None else env.f_min_reached,
                converged=bool((h is None or h.converged) and (env is None or env.converged)))


def measured(maps, l: str, u: str, cls: str, *, seed: int = 0) -> dict:
    """What the falsification search measures for ``maps`` on the class: the largest output singular
    value over every input it tried, the smallest over those with every normalized singular value
    in ``[l, u]`` (measured, not certified)."""
    from .falsify import ADVERSARIAL, search
    kind = CLASSES[cls][0]["inputs"]
    hi, lo, count, blocks = -math.inf, math.inf, 0, []
    for block in CLASSES[cls][1]:
        f = search(maps, u=u, l=l, inputs=kind, block=block, budget=SEARCH_BUDGET[0], rounds=SEARCH_BUDGET[1],
                   seeds=ADVERSARIAL.get(tuple(block), ()) if kind == "general" else (), seed=seed)
        hi = max(hi, f.out_max)
        lo = min(lo, f.out_min) if f.out_min is not None else lo
        count += f.inputs
        blocks.append(list(block))
    return dict(out_max=hi, out_min=None if lo == math.inf else lo, inputs=count, blocks=blocks)


def _entry(maps, h: str, c: str, chk: dict) -> dict:
    return dict(headroom=h, cushion=c, maps=[list(m) for m in maps], maps_hex=[[float(v).hex() for v in m] for m in maps],
                tail_gain=tail_gain(maps), **chk)


def robust_search(n: int, l: str, u: str, cls: str, *, bar: Progress | None = None) -> dict | None:
    """The most accurate passing member of the family for the class (module docstring); None if no
    member of the grid passes."""
    from .robust import resolution_floor
    if resolution_floor(class_model(cls), u) >= float(parse_real(l, "l")):
        return None          # every set is refused: the class's first rounding can move l to 0
    best, tried = None, 0
    for c in CUSHIONS:
        for h in H_GRID:
            try:
                maps = exact_set(n, l, u, h, c)
            except DeriveMapsError:
                continue     # the cushioned chain closes up (l_k = u_k) before the last map: no member
            cert = certify_envelope(maps, l, u)
            e = cert.max_abs_log_certified
            if best is not None and not e < best["max_abs_log_certified"]:
                break        # a larger h of this cushion only costs more accuracy
            tried += 1
            if bar is not None:
                bar.update(advance=0.0, detail=f"{n} maps, l = {l}, {cls}: h = {h}, cushion = {c}")
            chk = robust_check(maps, l, u, cls, exact=cert)
            if chk["passed"]:
                best = _entry(maps, h, c, chk)
                best.update(max_abs_log_attained=cert.max_abs_log_attained, floor_limited=cert.floor_limited)
                break
    if best is None:
        return None
    best["tried"] = tried
    best["measured"] = measured(tuple(map(tuple, best["maps"])), l, u, cls)
    return best


def _exact_entry(maps, l: str, u: str) -> dict:
    e = certify_envelope(maps, l, u)
    return dict(maps=[list(m) for m in maps], maps_hex=[[float(v).hex() for v in m] for m in maps],
                max_abs_log_certified=e.max_abs_log_certified, max_abs_log_attained=e.max_abs_log_attained,
                floor_limited=e.floor_limited, floor_width=e.floor_width, tail_gain=tail_gain(maps),
                refused={cls: robust_check(maps, l, u, cls, exact=e)["reason"] for cls in CLASSES})


def anvil_row() -> dict:
    """ANVIL_MAPS: its certified error at every lower end, its tail gain, and the robust check of each
    class at the seed's margin and at wider ones (SAFE's slack 2^-7, and 2^-6), each on ``[l, u]``
    with ``u`` that margin's end (the verdict's allowance is the exact error on that interval)."""
    out = dict(max_abs_log_certified={l: certify_envelope(ANVIL_MAPS, l, ANVIL_U).max_abs_log_certified
                                      for l in LOWER_ENDS},
               tail_gain=tail_gain(ANVIL_MAPS), robust={})
    for slack in ANVIL_SLACKS:
        u = safe_u(Fraction(slack))
        ut = f"{u.numerator}/{u.denominator}"
        exact = certify_envelope(ANVIL_MAPS, ANVIL_L, ut)
        out["robust"][slack] = {cls: robust_check(ANVIL_MAPS, ANVIL_L, ut, cls, exact=exact) for cls in CLASSES}
    return out


def frontier(progress: bool | None = None, checkpoint: Path | None = None) -> dict:
    """Every row (module docstring). ``checkpoint``: a file that keeps the rows done so far (a run
    that stops resumes from it; it is deleted at the end)."""
    done = json.loads(checkpoint.read_text()) if checkpoint is not None and checkpoint.is_file() else {}
    rows = []
    with Progress(len(LOWER_ENDS) * len(N_MAPS) + 1, "frontier", enabled=progress) as bar:
        for l in LOWER_ENDS:
            for n in N_MAPS:
                bar.update(len(rows), label=f"frontier: {n} maps on [{l}, u]")
                key = f"{n} {l}"
                if key not in done:
                    ex = exact_set(n, l, ANVIL_U)
                    done[key] = dict(n_maps=n, l=l, u=ANVIL_U, exact=_exact_entry(ex, l, ANVIL_U),
                                     robust={cls: robust_search(n, l, ANVIL_U, cls, bar=bar) for cls in CLASSES})
                    if checkpoint is not None:
                        checkpoint.write_text(dumps(done))
                rows.append(done[key])
        bar.update(len(rows), label="frontier: ANVIL_MAPS")
        anvil = anvil_row()
    if checkpoint is not None and checkpoint.is_file():
        checkpoint.unlink()
    return dict(generated_by=GENERATED_BY, config=MODEL_CONFIG,
                classes={k: dict(words=class_words(k), model=class_model(k).as_dict()) for k in CLASSES},
                eps=DEFAULT_EPS, h_grid=list(H_GRID), cushions=list(CUSHIONS), search_budget=list(SEARCH_BUDGET),
                anvil=anvil, rows=rows)


def _g(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def exact_text(ex: dict) -> str:
    """A certified max|log F| column: the certified value, or its floor."""
    v = _g(ex["max_abs_log_certified"])
    return f"<= {v} (floor)" if ex.get("floor_limited") else v


def markdown(d: dict) -> str:
    cls = list(d["classes"])
    head = "| l | maps | exact: max\\|log F\\| | exact: F'(0) |" + "".join(
        f" {c}: max\\|log F\\| | {c}: (h, cushion) | {c}: certified bf16 envelope | {c}: measured |" for c in cls)
    lines = [f"<!-- generated by `{GENERATED_BY}`: do not edit -->", head, "|" + "---|" * (4 + 4 * len(cls))]
    for r in d["rows"]:
        ex = r["exact"]
        cells = [r["l"], str(r["n_maps"]), exact_text(ex), f"{ex['tail_gain']:.1f}"]
        for c in cls:
            rb = r["robust"][c]
            if rb is None:
                below = "resolution" in ex["refused"][c]
                cells += ["none: l below the resolution" if below else "none in the grid", "-", "-", "-"]
                continue
            m = rb["measured"]
            lo = "-" if m["out_min"] is None else f"{m['out_min']:.4f}"
            cells += [exact_text(rb), f"({rb['headroom']}, {rb['cushion']})",
                      f"[{rb['robust_min_certified']:.4f}, {rb['robust_max_certified']:.4f}]",
                      f"[{lo}, {m['out_max']:.4f}]"]
        lines.append("| " + " | ".join(cells) + " |")
    words = "; ".join(f"{c}: {d['classes'][c]['words']}" for c in cls)
    lines += ["", f"Classes: {words}. Certified bf16 envelope: [min on [l, u], max on [0, u]] of the output "
                  "singular values under the class's rounding model; measured: the same extremes over the "
                  f"falsification search's inputs ({d['search_budget'][0]} per block shape plus "
                  f"{d['search_budget'][1]} rounds of local moves), a measurement. (floor): the certificate is "
                  "the interval arithmetic's rounding floor, not the set's error; such rows are not ordered. "
                  "Below the resolution: the class's first rounding can move a singular value at l to 0."]
    return "\n".join(lines) + "\n"


def same_certificate(stored: float, now: float, stored_floor: bool, now_floor: bool, width: float) -> bool:
    """Whether a re-computed certified ``max |log F|`` is the stored one. Compared exactly, unless the
    interval arithmetic's rounding floor decides both: then each value lies within its floor width of
    the true ``max |log F|`` (:attr:`derive_maps.certify.Envelope.floor_width`: the floored box that sets
    the bound holds a point where ``|log F|`` is at most that much lower), so the two agree to within
    the larger width ``width``, whatever the roundings of the longdouble kernels of the NumPy release."""
    if stored == now:
        return True
    return bool(stored_floor and now_floor and math.isfinite(stored) and math.isfinite(now)
                and abs(stored - now) <= width)


def check_stored(d: dict, *, n_maps=None) -> list[str]:
    """Re-certify every stored set (``n_maps``: only rows with that many maps); the differences
    (empty if none). Certificates compare exactly (:func:`same_certificate`: those the rounding floor
    decides, within its width), the verdicts and the robust bounds exactly."""
    diffs = []
    for r in d["rows"]:
        if n_maps is not None and r["n_maps"] != n_maps:
            continue
        ex = tuple(tuple(float.fromhex(v) for v in m) for m in r["exact"]["maps_hex"])
        got = certify_envelope(ex, r["l"], r["u"])
        st = r["exact"]
        if not same_certificate(st["max_abs_log_certified"], got.max_abs_log_certified, st["floor_limited"],
                                got.floor_limited, max(st.get("floor_width", 0.0), got.floor_width)):
            diffs.append(f"exact n={r['n_maps']} l={r['l']}: stored {st['max_abs_log_certified']}, "
                         f"now {got.max_abs_log_certified}")
        for cls, rb in r["robust"].items():
            if rb is None:
                continue
            maps = tuple(tuple(float.fromhex(v) for v in m) for m in rb["maps_hex"])
            exact = certify_envelope(maps, r["l"], r["u"])
            chk = robust_check(maps, r["l"], r["u"], cls, exact=exact)
            if not same_certificate(rb["max_abs_log_certified"], chk["max_abs_log_certified"], rb["floor_limited"],
                                    exact.floor_limited, max(rb.get("floor_width", 0.0), exact.floor_width)):
                diffs.append(f"robust {cls} n={r['n_maps']} l={r['l']} max_abs_log_certified: stored "
                             f"{rb['max_abs_log_certified']}, now {chk['max_abs_log_certified']}")
            for k in ("robust_max_certified", "robust_min_certified", "passed"):
                if chk[k] != rb[k]:
                    diffs.append(f"robust {cls} n={r['n_maps']} l={r['l']} {k}: stored {rb[k]}, now {chk[k]}")
    return diffs


def recertify(d: dict, progress: bool | None = None) -> dict:
    """The frontier of ``d`` with every certificate re-computed for its stored sets (the family members
    the search chose, the exact sets, the ANVIL row), the classes' words and models re-read; the
    search's choices and measurements kept. Equal to a full derivation when the certificates' rule only
    tightened since ``d`` was derived (a member refused then is refused now) and every stored member
    still passes: then the search stops at the same member. Raises if a stored member no longer passes
    (derive the frontier again)."""
    out = json.loads(json.dumps(d))
    with Progress(len(out["rows"]) + 1, "frontier: recertify", enabled=progress) as bar:
        for i, r in enumerate(out["rows"]):
            bar.update(i, label=f"frontier: recertify {r['n_maps']} maps on [{r['l']}, u]")
            ex = tuple(tuple(float.fromhex(v) for v in m) for m in r["exact"]["maps_hex"])
            r["exact"] = _exact_entry(ex, r["l"], r["u"])
            for cls, rb in r["robust"].items():
                if rb is None:
                    continue
                maps = tuple(tuple(float.fromhex(v) for v in m) for m in rb["maps_hex"])
                cert = certify_envelope(maps, r["l"], r["u"])
                chk = robust_check(maps, r["l"], r["u"], cls, exact=cert)
                if not chk["passed"]:
                    raise DeriveMapsError(f"{r['n_maps']} maps on [{r['l']}, u], {cls}: the stored member no longer "
                                          f"passes ({chk['reason']}); derive the frontier again")
                keep = {k: rb[k] for k in ("tried", "measured")}
                r["robust"][cls] = dict(_entry(maps, rb["headroom"], rb["cushion"], chk),
                                        max_abs_log_attained=cert.max_abs_log_attained,
                                        floor_limited=cert.floor_limited, **keep)
        bar.update(len(out["rows"]), label="frontier: ANVIL_MAPS")
        out["anvil"] = anvil_row()
    out["classes"] = {k: dict(words=class_words(k), model=class_model(k).as_dict()) for k in CLASSES}
    out["eps"] = DEFAULT_EPS
    return out


def export_set(d: dict, n_maps: int, l: str, cls: str) -> dict:
    """The robust set of the frontier ``d`` for ``n_maps`` maps on ``[l, u]`` and class ``cls`` as a map-set
    document (``maps=`` loads it): its coefficients, its certificate, and ``certified_inputs`` naming
    the class, so that loading it for other inputs warns (:func:`anvil_ref.maps.load_maps`)."""
    if cls not in CLASSES:
        raise DeriveMapsError(f"class {cls!r}: expected one of {sorted(CLASSES)}")
    row = next((r for r in d["rows"] if r["n_maps"] == n_maps and r["l"] == l), None)
    if row is None:
        raise DeriveMapsError(f"no row of {n_maps} maps on [{l}, u]; rows: "
                              f"{sorted({(r['n_maps'], r['l']) for r in d['rows']})}")
    rb = row["robust"][cls]
    if rb is None:
        raise DeriveMapsError(f"{n_maps} maps on [{l}, u]: no set of the grid passes for the class {cls!r}")
    kind = CLASSES[cls][0]["inputs"]
    return dict(generated_by=f"{GENERATED_BY} --export {n_maps} {l} {cls}", name=f"frontier_{n_maps}_{cls}",
                maps=rb["maps"], maps_hex=rb["maps_hex"],
                certified_inputs={"class": kind, "covers": d["classes"][cls]["words"]},
                certificate={k: rb[k] for k in ("max_abs_log_certified", "robust_min_certified",
                                                "robust_max_certified", "reason")},
                interval=[l, row["u"]], headroom=rb["headroom"], cushion=rb["cushion"])


def main(argv=None) -> int:
    from anvil_ref.cli_args import add_progress_flags
    p = argparse.ArgumentParser(prog="python -m derive_maps.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="re-certify the stored sets, change nothing")
    p.add_argument("--maps", type=int, default=None, choices=N_MAPS, help="--check: only the rows with this many maps")
    p.add_argument("--export", nargs=4, metavar=("N", "L", "CLASS", "PATH"), default=None,
                   help="write the stored robust set of N maps on [L, u] for CLASS as a map-set JSON at PATH")
    p.add_argument("--recertify", action="store_true",
                   help="re-compute every certificate of the stored sets and rewrite the files (recertify())")
    p.add_argument("--out", default=str(DATA), help="directory for frontier.json and frontier.md")
    add_progress_flags(p)
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.check:
        d = json.loads((out / "frontier.json").read_text())
        diffs = check_stored(d, n_maps=a.maps)
        md_ok = (out / "frontier.md").read_text() == markdown(d)
        for x in diffs:
            print(x)
        if not md_ok:
            print("frontier.md differs from the table of frontier.json")
        return 1 if diffs or not md_ok else 0
    if a.export:
        n, l, cls, path = a.export
        doc = export_set(json.loads((out / "frontier.json").read_text()), int(n), l, cls)
        Path(path).write_text(dumps(doc))
        print(f"wrote {path} ({doc['certified_inputs']['covers']})")
        return 0
    if a.recertify:
        d = recertify(json.loads((out / "frontier.json").read_text()), progress=a.progress)
        (out / "frontier.json").write_text(dumps(d))
        (out / "frontier.md").write_text(markdown(d))
        print(f"wrote {out / 'frontier.json'} and {out / 'frontier.md'}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    d = frontier(progress=a.progress, checkpoint=out / "frontier.partial.json")
    (out / "frontier.json").write_text(dumps(d))
    (out / "frontier.md").write_text(markdown(d))
    print(f"wrote {out / 'frontier.json'} and {out / 'frontier.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
