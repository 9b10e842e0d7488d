"""Differential testing of the fast path against anvil_ref, per component, next to two error floors.

For a shape, an input family and a configuration, each component runs three ways on the same input:

* **fast** -- anvil_fast (Triton kernels where they can run, compiled where asked);
* **eager** -- a plain eager-torch bf16 implementation of the same math (:mod:`anvil_fast.core.eager`);
* **ref** -- anvil_ref in float64, the specification.

and reports the relative error of fast and eager against ref, next to the *fp64 floor* (ref rounded
to the output's precision: no implementation that rounds its output can do better). Components:

``momentum``  twin rails + lookahead -> the cascade's bf16 input   (and the fp32 rails, in ulps)
``cascade``   normalization + maps (bf16 in, bf16 out)
``equalizer`` lane-energy equalizer (bf16 out; the fp32 lane energy in ulps)
``update``    sign-aligned decay + update: the fp32 master against the exact result, in fp32 ulps of
              the largest term, and the fraction bit-identical to ``anvil_ref.storage.store``

Errors are ``max over matrices of ||y - ref||_F / ||ref||_F`` (absolute where ref is zero; inf where
y is not finite). The verdict column applies one rule, :func:`anvil_fast.core.tolerances.check_row`
(:data:`VERDICT_RULE`): ``ok`` where the row meets it, ``FAIL`` where it does not, and
``expected-fail`` where it does not on a (component, config, family) listed in
:data:`EXPECTED_FAILURES`, the seed's documented explosions.

``python -m anvil_fast.studies.difftest`` prints the table (``--help`` for shapes, families, configs) and exits
with status 1 if a row is ``FAIL``.

Anyone's orthogonalization (:mod:`anvil_fast.studies.harness`) is judged from the same command line:
``--impl package.module:function`` with the math it declares (``--coeffs``, ``--steps``,
``--normalization``, ``--margin``, ``--eps``, ``--transpose-when``), or ``--adapter NAME`` for the
real implementations of other libraries (:mod:`anvil_fast.studies.adapters`; ``--list-adapters``), and
``--json FILE`` for the rows as JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor

import anvil_ref as R
from anvil_ref.cli_args import add_progress_flags, check_device, name_list, shape_list
from anvil_ref.constants import ANVIL_DEFAULTS, RAIL_BETA_MAX, RAIL_FAST_BETA, RAIL_FAST_WEIGHT

from anvil_fast.core import tolerances as T
from anvil_fast.core.cascade import CONFIGS, CascadeConfig, fast_cascade, get_config, gram_side_schedule
from anvil_fast.core.eager import eager_bf16_cascade, eager_equalizer, eager_rails, eager_update
from anvil_fast.kernels.equalizer import equalize
from anvil_fast.kernels.rails import twin_rail
from anvil_fast.kernels.update import sign_aligned_update
from anvil_fast.core.gram_side import eager_gram_side_cascade
from anvil_fast.core.tolerances import cascade_error_cap, check_row
# the input families and the error measure, shared with anvil_fast.studies.harness (re-exported here)
from .families import (FAMILIES, HUGE_EXP, TINY_EXP, WELL_CONDITIONED, WELL_CONDITIONED_SV, make_matrix,  # noqa: F401
                       rel_err, rel_errs)

#: Rows that fail the rule by design: FAITHFUL reproduces the seed's roundings, so its cascade explodes
#: on near-rank-1 input (the seed's rounded-down trace) and overflows on huge input (its bf16 Gram), as
#: anvil_fast/core/cascade.py documents and anvil_fast.studies.near_rank1 measures.
EXPECTED_FAILURES = frozenset({("cascade", "faithful", "near_rank1"), ("cascade", "faithful", "huge")})

#: The verdict rule as the table's footer states it.
VERDICT_RULE = (
    f"verdict: ok = within anvil_fast/core/tolerances.py (bf16: fast <= {T.FACTOR:g} eager + 2**{math.log2(T.ATOL):g}, "
    f"eager within its float64 bound, same bits on CPU (cascades up to {T.SAME_BITS_CASCADE_MAX_DIM} wide); "
    "fp32 results in ulps; cascade: error <= its explosion "
    f"cap 1 + {T.EXPLODED_SIGMA:g} sqrt(k) / ||ref||, the note 'error / explosion cap' <= 1); FAIL = outside; "
    "expected-fail = outside on a row the seed fails by design ("
    + ", ".join(f"{c} {cfg} {fam}" for c, cfg, fam in sorted(EXPECTED_FAILURES)) + ")")

# The record's scalars of an engaged step at the top of the momentum schedule; the update
# component steps with the record's matrix lr and weight decay.
MOMENTUM, FAST_BETA, FAST_WEIGHT = RAIL_BETA_MAX, RAIL_FAST_BETA, RAIL_FAST_WEIGHT
BETA2, LR, WEIGHT_DECAY = ANVIL_DEFAULTS["beta2"], ANVIL_DEFAULTS["lr"], ANVIL_DEFAULTS["weight_decay"]


def cap_ratio(y: Tensor, ref: Tensor) -> float:
    """max over matrices of the cascade's error / anvil_fast.core.tolerances.cascade_error_cap (> 1: exploded)."""
    r64 = ref.detach().double().cpu().reshape(-1, *ref.shape[-2:])
    k = min(r64.shape[-2:])
    caps = torch.tensor([cascade_error_cap(float(n), k) for n in r64.flatten(1).norm(dim=1)], dtype=torch.float64)
    return float((rel_errs(y, ref) / caps).max())


