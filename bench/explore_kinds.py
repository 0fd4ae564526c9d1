"""What goal-directed exploration changes in the task store: the share of event, read and long
(three or more calls on one entity) tasks, random walks alone against random walks with probes
(``explore.kind_target``), the same explorations each, over several seeds.

    python -m bench.explore_kinds --env shop --json docs/results/explore_kinds_shop.json

Each arm and seed is one ``autodidact explore`` (schema proposer, one round over the env's
training worlds) in a fresh directory. Per arm: each kind's share of the stored tasks, its
mean over seeds with a t interval (the tasks of one run share explorations, so the seed is the
unit), the tasks stored and the seconds; B - A per kind from the per-seed differences.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.output import command_line, write_result
from metrics.intervals import effect_label, seed_interval, seed_paired_interval
from protocol.config import load_config
from questioning.coverage import TASK_KINDS, task_kinds
from questioning.factory import TaskFactory
from questioning.task_store import TaskStore


def explore_once(env: str, kind_target: float, seed: int, sets: list[str]) -> dict:
    """One explore run: each kind's share of what it stored, the tasks and the seconds."""
    cfg = load_config(None, [f"env.name={env}", "explore.proposer=schema", f"seed={seed}",
                             f"explore.kind_target={kind_target}", *sets])
    with tempfile.TemporaryDirectory() as folder, TaskStore(Path(folder)) as store:
        t0 = time.monotonic()
        factory = TaskFactory(cfg, Path(folder), store, say=lambda _: None)
        summary = factory.run(rounds=1)
        tasks = store.all()
        seconds = time.monotonic() - t0
    kinds = [k for t in tasks for k in task_kinds(t)]
    return {"seed": seed, "tasks": len(tasks), "seconds": round(seconds, 1),
            "explorations": summary.get("explorations"),
            "shares": {k: kinds.count(k) / max(len(tasks), 1) for k in TASK_KINDS}}


def arm(runs: list[dict]) -> dict:
    out = {"runs": runs, "tasks_mean": sum(r["tasks"] for r in runs) / len(runs),
           "seconds_mean": sum(r["seconds"] for r in runs) / len(runs)}
    for kind in TASK_KINDS:
        values = [r["shares"][kind] for r in runs]
        out[kind] = {"mean": sum(values) / len(values), "ci": list(seed_interval(values))}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True)
    parser.add_argument("--kind-target", type=float, default=0.1, help="arm B's target")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="more config overrides for both arms, section.key=value")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    a = [explore_once(args.env, 0.0, s, args.sets) for s in range(args.seeds)]
    b = [explore_once(args.env, args.kind_target, s, args.sets) for s in range(args.seeds)]
    diff = {}
    for kind in TASK_KINDS:
        deltas = [rb["shares"][kind] - ra["shares"][kind] for ra, rb in zip(a, b)]
        low, high = seed_paired_interval(deltas)
        diff[kind] = {"diff": sum(deltas) / len(deltas), "ci": [low, high],
                      "label": effect_label(low, high)}
    result = {"command": command_line("bench.explore_kinds", argv), "env": args.env,
              "a": {"kind_target": 0.0, **arm(a)},
              "b": {"kind_target": args.kind_target, **arm(b)}, "b_minus_a": diff}
    write_result(result, args.json, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
