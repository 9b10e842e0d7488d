"""The tuning protocol of the paper's training comparison, and its cost; torch-free, so that
``python -m papers.build`` reads the sweep back through the same rules that ran it.

The protocol (:class:`Protocol`; ``python -m papers.train --protocol`` runs it), the same for every
contender of ``tuned``: one model size, ``tune_steps`` steps, every seed of ``tune_seeds``, the same
learning-rate shape (linear warm-up over ``steps // WARMUP_DIVISOR``, linear decay to 0), gradient
clipping ``clip`` for all; three coordinates searched one after the other (:data:`KEYS`):

1. **lr**: the contender's main learning rate over ``lr_centers[c] * factor**k`` (``k`` in
   ``offsets``), the Adam side at ``adam_center`` and the weight decay at ``wd_centers[c]``;
2. **adam_lr**: the Adam side's rate over ``adam_center * factor**k`` at the best lr;
3. **weight_decay**: the matrices' weight decay over ``wd_centers[c] * factor**k`` at the best lr
   and adam_lr. Each centre is the contender's documented default (ANVIL's: the record's 2.25), a
   starting point the search may leave.

"Best" is the lowest mean final validation loss over the seeds; a seed that diverged or failed
counts as ``+inf``, ties go to the lower value. A best value at an end of its grid extends the
grid by one ``factor`` step past that end, once per end (:func:`search`); a best value still at
an end after that is reported as at the edge, never as tuned. Then the horizon: every contender of
``long`` trains ``steps`` steps on every seed of ``seeds`` at its chosen values; a contender of
``borrows`` (ANVIL's lean state and its ablations, each changing one thing) takes another's chosen
values instead of a sweep of its own. The tuning seeds and the final seeds are disjoint (the final
runs are held out from the choice), every run of the horizon counts (none is dropped; a diverged
one is +inf), and the paper compares contenders by paired intervals over the final seeds
(papers/stats.py).

**Equal time** (``equal_time``): given each contender's lone seconds per step (the
``--timing-only`` JSONs beside the runs), every contender of ``equal_time`` other than
``time_reference`` also trains :func:`equal_time_steps` steps, the number whose time at its own rate
fits the reference's time for ``steps`` steps, with its complete schedule over them (warm-up and
decay to 0 at that step count), on every final seed.

A run is identified by ``(contender, lr, adam_lr, weight_decay, steps, seed)`` within one protocol
(the size, batch, clip and everything else are the protocol's), so the runs of a stage are found
again in the JSONs of an earlier, cut command: :func:`required` lists what is still missing.

The cost model (:func:`estimate`) is documented there.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from anvil_ref.constants import ANVIL_DEFAULTS, RAIL_SCALED_REFERENCE_STEPS

ROOT = Path(__file__).resolve().parents[1]

#: Each tuned contender's main learning rate at the centre of its grid: AdamW's 1e-3 is the best
#: of a one-rate sweep of this model (2.5e-4 .. 8e-3); torch Muon's 0.02 is the Muon README's and
#: its own best here; dion's Muon 0.02 is dion's documented rate (README, configs/muon_160m.yaml);
#: NorMuon's 0.01 is dion.NorMuon's default; ANVIL's is the record's (anvil_ref.ANVIL_DEFAULTS).
LR_CENTERS: dict[str, float] = {"adamw": 1e-3, "muon": 0.02, "dion": 0.02, "normuon": 0.01,
                                "anvil": ANVIL_DEFAULTS["lr"]}
#: Each tuned contender's weight decay at the centre of its grid, its documented default: nanoGPT's
#: AdamW 0.1; 0.01 for torch Muon (the Muon README's), dion's Muon and NorMuon (their defaults);
#: ANVIL's sign-gated, lr^2-scaled 2.25 (the record's).
WD_CENTERS: dict[str, float] = {"adamw": 0.1, "muon": 0.01, "dion": 0.01, "normuon": 0.01,
                                "anvil": ANVIL_DEFAULTS["weight_decay"]}
#: The Adam side's starting learning rate, the same for every contender (torch Muon's AdamW side
#: ran at it; ANVIL's own default, 8e-3, is one factor step above, inside the grid).
ADAM_CENTER = 4e-3

KEYS = ("lr", "adam_lr", "weight_decay")
#: The tuning horizon: the length at which the rail schedule's two rules agree
#: (anvil_ref.constants RAIL_SCALED_REFERENCE_STEPS).
TUNE_STEPS = RAIL_SCALED_REFERENCE_STEPS
#: ANVIL's ablations: each takes ANVIL's tuned values and changes one thing (papers/contenders.py).
ABLATIONS = ("anvil_no_equalizer", "anvil_one_rail", "anvil_decoupled", "anvil_rails_scaled", "anvil_derived",
             "anvil_polar")
#: Every run warms up over ``steps // WARMUP_DIVISOR`` steps (at least 1), then decays linearly.
WARMUP_DIVISOR = 20


@dataclass(frozen=True)
class Protocol:
    size: str = "small"
    tune_steps: int = TUNE_STEPS
    tune_seeds: tuple[int, ...] = (100, 101)
    steps: int = 4000
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    batch: int = 32
    clip: float | None = 1.0
    factor: float = 2.0
    offsets: tuple[int, ...] = (-1, 0, 1)
    adam_center: float = ADAM_CENTER
    lr_centers: tuple[tuple[str, float], ...] = tuple(LR_CENTERS.items())
    wd_centers: tuple[tuple[str, float], ...] = tuple(WD_CENTERS.items())
    tuned: tuple[str, ...] = ("adamw", "muon", "dion", "normuon", "anvil")
    borrows: tuple[tuple[str, str], ...] = (("anvil_lean", "anvil"), *((a, "anvil") for a in ABLATIONS))
    long: tuple[str, ...] = ("adamw", "muon", "dion", "normuon", "anvil", "anvil_lean", *ABLATIONS)
    equal_time: tuple[str, ...] = ("adamw", "muon", "dion", "normuon", "anvil")
    time_reference: str = "anvil"

    def __post_init__(self):
        if self.factor <= 1 or not self.offsets or sorted(set(self.offsets)) != list(self.offsets):
            raise ValueError(f"protocol: factor must be > 1 and offsets strictly increasing, got "
                             f"{self.factor} and {self.offsets}")
        if not self.tune_seeds or not self.seeds:
            raise ValueError("protocol: tune_seeds and seeds must be non-empty")
        shared = sorted(set(self.tune_seeds) & set(self.seeds))
        if shared:
            raise ValueError(f"protocol: the final seeds must be held out from tuning; {shared} are in both")
        centers = {k: v for k, v in self.lr_centers if k in dict(self.wd_centers)}
        missing = [c for c in self.tuned if c not in centers]
        if missing:
            raise ValueError(f"protocol: no lr or weight-decay centre for {missing}")
        src = dict(self.borrows)
        bad = [c for c in self.long if c not in self.tuned and src.get(c) not in self.tuned]
        if bad:
            raise ValueError(f"protocol: {bad} in the horizon runs are neither tuned nor borrow from a tuned contender")

    def center(self, name: str) -> float:
        return dict(self.lr_centers)[name]

    def wd_center(self, name: str) -> float:
        return dict(self.wd_centers)[name]

    def source(self, name: str) -> str:
        """The contender whose chosen values ``name`` trains with (itself, or the one it borrows from)."""
        return dict(self.borrows).get(name, name)

    def core(self) -> dict:
        """What makes two commands' runs the same runs: everything but which contenders take part."""
        return {k: v for k, v in self.to_json().items() if k not in _LISTS}

    def to_json(self) -> dict:
        return {k: ([list(x) for x in v] if k in _PAIRS else (list(v) if isinstance(v, tuple) else v))
                for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: Mapping) -> Protocol:
        kw = {}
        for k, v in d.items():
            if k in _PAIRS:
                kw[k] = tuple((a, b) for a, b in v)
            elif isinstance(v, list):
                kw[k] = tuple(v)
            else:
                kw[k] = v
        return cls(**kw)

    def with_contenders(self, names: Sequence[str]) -> Protocol:
        """This protocol over ``names`` only (a borrowing contender needs its source among them)."""
        src = dict(self.borrows)
        tuned = tuple(n for n in names if n not in src)
        lacking = [n for n in names if n in src and src[n] not in names]
        if lacking:
            raise ValueError(f"{lacking} take the tuned values of {[src[n] for n in lacking]}, which must be "
                             f"among the contenders too")
        return Protocol(**{**asdict(self), "lr_centers": self.lr_centers, "wd_centers": self.wd_centers,
                           "borrows": self.borrows, "tuned": tuned, "long": tuple(names),
                           "equal_time": tuple(n for n in self.equal_time if n in names)})


