"""papers/orthogonalizers.py: the paper's table of other libraries' orthogonalizations, rendered from the JSON
the harness writes (here a small CPU run; the paper's comes from results/h200_orthogonalizers)."""

from __future__ import annotations

import dataclasses
import json

from anvil_fast.studies import adapters as A
from anvil_fast.studies import harness as H
from papers import orthogonalizers as peers


def _data(tmp_path):
    impls, _ = A.load(["torch-muon", "anvil-safe", "field-muon-newton-schulz", "field-muon-newton-schulz-fused"])
    rows = H.judge(impls, shapes=[(2, 24, 16)], families=("spectrum", "gaussian", "near_rank1"),
                   near_rank1_count=4, progress=False, spectrum_count=64)
    path = tmp_path / "orthogonalizers.json"
    H.write_json(H.to_json(rows, command="python -m anvil_fast.studies.difftest --adapter torch-muon,anvil-safe", impls=impls,
                           unavailable={"dion-muon": "dion not installed"}), str(path))
    return json.loads(path.read_text()), rows


def test_the_table_renders_the_json(tmp_path):
    data, rows = _data(tmp_path)
    text = peers.table(data)
    lines = [line for line in text.splitlines() if line.startswith("| torch-muon") or line.startswith("| anvil-safe")]
    assert len(lines) == 2
    by = {(r.impl, r.family): r for r in rows}
    muon = lines[0].split(" | ")
    assert muon[1] == "24x16" and muon[2] == f"{by['torch-muon', 'gaussian'].fast:.3g}"
    assert muon[7] == f"{by['torch-muon', 'spectrum'].math_z:.1f}"
    assert "Not run there: dion-muon (dion not installed)" in text
    assert "python -m anvil_fast.studies.difftest --adapter torch-muon,anvil-safe" in text


def test_the_statements_follow_the_numbers(tmp_path):
    data, _ = _data(tmp_path)
    said = {e["impl"]: peers.classify(e) for e in peers.summarize(data)}
    # Muon's quintic is ~0.2 from the polar factor in float64 already: its math limits it
    assert "its math limits it" in said["torch-muon"] and "as accurate as its math allows" in said["torch-muon"]
    assert "its rounding limits it" in said["anvil-safe"]
    assert "FAIL" not in " ".join(said.values())


def test_a_probe_deviation_of_code_the_lift_found_exact_is_a_rounding_finding_in_the_paper(tmp_path):
    data, rows = _data(tmp_path)
    (row,) = [r for r in rows if r.impl == "field-muon-newton-schulz" and r.family == "spectrum"]
    assert row.lift_err is not None and row.declared_dtype == "bfloat16"
    moved = dataclasses.replace(row, math_z=9.5, math_shift=-0.003)  # a form whose rounding leans its own way
    assert moved.verdict() == "finding"
    i = next(i for i, d in enumerate(data["rows"]) if d["impl"] == row.impl and d["family"] == "spectrum")
    data["rows"][i] = moved.to_json()
    said = {e["impl"]: peers.classify(e) for e in peers.summarize(data)}
    assert "finding: its rounding moves the probe's singular values 9.5 standard errors" in said[row.impl]
    assert "math within" not in said[row.impl]
    assert [f for f in peers.findings(data) if f.startswith(f"Finding: the bf16 rounding of {row.impl} moves")
            and "9.5 standard errors" in f and "run in float64 its output is the declared math" in f]
    # where the lift did not reach, the same deviation is the probe's math FAIL
    assert dataclasses.replace(moved, lift_err=None).verdict() == "FAIL"


def test_siblings_with_the_same_math_that_round_differently_are_a_finding(tmp_path):
    data, _ = _data(tmp_path)
    by = {(r["impl"], r["family"]): r for r in data["rows"]}
    by["field-muon-newton-schulz", "gaussian"]["fast"] = 4 * by["field-muon-newton-schulz-fused", "gaussian"]["fast"]
    found = peers.findings(data)
    assert any(f.startswith("Finding: field-muon-newton-schulz rounds 4.0x more than its sibling "
                            "field-muon-newton-schulz-fused") for f in found), found
    by["torch-muon", "near_rank1"]["verdict"] = "FAIL"
    by["torch-muon", "near_rank1"]["verdicts"]["safety"] = ["safety: output not finite on 1/4 matrices (limit 0)"]
    assert any(f.startswith("FAIL: torch-muon") and "limit 0" in f for f in peers.findings(data))


