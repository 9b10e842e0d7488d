"""Write the Gram kernels' shipped tuning decisions for this device (CUDA only).

    python tools/gram_tuned_table.py [--out anvil_fast/kernels/gram_tuned.json] [--note TEXT]

Tunes every Gram problem the drop-in meets on the package's GPT (``--sizes``, default small and
medium; gpt2small's banks are medium's) and the GPT-2-small bank layout of ``python -m anvil_fast.bench optimizer``, with
``ANVIL_FAST_TUNE=fresh`` (every key tuned here, none taken from the file), and writes the decisions
whose choice was bit-identical to v1 (:func:`anvil_fast.kernels.gram_tune.table_entries`) into the
file with the device's architecture, keeping the entries of other devices and Triton versions made for
these kernels (an entry made for other kernel sources can never match and is dropped). A fresh process
on the same device (or one of the same architecture that has no decision of its own), Triton and
kernels then compiles one configuration per problem instead of every candidate
(:mod:`anvil_fast.kernels.gram_tune`).

    python tools/gram_tuned_table.py --rates [--peak-tflops T]

prints, without a GPU, the rate each stored full-product decision (``mm_add``: ``a X + B X``, 2 m n k
FLOPs per matrix) reached alone when it was tuned: what one lane's products run at on that device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def merged_entries(old: list[dict], mine: list[dict], current: str) -> tuple[list[dict], int, int]:
    """The file's entries after this device's run: ``mine`` replaces every old entry of its device and
    Triton version; another device's or version's entry stays where it was made for the ``current``
    kernels' digest, and goes where it was not (the digest is part of the key: it can never match
    again). Returns the sorted entries, how many old ones were kept and how many were dropped as stale."""
    same = {(e["device"], e["triton"]) for e in mine}
    kept = [e for e in old if (e["device"], e["triton"]) not in same and e["kernels"] == current]
    dropped = sum(e["kernels"] != current for e in old)
    entries = sorted(kept + mine, key=lambda e: (e["device"], e["triton"], e["kernels"], e["op"], e["m"], e["n"],
                                                  e["k"], e["batch"]))
    return entries, len(kept), dropped


def rate_lines(data: dict, peak_tflops: float | None = None) -> list[str]:
    """Per stored ``mm_add`` decision, its tuned time and rate (2 m n k x batch FLOPs over that time)."""
    out = [f"{data.get('generated_by', '?')}"]
    for e in data["entries"]:
        if e["op"] != "mm_add":
            continue
        rate = 2 * e["m"] * e["n"] * e["k"] * e["batch"] / (e["us"] * 1e-6) / 1e12
        out.append(f"{e['device']}  mm_add {e['batch']}x{e['m']}x{e['n']} (k {e['k']}): {e['us']:.1f} us, "
                   f"{rate:.0f} TFLOP/s" + (f", {100 * rate / peak_tflops:.0f}% of {peak_tflops:g}" if peak_tflops else ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--out", default=None, help="default: anvil_fast/kernels/gram_tuned.json")
    ap.add_argument("--note", default="", help="added to the file's generated_by line (where it ran)")
    ap.add_argument("--rates", action="store_true", help="print the stored full products' rates (no GPU) and stop")
    ap.add_argument("--peak-tflops", type=float, default=None, help="with --rates: the device's measured bf16 peak")
    a = ap.parse_args(argv)
    if a.rates:
        from anvil_fast.kernels.gram_tune import TUNED_FILE

        path = Path(a.out) if a.out else TUNED_FILE
        try:
            print("\n".join(rate_lines(json.loads(path.read_text()), a.peak_tflops)))
        except (OSError, ValueError, KeyError) as e:
            print(f"tools/gram_tuned_table.py --rates: {path}: not a readable tuning table ({e!r})", file=sys.stderr)
            return 2
        return 0
    if not torch.cuda.is_available():
        print("tools/gram_tuned_table.py needs CUDA")
        return 2
    os.environ["ANVIL_FAST_TUNE"] = "fresh"
    from anvil_fast.bench.dropin import _model, _set_grads
    from anvil_fast.bench import optimizer as B
    from anvil_fast.kernels import gram_tune as GT
    from anvil_fast.optim.entry import ANVIL
    from anvil_ref.provenance import source_commit

    dev = torch.device("cuda")
    GT.reset()
    for size in [s for s in a.sizes.split(",") if s]:
        model = _model(size, dev)
        _set_grads(model, dev)
        opt = ANVIL(model)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        print(f"{size}: {len(GT.RECORDS)} decisions so far", flush=True)
        del opt, model
    layout = B.gpt2_small_layout()
    opt, params = B.fast_optimizer(layout, dev)
    grads = B.make_grads(params)
    step = B.step_fn(opt, params, grads, True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"GPT-2-small layout: {len(GT.RECORDS)} decisions", flush=True)
    name = torch.cuda.get_device_name(dev)
    mine = GT.table_entries(GT.RECORDS, name, GT.device_arch(torch.cuda.get_device_properties(dev)))
    out = Path(a.out) if a.out else GT.TUNED_FILE
    old = json.loads(out.read_text()) if out.is_file() else {"entries": []}
    entries, kept, dropped = merged_entries(old["entries"], mine, GT.kernels_digest())
    import triton

    data = {"generated_by": f"tools/gram_tuned_table.py --sizes {a.sizes} at commit {source_commit() or 'unknown'} on {name} (torch "
                            f"{torch.__version__}, triton {triton.__version__}){' ' + a.note if a.note else ''}; "
                            "do not edit",
            "entries": entries}
    out.write_text(json.dumps(data, indent=1) + "\n")
    skipped = len(GT.RECORDS) - len(mine)
    print(f"wrote {len(mine)} decisions for {name} to {out} ({kept} of other devices or versions kept, "
          f"{dropped} made for other kernels dropped; {skipped} not written: shipped, cuBLAS or not bit-identical to v1)")
    print("\n".join(GT.report_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