_PAIRS = ("lr_centers", "wd_centers", "borrows")
#: The fields that say which contenders take part (not what makes two commands' runs the same runs).
_LISTS = ("tuned", "long", "borrows", "equal_time", "time_reference")


# ---------------------------------------------------------------------------------- one coordinate
@dataclass(frozen=True)
class Search:
    """One coordinate's search as far as the results go."""
    values: tuple[float, ...]          # the grid as it stands, ascending (extensions included)
    missing: tuple[float, ...]         # values not yet run on every seed
    means: dict[float, float]          # mean final loss of every value run on every seed
    best: float | None                 # None until the grid is complete
    edge: str | None                   # "low" / "high": the best is at that end after its extension
    extended: tuple[str, ...] = ()     # ends that were extended

    @property
    def inside(self) -> bool:
        return self.best is not None and self.edge is None


def mean(losses: Sequence[float]) -> float:
    """Mean over seeds; a non-finite seed (diverged, failed) makes it +inf."""
    return math.inf if any(not math.isfinite(v) for v in losses) else sum(losses) / len(losses)


def grid(center: float, factor: float, offsets: Sequence[int]) -> list[float]:
    """``center * factor**k`` for ``k`` in ``offsets`` (with factor 2 every value is exact)."""
    return [center * factor ** k for k in offsets]


