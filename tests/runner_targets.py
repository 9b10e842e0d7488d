"""What the worker processes of tests/test_runner.py run (a module a spawned process can import,
light enough that starting one costs little)."""

from __future__ import annotations

import os
import time


def init(arg):
    if arg == "fail":
        raise RuntimeError("this worker cannot start")
    return {"arg": arg, "pid": os.getpid()}


def run(state, spec):
    if spec.get("raise"):
        raise ValueError(f"spec {spec['id']} asked to fail")
    if spec.get("die"):
        os._exit(3)
    time.sleep(spec.get("sleep", 0.0))
    return {"id": spec["id"], "double": 2 * spec["v"], "pid": state["pid"], "arg": state["arg"],
            "run_wall_s": spec.get("sleep", 0.0)}
