"""The tuning protocol (papers.protocol): the grid rule with its one extension per end, the order of
the runs, reading a protocol back from run records, and the cost model."""

from __future__ import annotations

import math

import pytest

from papers import protocol as P


def _losses_from(f):
    """A search's ``losses(value)`` from a loss function of the value (two seeds, the same loss)."""
    return lambda v: [f(v), f(v)]


def test_centres_are_the_contenders_defaults():
    from anvil_ref import ANVIL_DEFAULTS, RAIL_SCALED_REFERENCE_STEPS
    from papers import contenders as K

    assert P.LR_CENTERS["anvil"] == ANVIL_DEFAULTS["lr"] and P.WD_CENTERS["anvil"] == ANVIL_DEFAULTS["weight_decay"]
    assert set(P.LR_CENTERS) == set(P.WD_CENTERS) == set(P.Protocol().tuned)
    for name, lr in P.LR_CENTERS.items():
        assert K.get(name).hparams["lr"] == lr, name
        assert K.get(name).hparams["weight_decay"] == P.WD_CENTERS[name], name
    for name in ("adamw", "muon", "dion", "normuon"):
        assert K.get(name).hparams["adam_lr"] == P.ADAM_CENTER, name
    # every contender the horizon runs exists, and the tuning horizon is where the rail rules agree
    for name in P.Protocol().long:
        K.get(name)
    assert P.Protocol().tune_steps == RAIL_SCALED_REFERENCE_STEPS


