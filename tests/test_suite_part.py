"""tools/suite_part.py: the gpu suite cut into parts for device calls too short to run it whole. The
parts must cover every file once, in pytest's order, and no file may be split."""

from __future__ import annotations

import importlib.util
import io
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("anvil_suite_part_tool", ROOT / "tools" / "suite_part.py")
SP = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SP)


def _ids(counts):
    return [f"tests/{f}.py::t{i}[cuda]" for f, c in counts for i in range(c)]


@pytest.mark.parametrize("counts", [[("a", 10), ("b", 1), ("c", 1), ("d", 10), ("e", 5)],
                                    [(f"f{k}", (7 * k) % 5 + 1) for k in range(23)]])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_parts_cover_every_file_once_in_order(counts, n):
    files = SP.files_in_order(_ids(counts))
    assert files == [(f"tests/{f}.py", c) for f, c in counts]
    parts = SP.split(files, n)
    assert len(parts) == n
    assert [f for p in parts for f in p] == [f for f, _ in files]
    assert all(parts[:len(files)]), parts


def test_the_cut_lands_nearest_the_even_share():
    files = [("a", 10), ("b", 1), ("c", 1), ("d", 10), ("e", 5)]
    # 27 tests in two parts: a cut after c (12 | 15) is nearer 13.5 than one after d (22 | 5)
    assert SP.split(files, 2) == [["a", "b", "c"], ["d", "e"]]
    assert SP.split(files, 1) == [["a", "b", "c", "d", "e"]]


def test_more_parts_than_files_leaves_the_last_empty():
    assert SP.split([("a", 3), ("b", 1)], 3) == [["a"], ["b"], []]


def test_main_prints_the_part(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(_ids([("a", 2), ("b", 2)])) + "\n\n2 tests collected\n"))
    assert SP.main(["2/2"]) == 0
    assert capsys.readouterr().out.split() == ["tests/b.py"]


@pytest.mark.parametrize("arg", ["0/2", "3/2", "x", "1/0", "1-2"])
def test_bad_part_is_named(arg, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("tests/a.py::t\n"))
    with pytest.raises(SystemExit, match="i/n"):
        SP.main([arg])


def test_no_ids_is_an_error(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("no tests ran\n"))
    with pytest.raises(SystemExit, match="no test ids"):
        SP.main(["1/1"])
    with pytest.raises(ValueError, match=">= 1"):
        SP.split([("a", 1)], 0)
