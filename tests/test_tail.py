"""anvil_fast.studies.tail: the certified screen of top singular values and the tail count built on it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from anvil_fast.studies import tail as TL


def _with_top(tops, m=64, n=16, seed=0):
    """Matrices U diag(s) V^T whose other singular values spread over [0.6, 1] and whose top is ``tops[i]``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for top in tops:
        u, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        s = torch.linspace(0.6, 1.0, n, dtype=torch.float64)
        s[-1] = top
        out.append(u @ torch.diag(s) @ v.T)
    return torch.stack(out)


@pytest.mark.parametrize("shape", [(5, 96, 32), (5, 32, 96), (5, 40, 40)])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_the_bounds_hold_the_exact_top_singular_value(shape, scale):
    y = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * scale
    exact = torch.linalg.svdvals(y)[:, 0]
    lo, up = TL.top_singular_bounds(y)
    assert torch.all(lo <= exact * (1 + 1e-12)) and torch.all(exact <= up * (1 + 1e-12))
    n = min(shape[1:])
    assert torch.allclose(up / lo, torch.full_like(up, n ** (1 / 2 ** (TL.SQUARINGS + 1))))


def test_the_upper_bound_is_tight_where_the_top_stands_apart_and_loose_by_at_most_its_factor_where_not():
    y = _with_top([3.0, 1.0])
    lo, up = TL.top_singular_bounds(y)
    assert up[0] == pytest.approx(3.0, rel=1e-9)
    # 16 values in [0.6, 1]: the upper bound is above 1 by less than n^(1/2p)
    assert 1.0 <= up[1] <= 16 ** (1 / 2 ** (TL.SQUARINGS + 1))
    # no squaring: the Frobenius norm, the plainest upper bound
    lo0, up0 = TL.top_singular_bounds(y, squarings=0)
    assert torch.allclose(up0, y.flatten(1).norm(dim=1))


def test_zero_and_non_finite_matrices():
    y = torch.randn(3, 8, 4, dtype=torch.float64)
    y[0] = 0
    y[1, 2, 3] = math.nan
    y[2, 0, 0] = math.inf
    lo, up = TL.top_singular_bounds(y)
    assert lo[0] == 0 and up[0] == 0 and torch.isinf(lo[1:]).all() and torch.isinf(up[1:]).all()
    with pytest.raises(ValueError, match="squarings"):
        TL.top_singular_bounds(y, squarings=-1)


def test_count_past_equals_the_exact_count_including_the_undecided_band():
    tops = [0.5, 1.0, 1.05, 1.0999, 1.1001, 1.2, 2.0]
    y = torch.cat([_with_top(tops), torch.full((1, 64, 16), math.nan, dtype=torch.float64)]).float()
    exact = torch.linalg.svdvals(torch.nan_to_num(y.double()))[:, 0]
    want = int((exact[:-1] > TL.EXPLODED_SIGMA).sum()) + 1
    c = TL.count_past(y)
    assert c["past"] == want == 4 and c["nonfinite"] == 1
    # with the rest at most 1, each upper bound is its top to within 1e-9, so only 1.1001, whose lower bound
    # (1.1001 / 16^(1/512)) falls under the limit, is left to eigvalsh
    assert c["exact"] == 1
    assert c["max_upper"] == pytest.approx(2.0, rel=1e-6)


def test_the_inputs_are_near_low_rank_and_seeded():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x = TL.near_low_rank(6, 48, 32, generator=g1, device="cpu")
    assert torch.equal(x, TL.near_low_rank(6, 48, 32, generator=g2, device="cpu"))
    s = torch.linalg.svdvals(x.double())
    assert torch.all(s[:, 4] / s[:, 0] < 2 ** -5)  # rank <= 4 plus noise at most 2^-6 of the RMS


def test_the_study_counts_every_form_on_the_same_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("ANVIL_COMMIT", "f" * 40)  # a tree copied without its history names its commit so
    out = tmp_path / "tail.json"
    assert TL.main(["--shapes", "24x16", "--forms", "safe,eager", "--seconds", "0", "--batch", "4",
                    "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["commit"] == "f" * 40
    rows = data["rows"]
    assert [(r["shape"], r["form"], r["matrices"]) for r in rows] == [("24x16", "safe", 4), ("24x16", "eager", 4)]
    assert all(r["past"] == 0 and 0.9 < r["max_upper"] < 1.1 for r in rows)


@pytest.mark.parametrize("args", [["--shapes", "24by16"], ["--forms", "fast,nope"], ["--batch", "0"]])
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit):
        TL.main([*args, "--seconds", "0", "--device", "cpu"])
