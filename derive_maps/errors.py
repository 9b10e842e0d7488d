"""Input checking for derive_maps: one error type, and messages that say what to change.

Every public entry point of derive_maps validates its settings here before doing any work, so bad
input fails at once with a :class:`DeriveMapsError` (a ``ValueError``) naming the setting, the
value it got and what it expects, instead of a NaN, a hang or a silently wrong table.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from typing import Union

import numpy as np

from anvil_ref._arrays import ReferenceInputError
from anvil_ref.maps import MapsLike, load_maps

RealLike = Union[int, float, str, Fraction]
Maps = tuple[tuple[float, float, float], ...]

#: Below this many significant digits the mpmath solvers cannot resolve the quantities they
#: iterate on (composite errors of ~1e-9 and coefficient steps many digits below that).
MIN_DPS = 20


class DeriveMapsError(ValueError):
    """Bad settings or a failed solve in derive_maps; the message says what to change."""


class ConvergenceError(DeriveMapsError):
    """A solver did not converge within its iteration budget; the message says which knob helps."""


def parse_real(value: RealLike, name: str) -> Fraction:
    """``value`` as an exact rational: ints, floats (their exact binary value), Fractions, and
    strings such as ``"1/300"``, ``"1/1.05"``, ``"1e-3"`` or ``"0.02407327424182761"`` (decimal
    strings are read exactly, not through a float)."""
    if isinstance(value, bool):
        raise DeriveMapsError(f"{name}: expected a real number, got a bool ({value!r})")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise DeriveMapsError(f"{name}: expected a finite number, got {value!r}")
        return Fraction(float(value))
    if isinstance(value, str):
        text = value.strip()
        try:
            if "/" in text:
                num, den = text.split("/", 1)
                out = Fraction(num.strip()) / Fraction(den.strip())
            else:
                out = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise DeriveMapsError(f"{name}: cannot read {value!r} as a number; write it like "
                                  "'0.001', '1e-3', '1/300' or '1/1.05'") from None
        return out
    raise DeriveMapsError(f"{name}: expected a real number or a string like '1/300', got "
                          f"{type(value).__name__}")


def check_interval(l: RealLike, u: RealLike, *, what: str = "interval") -> tuple[Fraction, Fraction]:
    """``(l, u)`` as exact rationals with ``0 < l < u``."""
    lf, uf = parse_real(l, "l"), parse_real(u, "u")
    if lf <= 0:
        raise DeriveMapsError(f"l = {float(lf):g}: the {what} [l, u] must have l > 0 (the maps are "
                              "odd, so F(0) = 0 and no bound on |log F| can hold at 0); give a small "
                              "positive lower bound such as 1e-3 or 1/300")
    if lf >= uf:
        raise DeriveMapsError(f"l = {float(lf):g} >= u = {float(uf):g}: the {what} [l, u] needs l < u")
    return lf, uf


def check_n_maps(n_maps: int) -> int:
    if isinstance(n_maps, bool) or not isinstance(n_maps, numbers.Integral):
        raise DeriveMapsError(f"n_maps: expected a positive integer, got {n_maps!r}")
    if n_maps < 1:
        raise DeriveMapsError(f"n_maps = {n_maps}: a map set needs at least one map")
    return int(n_maps)


def check_dps(dps: int) -> int:
    """Working precision in decimal digits for the mpmath solvers."""
    if isinstance(dps, bool) or not isinstance(dps, numbers.Integral):
        raise DeriveMapsError(f"dps: expected an integer number of decimal digits, got {dps!r}")
    if dps < MIN_DPS:
        raise DeriveMapsError(f"dps = {dps} is too low: the solvers need at least {MIN_DPS} "
                              "significant digits (default 40); raise dps")
    return int(dps)


def check_maps(maps: MapsLike) -> Maps:
    """A map set (name, JSON path or triples) as validated float triples; empty sets and
    non-finite coefficients are rejected with a message saying so."""
    if not isinstance(maps, (str, bytes)) and isinstance(maps, Sequence) and len(maps) == 0:
        raise DeriveMapsError("maps: the map set is empty; give at least one (a, b, c) triple")
    try:
        return load_maps(maps)
    except ReferenceInputError as exc:
        raise DeriveMapsError(str(exc)) from None


def check_positive(value: float, name: str, *, allow_zero: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        want = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise DeriveMapsError(f"{name} = {value!r}: expected {want}")
    return v
