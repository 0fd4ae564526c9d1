"""Outcome-only vs step attribution at the same seeds and budget, on the built-in environment.

    python -m bench.attribution [--updates 200] [--seeds 0] [--config configs/default.yaml]
                                [--out runs/bench-attr] [--reuse] [--set k=v ...] [--json F]

For each seed, runs `autodidact run` twice — `learner.advantage=grpo` with no judges, then
`learner.advantage=composite` with the reference judge — and prints from each run's replay
store and summary:

* training success per window of 10 policy versions;
* updates each arm needs to reach the outcome-only arm's final level (its last 20 versions),
  and their ratio: the data efficiency of attribution (> 1: attribution needs fewer updates);
* held-out avg@k after warm-start and after RL with 95% intervals, and attribution − outcome
  after RL with its paired interval and the label read off it;
* for the attribution arm: labelled groups vs groups trained outcome-only past the deadline.

With ``--json F`` the same numbers go to F, per seed (:func:`bench.run_compare.arms_record`,
and the judge's coverage), with the ratio and the command that wrote them.

Everything else (warm-start, experience settings, task mixture) is the config's; pass
`--set experience.enabled=false` to compare the two without self-navigating in either arm.
"""

from __future__ import annotations

from pathlib import Path

from autodidact.experiments.arms import read_result
from autodidact.experiments.page import comparison_line, held_out_line
from bench.output import command_line, write_result
from bench.run_compare import (
    WINDOW,
    arguments,
    arms_record,
    final_level,
    rollouts,
    run,
    success_curve,
    updates_to_reach,
)
from metrics.jsonl import read_metrics

ARMS = {
    "outcome": ["learner.advantage=grpo", "judge.workers=0"],
    "attribution": ["learner.advantage=composite", "judge.workers=1"],
}


def judge_coverage(run_dir: Path) -> tuple[int, int]:
    """(groups trained with labels, groups trained outcome-only past the deadline)."""
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    return (int(sum(r.get("learner/labelled_groups", 0) for r in rows)),
            int(sum(r.get("learner/judge_timeouts", 0) for r in rows)))


def compare(out: Path, seed: int, args) -> dict:
    """One seed's pair of runs, printed; returns its :func:`arms_record` with the judge's
    coverage."""
    dirs = {arm: run(out, f"{arm}-s{seed}", args.config, args.updates,
                     [*args.sets, f"seed={seed}", *sets], args.reuse)
            for arm, sets in ARMS.items()}
    curves = {arm: success_curve(rollouts(d), unguided_only=False) for arm, d in dirs.items()}
    level = final_level(curves["outcome"], args.updates)
    reach = {arm: updates_to_reach(c, level) for arm, c in curves.items()}
    print(f"\nseed {seed}: training success per 10 versions")
    for arm, curve in curves.items():
        print(f"  {arm:11s} " + " ".join(f"{v}:{s:.2f}" for v, s in curve.items()))
    print(f"  outcome-only final level (last 20 versions): {level:.3f}")
    held = {arm: read_result(arm, seed, d) for arm, d in dirs.items()}
    for arm, result in held.items():
        print(f"  {arm:11s} reaches it at update {reach[arm]}; held-out avg@k "
              f"{held_out_line(result)}")
    print(f"  {comparison_line(held['outcome'], held['attribution'])}")
    labelled, timeouts = judge_coverage(dirs["attribution"])
    print(f"  attribution arm: {labelled} groups trained on step labels, {timeouts} outcome-only "
          "past the judge deadline")
    return {"seed": seed, **arms_record(curves, level, held, "outcome"),
            "labelled_groups": labelled, "judge_timeouts": timeouts}


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, 200, "default.yaml", "bench-attr")
    parser.add_argument("--seeds", default="0", help="comma-separated, one pair of runs each")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    seeds = [compare(args.out, int(s), args) for s in args.seeds.split(",")]
    reaches = [{arm: a["reaches_level_at"] for arm, a in r["arms"].items()} for r in seeds]
    both = [(r["outcome"], r["attribution"]) for r in reaches
            if r["outcome"] is not None and r["attribution"] is not None]
    ratio = None
    if both:
        # A window's first version is reported; the level is reached by the window's end.
        ratio = sum(o + WINDOW for o, _ in both) / sum(a + WINDOW for _, a in both)
        print(f"\nupdates to the outcome-only final level, summed over {len(both)} seed(s): "
              f"outcome-only / attribution = {ratio:.2f}x")
    if args.json:
        write_result({"command": command_line("bench.attribution", argv), "seeds": seeds,
                      "outcome_over_attribution_updates": ratio}, args.json)


if __name__ == "__main__":
    main()
