"""Tail of the Gram side's top singular value over draws (seeds) of the harness's spectrum probe at 2x48x32 (ANVIL's maps,
their studied restart schedule): ``python tail.py MODE SEEDS`` from the repository root, MODE one of lower (the
kernels as they are: P = Q A on lower tiles, mirrored), full (P a full product, as before that), upper (P's upper
triangle mirrored instead), eager (the harness's eager bf16 Gram form of the same math). One line per seed."""
import sys, time
import torch
sys.path.insert(0, ".")
from anvil_fast.studies import adapters as A
from anvil_fast.studies import harness as H
import anvil_fast.core.cascade as C
from anvil_fast.kernels.gram import aX_plus_mm, sym_aX_plus_mm

mode = sys.argv[1]; seeds = [int(s) for s in sys.argv[2].split(",")]; shape = tuple(int(v) for v in sys.argv[3].split("x")) if len(sys.argv) > 3 else (2, 48, 32)
calls = [0]
def patched(X, L, R, *, a, out=None, backend="auto", config=None):
    calls[0] += 1
    first = calls[0] % 2 == 1          # P = Q A comes first in each pair, then A = Q P
    if first and mode == "full":
        return aX_plus_mm(X, L, R, a=a, out=out, backend=backend)
    if first and mode == "upper":
        y = aX_plus_mm(X, L, R, a=a, backend=backend)
        out.copy_(y.triu() + y.triu(1).mT)
        return out
    return sym_aX_plus_mm(X, L, R, a=a, out=out, backend=backend, config=config)
C.sym_aX_plus_mm = patched
impl = A._anvil("gram_side")("cpu", "auto")
for seed in seeds:
    t = time.time()
    sp = H.spectrum_input(shape, impl.math, seed=seed, device="cpu", count=H.spectrum_count(shape))
    x = sp.x
    calls[0] = 0
    if mode.startswith("eager"):
        y = torch.cat([H.eager_declared(x[i:i + 512], impl.math, form=H.GRAM_FORMS[0]).float() for i in range(0, x.shape[0], 512)])
    else:
        y = torch.cat([C.fast_gram_side(x[i:i + 512], maps="anvil").float() for i in range(0, x.shape[0], 512)])
    top = torch.linalg.svdvals(y.double())[:, 0]
    b = top.topk(3)
    print(f"{mode} seed {seed}: n {top.numel()} top {' '.join(f'{v:.4f}' for v in b.values.tolist())} "
          f">1.05 {int((top > 1.05).sum())} >1.08 {int((top > 1.08).sum())} >1.1 {int((top > 1.1).sum())} "
          f"q99.99 {top.quantile(0.9999).item():.4f} ({time.time()-t:.0f}s)", flush=True)
