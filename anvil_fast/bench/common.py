"""What every benchmark of :mod:`anvil_fast.bench` shares: the measured peaks, the element-wise
bytes of a bank update, the cascade's FLOPs per bank and the table writer.

Timers are the package's (:mod:`anvil_fast.kernels.timing`: ``do_bench_ms`` for kernels against the
roofline, ``median_ms`` and ``call_times`` for steps); :func:`graphed` turns a step into the replay
of a CUDA graph of it; :func:`kernel_us` is the tuner's own timer
(:func:`anvil_fast.kernels.gram_tune.time_us`), so a kernel's time in a benchmark table is the quantity the
tuner compared when it chose the kernel's configuration. FLOPs are the package's one count
(:func:`anvil_fast.core.gram_side.map_flops`; :func:`executed_flops` picks the standard or the Gram
side's count as the bank's configuration does).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from anvil_ref.constants import ANVIL_MAPS

from anvil_fast.core.cascade import default_config_for, get_config, gram_side_schedule
from anvil_fast.core.gram_side import SYMMETRIC_BLOCK, cascade_flops, map_flops
from anvil_fast.kernels.capture import capture
from anvil_fast.kernels.gram_tune import time_us as kernel_us
from anvil_fast.kernels.timing import do_bench_ms

#: Bytes per element the element-wise phases of one bank update move: rails 20 B, normalization
#: 4 B (read and write X; its partials come from the rails), equalizer 6 B, update 14 B.
ELEMENTWISE_BYTES = 20 + 4 + 6 + 14

#: The cascade's number of maps (each one Gram, one ``b*A + c*A@A`` and one ``a*X + X@B``): the
#: record's, ``len(ANVIL_MAPS)``.
MAPS_PER_CASCADE = len(ANVIL_MAPS)

def emit_table(lines: list[str], out: str | None) -> None:
    """Print a table and, with ``out``, write it there too (folders created)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """The replay of a CUDA graph of one ``fn()`` (warmed up three times on a side stream first, as
    capture requires)."""
    return capture(fn, warmup=3).replay


def measure_peaks() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s on 8192^3 random data, device-to-device copy GB/s counting read + write)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_ms(lambda: a @ b, rep_ms=200, warmup=50)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms_c = do_bench_ms(lambda: dst.copy_(src), rep_ms=200, warmup=50)
    gbs = 2 * src.numel() / ms_c / 1e6
    del a, b, src, dst
    return tflops, gbs


def held_storages(opt, exclude=()) -> dict[str, int]:
    """Every tensor storage an optimizer holds, counted once: path (the first attribute path that
    reaches it, e.g. ``opt.inner.banks['b'].velocity``) -> bytes. Walks the optimizer's attributes,
    dicts, lists and tuples and the objects of torch and of this package they reach, so a buffer
    held anywhere is found without naming it; tensors sharing a storage count once (views of the
    state, of a staging buffer). ``exclude``: tensors whose storages are not the optimizer's (the
    parameters and their gradients). Modules are not entered (a model the optimizer refers to is
    not its memory); host numpy arrays are not counted."""
    skip = {t.untyped_storage().data_ptr() for t in exclude if isinstance(t, torch.Tensor)}
    seen_obj, seen, out = set(), set(), {}
    stack = [("opt", opt)]
    while stack:
        path, o = stack.pop()
        if id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            key = st.data_ptr()
            if key and key not in seen and key not in skip:
                seen.add(key)
                out[path] = st.nbytes()
            continue
        if isinstance(o, torch.nn.Module) or isinstance(o, type):
            continue
        if isinstance(o, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in o.items()] + [(f"{path}<key>", k) for k in o]
        elif isinstance(o, (list, tuple, set, frozenset)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(o)]
        elif type(o).__module__.split(".")[0] in ("anvil_fast", "anvil_ref", "torch") and hasattr(o, "__dict__"):
            items = [(f"{path}.{k}", v) for k, v in vars(o).items()]
        else:
            continue
        stack.extend(reversed(items))
    return out


def flops(shape, *, block: int = SYMMETRIC_BLOCK) -> tuple[float, float]:
    """(plain, executed-by-symmetric-kernels) FLOPs of one bank's cascade (:func:`map_flops` per map)."""
    f = map_flops(shape, block=block)
    return MAPS_PER_CASCADE * f.plain, MAPS_PER_CASCADE * f.executed


def executed_flops(shape, config=None, device="cuda") -> float:
    """FLOPs the fast path executes for one cascade of the bank chunk ``shape`` ``[c, m, n]`` under
    ``config`` (a :class:`~anvil_fast.core.cascade.CascadeConfig` or its name; None: the one a bank
    of that shape gets on ``device``, :func:`~anvil_fast.core.cascade.default_config_for`): the Gram
    side's count where the cascade takes it (:func:`~anvil_fast.core.cascade.gram_side_schedule` gives the
    bank a restart schedule on ``device``), else the standard
    cascade's (:func:`flops`). A floor built on the standard count for a bank that runs the Gram side
    would sit above what that bank's kernels must execute."""
    shape = tuple(int(d) for d in shape)
    cfg = default_config_for(shape, device) if config is None else get_config(config)
    c, m, n = shape
    sched = gram_side_schedule(cfg, shape, device=device)
    if sched is not None:
        return c * cascade_flops(m, n, maps=MAPS_PER_CASCADE, restarts=sched)["gram_side"]
    return flops(shape)[1]


__all__ = ["ELEMENTWISE_BYTES", "MAPS_PER_CASCADE", "SYMMETRIC_BLOCK", "emit_table", "graphed", "held_storages",
           "kernel_us", "measure_peaks", "flops", "executed_flops"]
