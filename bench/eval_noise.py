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
from pathlib import Path

from autodidact.experiments.pairing import noise, paired, successes
from metrics.intervals import format_diff, format_rate


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