def test_final_seeds_are_held_out_and_enough():
    p = P.Protocol()
    assert not set(p.tune_seeds) & set(p.seeds) and len(p.seeds) >= 5 and p.steps >= 4000
    with pytest.raises(ValueError, match="held out"):
        P.Protocol(tune_seeds=(0, 1), seeds=(1, 2))


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
    the first required run until none is left must find every optimum, sweep stage by stage (lr,
    then adam_lr, then weight decay), and end with the horizon runs, seed-major, at the chosen
    values (the lean ANVIL and an ablation at ANVIL's)."""
    p = P.Protocol(tuned=("adamw", "anvil"), long=("adamw", "anvil", "anvil_lean", "anvil_one_rail"),
                   seeds=(0, 1), tune_seeds=(7, 8))
    # adamw's lr at the high end, anvil's adam_lr low, anvil's weight decay far below the record's
    best = {"adamw": (2e-3, 8e-3, 0.1), "anvil": (0.023, 2e-3, 2.25 / 4)}

    def loss(t: P.Task) -> float:
        b = best[p.source(t.contender)]
        return sum(math.log2(x / y) ** 2 for x, y in zip((t.lr, t.adam_lr, t.weight_decay), b)) + 0.001 * t.seed

    results, order = {}, []
    while tasks := P.required(p, results):
        t = tasks[0]
        order.append(t)
        results[t.key] = loss(t)
    sweeps = [t for t in order if t.role == "sweep"]
    assert all(t.role == "tuned" for t in order[len(sweeps):])
    assert all(t.seed in p.tune_seeds for t in sweeps)
    for name, (lr0, a0, w0) in best.items():
        mine = [t for t in sweeps if t.contender == name]
        stages = [t.stage for t in mine]
        assert stages == sorted(stages, key=P.KEYS.index)   # lr, then adam_lr, then weight_decay
        for t in mine:
            if t.stage == "lr":
                assert (t.adam_lr, t.weight_decay) == (p.adam_center, p.wd_center(name))
            elif t.stage == "adam_lr":
                assert (t.lr, t.weight_decay) == (lr0, p.wd_center(name))
            else:
                assert (t.lr, t.adam_lr) == (lr0, a0)
        assert P.tuning(p, name, results).chosen == (lr0, a0, w0)
    assert P.tuning(p, "adamw", results).lr.values == (5e-4, 1e-3, 2e-3, 4e-3)
    assert P.tuning(p, "anvil", results).adam_lr.values == (1e-3, 2e-3, 4e-3, 8e-3)
    # anvil's weight decay: 2.25 / 4 is two steps below the centre, past the one extension: at the edge
    wd = P.tuning(p, "anvil", results).weight_decay
    assert wd.edge == "low" and wd.best == 2.25 / 4 and not wd.inside
    horizon = [(t.seed, t.contender, t.lr, t.adam_lr, t.weight_decay) for t in order if t.role == "tuned"]
    assert horizon == [(s, n, *best[p.source(n)]) for s in (0, 1) for n in p.long]
    assert len(set(t.key for t in order)) == len(order)


def test_equal_time_runs_get_a_complete_schedule_at_their_own_step_count():
    assert P.equal_time_steps(4000, 0.5, 1.0) == 8000 and P.equal_time_steps(4000, 2.0, 1.0) == 2000
    assert P.equal_time_steps(4000, 3.0, 1.0, multiple=50) == 1300   # 1333 rounded down to 50s
    p = P.Protocol(tuned=("adamw", "anvil"), long=("adamw", "anvil"), equal_time=("adamw", "anvil"),
                   seeds=(0, 1))
    results = {}
    while tasks := P.required(p, results):
        results[tasks[0].key] = 1.0
    assert not [k for k in results if k[4] not in (p.tune_steps, p.steps)]   # no timing: no equal-time run
    extra = P.required(p, results, step_s={"adamw": 0.004, "anvil": 0.005}, multiple=50)
    assert [(t.contender, t.steps, t.seed, t.role) for t in extra] == [("adamw", 5000, 0, "equal_time"),
                                                                       ("adamw", 5000, 1, "equal_time")]


def test_required_skips_absent_contenders_and_their_borrowers():
    p = P.Protocol()
    names = {t.contender for t in P.required(p, {}, absent=["dion"])}
    assert names == {"adamw", "muon", "normuon", "anvil"}
    # anvil absent: no sweep of anvil, and the contenders borrowing anvil's values never get a run
    done = {}
    while tasks := P.required(p, done, absent=["anvil", "muon", "dion", "normuon"]):
        done[tasks[0].key] = 1.0
    assert {k[0] for k in done} == {"adamw"}


def test_the_first_runs_at_once_spread_over_the_contenders():
    first = [t.contender for t in P.required(P.Protocol(), {})[:10]]
    assert first == ["adamw", "muon", "dion", "normuon", "anvil"] * 2


def test_protocol_json_round_trip_and_refusals():
    p = P.Protocol()
    assert P.Protocol.from_json(p.to_json()) == p
    assert p.with_contenders(["adamw", "anvil", "anvil_lean"]).long == ("adamw", "anvil", "anvil_lean")
    assert p.with_contenders(["adamw"]).core() == p.core()
    with pytest.raises(ValueError, match="anvil_lean.*must be among the contenders"):
        p.with_contenders(["adamw", "anvil_lean"])
    with pytest.raises(ValueError, match="no lr or weight-decay centre"):
        P.Protocol(tuned=("sgd",))
    with pytest.raises(ValueError, match="factor must be > 1"):
        P.Protocol(factor=1.0)


def _rec(name, lr, adam, steps, seed, loss, *, role="sweep", proto=None, wd=0.1):
    return {"contender": name, "role": role, "hparams": {"lr": lr, "adam_lr": adam, "weight_decay": wd},
            "steps": steps, "seed": seed,
            "final_val_loss": loss, "diverged": False, "protocol": (proto or P.Protocol()).to_json()}


def test_results_of_keeps_the_protocols_runs_only():
    p = P.Protocol()
    other = P.Protocol(clip=None)
    recs = [_rec("adamw", 1e-3, 4e-3, 1000, 0, 1.5), _rec("adamw", 1e-3, 4e-3, 1000, 1, math.nan),
            _rec("adamw", 2e-3, 4e-3, 1000, 0, 1.4, proto=other),
            _rec("muon", 0.02, 4e-3, 1000, 0, 1.2, proto=p.with_contenders(["muon"]), wd=0.01),
            {**_rec("adamw", 5e-4, 4e-3, 1000, 0, 1.6), "role": "fixed"}]
    assert P.results_of(p, recs) == {("adamw", 1e-3, 4e-3, 0.1, 1000, 0): 1.5,
                                     ("adamw", 1e-3, 4e-3, 0.1, 1000, 1): math.inf,
                                     ("muon", 0.02, 4e-3, 0.01, 1000, 0): 1.2}
    with pytest.raises(ValueError, match="2 different protocols"):
        P.of_records(recs)
    got = P.of_records(recs[:2] + recs[3:4])
    assert got.tuned == ("adamw", "muon") and got.core() == p.core()


def test_chosen_of_reads_the_choice_back_and_lends_it():
    p = P.Protocol(tuned=("anvil",), long=("anvil", "anvil_lean"))
    results = {}
    while tasks := [t for t in P.required(p, results) if t.role == "sweep"]:
        t = tasks[0]
        results[t.key] = (abs(math.log2(t.lr / 0.046)) + abs(math.log2(t.adam_lr / 8e-3))
                          + abs(math.log2(t.weight_decay / 4.5)))
    recs = [_rec(k[0], k[1], k[2], k[4], k[5], v, proto=p, wd=k[3]) for k, v in results.items()]
    got = P.chosen_of(recs)
    assert got["anvil"] == (0.046, 8e-3, 4.5)
    assert {n: got[n] for n, src in p.borrows if src == "anvil"} == {n: got["anvil"] for n, src in p.borrows}


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


def test_the_default_protocols_run_list():
    """The default protocol's least run list: 5 tuned contenders x (3 lr + 2 adam_lr + 2 weight-decay
    values) x 2 tuning seeds, then 12 contenders (5 tuned, the lean state, 6 ablations) x 5 seeds at
    the horizon; its estimate on 8 jobs is the larger of its two bounds."""
    p = P.Protocol()
    tasks = P.planned(p)
    assert len(tasks) == 5 * 7 * 2 + 12 * 5
    assert sum(t.steps for t in tasks) == 70 * 1000 + 60 * 4000
    e = P.estimate(p, tasks, jobs=8, model={"n_layer": 6, "n_embd": 384, "ctx": 256, "vocab": 256})
    assert e["wall_s"] == max(e["host_s"] / 8, e["device_s"])
