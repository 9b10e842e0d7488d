"""anvil_ref.maps: map sets by literal, by name and from JSON files."""

from __future__ import annotations

import json

import numpy as np
import pytest

import anvil_ref as A
from anvil_ref.maps import available_map_sets, load_maps, validate_maps


def test_literal_and_name():
    assert load_maps("anvil") == A.ANVIL_MAPS
    assert load_maps([[1, 2, 3]]) == ((1.0, 2.0, 3.0),)
    assert "anvil" in available_map_sets()


def test_json_file_round_trip(tmp_path):
    maps = [[3.4445, -4.775, 2.0315]] * 5
    path = tmp_path / "muon.json"
    path.write_text(json.dumps({"generated_by": "test", "maps": maps}))
    assert load_maps(str(path)) == tuple(tuple(m) for m in maps)
    x = np.random.default_rng(0).standard_normal((6, 4))
    np.testing.assert_array_equal(A.cascade(x, maps=path), A.cascade(x, maps=maps))


@pytest.mark.parametrize("content,match", [
    ("not json", "cannot be read"),
    (json.dumps([1, 2]), "'maps' list"),
    (json.dumps({"maps": [[1, 2]]}), "triple"),
])
def test_bad_files(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(A.ReferenceInputError, match=match):
        load_maps(path)


def test_missing_file_and_bad_literals(tmp_path):
    with pytest.raises(A.ReferenceInputError, match="cannot be read"):
        load_maps(tmp_path / "nope.json")
    with pytest.raises(A.ReferenceInputError, match="real numbers"):
        validate_maps([("a", 1, 2)])
    with pytest.raises(A.ReferenceInputError, match="sequence"):
        validate_maps(3.0)
