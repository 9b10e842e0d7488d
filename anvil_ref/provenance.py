"""The commit a run is made at, for the records every measuring command writes (no dependencies).

``$ANVIL_COMMIT`` comes first: whoever copies the tree to a machine without its history (the GPU
machines get a copy whose own git may answer with another commit) states the commit it is. Otherwise
git is asked in the checkout that holds this package, and only when that folder is the top of its own
work tree: an installed copy inside some other repository (a virtual environment in a project's
folder) or a command started from another repository's folder must not record that repository's commit.
Nor is a commit recorded when a tracked file differs from it: the measured tree is then no commit (a
copy whose git history is older than its files, edits not yet committed). Untracked files do not count.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: The folder holding the project's packages (anvil_ref, anvil_fast, papers, ...).
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    """git's output in :data:`PROJECT_ROOT`, stripped (maybe empty); None where git failed or is absent."""
    try:
        out = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_commit() -> str | None:
    """``$ANVIL_COMMIT`` where set; else ``git rev-parse HEAD`` of the checkout holding this package
    when that checkout's top is :data:`PROJECT_ROOT` and its tracked files are HEAD's; else None (an
    installed package, no git, a tree that is no commit)."""
    if os.environ.get("ANVIL_COMMIT"):
        return os.environ["ANVIL_COMMIT"]
    top = _git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != PROJECT_ROOT:
        return None
    if _git("status", "--porcelain", "--untracked-files=no") != "":
        return None  # a tracked file differs from HEAD, or git failed
    return _git("rev-parse", "HEAD") or None
