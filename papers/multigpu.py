"""The paper's many-GPU subsection: the cost model of :mod:`anvil_fast.studies.cost_model`, its check
against the measured two-rank runs, its 4- and 8-rank predictions, and the training-step table.

Sources, in order of preference:

* papers/data/cost_model_h200.json (``python -m anvil_fast.studies.cost_model measure``): the model proper,
  pieces measured per rank on one GPU;
* without it, the measured runs alone (results/anvil_optimizer_h200/run4, run5, the JSON records of
  ``python -m anvil_fast.studies.scaling gpu`` beside their tables): the compute of the 1-rank comms-skipped step split ``1 / w``,
  the collectives scaled from the 2-rank collectives-alone by the ring's ``(w - 1) / w``, the step
  bracketed between full overlap and none (:func:`anvil_fast.studies.cost_model.bracket`);
* papers/data/train_step_h200.md (``python -m anvil_fast.studies.train_step``), included as written, and its
  record train_step_h200.json, which the model is checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "papers" / "data"
RESULTS = ROOT / "results"
PIECES = "cost_model_h200.json"
TRAIN_STEP = "train_step_h200.md"
#: the run's JSON record, which the train step writes beside its table
TRAIN_STEP_RECORD = "train_step_h200.json"
RUNS = ("anvil_optimizer_h200/run4", "anvil_optimizer_h200/run5")
PREDICT_WORLDS = (1, 2, 4, 8)
MEASURE_CMD = f"python -m anvil_fast.studies.cost_model measure --out papers/data/{PIECES}"
TRAIN_CMD = f"python -m anvil_fast.studies.train_step --device cuda --worlds 1,2 --out papers/data/{TRAIN_STEP}"


def _runs() -> list[dict]:
    from anvil_fast.studies import cost_model as C

    out = []
    for r in RUNS:
        run = C.read_scaling_run(RESULTS / r / "scaling_gpu_2ranks.json")
        run["path"] = f"results/{r}"
        out.append(run)
    return out


def _pieces() -> dict | None:
    from anvil_fast.studies import cost_model as C

    path = DATA / PIECES
    return C.load(path) if path.is_file() else None


def _bracket_validation(runs: list[dict]) -> list[dict]:
    from anvil_fast.studies import cost_model as C

    rows = []
    for run in runs:
        for w, meas in sorted(run["rows"].items()):
            if w == 1:
                continue
            b = C.bracket(run, w, from_world=w)
            rows.append(dict(run=run["path"], world=w, one=run["rows"][1]["nocomm_ms"], b=b, meas=meas,
                             nocomm_error=b["compute_ms"] / meas["nocomm_ms"] - 1,
                             inside=b["low_ms"] <= meas["step_ms"] <= b["high_ms"]))
    return rows


def table_validation() -> str:
    from anvil_fast.studies import cost_model as C

    runs, data = _runs(), _pieces()
    if data is not None:
        moved = any("anvil_fast.scaling " in r["command"] for r in runs)
        text = "\n".join(C.validation_table(data, runs)) + f"\n\n*Pieces: `papers/data/{PIECES}`; runs: " + \
            ", ".join(f"`{r['path']}` (`{r['command']}`)" for r in runs) + \
            ("; the commands as they ran: the module is `anvil_fast.studies.scaling` in this tree" if moved else "") + ".*"
        if (DATA / TRAIN_STEP_RECORD).is_file() and data.get("training"):
            run = C.read_train_step_run(DATA / TRAIN_STEP_RECORD)
            run["path"] = f"papers/data/{TRAIN_STEP}"
            text += "\n\nThe training step, against `python -m anvil_fast.studies.train_step`:\n\n" + \
                "\n".join(C.training_validation_table(data, [run]))
        return text
    lines = ["| run | ranks | 1-rank step, comms skipped ms | predicted w-rank comms skipped ms | measured ms | "
             "error | collectives alone ms (measured) | predicted step ms: full overlap .. none | measured step ms | "
             "in range |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in _bracket_validation(runs):
        b, m = r["b"], r["meas"]
        lines.append(f"| `{r['run']}` | {r['world']} | {r['one']:.3f} | {b['compute_ms']:.3f} | {m['nocomm_ms']:.3f} | "
                     f"{r['nocomm_error']:+.0%} | {m['comm_ms']:.3f} | {b['low_ms']:.3f} .. {b['high_ms']:.3f} | "
                     f"{m['step_ms']:.3f} | {'yes' if r['inside'] else 'no'} |")
    return "\n".join(lines) + "\n\n*Source: the timing tables of " + ", ".join(
        f"`{r['path']}/scaling_gpu_2ranks.md`" for r in runs) + (
        f" (the scaling study, `python -m anvil_fast.studies.scaling gpu"
        f"{runs[0]['command'].split(' gpu', 1)[1].split(' --out')[0]}`; each table's first line quotes the "
        "command as it was run).*")


def table_prediction() -> str:
    from anvil_fast.studies import cost_model as C

    data = _pieces()
    if data is not None:
        fallback, note = None, ""
        if not data.get("collectives"):
            # One GPU cannot time a collective: one bandwidth, calibrated on the latest two-rank run's
            # collectives alone (as the check above does), stands in for every kind at every size.
            run = _runs()[-1]
            fallback = C.calibrated_fits(run["rows"][2]["comm_ms"], C.ring_bytes(C.pieces_of(data, "gpt2small", 2), 2))
            bw = next(iter(fallback.values())).bw_gbs
            note = (f" Collectives: none measured on one GPU; every kind at {bw:.1f} GB/s and no latency, the "
                    f"bandwidth at which `{run['path']}`'s two-rank collectives alone take its measured "
                    f"{run['rows'][2]['comm_ms']:.3f} ms.")
        train = C.training_table(data, list(PREDICT_WORLDS), fallback_fits=fallback)
        return "\n".join(C.prediction_table(data, list(PREDICT_WORLDS), fallback_fits=fallback)
                         + ([""] + train if train else [])) + \
            f"\n\n*Source: `papers/data/{PIECES}`, `{data.get('generated_by', MEASURE_CMD)}`.{note}*"
    run = _runs()[-1]
    lines = ["| layout | ranks | compute ms | collectives ms | predicted step ms, collectives fully hidden | "
             "predicted step ms, none hidden |", "|---|---:|---:|---:|---:|---:|"]
    for w in PREDICT_WORLDS:
        b = C.bracket(run, w)
        lines.append(f"| gpt2small | {w} | {b['compute_ms']:.3f} | {b['comm_ms']:.3f} | {b['low_ms']:.3f} | "
                     f"{b['high_ms']:.3f} |")
    return "\n".join(lines) + f"\n\n*Predictions from `{run['path']}/scaling_gpu_2ranks.md` alone (1-rank compute, " \
        f"2-rank collectives); the seed layout's rows need the pieces (`{MEASURE_CMD}`).*"


def table_train_step() -> str:
    if not (DATA / TRAIN_STEP).is_file():
        return ("Not measured on GPUs: what the study measures, the share of the collectives hidden behind the "
                "backward pass, needs two GPUs of one host (a single rank has no collectives to hide), and it has "
                "not been run on such a machine (the two-GPU runs above time the optimizer's step alone, without a "
                "backward pass to hide the collectives behind), so this section has no table of it. What is "
                "checked is that the overlapped step gives the weights of the sequential one bit for bit, on two "
                f"gloo processes (`tests/test_train_step.py`). The measurement is `{TRAIN_CMD}` on two GPUs.")
    from papers.data_tables import include_markdown

    return include_markdown(TRAIN_STEP)


def values() -> dict[str, str]:
    rows = _bracket_validation(_runs())
    errs = ", ".join(f"{r['nocomm_error']:+.0%} ({r['run'].rsplit('/', 1)[-1]})" for r in rows)
    source = ("the measured per-rank pieces" if _pieces() is not None else
              "the measured runs' totals alone, since the per-rank pieces have not been measured yet")
    if _pieces() is None:
        note = (f"The comms-skipped step at two ranks misses by {errs}: these runs launched the step without "
                "CUDA graphs, and their two-rank step with the collectives skipped was *slower* than the one-rank "
                "step, so their step time was set by something other than the device's work -- most likely the "
                "host issuing the kernels (not profiled) -- which the device terms of the model cannot predict; the "
                "model's host term needs the host time that `measure` records. The predictions below are "
                "therefore of the device's work alone, and are stated as predictions:")
    else:
        note = ("The errors above are the model's on the only case that could be checked (two ranks); the "
                "predictions below, at four and eight ranks, are predictions:")
    return {"mg_validation_note": note, "mg_source": source, "mg_measure_cmd": f"`{MEASURE_CMD}`",
            "mg_train_cmd": f"`{TRAIN_CMD}`"}


def tables() -> dict[str, Callable[[], str]]:
    return {"multigpu_validation": table_validation, "multigpu_prediction": table_prediction,
            "train_step_h200": table_train_step}


__all__ = ["tables", "values"]
