"""Training evidence: ``python -m papers.train`` trains the package's GPT (anvil_fast.models.gpt) on the
CPython standard library's source (papers/corpus.py) with each contender (papers/contenders.py) and
writes one JSON per run; ``python -m papers.build`` turns those into the paper's training section.

What every run of a comparison shares: the corpus and its split (hash printed and stored), the
model's initialization (``anvil_fast.models.gpt.build(size, seed=seed)``), the batches (step ``s`` draws
its windows from a generator seeded with ``(data_seed, s)``; ``data_seed`` defaults to the run's
seed), the fixed validation windows, the learning-rate shape (linear warm-up over ``--warmup``
steps, default ``steps // 20``, then linear decay to zero at ``--steps``, applied by a
``LambdaLR`` on every optimizer) and gradient clipping (``--clip``: the global norm of every
gradient clipped to it before every optimizer step, ``torch.nn.utils.clip_grad_norm_``; 0 turns it
off). On CUDA the forward and backward run under bf16 autocast with fp32 parameters, TF32 allowed;
the model is not compiled. Two runs with the same seed therefore start from the same weights and
see the same batches: the statistics pair them (papers/stats.py).

Three kinds of command:

* runs at given learning rates (the default): ``--contenders`` x ``--seeds``, each contender at its
  default rates (papers/contenders.py), at ``--lr NAME=VALUE`` / ``--adam-lr NAME=VALUE``, or at
  the rates a tuning protocol chose (``--tuned-from DIR``: the sweep JSONs there);
* ``--protocol``: the tuning protocol of papers/protocol.py (two learning rates and the weight decay
  swept alike for every contender, then the horizon runs at the chosen values); ``--estimate`` prints its runs and
  their estimated GPU time instead of running them;
* ``--timing-only``: each contender's time per step and optimizer share on a lone device (no
  training): ``--timing-warmup`` untimed and ``--timing-steps`` timed steps, synchronized around
  the forward/backward, the clipping, the optimizer step and ``zero_grad``, medians kept;
  ``--timing-repeats N`` times every contender N times, interleaved.

``--jobs N`` runs N runs at once, each in its own process on the one device (papers/runner.py); a
run's result does not depend on N (every run sets ``--threads`` CPU threads and seeds itself), its
timings do: a run records ``jobs`` and ``timing_comparable``, and the paper takes times per step
from lone runs only. ``--time-budget-s``: no run starts unless the time spent since the process
started plus its estimated duration (the median seconds per step of its contender's finished runs
in this command, times its steps; a contender not run yet takes the rate of the one it borrows its
learning rates from or is costed like, papers/protocol.py ``COST_LIKE``, else ``UNSEEN_FACTOR``
times the slowest median) fits; at the budget every run still going is stopped; every finished
run's JSON is already written.
``--skip-existing [DIR]``: runs whose JSON exists in ``--out`` (or in DIR) are not run again (a
run is identified by its contender, hyper-parameters, seeds, steps and setup: ``run_id``), so a
second command continues where a cut one stopped.

Examples::

    python -m papers.train --size tiny --steps 200 --batch 16 --out /tmp/train   # CPU, seconds per run
    python -m papers.train --protocol --estimate --jobs 8                         # the protocol's cost
    python -m papers.train --protocol --jobs 8 --out results/train/protocol --skip-existing --time-budget-s 440
    python -m papers.train --timing-only --contenders adamw muon dion normuon anvil anvil_lean \\
        --tuned-from results/train/protocol --out results/train/protocol/timing

tools/h200_session.sh runs the paper's training (stage ``train``) on one H200.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # before torch's import: --time-budget-s counts the whole process

import argparse
import hashlib
import json
import math
import os
import platform
import signal
import statistics
import sys
from pathlib import Path

import torch

from anvil_fast.models import gpt
from anvil_ref.cli_args import check_device, positive_int
from anvil_ref.provenance import source_commit
from papers import contenders as K
from papers import corpus as C
from papers import protocol as P
from papers import runner as R

FORMAT = 2
#: --time-budget-s: a contender with no finished run yet (and none it resembles) is expected to take
#: this many times the slowest contender's seconds per step (torch's Muon steps several times slower
#: than fused AdamW).
UNSEEN_FACTOR = 3.0
ROOT = Path(__file__).resolve().parents[1]


def lr_shape(step: int, *, steps: int, warmup: int) -> float:
    """The learning-rate multiplier of step ``step`` (0-based): linear warm-up to 1 over ``warmup``
    steps, then linear decay reaching 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / (steps - warmup))


