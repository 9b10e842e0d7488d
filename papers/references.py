"""The paper's references: entries in papers/data/references.json (each field checked at the
addresses in its ``checked_at``), cited in the template as ``{{cite:key}}`` and numbered in the
order of first citation; the list at the end holds the cited entries alone."""

from __future__ import annotations

import json
from pathlib import Path

FILE = Path(__file__).resolve().parent / "data" / "references.json"


def load(path: Path = FILE) -> dict[str, dict]:
    return json.loads(path.read_text())["entries"]


def _authors(a: list[str]) -> str:
    if not a:
        return ""
    if len(a) > 4:
        return f"{a[0]} et al."
    return ", ".join(a[:-1]) + (" and " if len(a) > 1 else "") + a[-1]


def entry_text(e: dict) -> str:
    """One entry as a line: authors, title, venue and year, then its identifiers."""
    parts = [p for p in (_authors(e.get("authors", [])), f"*{e['title']}*" if e.get("title") else "") if p]
    where = ", ".join(str(x) for x in (e.get("venue"), e.get("year")) if x)
    if where:
        parts.append(where)
    ids = []
    if e.get("arxiv"):
        ids.append(f"arXiv:{e['arxiv']}")
    if e.get("url"):
        ids.append(f"<{e['url']}>")
    text = ". ".join(p.rstrip(".") for p in parts) + "."
    return text + (" " + ", ".join(ids) + "." if ids else "")


def render(order: list[str], entries: dict[str, dict] | None = None) -> str:
    """The numbered list of the entries in ``order`` (their citation order)."""
    entries = load() if entries is None else entries
    if not order:
        return "*(nothing cited)*"
    return "\n".join(f"{i}. [{k}] {entry_text(entries[k])}" for i, k in enumerate(order, 1))


__all__ = ["FILE", "load", "entry_text", "render"]