def test_without_data_the_table_says_which_command_writes_it(monkeypatch):
    monkeypatch.setattr(peers, "H200_DIR", "results/no_such_run")
    monkeypatch.setattr(peers, "CPU_DIR", "results/no_such_run_either")
    text = peers.table()
    assert "no data yet" in text and "results/no_such_run/*.json" in text
    assert "--adapter" in peers.COMMAND and "--json" in peers.COMMAND and "--resume" in peers.COMMAND


def test_the_h200_runs_cover_every_adapter_and_shape():
    named = {n for _, adapters, _ in peers.RUNS for n in adapters.split(",")}
    assert named == set(A.ADAPTERS)
    assert {s for _, _, s in peers.RUNS} == set(peers.SHAPES)
    assert len({name for name, _, _ in peers.RUNS}) == len(peers.RUNS)


def test_an_h200_fail_is_set_beside_the_same_adapter_s_cpu_verdicts(tmp_path):
    cpu, _ = _data(tmp_path)
    h200 = json.loads(json.dumps(cpu))
    assert "no FAIL" in peers.cross_device(h200, cpu)
    sp = next(r for r in h200["rows"] if r["impl"] == "torch-muon" and r["family"] == "spectrum")
    sp.update(verdict="FAIL", math_z=9.5, math_clause="step 1 b",
              verdicts={"math": ["math: off along step 1 b"], "safety": [], "rounding": [], "findings": []})
    text = peers.cross_device(h200, cpu)
    n_cpu = sum(r["impl"] == "torch-muon" for r in cpu["rows"])
    assert text == (f"* torch-muon (2x24x16, spectrum, math z 9.5 along step 1 b): the same adapter is ok on all "
                    f"{n_cpu} of its CPU rows; an open false alarm of the math verdict on this device, not a finding "
                    "about the library.")
    # a FAIL that the CPU run shares, or a safety FAIL, is not called a false alarm
    cpu_sp = next(r for r in cpu["rows"] if r["impl"] == "torch-muon" and r["family"] == "spectrum")
    cpu_sp["verdict"] = "FAIL"
    assert "false alarm" not in peers.cross_device(h200, cpu) and "FAIL 1" in peers.cross_device(h200, cpu)
    cpu_sp["verdict"] = "ok"
    sp["verdicts"]["safety"] = ["safety: output not finite"]
    assert "false alarm" not in peers.cross_device(h200, cpu)


def test_the_h200_progress_counts_stored_and_complete_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "ROOT", tmp_path)
    d = tmp_path / peers.H200_DIR
    d.mkdir(parents=True)
    assert peers.h200_progress().startswith(f"0 of the {len(peers.RUNS)} runs stored so far, 0 of them complete")
    (d / peers.RUNS[0][0]).write_text(json.dumps({"complete": False, "rows": []}))
    (d / peers.RUNS[1][0]).write_text(json.dumps({"complete": True, "rows": []}))
    (d / "not_a_run.json").write_text(json.dumps({"complete": True, "rows": []}))
    assert peers.h200_progress().startswith(f"2 of the {len(peers.RUNS)} runs stored so far, 1 of them complete")
    for name, _, _ in peers.RUNS:
        (d / name).write_text(json.dumps({"complete": True, "rows": []}))
    assert peers.h200_progress().startswith(f"all {len(peers.RUNS)} runs, each complete")
    (d / peers.RUNS[-1][0]).write_text(json.dumps({"complete": False, "rows": []}))
    assert peers.h200_progress().startswith(f"{len(peers.RUNS)} of the {len(peers.RUNS)} runs stored so far, "
                                            f"{len(peers.RUNS) - 1} of them complete")