def default_warmup(steps: int) -> int:
    return max(1, steps // P.WARMUP_DIVISOR)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _amp(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _loss(model, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = tokens.long()
    with _amp(device):
        return model(t[:, :-1], t[:, 1:])


@torch.no_grad()
def evaluate(model, val: torch.Tensor, *, batch: int, device: torch.device) -> float:
    """Mean cross-entropy (nats per byte) over the validation windows."""
    total = 0.0
    for i in range(0, val.shape[0], batch):
        chunk = val[i:i + batch]
        total += float(_loss(model, chunk, device)) * chunk.shape[0]
    return total / val.shape[0]


class Clip:
    """Clips the global gradient norm to ``max_norm`` (None: off) and keeps, on the device (no
    synchronization), the sum of the norms and the number of clipped steps since the last read."""

    def __init__(self, params, max_norm: float | None, device: torch.device):
        self.params = [p for p in params if p.requires_grad]
        self.max_norm = max_norm
        self.sum = torch.zeros((), device=device)
        self.clipped = torch.zeros((), device=device)
        self.n = 0

    def __call__(self) -> None:
        if self.max_norm is None:
            return
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.sum += norm
        self.clipped += norm > self.max_norm
        self.n += 1

    def read(self) -> dict:
        if self.max_norm is None or self.n == 0:
            return {}
        out = {"grad_norm_mean": float(self.sum) / self.n, "clipped_frac": float(self.clipped) / self.n}
        self.sum.zero_()
        self.clipped.zero_()
        self.n = 0
        return out


def _step(model, opts, tokens, device, clip: Clip) -> None:
    _loss(model, tokens, device).backward()
    clip()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad(set_to_none=True)


#: The parts of a timed training step, each synchronized at both ends (``time_steps``'s ``parts_s``):
#: the optimizer's share (``opt_s``) is the last three together.
TIMING_PARTS = ("forward_backward", "clip", "step", "zero_grad")


def time_steps(contender: K.Contender, *, size: str, seed: int, steps: int, batches: torch.Tensor,
               device: torch.device, warmup: int, timed: int, clip: float | None = None) -> dict | None:
    """Median seconds of one training step, of its optimizer part (gradient clipping, the optimizers'
    ``step`` and ``zero_grad``) and of each of ``TIMING_PARTS``, on a separate instance. The device is
    synchronized around every part, so a part's time is its host time or its device time, whichever
    ends later (one synchronization's latency included)."""
    if timed <= 0:
        return None
    model = gpt.build(size, seed=seed, device=device)
    # a run-length schedule (record rails) must cover the window, which may be longer than a short run
    opts = contender.make(model, total_steps=max(steps, warmup + timed), device=device)
    clipper = Clip(model.parameters(), clip, device)
    total, opt_t = [], []
    parts: dict[str, list[float]] = {k: [] for k in TIMING_PARTS}
    for i in range(warmup + timed):
        tokens = batches[i % batches.shape[0]]
        _sync(device)
        t0 = time.perf_counter()
        _loss(model, tokens, device).backward()
        _sync(device)
        t1 = time.perf_counter()
        clipper()
        _sync(device)
        t2 = time.perf_counter()
        for o in opts:
            o.step()
        _sync(device)
        t3 = time.perf_counter()
        for o in opts:
            o.zero_grad(set_to_none=True)
        _sync(device)
        t4 = time.perf_counter()
        if i >= warmup:
            total.append(t4 - t0)
            opt_t.append(t4 - t1)
            for k, v in zip(TIMING_PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[k].append(v)
    del model, opts
    step_s, opt_s = statistics.median(total), statistics.median(opt_t)
    return {"step_s": step_s, "opt_s": opt_s, "opt_share": opt_s / step_s, "warmup_steps": warmup,
            "timed_steps": timed, "parts_s": {k: statistics.median(v) for k, v in parts.items()}}


def _groups(opts) -> list[dict]:
    out = []
    for o in opts:
        for g in o.param_groups:
            d = {"optimizer": type(o).__name__, "n_params": len(g["params"])}
            for k in ("group", "kind", "algorithm", "lr", "initial_lr", "weight_decay"):
                if k in g:
                    d[k] = K.jsonable(g[k]) if not isinstance(g[k], torch.Tensor) else float(g[k])
            out.append(d)
    return out


def train_run(contender: K.Contender, *, size: str, seed: int, data_seed: int, steps: int, batch: int,
              warmup: int, eval_every: int, corpus: C.Corpus, val: torch.Tensor, device: torch.device,
              clip: float | None = None, timing_warmup: int = 5, timing_steps: int = 20) -> dict:
    """One run; returns its record (everything but the corpus and environment, added by the caller)."""
    cfg = gpt.SIZES[size]
    cpu_batches = C.train_batches(corpus.train, steps=steps, batch=batch, ctx=cfg.ctx, data_seed=data_seed)
    batches = cpu_batches.to(device)
    val_d = val.to(device)
    timing = time_steps(contender, size=size, seed=seed, steps=steps, batches=batches, device=device,
                        warmup=timing_warmup, timed=timing_steps, clip=clip)

    model = gpt.build(size, seed=seed, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    opts = contender.make(model, total_steps=steps, device=device)
    for o in opts:  # a float base rate: the schedule then writes floats (or fills a tensor rate) each step
        for g in o.param_groups:
            g.setdefault("initial_lr", float(g["lr"]))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_shape(s, steps=steps, warmup=warmup)) for o in opts]
    groups = _groups(opts)
    clipper = Clip(model.parameters(), clip, device)

    curve = [{"step": 0, "tokens": 0, "val_loss": evaluate(model, val_d, batch=batch, device=device),
              "train_time_s": 0.0}]
    train_time, diverged = 0.0, False
    _sync(device)
    t_seg = time.perf_counter()
    for s in range(steps):
        _step(model, opts, batches[s], device, clipper)
        for sc in scheds:
            sc.step()
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            _sync(device)
            train_time += time.perf_counter() - t_seg
            loss = evaluate(model, val_d, batch=batch, device=device)
            curve.append({"step": s + 1, "tokens": (s + 1) * batch * cfg.ctx, "val_loss": loss,
                          "train_time_s": train_time, **clipper.read()})
            if not math.isfinite(loss):
                diverged = True
                break
            _sync(device)
            t_seg = time.perf_counter()
    guard = guard_record(opts)
    del model, opts, scheds
    return {
        "contender": contender.name, "description": contender.description,
        "hparams": K.jsonable(contender.hparams), "hparams_text": K.hparams_text(contender),
        "pinned": K.jsonable(contender.pinned), "optimizer_groups": groups, "seed": seed, "data_seed": data_seed, "size": size,
        "model": {**cfg.__dict__, "n_params": n_params},
        "steps": steps, "batch": batch, "ctx": cfg.ctx, "tokens_per_step": batch * cfg.ctx,
        "tokens_seen": steps * batch * cfg.ctx, "train_tokens": int(corpus.train.numel()),
        "epochs": steps * batch * cfg.ctx / int(corpus.train.numel()),
        "warmup_steps": warmup, "lr_schedule": "linear warm-up, then linear decay to 0 (papers.train.lr_shape)",
        "clip": clip, "eval_every": eval_every, "val_windows": int(val.shape[0]),
        "batches_sha256": C.batches_sha256(cpu_batches),
        "curve": curve, "final_val_loss": curve[-1]["val_loss"], "diverged": diverged,
        "train_time_s": train_time, "timing": timing, "guard": guard,
    }


def guard_record(opts) -> dict | None:
    """What ANVIL ran and refused during a run: each bank's configuration (``bank_configs``: the
    drop-in's dispatch on this device, or the contender's pin), the matrix updates per bank whose
    cascade output came out non-finite or exploded (``refused_updates``) and the steps skipped for
    non-finite gradients; None for a contender without ANVIL."""
    for o in opts:
        if getattr(type(o), "refused_updates", None) is not None:
            return {"bank_configs": {label: bank.config.name for label, bank in o.inner.banks.items()},
                    "refused_updates": o.refused_updates, "skipped_steps": int(o.skipped_steps)}
    return None


def environment(device: torch.device) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
            "autocast": "bf16" if device.type == "cuda" else "none (fp32)"}


