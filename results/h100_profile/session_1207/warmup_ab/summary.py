"""Writes summary.log beside it: one line per first-step run of this folder, in the order the calls ran,
read from each run's peers.json and command.txt (python3 summary.py > summary.log)."""
import json

for f in ("warm_base_1", "warm_head_1", "warm_base_2", "warm_head_2"):
    d = json.load(open(f"{f}/peers.json"))
    note = open(f"{f}/command.txt").read().splitlines()[0]
    for r in d["rows"]:
        print(f"{f}: {r['contender']}: first step {r['first_step_s']:.1f} s, {r['ms']:.3f} ms/step, "
              f"host {r['host_ms']:.3f} ms ({note})")
