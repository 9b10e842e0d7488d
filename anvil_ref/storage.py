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


# ---------------------------------------------------------------------------------------------- lean rails
# The opt-in lean state stores the two rails in bf16. Each rail update is computed in fp32 (as the
# fp32 rails are) and rounded to bf16 *stochastically*: up with probability equal to the dropped
# fraction of an ulp, so the stored rail is an unbiased estimate of the fp32 one. Round-to-nearest
# would be biased where it matters: the slow rail's step ``(1 - 0.98) * (g - v)`` falls below half a
# bf16 ulp of ``v`` (2**-9 relative) whenever ``|g - v| < 0.1 |v|``, and every such step would be
# dropped, freezing the rail. The random bits are a hash of (step, salt, element index), not a
# generator's state: every device, every sharding and every replay draws the same bits.

#: Multiplier of the step in the per-step key (the golden ratio's 32-bit constant).
RAIL_KEY_MULTIPLIER = 0x9E3779B9


def hash32(x: Any) -> np.ndarray:
    """A 32-bit integer mixer (lowbias32): ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
    x *= 0x846ca68b; x ^= x >> 16``, all modulo 2**32, on uint32 arrays (a bijection of uint32)."""
    x = np.asarray(x, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    return x.astype(np.uint32)


def rail_random_bits(*, step: int, salt: int, index: Any) -> np.ndarray:
    """The 16 random bits of element ``index`` (its position in its bank, an integer array) at
    ``step`` (the optimizer's taken-step count) for rail ``salt``:
    ``hash32(index ^ hash32(step * RAIL_KEY_MULTIPLIER + salt)) & 0xFFFF`` (mod 2**32)."""
    key = hash32((int(step) * RAIL_KEY_MULTIPLIER + int(salt)) & 0xFFFFFFFF)
    idx = np.asarray(index, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    return (hash32(idx ^ key.astype(np.uint64)) & np.uint32(0xFFFF)).astype(np.uint32)


def stochastic_round_bf16(x: Any, *, step: int, salt: int, index: Any) -> Any:
    """``x`` (float32) rounded to bf16 stochastically (returned as float32 values): add the 16
    random bits of :func:`rail_random_bits` to the fp32 bit pattern and clear the low half. For a
    finite ``x`` between two bf16 neighbours this rounds away from zero with probability equal to
    ``x``'s distance from the lower-magnitude neighbour in units of their gap (sign and magnitude
    are separate fields, so the carry always moves the magnitude up), hence ``E[round(x)] = x``."""
    a = _f32(x, "x")
    bits = a.view(np.uint32).astype(np.uint64)
    r = rail_random_bits(step=step, salt=salt, index=index).astype(np.uint64)
    if r.shape != bits.shape:
        r = np.broadcast_to(r, bits.shape)
    out = (((bits + r) & np.uint64(0xFFFF0000)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return _out(out.view(np.float32), x)
