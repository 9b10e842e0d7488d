"""The fast ANVIL cascade: Frobenius normalization and the six quintic maps on bf16 banks
(seed: ``anvil_cascade`` after the rails; reference: :mod:`anvil_ref.cascade`).

Per matrix, with ``G`` = :func:`~anvil_fast.kernels.gram.XTX` for tall X (rows > cols) and
:func:`~anvil_fast.kernels.gram.XXT` otherwise::

    A = G(X)                                   on the unnormalized X (the seed's free norm)
    d = margin * sqrt(tr) + eps                tr: see the configurations below
    X <- bf16(X / d),  A <- bf16(A / d**2)     the first Gram is rescaled, not recomputed
    for (a, b, c) in maps:
        A <- G(X)                              (not for the first map)
        B <- ba_plus_cAA(A, alpha=c, beta=b)   B = b A + c A^2
        X <- a X + X B  (tall)  |  a X + B X  (wide/square)

Three configurations (:class:`CascadeConfig`):

``FAITHFUL`` -- the seed's operations and roundings: the trace is read off the bf16-rounded first
Gram; ``a X + X B`` is one ``baddbmm``, or ``bmm`` then ``add_`` (two roundings) for banks with more
than SPLIT_BADDBMM_MIN_ROWS rows. It reproduces the seed's failure on near-rank-1 input (below).

``SAFE`` (the default) -- the same math with four changes, each measured in NOTES.md:

1. the trace is the fp32 sum of squares of the bf16 X (not the bf16-rounded Gram diagonal);
2. the normalization prescales X by an exact power of two per matrix (eps with it) and takes the
   first Gram of the normalized X_1 instead of rescaling the unnormalized one (so no finite input
   can overflow it); the rails clamp the lookahead to bf16's finite range before the cast;
3. the margin is ``FROBENIUS_MARGIN * (1 + SAFE_MARGIN_SLACK)``;
4. ``a X + X B`` is one fused kernel (:func:`~anvil_fast.kernels.gram.aX_plus_mm`: one rounding, no extra
   pass over X), and the equalizer's guard is on (:mod:`anvil_fast.kernels.equalizer`).

``GRAM_SIDE`` -- SAFE, with the maps run on the short side (``A_{k+1} = Q_k A_k Q_k``, restarted where the
Gram-side study chose for the map set: GRAM_SIDE_RESTARTS for ANVIL_MAPS) for banks whose aspect ratio
makes it pay: :mod:`anvil_fast.core.gram_side`; :func:`gram_side_schedule` decides per bank.

In SAFE the twin rails, the normalization and the equalizer run as Triton kernels on CUDA
(``triton_elementwise``; :mod:`anvil_fast.kernels.rails`, :mod:`anvil_fast.kernels.normalize`,
:mod:`anvil_fast.kernels.equalizer`): the same operations, with fp32 sums in another (fixed) order -- for
speed (fewer passes over memory) and so that a matrix's update does not depend on how many
matrices share its bank (the compiled equalizer's did).

Why SAFE exists. A rank-1 matrix has ``sigma_max = ||X||_F``, so after the normalization
``sigma_max / d = 1 / margin`` -- exactly the end of the interval the maps are designed for. There
every partial composite ``p_k o ... o p_1`` attains its maximum, and those maxima lie on the rising
arms of the next maps (past their local minima), so the composite is steep: in exact arithmetic
``F(s (1 + 1e-5)) = 1.004``, ``F(s (1 + 3e-5)) = 1.04``, ``F(s (1 + 6e-5)) = 1.44`` and
``F(s (1 + 1e-4)) = 6.4`` at ``s = 1/1.05``, and past that each map's ``c x**5`` compounds up to 1e15
and inf. The seed's trace is a sum of bf16-rounded diagonal entries, whose relative error is about
``2**-8 / sqrt(3 n)`` (1.4e-4 for n = 768): roughly a third of the time it rounds down by more than
the ~5e-5 the composite tolerates, and the output explodes. With the fp32 trace the remaining
perturbation (roundings of A_1, X_1 and of every later iterate) is ~1e-5 and smaller, and
SAFE_MARGIN_SLACK = 2**-7 moves the rank-1 point to ``s (1 - 2**-7)``. That this slack suffices is
measured (the near-rank-1 study, :mod:`anvil_fast.studies.near_rank1`), not certified. A scalar model in
which every iterate is perturbed by a relative 4e-3 (~ one bf16 ulp) of its own singular value keeps
ANVIL_MAPS' output below 1.0052 at this slack (:mod:`derive_maps.robust`, outward-rounded interval
arithmetic), but that is a statement about the model: a bf16 rounding of a matrix moves every
singular value by up to ``2**-8 ||X||_F``, not ``2**-8 sigma``, and B = bA + cA^2 carries the
rounding of one singular direction into the others. The certificates of :mod:`derive_maps.robust`
name the inputs they hold for: with every rounding at its worst case, for diagonal inputs (each
rounding relative to the value it carries) ANVIL_MAPS needs a slack of 2**-6
(``python -m derive_maps robust anvil --inputs diagonal --slack 1/64``), and for general matrices,
whose roundings couple the singular directions, no slack it was checked at is enough (the ANVIL row
of ``papers/data/frontier.json``). The Gram-side configuration is another computation, outside
those models.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from anvil_ref.cascade import is_tall
from anvil_ref.constants import ANVIL_MAPS, FROBENIUS_EPS, FROBENIUS_MARGIN, SAFE_MARGIN_SLACK, SPLIT_BADDBMM_MIN_ROWS
from anvil_ref.gram_side import check_restarts
from anvil_ref.maps import MapsLike, load_maps

from anvil_fast.kernels.compiled import maybe_compiled, want_compile
from anvil_fast.kernels.backend import use_triton
from anvil_fast.kernels.equalizer import EqualizerWork
from anvil_fast.kernels.gram import XTX, XXT, aX_plus_mm, ba_plus_cAA, sym_aX_plus_mm
from .gram_side import GRAM_SIDE_RESTARTS, STUDIED, GramSideWork, restart_product, studied_restarts, uses_gram_side
from anvil_fast.kernels.plus_identity import plus_identity_
from anvil_fast.kernels.normalize import NormPartials, block_partials, normalize_from_partials
from anvil_fast.kernels.rails import BF16_MAX, PRESCALE_EXP_LIMIT
from anvil_fast.kernels.streams import run_forked, side_streams


@dataclass(frozen=True)
class CascadeConfig:
    """How the fast path runs the cascade (and whether the equalizer guards its output)."""

    name: str
    fp32_trace: bool  #: trace from the fp32 sum of squares of X (else the bf16 Gram's diagonal)
    prescale: bool  #: exact power-of-two prescale in the normalization (eps scaled alike); needs fp32_trace
    margin_slack: float  #: margin = FROBENIUS_MARGIN * (1 + margin_slack)
    fused_axb: bool  #: a*X + X@B as one kernel, one rounding (else the seed's baddbmm / bmm + add_)
    guard: bool  #: the equalizer zeroes (and counts) matrices whose update is non-finite or exploded
    #: the twin rails, the normalization and the equalizer as Triton kernels (:mod:`anvil_fast.kernels.rails`,
    #: :mod:`anvil_fast.kernels.normalize`, :mod:`anvil_fast.kernels.equalizer`) where they can run (else the seed's
    #: compiled torch code)
    triton_elementwise: bool = False
    #: the Gram-side cascade's restart schedule (map numbers, 1-based; :mod:`anvil_fast.core.gram_side`), run
    #: on banks whose shape passes :func:`anvil_fast.core.gram_side.uses_gram_side`: a tuple (for every map
    #: set), :data:`~anvil_fast.core.gram_side.STUDIED` (the study's schedule for the maps in use; the
    #: standard cascade for maps it has none for), or None: never (:func:`gram_side_schedule` decides)
    gram_side: tuple[int, ...] | str | None = None

    def __post_init__(self):
        if self.prescale and not self.fp32_trace:
            raise ValueError(f"config {self.name!r}: prescale takes the first Gram after the normalization, "
                             "so the trace must come from X (set fp32_trace=True)")
        if self.triton_elementwise and not self.prescale:
            raise ValueError(f"config {self.name!r}: the fused normalization kernels implement the prescaled "
                             "one (set prescale=True, or triton_elementwise=False)")
        if self.gram_side is not None:
            if not (self.prescale and self.fused_axb):
                raise ValueError(f"config {self.name!r}: the Gram side keeps SAFE's prescaled normalization and "
                                 "one-rounding products (set prescale=True and fused_axb=True)")
            if not isinstance(self.gram_side, tuple) and self.gram_side != STUDIED:
                raise ValueError(f"config {self.name!r}: gram_side must be a tuple of map numbers or "
                                 f"{STUDIED!r}, got {self.gram_side!r}")

    def margin(self, base: float = FROBENIUS_MARGIN) -> float:
        return base * (1.0 + self.margin_slack)


FAITHFUL = CascadeConfig("faithful", fp32_trace=False, prescale=False, margin_slack=0.0, fused_axb=False, guard=False)
SAFE = CascadeConfig("safe", fp32_trace=True, prescale=True, margin_slack=SAFE_MARGIN_SLACK, fused_axb=True, guard=True,
                    triton_elementwise=True)
#: SAFE with the maps run on the short side of tall and wide banks (:mod:`anvil_fast.core.gram_side`).
GRAM_SIDE = CascadeConfig("gram_side", fp32_trace=True, prescale=True, margin_slack=SAFE_MARGIN_SLACK, fused_axb=True,
                          guard=True, triton_elementwise=True, gram_side=STUDIED)
DEFAULT_CONFIG = SAFE
CONFIGS = {c.name: c for c in (FAITHFUL, SAFE, GRAM_SIDE)}


def default_config_for(chunk_shape: tuple[int, int, int], device) -> CascadeConfig:
    """A bank's configuration when none is asked for: GRAM_SIDE where its dispatch rule sends the
    bank on CUDA (:func:`anvil_fast.core.gram_side.uses_gram_side`: aspect >= 2 and short side >= 384,
    where the H200's bank benchmark measured the Gram side's update faster, and its difftest,
    near-rank-1 study and training runs held it to SAFE's quality), else SAFE (DEFAULT_CONFIG).
    Elsewhere (the CPU) always SAFE: the Gram side's speed there is unmeasured."""
    if torch.device(device).type == "cuda" and uses_gram_side(chunk_shape, device=device):
        return GRAM_SIDE
    return DEFAULT_CONFIG


def restarts_of(config: CascadeConfig | str, maps: MapsLike = ANVIL_MAPS) -> tuple[int, ...] | None:
    """The restart schedule ``config`` gives the Gram side under ``maps`` (whatever the bank's shape),
    or None: the configuration has none, or it is STUDIED and the study has none for these maps."""
    cfg = get_config(config)
    if cfg.gram_side is None:
        return None
    maps_ = load_maps(maps)
    if cfg.gram_side == STUDIED:
        return studied_restarts(maps_)
    return check_restarts(cfg.gram_side, len(maps_))


def gram_side_schedule(config: CascadeConfig | str, shape, *, maps: MapsLike = ANVIL_MAPS,
                       device=None) -> tuple[int, ...] | None:
    """The one decision of whether a bank of ``shape`` on ``device`` runs the Gram side: its restart
    schedule where it does (:func:`restarts_of` has one and the shape passes
    :func:`anvil_fast.core.gram_side.uses_gram_side`), else None (the standard cascade). The cascade,
    the difftest, the tolerances' rounding count and the benchmarks' FLOP floors all ask here."""
    if get_config(config).gram_side is None or not uses_gram_side(shape, device=device):
        return None
    return restarts_of(config, maps)


def get_config(config: CascadeConfig | str) -> CascadeConfig:
    if isinstance(config, CascadeConfig):
        return config
    try:
        return CONFIGS[config]
    except KeyError:
        raise ValueError(f"config: expected one of {sorted(CONFIGS)} or a CascadeConfig, got {config!r}") from None


@dataclass
class CascadeWorkspace:
    """Persistent buffers of one bank's cascade (allocated once, written in place: fixed addresses
    for CUDA graphs). X and C are the ping-pong iterates, A the Gram, B the polynomial, scale the
    prescale factor per matrix, partials the fused normalization's block partials and denominators,
    equalizer the Triton equalizer's buffers (used by the bank update)."""

    X: Tensor
    C: Tensor
    A: Tensor
    B: Tensor
    scale: Tensor = field(repr=False)
    partials: NormPartials | None = field(default=None, repr=False)
    equalizer: EqualizerWork | None = field(default=None, repr=False)
    #: the Gram side's square buffers (:class:`anvil_fast.core.gram_side.GramSideWork`), allocated at its first run
    gram_side: object | None = field(default=None, repr=False)
    #: :meth:`parts` made so far, by count
    _parts: dict = field(default_factory=dict, repr=False, compare=False)

    def parts(self, n: int) -> list["CascadeWorkspace"]:
        """This workspace as ``n`` workspaces of consecutive matrices (``n`` capped by the chunk; the first
        ``chunk % n`` parts hold one matrix more): views of these buffers, so a cascade run part by part
        reads and writes where the whole one does and needs no memory of its own. Made once per ``n``
        (and again after the Gram side's buffers are allocated, so the parts view them too)."""
        chunk = self.X.shape[0]
        n = max(1, min(int(n), chunk))
        made = self._parts.get(n)
        if made is not None and (self.gram_side is None) == (made[0].gram_side is None):
            return made
        sizes = [chunk // n + (1 if i < chunk % n else 0) for i in range(n)]
        out, lo = [], 0
        for size in sizes:
            cut = slice(lo, lo + size)
            out.append(CascadeWorkspace(
                X=self.X[cut], C=self.C[cut], A=self.A[cut], B=self.B[cut], scale=self.scale[cut],
                partials=None if self.partials is None else
                NormPartials(amax=self.partials.amax[cut], sumsq=self.partials.sumsq[cut], d=self.partials.d[cut]),
                equalizer=None,  # the bank update's, never the cascade's
                gram_side=None if self.gram_side is None else
                GramSideWork(P=self.gram_side.P[cut], R=self.gram_side.R[cut], R2=self.gram_side.R2[cut])))
            lo += size
        self._parts[n] = out
        return out

    @classmethod
    def for_shape(cls, shape: tuple[int, ...], device) -> "CascadeWorkspace":
        if len(shape) != 3:
            raise ValueError(f"a bank chunk must be [chunk, rows, cols], got {tuple(shape)}")
        k = shape[-1] if is_tall(shape) else shape[-2]
        bf = dict(dtype=torch.bfloat16, device=device)
        return cls(X=torch.empty(shape, **bf), C=torch.empty(shape, **bf), A=torch.empty((shape[0], k, k), **bf),
                   B=torch.empty((shape[0], k, k), **bf),
                   # written by every normalization before it is read (no fill kernel per captured step)
                   scale=torch.empty((shape[0], 1, 1), dtype=torch.float32, device=device),
                   partials=NormPartials.for_shape(tuple(shape), device),
                   equalizer=EqualizerWork.for_shape(tuple(shape), device))


def _normalize(X: Tensor, A: Tensor, scale: Tensor, fp32_trace: bool, prescale: bool, margin: float,
               eps: float) -> None:
    xf = X.float()
    if prescale:
        # An exact power of two per matrix (2**e <= max|X| < 2**(e+1)): scaling by it rounds nothing,
        # so X_1 below has the same bits as without it wherever nothing over- or underflows, and the
        # fp32 trace can never overflow. eps is scaled alike to keep d's meaning in X's units.
        e = torch.floor(torch.log2(xf.abs().amax(dim=(-2, -1), keepdim=True)))
        s = torch.exp2(-e.clamp(-PRESCALE_EXP_LIMIT, PRESCALE_EXP_LIMIT))
        scale.copy_(s)
        xf = xf * s
    else:
        s = 1.0
        scale.fill_(1.0)
    if fp32_trace:
        tr = xf.square().sum(dim=(-2, -1), keepdim=True)
    else:
        tr = A.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None]
    d = tr.sqrt() * margin + eps * s
    X.copy_(xf / d)
    if not prescale:
        A.copy_(A.float() / d.square())


def _safe_cast(x: Tensor, x_out: Tensor, prescale: bool) -> None:
    x_out.copy_(x.float().clamp(-BF16_MAX, BF16_MAX) if prescale else x)


def normalize_workspace(ws: CascadeWorkspace, cfg: CascadeConfig, *, margin: float, eps: float, backend: str,
                        compile: bool | None, partials_ready: bool) -> None:
    """The configuration's Frobenius normalization of ``ws.X`` in place (``ws.scale``: the prescale
    factor; FAITHFUL also rescales the first Gram already in ``ws.A``)."""
    X = ws.X
    if cfg.triton_elementwise and use_triton(X, backend):
        if ws.partials is None:
            ws.partials = NormPartials.for_shape(tuple(X.shape), X.device)
        if not partials_ready:
            block_partials(X, ws.partials, limit=PRESCALE_EXP_LIMIT)
        normalize_from_partials(X, ws.scale, ws.partials, margin=cfg.margin(margin), eps=float(eps),
                                limit=PRESCALE_EXP_LIMIT)
    else:
        norm = maybe_compiled(_normalize, want_compile(compile, X))
        norm(X, ws.A, ws.scale, cfg.fp32_trace, cfg.prescale, cfg.margin(margin), float(eps))


def check_streams(streams) -> int:
    """``streams`` as an int >= 1, or a ValueError saying what was wrong."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams: expected an int >= 1 (the number of parts of the bank run at once), "
                         f"got {streams!r}")
    return streams


def _run_parts(ws: CascadeWorkspace, streams: int, run) -> Tensor:
    """``run(part)`` for each of ``ws.parts(streams)``, each part on its own side stream on CUDA (in order on
    the current stream elsewhere), joined back; returns the whole workspace's buffer that holds the result.

    Why parts on streams: a bank's matrices are independent, and every kernel computes each matrix as it
    would in a bank of any size (the sharded update's chunk independence, bit for bit; the tuner's Triton
    candidates all sum alike, and cuBLAS, which does not, is a candidate only on request), so the parts
    give the whole's bits. Run at once, one part's kernels can fill the SMs that another's last wave of
    tiles and its launch gaps leave idle: a 24 x 768 x 768 bank's ``a X + B X`` is 432 tiles of 128 x 256,
    3.3 waves on 132 SMs, and its 18 products run one after another on one stream."""
    parts = ws.parts(streams)
    device = ws.X.device
    side = side_streams(device, len(parts)) if device.type == "cuda" else [None] * len(parts)
    outs = run_forked([(s, functools.partial(run, part)) for s, part in zip(side, parts)], device)
    whole = []
    for part, out in zip(parts, outs):
        whole.append(next((w for w, p in ((ws.X, part.X), (ws.C, part.C)) if out.data_ptr() == p.data_ptr()), None))
    if whole[0] is None or any(w is not whole[0] for w in whole):
        raise RuntimeError("the cascade's parts left their results in different buffers")  # one schedule: never
    return whole[0]


def cascade_workspace(ws: CascadeWorkspace, *, maps: MapsLike = ANVIL_MAPS, config: CascadeConfig | str = DEFAULT_CONFIG,
                      split: bool | None = None, margin: float = FROBENIUS_MARGIN, eps: float = FROBENIUS_EPS,
                      backend: str = "auto", compile: bool | None = None, partials_ready: bool = False,
                      streams: int = 1) -> Tensor:
    """Run the cascade on ``ws.X`` (bf16; the config's prescale is applied here and its factor left in
    ``ws.scale``); returns the buffer (``ws.X`` or ``ws.C``) holding the result. ``split``: the seed's two-kernel
    ``a X + X B`` (default: rows > SPLIT_BADDBMM_MIN_ROWS); ignored when the config fuses it.
    ``partials_ready``: ``ws.partials`` already holds the partials of this X (the fused rails wrote
    them), so the fused normalization skips its own pass over X. ``streams``: the bank run as that many
    parts of consecutive matrices, each on its own CUDA stream (:func:`_run_parts`; the same bits)."""
    cfg = get_config(config)
    maps_ = load_maps(maps)
    X, C, A, B = ws.X, ws.C, ws.A, ws.B
    sched = gram_side_schedule(cfg, X.shape, maps=maps_, device=X.device)
    if check_streams(streams) > 1 and X.shape[0] > 1:
        if sched is not None and ws.gram_side is None:
            ws.gram_side = GramSideWork.for_workspace(ws)
        return _run_parts(ws, streams, lambda part: cascade_workspace(
            part, maps=maps_, config=cfg, split=split, margin=margin, eps=eps, backend=backend, compile=compile,
            partials_ready=partials_ready))
    if sched is not None:
        return gram_side_workspace(ws, maps=maps_, config=cfg, margin=margin, eps=eps, backend=backend,
                                   compile=compile, partials_ready=partials_ready, restarts=sched)
    tall = is_tall(X.shape)
    gram = XTX if tall else XXT
    if split is None:
        split = X.shape[-2] > SPLIT_BADDBMM_MIN_ROWS
    if not cfg.prescale:
        gram(X, out=A, backend=backend)  # the seed's free norm: the trace of the unnormalized Gram
    normalize_workspace(ws, cfg, margin=margin, eps=eps, backend=backend, compile=compile,
                        partials_ready=partials_ready)
    for k, (a, b, c) in enumerate(maps_):
        if k > 0 or cfg.prescale:
            # With the prescale the first Gram is taken of the normalized X_1: the unnormalized X
            # may be huge (its Gram overflows past ~1e19) and the fp32 trace does not need it.
            gram(X, out=A, backend=backend)
        ba_plus_cAA(A, alpha=c, beta=b, out=B, backend=backend)
        if cfg.fused_axb:
            if tall:
                aX_plus_mm(X, X, B, a=a, out=C, backend=backend)
            else:
                aX_plus_mm(X, B, X, a=a, out=C, backend=backend)
        elif split:
            torch.bmm(X, B, out=C) if tall else torch.bmm(B, X, out=C)
            C.add_(X, alpha=a)
        else:
            torch.baddbmm(X, X, B, beta=a, out=C) if tall else torch.baddbmm(X, B, X, beta=a, out=C)
        X, C = C, X
    return X


def fast_cascade(x: Tensor, *, maps: MapsLike = ANVIL_MAPS, config: CascadeConfig | str = DEFAULT_CONFIG,
                 split: bool | None = None, margin: float = FROBENIUS_MARGIN, eps: float = FROBENIUS_EPS,
                 backend: str = "auto", compile: bool | None = None, streams: int = 1) -> Tensor:
    """The fast cascade of ``x`` ([..., rows, cols], any float dtype; cast to bf16 as the seed casts
    its fp32 lookahead). Returns a new bf16 tensor of x's shape. ``margin`` is the base margin (the
    SAFE config widens it by SAFE_MARGIN_SLACK). ``streams``: see :func:`cascade_workspace`."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2:
        raise ValueError(f"x: expected a floating-point tensor [..., rows, cols], got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}")
    if x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"x: matrices must have at least one row and one column, got {tuple(x.shape)}")
    cfg = get_config(config)
    lead = x.shape[:-2]
    x3 = x.reshape(-1, *x.shape[-2:])
    ws = CascadeWorkspace.for_shape(tuple(x3.shape), x.device)
    maybe_compiled(_safe_cast, want_compile(compile, x))(x3, ws.X, cfg.prescale)
    y = cascade_workspace(ws, maps=maps, config=cfg, split=split, margin=margin, eps=eps, backend=backend,
                          compile=compile, streams=streams)
    return y.reshape(*lead, *y.shape[-2:])


