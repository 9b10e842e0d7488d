"""Writes summary.log beside it: one line per first-step run of this folder, in the order the calls ran,
read from each run's peers.json and command.txt (python3 summary.py > summary.log)."""
import json

for f in ("warm_branch", "warm_base", "warm_branch2", "warm_base2"):
    d = json.load(open(f"{f}/peers.json"))
    r = d["rows"][0]
    note = open(f"{f}/command.txt").read().splitlines()[0]
    print(f"{f}: first step {r['first_step_s']:.1f} s, {r['ms']:.3f} ms/step, host {r['host_ms']:.3f} ms ({note})")
