"""Second hidden-style probe: genuine field code and slips not covered before, through the public API (CPU)."""
import sys, time
import torch
from anvil_fast.testing import assert_orthogonalizer, OrthogonalizerMismatch, MUON_MATH, POLAR_EXPRESS_MATH

A_, B_, C_ = 3.4445, -4.7750, 2.0315

def _orient(fn):
    def run(G, *a, **k):
        X = G
        tall = X.size(-2) > X.size(-1)
        if tall:
            X = X.mT
        X = fn(X, *a, **k)
        return X.mT if tall else X
    run.__name__ = fn.__name__
    return run

# ---------------- genuine
@_orient
def inplace_div_bf16(X, steps=5):
    X = X.bfloat16().clone()
    X.div_(X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.add(A, A @ A, alpha=C_ / B_).mul_(B_)   # b*A + c*A@A via alpha, then scaled
        X = torch.add(B @ X, X, alpha=A_)
    return X

@_orient
def bmm_transpose(X, steps=5):
    squeeze = X.ndim == 2
    X = X.bfloat16()
    if squeeze:
        X = X.unsqueeze(0)
    X = X / (torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = torch.bmm(X, X.transpose(1, 2))
        B = B_ * A + C_ * torch.bmm(A, A)
        X = A_ * X + torch.bmm(B, X)
    return X.squeeze(0) if squeeze else X

def polar_express_paper(G):
    # Polar Express as its paper's code: per-step coefficients, norm * 1.02 + 1e-7, bf16, tall transposed
    coeffs = [tuple(t) for t in POLAR_EXPRESS_MATH["coeffs"]]
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X

# ---------------- slips
@_orient
def global_norm(X, steps=5):            # one norm for the whole batch
    X = X.bfloat16()
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def spectral_norm(X, steps=5):          # the normalization's kind: spectral for Frobenius
    X = X.bfloat16()
    X = X / (torch.linalg.matrix_norm(X.float(), ord=2, keepdim=True).bfloat16() + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def eps_in_sqrt(X, steps=5):            # eps inside the root
    X = X.bfloat16()
    X = X / (X.float().square().sum(dim=(-2, -1), keepdim=True) + 1e-7).sqrt().bfloat16()
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def eps_1e8(X, steps=5):                # eps 1e-8 for the declared 1e-7
    X = X.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-8)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def inplace_order_bug(X, steps=5):      # X.mul_(a) runs before B @ X reads X
    X = X.bfloat16().clone()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = B_ * A + C_ * A @ A
        X.mul_(A_).add_(B @ X)
    return X

@_orient
def margin_1001(X, steps=5):            # margin 1.001 for the declared 1.0
    X = X.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.001 + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def normalize_after_first(X, steps=5):  # the first step on the raw input
    X = X.bfloat16()
    for i in range(steps):
        if i == 1:
            X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def b_plus_1e3_step4(X, steps=5):
    X = X.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for i in range(steps):
        b = B_ + (1e-3 if i == 3 else 0.0)
        A = X @ X.mT
        X = A_ * X + (b * A + C_ * A @ A) @ X
    return X

@_orient
def a_minus_1e3_step1(X, steps=5):
    X = X.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for i in range(steps):
        a = A_ - (1e-3 if i == 0 else 0.0)
        A = X @ X.mT
        X = a * X + (B_ * A + C_ * A @ A) @ X
    return X

def no_transpose_back(G, steps=5):      # transposes a tall input and returns it so
    X = G.bfloat16()
    if X.size(-2) > X.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
    return X

@_orient
def one_step_fp16(X, steps=5):          # one step in float16
    X = X.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for i in range(steps):
        if i == 2:
            X = X.half()
        A = X @ X.mT
        X = A_ * X + (B_ * A + C_ * A @ A) @ X
        X = X.bfloat16()
    return X

@_orient
def steps_reversed_pe(X):               # Polar Express with its steps in reverse order
    coeffs = [tuple(t) for t in POLAR_EXPRESS_MATH["coeffs"]][::-1]
    X = X.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X

GENUINE = {"inplace_div_bf16": (inplace_div_bf16, MUON_MATH), "bmm_transpose": (bmm_transpose, MUON_MATH),
           "polar_express_paper": (polar_express_paper, POLAR_EXPRESS_MATH)}
SLIPS = {n: (f, POLAR_EXPRESS_MATH if n == "steps_reversed_pe" else MUON_MATH) for n, f in [
    ("global_norm", global_norm), ("spectral_norm", spectral_norm), ("eps_in_sqrt", eps_in_sqrt), ("eps_1e8", eps_1e8),
    ("inplace_order_bug", inplace_order_bug), ("margin_1001", margin_1001),
    ("normalize_after_first", normalize_after_first), ("b_plus_1e3_step4", b_plus_1e3_step4),
    ("a_minus_1e3_step1", a_minus_1e3_step1), ("no_transpose_back", no_transpose_back),
    ("one_step_fp16", one_step_fp16), ("steps_reversed_pe", steps_reversed_pe)]}

if __name__ == "__main__":
    which = sys.argv[1:] or list(GENUINE) + list(SLIPS)
    for name in which:
        fn, math_ = (GENUINE | SLIPS)[name]
        kind = "genuine" if name in GENUINE else "slip"
        t = time.time()
        try:
            assert_orthogonalizer(fn, **math_)
            res = "PASS"
            detail = ""
        except OrthogonalizerMismatch as e:
            res = "FAIL"
            detail = str(e).splitlines()[0][:300]
        except Exception as e:  # noqa
            res = "ERROR"
            detail = f"{type(e).__name__}: {str(e)[:300]}"
        ok = (res == "PASS") == (kind == "genuine")
        print(f"{'OK ' if ok else 'BAD'} {kind:8s} {name:24s} {res:5s} {time.time()-t:6.1f}s  {detail}", flush=True)
