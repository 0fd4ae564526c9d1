"""Two settings compared over seeds on the same held-out tasks: what a config choice rests on.

    python -m bench.compare_arms --a runs/x-s0 runs/x-s1 --b runs/y-s0 runs/y-s1 [--json F]

``--a`` and ``--b`` are finished run directories, the i-th of each made at the same seed (so
each pair evaluated the same draw of tasks). For every pair: both runs' success at ``--stage``
(the per-task records in ``eval/heldout-<split>-<stage>.jsonl``) and B - A with its paired 95%
interval over tasks (``bench.eval_noise``), and each learner's updates and the share of groups
it set aside as uninformative. Over the pairs, as the rest of the project reads a
change over seeds (autodidact/experiments/page.py): B - A on every seed's tasks pooled, with its
paired bootstrap interval and label; beside it, the stricter t-interval of the per-seed
differences, which with three seeds is wide. A choice made on
validation reads ``--split validation`` (the default); the test split is for reporting once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.eval_noise import noise, paired, successes
from bench.output import command_line, write_result
from metrics.intervals import effect_label, format_diff, seed_paired_interval
from metrics.jsonl import read_metrics
from protocol.messages import HELD_OUT_SPLITS
from protocol.run_dir import HELD_OUT_STAGES, RunDir


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=Path, nargs="+", required=True, help="run directories, arm A")
    ap.add_argument("--b", type=Path, nargs="+", required=True,
                    help="run directories, arm B, at the same seeds in the same order")
    ap.add_argument("--split", default="validation", choices=HELD_OUT_SPLITS)
    ap.add_argument("--stage", default="rl", choices=HELD_OUT_STAGES)
    ap.add_argument("--what", default="", help="a sentence for the json: what is compared")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if len(args.a) != len(args.b):
        raise SystemExit(f"--a has {len(args.a)} runs and --b {len(args.b)}: give one of each "
                         "per seed, in the same order")
    a_runs = [records(d, args.split, args.stage) for d in args.a]
    b_runs = [records(d, args.split, args.stage) for d in args.b]
    pairs = [compare_pair(*four) for four in zip(a_runs, b_runs, args.a, args.b)]
    result = {"what": args.what, "command": command_line("bench.compare_arms", argv),
              "split": args.split, "stage": args.stage, "pairs": pairs,
              "over_seeds": over_seeds(a_runs, b_runs, pairs)}
    for p in pairs:
        d = p["b_minus_a"]
        print(f"{p['a']} -> {p['b']}: B - A {format_diff(d['diff'], d['ci'])}: {d['label']}; "
              f"updates {p['a_learner']['updates']} -> {p['b_learner']['updates']}")
    o = result["over_seeds"]
    p = o["pooled"]
    print(f"{o['seeds']} seeds' tasks pooled: B - A {format_diff(p['diff'], p['ci'])}: "
          f"{p['label']}")
    t = o["t_ci"] or (float("nan"), float("nan"))
    print(f"t over {o['seeds']} seeds: B - A {format_diff(o['mean'], t)}: {o['t_label']}")
    if (u := o["uninformative_share"]) is not None:
        t = u["t_ci"] or (float("nan"), float("nan"))
        print(f"groups set aside as uninformative: B - A {format_diff(u['mean'], t)}: "
              f"{u['t_label']}")
    write_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
