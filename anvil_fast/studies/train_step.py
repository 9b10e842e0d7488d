"""A training step on several ranks with the communication hidden behind the backward pass.

``python -m anvil_fast.studies.train_step --device cuda --worlds 1,2``: forward + backward + :class:`~anvil_fast.optim.optimizer.AnvilAndAdam` step of a GPT whose
hidden matrices live in banks (:class:`~anvil_fast.models.banked_gpt.BankedGPT`, a size of
:mod:`anvil_fast.models.gpt`; GPT-2 small by default), on one process per rank
(:func:`anvil_fast.parallel.distributed.spawn`: NCCL on CUDA, gloo on CPU), at the same *global* batch at
every world size (per-rank batch = global / world). The schedule is
:class:`~anvil_fast.optim.overlap.OverlappedStep`'s (:mod:`anvil_fast.optim.overlap`: each reduce-scatter
launched from the backward pass, the gathers waited in a forward pre-hook or at the step's end).

The arithmetic is the non-overlapped schedule's (:func:`~anvil_fast.optim.overlap.sequential_step`): the
same collectives on the same gradients, the same updates; only their launch times differ. The
benchmark checks it bit for bit on the same gradients (:func:`paired_check`).

Per world size the table reports (per step in steady state, slowest rank): the overlapped step
(both waits), the non-overlapped step, the step with communication skipped
(:class:`~anvil_fast.parallel.comms.NullComms`: the same shards and kernels, nothing moved), the collectives
alone (:func:`~anvil_fast.optim.overlap.comm_only`: the same reduce-scatters, all-reduce and all-gathers,
in order, no compute), and ``hidden = (t_nocomm + t_comm - t_step) / t_comm``. ``--out T.md`` also
writes the timings as JSON beside it (``T.json``, :mod:`anvil_fast.studies.study_runs`), which the cost
model reads.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.progress import Progress, default_enabled

from anvil_fast.models.banked_gpt import CPU_DEFAULTS, CUDA_DEFAULTS, WORK_ORDERS, BankedGPT, batch, check_batch
from anvil_fast.bench.common import emit_table
from anvil_fast.models.gpt import SIZES, GPTConfig
from anvil_fast.optim.overlap import WAIT_MODES, OverlappedStep, comm_only, make_optimizer, sequential_step
from .study_runs import TRAIN_STEP, write_record
from anvil_fast.kernels.timing import median_ms

#: Seconds a rank may wait in a collective (the first step compiles the bank updates).
GPU_TIMEOUT_S = 900.0
CPU_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------------------- training
def train(model: BankedGPT, opt, *, mode: str, steps: int, global_batch: int, seq: int, world: int, rank: int,
          first_step: int = 0, adam_every: int = 1, fixed_data: bool = False) -> Callable[[int], None]:
    """``steps`` training steps in ``mode`` (``sequential`` or a :data:`WAIT_MODES` entry); Adam on
    steps where ``t % adam_every == adam_every - 1``. Returns the one-step function ``one(t)``;
    ``fixed_data``: every step reads step 0's batch (for timing: no batch drawn and copied inside a
    timed step)."""
    dev = next(model.parameters()).device
    driver = None if mode == "sequential" else OverlappedStep(opt, model, wait=mode)
    data = {}

    def one(t: int) -> None:
        key = 0 if fixed_data else t
        if key not in data:
            data.clear()
            data[key] = batch(model.cfg, step=key, global_batch=global_batch, seq=seq, world=world, rank=rank,
                              device=dev)
        x, y = data[key]
        do_adam = t % adam_every == adam_every - 1
        if driver is not None:
            driver.begin(do_adam)
        loss = model(x, y)
        loss.backward()
        if driver is None:
            sequential_step(opt, do_adam)
        else:
            driver.step()

    for t in range(first_step, first_step + steps):
        one(t)
    if driver is not None:
        driver.wait_all()
    one.driver = driver
    return one


def paired_check(fresh: Callable[[], tuple[BankedGPT, object]], *, mode: str, steps: int, global_batch: int, seq: int,
                 world: int, rank: int,
                 on_start: Callable[[BankedGPT, OverlappedStep], None] | None = None) -> tuple[list, list]:
    """The overlapped schedule against the non-overlapped one on the *same* gradients: model A
    trains with :class:`OverlappedStep`; after each backward pass, B (the same initialization)
    gets a copy of A's gradients and takes :func:`sequential_step`. Sharing the gradients keeps the
    backward pass's own run-to-run variation (atomics in a GPU attention backward, for one) out of
    the comparison, which is then of the schedules alone. Adam on odd steps. Returns every rank's
    digests of A's and of B's parameters (a collective when distributed)."""
    from anvil_fast.parallel.distributed import all_digests, replica_digest

    ma, oa = fresh()
    mb, ob = fresh()
    driver = OverlappedStep(oa, ma, wait=mode)
    if on_start is not None:
        on_start(ma, driver)
    dev = next(ma.parameters()).device
    for t in range(steps):
        x, y = batch(ma.cfg, step=t, global_batch=global_batch, seq=seq, world=world, rank=rank, device=dev)
        do_adam = t % 2 == 1
        driver.begin(do_adam)
        ma(x, y).backward()
        with torch.no_grad():
            for (_, pa), (_, pb) in zip(ma.labelled(), mb.labelled()):
                pb.grad = None if pa.grad is None else pa.grad.detach().clone()
        driver.step()
        sequential_step(ob, do_adam)
    driver.wait_all()
    ta, tb = ([p.data for _, p in m.labelled()] for m in (ma, mb))
    if dist.is_initialized():
        return all_digests(ta), all_digests(tb)
    return [replica_digest(ta)], [replica_digest(tb)]


# ------------------------------------------------------------------------------------------ ranks
def _config(size: str) -> GPTConfig:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    return SIZES[size]


def _steady_ms(fn, n: int, warmup: int, device, *, blocks: int = 3) -> float:
    """Per-step ms of ``n`` back-to-back calls of ``fn`` (no synchronization between them, so the
    host runs ahead and a step's tail overlaps the next as in training), the median of ``blocks``."""
    return median_ms(fn, n=blocks, warmup=warmup, device=device, calls=n)


def _rank(rank: int, world: int, a: dict) -> dict:
    from anvil_fast.parallel.comms import LocalComms, NullComms

    dev = torch.device("cuda", rank) if a["device"] == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _config(a["size"])
    compile_banks = None if dev.type == "cuda" else False
    real = LocalComms() if world == 1 else None
    kw = dict(global_batch=a["global_batch"], seq=a["seq"], world=world, rank=rank)
    res: dict = {"world": world}

    def fresh(comms):
        model = BankedGPT(cfg, group_layers=a["group_layers"], seed=0).to(dev)
        return model, make_optimizer(model, comms=comms, compile_banks=compile_banks, work_order=a["work_order"],
                                     graphs=a["graphs"])

    # equivalence: each overlapped schedule against the non-overlapped one, on the same gradients
    res["digests"] = {mode: paired_check(lambda: fresh(real), mode=mode, steps=a["check_steps"], **kw)
                      for mode in WAIT_MODES}
    if a["n_time"] <= 0:
        return res
    # timing: every mode with communication, then without, then the collectives alone
    for mode in ("sequential", *WAIT_MODES):
        model, opt = fresh(real)
        one = train(model, opt, mode=mode, steps=1, fixed_data=True, **kw)
        t = iter(range(1, 10 ** 9))
        res[f"{mode}_ms"] = _steady_ms(lambda: one(next(t)), a["n_time"], a["warmup"], dev)
        if a["profile"] and mode == "prehook":
            res["profile"] = _profile(lambda: one(next(t)), a["profile"], world, rank, dev)
        if one.driver is not None:
            one.driver.wait_all()
        if mode == "end":
            res["comm_ms"] = median_ms(comm_only(opt, replicated_first=False), n=a["n_time"], warmup=a["warmup"], device=dev) if world > 1 else 0.0
        del model, opt, one
    model, opt = fresh(NullComms(world, rank) if world > 1 else real)
    one = train(model, opt, mode="end", steps=1, fixed_data=True, **kw)
    t = iter(range(1, 10 ** 9))
    res["nocomm_ms"] = _steady_ms(lambda: one(next(t)), a["n_time"], a["warmup"], dev)
    if dev.type == "cuda":
        res["max_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    return res


def _profile(fn, folder: str, world: int, rank: int, device, steps: int = 3) -> str:
    """A torch.profiler trace of ``steps`` steps (chrome format, one file per rank and world size,
    for chrome://tracing or Perfetto: the NCCL kernels next to the backward's), and the top of its
    table by device time, returned as text."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"train_step_w{world}_rank{rank}.json"))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15)


# ------------------------------------------------------------------------------------------ table
def hidden_share(step_ms: float, nocomm_ms: float, comm_ms: float) -> float:
    """The share of the collectives' time that does not show in the step: ``(t_nocomm + t_comm -
    t_step) / t_comm`` (NaN without collectives)."""
    return (nocomm_ms + comm_ms - step_ms) / comm_ms if comm_ms > 0 else float("nan")


def _slowest(res: list[dict], key: str) -> float:
    return max(r[key] for r in res)


def table(results: dict[int, list[dict]], a: dict) -> tuple[list[str], bool, dict[int, dict]]:
    """The table's lines, whether every bitwise check held, and the timed rows (the run's JSON
    record, :mod:`anvil_fast.studies.study_runs`)."""
    lines = ["| ranks | per-rank batch | step ms, overlapped (wait in pre-hook) | step ms, overlapped (wait at "
             "step end) | step ms, not overlapped | step ms, comms skipped | collectives alone ms | hidden "
             "(pre-hook) | step / 1-rank step (pre-hook) | bitwise == not overlapped |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ok = True
    record = {}
    base = results.get(1, [{}])[0].get("prehook_ms")
    for w, res in results.items():
        d = res[0]["digests"]
        same = all(d[m][0] == d[m][1] and len(set(d[m][0])) == 1 for m in WAIT_MODES)
        ok &= same
        if "prehook_ms" not in res[0]:
            lines.append(f"| {w} | {a['global_batch'] // w} | | | | | | | | {'yes' if same else 'NO'} |")
            continue
        pre, end, seq = (_slowest(res, k) for k in ("prehook_ms", "end_ms", "sequential_ms"))
        noc, com = _slowest(res, "nocomm_ms"), _slowest(res, "comm_ms")
        hid = hidden_share(pre, noc, com)
        record[w] = dict(batch=a["global_batch"] // w, prehook_ms=pre, end_ms=end, sequential_ms=seq, nocomm_ms=noc,
                         comm_ms=com)
        ratio = f"{pre / base:.2f}x" if base else ""
        lines.append(f"| {w} | {a['global_batch'] // w} | {pre:.2f} | {end:.2f} | {seq:.2f} | {noc:.2f} | {com:.2f} | "
                     f"{'' if math.isnan(hid) else f'{hid:.0%}'} | {ratio} | {'yes' if same else 'NO'} |")
    return lines, ok, record


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: NCCL, one GPU per rank; cpu: gloo, a smoke run (tiny model, few steps)")
    ap.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    ap.add_argument("--size", default=None, choices=list(SIZES),
                    help="anvil_fast.models.gpt size (default: gpt2small on cuda, tiny on cpu)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step over all ranks (default: 16 on cuda, 4 on cpu)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the size's context)")
    ap.add_argument("--group-layers", type=int, default=None,
                    help="layers per bank (default: 4 on cuda, so 8 ranks divide every bank; 1 on cpu)")
    ap.add_argument("--work-order", choices=WORK_ORDERS, default="backward",
                    help="the updates' order (BankedGPT.work_order): as the reduces land, as the forward reads, "
                         "or mixed")
    ap.add_argument("--graphs", action="store_true", help="bank updates replayed as CUDA graphs (cuda only)")
    ap.add_argument("--check-steps", type=int, default=3, help="steps of the bitwise equivalence check")
    ap.add_argument("--n-time", type=int, default=None, help="timed steps per variant (default 20 cuda, 3 cpu; "
                    "0: equivalence only)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5 cuda, 1 cpu)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="also write a torch.profiler trace of 3 overlapped steps per rank here (and print rank 0's "
                         "top kernels)")
    ap.add_argument("--out", default="", help="also write the table (markdown) here")


def settings(a: argparse.Namespace) -> dict:
    """The run's settings with the device's defaults, refused early when inconsistent."""
    cuda = a.device == "cuda"
    d = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    s = dict(device=a.device, size=a.size or d["size"],
             global_batch=a.global_batch if a.global_batch is not None else d["global_batch"],
             group_layers=a.group_layers if a.group_layers is not None else d["group_layers"],
             check_steps=a.check_steps, n_time=a.n_time if a.n_time is not None else (20 if cuda else 3),
             warmup=a.warmup if a.warmup is not None else (5 if cuda else 1),
             work_order=a.work_order, graphs=bool(a.graphs), profile=a.profile)
    if s["graphs"] and not cuda:
        raise ValueError("--graphs needs --device cuda (CUDA graphs)")
    cfg = _config(s["size"])
    s["seq"] = a.seq if a.seq is not None else cfg.ctx
    try:
        worlds = [int(w) for w in a.worlds.split(",")]
    except ValueError:
        raise ValueError(f"--worlds: expected comma-separated ints, got {a.worlds!r}") from None
    if not 1 <= s["seq"] <= cfg.ctx:
        raise ValueError(f"--seq {s['seq']} must lie in [1, {cfg.ctx}] (the {s['size']} context)")
    if s["check_steps"] < 1 or s["n_time"] < 0 or s["warmup"] < 0:
        raise ValueError("--check-steps must be >= 1, --n-time and --warmup >= 0")
    G = s["group_layers"]
    if G < 1 or cfg.n_layer % G:
        raise ValueError(f"--group-layers {G} must divide n_layer={cfg.n_layer}")
    for w in worlds:
        check_batch(s["global_batch"], w)
        for what, n in (("attention bank matrices", 4 * G), ("MLP bank matrices", 2 * G), ("vocabulary", cfg.vocab),
                        ("context", cfg.ctx)):
            if n % w:
                raise ValueError(f"{w} ranks cannot shard the {what} ({n}): raise --group-layers or pick a world "
                                 f"size dividing {n}")
    s["worlds"] = worlds
    return s


def run(a: argparse.Namespace) -> int:
    from anvil_fast.parallel.distributed import spawn

    try:
        s = settings(a)
    except ValueError as e:
        print(f"anvil_fast.studies.train_step: {e}", file=sys.stderr)
        return 2
    cuda = s["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        print("anvil_fast.studies.train_step --device cuda: needs CUDA devices (--device cpu is the smoke run)", file=sys.stderr)
        return 2
    results = {}
    with Progress(len(s["worlds"]), "train_step") as bar:
        for w in s["worlds"]:
            bar.update(label=f"train_step: {w} rank(s)")
            if cuda and torch.cuda.device_count() < w:
                print(f"skipping {w} ranks: {torch.cuda.device_count()} GPU(s)", flush=True)
            else:
                t0 = time.time()
                results[w] = spawn(_rank, w, s, backend="nccl" if cuda else "gloo", threads=0 if cuda else 1,
                                   timeout=GPU_TIMEOUT_S if cuda else CPU_TIMEOUT_S)
                print(f"{w} rank(s) measured in {time.time() - t0:.0f} s", flush=True)
            bar.update(advance=1)
    if not results:
        print("anvil_fast.studies.train_step: no world size could run", file=sys.stderr)
        return 2
    cfg = _config(s["size"])
    dev = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
    mem = max((r.get("max_memory_gib", 0.0) for res in results.values() for r in res), default=0.0)
    command = getattr(a, "command_line", None) or "python -m anvil_fast.studies.train_step " + " ".join(sys.argv[1:])
    lines = [f"<!-- generated by `{command}` -->",
             f"# Training step on {', '.join(map(str, results))} rank(s): forward + backward + AnvilAndAdam", "",
             f"Device: {dev}, torch {torch.__version__}. Model: BankedGPT `{s['size']}` ({cfg.n_layer} layers, width "
             f"{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}), banks of {s['group_layers']} layer(s), updates in "
             f"{s['work_order']} order, bank updates {'in CUDA graphs' if s['graphs'] else 'without CUDA graphs'}; global "
             f"batch {s['global_batch']} x {s['seq']} tokens at every world size; Adam every step; per step: "
             f"{s['n_time']} steps back to back (no sync between them), median of 3 such blocks after {s['warmup']} "
             "warm-up steps, slowest rank; collectives alone: median of single calls"
             + (f"; peak memory {mem:.1f} GiB per GPU" if mem else "") + ". Hidden = (comms skipped + collectives "
             f"alone - step) / collectives alone. Bitwise check: {s['check_steps']} steps (Adam on odd steps), every "
             "parameter of every rank, overlapped (both waits) against backward + step_from_buffers on the same gradients "
             "(paired_check).", ""]
    body, ok, record = table(results, s)
    emit_table(lines + body, a.out)
    if a.out and record:
        write_record(a.out, TRAIN_STEP, command, record)
    for w, res in results.items():
        if "profile" in res[0]:
            print(f"profile, {w} rank(s), rank 0 (traces in {s['profile']}):\n{res[0]['profile']}")
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.train_step", description=__doc__.split("\n\n")[0])
    add_args(ap)
    add_progress_flags(ap)
    a = ap.parse_args(argv)
    a.command_line = "python -m anvil_fast.studies.train_step " + " ".join(argv)
    with default_enabled(a.progress):
        return run(a)


if __name__ == "__main__":
    sys.exit(main())
