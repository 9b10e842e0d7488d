"""The cost model's measurements on this machine: the pieces of a step, timed per rank.

What :mod:`anvil_fast.studies.cost_model` ``measure`` records (its module docstring): each label's update
as one rank of ``w`` runs it (:func:`time_pieces`), the host's time to issue a step
(:func:`host_ms`), the whole step without communication (:func:`measure_layout`), the training
step's forward, backward and gradient-ready times (:func:`measure_training`), and the collectives'
times over message sizes (:func:`collective_rank`). Numbers only: fitting and predicting are the
model's, writing the data file is the command's. Timers: :mod:`anvil_fast.kernels.timing`.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any


def layouts() -> dict:
    """name -> bench.optimizer layout: GPT-2 small (4x hidden) and the seed's (hidden 2816)."""
    from anvil_fast.bench.optimizer import gpt2_small_layout

    return {"gpt2small": gpt2_small_layout(), "seed": gpt2_small_layout(hidden=2816)}


def host_ms(fn, n: int, device) -> float:
    """Host time to issue ``fn`` with the device idle at the start (no sync inside)."""
    from anvil_fast.kernels.timing import call_times

    return statistics.median(call_times(fn, device, n=n, synchronize_each=True).host_ms)


def time_pieces(opt, grads: dict, n: int, device) -> dict[str, float]:
    """Each label's update as rank ``opt.rank`` of ``opt.world_size`` runs it (after one step, so
    the scalars are staged and the bank updates compiled): a bank's on its matrices, a sharded Adam
    parameter's on its rows; the replicated labels share one fused pass, split by element count."""
    from anvil_fast.kernels.timing import median_ms

    upd = {}
    for label in opt.labels:
        cfg = opt.param_cfgs[label]
        if cfg.comms == "replicated":
            continue
        if cfg.optim == "anvil":
            upd[label] = median_ms(lambda l=label: opt.anvil_update(l, opt.banks[l].grad, opt.update_bank), n=n,
                                   warmup=2, device=device)
        else:
            chunk = grads[label][: cfg.chunk_size].contiguous()
            upd[label] = median_ms(lambda l=label, c=chunk: opt.adam_update(l, c), n=n, warmup=2, device=device)
    rep = [l for l in opt.labels if opt.param_cfgs[l].comms == "replicated"]
    if rep:
        ms = median_ms(lambda: opt.replicated.update(opt.adam_table), n=n, warmup=2, device=device)
        sizes = {l: opt.params[l].numel() for l in rep}
        for l in rep:
            upd[l] = ms * sizes[l] / sum(sizes.values())
    return upd


def training_problems(worlds: list[int], *, size: str, group_layers: int, global_batch: int, **_) -> dict[int, str]:
    """World size -> why the training step cannot run at it (none where it can): the global batch must
    divide into equal per-rank batches, and every sharded bank's first dimension into the ranks. The model
    and its optimizer are built on the meta device, so nothing is allocated."""
    import torch

    from anvil_fast.models.banked_gpt import BankedGPT, check_batch
    from anvil_fast.models.gpt import SIZES
    from anvil_fast.optim.overlap import make_optimizer
    from anvil_fast.parallel.comms import LocalComms, NullComms

    with torch.device("meta"):
        model = BankedGPT(SIZES[size], group_layers=group_layers)
    problems = {}
    for w in worlds:
        try:
            check_batch(global_batch, w)
            make_optimizer(model, comms=LocalComms() if w == 1 else NullComms(w, 0), compile_banks=False)
        except ValueError as e:  # ConfigError is one
            problems[w] = str(e)
    return problems


