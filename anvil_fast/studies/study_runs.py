"""The JSON record a multi-rank study writes beside its markdown table, which the cost model reads.

``python -m anvil_fast.studies.scaling gpu --out T.md`` and ``python -m anvil_fast.studies.train_step --out T.md``
write ``T.json`` too (:func:`record_path`). Schema (one object)::

    {"format": "anvil_fast.scaling/1" | "anvil_fast.train_step/1",
     "command": "<the command line that produced the run>",
     "rows": {"<ranks>": {<column>: <number>, ...}, ...}}

with the columns of :data:`COLUMNS` for the format, the times in ms (the slowest rank's):

* ``anvil_fast.scaling/1``: ``step_ms`` (with comms), ``nocomm_ms`` (comms skipped), ``comm_ms``
  (collectives alone), ``anvil_only_ms``;
* ``anvil_fast.train_step/1``: ``batch`` (per rank), ``prehook_ms``, ``end_ms``, ``sequential_ms``,
  ``nocomm_ms``, ``comm_ms``.

The records of runs stored as markdown alone are made by ``python tools/run_tables_to_json.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Format names are fixed strings, not module paths: a record keeps the name it was written under.
SCALING = "anvil_fast.scaling/1"
TRAIN_STEP = "anvil_fast.train_step/1"
#: The columns every row of a record of each format holds.
COLUMNS = {SCALING: ("step_ms", "nocomm_ms", "comm_ms", "anvil_only_ms"),
           TRAIN_STEP: ("batch", "prehook_ms", "end_ms", "sequential_ms", "nocomm_ms", "comm_ms")}


def record_path(table_path: str | os.PathLike) -> Path:
    """Where the record of the table written to ``table_path`` lies: the same name, ``.json``."""
    return Path(table_path).with_suffix(".json")


def check_record(rec: dict, fmt: str, where: str = "record") -> dict:
    if not isinstance(rec, dict) or rec.get("format") != fmt:
        got = rec.get("format") if isinstance(rec, dict) else None
        raise ValueError(f"{where}: not a {fmt!r} record (format {got!r})")
    rows = rec.get("rows")
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"{where}: no rows")
    for w, row in rows.items():
        missing = [c for c in COLUMNS[fmt] if c not in row]
        if not w.isdigit() or missing:
            raise ValueError(f"{where}: row {w!r} lacks {missing or 'a rank count'}")
    return rec


def write_record(table_path: str | os.PathLike, fmt: str, command: str, rows: dict[int, dict]) -> Path:
    """Write the record of the table at ``table_path`` (:func:`record_path`); ``rows``: ranks ->
    the format's columns."""
    rec = check_record(dict(format=fmt, command=command,
                            rows={str(w): {c: row[c] for c in COLUMNS[fmt]} for w, row in sorted(rows.items())}),
                       fmt, str(table_path))
    path = record_path(table_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def read_record(path: str | os.PathLike, fmt: str) -> dict:
    """A record as ``{"path", "command", "rows": {ranks (int): {column: number}}}``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such record (the study writes it beside its --out table)")
    try:
        rec = json.loads(p.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path}: not JSON; a study's record is the .json beside its table") from None
    rec = check_record(rec, fmt, str(path))
    rows = {int(w): {c: (int(v) if c == "batch" else float(v)) for c, v in row.items()}
            for w, row in rec["rows"].items()}
    return dict(path=str(path), command=rec.get("command", ""), rows=rows)


__all__ = ["SCALING", "TRAIN_STEP", "COLUMNS", "record_path", "check_record", "write_record", "read_record"]