# The Gram-side driver (anvil_fast.core.gram_side holds its kernel, buffers and rules): here, next to the
# standard one, because it shares the workspace and the normalization and cascade_workspace dispatches to it.

def gram_side_workspace(ws: CascadeWorkspace, *, maps: MapsLike = ANVIL_MAPS, config: CascadeConfig | str = "gram_side",
                        margin: float = FROBENIUS_MARGIN, eps: float = FROBENIUS_EPS, backend: str = "auto",
                        compile: bool | None = None, partials_ready: bool = False,
                        restarts: tuple[int, ...] | None = None) -> Tensor:
    """The Gram-side cascade of ``ws.X`` (module docstring) with the configuration's restart
    schedule for ``maps`` (:func:`restarts_of`), or ``restarts`` where the caller has decided it
    (:func:`gram_side_schedule`); same contract as :func:`anvil_fast.core.cascade.cascade_workspace`
    (returns the buffer, ``ws.X`` or ``ws.C``, that holds the result)."""
    cfg = get_config(config)
    if cfg.gram_side is None:
        raise ValueError(f"config {cfg.name!r} has no Gram-side restart schedule (gram_side=None)")
    maps_ = load_maps(maps)
    sched = restarts_of(cfg, maps_) if restarts is None else check_restarts(restarts, len(maps_))
    if sched is None:
        raise ValueError(f"config {cfg.name!r}: the Gram-side study has no restart schedule for these maps "
                         "(anvil_fast.core.gram_side.studied_restarts); pass one (fast_gram_side(..., restarts=...))")
    X0, C, A, B = ws.X, ws.C, ws.A, ws.B
    if ws.gram_side is None or tuple(ws.gram_side.R.shape) != tuple(A.shape):
        ws.gram_side = GramSideWork.for_workspace(ws)
    P, Rk, R2 = ws.gram_side.P, ws.gram_side.R, ws.gram_side.R2
    tall = is_tall(X0.shape)
    gram = XTX if tall else XXT
    normalize_workspace(ws, cfg, margin=margin, eps=eps, backend=backend, compile=compile,
                        partials_ready=partials_ready)
    gram(X0, out=A, backend=backend)
    fresh = True
    for k, (a, b, c) in enumerate(maps_, start=1):
        if k in sched:
            restart_product(X0, Rk, C, tall, backend)
            X0, C = C, X0
            gram(X0, out=A, backend=backend)
            fresh = True
        ba_plus_cAA(A, alpha=c, beta=b, out=B, backend=backend)
        if not fresh:
            aX_plus_mm(Rk, Rk, B, a=a, out=R2, backend=backend) if tall else \
                aX_plus_mm(Rk, B, Rk, a=a, out=R2, backend=backend)
            Rk, R2 = R2, Rk
        if k < len(maps_) and k + 1 not in sched:
            # P = Q A and Q P are exactly symmetric (Q is a polynomial in A): lower tiles only, mirrored.
            # R's update is symmetric in exact arithmetic too, but mirrored it lost accuracy in the
            # Gram-side study (module docstring of anvil_fast.core.gram_side), so it stays a full product.
            sym_aX_plus_mm(A, B, A, a=a, out=P, backend=backend)
            sym_aX_plus_mm(P, B, P, a=a, out=A, backend=backend)
        if fresh:
            # Q = a I + B: B's last reader has run, so Q is made in B's buffer, which becomes R's, and
            # R's becomes the next B (a pass over B to copy it saved). The diagonal is added in fp32 and
            # rounded once: a bf16 tensor's in-place ``add_(a)`` first rounds the scalar a to bf16, a
            # bias of up to 2**-9 on every eigenvalue of Q that the accumulated R never loses
            # (measured: 3x the error with one restart).
            Rk, B = plus_identity_(B, a, backend=backend), Rk
            fresh = False
    restart_product(X0, Rk, C, tall, backend)
    return C


