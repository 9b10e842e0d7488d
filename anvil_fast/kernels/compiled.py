"""One place that decides whether a fast-path function runs through torch.compile.

Every compiled function of anvil_fast is a plain torch function; :func:`maybe_compiled` returns its
``torch.compile(dynamic=False, fullgraph=True)`` twin (built once, lazily) or the function itself.
``compile=None`` means: compile when the tensors are on CUDA. On the CPU torch.compile costs tens of
seconds per shape for a few milliseconds saved, so the CPU path runs the same code eagerly unless
asked (tests compile once, as a smoke test of the compiled path).

dynamic=False as in the seed (dynamic shapes make the cascade much slower). Each bank shape compiles
once; Dynamo's recompile limit is raised so that a model's handful of bank shapes (and the
benchmark's shapes) do not fall back to eager silently.
"""

from __future__ import annotations

from typing import Callable

import torch

_COMPILED: dict[Callable, Callable] = {}
_LIMIT_RAISED = False


def _raise_recompile_limit(n: int = 64) -> None:
    global _LIMIT_RAISED
    if _LIMIT_RAISED:
        return
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)
    _LIMIT_RAISED = True


def want_compile(compile: bool | None, t: torch.Tensor) -> bool:
    return t.is_cuda if compile is None else bool(compile)


def maybe_compiled(fn: Callable, compile: bool) -> Callable:
    if not compile:
        return fn
    c = _COMPILED.get(fn)
    if c is None:
        _raise_recompile_limit()
        c = _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return c
