"""The tuning protocol (papers.protocol): the grid rule with its one extension per end, the order of
the runs, reading a protocol back from run records, and the cost model."""

from __future__ import annotations

import math

import pytest

from papers import protocol as P


def _losses_from(f):
    """A search's ``losses(value)`` from a loss function of the value (two seeds, the same loss)."""
    return lambda v: [f(v), f(v)]


def test_lr_centres_are_the_contenders_defaults():
    from anvil_ref import ANVIL_DEFAULTS
    from papers import contenders as K

    assert P.LR_CENTERS["anvil"] == ANVIL_DEFAULTS["lr"]
    for name, lr in P.LR_CENTERS.items():
        assert K.get(name).hparams["lr"] == lr, name
    for name in ("adamw", "muon", "dion"):
        assert K.get(name).hparams["adam_lr"] == P.ADAM_CENTER, name


def test_grid_values_are_exact_factor_two_steps():
    assert P.grid(0.023, 2.0, (-1, 0, 1)) == [0.0115, 0.023, 0.046]
    assert P.grid(1e-3, 2.0, (-2, 0)) == [0.00025, 0.001]


def test_search_best_inside_needs_no_extension():
    # a bowl in log2(v) with its bottom at the centre 0.02: the grid 0.01, 0.02, 0.04 holds it
    s = P.search(0.02, 2.0, (-1, 0, 1), _losses_from(lambda v: (math.log2(v / 0.02)) ** 2))
    assert s.values == (0.01, 0.02, 0.04) and s.best == 0.02 and s.inside and s.extended == () and not s.missing
    assert s.means == {0.01: 1.0, 0.02: 0.0, 0.04: 1.0}


def test_search_extends_an_end_once_and_finds_the_best_inside():
    # bottom at 0.01 (the low end): one point below, 0.005, is worse, so 0.01 is inside the extended grid
    s = P.search(0.02, 2.0, (-1, 0, 1), _losses_from(lambda v: (math.log2(v / 0.01)) ** 2))
    assert s.values == (0.005, 0.01, 0.02, 0.04) and s.best == 0.01 and s.inside and s.extended == ("low",)


def test_search_reports_the_edge_after_one_extension():
    # the loss falls all the way up: extended once at the high end (0.08), still best there
    s = P.search(0.02, 2.0, (-1, 0, 1), _losses_from(lambda v: -v))
    assert s.values == (0.01, 0.02, 0.04, 0.08) and s.best == 0.08 and s.edge == "high" and not s.inside
    # and all the way down: once at the low end
    s = P.search(0.02, 2.0, (-1, 0, 1), _losses_from(lambda v: v))
    assert s.values == (0.005, 0.01, 0.02, 0.04) and s.best == 0.005 and s.edge == "low"


def test_search_waits_for_every_seed_ties_go_low_and_a_diverged_seed_is_infinite():
    have = {0.01: [1.0, 1.0], 0.02: [1.0, None], 0.04: [2.0, 2.0]}
    s = P.search(0.02, 2.0, (-1, 0, 1), lambda v: None if None in have[v] else have[v])
    assert s.best is None and s.missing == (0.02,)
    have[0.02] = [1.0, 1.0]   # a tie between 0.01 and 0.02: the lower value, 0.01, an end: extended
    have[0.005] = [1.5, math.inf]
    s = P.search(0.02, 2.0, (-1, 0, 1), lambda v: have[v])
    assert s.means[0.005] == math.inf and s.best == 0.01 and s.inside


