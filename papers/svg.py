"""A tiny dependency-free SVG line-plot writer for the paper's figures (no matplotlib: the package's
dependencies are torch, triton, numpy, scipy, mpmath, pytest). Output is deterministic text, so the
regeneration test can compare figures byte for byte."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


@dataclass
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    dashed: bool = False


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                if lo <= 10.0 ** e <= hi * (1 + 1e-12)]
    span = hi - lo
    step = 10 ** math.floor(math.log10(span / 4)) if span > 0 else 1.0
    for m in (1, 2, 5, 10):
        if span / (step * m) <= 6:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 12) for i in range(int((hi - start) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4):
        e = math.floor(math.log10(abs(v)))
        m = v / 10 ** e
        return f"1e{e}" if abs(m - 1) < 1e-9 else f"{m:g}e{e}"
    return f"{v:g}"


def line_plot(series: Sequence[Series], *, title: str, xlabel: str, ylabel: str, logx: bool = False,
              ylim: tuple[float, float] | None = None, width: int = 640, height: int = 360,
              hlines: Sequence[float] = (), legend: str = "upper left") -> str:
    """An SVG document with one polyline per series, axes with ticks, a legend and a title."""
    left, right, top, bottom = 70, 20, 36, 50
    xs = [v for s in series for v in s.x]
    ys = [v for s in series for v in s.y if math.isfinite(v)]
    x0, x1 = min(xs), max(xs)
    y0, y1 = ylim if ylim else (min(ys), max(ys))
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    pw, ph = width - left - right, height - top - bottom

    def px(v: float) -> float:
        return left + (fx(v) - fx(x0)) / (fx(x1) - fx(x0)) * pw

    def py(v: float) -> float:
        v = min(max(v, y0), y1)
        return top + (1 - (v - y0) / (y1 - y0)) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2:.1f}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>']
    for t in _ticks(x0, x1, logx):
        out.append(f'<line x1="{px(t):.1f}" y1="{top + ph}" x2="{px(t):.1f}" y2="{top + ph + 5}" stroke="black"/>')
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 18}" text-anchor="middle">{_fmt(t)}</text>')
    for t in _ticks(y0, y1, False):
        out.append(f'<line x1="{left - 5}" y1="{py(t):.1f}" x2="{left}" y2="{py(t):.1f}" stroke="black"/>')
        out.append(f'<text x="{left - 8}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for h in hlines:
        out.append(f'<line x1="{left}" y1="{py(h):.1f}" x2="{left + pw}" y2="{py(h):.1f}" stroke="#999" '
                   'stroke-dasharray="2,3"/>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 12}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text x="16" y="{top + ph / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + ph / 2:.1f})">{ylabel}</text>')
    lw = 40 + 7 * max(len(s.label) for s in series)
    lx = left + 4 if legend == "upper left" else left + pw - lw - 4
    ly0 = top + 4 if legend == "upper left" else top + ph - 16 * len(series) - 8
    for i, s in enumerate(series):
        pts = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(s.x, s.y) if math.isfinite(b))
        dash = ' stroke-dasharray="6,3"' if s.dashed else ""
        color = PALETTE[i % len(PALETTE)]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{pts}"/>')
    out.append(f'<rect x="{lx}" y="{ly0}" width="{lw}" height="{16 * len(series) + 4}" fill="white" '
               'fill-opacity="0.85" stroke="#ccc"/>')
    for i, s in enumerate(series):
        color, dash = PALETTE[i % len(PALETTE)], ' stroke-dasharray="6,3"' if s.dashed else ""
        ly = ly0 + 14 + 16 * i
        out.append(f'<line x1="{lx + 6}" y1="{ly - 4}" x2="{lx + 30}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 36}" y="{ly}">{s.label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
