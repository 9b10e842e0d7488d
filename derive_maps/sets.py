"""The named map sets this package generates into ``anvil_ref/map_sets/`` (loadable with
``anvil_ref.maps.load_maps(name)``), and how each one is built.

=========================  ==============================================================================
name                       built by
=========================  ==============================================================================
``polar_express_paper6``   the Polar Express paper's recipe (our reproduction of its table), the first six
                           rows with Algorithm 1's 1.01 safety factor: ``PolarExpress(G, steps=6)``
``polar_express_nanogpt5`` modded-nanogpt's recipe (our reproduction of its five maps)
``muon_jordan5``           Muon's quintic (3.4445, -4.7750, 2.0315) five times (a published constant)
``anvil_express``          :func:`derive_maps.anvil_kind.derive` ``"express"`` (recommended)
``anvil_optimal``          :func:`derive_maps.anvil_kind.derive` ``"optimal"``
``anvil_polished``         :func:`derive_maps.anvil_kind.derive` ``"polished"``
=========================  ==============================================================================

Every file holds ``"maps"`` (what ``load_maps`` reads), the same numbers as exact hex floats, a
``"generated_by"`` header, how the set was made, and its certificate on the ANVIL interval
``[1/300, 1/1.05]`` (envelope, ``max |log F|``, headroom in the 1% band).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from anvil_ref.maps import MAP_SETS_DIR

from .anvil_kind import ANVIL_L, ANVIL_U, derive
from .certify import certify_envelope, certify_headroom
from .polar_express import RECIPES, greedy
from .tables import dumps
from .published import MUON_QUINTIC, MUON_STEPS, PAPER_SAFETY

GENERATED_BY = "python -m derive_maps regenerate"
BAND = 0.01


@dataclass(frozen=True)
class NamedSet:
    name: str
    description: str
    build: Callable[[], tuple]      # () -> (maps, provenance dict)


def _paper6():
    g = greedy(RECIPES["polar_express_paper"])
    s = PAPER_SAFETY
    maps = tuple((a / s, b / s ** 3, c / s ** 5) for a, b, c in g.maps_mp[:6])
    maps = tuple(tuple(float(v) for v in m) for m in maps)
    return maps, dict(recipe="polar_express_paper", rows="1-6", safety_after=PAPER_SAFETY,
                      settings=asdict(g.settings))


def _nanogpt5():
    g = greedy(RECIPES["modded_nanogpt"])
    return g.maps, dict(recipe="modded_nanogpt", settings=asdict(g.settings))


def _muon5():
    return (tuple(MUON_QUINTIC),) * MUON_STEPS, dict(source="Muon's Newton-Schulz quintic, applied 5 times")


def _anvil(method):
    def build():
        d = derive(method)
        return d.maps, dict(method=method, design_interval=list(d.design_interval), settings=d.settings,
                            notes=d.notes)
    return build


NAMED_SETS: dict[str, NamedSet] = {s.name: s for s in (
    NamedSet("polar_express_paper6", "Polar Express paper, Algorithm 1 with steps=6 (l=1e-3, safety 1.01)",
             _paper6),
    NamedSet("polar_express_nanogpt5", "modded-nanogpt's five Polar Express maps (l=1e-3, safety 1.02, "
             "cushion 0.02)", _nanogpt5),
    NamedSet("muon_jordan5", "Muon's quintic (3.4445, -4.7750, 2.0315) x5", _muon5),
    NamedSet("anvil_express", "ANVIL-kind, Polar Express greedy on [1/300, 1.0105/1.05], cushion 0.02, "
             "safety 1.01 (recommended)", _anvil("express")),
    NamedSet("anvil_optimal", "ANVIL-kind, exact-arithmetic optimum on [1/300, 1.0105/1.05] "
             "(greedy + joint minimax polish)", _anvil("optimal")),
    NamedSet("anvil_polished", "ANVIL-kind, local joint minimax polish from ANVIL_MAPS with 1% headroom, "
             "to max|log F| <= 2.5e-5", _anvil("polished")),
)}

#: The order of the comparison table.
COMPARISON = ("anvil", "anvil_express", "anvil_optimal", "anvil_polished", "polar_express_paper6",
              "polar_express_nanogpt5", "muon_jordan5")


def headroom_band(max_abs_log: float, band: float = BAND) -> float:
    """The band used for headroom: ``|log F| <= max(band, the set's own certified max |log F|)``, so a
    set whose composite is coarser than 1% is judged against its own envelope."""
    return max(band, float(max_abs_log))


def certificate(maps, *, l: str = ANVIL_L, u: str = ANVIL_U, band: float = BAND) -> dict:
    """Certified envelope, max |log F| and headroom of ``maps`` on ``[l, u]`` (a JSON-ready dict)."""
    e = certify_envelope(maps, l, u)
    if not math.isfinite(e.max_abs_log_certified):
        # F may reach 0 or below on [l, u]: no band |log F| <= b holds there, so no headroom either
        b = certified = upper = None
    else:
        b = headroom_band(e.max_abs_log_certified, band)
        h = certify_headroom(maps, u, band=b)
        certified, upper = h.certified, h.upper
    return dict(interval=[l, u], envelope_certified=[e.f_min_certified, e.f_max_certified],
                envelope_attained=[e.f_min_attained, e.f_max_attained],
                max_abs_log_certified=e.max_abs_log_certified, max_abs_log_attained=e.max_abs_log_attained,
                headroom_band=b, headroom_certified=certified, headroom_upper=upper)


def map_set_document(name: str) -> dict:
    """Build the named set and its JSON document."""
    ns = NAMED_SETS[name]
    maps, provenance = ns.build()
    return {
        "generated_by": GENERATED_BY,
        "name": name,
        "description": ns.description,
        "maps": [list(m) for m in maps],
        "maps_hex": [[float(v).hex() for v in m] for m in maps],
        "provenance": provenance,
        "certified": certificate(maps),
    }


def map_set_path(name: str, directory: Path | None = None) -> Path:
    return (MAP_SETS_DIR if directory is None else Path(directory)) / f"{name}.json"


def dump(doc: dict) -> str:
    return dumps(doc)
