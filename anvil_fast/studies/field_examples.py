"""Orthogonalizations written the way the field writes them, and the slips the harness must catch.

The genuine ones (each a plain function of a batch ``[..., rows, cols]``, judged by
:func:`anvil_fast.studies.harness.assert_orthogonalizer` or ``python -m anvil_fast.studies.difftest
--impl anvil_fast.studies.field_examples:NAME`` with the math in :data:`DECLARED`):

``muon_newton_schulz``        Muon's quintic as Keller Jordan's Muon and modded-nanogpt write it: the
                              input cast to bf16, ``X / (||X||_F + eps)``, tall matrices transposed,
                              then per step ``A = X X^T; B = b*A + c*A@A; X = a*X + B@X`` (unfused)
``muon_newton_schulz_fused``  the same steps through ``torch.baddbmm`` (fused, as torch's Muon writes them)
``polar_express``             Polar Express's five-step schedule, normalized by ``1.02 ||X||_F + 1e-7``,
                              unfused steps, as its reference code writes it
``polar_express_compiled``    the same steps as torch.compile fuses them on the CPU, modelled without a
                              compiler (not an adapter: the harness's test of its ``compiled`` form)
``muon_newton_schulz_compiled``  ``muon_newton_schulz`` under ``torch.compile`` (compiled on its first
                              call), as dion's and modded-nanogpt's compiled steps run
``muon_newton_schulz_horner`` the same quintic in Horner form as heavyball writes it: the fp32 input
                              normalized in fp32, then rounded to bf16, per step ``Y = c*A;
                              Y += b I; Y = Y@A; Y += a I; X = Y@X`` (the scalars added in place)
``muon_newton_schulz_expanded``  the quintic as the polynomial reads, ``X = a*X + b*A@X + c*A@A@X``:
                              its bf16 rounding shifts small singular values beyond every eager
                              form's (the spectrum probe sees it); the lifted run finds its math the
                              declared one, so the shift is reported as its rounding

The mutation set (:data:`MUTANTS`): :func:`muon_newton_schulz` with one slip each -- a coefficient of
one step off by 1e-3 (every step, a, b and c), the margin, eps, the normalization's kind, the
transpose dropped, the input in float16, the output zero, NaN, the identity or the input itself, a
step dropped. Every one FAILs the harness against :data:`MUON_MATH` (tests/test_harness.py, through
the API and the command line: ``--impl anvil_fast.studies.field_examples:mutant_NAME``).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Muon's quintic (Keller Jordan), five steps.
MUON_ABC = (3.4445, -4.7750, 2.0315)
MUON_STEPS = 5
#: The declared math of muon_newton_schulz and muon_newton_schulz_fused (assert_orthogonalizer's keywords).
MUON_MATH = dict(coeffs=[MUON_ABC], steps=MUON_STEPS, normalization="frobenius", margin=1.0, eps=1e-7,
                 transpose_when="tall")
#: Polar Express (Amsel, Persson, Musco, Gower 2025): its published five-step schedule for bf16, margin 1.02.
POLAR_EXPRESS_ABC = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                     (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                     (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                     (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                     (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_EXPRESS_MATH = dict(coeffs=POLAR_EXPRESS_ABC, normalization="frobenius", margin=1.02, eps=1e-7,
                          transpose_when="tall")


def _orthogonalize(G: Tensor, coeffs, *, eps=1e-7, margin=1.0, clamp=False, transpose=True, fused=False,
                   dtype=torch.bfloat16) -> Tensor:
    X = G.to(dtype)
    tall = transpose and G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True) * margin
    X = X / (norm.clamp_min(eps) if clamp else norm + eps)
    X = X.bfloat16()
    for a, b, c in coeffs:
        A = X @ X.mT
        if fused:
            B = torch.baddbmm(A, A, A, beta=b, alpha=c) if A.ndim == 3 else torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a) if X.ndim == 3 else torch.addmm(X, B, X, beta=a)
        else:
            B = b * A + c * A @ A
            X = a * X + B @ X
    if tall:
        X = X.mT
    return X


def muon_newton_schulz(G: Tensor, steps: int = MUON_STEPS, eps: float = 1e-7) -> Tensor:
    """Muon's Newton-Schulz as Keller Jordan's Muon and modded-nanogpt write it (unfused steps)."""
    a, b, c = MUON_ABC
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


_COMPILED: list = []


def muon_newton_schulz_compiled(G: Tensor) -> Tensor:
    """:func:`muon_newton_schulz` compiled by ``torch.compile`` (once, on the first call)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(muon_newton_schulz))
    return _COMPILED[0](G)


def muon_newton_schulz_horner(G: Tensor, steps: int = MUON_STEPS, eps: float = 1e-7) -> Tensor:
    """Muon's quintic in Horner form, ``X <- (a I + (b I + c A) A) X`` with ``A = X X^T``, each
    operation in bf16 and the scalars added to the diagonal in place; normalized in the input's fp32."""
    a, b, c = MUON_ABC
    X = (G.float() / (G.float().norm(dim=(-2, -1), keepdim=True) + eps)).bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        Y = c * A
        Y.diagonal(dim1=-2, dim2=-1).add_(b)
        Y = Y @ A
        Y.diagonal(dim1=-2, dim2=-1).add_(a)
        X = Y @ X
    return X.mT if tall else X


