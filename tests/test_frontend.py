"""The front-ends' base (anvil_fast.optim.frontend): the learning rate's one path from the param group
to the device's scalars, and the seams the front-ends and the graphs use instead of each other's
private attributes."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch
from torch import nn

from anvil_fast.optim.entry import ANVIL

ROOT = Path(__file__).resolve().parents[1]
#: Learning rates no other value of a step takes, so a frame holding one holds the learning rate.
LR, LR2 = 0.012345678, 0.0098765432


def _holds(v, lr: float, depth: int = 0) -> bool:
    if isinstance(v, float):
        return v == lr
    if depth < 3 and isinstance(v, (list, tuple)):
        return any(_holds(x, lr, depth + 1) for x in v)
    if depth < 3 and isinstance(v, dict):
        return any(_holds(x, lr, depth + 1) for x in v.values())
    return False


def lr_path(fn, lr: float) -> list[str]:
    """The anvil_fast modules whose frames hold ``lr`` (an argument, a local, or inside a list,
    tuple or dict such as a param group) while ``fn()`` runs, in the order each frame is first seen
    holding it, consecutive repeats collapsed. A frame is looked at whenever it calls (a Python or
    a C function) and when it returns: a value a frame holds at any other moment is either passed
    on by a call or dropped."""
    seen: set[int] = set()
    keep = []  # the frames seen, kept alive so that no id is reused during the run
    order: list[str] = []

    def look(frame) -> None:
        if frame is None or id(frame) in seen:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("anvil_fast") or not any(_holds(v, lr) for v in frame.f_locals.values()):
            return
        seen.add(id(frame))
        keep.append(frame)
        order.append(module)

    def profile(frame, event, arg):
        if event == "call":
            look(frame.f_back)
            look(frame)
        elif event in ("c_call", "return"):
            look(frame)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 16)

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(self.emb(x))))))


def _backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 16, (4, 6), generator=g)
    nn.functional.cross_entropy(model(x).flatten(0, 1), torch.randint(0, 16, (24,), generator=g)).backward()


#: param group -> the base (checked, change noticed) -> the drop-in's hand-over -> the inner
#: optimizer's seam (set, then read once) -> the device step's inbox, from which the device derives
#: the scalars the kernels read (anvil_fast.optim.frontend's docstring).
EXPECTED = ["anvil_fast.optim.frontend", "anvil_fast.optim.dropin", "anvil_fast.optim.optimizer", "anvil_fast.optim.device_step"]


def test_the_learning_rate_passes_through_each_module_once():
    torch.manual_seed(0)
    model = _Net()
    opt = ANVIL(model, lr=LR, adam_lr=0.004, compile=False)
    assert opt.banks, "the test needs a bank"
    _backward(model, 1)
    chain = lr_path(opt.step, LR)  # the first step hands the constructor's values over
    assert chain == EXPECTED, chain
    opt.zero_grad(set_to_none=True)
    opt.param_groups[0]["lr"] = LR2  # as a scheduler changes it
    _backward(model, 2)
    chain = lr_path(opt.step, LR2)
    assert chain == EXPECTED, chain
    assert len(set(chain)) == len(chain)
    assert opt.inner.hyperparameters()[0] == LR2


def test_the_path_finder_sees_a_module_that_reads_the_value_back():
    """The tracer reports a second pass through a module (what a front-end reading the inner
    optimizer's values back, beside its hand-over, would show)."""
    from anvil_fast.optim import contract

    def twice():
        contract._describe_value(LR)  # a drop-in frame holding the value
        torch.tensor(1.0).add(1)
        check = sys.modules["anvil_fast.optim.frontend"].check_hyperparameters
        check("adam", dict(lr=LR, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8))
        contract._describe_value(LR)

    assert lr_path(twice, LR) == ["anvil_fast.optim.contract", "anvil_fast.optim.frontend",
                                  "anvil_fast.optim.contract"]


def _attribute_chains(path: Path) -> set[str]:
    """Every dotted attribute read or written in a module (``self.local.inner.x`` -> that string)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            parts, n = [], node
            while isinstance(n, ast.Attribute):
                parts.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name):
                out.add(".".join([n.id] + parts[::-1]))
    return out


def test_front_ends_and_graphs_use_the_inner_optimizers_public_seams():
    fsdp = _attribute_chains(ROOT / "anvil_fast" / "optim" / "fsdp.py")
    assert not [c for c in fsdp if c.startswith(("self.local._", "self.local.inner"))], sorted(fsdp)
    graphs = _attribute_chains(ROOT / "anvil_fast" / "optim" / "graphs.py")
    assert not [c for c in graphs if c.startswith("opt._") or c.startswith("self.opt._")]
    # the drop-in hands its values over through AnvilAndAdam.set_hyperparameters alone
    src = (ROOT / "anvil_fast" / "optim" / "dropin.py").read_text()
    tree = ast.parse(src)
    written = [ast.unparse(t) for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    assert not [w for w in written if "param_cfgs" in w or "beta2" in w or "cfg." in w], written
    assert "set_hyperparameters" in src and "set_rails" not in src
