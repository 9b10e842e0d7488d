"""Tables rendered from the measurement files in papers/data/ (each file names the command that
wrote it in its ``generated_by`` field). Registered into papers.build's template by name."""

from __future__ import annotations

from collections.abc import Callable

TABLES: dict[str, Callable[[], str]] = {}
