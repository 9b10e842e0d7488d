"""derive_maps.progress: the tiny progress bar."""

import io

from derive_maps.progress import Progress


def test_draws_when_enabled_and_finishes_the_line():
    s = io.StringIO()
    with Progress(10, "work", enabled=True, stream=s, delay=0.0) as bar:
        for k in range(10):
            bar.update(k + 1)
    text = s.getvalue()
    assert "[" in text and "100%" in text and "work" in text and text.endswith("\n")


def test_silent_when_not_a_terminal():
    s = io.StringIO()          # StringIO is not a tty: auto mode stays silent
    with Progress(3, "quiet", stream=s, delay=0.0) as bar:
        bar.update(3)
    assert s.getvalue() == ""


def test_silent_for_quick_work():
    s = io.StringIO()
    with Progress(3, "fast", enabled=True, stream=s, delay=60.0) as bar:
        bar.update(3)
    assert s.getvalue() == ""
