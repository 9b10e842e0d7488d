"""papers/lr_final.py: the final horizon's learning-rate neighbours against the protocol's runs."""

from __future__ import annotations

import copy

import pytest

from papers import lr_final as L
from papers import training as T


@pytest.fixture(scope="module")
def stored():
    proto, runs = T.load(), L.load()
    if not runs or not T.tuned_groups(proto, horizon="long"):
        pytest.skip("no stored runs of results/train_lr_final or of the protocol's horizon")
    return proto, runs


def _one(runs, contender="anvil", seed=0):
    return next(r for r in runs if r["contender"] == contender and r["seed"] == seed)


@pytest.mark.parametrize("change, named", [
    (lambda r: r.update(steps=r["steps"] // 2), "steps"),
    (lambda r: r.update(clip=None), "clip"),
    (lambda r: r["hparams"].update(weight_decay=r["hparams"]["weight_decay"] * 2), "hparams.weight_decay"),
    (lambda r: r.update(batches_sha256="0" * 64), "data order"),
    (lambda r: r["corpus"].update(sha256="0" * 64), "corpus"),
])
def test_a_run_of_another_setup_is_refused_by_name(stored, change, named):
    proto, runs = stored
    runs = copy.deepcopy(runs)
    change(_one(runs))
    with pytest.raises(ValueError, match=named):
        L.grid(proto, runs)


def test_a_rate_off_the_factor_2_grid_is_refused(stored):
    proto, runs = stored
    runs = copy.deepcopy(runs)
    _one(runs)["hparams"]["lr"] *= 1.5
    with pytest.raises(ValueError, match="power of 2"):
        L.grid(proto, runs)


def test_the_chosen_rate_takes_new_seeds_only(stored):
    proto, runs = stored
    runs = copy.deepcopy(runs)
    r = _one(runs, "anvil", 0)
    r["hparams"]["lr"] = L.grid(proto, runs)["anvil"][0][0]["hparams"]["lr"]
    with pytest.raises(ValueError, match="horizon runs hold this seed"):
        L.grid(proto, runs)
    # a seed the protocol did not run joins the chosen rate's column (its data order is its own)
    r["seed"] = r["data_seed"] = 9
    g = L.grid(proto, runs)
    assert g["anvil"][0][9] is r and 0 in g["anvil"][0]


def test_a_repeated_seed_is_refused(stored):
    proto, runs = stored
    with pytest.raises(ValueError, match="two runs of the same seed"):
        L.grid(proto, [*runs, copy.deepcopy(_one(runs))])


def test_the_grid_places_each_run_by_its_factor(stored):
    proto, runs = stored
    g = L.grid(proto, runs)
    chosen = {n: row[0][0]["hparams"]["lr"] for n, row in g.items()}
    for r in runs:
        cell = [k for k, c in g[r["contender"]].items() if c.get(r["seed"]) is r]
        assert len(cell) == 1 and r["hparams"]["lr"] == pytest.approx(chosen[r["contender"]] * 2 ** cell[0])
    assert all(0 in row for row in g.values())


def _row(cells):
    return {k: {s: {"final_val_loss": v, "diverged": False} for s, v in enumerate(vals)} for k, vals in cells.items()}


def test_best_is_the_lowest_mean_over_the_selection_seeds():
    assert L.best(_row({-1: [0.80, 0.80, 0.80], 0: [0.79, 0.79, 0.79], 1: [0.78, 0.80, 0.76]})) == 1
    # a cell without every selection seed cannot be best, however low
    assert L.best(_row({0: [0.79, 0.79, 0.79], 2: [0.5, 0.5]})) == 0
    # ties: the chosen rate first, then the lower rate
    assert L.best(_row({-1: [0.7] * 3, 0: [0.7] * 3, 1: [0.7] * 3})) == 0
    assert L.best(_row({-1: [0.7] * 3, 1: [0.7] * 3, 0: [0.8] * 3})) == -1


def test_a_diverged_seed_makes_its_cell_lose():
    row = _row({0: [0.79, 0.79, 0.79], 1: [0.70, 0.70, 0.70]})
    row[1][2]["diverged"] = True
    assert L.best(row) == 0


def test_the_headline_states_a_difference_only_past_holm(stored):
    proto, runs = stored
    runs = copy.deepcopy(runs)
    c = L.at_best(proto, runs)
    k_ref, cell = c["cells"]["anvil"]
    # ANVIL's best cell moved onto dion's best cell's losses plus a seed-dependent jitter: no claim either way
    dion = c["cells"]["dion"][1]
    for s, r in cell.items():
        if s in dion:
            r["final_val_loss"] = T._final(dion[s]) + (1e-4 if s % 2 else -1e-4)
    text = L.headline(proto, runs)
    assert "not distinguishable from" in text and "dion's Muon's" in text.split("not distinguishable from")[1]
    # ANVIL far worse at every rate on every seed: the headline says higher, never lower
    proto = copy.deepcopy(proto)
    for r in (*proto, *runs):
        if r["contender"] == "anvil" and r.get("role") in ("tuned", "fixed"):  # the sweep's choice stays
            r["final_val_loss"] = 2.0 + 1e-3 * r["seed"]
    text = L.headline(proto, runs)
    assert "higher than" in text and "lower than" not in text


def test_the_tables_say_so_without_runs(stored):
    proto, _ = stored
    assert "no run" in L.table_grid(proto, []) and "no run" in L.table_best(proto, [])


def test_the_held_out_comparison_leaves_out_the_selection_seeds():
    a = _row({0: [0.70, 0.71, 0.72, 0.73, 0.74]})[0]
    b = _row({0: [0.90, 0.91, 0.92, 0.70, 0.70]})[0]
    pd = L._paired(a, b, held_out=True)
    assert pd["seeds"] == [s for s in range(5) if s not in L.SELECT_SEEDS]
    assert pd["mean"] == pytest.approx((0.73 + 0.74) / 2 - 0.70)
    assert L._paired(a, b)["n"] == 5
    assert L._paired(_row({0: [0.7] * 3})[0], b, held_out=True)["n"] == 0


def test_a_peer_without_held_out_seeds_has_no_held_out_test(stored):
    proto, runs = stored
    c = L.at_best(proto, runs)
    for n, (_, cell) in c["cells"].items():
        held = [s for s in cell if s not in L.SELECT_SEEDS and s in c["cells"]["anvil"][1]]
        assert (n in c["held"]) == (n != "anvil" and len(held) >= L.MIN_HELD_OUT)
