"""95% intervals for held-out success rates and for the difference between two evaluations.

A held-out number is avg@k: the mean over tasks of each task's share of solved samples (a sample
counts as solved when its value is at least 1.0, as ``episodes/evaluate.py`` counts it). Two
things would move it if the evaluation were made again: another draw of tasks, and other
samples on the same tasks. The interval takes both into account with a two-level percentile
bootstrap:

1. draw as many tasks as were evaluated, with replacement;
2. within each drawn task, draw its k samples with replacement. Drawing k samples from k
   outcomes of which s are solved is a Binomial(k, s/k) draw, so it costs one binomial per task
   (nothing moves where k = 1, or where a task was always or never solved);
3. take the mean rate of the drawn tasks. Repeated ``resamples`` times, the interval is the
   central ``level`` share of those means (their 2.5th and 97.5th percentiles at 95%, values the
   bootstrap actually took).

A difference B - A between two evaluations of the same tasks (two arms of one seed, two stages
of one run) is paired: step 1 draws the same tasks for both sides, step 2 draws each side's
samples on its own. Task difficulty, the largest part of the noise of one evaluation, cancels
that way. The two sides' samples are taken as independent; where both evaluations sampled with
one seed, and so drew alike where the policies act alike, the interval is wider than the truth,
never narrower.

Where only one number per seed is left (runs made before per-task records were kept), the
interval of a mean over seeds, or of a paired difference per seed, is Student's t-interval over
the seeds: it also holds the training's seed-to-seed variation, and with three seeds it is wide.

A label is read off an interval and nothing else: "helps" when it lies above 0, "hurts" when
below, "no change" when it holds 0. Everything here is deterministic given ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000


def rate_interval(outcomes: Sequence[Sequence[float]], *, level: float = LEVEL,
                  resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """``(low, high)`` of avg@k, from one list of k per-sample outcomes per task: the two-level
    bootstrap of the module's docstring. Raises ValueError without tasks."""
    if not outcomes:
        raise ValueError("no tasks: an interval needs at least one evaluated task")
    k, solved = _counts(outcomes)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(k), size=(resamples, len(k)))
    return _central(_resampled_rates(k, solved, draws, rng).mean(axis=1), level)


def paired_interval(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], *,
                    level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """B - A on the task ids both hold (``{task_id: per-sample outcomes}`` each): the same task
    draw for both sides, each side's samples drawn within a task. Returns ``{"diff": mean(B) -
    mean(A), "low", "high", "tasks": n}``; raises ValueError when no task is shared."""
    shared = sorted(set(a) & set(b))  # sorted: the draw must not depend on hash order
    if not shared:
        raise ValueError(f"the two evaluations share no task (A holds {len(a)} tasks, B "
                         f"{len(b)}): evaluate both on the same tasks to pair them")
    ka, sa = _counts([a[t] for t in shared])
    kb, sb = _counts([b[t] for t in shared])
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(shared), size=(resamples, len(shared)))
    diffs = (_resampled_rates(kb, sb, draws, rng) - _resampled_rates(ka, sa, draws, rng))
    low, high = _central(diffs.mean(axis=1), level)
    diff = float(np.mean(sb / kb) - np.mean(sa / ka))
    return {"diff": diff, "low": low, "high": high, "tasks": len(shared)}


def effect_label(low: float, high: float) -> str:
    """What a paired interval of B - A says: "helps" above 0, "hurts" below, else "no change"
    (also for an interval that could not be taken: NaN ends)."""
    if low > 0:
        return "helps"
    if high < 0:
        return "hurts"
    return "no change"


def seed_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """Student's t-interval of the mean of one number per seed; ``(nan, nan)`` with fewer than
    two seeds (their spread is unknown)."""
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def seed_paired_interval(diffs: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """The t-interval over per-seed paired differences B - A (each seed's B minus the same
    seed's A): the fallback where only per-seed numbers exist."""
    return seed_interval(diffs, level)


def t_quantile(level: float, df: int) -> float:
    """The t such that P(|T| <= t) = ``level`` for Student's t with ``df`` degrees of freedom
    (4.303 for 95% and df 2), by bisection on the closed-form distribution."""
    low, high = 0.0, 1.0
    while _t_central(high, df) < level:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central(mid, df) < level else (low, mid)
    return (low + high) / 2


def format_rate(rate: float, interval: Sequence[float], level: float = LEVEL) -> str:
    """``80.1% (95% 74.6–85.2)``: a rate in percent with its interval."""
    low, high = interval
    if _missing(low, high):
        return f"{rate:.1%} (no interval)"
    return f"{rate:.1%} ({level:.0%} {100 * low:.1f}–{100 * high:.1f})"


def format_diff(diff: float, interval: Sequence[float], level: float = LEVEL) -> str:
    """``+0.8 points (95% -0.5 to +2.1)``: a difference of rates, in points, with its
    interval."""
    low, high = interval
    if _missing(low, high):
        return f"{100 * diff:+.1f} points (no interval)"
    return f"{100 * diff:+.1f} points ({level:.0%} {100 * low:+.1f} to {100 * high:+.1f})"


# --- the arithmetic ----------------------------------------------------------------------------


def _counts(outcomes: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Per task, its number of samples k and of solved ones."""
    k = np.array([len(task) for task in outcomes])
    if (k == 0).any():
        raise ValueError("a task without samples: every task needs at least one outcome")
    solved = np.array([sum(value >= 1.0 for value in task) for task in outcomes])
    return k, solved


def _resampled_rates(k: np.ndarray, solved: np.ndarray, draws: np.ndarray,
                     rng: np.random.Generator) -> np.ndarray:
    """The rate of every drawn task (``draws``: resamples x tasks, indices) with its k samples
    drawn again: Binomial(k, solved / k) over k."""
    kd = k[draws]
    return rng.binomial(kd, solved[draws] / kd) / kd


def _central(values: np.ndarray, level: float) -> tuple[float, float]:
    """The central ``level`` share of ``values``: both ends are values that occur."""
    tail = (1 - level) / 2
    low, high = np.quantile(values, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df``: the finite series in cos^2 of
    theta = atan(t / sqrt(df)) (odd df: with theta itself; even df: times sin theta)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:
        term, series = 1.0, 1.0 if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            series += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    term, series = 1.0, 1.0
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        series += term
    return math.sin(theta) * series


def _missing(low: float, high: float) -> bool:
    return low is None or high is None or math.isnan(low) or math.isnan(high)
