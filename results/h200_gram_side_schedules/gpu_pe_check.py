import torch
from anvil_fast.core.cascade import GRAM_SIDE, SAFE, fast_cascade, fast_gram_side, gram_side_schedule
from anvil_fast.studies.gram_side_study import study_input
from anvil_fast.studies.near_rank1 import top_singular_value
for maps in ["anvil", "polar_express_paper6", "polar_express_nanogpt5", "anvil_express"]:
    from anvil_ref.constants import ANVIL_MAPS
    m = ANVIL_MAPS if maps == "anvil" else maps
    for fam in ["power_law_1.4", "power_law_1"]:
        for shape in [(2, 2048, 512), (2, 3072, 768)]:
            x = study_input(fam, shape, seed=0).cuda()
            sched = gram_side_schedule(GRAM_SIDE, shape, maps=m, device="cuda")
            y = fast_cascade(x, maps=m, config=GRAM_SIDE)
            y4 = fast_gram_side(x, maps=m, restarts=(4,))
            ys = fast_cascade(x, maps=m, config=SAFE)
            print(maps, fam, shape, "schedule", sched, "top sv: GRAM_SIDE", f"{top_singular_value(y).max().item():.4g}",
                  "| ANVIL's (4,)", f"{top_singular_value(y4).max().item():.4g}", "| SAFE", f"{top_singular_value(ys).max().item():.4g}", flush=True)
