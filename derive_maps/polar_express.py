"""The Polar Express greedy composition: each map is the minimax odd polynomial for the interval the
previous maps leave.

Starting from ``[l_1, u_1] = [l, u]``, step k:

1. cushion: solve the minimax problem (:func:`derive_maps.remez.remez_odd`) on
   ``[max(l_k, cushion * u_k), u_k]`` instead of ``[l_k, u_k]`` (keeps ``p(x) / x`` away from 0 for the
   small singular values, which bf16 needs; the Polar Express paper's Section 4.4);
2. recentre the solution on ``[l_k, u_k]`` (``"arithmetic"``: ``(p(l_k) + p(u_k)) / 2 = 1``;
   ``"geometric"``: ``p(l_k) p(u_k) = 1``), always or only when the cushion was active
   (``recentre_when``); the last map is recentred with ``final_recentre``;
3. safety factor inside the loop: replace ``p(x)`` by ``p(x / s)`` (coefficients ``a/s, b/s^3, c/s^5``),
   for every map but the last unless ``safety_last``;
4. propagate the interval: ``l_{k+1} = p(l_k)`` and ``u_{k+1}`` its mirror ``2 - l_{k+1}``
   (arithmetically centred map, which is also what the Remez solution is when no recentring was
   applied) or ``1 / l_{k+1}`` (geometrically centred), as the published algorithm does, or the
   exact image ``[min p, max p]`` over ``[l_k, u_k]`` (``propagate="exact"``).

With ``safety_mode="after"`` the factor is applied to the finished list instead (the interval
chain then ignores it), which is how the Polar Express paper's Algorithm 1 uses its table.

Published recipes (:data:`RECIPES`): the paper's table (``l = 1e-3``, cushion 0.02407327424182761,
always recentred, no safety factor in the table), and modded-nanogpt's five maps (``l = 1e-3``,
cushion 0.02, recentred only when cushioned, safety 1.02 inside the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mpmath

from .errors import DeriveMapsError, check_dps, check_interval, check_n_maps, parse_real
from .remez import DEFAULT_DPS, odd_poly, recentre, remez_odd

RECENTRE_MODES = ("arithmetic", "geometric")
SAFETY_MODES = ("inside", "after")
RECENTRE_WHEN = ("always", "cushioned")
PROPAGATE = ("mirror", "exact")


@dataclass(frozen=True)
class GreedySettings:
    """Every knob of the greedy composition (see module docstring); ``l``, ``u``, ``cushion`` and
    ``safety`` are exact decimal strings or rationals."""
    l: str = "1e-3"
    u: str = "1"
    n_maps: int = 5
    degree: int = 5
    cushion: str = "0"
    safety: str = "1"
    safety_mode: str = "inside"
    safety_last: bool = False
    recentre: str = "arithmetic"
    recentre_when: str = "always"
    final_recentre: str | None = None
    propagate: str = "mirror"


@dataclass
class GreedyResult:
    """``maps``: float64 triples (coefficients rounded to nearest); ``maps_mp``: the mpf
    coefficients; ``chain``: ``(l_k, u_k)`` fed to each map (mpf); ``errors``: each map's minimax
    error on its (cushioned) interval."""
    settings: GreedySettings
    maps: tuple
    maps_mp: list
    chain: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def _mp(q):
    q = parse_real(q, "value")
    return mpmath.mpf(q.numerator) / q.denominator


def _check(settings: GreedySettings) -> None:
    check_interval(settings.l, settings.u)
    check_n_maps(settings.n_maps)
    if settings.degree != 5:
        # Map sets are quintic triples everywhere in the project; the Remez solver itself is general.
        raise DeriveMapsError(f"degree = {settings.degree}: map sets are odd quintics (a, b, c); use "
                              "derive_maps.remez.remez_odd directly for other degrees")
    c = parse_real(settings.cushion, "cushion")
    if not 0 <= c < 1:
        raise DeriveMapsError(f"cushion = {settings.cushion}: expected 0 <= cushion < 1 (a fraction of u)")
    s = parse_real(settings.safety, "safety")
    if s < 1:
        raise DeriveMapsError(f"safety = {settings.safety}: expected a factor >= 1 (1 = no safety factor)")
    for name, val, allowed in (("safety_mode", settings.safety_mode, SAFETY_MODES),
                               ("recentre", settings.recentre, RECENTRE_MODES),
                               ("recentre_when", settings.recentre_when, RECENTRE_WHEN),
                               ("propagate", settings.propagate, PROPAGATE)):
        if val not in allowed:
            raise DeriveMapsError(f"{name} = {val!r}: expected one of {allowed}")
    if settings.final_recentre not in (None,) + RECENTRE_MODES:
        raise DeriveMapsError(f"final_recentre = {settings.final_recentre!r}: expected None or one of "
                              f"{RECENTRE_MODES}")


def _image(coeffs, l, u):
    """Exact min and max of the odd polynomial over [l, u] (endpoints and critical points)."""
    from .remez import _extrema
    vals = [odd_poly(coeffs, x) for x in _extrema(coeffs, l, u)]
    return min(vals), max(vals)


def greedy(settings: GreedySettings | None = None, *, dps: int = DEFAULT_DPS, **overrides) -> GreedyResult:
    """Run the greedy composition for ``settings`` (or keyword overrides of the defaults)."""
    settings = settings if settings is not None else GreedySettings()
    if overrides:
        settings = GreedySettings(**{**settings.__dict__, **overrides})
    _check(settings)
    dps = check_dps(dps)
    n = settings.n_maps
    with mpmath.workdps(dps):
        l, u = _mp(settings.l), _mp(settings.u)
        cushion, s = _mp(settings.cushion), _mp(settings.safety)
        maps, chain, errors = [], [], []
        for k in range(n):
            last = k == n - 1
            chain.append((l, u))
            lo = max(l, cushion * u)
            r = remez_odd(lo, u, degree=settings.degree, dps=dps)
            coeffs = r.coeffs
            errors.append(r.error)
            mode = settings.final_recentre if (last and settings.final_recentre) else settings.recentre
            if settings.recentre_when == "always" or cushion * u > l or (last and settings.final_recentre):
                coeffs = recentre(coeffs, l, u, mode=mode)
            else:
                mode = "arithmetic"   # the Remez solution itself is arithmetically centred
            if settings.safety_mode == "inside" and (not last or settings.safety_last):
                coeffs = tuple(c / s ** (2 * j + 1) for j, c in enumerate(coeffs))
            maps.append(coeffs)
            if settings.propagate == "exact":
                l, u = _image(coeffs, l, u)
            else:
                l = odd_poly(coeffs, l)
                u = 2 - l if mode == "arithmetic" else 1 / l
        if settings.safety_mode == "after":
            maps = [tuple(c / s ** (2 * j + 1) for j, c in enumerate(m)) if (k < n - 1 or settings.safety_last)
                    else m for k, m in enumerate(maps)]
        maps_f = tuple(tuple(float(c) for c in m) for m in maps)
    return GreedyResult(settings=settings, maps=maps_f, maps_mp=maps, chain=chain, errors=errors)


#: The published recipes reproduced by ``python -m derive_maps reproduce``.
RECIPES: dict[str, GreedySettings] = {
    # Polar Express paper (arXiv:2505.16932), Appendix G code with its defaults, printed as the
    # table of Algorithm 1 (8 rows; the 1.01 safety factor is applied afterwards, at run time).
    "polar_express_paper": GreedySettings(l="1e-3", u="1", n_maps=8, cushion="0.02407327424182761",
                                          safety="1", recentre="arithmetic", recentre_when="always"),
    # modded-nanogpt train_gpt.py polar_express_coeffs ("num_iters=5, safety_factor=2e-2,
    # cushion=2" in its comment): the Polar Express repository's optimal_composition with
    # l=1e-3, safety inside the loop except on the last map, recentring only when cushioned.
    "modded_nanogpt": GreedySettings(l="1e-3", u="1", n_maps=5, cushion="0.02", safety="1.02",
                                     safety_mode="inside", recentre="arithmetic",
                                     recentre_when="cushioned"),
}
