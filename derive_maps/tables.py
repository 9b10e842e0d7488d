"""Tables for people and papers: aligned text (default), Markdown, LaTeX, and JSON.

A :class:`Table` holds already formatted cells; the number formats live here so that every output
(terminal, ``papers/data/*.md``, ``*.tex``) prints the same digits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


def sig(x, digits: int = 4) -> str:
    """``x`` with ``digits`` significant digits (``-`` for None, ``inf``/``nan`` spelled out)."""
    if x is None:
        return "-"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def fixed(x, decimals: int = 6) -> str:
    if x is None:
        return "-"
    x = float(x)
    if not math.isfinite(x):
        return sig(x)
    return f"{x:.{decimals}f}"


def pct(x, digits: int = 3) -> str:
    """A relative quantity as a percentage."""
    if x is None:
        return "-"
    return f"{100 * float(x):.{digits}g}%"


def interval(lo, hi, decimals: int = 6) -> str:
    return f"[{fixed(lo, decimals)}, {fixed(hi, decimals)}]"


@dataclass
class Table:
    title: str
    columns: list
    rows: list
    notes: list = field(default_factory=list)

    def text(self) -> str:
        cols = [str(c) for c in self.columns]
        rows = [[str(c) for c in r] for r in self.rows]
        w = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        line = "  ".join("-" * x for x in w)
        out = [self.title, "", "  ".join(c.ljust(w[i]) for i, c in enumerate(cols)), line]
        out += ["  ".join(r[i].rjust(w[i]) if i else r[i].ljust(w[i]) for i in range(len(cols)))
                for r in rows]
        if self.notes:
            out += [""] + list(self.notes)
        return "\n".join(out) + "\n"

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(map(str, self.columns)) + " |",
               "|" + "|".join("---" for _ in self.columns) + "|"]
        out += ["| " + " | ".join(str(c) for c in r) + " |" for r in self.rows]
        if self.notes:
            out += [""] + [f"{n}  " for n in self.notes]
        return "\n".join(out) + "\n"

    def latex(self) -> str:
        def esc(s):
            s = str(s)
            for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"),
                         ("#", r"\#"), ("|", r"$|$")):
                s = s.replace(a, b)
            return s
        spec = "l" + "r" * (len(self.columns) - 1)
        out = [r"\begin{tabular}{" + spec + "}", r"\toprule",
               " & ".join(esc(c) for c in self.columns) + r" \\", r"\midrule"]
        out += [" & ".join(esc(c) for c in r) + r" \\" for r in self.rows]
        out += [r"\bottomrule", r"\end{tabular}"]
        return "\n".join(out) + "\n"


def render(tables, fmt: str) -> str:
    """``fmt``: ``"text"``, ``"markdown"``, ``"latex"``."""
    tables = tables if isinstance(tables, (list, tuple)) else [tables]
    if fmt == "text":
        return "\n".join(t.text() for t in tables)
    if fmt == "markdown":
        return "\n".join(t.markdown() for t in tables)
    if fmt == "latex":
        return "\n".join(t.latex() for t in tables)
    raise ValueError(f"unknown table format {fmt!r}")


def dumps(data, indent: int = 2) -> str:
    """JSON with a stable, compact layout: objects one key per line, lists of scalars on one line
    (so a map set reads one triple per line). Floats are written with ``repr``, which round-trips."""
    def enc(v, level):
        pad = " " * (indent * (level + 1))
        end = " " * (indent * level)
        if isinstance(v, dict):
            if not v:
                return "{}"
            items = [f"{pad}{json.dumps(str(k))}: {enc(x, level + 1)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + end + "}"
        if isinstance(v, (list, tuple)):
            if all(not isinstance(x, (dict, list, tuple)) for x in v):
                return "[" + ", ".join(json.dumps(x, allow_nan=True) for x in v) + "]"
            return "[\n" + ",\n".join(pad + enc(x, level + 1) for x in v) + "\n" + end + "]"
        return json.dumps(v, allow_nan=True)
    return enc(data, 0) + "\n"
