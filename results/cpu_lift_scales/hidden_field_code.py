"""Hidden-style genuine implementations and slips, judged through the public API (CPU)."""
import sys, time, traceback
import torch
from anvil_fast.testing import assert_orthogonalizer, OrthogonalizerMismatch, MUON_MATH

A_, B_, C_ = 3.4445, -4.7750, 2.0315

def _norm(X, eps=1e-7):
    return X / (X.norm(dim=(-2, -1), keepdim=True) + eps)

def right_gram(G, steps=5):
    X = _norm(G.bfloat16())
    tall = X.size(-2) > X.size(-1)
    for _ in range(steps):
        if tall:
            A = X.mT @ X
            X = A_ * X + X @ (B_ * A + C_ * A @ A)
        else:
            A = X @ X.mT
            X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

def expanded(G, steps=5):
    X = G.bfloat16()
    if X.size(-2) > X.size(-1):
        X = X.mT
    X = _norm(X)
    for _ in range(steps):
        A = X @ X.mT
        AX = A @ X
        X = A_ * X + B_ * AX + C_ * (A @ AX)
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X

def fp32_iter(G, steps=5):
    X = G.float()
    if X.size(-2) > X.size(-1):
        X = X.mT
    X = _norm(X)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X

def norm_fp32_then_bf16(G, steps=5):
    X = _norm(G.float()).bfloat16()
    if X.size(-2) > X.size(-1):
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = B_ * A + C_ * A @ A
        X = A_ * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X

def matrix_norm_einsum(G, steps=5):
    X = G.bfloat16()
    t = X.size(-2) > X.size(-1)
    if t:
        X = X.transpose(-2, -1)
    X = X / (torch.linalg.matrix_norm(X.float(), keepdim=True).bfloat16() + 1e-7)
    for _ in range(steps):
        A = torch.einsum("bij,bkj->bik", X, X)
        B = B_ * A + C_ * torch.einsum("bij,bjk->bik", A, A)
        X = A_ * X + torch.einsum("bij,bjk->bik", B, X)
    return X.transpose(-2, -1) if t else X

def inplace_baddbmm(G, steps=5):
    X = G.bfloat16()
    t = X.size(-2) > X.size(-1)
    if t:
        X = X.mT
    X = X.div(X.norm(dim=(-2, -1), keepdim=True).add_(1e-7))
    for _ in range(steps):
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=B_, alpha=C_)
        X = torch.baddbmm(X, B, X, beta=A_, alpha=1.0)
    return X.mT if t else X

def per_matrix_loop(G, steps=5):
    out = []
    for M in G.unbind(0):
        X = M.bfloat16()
        if M.size(0) > M.size(1):
            X = X.T
        X = X / (X.norm() + 1e-7)
        for _ in range(steps):
            A = torch.mm(X, X.T)
            X = torch.addmm(X, torch.addmm(A, A, A, beta=B_, alpha=C_), X, beta=A_)
        out.append(X.T if M.size(0) > M.size(1) else X)
    return torch.stack(out)

def fp16_iter(G, steps=5):
    X = G.half()
    if X.size(-2) > X.size(-1):
        X = X.mT
    X = _norm(X)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X

def generic(G, coeffs, *, eps=1e-7, margin=1.0, steps=5, trans="tall", norm="fro", batch_norm=False, scale=False, swap=False):
    X = G.bfloat16()
    tall = X.size(-2) > X.size(-1)
    t = tall if trans == "tall" else (not tall and X.size(-2) != X.size(-1)) if trans == "wide" else False
    if t:
        X = X.mT
    if batch_norm:
        n = X.norm()
    elif norm == "spectral":
        n = torch.linalg.matrix_norm(X.float(), ord=2, keepdim=True).bfloat16()
    else:
        n = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (margin * n + eps)
    for i in range(steps):
        a, b, c = coeffs[min(i, len(coeffs) - 1)]
        if swap:
            b, c = c, b
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if t:
        X = X.mT
    if scale:
        X = X * max(1, G.size(-2) / G.size(-1)) ** 0.5
    return X

M = [(A_, B_, C_)]
GENUINE = {f.__name__: f for f in [right_gram, expanded, fp32_iter, norm_fp32_then_bf16, matrix_norm_einsum, inplace_baddbmm, per_matrix_loop]}
SLIPS = {
    "transpose_when_wide": lambda G: generic(G, M, trans="wide"),
    "spectral_norm": lambda G: generic(G, M, norm="spectral"),
    "six_steps": lambda G: generic(G, M, steps=6),
    "b_c_swapped": lambda G: generic(G, M, swap=True),
    "muon_scale_included": lambda G: generic(G, M, scale=True),
    "batch_norm_not_per_matrix": lambda G: generic(G, M, batch_norm=True),
    "margin_1.001": lambda G: generic(G, M, margin=1.001),
    "eps_1e-3": lambda G: generic(G, M, eps=1e-3),
    "step3_c_minus_5e-4": lambda G: generic(G, [M[0]] * 2 + [(A_, B_, C_ - 5e-4)] + [M[0]] * 2),
    "step1_a_minus_1e-3": lambda G: generic(G, [(A_ - 1e-3, B_, C_)] + [M[0]] * 4),
}
if __name__ == "__main__":
  which = sys.argv[1]
  names = sys.argv[2:]
  table = GENUINE if which == "genuine" else SLIPS
  for name in names or table:
    fn = table[name]
    t0 = time.time()
    try:
        assert_orthogonalizer(fn, name=name, **MUON_MATH)
        res = "pass"
        detail = ""
    except OrthogonalizerMismatch as e:
        res = "FAIL"
        detail = str(e).split("\n\n")[0]
    except Exception as e:
        res = "ERROR"
        detail = traceback.format_exc()
    print(f"== {which} {name}: {res} ({time.time()-t0:.0f} s)\n{detail}", flush=True)