def test_a_table_judged_on_two_machines_names_each_with_its_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "ROOT", tmp_path)
    d = tmp_path / peers.H200_DIR
    d.mkdir(parents=True)
    assert peers.gpu_machines() == "the H200"
    # one run's rows name their machines (a run resumed elsewhere), another's only its run's device
    (d / peers.RUNS[0][0]).write_text(json.dumps({"device": "GPU B", "rows": [
        {"device_name": "GPU A"}, {"device_name": "GPU B"}, {"device_name": "GPU B"}]}))
    (d / peers.RUNS[1][0]).write_text(json.dumps({"device": "GPU A", "rows": [{}]}))
    data = peers.load(where=peers.H200_DIR)
    assert data["devices"] == {"GPU A": 2, "GPU B": 2}
    assert peers.gpu_machines() == data["device"] == "GPU A (2 rows), GPU B (2 rows)"
    (d / peers.RUNS[1][0]).unlink()
    (d / peers.RUNS[0][0]).write_text(json.dumps({"device": "GPU B", "rows": [{"device_name": "GPU B"}]}))
    assert peers.gpu_machines() == "GPU B"


def test_the_gpu_table_follows_the_runs_order_not_the_files_names(tmp_path, monkeypatch):
    """The runs' order is the layout's bank shapes (4x256x768 first); the files' names sort
    1x4096x4096 first: the merged rows follow the runs, a file of no run comes last."""
    monkeypatch.setattr(peers, "ROOT", tmp_path)
    d = tmp_path / peers.H200_DIR
    d.mkdir(parents=True)
    picked = [peers.RUNS[4], peers.RUNS[0], peers.RUNS[2]]
    assert sorted(name for name, _, _ in picked) != [name for name, _, _ in sorted(picked, key=peers.RUNS.index)]
    (d / "aaa_not_a_run.json").write_text(json.dumps({"rows": [{"impl": "other"}]}))
    for name, _, shape in picked:
        (d / name).write_text(json.dumps({"rows": [{"impl": name}]}))
    rows = peers.load(where=peers.H200_DIR)["rows"]
    assert [r["impl"] for r in rows] == [peers.RUNS[0][0], peers.RUNS[2][0], peers.RUNS[4][0], "other"]


def test_the_remaining_runs_are_the_lines_whose_json_is_missing_or_incomplete(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "ROOT", tmp_path)
    d = tmp_path / peers.H200_DIR
    d.mkdir(parents=True)
    (d / peers.RUNS[0][0]).write_text(json.dumps({"complete": True, "rows": [{}]}))
    (d / peers.RUNS[2][0]).write_text(json.dumps({"complete": False, "rows": [{}, {}, {}]}))
    rest = peers.remaining()
    assert [line for line, _, _ in rest] == [2] + list(range(3, len(peers.RUNS) + 1))
    n = len(peers.RUNS[2][1].split(",")) * 8  # the adapters x the eight input families
    assert rest[0][2] == "not run" and rest[1] == (3, peers.RUNS[2][0], f"3 of {n} rows")
    # the line numbers are those of the generated commands file, as the device stage counts them
    cmds = [ln for ln in peers.commands_file().splitlines() if ln.strip() and not ln.startswith("#")]
    assert peers.RUNS[2][0] in cmds[3 - 1]
    assert peers.main(["--lines"]) == 0
    assert capsys.readouterr().out.split() == [str(line) for line, _, _ in rest]


def test_the_stored_cpu_table_has_no_fail_and_names_its_commit():
    """The paper's CPU table (section 6.1) is judged by the current rule with no FAIL: the field's
    code and every library's, each below the math verdict's limit; a re-run that FAILs shows here."""
    from anvil_fast.core import tolerances as T

    data = peers.load(where=peers.CPU_DIR)
    assert data is not None and data["complete"]
    assert not [(r["impl"], r["shape"], r["family"]) for r in data["rows"] if r["verdict"] == "FAIL"]
    # past the probe's limit only where the lifted run found the declared math: the code's rounding
    past = [r for r in data["rows"] if r.get("math_z") is not None and r["math_z"] > T.MATH_Z]
    assert all(r["verdict"] == "finding" and r["lift_err"] <= T.LIFT_RTOL and r["lift_eps_err"] <= T.LIFT_RTOL
               and r["verdicts"]["rounding"][0].startswith("rounding: its bf16 rounding moves") for r in past)
    assert {r["impl"] for r in past} <= {"field-muon-newton-schulz-expanded"}
    commit = json.loads((peers.ROOT / peers.CPU_DIR / "orthogonalizers.json").read_text())["commit"]
    assert commit[:7] in (peers.ROOT / peers.CPU_DIR / "runs.txt").read_text()
    # the lifted run reached the field's code and found its math exact in float64
    lifted = [r for r in data["rows"] if r["family"] == "spectrum" and r.get("lift_err") is not None]
    assert len(lifted) >= 30 and max(r["lift_err"] for r in lifted) < 1e-3 * T.LIFT_RTOL
    # and at norms near eps its normalization the declared one (dion's NorMuon, the largest, 5e-8)
    assert all(r["lift_eps_err"] is not None for r in lifted) and max(r["lift_eps_err"] for r in lifted) < 0.1 * T.LIFT_RTOL


