"""The paper's markdown tables: one writer, shared by the section generators and ``papers.build``
(a leaf module, so a generator never imports the build that calls it)."""

from __future__ import annotations


def md_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


__all__ = ["md_table"]
