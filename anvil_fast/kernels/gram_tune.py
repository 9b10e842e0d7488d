"""Per-shape choice of the Gram kernels' launch configuration, made at the first call on a GPU.

Why a tuner and not a size heuristic: the first H200 sweep (NOTES.md) showed the best tile shape,
warp count and pipeline depth change with the problem (a 64-tile K=128 config was 5x faster than the
128-tile default on 8x256x768 and 20% slower on 64x768x768), and whether TMA loads or a persistent
grid pay cannot be predicted from the FLOP count of a kernel whose K loop is only 6-12 steps long.
So each new problem key (kernel, sizes, batch, device) gets a short list of candidates, and

1. every candidate runs once and its output is compared with the v1 kernels' (the reference that was
   validated on the H200 first): a candidate that raises (a compile error of this Triton version, a
   shared-memory overflow) or disagrees beyond bf16 rounding is dropped and recorded, never used;
2. the survivors are timed as CUDA-graph replays of back-to-back launches (GPU time only: the
   host's launch cost is not what a captured bank update pays), the fastest is kept for the process.

Tuning never runs while a CUDA graph is being captured (the untuned default runs instead; the
capture helpers warm up first, so real captures see tuned shapes), costs nothing on later calls,
and is skipped with ``ANVIL_FAST_TUNE=0``.

A fresh process compiles every candidate of every new key, which is most of a cold warm-up; the package
therefore ships decisions (:data:`TUNED_FILE`, written by ``tools/gram_tuned_table.py`` on the device it
names): where the device's name, the Triton version and the kernels' source (:func:`kernels_digest`) are
those a decision was made with, the choice is taken from there and only it compiles. A device with no
decision of its own for a key takes one made on a device of the same architecture (:func:`device_arch`:
compute capability, SM count, shared memory per SM; the H100 SXM and the H200 are one chip, GH100, with
132 SMs): Triton compiles the same code for both, the persistent grids have the same size and the tiles
fit, so the choice gives the same bits; only its speed was measured elsewhere. Every shipped choice is a Triton
candidate that was bit-identical to v1 where it was made (never cuBLAS); where every candidate is (all
Triton ones on the H200, NOTES.md), a shipped choice and a fresh tuning give the same bits.
``ANVIL_FAST_TUNE=fresh`` tunes every key anew. :data:`RECORDS` keeps every decision (the benchmark
prints it). Every candidate computes fp32 sums of the same bf16 products in the same K order and rounds
once; :data:`RECORDS` also says whether each one was bit-identical to the reference.

Candidates for the symmetric kernels are square tiles only (the mirrored store needs them); cuBLAS
is a candidate for ``aX_plus_mm`` alone, because a library Gram or ``A@A`` is not guaranteed to be
exactly symmetric.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .backend import num_sms
from .capture import collector_paused, generator_kept
from .precompile import recording
from .timing import median_ms, timer


class TileConfig(NamedTuple):
    """Launch parameters of one kernel call. The symmetric kernels use square BLOCK_M x BLOCK_M
    tiles (BLOCK_N is ignored there).

    ``kernel``: ``"ptr"`` (pointer loads), ``"tma"`` (TMA descriptors; used only where the problem
    tiles exactly and the views are 16-byte aligned, else the pointer path runs), ``"v1"`` (the first
    kernels) or ``"cublas"`` (``aX_plus_mm`` only: ``torch.baddbmm``, the same one-rounding math).
    ``per_sm``: 0 launches one program per tile; k > 0 launches a persistent grid of k programs per
    SM that walk the tiles.
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    kernel: str = "ptr"
    per_sm: int = 0

    def describe(self) -> str:
        if self.kernel == "cublas":
            return "cublas"
        p = f" p{self.per_sm}" if self.per_sm else ""
        return (f"{self.kernel} {self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} w{self.num_warps} "
                f"s{self.num_stages}{p}")


