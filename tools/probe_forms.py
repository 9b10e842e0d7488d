"""Which evaluation form an implementation's spectrum residuals sit beside (device diagnostic).

For each adapter and shape (``python tools/probe_forms.py 4x256x768 dion-muon,heavyball-ns5``): the
math verdict's z against each eager form of the harness alone, each form against the others, the
implementation against the hull of all (the verdict), the share of its output equal to the Inductor
form's bit for bit, and 1e-3 slips of single coefficients written in several forms against the hull
(whether the hull still catches them at that shape; ``PROBE_SLIPS=0`` skips them). Prints one line
per comparison.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from anvil_fast.studies import adapters as A
from anvil_fast.studies import harness as H

DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: (step, coefficient, change) of the slips written in several forms (PROBE_SLIPS=0: none)
SLIPS = ((0, 0, -1e-3), (0, 1, 1e-3), (0, 2, 1e-3), (2, 2, 1e-3), (3, 0, -1e-3), (4, 1, 1e-3))


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
    names = sys.argv[2].split(",")
    for shape in shapes:
        cache = H._Cache(seed=0, device=DEV, count=8)
        for name in names:
            t0 = time.monotonic()
            impl = A.build(name, device=DEV, compile="auto")
            m = impl.math
            sp = cache.spectrum(shape, m)
            chunk = min(H.spectrum_chunk(shape), sp.x.shape[0])
            H.warm_up(impl, shape, cache)
            y, _ = H.run_impl(impl, sp.x, seed=0, record=False, chunk=chunk)
            dn, sens = cache.sens(shape, m)
            forms = {f: cache.residuals(shape, m, cache.eager(shape, "spectrum", m, f)) for f in m.forms(DEV)}
            yc = cache.eager(shape, "spectrum", m, H.INDUCTOR_FORM) if DEV == "cuda" else None
            ri = cache.residuals(shape, m, y)

            def z(r, fs):
                st = H.math_statistic(r, fs, sp.key, dn, sens, margin=m.margin, eps=m.eps)
                return f"{st.z:6.1f} ({st.clause}, beyond {st.form})"

            same = float((y.to(yc.dtype) == yc).float().mean()) if yc is not None else float("nan")
            print(f"== {name} {'x'.join(map(str, shape))}: {sp.x.shape[0]} matrices; equal elements to the "
                  f"inductor form {same:.4f}; {time.monotonic() - t0:.0f} s", flush=True)
            for f in forms:
                print(f"   impl vs {f:12s} alone: {z(ri, {f: forms[f]})}")
                print(f"   {f:12s} vs the others: {z(forms[f], {g: forms[g] for g in forms if g != f})}")
            print(f"   impl vs hull: {z(ri, forms)}")
            for j, i, d in () if os.environ.get("PROBE_SLIPS") == "0" else SLIPS:
                cs = [list(t) for t in m.coeffs]
                cs[j][i] += d
                ms = H.DeclaredMath(tuple(map(tuple, cs)), normalization=m.normalization, margin=m.margin, eps=m.eps,
                                    transpose_when=m.transpose_when)
                for f in ("compiled", "unfused") + ((H.INDUCTOR_FORM,) if DEV == "cuda" else ()):
                    rm = cache.residuals(shape, m, H.eager_declared(sp.x, ms, f))
                    print(f"   slip step {j + 1} {'abc'[i]} {d:+g} in the {f} form: vs hull {z(rm, forms)}", flush=True)


if __name__ == "__main__":
    main()
