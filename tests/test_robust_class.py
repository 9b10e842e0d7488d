"""The robust certificates' classes carry every assumption of their models: the words (norm floor,
size limits), a membership check of a given matrix, the first iterate's two roundings, |output| on
[0, u], and one verdict rule for the CLI and the frontier."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from anvil_fast.core.eager import eager_bf16_cascade
from anvil_ref.constants import FP32_UNIT_ROUNDOFF, MIN_NORM, NORM_BLOCK, NORM_REDUCE_BLOCK
from derive_maps.errors import DeriveMapsError, parse_real
from derive_maps.frontier import CLASSES, DATA, class_model, markdown
from derive_maps.robust import (RoundingModel, _first_cross, class_membership, cross_frame, robust_envelope,
                                robust_verdict, rounding_model)


def _data():
    return json.loads((DATA / "frontier.json").read_text())


def _row(n, l):
    return next(r for r in _data()["rows"] if r["n_maps"] == n and r["l"] == l)


def _maps(hexes):
    return tuple(tuple(float.fromhex(v) for v in m) for m in hexes)


def _cascade(x: torch.Tensor, maps, u) -> torch.Tensor:
    """The package's eager SAFE-order bf16 cascade at the total margin 1/u (fp32 products)."""
    return eager_bf16_cascade(x, maps=maps, margin=float(1 / parse_real(u, "u")), fp32_trace=True, prescale=True,
                              gemm="fp32")


def _counterexample(scale: float, l: float, u: float) -> np.ndarray:
    """The diagonal input of normalized singular values about sqrt(u^2 - (1.001 l)^2) and 1.001 l at
    Frobenius norm ``scale * u``."""
    return np.diag([scale * math.sqrt(u * u - (1.001 * l) ** 2), scale * 1.001 * l])


# ---------------------------------------------------------------------------------------------
# The words.

@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_every_class_states_its_norm_floor_and_size_limits(cls):
    m = class_model(cls)
    words = m.covers()
    assert m.min_norm == MIN_NORM and f"||X||_F >= {MIN_NORM:g}" in words
    # the trace's depth was derived for the model's lanes: ceil(nb / 1024) sequential adds per lane
    assert m.max_entries == NORM_BLOCK * NORM_REDUCE_BLOCK and f"at most {m.max_entries} entries" in words
    if m.cross_talk:
        # the fp32 sums' error terms are gamma_L of the long side L = 768
        assert m.max_long_side == 768 and "long side n at most 768" in words
    d = _data()
    assert d["classes"][cls]["words"] == words and d["classes"][cls]["model"] == m.as_dict()
    assert f"{cls}: {words}" in markdown(d)


def test_a_model_without_a_floor_says_so():
    m = RoundingModel(delta_x=2 ** -8, delta_gram=0, delta_b=0, gamma_b=0, gamma_y=0, delta0=0)
    assert "any Frobenius norm" in m.covers() and "any number of entries" in m.covers()


# ---------------------------------------------------------------------------------------------
# Membership.

def test_membership_refuses_what_breaks_an_assumption():
    two, diag = class_model("two"), class_model("diagonal")
    ok = np.zeros((5, 800))
    ok[1, :700], ok[3, :700] = 1.0, np.linspace(-1, 1, 700)
    assert class_membership(ok, two).inside and class_membership(torch.tensor(ok), two).inside
    assert class_membership(ok.T, two).inside                      # the block's orientation is free
    r = class_membership(np.ones((3, 10)), two)
    assert not r.inside and "3 rows" in r.reason
    long_ = np.zeros((2, 800))
    long_[:, :769] = 1.0
    r = class_membership(long_, two)
    assert not r.inside and "769 > 768" in r.reason
    small = np.diag([1e-4, 1e-4])
    r = class_membership(small, diag)
    assert not r.inside and "norm floor" in r.reason
    assert class_membership(np.diag([1.0, 2.0]), diag).inside
    perm = np.zeros((3, 3))
    perm[0, 2], perm[2, 0], perm[1, 1] = 1.0, -2.0, 3.0          # permuted and signed: still diagonal
    assert class_membership(perm, diag).inside
    r = class_membership(np.array([[1.0, 1.0], [0.0, 1.0]]), diag)
    assert not r.inside and "row 0" in r.reason
    r = class_membership(np.ones((2049, 2048)), diag)            # past the trace's summation depth
    assert not r.inside and "size limit" in r.reason
    bank = torch.stack([torch.eye(2), torch.ones(2, 2)])
    r = class_membership(bank, diag)
    assert not r.inside and r.reason.startswith("matrix 1:")
    r = class_membership(np.array([[np.nan, 0.0], [0.0, 1.0]]), diag)
    assert not r.inside and "non-finite" in r.reason