def muon_newton_schulz_expanded(G: Tensor, steps: int = MUON_STEPS, eps: float = 1e-7) -> Tensor:
    """Muon's quintic written as the polynomial reads, ``X <- a X + b A X + c A A X`` with ``A = X X^T``
    (Python evaluates ``c * A @ A @ X`` as ``((c A) A) X``): three products a step, each term rounded
    on its own; its bf16 rounding leans another way than the fused and unfused forms' at small singular
    values."""
    a, b, c = MUON_ABC
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + b * A @ X + c * A @ A @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_newton_schulz_fused(G: Tensor) -> Tensor:
    """The same quintic with each step's two updates fused (``baddbmm`` / ``addmm``)."""
    return _orthogonalize(G, [MUON_ABC] * MUON_STEPS, fused=True)


def polar_express(G: Tensor) -> Tensor:
    """Polar Express's schedule as its reference code writes it (bf16, unfused steps; a tall matrix's
    Gram formed as X^T X)."""
    return _polar_express(G, POLAR_EXPRESS_ABC)


def _polar_express(G: Tensor, coeffs) -> Tensor:
    X = G.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-7)
    tall = G.size(-2) > G.size(-1)
    for a, b, c in coeffs:
        if tall:
            A = X.mT @ X
            B = b * A + c * (A @ A)
            X = a * X + X @ B
        else:
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return X


def polar_express_compiled(G: Tensor) -> Tensor:
    """Polar Express's unfused steps as torch.compile turns them into kernels (dion's compiled
    ``polar_express``), modelled without a compiler: the normalization in fp32 rounded once, each
    product rounded once to bf16, each line's element-wise part (``b*A + c*AA``, ``a*X + BX``) in fp32
    rounded once."""
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    Xf = X.float()
    X = (Xf / (Xf.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-7)).bfloat16()
    for a, b, c in POLAR_EXPRESS_ABC:
        A = X @ X.mT
        B = (b * A.float() + c * (A @ A).float()).bfloat16()
        X = (a * X.float() + (B @ X).float()).bfloat16()
    return X.mT if tall else X


#: The genuine examples and the math each declares.
DECLARED = {"muon_newton_schulz": MUON_MATH, "muon_newton_schulz_fused": MUON_MATH,
            "muon_newton_schulz_compiled": MUON_MATH, "muon_newton_schulz_horner": MUON_MATH,
            "muon_newton_schulz_expanded": MUON_MATH, "polar_express": POLAR_EXPRESS_MATH}


# ------------------------------------------------------------------------------ the mutation set

def _slipped(step: int, which: int, delta: float = 1e-3):
    coeffs = [list(MUON_ABC) for _ in range(MUON_STEPS)]
    coeffs[step][which] += delta
    return lambda G: _orthogonalize(G, coeffs)


def _mutants() -> dict:
    base = [MUON_ABC] * MUON_STEPS
    out = {}
    for step in range(MUON_STEPS):
        for i, letter in enumerate("abc"):
            out[f"step{step + 1}_{letter}_plus_1e-3"] = _slipped(step, i)
            out[f"step{step + 1}_{letter}_minus_1e-3"] = _slipped(step, i, -1e-3)
    out.update({
        "margin_1.02": lambda G: _orthogonalize(G, base, margin=1.02),
        "eps_1e-5": lambda G: _orthogonalize(G, base, eps=1e-5),
        "normalization_clamped": lambda G: _orthogonalize(G, base, clamp=True),
        "no_transpose": lambda G: _orthogonalize(G, base, transpose=False),
        "float16_input": lambda G: _orthogonalize(G, base, dtype=torch.float16),
        "zero_output": lambda G: torch.zeros_like(G, dtype=torch.bfloat16),
        "nan_output": lambda G: _orthogonalize(G, base) * float("nan"),
        "identity_output": lambda G: torch.eye(G.size(-2), G.size(-1), dtype=torch.bfloat16).expand_as(G).clone(),
        "input_returned": lambda G: (G / G.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)).bfloat16(),
        "step_dropped": lambda G: _orthogonalize(G, base[:-1]),
    })
    for name, fn in out.items():
        fn.__name__ = fn.__qualname__ = f"mutant_{name.replace('.', '_').replace('-', '_')}"
    return out


#: Every slip of the mutation set, by name: each a function of a batch that FAILs against MUON_MATH.
MUTANTS = _mutants()
globals().update({fn.__name__: fn for fn in MUTANTS.values()})


def _polar_express_mutants() -> dict:
    out = {}
    for step in range(len(POLAR_EXPRESS_ABC)):
        for i, letter in enumerate("abc"):
            for sign, word in ((1, "plus"), (-1, "minus")):
                coeffs = [list(t) for t in POLAR_EXPRESS_ABC]
                coeffs[step][i] += sign * 1e-3
                fn = (lambda co: lambda G: _polar_express(G, co))(coeffs)
                fn.__name__ = fn.__qualname__ = f"polar_express_mutant_step{step + 1}_{letter}_{word}_1e_3"
                out[f"step{step + 1}_{letter}_{word}_1e-3"] = fn
    return out


#: Polar Express (:data:`POLAR_EXPRESS_MATH`, unfused steps) with one coefficient of one step off by 1e-3:
#: the slips the math verdict is measured against where the coefficients are large (step 1's) and the
#: composite contracts an early slip before the output (tests/test_harness.py states which it catches).
POLAR_EXPRESS_MUTANTS = _polar_express_mutants()
globals().update({fn.__name__: fn for fn in POLAR_EXPRESS_MUTANTS.values()})
