"""The maps-versus-accuracy frontier, with and without the bf16 robustness constraint.

For ``n`` maps and an interval ``[l, u]`` (``u = 1/1.05``):

* **exact**: the greedy minimax composition (:func:`derive_maps.polar_express.greedy`, no cushion, no
  safety factor, recentred; optimal for the composition problem, Polar Express Theorem 4.1) on
  ``[l, u]``, certified with :func:`derive_maps.certify.certify_envelope`;
* **robust**: the same construction on ``[l, u (1 + h)]`` with the safety factor ``1 + h`` inside the
  loop (every map but the last is designed for stage values up to ``1 + h`` times its interval's
  end: a rounding at an inner stage pushes the value past that end, and widening only the input
  interval leaves every inner stage at the cliff -- those sets blow up under a 1e-3 perturbation
  even with h = 1/4), for the smallest ``h`` (bisection on ``[0, H_MAX]``, BISECT_STEPS steps)
  whose set passes the robust certificate
  (:mod:`derive_maps.robust`) under the SAFE rounding model on ``[0, u]`` -- no blow-up, and the
  output at most ``exp(e) (1 + eps)`` for every admissible perturbation, where ``e`` is the set's
  own certified exact ``max |log F|`` on ``[l, u]`` (a coarse set cannot promise ``1 + eps``) and
  ``eps = DEFAULT_EPS``. The search is over this one-parameter family: its value is an upper bound
  on the robust optimum, and every number reported is certified.

Each row also has the tail gain ``F'(0) = prod a_k`` (how much the cascade amplifies the smallest
singular directions). ``python -m derive_maps.frontier`` derives everything (a few minutes) and
writes ``papers/data/frontier.json`` and ``frontier.md``; ``--check`` re-certifies the stored sets
and compares (what the tests run, marked slow).
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
from .errors import parse_real
from .polar_express import GreedySettings, greedy
from .robust import DEFAULT_EPS, robust_envelope, rounding_model
from .tables import dumps

GENERATED_BY = "python -m derive_maps.frontier"
N_MAPS = (4, 5, 6, 7)
LOWER_ENDS = ("1/1000", "1/300", "1/100")
H_MAX = Fraction(1, 4)
BISECT_STEPS = 6
MODEL_CONFIG = "safe"
DATA = Path(__file__).resolve().parent.parent / "papers" / "data"


def tail_gain(maps) -> float:
    """``F'(0) = prod_k a_k``."""
    return math.prod(float(m[0]) for m in maps)


def exact_set(n: int, l: str, u: str, h: Fraction = Fraction(0)):
    """The greedy minimax set of ``n`` maps on ``[l, u (1 + h)]``, safety factor ``1 + h`` inside the loop."""
    ud = parse_real(u, "u") * (1 + h)
    g = greedy(GreedySettings(l=l, u=f"{ud.numerator}/{ud.denominator}", n_maps=n, cushion="0",
                              safety=f"{(1 + h).numerator}/{(1 + h).denominator}", safety_mode="inside",
                              recentre="arithmetic", recentre_when="always", final_recentre="geometric"), dps=40)
    return g.maps


def robust_check(maps, l: str, u: str) -> dict:
    """Certified exact error on [l, u] and the robust certificate on [0, u] (see the module docstring)."""
    e = certify_envelope(maps, l, u)
    r = robust_envelope(maps, 0, u, rounding_model(MODEL_CONFIG))
    limit = math.exp(e.max_abs_log_certified) * (1 + DEFAULT_EPS) if math.isfinite(e.max_abs_log_certified) else 0.0
    passed = (not r.blown_up) and r.f_max_certified <= limit
    return dict(max_abs_log_certified=e.max_abs_log_certified, robust_max_certified=r.f_max_certified,
                robust_max_reached=r.f_max_reached, blown_up=r.blown_up, limit=limit, passed=passed)


def robust_search(n: int, l: str, u: str) -> dict | None:
    """Smallest headroom (bisection) whose set passes; None if ``H_MAX`` does not."""
    hi = H_MAX
    maps = exact_set(n, l, u, hi)
    chk = robust_check(maps, l, u)
    if not chk["passed"]:
        return None
    best = (hi, maps, chk)
    lo = Fraction(0)
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        maps = exact_set(n, l, u, mid)
        chk = robust_check(maps, l, u)
        if chk["passed"]:
            hi, best = mid, (mid, maps, chk)
        else:
            lo = mid
    h, maps, chk = best
    return dict(headroom=f"{h.numerator}/{h.denominator}", maps=[list(m) for m in maps],
                maps_hex=[[float(v).hex() for v in m] for m in maps], tail_gain=tail_gain(maps), **chk)


