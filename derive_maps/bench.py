"""``python -m derive_maps bench``: wall-clock timings of the solvers against their time targets
(one Remez solve < 1 s; both published tables < 20 s; certifying a six-map set < 30 s; the full
ANVIL-kind derivation < 5 min), on one CPU core (BLAS and torch threads pinned to 1 for the run).

Timings are measurements, printed, never asserted in tests.
"""

from __future__ import annotations

import os
import time

from .tables import Table, dumps, render


def _pin_threads() -> None:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_bench(*, fmt: str = "text", repeat: int = 1, progress: bool | None = None) -> int:
    _pin_threads()
    from anvil_ref.constants import ANVIL_MAPS

    from .anvil_kind import ANVIL_L, ANVIL_U, derive
    from .certify import certify_envelope, certify_headroom
    from .polar_express import RECIPES, greedy
    from .remez import remez_odd

    def both_tables():
        greedy(RECIPES["polar_express_paper"])
        greedy(RECIPES["modded_nanogpt"])

    express = derive("express").maps

    def certify(maps):
        return lambda: (certify_envelope(maps, ANVIL_L, ANVIL_U), certify_headroom(maps, ANVIL_U))

    def full():
        for m in ("express", "optimal", "polished"):
            maps = derive(m).maps
            certify_envelope(maps, ANVIL_L, ANVIL_U)
            certify_headroom(maps, ANVIL_U)

    cases = [
        ("one Remez solve (quintic on [1e-3, 1], 40 digits)", lambda: remez_odd("1e-3", "1"), 1.0),
        ("one Remez solve (degree 9 on [1/300, 1/1.05])", lambda: remez_odd("1/300", "1/1.05", degree=9), 1.0),
        ("both published tables (paper 8 rows + modded-nanogpt 5)", both_tables, 20.0),
        ("certify ANVIL_MAPS on [1/300, 1/1.05] (+ headroom)", certify(ANVIL_MAPS), 30.0),
        ("certify anvil_express (421 extrema) (+ headroom)", certify(express), 30.0),
        ("full ANVIL-kind derivation (express, optimal, polished; certified)", full, 300.0),
    ]
    from .progress import Progress

    rows, data = [], []
    bar = Progress(len(cases), "bench", enabled=progress)
    for i, (name, fn, target) in enumerate(cases):
        bar.update(i, label=f"bench: {name}")
        t = _time(fn, repeat)
        ok = t < target
        rows.append([name, f"{t:.3f} s", f"< {target:g} s", "ok" if ok else "SLOW"])
        data.append(dict(case=name, seconds=t, target_seconds=target, ok=ok))
    bar.update(len(cases))
    bar.close()
    table = Table("derive_maps benchmark (one CPU core, best of %d)" % repeat,
                  ["case", "time", "target", ""], rows)
    import sys
    sys.stdout.write(dumps({"rows": data}) if fmt == "json" else render([table], fmt))
    return 0 if all(d["ok"] for d in data) else 1