def measure_training(worlds: list[int], *, n: int, device, size: str, group_layers: int, global_batch: int,
                     seq: int | None = None) -> dict:
    """The training step's pieces for rank 0 of each world size, on one device: forward and
    backward at the per-rank batch (``global_batch / w``), the time after the backward pass's start
    at which each sharded gradient is complete (a post-accumulate-grad hook records an event), and
    the updates (:func:`time_pieces`) of :class:`anvil_fast.models.banked_gpt.BankedGPT`'s optimizer. The
    marks are CUDA events recorded in the stream as the passes reach them (wall clock on CPU), not
    :mod:`anvil_fast.kernels.timing`'s per-call timers: they split one call into its phases."""
    import torch

    from anvil_fast.parallel.comms import LocalComms, NullComms
    from anvil_fast.models.gpt import SIZES
    from anvil_fast.models.banked_gpt import BankedGPT, batch, check_batch
    from anvil_fast.optim.overlap import make_optimizer, sequential_step
    from anvil_fast.kernels.timing import synchronize

    cfg = SIZES[size]
    seq = cfg.ctx if seq is None else seq
    cuda = device.type == "cuda"
    out = dict(size=size, group_layers=group_layers, global_batch=global_batch, seq=seq, worlds={})
    for w in worlds:
        check_batch(global_batch, w)
        model = BankedGPT(cfg, group_layers=group_layers).to(device)
        opt = make_optimizer(model, comms=LocalComms() if w == 1 else NullComms(w, 0), compile_banks=None if cuda else False)
        if "labels" not in out:
            out["labels"] = {l: dict(comms=opt.param_cfgs[l].comms, shape=list(p.shape),
                                     nbytes=p.numel() * (2 if l in opt.banks else p.element_size()))
                             for l, p in opt.params.items()}
            out["scatter"], out["work"] = list(opt.scatter_order), list(opt.work_order)
        x, y = batch(cfg, step=0, global_batch=global_batch, seq=seq, world=w, rank=0, device=device)
        sharded = [l for l in opt.labels if opt.param_cfgs[l].comms == "sharded"]
        marks: dict[str, Any] = {}

        def mark(key):
            if cuda:
                marks[key] = torch.cuda.Event(enable_timing=True)
                marks[key].record()
            else:
                marks[key] = time.perf_counter()

        def since(a, b):
            return marks[a].elapsed_time(marks[b]) if cuda else 1e3 * (marks[b] - marks[a])

        hooks = [opt.params[l].register_post_accumulate_grad_hook(lambda p, l=l: mark(l)) for l in sharded]
        runs = []
        for i in range(n + 3):
            for p in model.parameters():
                p.grad = None
            mark("start")
            loss = model(x, y)
            mark("fwd")
            loss.backward()
            mark("bwd")
            synchronize(device)
            if i >= 3:
                runs.append(dict(fwd=since("start", "fwd"), bwd=since("fwd", "bwd"),
                                 ready={l: since("fwd", l) for l in sharded}))
        for h in hooks:
            h.remove()
        grads = {l: p.grad.detach().clone() for l, p in opt.params.items()}
        sequential_step(opt)
        out["worlds"][str(w)] = dict(
            fwd_ms=statistics.median(r["fwd"] for r in runs), bwd_ms=statistics.median(r["bwd"] for r in runs),
            ready_ms={l: statistics.median(r["ready"][l] for r in runs) for l in sharded},
            update_ms=time_pieces(opt, grads, n, device))
        e = out["worlds"][str(w)]
        print(f"  training step at {w} rank(s), batch {global_batch // w}: forward {e['fwd_ms']:.2f} ms, backward "
              f"{e['bwd_ms']:.2f} ms, updates {sum(e['update_ms'].values()):.2f} ms", flush=True)
        del model, opt, grads
        if cuda:
            torch.cuda.empty_cache()
    return out


def measure_layout(name: str, layout: dict, worlds: list[int], *, n: int, device) -> dict:
    """Rank 0's pieces of ``layout`` at each world size, on one GPU (module docstring)."""
    import torch

    from anvil_fast.bench.optimizer import SCATTER, WORK, make_grads, make_params, step_fn, table_of
    from anvil_fast.parallel.comms import LocalComms, NullComms
    from anvil_fast.optim.optimizer import AnvilAndAdam
    from anvil_fast.kernels.timing import median_ms

    labels = {}
    for label, (shape, reshape, dtype, entry) in layout.items():
        travels = 2 if reshape is not None else torch.finfo(dtype).bits // 8  # bank gradients travel in bf16
        labels[label] = dict(comms=entry["comms"], nbytes=math.prod(shape) * travels, shape=list(shape))
    out = dict(labels=labels, scatter=list(SCATTER), work=list(WORK), worlds={})
    for w in worlds:
        params = make_params(layout, device)
        comms = LocalComms() if w == 1 else NullComms(w, 0)
        # lanes=1: the banks on the main stream at every world size, as the model's schedule runs its pieces
        opt = AnvilAndAdam(params, table_of(layout), SCATTER, WORK, comms=comms, lanes=1)
        opt.copy_lm_state_to_embed()  # untied: every parameter updated, as anvil_fast.studies.scaling times it
        grads = make_grads(params)
        step = step_fn(opt, params, grads, True)
        step_ms = median_ms(step, n=n, warmup=3, device=device)  # also the warm-up: compiles the bank updates
        host = host_ms(step, n, device)
        step()
        upd = time_pieces(opt, grads, n, device)
        out["worlds"][str(w)] = dict(update_ms=upd, step_nocomm_ms=step_ms, host_ms=host)
        print(f"  {name} at {w} rank(s): step without comms {step_ms:.3f} ms, pieces {sum(upd.values()):.3f} ms, "
              f"host {host:.3f} ms", flush=True)
        del opt, params, grads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def collective_rank(rank: int, world: int, kinds: list[str], sizes: list[int], n: int, device: str) -> dict:
    """One rank's ms per collective kind and message size (the slowest rank's is the point)."""
    import torch

    from anvil_fast.parallel.comms import DistComms
    from anvil_fast.kernels.timing import median_ms

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    comms = DistComms()
    res = {}
    for kind in kinds:
        pts = []
        for nbytes in sizes:
            full = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=dev)
            part = torch.zeros(nbytes // 2 // world, dtype=torch.bfloat16, device=dev)
            fn = {"reduce_scatter": lambda: comms.reduce_scatter_avg(part, full).wait(),
                  "all_gather": lambda: comms.all_gather(full, part).wait(),
                  "all_reduce": lambda: comms.all_reduce_avg(full).wait()}[kind]
            pts.append((nbytes, median_ms(fn, n=n, warmup=3, device=dev)))
        res[kind] = pts
    return res


__all__ = ["layouts", "host_ms", "time_pieces", "measure_training", "measure_layout", "collective_rank"]
