"""Argument types shared by the package's command lines (anvil_ref, anvil_fast, derive_maps, tools/).

Each is an ``argparse`` ``type=``: a value it cannot read raises ``argparse.ArgumentTypeError``, which
argparse prints as one ``usage``/``error:`` line pair with exit status 2 (no traceback). Lists of names
refuse an unknown name rather than dropping it, and name the valid ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def shape_list(ndim: int, *, form: str) -> Callable[[str], list[tuple[int, ...]]]:
    """Comma-separated shapes of ``ndim`` positive integers joined by ``x`` (``form``: how the help
    names them, e.g. ``CHUNKxROWSxCOLS``)."""
    def parse(text: str) -> list[tuple[int, ...]]:
        out = []
        for item in text.split(","):
            parts = item.strip().lower().split("x")
            try:
                shape = tuple(int(p) for p in parts)
            except ValueError:
                shape = ()
            if len(shape) != ndim or min(shape) < 1:
                raise argparse.ArgumentTypeError(
                    f"shape {item.strip()!r}: expected {form} ({ndim} positive integers joined by 'x'), "
                    "comma-separated")
            out.append(shape)
        return out
    parse.__name__ = "shapes"  # argparse names the type in its message when the call fails otherwise
    return parse


def name_list(choices: Iterable[str], *, what: str) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices`` (``what``: the singular noun, e.g. ``family``)."""
    valid = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",")]
        bad = [n for n in names if n not in valid]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what}{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                f"expected a comma-separated subset of: {', '.join(valid)}")
        return names
    parse.__name__ = f"{what} list"
    return parse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def check_device(ap: argparse.ArgumentParser, device: str) -> None:
    """Refuse (``ap.error``: one line, exit 2) a ``--device`` torch cannot parse, or CUDA where there is none."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        ap.error(f"argument --device: expected a torch device such as cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"argument --device: {device!r} asked for, but CUDA is not available here")


def unit_fraction(text: str) -> float:
    """A number in (0, 1] (a ratio of a smaller to a larger positive value)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        return [positive_int(t.strip()) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None


def add_progress_flags(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` into ``progress`` (True / False; None without either: a bar
    in a terminal, a line per stage in a pipe -- :class:`anvil_ref.progress.Progress`)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                   help="draw the progress bar even when stderr is not a terminal")
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                   help="no progress on stderr (default: a bar in a terminal, a line per stage otherwise)")
