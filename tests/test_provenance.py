"""anvil_ref.provenance: the commit a record names is the project's own, never another repository's."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from anvil_ref import provenance
from anvil_ref.provenance import source_commit

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


def _commit_seen_by_a_copy(package_parent: Path, cwd: Path) -> str:
    """What source_commit answers for a copy of anvil_ref/provenance.py in ``package_parent/anvil_ref``,
    run from ``cwd`` in a fresh process without ANVIL_COMMIT."""
    (package_parent / "anvil_ref").mkdir(parents=True, exist_ok=True)
    shutil.copy(provenance.__file__, package_parent / "anvil_ref" / "provenance.py")
    (package_parent / "anvil_ref" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "ANVIL_COMMIT"}
    env["PYTHONPATH"] = str(package_parent)
    out = subprocess.run([sys.executable, "-c", "from anvil_ref.provenance import source_commit as s; print(s())"],
                         cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@needs_git
def test_the_checkout_s_own_commit_and_no_commit_for_a_tree_that_differs_from_it(tmp_path):
    repo = tmp_path / "checkout"
    _repo_with_a_commit(repo)
    _commit_seen_by_a_copy(repo, repo)  # the package's files, then committed with it
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "package")
    head = _git(repo, "rev-parse", "HEAD")
    assert _commit_seen_by_a_copy(repo, tmp_path) == head
    (repo / "untracked.txt").write_text("a result not committed yet\n")
    assert _commit_seen_by_a_copy(repo, tmp_path) == head
    (repo / "f.txt").write_text("edited\n")  # a tracked file no longer HEAD's: the tree is no commit
    assert _commit_seen_by_a_copy(repo, tmp_path) == "None"


@needs_git
def test_another_repository_as_working_directory_is_not_recorded(tmp_path):
    other = _repo_with_a_commit(tmp_path / "other")
    package = tmp_path / "outside"  # in no repository
    assert _commit_seen_by_a_copy(package, tmp_path / "other") == "None", other


@needs_git
def test_a_copy_inside_another_repository_records_no_commit(tmp_path):
    # an installed copy of the package in a folder of some project's repository (a virtual
    # environment there): git would answer with that project's commit, which is not the package's
    other = _repo_with_a_commit(tmp_path / "project")
    site = tmp_path / "project" / "venv" / "site"
    assert _commit_seen_by_a_copy(site, tmp_path / "project") == "None", other
