"""A tiny progress bar on stderr (no dependencies).

It draws only when stderr is a terminal (or when forced with ``enabled=True``, as the command
line's ``--progress`` does), and only once the work has run for ``delay`` seconds, so quick calls
and test runs stay silent. Redraws are throttled to ten a second.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total, "certify") as bar: ... bar.update(k)`` draws ``[####....]  40% certify``."""

    def __init__(self, total: float, label: str = "", *, enabled: bool | None = None,
                 stream: TextIO | None = None, width: int = 30, delay: float = 1.0) -> None:
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.total = max(float(total), 1e-300)
        self.label = label
        self.width = width
        self.delay = delay
        self.done = 0.0
        self._t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, done: float | None = None, *, advance: float = 0.0, label: str | None = None) -> None:
        """Set the amount done (or advance it) and redraw if due."""
        self.done = self.done + advance if done is None else float(done)
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._t0 < self.delay or (now - self._last < 0.1 and self.done < self.total):
            return
        self._last = now
        frac = min(max(self.done / self.total, 0.0), 1.0)
        fill = int(round(frac * self.width))
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:3.0f}% "
                          f"{self.label[:50]:<50} {now - self._t0:6.1f}s")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            if self.done < self.total:
                self._last = 0.0
                self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
