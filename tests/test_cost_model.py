"""anvil_fast.studies.cost_model: the alpha-beta arithmetic, the schedule's timeline, the data file and the
validation against measured runs, on synthetic inputs whose answers are worked out by hand."""

from __future__ import annotations

import json

import pytest

from anvil_fast.studies import cost_model as C

RUN5 = "results/anvil_optimizer_h200/run5/scaling_gpu_2ranks.json"


def test_ring_formula_for_known_alpha_beta():
    ab = C.AlphaBeta(alpha_ms=0.01, bw_gbs=100.0)
    # 4 ranks, 1 GB: 3 steps of 10 us + 3/4 of 1 GB at 100 GB/s (7.5 ms); an all-reduce twice that
    assert C.ring_ms("reduce_scatter", 1e9, 4, ab) == pytest.approx(7.53)
    assert C.ring_ms("all_gather", 1e9, 4, ab) == pytest.approx(7.53)
    assert C.ring_ms("all_reduce", 1e9, 4, ab) == pytest.approx(15.06)
    assert C.ring_ms("all_reduce", 1e9, 1, ab) == 0.0
    # 8 ranks: 7 steps, 7/8 of the bytes
    assert C.ring_ms("reduce_scatter", 8e8, 8, C.AlphaBeta(0.0, 50.0)) == pytest.approx(14.0)


def test_fit_recovers_alpha_and_bandwidth():
    truth = C.AlphaBeta(alpha_ms=0.02, bw_gbs=150.0)
    for kind in C.KINDS:
        pts = [(n, C.ring_ms(kind, n, 2, truth)) for n in C.SWEEP_BYTES]
        fit = C.fit_alpha_beta(kind, 2, pts)
        assert fit.alpha_ms == pytest.approx(0.02, rel=1e-6) and fit.bw_gbs == pytest.approx(150.0, rel=1e-9)
    with pytest.raises(ValueError, match="two message sizes"):
        C.fit_alpha_beta("all_gather", 2, [(1 << 20, 0.1)])
    with pytest.raises(ValueError, match="does not grow"):
        C.fit_alpha_beta("all_gather", 2, [(1 << 20, 0.2), (1 << 22, 0.1)])


def test_bad_alpha_beta_and_world_are_refused():
    with pytest.raises(ValueError, match="bw_gbs"):
        C.AlphaBeta(0.0, 0.0)
    with pytest.raises(ValueError, match="alpha_ms"):
        C.AlphaBeta(-1.0, 1.0)
    with pytest.raises(ValueError, match="positive int"):
        C.ring_steps("all_gather", 0)
    with pytest.raises(ValueError, match="unknown collective"):
        C.ring_steps("broadcast", 2)


def _two_pieces():
    # at 1 GB/s and 2 ranks a collective of n bytes takes n / 2e6 ms: A's 2 ms, B's 1 ms
    pieces = {"A": C.Piece("A", "sharded", 1.0, 4_000_000), "B": C.Piece("B", "sharded", 3.0, 2_000_000)}
    fits = {k: C.AlphaBeta(0.0, 1.0) for k in C.KINDS}
    return pieces, fits


def test_schedule_timeline_by_hand():
    pieces, fits = _two_pieces()
    # comm stream: RS A [0, 2], RS B [2, 3]; compute: A [2, 3], B [3, 6]; AG A [3, 5], AG B [6, 7]
    p = C.schedule(pieces, ["A", "B"], ["A", "B"], 2, fits)
    assert (p.compute_ms, p.comm_ms, p.device_ms, p.step_ms) == pytest.approx((4.0, 6.0, 7.0, 7.0))
    assert p.hidden == pytest.approx(0.5)
    # B's reduce first: RS B [0, 1], RS A [1, 3]; B [1, 4], AG B [4, 5]; A [4, 5], AG A [5, 7]
    q = C.schedule(pieces, ["B", "A"], ["B", "A"], 2, fits)
    assert q.device_ms == pytest.approx(7.0)
    # a host slower than the device bounds the step
    assert C.schedule(pieces, ["A", "B"], ["A", "B"], 2, fits, host_ms=8.5).step_ms == 8.5
    # one rank: no collectives, the compute alone
    assert C.schedule(pieces, ["A", "B"], ["A", "B"], 1, None).step_ms == pytest.approx(4.0)