def search(center: float, factor: float, offsets: Sequence[int],
           losses: Callable[[float], Sequence[float] | None]) -> Search:
    """Run the grid rule of the module docstring over ``losses(value)`` (the per-seed final
    losses of a value run on every seed, else None)."""
    values = sorted(grid(center, factor, offsets))
    extended: list[str] = []
    while True:
        have = {v: losses(v) for v in values}
        means = {v: mean(x) for v, x in have.items() if x is not None}
        missing = tuple(v for v in values if have[v] is None)
        if missing:
            return Search(tuple(values), missing, means, None, None, tuple(extended))
        best = min(values, key=lambda v: (means[v], v))
        end = "low" if best == values[0] else "high" if best == values[-1] else None
        if end is None:
            return Search(tuple(values), (), means, best, None, tuple(extended))
        if end in extended:
            return Search(tuple(values), (), means, best, end, tuple(extended))
        extended.append(end)
        values = [values[0] / factor, *values] if end == "low" else [*values, values[-1] * factor]


# ---------------------------------------------------------------------------------- whole protocol
@dataclass(frozen=True)
class Task:
    contender: str
    lr: float
    adam_lr: float
    weight_decay: float
    steps: int
    seed: int
    role: str              # "sweep", "tuned" or "equal_time"
    stage: str | None = None   # the coordinate of a sweep run (one of KEYS)

    @property
    def key(self) -> tuple:
        return (self.contender, self.lr, self.adam_lr, self.weight_decay, self.steps, self.seed)


Results = Mapping[tuple, float]   # Task.key -> final validation loss (inf: diverged or failed)


@dataclass(frozen=True)
class Tuning:
    contender: str
    searches: tuple[Search, ...]   # one per coordinate of KEYS reached so far

    @property
    def lr(self) -> Search:
        return self.searches[0]

    @property
    def adam_lr(self) -> Search | None:
        return self.searches[1] if len(self.searches) > 1 else None

    @property
    def weight_decay(self) -> Search | None:
        return self.searches[2] if len(self.searches) > 2 else None

    @property
    def chosen(self) -> tuple[float, float, float] | None:
        if len(self.searches) < len(KEYS) or self.searches[-1].best is None:
            return None
        return tuple(x.best for x in self.searches)


def tuning(p: Protocol, name: str, results: Results) -> Tuning:
    """Where contender ``name``'s searches stand, given the results (coordinates in KEYS order, each
    at the best values of the ones before it and the centres of the ones after)."""
    point = [p.center(name), p.adam_center, p.wd_center(name)]
    centers = list(point)
    out: list[Search] = []
    for i in range(len(KEYS)):
        def losses(v, i=i):
            x = list(point)
            x[i] = v
            got = [results.get((name, *x, p.tune_steps, s)) for s in p.tune_seeds]
            return None if any(r is None for r in got) else got

        s = search(centers[i], p.factor, p.offsets, losses)
        out.append(s)
        if s.best is None:
            break
        point[i] = s.best
    return Tuning(name, tuple(out))


