"""Headroom of a map set at the end of its interval: why SAFE_MARGIN_SLACK is 2**-7.

:func:`worst_case_output` propagates *intervals* of singular values through the maps: the input
interval ``[0, (1 - slack) / margin]`` is cut into ``cells`` pieces; before every map each piece is
widened by a relative perturbation ``delta`` (a model of the bf16 roundings of the iterate, its Gram
and its polynomial, which move a singular value by a small relative amount), and each map takes the
exact image of the piece (its end points and any critical point of the quintic inside it). The
largest value reached after the last map bounds the cascade's output for every input singular value
in the interval and every perturbation sequence of at most ``delta`` per stage.

Printed by ``python -m anvil_fast.safety``; ``tests/test_near_rank1.py`` checks the numbers quoted in
anvil_fast/cascade.py.
"""

from __future__ import annotations

import numpy as np

from anvil_ref.cascade import quintic
from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_MARGIN
from anvil_ref.maps import MapsLike, load_maps


def _critical_points(coeffs) -> np.ndarray:
    a, b, c = coeffs
    r = np.roots([5 * c, 0, 3 * b, 0, a])
    return np.sort(r[np.isreal(r) & (r.real > 0)].real)


def worst_case_output(slack: float, delta: float, *, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                      cells: int = 200_000) -> float:
    """Largest cascade output (in float64 interval arithmetic, see the module docstring) over input
    singular values in ``[0, (1 - slack) / margin]`` with a relative perturbation of up to ``delta``
    before every map."""
    maps_ = load_maps(maps)
    edges = np.linspace(0.0, (1.0 - slack) / margin, cells + 1)
    lo, hi = edges[:-1], edges[1:]
    for coeffs in maps_:
        lo, hi = lo * (1 - delta), hi * (1 + delta)
        vals = [quintic(lo, coeffs), quintic(hi, coeffs)]
        for cp in _critical_points(coeffs):
            inside = (lo < cp) & (cp < hi)
            vals.append(np.where(inside, quintic(cp, coeffs), vals[0]))
        v = np.stack(vals)
        lo, hi = v.min(0), v.max(0)
    return float(hi.max())


def headroom_table(slacks=(0.0, 2.0 ** -12, 2.0 ** -9, 2.0 ** -8, 2.0 ** -7, 2.0 ** -6),
                   deltas=(0.0, 1e-5, 1e-4, 1e-3, 2e-3, 4e-3, 8e-3), **kw) -> list[tuple[float, list[float]]]:
    return [(s, [worst_case_output(s, d, **kw) for d in deltas]) for s in slacks]


def main() -> None:
    deltas = (0.0, 1e-5, 1e-4, 1e-3, 2e-3, 4e-3, 8e-3)
    print("worst cascade output over sigma in [0, (1 - slack)/1.05], relative perturbation <= delta per stage")
    print(f"{'slack':>12} | " + " | ".join(f"delta={d:<7g}" for d in deltas))
    for s, row in headroom_table(deltas=deltas):
        print(f"{s:>12.6g} | " + " | ".join(f"{v:13.6g}" for v in row))


if __name__ == "__main__":
    main()
