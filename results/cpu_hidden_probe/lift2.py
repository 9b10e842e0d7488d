"""The lifted run alone on each variant of probe2.py (both scales, its casts): which measurement sees a slip."""
import sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch
from anvil_fast.studies import harness as H
import probe2 as P2

for name, (fn, math_) in (P2.GENUINE | P2.SLIPS).items():
    m = H.DeclaredMath.of(**math_)
    for shape in [(2, 48, 32), (2, 32, 48)]:
        x = H.spectrum_input(shape, m, seed=0, device="cpu", count=256).x
        impl = H.Implementation(name, fn, m)
        try:
            impl.settle(x[:2])
            lf = H.lifted_run(impl, H.lift_input(x), m, eps_x=H.lift_eps_input(x, m))
            print(f"{name:24s} {'x'.join(map(str, shape)):8s} err {lf.err if lf.err is None else f'{lf.err:.2e}'} "
                  f"eps_err {lf.eps_err if lf.eps_err is None else f'{lf.eps_err:.2e}'} casts {','.join(lf.casts) or '-'} "
                  f"{lf.why_not[:90]}", flush=True)
        except Exception as e:  # noqa
            print(f"{name:24s} {'x'.join(map(str, shape)):8s} raised {type(e).__name__}: {str(e)[:120]}", flush=True)