def test_schedule_replicated_pass_waits_for_its_all_reduce():
    pieces = {"A": C.Piece("A", "sharded", 1.0, 2_000_000), "r": C.Piece("r", "replicated", 0.5, 2_000_000)}
    fits = {k: C.AlphaBeta(0.0, 1.0) for k in C.KINDS}
    # AR r [0, 2] (twice a 1 ms ring), RS A [2, 3]; r's pass [2, 2.5]; A [3, 4]; AG A [4, 5]
    p = C.schedule(pieces, ["A", "r"], ["r", "A"], 2, fits)
    assert p.device_ms == pytest.approx(5.0) and p.comm_ms == pytest.approx(4.0)


def test_schedule_refuses_incomplete_orders_and_missing_fits():
    pieces, fits = _two_pieces()
    with pytest.raises(ValueError, match="scatter_order must list every piece"):
        C.schedule(pieces, ["A"], ["A", "B"], 2, fits)
    with pytest.raises(ValueError, match="need collective fits"):
        C.schedule(pieces, ["A", "B"], ["A", "B"], 2, None)


def _data(collectives: bool = True) -> dict:
    labels = {"A": dict(comms="sharded", nbytes=4_000_000, shape=[2]), "B": dict(comms="sharded", nbytes=2_000_000,
                                                                               shape=[2])}
    worlds = {"1": dict(update_ms={"A": 2.0, "B": 6.0}, step_nocomm_ms=8.1, host_ms=0.5),
              "2": dict(update_ms={"A": 1.0, "B": 3.0}, step_nocomm_ms=4.1, host_ms=0.5)}
    coll = {"2": {k: dict(fit=dict(alpha_ms=0.0, bw_gbs=1.0), points=[]) for k in C.KINDS}} if collectives else {}
    return dict(format=C.FORMAT, generated_by="synthetic", layouts={"gpt2small": dict(
        labels=labels, scatter=["A", "B"], work=["A", "B"], worlds=worlds)}, collectives=coll)


def test_json_round_trip_and_refusal(tmp_path):
    path = tmp_path / "d" / "pieces.json"
    C.save(_data(), path)
    back = C.load(path)
    assert back == json.loads(json.dumps(_data()))
    assert C.predict(back, "gpt2small", 2).device_ms == pytest.approx(7.0)
    # fits for 4 ranks come from the largest measured world's (2)
    assert C.fits_of(back, 4) == {k: C.AlphaBeta(0.0, 1.0) for k in C.KINDS}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a cost-model data file"):
        C.load(bad)
    with pytest.raises(ValueError, match="no pieces for layout 'gpt2small' at 8 ranks"):
        C.predict(back, "gpt2small", 8)


def test_read_scaling_run_reads_the_runs_record():
    run = C.read_scaling_run(RUN5)
    assert run["rows"] == {1: dict(step_ms=8.521, nocomm_ms=8.347, comm_ms=0.0, anvil_only_ms=8.083),
                           2: dict(step_ms=8.896, nocomm_ms=13.17, comm_ms=2.227, anvil_only_ms=8.486)}
    assert run["command"].startswith("python -m anvil_fast.scaling gpu --worlds 1,2")  # as it was run
    with pytest.raises(ValueError, match="not JSON"):
        C.read_scaling_run(RUN5.replace(".json", ".md"))
    with pytest.raises(ValueError, match="not a 'anvil_fast.train_step/1' record"):
        C.read_train_step_run(RUN5)


def test_stored_records_are_the_conversion_of_their_tables(tmp_path):
    # every committed record of a table-only run is what tools/run_tables_to_json.py makes of the table
    import shutil
    from pathlib import Path

    from tools.run_tables_to_json import convert

    stored = sorted(Path("results").glob("anvil_optimizer_h200/run*/scaling_gpu_2ranks*.json"))
    assert len(stored) == 3
    for rec in stored:
        copy = tmp_path / rec.parent.name / rec.with_suffix(".md").name
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(rec.with_suffix(".md"), copy)
        assert convert(copy).read_text() == rec.read_text(), rec


def test_cost_model_reads_no_markdown():
    from pathlib import Path

    src = Path(C.__file__).read_text()
    assert "import re\n" not in src and "re.compile" not in src