# ------------------------------------------------------------------------------- one run (a spec)
def run_id(spec: dict) -> str:
    """A run's identity: its contender, hyper-parameters, seeds, steps and setup (never the
    number of jobs, the device or the time)."""
    keys = ("contender", "hparams", "seed", "data_seed", "size", "steps", "batch", "warmup", "eval_every",
            "val_windows", "clip", "role", "timing_steps")
    if spec.get("repeat") is not None:  # a repeated lone timing (--timing-repeats); absent elsewhere, so no other id moves
        keys += ("repeat",)
    blob = json.dumps({k: spec.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_spec(c: K.Contender, *, seed: int, steps: int, a, role: str, stage: str | None = None,
              warmup: int | None = None, repeat: int | None = None) -> dict:
    spec = {"contender": c.name, "hparams": K.jsonable(c.hparams), "seed": seed,
            "data_seed": a.data_seed if a.data_seed is not None else seed, "size": a.size, "steps": steps,
            "batch": a.batch, "warmup": warmup if warmup is not None else default_warmup(steps),
            "eval_every": a.eval_every, "val_windows": a.val_windows, "clip": a.clip, "role": role,
            "stage": stage, "timing_steps": a.timing_steps if role in ("fixed", "timing") else 0,
            "timing_warmup": a.timing_warmup}
    if repeat is not None:
        spec["repeat"] = repeat
    spec["id"] = run_id(spec)
    short = {"lr": "lr", "adam_lr": "adamlr", "weight_decay": "wd"}
    protocol_role = role in ("sweep", "tuned", "equal_time")
    lrs = "".join(f"-{short[k]}{c.hparams[k]:g}" for k in P.KEYS if protocol_role and k in c.hparams)
    tail = ("timing" + (f"-r{repeat}" if repeat is not None else "")) if role == "timing" else (f"{steps}steps-seed{seed}" if protocol_role else f"seed{seed}")
    spec["name"] = f"{a.size}-{c.name}{lrs}-{tail}"
    return spec


def contender_of(spec: dict) -> K.Contender:
    c = K.get(spec["contender"])
    return c.with_hparams(spec["hparams"])


def _worker_init(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return {"device": device, "corpus": C.load(), "val": {}, "env": environment(device), "jobs": cfg["jobs"],
            "threads": cfg["threads"]}


def execute(state: dict, spec: dict) -> dict:
    """Run one spec (a worker's target; also the in-process path) and return its record."""
    t0 = time.perf_counter()
    device, corpus = state["device"], state["corpus"]
    size = spec["size"]
    cfg = gpt.SIZES[size]
    c = contender_of(spec)
    if spec["role"] == "timing":
        batches = C.train_batches(corpus.train, steps=spec["timing_warmup"] + spec["timing_steps"], batch=spec["batch"],
                                  ctx=cfg.ctx, data_seed=spec["data_seed"]).to(device)
        timing = time_steps(c, size=size, seed=spec["seed"], steps=spec["steps"], batches=batches, device=device,
                            warmup=spec["timing_warmup"], timed=spec["timing_steps"], clip=spec["clip"])
        rec = {"contender": c.name, "description": c.description, "hparams": K.jsonable(c.hparams),
               "hparams_text": K.hparams_text(c), "seed": spec["seed"], "size": size, "batch": spec["batch"],
               "ctx": cfg.ctx, "clip": spec["clip"], "steps": spec["steps"], "timing": timing}
        if spec.get("repeat") is not None:
            rec["repeat"] = spec["repeat"]
    else:
        key = (size, spec["val_windows"])
        if key not in state["val"]:
            state["val"][key] = C.val_windows(corpus.val, n=spec["val_windows"], ctx=cfg.ctx)
        rec = train_run(c, size=size, seed=spec["seed"], data_seed=spec["data_seed"], steps=spec["steps"],
                        batch=spec["batch"], warmup=spec["warmup"], eval_every=spec["eval_every"], corpus=corpus,
                        val=state["val"][key], device=device, clip=spec["clip"],
                        timing_warmup=spec["timing_warmup"], timing_steps=spec["timing_steps"])
    rec.update({"format": FORMAT, "role": spec["role"], "stage": spec.get("stage"), "run_id": spec["id"],
                "corpus": corpus.describe(), "environment": state["env"], "jobs": state["jobs"],
                "threads": state["threads"], "timing_comparable": state["jobs"] == 1,
                "run_wall_s": time.perf_counter() - t0})
    return rec


# ------------------------------------------------------------------------------------- records
def load_records(folder: Path) -> list[dict]:
    """Every run JSON of this format under ``folder`` (any depth)."""
    out = []
    if not Path(folder).is_dir():
        return out
    for p in sorted(Path(folder).rglob("*.json")):
        try:
            r = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and r.get("format") == FORMAT and "contender" in r:
            out.append(r)
    return out


def absent_record(name: str, reason: str, a, *, role: str) -> dict:
    return {"format": FORMAT, "role": "absent", "for_role": role, "contender": name, "reason": reason,
            "size": a.size, "description": K.get(name).description}


# ------------------------------------------------------------------------------------------ CLI
def preflight(cs: list[K.Contender]) -> dict[str, str]:
    """Build every contender once on the tiny model (CPU), so a contender this checkout cannot
    build is known before the first run; returns {name: why unavailable} of those that cannot."""
    out, seen = {}, set()
    for c in cs:
        if c.name in seen or c.name in out:
            continue
        seen.add(c.name)
        why = c.why_unavailable()
        if why is None:
            try:
                c.make(gpt.build("tiny"), total_steps=2, device=torch.device("cpu"))
            except K.Unavailable as exc:
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 (one contender that cannot be built must not stop the others)
                why = f"building it on the tiny model failed: {type(exc).__name__}: {exc}"
        if why is not None:
            out[c.name] = why
    return out


def _parse_rates(items: list[str], flag: str) -> dict[str, float]:
    """``NAME=VALUE`` pairs (a known contender, a positive finite rate); ValueError says which is wrong."""
    out = {}
    for it in items:
        name, sep, val = it.partition("=")
        if not sep:
            raise ValueError(f"{flag} takes NAME=VALUE, got {it!r}")
        K.get(name)
        try:
            lr = float(val)
        except ValueError:
            lr = float("nan")
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"{flag} {it!r}: expected a positive number after '='")
        out[name] = lr
    return out


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def build_protocol(a) -> P.Protocol:
    base = P.Protocol()
    over = {"size": a.size or base.size, "batch": a.batch or base.batch, "clip": a.clip}
    if a.steps_given:
        over["steps"] = a.steps
    if a.seeds_given:
        over["seeds"] = tuple(a.seeds)
    if a.tune_steps is not None:
        over["tune_steps"] = a.tune_steps
    if a.tune_seeds is not None:
        over["tune_seeds"] = tuple(a.tune_seeds)
    p = P.Protocol(**{**base.__dict__, **over})
    return p.with_contenders(a.contenders) if a.contenders_given else p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m papers.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, choices=list(gpt.SIZES), help="default: small")
    ap.add_argument("--contenders", nargs="+", default=None, choices=list(K.REGISTRY),
                    help=f"default: {' '.join(K.DEFAULT_CONTENDERS)} (--protocol: the protocol's)")
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2")
    ap.add_argument("--data-seed", type=int, default=None, help="batch-order seed for every run (default: the run's seed)")
    ap.add_argument("--steps", type=positive_int, default=None, help="default: 1000 (--protocol: its horizon, 4000)")
    ap.add_argument("--batch", type=positive_int, default=None, help="default: 32")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 20, at least 1)")
    ap.add_argument("--eval-every", type=positive_int, default=50,
                    help="steps between evaluations; steps to a target are interpolated between them")
    ap.add_argument("--val-windows", type=positive_int, default=128, help="fixed validation windows of ctx + 1 bytes")
    ap.add_argument("--clip", type=_nonneg_float, default=1.0, help="clip the global gradient norm to this (0: off)")
    ap.add_argument("--lr", nargs="+", default=[], metavar="NAME=VALUE", help="a contender's main learning rate")
    ap.add_argument("--adam-lr", nargs="+", default=[], metavar="NAME=VALUE", help="a contender's Adam-side learning rate")
    ap.add_argument("--tuned-from", type=Path, default=None, help="take the learning rates a protocol chose (sweep JSONs here)")
    ap.add_argument("--protocol", action="store_true", help="run the tuning protocol (papers/protocol.py)")
    ap.add_argument("--tune-steps", type=positive_int, default=None, help="--protocol: steps of a sweep run (default 1000)")
    ap.add_argument("--tune-seeds", nargs="+", type=int, default=None, help="--protocol: seeds of a sweep value (default 0 1)")
    ap.add_argument("--estimate", action="store_true", help="--protocol: print the runs and their GPU-time estimate, run nothing")
    ap.add_argument("--timing-only", action="store_true", help="time each contender's step alone, train nothing")
    ap.add_argument("--timing-warmup", type=int, default=5)
    ap.add_argument("--timing-steps", type=int, default=20, help="timed steps per run (0: no timing; --protocol: 0)")
    ap.add_argument("--timing-repeats", type=positive_int, default=1,
                    help="--timing-only: time every contender this many times, interleaved (JSONs ...-timing-r<i>)")
    ap.add_argument("--jobs", type=positive_int, default=1, help="runs at once, each in its own process")
    ap.add_argument("--threads", type=positive_int, default=1, help="CPU threads of every run (results depend on it on the CPU)")
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--skip-existing", nargs="?", type=Path, const=True, default=None, metavar="DIR",
                    help="skip runs whose JSON exists in --out (or in DIR: runs kept from an earlier command)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--out", type=Path, default=None, help="where the run JSONs go (required unless --estimate)")
    a = ap.parse_args(argv)
    a.seeds_given, a.steps_given, a.contenders_given = a.seeds is not None, a.steps is not None, a.contenders is not None
    if a.protocol and a.timing_only:
        ap.error("--protocol and --timing-only are different commands; give one")
    if a.estimate and not a.protocol:
        ap.error("--estimate needs --protocol")
    if a.out is None and not a.estimate:
        ap.error("--out is required")
    a.size = a.size or "small"
    a.batch = a.batch or 32
    a.clip = a.clip or None
    a.seeds = a.seeds if a.seeds is not None else [0, 1, 2]
    if a.timing_repeats > 1 and not a.timing_only:
        ap.error("--timing-repeats needs --timing-only")
    if a.timing_warmup < 0 or a.timing_steps < 0:
        ap.error(f"--timing-warmup and --timing-steps must be >= 0, got {a.timing_warmup} and {a.timing_steps}")
    try:
        lrs, adam_lrs = _parse_rates(a.lr, "--lr"), _parse_rates(a.adam_lr, "--adam-lr")
    except ValueError as exc:
        ap.error(str(exc))
    proto = None
    if a.protocol:
        if a.lr or a.adam_lr or a.tuned_from or a.warmup is not None:
            ap.error("--protocol chooses the learning rates and warm-up itself: drop --lr, --adam-lr, --tuned-from, --warmup")
        try:
            proto = build_protocol(a)
        except ValueError as exc:
            ap.error(str(exc))
        a.contenders = list(proto.long)
        a.timing_steps = 0
    else:
        a.steps = a.steps or 1000
        a.contenders = a.contenders or list(K.DEFAULT_CONTENDERS)
        warmup = a.warmup if a.warmup is not None else default_warmup(a.steps)
        if not 1 <= warmup < a.steps:
            ap.error(f"--warmup must be in [1, steps), got {warmup} with --steps {a.steps}")
        a.warmup = warmup
    tuned = {}
    if a.tuned_from is not None:
        try:
            tuned = P.chosen_of(load_records(a.tuned_from))
        except ValueError as exc:
            ap.error(f"--tuned-from {a.tuned_from}: {exc}")
        if not tuned:
            ap.error(f"--tuned-from {a.tuned_from}: no protocol sweep JSON there chose a learning rate")

    if a.estimate:
        try:
            return print_estimate(proto, a)
        except (OSError, ValueError) as exc:
            ap.error(f"--estimate reads the H200 logs of size {proto.size}: {exc}")
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(ap, a.device)
    device = torch.device(a.device)
    if a.jobs > 1 and device.type == "cuda" and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # the compile workers of N processes share the host's cores (the kernels compiled are the same)
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // a.jobs))
    corpus = C.load()
    cfg = gpt.SIZES[a.size]
    d = corpus.describe()
    print(f"corpus: {d['root']}: {d['files']} files ({d['train_files']} train, {d['val_files']} validation), "
          f"{d['train_bytes']:,} + {d['val_bytes']:,} bytes; file list sha256 {d['sha256']}")
    print(f"split: {d['rule']}; unigram entropy of the train split {C.unigram_entropy(corpus.train):.4f} nats/byte")
    print(f"model: {a.size} {cfg}; batch {a.batch} x {cfg.ctx}, clip {a.clip}, eval every {a.eval_every} on "
          f"{a.val_windows} windows; {a.device}, torch {torch.__version__}; {a.jobs} job(s) of {a.threads} thread(s)")
    if proto is not None:
        print(f"protocol: {json.dumps(proto.to_json())}")

    def contender(name: str) -> K.Contender:
        c = K.get(name)
        lr, adam, wd = tuned.get(name, (None, None, None))
        return c.with_lrs(lrs.get(name, lr), adam_lrs.get(name, adam), wd)

    absent = preflight([K.get(n) for n in a.contenders])
    for n, why in absent.items():
        print(f"contender {n}: absent: {why}")
    for n in a.contenders:
        if n not in absent:
            c = contender(n)
            pins = "".join(f"; pinned {k}={v}" for k, v in c.pinned.items())
            print(f"contender {n}: {c.description}; {K.hparams_text(c)}{pins}")

    a.out.mkdir(parents=True, exist_ok=True)
    kept_dir = None if a.skip_existing is None else (a.out if a.skip_existing is True else a.skip_existing)
    records = load_records(a.out) + (load_records(kept_dir) if kept_dir not in (None, a.out) else [])
    by_id = {r["run_id"]: r for r in records if "run_id" in r} if kept_dir is not None else {}
    role = "timing" if a.timing_only else "tuned" if proto else "fixed"
    for n in a.contenders:
        stale = a.out / f"{a.size}-{n}-absent.json"
        if n in absent:
            stale.write_text(json.dumps(absent_record(n, absent[n], a, role=role), indent=1) + "\n")
        elif stale.is_file():
            stale.unlink()
    broken: dict[str, str] = {}
    commit = source_commit()
    done_recs: list[dict] = list(by_id.values())

    step_s = P.step_seconds(records, size=a.size) if proto is not None else {}
    if step_s:
        print("lone seconds per step (--timing-only JSONs, for the equal-time runs): "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(step_s.items())))
    if proto is not None:
        def ready() -> list[dict]:
            res = P.results_of(proto, done_recs)
            out = []
            for t in P.required(proto, res, absent=[*absent, *broken], step_s=step_s, multiple=a.eval_every):
                c = K.get(t.contender).with_lrs(t.lr, t.adam_lr, t.weight_decay)
                s = make_spec(c, seed=t.seed, steps=t.steps, a=a, role=t.role, stage=t.stage)
                s["protocol"] = proto.to_json()
                out.append(s)
            return out
    else:
        if a.timing_only:
            # repeats interleave the contenders (every contender once, then again), so a drift of the
            # device over the command falls on all of them alike
            reps = [None] if a.timing_repeats == 1 else list(range(1, a.timing_repeats + 1))
            plan = [make_spec(contender(n), seed=a.seeds[0], steps=a.steps, a=a, role="timing", repeat=r)
                    for r in reps for n in a.contenders if n not in absent]
        else:
            plan = [make_spec(contender(n), seed=s, steps=a.steps, a=a, role="fixed", warmup=a.warmup)
                    for s in a.seeds for n in a.contenders if n not in absent]

        def ready() -> list[dict]:
            have = {r.get("run_id") for r in done_recs}
            return [s for s in plan if s["id"] not in have and s["contender"] not in broken]

    skipped = [r for r in done_recs if r.get("run_id")]
    if skipped:
        print(f"{len(skipped)} run(s) exist in {kept_dir}: not run again")
    pending = ready()
    print(f"{len(pending)} run(s) ready to start" + (" (more follow as the sweeps decide)" if proto else ""), flush=True)

    per_step: dict[str, list[float]] = {}
    # a contender not run yet is costed as the one it borrows its rates from or resembles
    like = {**P.COST_LIKE, **(dict(proto.borrows) if proto else {})}

    def estimate(spec: dict) -> float:
        name = spec["contender"]
        rates = per_step.get(name) or per_step.get(like.get(name, ""))
        if rates:
            rate = statistics.median(rates)
        else:
            rate = UNSEEN_FACTOR * max((statistics.median(r) for r in per_step.values()), default=0.0)
        return rate * (spec["steps"] + spec.get("timing_steps", 0))

    counter = [0]

    def on_done(spec: dict, rec: dict) -> None:
        counter[0] += 1
        rec["command"] = "python -m papers.train " + " ".join(argv)
        rec["commit"] = commit
        if "protocol" in spec:
            rec["protocol"] = spec["protocol"]
        path = a.out / f"{spec['name']}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        tmp.replace(path)
        done_recs.append(rec)
        steps = spec["steps"] + spec.get("timing_steps", 0)
        per_step.setdefault(spec["contender"], []).append(rec["run_wall_s"] / max(steps, 1))
        spent = time.perf_counter() - T_START
        if spec["role"] == "timing":
            tm = rec["timing"]
            print(f"[{counter[0]}] {spec['name']}: {tm['step_s'] * 1e3:.2f} ms/step, optimizer {tm['opt_share']:.0%} "
                  f"({rec['run_wall_s']:.1f} s; {spent:.0f} s since start) -> {path}", flush=True)
            return
        tm = rec.get("timing")
        tm_s = f", {tm['step_s'] * 1e3:.1f} ms/step, optimizer {tm['opt_share']:.0%}" if tm else ""
        print(f"[{counter[0]}] {spec['name']}: val loss {rec['curve'][0]['val_loss']:.4f} -> "
              f"{rec['final_val_loss']:.4f}{' DIVERGED' if rec['diverged'] else ''} "
              f"({rec['run_wall_s']:.1f} s{tm_s}; {spent:.0f} s since start) -> {path}", flush=True)

    def on_failed(spec: dict, err: str) -> None:
        last = err.strip().splitlines()[-1] if err.strip() else "?"
        print(f"FAILED {spec['name']}:\n{err}", flush=True)
        if spec["contender"] not in broken:
            broken[spec["contender"]] = f"its run {spec['name']} failed on {a.device}: {last}"
            (a.out / f"{a.size}-{spec['contender']}-absent.json").write_text(json.dumps(
                absent_record(spec["contender"], broken[spec["contender"]], a, role=role), indent=1) + "\n")

    deadline = None if a.time_budget_s is None else T_START + a.time_budget_s
    jobs = 1 if a.timing_only else a.jobs
    init_arg = {"device": a.device, "threads": a.threads, "jobs": jobs}
    old_threads = torch.get_num_threads()
    old_term = signal.getsignal(signal.SIGTERM)
    if jobs > 1:  # a SIGTERM (the stage's timeout) unwinds through run_all, which stops the workers
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        out = R.run_all(ready, jobs=jobs, execute=execute, init=_worker_init, init_arg=init_arg, on_done=on_done,
                        on_failed=on_failed, estimate=estimate, deadline=deadline)
    finally:
        torch.set_num_threads(old_threads)
        if jobs > 1:
            signal.signal(signal.SIGTERM, old_term)
    if proto is not None:
        res = P.results_of(proto, done_recs)
        for name in proto.tuned:
            if name in absent or name in broken:
                continue
            t = P.tuning(proto, name, res)
            for key, s in zip(P.KEYS, t.searches):
                tried = ", ".join(f"{v:g}: {s.means[v]:.4f}" if v in s.means else f"{v:g}: -" for v in s.values)
                state = ("not finished" if s.best is None else
                         f"best {s.best:g}, " + ("inside the grid" if s.inside else f"AT THE {s.edge.upper()} EDGE of the extended grid"))
                print(f"sweep {name} {key}: {state} ({tried})")
    if broken:
        print("failed contenders: " + "; ".join(f"{n}: {w}" for n, w in broken.items()))
    if out.not_started or out.stopped:
        print(f"time budget: {len(out.not_started)} run(s) not started, {len(out.stopped)} stopped")
    if proto is not None and ready():
        print(f"protocol unfinished: {len(ready())} run(s) still needed now (run the command again with --skip-existing)")
    print(f"total {time.perf_counter() - T_START:.0f} s")
    return 0


