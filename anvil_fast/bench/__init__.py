"""anvil_fast.bench: benchmarks of the fast path, ``python -m anvil_fast.bench <command>`` (a table, never a test).

===========  =============================================================================================
command      what it times (module)
===========  =============================================================================================
``bank``     one bank update next to the seed's compiled plain-matmul update, against the roofline;
             the tuner's decisions and a phase table (:mod:`anvil_fast.bench.bank`)
``optimizer`` one AnvilAndAdam step on a GPT-2-small bank layout next to torch.optim.Muon + fused
             AdamW (:mod:`anvil_fast.bench.optimizer`)
``dropin``   the drop-in ``anvil_fast.ANVIL``'s step on the package's GPT next to Muon + AdamW and
             AdamW alone, with its floor and phase shares (:mod:`anvil_fast.bench.dropin`;
             ``--device cpu`` is a smoke run)
``peers``    the drop-in's step next to every installed peer (dion, heavyball, emerging-optimizers,
             pytorch-optimizer, torch Muon, AdamW), each in its own time-boxed process: ms, host ms,
             resident / peak / reserved memory, the update's singular-value spread
             (:mod:`anvil_fast.bench.peers`; ``--device cpu`` is a smoke run)
``fsdp``     ANVIL on an FSDP2 (``fully_shard``) GPT: step time, phases, bytes per step at several rank
             counts (:mod:`anvil_fast.bench.fsdp`; gloo on a CPU is an indication only)
===========  =============================================================================================

What the commands share -- the measured peaks, the element-wise bytes, a table writer -- is
:mod:`anvil_fast.bench.common`; timers come from :mod:`anvil_fast.kernels.timing`, the FLOP count from
:func:`anvil_fast.core.gram_side.map_flops`.

A new benchmark is a module of this package with ``add_args(parser)``, ``run(namespace) -> exit
code`` (exit code 2 where the device it needs is missing) and a one-line ``SUMMARY`` for ``--help``,
registered with one line in
:data:`COMMANDS`. Its module is imported only when the command line is parsed, so registering it
costs ``import anvil_fast.bench`` nothing.
"""

from __future__ import annotations

import argparse
import importlib

from anvil_ref.cli_args import add_progress_flags
from anvil_ref.progress import default_enabled

#: command name -> module of this package defining ``add_args(parser)`` and ``run(namespace) -> int``.
COMMANDS: dict[str, str] = {
    "bank": ".bank",
    "optimizer": ".optimizer",
    "dropin": ".dropin",
    "fsdp": ".fsdp",
    "peers": ".peers",
}


def command_module(name: str):
    """The module that implements command ``name`` (:data:`COMMANDS`: relative to this package, or an
    absolute module name for a benchmark that is also its own command line)."""
    return importlib.import_module(COMMANDS[name], __name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anvil_fast.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        mod = command_module(name)
        p = sub.add_parser(name, help=getattr(mod, "SUMMARY", None), description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
        add_progress_flags(p)
    a = ap.parse_args(argv)
    with default_enabled(a.progress):
        return command_module(a.command).run(a)


__all__ = ["COMMANDS", "command_module", "main"]
