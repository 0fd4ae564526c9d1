"""Two settings' runs paired by task, seed by seed, on one split and stage: what a choice of
settings rests on. ``python -m bench.compare_arms`` (two lists of run directories),
``python -m bench.eval_noise`` (two per-task files) and ``autodidact sweep`` (a grid of arms
against a baseline) all read their comparisons from here.

A run's per-task records (``eval/heldout-<split>-<stage>.jsonl``) hold k outcomes per task.
Two runs of one seed evaluated the same tasks, so B - A is paired by task (the paired
bootstrap of ``metrics/intervals.py``); over seeds, every seed's tasks are pooled into one
sample (each seed draws its own tasks, so a task id is prefixed by its seed's place), and
beside it the stricter t-interval of the per-seed differences, which with three seeds is wide.
"""

from __future__ import annotations

import math
from pathlib import Path

from autodidact.experiments.page import mean_std
from autodidact.heldout import read_records
from metrics.intervals import effect_label, paired_interval, rate_interval, seed_paired_interval
from metrics.jsonl import read_metrics
from protocol.run_dir import RunDir

# --- one evaluation, and two of the same tasks --------------------------------------------------


def successes(path: Path) -> dict[str, list[bool]]:
    """``{task_id: [solved?] * k}`` from a file of per-task records."""
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


# --- two arms' runs over seeds -----------------------------------------------------------------


def records(run_dir: Path, split: str, stage: str) -> dict[str, list[bool]]:
    path = RunDir(run_dir).heldout_records(split, stage)
    if not path.exists():
        raise SystemExit(f"{path}: no per-task records of the {stage} stage on {split}; is "
                         f"{run_dir} a finished run (autodidact run writes them)?")
    return successes(path)


def compare_pair(a: dict, b: dict, a_dir: Path, b_dir: Path) -> dict:
    """One seed: both runs' rates and B - A paired by task, and what each learner did."""
    return {"a": str(a_dir), "b": str(b_dir), "a_rate": noise(a), "b_rate": noise(b),
            "b_minus_a": paired(a, b), "a_learner": learner_totals(a_dir),
            "b_learner": learner_totals(b_dir)}


def learner_totals(run_dir: Path) -> dict:
    """The run's updates and the share of the groups replay offered that it set aside as
    uninformative (learner.skip_uninformative), over the whole run."""
    steps = [r for r in read_metrics(run_dir, "learner") if "learner/groups" in r]
    trained = sum(r["learner/groups"] for r in steps)
    skipped = sum(r.get("learner/uninformative_groups", 0) for r in steps)
    return {"updates": len(steps), "groups_trained": trained, "uninformative_groups": skipped,
            "uninformative_share": skipped / (skipped + trained) if steps else None}


def pooled(per_seed: list[dict]) -> dict:
    """Every seed's per-task outcomes as one sample (each seed draws its own tasks)."""
    return {f"seed {i}/{task}": outcomes for i, tasks in enumerate(per_seed)
            for task, outcomes in tasks.items()}


def over_seeds(a_runs: list[dict], b_runs: list[dict], pairs: list[dict]) -> dict:
    """B - A over every seed's tasks pooled (paired by task), and the mean of the per-seed
    differences with their t-interval (none with one seed: its spread is unknown)."""
    diffs = [p["b_minus_a"]["diff"] for p in pairs]
    return {"seeds": len(diffs), "pooled": paired(pooled(a_runs), pooled(b_runs)),
            **seed_change(diffs), "uninformative_share": share_change(pairs)}


def seed_change(diffs: list[float]) -> dict:
    """Per-seed differences, their mean and its t-interval (none with one seed: its spread is
    unknown)."""
    out = {"per_seed": diffs, "mean": sum(diffs) / len(diffs), "t_ci": None,
           "t_label": "one seed: no interval"}
    if len(diffs) > 1:
        low, high = seed_paired_interval(diffs)
        out.update(t_ci=[low, high], t_label=effect_label(low, high))
    return out


def share_change(pairs: list[dict]) -> dict | None:
    """B - A in the share of groups set aside as uninformative, per seed and with the
    t-interval over seeds; None where a run of a pair had no learner metrics."""
    shares = [(p["a_learner"]["uninformative_share"], p["b_learner"]["uninformative_share"])
              for p in pairs]
    if any(a is None or b is None for a, b in shares):
        return None
    change = seed_change([b - a for a, b in shares])
    if change["t_ci"] is not None:  # a share of groups without signal: lower is better, and
        # "helps"/"hurts" read off the sign would say the opposite; the words say which way
        low, high = change["t_ci"]
        change["t_label"] = "fewer" if high < 0 else "more" if low > 0 else "no change"
    return {"a": [a for a, _ in shares], "b": [b for _, b in shares],
            "a_mean": sum(a for a, _ in shares) / len(shares),
            "b_mean": sum(b for _, b in shares) / len(shares), **change}