def test_the_h200_rules_name_each_run_s_commit_and_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "ROOT", tmp_path)
    d = tmp_path / peers.H200_DIR
    d.mkdir(parents=True)
    assert peers.h200_rules() == "no run stored yet"
    ok = {"verdict": "ok", "verdicts": {"math": []}}
    (d / peers.RUNS[0][0]).write_text(json.dumps({"commit": "a" * 40, "rows": [ok]}))
    (d / peers.RUNS[1][0]).write_text(json.dumps({"commit": "b" * 40, "rows": [dict(ok, math_matrices=31)]}))
    (d / peers.RUNS[2][0]).write_text(json.dumps({"commit": "c" * 40, "rows": [{"verdicts": {"math": ["m"]}}]}))
    text = peers.h200_rules()
    assert f"`{peers.RUNS[0][0]}` at commit aaaaaaa, whose math z reads the t statistic as a normal deviate" in text
    assert "neither of which can turn an ok into a FAIL" in text
    assert "every math verdict of ok there stands" in text
    assert f"`{peers.RUNS[1][0]}` at commit bbbbbbb, judged by this tree's rule" in text
    assert "its 1 math FAIL(s) are to be judged again" in text


def test_the_few_matrices_false_alarm_is_stated_from_its_run_and_the_probe_s_input():
    """The paper's numbers of the normal reading's false alarm: the stored run's z, and the matrices of
    the probe in the bin that failed, counted again from the probe's input (its clause names the bin)."""
    import numpy as np

    data = json.loads((peers.ROOT / peers.FEW_MATRICES["file"]).read_text())
    row = next(r for r in data["rows"] if r["impl"] == peers.FEW_MATRICES["impl"] and r["family"] == "spectrum")
    assert row["verdict"] == "FAIL" and row["math_clause"].startswith("sigma in [")
    lo, hi = (float(v) for v in row["math_clause"][len("sigma in ["):].rstrip("])").split(","))
    info = data["implementations"][peers.FEW_MATRICES["impl"]]["math"]
    m = H.DeclaredMath.of(info["coeffs"], normalization=info["normalization"], margin=info["margin"], eps=info["eps"])
    shape = tuple(row["shape"])
    key = H.spectrum_input(shape, m, seed=data.get("seed", 0), device="cpu").key.numpy()
    mats = np.broadcast_to(np.arange(key.shape[0])[:, None], key.shape)
    group = next(g for g in H._bins(np.where(key > 0, key, np.nan).reshape(-1))
                 if abs(key.reshape(-1)[g].min() / lo - 1) < 5e-3 and abs(key.reshape(-1)[g].max() / hi - 1) < 5e-3)
    assert len(np.unique(mats.reshape(-1)[group])) == peers.FEW_MATRICES["matrices"]
    v = peers.few_matrices()
    assert v["peers_few_z"] == f"{row['math_z']:.1f}" and float(v["peers_few_t"]) < 6 < float(v["peers_few_z"])


def test_the_package_s_bf16_only_kernels_are_not_read_as_unjudged_code():
    """An anvil adapter whose kernels refuse the float64 lift's dtype is said to take bf16 only, with its
    float64 math named; another library's refusal stays "not judged in float64"."""
    spectrum = {"family": "spectrum", "lift_note": peers.BF16_ONLY_NOTE, "verdict": "ok"}
    ours = peers.classify({"impl": "anvil-safe", "shape": "48x32", "families": {"spectrum": spectrum}})
    theirs = peers.classify({"impl": "dion-muon", "shape": "48x32", "families": {"spectrum": spectrum}})
    assert "its kernels take bf16 only; its float64 math is `anvil_ref`" in ours and "not judged" not in ours
    assert "not judged in float64 (raised GramInputError in float64)" in theirs