def test_validate_scales_pieces_to_the_runs_one_rank_row():
    run = dict(path="synthetic", command="", rows={1: dict(step_ms=16.5, nocomm_ms=16.0, comm_ms=0.0),
                                                   2: dict(step_ms=15.0, nocomm_ms=8.0, comm_ms=6.0)})
    (v,) = C.validate(_data(), run)
    # pieces x2 (16 ms at one rank): RS A [0, 2], RS B [2, 3]; A [2, 4]; AG A [4, 6]; B [4, 10]; AG B [10, 11]
    assert v["scale"] == pytest.approx(2.0) and not v["calibrated"]
    assert v["predicted"].step_ms == pytest.approx(11.0) and v["step_error"] == pytest.approx(11 / 15 - 1)
    assert v["nocomm_error"] == pytest.approx(0.0)
    # without measured collectives: one bandwidth calibrated so that the collectives alone take 6 ms
    (w,) = C.validate(_data(collectives=False), run)
    assert w["calibrated"] and w["predicted"].comm_ms == pytest.approx(6.0)


def test_prediction_table_takes_fallback_fits_where_the_data_has_none():
    data = _data(collectives=False)
    assert [line.split("|")[2].strip() for line in C.prediction_table(data, [1, 2])[2:]] == ["1"]
    fits = C.calibrated_fits(6.0, C.ring_bytes(C.pieces_of(data, "gpt2small", 2), 2))
    rows = C.prediction_table(data, [1, 2], fallback_fits=fits)[2:]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "2"]
    # calibrated on 6 ms of collectives at two ranks: the two-rank row's collectives alone are those 6 ms
    assert float(rows[1].split("|")[4]) == pytest.approx(6.0)
    # measured fits win over the fallback
    with_fits = C.prediction_table(_data(), [2], fallback_fits=fits)[2:]
    assert with_fits == C.prediction_table(_data(), [2])[2:]


def test_bracket_from_totals():
    run = dict(rows={1: dict(step_ms=8.0, nocomm_ms=8.0, comm_ms=0.0), 2: dict(step_ms=6.0, nocomm_ms=4.0, comm_ms=2.0)})
    b = C.bracket(run, 8)
    # compute 8/8; collectives 2 ms x (7/8) / (1/2)
    assert b["compute_ms"] == pytest.approx(1.0) and b["comm_ms"] == pytest.approx(3.5)
    assert (b["low_ms"], b["high_ms"]) == pytest.approx((3.5, 4.5))


def test_predict_cli(tmp_path, capsys):
    path = tmp_path / "pieces.json"
    C.save(_data(), path)
    out = tmp_path / "pred.md"
    assert C.main(["predict", "--data", str(path), "--worlds", "1,2", "--validate", RUN5, "--out", str(out)]) == 0
    text = out.read_text()
    assert "| gpt2small | 2 | 4.000 | 6.000 | 7.000 | 50% |" in text
    assert RUN5 in text
    assert C.main(["predict", "--data", str(tmp_path / "missing.json")]) == 2
    assert "no data file" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_measure_smoke_on_cpu_writes_a_file_predict_reads(tmp_path):
    path = tmp_path / "pieces.json"
    assert C.main(["measure", "--device", "cpu", "--layouts", "gpt2small", "--worlds", "1,2", "--n", "1",
                   "--out", str(path)]) == 0
    data = C.load(path)
    lay = data["layouts"]["gpt2small"]
    # every label has a piece at both world sizes; the collectives were swept at 2 ranks
    assert set(lay["worlds"]) == {"1", "2"}
    assert all(set(w["update_ms"]) == set(lay["labels"]) for w in lay["worlds"].values())
    assert set(data["collectives"]["2"]) == set(C.KINDS)
    assert C.main(["predict", "--data", str(path), "--worlds", "1,2"]) == 0


def test_measure_refuses_a_world_that_cannot_shard(capsys):
    assert C.main(["measure", "--device", "cpu", "--worlds", "1,3", "--out", "/nonexistent/x.json"]) == 2
    assert "3 ranks cannot shard" in capsys.readouterr().err


def _training_data(scatter=("A", "B")) -> dict:
    d = _data()
    d["training"] = dict(size="tiny", group_layers=1, global_batch=4, seq=8, scatter=list(scatter), work=["A", "B"],
                         labels=d["layouts"]["gpt2small"]["labels"],
                         worlds={"2": dict(fwd_ms=10.0, bwd_ms=20.0, ready_ms={"A": 5.0, "B": 18.0},
                                           update_ms={"A": 1.0, "B": 3.0})})
    return d


