"""The command-line tools as a user meets them: progress on long runs, one verdict rule in difftest,
bad arguments refused in one line, valid values in ``--help``, tools that run on CPU.

Each CLI is driven through its ``main(argv)`` (argparse errors raise SystemExit with status 2 and
write to stderr); difftest also runs as a subprocess from a directory outside the repository, on a
copy of the packages without ``tests/``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anvil_fast.studies import difftest as D
from anvil_fast.studies import near_rank1 as N
from anvil_fast.studies import scaling
from anvil_fast.core.cascade import FAITHFUL
from anvil_fast.core.tolerances import EXPLODED_SIGMA, check

REPO = Path(__file__).resolve().parents[1]
#: CPU on every machine: the verdicts below are those of this seed on the CPU path
TINY = ["--shapes", "2x16x8", "--configs", "safe", "--compile", "no", "--device", "cpu"]


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"_cli_tool_{name}", REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _chunk_independence():
    return _tool("chunk_independence")


def _derive_maps_main(argv):
    from derive_maps.cli import main
    return main(argv)


def _anvil_ref_main(argv):
    from anvil_ref.__main__ import main
    return main(argv)


def _train_main(argv):
    from papers.train import main
    return main(argv)


# --- difftest: one verdict rule ---------------------------------------------------------------

def test_an_exploded_faithful_cascade_is_an_expected_failure_not_ok():
    # the seed explodes on this near-rank-1 batch and FAITHFUL with it: fast ~ eager, so the factor
    # rule alone passes; the explosion cap against float64 does not
    row, _ = D.cascade_row((2, 48, 32), "near_rank1", FAITHFUL, compile=False)
    assert row.fast > 1e3 and check("cascade", fast=row.fast, eager=row.eager, floor=row.floor)
    assert row.cap_ratio > 1
    assert row.verdict() == "expected-fail"
    # the same numbers on a configuration that must not explode: a plain failure
    assert dataclasses.replace(row, config="safe").verdict() == "FAIL"


def test_the_explosion_cap_decides_where_the_factor_rule_passes():
    def row(cap_ratio):
        return D.Row("cascade", (2, 48, 32), "gaussian", "safe", fast=5.0, floor=0.0017, eager=5.0,
                     same_bits=1.0, cap_ratio=cap_ratio)

    assert row(0.5).verdict() == "ok"
    assert row(1.5).verdict() == "FAIL"
    assert dataclasses.replace(row(1.5), family="near_rank1", config="faithful").verdict() == "expected-fail"


def test_cap_ratio_is_the_error_over_the_explosion_cap():
    # a 16x16 orthogonal reference (||ref||_F = 4, k = 16): cap = 1 + EXPLODED_SIGMA * 4 / 4
    q = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64))[0]
    ref = q[None]
    cap = 1 + EXPLODED_SIGMA
    assert D.cap_ratio(1.1 * ref, ref) == pytest.approx(0.1 / cap, rel=1e-9)
    assert D.cap_ratio(4.0 * ref, ref) == pytest.approx(3.0 / cap, rel=1e-9)
    # zero reference: the error is absolute and so is the cap, EXPLODED_SIGMA * sqrt(16)
    y = torch.zeros(1, 16, 16, dtype=torch.float64)
    y[0, 0, 0] = 2.0
    assert D.cap_ratio(y, torch.zeros_like(y)) == pytest.approx(2.0 / (4 * EXPLODED_SIGMA), rel=1e-9)
    assert D.cap_ratio(torch.full_like(ref, math.nan), ref) == math.inf


def _verdicts(out: str) -> list[str]:
    return [ln.split()[8] for ln in out.splitlines() if ln.split()[:1] and ln.split()[0] in
            ("momentum", "cascade", "equalizer", "update")]


def _footer(out: str) -> dict[str, int]:
    m = re.search(r"^(\d+) rows: (\d+) ok, (\d+) FAIL, (\d+) expected-fail$", out, re.M)
    assert m, out
    return dict(rows=int(m[1]), ok=int(m[2]), FAIL=int(m[3]), expected=int(m[4]))


def test_cli_footer_counts_agree_with_the_rows_and_state_the_rule(capsys):
    assert D.main(["--shapes", "2x48x32", "--families", "near_rank1,gaussian", "--configs", "faithful",
                   "--compile", "no", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    v = _verdicts(out)
    assert len(v) == 8 and v[1] == "expected-fail" and v.count("expected-fail") == 1, out
    assert _footer(out) == dict(rows=8, ok=v.count("ok"), FAIL=v.count("FAIL"), expected=1)
    assert D.VERDICT_RULE in out


def test_cli_exits_1_when_a_row_fails(monkeypatch, capsys):
    from anvil_ref.constants import ANVIL_MAPS

    real = D.fast_cascade   # a mutant: the fast cascade drops its last map
    monkeypatch.setattr(D, "fast_cascade", lambda x, **kw: real(x, **{**kw, "maps": list(ANVIL_MAPS[:-1])}))
    assert D.main(["--shapes", "2x48x32", "--families", "gaussian", "--configs", "safe", "--compile", "no",
                   "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert _verdicts(out)[1] == "FAIL" and _footer(out)["FAIL"] == 1


def test_cli_judges_every_row_outside_the_repository(tmp_path):
    # an installed copy of the packages (no tests/ beside them), run from an unrelated directory
    site = tmp_path / "site"
    for pkg in ("anvil_ref", "anvil_fast", "derive_maps"):
        shutil.copytree(REPO / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", "import sys, runpy; import anvil_fast; "
                        "assert anvil_fast.__file__.startswith(sys.argv[1]), anvil_fast.__file__; "
                        "sys.argv = ['difftest'] + sys.argv[2:]; "
                        "runpy.run_module('anvil_fast.studies.difftest', run_name='__main__')",
                        str(site), *TINY, "--families", "gaussian,zero"],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _verdicts(r.stdout) == ["ok"] * 8, r.stdout
    assert _footer(r.stdout) == dict(rows=8, ok=8, FAIL=0, expected=0)


# --- bad arguments: one line, status 2, the bad value named ------------------------------------

BAD = [
    ("difftest shapes", lambda: D.main(["--shapes", "64by48"]), "64by48"),
    ("difftest families", lambda: D.main(["--families", "gaussian,bogus"]), "bogus"),
    ("difftest configs", lambda: D.main(["--configs", "safe,fast"]), "'fast'"),
    ("difftest device", lambda: D.main(["--device", "gpu0"]), "gpu0"),
    ("near_rank1 paths", lambda: N.main(["--paths", "fp64,bogus"]), "bogus"),
    ("near_rank1 shapes", lambda: N.main(["--shapes", "64by48"]), "64by48"),
    ("near_rank1 count", lambda: N.main(["--count", "0"]), "'0'"),
    ("scaling world", lambda: scaling.main(["cpu", "--world", "3"]), "3"),
    ("scaling worlds", lambda: scaling.main(["gpu", "--worlds", "1,x"]), "1,x"),
    ("anvil_ref shape", lambda: _anvil_ref_main(["demo", "--shape", "0", "4", "4"]), "'0'"),
    ("anvil_ref maps", lambda: _anvil_ref_main(["demo", "--maps", "bogus"]), "bogus"),
    ("anvil_ref decay", lambda: _anvil_ref_main(["demo", "--decay", "-1"]), "-1"),
    ("derive_maps iterations", lambda: _derive_maps_main(["facts", "--polish-iterations", "-3"]), "-3"),
    ("derive_maps repeat", lambda: _derive_maps_main(["bench", "--repeat", "0"]), "'0'"),
    ("train lr", lambda: _train_main(["--out", "unused", "--lr", "adamw=abc"]), "adamw=abc"),
    ("train warmup", lambda: _train_main(["--out", "unused", "--steps", "10", "--warmup", "20"]), "20"),
    ("train device", lambda: _train_main(["--out", "unused", "--device", "bogus"]), "bogus"),
    ("chunk_independence shapes", lambda: _chunk_independence().main(["--shapes", "3x8x8"]), "3x8x8"),
    ("chunk_independence config", lambda: _chunk_independence().main(["--config", "bogus"]), "bogus"),
    ("mutants name", lambda: _tool("mutants").main(["-k", "no such mutant"]), "no such mutant"),
    ("gram_sm90_report group", lambda: _tool("gram_sm90_report").parse_args(["gram", "bogus"]), "bogus"),
]


@pytest.mark.parametrize("call,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_get_one_clear_line(call, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # nothing may be written, wherever it would go
    with pytest.raises(SystemExit) as exc:
        call()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())


def test_the_sm90_report_compiles_its_default_groups_when_given_none():
    tool = _tool("gram_sm90_report")
    assert tool.parse_args([]) == list(tool.DEFAULT_GROUPS)
    assert tool.parse_args(["rails", "mm"]) == ["rails", "mm"]


def test_the_study_refuses_an_unknown_path():
    with pytest.raises(ValueError, match="bogus"):
        N.study([(8, 8)], 2, only=["fp64", "bogus"])


HELP = [
    ("difftest", lambda: D.main(["--help"]), D.FAMILIES + ("safe", "faithful")),
    ("near_rank1", lambda: N.main(["--help"]), N.PATHS),
    ("scaling cpu", lambda: scaling.main(["cpu", "--help"]), ("{1,2,4,8}",)),
    ("anvil_ref demo", lambda: _anvil_ref_main(["demo", "--help"]), ("anvil_express", "muon_jordan5")),
    ("chunk_independence", lambda: _chunk_independence().main(["--help"]), ("faithful", "safe")),
]


@pytest.mark.parametrize("call,names", [h[1:] for h in HELP], ids=[h[0] for h in HELP])
def test_help_lists_the_valid_values(call, names, capsys):
    with pytest.raises(SystemExit) as exc:
        call()
    out = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    assert exc.value.code == 0
    missing = [n for n in names if n not in out]
    assert not missing, out


# --- progress: a line per stage when stderr is not a terminal ---------------------------------

@pytest.fixture
def immediate_progress(monkeypatch):
    from anvil_ref import progress

    monkeypatch.setattr(progress, "DELAY", 0.0)


def test_difftest_reports_each_case_when_piped(immediate_progress, capsys):
    assert D.main([*TINY, "--families", "gaussian,zero"]) == 0
    err = capsys.readouterr().err
    assert "difftest: safe 2x16x8 gaussian (1/2)" in err and "difftest: safe 2x16x8 zero (2/2)" in err, err
    assert re.search(r"done after \d", err) and "\r" not in err


def test_no_progress_silences_the_lines(immediate_progress, capsys):
    assert D.main([*TINY, "--families", "zero", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_near_rank1_reports_each_batch_when_piped(immediate_progress, capsys):
    assert N.main(["--shapes", "8x8", "--count", "4", "--batch", "2", "--paths", "fp64", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "near_rank1: 8x8, inputs 0..2 of 4" in err and "near_rank1: 8x8, inputs 2..4 of 4" in err, err


def test_derive_maps_compare_reports_each_set_when_piped(immediate_progress, capsys):
    assert _derive_maps_main(["compare", "anvil", "muon_jordan5", "--no-bf16"]) == 0
    err = capsys.readouterr().err
    assert "compare: anvil:" in err and "compare: muon_jordan5:" in err, err


# --- tools/chunk_independence.py runs on CPU --------------------------------------------------

def test_chunk_independence_runs_on_cpu(capsys):
    assert _chunk_independence().main(["--device", "cpu", "--shapes", "2x16x8,2x8x24", "--eager-post"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith(("2x16x8", "2x8x24"))]
    assert len(rows) == 14 and all("yes" in r for r in rows), rows



# --- tools/kernel_profile.py: CUDA only; its timeline reads a Chrome trace ----------------------

def test_kernel_profile_refuses_without_cuda_and_reads_one_step_of_a_trace(monkeypatch, capsys):
    kp = _tool("kernel_profile")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kp.main(["--size", "tiny"]) == 2 and "needs CUDA" in capsys.readouterr().out

    def k(ts, dur, stream, name):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": stream, "grid": [1, 1, 1]}}

    # two steps of three kernels; the second step's rails run on two streams at once
    trace = {"traceEvents": [k(0, 2, 7, "check"), k(3, 10, 20, "rails"), k(4, 8, 21, "rails"),
                             k(100, 2, 7, "check"), k(103, 10, 20, "rails"), k(105, 9, 21, "rails"),
                             {"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 50, "name": "aten::mm", "args": {}}]}
    lines = kp.timeline(trace, per_step=3, show=1)
    assert lines[0] == "step 1: 3 device events, span 14.0 us", lines
    assert [ln.strip() for ln in lines[1:4]] == ["stream 7: 1 kernels, busy 2.0 us, from 0.0 to 2.0 us",
                                              "stream 20: 1 kernels, busy 10.0 us, from 3.0 to 13.0 us",
                                              "stream 21: 1 kernels, busy 9.0 us, from 5.0 to 14.0 us"], lines
    assert kp.timeline(trace, per_step=3, show=2)[0].startswith("no step 2 in the trace (6 device events")

def test_kernel_profile_splits_a_step_into_its_matmul_and_other_phases(tmp_path, monkeypatch, capsys):
    """The phase lines: busy time as the union of intervals over streams (two overlapping matmul kernels
    count once), the time both phases run at once, and the matmul phase's rate; from a stored log's timeline."""
    kp = _tool("kernel_profile")
    log = "\n".join(["step 5: 5 device events, span 40.0 us", "  start us  dur us  stream  kernel  grid",
                     "       0.0     4.0  7  _check_kernel  [1, 1, 1]",
                     "       4.0    10.0  7  _gram_kernel  [1, 1, 1]",
                     "       8.0    10.0  9  _mm_add_kernel  [1, 1, 1]",
                     "      16.0    10.0  9  _update_kernel  [1, 1, 1]",
                     "      30.0    10.0  7  void at::native::vectorized_elementwise_kernel<4>  [1, 1, 1]",
                     "not a kernel line"])
    events = kp.timeline_events(log)
    assert [n for _, _, n in events] == ["_check_kernel", "_gram_kernel", "_mm_add_kernel", "_update_kernel", "void"]
    lines = kp.phase_lines(events, flop=2.8e9, peak_tflops=1000.0)
    # matmul: [4, 18) = 14 us; other: [0, 4) + [16, 26) + [30, 40) = 24 us; both: [16, 18) = 2 us
    assert lines[0] == ("phases: matmul kernels busy 14.0 us, other kernels busy 24.0 us (each the union over "
                        "streams), both at once 2.0 us, anything running 36.0 us"), lines
    assert lines[1] == "matmul phase: 0.003 TFLOP executed per step, 200 TFLOP/s over its busy time, 20% of 1000 TFLOP/s"
    with pytest.raises(ValueError, match="no timeline"):
        kp.timeline_events("no table here")
    (tmp_path / "k.log").write_text(log)
    monkeypatch.setattr(kp, "dropin_flop", lambda size: 1.4e9 if size == "tiny" else 0.0)
    assert kp.main(["--from-log", str(tmp_path / "k.log"), "--size", "tiny"]) == 0
    assert "0.001 TFLOP executed per step, 100 TFLOP/s" in capsys.readouterr().out
    (tmp_path / "empty.log").write_text("no table\n")
    for bad in ("empty.log", "missing.log"):
        assert kp.main(["--from-log", str(tmp_path / bad), "--size", "tiny"]) == 2
        assert "--from-log" in capsys.readouterr().err


def test_kernel_profile_counts_the_flop_of_every_bank_of_the_gpt():
    """The drop-in's banks on the tiny GPT are its blocks' four matrix shapes, one matrix per layer each
    (the model's own configuration, not the drop-in's plan, gives the expected shapes)."""
    from anvil_fast.bench.common import executed_flops
    from anvil_fast.models.gpt import SIZES

    kp = _tool("kernel_profile")
    c = SIZES["tiny"]
    d = c.n_embd
    shapes = [(c.n_layer, 3 * d, d), (c.n_layer, d, d), (c.n_layer, 4 * d, d), (c.n_layer, d, 4 * d)]
    assert kp.dropin_flop("tiny") == pytest.approx(sum(executed_flops(s, None, "cuda") for s in shapes), rel=1e-12)


def test_gram_tuned_rates_are_the_full_products_flop_over_their_tuned_time(capsys, tmp_path):
    gt = _tool("gram_tuned_table")
    data = {"generated_by": "made here", "entries": [
        {"device": "card", "op": "mm_add", "m": 100, "n": 200, "k": 50, "batch": 4, "us": 2.0},
        {"device": "card", "op": "XTX", "m": 100, "n": 100, "k": 50, "batch": 4, "us": 1.0}]}
    lines = gt.rate_lines(data, peak_tflops=16.0)
    # 2 * 100 * 200 * 50 * 4 = 8e6 FLOP in 2 us: 4 TFLOP/s; the Gram entry (not a full product) is left out
    assert lines == ["made here", "card  mm_add 4x100x200 (k 50): 2.0 us, 4 TFLOP/s, 25% of 16"], lines
    (tmp_path / "t.json").write_text(__import__("json").dumps(data))
    assert gt.main(["--rates", "--out", str(tmp_path / "t.json")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "card  mm_add 4x100x200 (k 50): 2.0 us, 4 TFLOP/s"
    (tmp_path / "bad.json").write_text("{}")
    assert gt.main(["--rates", "--out", str(tmp_path / "bad.json")]) == 2
    assert "not a readable tuning table" in capsys.readouterr().err


#: Every command line of the package, as (module, arguments before --help): each takes
#: --progress / --no-progress (README). Quick ones are listed apart with the reason.
PROGRESS_COMMANDS = [("derive_maps", [c]) for c in ("reproduce", "robust", "derive", "compare", "regenerate")] + [
    ("derive_maps.frontier", []), ("derive_maps.stage_errors", []),
    ("anvil_fast.studies.difftest", []), ("anvil_fast.studies.near_rank1", []), ("anvil_fast.studies.gram_side_study", []),
    ("anvil_fast.studies.tail", []),
    ("anvil_fast.studies.scaling", ["cpu"]), ("anvil_fast.studies.scaling", ["gpu"]), ("anvil_fast.studies.train_step", []),
    ("anvil_fast.studies.cost_model", ["measure"]), ("anvil_fast.studies.cost_model", ["predict"]),
] + [("anvil_fast.bench", [c]) for c in ("bank", "optimizer", "dropin", "peers", "fsdp")]
QUICK_COMMANDS = {
    "anvil_ref": "the demo applies the reference cascade to a few small matrices",
    "papers.build": "renders stored results into the paper's files",
    "papers.orthogonalizers": "lists the GPU table's runs not complete yet from the stored JSONs",
    "papers.train": "prints a line per finished run itself",
    "papers.training": "asks git for the version at a handful of commits and writes one small file",
}


def _main_of(module: str):
    import importlib

    mod = importlib.import_module(module)
    if hasattr(mod, "main"):
        return mod.main
    return importlib.import_module(f"{module}.cli").main  # derive_maps: __main__ runs it on import


@pytest.mark.parametrize("module,argv", PROGRESS_COMMANDS, ids=[f"{m} {' '.join(a)}" for m, a in PROGRESS_COMMANDS])
def test_every_command_line_takes_the_progress_flags(module, argv, capsys):
    with pytest.raises(SystemExit) as e:
        _main_of(module)(argv + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--progress" in out and "--no-progress" in out, f"{module} {' '.join(argv)}"


def test_the_progress_list_covers_every_command_line_of_the_package():
    """A new command line must be listed above, in one of the two lists."""
    root = Path(__file__).resolve().parents[1]
    found = set()
    for pkg in ("anvil_fast", "derive_maps", "anvil_ref", "papers"):
        for p in (root / pkg).rglob("*.py"):
            src = p.read_text()
            if p.name == "__main__.py" or ('\nif __name__ == "__main__":' in src):
                parts = p.relative_to(root).with_suffix("").parts
                found.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    listed = {m for m, _ in PROGRESS_COMMANDS} | set(QUICK_COMMANDS)
    peers = "anvil_fast.bench.peers"  # run as `python -m anvil_fast.bench peers` (its children too)
    assert found - {peers} == listed, (sorted(found - listed), sorted(listed - found))


def test_resident_diff_sums_the_held_memory_by_pool_and_the_graph_pools_allocations():
    """tools/resident_diff.py --held on a hand-made memory snapshot: the baseline's segment is left out,
    the allocator's pool and a graph's private pool are summed apart, and only the allocations made
    inside the graph pool's new segment are listed, grouped by where and stream."""
    rd = _tool("resident_diff")
    frame = {"filename": "/x/anvil_fast/core/cascade.py", "line": 7, "name": "cascade_workspace"}
    other = {"filename": "/x/anvil_fast/optim/entry.py", "line": 9, "name": "step"}
    snap = {"segments": [
        {"address": 0, "total_size": 100, "segment_pool_id": (0, 0), "blocks": [{"size": 100, "state": "active_allocated"}]},
        {"address": 1000, "total_size": 300, "segment_pool_id": (0, 0),
         "blocks": [{"size": 200, "state": "active_allocated"}, {"size": 100, "state": "inactive"}]},
        {"address": 5000, "total_size": 800, "segment_pool_id": (1, 4),
         "blocks": [{"size": 100, "state": "active_allocated"}, {"size": 700, "state": "inactive"}]},
    ], "device_traces": [[
        {"action": "alloc", "addr": 5000, "size": 100, "stream": 7, "frames": [frame]},
        {"action": "alloc", "addr": 5100, "size": 400, "stream": 7, "frames": [frame]},
        {"action": "free_completed", "addr": 5100, "size": 400, "stream": 7, "frames": [frame]},
        {"action": "alloc", "addr": 5100, "size": 300, "stream": 9, "frames": [other]},
        {"action": "alloc", "addr": 1000, "size": 200, "stream": 0, "frames": [other]},   # allocator's pool
        {"action": "alloc", "addr": 10, "size": 50, "stream": 0, "frames": [frame]},      # baseline segment
    ]]}
    pools = rd.held_by_pool(snap, {0})
    assert pools == [{"pool": "graph pool 1.4", "segments": 1, "reserved": 800, "allocated": 100},
                     {"pool": "allocator", "segments": 1, "reserved": 300, "allocated": 200}]
    allocs = rd.graph_pool_allocations(snap, {0})
    assert [(g["where"], g["stream"], g["count"], g["bytes"], g["largest"]) for g in allocs] == [
        ("core/cascade.py:7 cascade_workspace", 7, 2, 500, 400), ("optim/entry.py:9 step", 9, 1, 300, 300)]


def test_first_step_phases_add_each_rows_function_up(tmp_path):
    import cProfile
    import pstats

    first_step = _tool("first_step")

    def inner():
        return sum(range(20000))

    def outer():
        return [inner() for _ in range(3)]

    prof = cProfile.Profile()
    prof.enable()
    outer()
    prof.disable()
    here = "tests/test_cli.py"
    rows = first_step.phases(pstats.Stats(prof), table=(("outer", here, "outer"), ("inner", here, "inner"),
                                                          ("absent", here, "no_such_function")))
    (lo, t_outer, n_outer), (li, t_inner, n_inner), (la, t_absent, n_absent) = rows
    assert (lo, li, la) == ("outer", "inner", "absent")
    assert (n_outer, n_inner, n_absent) == (1, 3, 0) and t_absent == 0.0
    assert 0 < t_inner <= t_outer  # cumulative: the outer row holds the inner one
    assert {label for label, _, _ in first_step.PHASES} >= {"Triton launchers built (gcc)"}
