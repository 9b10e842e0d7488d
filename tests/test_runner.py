"""papers.runner: runs in worker processes (a raising run and a dying worker leave the others
running), runs that become ready as others finish, the time budget (runs left out, runs stopped),
the in-process path."""

from __future__ import annotations

import time

from papers import runner as R
from tests import runner_targets as W


def _spec(i, **kw):
    return {"id": f"s{i}", "name": f"s{i}", "contender": kw.pop("contender", "c"), "role": "sweep", "v": i, **kw}


def _run(specs, *, jobs, deadline=None, estimate=lambda s: 0.0, init_arg="x", after=None):
    done, failed = [], []
    after = after or {}

    def ready():
        have = {r["id"] for r in done}
        return [s for s in specs if all(d in have for d in after.get(s["id"], ()))]

    out = R.run_all(ready, jobs=jobs, execute=W.run, init=W.init, init_arg=init_arg,
                    on_done=lambda s, r: done.append(r), on_failed=lambda s, e: failed.append((s["id"], e)),
                    estimate=estimate, deadline=deadline, log=lambda m: None)
    return out, done, failed


def test_workers_survive_a_raising_run_and_replace_a_dead_worker():
    specs = [_spec(1), _spec(2, raise_=True), _spec(3, die=True), _spec(4), _spec(5), _spec(6)]
    for s in specs:
        if s.pop("raise_", False):
            s["raise"] = True
    # s6 becomes ready only once s1 and s5 are done
    out, done, failed = _run(specs, jobs=2, after={"s6": ("s1", "s5")})
    assert sorted(r["id"] for r in done) == ["s1", "s4", "s5", "s6"]
    assert {r["id"]: r["double"] for r in done} == {"s1": 2, "s4": 8, "s5": 10, "s6": 12}
    errs = dict(failed)
    assert set(errs) == {"s2", "s3"} and "ValueError: spec s2 asked to fail" in errs["s2"]
    assert "exited with code 3" in errs["s3"]
    assert all(r["arg"] == "x" for r in done)
    assert not out.not_started and not out.stopped
    # the first two runs go to the two workers at once and kill both: the rest can only finish in
    # their replacements
    specs = [_spec(1, die=True), _spec(2, die=True), _spec(3), _spec(4), _spec(5)]
    out, done, failed = _run(specs, jobs=2)
    assert sorted(r["id"] for r in done) == ["s3", "s4", "s5"]
    assert sorted(e for e, _ in failed) == ["s1", "s2"] and all("exited with code 3" in m for _, m in failed)
    assert not out.not_started and not out.stopped


def test_the_budget_leaves_runs_out_and_stops_the_ones_going():
    t0 = time.perf_counter()
    specs = [_spec(1, sleep=60.0), _spec(2, sleep=60.0), _spec(3)]
    # s3 is estimated to take longer than the budget: never started; s1 and s2 are stopped at the budget
    out, done, failed = _run(specs, jobs=3, deadline=time.perf_counter() + 8.0,
                             estimate=lambda s: 100.0 if s["id"] == "s3" else 0.0)
    assert time.perf_counter() - t0 < 40
    assert not done and not failed
    assert [s["id"] for s in out.not_started] == ["s3"]
    assert sorted(s["id"] for s in out.stopped) == ["s1", "s2"]


def test_a_worker_that_cannot_start_fails_its_runs_and_retires():
    out, done, failed = _run([_spec(1), _spec(2)], jobs=1 + 1, init_arg="fail")
    assert not done and sorted(i for i, _ in failed) == ["s1", "s2"]
    assert all("this worker cannot start" in e for _, e in failed)


def test_in_process_path_runs_in_order_and_respects_the_budget():
    specs = [_spec(1), _spec(2, raise_=True), _spec(3)]
    specs[1]["raise"] = True
    out, done, failed = _run(specs, jobs=1, deadline=time.perf_counter() + 30.0,
                             estimate=lambda s: 1000.0 if s["id"] == "s3" else 0.0)
    assert [r["id"] for r in done] == ["s1"] and [i for i, _ in failed] == ["s2"]
    assert [s["id"] for s in out.not_started] == ["s3"]
