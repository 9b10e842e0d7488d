"""A model of the fast path's parameter storage (seed: ``_sign_aligned_decay_update``).

A bank's fp32 master weight ``w`` is stored as two 16-bit halves of its IEEE-754 bit pattern::

    bits(w) = (hi << 16) | lo        hi: the bf16 parameter the model reads, lo: the uint16 mantissa

so the bf16 parameter is ``w`` *truncated* to bf16 (rounded toward zero in magnitude), not rounded,
and ``join(hi, lo)`` gives back ``w`` exactly, for every bit pattern (normal, subnormal, zero,
negative zero, infinities and NaNs alike). After an update the fast path writes the new fp32
master the same way; :func:`store` is the reference's version of that write: it rounds the exact
(float64) result to the nearest fp32 (ties to even) and splits it.

All functions work on raw bits, take NumPy arrays or torch tensors, and return the kind they were
given: uint16/float32 NumPy arrays, or torch.uint16/float32 CPU tensors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._arrays import ReferenceInputError, _is_torch


class Halves(NamedTuple):
    """The two halves of an fp32 bit pattern."""

    hi: Any  #: uint16: the bf16 parameter's bits (high half)
    lo: Any  #: uint16: the mantissa buffer (low half)


def _bits16(x: Any, name: str) -> np.ndarray:
    if _is_torch(x):
        import torch

        t = x.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.int16, torch.float16):
            t = t.view(torch.uint16)
        if t.dtype != torch.uint16:
            raise ReferenceInputError(f"{name}: expected a uint16 or bfloat16 tensor, got {t.dtype}")
        return t.numpy().copy()
    a = np.asarray(x)
    if a.dtype != np.uint16:
        raise ReferenceInputError(f"{name}: expected a uint16 array, got {a.dtype}")
    return a.copy()


def _f32(x: Any, name: str) -> np.ndarray:
    if _is_torch(x):
        import torch

        t = x.detach().cpu()
        if t.dtype != torch.float32:
            raise ReferenceInputError(f"{name}: expected a float32 tensor, got {t.dtype}")
        return t.numpy().copy()
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise ReferenceInputError(f"{name}: expected a float32 array, got {a.dtype}")
    return a.copy()


def _out(arr: np.ndarray, template: Any) -> Any:
    if _is_torch(template):
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr))
    return arr


def split_fp32(master: Any) -> Halves:
    """``(hi, lo)`` with ``bits(master) = (hi << 16) | lo`` (``master`` is float32)."""
    bits = _f32(master, "master").view(np.uint32)
    return Halves(_out((bits >> 16).astype(np.uint16), master),
                  _out((bits & 0xFFFF).astype(np.uint16), master))


def join_fp32(hi: Any, lo: Any) -> Any:
    """The fp32 master whose bit pattern is ``(hi << 16) | lo``. ``hi`` may be a bf16 tensor."""
    h, l_ = _bits16(hi, "hi"), _bits16(lo, "lo")
    if h.shape != l_.shape:
        raise ReferenceInputError(f"lo: shape {l_.shape} does not match hi's {h.shape}")
    bits = (h.astype(np.uint32) << 16) | l_.astype(np.uint32)
    return _out(bits.view(np.float32), hi)


def bf16_truncate(master: Any) -> Any:
    """The bf16 parameter's value as float32: ``master`` with its low 16 bits cleared."""
    bits = _f32(master, "master").view(np.uint32) & np.uint32(0xFFFF0000)
    return _out(bits.view(np.float32), master)


def round_to_fp32(x: Any) -> np.ndarray:
    """The nearest float32 to each float64 value (ties to even; IEEE conversion)."""
    if _is_torch(x):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def store(master64: Any) -> Halves:
    """The reference's write of an updated master: round the exact value to fp32, then split."""
    r = round_to_fp32(master64)
    halves = split_fp32(r)
    return Halves(_out(halves.hi, master64), _out(halves.lo, master64))
