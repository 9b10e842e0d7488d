"""Training evidence: ``python -m papers.train`` trains the package's GPT (anvil_fast.gpt) on the
CPython standard library's source (papers/corpus.py) with each contender (papers/contenders.py) and
writes one JSON per run; ``python -m papers.build`` turns those into the paper's training section.

What every run of a comparison shares: the corpus and its split (hash printed and stored), the
model's initialization (``anvil_fast.gpt.build(size, seed=seed)``), the batches (step ``s`` draws
its windows from a generator seeded with ``(data_seed, s)``; ``data_seed`` defaults to the run's
seed), the fixed validation windows, and the learning-rate shape: linear warm-up over ``--warmup``
steps, then linear decay to zero at ``--steps``, applied by a ``LambdaLR`` on every optimizer. On
CUDA the forward and backward run under bf16 autocast with fp32 parameters, TF32 allowed; the model
is not compiled (compile time would dominate runs this short).

Timing: before each run a separate instance (same model, same contender) takes
``--timing-warmup`` untimed and ``--timing-steps`` timed steps, synchronizing around the
forward/backward and around the optimizer step; the medians are the run's time per step and the
optimizer's share. The training itself never synchronizes except at evaluations.

Runs are ordered seed-major (every contender of seed 0, then of seed 1, ...), so a command cut by
``--time-budget-s`` loses its last seeds, not one contender's runs (``--time-budget-s``: (no new run starts when the time spent since the process started plus the
longest finished run of that contender, or ``UNSEEN_FACTOR`` times the longest finished run of any
contender, would pass the budget); every finished run's JSON is already written,
and ``--skip-existing DIR`` resumes where a cut command stopped.

Examples::

    python -m papers.train --size tiny --steps 200 --batch 16 --out /tmp/train   # CPU, seconds per run
    python -m papers.train --size small --sweep adamw muon --out results/train/small/sweep
    python -m papers.train --size small --seeds 0 1 2 --tuned-from results/train/small/sweep \\
        --out results/train/small --time-budget-s 500

``--sweep NAME ...`` runs each named contender at every learning rate of its sweep (adamw:
``ADAMW_SWEEP``, muon: ``MUON_SWEEP`` in papers/contenders.py; first seed only unless ``--seeds``
is given) and prints the best (lowest mean final validation loss). ``--tuned-from DIR`` takes that
best learning rate from the sweep JSONs under DIR; ``--lr NAME=VALUE`` sets one by hand.
tools/h200_session.sh runs the paper's stages (sweep, small, medium) on one H200; results/train/logs holds their commands and logs.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # before torch's import: --time-budget-s counts the whole process

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from anvil_fast import gpt
from anvil_ref.cli_args import check_device, positive_int
from papers import contenders as K
from papers import corpus as C

FORMAT = 1
#: --time-budget-s: a contender with no finished run yet is expected to take this many times the
#: longest finished run (torch's Muon steps several times slower than fused AdamW on a GPU).
UNSEEN_FACTOR = 3.0


def lr_shape(step: int, *, steps: int, warmup: int) -> float:
    """The learning-rate multiplier of step ``step`` (0-based): linear warm-up to 1 over ``warmup``
    steps, then linear decay reaching 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / (steps - warmup))


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


def _step(model, opts, tokens, device) -> None:
    _loss(model, tokens, device).backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad(set_to_none=True)


def time_steps(contender: K.Contender, *, size: str, seed: int, steps: int, batches: torch.Tensor,
               device: torch.device, warmup: int, timed: int) -> dict | None:
    """Median seconds of one training step and of its optimizer part, on a separate instance."""
    if timed <= 0:
        return None
    model = gpt.build(size, seed=seed, device=device)
    # a run-length schedule (record rails) must cover the window, which may be longer than a short run
    opts = contender.make(model, total_steps=max(steps, warmup + timed), device=device)
    total, opt_t = [], []
    for i in range(warmup + timed):
        tokens = batches[i % batches.shape[0]]
        _sync(device)
        t0 = time.perf_counter()
        _loss(model, tokens, device).backward()
        _sync(device)
        t1 = time.perf_counter()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            total.append(t2 - t0)
            opt_t.append(t2 - t1)
    del model, opts
    step_s, opt_s = statistics.median(total), statistics.median(opt_t)
    return {"step_s": step_s, "opt_s": opt_s, "opt_share": opt_s / step_s, "warmup_steps": warmup,
            "timed_steps": timed}


