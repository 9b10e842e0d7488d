import torch, math, sys
from anvil_fast.core.cascade import fast_gram_side, fast_cascade
from anvil_fast.kernels.equalizer import GUARD_NORM_RATIO
torch.manual_seed(0)
DEV = sys.argv[1] if len(sys.argv) > 1 else "cpu"
def fam(kind, m, n, b):
    if m < n:
        return fam(kind, n, m, b).mT.contiguous()
    if kind == "gauss":
        return torch.randn(b, m, n)
    if kind == "lowrank":   # rank-r signal plus small noise
        r = 4
        return torch.randn(b, m, r) @ torch.randn(b, r, n) + 0.01 * torch.randn(b, m, n)
    if kind == "decay":     # power-law spectrum
        U, _ = torch.linalg.qr(torch.randn(b, m, n)); V, _ = torch.linalg.qr(torch.randn(b, n, n))
        s = torch.arange(1, n + 1, dtype=torch.float32) ** -1.5
        return U @ torch.diag_embed(s.expand(b, n)) @ V.transpose(-1, -2)
    if kind == "spike":     # one dominant direction, the rest gaussian
        return 30 * torch.randn(b, m, 1) @ torch.randn(b, 1, n) / math.sqrt(m * n) * math.sqrt(n) + torch.randn(b, m, n) / math.sqrt(m)
for (m, n) in [(1536, 384), (384, 1536), (1152, 384), (3072, 768), (1280, 640)]:
    for kind in ["gauss", "lowrank", "decay", "spike"]:
        b = 24 if n == 384 else 6
        x = fam(kind, m, n, b).to(DEV)
        k = min(m, n)
        lim = GUARD_NORM_RATIO * math.sqrt(k)
        out = {}
        for name, f in (("safe", lambda t: fast_cascade(t, config="safe")), ("gram_side", fast_gram_side)):
            y = f(x).float()
            r = y.flatten(1).norm(dim=1)
            s = torch.linalg.svdvals(y.cpu())
            out[name] = (int((~torch.isfinite(r) | (r > lim)).sum()), float(s.max()), float(r.max() / math.sqrt(k)), int((s.amax(-1) > 1.1).sum()))
        print(m, n, kind, out, flush=True)
