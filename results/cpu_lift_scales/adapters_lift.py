"""The lifted run at both scales and its casts on every adapter that runs on this CPU (the table's lift_err and
lift_eps_err columns, without the rest of the table)."""
import torch, warnings
warnings.filterwarnings("ignore")
from anvil_fast.studies import harness as H, adapters as AD
impls, unavailable = AD.load(list(AD.ADAPTERS), device="cpu")
print("unavailable:", list(unavailable))
for impl in impls:
    m = impl.math
    if m is None:
        print(f"{impl.name:40s} undeclared"); continue
    for shape in [(2, 48, 32), (2, 32, 48)]:
        sp = H.spectrum_input(shape, m, seed=0, device="cpu", count=256)
        x = sp.x
        try:
            impl.settle(x[:4])
            if impl.observe:
                _, seen = H.run_impl(impl, x[:4], seed=0, record=True, chunk=4)
                if seen is None:
                    print(f"{impl.name:40s} {shape} not lifted (kernel)"); continue
            lf = H.lifted_run(impl, H.lift_input(x), m, eps_x=H.lift_eps_input(x, m))
        except Exception as e:
            print(f"{impl.name:40s} {shape} error {type(e).__name__}: {e}"); continue
        f = lambda v: "None" if v is None else f"{v:.1e}"
        print(f"{impl.name:40s} {shape} dtype={m.dtype} err={f(lf.err)} eps_err={f(lf.eps_err)} casts={lf.casts} {lf.why_not[:60]}", flush=True)
