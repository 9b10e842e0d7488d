"""``python -m derive_maps``: reproduce, analyse, certify, robust, derive, compare, facts, regenerate, bench.

Human-readable tables by default; ``--json`` prints machine-readable JSON to stdout, ``--latex``
a table for the paper; ``derive --out FILE`` writes the derived set to a file that ``anvil_ref`` and
``anvil_fast`` load with ``maps="FILE"``. Map sets are named (``anvil``, anything in anvil_ref/map_sets: ``anvil_express``,
``polar_express_nanogpt5``, ``muon_jordan5``...) or given as a JSON path. Interval ends accept
exact forms such as ``1/300`` and ``1/1.05``.

Examples::

    python -m derive_maps reproduce
    python -m derive_maps analyse anvil
    python -m derive_maps certify anvil_express --l 1/300 --u 1/1.05
    python -m derive_maps derive express --headroom 0.01 --name my_maps --out my_maps.json
    python -m derive_maps derive greedy --l 1e-3 --u 1 --n-maps 5 --cushion 0.02 --safety 1.02
    python -m derive_maps compare anvil anvil_express muon_jordan5
    python -m derive_maps robust anvil --inputs diagonal --slack 1/64
    python -m derive_maps regenerate --check
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from anvil_ref.cli_args import add_progress_flags, positive_int
from anvil_ref.progress import default_enabled
from anvil_ref.constants import MIN_NORM

from .errors import DeriveMapsError

def _add_format(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", dest="fmt", action="store_const", const="json",
                   help="print machine-readable JSON to stdout")
    g.add_argument("--latex", dest="fmt", action="store_const", const="latex", help="LaTeX tabular")
    g.add_argument("--markdown", dest="fmt", action="store_const", const="markdown", help="Markdown table")
    p.set_defaults(fmt="text")
    add_progress_flags(p)


def _add_interval(p: argparse.ArgumentParser, *, l: str, u: str) -> None:
    p.add_argument("--l", default=l, help="lower end of the interval (exact forms such as 1/300 accepted)")
    p.add_argument("--u", default=u, help="upper end of the interval")


def _emit(tables, data, fmt: str) -> None:
    from .tables import dumps, render
    if fmt == "json":
        sys.stdout.write(dumps(data))
    else:
        sys.stdout.write(render(tables, fmt))


# ---------------------------------------------------------------------------------------------

def cmd_reproduce(a) -> int:
    from .regenerate import reproduction_data, reproduction_tables
    data = reproduction_data()
    _emit(reproduction_tables(data), data, a.fmt)
    return 0


def _maps_arg(spec: str):
    from .compare import resolve
    return resolve(spec)


def _band(arg: str, max_abs_log: float) -> float | None:
    """The headroom band from ``--band``; None where no band makes sense (F may reach 0 or below)."""
    import math
    from .sets import headroom_band
    if arg != "auto":
        return float(arg)
    return headroom_band(max_abs_log) if math.isfinite(max_abs_log) else None


def _headroom_row(h) -> list[str]:
    from .tables import pct, sig
    if h is None:
        return ["headroom", "none: F may reach 0 or below on the interval, so no band |log F| <= b holds"]
    return [f"headroom (|log F| <= {sig(h.band, 3)})",
            f"{pct(h.certified, 4)} certified" + (f", out of band at {pct(h.upper, 4)}" if h.upper else
                                                  f" (in band to the {pct(h.h_max, 3)} search limit)")]


def _worst_at(e) -> float:
    """The point where the attained |log F| is largest (the min or the max of F)."""
    import math
    lo = -math.log(e.f_min_attained) if e.f_min_attained > 0 else math.inf
    hi = math.log(e.f_max_attained) if e.f_max_attained > 0 else -math.inf
    return e.argmin if lo >= hi else e.argmax


def cmd_certify(a) -> int:
    from .certify import certify_envelope, certify_headroom
    from .tables import Table, interval, sig
    maps = _maps_arg(a.maps)
    e = certify_envelope(maps, a.l, a.u, rtol=a.rtol, progress=a.progress)
    band = _band(a.band, e.max_abs_log_certified)
    h = certify_headroom(maps, a.u, band=band) if band is not None else None
    data = dict(maps=a.maps, interval=[a.l, a.u], envelope=e.as_dict(), headroom=asdict(h) if h else None)
    rows = [["certified envelope", interval(e.f_min_certified, e.f_max_certified, 10)],
            ["attained values", interval(e.f_min_attained, e.f_max_attained, 10)],
            ["min F attained at sigma", f"{e.argmin:.12g}"],
            ["max F attained at sigma", f"{e.argmax:.12g}"],
            ["certified max |log F|", sig(e.max_abs_log_certified, 6)],
            ["attained max |log F|", f"{sig(e.max_abs_log_attained, 6)} at sigma = {_worst_at(e):.12g}"],
            _headroom_row(h),
            ["boxes", str(e.boxes)]]
    _emit([Table(f"{a.maps} on [{a.l}, {a.u}]", ["quantity", "value"], rows)], data, a.fmt)
    return 0


def cmd_robust(a) -> int:
    from fractions import Fraction
    from .robust import model_for, robust_verdict, safe_u
    from .tables import Table, interval, sig
    maps = _maps_arg(a.maps)
    for name in ("rows", "cols"):
        if getattr(a, name) < 1:
            raise DeriveMapsError(f"--{name} {getattr(a, name)}: expected a positive block size")
    model = model_for(a.config, delta=a.delta, delta0=a.delta0, rows=a.rows, cols=a.cols, inputs=a.inputs,
                      min_norm=a.min_norm)
    if a.u is not None:
        u = a.u
    else:
        from .errors import parse_real
        slack = parse_real(a.slack, "slack") if a.slack is not None else None
        u = safe_u(slack if a.config == "safe" else (slack or Fraction(0)))
    v = robust_verdict(maps, model, l=a.l, u=u, eps=a.eps, progress=a.progress)
    a.eps = v.eps
    h, e = v.headroom, v.envelope
    u_txt = u if isinstance(u, str) else f"{float(u):.12g}"
    data = dict(maps=a.maps, config=a.config, inputs=a.inputs, covers=model.covers(), interval=[a.l, u_txt],
                verdict=v.as_dict())
    mdl = ", ".join(f"{k} {sig(x, 4)}" for k, x in model.as_dict().items())
    rows = [["inputs covered", model.covers()], ["rounding model", mdl],
            ["allowance: exact max |log F| on [l, u] (certified)", sig(v.exact_error, 6)]]
    if h is not None:
        rows += [[f"output on [0, {u_txt}] (certified)", "blows up" if h.blown_up else
                  interval(h.f_min_certified, h.f_max_certified, 8)],
                 ["max output reached by the model", f"{h.f_max_reached:.8g} at sigma = {h.argmax:.10g}"],
                 ["robust headroom (max output - 1)", "inf (blow-up)" if h.blown_up else
                  f"{sig(h.headroom_reached, 4)} reached, {sig(h.headroom_certified, 4)} certified"]]
    if e is not None:
        rows += [[f"robust envelope on [{a.l}, {u_txt}] (certified)", "blows up" if e.blown_up else
                  interval(e.f_min_certified, e.f_max_certified, 8)],
                 ["min output reached by the model", f"{e.f_min_reached:.8g} at sigma = {e.argmin:.10g}"],
                 ["robust max |log| (certified)", sig(e.max_abs_log_certified, 6)]]
    rows.append([f"verdict (eps {sig(a.eps, 3)})", ("passed: " if v.passed else "refused: ") + v.reason])
    _emit([Table(f"{a.maps} under the {a.config} rounding model", ["quantity", "value"], rows)], data, a.fmt)
    return 0 if v.passed else 1


def cmd_analyse(a) -> int:
    from .analysis import analyse
    from .sets import headroom_band
    from .certify import certify_envelope
    from .tables import Table, interval, pct, sig
    if a.top < 1:
        raise DeriveMapsError(f"--top {a.top}: expected a positive number of alternation points to list")
    maps = _maps_arg(a.maps)
    band = a.band
    if band == "auto":
        band = headroom_band(certify_envelope(maps, a.l, a.u, progress=a.progress).max_abs_log_certified)
    r = analyse(maps, a.l, a.u, band=float(band), bf16=a.bf16, progress=a.progress)
    chain = Table(f"{a.maps}: interval chain on [{a.l}, {a.u}]",
                  ["stage", "a", "b", "c", "certified range of s_k", "headroom of the rest"],
                  [[str(s.k), *(("-",) * 3 if s.coeffs is None else tuple(f"{v:.15g}" for v in s.coeffs)),
                    interval(s.lo, s.hi, 8), "-" if s.headroom is None else pct(s.headroom, 3)] for s in r.chain])
    worst = sorted(r.alternation, key=lambda t: -abs(t[1]))[:a.top]
    alt = Table(f"alternation points: {r.n_extrema} extrema (endpoints included), {r.n_active} within 1% "
                f"of the worst; the {len(worst)} largest", ["sigma", "log F"],
                [[f"{x:.12g}", sig(v, 6)] for x, v in sorted(worst)])
    e, h = r.envelope, r.headroom
    summ_rows = [["certified envelope", interval(e.f_min_certified, e.f_max_certified, 10)],
                 ["certified max |log F|", sig(e.max_abs_log_certified, 6)],
                 [f"certified headroom (|log F| <= {sig(h.band, 3)})", pct(h.certified, 4)]]
    if r.bf16:
        summ_rows.append(["bf16 envelope (measured on the suite)", interval(r.bf16["lo"], r.bf16["hi"], 6)])
    summ = Table("certificate", ["quantity", "value"], summ_rows)
    _emit([summ, chain, alt], r.as_dict(), a.fmt)
    return 0


def cmd_derive(a) -> int:
    from .anvil_kind import AnvilKindSettings, derive
    from .certify import certify_envelope, certify_headroom
    from .polar_express import GreedySettings, greedy
    from .polish import polish
    from .tables import Table, dumps, interval, pct, sig
    u = a.u if a.u is not None else f"1/{a.margin}"
    from .sets import NAMED_SETS
    if a.name in NAMED_SETS or a.name == "anvil":
        raise DeriveMapsError(f"--name {a.name}: that name belongs to a generated set (python -m derive_maps "
                              "regenerate rewrites it); choose another name or use --out PATH")
    if a.name and not a.out:
        raise DeriveMapsError(f"--name {a.name}: give --out PATH too; the set is written to PATH under "
                              "that name (the package's map_sets directory holds only generated sets)")
    if a.method in ("express", "optimal", "polished"):
        s = AnvilKindSettings(l=a.l, u=u, n_maps=a.n_maps, headroom=a.headroom, margin=a.design_margin,
                              cushion=a.cushion or "0.02", safety=a.safety, objective=a.objective,
                              target=a.target, max_iter=a.max_iter, dps=a.dps)
        d = derive(a.method, s, name=a.name, start=_maps_arg(a.start) if a.start else None,
                   progress=a.progress)
        maps, info = d.maps, dict(method=a.method, design_interval=list(d.design_interval),
                                  settings=d.settings, notes=d.notes)
    elif a.method == "greedy":
        g = greedy(GreedySettings(l=a.l, u=u, n_maps=a.n_maps, cushion=a.cushion or "0",
                                  safety=a.safety or "1", safety_mode=a.safety_mode, recentre=a.recentre,
                                  recentre_when=a.recentre_when, final_recentre=a.final_recentre),
                   dps=a.dps)
        maps, info = g.maps, dict(method="greedy", settings=asdict(g.settings),
                                  chain=[[float(x), float(y)] for x, y in g.chain])
    else:  # polish
        if not a.start:
            raise DeriveMapsError("derive polish: give the starting map set with --start NAME_OR_JSON")
        r = polish(_maps_arg(a.start), a.l, u, objective=a.objective, dps=a.dps, max_iter=a.max_iter,
                   target=a.target, progress=a.progress)
        maps, info = r.maps, dict(method="polish", start=a.start, objective=a.objective, error=r.error,
                                  start_error=r.start_error, iterations=r.iterations, converged=r.converged)
    e = certify_envelope(maps, a.l, u, progress=a.progress)
    band = _band("auto", e.max_abs_log_certified)
    h = certify_headroom(maps, u, band=band) if band is not None else None
    doc = {"generated_by": a.cmdline, "name": a.name or f"derived_{a.method}",
           "maps": [list(m) for m in maps], "maps_hex": [[float(v).hex() for v in m] for m in maps],
           "provenance": info,
           "certified": dict(interval=[a.l, u], envelope_certified=[e.f_min_certified, e.f_max_certified],
                             max_abs_log_certified=e.max_abs_log_certified,
                             headroom_band=h.band if h else None, headroom_certified=h.certified if h else None)}
    written = None
    if a.out:
        path = Path(a.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(doc))
        written = str(path)
    rows = [[str(k + 1), *(f"{v:.17g}" for v in m)] for k, m in enumerate(maps)]
    head = (f"headroom {pct(h.certified, 4)} (|log F| <= {sig(h.band, 3)})" if h else
            "no headroom (F may reach 0 or below)")
    notes = [f"certified on [{a.l}, {u}]: envelope {interval(e.f_min_certified, e.f_max_certified, 10)}, "
             f"max |log F| {sig(e.max_abs_log_certified, 5)}, {head}"]
    if written:
        notes.append(f"written to {written} (load with anvil_ref.maps.load_maps)")
    _emit([Table(f"derived ({a.method})", ["map", "a", "b", "c"], rows, notes)], doc, a.fmt)
    return 0


def cmd_compare(a) -> int:
    import warnings
    from anvil_ref.maps import MapSetClassWarning
    from .compare import certified_inputs, compare_rows, comparison_table, criteria_table, resolve
    from .sets import COMPARISON
    names = a.sets or list(COMPARISON)
    limited = {n: c for n in names if (c := certified_inputs(n)) is not None and c[0] != "general"}
    for n, (cls, words) in limited.items():
        print(f"note: {n} is certified for {cls} inputs only ({words}); the bf16 suites below run it on "
              "general matrices", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MapSetClassWarning)     # said above, once per set
        sets = {n: resolve(n) for n in names}
    rows = compare_rows(sets, bf16=not a.no_bf16, quick=a.quick, l=a.l, u=a.u, progress=a.progress)
    tables = [comparison_table(rows)] + ([criteria_table(rows)] if any(r["name"] == "anvil" for r in rows)
                                         and len(rows) > 1 else [])
    _emit(tables, {"rows": rows}, a.fmt)
    return 0


def cmd_facts(a) -> int:
    from .facts import all_facts, facts_table
    f = all_facts(polish_iterations=a.polish_iterations, progress=a.progress)
    _emit([facts_table(f)], f, a.fmt)
    return 0


def cmd_regenerate(a) -> int:
    from .regenerate import REPO, build_all, check_all, write_all
    files = build_all(progress=a.progress)
    if a.check:
        problems = check_all(files)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(files)} generated files checked: " + ("unchanged" if not problems else
                                                            f"{len(problems)} differ"))
        return 1 if problems else 0
    write_all(files)
    for p in files:
        print(p.relative_to(REPO))
    return 0


def cmd_bench(a) -> int:
    from .bench import run_bench
    return run_bench(fmt=a.fmt, repeat=a.repeat, progress=a.progress)


# ---------------------------------------------------------------------------------------------

class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option that takes a value shows its default in --help; flags have none worth showing."""

    def _get_help_string(self, action):
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from .anvil_kind import ANVIL_L, ANVIL_U
    p = argparse.ArgumentParser(prog="python -m derive_maps", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    plain_add = sub.add_parser

    def add_parser(*args, **kw):
        return plain_add(*args, formatter_class=_ShowDefaults, **kw)
    sub.add_parser = add_parser

    s = sub.add_parser("reproduce", help="reproduce the published Polar Express tables")
    _add_format(s)
    s.set_defaults(func=cmd_reproduce)

    for name, func, hlp in (("certify", cmd_certify, "certified envelope, max|log F| and headroom"),
                            ("analyse", cmd_analyse, "interval chain, alternation points and certificate")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("maps", help="map set name or JSON path")
        _add_interval(s, l=ANVIL_L, u=ANVIL_U)
        s.add_argument("--band", default="auto",
                       help="headroom band: |log F| <= band (auto: max(0.01, the set's certified max|log F|))")
        _add_format(s)
        s.set_defaults(func=func)
        if name == "certify":
            s.add_argument("--rtol", type=float, default=1e-3, help="relative tightness of each certified bound, in units of max|log F|")
        else:
            s.add_argument("--bf16", action="store_true", help="also measure the bf16 envelope on a suite of inputs")
            s.add_argument("--top", type=int, default=12, help="how many alternation points to list")

    s = sub.add_parser("robust", help="robust certificate under the bf16 rounding model (exit 1 if refused)")
    s.add_argument("maps", help="map set name or JSON path")
    s.add_argument("--config", choices=("safe", "faithful"), default="safe",
                   help="the fast cascade's configuration whose rounding model is used")
    s.add_argument("--delta", type=float, default=None,
                   help="override: relative perturbation of every rounding point (iterate, Gram, B)")
    s.add_argument("--delta0", type=float, default=None, help="override: relative perturbation of the trace")
    s.add_argument("--inputs", choices=("general", "diagonal"), default="general",
                   help="the inputs certified: general matrices whose nonzero block is at most rows x cols "
                        "(min(rows, cols) singular values share each rounding), or diagonal ones")
    s.add_argument("--rows", type=int, default=8, help="rows of the nonzero block (diagonal: of the matrix)")
    s.add_argument("--cols", type=int, default=8, help="columns of the nonzero block (diagonal: of the matrix)")
    s.add_argument("--min-norm", type=float, default=MIN_NORM,
                   help="the class's norm floor: smallest Frobenius norm of an input covered (the normalization's eps)")
    s.add_argument("--l", default=ANVIL_L, help="lower end of the envelope's interval")
    s.add_argument("--u", default=None, help="end of the input interval (None: 1/(1.05 (1 + slack)))")
    s.add_argument("--slack", default=None, help="margin slack when --u is not given (None: the config's, "
                                                 "2^-7 for safe, 0 for faithful)")
    s.add_argument("--eps", type=float, default=None,
                   help="pass if the output stays in [1/(1 + eps), 1 + eps] (None: 2^-5)")
    _add_format(s)
    s.set_defaults(func=cmd_robust)

    s = sub.add_parser("derive", help="derive a new map set")
    s.add_argument("method", choices=("express", "optimal", "polished", "greedy", "polish"),
                   help="express/optimal/polished: the ANVIL-kind pipelines; greedy: Polar Express with "
                        "your settings; polish: joint minimax polish of --start")
    s.add_argument("--l", default=ANVIL_L, help="lower end of the design interval")
    s.add_argument("--u", default=None, help="upper end of the design interval (None: 1/margin)")
    s.add_argument("--margin", default="1.05", help="Frobenius margin: u = 1/margin when --u is not given")
    s.add_argument("--n-maps", type=int, default=6, help="number of maps (polished: that of its start)")
    s.add_argument("--headroom", default="0.01", help="express/optimal/polished: certified headroom above u "
                                                      "to design for")
    s.add_argument("--design-margin", default="0.0005", help="extra design room on top of --headroom")
    s.add_argument("--objective", choices=("log", "abs"), default="log",
                   help="optimal/polished/polish: minimize max |log F| or max |F - 1|")
    s.add_argument("--cushion", default=None, help="Polar Express cushion (None: 0.02 for express, 0 for "
                                                   "greedy)")
    s.add_argument("--safety", default=None, help="Polar Express safety factor (None: 1 + headroom for "
                                                  "express, 1 for greedy)")
    s.add_argument("--safety-mode", choices=("inside", "after"), default="inside",
                   help="greedy: apply the safety factor inside the loop or after it")
    s.add_argument("--recentre", choices=("arithmetic", "geometric"), default="arithmetic",
                   help="greedy: how each map is recentred")
    s.add_argument("--recentre-when", choices=("always", "cushioned"), default="always",
                   help="greedy: recentre every map or only cushioned ones")
    s.add_argument("--final-recentre", choices=("arithmetic", "geometric"), default=None,
                   help="greedy: recentring of the last map (None: as --recentre)")
    s.add_argument("--start", default=None, help="starting map set for polish/polished (None: ANVIL_MAPS "
                                                 "for polished)")
    s.add_argument("--target", type=float, default=2.5e-5, help="polish/polished: stop at this max|log F|")
    s.add_argument("--max-iter", type=positive_int, default=200, help="polish iterations at most")
    s.add_argument("--dps", type=positive_int, default=40, help="mpmath working precision (digits)")
    s.add_argument("--name", default=None, help="name recorded in the file written with --out")
    s.add_argument("--out", default=None, help="write the derived set to this JSON path")
    _add_format(s)
    s.set_defaults(func=cmd_derive)

    s = sub.add_parser("compare", help="compare map sets side by side")
    s.add_argument("sets", nargs="*", help="names or JSON paths (default: the paper's comparison)")
    s.add_argument("--no-bf16", action="store_true", help="skip the bf16 measurement")
    s.add_argument("--quick", action="store_true", help="small bf16 suite")
    _add_interval(s, l=ANVIL_L, u=ANVIL_U)
    _add_format(s)
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("facts", help="check the published statements about ANVIL_MAPS")
    s.add_argument("--polish-iterations", type=positive_int, default=100,
                   help="iterations of the polish that checks the published accuracy claim")
    _add_format(s)
    s.set_defaults(func=cmd_facts)

    s = sub.add_parser("regenerate", help="rewrite (or --check) every generated file")
    s.add_argument("--check", action="store_true", help="compare with the files on disk, change nothing")
    add_progress_flags(s)
    s.set_defaults(func=cmd_regenerate)

    s = sub.add_parser("bench", help="time the solvers (one CPU core)")
    s.add_argument("--repeat", type=positive_int, default=1, help="timings per solver (the best is shown)")
    _add_format(s)
    s.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    import shlex
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser.parse_args(argv)
    a.cmdline = "python -m derive_maps " + " ".join(shlex.quote(x) for x in argv)
    try:
        with default_enabled(getattr(a, "progress", None)):
            return a.func(a)
    except DeriveMapsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