def same_bits(a: Tensor, b: Tensor) -> float:
    """Fraction of elements of two same-dtype tensors that are bit-identical."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"same_bits: expected equal shapes and dtypes, got {tuple(a.shape)} {a.dtype} "
                         f"and {tuple(b.shape)} {b.dtype}")
    ia = a.detach().cpu().contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.detach().cpu().contiguous().view(ia.dtype)
    return float((ia == ib).double().mean()) if ia.numel() else 1.0


def mean_singular_value_error(y: Tensor, ref: Tensor, x: Tensor) -> float:
    """The cascade's systematic error, in units of one bf16 rounding of its output.

    Per matrix, with ``x = U S V^T`` (float64 SVD of the cascade's input), ``t = tr(U^T (y - ref) V) / k``
    is the mean error of the output's singular values ``u_i^T y v_i`` (k = min(rows, cols)). Rounding
    errors are zero-mean and nearly independent, so they average out of ``t``; a wrong coefficient, a
    dropped map or a wrong margin shifts every singular value the same way and does not. The unit is the
    standard deviation of ``t`` for one rounding of every output element (relative RMS
    ``2**-8 / sqrt(3)`` each): ``rho = 2**-8 / sqrt(3) * sqrt(sum_ab ref_ab^2 W_ab^2) / k`` with
    ``W = U V^T``. Returns max over matrices of ``|t| / rho`` (0 where ref is zero)."""
    y64 = y.detach().double().cpu().reshape(-1, *y.shape[-2:])
    r64 = ref.detach().double().cpu().reshape(-1, *ref.shape[-2:])
    x64 = x.detach().double().cpu().reshape(-1, *x.shape[-2:])
    if not torch.isfinite(y64).all():
        return math.inf
    u, _, vh = torch.linalg.svd(x64, full_matrices=False)
    w = u @ vh
    k = min(w.shape[-2:])
    t = ((y64 - r64) * w).sum(dim=(-2, -1)) / k
    rho = 2.0 ** -8 / math.sqrt(3.0) * (r64.square() * w.square()).sum(dim=(-2, -1)).sqrt() / k
    return float(torch.where(rho > 0, t.abs() / rho.clamp_min(1e-300), t.abs()).max())


def ulp_diff(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance in fp32 ulps (units in the last place) between two fp32 tensors."""
    def key(t):
        i = t.detach().cpu().float().contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (key(a) - key(b)).abs()


def ulp32(x: Tensor) -> Tensor:
    """The fp32 ulp at |x| (float64 tensor): 2**(floor(log2|x|) - 23), at least 2**-149."""
    x = x.detach().double().cpu().abs()
    e = torch.floor(torch.log2(x.clamp_min(2.0 ** -126)))
    return torch.exp2(e - 23).clamp_min(2.0 ** -149)


def err_ulps(y: Tensor, exact: Tensor, scale: Tensor) -> float:
    """max |y - exact| in fp32 ulps of ``scale`` (the largest term that entered the result): the unit
    of an fp32 computation's rounding error, which does not blow up where the result cancels."""
    d = (y.detach().double().cpu() - exact.detach().double().cpu()).abs()
    if not torch.isfinite(d).all():
        return math.inf
    return float((d / ulp32(scale)).max())


@dataclass
class Row:
    component: str
    shape: tuple[int, ...]
    family: str
    config: str
    fast: float
    floor: float
    eager: float
    extra: str = ""
    ulps: float | None = None  #: fp32 side result in ulps (momentum: rails; equalizer: lane energy)
    #: share of the fast bf16 output's elements bit-identical to the eager one's (None for "update")
    same_bits: float | None = None
    #: cascade on a WELL_CONDITIONED family: the eager output's mean singular-value error in units of
    #: one output rounding (:func:`mean_singular_value_error`); None elsewhere
    eager_sv: float | None = None
    #: the input is in WELL_CONDITIONED (the eager-vs-float64 side of the rule applies)
    well_conditioned: bool = False
    #: cascade: max over matrices of the fast error / its explosion cap against float64
    #: (anvil_fast.core.tolerances.cascade_error_cap; > 1: exploded); None elsewhere
    cap_ratio: float | None = None
    #: where the fast path ran: on "cpu" fast and eager share a backend (plain torch or interpreted
    #: kernels against torch), on CUDA Triton kernels meet cuBLAS
    device: str = "cpu"

    def verdict(self) -> str:
        """"ok", "FAIL" or "expected-fail" (:data:`VERDICT_RULE`)."""
        if check_row(self, same_backend=self.device == "cpu"):
            return "ok"
        return "expected-fail" if (self.component, self.config, self.family) in EXPECTED_FAILURES else "FAIL"


def _to(dev, *ts):
    return [t.to(dev) for t in ts]


def momentum_row(shape, family, cfg: CascadeConfig | str, *, seed=0, device="cpu", compile=None,
                 backend="auto") -> tuple[Row, dict]:
    cfg = get_config(cfg)
    grad = make_matrix(family, shape, seed=seed).bfloat16()
    gen = torch.Generator().manual_seed(seed + 1)
    scale = grad.float().abs().amax().clamp_min(1e-30)
    vel = torch.randn((2, *shape), generator=gen) * scale
    f32 = dict(dtype=torch.float32, device=device)
    mu, fb, w = (torch.tensor(v, **f32) for v in (MOMENTUM, FAST_BETA, FAST_WEIGHT))
    v_dev, g_dev = _to(device, vel.clone(), grad)
    x_out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    twin_rail(g_dev, v_dev, momentum=mu, fast_beta=fb, fast_weight=w, x_out=x_out, prescale=cfg.prescale,
              fused=cfg.triton_elementwise, backend=backend, compile=compile)
    ref = R.twin_rail(grad, vel[0], vel[1], momentum=float(mu), fast_beta=float(fb), fast_weight=float(w))
    look_fast = x_out.double().cpu()
    look_eager, e0, e1 = eager_rails(grad, vel[0], vel[1], momentum=float(mu), fast_beta=float(fb), fast_weight=float(w))
    big = [torch.maximum(vel[i].abs(), grad.float().abs()).double() for i in (0, 1)]
    rails_ulps = max(err_ulps(v_dev[0], ref.v_fast, big[0]), err_ulps(v_dev[1], ref.v_slow, big[1]))
    eager_ulps = max(err_ulps(e0, ref.v_fast, big[0]), err_ulps(e1, ref.v_slow, big[1]))
    row = Row("momentum", shape, family, cfg.name, rel_err(look_fast, ref.lookahead),
              rel_err(ref.lookahead.bfloat16(), ref.lookahead), rel_err(look_eager.bfloat16(), ref.lookahead),
              f"rails: max err in ulps of max(|v|,|g|): fast {rails_ulps:.3g} eager {eager_ulps:.3g}", ulps=rails_ulps,
              same_bits=same_bits(x_out.cpu(), look_eager.bfloat16()), well_conditioned=family in WELL_CONDITIONED,
              device=str(torch.device(device).type))
    return row, {"rails_ulps": rails_ulps, "eager_rails_ulps": eager_ulps}


def cascade_row(shape, family, cfg: CascadeConfig | str, *, seed=0, device="cpu", compile=None, backend="auto") -> tuple[Row, Tensor]:
    cfg = get_config(cfg)
    x = make_matrix(family, shape, seed=seed)
    y = fast_cascade(x.to(device), config=cfg, compile=compile, backend=backend)
    ref = R.cascade(x.bfloat16(), margin=cfg.margin())
    sched = gram_side_schedule(cfg, shape, device=device)
    if sched is not None:
        e = eager_gram_side_cascade(x.to(device), restarts=sched, margin=cfg.margin())
    else:
        e = eager_bf16_cascade(x.to(device), margin=cfg.margin(), fp32_trace=cfg.fp32_trace, prescale=cfg.prescale,
                               split=False if cfg.fused_axb else None)
    wc = family in WELL_CONDITIONED
    sv = mean_singular_value_error(e, ref, x.bfloat16()) if wc else None
    cr = cap_ratio(y, ref)
    notes = f"error / explosion cap: {cr:.3g}" + (
        "" if sv is None else f"; eager mean singular-value error: {sv:.3g} sd of one output rounding")
    return Row("cascade", shape, family, cfg.name, rel_err(y, ref), rel_err(ref.bfloat16(), ref), rel_err(e, ref),
               notes, same_bits=same_bits(y.cpu(), e.cpu()), eager_sv=sv, well_conditioned=wc,
               device=str(torch.device(device).type), cap_ratio=cr), ref


def equalizer_row(v: Tensor, shape, family, cfg: CascadeConfig | str, *, seed=0, device="cpu", compile=None,
                  backend="auto") -> tuple[Row, Tensor]:
    cfg = get_config(cfg)
    gen = torch.Generator().manual_seed(seed + 2)
    v = v.bfloat16().cpu()
    red = R.reduction_axis(shape)
    lane_shape = R.lane_energy_shape(shape)
    energy = v.float().square().mean(dim=red, keepdim=True) * (0.5 + torch.rand(lane_shape, generator=gen))
    ref_v, ref_e = R.equalize(v, energy, beta2=BETA2)
    vf, ef = _to(device, v.clone(), energy.clone())
    trips = torch.zeros(shape[0], dtype=torch.int32, device=device) if cfg.guard else None
    equalize(vf, ef, beta2=BETA2, red_dim=red, guard_trips=trips, compile=compile, fused=cfg.triton_elementwise,
             backend=backend)
    ev, ee = eager_equalizer(v, energy, beta2=BETA2)
    power = R.lane_power(v)
    eulps = err_ulps(ef, ref_e, torch.maximum(energy.double().abs(), power.abs()))
    row = Row("equalizer", shape, family, cfg.name, rel_err(vf, ref_v), rel_err(ref_v.bfloat16(), ref_v),
              rel_err(ev, ref_v), f"lane energy: max err in ulps of max(E, P): {eulps:.3g}", ulps=eulps,
              same_bits=same_bits(vf.cpu(), ev), well_conditioned=family in WELL_CONDITIONED,
              device=str(torch.device(device).type))
    return row, vf.cpu()


def update_row(u: Tensor, shape, family, cfg: CascadeConfig | str, *, seed=0, device="cpu", compile=None,
               backend="auto") -> Row:
    """The parameter update as ``cfg`` runs it (SAFE: the Triton kernel where ``backend`` runs Triton)."""
    cfg = get_config(cfg)
    gen = torch.Generator().manual_seed(seed + 3)
    master = (0.02 * torch.randn(shape, generator=gen)).float()
    hi, lo = R.split_fp32(master)
    p = hi.view(torch.bfloat16).clone()
    mant = lo.clone()
    gate = torch.randn(shape, generator=gen)
    chunk = shape[0]
    mult = [0.0 if i == chunk - 1 and chunk > 2 else (2.0 if i % 2 else 1.0) for i in range(chunk)]
    eff_lr = torch.tensor([LR * m for m in mult], dtype=torch.float32).reshape(-1, 1, 1)
    eff_wd = torch.tensor(LR * WEIGHT_DECAY, dtype=torch.float32)
    u = u.bfloat16().cpu()
    ref_w = R.sign_aligned_update(R.join_fp32(p, mant), u, gate, eff_lr=eff_lr.double(), eff_wd=float(eff_wd))
    ref_hi, ref_lo = R.store(ref_w)
    ref_bits = R.join_fp32(ref_hi, ref_lo)
    pd, md, ud, gd, ld, wd = _to(device, p.clone(), mant.clone(), u, gate, eff_lr, eff_wd)
    sign_aligned_update(pd, md, ud, gate=gd, eff_lr=ld, eff_wd=wd, compile=compile, fused=cfg.triton_elementwise,
                        backend=backend)
    fast_bits = R.join_fp32(pd.cpu(), md.cpu())
    ep, em = eager_update(p, mant, u, gate, eff_wd=eff_wd, eff_lr=eff_lr)
    eager_bits = R.join_fp32(ep, em)
    w0 = R.join_fp32(p, mant).double()
    terms = torch.stack([w0.abs(), (w0 * float(eff_wd) * eff_lr.double()).abs(), (u.double() * eff_lr.double()).abs(),
                         ref_w.abs()]).amax(0)
    uf, ue = ulp_diff(fast_bits, ref_bits), ulp_diff(eager_bits, ref_bits)
    return Row("update", shape, family, cfg.name, err_ulps(fast_bits, ref_w, terms), err_ulps(ref_bits, ref_w, terms),
               err_ulps(eager_bits, ref_w, terms),
               f"master == store(ref) bitwise: fast {float((uf == 0).double().mean()):.4f} "
               f"eager {float((ue == 0).double().mean()):.4f}")


def run(shape, family, config: CascadeConfig | str, *, seed=0, device="cpu", compile=None, backend="auto") -> list[Row]:
    """All four components for one (shape, family, config). Equalizer and update take the previous
    component's reference output as input, so each component is judged on its own error."""
    cfg = get_config(config)
    shape = tuple(shape)
    rows = [momentum_row(shape, family, cfg, seed=seed, device=device, compile=compile, backend=backend)[0]]
    crow, ref_y = cascade_row(shape, family, cfg, seed=seed, device=device, compile=compile, backend=backend)
    rows.append(crow)
    erow, v_eq = equalizer_row(ref_y, shape, family, cfg, seed=seed, device=device, compile=compile, backend=backend)
    rows.append(erow)
    rows.append(update_row(v_eq, shape, family, cfg, seed=seed, device=device, compile=compile, backend=backend))
    return rows


def format_table(rows: list[Row]) -> str:
    head = (f"{'component':<10} {'shape':<16} {'family':<11} {'config':<9} {'fast':>10} {'fp64->bf16':>10} "
            f"{'eager':>10} {'fast/eager':>10} {'verdict':>13}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r.fast / r.eager if r.eager > 0 and math.isfinite(r.eager) else float("nan")
        lines.append(f"{r.component:<10} {'x'.join(map(str, r.shape)):<16} {r.family:<11} {r.config:<9} "
                     f"{r.fast:>10.3g} {r.floor:>10.3g} {r.eager:>10.3g} {ratio:>10.3g} {r.verdict():>13}  {r.extra}")
    lines.append("errors: relative Frobenius vs anvil_ref (max over matrices); update: max error of the fp32 master "
                 "vs the exact result, in fp32 ulps of the largest term (floor: anvil_ref.storage.store's rounding)")
    lines.append(VERDICT_RULE)
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """The footer: how many rows got each verdict."""
    counts = {v: 0 for v in ("ok", "FAIL", "expected-fail")}
    for r in rows:
        counts[r.verdict()] += 1
    return f"{len(rows)} rows: " + ", ".join(f"{n} {v}" for v, n in counts.items())


HARNESS_EPILOG = """\
Testing your own orthogonalization (anvil_fast.studies.harness): give the function (it takes a batch
[chunk, rows, cols], or one matrix, which the first call shows, and returns the same shape) and the math it
declares; each row is judged against that math in float64 and against a plain eager bf16 run of it:

  python -m anvil_fast.studies.difftest --impl mylib.ortho:newton_schulz \\
      --coeffs 3.4445,-4.7750,2.0315 --steps 5 --normalization frobenius_clamp --margin 1 --eps 1e-7 \\
      --transpose-when tall --shapes 2x48x32,2x32x48 --json out.json

  --coeffs takes triples a,b,c;a,b,c;... (one per step), a map-set name of anvil_ref (muon_jordan5,
  polar_express_nanogpt5, ...) or a JSON file; --steps repeats the last triple (--cycle: the whole
  list). Without --coeffs the math is undeclared: safety only. --impl-kwargs '{"steps": 5}' passes
  keyword arguments on every call; --impl takes several functions, comma-separated (one math), each
  from a module on the import path or from a file: --impl path/to/my_ns.py:newton_schulz.

Three verdicts per row (anvil_fast/core/tolerances.py): math (the function run with every tensor
lifted to float64 against the declared math; the spectrum family's singular values against the
declared map; the Gram side) and safety (finite, not vacuous, no explosion its eager bf16
math does not have) FAIL; rounding (error against float64 over the fused and unfused eager bf16
runs of the same math) is a finding. The field's own code, and the slips a harness must catch:

  python -m anvil_fast.studies.difftest --impl anvil_fast.studies.field_examples:muon_newton_schulz \\
      --coeffs 3.4445,-4.7750,2.0315 --steps 5

The real implementations of other libraries, where installed (--list-adapters says which):

  python -m anvil_fast.studies.difftest --adapter torch-muon,pytorch-optimizer-quintic,anvil-safe

A long table in runs of under ten minutes, compilers' caches kept:

  python -m anvil_fast.studies.difftest --adapter all --shapes 4x256x768 --json t.json --resume \\
      --time-budget-s 420 --cache-dir cache     # again until its JSON says "complete": true

Exit status: 0, or 1 if a row is FAIL (every failed clause printed with its value and limit); 2 for
bad arguments."""


def _coeffs(text: str):
    """--coeffs: triples ``a,b,c;a,b,c`` (any text with a comma), else a map-set name or a JSON file."""
    from anvil_ref._arrays import ReferenceInputError
    from anvil_ref.maps import load_maps

    try:
        if "," in text:
            return load_maps([tuple(float(v) for v in part.split(",")) for part in text.split(";") if part.strip()])
        return load_maps(text)
    except (ValueError, ReferenceInputError) as exc:
        raise argparse.ArgumentTypeError(f"expected triples a,b,c;a,b,c, a map-set name or a JSON file ({exc})") from None


def _json_object(text: str) -> dict:
    import json

    try:
        v = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return v


def _restarts(text: str) -> tuple[int, ...]:
    """--restarts: 0-based step indices, comma-separated."""
    try:
        out = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected step indices >= 0 like 2 or 2,4, got {text!r}")
    return out


def _harness_args(ap: argparse.ArgumentParser) -> None:
    from anvil_ref.cli_args import positive_int

    from . import harness as H
    from anvil_ref.polar import NORMALIZATIONS, ORIENTATIONS

    g = ap.add_argument_group("anyone's orthogonalization (anvil_fast.studies.harness)")
    g.add_argument("--impl", metavar="package.module:function",
                   help="the function to judge (or path/to/file.py:function)")
    g.add_argument("--impl-kwargs", type=_json_object, default={}, metavar="JSON",
                   help="keyword arguments passed to it on every call")
    per = g.add_mutually_exclusive_group()
    per.add_argument("--per-matrix", dest="per_matrix", action="store_const", const=True, default=None,
                     help="it takes one matrix [rows, cols], not a batch (default, as the API: decided from one "
                          "call on a batch, which a function of one matrix refuses)")
    per.add_argument("--batched", dest="per_matrix", action="store_const", const=False,
                     help="it takes a batch [chunk, rows, cols]: no such call")
    g.add_argument("--input-dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32",
                   help="dtype of the input it is given (default: %(default)s)")
    g.add_argument("--coeffs", type=_coeffs, default=None, help="its per-step (a, b, c): see below")
    g.add_argument("--steps", type=positive_int, default=None, help="number of steps (see below)")
    g.add_argument("--cycle", action="store_true", help="--steps cycles the list instead of repeating its last")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="frobenius",
                   help="frobenius: X/(margin ||X||_F + eps); frobenius_clamp: X/max(margin ||X||_F, eps); "
                        "aol: rows scaled by (sum_j |(X X^T)_ij|)^(-1/2) (default: %(default)s)")
    g.add_argument("--margin", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--eps", type=float, default=1e-7, help="(default: %(default)s)")
    g.add_argument("--transpose-when", choices=ORIENTATIONS, default="tall",
                   help="which matrices it transposes before iterating: tall (rows > cols; the Gram on the "
                        "short side), wide, never, always (default: %(default)s)")
    g.add_argument("--restarts", type=_restarts, default=None, metavar="I[,I...]",
                   help="it iterates in the Gram form, X re-formed before these steps (0-based; e.g. 2 for "
                        "gram-newton-schulz's reset): its eager baseline is then the Gram form's")
    g.add_argument("--dtype", choices=H.ITERATION_DTYPES, default="bfloat16",
                   help="the dtype it iterates in; its eager baselines iterate in it too (default: %(default)s)")
    g.add_argument("--adapter", default=None, metavar="NAME[,NAME...]",
                   help="adapters of other libraries' implementations (and the package's), or 'all'")
    g.add_argument("--list-adapters", action="store_true", help="list the adapters and whether each runs here")
    g.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON ('-': stdout)")
    g.add_argument("--near-rank1-count", type=positive_int, default=8,
                   help="near-rank-1 inputs per shape, the explosion count (default: %(default)s)")
    g.add_argument("--spectrum-count", type=positive_int, default=None,
                   help=f"matrices of the spectrum probe per shape (default: {H.SPECTRUM_MIN_COUNT}, fewer on large "
                        "shapes; fewer see less of a slip)")
    g.add_argument("--time-reps", type=int, default=0, help="timed calls per shape on CUDA (default: none)")
    g.add_argument("--time-budget-s", "--time-limit", dest="time_limit", type=float, default=None, metavar="SECONDS",
                   help="start no new (implementation, shape) after this many seconds; the rows done are written "
                        "and --resume continues from them")
    g.add_argument("--resume", action="store_true",
                   help="keep the rows of --json FILE from an earlier run of the same command and measure the rest")
    g.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="keep the compilers' caches here between runs (TRITON_CACHE_DIR=DIR/triton, "
                        "TORCHINDUCTOR_CACHE_DIR=DIR/inductor): a second run compiles and autotunes nothing again")


def _set_cache_dir(path: str) -> None:
    import os
    from pathlib import Path

    root = Path(path).resolve()
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(root / sub)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


def harness_main(ap: argparse.ArgumentParser, a: argparse.Namespace, argv) -> int:
    import json
    import shlex
    from pathlib import Path

    from . import adapters as AD
    from . import harness as H

    if a.list_adapters:
        print(AD.listing(device=a.device))
        return 0
    if (a.impl is None) == (a.adapter is None):
        ap.error("give either --impl package.module:function or --adapter NAME, not both")
    if a.time_reps < 0:
        ap.error(f"argument --time-reps: expected a count >= 0, got {a.time_reps}")
    if a.resume and a.json in (None, "-"):
        ap.error("argument --resume: needs --json FILE (the rows it continues from)")
    if a.cache_dir is not None:
        _set_cache_dir(a.cache_dir)
    shapes = a.shapes or [tuple(s) for s in H.DEFAULT_SHAPES]
    families = list(a.families) if a.families is not None else list(H.DEFAULT_FAMILIES)
    unavailable: dict[str, str] = {}
    if a.impl is not None:
        math_ = None
        if a.coeffs is not None:
            try:
                math_ = H.DeclaredMath.of(a.coeffs, steps=a.steps, cycle=a.cycle, normalization=a.normalization,
                                          margin=a.margin, eps=a.eps, transpose_when=a.transpose_when,
                                          restarts=a.restarts, dtype=a.dtype)
            except ValueError as exc:
                ap.error(f"declared math: {exc}")
        kw = dict(a.impl_kwargs)
        impls = []
        for spec in [v.strip() for v in a.impl.split(",") if v.strip()]:
            try:
                fn = H.resolve(spec)
            except ValueError as exc:
                ap.error(str(exc))
            impls.append(H.Implementation(spec, (lambda x, fn=fn: fn(x, **kw)) if kw else fn, math_,
                                          per_matrix=a.per_matrix, input_dtype=getattr(torch, a.input_dtype)))
    else:
        names = list(AD.ADAPTERS) if a.adapter == "all" else [n.strip() for n in a.adapter.split(",")]
        bad = [n for n in names if n not in AD.ADAPTERS]
        if bad:
            ap.error(f"argument --adapter: unknown {', '.join(map(repr, bad))}; --list-adapters lists them")
        impls, unavailable = AD.load(names, device=a.device, compile=a.compile)
        for n, why in unavailable.items():
            print(f"{n}: unavailable: {why}", file=sys.stderr)
        if not impls:
            ap.error("no requested adapter can run here (see above)")
    cmd = "python -m anvil_fast.studies.difftest " + " ".join(shlex.quote(v) for v in (argv if argv is not None else sys.argv[1:]))
    done: list = []
    warmups: dict = {}
    if a.resume and Path(a.json).is_file():
        old = json.loads(Path(a.json).read_text())
        names_now = {i.name for i in impls}
        here = [r for r in old.get("rows", []) if r["impl"] in names_now
                and tuple(r["shape"]) in set(shapes) and r["family"] in families]
        # a declared row without declared_dtype was judged before the lifted run's second scale and casts:
        # measured again, not kept under a rule it was not judged by
        done = [H.row_from_json(r) for r in here if not r.get("declared", True) or r.get("declared_dtype")]
        for r in done:  # rows stored before rows named their machine: the stored run's
            r.device_name = r.device_name or old.get("device", "")
        warmups = dict(old.get("warmups", {}))
        print(f"resumed: {len(done)} rows of {a.json} kept"
              + (f", {len(here) - len(done)} of an older rule measured again" if len(here) > len(done) else ""),
              file=sys.stderr)

    total = sum(len([f for f in families if not (f == H.SPECTRUM and i.math is None)]) for i in impls) * len(shapes)
    clock = [time.monotonic(), len(done)]
    seconds: dict = {}
    shown: dict = {}

    # one line per finished row on stdout where no bar is drawn (a pipe, --no-progress): what a log of
    # the run needs to say where the time went, each row with its phases' seconds
    row_lines = a.progress is False or (a.progress is None and not sys.stderr.isatty())

    def write(rows):
        if len(rows) > clock[1] and row_lines:
            now, r = time.monotonic(), rows[-1]
            parts = sorted(((k, v - shown.get(k, 0.0)) for k, v in seconds.items()), key=lambda kv: -kv[1])
            shown.update(seconds)
            print(f"row {len(rows)}/{total} {r.impl} {'x'.join(map(str, r.shape))} {r.family}: {r.verdict()} "
                  f"in {now - clock[0]:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in parts if v >= 0.05) + ")",
                  flush=True)
        if len(rows) > clock[1]:
            clock[:] = [time.monotonic(), len(rows)]
        if a.json is not None:
            H.write_json(H.to_json(rows, command=cmd, impls=impls, unavailable=unavailable,
                                   meta={"complete": len(rows) >= total, "shapes": [list(s) for s in shapes],
                                         "families": families, "seed": a.seed, "warmups": warmups}), a.json)

    rows = H.judge(impls, shapes=shapes, families=families, seed=a.seed, device=a.device,
                   near_rank1_count=a.near_rank1_count, time_reps=a.time_reps, progress=a.progress,
                   time_limit=a.time_limit, checkpoint=write if a.json not in (None, "-") else None, done=done,
                   warmups=warmups, spectrum_count=a.spectrum_count, seconds=seconds)
    print(H.format_table(rows))
    print("\n" + H.summary(rows))
    for n, why in unavailable.items():
        print(f"unavailable: {n}: {why}")
    failed = [(r, c) for r in rows if r.verdict() == "FAIL" for c in r.failures()]
    for r, c in failed:
        print(f"FAIL {r.impl} {'x'.join(map(str, r.shape))} {r.family}: {c}")
    write(rows)
    return 1 if failed else 0