def print_estimate(p: P.Protocol, a) -> int:
    cfg = gpt.SIZES[p.size]
    model = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "ctx": cfg.ctx, "vocab": cfg.vocab}
    logs = P.read_logs(size=p.size)
    # the equal-time step counts from the logs' lone wall rates (the runs take them from --timing-only)
    rate = {n: logs["wall_per_1000"][P.COST_LIKE.get(n, n)] for n in p.equal_time}
    tasks = P.planned(p, step_s=rate)
    e = P.estimate(p, tasks, jobs=a.jobs, model=model, logs=logs)
    train_bytes = int(C.load().train.numel())
    print(f"protocol: {json.dumps(p.to_json())}")
    by_role = {r: [t for t in tasks if t.role == r] for r in ("sweep", "tuned", "equal_time")}
    print(f"runs without grid extensions: {len(by_role['sweep'])} sweep runs of {p.tune_steps} steps (seeds "
          f"{list(p.tune_seeds)}), {len(by_role['tuned'])} horizon runs of {p.steps} steps (held-out seeds "
          f"{list(p.seeds)}; {len(p.long)} contenders, ablations included), {len(by_role['equal_time'])} equal-time "
          f"runs; {e['steps']:,} steps in all")
    print("equal-time step counts (from the logs' lone rates; the runs use --timing-only's): "
          + ", ".join(f"{n} {P.equal_time_steps(p.steps, rate[n], rate[p.time_reference])}"
                      for n in p.equal_time if n != p.time_reference))
    for steps in (p.tune_steps, p.steps):
        tok = steps * p.batch * cfg.ctx
        print(f"{steps} steps: {tok:,} tokens seen, {tok / train_bytes:.2f} epochs of the {train_bytes:,}-byte train split")
    print(f"each grid extension adds {len(p.tune_seeds)} runs of {p.tune_steps} steps")
    print(f"forward + backward on the GPU: {e['forward_backward_ms']:.2f} ms per step "
          f"(matmul efficiency {P.MATMUL_EFFICIENCY:g} of the measured peak)")
    print("device time by contender: " + ", ".join(f"{k} {v:.0f} s" for k, v in e["device_by_contender_s"].items()))
    for r, ts in by_role.items():
        if ts:
            er = P.estimate(p, ts, jobs=a.jobs, model=model, logs=logs)
            print(f"  {r}: {len(ts)} runs, estimate {er['wall_s'] / 60:.1f} min of wall time at {a.jobs} jobs")
    print(f"host-bound: {e['host_s']:.0f} s of lone runs / {a.jobs} jobs = {e['host_per_job_s']:.0f} s; "
          f"device-bound: {e['device_s']:.0f} s; estimate {e['wall_s']:.0f} s of wall time "
          f"({e['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
