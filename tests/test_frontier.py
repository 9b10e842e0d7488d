"""The maps-versus-accuracy frontier (derive_maps.frontier): the stored sets re-certify to the stored
numbers, the table is the stored data's, the robust sets pass and their h = 0 versions do not."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from anvil_ref.constants import ANVIL_MAPS
from derive_maps.frontier import DATA, exact_set, markdown, robust_check, tail_gain
from derive_maps.certify import certify_envelope


def _data():
    return json.loads((DATA / "frontier.json").read_text())


def _maps(hexes):
    return tuple(tuple(float.fromhex(v) for v in m) for m in hexes)


def test_tail_gain_of_anvil_maps_is_the_published_one():
    # the record's README quotes F'(0) = 643.13
    assert f"{tail_gain(ANVIL_MAPS):.2f}" == "643.13"


def test_table_is_the_stored_data():
    assert (DATA / "frontier.md").read_text() == markdown(_data())


def test_five_maps_row_recertifies():
    d = _data()
    row = next(r for r in d["rows"] if r["n_maps"] == 5 and r["l"] == "1/300")
    ex = _maps(row["exact"]["maps_hex"])
    assert certify_envelope(ex, row["l"], row["u"]).max_abs_log_certified == row["exact"]["max_abs_log_certified"]
    # the stored exact set is the derivation's (h = 0)
    assert ex == exact_set(5, row["l"], row["u"])
    rb = row["robust"]
    chk = robust_check(_maps(rb["maps_hex"]), row["l"], row["u"])
    assert chk["passed"] and chk["robust_max_certified"] == rb["robust_max_certified"]
    # the exact optimum itself is refused: robustness costs accuracy
    assert not robust_check(ex, row["l"], row["u"])["passed"]
    assert rb["max_abs_log_certified"] > row["exact"]["max_abs_log_certified"]
    # and the robust set is the family's member at the stored headroom
    assert _maps(rb["maps_hex"]) == exact_set(5, row["l"], row["u"], Fraction(rb["headroom"]))


@pytest.mark.slow
def test_every_stored_set_recertifies():
    r = subprocess.run([sys.executable, "-m", "derive_maps.frontier", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