def train_run(contender: K.Contender, *, size: str, seed: int, data_seed: int, steps: int, batch: int,
              warmup: int, eval_every: int, corpus: C.Corpus, val: torch.Tensor, device: torch.device,
              timing_warmup: int = 5, timing_steps: int = 20) -> dict:
    """One run; returns its record (everything but the corpus and environment, added by the caller)."""
    cfg = gpt.SIZES[size]
    cpu_batches = C.train_batches(corpus.train, steps=steps, batch=batch, ctx=cfg.ctx, data_seed=data_seed)
    batches = cpu_batches.to(device)
    val_d = val.to(device)
    timing = time_steps(contender, size=size, seed=seed, steps=steps, batches=batches, device=device,
                        warmup=timing_warmup, timed=timing_steps)

    model = gpt.build(size, seed=seed, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    opts = contender.make(model, total_steps=steps, device=device)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_shape(s, steps=steps, warmup=warmup)) for o in opts]
    groups = [{"optimizer": type(o).__name__, **{k: g[k] for k in ("lr", "kind") if k in g},
               "initial_lr": g.get("initial_lr"), "n_params": len(g["params"])} for o in opts for g in o.param_groups]

    curve = [{"step": 0, "tokens": 0, "val_loss": evaluate(model, val_d, batch=batch, device=device),
              "train_time_s": 0.0}]
    train_time, diverged = 0.0, False
    _sync(device)
    t_seg = time.perf_counter()
    for s in range(steps):
        _step(model, opts, batches[s], device)
        for sc in scheds:
            sc.step()
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            _sync(device)
            train_time += time.perf_counter() - t_seg
            loss = evaluate(model, val_d, batch=batch, device=device)
            curve.append({"step": s + 1, "tokens": (s + 1) * batch * cfg.ctx, "val_loss": loss,
                          "train_time_s": train_time})
            if not math.isfinite(loss):
                diverged = True
                break
            _sync(device)
            t_seg = time.perf_counter()
    del model, opts, scheds
    return {
        "contender": contender.name, "description": contender.description,
        "hparams": K.jsonable(contender.hparams), "hparams_text": K.hparams_text(contender),
        "optimizer_groups": groups, "seed": seed, "data_seed": data_seed, "size": size,
        "model": {**cfg.__dict__, "n_params": n_params},
        "steps": steps, "batch": batch, "ctx": cfg.ctx, "tokens_per_step": batch * cfg.ctx,
        "warmup_steps": warmup, "lr_schedule": "linear warm-up, then linear decay to 0 (papers.train.lr_shape)",
        "eval_every": eval_every, "val_windows": int(val.shape[0]),
        "batches_sha256": C.batches_sha256(cpu_batches),
        "curve": curve, "final_val_loss": curve[-1]["val_loss"], "diverged": diverged,
        "train_time_s": train_time, "timing": timing,
    }


def environment(device: torch.device) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
            "autocast": "bf16" if device.type == "cuda" else "none (fp32)"}


# ------------------------------------------------------------------------------------------ CLI
def preflight(cs: list[K.Contender]) -> None:
    """Build every contender once on the tiny model (CPU), so a contender this checkout cannot build
    fails before the first run rather than in the middle of a timed command."""
    seen = set()
    for c in cs:
        key = (c.name, K.hparams_text(c))
        if key not in seen:
            seen.add(key)
            c.make(gpt.build("tiny"), total_steps=2, device=torch.device("cpu"))


def sweep_best(records: list[dict]) -> dict[str, float]:
    """For each contender of sweep records, the lr with the lowest mean final validation loss."""
    by: dict[str, dict[float, list[float]]] = {}
    for r in records:
        loss = r["final_val_loss"]
        by.setdefault(r["contender"], {}).setdefault(float(r["hparams"]["lr"]), []).append(
            loss if math.isfinite(loss) else math.inf)
    return {name: min(lrs, key=lambda lr: (sum(lrs[lr]) / len(lrs[lr]), lr)) for name, lrs in by.items()}