def test_required_runs_the_protocol_to_its_end_in_order():
    """Simulate a whole protocol: each contender's loss is a bowl around its own optimum; running
    the first required run until none is left must find every optimum, sweep stage by stage, and
    end with the horizon runs, seed-major, at the chosen values (the lean ANVIL at ANVIL's)."""
    p = P.Protocol(tuned=("adamw", "anvil"), long=("adamw", "anvil", "anvil_lean"), seeds=(0, 1), tune_seeds=(0, 1))
    best = {"adamw": (2e-3, 8e-3), "anvil": (0.023, 2e-3)}   # adamw's lr at the high end, anvil's adam_lr low

    def loss(t: P.Task) -> float:
        lr0, a0 = best[P.Protocol().source(t.contender)]
        return math.log2(t.lr / lr0) ** 2 + math.log2(t.adam_lr / a0) ** 2 + 0.001 * t.seed

    results, order = {}, []
    while tasks := P.required(p, results):
        t = tasks[0]
        order.append(t)
        results[t.key] = loss(t)
    sweeps = [t for t in order if t.role == "sweep"]
    assert all(t.role == "tuned" for t in order[len(sweeps):])
    for name, (lr0, a0) in best.items():
        mine = [t for t in sweeps if t.contender == name]
        first_b = next(i for i, t in enumerate(mine) if t.stage == "adam_lr")
        assert all(t.stage == "lr" and t.adam_lr == p.adam_center for t in mine[:first_b])
        assert all(t.stage == "adam_lr" and t.lr == lr0 for t in mine[first_b:])
        assert P.tuning(p, name, results).chosen == (lr0, a0)
    # adamw's grids extended at their high ends (0.002 and 0.008 were ends), anvil's adam_lr grid at the low end
    assert P.tuning(p, "adamw", results).lr.values == (5e-4, 1e-3, 2e-3, 4e-3)
    assert P.tuning(p, "adamw", results).adam_lr.values == (2e-3, 4e-3, 8e-3, 1.6e-2)
    assert P.tuning(p, "anvil", results).adam_lr.values == (1e-3, 2e-3, 4e-3, 8e-3)
    horizon = [(t.seed, t.contender, t.lr, t.adam_lr) for t in order if t.role == "tuned"]
    assert horizon == [(s, n, *best[P.Protocol().source(n)]) for s in (0, 1) for n in ("adamw", "anvil", "anvil_lean")]
    # every run once, on 2 seeds: adamw 3 + 1 lr values and 3 + 1 adam_lr values less the one shared (the
    # centre at the best lr), anvil 3 lr values and 3 + 1 adam_lr values less the shared one
    assert len(sweeps) == 2 * ((4 + 3) + (3 + 3)) and len(set(t.key for t in order)) == len(order)


def test_required_skips_absent_contenders_and_their_borrowers():
    p = P.Protocol()
    names = {t.contender for t in P.required(p, {}, absent=["dion"])}
    assert names == {"adamw", "muon", "anvil"}
    # anvil absent: no sweep of anvil, and anvil_lean (which borrows anvil's values) never gets a run
    done = {}
    while tasks := P.required(p, done, absent=["anvil", "muon", "dion"]):
        done[tasks[0].key] = 1.0
    assert {k[0] for k in done} == {"adamw"}


def test_the_first_runs_at_once_spread_over_the_contenders():
    first = [t.contender for t in P.required(P.Protocol(), {})[:8]]
    assert first == ["adamw", "muon", "dion", "anvil"] * 2


def test_protocol_json_round_trip_and_refusals():
    p = P.Protocol()
    assert P.Protocol.from_json(p.to_json()) == p
    assert p.with_contenders(["adamw", "anvil", "anvil_lean"]).long == ("adamw", "anvil", "anvil_lean")
    assert p.with_contenders(["adamw"]).core() == p.core()
    with pytest.raises(ValueError, match="anvil_lean.*must be among the contenders"):
        p.with_contenders(["adamw", "anvil_lean"])
    with pytest.raises(ValueError, match="no lr centre"):
        P.Protocol(tuned=("sgd",))
    with pytest.raises(ValueError, match="factor must be > 1"):
        P.Protocol(factor=1.0)


def _rec(name, lr, adam, steps, seed, loss, *, role="sweep", proto=None):
    return {"contender": name, "role": role, "hparams": {"lr": lr, "adam_lr": adam}, "steps": steps, "seed": seed,
            "final_val_loss": loss, "diverged": False, "protocol": (proto or P.Protocol()).to_json()}


def test_results_of_keeps_the_protocols_runs_only():
    p = P.Protocol()
    other = P.Protocol(clip=None)
    recs = [_rec("adamw", 1e-3, 4e-3, 1000, 0, 1.5), _rec("adamw", 1e-3, 4e-3, 1000, 1, math.nan),
            _rec("adamw", 2e-3, 4e-3, 1000, 0, 1.4, proto=other),
            _rec("muon", 0.02, 4e-3, 1000, 0, 1.2, proto=p.with_contenders(["muon"])),
            {**_rec("adamw", 5e-4, 4e-3, 1000, 0, 1.6), "role": "fixed"}]
    assert P.results_of(p, recs) == {("adamw", 1e-3, 4e-3, 1000, 0): 1.5, ("adamw", 1e-3, 4e-3, 1000, 1): math.inf,
                                     ("muon", 0.02, 4e-3, 1000, 0): 1.2}
    with pytest.raises(ValueError, match="2 different protocols"):
        P.of_records(recs)
    got = P.of_records(recs[:2] + recs[3:4])
    assert got.tuned == ("adamw", "muon") and got.core() == p.core()