def main(argv=None) -> int:
    from anvil_ref.progress import Progress

    shapes = shape_list(3, form="CHUNKxROWSxCOLS")
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.studies.difftest", description=__doc__.split("\n\n")[0],
                                 epilog=HARNESS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shapes, default=None,
                    help="comma-separated CHUNKxROWSxCOLS (default: 4x96x96,2x256x768,2x768x768,2x2816x768; "
                         "with --impl or --adapter: 2x48x32,2x32x48,2x32x32)")
    from .harness import DEFAULT_FAMILIES, HARNESS_FAMILIES, SPECTRUM

    ap.add_argument("--families", type=name_list(HARNESS_FAMILIES, what="family"), default=None,
                    help=f"comma-separated input families, any of: {', '.join(HARNESS_FAMILIES)} (default: every "
                         f"one but {SPECTRUM}; with --impl or --adapter, as anvil_fast.testing: "
                         f"{', '.join(DEFAULT_FAMILIES)})")
    ap.add_argument("--configs", type=name_list(CONFIGS, what="config"), default="safe,faithful",
                    help=f"comma-separated cascade configurations, any of: {', '.join(CONFIGS)} "
                         "(default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device of the fast path (default: %(default)s)")
    ap.add_argument("--compile", choices=("auto", "yes", "no"), default="auto",
                    help="torch.compile the fast path's element-wise parts; for --adapter, whether libraries "
                         "that compile their function run it compiled (anvil_fast.studies.adapters) (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: %(default)s)")
    add_progress_flags(ap)
    _harness_args(ap)
    a = ap.parse_args(argv)
    check_device(ap, a.device)
    if a.impl is not None or a.adapter is not None or a.list_adapters:
        return harness_main(ap, a, argv)
    if a.families is None:
        a.families = list(FAMILIES)
    if SPECTRUM in a.families:
        ap.error(f"argument --families: {SPECTRUM} is the harness's (--impl or --adapter)")
    if a.shapes is None:
        a.shapes = shapes("4x96x96,2x256x768,2x768x768,2x2816x768")
    comp = {"auto": None, "yes": True, "no": False}[a.compile]
    rows = []
    cases = [(c, s, f) for c in a.configs for s in a.shapes for f in a.families]
    with Progress(len(cases), "difftest", enabled=a.progress) as bar:
        for i, (cname, shape, fam) in enumerate(cases):
            bar.update(i, label=f"difftest: {cname} {'x'.join(map(str, shape))} {fam} ({i + 1}/{len(cases)})")
            rows += run(shape, fam, cname, seed=a.seed, device=a.device, compile=comp)
        bar.update(len(cases))
    print(format_table(rows))
    print("\n" + summary(rows))
    return 1 if any(r.verdict() == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
