"""How much of a held-out number, or of a difference between two, is noise: read off the
per-task files of ``autodidact eval --out`` (k sampled episodes per task).

    python -m bench.eval_noise A.jsonl [B.jsonl] [--json F]

For each file: avg@k, its standard error across tasks (what another draw of tasks would give)
and its sampling standard error alone (what another draw of episodes on the same tasks would
give: the binomial variance of k samples per task). For a pair evaluated on the same tasks,
as the ablation's arms of one seed are: the difference B - A, its paired standard error across
tasks, and its sampling standard error.

Beside the standard errors, each number's 95% interval from ``metrics/intervals.py``: avg@k's
bootstrap over tasks and their samples, and the paired bootstrap of B - A (the same task draw
for both), with the label read off it ("helps", "hurts", "no change"). A difference whose
paired interval holds zero is not a measured effect.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from autodidact.experiments.page import mean_std
from autodidact.heldout import read_records
from metrics.intervals import (
    effect_label,
    format_diff,
    format_rate,
    paired_interval,
    rate_interval,
)


def successes(path: Path) -> dict[str, list[bool]]:
    """``{task_id: [solved?] * k}`` from an ``autodidact eval`` per-task JSONL."""
    try:
        rows = read_records(path)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return {task: [r >= 1.0 for r in rewards] for task, rewards in rows.items()}


def _sampling_var(solved: list[bool]) -> float:
    """Unbiased variance of one task's success rate over its k samples."""
    k = len(solved)
    p = sum(solved) / k
    return p * (1 - p) / (k - 1) if k > 1 else float("nan")


def noise(rows: dict[str, list[bool]]) -> dict:
    """avg@k with its standard error across tasks and its sampling standard error."""
    rates = [sum(s) / len(s) for s in rows.values()]
    avg, sd = mean_std(rates)
    n = len(rates)
    return {"tasks": n, "k": len(next(iter(rows.values()))), "avg": avg,
            "ci": list(rate_interval(list(rows.values()))),
            "se_tasks": sd / math.sqrt(n),
            "se_sampling": math.sqrt(sum(_sampling_var(s) for s in rows.values())) / n}


def paired(a: dict[str, list[bool]], b: dict[str, list[bool]]) -> dict:
    """B - A on the tasks both evaluated: the difference with its paired 95% interval and the
    label read off it, its standard error across tasks (paired by task) and its sampling
    standard error (the two evaluations' samples apart)."""
    try:
        interval = paired_interval(a, b)
    except ValueError as exc:
        raise SystemExit(f"{exc}: evaluate both with the same config (seed, "
                         "eval.num_tasks) so they draw the same tasks") from None
    common = sorted(set(a) & set(b))
    diffs = [sum(b[t]) / len(b[t]) - sum(a[t]) / len(a[t]) for t in common]
    n = len(common)
    sampling = sum(_sampling_var(a[t]) + _sampling_var(b[t]) for t in common)
    return {"tasks": n, "diff": interval["diff"], "ci": [interval["low"], interval["high"]],
            "label": effect_label(interval["low"], interval["high"]),
            "se_paired": mean_std(diffs)[1] / math.sqrt(n),
            "se_sampling": math.sqrt(sampling) / n,
            "tasks_that_differ": sum(d != 0 for d in diffs)}


def show(name: str, stats: dict) -> str:
    if "diff" in stats:
        return (f"{name}: B - A {format_diff(stats['diff'], stats['ci'])} on {stats['tasks']} "
                f"tasks ({stats['tasks_that_differ']} differ): {stats['label']}; paired s.e. "
                f"{100 * stats['se_paired']:.2f}, sampling s.e. {100 * stats['se_sampling']:.2f}")
    return (f"{name}: avg@{stats['k']} {format_rate(stats['avg'], stats['ci'])} on "
            f"{stats['tasks']} tasks; s.e. across tasks {100 * stats['se_tasks']:.2f}, sampling "
            f"s.e. {100 * stats['se_sampling']:.2f} points")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="per-task JSONL of `autodidact eval --out`")
    ap.add_argument("b", type=Path, nargs="?", default=None, help="a second one, same tasks")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    a = successes(args.a)
    result = {"a": noise(a)}
    if args.b is not None:
        b = successes(args.b)
        result.update(b=noise(b), b_minus_a=paired(a, b))
    for name, stats in result.items():
        print(show(name, stats))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