def test_membership_refuses_bad_input_clearly():
    with pytest.raises(DeriveMapsError, match="expected a matrix"):
        class_membership(np.ones(3), class_model("two"))
    with pytest.raises(DeriveMapsError, match="RoundingModel"):
        class_membership(np.eye(2), "two")
    with pytest.raises(DeriveMapsError, match="real matrix"):
        class_membership(np.array([["a"]]), class_model("two"))


@pytest.mark.parametrize("n, l", [(4, "1/100"), (5, "1/1000")])
def test_the_norm_floor_counterexamples(n, l):
    # a tiny diagonal input (||X||_F = 1.05e-5 u) whose singular values sit at l and near u: the
    # normalization's eps shrinks them past the certified minimum. It is outside the class; the same
    # singular value ratio at a norm inside the class keeps the certified bound (eager SAFE cascade).
    row = _row(n, l)
    rb = row["robust"]["diagonal"]
    maps, lf, uf = _maps(rb["maps_hex"]), float(Fraction(l)), float(parse_real(row["u"], "u"))
    tiny = _counterexample(1.05e-5, lf, uf)
    r = class_membership(tiny, class_model("diagonal"))
    assert not r.inside and "norm floor" in r.reason
    y = _cascade(torch.tensor(tiny, dtype=torch.float64), maps, row["u"]).double()
    assert torch.linalg.svdvals(y).min().item() < rb["robust_min_certified"]   # why the floor is there
    for scale in (1.05 * MIN_NORM, 1.0, 1e3):
        x = _counterexample(scale, lf, uf)
        assert class_membership(x, class_model("diagonal")).inside
        s = torch.linalg.svdvals(_cascade(torch.tensor(x, dtype=torch.float64), maps, row["u"]).double())
        assert rb["robust_min_certified"] <= s.min().item() and s.max().item() <= rb["robust_max_certified"]


# ---------------------------------------------------------------------------------------------
# The first iterate and |output|.

def test_the_first_iterate_carries_the_fp32_rounding_of_x_s_over_d():
    m = rounding_model("safe", rows=2, cols=8)
    assert m.delta_z == FP32_UNIT_ROUNDOFF
    # X_1 = bf16(fp32(Z)): ||X_1 - Z||_2 <= (u + 2^-24 (1 + u)) ||Z||_F, written out here independently
    z = Fraction(3, 4)
    want = (Fraction(m.delta_x) + Fraction(m.delta_z) * (1 + Fraction(m.delta_x))) * z
    lo, hi = _first_cross((np.array([np.longdouble(0.5)]), np.array([np.longdouble(0.5)])), m, np.longdouble(0.75))
    assert Fraction(*hi[0].as_integer_ratio()) - Fraction(1, 2) >= want
    assert Fraction(1, 2) - Fraction(*lo[0].as_integer_ratio()) >= want
    # without the fp32 term the bound would be short by 2^-24 (1 + u) ||Z||_F
    assert Fraction(*hi[0].as_integer_ratio()) - Fraction(1, 2) < want + Fraction(1, 2 ** 60)
    # diagonal inputs carry it in delta0 (each entry rounded relative to the value it carries)
    assert rounding_model("safe", rows=8, cols=8, inputs="diagonal").delta_z == 0


