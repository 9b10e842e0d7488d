"""Input handling shared by the reference functions: float64 conversion, checks, and output kind.

Every public function of anvil_ref accepts NumPy arrays, torch tensors (any dtype, any device) or
Python scalars, computes in NumPy float64 on the CPU, and returns the kind it was given: a NumPy
float64 array for NumPy (or scalar/list) input, a CPU ``torch.float64`` tensor when the first array
argument was a torch tensor. torch is imported lazily, so the reference works without it.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


class ReferenceInputError(ValueError):
    """Bad input to an anvil_ref function: the message says what was wrong and what was expected."""


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_f64(x: Any, name: str, *, min_ndim: int = 0, finite: bool = True) -> np.ndarray:
    """``x`` as a fresh float64 NumPy array; raise ReferenceInputError if it is not numeric, has fewer
    than ``min_ndim`` dimensions, or (when ``finite``) holds NaN or infinity."""
    if _is_torch(x):
        t = x.detach().cpu()
        if t.dtype.is_complex:
            raise ReferenceInputError(f"{name}: complex tensors are not supported (got {t.dtype})")
        arr = t.double().numpy().copy()
    else:
        try:
            arr = np.array(x, dtype=np.float64, copy=True)
        except (TypeError, ValueError) as exc:
            raise ReferenceInputError(f"{name}: expected a real array, tensor or number, got "
                                      f"{type(x).__name__} ({exc})") from None
    if arr.ndim < min_ndim:
        raise ReferenceInputError(f"{name}: expected at least {min_ndim} dimensions, got shape "
                                  f"{tuple(arr.shape)}")
    if finite and not np.all(np.isfinite(arr)):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise ReferenceInputError(f"{name}: {bad} non-finite value(s) (NaN or inf); the reference "
                                  "only accepts finite input")
    return arr


def to_scalar(x: Any, name: str, *, lo: float | None = None, hi: float | None = None) -> float:
    """``x`` as a finite Python float, optionally checked to lie in [lo, hi]."""
    if _is_torch(x):
        if x.numel() != 1:
            raise ReferenceInputError(f"{name}: expected a scalar, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, np.ndarray):
        if x.size != 1:
            raise ReferenceInputError(f"{name}: expected a scalar, got an array of shape {x.shape}")
        x = x.reshape(()).item()
    if not isinstance(x, numbers.Real):
        raise ReferenceInputError(f"{name}: expected a real number, got {type(x).__name__}")
    v = float(x)
    if not np.isfinite(v):
        raise ReferenceInputError(f"{name}: expected a finite number, got {v}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise ReferenceInputError(f"{name}: expected a value in [{lo}, {hi}], got {v}")
    return v


def same_shape(name_a: str, a: np.ndarray, name_b: str, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ReferenceInputError(f"{name_b}: shape {tuple(b.shape)} does not match {name_a}'s "
                                  f"{tuple(a.shape)}")


def like(result: np.ndarray, template: Any) -> Any:
    """Return ``result`` (float64) as the kind of ``template``: a CPU torch.float64 tensor when the
    template is a torch tensor, else the NumPy array itself."""
    if _is_torch(template):
        import torch

        return torch.from_numpy(np.ascontiguousarray(result))
    return result
