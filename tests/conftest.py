"""Test session setup shared by all test files.

* ``gpu`` marker: tests that need a CUDA device are skipped without one.
* ``triton_dev`` fixture: a test of the Triton kernels that takes it runs twice -- on CPU through
  Triton's interpreter (``interpreter``: CI; skipped where the interpreter is off, i.e. with CUDA)
  and on CUDA (``cuda``, carrying the ``gpu`` marker, so ``pytest -m gpu`` runs it on the GPU).
* Without CUDA, Triton kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be set
  before any kernel module is imported, so it is set here (conftest is imported first). The library
  itself never runs the interpreter on its own: CPU tensors take the plain-torch path unless a test
  asks for ``backend="triton"`` (see anvil_fast/kernels/gram.py and anvil_fast/kernels/backend.py).
* ``ANVIL_TEST_FAILURES=FILE``: each failing test's report is appended to FILE when it fails, so a run
  stopped by a time limit (a device call) still says why a test failed; pytest itself prints the
  reports only at the end.
"""

from __future__ import annotations

import os

import pytest


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


HAS_CUDA = _cuda()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


from anvil_fast.kernels.backend import interpreting as _interpreting  # noqa: E402  (after TRITON_INTERPRET is set)
from anvil_fast.kernels.backend import triton_available as _triton  # noqa: E402


@pytest.fixture(params=[
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        not (_triton() and _interpreting()), reason="Triton's interpreter is off here (TRITON_INTERPRET unset: CUDA)")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _triton(), reason="needs Triton")]),
])
def triton_dev(request) -> str:
    return request.param


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("ANVIL_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