def test_a_sign_flip_past_the_bound_is_refused():
    # a one-map set whose output at the top of [0, u] is large and negative: the signed maximum stays
    # small, |output| does not
    maps = ((1.0, -3.0, 0.0),)                 # p(s) = s - 3 s^3: p(0.95) = -1.62
    m = rounding_model("safe", rows=8, cols=8, inputs="diagonal")
    h = robust_envelope(maps, 0, "1/1.05", m)
    assert h.f_max_certified < 1.1 and h.f_min_certified < -1.5
    v = robust_verdict(maps, m, l=None, u="1/1.05")
    assert not v.passed and "|output|" in v.reason and "> " in v.reason


# ---------------------------------------------------------------------------------------------
# One verdict rule.

def test_the_cli_and_the_frontier_agree_on_the_stored_sets(tmp_path):
    # the sets papers/data/frontier.md lists as passed for diagonal inputs at l = 1/300 (4 maps) and
    # l = 1/1000 (5 maps), under the CLI's SAFE model of the frontier's class
    for n, l in ((4, "1/300"), (5, "1/1000")):
        row = _row(n, l)
        rb = row["robust"]["diagonal"]
        assert rb["passed"]
        spec = tmp_path / f"n{n}.json"
        spec.write_text(json.dumps({"maps": rb["maps"]}))
        kw = CLASSES["diagonal"][0]
        r = subprocess.run([sys.executable, "-m", "derive_maps", "robust", str(spec), "--inputs", "diagonal",
                            "--rows", str(kw["rows"]), "--cols", str(kw["cols"]), "--l", l, "--u", row["u"],
                            "--json", "--no-progress"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        v = json.loads(r.stdout)["verdict"]
        assert v["passed"] and v["exact_error"] == rb["max_abs_log_certified"]
        assert v["headroom"]["f_max_certified"] == rb["robust_max_certified"]
        assert v["envelope"]["f_min_certified"] == rb["robust_min_certified"]


# ---------------------------------------------------------------------------------------------
# Sets certified for diagonal inputs only say so where a user picks them.

def test_a_diagonal_only_set_warns_where_it_is_loaded(tmp_path):
    import warnings

    import anvil_ref
    from anvil_ref.maps import MapSetClassWarning, load_maps
    from derive_maps.compare import certified_inputs
    from derive_maps.frontier import export_set
    d = _data()
    path = tmp_path / "n6_diag.json"
    doc = export_set(d, 6, "1/100", "diagonal")
    path.write_text(json.dumps(doc))
    assert doc["certified_inputs"] == {"class": "diagonal", "covers": d["classes"]["diagonal"]["words"]}
    words = d["classes"]["diagonal"]["words"]
    with pytest.warns(MapSetClassWarning, match="diagonal inputs only") as rec:
        maps = load_maps(str(path))
    assert words in str(rec[0].message)
    assert maps == _maps(_row(6, "1/100")["robust"]["diagonal"]["maps_hex"])
    with pytest.warns(MapSetClassWarning):
        anvil_ref.cascade(np.eye(4), maps=str(path))
    with pytest.warns(MapSetClassWarning):
        eager_bf16_cascade(torch.eye(4), maps=str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_maps(str(path), inputs="diagonal") == maps          # the caller states the class
        load_maps("anvil_express")                                     # a set naming no class: silent
    assert certified_inputs(str(path)) == ("diagonal", words) and certified_inputs("anvil_express") is None
    r = subprocess.run([sys.executable, "-m", "derive_maps", "compare", str(path), "--no-bf16", "--no-progress"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "certified for diagonal inputs only" in r.stderr, r.stderr
    with pytest.raises(DeriveMapsError, match="no set of the grid"):
        export_set(d, 4, "1/1000", "diagonal")
    with pytest.raises(Exception, match="inputs"):
        load_maps(str(path), inputs="dense")
