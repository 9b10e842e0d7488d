"""The maps-versus-accuracy frontier (derive_maps.frontier): the stored sets re-certify to the stored
numbers, the table is the stored data's, the robust sets pass two-sided and their exact versions do
not, certificates at the rounding floor are marked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from anvil_ref.constants import ANVIL_MAPS
from derive_maps.certify import certify_envelope
from derive_maps.frontier import (CLASSES, DATA, check_stored, exact_set, exact_text, markdown, robust_check,
                                  same_certificate, tail_gain)


def _data():
    return json.loads((DATA / "frontier.json").read_text())


def _maps(hexes):
    return tuple(tuple(float.fromhex(v) for v in m) for m in hexes)


def test_tail_gain_of_anvil_maps_is_the_published_one():
    # the record's README quotes F'(0) = 643.13
    assert f"{tail_gain(ANVIL_MAPS):.2f}" == "643.13"


def test_table_is_the_stored_data():
    assert (DATA / "frontier.md").read_text() == markdown(_data())


def test_rows_and_classes_are_complete():
    d = _data()
    assert set(d["classes"]) == set(CLASSES)
    for r in d["rows"]:
        assert set(r["robust"]) == set(CLASSES)
        for cls, rb in r["robust"].items():
            if rb is not None:
                assert rb["passed"] and rb["converged"]
                # two-sided: the certified envelope lies inside the limits, and holds what was measured
                assert rb["lo_limit"] <= rb["robust_min_certified"] <= rb["robust_max_certified"] <= rb["hi_limit"]
                m = rb["measured"]
                assert m["out_max"] <= rb["robust_max_certified"]
                assert m["out_min"] is None or m["out_min"] >= rb["robust_min_certified"]
            else:
                assert r["exact"]["refused"][cls]       # the exact set is refused with a reason


def test_two_singular_values_are_not_certified_below_the_resolution():
    # the first rounding of a two-singular-value iterate may move a singular value by ~u / 1.05: no set
    # is certified for l = 1/300 or 1/1000 on that class
    for r in _data()["rows"]:
        if r["l"] in ("1/300", "1/1000"):
            assert r["robust"]["two"] is None and "reaches 0" in r["exact"]["refused"]["two"]


def test_anvil_row_under_both_classes():
    a = _data()["anvil"]
    # the seed's margin and SAFE's slack 2^-7 are refused for every class; 2^-6 passes for diagonal inputs
    for cls in CLASSES:
        assert not a["robust"]["0"][cls]["passed"] and not a["robust"]["1/128"][cls]["passed"]
    assert a["robust"]["1/64"]["diagonal"]["passed"] and not a["robust"]["1/64"]["two"]["passed"]


def test_five_maps_row_recertifies():
    d = _data()
    row = next(r for r in d["rows"] if r["n_maps"] == 5 and r["l"] == "1/300")
    ex = _maps(row["exact"]["maps_hex"])
    e = certify_envelope(ex, row["l"], row["u"])
    assert e.max_abs_log_certified == row["exact"]["max_abs_log_certified"]
    # the stored exact set is the derivation's (h = 0, no cushion)
    assert ex == exact_set(5, row["l"], row["u"])
    rb = row["robust"]["diagonal"]
    maps = _maps(rb["maps_hex"])
    chk = robust_check(maps, row["l"], row["u"], "diagonal")
    assert chk["passed"] and chk["robust_max_certified"] == rb["robust_max_certified"]
    assert chk["robust_min_certified"] == rb["robust_min_certified"]
    # the exact optimum itself is refused: robustness costs accuracy
    assert not robust_check(ex, row["l"], row["u"], "diagonal", exact=e)["passed"]
    assert rb["max_abs_log_certified"] > row["exact"]["max_abs_log_certified"]
    # and the robust set is the family's member at the stored headroom and cushion
    assert maps == exact_set(5, row["l"], row["u"], rb["headroom"], rb["cushion"])


def test_floor_rows_are_marked():
    d = _data()
    floor = [r for r in d["rows"] if r["exact"]["floor_limited"]]
    assert floor                                   # the seven-map rows reach the certifier's floor
    for r in floor:
        assert exact_text(r["exact"]).endswith("(floor)")
        assert r["exact"]["max_abs_log_attained"] <= r["exact"]["max_abs_log_certified"]
    # where the floor decides, the certified value says nothing about the set's error
    assert any(r["exact"]["max_abs_log_attained"] < r["exact"]["max_abs_log_certified"] / 100 for r in floor)
    assert all(not exact_text(r["exact"]).endswith("(floor)") for r in d["rows"] if not r["exact"]["floor_limited"])


@pytest.mark.slow
def test_five_map_rows_recertify():
    r = subprocess.run([sys.executable, "-m", "derive_maps.frontier", "--check", "--maps", "5", "--no-progress"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_floor_certificates_compare_within_their_floor_width():
    # exact unless the rounding floor decides both; then within the larger floor width
    assert same_certificate(1e-14, 1e-14, False, False, 0.0)
    assert not same_certificate(1e-14, 1.0000001e-14, False, False, 1.0)
    assert same_certificate(1.6e-14, 1.5e-14, True, True, 2e-15)
    assert not same_certificate(1.6e-14, 1.5e-14, True, True, 5e-16)
    assert not same_certificate(1.6e-14, 1.5e-14, True, False, 1.0)
    for r in _data()["rows"]:
        ex = r["exact"]
        assert (ex["floor_width"] > 0) == ex["floor_limited"]


def test_the_check_catches_a_changed_coefficient():
    d = _data()
    row = next(r for r in d["rows"] if r["n_maps"] == 4 and r["l"] == "1/30")
    d = dict(d, rows=[json.loads(json.dumps(row))])
    v = float.fromhex(d["rows"][0]["exact"]["maps_hex"][0][1]) * (1 + 1e-9)
    d["rows"][0]["exact"]["maps_hex"][0][1] = v.hex()
    d["rows"][0]["robust"] = {c: None for c in CLASSES}
    diffs = check_stored(d)
    assert len(diffs) == 1 and diffs[0].startswith("exact n=4 l=1/30")
