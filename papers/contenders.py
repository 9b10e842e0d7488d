"""The optimizers ``python -m papers.train`` compares, each configured here and nowhere else.

A contender builds its optimizer(s) for a model from its hyper-parameters; the harness applies the
same learning-rate shape (linear warm-up, then linear decay to zero) to every optimizer it returns
through ``torch.optim.lr_scheduler.LambdaLR``, so every group's learning rate is its ``lr`` times
the schedule.

=================  =================================================================================
name               optimizer
=================  =================================================================================
``adamw``          ``torch.optim.AdamW`` (fused on CUDA) on every parameter; weight decay on the
                   2-D ones only (nanoGPT's rule). Sweep: lr in :data:`ADAMW_SWEEP`.
``muon``           ``torch.optim.Muon`` on the 2-D weights inside the transformer blocks (not the
                   embeddings, not the head) + fused AdamW on the rest at the ``adamw`` defaults.
                   Sweep: Muon's lr in :data:`MUON_SWEEP`.
``anvil``          ``anvil_fast.ANVIL(model, rails="record", total_steps=steps)``: SAFE (the default
                   bank configuration) with the record's twin rails.
``anvil_faithful`` the same with ``bank_config="faithful"`` (the seed's exact roundings).
``anvil_gram_side`` the same with ``bank_config="gram_side"`` (the maps on the short side of tall and
                   wide banks, :mod:`anvil_fast.gram_side`; SAFE elsewhere).
``anvil_derived``  the same with ``maps="anvil_express"``.
``anvil_polar``    the same with ``maps="polar_express_paper6"``.
``anvil_nesterov`` the same with ``rails="nesterov"`` (plain Nesterov momentum, no twin rails).
``anvil_defaults`` ``anvil_fast.ANVIL(model)``, every argument at its default (the CI contender; not
                   in the default comparison).
=================  =================================================================================

The ANVIL contenders keep the drop-in's own learning rates (``lr``, ``adam_lr`` of
``anvil_fast.ANVIL``): they are the record's, and the comparison asks how the package trains as
shipped. AdamW and Muon have no such tuned default for this model, hence their sweeps.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

#: AdamW's learning rates swept by ``--sweep adamw``: a factor 2 apart around nanoGPT-scale rates,
#: reaching down to 2.5e-4 so that the best rate on the small GPT lies inside the sweep, not at its end.
ADAMW_SWEEP = (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
#: Muon's learning rates swept by ``--sweep muon`` (around torch.optim.Muon's examples and the
#: record's 0.02-0.05).
MUON_SWEEP = (0.01, 0.02, 0.04, 0.08)

ADAMW_HP = {"lr": 4e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MUON_HP = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0, "ns_steps": 5,
           "adjust_lr_fn": "original"}

#: The derived map set of the comparison: anvil_express is the one set of derive_maps that meets
#: every requirement against ANVIL_MAPS at once (certified better in exact arithmetic, certified
#: headroom above 1/1.05, and a bf16 envelope no wider at either end; papers/data/maps_comparison.md,
#: written by `python -m derive_maps regenerate`). anvil_optimal and anvil_polished are certified
#: too but realize a wider bf16 envelope at the high end.
DERIVED_MAPS = "anvil_express"
POLAR_MAPS = "polar_express_paper6"


def _adamw(params_2d, params_other, hp: dict, device: torch.device) -> torch.optim.AdamW:
    groups = [{"params": params_2d, "weight_decay": hp["weight_decay"]},
              {"params": params_other, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                             fused=device.type == "cuda")


def build_adamw(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    ps = [p for p in model.parameters() if p.requires_grad]
    return [_adamw([p for p in ps if p.ndim >= 2], [p for p in ps if p.ndim < 2], hp, device)]


def muon_params(model: nn.Module) -> list[str]:
    """Names of the hidden matrices Muon takes: 2-D parameters inside ``model.blocks``."""
    return [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]


def build_muon(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"the muon contender needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    hidden = set(muon_params(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mat = [p for n, p in named if n in hidden]
    rest = [(n, p) for n, p in named if n not in hidden]
    muon = torch.optim.Muon(mat, lr=hp["lr"], momentum=hp["momentum"], nesterov=hp["nesterov"],
                            weight_decay=hp["weight_decay"], ns_steps=hp["ns_steps"],
                            adjust_lr_fn=hp["adjust_lr_fn"])
    adam = _adamw([p for _, p in rest if p.ndim >= 2], [p for _, p in rest if p.ndim < 2], hp["adamw"], device)
    return [muon, adam]


def build_anvil(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    import anvil_fast

    kwargs = dict(hp)
    if kwargs.pop("total_steps", None) == "run":
        kwargs["total_steps"] = total_steps
    accepted = inspect.signature(anvil_fast.ANVIL.__init__).parameters
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise TypeError(f"anvil_fast.ANVIL does not accept {unknown} in this checkout; this contender needs a "
                        f"drop-in with those arguments")
    return [anvil_fast.ANVIL(model, **kwargs)]


@dataclass(frozen=True)
class Contender:
    name: str
    description: str
    build: Callable[..., list]
    hparams: dict
    sweep: tuple[float, ...] = ()   # values of hparams["lr"] tried by --sweep NAME
    extra: dict = field(default_factory=dict)

    def with_lr(self, lr: float) -> Contender:
        return Contender(self.name, self.description, self.build, {**self.hparams, "lr": lr}, self.sweep, self.extra)

    def make(self, model: nn.Module, *, total_steps: int, device: torch.device) -> list:
        return self.build(model, self.hparams, total_steps=total_steps, device=device)


_RECORD = {"rails": "record", "total_steps": "run"}  # "run": the run's step count, filled in at build

REGISTRY: dict[str, Contender] = {c.name: c for c in (
    Contender("adamw", "torch.optim.AdamW (fused on CUDA), weight decay on 2-D parameters", build_adamw,
              dict(ADAMW_HP), ADAMW_SWEEP),
    Contender("muon", "torch.optim.Muon on the blocks' 2-D weights + fused AdamW (adamw defaults) on the rest",
              build_muon, {**MUON_HP, "adamw": dict(ADAMW_HP)}, MUON_SWEEP),
    Contender("anvil", "anvil_fast.ANVIL SAFE, record rails", build_anvil, dict(_RECORD)),
    Contender("anvil_faithful", "anvil_fast.ANVIL FAITHFUL, record rails", build_anvil,
              {**_RECORD, "bank_config": "faithful"}),
    Contender("anvil_gram_side", "anvil_fast.ANVIL GRAM_SIDE, record rails", build_anvil,
              {**_RECORD, "bank_config": "gram_side"}),
    Contender("anvil_derived", f"anvil_fast.ANVIL SAFE, record rails, maps={DERIVED_MAPS}", build_anvil,
              {**_RECORD, "maps": DERIVED_MAPS}),
    Contender("anvil_polar", f"anvil_fast.ANVIL SAFE, record rails, maps={POLAR_MAPS}", build_anvil,
              {**_RECORD, "maps": POLAR_MAPS}),
    Contender("anvil_nesterov", "anvil_fast.ANVIL SAFE, plain Nesterov rails", build_anvil,
              {"rails": "nesterov"}),
    Contender("anvil_defaults", "anvil_fast.ANVIL(model), every argument at its default", build_anvil, {}),
)}

#: The comparison run by default (``--contenders`` not given).
DEFAULT_CONTENDERS = ("adamw", "muon", "anvil", "anvil_faithful", "anvil_derived", "anvil_polar", "anvil_nesterov")


def get(name: str) -> Contender:
    if name not in REGISTRY:
        raise ValueError(f"unknown contender {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def hparams_text(c: Contender) -> str:
    """One line of a contender's hyper-parameters (printed by the harness, stored in its JSON)."""
    def fmt(v):
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) + "}"
        return f"{v:g}" if isinstance(v, float) else str(v)
    return ", ".join(f"{k}={fmt(v)}" for k, v in c.hparams.items()) or "(defaults)"


def jsonable(v):
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [jsonable(x) for x in v]
    return v