def fast_gram_side(x: Tensor, *, restarts=None, maps: MapsLike = ANVIL_MAPS, margin: float = FROBENIUS_MARGIN,
                   eps: float = FROBENIUS_EPS, backend: str = "auto", compile: bool | None = None) -> Tensor:
    """The Gram-side cascade of ``x`` ([..., rows, cols], any float dtype, cast to bf16 as
    :func:`anvil_fast.core.cascade.fast_cascade` does) whatever its shape (no dispatch rule), with
    ``restarts`` (default: the study's schedule for ``maps``, :func:`anvil_fast.core.gram_side.studied_restarts`;
    a ValueError where it has none). Returns a new bf16 tensor of x's shape."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2 or 0 in x.shape[-2:]:
        raise ValueError(f"x: expected a floating-point tensor [..., rows, cols] with rows, cols >= 1, got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}")
    cfg = GRAM_SIDE if restarts is None else dataclasses.replace(GRAM_SIDE, gram_side=tuple(restarts))
    lead = x.shape[:-2]
    x3 = x.reshape(-1, *x.shape[-2:])
    ws = CascadeWorkspace.for_shape(tuple(x3.shape), x.device)
    _safe_cast(x3, ws.X, True)
    y = gram_side_workspace(ws, maps=maps, config=cfg, margin=margin, eps=eps, backend=backend, compile=compile)
    return y.reshape(*lead, *y.shape[-2:])