def anvil_row() -> dict:
    """ANVIL_MAPS: its certified error at every lower end, its tail gain, and the robust check at
    the seed's margin and at SAFE's."""
    from .robust import safe_u
    return dict(max_abs_log_certified={l: certify_envelope(ANVIL_MAPS, l, ANVIL_U).max_abs_log_certified
                                       for l in LOWER_ENDS},
                tail_gain=tail_gain(ANVIL_MAPS),
                robust_seed_margin=robust_check(ANVIL_MAPS, ANVIL_L, ANVIL_U),
                robust_safe_slack=robust_check(ANVIL_MAPS, ANVIL_L, safe_u()))


def frontier(progress=print) -> dict:
    rows = []
    for l in LOWER_ENDS:
        for n in N_MAPS:
            ex = exact_set(n, l, ANVIL_U)
            e = certify_envelope(ex, l, ANVIL_U)
            rb = robust_search(n, l, ANVIL_U)
            rows.append(dict(n_maps=n, l=l, u=ANVIL_U,
                             exact=dict(maps=[list(m) for m in ex], maps_hex=[[float(v).hex() for v in m] for m in ex],
                                        max_abs_log_certified=e.max_abs_log_certified, tail_gain=tail_gain(ex)),
                             robust=rb))
            progress(f"n={n} l={l}: exact {e.max_abs_log_certified:.4g}, robust "
                     f"{'none' if rb is None else format(rb['max_abs_log_certified'], '.4g')}")
    return dict(generated_by=GENERATED_BY, model=dict(config=MODEL_CONFIG, **rounding_model(MODEL_CONFIG).as_dict()),
                eps=DEFAULT_EPS, h_max=str(H_MAX), bisect_steps=BISECT_STEPS,
                anvil=anvil_row(),
                rows=rows)


def _g(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def markdown(d: dict) -> str:
    head = ("| l | maps | exact: max\\|log F\\| | exact: F'(0) | robust: max\\|log F\\| | robust: headroom h | "
            "robust: max output (bf16 model) | robust: F'(0) |")
    lines = [f"<!-- generated by `{GENERATED_BY}`: do not edit -->", head, "|" + "---|" * 8]
    for r in d["rows"]:
        ex, rb = r["exact"], r["robust"]
        lines.append(f"| {r['l']} | {r['n_maps']} | {_g(ex['max_abs_log_certified'])} | {ex['tail_gain']:.1f} | "
                     + ("none up to h = " + d["h_max"] + " | - | - | - |" if rb is None else
                        f"{_g(rb['max_abs_log_certified'])} | {rb['headroom']} | {rb['robust_max_certified']:.4f} | "
                        f"{rb['tail_gain']:.1f} |"))
    return "\n".join(lines) + "\n"


def check_stored(d: dict) -> list[str]:
    """Re-certify every stored set; the differences (empty if none)."""
    diffs = []
    for r in d["rows"]:
        ex = tuple(tuple(float.fromhex(v) for v in m) for m in r["exact"]["maps_hex"])
        got = certify_envelope(ex, r["l"], r["u"]).max_abs_log_certified
        if got != r["exact"]["max_abs_log_certified"]:
            diffs.append(f"exact n={r['n_maps']} l={r['l']}: stored {r['exact']['max_abs_log_certified']}, now {got}")
        rb = r["robust"]
        if rb is not None:
            maps = tuple(tuple(float.fromhex(v) for v in m) for m in rb["maps_hex"])
            chk = robust_check(maps, r["l"], r["u"])
            for k in ("max_abs_log_certified", "robust_max_certified", "passed"):
                if chk[k] != rb[k]:
                    diffs.append(f"robust n={r['n_maps']} l={r['l']} {k}: stored {rb[k]}, now {chk[k]}")
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m derive_maps.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="re-certify the stored sets, change nothing")
    p.add_argument("--out", default=str(DATA), help="directory for frontier.json and frontier.md")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.check:
        d = json.loads((out / "frontier.json").read_text())
        diffs = check_stored(d)
        md_ok = (out / "frontier.md").read_text() == markdown(d)
        for x in diffs:
            print(x)
        if not md_ok:
            print("frontier.md differs from the table of frontier.json")
        return 1 if diffs or not md_ok else 0
    d = frontier(progress=lambda s: print(s, file=sys.stderr))
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(dumps(d))
    (out / "frontier.md").write_text(markdown(d))
    print(f"wrote {out / 'frontier.json'} and {out / 'frontier.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