def test_chosen_of_reads_the_choice_back_and_lends_it():
    p = P.Protocol(tuned=("anvil",), long=("anvil", "anvil_lean"))
    results = {}
    while tasks := [t for t in P.required(p, results) if t.role == "sweep"]:
        t = tasks[0]
        results[t.key] = abs(math.log2(t.lr / 0.046)) + abs(math.log2(t.adam_lr / 8e-3))
    recs = [_rec(k[0], k[1], k[2], k[3], k[4], v, proto=p) for k, v in results.items()]
    assert P.chosen_of(recs) == {"anvil": (0.046, 8e-3), "anvil_lean": (0.046, 8e-3)}


# ----------------------------------------------------------------------------------- cost model
def test_forward_backward_ms_hand_case():
    # 1 layer, width 2, context 3, vocabulary 4, batch 1: tokens 3; matmul parameters 12 * 2^2 + 2 * 4 = 56;
    # FLOPs 6 * 56 * 3 + 12 * 1 * 3 * 2 * 3 = 1224 at 1000 FLOP/s x MATMUL_EFFICIENCY; traffic
    # ACTIVATION_TENSORS * 1 * 3 * 2 * 2 bytes at 1 byte/s
    ms = P.forward_backward_ms(n_layer=1, n_embd=2, ctx=3, vocab=4, batch=1, tflops=1e-9, copy_gbs=1e-9)
    expected = 1224 / (1000 * P.MATMUL_EFFICIENCY) * 1e3 + P.ACTIVATION_TENSORS * 12 * 1e3
    assert ms == pytest.approx(expected, rel=1e-12)


def test_read_logs_parses_the_training_and_bench_lines(tmp_path):
    train = tmp_path / "train.log"
    train.write_text("model: small GPTConfig(n_layer=6); steps 500, batch 32 x 256\n"
                     "[1/3] small adamw seed 0: val loss 5.5 -> 1.1 (10.0 s, 6.8 ms/step, optimizer 7%; 17 s) -> x\n"
                     "[2/3] small adamw seed 1: val loss 5.6 -> 1.1 (12.0 s, 6.8 ms/step, optimizer 7%; 29 s) -> x\n"
                     "[3/3] small adamw seed 2: val loss 5.6 -> 1.1 (30.0 s, 6.8 ms/step, optimizer 7%; 59 s) -> x\n")
    bench = tmp_path / "bench.log"
    bench.write_text("device X; bf16 8192^3 matmul 700 TFLOP/s, copy 4000 GB/s (read + write)\n"
                     "  small anvil: 0.9 ms (600 steps, 1 s)\n  medium anvil: 5.0 ms (88 steps, 1 s)\n")
    logs = P.read_logs(train, bench, size="small")
    # the median of 10, 12, 30 s over 500 steps, per 1000 steps
    assert logs == {"wall_per_1000": {"adamw": 24.0}, "tflops": 700.0, "copy_gbs": 4000.0, "opt_ms": {"anvil": 0.9}}


def test_the_default_protocol_fits_the_training_stage():
    """The default protocol's estimate (no grid extended) on 8 jobs leaves room in the training
    stage's budget (tools/h200_session.sh: T_TRAIN 450 s, the protocol's budget 10 s less) for the
    grid extensions (2 runs of 1000 steps each), the workers' start and the tail."""
    p = P.Protocol()
    e = P.estimate(p, P.planned(p), jobs=8, model={"n_layer": 6, "n_embd": 384, "ctx": 256, "vocab": 256})
    assert e["runs"] == 4 * (3 + 2) * 2 + 5 * 3 and e["steps"] == 40 * 1000 + 15 * 4000
    assert e["wall_s"] == max(e["host_s"] / 8, e["device_s"])
    assert e["wall_s"] < 400, e
