"""derive_maps.tables: number formats and the three renderings."""

import json

from derive_maps.tables import Table, dumps, interval, pct, sig


def test_formats():
    assert sig(6.5902e-4, 3) == "0.000659" and sig(None) == "-" and sig(float("inf")) == "inf"
    assert pct(0.0216) == "2.16%" and interval(0.5, 1.25, 2) == "[0.50, 1.25]"


def test_renderings():
    t = Table("t_1 & co", ["name", "x|y"], [["a_b", "50%"]], ["note"])
    assert "a_b" in t.text() and "note" in t.text()
    assert t.markdown().splitlines()[2] == "| name | x|y |"
    tex = t.latex()
    assert r"a\_b" in tex and r"50\%" in tex and r"x$|$y" in tex and tex.startswith(r"\begin{tabular}{lr}")


def test_dumps_round_trips_floats_exactly():
    data = {"maps": [[0.1, -1 / 3, 2.0 ** -60]], "nested": {"k": [1, 2]}}
    text = dumps(data)
    assert json.loads(text) == data
    assert '[0.1, -0.3333333333333333, 8.673617379884035e-19]' in text
