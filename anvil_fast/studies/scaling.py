"""The fast optimizer at several ranks -- equivalence and step time.

``python -m anvil_fast.studies.scaling cpu --world 8``
    ``world`` gloo processes on CPU, on a scaled-down copy of the benchmark's GPT-2 layout (4 layers,
    width 32: every bank has 8 matrices, so the seed's 8-way sharding applies unchanged), 20 steps
    (Adam on odd steps, the untie at step 10):

    * exact gradients (rank-independent, on a 2**-6 grid with |k| <= 15: every partial sum of the
      reduction is an integer multiple of 2**-6 below 256 in magnitude, exact in bf16 and fp32, and
      the division by a power-of-two world size is exact): every rank's replica and its shard of the
      state must equal the single-process run's bit for bit;
    * each rank's own gradients: every rank's replica is bitwise identical, and the 20-step
      trajectory's distance from the float64 reference on the mean gradients is compared with the
      single-process fast run's (anvil_fast/core/tolerances.py's rule: at most 2x + 2**-8).

``python -m anvil_fast.studies.scaling gpu --worlds 1,2``
    NCCL, one process per GPU, the benchmark's GPT-2-small layout (:mod:`anvil_fast.bench.optimizer`), bank
    updates compiled (``--graphs``: and captured in CUDA graphs), untied Adam steps:

    * step time at each world size with communication (DistComms) and without (NullComms: the same
      shards and kernels, no collective), and the collectives alone (the same reduce-scatters,
      all-reduces and all-gathers in the same order, no compute); ``hidden`` = the share of the
      collectives' time that does not show up in the step: ``(t_nocomm + t_comm - t_step) / t_comm``;
    * 20 steps with exact gradients: every rank's replica bitwise identical and equal to the one-GPU
      run's; 20 steps with each rank's own gradients: replicas bitwise identical.

Each writes its table (markdown, with the command that produced it) to ``--out``; ``gpu`` also
writes its timings beside it as JSON (:mod:`anvil_fast.studies.study_runs`), which the cost model reads.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from anvil_ref.cli_args import add_progress_flags, positive_int, positive_int_list

from anvil_fast.bench.common import emit_table
from anvil_fast.bench.optimizer import SCATTER, WORK, gpt2_small_layout, make_params, table_of
from anvil_fast.parallel.distributed import all_digests, replica_digest, spawn
from anvil_fast.optim.overlap import comm_only
from .study_runs import SCALING, write_record
from anvil_fast.kernels.timing import median_ms

STEPS = 20
#: Seconds a GPU rank may wait in a collective: a rank's first step compiles the banks and captures
#: graphs (minutes at the record's shapes) while the others already wait for it.
GPU_TIMEOUT_S = 900.0
UNTIE_AT = 10
SMALL = dict(n_layer=4, width=32, vocab=256, heads=2, head_dim=16, hidden=128)


def fixed_point_grads(params, step: int, *, rank: int | None = None) -> dict[str, torch.Tensor]:
    """Gradients on a 2**-6 grid with |k| <= 15 (module docstring); rank-dependent when ``rank`` is
    given, else the same on every rank."""
    dev = params[0][1].device
    g = torch.Generator(device=dev).manual_seed(10_000 * step + (0 if rank is None else 17 * (rank + 1)))
    out = {}
    for label, p in params:
        x = torch.randn(p.shape, generator=g, device=dev)
        out[label] = torch.clamp(torch.round(4 * x), -15, 15) * 2.0 ** -6 if rank is None else 1e-2 * x
    return out


def _opt(layout, device, comms, *, graphs: bool, compile_banks, seed=0):
    import functools

    from anvil_fast.core.bank import anvil_bank_update
    from anvil_fast.optim.optimizer import AnvilAndAdam

    params = make_params(layout, device, seed=seed)
    # lanes=1: one rank's step has its banks on the main stream at every world size (several ranks keep the
    # comms schedule's launch order), so the world sizes compare the same schedule
    opt = AnvilAndAdam(params, table_of(layout), SCATTER, WORK, comms=comms, lanes=1,
                       bank_update=functools.partial(anvil_bank_update, compile=compile_banks))
    if graphs:
        opt.use_cuda_graphs()
    return opt, params


def _hyper(opt, t):
    from anvil_ref.rails import rail_scalars

    opt.set_rail_scalars(rail_scalars(t, 2 * STEPS, engage_step=STEPS // 2))
    for cfg in opt.param_cfgs.values():
        cfg.lr = cfg.initial_lr * (1 - t / (4 * STEPS))


def trajectory(opt, params, grads_of, steps=STEPS) -> None:
    """``steps`` training-loop steps: backward accumulates into ``.grad`` (kept Adam gradients),
    Adam on odd steps, the untie at UNTIE_AT."""
    for t in range(steps):
        _hyper(opt, t)
        for label, g in grads_of(t).items():
            p = opt.params[label]
            if p.grad is None:
                p.grad = g.to(p.dtype)
            else:
                p.grad += g.to(p.dtype)
        if t == UNTIE_AT:
            opt.copy_lm_state_to_embed()
        opt.step(do_adam=t % 2 == 1)


def _state_tensors(opt):
    return [v for st in opt.param_states.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _shard_of(single, opt) -> list[torch.Tensor]:
    """The single-process run's state cut to ``opt``'s shards (same order as _state_tensors(opt))."""
    out = []
    for label, st in single.param_states.items():
        cfg = opt.param_cfgs[label]
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            if cfg.comms == "sharded":
                lo, hi = opt.rank * cfg.chunk_size, (opt.rank + 1) * cfg.chunk_size
                v = v[:, lo:hi] if k == "velocity" else v[lo:hi]
            out.append(v)
    return out


# --------------------------------------------------------------------------------------------- CPU
def _cpu_rank(rank: int, world: int) -> dict:
    from anvil_ref import ReferenceAnvilAndAdam
    from anvil_ref.optimizer import ParamSpec

    from anvil_fast.parallel.comms import LocalComms

    layout = gpt2_small_layout(**SMALL)
    res = {}
    # exact gradients: sharded == single process, bit for bit
    opt, params = _opt(layout, "cpu", None, graphs=False, compile_banks=False)
    trajectory(opt, params, lambda t: fixed_point_grads(params, t))
    single, sparams = _opt(layout, "cpu", LocalComms(), graphs=False, compile_banks=False)
    trajectory(single, sparams, lambda t: fixed_point_grads(sparams, t))
    res["exact_digests"] = all_digests([p.data for p in opt.params.values()])
    res["exact_equals_single"] = (replica_digest([p.data for p in opt.params.values()]) ==
                                  replica_digest([p.data for p in single.params.values()]))
    res["exact_state_equals_single"] = replica_digest(_state_tensors(opt)) == replica_digest(_shard_of(single, opt))
    # each rank's own gradients: identical replicas; distance from the reference vs the single run's
    opt, params = _opt(layout, "cpu", None, graphs=False, compile_banks=False)
    trajectory(opt, params, lambda t: fixed_point_grads(params, t, rank=rank))
    res["random_digests"] = all_digests([p.data for p in opt.params.values()])
    if rank == 0:
        def mean_grads(t, ps):
            gs = [fixed_point_grads(ps, t, rank=r) for r in range(world)]
            return {l: sum(g[l].double() for g in gs) / world for l in gs[0]}

        single, sparams = _opt(layout, "cpu", LocalComms(), graphs=False, compile_banks=False)
        trajectory(single, sparams, lambda t: {l: g.float() for l, g in mean_grads(t, sparams).items()})
        init = dict(make_params(layout, "cpu"))
        ref = ReferenceAnvilAndAdam({l: ParamSpec(p.detach().double(), p.__dict__.get("reshape"))
                                     for l, p in init.items()}, table_of(layout))
        for t in range(STEPS):
            _hyper(ref, t)
            if t == UNTIE_AT:
                ref.copy_lm_state_to_embed()
            ref.step({l: g.numpy() for l, g in mean_grads(t, sparams).items()}, do_adam=t % 2 == 1)
        dist_rel, single_rel = {}, {}
        for label in layout:
            r = torch.from_numpy(ref.params[label])
            moved = (r - init[label].detach().double()).norm()
            dist_rel[label] = float((opt.params[label].detach().double() - r).norm() / moved)
            single_rel[label] = float((single.params[label].detach().double() - r).norm() / moved)
        res["distance_from_reference"] = (dist_rel, single_rel)
    return res


def run_cpu(a: argparse.Namespace) -> int:
    from anvil_fast.core.tolerances import bf16_bound

    from anvil_ref.progress import Progress

    t0 = time.time()
    with Progress(1, f"scaling: {a.world} gloo ranks, {STEPS} steps each", enabled=a.progress):
        res = spawn(_cpu_rank, a.world, backend="gloo")
    wall = time.time() - t0
    ok = True
    lines = [f"<!-- generated by `{a.command_line}` -->",
             f"# The fast optimizer on {a.world} gloo ranks (CPU), {STEPS} steps", "",
             f"Layout: `gpt2_small_layout(**{SMALL})` (every bank 8 matrices); Adam on odd steps, untie at "
             f"step {UNTIE_AT}; wall time {wall:.0f} s.", "",
             "| check | result |", "|---|---|"]
    checks = [
        ("exact gradients: all ranks' replicas identical", len(set(res[0]["exact_digests"])) == 1),
        ("exact gradients: every replica == single-process run (bitwise)", all(r["exact_equals_single"] for r in res)),
        ("exact gradients: every rank's state shard == single-process run's (bitwise)",
         all(r["exact_state_equals_single"] for r in res)),
        ("own gradients: all ranks' replicas identical (bitwise)", len(set(res[0]["random_digests"])) == 1),
    ]
    dist_rel, single_rel = res[0]["distance_from_reference"]
    within = all(dist_rel[l] <= bf16_bound(single_rel[l]) for l in dist_rel)
    checks.append(("own gradients: distance from the fp64 reference <= 2 x single-process's + 2^-8", within))
    for name, good in checks:
        ok &= bool(good)
        lines.append(f"| {name} | {'yes' if good else 'NO'} |")
    lines += ["", f"Distance after {STEPS} steps, ||p - p_ref|| / ||p_ref - p_0||, on the mean of the ranks' gradients:",
              "", f"| parameter | {a.world} ranks | 1 process |", "|---|---:|---:|"]
    lines += [f"| {l} | {dist_rel[l]:.2e} | {single_rel[l]:.2e} |" for l in dist_rel]
    emit_table(lines, a.out)
    return 0 if ok else 1



# --------------------------------------------------------------------------------------------- GPU
def _gpu_rank(rank: int, world: int, steps: int, n_time: int, graphs: bool = False) -> dict:
    from anvil_fast.bench.optimizer import make_grads, step_fn
    from anvil_fast.parallel.comms import LocalComms, NullComms

    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    layout = gpt2_small_layout()
    res = {"world": world}
    real = LocalComms() if world == 1 else None
    t0 = time.time()
    # equivalence: exact gradients (20 steps) and each rank's own gradients (20 steps)
    opt, params = _opt(layout, dev, real, graphs=graphs, compile_banks=None)
    trajectory(opt, params, lambda t: fixed_point_grads(params, t), steps)
    res["exact_digest"] = replica_digest([p.data for p in opt.params.values()])
    res["exact_digests"] = all_digests([p.data for p in opt.params.values()]) if world > 1 else [res["exact_digest"]]
    if rank == 0:
        res["exact_params"] = {l: p.detach().cpu() for l, p in opt.params.items()}
        res["init_params"] = {l: p.detach().cpu() for l, p in make_params(layout, dev)}
    del opt, params
    opt, params = _opt(layout, dev, real, graphs=graphs, compile_banks=None)
    trajectory(opt, params, lambda t: fixed_point_grads(params, t, rank=rank), steps)
    res["random_digests"] = all_digests([p.data for p in opt.params.values()]) if world > 1 else [""]
    del opt, params
    res["equivalence_s"] = time.time() - t0
    # timing: untied Adam steps with communication, without, and the collectives alone
    opt, params = _opt(layout, dev, real, graphs=graphs, compile_banks=None)
    opt.copy_lm_state_to_embed()
    grads = make_grads(params)
    res["step_ms"] = median_ms(step_fn(opt, params, grads, True), n=n_time, warmup=10, device=dev)
    res["anvil_only_ms"] = median_ms(step_fn(opt, params, grads, False), n=n_time, warmup=10, device=dev)
    res["comm_ms"] = median_ms(comm_only(opt, replicated_first=True), n=n_time, warmup=5, device=dev) if world > 1 else 0.0
    del opt
    null, nparams = _opt(layout, dev, NullComms(world, rank), graphs=graphs, compile_banks=None)
    null.copy_lm_state_to_embed()
    res["nocomm_ms"] = median_ms(step_fn(null, nparams, grads_like(nparams, grads), True), n=n_time, warmup=10, device=dev)
    res["total_s"] = time.time() - t0
    return res


def grads_like(params, grads):
    return {l: grads[l] for l, _ in params}


def run_gpu(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("anvil_fast.studies.scaling gpu: needs CUDA devices")
        return 2
    from anvil_ref.progress import Progress

    results = {}
    with Progress(len(a.worlds), "scaling", enabled=a.progress) as bar:
        for i, w in enumerate(a.worlds):
            if torch.cuda.device_count() < w:
                print(f"skipping {w} ranks: {torch.cuda.device_count()} GPUs")
                continue
            bar.update(i, label=f"scaling: {w} rank(s), {a.steps} steps")
            t0 = time.time()
            results[w] = spawn(_gpu_rank, w, a.steps, a.n_time, a.graphs, backend="nccl", threads=0,
                               timeout=GPU_TIMEOUT_S)
            print(f"{w} rank(s) measured in {time.time() - t0:.0f} s", flush=True)
        bar.update(len(a.worlds))
    one = results.get(1, [{}])[0].get("exact_digest")
    lines = [f"<!-- generated by `{a.command_line}` -->",
             f"# The fast optimizer on {', '.join(map(str, results))} H200 GPU(s): GPT-2-small layout, NCCL", "",
             f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}. Untied Adam step (every parameter "
             f"updated), bank updates compiled{' and in CUDA graphs' if a.graphs else ' (no CUDA graphs)'}; median "
             f"of {a.n_time} steps per rank, slowest rank reported.", "",
             "| ranks | step ms (with comms) | step ms (comms skipped) | collectives alone ms | hidden | "
             "ANVIL-only step ms |", "|---:|---:|---:|---:|---:|---:|"]
    record = {}
    for w, res in results.items():
        step = max(r["step_ms"] for r in res)
        noc = max(r["nocomm_ms"] for r in res)
        com = max(r["comm_ms"] for r in res)
        record[w] = dict(step_ms=step, nocomm_ms=noc, comm_ms=com, anvil_only_ms=max(r["anvil_only_ms"] for r in res))
        hidden = "" if w == 1 or com <= 0 else f"{max(0.0, min(1.0, (noc + com - step) / com)):.0%}"
        lines.append(f"| {w} | {step:.3f} | {noc:.3f} | {com:.3f} | {hidden} | {max(r['anvil_only_ms'] for r in res):.3f} |")
    lines += ["", f"Equivalence ({a.steps} steps; Adam on odd steps; untie at step {UNTIE_AT}). Exact gradients: "
              "rank-independent, on a grid where every reduction is exact, so the sharded run computes on the "
              "same inputs as the one-GPU run; `max rel. diff` = max over parameters of ||p_W - p_1|| / "
              "||p_1 - p_0|| (0 when bitwise equal):", "",
              "| ranks | exact gradients: replicas identical | exact gradients: == one-GPU run (bitwise) | "
              "max rel. diff vs one GPU | own gradients: replicas identical |", "|---:|---|---|---:|---|"]
    ok = True
    base = results.get(1, [{}])[0]
    for w, res in results.items():
        same = len(set(res[0]["exact_digests"])) == 1
        eq1 = one is not None and all(r["exact_digest"] == one for r in res)
        rel = float("nan")
        if "exact_params" in base:
            rel = max(float((res[0]["exact_params"][l].double() - base["exact_params"][l].double()).norm() /
                            (base["exact_params"][l].double() - base["init_params"][l].double()).norm().clamp_min(1e-30))
                      for l in base["exact_params"])
        rnd = w == 1 or len(set(res[0]["random_digests"])) == 1
        ok &= same and rnd and (eq1 or rel <= 2.0 ** -5)
        lines.append(f"| {w} | {'yes' if same else 'NO'} | {'yes' if eq1 else 'no'} | {rel:.2e} | "
                     f"{'yes' if rnd else 'NO'} |")
    emit_table(lines, a.out)
    if a.out and record:
        write_record(a.out, SCALING, a.command_line, record)
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.scaling", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cpu", help="gloo ranks on CPU: equivalence with the single-process run")
    c.add_argument("--world", type=int, choices=(1, 2, 4, 8), default=8,
                   help="gloo processes: a power of two (exact mean gradients) dividing the banks' 8 matrices "
                        "(default: %(default)s)")
    c.add_argument("--out", default="", help="also write the table to this markdown file")
    g = sub.add_parser("gpu", help="NCCL ranks, one per GPU: step time and equivalence")
    g.add_argument("--worlds", type=positive_int_list, default="1,2",
                   help="comma-separated world sizes (default: %(default)s)")
    g.add_argument("--steps", type=positive_int, default=STEPS, help="equivalence steps (default: %(default)s)")
    g.add_argument("--n-time", type=positive_int, default=30, help="timed steps per rank (default: %(default)s)")
    g.add_argument("--graphs", action="store_true", help="bank updates in CUDA graphs (the capture can fail on "
                   "a rank of several; see the report)")
    g.add_argument("--out", default="", help="also write the table to this markdown file")
    for p in (c, g):
        add_progress_flags(p)
    a = ap.parse_args(argv)
    a.command_line = "python -m anvil_fast.studies.scaling " + " ".join(argv)
    return run_cpu(a) if a.mode == "cpu" else run_gpu(a)


if __name__ == "__main__":
    sys.exit(main())
