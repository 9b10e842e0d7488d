"""Replay the inputs the guard refused (saved by diag_explode.py eager OUT ...) through the Gram side with
every restart schedule of the study, on the CPU's torch path:

    PYTHONPATH=. python results/h100_profile/host_and_gram_side_384/replay_refused.py MAPS OUT

prints, per schedule, the largest top singular value over the first 12 saved inputs and how many pass 1.1."""
import glob
import sys
import time

import torch

from anvil_fast.core.cascade import fast_gram_side
from anvil_fast.studies import gram_side_study as S
from anvil_fast.studies.near_rank1 import top_singular_value
from anvil_ref.maps import load_maps

maps, folder = sys.argv[1], sys.argv[2]
xs = [torch.load(f)["x"] for f in sorted(glob.glob(f"{folder}/exploded_*.pt"))[:12]]
for sched in S.study_schedules(len(load_maps(maps))):
    t = time.time()
    tops = [top_singular_value(fast_gram_side(x.float(), restarts=sched, maps=maps, backend="torch")).max().item()
            for x in xs]
    print(sched, "max top sv over saved inputs", f"{max(tops):.3g}", "n>1.1:", sum(v > 1.1 for v in tops),
          f"{time.time() - t:.1f}s", flush=True)
