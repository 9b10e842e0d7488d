"""Top singular value tail of the Gram side (fast_gram_side, ANVIL maps, its studied schedule) and of its
eager bf16 Gram form on near-low-rank inputs at the bank shapes the drop-in sends it on CUDA."""
import sys, time
import torch
sys.path.insert(0, ".")
from anvil_fast.core.cascade import fast_gram_side, fast_cascade, CONFIGS
from anvil_fast.studies import adapters as A, harness as H

dev = "cuda"; per = float(sys.argv[1]) if len(sys.argv) > 1 else 40.0
impl = A._anvil("gram_side")(dev, "auto")
g = torch.Generator(device=dev); g.manual_seed(0)
def inputs(b, m, n):
    r = torch.randint(1, 5, (b, 1, 1), device=dev, generator=g)
    s = torch.exp2(-8 * torch.rand(b, 1, 4, device=dev, generator=g)); s[..., 0] = 1
    s = s * (torch.arange(4, device=dev)[None, None] < r)
    u = torch.randn(b, m, 4, device=dev, generator=g); v = torch.randn(b, n, 4, device=dev, generator=g)
    x = (u * s) @ v.mT
    tau = torch.exp2(-20 + 14 * torch.rand(b, 1, 1, device=dev, generator=g)) * x.norm(dim=(-2, -1), keepdim=True) / (m * n) ** 0.5
    x = x + tau * torch.randn(b, m, n, device=dev, generator=g) * (torch.rand(b, 1, 1, device=dev, generator=g) < 0.7)
    return x * torch.exp2(8 * torch.rand(b, 1, 1, device=dev, generator=g) - 4)
def top(y):
    y = y.float(); G = y.mT @ y if y.shape[-2] >= y.shape[-1] else y @ y.mT
    return torch.linalg.eigvalsh(G.double())[..., -1].clamp_min(0).sqrt()
for shape in [(1536, 384), (384, 1536), (1152, 384), (3072, 768), (768, 3072), (2304, 768)]:
    b = 128 if shape[0] * shape[1] < 1e6 else 32
    stats = {k: [0, 0, 0.0] for k in ("fast", "eager", "safe")}
    t = time.time(); n = 0
    while time.time() - t < per:
        x = inputs(b, *shape); n += b
        outs = {"fast": fast_gram_side(x, maps="anvil"), "eager": H.eager_declared(x, impl.math, form=H.GRAM_FORMS[0]),
                "safe": fast_cascade(x, maps="anvil", config=CONFIGS["safe"])}
        for k, y in outs.items():
            tv = top(y); nf = ~torch.isfinite(tv)
            stats[k][0] += int((tv > 1.1).sum() + nf.sum()); stats[k][1] += int(nf.sum())
            stats[k][2] = max(stats[k][2], float(tv[~nf].max()) if (~nf).any() else 0.0)
    print(f"{shape[0]}x{shape[1]}: {n} matrices; " + "; ".join(f"{k} >1.1 {v[0]} (nonfinite {v[1]}) max {v[2]:.4f}" for k, v in stats.items()), flush=True)
