"""One part of the gpu-marked suite, for a device call too short to run it whole.

    python -m pytest --collect-only -q -m gpu tests/ | python tools/suite_part.py 2/3

reads pytest's collected test ids on standard input and prints the test files of part ``i`` of ``n``:
the files in pytest's order, cut into ``n`` runs of consecutive files whose test counts are as even as
whole files allow (a file is never split, so a module-scoped fixture still runs once). Run the parts
one call each, ``1/n`` .. ``n/n``; together they are the whole suite, each file in exactly one part.
"""

from __future__ import annotations

import sys


def files_in_order(ids: list[str]) -> list[tuple[str, int]]:
    """(file, number of its tests) for each file of the collected ids ``path::name[...]``, first seen first."""
    counts: dict[str, int] = {}
    for line in ids:
        line = line.strip()
        if "::" not in line:
            continue
        f = line.split("::", 1)[0]
        counts[f] = counts.get(f, 0) + 1
    return list(counts.items())


def split(files: list[tuple[str, int]], n: int) -> list[list[str]]:
    """``files`` cut into ``n`` consecutive runs: part ``j`` (from 1) ends where the cumulative count
    comes nearest ``j / n`` of the total, and no part is left empty while files remain for it."""
    if n < 1:
        raise ValueError(f"the number of parts must be >= 1, got {n}")
    total = sum(c for _, c in files)
    parts: list[list[str]] = [[] for _ in range(n)]
    seen, j = 0, 0
    for k, (f, c) in enumerate(files):
        target = total * (j + 1) / n
        # cut before this file when that lands nearer the target than taking it would, or when the
        # files left (this one included) are only enough for one per later part
        if j < n - 1 and parts[j] and (seen + c - target > target - seen or len(files) - k <= n - 1 - j):
            j += 1
        parts[j].append(f)
        seen += c
    return parts


def parse_part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"suite_part: expected a part as i/n (e.g. 2/3), got {text!r}") from None
    if not 1 <= i <= n:
        raise SystemExit(f"suite_part: expected 1 <= i <= n in i/n, got {text!r}")
    return i, n


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: pytest --collect-only -q -m gpu tests/ | python tools/suite_part.py i/n")
    i, n = parse_part(argv[0])
    files = files_in_order(sys.stdin.read().splitlines())
    if not files:
        raise SystemExit("suite_part: no test ids (path::name) on standard input")
    print(" ".join(split(files, n)[i - 1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
