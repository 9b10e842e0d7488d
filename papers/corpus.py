"""The training corpus of ``python -m papers.train``: the CPython standard library's own source.

It needs no download and every machine with Python has it, but its content depends on the
interpreter's version, so a run records exactly what it trained on (:func:`load`'s ``sha256``).

* Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, found by ``os.walk`` without
  following symbolic links, **excluding** any path with a ``site-packages`` or ``dist-packages``
  component (third-party packages installed inside the stdlib directory are not the standard
  library, and they differ between machines far more than the stdlib does). Paths are relative,
  '/'-separated, sorted as strings.
* Split, by file: a file is **validation** iff ``zlib.crc32(relative_path.encode()) % 10 == 0``
  (:data:`VAL_MODULUS`), else train. The rule depends on the path alone, so adding or removing a
  file never moves another file across the split, and no file contributes to both.
* Tokens: the raw bytes (vocabulary 256) of each split's files concatenated in sorted-path order.
  A window may span two files; the byte stream is what the model learns either way.
* ``sha256``: SHA-256 over ``path \\0 size \\n`` of every file in sorted order (train and validation
  alike): two runs with the same hash trained on the same file list.

Batches are drawn so every optimizer of a comparison sees the same ones: the start offsets of step
``s`` come from a ``torch.Generator`` seeded with :func:`step_seed` ``(data_seed, s)``; the
validation windows from one seeded with :data:`VAL_SEED`, the same for every run of every seed.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: A file is validation iff crc32(path) % VAL_MODULUS == 0 (about 1 file in 10).
VAL_MODULUS = 10
#: Path components that mark installed third-party code inside the stdlib directory.
EXCLUDED_DIRS = ("site-packages", "dist-packages")
#: The seed of the validation windows' generator: one fixed set for every run and every seed.
VAL_SEED = 20_240_601
#: Step seeds are data_seed * STEP_SEED_STRIDE + step. torch's CPU generator (mt19937) keeps only
#: the low 32 bits of a seed, so the pair must fit in 32 bits to stay unique: data seeds below
#: MAX_DATA_SEED, steps below the stride.
STEP_SEED_STRIDE = 1 << 20
MAX_DATA_SEED = 1 << 12


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path) -> list[str]:
    """The corpus's relative paths under ``root``, sorted (module docstring)."""
    out = []
    for d, dirs, files in os.walk(root, followlinks=False):
        rel_dir = Path(d).relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel_dir.parts):
            dirs[:] = []
            continue
        dirs[:] = [x for x in dirs if x not in EXCLUDED_DIRS]
        out += [(rel_dir / f).as_posix() for f in files if f.endswith(".py") and os.path.isfile(os.path.join(d, f))]
    return sorted(out)


def is_validation(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % VAL_MODULUS == 0


def split(paths: list[str]) -> tuple[list[str], list[str]]:
    """(train, validation) paths, each in the order given."""
    return [p for p in paths if not is_validation(p)], [p for p in paths if is_validation(p)]


def file_list_sha256(paths: list[str], sizes: list[int]) -> str:
    h = hashlib.sha256()
    for p, s in zip(paths, sizes, strict=True):
        h.update(f"{p}\0{s}\n".encode())
    return h.hexdigest()


@dataclass
class Corpus:
    root: str
    train: torch.Tensor   # uint8, the train split's bytes
    val: torch.Tensor     # uint8, the validation split's bytes
    n_files: int
    n_train_files: int
    n_val_files: int
    sha256: str

    def describe(self) -> dict:
        return {"root": self.root, "files": self.n_files, "train_files": self.n_train_files,
                "val_files": self.n_val_files, "train_bytes": int(self.train.numel()),
                "val_bytes": int(self.val.numel()), "sha256": self.sha256,
                "rule": f"crc32(path) % {VAL_MODULUS} == 0 -> validation; excluded: {', '.join(EXCLUDED_DIRS)}"}


def _concat(root: Path, paths: list[str]) -> torch.Tensor:
    data = b"".join((root / p).read_bytes() for p in paths)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def load(root: Path | str | None = None) -> Corpus:
    """The corpus under ``root`` (default: this interpreter's stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    paths = list_files(root)
    if not paths:
        raise FileNotFoundError(f"no *.py files under {root}: the corpus is empty")
    sizes = [(root / p).stat().st_size for p in paths]
    tr, va = split(paths)
    if not tr or not va:
        raise ValueError(f"{root}: the split left train={len(tr)} and validation={len(va)} files; both must be non-empty")
    return Corpus(str(root), _concat(root, tr), _concat(root, va), len(paths), len(tr), len(va),
                  file_list_sha256(paths, sizes))


def unigram_entropy(tokens: torch.Tensor, vocab: int = 256) -> float:
    """Entropy in nats of the byte distribution of ``tokens``: the validation loss of the best
    model that ignores context, a bound any model that learned something must beat."""
    counts = torch.bincount(tokens.long().flatten(), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def step_seed(data_seed: int, step: int) -> int:
    if not 0 <= step < STEP_SEED_STRIDE:
        raise ValueError(f"step {step} is outside [0, {STEP_SEED_STRIDE})")
    if not 0 <= data_seed < MAX_DATA_SEED:
        raise ValueError(f"data seed {data_seed} is outside [0, {MAX_DATA_SEED})")
    return data_seed * STEP_SEED_STRIDE + step


def windows(data: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``length`` consecutive tokens of ``data`` at uniformly drawn offsets, as
    uint8 ``[n, length]``, from a generator seeded with ``seed``."""
    if data.numel() < length:
        raise ValueError(f"the split holds {data.numel()} tokens, fewer than one window of {length}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - length + 1, (n,), generator=g)
    return data[starts[:, None] + torch.arange(length)]


def train_batches(data: torch.Tensor, *, steps: int, batch: int, ctx: int, data_seed: int) -> torch.Tensor:
    """Every step's batch, uint8 ``[steps, batch, ctx + 1]`` (inputs = [..., :-1], targets = [..., 1:])."""
    return torch.stack([windows(data, batch, ctx + 1, step_seed(data_seed, s)) for s in range(steps)])


def val_windows(data: torch.Tensor, *, n: int, ctx: int) -> torch.Tensor:
    """The fixed validation set, uint8 ``[n, ctx + 1]``."""
    return windows(data, n, ctx + 1, VAL_SEED)


def batches_sha256(batches: torch.Tensor) -> str:
    """SHA-256 of every token of every batch, in step order."""
    return hashlib.sha256(batches.contiguous().numpy().tobytes()).hexdigest()
