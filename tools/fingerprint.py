"""The fast path's bits on this machine: SHA-256 digests of what a few bank updates and drop-in steps
write, on fixed seeded inputs.

    python tools/fingerprint.py [--out FILE]

Two runs of the same code on the same device and software give the same digests; a refactor that
must not change behaviour (moving a helper, renaming an argument) is checked by running this before
and after it and comparing the files line by line. A digest says nothing about accuracy: the
differential tests judge that. On a machine without CUDA the banks are small and the Triton kernels
run in the interpreter (set TRITON_INTERPRET=1), so CPU and GPU digests are not comparable.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPU_SHAPES = ((8, 256, 768), (8, 768, 768), (8, 2816, 768), (4, 768, 3072))
CPU_SHAPES = ((3, 48, 32), (2, 32, 32), (2, 32, 80))
STEPS = 3


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def bank_rows(shapes, dev):
    from anvil_fast.core.bank import AnvilBank, anvil_bank_update

    for config in ("safe", "faithful", "gram_side"):
        for shape in shapes:
            g = torch.Generator().manual_seed(1234)
            p = (0.02 * torch.randn(shape, generator=g)).bfloat16().to(dev)
            bank = AnvilBank.create("b", p, beta2=0.95, config=config)
            bank.set_scalars(momentum=0.93, eff_wd=1e-4, fast_beta=0.85, fast_weight=0.44, eff_lr=0.02)
            for _ in range(STEPS):
                bank.grad.copy_(torch.randn(shape, generator=g))
                anvil_bank_update(bank)
            m = bank.mutated()
            yield f"bank {config} {'x'.join(map(str, shape))}", digest(m[k] for k in sorted(m))


def dropin_rows(size, dev):
    from anvil_fast import ANVIL
    from anvil_fast.models.gpt import build

    for kw in ({}, {"cuda_graphs": False}) if dev.type == "cuda" else ({},):
        model = build(size, seed=0, device=dev)
        opt = ANVIL(model, **kw)
        g = torch.Generator().manual_seed(99)
        for _ in range(STEPS):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(dev, p.dtype)
            opt.step()
        yield f"drop-in {size} {kw or 'defaults'}", digest(p for p in model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the digests to this file")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes, size = (GPU_SHAPES, "small") if dev.type == "cuda" else (CPU_SHAPES, "tiny")
    lines = []
    for name, d in [*bank_rows(shapes, dev), *dropin_rows(size, dev)]:
        lines.append(f"{name:<44} {d}")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
