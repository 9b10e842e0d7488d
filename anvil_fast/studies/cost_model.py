"""A cost model of the optimizer step at any world size, from pieces measured on one GPU.

``python -m anvil_fast.studies.cost_model measure --out results/cost_model/h200.json``
    On one GPU, for each layout (:data:`LAYOUTS`) and world size ``w`` of ``--worlds``: the
    optimizer exactly as rank 0 of ``w`` holds it (:class:`~anvil_fast.parallel.comms.NullComms`: its shards,
    nothing moved) and the time of every piece of its step -- each bank's update on its
    ``n / w`` matrices, each sharded Adam parameter's update on its rows, the replicated Adam pass --
    the whole step without communication, and the host's time to issue it. The same for the
    training step of :mod:`anvil_fast.studies.train_step` (its defaults,
    :data:`anvil_fast.models.banked_gpt.CUDA_DEFAULTS`), plus forward and backward at the per-rank batch
    and the time each gradient is complete in the backward pass. With two or more GPUs it also
    times the collectives (reduce-scatter, all-gather, all-reduce; 1 MiB to 256 MiB) on ``w`` NCCL
    ranks for every ``w`` of ``--worlds`` the GPUs allow, and fits the alpha-beta model. The timing
    is :mod:`anvil_fast.studies.cost_measure`'s; this module holds the model (functions of numbers), the
    data file and the tables.

``python -m anvil_fast.studies.cost_model predict --data FILE [--validate RUN.md ...]``
    The step at every world size of ``--worlds`` for each layout, and the comparison with measured
    multi-rank runs (the JSON records of ``python -m anvil_fast.studies.scaling gpu`` and
    ``python -m anvil_fast.studies.train_step``, written beside their tables: :mod:`anvil_fast.studies.study_runs`).

The model (one rank; every rank holds ``1 / w`` of every bank's matrices and of every sharded Adam
parameter's rows, so all ranks do the same work and the slowest rank is any rank):

* compute: the measured piece times at ``w`` (pieces are measured at their per-rank shapes, not
  scaled from one rank's: a bank update's time is not linear in its matrix count at small counts);
* collectives: NCCL's ring algorithms, the standard alpha-beta form. For ``n`` bytes (a
  reduce-scatter's input, an all-gather's output, an all-reduce's buffer) on ``w`` ranks::

      reduce-scatter, all-gather:  (w - 1) * alpha + (w - 1) / w * n / bw
      all-reduce:                 2 (w - 1) * alpha + 2 (w - 1) / w * n / bw

  with ``alpha`` and ``bw`` fitted per collective kind (least squares over the message sizes). At
  a world size where nothing was measured the largest measured world's fit is used -- assumed:
  one NVSwitch host, where every GPU's link bandwidth is the same whatever the ring length;
* the schedule (:mod:`anvil_fast.optim.optimizer`): the collectives run on one stream in launch order,
  the compute on another. Phase 0 launches the replicated all-reduce, phase 1 every reduce-scatter
  in ``scatter_order``; phase 2 walks ``work_order``: an update starts when the compute stream is
  free and its reduce-scatter has landed, and its all-gather is enqueued behind it; the step ends
  when both streams are idle;
* the host: the step cannot end before the host has issued it (``host_ms``, measured at ``w``);
* the training step: forward and backward first; each reduce-scatter launched once its gradient
  and every one before it in ``scatter_order`` is complete, the all-reduce after the backward pass,
  the updates after it as above (gathers waited at the step's end).

Predictions are stated as predictions: only world sizes that were run can be checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.progress import Progress, default_enabled
from anvil_ref.provenance import source_commit

from .study_runs import SCALING, TRAIN_STEP, read_record

FORMAT = "anvil_fast.cost_model/1"  # a fixed name (data files keep it), not a module path
KINDS = ("reduce_scatter", "all_gather", "all_reduce")
#: message sizes of the collective sweep (bytes)
SWEEP_BYTES = tuple(2 ** k for k in range(20, 29, 2))
DEFAULT_WORLDS = (1, 2, 4, 8)


LAYOUTS = ("gpt2small", "seed")


# --------------------------------------------------------------------------------------- the math
@dataclass(frozen=True)
class AlphaBeta:
    """One collective kind's latency per ring step (ms) and bandwidth (GB/s)."""

    alpha_ms: float
    bw_gbs: float

    def __post_init__(self):
        if not (math.isfinite(self.alpha_ms) and self.alpha_ms >= 0):
            raise ValueError(f"alpha_ms must be finite and >= 0, got {self.alpha_ms!r}")
        if not (math.isfinite(self.bw_gbs) and self.bw_gbs > 0):
            raise ValueError(f"bw_gbs must be finite and > 0, got {self.bw_gbs!r}")


