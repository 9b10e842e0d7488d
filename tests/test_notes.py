"""anvil_fast/NOTES.md quotes measurements: every line of its fenced blocks must appear verbatim in one of
the H200 logs under results/ (numbers in docs are copied from generated output, never typed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_notes_quote_the_logs_verbatim():
    notes = (ROOT / "anvil_fast" / "NOTES.md").read_text()
    logs = "\n".join(p.read_text() for p in sorted((ROOT / "results").rglob("*.log")))
    quoted = [line for block in re.findall(r"```\n(.*?)```", notes, flags=re.S) for line in block.splitlines()]
    assert quoted
    missing = [line for line in quoted if line.strip() and line not in logs]
    assert not missing, missing
