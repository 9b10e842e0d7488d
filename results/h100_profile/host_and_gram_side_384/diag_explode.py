"""Which Gram-side cascade outputs the guard refuses in a short training of the small GPT, and their inputs.

    python diag_explode.py MODE OUT [CONTENDERS]     (from the branch's tree; MODE: eager | graphs)

eager: the drop-in without CUDA graphs, every Gram-side call wrapped: an output whose Frobenius norm over
sqrt(min side) passes GUARD_NORM_RATIO (or is non-finite) is reported, and its bf16 input saved to OUT.
graphs: the drop-in as shipped; only the warnings are counted.
DIAG_DEVICE=cpu: the same on the CPU, with bank_config="gram_side" in place of cuda_graphs=False (the CPU's
default configuration is SAFE)."""
import math, os, sys, warnings
import torch
sys.path.insert(0, os.getcwd())
import anvil_fast
import anvil_fast.core.cascade as CC
from anvil_fast.kernels.equalizer import GUARD_NORM_RATIO
from anvil_fast.models import gpt
from papers import contenders as K, corpus as C, train as T

mode, out = sys.argv[1], sys.argv[2]
names = (sys.argv[3] if len(sys.argv) > 3 else "anvil,anvil_lean,anvil_no_equalizer").split(",")
os.makedirs(out, exist_ok=True)
found = []
if mode == "eager":
    orig_anvil = anvil_fast.ANVIL
    extra = {"cuda_graphs": False} if os.environ.get("DIAG_DEVICE", "cuda") == "cuda" else {"bank_config": "gram_side"}
    anvil_fast.ANVIL = lambda model, *a, **k: orig_anvil(model, *a, **{**k, **extra})
    orig = CC.gram_side_workspace

    calls = [0]

    def wrapped(ws, **kw):
        calls[0] += 1
        x_in = ws.X.detach().clone()
        res = orig(ws, **kw)
        y = res.float()
        k = min(y.shape[-2:])
        r = y.flatten(1).norm(dim=1) / math.sqrt(k)
        bad = ~torch.isfinite(r) | (r > GUARD_NORM_RATIO)
        if bool(bad.any()):
            i = len(found)
            torch.save(dict(x=x_in[bad].cpu(), y=res[bad].cpu(), r=r[bad].cpu(), shape=tuple(x_in.shape),
                            kw={k2: v for k2, v in kw.items() if isinstance(v, (int, float, str, bool, tuple))}),
                       os.path.join(out, f"exploded_{i}.pt"))
            found.append((tuple(x_in.shape), r[bad].tolist()))
            print("EXPLODED", tuple(x_in.shape), [round(v, 3) for v in r[bad].tolist()], flush=True)
        return res
    CC.gram_side_workspace = wrapped

stdlib = C.load()
val = C.val_windows(stdlib.val, n=16, ctx=gpt.SIZES["small"].ctx)
for n in names:
    c = K.get(n)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r = T.train_run(c, size="small", seed=0, data_seed=0, steps=30, batch=8, warmup=3, eval_every=30,
                        corpus=stdlib, val=val, device=torch.device(os.environ.get("DIAG_DEVICE", "cuda")), clip=1.0, timing_warmup=2, timing_steps=3)
    refused = [str(x.message) for x in w if "NonFiniteUpdate" in type(x.message).__name__]
    print(f"{mode} {n}: final val {r['final_val_loss']:.4f}, {len(refused)} refusal warning(s)", flush=True)
    for m in refused[:5]:
        print("   ", m[:200], flush=True)
print(f"{mode}: {len(found)} exploded call(s) seen by the wrapper, of {calls[0] if mode == 'eager' else '?'} calls")
