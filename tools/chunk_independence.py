"""Does one bank update depend on how many matrices the bank holds? A bank of 2c matrices is updated
once, and its two halves as two banks of c matrices (what each of two ranks does when the seed's
sharding splits the bank); each phase's output is compared bit for bit, with the first phase that
differs named.

    python tools/chunk_independence.py [--shapes 24x768x768,24x3072x768,72x256x768] [--config safe]

It runs wherever anvil_fast does: on a CUDA device (the default where one is present) with the Triton
kernels, on CPU (``--device cpu``, the default elsewhere) with the plain-torch kernels; small shapes
take seconds there (``--shapes 4x64x48,2x32x96``), the record's shapes minutes.

Why: on two H200s the sharded optimizer's 20-step trajectory differed from the one-GPU run's by a
relative 2.0e-5 (results/anvil_optimizer_h200/run4/), with or without cuBLAS among the tuner's
candidates. Every phase is run on the same inputs in both layouts, so a difference is the phase's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anvil_ref.cli_args import add_progress_flags, check_device, shape_list  # noqa: E402  (after the path is set)
from anvil_ref.progress import Progress  # noqa: E402


def _bank(shape, dev, seed, config):
    from anvil_fast.core.bank import AnvilBank

    g = torch.Generator().manual_seed(seed)
    p = (0.02 * torch.randn(shape, generator=g)).bfloat16().to(dev)
    bank = AnvilBank.create("b", p, beta2=0.95, config=config)
    bank.grad.copy_(torch.randn(shape, generator=g))
    bank.velocity.copy_(0.1 * torch.randn((2, *shape), generator=g))
    bank.lane_energy.copy_(0.01 * torch.rand(bank.lane_energy.shape, generator=g))
    bank.mantissa.copy_(torch.randint(0, 2 ** 16, shape, generator=g).to(torch.uint16))
    bank.set_scalars(momentum=0.93, eff_wd=1e-4, fast_beta=0.85, fast_weight=0.44, eff_lr=0.02)
    return bank


def _halves(bank, config):
    from anvil_fast.core.bank import AnvilBank

    c = bank.p_slice.shape[0] // 2
    out = []
    for s in (slice(0, c), slice(c, 2 * c)):
        h = AnvilBank.create("h", bank.p_slice[s].clone(), beta2=bank.beta2, config=config,
                             velocity=bank.velocity[:, s].clone(), lane_energy=bank.lane_energy[s].clone(),
                             mantissa=bank.mantissa[s].clone(), grad=bank.grad[s].clone())
        h.set_scalars(momentum=float(bank.momentum), eff_wd=float(bank.eff_wd), fast_beta=float(bank.fast_beta),
                      fast_weight=float(bank.fast_weight), eff_lr=bank.eff_lr[s].flatten().tolist())
        out.append(h)
    return out


def phases(bank, compile_post=None) -> dict[str, torch.Tensor]:
    """Run one update phase by phase, returning a copy of each phase's output."""
    from anvil_fast.core.cascade import cascade_workspace
    from anvil_fast.kernels.equalizer import equalize
    from anvil_fast.kernels.rails import twin_rail
    from anvil_fast.kernels.update import sign_aligned_update

    ws, cfg, out = bank.workspace, bank.config, {}
    ready = twin_rail(bank.grad, bank.velocity, momentum=bank.momentum, fast_beta=bank.fast_beta,
                      fast_weight=bank.fast_weight, x_out=ws.X, prescale=cfg.prescale, fused=cfg.triton_elementwise,
                      partials=ws.partials)
    out["rails: velocity"], out["rails: X"] = bank.velocity.clone(), ws.X.clone()
    v = cascade_workspace(ws, maps=bank.maps, config=cfg, split=bank.split_baddbmm, partials_ready=ready)
    out["cascade"] = v.clone()
    v = equalize(v, bank.lane_energy, beta2=bank.beta2, red_dim=bank.red_dim,
                 guard_trips=bank.guard_trips if cfg.guard else None, compile=compile_post,
                 fused=cfg.triton_elementwise, work=ws.equalizer)
    out["equalizer: v"], out["equalizer: lane energy"] = v.clone(), bank.lane_energy.clone()
    sign_aligned_update(bank.p_slice, bank.mantissa, v, gate=bank.velocity[1], eff_lr=bank.eff_lr,
                        eff_wd=bank.eff_wd, compile=compile_post)
    out["update: p"], out["update: mantissa"] = bank.p_slice.clone(), bank.mantissa.clone()
    return out


def compare(shape, config, dev, compile_post=None) -> list[tuple[str, bool, float]]:
    whole = _bank(shape, dev, 0, config)
    a, b = _halves(whole, config)
    pw = phases(whole, compile_post)
    pa, pb = phases(a, compile_post), phases(b, compile_post)
    rows = []
    for k, w in pw.items():
        dim = 1 if k == "rails: velocity" else 0
        h = torch.cat([pa[k], pb[k]], dim=dim)
        same = torch.equal(w.view(torch.uint8) if w.dtype == torch.uint16 else w,
                           h.view(torch.uint8) if h.dtype == torch.uint16 else h)
        diff = float((w.double() - h.double()).abs().max()) if w.is_floating_point() else float(
            (w.view(torch.int16).int() - h.view(torch.int16).int()).abs().max())
        rows.append((k, same, diff))
    return rows


def _bank_shapes(text: str) -> list[tuple[int, ...]]:
    shapes = shape_list(3, form="CHUNKxROWSxCOLS")(text)
    odd = [s for s in shapes if s[0] % 2]
    if odd:
        raise argparse.ArgumentTypeError(
            f"shape {'x'.join(map(str, odd[0]))}: expected an even CHUNK (the bank is split into two halves)")
    return shapes


def main(argv=None) -> int:
    from anvil_fast.core.cascade import CONFIGS, get_config

    ap = argparse.ArgumentParser(prog="python tools/chunk_independence.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=_bank_shapes, default="24x768x768,24x3072x768,72x256x768",
                    help="comma-separated CHUNKxROWSxCOLS, CHUNK even (default: %(default)s)")
    ap.add_argument("--config", choices=tuple(CONFIGS), default="safe",
                    help="cascade configuration (default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device: cuda (Triton kernels) or cpu (plain torch) (default: %(default)s)")
    ap.add_argument("--eager-post", action="store_true", help="run the equalizer and the update eagerly "
                    "(not through torch.compile)")
    add_progress_flags(ap)
    a = ap.parse_args(argv)
    check_device(ap, a.device)
    cfg = get_config(a.config)
    post = False if a.eager_post else None
    print(f"device {a.device}, config {cfg.name}{', eager equalizer and update' if a.eager_post else ''}: "
          "bank of 2c matrices vs two banks of c, phase by phase")
    print(f"{'shape':<14} {'phase':<24} {'bitwise':<8} max |diff|")
    with Progress(len(a.shapes), "chunk independence", enabled=a.progress) as bar:
        for i, shape in enumerate(a.shapes):
            s = "x".join(map(str, shape))
            bar.update(i, label=f"chunk independence: {s} ({i + 1}/{len(a.shapes)})")
            for k, same, diff in compare(shape, cfg, a.device, post):
                print(f"{s:<14} {k:<24} {'yes' if same else 'NO':<8} {diff:.3g}", flush=True)
        bar.update(len(a.shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