def equal_time_steps(steps: int, step_s: float, reference_step_s: float, *, multiple: int = 1) -> int:
    """The step count whose time at ``step_s`` seconds per step fits the time of ``steps`` steps at
    ``reference_step_s``, rounded down to a multiple of ``multiple`` (at least one multiple)."""
    if step_s <= 0 or reference_step_s <= 0:
        raise ValueError(f"seconds per step must be > 0, got {step_s} and {reference_step_s}")
    n = math.floor(steps * reference_step_s / step_s + 1e-9)
    return max(multiple, n // multiple * multiple)


def chosen_values(p: Protocol, results: Results, *, absent: Sequence[str] = ()) -> dict[str, tuple]:
    """Per contender of ``long`` whose (source's) searches are done: its (lr, adam_lr, weight_decay)."""
    chosen = {}
    for name in p.tuned:
        if name not in absent:
            ch = tuning(p, name, results).chosen
            if ch is not None:
                chosen[name] = ch
    return {n: chosen[p.source(n)] for n in p.long if n not in absent and p.source(n) in chosen}


def required(p: Protocol, results: Results, *, absent: Sequence[str] = (),
             step_s: Mapping[str, float] | None = None, multiple: int = 1) -> list[Task]:
    """Every run the protocol needs now and the results lack, in priority order: the sweeps' runs
    first, taken in turn from each contender (so that the runs at once are spread over the
    contenders and every contender's sweep advances), then the horizon runs seed-major (every
    contender's seed 0, then seed 1, ...), so a command cut short loses the last seeds of the
    horizon, then the equal-time runs (when ``step_s``, lone seconds per step by contender, holds
    the reference and the contender; step counts a multiple of ``multiple``). Contenders in
    ``absent`` get no runs; a contender borrowing from an absent one neither."""
    sweeps: list[list[Task]] = []
    for name in p.tuned:
        if name in absent:
            continue
        t = tuning(p, name, results)
        if t.chosen is not None:
            continue
        stage = KEYS[len(t.searches) - 1]
        base = [p.center(name), p.adam_center, p.wd_center(name)]
        for i, s_ in enumerate(t.searches[:-1]):
            base[i] = s_.best
        mine = []
        for s in p.tune_seeds:
            for v in t.searches[-1].missing:
                x = list(base)
                x[len(t.searches) - 1] = v
                if (name, *x, p.tune_steps, s) not in results:
                    mine.append(Task(name, *x, p.tune_steps, s, "sweep", stage))
        sweeps.append(mine)
    out = [x for row in itertools.zip_longest(*sweeps) for x in row if x is not None]
    chosen = chosen_values(p, results, absent=absent)
    for s in p.seeds:
        for name in p.long:
            if name in chosen and (name, *chosen[name], p.steps, s) not in results:
                out.append(Task(name, *chosen[name], p.steps, s, "tuned"))
    step_s = step_s or {}
    ref = step_s.get(p.time_reference)
    if ref is not None:
        for s in p.seeds:
            for name in p.equal_time:
                if name == p.time_reference or name not in chosen or name not in step_s:
                    continue
                n = equal_time_steps(p.steps, step_s[name], ref, multiple=multiple)
                if n != p.steps and (name, *chosen[name], n, s) not in results:
                    out.append(Task(name, *chosen[name], n, s, "equal_time"))
    return out


# ---------------------------------------------------------------------------------- from the records
def _core(d: Mapping) -> dict:
    return {k: v for k, v in d.items() if k not in _LISTS}


def _final(r: Mapping) -> float:
    v = r["final_val_loss"]
    return v if isinstance(v, (int, float)) and math.isfinite(v) and not r.get("diverged") else math.inf


def results_of(p: Protocol, records: Sequence[Mapping]) -> dict[tuple, float]:
    """Task key -> final loss (inf: diverged) of the protocol's runs among run records (the JSONs
    of papers.train); a run belongs to the protocol when its stored protocol agrees with ``p`` on
    everything but the contender lists."""
    core = p.core()
    out = {}
    for r in records:
        if r.get("role") not in ("sweep", "tuned", "equal_time") or _core(r.get("protocol") or {}) != core:
            continue
        hp = r["hparams"]
        out[(r["contender"], *(hp[k] for k in KEYS), r["steps"], r["seed"])] = _final(r)
    return out


def step_seconds(records: Sequence[Mapping], *, size: str) -> dict[str, float]:
    """Median lone seconds per step by contender of the ``--timing-only`` records of ``size``."""
    by: dict[str, list[float]] = {}
    for r in records:
        if r.get("role") == "timing" and r.get("size") == size and r.get("timing"):
            by.setdefault(r["contender"], []).append(r["timing"]["step_s"])
    return {k: sorted(v)[len(v) // 2] for k, v in by.items()}


def of_records(records: Sequence[Mapping]) -> Protocol | None:
    """The protocol of the sweep records, its contender lists those the records hold; None
    without sweep records; ValueError if they come from different protocols."""
    sweeps = [r for r in records if r.get("role") == "sweep"]
    cores = {repr(sorted(_core(r["protocol"]).items())) for r in sweeps}
    if len(cores) > 1:
        raise ValueError(f"sweep records of {len(cores)} different protocols; keep one protocol's records in the folder")
    if not sweeps:
        return None
    p = Protocol.from_json(sweeps[0]["protocol"])
    tuned = tuple(dict.fromkeys(r["contender"] for r in sweeps))
    src = dict(p.borrows)
    long = tuple(dict.fromkeys(r["contender"] for r in records if r.get("role") == "tuned"
                               and _core(r.get("protocol") or {}) == p.core()
                               and (r["contender"] in tuned or src.get(r["contender"]) in tuned)))
    return Protocol(**{**p.__dict__, "tuned": tuned, "long": long,
                       "equal_time": tuple(n for n in p.equal_time if n in long)})


def chosen_of(records: Sequence[Mapping]) -> dict[str, tuple[float, float, float]]:
    """Per contender, the (lr, adam_lr, weight_decay) the records' protocol chose (a borrowing
    contender: its source's); contenders whose searches are unfinished are left out."""
    p = of_records(records)
    if p is None:
        return {}
    res = results_of(p, records)
    out = {}
    for name in p.tuned:
        ch = tuning(p, name, res).chosen
        if ch is not None:
            out[name] = ch
    for name, src in p.borrows:
        if src in out:
            out[name] = out[src]
    return out


def planned(p: Protocol, *, step_s: Mapping[str, float] | None = None) -> list[Task]:
    """The runs of the protocol when no grid extends (its least number of runs) and every search
    chooses its centre, in order; the equal-time runs where ``step_s`` gives the rates."""
    out = []
    for name in p.tuned:
        c = [p.center(name), p.adam_center, p.wd_center(name)]
        for i, k in enumerate(KEYS):
            for v in grid(c[i], p.factor, p.offsets):
                if i and v == c[i]:
                    continue   # the centre was run by the coordinate before
                x = list(c)
                x[i] = v
                out += [Task(name, *x, p.tune_steps, s, "sweep", k) for s in p.tune_seeds]

    def vals(n):
        src = p.source(n)
        return p.center(src), p.adam_center, p.wd_center(src)

    for s in p.seeds:
        out += [Task(n, *vals(n), p.steps, s, "tuned") for n in p.long]
    if step_s and p.time_reference in step_s:
        for s in p.seeds:
            out += [Task(n, *vals(n), equal_time_steps(p.steps, step_s[n], step_s[p.time_reference]), s,
                         "equal_time") for n in p.equal_time if n != p.time_reference and n in step_s]
    return out


# ---------------------------------------------------------------------------------- the cost model
#: The H200 logs the cost model reads, each written by the command in the command.txt beside it:
#: the training runs of a size (results/train/logs/train_<size>.log, runs one at a time) and the
#: drop-in benchmark (the optimizer's step alone, at both sizes).
def train_log_of(size: str) -> Path:
    return ROOT / "results" / "train" / "logs" / f"train_{size}.log"


BENCH_LOG = ROOT / "results" / "h200_dropin" / "call5" / "bench_dropin.log"
#: Contenders the logs lack, costed as the one named (dion's Muon: one stacked Polar Express per
#: matrix shape through torch.compile, like ANVIL's banks, not torch Muon's loop over matrices).
COST_LIKE = {"dion": "anvil", "normuon": "anvil", "anvil_lean": "anvil",
             **{a: "anvil" for a in ABLATIONS}}
#: GPU work of the small GPT's forward + backward per step, in ms: its matmul FLOPs (6 x
#: parameters in matmuls x tokens, plus the attention's 12 x layers x ctx x width x tokens) at
#: MATMUL_EFFICIENCY of the bf16 matmul peak measured in BENCH_LOG, plus the element-wise traffic
#: (about 30 bf16 activation tensors of tokens x width read or written per layer) at the measured
#: copy bandwidth. MATMUL_EFFICIENCY is an assumption (matmuls of width 384 run well below the
#: peak of 8192^3), and the least certain number here.
MATMUL_EFFICIENCY = 0.4
ACTIVATION_TENSORS = 30
#: The GPU part of torch Muon's step, in ms: its host loop issues about 24 matrices x 5 iterations
#: x 3 matmuls of small, latency-bound kernels (~5 us each) plus their element-wise work; the
#: host-bound step it sits in is measured (BENCH_LOG: 12.8 ms), its device share is not.
MUON_DEVICE_MS = 2.5


def read_logs(train_log: Path | None = None, bench_log: Path = BENCH_LOG, *, size: str = "small") -> dict:
    """Lone-run wall seconds per 1000 steps of each contender (median over its runs, from the
    training log of ``size``; compile included in the first), the H200's bf16 peak and copy
    bandwidth, and the optimizer's step in ms at ``size`` (bench log)."""
    train_log = train_log or train_log_of(size)
    walls: dict[str, list[float]] = {}
    steps = None
    for line in train_log.read_text().splitlines():
        m = re.match(r"model: \S+ .*; steps (\d+),", line)
        if m:
            steps = int(m.group(1))
        m = re.match(r"\[\d+/\d+\] \S+ (\S+) seed \d+: .*\((\d+(?:\.\d+)?) s, ", line)
        if m:
            walls.setdefault(m.group(1), []).append(float(m.group(2)))
    if not walls or steps is None:
        raise ValueError(f"{train_log}: no run lines to read")
    text = bench_log.read_text()
    peak = float(re.search(r"bf16 8192\^3 matmul (\d+(?:\.\d+)?) TFLOP/s", text).group(1))
    copy = float(re.search(r"copy (\d+(?:\.\d+)?) GB/s", text).group(1))
    opt = {k: float(v) for k, v in re.findall(rf"^\s+{size} (\w+): (\d+(?:\.\d+)?) ms", text, re.M)}
    return {"wall_per_1000": {k: sorted(v)[len(v) // 2] * 1000 / steps for k, v in walls.items()},
            "tflops": peak, "copy_gbs": copy, "opt_ms": opt}


def forward_backward_ms(*, n_layer: int, n_embd: int, ctx: int, vocab: int, batch: int, tflops: float,
                        copy_gbs: float) -> float:
    """The model's forward + backward GPU time per step, in ms (the estimate of :data:`MATMUL_EFFICIENCY`)."""
    tokens = batch * ctx
    matmul_params = n_layer * 12 * n_embd ** 2 + n_embd * vocab
    flops = 6 * matmul_params * tokens + 12 * n_layer * ctx * n_embd * tokens
    traffic = ACTIVATION_TENSORS * n_layer * tokens * n_embd * 2
    return flops / (tflops * 1e12 * MATMUL_EFFICIENCY) * 1e3 + traffic / (copy_gbs * 1e9) * 1e3


def estimate(p: Protocol, tasks: Sequence[Task], *, jobs: int, model: dict, logs: dict | None = None) -> dict:
    """Wall seconds of ``tasks`` run ``jobs`` at a time on one GPU: the larger of the host-bound
    bound (the runs' lone wall times, read from the H200 training log and scaled by their step
    counts, divided over ``jobs`` processes) and the device-bound one (every step's GPU work:
    :func:`forward_backward_ms` plus the optimizer's device time, the bench log's step for AdamW
    and ANVIL, :data:`MUON_DEVICE_MS` for torch Muon), each step's evaluation share added
    (``evals`` forward passes of a quarter of a step each). ``model``: the GPT's config fields."""
    logs = logs or read_logs(size=p.size)
    fb = forward_backward_ms(batch=p.batch, tflops=logs["tflops"], copy_gbs=logs["copy_gbs"], **model)
    opt_dev = {"adamw": logs["opt_ms"].get("adamw", 0.2), "anvil": logs["opt_ms"].get("anvil", 0.9),
               "muon": MUON_DEVICE_MS}
    host = device = 0.0
    per: dict[str, float] = {}
    for t in tasks:
        like = COST_LIKE.get(t.contender, t.contender)
        wall = logs["wall_per_1000"][like] * t.steps / 1000
        dev = t.steps * (fb + opt_dev[like]) / 1e3 * 1.03   # evaluations: ~3% more forward work
        host += wall
        device += dev
        per[t.contender] = per.get(t.contender, 0.0) + dev
    return {"runs": len(tasks), "steps": sum(t.steps for t in tasks), "host_s": host, "host_per_job_s": host / jobs,
            "device_s": device, "wall_s": max(host / jobs, device), "forward_backward_ms": fb,
            "device_by_contender_s": per, "jobs": jobs}