class ProblemKey(NamedTuple):
    """What a tuned choice is remembered by: the operation (``"XXT"``, ``"XTX"``, ``"ba_plus_cAA"``,
    ``"mm_add"``, ``"sym_mm_add"``), the product's sizes ``[m, k] @ [k, n]`` per matrix (a Gram of an
    ``n x k`` operand has ``m = n``; ``A @ A`` has ``m = n = k``), the batch, and the CUDA device index."""

    op: str
    m: int
    n: int
    k: int
    batch: int
    device: int | None

    def flops(self) -> int:
        """FLOPs of the full products (the symmetric kernels execute about half of a Gram's)."""
        return 2 * self.m * self.n * self.k * self.batch

    def describe(self) -> str:
        return f"{self.op} m={self.m} n={self.n} k={self.k} batch={self.batch}"


T = TileConfig

SYM_CANDIDATES: tuple[TileConfig, ...] = (
    T(128, 128, 64, 8, 4, kernel="ptr"),
    T(128, 128, 64, 4, 3, kernel="ptr"),
    T(64, 64, 128, 4, 3, kernel="ptr"),
    T(128, 128, 64, 8, 4, kernel="tma"),
    T(128, 128, 64, 8, 3, kernel="tma"),
    T(128, 128, 64, 4, 3, kernel="tma"),
    T(128, 128, 64, 4, 2, kernel="tma"),
    T(128, 128, 128, 8, 2, kernel="tma"),
    T(64, 64, 128, 4, 3, kernel="tma"),
    T(64, 64, 64, 4, 4, kernel="tma"),
    T(128, 128, 64, 8, 4, kernel="tma", per_sm=1),
    T(128, 128, 64, 4, 3, kernel="tma", per_sm=2),
    T(128, 128, 64, 4, 2, kernel="tma", per_sm=2),
)

MM_CANDIDATES: tuple[TileConfig, ...] = (  # (no pointer 128 x 256: it spills; v1 times that shape)
    T(128, 128, 64, 8, 4, kernel="ptr"),
    T(64, 128, 64, 4, 4, kernel="ptr"),
    T(128, 256, 64, 8, 3, kernel="tma"),
    T(256, 128, 64, 8, 3, kernel="tma"),
    T(128, 128, 64, 8, 4, kernel="tma"),
    T(128, 128, 64, 4, 3, kernel="tma"),
    T(64, 128, 64, 4, 4, kernel="tma"),
    T(128, 256, 64, 8, 3, kernel="tma", per_sm=1),
    T(128, 128, 64, 4, 3, kernel="tma", per_sm=2),
    T(0, 0, 0, 0, 0, kernel="cublas"),
)

#: Every tuning decision of this process: dicts with key, results [(config, us | None, note)], chosen.
RECORDS: list[dict] = []
_CHOICES: dict[ProblemKey, TileConfig] = {}


#: Problems below this many FLOPs (of the full product) keep the untuned default: a few microseconds
#: of work, where launch cost dominates and tuning would only add its own time (and tests' time).
MIN_TUNE_FLOPS = 2 ** 28


def tuning_enabled() -> bool:
    return os.environ.get("ANVIL_FAST_TUNE", "1") != "0"


def table_enabled() -> bool:
    """Whether shipped decisions are used (:data:`TUNED_FILE`): not with ``ANVIL_FAST_TUNE=fresh``."""
    return os.environ.get("ANVIL_FAST_TUNE", "1") != "fresh"


#: The shipped tuning decisions (module docstring).
TUNED_FILE = Path(__file__).with_name("gram_tuned.json")
#: The sources a shipped decision was made with: the Triton kernels and their launches.
KERNELS_SOURCES = (Path(__file__).with_name("gram_kernels.py"), Path(__file__).with_name("gram.py"))


@functools.lru_cache(maxsize=None)
def kernels_digest() -> str:
    """The first 16 hex digits of the SHA-256 of the kernels' and their launches' source: a shipped
    decision holds for the code it was timed and checked with, and for no edit of it."""
    h = hashlib.sha256()
    for p in KERNELS_SOURCES:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # pragma: no cover - triton is a dependency
        return "none"
    return triton.__version__


def _problem(key: ProblemKey) -> tuple:
    return (_triton_version(), kernels_digest(), key.op, key.m, key.n, key.k, key.batch)


