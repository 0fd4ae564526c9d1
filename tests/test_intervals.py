"""metrics/intervals.py: the bootstrap intervals against cases computed by hand or by exact
enumeration, the paired interval and its label, the t-interval over seeds, and the edges."""

from __future__ import annotations

import itertools
import math
import time
from math import comb

import numpy as np
import pytest

from metrics.intervals import (
    effect_label,
    format_diff,
    format_rate,
    paired_interval,
    rate_interval,
    seed_interval,
    seed_paired_interval,
    t_quantile,
)


def exact_interval(outcomes, level=0.95):
    """The two-level bootstrap's distribution enumerated: every draw of tasks, and within each
    drawn task every binomial count; the central ``level`` of it, as values that occur."""
    n = len(outcomes)
    per_task = []  # per task: {rate: probability} of its resampled rate
    for task in outcomes:
        k, p = len(task), sum(v >= 1.0 for v in task) / len(task)
        per_task.append({j / k: comb(k, j) * p ** j * (1 - p) ** (k - j) for j in range(k + 1)})
    dist: dict[float, float] = {}
    for drawn in itertools.product(range(n), repeat=n):
        for rates in itertools.product(*(per_task[i].items() for i in drawn)):
            mean = round(sum(r for r, _ in rates) / n, 12)
            dist[mean] = dist.get(mean, 0.0) + math.prod(p for _, p in rates) / n ** n
    tail, cdf, low, high = (1 - level) / 2, 0.0, None, None
    for value in sorted(dist):
        cdf += dist[value]
        if low is None and cdf > tail:
            low = value
        if high is None and cdf >= 1 - tail:
            high = value
    return low, high


def test_two_tasks_one_sample_each_by_hand():
    # Draws of two tasks from {solved, failed}: means 0, 0.5, 1 with probabilities 1/4, 1/2,
    # 1/4, so 2.5% and 97.5% fall on 0 and 1.
    assert rate_interval([[1.0], [0.0]]) == (0.0, 1.0)
    assert exact_interval([[1.0], [0.0]]) == (0.0, 1.0)


def test_samples_within_a_task_are_drawn_again_where_k_is_above_one():
    # Tasks [1, 1] and [1, 0]. One drawn task's rate: 1 with 1/2 + 1/2 * 1/4 = 5/8, 0.5 with
    # 1/4, 0 with 1/8. The mean of two: 0 with 1/64 (below 2.5%), 0.25 with 1/16 (the CDF
    # passes 2.5% there), ... 1 with 25/64 (above 97.5% of the CDF only at 1). So (0.25, 1).
    outcomes = [[1.0, 1.0], [1.0, 0.0]]
    assert exact_interval(outcomes) == (0.25, 1.0)
    assert rate_interval(outcomes) == (0.25, 1.0)
    # Resampling tasks alone would give means 0.5, 0.75, 1 and the interval (0.5, 1).


