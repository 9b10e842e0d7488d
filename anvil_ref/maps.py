"""Map sets: checking a sequence of odd quintics, and loading one by name or from a JSON file.

A map set is a sequence of ``(a, b, c)`` triples, each the odd quintic ``p(s) = a*s + b*s**3 + c*s**5``.
Besides literal sequences, every function that takes ``maps=`` in anvil_ref and anvil_fast accepts

* a name: ``"anvil"`` (ANVIL_MAPS, record #360) or the stem of a JSON file in
  ``anvil_ref/map_sets/`` (written by ``python -m derive_maps``), e.g. ``"polar_express"``;
* a path to a JSON file (anything ending in ``.json``) holding ``{"maps": [[a, b, c], ...]}``, as
  ``python -m derive_maps derive --json`` writes it.

so a new schedule can be tried without editing code.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from ._arrays import ReferenceInputError
from .constants import ANVIL_MAPS

Maps = tuple[tuple[float, float, float], ...]
MapsLike = Union[str, os.PathLike, Sequence[Sequence[float]]]

#: Folder of the named map sets shipped with the package.
MAP_SETS_DIR = Path(__file__).with_name("map_sets")


def validate_maps(maps: Sequence[Sequence[float]]) -> Maps:
    """``maps`` as a tuple of float triples; raise ReferenceInputError unless it is a non-empty
    sequence of length-3 sequences of finite real numbers."""
    if isinstance(maps, (str, bytes)) or not isinstance(maps, Sequence):
        raise ReferenceInputError(f"maps: expected a sequence of (a, b, c) triples, got {type(maps).__name__}")
    if len(maps) == 0:
        raise ReferenceInputError("maps: expected at least one (a, b, c) triple, got none")
    out = []
    for k, triple in enumerate(maps):
        if isinstance(triple, (str, bytes)) or not isinstance(triple, Sequence) or len(triple) != 3:
            raise ReferenceInputError(f"maps[{k}]: expected an (a, b, c) triple, got {triple!r}")
        try:
            a, b, c = (float(v) for v in triple)
        except (TypeError, ValueError):
            raise ReferenceInputError(f"maps[{k}]: coefficients must be real numbers, got {triple!r}") from None
        if not all(math.isfinite(v) for v in (a, b, c)):
            raise ReferenceInputError(f"maps[{k}]: coefficients must be finite, got {(a, b, c)}")
        out.append((a, b, c))
    return tuple(out)


def available_map_sets() -> list[str]:
    """Names that :func:`load_maps` accepts."""
    names = {"anvil"} | {p.stem for p in MAP_SETS_DIR.glob("*.json")}
    return sorted(names)


def _read_json(path: Path) -> Maps:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReferenceInputError(f"maps file {path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict) or "maps" not in data:
        raise ReferenceInputError(f"maps file {path}: expected an object with a 'maps' list of [a, b, c]")
    return validate_maps(data["maps"])


def load_maps(spec: MapsLike) -> Maps:
    """Resolve ``spec`` (a name, a JSON path, or a sequence of triples) to a validated map set."""
    if isinstance(spec, (str, os.PathLike)):
        s = os.fspath(spec)
        if s.endswith(".json") or os.sep in s:
            return _read_json(Path(s))
        if s == "anvil":
            return validate_maps(ANVIL_MAPS)
        path = MAP_SETS_DIR / f"{s}.json"
        if path.is_file():
            return _read_json(path)
        raise ReferenceInputError(f"maps: unknown map set {s!r}; known names: {available_map_sets()}, "
                                  "or give a path to a .json file")
    return validate_maps(spec)

