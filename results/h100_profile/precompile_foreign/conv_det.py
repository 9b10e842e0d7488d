import os, sys, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import test_precompile as T
from anvil_fast.kernels import precompile as PC
from anvil_fast.optim.entry import ANVIL
def run(switch, det, name="conv_net"):
    os.environ[PC.ENV] = switch
    torch.backends.cudnn.deterministic = det; torch.backends.cudnn.benchmark = False
    build, batch, classes = T.FOREIGN[name]
    torch.manual_seed(0); model = build().cuda(); opt = ANVIL(model)
    g = torch.Generator(device="cuda").manual_seed(1); grads = []
    for _ in range(3):
        x = batch(g); y = torch.randint(0, classes, (x.shape[0],), generator=g, device="cuda")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step(); opt.zero_grad()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()], grads
def same(a, b): return all(torch.equal(x, y) for x, y in zip(a, b))
for det in (False, True):
    for sw in (("0", "0"), ("1", "1"), ("0", "1")):
        (pa, ga), (pb, gb) = run(sw[0], det), run(sw[1], det)
        print(f"deterministic={det} switches={sw}: params equal {same(pa, pb)}, step-1 grads equal {same(ga[0], gb[0])}, all grads equal {all(same(x, y) for x, y in zip(ga, gb))}", flush=True)
