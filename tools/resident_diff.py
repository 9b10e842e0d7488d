"""Which device allocations an optimizer holds beyond the model and its gradients (CUDA only).

    python tools/resident_diff.py --size small --contender anvil [--no-forward]

For one contender of ``python -m anvil_fast.bench peers``, in a fresh process (what one contender
leaves behind, a library's workspace say, would sit in the next one's baseline), as that bench
measures its "resident MiB": the model, its fixed gradients,
the baseline; the optimizer built and ``--warmup`` steps taken. With CUDA's allocator history on,
it then lists every allocation live after the steps and not live at the baseline, grouped by the
first frame outside torch's own files, with their count and MiB, largest first; their sum is the
bench's resident figure. As in that bench, one forward of the model (no gradient, one row of tokens,
:func:`anvil_fast.bench.peers.first_forward`) runs before the baseline, as a training loop's forward
runs before the optimizer's first step: what the forward's libraries allocate once per process (a
matmul library's workspace) belongs to the baseline, not to the optimizer; ``--no-forward`` leaves it
out, to see what such a workspace costs the contender that allocates it first.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

MIB = 2.0 ** 20


def _live(snapshot: dict) -> dict[int, dict]:
    """address -> block of every allocated block in a memory snapshot."""
    out = {}
    for seg in snapshot["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[addr] = b
            addr += b["size"]
    return out


def _where(block: dict) -> str:
    """The first frame of the block's allocation stack outside torch's and Python's own files."""
    for f in block.get("frames", []):
        name = f.get("filename", "")
        if not name.endswith(".py") or "/torch/" in name or name.startswith("<") or "/python3" in name and "site-packages" not in name:
            continue
        return f"{'/'.join(name.rsplit('/', 2)[-2:])}:{f.get('line')} {f.get('name')}"
    return "(no frame outside torch)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--contender", default="anvil")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/resident_diff.py needs CUDA")
        return 2
    from anvil_fast.bench import peers as P

    dev = torch.device("cuda")
    for name in [a.contender]:
        c = P.contender(name)
        model = P.build_model(a.size, dev)
        params = [p for p in model.parameters() if p.requires_grad]
        fixed = P.fixed_gradients(params, dev)
        P.load_gradients(params, fixed)
        if not a.no_forward:
            P.first_forward(model, dev)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        base_bytes = torch.cuda.memory_allocated()
        base = _live(torch.cuda.memory._snapshot())
        opt = c.build(model, dev, a.warmup)
        for _ in range(a.warmup):
            P.load_gradients(params, fixed)
            opt.step()
        torch.cuda.synchronize()
        after = _live(torch.cuda.memory._snapshot())
        resident = (torch.cuda.memory_allocated() - base_bytes) / MIB
        torch.cuda.memory._record_memory_history(enabled=None)
        new = [b for addr, b in after.items() if addr not in base]
        groups = collections.defaultdict(lambda: [0, 0])
        for b in new:
            g = groups[_where(b)]
            g[0] += 1
            g[1] += b["size"]
        print(f"{name} {a.size}{' (no forward first)' if a.no_forward else ''}: resident {resident:.1f} MiB, "
              f"{len(new)} allocations new since the baseline, {sum(b['size'] for b in new) / MIB:.1f} MiB")
        for where, (n, size) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"  {size / MIB:9.2f} MiB  {n:5d}  {where}")
        del opt, model, params, fixed
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
