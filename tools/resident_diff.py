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

``--held`` adds what the bench's "held MiB" column counts beyond the resident figure: after the steps
and ``torch.cuda.empty_cache()``, the reserved segments new since the baseline by memory pool (the
allocator's own pool, and each CUDA graph's private pool, which keeps what a capture allocated for
the graph's replays), with their allocated and free bytes; and, inside the graphs' pools, the
allocations the history recorded there grouped by where they were made and by stream, with the
largest single one of each group (a capture's temporaries: freed inside the capture, their memory
stays with the pool).
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


def held_by_pool(snapshot: dict, base_segments: set[int]) -> list[dict]:
    """The segments of ``snapshot`` not in ``base_segments`` (addresses), summed by pool:
    ``[{"pool", "segments", "reserved", "allocated"}]``, largest first; ``pool`` is "allocator" for
    the allocator's own pool (id (0, 0)) and "graph pool <id>" for a private one."""
    pools: dict[str, dict] = {}
    for seg in snapshot["segments"]:
        if seg["address"] in base_segments:
            continue
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        name = "allocator" if pid == (0, 0) else f"graph pool {pid[0]}.{pid[1]}"
        p = pools.setdefault(name, {"pool": name, "segments": 0, "reserved": 0, "allocated": 0})
        p["segments"] += 1
        p["reserved"] += seg["total_size"]
        p["allocated"] += sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    return sorted(pools.values(), key=lambda p: -p["reserved"])


def graph_pool_allocations(snapshot: dict, base_segments: set[int]) -> list[dict]:
    """The allocations the recorded history made inside private (graph) pools' new segments, grouped by
    (where, stream): ``[{"where", "stream", "count", "bytes", "largest"}]``, largest ``bytes`` first."""
    ranges = [(seg["address"], seg["address"] + seg["total_size"]) for seg in snapshot["segments"]
              if seg["address"] not in base_segments and tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0)]
    groups: dict[tuple, dict] = {}
    for trace in snapshot.get("device_traces", []):
        for ev in trace:
            if ev.get("action") != "alloc" or not any(lo <= ev["addr"] < hi for lo, hi in ranges):
                continue
            key = (_where(ev), ev.get("stream", 0))
            g = groups.setdefault(key, {"where": key[0], "stream": key[1], "count": 0, "bytes": 0, "largest": 0})
            g["count"] += 1
            g["bytes"] += ev["size"]
            g["largest"] = max(g["largest"], ev["size"])
    return sorted(groups.values(), key=lambda g: -g["bytes"])


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
    ap.add_argument("--held", action="store_true", help="also the reserved memory by pool after empty_cache(), "
                    "and the allocations made inside the graphs' pools")
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
        base_snap = torch.cuda.memory._snapshot()
        base = _live(base_snap)
        base_segments = {seg["address"] for seg in base_snap["segments"]}
        opt = c.build(model, dev, a.warmup)
        for _ in range(a.warmup):
            P.load_gradients(params, fixed)
            opt.step()
        torch.cuda.synchronize()
        after = _live(torch.cuda.memory._snapshot())
        resident = (torch.cuda.memory_allocated() - base_bytes) / MIB
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
        if a.held:
            torch.cuda.empty_cache()
            snap = torch.cuda.memory._snapshot()
            held = (torch.cuda.memory_reserved() - base_bytes) / MIB
            print(f"{name} {a.size}: held {held:.1f} MiB (reserved after empty_cache() minus the baseline's allocated); "
                  "new segments by pool:")
            for p in held_by_pool(snap, base_segments):
                print(f"  {p['pool']:>18}: {p['reserved'] / MIB:9.2f} MiB reserved, {p['allocated'] / MIB:9.2f} MiB "
                      f"allocated, {p['segments']} segment(s)")
            print("  allocations made inside the graphs' pools (MiB in all, count, largest MiB, stream, where):")
            for g in graph_pool_allocations(snap, base_segments)[:a.top]:
                print(f"  {g['bytes'] / MIB:9.2f}  {g['count']:5d}  {g['largest'] / MIB:8.2f}  {g['stream']}  {g['where']}")
        torch.cuda.memory._record_memory_history(enabled=None)
        del opt, model, params, fixed
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
