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


def test_the_chosen_rate_column_is_the_protocols_plus_new_seeds_or_a_whole_rerun(stored):
    proto, runs = stored
    runs = copy.deepcopy(runs)
    chosen = L.grid(proto, runs)["anvil"][0][0]["hparams"]["lr"]
    x2 = [r for r in runs if r["contender"] == "anvil" and r["hparams"]["lr"] == pytest.approx(2 * chosen)]
    assert sorted(r["seed"] for r in x2) == list(L.SELECT_SEEDS)
    # a partial rerun of the protocol's seeds would mix two sources in one column
    x2[0]["hparams"]["lr"] = chosen
    with pytest.raises(ValueError, match="reruns the protocol's seeds"):
        L.grid(proto, runs)
    # a seed the protocol did not run joins the protocol's column (its data order is its own)
    x2[0]["seed"] = x2[0]["data_seed"] = 9
    g = L.grid(proto, runs)
    assert g["anvil"][0][9] is x2[0] and g["anvil"][0][0]["commit"] != x2[0]["commit"]
    # every selection seed rerun here: the rerun is the whole column
    for r in x2:
        r["hparams"]["lr"] = chosen
    x2[0]["seed"] = x2[0]["data_seed"] = L.SELECT_SEEDS[0]
    g = L.grid(proto, runs)
    assert {s: r for s, r in g["anvil"][0].items()} == {r["seed"]: r for r in x2}


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


def test_every_commit_of_the_runs_has_the_protocols_optimizer_bits(stored):
    """The paper says the optimizer's bits are the same at the runs' commits: each commit the check's runs
    name has its CPU fingerprint stored beside them, every line of it the protocol commit's line of the same
    row (rows the older commit lacks, such as a later bank kind, are not compared)."""
    _, runs = stored
    root = T.ROOT / "results"

    def rows(path):
        return dict(line.rsplit(None, 1) for line in path.read_text().splitlines() if line.strip())
    base = rows(root / "train" / "logs" / "fingerprint" / f"{T.SAME_CODE_FROM}.txt")
    for commit in sorted({r["commit"][:7] for r in runs}):
        fp = L.FOLDER / f"fingerprint_{commit}.txt"
        assert fp.is_file(), f"{fp} missing: run tools/fingerprint.py at {commit} (results/train_lr_final/runs.txt)"
        mine = rows(fp)
        assert base.keys() <= mine.keys() and all(mine[k] == v for k, v in base.items()), commit


def test_the_held_out_devices_name_every_seed_run_elsewhere(stored):
    """The paper's sentence on where the held-out comparison ran: the device most of its runs had, and each
    contender's seeds that ran on another (read from the runs, not from the grid's columns)."""
    proto, runs = stored
    proto, runs = copy.deepcopy(proto), copy.deepcopy(runs)
    for r in proto + runs:
        r.setdefault("environment", {})["device"] = "card A"
    assert L.held_devices_text(proto, runs).endswith("ran on card A, every one")
    c = L.at_best(proto, runs)
    k, cell = c["cells"]["dion"]
    seed = max(cell)
    assert seed not in L.SELECT_SEEDS
    cell[seed]["environment"]["device"] = "card B"
    text = L.held_devices_text(proto, runs)
    assert text.endswith(f"ran on card A, except {T.PEER_NAMES['dion']}'s seed {seed} (card B)"), text
    assert "card B" not in L.held_devices_text(proto, [r for r in runs if r is not cell[seed]])
