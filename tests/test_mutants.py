"""tools/mutants.py: its list applies to the tree, its verdicts count only assertions, a failing
baseline stops it, and (slow) every mutant is caught."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("anvil_mutants_tool", ROOT / "tools" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_once_and_names_existing_tests():
    T = _tool()
    names = [m.name for m in T.MUTANTS]
    assert len(set(names)) == len(names)
    for m in T.MUTANTS:
        assert m.tests, m.name
        for path, old, new in m.edits():
            assert old != new, m.name
            assert (ROOT / path).read_text().count(old) == 1, (m.name, path)
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).is_file(), (m.name, t)


def test_only_an_assertion_counts_as_caught():
    T = _tool()
    ok = {"failures": [], "errors": [], "exitstatus": 0}
    assert T.classify(ok, "")[0] == "SURVIVED"
    caught = {**ok, "failures": [{"test": "tests/t.py::a", "what": "AssertionError"}], "exitstatus": 1}
    assert T.classify(caught, "") == ("CAUGHT", "tests/t.py::a (AssertionError)")
    crash = {**ok, "errors": [{"test": "tests/t.py::a", "what": "call: RuntimeError: boom"}], "exitstatus": 1}
    assert T.classify(crash, "")[0] == "ERROR"
    collect = {**ok, "errors": [{"test": "tests/t.py", "what": "collection error"}], "exitstatus": 2}
    assert T.classify(collect, "")[0] == "ERROR"
    assert T.classify(None, "timeout after 600 s") == ("ERROR", "timeout after 600 s")
    assert T.classify({**ok, "exitstatus": 3}, "")[0] == "ERROR"  # pytest's internal error, nothing reported


def test_a_failing_baseline_stops_the_tool(monkeypatch, capsys):
    T = _tool()
    runs = []

    def fake(work, tests, timeout):
        runs.append(list(tests))
        return {"failures": [{"test": "x", "what": "AssertionError"}], "errors": [], "exitstatus": 1,
                "modules": {}}, "tail", 0.0

    monkeypatch.setattr(T, "_pytest", fake)
    assert T.main(["-k", "ref rails: wrong sign"]) == 2
    assert len(runs) == 1  # the baseline only: no mutant judged
    assert "BASELINE FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_every_mutant_is_caught_by_an_assertion():
    # the whole tool: ~8 min on 2 cores (baseline ~2.5 min, then ~40 mutants at 3-20 s)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "mutants.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "SURVIVED" not in r.stdout and " ERROR " not in r.stdout, r.stdout[-6000:]
