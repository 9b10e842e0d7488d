"""anvil_ref.provenance: the commit a record names is the project's own, never another repository's."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from anvil_ref import provenance
from anvil_ref.provenance import PROJECT_ROOT, source_commit

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _repo_with_a_commit(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    (path / "f.txt").write_text("x\n")
    _git(path, "add", "f.txt")
    _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m")
    return _git(path, "rev-parse", "HEAD")


def test_anvil_commit_comes_first(monkeypatch):
    monkeypatch.setenv("ANVIL_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert source_commit() == "0123456789abcdef0123456789abcdef01234567"


@needs_git
def test_another_repository_as_working_directory_is_not_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv("ANVIL_COMMIT", raising=False)
    other = _repo_with_a_commit(tmp_path / "other")
    monkeypatch.chdir(tmp_path / "other")
    got = source_commit()
    assert got != other
    own = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if own.returncode == 0 and Path(own.stdout.strip()).resolve() == PROJECT_ROOT:
        assert got == _git(PROJECT_ROOT, "rev-parse", "HEAD")
    else:  # a copy of the project without its own git (CI's checkout may be one)
        assert got is None


@needs_git
def test_a_copy_inside_another_repository_records_no_commit(tmp_path):
    # an installed copy of the package in a folder of some project's repository (a virtual
    # environment there): git would answer with that project's commit, which is not the package's
    other = _repo_with_a_commit(tmp_path / "project")
    site = tmp_path / "project" / "venv" / "site"
    (site / "anvil_ref").mkdir(parents=True)
    shutil.copy(provenance.__file__, site / "anvil_ref" / "provenance.py")
    (site / "anvil_ref" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "ANVIL_COMMIT"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", "from anvil_ref.provenance import source_commit as s; print(s())"],
                         cwd=tmp_path / "project", env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None", (out.stdout, other)
