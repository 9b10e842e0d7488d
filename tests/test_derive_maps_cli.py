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


def test_certify_text_says_where_the_worst_point_is(capsys):
    code, out, _ = run(capsys, "certify", "anvil")
    _, js, _ = run(capsys, "certify", "anvil", "--json")
    e = json.loads(js)["envelope"]
    assert code == 0 and f"{e['argmin']:.12g}" in out and f"{e['argmax']:.12g}" in out
    assert "attained max |log F|" in out and " at sigma = " in out


def test_certify_a_set_whose_composite_reaches_zero(capsys, tmp_path):
    # p(x) = x - 2 x^3 is negative above 1/sqrt(2), inside the default interval: no band, no headroom
    p = tmp_path / "neg.json"
    p.write_text(json.dumps({"maps": [[1.0, -2.0, 0.0]]}))
    code, out, err = run(capsys, "certify", str(p), "--no-progress")
    assert code == 0 and "headroom" in out and "reach 0" in out and err == ""
    code, out, _ = run(capsys, "compare", str(p), "--no-bf16", "--json")
    assert code == 0 and json.loads(out)["rows"][0]["certified"]["headroom_certified"] is None


def test_compare_on_a_given_interval(capsys):
    code, out, _ = run(capsys, "compare", "anvil", "--no-bf16", "--l", "1/100", "--u", "1/1.1", "--json")
    assert code == 0 and json.loads(out)["rows"][0]["certified"]["interval"] == ["1/100", "1/1.1"]
    code, out, _ = run(capsys, "compare", "anvil", "--no-bf16", "--l", "1/100", "--u", "1/1.1")
    assert code == 0 and "[1/100, 1/1.1]" in out


@pytest.mark.parametrize("argv", [("derive", "greedy", "--u", "1e6"),
                                  ("derive", "greedy", "--l", "1e-12", "--n-maps", "2")])
def test_derive_far_from_the_anvil_interval_certifies_what_it_made(capsys, argv):
    # A large F somewhere must not spoil the certified lower bound (and with it the band).
    code, out, err = run(capsys, *argv, "--json", "--no-progress")
    doc = json.loads(out)
    assert code == 0 and err == ""
    assert math.isfinite(doc["certified"]["max_abs_log_certified"]) and doc["certified"]["envelope_certified"][0] > 0


def test_analyse_refuses_a_negative_top(capsys):
    code, out, err = run(capsys, "analyse", "anvil", "--top", "-1")
    assert code == 2 and "--top -1" in err and out == ""


def test_derive_name_without_out_writes_nothing(capsys, tmp_path):
    from anvil_ref.maps import MAP_SETS_DIR
    before = sorted(p.name for p in MAP_SETS_DIR.iterdir())
    code, out, err = run(capsys, "derive", "greedy", "--n-maps", "2", "--name", "my_maps")
    assert code == 2 and "--out" in err and out == ""
    assert sorted(p.name for p in MAP_SETS_DIR.iterdir()) == before
    path = tmp_path / "m.json"
    code, out, _ = run(capsys, "derive", "greedy", "--n-maps", "2", "--name", "my_maps", "--out", str(path))
    assert code == 0 and json.loads(path.read_text())["name"] == "my_maps"
    assert sorted(p.name for p in MAP_SETS_DIR.iterdir()) == before


def test_derive_polished_keeps_its_number_of_maps(capsys):
    code, out, err = run(capsys, "derive", "polished", "--n-maps", "5")
    assert code == 2 and "--n-maps 6" in err and out == ""


def test_derive_polished_refuses_a_start_that_blows_up_at_once(capsys):
    code, out, err = run(capsys, "derive", "polished", "--u", "1/1.02")
    assert code == 2 and "far from 1" in err and "--u" in err and out == ""


def test_every_option_has_help_and_shows_its_default():
    import argparse

    from derive_maps.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        text = parser.format_help()
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help text"
                if action.nargs != 0:
                    assert f"(default: {action.default})" in " ".join(text.split()), \
                        f"{name} {action.option_strings[0]} does not show its default"
