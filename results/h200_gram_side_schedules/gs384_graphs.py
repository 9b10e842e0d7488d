# The Gram side from a short side of 384 on CUDA (the dispatch's default lowered for this process only),
# with each map set's studied schedule: the drop-in as shipped, 30 steps of the small GPT, refusals counted.
import sys
import anvil_fast.core.gram_side as GS
GS.uses_gram_side.__kwdefaults__["min_short"] = 384
assert GS.uses_gram_side((6, 1536, 384), device="cuda")
sys.argv = ["diag_explode.py", "graphs", sys.argv[1], sys.argv[2]]
exec(open(".h/diag_explode.py").read())
