"""Two settings compared over seeds on the same held-out tasks: what a config choice rests on.

    python -m bench.compare_arms --a runs/x-s0 runs/x-s1 --b runs/y-s0 runs/y-s1 [--json F]

``--a`` and ``--b`` are finished run directories, the i-th of each made at the same seed (so
each pair evaluated the same draw of tasks). For every pair: both runs' success at ``--stage``
(the per-task records in ``eval/heldout-<split>-<stage>.jsonl``) and B - A with its paired 95%
interval over tasks, and each learner's updates and the share of groups it set aside as
uninformative. Over the pairs: B - A on every seed's tasks pooled, with its paired bootstrap
interval and label; beside it, the stricter t-interval of the per-seed differences, which with
three seeds is wide. The pairing is ``autodidact/experiments/pairing.py``'s, which ``autodidact
sweep`` reads a grid's arms with too. A choice made on
validation reads ``--split validation`` (the default); the test split is for reporting once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autodidact.experiments.pairing import compare_pair, over_seeds, records
from bench.output import command_line, write_result
from metrics.intervals import format_diff
from protocol.messages import HELD_OUT_SPLITS
from protocol.run_dir import HELD_OUT_STAGES


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
