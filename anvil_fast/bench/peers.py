"""``python -m anvil_fast.bench peers``: the drop-in ``anvil_fast.ANVIL``'s step next to every installed
peer, each with its documented configuration, on the package's GPT (:func:`anvil_fast.models.gpt.build`, fp32
parameters; a size named with ``-bf16``, bf16 ones), each contender at each size in its own time-boxed process.

Contenders (:data:`CONTENDERS`, in the order they run):

=====================  ===========================================================================
name                   what is built (the split and the arguments its documentation gives)
=====================  ===========================================================================
``anvil``              ``anvil_fast.ANVIL(model)``
``anvil_lean``         ``anvil_fast.ANVIL(model, rails_dtype=torch.bfloat16)`` ("not available"
                       where the drop-in has no ``rails_dtype`` keyword)
``dion_graphed``       microsoft/dion ``Muon`` (Polar Express, its defaults, lr 0.02 as in its
                       ``configs/muon_160m.yaml``; the blocks' matrices in the default group, the
                       head and the rest in ``algorithm="adamw"`` groups) inside its
                       ``dion.cuda_graph.CudaGraphOptimizer`` (``warmup_steps`` 10; CUDA only)
``dion_compiled``      the same ``Muon`` alone: its compiled Polar Express, no CUDA graph
``torch_muon``         ``torch.optim.Muon(lr=0.02, momentum=0.95)`` + fused ``torch.optim.AdamW
                       (lr=3e-4, weight_decay=0.01)`` (the example of torch's Muon docstring)
``pytorch_optimizer``  ``pytorch_optimizer.Muon`` with its ``use_muon`` groups (its docstring's
                       example: matrices lr 0.02, the rest lr 3e-4, betas (0.9, 0.95))
``emerging``           NVIDIA emerging-optimizers ``Muon`` (its defaults) + the same fused AdamW
``gram_ns``            Dao AI Lab gram-newton-schulz ``Muon`` (its defaults: Gram Newton-Schulz on
                       quack's symmetric GEMMs in fp16, Polar Express coefficients, one restart placed
                       by its own tuner; lr 0.02) on the blocks' matrices, with a torch ``AdamW``
                       (lr 3e-4, weight decay 0.01) as its ``scalar_optimizer`` (CUDA only)
``gram_ns_standard``   the same ``Muon`` with ``ns_algorithm="standard_newton_schulz"`` (its quack
                       kernels, no Gram iteration)
``adamw``              fused ``torch.optim.AdamW`` alone, the package's Adam settings (a reference:
                       element-wise work only, so never the "fastest peer")
``heavyball``          heavyball ``SplitOpt([Muon lr 0.02, AdamW lr 1e-3])`` (its README), compiled
                       as heavyball compiles by default (``max-autotune-no-cudagraphs``); run last
``heavyball_default_compile``  the same with ``heavyball.utils.compile_mode = "default"`` (opt-in:
                       not heavyball's default, named with ``--contenders``)
=====================  ===========================================================================

"The blocks' matrices" are the 2-D weights under ``blocks.`` (the matrices ANVIL banks); every other
parameter (embeddings, head, LayerNorms) goes to the contender's AdamW. A peer whose module is not
importable gets a row "not installed". microsoft/dion is imported if installed, otherwise from
``<--peers-dir>/dion`` (a checkout of its repository, put on the child's ``sys.path``); the JSON's
``source`` says which, with a digest of its ``dion/*.py``.

Method, per contender and size, in a fresh process: build the model (seed 0) and one fixed seeded
random gradient per parameter (std :data:`GRAD_SCALE`); put it into ``.grad``; run one forward of the
model (:func:`first_forward`); take the memory baseline (``memory_allocated`` / ``memory_reserved``:
the model, its gradients and what its forward's libraries keep per process exist, the optimizer does
not); build the optimizer; run ``--warmup`` steps (compilation, autotuning, graph capture);
then ``--steps`` timed steps. Before every step the fixed gradient is copied into ``p.grad`` (a fresh
tensor where the optimizer cleared it, as a backward pass would allocate), outside the timed region.

* ms/step: median over the timed steps of a CUDA event pair around ``opt.step()`` alone (CPU: wall time),
  each step called with the device idle (the gradients' copies are done by then): a step whose host
  part outlasts its device work is timed at its host's pace, as in a loop whose forward and backward
  leave the host no lead;
* ms/step, host ahead: the same steps again, each called while :func:`anvil_fast.kernels.timing.busy`
  keeps the device busy for :data:`LEAD_FACTOR` times the host ms plus :data:`LEAD_MIN_MS`, so the
  whole step is queued before the device reaches it: the step's device time when the host runs ahead
  (a training loop whose backward pass keeps the device busy while the host issues the step); CUDA
  only. The two columns differ by the host issue time an idle device waits out;
* host ms/step: median wall time of the ``opt.step()`` call on the host, without a synchronization;
* resident MiB: ``memory_allocated`` after the warm-up, gradients in place, minus the baseline;
* peak MiB: ``max_memory_allocated`` over the timed steps minus the baseline;
* reserved MiB: ``memory_reserved`` after the timed steps minus its baseline (CUDA graph pools and
  the caching allocator's slack show up here);
* held MiB: ``memory_reserved`` after the timed steps and ``torch.cuda.empty_cache()``, minus the
  baseline's ``memory_allocated``: what no other allocation of the process can use while the optimizer
  lives (its tensors, its CUDA graphs' private pools, the unused parts of segments it shares); the
  reserved memory above it is cache that the allocator hands to the next request;
* spread: the first warm-up step (a fresh optimizer, the fixed gradient), the probed matrices
  (:data:`PROBES`) starting at zero (so decoupled weight decay, a multiple of the weight, adds
  nothing to the change; the step's cost does not depend on the values); the singular values of
  each matrix's change (taken on the host, in float64) divided by their RMS, min / mean / max. A
  polar factor gives 1 / 1 / 1; a step that is not an orthogonalization shows its spread.
* first step s: the first step's wall time (compilation, autotuning, the spread's step);
* x fastest peer: this row's ms / the fastest ``peer`` row's ms at the same size (``adamw`` and ANVIL's
  own rows are not peers), for each of the two ms columns (the fastest peer of each column).

The memory columns are CUDA's allocator counters: absent on CPU, where ``--device cpu`` (the
``smoke`` GPT) runs everything else, so a test can run the command end to end; its times mean nothing.

Boxes: each process gets ``--box-s`` seconds of wall time (imports, compilation and all; a contender
may carry a shorter box of its own) and is killed with its process group after that: its row says
"timeout", names the stage it was in and keeps what was measured before (the spread, once the first
step is done); a contender that timed out is not started again at the sizes after it. A process that
raises gives an "error" row with the exception (its traceback in the JSON and ``peers.log``).
``--budget-s`` bounds the whole run: a box never extends past it, and what is left when it is spent
gets a row "not run". The JSON and the markdown are rewritten after every row; SIGTERM or SIGINT
(say, from ``timeout``) kills the running process's group, marks its row "stopped", writes the
outputs and exits with status 130, so a run stopped from outside keeps what it measured.

Output under ``--out``: ``peers.json`` (every row and the run's settings), ``peers.md`` (the tables,
re-rendered from the JSON by ``--from``), ``command.txt`` (``--note``, the command, the machine) and
``peers.log`` (every child's output, its first and last lines where it is long). ``--readme FILE
--from JSON [--from JSON ...]`` rewrites the speed sentence of the README (between
:data:`README_BEGIN` and :data:`README_END`) from stored runs and runs nothing: each size is quoted
from the first run given that timed both the drop-in and a peer at that size, so each ratio is of
two times measured in one run.

``--plugin MODULE`` adds the contenders of an importable module's ``CONTENDERS`` list (how the tests
bring in fake peers: one that raises, one that hangs, one that is missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from anvil_ref.cli_args import name_list, positive_int
from anvil_ref.provenance import source_commit

from anvil_fast.kernels.timing import call_times

#: One line for ``python -m anvil_fast.bench --help``.
SUMMARY = ("the drop-in ANVIL's step next to every installed peer (dion, gram-newton-schulz, heavyball, "
           "emerging-optimizers, pytorch-optimizer, torch Muon, AdamW), each in its own time-boxed process")

#: Standard deviation of the fixed random gradients (the drop-in benchmark's).
GRAD_SCALE = 1e-3
#: Seeds: the model's initialization, the fixed gradients.
MODEL_SEED, GRAD_SEED = 0, 1
#: The host-ahead timing's lead: the device is kept busy for LEAD_FACTOR times the step's host ms
#: (the larger of its median and 90th percentile) plus LEAD_MIN_MS before each step, so the host has
#: issued the whole step before the device reaches it even when one call is slower than the median.
LEAD_FACTOR, LEAD_MIN_MS = 2.0, 0.5
#: The matrices whose update's singular values are reported: the first block's attention output
#: projection (square) and its MLP's first matrix (4:1).
PROBES = {"attn.proj": "blocks.0.attn.proj.weight", "mlp.fc": "blocks.0.mlp.fc.weight"}
#: The stored runs the README's sentence reads (relative to the repository root), in the order it
#: prefers them: the whole default command on the small GPT, and every contender on the medium GPT,
#: each in one run.
RESULTS_JSONS = ("results/h200_peers/small_53cdced/run1/peers.json", "results/h200_peers/medium_53cdced/run1/peers.json")
#: Runs of one command made one after another, each contender in a fresh process every time: the
#: sentence gives the range of their times, the spread that one run's figure cannot show.
RESULTS_REPEATS = tuple(f"results/h200_peers/small_53cdced/run{i}/peers.json" for i in (2, 3))
#: Markers of the README's generated speed sentence (its opening names the command that rewrites it).
README_BEGIN_PREFIX = "<!-- speed sentence: generated by `python -m anvil_fast.bench peers --readme"
README_BEGIN = (README_BEGIN_PREFIX + " README.md "
                + " ".join([f"--from {p}" for p in RESULTS_JSONS] + [f"--repeat {p}" for p in RESULTS_REPEATS])
                + "`; do not edit -->")
README_END = "<!-- end of the speed sentence -->"
KINDS = ("anvil", "peer", "reference")
#: The run's default wall budget: on the H200 each contender's process took 12-47 s (compilation and
#: CUDA-graph capture included), about 190 s per size for the eight that ran, and heavyball's box
#: comes on top (results/h200_peers/*/peers.json, their wall_s per row).
DEFAULT_BUDGET_S = 540.0
#: Seconds a process may take to exit once its result is written, before its group is killed.
EXIT_GRACE_S = 20.0
#: Lines of each process's output kept in peers.log: the first and the last (a compiler's chatter
#: in between is counted, not kept).
LOG_HEAD_LINES, LOG_TAIL_LINES = 60, 200
MIB = float(1 << 20)


# ====================================================================================== contenders
@dataclasses.dataclass(frozen=True)
class Contender:
    """One row of the table: ``build(model, device, warmup)`` returns an object with ``step()``.

    ``modules``: importable modules it needs (a row "not installed" otherwise); ``distribution``: the
    pip distribution whose version the JSON records; ``check()``: a reason it cannot run here, or
    None (run in the parent, so it must not touch CUDA); ``last``: run after every other contender,
    so a long compile cannot cost the others their turn; ``opt_in``: run only when named;
    ``box_s``: its own box where shorter than ``--box-s``."""

    name: str
    label: str
    kind: str
    build: Callable[..., Any]
    modules: tuple[str, ...] = ()
    distribution: str | None = None
    needs_cuda: bool = False
    check: Callable[[], str | None] | None = None
    last: bool = False
    opt_in: bool = False
    box_s: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"contender {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


def split_params(model) -> tuple[list, list, list]:
    """(the blocks' 2-D weights, the output head, everything else)."""
    hidden, head, rest = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and name.startswith("blocks."):
            hidden.append(p)
        elif name.startswith("lm_head."):
            head.append(p)
        else:
            rest.append(p)
    return hidden, head, rest


class Chain:
    """Several optimizers stepped in order, as their documentation's training loops do."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def step(self):
        for opt in self.optimizers:
            opt.step()


def _fused(device) -> dict:
    return dict(fused=True) if device.type == "cuda" else {}


def _companion_adamw(params, device):
    """The fused AdamW beside a Muon (the values of torch's Muon docstring example)."""
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, **_fused(device))


def _anvil(model, device, warmup):
    import anvil_fast

    return anvil_fast.ANVIL(model)


def _anvil_lean(model, device, warmup):
    import anvil_fast

    return anvil_fast.ANVIL(model, rails_dtype=torch.bfloat16)


def _lean_check() -> str | None:
    import inspect

    from anvil_fast.optim.dropin import DropInAnvil

    if "rails_dtype" not in inspect.signature(DropInAnvil).parameters:
        return "anvil_fast.ANVIL has no rails_dtype keyword"
    return None


def _dion_muon(model, device, warmup):
    from dion import Muon

    hidden, head, rest = split_params(model)
    return Muon([dict(params=hidden), dict(params=rest, algorithm="adamw"), dict(params=head, algorithm="adamw")],
                lr=0.02)


def _dion_graphed(model, device, warmup):
    from dion.cuda_graph import CudaGraphOptimizer

    # its default of 10 eager steps before capture, fewer only when the warm-up is shorter (capture
    # must happen inside the warm-up, so the timed steps are replays)
    return CudaGraphOptimizer(_dion_muon(model, device, warmup), warmup_steps=max(1, min(10, warmup - 1)))


def _torch_muon_check() -> str | None:
    return None if hasattr(torch.optim, "Muon") else f"torch {torch.__version__} has no torch.optim.Muon"


def _torch_muon(model, device, warmup):
    hidden, head, rest = split_params(model)
    return Chain(torch.optim.Muon(hidden, lr=0.02, momentum=0.95), _companion_adamw(head + rest, device))


def _pytorch_optimizer(model, device, warmup):
    from pytorch_optimizer import Muon

    hidden, head, rest = split_params(model)
    return Muon([dict(params=hidden, lr=0.02, weight_decay=0.01, use_muon=True),
                 dict(params=head + rest, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, use_muon=False)])


def _emerging(model, device, warmup):
    from emerging_optimizers.orthogonalized_optimizers import Muon

    hidden, head, rest = split_params(model)
    return Chain(Muon(hidden), _companion_adamw(head + rest, device))


def _gram_ns(model, device, warmup, algorithm: str = "gram_newton_schulz"):
    from gram_newton_schulz import Muon

    hidden, head, rest = split_params(model)
    # its scalar optimizer is stepped inside its own torch.compile: the plain (foreach) AdamW
    return Muon(hidden, lr=0.02, ns_algorithm=algorithm,
                scalar_optimizer=torch.optim.AdamW(head + rest, lr=3e-4, weight_decay=0.01))


def _gram_ns_standard(model, device, warmup):
    return _gram_ns(model, device, warmup, algorithm="standard_newton_schulz")


def _adamw(model, device, warmup):
    from anvil_ref.constants import ADAM_DEFAULTS

    return torch.optim.AdamW(model.parameters(), lr=ADAM_DEFAULTS["lr"], betas=ADAM_DEFAULTS["betas"],
                             eps=ADAM_DEFAULTS["eps"], weight_decay=0.0, **_fused(device))


def _heavyball(model, device, warmup):
    import heavyball

    hidden, head, rest = split_params(model)
    return heavyball.SplitOpt([{"params": hidden, "optimizer": heavyball.Muon, "lr": 0.02},
                               {"params": head + rest, "optimizer": heavyball.AdamW, "lr": 1e-3}])


def _heavyball_default_compile(model, device, warmup):
    import heavyball.utils

    heavyball.utils.compile_mode = "default"
    return _heavyball(model, device, warmup)


#: The contenders, in the order they run (``last`` ones after all others).
CONTENDERS: list[Contender] = [
    Contender("anvil", "anvil_fast.ANVIL, defaults", "anvil", _anvil),
    Contender("anvil_lean", "anvil_fast.ANVIL, rails_dtype=bfloat16", "anvil", _anvil_lean, check=_lean_check),
    Contender("dion_graphed", "microsoft/dion Muon in its CudaGraphOptimizer", "peer", _dion_graphed,
              modules=("dion",), distribution="dion", needs_cuda=True),
    Contender("dion_compiled", "microsoft/dion Muon, compiled, no graphs", "peer", _dion_muon,
              modules=("dion",), distribution="dion"),
    Contender("torch_muon", "torch.optim.Muon + fused AdamW", "peer", _torch_muon, check=_torch_muon_check),
    Contender("pytorch_optimizer", "pytorch-optimizer Muon (its AdamW groups)", "peer", _pytorch_optimizer,
              modules=("pytorch_optimizer",), distribution="pytorch-optimizer"),
    Contender("emerging", "NVIDIA emerging-optimizers Muon + fused AdamW", "peer", _emerging,
              modules=("emerging_optimizers",), distribution="emerging-optimizers"),
    Contender("gram_ns", "Dao AI Lab gram-newton-schulz Muon (Gram NS, quack kernels)", "peer", _gram_ns,
              modules=("gram_newton_schulz", "quack"), distribution="gram-newton-schulz", needs_cuda=True),
    Contender("gram_ns_standard", "Dao AI Lab gram-newton-schulz Muon, standard NS (quack kernels)", "peer",
              _gram_ns_standard, modules=("gram_newton_schulz", "quack"), distribution="gram-newton-schulz",
              needs_cuda=True),
    Contender("adamw", "fused torch.optim.AdamW alone", "reference", _adamw),
    Contender("heavyball", "heavyball SplitOpt(Muon, AdamW), its default compile", "peer", _heavyball,
              modules=("heavyball",), distribution="heavyball", last=True),
    Contender("heavyball_default_compile", "heavyball SplitOpt(Muon, AdamW), compile_mode='default'", "peer",
              _heavyball_default_compile, modules=("heavyball",), distribution="heavyball", last=True,
              opt_in=True),
]


def load_plugins(names) -> None:
    """Append the ``CONTENDERS`` of each named module to :data:`CONTENDERS` (a name already taken is
    refused)."""
    for mod_name in names:
        mod = importlib.import_module(mod_name)
        extra = getattr(mod, "CONTENDERS", None)
        if not isinstance(extra, (list, tuple)):
            raise ValueError(f"--plugin {mod_name}: the module has no CONTENDERS list")
        taken = {c.name for c in CONTENDERS}
        for c in extra:
            if c.name in taken:
                raise ValueError(f"--plugin {mod_name}: contender name {c.name!r} is taken")
            CONTENDERS.append(c)
            taken.add(c.name)


def contender(name: str) -> Contender:
    for c in CONTENDERS:
        if c.name == name:
            return c
    raise KeyError(f"unknown contender {name!r}; known: {', '.join(c.name for c in CONTENDERS)}")


# ====================================================================================== where a peer comes from
def _tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def locate(c: Contender, peers_dir: Path) -> tuple[str | None, str, list[str]]:
    """(a reason it cannot run, or None; where it comes from; folders to put on the child's path)."""
    paths, where = [], []
    for mod in c.modules:
        spec = importlib.util.find_spec(mod)
        if spec is not None:
            where.append(f"{mod} from {Path(spec.origin).parent if spec.origin else spec.name}")
            continue
        tree = peers_dir / mod
        if (tree / mod / "__init__.py").is_file():  # a checkout of the peer's repository
            paths.append(str(tree.resolve()))
            where.append(f"{mod} from the source tree {tree} (sha256 of {mod}/*.py: {_tree_digest(tree / mod)})")
            continue
        return f"no module {mod!r} (and no checkout at {tree})", "", []
    if c.distribution:
        try:
            where.insert(0, f"{c.distribution} {importlib.metadata.version(c.distribution)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    if not c.modules:
        where.append(f"torch {torch.__version__}" if c.kind != "anvil" else _anvil_source())
    return None, "; ".join(where), paths


def _anvil_source() -> str:
    import anvil_fast
    import anvil_ref

    return f"anvil_fast {anvil_ref.__version__} from {Path(anvil_fast.__file__).parent}"


# ====================================================================================== the measurement
def build_model(size: str, device):
    from anvil_fast.models.gpt import GPTConfig, build

    # the drop-in benchmark's smoke GPT (one block, width unequal to the context), written out here so
    # a peer's process does not import that benchmark's kernels
    smoke = GPTConfig(n_layer=1, n_embd=32, n_head=2, ctx=16)
    return build(smoke if size == "smoke" else size, seed=MODEL_SEED, device=device)


def fixed_gradients(params, device, seed: int = GRAD_SEED) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [GRAD_SCALE * torch.randn(p.shape, device=device, generator=g, dtype=p.dtype) for p in params]


def first_forward(model, device) -> None:
    """One forward of ``model`` on one row of tokens, without a gradient, as a training loop's forward
    runs before the optimizer's first step: what a matmul library allocates once per process and
    stream (cuBLAS's workspace, 32 MiB on an H200) is then in the memory baseline, not charged to
    whichever contender's step happens to run the process's first matmul."""
    with torch.no_grad():
        model(torch.zeros(1, model.cfg.ctx, dtype=torch.long, device=device))


def load_gradients(params, fixed) -> None:
    """The fixed gradient into every ``p.grad``: copied into the tensor the optimizer keeps there, or
    a fresh tensor where it cleared it (as a backward pass would allocate one)."""
    with torch.no_grad():
        for p, g in zip(params, fixed):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(opt, params, fixed, device, *, warmup: int, steps: int, phase=lambda s: None,
               after_first=lambda seconds: None) -> dict:
    """Warm up (``after_first(seconds)`` runs once the first step has finished), then time ``steps`` calls
    of ``opt.step()`` (module docstring). The memory counters are read on CUDA only."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    out: dict[str, Any] = dict(steps=steps)
    for i in range(warmup):
        phase(f"warm-up step {i + 1} of {warmup}")
        load_gradients(params, fixed)
        opt.step()
        if i == 0:
            _sync(device)
            out["first_step_s"] = time.perf_counter() - t0
            after_first(out["first_step_s"])
    _sync(device)
    out["warmup_s"] = time.perf_counter() - t0
    phase(f"{steps} timed steps")
    load_gradients(params, fixed)
    if cuda:
        torch.cuda.synchronize()
        out["allocated"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    dev, host = call_times(opt.step, device, n=steps, between=lambda: load_gradients(params, fixed))
    if cuda:
        out["peak"] = torch.cuda.max_memory_allocated()
        out["reserved"] = torch.cuda.memory_reserved()
    out.update(ms=statistics.median(dev), ms_min=min(dev), host_ms=statistics.median(host))
    if cuda:
        phase(f"{steps} timed steps, host ahead")
        lead = LEAD_FACTOR * max(out["host_ms"], statistics.quantiles(host, n=10)[-1]) + LEAD_MIN_MS
        load_gradients(params, fixed)
        ahead, _ = call_times(opt.step, device, n=steps, between=lambda: load_gradients(params, fixed), lead_ms=lead)
        out.update(ms_ahead=statistics.median(ahead), lead_ms=lead)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["held"] = torch.cuda.memory_reserved()
    return out


def spread_of(delta: torch.Tensor) -> dict[str, float] | None:
    """min / mean / max of the singular values of ``delta`` over their RMS (None for a zero change)."""
    s = torch.linalg.svdvals(delta.detach().to(torch.float64))
    rms = float(s.square().mean().sqrt())
    if not rms > 0.0:
        return None
    r = s / rms
    return dict(min=float(r.min()), mean=float(r.mean()), max=float(r.max()))


def measure(c: Contender, size: str, device, *, warmup: int, steps: int, phase=lambda s: None,
            report=lambda row: None) -> dict:
    """Every number of one row, in this process (the child's work; tests call it directly).
    ``report(row)`` gets the row as it fills (the child writes it out, so a box that runs out keeps
    what was measured).

    The spread comes from the first warm-up step: the optimizer is fresh, the gradient the fixed one,
    and the probed matrices start at zero (module docstring). Their change goes to the host and its
    singular values are taken there, so no device workspace enters the memory columns."""
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first step gives the spread), got {warmup}")
    cuda = device.type == "cuda"
    phase("model")
    model = build_model(size, device)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for full in PROBES.values():
            named[full].zero_()
    params = [p for p in model.parameters() if p.requires_grad]
    fixed = fixed_gradients(params, device)
    load_gradients(params, fixed)
    first_forward(model, device)
    row: dict[str, Any] = dict(parameters=sum(p.numel() for p in params), resident_mib=None, peak_mib=None,
                               reserved_mib=None, held_mib=None)
    base = None
    if cuda:
        torch.cuda.synchronize()
        base = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    phase("build")
    opt = c.build(model, device, warmup)
    before = {short: named[full].detach().to("cpu", copy=True) for short, full in PROBES.items()}

    def first_step_done(seconds: float):
        row["first_step_s"] = seconds
        spread: dict[str, Any] = {}
        for short, full in PROBES.items():
            s = spread_of(named[full].detach().to("cpu", copy=True) - before[short])
            spread[short] = s if s is not None else "no change on the first step"
        row["spread"] = spread
        report(row)

    t = time_steps(opt, params, fixed, device, warmup=warmup, steps=steps, phase=phase, after_first=first_step_done)
    row.update(ms=t["ms"], ms_min=t["ms_min"], host_ms=t["host_ms"], steps=t["steps"],
               ms_ahead=t.get("ms_ahead"), lead_ms=t.get("lead_ms"),
               first_step_s=t["first_step_s"], warmup_s=t["warmup_s"])
    if cuda:
        row.update(resident_mib=(t["allocated"] - base[0]) / MIB, peak_mib=(t["peak"] - base[0]) / MIB,
                   reserved_mib=(t["reserved"] - base[1]) / MIB, held_mib=(t["held"] - base[0]) / MIB)
    return row


def environment(device) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, host=platform.node())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name()
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


# ====================================================================================== the child process
def child_main(spec_path: str) -> int:
    """Measure one contender at one size as the spec file says; write the result file (always, on
    an error too: the parent tells a crash from an error by its presence)."""
    spec = json.loads(Path(spec_path).read_text())
    parent = os.getppid()

    def orphaned():  # the parent was killed: do not hold the GPU any longer
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=orphaned, daemon=True).start()

    phase_path = Path(spec["phase_path"])

    def phase(text: str) -> None:
        phase_path.write_text(text)
        print(f"[{time.strftime('%H:%M:%S')}] {spec['contender']} {spec['size']}: {text}", flush=True)

    result_path = Path(spec["result_path"])

    def write(result: dict) -> None:
        tmp = result_path.with_name(result_path.name + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(result_path)

    partial: dict[str, Any] = {}

    def report(row: dict) -> None:  # what is measured so far, should the box run out
        partial.update(row)
        write(dict(partial, status="partial"))

    try:
        load_plugins(spec["plugins"])
        device = torch.device(spec["device"])
        phase("imports")
        c = contender(spec["contender"])
        partial["environment"] = environment(device)
        row = measure(c, spec["size"], device, warmup=spec["warmup"], steps=spec["steps"], phase=phase, report=report)
        write(dict(partial, **row, status="ok"))
    except Exception as e:
        traceback.print_exc()
        write(dict(partial, status="error", detail=f"{type(e).__name__}: {e}".splitlines()[0][:400],
                   traceback=traceback.format_exc()[-3000:]))
    return 0


class _Stop(Exception):
    """SIGTERM/SIGINT reached the parent: stop the running child and keep what was measured."""


def run_boxed(cmd: list[str], *, box_s: float, log, env=None, cwd=None, done: Callable[[], bool] | None = None,
              grace_s: float = 20.0) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group with stdout/stderr into ``log``; kill the whole group
    after ``box_s`` seconds, or ``grace_s`` seconds after ``done()`` first holds (a process whose
    result is written but that does not exit). Returns (exit code, or None when killed; wall seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                            process_group=0)
    rc, done_at = None, None
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - t0 >= box_s:
                    break
                if done is not None and done_at is None and done():
                    done_at = now
                if done_at is not None and now - done_at >= grace_s:
                    break
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc, time.monotonic() - t0


# ====================================================================================== the run
def plan(names: list[str], sizes: list[str]) -> list[tuple[str, str]]:
    """(contender, size) in running order: every contender not marked ``last`` at every size (size
    by size), then the ``last`` ones."""
    first = [n for n in names if not contender(n).last]
    last = [n for n in names if contender(n).last]
    return [(n, s) for s in sizes for n in first] + [(n, s) for n in last for s in sizes]


def fastest_peers(rows: list[dict], key: str = "ms") -> dict[str, dict]:
    """size -> the fastest ``peer`` row that ran and has a ``key`` time (``contender``, ``label``, ``ms``:
    that time)."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("kind") == "peer" and r.get("status") == "ok" and r.get(key) is not None:
            b = best.get(r["size"])
            if b is None or r[key] < b["ms"]:
                best[r["size"]] = dict(contender=r["contender"], label=r["label"], ms=r[key])
    return best


def _fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def _spread_cell(spread, short: str) -> str:
    if not spread:
        return ""
    s = spread.get(short)
    if isinstance(s, dict):
        return f"{s['min']:.2f} / {s['mean']:.2f} / {s['max']:.2f}"
    return str(s)


def render_markdown(data: dict) -> str:
    """The tables of a run (one per size) from its JSON."""
    env = data.get("environment") or {}
    s = data["settings"]
    best = fastest_peers(data["rows"])
    best_ahead = fastest_peers(data["rows"], "ms_ahead")
    # runs stored before the held column keep their tables as they were
    held = any("held_mib" in r for r in data["rows"])
    lines = ["<!-- generated by `python -m anvil_fast.bench peers` from peers.json beside this file "
             "(`--from peers.json` re-renders it): do not edit -->",
             f"# The drop-in's step next to its peers: {env.get('device', '?')}",
             "",
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, python {env.get('python', '?')}; "
             f"{s['warmup']} warm-up steps, median of {s['steps']} timed steps; box {s['box_s']:g} s per "
             f"process, run budget {s['budget_s']:g} s. Command: `{data['command']}`", ""]
    for size in s["sizes"]:
        rows = [r for r in data["rows"] if r["size"] == size]
        b, ba = best.get(size), best_ahead.get(size)
        n = next((r["parameters"] for r in rows if r.get("parameters")), None)
        lines += [f"## {size} GPT" + (f" ({n:,} parameters)" if n else ""), "",
                  "| contender | ms/step | x fastest peer | ms/step, host ahead | x fastest peer, host ahead | host ms "
                  "| resident MiB | peak MiB | reserved MiB | " + ("held MiB | " if held else "")
                  + " | ".join(f"spread {k} min / mean / max" for k in PROBES) + " | first step s | status |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(PROBES) + held) + "---:|---|"]
        for r in rows:
            ok = r["status"] == "ok"
            ratio = f"{r['ms'] / b['ms']:.2f}" if ok and b else ""
            ratio_ahead = f"{r['ms_ahead'] / ba['ms']:.2f}" if ok and ba and r.get("ms_ahead") is not None else ""
            status = "ok" if ok else f"{r['status']}: {r.get('detail', '')}".rstrip(": ")
            lines.append(f"| {r['label']} | {_fmt(r.get('ms'), '.3f')} | {ratio} | {_fmt(r.get('ms_ahead'), '.3f')} | "
                         f"{ratio_ahead} | {_fmt(r.get('host_ms'), '.3f')} | "
                         f"{_fmt(r.get('resident_mib'), '.1f')} | {_fmt(r.get('peak_mib'), '.1f')} | "
                         f"{_fmt(r.get('reserved_mib'), '.1f')} | "
                         + (f"{_fmt(r.get('held_mib'), '.1f')} | " if held else "")
                         + " | ".join(_spread_cell(r.get("spread"), k) for k in PROBES)
                         + f" | {_fmt(r.get('first_step_s'), '.1f')} | {status} |")
        lines += ["", f"Fastest peer: {b['label']}, {b['ms']:.3f} ms/step." if b else "Fastest peer: none ran."]
        if ba:
            lines += ["", f"Fastest peer, host ahead: {ba['label']}, {ba['ms']:.3f} ms/step."]
        lines += [""]
    lines += ["ms/step: median of CUDA events around `opt.step()` called with the device idle (CPU: wall time); "
              "ms/step, host ahead: the same with the device kept busy until the host has issued the whole step "
              "(the step's device time when the host runs ahead, as behind a backward pass); host ms: median wall time of "
              "the call without a synchronization; resident: `memory_allocated` after the warm-up minus the "
              "baseline taken with the model and its gradients in place, before the optimizer; peak: "
              "`max_memory_allocated` over the timed steps minus that baseline; reserved: the `memory_reserved` "
              "delta (graph pools); " + ("held: `memory_reserved` after the timed steps and `torch.cuda.empty_cache()` "
              "minus the baseline's `memory_allocated` (what the optimizer keeps from other allocations: its "
              "tensors, its graphs' pools, partly used segments); " if held else "") + "spread: singular values of one fresh step's weight change over their RMS "
              "(a polar factor gives 1 / 1 / 1); first step s: wall time of the first step (compilation, autotuning); "
              "x fastest peer: ms / the fastest peer's ms at that size, for each ms column "
              "(AdamW alone and ANVIL's rows are not peers). `python -m anvil_fast.bench peers --help` has the "
              "method."]
    return "\n".join(lines) + "\n"


def _runs(data, where: str) -> list[tuple[dict, str]]:
    """One run (a JSON dict), several ``(data, folder)`` pairs, or None, as ``(data, folder)`` pairs."""
    if data is None:
        return []
    if isinstance(data, dict):
        return [(data, where)]
    return list(data)


def _at(d: dict) -> str:
    """", commit abc1234" where the run records its commit (:func:`load_run`)."""
    return f", commit {d['commit'][:7]}" if d.get("commit") else ""


def repeats_clause(repeats: list[tuple[dict, str]]) -> str:
    """Per size of the repeated runs: the range over the runs of the drop-in's time and of the fastest
    peer's (each run's own fastest), from idle and with the host ahead."""
    if not repeats:
        return ""
    folders = sorted({w.rstrip("/").rsplit("/", 1)[0] + "/" for _, w in repeats})
    commits = sorted({d["commit"][:7] for d, _ in repeats if d.get("commit")})
    out = []
    for size in dict.fromkeys(sz for d, _ in repeats for sz in d["settings"]["sizes"]):
        mine = [r for d, _ in repeats for r in d["rows"] if r["size"] == size and r["contender"] == "anvil"
                and r["status"] == "ok"]
        peers = [fastest_peers(d["rows"]).get(size) for d, _ in repeats]
        ahead = [fastest_peers(d["rows"], "ms_ahead").get(size) for d, _ in repeats]
        peers, ahead = [b for b in peers if b], [b for b in ahead if b]
        if not mine or not peers:
            continue

        def span(v):  # a range only where the printed ends differ (0.6491 and 0.6494 are one 0.649)
            lo, hi = f"{min(v):.3f}", f"{max(v):.3f}"
            return lo if lo == hi else f"{lo}-{hi}"
        labels = sorted({b["label"] for b in peers + ahead})
        text = (f"on the {size} GPT the drop-in's step took {span([r['ms'] for r in mine])} ms from idle against "
                f"the fastest peer's {span([b['ms'] for b in peers])} ms")
        ahead_mine = [r["ms_ahead"] for r in mine if r.get("ms_ahead") is not None]
        if ahead_mine and ahead:
            text += (f", and {span(ahead_mine)} ms with the host ahead against "
                     f"{span([b['ms'] for b in ahead])} ms")
        out.append(text + f" ({', '.join(labels)}; the drop-in ran in {len(mine)} of the {len(repeats)} runs)")
    if not out:
        return ""
    return (f" The same command repeated {len(repeats)} times in a row, every contender in a fresh process each "
            f"time (`{'`, `'.join(folders)}`" + (f", commit {', '.join(commits)}" if commits else "") + "): "
            + "; ".join(out) + ".")


def readme_sentence(data, *, where: str = "results/h200_peers/", repeats: list[tuple[dict, str]] | None = None) -> str:
    """The README's speed sentence from one run's JSON, or from several ``(JSON, folder)`` runs (each
    size quoted from the first run in which the drop-in and a peer both ran at that size, so every
    ratio is of two times measured in one run); ``None``: the sentence before any run exists."""
    runs = _runs(data, where)
    if not runs:
        return ("The drop-in's step next to every installed peer is measured by `python -m anvil_fast.bench "
                f"peers` (one time-boxed process per contender); no H200 run of it is stored in `{where}` yet, "
                "so this README quotes no speed for it.")
    env = runs[0][0].get("environment") or {}
    sizes = list(dict.fromkeys(size for d, _ in runs for size in d["settings"]["sizes"]))
    clauses = []
    for size in sizes:
        def anvil_of(d):
            return next((r for r in d["rows"] if r["size"] == size and r["contender"] == "anvil"), None)

        having = [(d, w) for d, w in runs if size in d["settings"]["sizes"]]
        both = [(d, w) for d, w in having if (anvil_of(d) or {}).get("status") == "ok" and size in fastest_peers(d["rows"])]
        d, w = (both or having)[0]
        anvil, b = anvil_of(d), fastest_peers(d["rows"]).get(size)
        if anvil is None or anvil["status"] != "ok":
            mine = "the drop-in's step did not run" if anvil is None else \
                f"the drop-in's step gave no time ({anvil['status']})"
        else:
            mine = f"the drop-in's step (`anvil_fast.ANVIL`, defaults) takes {anvil['ms']:.3f} ms"
        peer = (f"the fastest peer measured beside it, {b['label']}, {b['ms']:.3f} ms"
                + (f" ({anvil['ms'] / b['ms']:.2f}x ANVIL's time over the peer's)" if anvil and
                   anvil["status"] == "ok" else "")) if b else "no peer ran"
        ba = fastest_peers(d["rows"], "ms_ahead").get(size)
        if anvil and anvil["status"] == "ok" and anvil.get("ms_ahead") is not None and ba:
            peer += (f"; with the host ahead of the device (the step queued behind other device work, as after a "
                     f"backward pass) {anvil['ms_ahead']:.3f} ms, the fastest peer {ba['label']}, {ba['ms']:.3f} ms "
                     f"({anvil['ms_ahead'] / ba['ms']:.2f}x)")
        untimed = [f"{r['label']} ({r['status']})" for r in d["rows"]
                   if r["size"] == size and r.get("kind") == "peer" and r["status"] != "ok"]
        where_clause = f" (`{w}`{_at(d)})" if len(runs) > 1 else ""
        clauses.append(f"on the {size} GPT{where_clause} {mine}; {peer}"
                       + (f"; not timed in that run: {', '.join(untimed)}" if untimed else ""))
    place = ("each size's times from one run, in the folder named" if len(runs) > 1
             else f"`{runs[0][1]}`{_at(runs[0][0])}")
    return (f"Measured on one {env.get('device', '?')} (torch {env.get('torch', '?')}, {place}, "
            f"`python -m anvil_fast.bench peers`): " + "; ".join(clauses) + "." + repeats_clause(repeats or []))


def readme_block(data, *, where: str = "results/h200_peers/", repeats: list[tuple[dict, str]] | None = None) -> str:
    return f"{README_BEGIN}\n{readme_sentence(data, where=where, repeats=repeats)}\n{README_END}"


def rewrite_readme(readme: Path, data, *, where: str = "results/h200_peers/",
                   repeats: list[tuple[dict, str]] | None = None) -> bool:
    """Replace the README's marked speed sentence (from the opening marker, whichever runs it names,
    to the closing one; the new opening names the runs given); True where the file changed."""
    text = readme.read_text()
    i = text.find(README_BEGIN_PREFIX)
    j = text.find(README_END, max(i, 0))
    if i < 0 or j < i:
        raise ValueError(f"{readme}: no speed-sentence markers ({README_BEGIN!r} ... {README_END!r})")
    new = text[:i] + readme_block(data, where=where, repeats=repeats) + text[j + len(README_END):]
    if new != text:
        readme.write_text(new)
    return new != text


def load_run(path) -> tuple[dict, str]:
    """A stored run as ``(data, folder)``: its JSON, with ``commit`` from the ``commit.txt`` beside it
    (the commit of the tree that ran, recorded when the run came back) where the JSON has none."""
    path = Path(path)
    data = json.loads(path.read_text())
    beside = path.parent / "commit.txt"
    if not data.get("commit") and beside.exists():
        data["commit"] = beside.read_text().split()[0]
    return data, path.parent.as_posix().rstrip("/") + "/"


def stored_runs(root: Path, paths: tuple[str, ...] = RESULTS_JSONS) -> list[tuple[dict, str]]:
    """The stored H200 runs the README quotes (:data:`RESULTS_JSONS`, or ``paths``; those that exist),
    as :func:`load_run` gives them, folders relative to ``root``."""
    return [(load_run(root / p)[0], Path(p).parent.as_posix() + "/") for p in paths if (root / p).exists()]


def _write_outputs(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("peers.json", json.dumps(data, indent=1) + "\n"), ("peers.md", render_markdown(data))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def add_args(ap: argparse.ArgumentParser) -> None:
    from anvil_fast.models.gpt import BF16_SUFFIX, SIZE_NAMES

    ap.add_argument("--sizes", type=name_list((*SIZE_NAMES, "smoke"), what="size"), default=None,
                    help=f"comma-separated GPT sizes (default small,medium; --device cpu: smoke); a size with "
                         f"{BF16_SUFFIX} (small{BF16_SUFFIX}) has bf16 parameters")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated contenders (default: all but the opt-in ones; module docstring)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--warmup", type=positive_int, default=15,
                    help="untimed steps first, the first of them giving the spread (default 15)")
    ap.add_argument("--steps", type=positive_int, default=50, help="timed steps (default 50)")
    ap.add_argument("--box-s", type=_positive_float, default=120.0,
                    help="wall seconds per contender process, compilation included (default 120)")
    ap.add_argument("--budget-s", type=_positive_float, default=DEFAULT_BUDGET_S,
                    help=f"wall seconds for the whole run (default {DEFAULT_BUDGET_S:g}: both sizes' contenders "
                         "took about 390 s on the H200, heavyball's box besides)")
    ap.add_argument("--out", default=None, help="folder for peers.json, peers.md, command.txt and peers.log")
    ap.add_argument("--note", default="", help="a line for command.txt (the machine, the commit)")
    ap.add_argument("--peers-dir", default=".peers",
                    help="where checkouts of peers' repositories live (dion: <peers-dir>/dion; default .peers)")
    ap.add_argument("--plugin", action="append", default=[], help="a module whose CONTENDERS are added (repeatable)")
    ap.add_argument("--from", dest="from_json", action="append", default=None,
                    help="render peers.md (into --out, else stdout) from this JSON instead of running; with "
                         "--readme, repeatable: each size is quoted from the first run given that timed both "
                         "the drop-in and a peer there")
    ap.add_argument("--repeat", action="append", default=[],
                    help="with --readme, repeatable: runs of one command made in a row, quoted as the range of "
                         "their times")
    ap.add_argument("--readme", default=None,
                    help="with --from: rewrite this README's speed sentence from the JSON and run nothing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _error(msg: str) -> int:
    print(f"anvil_fast.bench peers: error: {msg}", file=sys.stderr)
    return 2


def run(a: argparse.Namespace) -> int:
    if a.child:
        return child_main(a.child)
    if a.readme:
        if not a.from_json:
            return _error("--readme needs --from JSON (the run whose numbers the sentence quotes)")
        runs = [load_run(f) for f in a.from_json]
        reps = [load_run(f) for f in a.repeat]
        changed = rewrite_readme(Path(a.readme), runs, repeats=reps)
        print(f"{a.readme}: speed sentence {'rewritten' if changed else 'already current'} from "
              f"{', '.join(a.from_json)}")
        return 0
    if a.from_json:
        if len(a.from_json) > 1:
            return _error("--from without --readme renders one run's tables: give one JSON")
        data = json.loads(Path(a.from_json[0]).read_text())
        if a.out:
            _write_outputs(Path(a.out), data)
        else:
            print(render_markdown(data))
        return 0
    try:
        load_plugins(a.plugin)
    except (ImportError, ValueError) as e:
        return _error(f"--plugin: {e}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda asked for, but CUDA is not available here (--device cpu runs the smoke GPT)")
    known = [c.name for c in CONTENDERS]
    if a.contenders is None:
        names = [c.name for c in CONTENDERS if not c.opt_in]
    else:
        names = [n.strip() for n in a.contenders.split(",") if n.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            return _error(f"--contenders: unknown {', '.join(map(repr, bad)) or 'empty list'}; "
                          f"expected a comma-separated subset of: {', '.join(known)}")
    sizes = a.sizes or (["smoke"] if device.type == "cpu" else ["small", "medium"])
    return _run(a, names, sizes, device)


def gate(c: Contender, device, peers_dir: Path, *, timed_out: dict[str, str], left_s: float,
         budget_s: float) -> tuple[dict | None, str, list[str]]:
    """Whether a contender's process starts: (None, or the status and detail of a row that says why
    not; where it comes from; folders for the child's path). ``timed_out``: contender -> the size at
    which it ran out of its box; ``left_s``: what is left of the run's budget."""
    missing, source, paths = locate(c, peers_dir)
    if missing is not None:
        return dict(status="not installed", detail=missing), source, paths
    unavailable = c.check() if c.check is not None else None
    if unavailable is not None:
        return dict(status="not available", detail=unavailable), source, paths
    if c.needs_cuda and device.type != "cuda":
        return dict(status="needs CUDA", detail="it captures a CUDA graph"), source, paths
    if c.name in timed_out:
        return dict(status="skipped", detail=f"timed out at {timed_out[c.name]}"), source, paths
    if left_s < 1.0:
        return dict(status="not run", detail=f"the run's budget of {budget_s:g} s was spent"), source, paths
    return None, source, paths


def _run(a, names: list[str], sizes: list[str], device) -> int:
    from anvil_ref.progress import Progress

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="anvil_peers_"))
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m anvil_fast.bench peers " + " ".join(shlex.quote(x) for x in sys.argv[2:]) \
        if sys.argv[1:2] == ["peers"] else "python -m anvil_fast.bench peers"
    peers_dir = Path(a.peers_dir)
    data: dict[str, Any] = dict(
        generated_by="python -m anvil_fast.bench peers", command=command, commit=source_commit(),
        settings=dict(sizes=sizes, contenders=names, device=device.type, warmup=a.warmup, steps=a.steps,
                      box_s=a.box_s, budget_s=a.budget_s, grad_scale=GRAD_SCALE, model_seed=MODEL_SEED,
                      grad_seed=GRAD_SEED, probes=PROBES),
        environment=None, rows=[])
    (out / "command.txt").write_text(
        (a.note + "\n" if a.note else "") + f"{command}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, host {platform.node()}, "
        f"started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    _write_outputs(out, data)
    pkg_root = str(Path(__file__).resolve().parents[2])
    base_path = [pkg_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # a plugin imported from the working directory must be importable by the child as well
    base_path.append(os.getcwd())
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True
        raise _Stop(signal.Signals(signum).name)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    t_start = time.monotonic()
    timed_out: dict[str, str] = {}
    jobs = plan(names, sizes)
    running: dict[str, Any] | None = None
    log_path = out / "peers.log"
    print(f"anvil_fast.bench peers: {len(jobs)} rows on {device.type}, box {a.box_s:g} s, budget {a.budget_s:g} s; "
          f"output in {out}", flush=True)
    try:
        with open(log_path, "w") as log, tempfile.TemporaryDirectory(prefix="anvil_peers_") as tmp, \
                Progress(len(jobs), "peers", enabled=a.progress) as bar:
            for k, (name, size) in enumerate(jobs):
                c = contender(name)
                bar.update(k, label=f"peers: {size} {name}")
                row: dict[str, Any] = dict(size=size, contender=name, label=c.label, kind=c.kind)
                left = a.budget_s - (time.monotonic() - t_start)
                verdict, source, paths = gate(c, device, peers_dir, timed_out=timed_out, left_s=left,
                                              budget_s=a.budget_s)
                row["source"] = source
                if verdict is not None:
                    row.update(verdict)
                else:
                    box = min(a.box_s, left, c.box_s or math.inf)
                    running = row
                    row.update(_run_child(c, size, device, a, box=box, tmp=Path(tmp), log=log,
                                          path=paths + base_path))
                    if row["status"] == "timeout":
                        timed_out[name] = size
                    if data["environment"] is None and row.get("environment"):
                        data["environment"] = row["environment"]
                    row.pop("environment", None)
                running = None
                data["rows"].append(row)
                _write_outputs(out, data)
                print(_row_line(row), flush=True)
            bar.update(len(jobs))
    except _Stop as e:
        if running is not None:
            data["rows"].append(dict(running, status="stopped", detail=f"the run was stopped by {e} while it ran"))
        n = len(data["rows"])
        print(f"anvil_fast.bench peers: stopped by {e}; {n} row{'s' * (n != 1)} kept in {out}", flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if data["environment"] is None:
        data["environment"] = environment(torch.device("cpu")) if device.type == "cpu" else \
            dict(python=platform.python_version(), torch=torch.__version__, device="cuda (no contender ran)")
    data["wall_s"] = time.monotonic() - t_start
    _write_outputs(out, data)
    print(render_markdown(data))
    return 130 if stop["flag"] else 0


def _row_line(row: dict) -> str:
    head = f"  {row['size']} {row['contender']}: {row['status']}"
    if row["status"] == "ok":
        return head + f", {row['ms']:.3f} ms/step, host {row['host_ms']:.3f} ms ({row.get('wall_s', 0):.1f} s)"
    return head + f": {row.get('detail', '')}"


def capped(text: str, *, head: int = LOG_HEAD_LINES, tail: int = LOG_TAIL_LINES) -> str:
    """``text`` with the lines between its first ``head`` and last ``tail`` left out (and counted)."""
    lines = text.splitlines(keepends=True)
    if len(lines) <= head + tail:
        return text if not text or text.endswith("\n") else text + "\n"
    cut = len(lines) - head - tail
    return "".join(lines[:head]) + f"[... {cut} lines left out ...]\n" + "".join(lines[-tail:]) \
        + ("" if lines[-1].endswith("\n") else "\n")


def _run_child(c: Contender, size: str, device, a, *, box: float, tmp: Path, log, path: list[str]) -> dict:
    stem = f"{c.name}-{size}"
    spec = dict(contender=c.name, size=size, device=device.type, warmup=a.warmup, steps=a.steps,
                plugins=a.plugin, result_path=str(tmp / f"{stem}.result.json"), phase_path=str(tmp / f"{stem}.phase"))
    spec_path = tmp / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(path)), PYTHONUNBUFFERED="1")
    log.write(f"===== {stem} (box {box:.0f} s)\n")
    log.flush()
    result_file = Path(spec["result_path"])

    def finished() -> bool:
        try:
            return json.loads(result_file.read_text()).get("status") in ("ok", "error")
        except (OSError, ValueError):
            return False
    own_log = tmp / f"{stem}.log"
    with open(own_log, "w") as child_log:
        rc, wall = run_boxed([sys.executable, "-m", "anvil_fast.bench.peers", "--child", str(spec_path)],
                             box_s=box, log=child_log, env=env, done=finished, grace_s=EXIT_GRACE_S)
    log.write(capped(own_log.read_text(errors="replace")))
    log.write(f"===== {stem}: exit {rc}, {wall:.1f} s\n")
    log.flush()
    phase_file = Path(spec["phase_path"])
    last = phase_file.read_text() if phase_file.exists() else "starting the process"
    res = json.loads(result_file.read_text()) if result_file.exists() else {}
    res["wall_s"] = wall
    if rc is None and res.get("status") in ("ok", "error"):
        res["exit"] = f"killed {EXIT_GRACE_S:g} s after writing its result: the process did not exit"
    elif rc is None:
        res.update(status="timeout", detail=f"did not finish within {box:.0f} s (in: {last})")
    elif res.get("status") not in ("ok", "error"):
        res.update(status="error", detail=f"the process exited with {rc} before its result (in: {last}); "
                                          "peers.log has its output")
    return res


if __name__ == "__main__":  # the child: the canonical module, so plugins importing it share its classes
    from anvil_fast.bench import peers as _peers

    _ns = argparse.ArgumentParser(prog="python -m anvil_fast.bench.peers")
    _ns.add_argument("--child", required=True)
    sys.exit(_peers.child_main(_ns.parse_args().child))


__all__ = ["Contender", "CONTENDERS", "PROBES", "README_BEGIN", "README_END", "add_args", "run", "measure",
           "time_steps", "spread_of", "load_gradients", "fixed_gradients", "split_params", "plan", "gate",
           "run_boxed", "capped", "fastest_peers", "render_markdown", "readme_sentence", "readme_block",
           "rewrite_readme", "stored_runs", "load_run"]
