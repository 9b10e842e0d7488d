"""ANVIL-kind map sets: six odd quintics for ``sigma in [1/300, 1/1.05]``, by deterministic pipelines.

ANVIL_MAPS (record #360) are frozen constants; their printed digits do not follow from a principle
(``python -m derive_maps facts``). What can be rebuilt is the method that makes maps of their kind,
and three pipelines do that here, each deterministic (no randomness at all):

``express`` (recommended)
    The Polar Express greedy composition on the headroom-extended interval
    ``[l, u (1 + headroom + margin)]``, with the Polar Express finite-precision devices: cushion 0.02
    and a safety factor ``1 + headroom`` inside the loop (every map but the last), arithmetic
    recentring, the last map recentred geometrically (so ``log F`` is centred). The safety factor
    trades some exact-arithmetic error for slack at every stage, which is what keeps the bf16
    cascade tight (the numbers: ``papers/data/maps_comparison.md``).
``optimal``
    The same greedy without cushion or safety factor, followed by the joint minimax polish of all 18
    coefficients on the same interval: the greedy composition is optimal (Polar Express Theorem 4.1),
    and the polish, which finds no descent direction, confirms it numerically. The best exact
    arithmetic reachable with six quintics; less robust in bf16.
``polished``
    The local joint minimax polish of ``max |log F|`` started from ANVIL_MAPS, as the record's
    "CEM + minimax polish" suggests. Headroom comes from input scaling: the first map is replaced by
    ``p_1(x / s)``, ``s = 1 + headroom + margin`` (ANVIL's composite on ``[l/s, u]`` has no blow-up),
    and the polish runs on ``[l, s u]``. It stops at ``target`` (default 2.5e-5, the ANVIL-kind accuracy goal) or
    after ``max_iter`` iterations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from fractions import Fraction

import numpy as np

from anvil_ref.cascade import composite
from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_MARGIN

from .errors import DeriveMapsError, check_interval, check_maps, check_n_maps, parse_real
from .polar_express import GreedySettings, greedy
from .polish import polish

METHODS = ("express", "optimal", "polished")

#: The ANVIL design interval: singular values after the cascade's Frobenius normalization.
ANVIL_L = "1/300"
ANVIL_U = f"1/{FROBENIUS_MARGIN!r}"


@dataclass(frozen=True)
class AnvilKindSettings:
    """Settings of the ANVIL-kind pipelines (exact decimal strings where a value is a real number)."""
    l: str = ANVIL_L
    u: str = ANVIL_U
    n_maps: int = 6
    headroom: str = "0.01"        # certified headroom wanted above u (relative)
    margin: str = "0.0005"        # extra design room on top of the headroom
    cushion: str = "0.02"         # express only
    safety: str | None = None     # express only; None: 1 + headroom
    objective: str = "log"        # optimal / polished
    target: float = 2.5e-5        # polished: stop once max |log F| on the design interval is below
    max_iter: int = 200           # polished / optimal: polish iterations
    dps: int = 40

    def design_u(self) -> Fraction:
        lf, uf = check_interval(self.l, self.u)
        h = parse_real(self.headroom, "headroom")
        m = parse_real(self.margin, "margin")
        if h < 0 or m < 0:
            raise DeriveMapsError(f"headroom = {self.headroom}, margin = {self.margin}: expected values >= 0")
        return uf * (1 + h + m)

    def design_scale(self) -> Fraction:
        return 1 + parse_real(self.headroom, "headroom") + parse_real(self.margin, "margin")


@dataclass
class Derived:
    """A derived map set and how it was made."""
    name: str
    method: str
    maps: tuple
    settings: dict
    design_interval: tuple       # (l, u_design) as strings
    notes: dict = field(default_factory=dict)


def _str(q: Fraction) -> str:
    return f"{q.numerator}/{q.denominator}" if q.denominator != 1 else str(q.numerator)


#: The polish is local: a starting composite farther than this from 1 (max |log F| on the design
#: interval) is not near an equioscillating set, and the polish would spend minutes isolating its
#: extrema before failing.
POLISH_START_MAX_ABS_LOG = 0.1


def _check_polish_start(maps, l: Fraction, u: Fraction) -> None:
    """Refuse a starting set whose composite is far from 1 somewhere on ``[l, u]`` (a dense float64
    look suffices: the values that trip it are orders of magnitude above the limit)."""
    sigma = np.geomspace(float(l), float(u), 4097)
    with np.errstate(all="ignore"):
        f = composite(sigma, maps=maps)
        err = np.where(f > 0, np.abs(np.log(np.where(f > 0, f, 1.0))), np.inf)
    i = int(np.argmax(err))
    if not err[i] <= POLISH_START_MAX_ABS_LOG:
        raise DeriveMapsError(
            f"the polished pipeline starts from the given set with its first map scaled to the design "
            f"interval [{float(l):.6g}, {float(u):.6g}], and that composite is far from 1 there "
            f"(F({sigma[i]:.6g}) = {f[i]:.4g}, |log F| = {err[i]:.4g} > {POLISH_START_MAX_ABS_LOG}): the "
            "local polish cannot start from it. Lower --u (or --headroom), or give a --start set "
            "designed for this interval (e.g. from derive express)")


def derive(method: str, settings: AnvilKindSettings | None = None, *, name: str | None = None,
           start=None, progress: bool | None = None) -> Derived:
    """Run one pipeline (``"express"``, ``"optimal"`` or ``"polished"``)."""
    s = settings if settings is not None else AnvilKindSettings()
    if method not in METHODS:
        raise DeriveMapsError(f"method = {method!r}: expected one of {METHODS}")
    check_n_maps(s.n_maps)
    lf, uf = check_interval(s.l, s.u)
    ud = s.design_u()
    design = (s.l, _str(ud))
    name = name or f"anvil_{method}"
    if method == "express":
        safety = s.safety if s.safety is not None else _str(1 + parse_real(s.headroom, "headroom"))
        g = greedy(GreedySettings(l=s.l, u=_str(ud), n_maps=s.n_maps, cushion=s.cushion, safety=safety,
                                  safety_mode="inside", recentre="arithmetic", recentre_when="always",
                                  final_recentre="geometric"), dps=s.dps)
        return Derived(name=name, method=method, maps=g.maps, settings=asdict(s), design_interval=design,
                       notes=dict(safety=safety, greedy_errors=[float(e) for e in g.errors]))
    if method == "optimal":
        g = greedy(GreedySettings(l=s.l, u=_str(ud), n_maps=s.n_maps, cushion="0", safety="1",
                                  recentre="arithmetic", recentre_when="always",
                                  final_recentre="geometric"), dps=s.dps)
        r = polish(g.maps, s.l, _str(ud), objective=s.objective, dps=s.dps, max_iter=s.max_iter,
                   progress=progress, label="polish (optimal)")
        return Derived(name=name, method=method, maps=r.maps, settings=asdict(s), design_interval=design,
                       notes=dict(greedy_error=r.start_error, polished_error=r.error,
                                  polish_iterations=r.iterations, polish_converged=r.converged,
                                  polish_changed=r.maps != g.maps))
    # polished
    start_maps = check_maps(ANVIL_MAPS if start is None else start)
    if len(start_maps) != s.n_maps:
        raise DeriveMapsError(f"n_maps = {s.n_maps}: the polished pipeline keeps the number of maps of its "
                              f"starting set, which has {len(start_maps)}; give --n-maps {len(start_maps)}, "
                              f"or a starting set of {s.n_maps} maps with --start")
    sc = float(s.design_scale())
    (a, b, c), rest = start_maps[0], start_maps[1:]
    scaled = ((a / sc, b / sc ** 3, c / sc ** 5),) + tuple(rest)
    _check_polish_start(scaled, lf, ud)
    r = polish(scaled, s.l, _str(ud), objective=s.objective, dps=s.dps, max_iter=s.max_iter,
               target=s.target, progress=progress, label="polish (from ANVIL_MAPS)")
    return Derived(name=name, method=method, maps=r.maps, settings=asdict(s), design_interval=design,
                   notes=dict(start_error=r.start_error, polished_error=r.error, polish_iterations=r.iterations,
                              polish_converged=r.converged, reached_target=r.error <= s.target))
