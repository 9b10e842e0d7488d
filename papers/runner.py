"""Many training runs at once on one machine: ``jobs`` worker processes (``spawn``ed, so none
inherits the parent's CUDA state), each taking one run at a time, and the scheduling loop around
them (:func:`run_all`) with its time budget.

Why processes on one GPU: a small model's step is bound by the host (Python, kernel launches), so
one run leaves the GPU mostly idle; runs in separate processes overlap their host work and queue
their kernels side by side. A run's result does not depend on how many run at once: every run
seeds its own initialization and batches, sets the same number of CPU threads (``threads``) and
shares nothing with the others but the device. Its timings do depend on it, and the runs say so
(``timing_comparable``).

The loop: ``ready()`` returns the runs that may start now (it is asked again after every finished
run, so a run may depend on earlier results); a free worker takes the first of them, preferring
one whose contender it has already run (its compiled kernels are loaded); a run starts only when
the time spent plus its estimated duration (``estimate(spec)``) fits in the budget, and at the
budget every run still going is stopped, its result lost, every finished one kept. A worker whose
run raises reports the traceback and goes on; a worker that dies is replaced.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field


def _loop(conn_in, conn_out, init: Callable, init_arg, target: Callable) -> None:
    parent = os.getppid()
    try:
        state = init(init_arg)
    except BaseException:  # noqa: BLE001 (reported to the parent, which decides)
        conn_out.send((None, None, traceback.format_exc()))
        return
    while True:
        if not conn_in.poll(5.0):
            if os.getppid() != parent:  # the parent is gone (killed): nothing will collect a result
                return
            continue
        try:
            spec = conn_in.recv()
        except EOFError:
            return
        if spec is None:
            return
        try:
            rec = target(state, spec)
        except BaseException:  # noqa: BLE001
            conn_out.send((spec["id"], None, traceback.format_exc()))
        else:
            conn_out.send((spec["id"], rec, None))


class Pool:
    """``jobs`` processes running ``target(init(init_arg), spec)`` for the specs submitted to them.

    Each worker has its own pipes (no queue shared between workers, whose lock a dying worker could
    leave taken). The processes are not daemonic (a daemonic process may not start the compile
    workers torch.compile uses); :meth:`stop` ends them, and a worker whose parent is gone ends
    itself."""

    #: restarts of a worker that died with no run to report (a start-up that keeps failing)
    MAX_IDLE_RESTARTS = 2

    def __init__(self, jobs: int, init: Callable, init_arg, target: Callable):
        self.ctx = mp.get_context("spawn")
        self.args = (init, init_arg, target)
        self.workers: list = [None] * jobs
        self.send: list = [None] * jobs
        self.recv: list = [None] * jobs
        self.busy: dict[int, dict] = {}
        self.idle_restarts = [0] * jobs
        for i in range(jobs):
            self._start(i)

    def _start(self, i: int) -> None:
        r_in, self.send[i] = self.ctx.Pipe(duplex=False)
        self.recv[i], w_out = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_loop, args=(r_in, w_out, *self.args), daemon=False)
        p.start()
        r_in.close()
        w_out.close()
        self.workers[i] = p

    def idle(self) -> list[int]:
        return [i for i, p in enumerate(self.workers) if i not in self.busy and p is not None]

    def submit(self, i: int, spec: dict) -> None:
        self.busy[i] = spec
        self.send[i].send(spec)

    def collect(self, timeout: float) -> list[tuple[int, dict, dict | None, str | None]]:
        """Finished runs: (worker, spec, record or None, traceback or None); waits up to ``timeout``."""
        out = []
        conns = {id(self.recv[i]): i for i, p in enumerate(self.workers) if p is not None}
        live = [self.recv[i] for i in conns.values()]
        for c in mp.connection.wait(live, timeout=max(timeout, 0.0)):
            i = conns[id(c)]
            try:
                _, rec, err = c.recv()
            except (EOFError, OSError):
                continue  # the worker is gone: found below
            spec = self.busy.pop(i, None)
            if spec is not None:
                out.append((i, spec, rec, err))
        for i, p in enumerate(self.workers):
            if p is None or p.is_alive():
                continue
            p.join()
            if i in self.busy:
                out.append((i, self.busy.pop(i), None, f"worker {i} exited with code {p.exitcode} during the run"))
            elif self.idle_restarts[i] >= self.MAX_IDLE_RESTARTS:
                self.workers[i] = None  # retired: its start-up keeps failing
                continue
            else:
                self.idle_restarts[i] += 1
            self._start(i)
        return out

    def stop(self, *, now: bool = False) -> None:
        live = [(i, p) for i, p in enumerate(self.workers) if p is not None]
        for i, p in live:
            if now or i in self.busy:
                p.terminate()
            else:
                try:
                    self.send[i].send(None)
                except (BrokenPipeError, OSError):
                    p.terminate()
        for _, p in live:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


@dataclass
class Outcome:
    done: list = field(default_factory=list)        # records of finished runs
    failed: list = field(default_factory=list)      # (spec, traceback)
    not_started: list = field(default_factory=list)  # specs the budget left out
    stopped: list = field(default_factory=list)     # specs stopped at the budget


def run_all(ready: Callable[[], list[dict]], *, jobs: int, execute: Callable, init: Callable, init_arg,
            on_done: Callable[[dict, dict], None], on_failed: Callable[[dict, str], None],
            estimate: Callable[[dict], float], deadline: float | None, log: Callable[[str], None] = print,
            clock: Callable[[], float] = time.perf_counter) -> Outcome:
    """The scheduling loop of the module docstring. ``execute(state, spec)`` runs one spec in a
    process whose ``state = init(init_arg)``; with ``jobs == 1`` that process is this one."""
    out = Outcome()
    seen: set[str] = set()          # started, finished, failed or left out
    warmed: dict[int, set[str]] = {}
    pool = Pool(jobs, init, init_arg, execute) if jobs > 1 else None
    state = None

    def pick(cands: list[dict], w: int) -> dict:
        if cands[0].get("repeat") is not None:  # repeated timings keep their interleaved order
            return cands[0]
        mine = [s for s in cands if s["contender"] in warmed.get(w, ())]
        # affinity only among runs of the same kind as the most urgent one (a sweep run that others
        # wait for is never passed over for a long run of a warmed contender)
        mine = [s for s in mine if s.get("role") == cands[0].get("role")]
        return mine[0] if mine else cands[0]

    try:
        while True:
            now = clock()
            if deadline is not None and now >= deadline and pool is not None and pool.busy:
                out.stopped += list(pool.busy.values())
                log(f"time budget reached: {len(pool.busy)} run(s) stopped: "
                    + " ".join(s["name"] for s in pool.busy.values()))
                pool.stop(now=True)
                pool = None
                break
            cands = [s for s in ready() if s["id"] not in seen]
            free = pool.idle() if pool is not None else [0]
            for w in free:
                while cands:
                    s = pick(cands, w)
                    cands.remove(s)
                    est = estimate(s)
                    if deadline is not None and clock() + est > deadline:
                        seen.add(s["id"])
                        out.not_started.append(s)
                        log(f"not started: {s['name']} (~{est:.0f} s would pass the budget by "
                            f"{clock() + est - deadline:.0f} s)")
                        continue
                    seen.add(s["id"])
                    warmed.setdefault(w, set()).add(s["contender"])
                    if pool is not None:
                        pool.submit(w, s)
                        break
                    try:
                        if state is None:
                            state = init(init_arg)
                        rec = execute(state, s)
                    except Exception:  # noqa: BLE001 (a failed run is reported, the others go on)
                        err = traceback.format_exc()
                        out.failed.append((s, err))
                        on_failed(s, err)
                    else:
                        out.done.append(rec)
                        on_done(s, rec)
                    break
            if pool is None:
                if not [s for s in ready() if s["id"] not in seen]:
                    break
                continue
            if not pool.busy:
                if not pool.idle() or not [s for s in ready() if s["id"] not in seen]:
                    break
                continue
            wait = 1.0 if deadline is None else min(1.0, max(deadline - clock(), 0.0))
            for _, spec, rec, err in pool.collect(wait):
                if err is not None:
                    out.failed.append((spec, err))
                    on_failed(spec, err)
                else:
                    out.done.append(rec)
                    on_done(spec, rec)
    finally:
        if pool is not None:  # the normal end (nothing busy) or an exception (SIGTERM, Ctrl-C): stop the workers
            pool.stop(now=bool(pool.busy))
    return out
