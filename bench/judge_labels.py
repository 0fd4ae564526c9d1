"""What an LLM step judge said during a run, read off its raw replies.

    python -m bench.judge_labels RUN_DIR [RUN_DIR ...] [--json OUT]

A run whose judge is an LLM (``judge.serve`` or ``llm.url``) logs every request and raw reply in
``RUN/llm/judge-*.jsonl``. For each run this prints:

* how many replies, steps and trajectories it labelled, and the replies that did not parse;
* the GOOD fraction by step position (1, 2, ...): a judge that labels by position rather
  than by what the step did shows a pattern here whatever the trajectories were;
* the GOOD fraction on the steps of successful and of failed trajectories (the outcome the
  judge was told), and the same restricted to step 1, which separates the outcome from the
  position when successful episodes are shorter;
* agreement with the reference judge: the worker's ``judge/agreement`` cross-check, weighted by
  the steps of each logged window.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from judge.step_judges import parse_judgement
from metrics.jsonl import read_metrics
from protocol.run_dir import LLM_REPLIES, RunDir

# build_judge_messages writes these two lines into every request
_OUTCOME = re.compile(r"^Outcome: (success|partial success|failure) ", re.M)
_STEPS = re.compile(r"^Steps \((\d+)\):", re.M)


def replies(run_dir: Path) -> list[dict]:
    """Every logged judge request of the run, oldest first."""
    folder = RunDir(run_dir).path / LLM_REPLIES
    rows = []
    for path in sorted(folder.glob("judge-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r.get("t", 0.0))


def label_stats(rows: list[dict]) -> dict:
    """GOOD fractions by position and by outcome, from the raw replies that parse."""
    by_position: dict[int, list[int]] = defaultdict(list)
    by_outcome: dict[str, list[int]] = defaultdict(list)
    first_step: dict[str, list[int]] = defaultdict(list)
    unparsed = unreadable = 0
    for row in rows:
        outcome, steps = _OUTCOME.search(row["asked"]), _STEPS.search(row["asked"])
        if outcome is None or steps is None:
            unreadable += 1  # not a step-judge request (or clipped before its header)
            continue
        labels, _ = parse_judgement(row.get("reply"), int(steps.group(1)))
        if labels is None:
            unparsed += 1
            continue
        won = "success" if outcome.group(1) != "failure" else "failure"
        for position, label in enumerate(labels, 1):
            by_position[position].append(label)
        by_outcome[won] += labels
        first_step[won].append(labels[0])
    return {
        "replies": len(rows), "unparsed": unparsed, "unreadable": unreadable,
        "labelled_trajectories": sum(len(v) for v in first_step.values()),
        "steps": sum(len(v) for v in by_outcome.values()),
        "good_by_position": {p: _share(v) for p, v in sorted(by_position.items())},
        "steps_by_position": {p: len(v) for p, v in sorted(by_position.items())},
        "good_by_outcome": {k: _share(v) for k, v in sorted(by_outcome.items())},
        "good_first_step_by_outcome": {k: _share(v) for k, v in sorted(first_step.items())},
    }


def _share(labels: list[int]) -> float:
    return sum(labels) / len(labels)


def agreement(run_dir: Path) -> float | None:
    """The reference cross-check's agreement, weighted by each window's labelled steps."""
    rows = [r for r in read_metrics(run_dir, "judge")
            if "judge/agreement" in r and r.get("judge/steps")]
    weight = sum(r["judge/steps"] for r in rows)
    return sum(r["judge/agreement"] * r["judge/steps"] for r in rows) / weight if weight else None


def show(run_dir: Path, stats: dict, agree: float | None) -> str:
    positions = "  ".join(f"{p}: {g:.0%} of {stats['steps_by_position'][p]}"
                          for p, g in stats["good_by_position"].items())
    outcome = "  ".join(f"{k} {v:.0%}" for k, v in stats["good_by_outcome"].items())
    first = "  ".join(f"{k} {v:.0%}" for k, v in stats["good_first_step_by_outcome"].items())
    return "\n".join([
        f"{run_dir}: {stats['replies']} replies, {stats['labelled_trajectories']} trajectories "
        f"labelled, {stats['steps']} steps, {stats['unparsed']} unparsed",
        f"  GOOD by step position   {positions}",
        f"  GOOD by outcome         {outcome}",
        f"  GOOD at step 1          {first}",
        "  agreement with the reference judge (steps-weighted): "
        + ("–" if agree is None else f"{agree:.0%}")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {}
    for run in args.runs:
        rows = replies(run)
        if not rows:
            raise SystemExit(f"{run}: no judge replies in {RunDir(run).llm_replies('judge-0')}"
                             " (the run's judge was not an LLM)")
        stats, agree = label_stats(rows), agreement(run)
        print(show(run, stats, agree))
        report[str(run)] = {**stats, "agreement": agree}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
