"""``python -m anvil_ref demo``: the reference cascade on a bank of random matrices.

Prints, per matrix, the singular-value range of the input, of the Frobenius-normalized input (what
the maps see) and of the cascade's output, which ANVIL_MAPS drive to about 1.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ._arrays import ReferenceInputError
from .cascade import cascade, frobenius_normalize
from .cli_args import positive_int, unit_fraction
from .constants import FROBENIUS_EPS, FROBENIUS_MARGIN
from .maps import available_map_sets, load_maps


def demo(shape: tuple[int, int, int], seed: int, maps: str, decay: float) -> str:
    rng = np.random.default_rng(seed)
    n, m, k = shape
    r = min(m, k)
    rows = []
    for i in range(n):
        # A spread-out spectrum (log-uniform in [decay, 1]), as a gradient's often is.
        u, _ = np.linalg.qr(rng.standard_normal((m, r)))
        v, _ = np.linalg.qr(rng.standard_normal((k, r)))
        s = decay ** rng.uniform(0.0, 1.0, r)
        rows.append(u @ np.diag(s) @ v.T)
    x = np.stack(rows)
    xn = frobenius_normalize(x, margin=FROBENIUS_MARGIN, eps=FROBENIUS_EPS)
    y = cascade(x, maps=maps)
    sv = lambda a: np.linalg.svd(a, compute_uv=False)  # noqa: E731
    lines = [f"reference cascade (maps={maps!r}) on {n} random {m}x{k} matrices, seed {seed}",
             f"{'matrix':>6}  {'input s_min..s_max':>22}  {'normalized s_min..s_max':>26}  {'output s_min..s_max':>22}"]
    for i in range(n):
        a, b, c = sv(x[i]), sv(xn[i]), sv(y[i])
        lines.append(f"{i:>6}  {a.min():10.4e}..{a.max():10.4e}  {b.min():12.4e}..{b.max():12.4e}"
                     f"  {c.min():10.6f}..{c.max():10.6f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_ref", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="apply the reference cascade to a bank of random matrices")
    d.add_argument("--shape", type=positive_int, nargs=3, default=(4, 96, 64), metavar=("N", "ROWS", "COLS"),
                   help="number of matrices and their shape (default: 4 96 64)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random matrices (default: %(default)s)")
    d.add_argument("--maps", default="anvil",
                   help=f"a map set name, one of {', '.join(available_map_sets())}, or a .json path "
                        "(default: %(default)s)")
    d.add_argument("--decay", type=unit_fraction, default=1e-2,
                   help="ratio of smallest to largest input singular value, in (0, 1] (default: %(default)s)")
    a = ap.parse_args(argv)
    try:
        load_maps(a.maps)
    except (ReferenceInputError, OSError, ValueError) as exc:
        d.error(f"argument --maps: {exc}")
    if a.cmd == "demo":
        print(demo(tuple(a.shape), a.seed, a.maps, a.decay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
