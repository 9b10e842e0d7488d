"""tests/conftest.py's ANVIL_TEST_FAILURES: a failing test's report is written when it fails, not only
in pytest's closing summary, which a run stopped by a device call's time limit never prints."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_each_failure_is_written_as_it_happens(tmp_path):
    mod = tmp_path / "test_sample.py"
    mod.write_text(
        "import pytest, time\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('fixture broke')\n"
        "def test_ok():\n"
        "    pass\n"
        "def test_bad():\n"
        "    assert 1 + 1 == 3, 'arithmetic'\n"
        "def test_setup(broken):\n"
        "    pass\n"
        "def test_hangs():\n"
        "    open(__file__ + '.reached', 'w').close()\n"
        "    time.sleep(600)\n")
    log = tmp_path / "failures.txt"
    env = dict(os.environ, ANVIL_TEST_FAILURES=str(log))
    # the run is killed inside its last test, as a time limit would: the report must already be there
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                             str(mod)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reached = pathlib.Path(str(mod) + ".reached")
    try:
        for _ in range(1200):
            if reached.exists():
                break
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
        assert reached.exists(), proc.stdout.read().decode() if proc.poll() is not None else "never reached"
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert "test_sample.py::test_bad (call)" in text
    assert "arithmetic" in text
    assert "test_setup (setup)" in text and "fixture broke" in text
    assert "test_ok" not in text and "test_hangs" not in text
