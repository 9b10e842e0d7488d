"""The lifted run at both scales (far above eps, and unscaled at norms near eps) and the casts it records, on
the mutation set, the field examples and hidden_field_code.py (code written the field's ways, and slips), CPU."""
import sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from anvil_fast.studies import harness as H, field_examples as F
import hidden_field_code as HD
m = H.DeclaredMath.of(**F.MUON_MATH)
for shape in [(2, 48, 32), (2, 32, 32)]:
    sp = H.spectrum_input(shape, m, seed=0, device="cpu", count=256)
    x = sp.x
    cands = {**{k: v for k, v in F.MUTANTS.items() if not k.startswith("step")}, **HD.GENUINE, **HD.SLIPS,
             "field_unfused": F.muon_newton_schulz, "field_fused": F.muon_newton_schulz_fused,
             "field_horner": F.muon_newton_schulz_horner, "fp16_iter": HD.fp16_iter}
    for name, fn in cands.items():
        impl = H.Implementation(name, fn, m, per_matrix=None)
        impl.settle(x[:4])
        lf = H.lifted_run(impl, H.lift_input(x), m, eps_x=H.lift_eps_input(x, m))
        print(f"{shape} {name:28s} err={lf.err if lf.err is None else f'{lf.err:.2e}'} eps_err={lf.eps_err if lf.eps_err is None else f'{lf.eps_err:.2e}'} casts={lf.casts} {lf.why_not}", flush=True)