def test_training_step_timeline_by_hand():
    # RS A launched at 15 (10 + 5) -> 17; RS B at 28 -> 29; updates from 30: A [30, 31], AG A [31, 33];
    # B [31, 34], AG B [34, 35]
    p = C.predict_training(_training_data(), 2)
    assert p.step_ms == pytest.approx(35.0) and p.nocomm_ms == pytest.approx(34.0)
    assert p.opt.comm_ms == pytest.approx(6.0) and p.hidden == pytest.approx(5 / 6)
    # reduces strictly in scatter order: A waits behind B (launched at 28): RS B [28, 29], RS A [29, 31];
    # A [31, 32], AG A [32, 34]; B [32, 35], AG B [35, 36]
    assert C.predict_training(_training_data(("B", "A")), 2).step_ms == pytest.approx(36.0)
    with pytest.raises(ValueError, match="no training-step pieces at 4 ranks"):
        C.predict_training(_training_data(), 4)


def test_training_validation_reads_a_train_step_record(tmp_path):
    from tools.run_tables_to_json import convert

    table = tmp_path / "ts.md"
    table.write_text("<!-- generated by `python -m anvil_fast.studies.train_step --worlds 2` -->\n# t\n\n| ranks | per-rank batch |"
                     " a | b | c | d | e | f | g | h |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
                     "| 2 | 2 | 34.00 | 35.00 | 36.00 | 34.00 | 6.00 | 83% | | yes |\n")
    run = C.read_train_step_run(convert(table))
    assert run["rows"] == {2: dict(batch=2, prehook_ms=34.0, end_ms=35.0, sequential_ms=36.0, nocomm_ms=34.0,
                                   comm_ms=6.0)}
    lines = C.training_validation_table(_training_data(), [run])
    # the model's 35 ms (test_training_step_timeline_by_hand) against the measured 35: no error
    assert lines[-1].split("|")[3:6] == [" 35.00 ", " 35.00 ", " +0% "]
    run["rows"][2]["batch"] = 1
    with pytest.raises(ValueError, match="per-rank batch of 1"):
        C.training_validation_table(_training_data(), [run])


def test_study_records_round_trip_and_refuse_a_short_row(tmp_path):
    from anvil_fast.studies import study_runs as R

    rows = {2: dict(step_ms=9.0, nocomm_ms=8.0, comm_ms=2.0, anvil_only_ms=7.0, extra=1.0),
            1: dict(step_ms=8.0, nocomm_ms=8.0, comm_ms=0.0, anvil_only_ms=7.5)}
    path = R.write_record(tmp_path / "s.md", R.SCALING, "python -m anvil_fast.studies.scaling gpu --worlds 1,2", rows)
    assert path == tmp_path / "s.json"
    run = C.read_scaling_run(path)
    assert run["rows"] == {w: {k: v for k, v in r.items() if k != "extra"} for w, r in rows.items()}
    assert list(json.loads(path.read_text())["rows"]) == ["1", "2"]
    with pytest.raises(KeyError):
        R.write_record(tmp_path / "t.md", R.TRAIN_STEP, "", {2: dict(batch=2)})
    path.write_text(json.dumps({"format": R.SCALING, "rows": {"2": dict(step_ms=1.0)}}))
    with pytest.raises(ValueError, match="row '2' lacks"):
        C.read_scaling_run(path)


def test_training_problems_name_the_world_sizes_the_training_model_cannot_run_at():
    from anvil_fast.models.banked_gpt import CPU_DEFAULTS, CUDA_DEFAULTS
    from anvil_fast.studies.cost_measure import training_problems

    # the CPU smoke's tiny model: banks of 2 and 4 matrices, a global batch of 4
    cpu = training_problems([1, 2, 4, 8], **CPU_DEFAULTS)
    assert sorted(cpu) == [4, 8]
    assert "divisible by world_size=4" in cpu[4] and "global batch 4" in cpu[8]
    # GPT-2 small in banks of four layers divides over 8 ranks, not 16
    gpu = training_problems([1, 2, 4, 8, 16], **CUDA_DEFAULTS)
    assert sorted(gpu) == [16] and "world_size=16" in gpu[16]