def ring_steps(kind: str, world: int) -> int:
    """Sequential ring steps of one collective: w - 1, twice for an all-reduce."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive int, got {world!r}")
    return (2 if kind == "all_reduce" else 1) * (world - 1)


def ring_ms(kind: str, nbytes: float, world: int, ab: AlphaBeta) -> float:
    """``steps * alpha + steps / w * n / bw`` (module docstring); 0 on one rank."""
    s = ring_steps(kind, world)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return 0.0 if s == 0 else s * ab.alpha_ms + s / world * nbytes / (ab.bw_gbs * 1e6)


def fit_alpha_beta(kind: str, world: int, points: list[tuple[float, float]]) -> AlphaBeta:
    """Least squares of ``ms = a + b * nbytes`` over (nbytes, ms) points, read as the ring form:
    ``alpha = a / steps``, ``bw = steps / (w * b)``. A negative intercept (noise at small
    messages) is clipped to zero latency."""
    s = ring_steps(kind, world)
    if s == 0:
        raise ValueError("a one-rank collective moves nothing: nothing to fit")
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError(f"{kind} at {world} ranks: need points at two message sizes at least, got {points}")
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if not b > 0:
        raise ValueError(f"{kind} at {world} ranks: time does not grow with the message size: {points}")
    a = my - b * mx
    return AlphaBeta(alpha_ms=max(a, 0.0) / s, bw_gbs=s / (world * b) / 1e6)


@dataclass(frozen=True)
class Piece:
    """One label's part of a step at one world size: its update's time on this rank and the
    bytes of its collectives (``rs`` and ``ag`` for sharded labels, ``ar`` for replicated)."""

    label: str
    comms: str  #: "sharded" or "replicated"
    update_ms: float
    nbytes: int  #: the full tensor's bytes as it travels (bank gradients bf16, Adam fp32)


@dataclass(frozen=True)
class Prediction:
    world: int
    compute_ms: float  #: sum of the update pieces (comms skipped)
    comm_ms: float  #: the collectives alone, back to back
    device_ms: float  #: the two streams' schedule
    host_ms: float
    step_ms: float  #: max(device, host)

    @property
    def hidden(self) -> float:
        """The share of the collectives that does not lengthen the device's timeline over the
        compute (the host bound left out: a host-bound step hides everything behind the host)."""
        return (self.compute_ms + self.comm_ms - self.device_ms) / self.comm_ms if self.comm_ms > 0 else float("nan")


def schedule(pieces: dict[str, Piece], scatter: list[str], work: list[str], world: int,
             fits: dict[str, AlphaBeta] | None, *, host_ms: float = 0.0, ready: dict[str, float] | None = None,
             compute_start: float = 0.0) -> Prediction:
    """The step's two-stream timeline (module docstring). Optimizer alone (``ready`` None): every
    gradient is there at 0, the replicated all-reduce goes first. Training step (``ready``: label
    -> the time its gradient is complete, ``compute_start``: the backward pass's end): each
    reduce-scatter is launched in ``scatter_order`` once it and every label before it is ready
    (:class:`anvil_fast.optim.overlap.OverlappedStep`), the all-reduce after the backward pass, and
    the updates start at ``compute_start``. ``compute_ms`` is the updates' sum either way."""
    for order_name, order in (("scatter_order", scatter), ("work_order", work)):
        if sorted(order) != sorted(pieces):
            raise ValueError(f"{order_name} must list every piece once: {order} vs {sorted(pieces)}")
    if world > 1 and not fits:
        raise ValueError(f"{world} ranks need collective fits (alpha, bw per kind)")
    if ready is not None:
        missing = sorted(l for l in pieces if pieces[l].comms == "sharded" and l not in ready)
        if missing:
            raise ValueError(f"ready times missing for {missing}")

    def coll(kind, nbytes):
        return 0.0 if world == 1 else ring_ms(kind, nbytes, world, fits[kind])

    rep = [l for l in work if pieces[l].comms == "replicated"]
    ar_ms = coll("all_reduce", sum(pieces[l].nbytes for l in rep)) if rep else 0.0
    comm_t, comm_alone = 0.0, ar_ms
    if ready is None:
        comm_t = ar_done = ar_ms
    rs_done, launch = {}, 0.0
    for l in scatter:
        if pieces[l].comms == "sharded":
            launch = max(launch, 0.0 if ready is None else ready[l])
            rs = coll("reduce_scatter", pieces[l].nbytes)
            comm_t = max(comm_t, launch) + rs
            comm_alone += rs
            rs_done[l] = comm_t
    if ready is not None:
        comm_t = ar_done = max(comm_t, compute_start) + ar_ms
    compute_t, rep_done = compute_start, False
    for l in work:
        p = pieces[l]
        if p.comms == "replicated":
            if not rep_done:  # one fused pass over every replicated parameter, after the all-reduce
                compute_t = max(compute_t, ar_done) + sum(pieces[r].update_ms for r in rep)
                rep_done = True
            continue
        compute_t = max(compute_t, rs_done[l]) + p.update_ms
        ag = coll("all_gather", p.nbytes)
        comm_t = max(comm_t, compute_t) + ag
        comm_alone += ag
    device = max(compute_t, comm_t)
    compute = sum(p.update_ms for p in pieces.values())
    return Prediction(world=world, compute_ms=compute, comm_ms=comm_alone, device_ms=device, host_ms=host_ms,
                      step_ms=max(device, host_ms))


# --------------------------------------------------------------------------------------- data file
def pieces_of(data: dict, layout: str, world: int, *, scale: float = 1.0) -> dict[str, Piece]:
    """The pieces of ``layout`` at ``world`` from a measurement file (``scale``: every update time
    multiplied, for a run on other code or clocks)."""
    try:
        entry = data["layouts"][layout]["worlds"][str(world)]
    except KeyError:
        raise ValueError(f"the data has no pieces for layout {layout!r} at {world} ranks (measured: "
                         f"{sorted(data.get('layouts', {}).get(layout, {}).get('worlds', {}), key=int)}); "
                         "run `python -m anvil_fast.studies.cost_model measure` with that world size") from None
    meta = data["layouts"][layout]["labels"]
    return {l: Piece(l, meta[l]["comms"], scale * float(ms), int(meta[l]["nbytes"])) for l, ms in entry["update_ms"].items()}


def fits_of(data: dict, world: int) -> dict[str, AlphaBeta] | None:
    """Collective fits at ``world`` (the largest measured world's where ``world`` was not measured;
    worlds whose sweep could not be fitted are left out; None without any)."""
    coll = {w: c for w, c in (data.get("collectives") or {}).items() if all(c[k].get("fit") for k in KINDS)}
    if not coll:
        return None
    key = str(world) if str(world) in coll else str(max(map(int, coll)))
    return {k: AlphaBeta(**coll[key][k]["fit"]) for k in KINDS}


def predict(data: dict, layout: str, world: int, *, fits: dict[str, AlphaBeta] | None = None,
            scale: float = 1.0, with_host: bool = True) -> Prediction:
    lay = data["layouts"][layout]
    fits = fits if fits is not None else fits_of(data, world)
    host = float(lay["worlds"][str(world)].get("host_ms", 0.0)) if with_host and str(world) in lay["worlds"] else 0.0
    return schedule(pieces_of(data, layout, world, scale=scale), lay["scatter"], lay["work"], world, fits, host_ms=host)


@dataclass(frozen=True)
class TrainPrediction:
    world: int
    fwd_ms: float
    bwd_ms: float
    opt: Prediction  #: the optimizer part's timeline (its step_ms: the whole step's end)

    @property
    def step_ms(self) -> float:
        return self.opt.step_ms

    @property
    def nocomm_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms + self.opt.compute_ms

    @property
    def hidden(self) -> float:
        c = self.opt.comm_ms
        return (self.nocomm_ms + c - self.step_ms) / c if c > 0 else float("nan")


def predict_training(data: dict, world: int, *, fits: dict[str, AlphaBeta] | None = None) -> TrainPrediction:
    """The overlapped training step (gathers waited at the step's end) at ``world`` ranks."""
    tr = data.get("training")
    if not tr or str(world) not in tr["worlds"]:
        raise ValueError(f"the data has no training-step pieces at {world} ranks; run `python -m anvil_fast.studies.cost_model "
                         "measure` with that world size")
    e = tr["worlds"][str(world)]
    pieces = {l: Piece(l, tr["labels"][l]["comms"], float(ms), int(tr["labels"][l]["nbytes"]))
              for l, ms in e["update_ms"].items()}
    fits = fits if fits is not None else fits_of(data, world)
    fwd, bwd = float(e["fwd_ms"]), float(e["bwd_ms"])
    opt = schedule(pieces, tr["scatter"], tr["work"], world, fits,
                   ready={l: fwd + float(t) for l, t in e["ready_ms"].items()}, compute_start=fwd + bwd)
    return TrainPrediction(world=world, fwd_ms=fwd, bwd_ms=bwd, opt=opt)


def check_data(data: dict) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a cost-model data file (format {data.get('format') if isinstance(data, dict) else None!r}, "
                         f"expected {FORMAT!r})")
    for name, lay in data.get("layouts", {}).items():
        for key in ("labels", "scatter", "work", "worlds"):
            if key not in lay:
                raise ValueError(f"layout {name!r}: missing {key!r}")
    return data


def save(data: dict, path: str | os.PathLike) -> None:
    check_data(data)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def load(path: str | os.PathLike) -> dict:
    if not Path(path).is_file():
        raise ValueError(f"{path}: no data file; `python -m anvil_fast.studies.cost_model measure --out {path}` writes it")
    return check_data(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------- measured runs
def read_scaling_run(path: str | os.PathLike) -> dict:
    """The timing rows of a ``python -m anvil_fast.studies.scaling gpu`` run's JSON record
    (:mod:`anvil_fast.studies.study_runs`): ranks -> (step, comms skipped, collectives alone, ANVIL-only)
    ms, and the command line that produced it."""
    run = read_record(path, SCALING)
    if 1 not in run["rows"] or len(run["rows"]) < 2:
        raise ValueError(f"{path}: no timing table with a 1-rank row and a multi-rank row")
    return run


def read_train_step_run(path: str | os.PathLike) -> dict:
    """The rows of a ``python -m anvil_fast.studies.train_step`` run's JSON record: ranks -> per-rank batch
    and the steps' ms (pre-hook, end, not overlapped, comms skipped, collectives alone)."""
    return read_record(path, TRAIN_STEP)


def calibrated_fits(comm_ms: float, ring: dict[str, float]) -> dict[str, AlphaBeta]:
    """One bandwidth for every kind, zero latency, such that the step's collectives alone take
    ``comm_ms``: the fallback when no collective was measured (one number cannot separate latency
    from bandwidth). ``ring``: per kind, the total ring bytes ``sum steps / w * n`` of the step's
    collectives at the world size in question (:func:`ring_bytes`)."""
    total = sum(ring.values())
    if not comm_ms > 0:
        raise ValueError(f"collectives alone must take > 0 ms to calibrate, got {comm_ms!r}")
    bw = total / (comm_ms * 1e6)
    return {k: AlphaBeta(0.0, bw) for k in KINDS}


def ring_bytes(pieces: dict[str, Piece], world: int) -> dict[str, float]:
    """Per kind, ``sum steps / w * n`` over the step's collectives (what one unit of 1/bw costs)."""
    rep = sum(p.nbytes for p in pieces.values() if p.comms == "replicated")
    sh = sum(p.nbytes for p in pieces.values() if p.comms == "sharded")
    return {"reduce_scatter": ring_steps("reduce_scatter", world) / world * sh,
            "all_gather": ring_steps("all_gather", world) / world * sh,
            "all_reduce": ring_steps("all_reduce", world) / world * rep}


def validate(data: dict, run: dict, *, layout: str = "gpt2small") -> list[dict]:
    """Predict each multi-rank row of a measured run from the run's 1-rank row: the measured
    pieces scaled so that their 1-rank sum is the run's 1-rank comms-skipped step (the run may
    be of other code), the collectives from the data's fits or, without them, calibrated on the
    run's own collectives-alone column (then only the compute and the overlap are predicted)."""
    rows = run["rows"]
    one = predict(data, layout, 1, with_host=False)
    scale = rows[1]["nocomm_ms"] / one.compute_ms
    out = []
    for w, meas in sorted(rows.items()):
        if w == 1:
            continue
        fits = fits_of(data, w)
        calibrated = fits is None
        if calibrated:
            fits = calibrated_fits(meas["comm_ms"], ring_bytes(pieces_of(data, layout, w), w))
        p = predict(data, layout, w, fits=fits, scale=scale, with_host=False)
        out.append(dict(world=w, scale=scale, calibrated=calibrated, predicted=p, measured=meas,
                        step_error=p.step_ms / meas["step_ms"] - 1, nocomm_error=p.compute_ms / meas["nocomm_ms"] - 1))
    return out


def bracket(run: dict, world: int, *, from_world: int = 2) -> dict:
    """Without measured pieces: the compute of a run's 1-rank comms-skipped step split ``1 / w``
    (every piece sharded; the replicated ones are ~0.1k elements), the collectives scaled from the
    run's ``from_world`` collectives-alone by the ring's ``(w - 1) / w`` (zero latency), and the
    step between full overlap ``max(compute, comms)`` and none ``compute + comms``."""
    rows = run["rows"]
    compute = rows[1]["nocomm_ms"] / world
    comm = 0.0 if world == 1 else rows[from_world]["comm_ms"] * ((world - 1) / world) / ((from_world - 1) / from_world)
    return dict(world=world, compute_ms=compute, comm_ms=comm, low_ms=max(compute, comm), high_ms=compute + comm)


# ------------------------------------------------------------------------------- the measure command
#: ``--device cpu``: a smoke run of the whole command on a small layout (CPU timings mean nothing)
SMOKE_LAYOUT = dict(n_layer=4, width=32, vocab=256, heads=2, head_dim=16, hidden=128)
SMOKE_BYTES = (2 ** 16, 2 ** 18, 2 ** 20)


def measure(a: argparse.Namespace) -> int:
    import torch

    from . import cost_measure as M
    from anvil_fast.parallel.distributed import spawn

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("anvil_fast.studies.cost_model measure: needs a CUDA device (the pieces are GPU timings; --device cpu is a "
              "smoke run)", file=sys.stderr)
        return 2
    if a.n < 1:
        print(f"--n must be >= 1, got {a.n}", file=sys.stderr)
        return 2
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    worlds = _worlds(a.worlds)
    if cuda:
        lays = M.layouts()
    else:
        from anvil_fast.bench.optimizer import gpt2_small_layout

        lays = {name: gpt2_small_layout(**SMOKE_LAYOUT) for name in LAYOUTS}
    sweep = SWEEP_BYTES if cuda else SMOKE_BYTES
    n_devices = torch.cuda.device_count() if cuda else max(worlds)
    data = dict(format=FORMAT, generated_by=a.command_line, commit=source_commit(),
                device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, n=a.n, layouts={}, collectives={})
    t0 = time.time()
    names = a.layouts.split(",")
    for name in names:
        if name not in lays:
            print(f"unknown layout {name!r}; known: {', '.join(lays)}", file=sys.stderr)
            return 2
        for w in worlds:
            bad = [l for l, (shape, reshape, _, e) in lays[name].items()
                   if e["comms"] == "sharded" and (reshape or shape)[0] % w]
            if bad:
                print(f"{name}: {w} ranks cannot shard {bad} (first dimensions "
                      f"{[(lays[name][l][1] or lays[name][l][0])[0] for l in bad]})", file=sys.stderr)
                return 2
    coll_worlds = [w for w in worlds if 1 < w <= n_devices]
    bar = Progress(len(names) + bool(a.training) + len(coll_worlds), "cost_model measure")
    for name in names:
        bar.update(label=f"cost_model measure: layout {name}")
        data["layouts"][name] = M.measure_layout(name, lays[name], worlds, n=a.n,
                                               device=torch.device("cuda" if cuda else "cpu"))
        print(f"{name} measured at +{time.time() - t0:.0f} s", flush=True)
        bar.update(advance=1)
    if a.training:
        bar.update(label="cost_model measure: training step")
        from anvil_fast.models.banked_gpt import CPU_DEFAULTS, CUDA_DEFAULTS

        d = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
        # the layouts' world sizes need not suit the training step's model (the CPU smoke's tiny model
        # shards its banks over at most 2 ranks): it is measured where it can run, and the rest is named
        skipped = M.training_problems(worlds, **d)
        for w, why in skipped.items():
            print(f"  training step at {w} rank(s): not measured ({why})", flush=True)
        data["training"] = M.measure_training([w for w in worlds if w not in skipped], n=a.n,
                                              device=torch.device("cuda" if cuda else "cpu"), **d)
        data["training"]["skipped"] = {str(w): why for w, why in skipped.items()}
        print(f"training step measured at +{time.time() - t0:.0f} s", flush=True)
        bar.update(advance=1)
    for w in coll_worlds:
        bar.update(label=f"cost_model measure: collectives at {w} ranks")
        res = spawn(M.collective_rank, w, list(KINDS), list(sweep), a.n, a.device, backend="nccl" if cuda else "gloo",
                    threads=0 if cuda else 1)
        pts = {k: [max(r[k][i][1] for r in res) for i in range(len(sweep))] for k in KINDS}
        entry = {}
        for k in KINDS:
            entry[k] = dict(points=[[b, ms] for b, ms in zip(sweep, pts[k])], fit=None)
            try:
                entry[k]["fit"] = fit_alpha_beta(k, w, list(zip(sweep, pts[k]))).__dict__
            except ValueError as e:  # kept with its points: predict() then has no fit at this world size
                entry[k]["fit_error"] = str(e)
                print(f"  no fit: {e}", flush=True)
        data["collectives"][str(w)] = entry
        print(f"collectives at {w} ranks measured at +{time.time() - t0:.0f} s", flush=True)
        bar.update(advance=1)
    bar.close()
    save(data, a.out)
    print(f"wrote {a.out}")
    return 0


# ---------------------------------------------------------------------------------------- tables
def _pct(x: float) -> str:
    return "" if math.isnan(x) else f"{x:+.0%}"


def prediction_table(data: dict, worlds: list[int], *, fallback_fits: dict[str, AlphaBeta] | None = None) -> list[str]:
    """Per layout and world size, the predicted step; multi-rank rows need collective fits: the data's,
    or ``fallback_fits`` where it has none at that size (e.g. :func:`calibrated_fits` of a measured run)."""
    lines = ["| layout | ranks | compute ms | collectives alone ms | predicted step ms | hidden | host ms | "
             "measured step, comms skipped, 1 GPU ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in data["layouts"]:
        for w in worlds:
            if str(w) not in data["layouts"][name]["worlds"]:
                continue
            fits = fits_of(data, w) or (fallback_fits if w > 1 else None)
            if w > 1 and fits is None:
                continue
            p = predict(data, name, w, fits=fits)
            meas = data["layouts"][name]["worlds"][str(w)].get("step_nocomm_ms")
            hid = "" if math.isnan(p.hidden) else f"{p.hidden:.0%}"
            lines.append(f"| {name} | {w} | {p.compute_ms:.3f} | {p.comm_ms:.3f} | {p.step_ms:.3f} | {hid} | "
                         f"{p.host_ms:.3f} | {'' if meas is None else f'{meas:.3f}'} |")
    return lines


def training_table(data: dict, worlds: list[int], *, fallback_fits: dict[str, AlphaBeta] | None = None) -> list[str]:
    tr = data.get("training")
    if not tr:
        return []
    lines = [f"Training step: BankedGPT `{tr['size']}` in banks of {tr['group_layers']} layer(s), global batch "
             f"{tr['global_batch']} x {tr['seq']} tokens; gathers waited at the step's end.", "",
             "| ranks | per-rank batch | forward + backward ms | updates ms | collectives alone ms | predicted step ms | "
             "comms skipped ms | hidden | step / 1-rank step |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = None
    for w in worlds:
        fits = fits_of(data, w) or (fallback_fits if w > 1 else None)
        if str(w) not in tr["worlds"] or (w > 1 and fits is None):
            continue
        p = predict_training(data, w, fits=fits)
        base = p.step_ms if w == 1 else base
        hid = "" if math.isnan(p.hidden) else f"{p.hidden:.0%}"
        lines.append(f"| {w} | {tr['global_batch'] // w} | {p.fwd_ms + p.bwd_ms:.2f} | {p.opt.compute_ms:.2f} | "
                     f"{p.opt.comm_ms:.2f} | {p.step_ms:.2f} | {p.nocomm_ms:.2f} | {hid} | "
                     f"{'' if base is None else f'{p.step_ms / base:.2f}x'} |")
    return lines


def training_validation_table(data: dict, runs: list[dict]) -> list[str]:
    """Measured training steps against the model's (gathers waited at the step's end)."""
    tr = data.get("training") or {}
    lines = ["| run | ranks | predicted step ms | measured step ms (wait at end) | error | predicted comms skipped ms | "
             "measured ms | error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for w, m in sorted(run["rows"].items()):
            if str(w) not in tr.get("worlds", {}) or (w > 1 and fits_of(data, w) is None):
                continue
            if m["batch"] != tr["global_batch"] // w:
                raise ValueError(f"{run['path']}: {w} ranks ran a per-rank batch of {m['batch']}, the pieces' is "
                                 f"{tr['global_batch'] // w}")
            p = predict_training(data, w)
            lines.append(f"| {run['path']} | {w} | {p.step_ms:.2f} | {m['end_ms']:.2f} | {_pct(p.step_ms / m['end_ms'] - 1)} "
                         f"| {p.nocomm_ms:.2f} | {m['nocomm_ms']:.2f} | {_pct(p.nocomm_ms / m['nocomm_ms'] - 1)} |")
    return lines


def validation_table(data: dict, runs: list[dict]) -> list[str]:
    lines = ["| run | ranks | predicted step ms | measured step ms | error | predicted comms-skipped ms | "
             "measured ms | error | collectives |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in runs:
        for v in validate(data, run):
            p, m = v["predicted"], v["measured"]
            src = "calibrated on the run's collectives alone" if v["calibrated"] else "measured fits"
            lines.append(f"| {run['path']} | {v['world']} | {p.step_ms:.3f} | {m['step_ms']:.3f} | "
                         f"{_pct(v['step_error'])} | {p.compute_ms:.3f} | {m['nocomm_ms']:.3f} | "
                         f"{_pct(v['nocomm_error'])} | {src} |")
    return lines


def _worlds(text: str) -> list[int]:
    try:
        ws = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--worlds: expected comma-separated positive ints, got {text!r}") from None
    if not ws or min(ws) < 1:
        raise SystemExit(f"--worlds: expected comma-separated positive ints, got {text!r}")
    return ws


def predict_cmd(a: argparse.Namespace) -> int:
    data = load(a.data)
    worlds = _worlds(a.worlds)
    lines = [f"<!-- generated by `{a.command_line}` -->", "# Cost model of the optimizer step: predictions", "",
             f"Pieces: `{a.data}` ({data.get('device', '?')}, `{data.get('generated_by', '?')}`). Collectives: "
             + ("fits at " + ", ".join(sorted(data["collectives"], key=int)) + " ranks" if data.get("collectives")
                else "none measured (multi-rank rows need `--validate` calibration)") + ".", ""]
    lines += prediction_table(data, worlds)
    train = training_table(data, worlds)
    if train:
        lines += ["", "## Training step", "", *train]
    if a.validate:
        lines += ["", "## Against measured runs (2-rank step predicted from the run's 1-rank row)", ""]
        lines += validation_table(data, [read_scaling_run(p) for p in a.validate])
    if a.validate_train:
        lines += ["", "## Training step against measured runs", ""]
        lines += training_validation_table(data, [read_train_step_run(p) for p in a.validate_train])
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.cost_model", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure", help="time the pieces on this machine's GPU(s) and write the data file")
    m.add_argument("--out", required=True, help="the JSON data file to write")
    m.add_argument("--worlds", default=",".join(map(str, DEFAULT_WORLDS)),
                   help="world sizes whose per-rank pieces are timed (collectives: those the GPUs allow)")
    m.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layouts")
    m.add_argument("--n", type=int, default=20, help="timed repetitions per piece (median)")
    m.add_argument("--no-training", dest="training", action="store_false",
                   help="leave out the training step's pieces (anvil_fast.studies.train_step's model at its defaults)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of the command on a small layout and gloo ranks (timings meaningless)")
    p = sub.add_parser("predict", help="predict the step from a data file")
    p.add_argument("--data", required=True, help="a file written by `measure`")
    p.add_argument("--worlds", default=",".join(map(str, DEFAULT_WORLDS)))
    p.add_argument("--validate", nargs="*", default=[], help="`anvil_fast.studies.scaling gpu` runs' JSON records to check against")
    p.add_argument("--validate-train", nargs="*", default=[], help="`anvil_fast.studies.train_step` runs' JSON records to check against")
    p.add_argument("--out", default="", help="also write the tables (markdown) here")
    for s in (m, p):
        add_progress_flags(s)
    a = ap.parse_args(argv)
    a.command_line = "python -m anvil_fast.studies.cost_model " + " ".join(argv)
    try:
        with default_enabled(a.progress):
            return measure(a) if a.mode == "measure" else predict_cmd(a)
    except ValueError as e:
        print(f"anvil_fast.studies.cost_model: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
