"""Map sets: checking a sequence of odd quintics, and loading one by name or from a JSON file.

A map set is a sequence of ``(a, b, c)`` triples, each the odd quintic ``p(s) = a*s + b*s**3 + c*s**5``.
Besides literal sequences, every function that takes ``maps=`` in anvil_ref and anvil_fast accepts

* a name: ``"anvil"`` (ANVIL_MAPS, record #360) or the stem of a JSON file in
  ``anvil_ref/map_sets/`` (written by ``python -m derive_maps``), e.g. ``"polar_express"``;
* a path to a JSON file (anything ending in ``.json``) holding ``{"maps": [[a, b, c], ...]}``, as
  ``python -m derive_maps derive --json`` writes it.

so a new schedule can be tried without editing code.

A JSON set may name the inputs its bf16 certificate holds for: ``"certified_inputs": {"class":
"diagonal", "covers": "<the class in words>"}`` (``python -m derive_maps.frontier --export`` writes
it). A set certified for diagonal inputs only says so when it is loaded: :func:`load_maps` warns
(:class:`MapSetClassWarning`, naming the class) unless the caller states that its inputs are of that
class (``load_maps(spec, inputs="diagonal")``, then pass the loaded triples as ``maps=``): on general
matrices, gradients among them, such a set may explode.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from ._arrays import ReferenceInputError
from .constants import ANVIL_MAPS

Maps = tuple[tuple[float, float, float], ...]
MapsLike = Union[str, os.PathLike, Sequence[Sequence[float]]]

#: Folder of the named map sets shipped with the package.
MAP_SETS_DIR = Path(__file__).with_name("map_sets")


class MapSetClassWarning(UserWarning):
    """A map set certified for a narrower class of inputs (diagonal ones) is used without the caller
    stating that its inputs are of that class."""


#: Input classes a map set's certificate may name; "general" needs no statement.
INPUT_CLASSES = ("diagonal", "general")


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


def certified_class(doc: dict, where: str = "maps file") -> tuple[str, str] | None:
    """``(class, words)`` of a map-set document's ``certified_inputs``, or None if it names none."""
    ci = doc.get("certified_inputs")
    if ci is None:
        return None
    if not isinstance(ci, dict) or ci.get("class") not in INPUT_CLASSES:
        raise ReferenceInputError(f"{where}: certified_inputs must be {{'class': one of {INPUT_CLASSES}, "
                                  f"'covers': words}}, got {ci!r}")
    return ci["class"], str(ci.get("covers", ci["class"]))


def _read_json(path: Path, inputs: str | None) -> Maps:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReferenceInputError(f"maps file {path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict) or "maps" not in data:
        raise ReferenceInputError(f"maps file {path}: expected an object with a 'maps' list of [a, b, c]")
    maps = validate_maps(data["maps"])
    cls = certified_class(data, f"maps file {path}")
    if cls is not None and cls[0] != "general" and inputs != cls[0]:
        warnings.warn(MapSetClassWarning(
            f"map set {path.name}: its bf16 certificate holds for {cls[0]} inputs only ({cls[1]}); on general "
            f"matrices (gradients) it may explode. State the input class to use it: "
            f"load_maps({str(path)!r}, inputs={cls[0]!r})"), stacklevel=3)
    return maps


def load_maps(spec: MapsLike, *, inputs: str | None = None) -> Maps:
    """Resolve ``spec`` (a name, a JSON path, or a sequence of triples) to a validated map set.
    ``inputs``: the class of the inputs the caller runs the set on (``"diagonal"`` or ``"general"``);
    a JSON set certified for a narrower class warns unless it is stated (module docstring)."""
    if inputs is not None and inputs not in INPUT_CLASSES:
        raise ReferenceInputError(f"inputs = {inputs!r}: expected one of {INPUT_CLASSES} or None")
    if isinstance(spec, (str, os.PathLike)):
        s = os.fspath(spec)
        if s.endswith(".json") or os.sep in s:
            return _read_json(Path(s), inputs)
        if s == "anvil":
            return validate_maps(ANVIL_MAPS)
        path = MAP_SETS_DIR / f"{s}.json"
        if path.is_file():
            return _read_json(path, inputs)
        raise ReferenceInputError(f"maps: unknown map set {s!r}; known names: {available_map_sets()}, "
                                  "or give a path to a .json file")
    return validate_maps(spec)

