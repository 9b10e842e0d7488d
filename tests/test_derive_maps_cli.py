"""python -m derive_maps: every subcommand, its output formats, and its error messages."""

import json
import math

import pytest

from anvil_ref.maps import load_maps
from derive_maps.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_reproduce_json(capsys):
    code, out, _ = run(capsys, "reproduce", "--json")
    data = json.loads(out)
    assert code == 0 and [t["recipe"] for t in data["tables"]] == ["polar_express_paper", "modded_nanogpt"]
    assert all(r["max_rel_diff"] <= 1e-12 for r in data["tables"][0]["rows"][:6])
    assert all(r["max_rel_diff"] <= 1e-13 for r in data["tables"][1]["rows"])


def test_reproduce_text_and_latex(capsys):
    code, out, _ = run(capsys, "reproduce")
    assert code == 0 and "modded_nanogpt" in out and "max rel. diff" in out
    code, out, _ = run(capsys, "reproduce", "--latex")
    assert code == 0 and out.count(r"\begin{tabular}") == 2 and r"modded\_nanogpt" not in out


def test_certify_json(capsys):
    code, out, _ = run(capsys, "certify", "anvil", "--json")
    d = json.loads(out)
    assert code == 0
    assert d["envelope"]["max_abs_log_attained"] <= 6.5903e-4 <= d["envelope"]["max_abs_log_certified"]
    assert d["headroom"]["certified"] < 1e-4


def test_analyse_text(capsys):
    code, out, _ = run(capsys, "analyse", "anvil_express", "--top", "3")
    assert code == 0 and "interval chain" in out and "alternation points" in out


def test_derive_greedy_writes_a_loadable_set(capsys, tmp_path):
    path = tmp_path / "pe5.json"
    code, out, _ = run(capsys, "derive", "greedy", "--l", "1e-3", "--u", "1", "--n-maps", "5",
                       "--cushion", "0.02", "--safety", "1.02", "--recentre-when", "cushioned",
                       "--out", str(path), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["generated_by"].startswith("python -m derive_maps derive greedy")
    maps = load_maps(str(path))
    assert maps == tuple(tuple(m) for m in doc["maps"]) and len(maps) == 5
    assert [float.fromhex(h) for h in doc["maps_hex"][0]] == list(maps[0])


def test_derive_polish_needs_a_start(capsys):
    code, _, err = run(capsys, "derive", "polish")
    assert code == 2 and "--start" in err


def test_derive_polish(capsys, tmp_path):
    code, out, _ = run(capsys, "derive", "polish", "--start", "anvil", "--max-iter", "3", "--json",
                       "--out", str(tmp_path / "p.json"))
    doc = json.loads(out)
    assert code == 0 and doc["provenance"]["error"] < doc["provenance"]["start_error"]


def test_compare_without_bf16(capsys):
    code, out, _ = run(capsys, "compare", "anvil", "muon_jordan5", "--no-bf16", "--json")
    rows = json.loads(out)["rows"]
    assert code == 0 and [r["name"] for r in rows] == ["anvil", "muon_jordan5"]
    assert "bf16" not in rows[0]
    code, out, _ = run(capsys, "compare", "anvil", "anvil_express", "--no-bf16", "--markdown")
    assert code == 0 and "| anvil_express |" in out and "requirements" in out


@pytest.mark.parametrize("argv, message", [
    (("certify", "anvil", "--l", "0"), "l > 0"),
    (("certify", "anvil", "--l", "1", "--u", "0.5"), "l < u"),
    (("certify", "no_such_set"), "unknown map set"),
    (("derive", "greedy", "--n-maps", "0"), "at least one map"),
    (("derive", "express", "--dps", "5"), "dps"),
    (("derive", "greedy", "--cushion", "abc"), "cannot read"),
    (("derive", "express", "--name", "anvil_express"), "generated set"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and out == ""


def test_bad_map_file(capsys, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"maps": [[1.0, 2.0, math.inf]]}).replace("Infinity", "1e999"))
    code, _, err = run(capsys, "certify", str(p))
    assert code == 2 and "finite" in err
    p.write_text(json.dumps({"maps": []}))
    code, _, err = run(capsys, "certify", str(p))
    assert code == 2 and "at least one" in err
