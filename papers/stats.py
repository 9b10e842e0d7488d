"""Statistics of the training runs (``python -m papers.train``'s JSON), as the paper cites them.

* A curve is the validation loss at the evaluated steps ``(steps, losses)``, step 0 included.
* :func:`loss_at`: the loss at a step budget, by linear interpolation between evaluations (all
  contenders of a comparison use the same batch, so a token budget is a step budget).
* :func:`steps_to_target`: the first step at which the curve reaches ``target`` (loss <= target), by
  linear interpolation between the two evaluations that bracket the crossing; ``inf`` if never.
* :func:`summary`: mean, sample standard deviation (ddof = 1), min and max over seeds.
* :func:`verdict`, the rule for ranking two contenders on one metric: with ``d = mean_a - mean_b``
  and ``spread = max(std_a, std_b)`` (the larger of the two sample standard deviations over seeds),
  ``|d| <= spread`` is "no measurable difference"; otherwise the one with the lower mean is lower.
  Fewer than 2 seeds on either side is "not enough seeds" (no spread, so no claim). Metrics that
  are ``inf`` for some seed (target not reached) are compared only when both sides are finite for
  every seed, or one side reached it on every seed and the other on none.
* :func:`paired`, the paired comparison: two contenders run with the same seeds start from the same
  weights and see the same batches, so their difference is taken seed by seed,
  ``d_s = a_s - b_s``, and summarized by its mean and a two-sided Student t interval over the seeds,
  ``mean(d) -+ t(1 - alpha / 2, n - 1) * sd(d) / sqrt(n)`` (sample sd, ``n`` paired seeds,
  :data:`LEVEL` = 95 %). :func:`paired_verdict`: an interval wholly below 0 says a is lower, wholly
  above 0 that b is lower; one that holds 0 resolves no difference. It assumes the per-seed
  differences are independent and roughly normal; with 2 or 3 seeds the interval is wide
  (t = 12.7 and 4.3), which is the honest price of few seeds.
* :func:`paired_ratio`: the same on ``log(a_s / b_s)`` (steps to a target), reported as the
  geometric-mean ratio and its interval.
* :func:`paired_p`: the two-sided p-value of the same paired t test,
  ``2 * P(T_{n-1} >= |mean(d)| / (sd(d) / sqrt(n)))``; :func:`holm`: Holm's step-down adjustment of a
  family of such p-values (sorted ascending, ``p_(i) * (m - i + 1)``, made monotone and capped at 1),
  which holds the chance of any false "lower" in the family at the level, where each interval alone
  holds it per comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

NO_DIFFERENCE = "no measurable difference"
NOT_ENOUGH = "not enough seeds"
HOLDS_ZERO = "interval holds 0"
LEVEL = 0.95


def _check_curve(steps: Sequence[float], losses: Sequence[float]) -> None:
    if len(steps) != len(losses) or not steps:
        raise ValueError(f"a curve needs equally many steps and losses (>= 1), got {len(steps)} and {len(losses)}")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"a curve's steps must increase strictly, got {list(steps)}")


def loss_at(steps: Sequence[float], losses: Sequence[float], step: float) -> float:
    """The curve's loss at ``step`` (linear between evaluations); outside the evaluated range it is
    an error, not an extrapolation."""
    _check_curve(steps, losses)
    if not steps[0] <= step <= steps[-1]:
        raise ValueError(f"step {step} is outside the evaluated range [{steps[0]}, {steps[-1]}]")
    for i in range(1, len(steps)):
        if step <= steps[i]:
            w = (step - steps[i - 1]) / (steps[i] - steps[i - 1])
            return losses[i - 1] + w * (losses[i] - losses[i - 1])
    return losses[0]  # a one-point curve evaluated at its only step


def steps_to_target(steps: Sequence[float], losses: Sequence[float], target: float) -> float:
    """First step at which the curve reaches ``target`` (module docstring); ``math.inf`` if never."""
    _check_curve(steps, losses)
    if losses[0] <= target:
        return float(steps[0])
    for i in range(1, len(steps)):
        if losses[i] <= target:
            hi, lo = losses[i - 1], losses[i]
            return steps[i - 1] + (hi - target) / (hi - lo) * (steps[i] - steps[i - 1])
    return math.inf


def mean_curve(curves: Sequence[tuple[Sequence[float], Sequence[float]]]) -> tuple[list[float], list[float]]:
    """The seed-mean curve of curves evaluated at the same steps."""
    if not curves:
        raise ValueError("mean_curve needs at least one curve")
    steps = list(curves[0][0])
    for s, _ in curves:
        if list(s) != steps:
            raise ValueError("mean_curve: the curves were evaluated at different steps")
    n = len(curves)
    return steps, [sum(c[1][i] for c in curves) / n for i in range(len(steps))]


def summary(values: Sequence[float]) -> dict[str, float]:
    """``n``, ``mean``, ``std`` (sample, ddof = 1; nan for one value), ``min``, ``max``."""
    if not values:
        raise ValueError("summary needs at least one value")
    n = len(values)
    if any(math.isinf(v) for v in values):
        mean = math.inf
        std = math.nan
    else:
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return {"n": n, "mean": mean, "std": std, "min": min(values), "max": max(values)}


def verdict(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("a", "b")) -> str:
    """Which of two contenders is lower on a metric (lower is better), by the rule of the module
    docstring: ``"<name> lower"``, :data:`NO_DIFFERENCE` or :data:`NOT_ENOUGH`."""
    if len(a) < 2 or len(b) < 2:
        return NOT_ENOUGH
    ia, ib = [math.isinf(v) for v in a], [math.isinf(v) for v in b]
    if any(ia) or any(ib):
        if all(ia) and all(ib):
            return NO_DIFFERENCE
        if not any(ia) and all(ib):
            return f"{names[0]} lower"
        if all(ia) and not any(ib):
            return f"{names[1]} lower"
        return NO_DIFFERENCE  # some seeds reached the target and some did not: within the spread
    sa, sb = summary(a), summary(b)
    d = sa["mean"] - sb["mean"]
    if abs(d) <= max(sa["std"], sb["std"]):
        return NO_DIFFERENCE
    return f"{names[0] if d < 0 else names[1]} lower"


def fmt_spread(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std [min, max]`` (``n = 1``: the value alone; ``inf``: "not reached (k/n)")."""
    s = summary(values)
    if math.isinf(s["mean"]):
        k = sum(not math.isinf(v) for v in values)
        return f"not reached ({k}/{s['n']} seeds)"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t distribution with ``dof`` degrees of freedom."""
    if not 0 < p < 1 or dof < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    from scipy.stats import t

    return float(t.ppf(p, dof))


def paired(a: Sequence[float], b: Sequence[float], *, level: float = LEVEL) -> dict:
    """The paired comparison of the module docstring over equally long per-seed values (seed
    ``i`` of ``a`` with seed ``i`` of ``b``): ``n``, ``diffs``, ``mean``, ``sd``, ``lo``, ``hi``
    (nan below 2 seeds; ``mean`` inf/nan when a seed is not finite)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired needs equally many values per side (>= 1), got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    out = {"n": n, "diffs": d, "level": level}
    if any(not math.isfinite(v) for v in d):
        return {**out, "mean": math.nan, "sd": math.nan, "lo": math.nan, "hi": math.nan}
    m = sum(d) / n
    if n < 2:
        return {**out, "mean": m, "sd": math.nan, "lo": math.nan, "hi": math.nan}
    sd = math.sqrt(sum((v - m) ** 2 for v in d) / (n - 1))
    half = t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)
    return {**out, "mean": m, "sd": sd, "lo": m - half, "hi": m + half}