@functools.lru_cache(maxsize=None)
def _table(path: str) -> tuple[dict, dict]:
    """The file's decisions by (device name, problem) and by (architecture, problem); an architecture
    made on several devices keeps the decision of the first device name in sorted order."""
    p = Path(path)
    if not p.is_file():
        return {}, {}
    by_name, by_arch = {}, {}
    try:
        entries = json.loads(p.read_text())["entries"]
        for e in sorted(entries, key=lambda e: str(e["device"])):
            cfg = TileConfig(*e["config"])
            if cfg.kernel not in ("ptr", "tma", "v1"):
                raise ValueError(f"kernel {cfg.kernel!r} (expected ptr, tma or v1)")
            problem = (e["triton"], e["kernels"], e["op"], e["m"], e["n"], e["k"], e["batch"])
            by_name[(e["device"], *problem)] = cfg
            if e.get("arch"):
                by_arch.setdefault((e["arch"], *problem), (cfg, e["device"]))
    except (ValueError, KeyError, TypeError) as exc:  # json's errors are ValueErrors
        # the decisions only save time: without them every key is tuned, as with ANVIL_FAST_TUNE=fresh
        warnings.warn(f"{p}: not a table of tuning decisions ({type(exc).__name__}: {exc}); every Gram problem "
                      "is tuned in this process instead", RuntimeWarning, stacklevel=2)
        return {}, {}
    return by_name, by_arch


def device_arch(props) -> str:
    """What a tuning decision needs of a device to give the same bits there (``props``: what
    ``torch.cuda.get_device_properties`` returns): the compute capability Triton compiles for, the SM
    count the persistent grids are sized by, and the shared memory per SM the tiles must fit in."""
    smem = getattr(props, "shared_memory_per_multiprocessor", 0)
    return f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, {smem} B shared per SM"


def _device_name(out: Tensor) -> str | None:
    return torch.cuda.get_device_name(out.device) if out.is_cuda else None


def _device_arch(out: Tensor) -> str | None:
    return device_arch(torch.cuda.get_device_properties(out.device)) if out.is_cuda else None


def table_decision(key: ProblemKey, device_name: str | None, path: Path | None = None, *,
                   arch: str | None = None) -> tuple[TileConfig, str] | None:
    """The shipped choice for ``key`` with this Triton and these kernels and the device it was made
    on: the one made on the device named ``device_name``, else (given ``arch``) one made on a device
    of that architecture (module docstring), else None."""
    if device_name is None:
        return None
    by_name, by_arch = _table(str(path or TUNED_FILE))
    problem = _problem(key)
    cfg = by_name.get((device_name, *problem))
    if cfg is not None:
        return cfg, device_name
    return by_arch.get((arch, *problem)) if arch else None


def table_entries(records: list[dict], device_name: str, arch: str | None = None) -> list[dict]:
    """The tuned decisions of ``records`` whose choice was bit-identical to v1 there (not shipped ones,
    not cuBLAS) as :data:`TUNED_FILE` entries, each with its time and v1's on the device that made it
    (and that device's :func:`device_arch`, where given)."""
    out = []
    for r in records:
        cfg, key = r["chosen"], r["key"]
        us, note = next(((t, n) for c, t, n in r["results"] if c == cfg), (None, ""))
        if r.get("source", "tuned") != "tuned" or cfg.kernel == "cublas" or note != "bitwise":
            continue
        v1 = next((t for c, t, _ in r["results"] if c.kernel == "v1"), None)
        entry = {"device": device_name, "triton": _triton_version(), "kernels": kernels_digest(), "op": key.op,
                 "m": key.m, "n": key.n, "k": key.k, "batch": key.batch, "config": list(cfg), "us": us,
                 "v1_us": v1}
        out.append(dict(entry, arch=arch) if arch else entry)
    return out


