"""Analysis of one map set on ``[l, u]``: the per-stage interval chain, the alternation points, the
certified envelope and headroom (and, on request, the bf16 envelope measured on a suite of inputs).

* Interval chain: for each stage ``k`` the certified range ``[l_k, u_k]`` of ``s_k = p_k(...p_1(x))``
  over ``x in [l, u]`` (:func:`derive_maps.certify.certify_range`), and the stage headroom: how far
  above ``u_k`` the remaining maps ``p_K o ... o p_{k+1}`` keep their output inside the band. A
  stage with no headroom blows up as soon as rounding pushes a value past ``u_k``.
* Alternation points: the endpoints and every zero of ``F'`` (rigorously isolated), with
  ``log F`` there in mpmath; the ones within 1% of the worst are the active set of the minimax.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

import mpmath

from . import mpcomposite as mc
from .certify import Envelope, Headroom, certify_envelope, certify_headroom, certify_range, critical_points
from .errors import RealLike, check_interval, check_maps


@dataclass
class Stage:
    """Stage k (0 = the input): certified ``lo <= min s_k`` and ``hi >= max s_k`` over [l, u], and
    the certified relative headroom of the remaining maps above ``hi`` (None after the last map)."""
    k: int
    coeffs: tuple | None
    lo: float
    hi: float
    headroom: float | None
    headroom_upper: float | None


@dataclass
class Analysis:
    l: float
    u: float
    band: float
    envelope: Envelope
    headroom: Headroom
    chain: list
    alternation: list          # [(x, log F(x))], sorted by x
    n_extrema: int
    n_active: int              # extrema with |log F| >= 0.99 max
    bf16: dict | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["envelope"] = self.envelope.as_dict()
        d["headroom"] = asdict(self.headroom)
        return d


def analyse(maps, l: RealLike, u: RealLike, *, band: float = 0.01, bf16: bool = False,
            progress: bool | None = None) -> Analysis:
    maps_ = check_maps(maps)
    lf, uf = check_interval(l, u)
    env = certify_envelope(maps_, lf, uf, progress=progress)
    head = certify_headroom(maps_, uf, band=band)
    chain = [Stage(k=0, coeffs=None, lo=float(lf), hi=float(uf), headroom=head.certified,
                   headroom_upper=head.upper)]
    for k in range(1, len(maps_) + 1):
        lo, _, _, hi = certify_range(maps_[:k], lf, uf)
        tail = maps_[k:]
        hr = hu = None
        if tail and hi > 0:
            h = certify_headroom(tail, Fraction(hi), band=band)
            hr, hu = h.certified, h.upper
        chain.append(Stage(k=k, coeffs=maps_[k - 1], lo=lo, hi=hi, headroom=hr, headroom_upper=hu))
    xs = critical_points(maps_, lf, uf)
    th = mc.to_theta(maps_)
    alternation = []
    with mpmath.workdps(30):
        pts = [mpmath.mpf(lf.numerator) / lf.denominator]
        pts += [mpmath.mpf(x.as_integer_ratio()[0]) / x.as_integer_ratio()[1] for x in xs]
        pts += [mpmath.mpf(uf.numerator) / uf.denominator]
        for x in pts:
            F = mc.value(th, x)
            alternation.append((float(x), float(mpmath.log(F)) if F > 0 else float("-inf")))
    worst = max(abs(v) for _, v in alternation)
    active = sum(1 for _, v in alternation if abs(v) >= 0.99 * worst)
    out = Analysis(l=float(lf), u=float(uf), band=band, envelope=env, headroom=head, chain=chain,
                   alternation=alternation, n_extrema=len(alternation), n_active=active)
    if bf16:
        from .bf16 import bf16_envelope
        out.bf16 = bf16_envelope(maps_, l=float(lf), u=float(uf)).as_dict()
    return out