def paired_p(pd: dict) -> float:
    """The two-sided p-value of :func:`paired`'s t test of mean 0 (nan below 2 seeds or where a seed
    is not finite; 0 where every difference is the same non-zero value, 1 where all are 0)."""
    if pd["n"] < 2 or not math.isfinite(pd["mean"]):
        return math.nan
    if pd["sd"] == 0:
        return 1.0 if pd["mean"] == 0 else 0.0
    from scipy.stats import t

    stat = abs(pd["mean"]) / (pd["sd"] / math.sqrt(pd["n"]))
    return float(2 * t.sf(stat, pd["n"] - 1))


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values of a family, in the order given (nan entries are left out of the
    family and stay nan)."""
    idx = sorted((i for i, p in enumerate(ps) if math.isfinite(p)), key=lambda i: ps[i])
    m = len(idx)
    out = [math.nan] * len(ps)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, ps[i] * (m - rank)))
        out[i] = running
    return out


def fmt_p(p: float) -> str:
    """A p-value for a table: three decimals, ``< 0.001`` below that, ``-`` where undefined."""
    if not math.isfinite(p):
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def paired_verdict(pd: dict, names: tuple[str, str] = ("a", "b")) -> str:
    """``"<name> lower"`` when the interval of :func:`paired` excludes 0, :data:`HOLDS_ZERO` when
    it does not, :data:`NOT_ENOUGH` below 2 seeds, a sentence when a seed is not finite."""
    if pd["n"] < 2:
        return NOT_ENOUGH
    if not math.isfinite(pd["mean"]):
        return "not comparable (a seed diverged or did not reach the target)"
    if pd["hi"] < 0:
        return f"{names[0]} lower"
    if pd["lo"] > 0:
        return f"{names[1]} lower"
    return HOLDS_ZERO


def paired_ratio(a: Sequence[float], b: Sequence[float], *, level: float = LEVEL) -> dict:
    """:func:`paired` on ``log(a_s / b_s)``, back on the ratio scale: ``ratio`` (geometric mean),
    ``lo``, ``hi``, ``n``, ``ratios``."""
    if any(not (math.isfinite(x) and x > 0) for x in (*a, *b)):
        ratios = [x / y if math.isfinite(x) and math.isfinite(y) and y > 0 else math.inf for x, y in zip(a, b)]
        return {"n": len(a), "ratios": ratios, "ratio": math.nan, "lo": math.nan, "hi": math.nan}
    pd = paired([math.log(x) for x in a], [math.log(y) for y in b], level=level)
    ex = (lambda v: math.exp(v) if math.isfinite(v) else math.nan)
    return {"n": pd["n"], "ratios": [math.exp(v) for v in pd["diffs"]], "ratio": ex(pd["mean"]),
            "lo": ex(pd["lo"]), "hi": ex(pd["hi"]), "level": level}


def fmt_interval(pd: dict, digits: int = 4, *, signed: bool = True) -> str:
    """``mean [lo, hi]`` of :func:`paired` (or ``ratio [lo, hi]`` of :func:`paired_ratio`)."""
    v = pd.get("mean", pd.get("ratio"))
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if v is None or not math.isfinite(v):
        return "-"
    if not math.isfinite(pd["lo"]):
        return f.format(v)
    return f"{f.format(v)} [{f.format(pd['lo'])}, {f.format(pd['hi'])}]"
