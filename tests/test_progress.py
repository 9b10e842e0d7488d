"""anvil_ref.progress: a bar in a terminal, a line per stage in a pipe, silence for quick work."""

import io
import time

from anvil_ref.progress import Progress


def test_draws_when_enabled_and_finishes_the_line():
    s = io.StringIO()
    with Progress(10, "work", enabled=True, stream=s, delay=0.0) as bar:
        for k in range(10):
            bar.update(k + 1)
    text = s.getvalue()
    assert "[" in text and "100%" in text and "work" in text and text.endswith("\n")


def test_a_pipe_gets_one_line_per_stage_and_a_closing_line():
    s = io.StringIO()          # StringIO is not a tty: auto mode writes lines, no carriage returns
    with Progress(3, "stage a", stream=s, delay=0.0) as bar:
        bar.update(0, label="stage a")
        bar.update(1, label="stage b")
        bar.update(1, label="stage b")   # same stage: no second line
        bar.update(2, label="stage c")
        bar.update(3)
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue()
    assert [ln.split(":")[0] for ln in lines] == ["stage a", "stage b", "stage c", "stage c"], lines
    assert "33%" in lines[1] and lines[-1].startswith("stage c: done after")


def test_a_pipe_hears_of_a_long_first_stage_before_it_ends():
    s = io.StringIO()
    bar = Progress(2, "first stage", stream=s, delay=0.05)
    deadline = time.monotonic() + 5.0
    while "first stage" not in s.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)     # the work: no update arrives, the timer names the stage
    bar.close()
    bar.close()              # closing twice writes one closing line
    lines = s.getvalue().splitlines()
    assert lines[0].startswith("first stage:   0% after"), lines
    assert lines[1].startswith("first stage: done after") and len(lines) == 2, lines


def test_silent_when_disabled():
    s = io.StringIO()
    with Progress(3, "quiet", enabled=False, stream=s, delay=0.0) as bar:
        bar.update(3, label="other")
    assert s.getvalue() == ""


def test_silent_for_quick_work():
    for enabled in (True, None):
        s = io.StringIO()
        with Progress(3, "fast", enabled=enabled, stream=s, delay=60.0) as bar:
            bar.update(3, label="next")
        assert s.getvalue() == ""


def test_a_detail_rides_along_but_is_no_stage():
    s = io.StringIO()
    with Progress(3, "polish", stream=s, delay=0.0) as bar:
        for k, e in enumerate((3e-5, 2e-5, 1e-5)):
            bar.update(k, detail=f"E = {e:g}")
    lines = s.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("polish: E = 1e-05: done after"), lines


def test_a_command_lines_choice_reaches_nested_bars():
    from anvil_ref.progress import default_enabled

    s = io.StringIO()
    with default_enabled(False):
        with Progress(2, "inner", stream=s, delay=0.0) as bar:   # a library call's bar: enabled=None
            bar.update(1, label="inner: next")
    assert s.getvalue() == ""
    with default_enabled(True):
        assert Progress(1, "inner", stream=s, delay=0.0).mode == "bar"
        assert Progress(1, "inner", stream=s, delay=0.0, enabled=False).mode == "off"
    restored = Progress(1, "inner", stream=s, delay=60.0)
    assert restored.mode == "lines"   # the default is back after the block
    restored.close()
