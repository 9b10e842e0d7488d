"""The one spectrum-probe matrix on which anvil-gram-side exploded at 2x48x32 (orthogonalizers.json), traced to
a commit. ``python gram_side_probe.py make`` (from a tree that has the harness) saves the harness's spectrum
inputs at 2x48x32, seed 0 (what the difftest judged); ``python gram_side_probe.py NAME`` (from the repository
root of any tree) runs that tree's fast_gram_side (ANVIL's maps) on them and prints the five largest top
singular values, where, and how many pass 1.1; ``python gram_side_probe.py detail N`` prints matrix N's
spectrum (its top singular value over its Frobenius norm, its second over its top) and the top singular
value of SAFE's cascade and of the Gram side on it."""
import sys

import torch

sys.path.insert(0, ".")
INPUTS = "/tmp/gs_x.pt"

if sys.argv[1] == "make":
    from anvil_fast.studies import adapters as A
    from anvil_fast.studies import harness as H

    impl = A._anvil("gram_side")("cpu", "auto")
    sp = H.spectrum_input((2, 48, 32), impl.math, seed=0, device="cpu", count=H.spectrum_count((2, 48, 32)))
    torch.save(sp.x, INPUTS)
    print(f"inputs {tuple(sp.x.shape)} {sp.x.dtype} -> {INPUTS}")
elif sys.argv[1] == "detail":
    from anvil_fast.core.cascade import CONFIGS, fast_cascade, fast_gram_side

    n = int(sys.argv[2])
    x = torch.load(INPUTS)[n:n + 1]
    s = torch.linalg.svdvals(x[0].double())
    safe = torch.linalg.svdvals(fast_cascade(x, maps="anvil", config=CONFIGS["safe"])[0].double())[0]
    gram = torch.linalg.svdvals(fast_gram_side(x, maps="anvil")[0].double())[0]
    print(f"matrix {n}: top singular value / Frobenius norm {s[0] / s.norm():.4f}, second / top {s[1] / s[0]:.4f}; "
          f"top singular value of the output: SAFE {safe:.4f}, Gram side {gram:.4f}")
else:
    from anvil_fast.core.cascade import fast_gram_side

    x = torch.load(INPUTS)
    y = torch.cat([fast_gram_side(x[i:i + 512], maps="anvil").float() for i in range(0, x.shape[0], 512)])
    top = torch.linalg.svdvals(y.double())[:, 0]
    best = top.topk(5)
    print(f"{sys.argv[1]}: top singular values {' '.join(f'{v:.4f}' for v in best.values.tolist())} "
          f"at matrices {best.indices.tolist()}; {int((top > 1.1).sum())} of {top.numel()} past 1.1")
