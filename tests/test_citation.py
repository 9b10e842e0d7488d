"""CITATION.cff: what a citing researcher needs, consistent with the package (its version, the
write-up's title, the commit the write-up's H200 training results were produced at) and with the
sources the write-up restates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import anvil_ref

ROOT = Path(__file__).resolve().parents[1]
CFF = ROOT / "CITATION.cff"
COMMIT_FILE = ROOT / "results" / "train" / "logs" / "protocol_commit.txt"


def _text() -> str:
    return CFF.read_text()


def test_version_and_preferred_citation_match_the_package_and_its_write_up():
    text = _text()
    assert re.search(r"^version: (\S+)$", text, re.M).group(1) == anvil_ref.__version__
    pref = text.split("preferred-citation:", 1)[1].split("\nreferences:", 1)[0]
    assert re.search(r"^  type: report$", pref, re.M)
    assert re.search(r"^  version: (\S+)$", pref, re.M).group(1) == anvil_ref.__version__
    title = next(ln for ln in (ROOT / "papers" / "anvil.md").read_text().splitlines() if ln.startswith("# "))[2:]
    assert re.search(r'^  title: "(.*)"$', pref, re.M).group(1) == title


def test_commit_is_the_one_the_training_results_were_produced_at():
    commits = re.findall(r"^\s*commit: \"?([0-9a-f]+)\"?$", _text(), re.M)
    if COMMIT_FILE.is_file():
        recorded = COMMIT_FILE.read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{40}", recorded), f"{COMMIT_FILE} holds {recorded!r}, not a commit hash"
        assert commits and set(commits) == {recorded}, (commits, recorded)
    else:
        assert not commits, "CITATION.cff names a commit, but no H200 training results record one yet"


def test_references_name_the_record_modded_nanogpt_muon_and_polar_express():
    text = _text()
    refs = text.split("\nreferences:", 1)[1]
    titles = re.findall(r'^  - type: \S+\n    title: "(.*)"$', refs, re.M)
    assert any("ANVIL2" in t for t in titles) and "https://github.com/KellerJordan/modded-nanogpt/pull/360" in refs
    assert "modded-nanogpt: Speedrunning the NanoGPT baseline" in titles
    assert "Muon: An optimizer for hidden layers in neural networks" in titles
    assert any(t.startswith("The Polar Express") for t in titles) and "arxiv.org/abs/2505.16932" in refs
    # every reference has authors (as its source names them)
    for block in refs.split("\n  - type: ")[1:]:
        assert "\n    authors:\n" in block, block.splitlines()[0]


def test_the_file_is_valid_yaml_with_the_cff_keys():
    yaml = pytest.importorskip("yaml")
    d = yaml.safe_load(_text())
    assert d["cff-version"] == "1.2.0" and d["version"] == anvil_ref.__version__
    assert {"title", "authors", "preferred-citation", "references", "message"} <= set(d)
    assert all({"type", "title", "authors"} <= set(r) for r in d["references"])
