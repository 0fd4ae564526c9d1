"""Two settings compared over seeds on the same held-out tasks: what a config choice rests on.

    python -m bench.compare_arms --a runs/x-s0 runs/x-s1 --b runs/y-s0 runs/y-s1 [--json F]

``--a`` and ``--b`` are finished run directories, the i-th of each made at the same seed (so
each pair evaluated the same draw of tasks). For every pair: both runs' success at ``--stage``
(the per-task records in ``eval/heldout-<split>-<stage>.jsonl``) and B - A with its paired 95%
interval over tasks (``bench.eval_noise``). Over the pairs: the mean difference with the
t-interval of the per-seed differences, and the label read off that interval. A choice made on
validation reads ``--split validation`` (the default); the test split is for reporting once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.eval_noise import noise, paired, successes
from metrics.intervals import effect_label, format_diff, seed_paired_interval
from protocol.messages import HELD_OUT_SPLITS
from protocol.run_dir import HELD_OUT_STAGES, RunDir


def records(run_dir: Path, split: str, stage: str) -> dict[str, list[bool]]:
    path = RunDir(run_dir).heldout_records(split, stage)
    if not path.exists():
        raise SystemExit(f"{path}: no per-task records of the {stage} stage on {split}; is "
                         f"{run_dir} a finished run (autodidact run writes them)?")
    return successes(path)


def compare_pair(a_dir: Path, b_dir: Path, split: str, stage: str) -> dict:
    """One seed: both runs' rates and B - A paired by task."""
    a, b = records(a_dir, split, stage), records(b_dir, split, stage)
    return {"a": str(a_dir), "b": str(b_dir), "a_rate": noise(a), "b_rate": noise(b),
            "b_minus_a": paired(a, b)}


def over_seeds(pairs: list[dict]) -> dict:
    """The mean of the per-seed differences with their t-interval."""
    diffs = [p["b_minus_a"]["diff"] for p in pairs]
    if len(diffs) < 2:  # one seed's spread is unknown: no interval, rather than a NaN in json
        return {"seeds": 1, "diff": diffs[0], "ci": None, "label": "one seed: no interval",
                "per_seed": diffs}
    low, high = seed_paired_interval(diffs)
    return {"seeds": len(diffs), "diff": sum(diffs) / len(diffs), "ci": [low, high],
            "label": effect_label(low, high), "per_seed": diffs}


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
    pairs = [compare_pair(a, b, args.split, args.stage) for a, b in zip(args.a, args.b)]
    result = {"what": args.what, "command": " ".join(["python -m bench.compare_arms",
                                                      *(argv or sys.argv[1:])]),
              "split": args.split, "stage": args.stage, "pairs": pairs,
              "over_seeds": over_seeds(pairs)}
    for p in pairs:
        d = p["b_minus_a"]
        print(f"{p['a']} -> {p['b']}: B - A {format_diff(d['diff'], d['ci'])}: {d['label']}")
    o = result["over_seeds"]
    interval = o["ci"] or (float("nan"), float("nan"))
    print(f"over {o['seeds']} seeds: B - A {format_diff(o['diff'], interval)}: {o['label']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