def load_records(folder: Path, *, size: str | None = None, sweep: bool | None = None) -> list[dict]:
    out = []
    for p in sorted(Path(folder).rglob("*.json")):
        r = json.loads(p.read_text())
        if r.get("format") != FORMAT or "contender" not in r:
            continue
        if (size is None or r["size"] == size) and (sweep is None or bool(r.get("sweep")) == sweep):
            out.append(r)
    return out


def _plan(a) -> list[tuple[int, K.Contender, bool]]:
    """(seed, contender, is_sweep) in run order: seed-major."""
    if a.sweep:
        seeds = a.seeds if a.seeds_given else a.seeds[:1]
        return [(s, K.get(n).with_lr(lr), True) for s in seeds for n in a.sweep for lr in K.get(n).sweep]
    tuned = dict(a.tuned)
    return [(s, K.get(n).with_lr(tuned[n]) if n in tuned else K.get(n), False) for s in a.seeds for n in a.contenders]


def _parse_lr(items: list[str]) -> dict[str, float]:
    """``NAME=VALUE`` pairs (a known contender, a positive finite rate); ValueError says which is wrong."""
    out = {}
    for it in items:
        name, sep, val = it.partition("=")
        if not sep:
            raise ValueError(f"--lr takes NAME=VALUE, got {it!r}")
        K.get(name)
        try:
            lr = float(val)
        except ValueError:
            lr = float("nan")
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"--lr {it!r}: expected a positive number after '='")
        out[name] = lr
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m papers.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=list(gpt.SIZES))
    ap.add_argument("--contenders", nargs="+", default=list(K.DEFAULT_CONTENDERS), choices=list(K.REGISTRY))
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (a sweep: 0)")
    ap.add_argument("--data-seed", type=int, default=None, help="batch-order seed for every run (default: the run's seed)")
    ap.add_argument("--steps", type=positive_int, default=1000)
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 20, at least 1)")
    ap.add_argument("--eval-every", type=positive_int, default=50,
                    help="steps between evaluations; steps to a target are interpolated between them")
    ap.add_argument("--val-windows", type=positive_int, default=128, help="fixed validation windows of ctx + 1 bytes")
    ap.add_argument("--sweep", nargs="+", default=None, choices=[n for n, c in K.REGISTRY.items() if c.sweep])
    ap.add_argument("--lr", nargs="+", default=[], metavar="NAME=VALUE")
    ap.add_argument("--tuned-from", type=Path, default=None, help="take swept contenders' best lr from sweep JSONs here")
    ap.add_argument("--tuned-size", default=None, choices=list(gpt.SIZES),
                    help="the size whose sweep --tuned-from reads (default: --size)")
    ap.add_argument("--timing-warmup", type=int, default=5)
    ap.add_argument("--timing-steps", type=int, default=20, help="timed steps per run (0: no timing)")
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--skip-existing", nargs="?", type=Path, const=True, default=None, metavar="DIR",
                    help="skip runs whose JSON exists in --out (or in DIR: runs kept from an earlier command)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.seeds_given = a.seeds is not None
    a.seeds = a.seeds if a.seeds is not None else [0, 1, 2]
    warmup = a.warmup if a.warmup is not None else max(1, a.steps // 20)
    if not 1 <= warmup < a.steps:
        ap.error(f"--warmup must be in [1, steps), got {warmup} with --steps {a.steps}")
    if a.timing_warmup < 0 or a.timing_steps < 0:
        ap.error(f"--timing-warmup and --timing-steps must be >= 0, got {a.timing_warmup} and {a.timing_steps}")
    try:
        lrs = _parse_lr(a.lr)
    except ValueError as exc:
        ap.error(str(exc))
    tuned = {}
    if a.tuned_from is not None:
        tsize = a.tuned_size or a.size
        sw = load_records(a.tuned_from, size=tsize, sweep=True)
        if not sw:
            ap.error(f"--tuned-from {a.tuned_from}: no sweep JSON of size {tsize} there")
        tuned = sweep_best(sw)
    a.tuned = {**tuned, **lrs}

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(ap, a.device)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    corpus = C.load()
    cfg = gpt.SIZES[a.size]
    val = C.val_windows(corpus.val, n=a.val_windows, ctx=cfg.ctx)
    env = environment(device)
    d = corpus.describe()
    print(f"corpus: {d['root']}: {d['files']} files ({d['train_files']} train, {d['val_files']} validation), "
          f"{d['train_bytes']:,} + {d['val_bytes']:,} bytes; file list sha256 {d['sha256']}")
    print(f"split: {d['rule']}; unigram entropy of the train split {C.unigram_entropy(corpus.train):.4f} nats/byte")
    print(f"model: {a.size} {cfg}; steps {a.steps}, batch {a.batch} x {cfg.ctx}, warm-up {warmup}, "
          f"eval every {a.eval_every} on {a.val_windows} windows; {env['device']}, torch {env['torch']}")
    plan = _plan(a)
    names = sorted({c.name for _, c, _ in plan})
    for n in names:
        c = next(c for _, c, _ in plan if c.name == n)
        lrs = sorted({c2.hparams.get('lr') for _, c2, _ in plan if c2.name == n and 'lr' in c2.hparams})
        print(f"contender {n}: {c.description}; {K.hparams_text(c)}" + (f"; lr in {lrs}" if a.sweep else ""))

    preflight([c for _, c, _ in plan])
    a.out.mkdir(parents=True, exist_ok=True)
    longest: dict[str, float] = {}
    done, skipped = [], []
    for i, (seed, c, is_sweep) in enumerate(plan, 1):
        tag = f"-lr{c.hparams['lr']:g}" if is_sweep else ""
        path = a.out / f"{a.size}-{c.name}{tag}-seed{seed}.json"
        kept = (a.out if a.skip_existing is True else a.skip_existing or a.out) / path.name
        if a.skip_existing is not None and kept.is_file():
            print(f"[{i}/{len(plan)}] {kept} exists: skipped")
            done.append(json.loads(kept.read_text()))
            continue
        if a.time_budget_s is not None:
            spent = time.perf_counter() - T_START
            # a contender not yet run here may be several times slower than those that were (and
            # its first run carries its warm-up), hence the factor
            est = longest.get(c.name, UNSEEN_FACTOR * max(longest.values(), default=0.0))
            if spent + est > a.time_budget_s:
                skipped.append(path.name)
                print(f"[{i}/{len(plan)}] not started: {spent:.0f} s spent + ~{est:.0f} s > budget {a.time_budget_s:.0f} s")
                continue
        t0 = time.perf_counter()
        ds = a.data_seed if a.data_seed is not None else seed
        rec = train_run(c, size=a.size, seed=seed, data_seed=ds, steps=a.steps, batch=a.batch, warmup=warmup,
                        eval_every=a.eval_every, corpus=corpus, val=val, device=device,
                        timing_warmup=a.timing_warmup, timing_steps=a.timing_steps)
        wall = time.perf_counter() - t0
        longest[c.name] = max(longest.get(c.name, 0.0), wall)
        rec.update({"format": FORMAT, "sweep": is_sweep, "corpus": d, "environment": env, "run_wall_s": wall,
                    "command": "python -m papers.train " + " ".join(argv)})
        path.write_text(json.dumps(rec, indent=1) + "\n")
        done.append(rec)
        tm = rec["timing"]
        tm_s = f", {tm['step_s'] * 1e3:.1f} ms/step, optimizer {tm['opt_share']:.0%}" if tm else ""
        print(f"[{i}/{len(plan)}] {a.size} {c.name} seed {seed}{' lr ' + format(c.hparams['lr'], 'g') if is_sweep else ''}: "
              f"val loss {rec['curve'][0]['val_loss']:.4f} -> "
              f"{rec['final_val_loss']:.4f}{' DIVERGED' if rec['diverged'] else ''} "
              f"({wall:.1f} s{tm_s}; {time.perf_counter() - T_START:.0f} s since start) -> {path}", flush=True)
    if a.sweep:
        sw = [r for r in done if r.get("sweep")]
        for n, lr in sorted(sweep_best(sw).items()):
            print(f"best lr {n}: {lr:g} (" + ", ".join(
                f"{r['hparams']['lr']:g}: {r['final_val_loss']:.4f}" for r in sw if r["contender"] == n) + ")")
    if skipped:
        print(f"time budget: {len(skipped)} run(s) not started: {' '.join(skipped)}")
    print(f"total {time.perf_counter() - T_START:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
