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


def test_readme_measurements_are_marked_measured_and_match_their_logs():
    # a sentence of the README that states a measured count names it as measured, with its log, and
    # the count is the log's
    readme = (ROOT / "README.md").read_text()
    claims = re.findall(r"measured: (\d+) of (\d+) near-rank-1 inputs\s+exploded on an H200, `([^`]+)`", readme)
    assert claims, "the README's near-rank-1 measurement of SAFE"
    for exploded, total, log in claims:
        text = (ROOT / log).read_text()
        m = re.search(r"fast-safe (\d+)/(\d+) exploded", text)
        assert m and (m.group(1), m.group(2)) == (exploded, total), (log, m and m.groups())
    assert "never explodes" not in readme