@pytest.mark.parametrize("outcomes", [
    [[1, 1, 1, 0]],                              # one task: Binomial(4, 3/4) / 4 -> (0.25, 1)
    [[1, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[1, 1, 0, 0], [1], [1, 1, 1, 0]],
])
def test_the_bootstrap_matches_exact_enumeration(outcomes):
    assert rate_interval(outcomes) == pytest.approx(exact_interval(outcomes))


def test_degenerate_evaluations_have_no_width():
    assert rate_interval([[1.0] * 4] * 10) == (1.0, 1.0)
    assert rate_interval([[0.0] * 4] * 10) == (0.0, 0.0)
    # a sample counts as solved at a reward of 1.0 or more, as avg@k counts it
    assert rate_interval([[0.5, 0.9]] * 3) == (0.0, 0.0)


def test_the_same_seed_gives_the_same_interval():
    rng = np.random.default_rng(3)
    outcomes = [list((rng.random(4) < 0.4).astype(float)) for _ in range(50)]
    assert rate_interval(outcomes, seed=7) == rate_interval(outcomes, seed=7)
    low, high = rate_interval(outcomes)
    mean = np.mean([np.mean(o) for o in outcomes])
    assert low < mean < high


def test_no_tasks_is_an_error():
    with pytest.raises(ValueError, match="no tasks"):
        rate_interval([])
    with pytest.raises(ValueError, match="without samples"):
        rate_interval([[1.0], []])


# --- paired -----------------------------------------------------------------------------------


def test_a_paired_case_by_hand():
    # Per-task differences 1 and 0: drawn in pairs, their mean is 0, 0.5, 1 with 1/4, 1/2, 1/4.
    stats = paired_interval({"t1": [0.0], "t2": [0.0]}, {"t1": [1.0], "t2": [0.0]})
    assert stats == {"diff": 0.5, "low": 0.0, "high": 1.0, "tasks": 2}
    assert effect_label(stats["low"], stats["high"]) == "no change"


def test_the_same_evaluation_twice_is_no_change():
    rng = np.random.default_rng(0)
    a = {f"t{i}": list((rng.random(4) < 0.5).astype(float)) for i in range(100)}
    stats = paired_interval(a, dict(a))
    assert stats["diff"] == 0.0 and stats["tasks"] == 100
    assert stats["low"] < 0 < stats["high"]
    assert effect_label(stats["low"], stats["high"]) == "no change"


def test_a_clear_improvement_helps_and_its_reverse_hurts():
    a = {f"t{i}": [0.0, 0.0, 1.0, 0.0] for i in range(60)}
    b = {f"t{i}": [1.0, 1.0, 1.0, 0.0] for i in range(60)}
    up = paired_interval(a, b)
    assert up["diff"] == pytest.approx(0.5) and up["low"] > 0
    assert effect_label(up["low"], up["high"]) == "helps"
    down = paired_interval(b, a)
    assert effect_label(down["low"], down["high"]) == "hurts"


def test_pairing_removes_task_difficulty_from_the_interval():
    # Half the tasks easy, half impossible, B one sample better on every fourth task: the
    # rates' own intervals overlap, the paired one lies above 0.
    a = {f"t{i}": [1.0] * 4 if i % 2 else [0.0] * 4 for i in range(80)}
    b = {t: ([1.0] + o[1:]) if int(t[1:]) % 4 == 0 else o for t, o in a.items()}
    a_low, a_high = rate_interval(list(a.values()))
    b_low, b_high = rate_interval(list(b.values()))
    assert b_low < a_high
    stats = paired_interval(a, b)
    assert effect_label(stats["low"], stats["high"]) == "helps"


def test_only_the_shared_tasks_are_paired_and_none_shared_is_an_error():
    stats = paired_interval({"t1": [1.0], "t2": [0.0], "only_a": [1.0]},
                            {"t1": [1.0], "t2": [1.0]})
    assert stats["tasks"] == 2 and stats["diff"] == 0.5
    with pytest.raises(ValueError, match=r"share no task \(A holds 1 tasks, B 2\)"):
        paired_interval({"t1": [1.0]}, {"t2": [1.0], "t3": [0.0]})


def test_labels_come_from_the_interval_alone():
    assert effect_label(0.001, 0.2) == "helps"
    assert effect_label(-0.2, -0.001) == "hurts"
    assert effect_label(-0.005, 0.021) == "no change"  # a positive mean is not a help
    assert effect_label(0.0, 0.1) == "no change"
    assert effect_label(math.nan, math.nan) == "no change"


# --- over seeds -------------------------------------------------------------------------------


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262),
                                          (30, 2.042)])
def test_t_quantiles_match_the_table(df, expected):
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=5e-4)


def test_seed_paired_interval_by_hand():
    # SmolLM2 +attributing minus +questioning, seeds 0, 1, 2: +1.0, +0.25, +1.25 points; the
    # same sign on every seed, yet the t-interval (2 degrees of freedom) holds 0.
    diffs = [0.01, 0.0025, 0.0125]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    low, high = seed_paired_interval(diffs)
    assert (low, high) == pytest.approx((mean - 4.302653 * sd / math.sqrt(3),
                                         mean + 4.302653 * sd / math.sqrt(3)))
    assert low < 0 < high and effect_label(low, high) == "no change"
    assert effect_label(*seed_paired_interval([0.05, 0.04, 0.06])) == "helps"
    assert all(math.isnan(x) for x in seed_interval([0.3]))  # one seed: no spread to use


# --- presentation and speed -------------------------------------------------------------------


def test_formats():
    assert format_rate(0.801, (0.746, 0.852)) == "80.1% (95% 74.6–85.2)"
    assert format_rate(0.4, [math.nan, math.nan]) == "40.0% (no interval)"
    assert format_diff(0.008, (-0.005, 0.021)) == "+0.8 points (95% -0.5 to +2.1)"


def test_200_tasks_of_k4_take_well_under_a_second():
    rng = np.random.default_rng(1)
    outcomes = {f"t{i}": list((rng.random(4) < 0.6).astype(float)) for i in range(200)}
    start = time.perf_counter()
    rate_interval(list(outcomes.values()))
    paired_interval(outcomes, outcomes)
    assert time.perf_counter() - start < 1.0
