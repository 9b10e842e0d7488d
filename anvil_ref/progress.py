"""Progress of a long run on stderr (no dependencies): a bar in a terminal, a line per stage in a pipe.

In a terminal (or when forced with ``enabled=True``, as the command lines' ``--progress`` does) it
draws a bar, redrawn at most ten times a second. When stderr is not a terminal (a pipe, a log file,
CI) a bar's carriage returns would pile up, so it writes one line whenever the stage (the label)
changes, and one when the work ends; a ``detail`` (an iteration's error, a level of a bisection)
rides along on those lines and on the bar but is no stage of its own. ``enabled=False`` silences
both. Either way nothing is written before the work has run for ``delay`` seconds (default
:data:`DELAY`), so quick calls and test runs stay silent.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

#: Seconds of work before anything is written (the default of ``Progress(delay=...)``).
DELAY = 1.0

_default_enabled: bool | None = None


@contextlib.contextmanager
def default_enabled(enabled: bool | None) -> Iterator[None]:
    """Within the block, a Progress made with ``enabled=None`` takes ``enabled``: a command line's
    ``--progress`` / ``--no-progress`` reaches the bars of every library call it makes, however deep."""
    global _default_enabled
    old, _default_enabled = _default_enabled, enabled
    try:
        yield
    finally:
        _default_enabled = old


class Progress:
    """``with Progress(total, "certify") as bar: ... bar.update(k)`` draws ``[####....]  40% certify``
    in a terminal and writes ``certify: 40% after 3.1 s`` per stage into a pipe."""

    def __init__(self, total: float, label: str = "", *, enabled: bool | None = None,
                 stream: TextIO | None = None, width: int = 30, delay: float | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            enabled = _default_enabled
        if enabled is None:
            self.mode = "bar" if bool(getattr(self.stream, "isatty", lambda: False)()) else "lines"
        else:
            self.mode = "bar" if enabled else "off"
        self.enabled = self.mode != "off"
        self.total = max(float(total), 1e-300)
        self.label = label
        self.detail = ""
        self.width = width
        self.delay = DELAY if delay is None else delay
        self.done = 0.0
        self._t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self._line_label: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._timer = None
        if self.mode == "lines":
            # names the running stage once the delay has passed, even if the first stage is long and
            # reports nothing before it ends
            self._timer = threading.Timer(self.delay, self._announce)
            self._timer.daemon = True
            self._timer.start()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, done: float | None = None, *, advance: float = 0.0, label: str | None = None,
               detail: str | None = None) -> None:
        """Set the amount done (or advance it), optionally name the stage now running (``label``) or
        how it is going (``detail``), and redraw if due."""
        self.done = self.done + advance if done is None else float(done)
        if label is not None:
            self.label = label
        if detail is not None:
            self.detail = detail
        if self.mode == "off":
            return
        now = time.monotonic()
        if now - self._t0 < self.delay:
            return
        if self.mode == "lines":
            with self._lock:
                if self.label != self._line_label and not self._closed:
                    self._line(now)
            return
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self._frac()
        fill = int(round(frac * self.width))
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:3.0f}% "
                          f"{self._text()[:50]:<50} {now - self._t0:6.1f}s")
        self.stream.flush()
        self._drawn = True

    def _announce(self) -> None:
        with self._lock:
            if not self._closed and self._line_label is None:
                self._line(time.monotonic())

    def _text(self) -> str:
        return f"{self.label}: {self.detail}" if self.detail else self.label

    def _frac(self) -> float:
        return min(max(self.done / self.total, 0.0), 1.0)

    def _line(self, now: float, *, end: bool = False) -> None:
        what = "done" if end else f"{100 * self._frac():3.0f}%"
        self.stream.write(f"{self._text()}: {what} after {now - self._t0:.1f} s\n")
        self.stream.flush()
        self._line_label = self.label
        self._drawn = True

    def close(self) -> None:
        """Finish the bar's line, or write the pipe's closing line (once; again is a no-op)."""
        if self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
        now = time.monotonic()
        if self.mode == "lines":
            if self._line_label is not None:
                self._line(now, end=True)
        elif self._drawn:
            if self.done < self.total:
                self._last = 0.0
                self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
