"""The optimizers ``python -m papers.train`` compares, each configured here and nowhere else.

A contender builds its optimizer(s) for a model from its hyper-parameters; the harness applies the
same learning-rate shape (linear warm-up, then linear decay to zero) to every optimizer it returns
through ``torch.optim.lr_scheduler.LambdaLR``, so every group's learning rate is its own rate
times the schedule, and clips the global gradient norm by the same rule for every contender
(``--clip``). Every contender has two learning rates and a weight decay, the values the tuning
protocol sweeps (papers/protocol.py): ``lr``, the hidden matrices' (the 2-D weights inside
``model.blocks``), ``adam_lr``, the Adam side's (embeddings, output head, LayerNorm gains and biases),
and the hidden matrices' ``weight_decay``. Everything else is each contender's documented
configuration, never swept:

=================  =================================================================================
name               optimizer
=================  =================================================================================
``adamw``          ``torch.optim.AdamW`` (fused on CUDA) with three groups: the matrices (``lr``,
                   weight decay 0.1), the embeddings and the head (``adam_lr``, weight decay 0.1)
                   and the gains and biases (``adam_lr``, no weight decay): nanoGPT's weight decay
                   (on every 2-D tensor, none on 1-D ones), betas (0.9, 0.95), eps 1e-8.
``muon``           ``torch.optim.Muon`` on the matrices (momentum 0.95, Nesterov, 5 Newton-Schulz
                   steps, torch's shape scaling ``sqrt(max(1, rows / cols))``) + fused AdamW on the
                   rest (betas (0.9, 0.95)); weight decay 0.01 on both (the Muon README's pairing).
``dion``           microsoft/dion's ``dion.Muon`` (its defaults: Polar Express coefficients, momentum
                   0.95 without Nesterov, the spectral-norm scaling ``sqrt(rows / cols)``, weight
                   decay 0.01, the pure-torch compiled orthogonalization) on the matrices; dion's own
                   AdamW (``algorithm="adamw"`` groups of the same optimizer) on the rest, the
                   embeddings and the head without weight decay (dion's README). Used when ``dion``
                   is importable, else from ``.peers/dion`` under the repository root; absent
                   otherwise (:func:`find_dion` says why).
``normuon``        microsoft/dion's ``dion.NorMuon`` at its documented defaults (lr 0.01, momentum 0.95
                   without Nesterov, ``muon_beta2`` 0.95, weight decay 0.01 without the cautious
                   mask, spectral-norm scaling, Polar Express) on the matrices, with dion's AdamW
                   groups as for ``dion``; from the same source as ``dion``.
``anvil``          ``anvil_fast.ANVIL(model, rails="record", total_steps=steps, bank_config="safe")``:
                   SAFE on every bank (pinned: the drop-in's default sends oblong banks to the Gram
                   side on CUDA) with the record's twin rails.
``anvil_lean``     the same with ``rails_dtype=torch.bfloat16`` (the rails kept in bf16); absent
                   where ``anvil_fast.ANVIL`` has no such argument (:func:`lean_unavailable`).
``anvil_faithful`` the same as ``anvil`` with ``bank_config="faithful"`` (the seed's exact roundings).
``anvil_gram_side`` the same with ``bank_config="gram_side"`` (the maps on the short side of tall and
                   wide banks, :mod:`anvil_fast.core.gram_side`; SAFE elsewhere).
``anvil_derived``  the same with ``maps="anvil_express"``.
``anvil_polar``    the same with ``maps="polar_express_paper6"``.
``anvil_nesterov`` the same with ``rails="nesterov"`` (plain Nesterov momentum 0.95, no twin rails:
                   changes the momentum schedule too; ``anvil_one_rail`` is the clean ablation).
``anvil_one_rail`` the record's momentum schedule with ``w = 1`` throughout (:class:`RailSchedule`).
``anvil_rails_scaled`` the record's rails at steps scaled to the run (:class:`RailSchedule`, rule
                   ``"scaled"`` of :func:`anvil_ref.rails.rail_steps`).
``anvil_no_equalizer`` ``beta2=1``: the lane energy stays at 0, every gain equal, the equalizer the
                   identity.
``anvil_decoupled`` the decay without its sign gate (:class:`DecoupledDecay`).
``anvil_defaults`` ``anvil_fast.ANVIL(model)``, every argument at its default (the CI contender).
=================  =================================================================================

Weight decay: the matrices' ``weight_decay`` is tuned by the protocol like the two rates (centres
papers/protocol.py ``WD_CENTERS``); the Adam side's decay stays each contender's own.

Default learning rates (a run outside the tuning protocol): ``lr`` at the centre of the
protocol's grid (papers/protocol.py ``LR_CENTERS``); ``adam_lr`` at the protocol's common starting
point for AdamW, Muon and dion, at the drop-in's own default (8e-3) for the ANVIL contenders.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from anvil_ref import ADAM_DEFAULTS, ANVIL_DEFAULTS, RAIL_RULE
from papers import protocol as P

ROOT = Path(__file__).resolve().parents[1]
#: Where the dion contender looks for microsoft/dion's source when ``import dion`` fails.
DION_PEER = ROOT / ".peers" / "dion"

ADAMW_HP = {"lr": P.LR_CENTERS["adamw"], "adam_lr": P.ADAM_CENTER, "betas": (0.9, 0.95), "eps": 1e-8,
            "weight_decay": P.WD_CENTERS["adamw"]}
MUON_HP = {"lr": P.LR_CENTERS["muon"], "adam_lr": P.ADAM_CENTER, "momentum": 0.95, "nesterov": True,
           "ns_steps": 5, "adjust_lr_fn": "original", "weight_decay": P.WD_CENTERS["muon"], "adam_betas": (0.9, 0.95),
           "adam_eps": 1e-8, "adam_weight_decay": 0.01}
DION_HP = {"lr": P.LR_CENTERS["dion"], "adam_lr": P.ADAM_CENTER, "mu": 0.95, "nesterov": False,
           "weight_decay": P.WD_CENTERS["dion"], "adjust_lr": "spectral_norm", "use_polar_express": True,
           "use_triton": False}
#: dion.NorMuon's documented defaults (dion/normuon.py): lr 0.01, mu 0.95, muon_beta2 0.95 (the
#: per-neuron second moment), weight decay 0.01 without the cautious mask, no Nesterov, spectral-norm
#: scaling, Polar Express.
NORMUON_HP = {"lr": P.LR_CENTERS["normuon"], "adam_lr": P.ADAM_CENTER, "mu": 0.95, "muon_beta2": 0.95,
              "nesterov": False, "weight_decay": P.WD_CENTERS["normuon"], "cautious_wd": False,
              "adjust_lr": "spectral_norm", "use_polar_express": True, "use_triton": False}

#: The derived map set of the comparison: anvil_express is the one set of derive_maps that meets
#: every requirement against ANVIL_MAPS at once (certified better in exact arithmetic, certified
#: headroom above 1/1.05, and a bf16 envelope no wider at either end; papers/data/maps_comparison.md,
#: written by `python -m derive_maps regenerate`). anvil_optimal and anvil_polished are certified
#: too but realize a wider bf16 envelope at the high end.
DERIVED_MAPS = "anvil_express"
POLAR_MAPS = "polar_express_paper6"


class Unavailable(RuntimeError):
    """A contender this installation cannot build (the message says why)."""


# ------------------------------------------------------------------------------ parameter groups
def muon_params(model: nn.Module) -> list[str]:
    """Names of the hidden matrices: 2-D parameters inside ``model.blocks`` (the matrices of every
    contender's ``lr``)."""
    return [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]


def split_params(model: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """The three groups of every contender: ``matrices`` (:func:`muon_params`), ``exterior`` (the
    other 2-D parameters: embeddings and the output head) and ``vectors`` (gains and biases)."""
    hidden = set(muon_params(model))
    out = {"matrices": [], "exterior": [], "vectors": []}
    for n, p in model.named_parameters():
        if p.requires_grad:
            out["matrices" if n in hidden else "exterior" if p.ndim >= 2 else "vectors"].append((n, p))
    return out


def _ps(pairs):
    return [p for _, p in pairs]


def build_adamw(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    g = split_params(model)
    groups = [{"params": _ps(g["matrices"]), "lr": hp["lr"], "weight_decay": hp["weight_decay"], "group": "matrices"},
              {"params": _ps(g["exterior"]), "lr": hp["adam_lr"], "weight_decay": hp["weight_decay"],
               "group": "embeddings+head"},
              {"params": _ps(g["vectors"]), "lr": hp["adam_lr"], "weight_decay": 0.0, "group": "gains+biases"}]
    return [torch.optim.AdamW([x for x in groups if x["params"]], betas=hp["betas"], eps=hp["eps"],
                              fused=device.type == "cuda")]


def build_muon(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    if not hasattr(torch.optim, "Muon"):
        raise Unavailable(f"the muon contender needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    g = split_params(model)
    muon = torch.optim.Muon(_ps(g["matrices"]), lr=hp["lr"], momentum=hp["momentum"], nesterov=hp["nesterov"],
                            weight_decay=hp["weight_decay"], ns_steps=hp["ns_steps"], adjust_lr_fn=hp["adjust_lr_fn"])
    rest = [{"params": _ps(g[k]), "group": k} for k in ("exterior", "vectors") if g[k]]
    adam = torch.optim.AdamW(rest, lr=hp["adam_lr"], betas=hp["adam_betas"], eps=hp["adam_eps"],
                             weight_decay=hp["adam_weight_decay"], fused=device.type == "cuda")
    return [muon, adam]


def find_dion():
    """microsoft/dion's package: ``import dion`` if that works, else the source under
    :data:`DION_PEER` (put on ``sys.path``). Raises :class:`Unavailable` saying why neither worked."""
    reasons = []
    for where in (None, DION_PEER):
        if where is not None:
            if not (where / "dion" / "__init__.py").is_file():
                reasons.append(f"no {where.relative_to(ROOT)}/dion/__init__.py")
                continue
            if str(where) not in sys.path:
                sys.path.insert(0, str(where))
        try:
            mod = importlib.import_module("dion")
        except ImportError as exc:
            reasons.append(f"import dion: {exc}")
            continue
        except Exception as exc:  # dion's import itself failed (its torch or triton needs)
            raise Unavailable(f"import dion failed: {type(exc).__name__}: {exc}") from exc
        if not hasattr(mod, "Muon"):
            reasons.append(f"the importable 'dion' ({getattr(mod, '__file__', '?')}) has no Muon")
            sys.modules.pop("dion", None)
            continue
        return mod
    raise Unavailable("microsoft/dion is not installed: " + "; ".join(reasons))


def _dion_groups(model: nn.Module, hp: dict) -> list[dict]:
    """dion's parameter groups (its README's): the matrices on the orthogonalized algorithm, the
    gains and biases on dion's AdamW at ``adam_lr``, the embeddings and the head on it without decay."""
    g = split_params(model)
    emb = [p for n, p in g["exterior"] if not n.startswith("lm_head")]
    head = [p for n, p in g["exterior"] if n.startswith("lm_head")]
    groups = [{"params": _ps(g["matrices"])},
              {"params": _ps(g["vectors"]), "algorithm": "adamw", "lr": hp["adam_lr"]},
              {"params": emb, "algorithm": "adamw", "lr": hp["adam_lr"], "weight_decay": 0.0},
              {"params": head, "algorithm": "adamw", "lr": hp["adam_lr"], "weight_decay": 0.0}]
    return [x for x in groups if x["params"]]


def build_dion(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    dion = find_dion()
    return [dion.Muon(_dion_groups(model, hp), lr=hp["lr"], mu=hp["mu"], nesterov=hp["nesterov"],
                      weight_decay=hp["weight_decay"], adjust_lr=hp["adjust_lr"],
                      use_polar_express=hp["use_polar_express"], use_triton=hp["use_triton"])]


def build_normuon(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    dion = find_dion()
    if not hasattr(dion, "NorMuon"):
        raise Unavailable(f"the importable dion ({getattr(dion, '__file__', '?')}) has no NorMuon")
    return [dion.NorMuon(_dion_groups(model, hp), lr=hp["lr"], mu=hp["mu"], muon_beta2=hp["muon_beta2"],
                         weight_decay=hp["weight_decay"], cautious_wd=hp["cautious_wd"], nesterov=hp["nesterov"],
                         adjust_lr=hp["adjust_lr"], use_polar_express=hp["use_polar_express"],
                         use_triton=hp["use_triton"])]


def _anvil_accepts() -> set[str]:
    from anvil_fast.optim.dropin import DropInAnvil

    return set(inspect.signature(DropInAnvil).parameters)


def lean_unavailable() -> str | None:
    """Why the lean-state contender cannot run here (None: it can): it needs the drop-in's
    ``rails_dtype`` argument."""
    if "rails_dtype" not in _anvil_accepts():
        return "anvil_fast.ANVIL takes no rails_dtype argument in this checkout"
    return None


class RailSchedule:
    """The rails of an ablation, set by the harness before every step of a drop-in built with
    ``rails="nesterov"`` (a step pre-hook writes the anvil group's momentum, fast_beta and
    fast_weight, which the drop-in reads at the step): :func:`anvil_ref.rails.rail_scalars` at the
    step counts of :func:`anvil_ref.rails.rail_steps` ``(total_steps, rule)``; ``w1``: the engage
    step moved past the run, so ``w = 1`` throughout (the record's momentum schedule, one rail).
    With ``rule="absolute"`` and ``w1=False`` it writes what ``rails="record"`` writes
    (tests/test_train.py checks it). ``t`` counts the hook's calls, the steps given."""

    def __init__(self, total_steps: int, *, rule: str, w1: bool):
        from anvil_ref.rails import rail_steps

        self.total_steps, self.rule, self.w1 = total_steps, rule, w1
        self.steps = rail_steps(total_steps, rule)
        self.t = 0

    def __call__(self, opt, args, kwargs) -> None:
        from anvil_ref.rails import rail_scalars

        engage = self.total_steps + 1 if self.w1 else self.steps.engage
        s = rail_scalars(self.t, self.total_steps, engage_step=engage, warmup_steps=self.steps.warmup,
                         cooldown_steps=self.steps.cooldown)
        for g in opt.param_groups:
            if g.get("kind") == "anvil":
                g.update(momentum=s.momentum, fast_beta=s.fast_beta, fast_weight=s.fast_weight)
        self.t += 1


class DecoupledDecay:
    """ANVIL's weight decay without the sign gate, applied by the harness: before every step each
    matrix of the drop-in's banks is multiplied by ``1 - weight_decay * lr * lr * scale`` (the
    drop-in's ``eff_wd * eff_lr`` of :mod:`anvil_fast.optim.entry`, ``scale`` =
    :func:`anvil_ref.update.shape_lr_multiplier` of the matrix, ``lr`` the anvil group's at that
    step) and the drop-in runs with ``weight_decay=0``. Decaying before the update is the drop-in's
    expression ``W - W*eff_wd*eff_lr - U*eff_lr`` with the gate at 1 (tests/test_train.py checks
    the two agree where the gate is 1 everywhere)."""

    def __init__(self, model: nn.Module, opt, weight_decay: float):
        from anvil_ref.update import shape_lr_multiplier

        params = dict(model.named_parameters())
        self.weight_decay = weight_decay
        self.items = []
        for e in opt.plan:
            if e.route == "adam":
                continue
            rows, cols = e.bank_shape[1:]
            if e.transposed:
                rows, cols = cols, rows
            self.items.append((params[e.name], shape_lr_multiplier(rows, cols)))

    @torch.no_grad()
    def __call__(self, opt, args, kwargs) -> None:
        lr = next(float(g["lr"]) for g in opt.param_groups if g.get("kind") == "anvil")
        for p, scale in self.items:
            p.mul_(1.0 - self.weight_decay * lr * lr * scale)


def build_anvil(model: nn.Module, hp: dict, *, total_steps: int, device: torch.device) -> list:
    """``anvil_fast.ANVIL(model, **hp)``, except three harness keys: ``rail_rule`` / ``rail_w1``
    (the rails set by :class:`RailSchedule` instead of the drop-in's ``rails="record"``) and
    ``decay="decoupled"`` (:class:`DecoupledDecay`)."""
    import anvil_fast

    kwargs = dict(hp)
    rule, w1 = kwargs.pop("rail_rule", None), kwargs.pop("rail_w1", False)
    decay = kwargs.pop("decay", "sign_gated")
    if decay not in ("sign_gated", "decoupled"):
        raise ValueError(f"decay must be 'sign_gated' or 'decoupled', got {decay!r}")
    if kwargs.pop("total_steps", None) == "run":
        kwargs["total_steps"] = total_steps
    if rule is not None:
        kwargs.update(rails="nesterov", total_steps=None)
    wd = kwargs.get("weight_decay", ANVIL_DEFAULTS["weight_decay"])
    if decay == "decoupled":
        kwargs["weight_decay"] = 0.0
    if "rails_dtype" in kwargs:
        kwargs["rails_dtype"] = getattr(torch, kwargs["rails_dtype"])
    unknown = sorted(k for k in kwargs if k not in _anvil_accepts())
    if unknown:
        raise Unavailable(f"anvil_fast.ANVIL takes no {', '.join(unknown)} argument in this checkout")
    opt = anvil_fast.ANVIL(model, **kwargs)
    if decay == "decoupled":
        opt.register_step_pre_hook(DecoupledDecay(model, opt, wd))
    if rule is not None:
        opt.register_step_pre_hook(RailSchedule(total_steps, rule=rule, w1=w1))
    return [opt]


# ------------------------------------------------------------------------------------ contenders
@dataclass(frozen=True)
class Contender:
    name: str
    description: str
    build: Callable[..., list]
    hparams: dict
    #: returns why the contender cannot run here, or None (checked before any run starts)
    unavailable: Callable[[], str | None] = field(default=lambda: None, compare=False)
    #: build arguments that hold the description true whatever the package's defaults become (the bank
    #: configuration of a contender described as SAFE: the drop-in's default on CUDA sends some bank shapes
    #: to the Gram side). Not tuned and not part of a run's identity (papers.train.run_id): a stored run
    #: keeps its id, and its JSON records them beside the hyper-parameters.
    pinned: dict = field(default_factory=dict)

    def with_lrs(self, lr: float | None = None, adam_lr: float | None = None,
                 weight_decay: float | None = None) -> Contender:
        hp = dict(self.hparams)
        if lr is not None:
            hp["lr"] = float(lr)
        if adam_lr is not None:
            hp["adam_lr"] = float(adam_lr)
        if weight_decay is not None:
            hp["weight_decay"] = float(weight_decay)
        return Contender(self.name, self.description, self.build, hp, self.unavailable, dict(self.pinned))

    def with_hparams(self, hparams: dict) -> Contender:
        """The same contender with these hyper-parameters (a stored run's), its pins kept."""
        return Contender(self.name, self.description, self.build, dict(hparams), self.unavailable, dict(self.pinned))

    def with_lr(self, lr: float) -> Contender:
        return self.with_lrs(lr=lr)

    def make(self, model: nn.Module, *, total_steps: int, device: torch.device) -> list:
        return self.build(model, {**self.pinned, **self.hparams}, total_steps=total_steps, device=device)

    def why_unavailable(self) -> str | None:
        try:
            return self.unavailable()
        except Unavailable as exc:
            return str(exc)


def _dion_unavailable() -> str | None:
    find_dion()
    return None


_ANVIL_LRS = {"lr": ANVIL_DEFAULTS["lr"], "adam_lr": ADAM_DEFAULTS["lr"], "weight_decay": ANVIL_DEFAULTS["weight_decay"]}
# the contenders described as SAFE run SAFE on every bank, whatever the drop-in's default dispatch does
_SAFE = {"bank_config": "safe"}
_RECORD = {**_ANVIL_LRS, "rails": "record", "total_steps": "run"}  # "run": the run's step count, filled in at build

REGISTRY: dict[str, Contender] = {c.name: c for c in (
    Contender("adamw", "torch.optim.AdamW (fused on CUDA): matrices, embeddings + head, gains + biases",
              build_adamw, dict(ADAMW_HP)),
    Contender("muon", "torch.optim.Muon on the blocks' matrices + fused AdamW on the rest", build_muon, dict(MUON_HP)),
    Contender("dion", "microsoft/dion's Muon (Polar Express) on the blocks' matrices + dion's AdamW on the rest",
              build_dion, dict(DION_HP), _dion_unavailable),
    Contender("normuon", "microsoft/dion's NorMuon (Polar Express, per-neuron second moment) on the blocks' "
              "matrices + dion's AdamW on the rest", build_normuon, dict(NORMUON_HP), _dion_unavailable),
    Contender("anvil", "anvil_fast.ANVIL SAFE, record rails", build_anvil, dict(_RECORD), pinned=_SAFE),
    Contender("anvil_rails_scaled", "anvil_fast.ANVIL SAFE, record rails at steps scaled to the run "
              "(anvil_ref.rails.rail_steps rule 'scaled')", build_anvil, {**_ANVIL_LRS, "rail_rule": "scaled"},
              pinned=_SAFE),
    Contender("anvil_one_rail", "anvil_fast.ANVIL SAFE, the record's momentum schedule with w = 1 throughout "
              "(no second rail)", build_anvil, {**_ANVIL_LRS, "rail_rule": RAIL_RULE, "rail_w1": True},
              pinned=_SAFE),
    Contender("anvil_no_equalizer", "anvil_fast.ANVIL SAFE, record rails, beta2 = 1 (the lane energy stays 0: "
              "every gain equal, the equalizer the identity)", build_anvil, {**_RECORD, "beta2": 1.0},
              pinned=_SAFE),
    Contender("anvil_decoupled", "anvil_fast.ANVIL SAFE, record rails, decoupled weight decay (no sign gate)",
              build_anvil, {**_RECORD, "decay": "decoupled"}, pinned=_SAFE),
    Contender("anvil_lean", "anvil_fast.ANVIL SAFE, record rails, rails in bf16", build_anvil,
              {**_RECORD, "rails_dtype": "bfloat16"}, lean_unavailable, pinned=_SAFE),
    Contender("anvil_faithful", "anvil_fast.ANVIL FAITHFUL, record rails", build_anvil,
              {**_RECORD, "bank_config": "faithful"}),
    Contender("anvil_gram_side", "anvil_fast.ANVIL GRAM_SIDE, record rails", build_anvil,
              {**_RECORD, "bank_config": "gram_side"}),
    Contender("anvil_derived", f"anvil_fast.ANVIL SAFE, record rails, maps={DERIVED_MAPS}", build_anvil,
              {**_RECORD, "maps": DERIVED_MAPS}, pinned=_SAFE),
    Contender("anvil_polar", f"anvil_fast.ANVIL SAFE, record rails, maps={POLAR_MAPS}", build_anvil,
              {**_RECORD, "maps": POLAR_MAPS}, pinned=_SAFE),
    Contender("anvil_nesterov", "anvil_fast.ANVIL SAFE, plain Nesterov rails", build_anvil,
              {**_ANVIL_LRS, "rails": "nesterov"}, pinned=_SAFE),
    Contender("anvil_defaults", "anvil_fast.ANVIL(model), every argument at its default", build_anvil, {}),
)}

#: The comparison run by default outside the protocol (``--contenders`` not given).
DEFAULT_CONTENDERS = ("adamw", "muon", "dion", "anvil")


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
    if isinstance(v, (tuple, list)):
        return [jsonable(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v