def cublas_allowed() -> bool:
    """``ANVIL_FAST_TUNE_CUBLAS=1`` adds cuBLAS to the candidates (off by default). Every Triton
    candidate was bit-identical to v1 on the H200 (NOTES.md), so the tuner's choice among them never
    changes a result; cuBLAS sums in another order (a bf16 ulp in ~0.1% of entries), so with it the
    bits of a shape where it wins depend on the timing -- and on the bank's size, so a sharded bank
    would no longer reproduce the one-process result bit for bit. It won one key in five banks, by
    8% of one kernel (anvil_fast/NOTES.md), which is not worth that."""
    return os.environ.get("ANVIL_FAST_TUNE_CUBLAS", "0") == "1"


def _even(kind: str, cfg: TileConfig, key: ProblemKey) -> bool:
    if kind == "mm_add":
        return key.m % cfg.BLOCK_M == 0 and key.n % cfg.BLOCK_N == 0 and key.k % cfg.BLOCK_K == 0
    return key.n % cfg.BLOCK_M == 0 and key.k % cfg.BLOCK_K == 0  # square tiles of the symmetric output


def _tiles(kind: str, cfg: TileConfig, key: ProblemKey) -> int:
    if kind == "mm_add":
        return -(-key.m // cfg.BLOCK_M) * -(-key.n // cfg.BLOCK_N) * key.batch
    t = -(-key.n // cfg.BLOCK_M)
    return t * (t + 1) // 2 * key.batch  # lower tiles only


def candidates(kind: str, key: ProblemKey, sms: int) -> list[TileConfig]:
    """The candidates that differ for this problem: TMA only where it applies (else it would run the
    pointer path again), persistent grids only where there are more tiles than programs, no tile
    more than twice the problem's side, no configuration that spills registers (sm_90a resource
    report of each candidate, compiled with ``tools/gram_sm90_report.py``)."""
    out = []
    side = min(key.m, key.n)
    for c in (MM_CANDIDATES if kind == "mm_add" else SYM_CANDIDATES):
        if c.kernel == "cublas":
            if cublas_allowed():
                out.append(c)
            continue
        if min(c.BLOCK_M, c.BLOCK_N if kind == "mm_add" else c.BLOCK_M) > max(64, 2 * side):
            continue
        if c.kernel == "tma" and not _even(kind, c, key):
            continue
        if c.per_sm and _tiles(kind, c, key) <= c.per_sm * sms:
            continue
        if kind in ("ba_plus_cAA", "sym_mm_add") and c.BLOCK_M >= 128 and c.num_warps < 8:
            # 128 x 128 fp32 accumulator + the epilogue's A (or X) tile on 4 warps spills registers
            continue
        out.append(c)
    return out


def time_us(fn: Callable[[], None], *, target_ms: float = 2.0) -> float:
    """GPU time of one ``fn()``: replays of a CUDA graph of back-to-back calls (event timing of
    eager calls if capture fails), median of 5 (:func:`anvil_fast.kernels.timing.median_ms`). The benchmarks time kernels with it too
    (:mod:`anvil_fast.bench.common`), so their tables show what the tuner compared."""
    torch.cuda.synchronize()
    timed = timer("cuda")
    reps = int(min(200, max(3, target_ms / max(timed(fn), 1e-3))))
    run: Callable[[], None]
    try:
        g = torch.cuda.CUDAGraph()
        # no collection mid-capture, and a failed capture leaves the user's generator usable
        with collector_paused(), generator_kept(), torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    except Exception:  # pragma: no cover - depends on the device
        def run():
            for _ in range(reps):
                fn()
    # no barrier: a rank tunes alone, whatever the others do
    return 1000.0 * median_ms(run, n=5, warmup=1, device="cuda", barrier=False) / reps


def _agrees(y: Tensor, ref: Tensor) -> tuple[bool, str]:
    if torch.equal(y, ref):
        return True, "bitwise"
    yf, rf = y.float(), ref.float()
    if not torch.equal(torch.isnan(yf), torch.isnan(rf)):
        return False, "NaN pattern differs"
    yf, rf = torch.nan_to_num(yf), torch.nan_to_num(rf)
    # Different fp32 summation orders then one rounding: a bf16 ulp here and there (2**-8 relative);
    # a broken kernel is off by O(1) of the largest entry.
    err = (yf - rf).abs().max().item()
    scale = rf.abs().max().item()
    ndiff = int((yf != rf).sum().item())
    ok = err <= 2.0 ** -6 * max(scale, 1e-30)
    return ok, f"{ndiff} entries differ, max |diff| {err:.3g} (max |ref| {scale:.3g})"


def tune(kind: str, key: ProblemKey, launch: Callable[[TileConfig], None], out: Tensor, reference: TileConfig, *,
         cands: list[TileConfig] | None = None, timer: Callable[[Callable[[], None]], float] = time_us,
         sync: Callable[[], None] | None = None) -> tuple[TileConfig, dict]:
    """Run, check and time every candidate (and the reference) on this call's tensors; return the
    fastest agreeing one and the record. ``launch(cfg)`` computes the call into ``out``; ``cands``
    defaults to :func:`candidates`; ``timer`` and ``sync`` are replaceable for tests."""
    sync = sync or torch.cuda.synchronize
    launch(reference)
    sync()
    ref = out.clone()
    results = []
    if cands is None:
        cands = candidates(kind, key, num_sms(out.device.index))
    for cfg in [reference, *cands]:
        try:
            launch(cfg)
            sync()
            ok, note = _agrees(out, ref)
            us = timer(lambda c=cfg: launch(c)) if ok else None
            if not ok:
                note = "REJECTED (disagrees with v1): " + note
        except Exception as e:  # a candidate this Triton/GPU cannot build or run is skipped, visibly
            us, note = None, f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        results.append((cfg, us, note))
    timed = [(us, cfg) for cfg, us, _ in results if us is not None]
    best = min(timed, key=lambda t: t[0])[1] if timed else reference
    return best, {"kind": kind, "key": key, "results": results, "chosen": best}


def choose(kind: str, key: ProblemKey, launch: Callable[[TileConfig], None], out: Tensor,
           default: TileConfig) -> TileConfig:
    """The configuration for ``key``: the tuned one, tuning now if the key is new (not while a CUDA
    graph is being captured, not below MIN_TUNE_FLOPS, and not with ``ANVIL_FAST_TUNE=0``: then
    ``default``)."""
    got = _CHOICES.get(key)
    if got is not None:
        return got
    if (not tuning_enabled() or key.flops() < MIN_TUNE_FLOPS
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
        return default  # (a capture: a shipped choice would compile its kernel inside it)
    if table_enabled():
        name = _device_name(out)
        got = table_decision(key, name, arch=_device_arch(out))
        if got is not None:
            shipped, made_on = got
            _CHOICES[key] = shipped
            RECORDS.append({"kind": kind, "key": key, "results": [], "chosen": shipped, "source": "shipped",
                            "made_on": None if made_on == name else made_on})
            return shipped
    if recording():
        # a precompile pass computes on what its skipped launches left: tuning waits for the real run
        return default
    best, record = tune(kind, key, launch, out, default)
    record["source"] = "tuned"
    _CHOICES[key] = best
    RECORDS.append(record)
    return best


def reset() -> None:
    """Forget every tuned choice (the next call of each shape tunes again)."""
    _CHOICES.clear()
    RECORDS.clear()


def report_lines() -> list[str]:
    """One block per tuned key: every candidate's time (us) or why it was dropped, the choice."""
    lines = []
    for r in RECORDS:
        base = next((us for c, us, _ in r["results"] if c.kernel == "v1" and us is not None), None)
        how = ""
        if r.get("source") == "shipped":
            how = (f" (shipped decision, made on {r['made_on']}: the same architecture)" if r.get("made_on")
                   else " (shipped decision)")
        lines.append(f"tune {r['key'].describe()}: chosen {r['chosen'].describe()}{how}")
        for cfg, us, note in r["results"]:
            t = f"{us:8.1f} us" if us is not None else "       -   "
            rel = f"  x{base / us:4.2f} vs v1" if (us and base) else ""
            lines.append(f"    {cfg.describe():<28} {t}{rel}  {note}")
    return lines
