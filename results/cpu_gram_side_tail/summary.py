"""Totals of the logs beside it (python3 summary.py > summary.log, from this folder): per MODE, the seeds, the
matrices and those whose top singular value passes 1.1; then the one-sided exact test that the kernels (lower)
explode more often than the eager Gram form over the same seeds (anvil_fast.core.tolerances.explosion_excess_p)."""
import re
import sys

sys.path.insert(0, "../..")
from anvil_fast.core.tolerances import explosion_excess_p  # noqa: E402

tot = {}
for mode, files in {"full": ["full.log"], "upper": ["upper.log"], "lower": ["lower.log", "lower2.log"],
                    "eager": ["eager.log", "eager2.log"]}.items():
    seeds, n, k = set(), 0, 0
    for f in files:
        for line in open(f):
            m = re.match(r"\w+ seed (\d+): n (\d+) .* >1\.1 (\d+) ", line)
            if m:
                seeds.add(int(m[1])); n += int(m[2]); k += int(m[3])
    tot[mode] = (k, n)
    print(f"{mode}: seeds {min(seeds)}-{max(seeds)} ({len(seeds)}), {n} matrices, {k} past 1.1")
(k, n), (j, m) = tot["lower"], tot["eager"]
print(f"lower against eager: one-sided p {explosion_excess_p(k, n, j, m):.2f}")
