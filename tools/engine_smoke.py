"""The one-process device-decided step on a GPU, first thing: the package's small GPT, the default
(graphed, gradients read in place, banks on side streams) against the eager device part
(``cuda_graphs=False``), over steps with an LR scheduler, a NaN step and a member without a
gradient; bit for bit, or exit 1 naming the first parameter that differs.

    python tools/engine_smoke.py [--size small] [--steps 8]
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    from anvil_fast.models import gpt
    from anvil_fast import ANVIL

    m = gpt.build(a.size, seed=0, device="cuda")
    m2 = copy.deepcopy(m)
    o1, o2 = ANVIL(m), ANVIL(m2, cuda_graphs=False)
    e = o1.engine
    print(f"grad_read {o1.grad_read}, graphs {e.use_graphs}, lanes {len(e.lanes)}, banks {len(e.banks)}", flush=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 - s / (4 * a.steps)) for o in (o1, o2)]
    idle = "blocks.1.attn.qkv.weight"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(a.steps):
            for mm, oo, sc in ((m, o1, scheds[0]), (m2, o2, scheds[1])):
                g = torch.Generator(device="cuda").manual_seed(s)
                for p in mm.parameters():
                    p.grad = 1e-3 * torch.randn(p.shape, device="cuda", generator=g)
                if s == 2:
                    mm.blocks[0].mlp.fc.weight.grad[0, 0] = float("nan")
                if s >= 4:
                    dict(mm.named_parameters())[idle].grad = None
                oo.step()
                sc.step()
        counts = (o1.taken_steps, o1.skipped_steps, o2.taken_steps, o2.skipped_steps)
    torch.cuda.synchronize()
    print(f"taken/skipped graphed {counts[:2]}, eager {counts[2:]}; captures {e.captures}, replays {e.replays}; "
          f"{sum('non-finite gradient' in str(w.message) for w in caught)} skip warnings")
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        if not torch.equal(p, q):
            print(f"FAIL: {n} differs between the graphed and the eager step (max |diff| "
                  f"{(p - q).abs().max().item():.3g})")
            return 1
    if counts != (a.steps - 1, 1, a.steps - 1, 1):
        print(f"FAIL: counts {counts}")
        return 1
    print("ok: graphed == eager bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
