"""The ablation's arms and their runs (``autodidact ablation``, ``autodidact/ablation_cli.py``):
AgentEvolver's ablation table at our scale, on the built-in env.

Every arm trains only on synthetic (self-questioned) tasks and is scored on the env's held-out
*original* tasks, from the same seeds and with the same update budget::

    zero-shot                the model before any training (each run's first evaluation)
    +questioning             synthetic tasks, warm-start on their verified references, RL with
                             the outcome reward only (GRPO, no judge, no experience)
    +questioning+navigating  ... and retrieved experiences in half the rollouts (stripped in
                             training)
    +questioning+attributing ... and step labels from the judge (composite advantage)
    full                     all three

For each arm and seed the command runs ``autodidact run`` as a user would (its own processes and
run directory under ``--out``), one after another, so runs never compete for the cores. Finished
runs are reused when asked again with the same settings, so an interrupted ablation goes on
where it stopped. Arms whose warm-start would be the same (the same seed, and experiences either
off or absent from the warm-start examples) share one: the first such run's ``policy_init/`` is
kept in ``OUT/warmstart/`` and linked into the others', which then skip that stage (on a real
model it is most of a run's set-up), and take its held-out evaluations before RL instead of
repeating them (``eval.before_rl=false``).

After every run the table is written (``autodidact/experiments/page.py``): mean ± std over
seeds of avg@k and best@k with 95% intervals, and each arm's change against +questioning with
its paired interval, with a plot, into the doc (``docs/results/ablation.md`` by default)
between markers, keeping any text outside them, and every cell into the doc's json, with the
per-task outcomes of its held-out evaluations (``Result.outcomes``) that the paired intervals
are taken from.
Committed beside the doc, that json is the record a fresh checkout goes on from (``Records``):
run directories are git-ignored. With ``--curve-versions`` the reference and attributing arms
also get held-out points at those weight versions (``autodidact/heldout.py``), recorded with the
cell. At the end the seed-0 runs are overlaid in ``OUT/report`` with ``autodidact report``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path

import click

from autodidact.heldout import curve, run_records
from protocol.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[2]  # the repository: runs start from there

K = 8  # episodes per held-out task by default: avg@K and best@K, as in AgentEvolver's


def common(k: int) -> tuple[str, ...]:
    """What every arm shares: training on self-questioned tasks only, held-out scored with k
    episodes per task."""
    return ("tasks.synthetic_share=1.0", f"eval.k={k}")


def shared_sets(k: int, budget: Budget, sets: list[str]) -> list[str]:
    """Every override all runs get, in order: the common ones, the budget's, the user's."""
    return [*common(k), *budget.sets, *sets]


ARMS: dict[str, tuple[str, ...] | None] = {
    "zero-shot": None,  # not a run: the base model each trained run evaluates first
    "+questioning": ("experience.enabled=false", "learner.advantage=grpo", "judge.workers=0"),
    "+questioning+navigating": ("experience.enabled=true", "learner.advantage=grpo",
                                "judge.workers=0"),
    "+questioning+attributing": ("experience.enabled=false", "learner.advantage=composite",
                                 "judge.workers=1"),
    "full": ("experience.enabled=true", "learner.advantage=composite", "judge.workers=1"),
}
REFERENCE = "+questioning"  # the arm the others are compared with, seed by seed
# With --llm-judge MODEL: +attributing with an LLM as the step judge (``vllm serve`` on MODEL,
# its replies held to the label format by the server) instead of the reference judge.
LLM_JUDGE_ARM = "+questioning+llm-attributing"


def arm_settings(arm: str, llm_judge: str | None = None,
                 nav_sets: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The config overrides that make ``arm`` (None for zero-shot, which is not a run);
    ``nav_sets`` go to the arms that navigate (experience enabled) and to no other."""
    if arm == LLM_JUDGE_ARM:
        if not llm_judge:
            raise ValueError(f"the arm {LLM_JUDGE_ARM} needs --llm-judge MODEL")
        return (*ARMS["+questioning+attributing"], f"judge.serve={llm_judge}",
                "llm.structured_outputs=vllm")
    sets = ARMS[arm]
    if sets is not None and "experience.enabled=true" in sets:
        sets = (*sets, *nav_sets)
    return sets


@dataclass(frozen=True)
class Budget:
    """What one arm may spend; the same for every arm and seed."""

    updates: int
    """Learner updates of RL after the warm-start."""

    sets: tuple[str, ...] = ()
    """Further config overrides that set the budget (warm-start steps, evaluated tasks)."""


DEFAULT_BUDGET = Budget(100, ("eval.num_tasks=100",))
QUICK_BUDGET = Budget(16, ("eval.num_tasks=40", "warmstart.steps=100", "learner.batch_groups=8",
                           "explore.seeds=12"))


NOT_RUN = "not run yet"  # the error of a run --no-run found unfinished


@dataclass
class Result:
    """One arm at one seed: the held-out evaluations its ``summary.json`` holds."""

    arm: str
    seed: int
    run_dir: Path | None
    base: dict = field(default_factory=dict)   # before any training (the zero-shot model)
    warm: dict = field(default_factory=dict)   # after the warm-start
    final: dict = field(default_factory=dict)  # after RL: the arm's number
    updates: int = 0
    seconds: float = 0.0
    error: str = ""
    reused: bool = False  # read from a finished run of an earlier call
    stamp: list[str] = field(default_factory=list)  # what defines the cell (cell_stamp)
    curve: dict[int, float] = field(default_factory=dict)  # held-out avg@k by weight version
    from_record: bool = False  # read from the doc's json, the run directory being gone
    outcomes: dict = field(default_factory=dict)
    """Per-task outcomes of the held-out evaluations, for paired intervals: ``{"split": ...,
    "base" | "warm" | "final": {task_id: "solved/k"}}`` (none for runs made before per-task
    records were kept)."""

    def per_task(self, stage: str) -> dict[str, list[float]] | None:
        """``{task_id: per-sample outcomes}`` of the evaluation ``stage`` ("base", "warm",
        "final"), None when not kept."""
        kept = self.outcomes.get(stage)
        if not kept:
            return None
        return {task: _expand(count) for task, count in kept.items()}


RECORD_STAGES = {"base": "base", "warm": "warm", "final": "rl"}  # Result's -> the run's names


def held_out_outcomes(run_dir: Path, summary: dict, split: str | None = None) -> dict:
    """:attr:`Result.outcomes` from the run's own per-task records, on ``split`` (default: the
    split its summary evaluated; empty for a run made before they were kept)."""
    split = split or (summary.get("success_rl") or summary.get("success_warm") or {}).get(
        "split")
    records = run_records(run_dir, split) if split else {}
    kept = {ours: {task: compact(rewards) for task, rewards in records[theirs].items()}
            for ours, theirs in RECORD_STAGES.items() if theirs in records}
    return {"split": split, **kept} if kept else {}


def compact(rewards: list[float]) -> str:
    """One task's samples as ``"solved/k"``: all a bootstrap needs, a line of the doc's json."""
    return f"{sum(r >= 1.0 for r in rewards)}/{len(rewards)}"


def _expand(count: str) -> list[float]:
    solved, k = (int(x) for x in count.split("/"))
    return [1.0] * solved + [0.0] * (k - solved)


# --- running ---------------------------------------------------------------------------------


def run_name(arm: str, seed: int) -> str:
    return f"{arm.strip('+').replace('+', '-')}-s{seed}"


def run_argv(config: Path | None, run_dir: Path, updates: int | None,
             sets: list[str]) -> list[str]:
    """``autodidact run`` for one run directory, with ``sets`` applied in order (and the
    config's own update limit when ``updates`` is None)."""
    argv = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(run_dir)]
    if updates is not None:
        argv += ["--max-updates", str(updates)]
    if config is not None:
        argv += ["-c", str(config)]
    return argv + [a for s in sets for a in ("--set", s)]


def run_once(argv: list[str], log_path: Path) -> int:
    """Run ``argv`` from the repository root with its output in ``log_path``; the exit code."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        return subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def finished(run_dir: Path, argv: list[str]) -> bool:
    """Whether ``run_dir`` holds a completed run made by exactly ``argv``."""
    stamp, summary = RunDir(run_dir).ablation_argv, RunDir(run_dir).summary
    if not (stamp.exists() and summary.exists()):
        return False
    return (json.loads(stamp.read_text()) == argv[1:]
            and json.loads(summary.read_text()).get("success_rl") is not None)


def read_result(arm: str, seed: int, run_dir: Path, summary: dict | None = None) -> Result:
    """The result of a finished run, from its ``summary.json`` (or ``summary``, its contents)."""
    if summary is None:
        summary = json.loads(RunDir(run_dir).summary.read_text())
    learner = summary.get("learner") or {}
    return Result(arm, seed, run_dir, base=summary.get("success_base") or {},
                  warm=summary.get("success_warm") or {}, final=summary.get("success_rl") or {},
                  updates=int(learner.get("learner/updates", 0)),
                  seconds=float(summary.get("ablation_seconds", 0.0)),
                  outcomes=held_out_outcomes(run_dir, summary))


def test_result(result: Result) -> Result | None:
    """``result``'s run as evaluated on the test split (``autodidact run --final-test``), its
    per-task records included; None when the run did not look at test."""
    if result.run_dir is None or not RunDir(result.run_dir).summary.exists():
        return None
    summary = json.loads(RunDir(result.run_dir).summary.read_text())
    test = summary.get("test") or {}
    if not test.get("rl"):
        return None
    return Result(result.arm, result.seed, result.run_dir, base=test.get("base") or {},
                  warm=test.get("warm") or {}, final=test["rl"], updates=result.updates,
                  seconds=result.seconds,
                  outcomes=held_out_outcomes(result.run_dir, summary, "test"))


def cell_stamp(config: Path | None, updates: int, shared: list[str],
               settings: tuple[str, ...], seed: int) -> list[str]:
    """What defines one arm at one seed, whatever machine or folder runs it: two runs of equal
    stamps are the same experiment."""
    return [str(config), f"updates={updates}", *shared, *settings, f"seed={seed}"]


@dataclass(frozen=True)
class Plan:
    """Everything the cells of one ``autodidact ablation`` call share."""

    out: Path
    config: Path | None
    budget: Budget
    sets: list[str]
    k: int = K
    llm_judge: str | None = None
    nav_sets: tuple[str, ...] = ()
    fresh: bool = False
    records: Records | None = None
    """Finished cells of earlier calls, from the doc's json (None: trust run directories only)."""
    curve_versions: tuple[int, ...] = ()
    """Weight versions evaluated on held-out tasks after RL, for the arms in ``curve_arms``."""
    curve_arms: tuple[str, ...] = ()

    def curve_asked(self, arm: str) -> list[int]:
        """The versions ``arm``'s runs must have a held-out point at (none past the last)."""
        if arm not in self.curve_arms:
            return []
        return [v for v in self.curve_versions if 0 < v < self.budget.updates]


def run_arm(arm: str, seed: int, plan: Plan, may_run: bool = True,
            use_records: bool = True, evaluate: bool = True) -> Result:
    """One trained arm at one seed: reused when its run directory finished before with the same
    argv, or else (``use_records``) when the doc's json recorded it with the same stamp;
    otherwise run (``may_run``). A run directory's missing curve points are evaluated
    (``evaluate``); a record's cannot be (see ``lacks_curve``)."""
    out, budget, fresh = plan.out, plan.budget, plan.fresh
    run_dir = (out / run_name(arm, seed)).resolve()
    shared = shared_sets(plan.k, budget, plan.sets)
    settings = arm_settings(arm, plan.llm_judge, plan.nav_sets)
    stamp = cell_stamp(plan.config, budget.updates, shared, settings, seed)
    warm = SharedWarmStart.of(settings, seed, out, plan.config, shared)
    # A run starting from a kept warm-start has nothing new to evaluate before RL.
    reused = ["eval.before_rl=false"] if warm.serves(run_dir) is not None and not fresh else []
    argv = run_argv(plan.config, run_dir, budget.updates,
                    [*shared, *settings, f"seed={seed}", *reused,
                     f"name=abl-{run_name(arm, seed)}", f"tracking.group={out.name}/{arm}"])
    asked = plan.curve_asked(arm)
    recorded = plan.records.lookup(arm, seed, stamp) \
        if plan.records and use_records and not fresh and not finished(run_dir, argv) else None
    if recorded is not None:
        return recorded
    result = run_or_reuse(arm, seed, run_dir, argv, out / f"{run_dir.name}.log", fresh,
                          may_run=may_run, warm=warm)
    result.stamp = stamp
    if asked and result.final and result.run_dir:
        result.curve = curve(result.run_dir, asked, evaluate=evaluate)
    return result


class Records:
    """The finished cells an earlier call wrote into the doc's json, committed beside the doc.

    A fresh checkout has no run directories, so without these an ablation that spans sessions
    would start over each time. A record stands in for its run when its stamp is the cell's;
    the run directory, when present, still comes first. A record of other settings is
    replaced when its cell runs."""

    def __init__(self, path: Path):
        self.path = path
        data = json.loads(path.read_text()) if path.exists() else {}
        runs = data.get("runs", []) + data.get("other_records", [])
        self.by_cell = {(r["arm"], r["seed"]): r for r in runs
                        if r.get("stamp") and r.get("final") and not r.get("error")}

    def others(self, results: list[Result]) -> list[dict]:
        """The records of cells ``results`` does not hold (other arms or seeds than this call
        asks): kept in the json, so a narrower call never drops them."""
        asked = {(r.arm, r.seed) for r in results}
        return [record for cell, record in self.by_cell.items() if cell not in asked]

    def lookup(self, arm: str, seed: int, stamp: list[str]) -> Result | None:
        record = self.by_cell.get((arm, seed))
        if record is None or record["stamp"] != stamp:
            return None
        result = recorded_result(record)
        result.reused, result.from_record = True, True
        return result


def recorded_result(record: dict) -> Result:
    """A cell as the doc's json records it (``Result``'s fields; the curve's versions and the
    run directory as JSON spells them)."""
    known = {f.name: record[f.name] for f in fields(Result) if f.name in record}
    return Result(**{**known, "run_dir": Path(record["run_dir"]) if record.get("run_dir")
                     else None,
                     "curve": {int(v): s for v, s in (record.get("curve") or {}).items()}})


def lacks_curve(result: Result, plan: Plan) -> bool:
    """Whether a recorded cell misses curve points the plan asks: its weights are gone with its
    run directory, so the cell is run again (keeping the record until the new run replaces
    it)."""
    return result.from_record and any(v not in result.curve
                                       for v in plan.curve_asked(result.arm))


def same_evaluation(a: dict, b: dict) -> bool:
    """Whether two held-out evaluations of the same tasks and sampling seed gave the same
    numbers: the fingerprint of a warm-started policy that outlives its files."""
    return all(a.get(key) == b.get(key) for key in ("avg", "best", "greedy"))


def stale_records(results: list[Result], made: Result) -> list[int]:
    """Indices of the recorded cells of ``made``'s seed whose warm-start evaluated otherwise
    than the one ``made`` started from: re-made on another machine, it is another policy, so
    pairing those cells with ``made`` would compare RL from different starts."""
    return [i for i, r in enumerate(results)
            if r.from_record and r.seed == made.seed and made.warm
            and not same_evaluation(r.warm, made.warm)]


@dataclass(frozen=True)
class SharedWarmStart:
    """A warm-started policy several arms of one seed start RL from, kept in ``folder`` with
    the held-out evaluations of the run that made it (before and after its warm-start).

    It is valid for runs made with exactly ``stamp`` (the config, the shared settings, the seed
    and whether the warm-start shows experiences); a run of another stamp warm-starts itself
    and replaces it."""

    folder: Path
    stamp: list[str]

    @classmethod
    def of(cls, arm_sets: tuple[str, ...], seed: int, out: Path, config: Path | None,
           shared: list[str]) -> SharedWarmStart:
        from autodidact.resolve import resolve_config

        cfg = resolve_config(config, [*shared, *arm_sets, f"seed={seed}"])
        guided = cfg.experience.enabled and cfg.experience.warmstart_share > 0
        kind = "with-experience" if guided else "plain"
        stamp = [str(config), *shared, f"seed={seed}", kind]
        return cls((out / "warmstart" / f"s{seed}-{kind}").resolve(), stamp)

    def record(self) -> dict | None:
        """What was kept: ``{"stamp", "source", "success_base", "success_warm"}``, or None
        when nothing valid for this stamp is."""
        path = self.folder / "record.json"
        if not (path.exists() and (self.folder / "policy_init" / "config.json").exists()):
            return None
        record = json.loads(path.read_text())
        return record if record.get("stamp") == self.stamp else None

    def serves(self, run_dir: Path) -> dict | None:
        """The record, when ``run_dir`` would start from the kept policy (it exists and
        another run made it); else None."""
        record = self.record()
        return record if record is not None and record["source"] != str(run_dir) else None

    def link_into(self, run_dir: Path) -> dict | None:
        """Hard-link the kept policy into ``run_dir/policy_init`` when it serves that run;
        the record, or None."""
        record = self.serves(run_dir)
        if record is None:
            return None
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.folder / "policy_init", RunDir(run_dir).policy_init,
                        copy_function=os.link)
        return record

    def keep_from(self, run_dir: Path, summary: dict) -> None:
        """Keep ``run_dir``'s warm-started policy and its evaluations for the next arms."""
        policy = RunDir(run_dir).policy_init
        if not (policy / "config.json").exists():
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.copytree(policy, self.folder / "policy_init", copy_function=os.link)
        copy_before_rl(run_dir, self.folder, summary)
        (self.folder / "record.json").write_text(json.dumps({
            "stamp": self.stamp, "source": str(run_dir),
            "success_base": summary.get("success_base"),
            "success_warm": summary.get("success_warm")}, indent=1))


def copy_before_rl(source: Path, target: Path, summary: dict) -> None:
    """The per-task records of ``source``'s evaluations before RL (base and warm-start, on the
    split ``summary`` names) into ``target``'s ``eval/``, laid out as in a run directory: a run
    that starts from a kept warm-start takes them with its evaluations."""
    split = (summary.get("success_warm") or {}).get("split")
    for stage in ("base", "warm") if split else ():
        kept = RunDir(source).heldout_records(split, stage)
        if kept.exists():
            copy = RunDir(target).heldout_records(split, stage)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kept, copy)


def run_or_reuse(label: str, seed: int, run_dir: Path, argv: list[str], log_path: Path,
                 fresh: bool = False, may_run: bool = True,
                 warm: SharedWarmStart | None = None) -> Result:
    """The run ``argv`` makes in ``run_dir``: read back when it finished before with the same
    ``argv`` (unless ``fresh``), else run from an empty directory (a half-finished run is not
    resumed: every run has the same start; ``warm``'s policy, when kept, stands in for the
    warm-start) and stamped; with ``may_run`` false, an unfinished result instead of
    running."""
    if not fresh and finished(run_dir, argv):
        result = read_result(label, seed, run_dir)
        result.reused = True
        return result
    if not may_run:
        return Result(label, seed, run_dir, error=NOT_RUN)
    shutil.rmtree(run_dir, ignore_errors=True)
    kept = warm.link_into(run_dir) if warm is not None and not fresh else None
    t0 = time.monotonic()
    code = run_once(argv, log_path)
    seconds = time.monotonic() - t0
    summary = RunDir(run_dir).summary
    if code != 0 or not summary.exists():
        return Result(label, seed, run_dir, seconds=seconds,
                      error=f"exit code {code}; see {log_path}")
    data = json.loads(summary.read_text())
    data["ablation_seconds"] = seconds
    data["ablation_shared_warmstart"] = kept is not None
    if kept is not None:  # the same policy's evaluations, made by the run that warm-started
        for key in ("success_base", "success_warm"):
            data[key] = data.get(key) or kept[key]
        copy_before_rl(warm.folder, run_dir, kept)
    summary.write_text(json.dumps(data, indent=2, default=str))
    RunDir(run_dir).ablation_argv.write_text(json.dumps(argv[1:]))
    if warm is not None and kept is None:
        warm.keep_from(run_dir, data)
    return read_result(label, seed, run_dir, data)


def zero_shot(results: list[Result], seed: int) -> Result:
    """The zero-shot arm at ``seed``: the base-model evaluation of that seed's trained runs.

    Every run of a seed builds the same base model and evaluates it on the same tasks with the
    same sampling seed, so the runs agree; should they not, their mean is taken."""
    runs = [r for r in results if r.seed == seed and r.base]
    if not runs:
        return Result("zero-shot", seed, None, error=NOT_RUN)  # no run of this seed finished
    bases = [r.base for r in runs]
    final = {key: sum(b[key] for b in bases) / len(bases)
             for key in ("avg", "best", "greedy") if all(key in b for b in bases)}
    kept = next((r.outcomes for r in runs if r.outcomes.get("base")), {})
    outcomes = {"split": kept["split"], "base": kept["base"], "final": kept["base"]} \
        if kept else {}
    return Result("zero-shot", seed, None, base=bases[0], final=final, outcomes=outcomes)


def controlled_keys() -> set[str]:
    """Config keys the ablation sets itself: what defines an arm, the score and the seed."""
    keys = {s.split("=", 1)[0] for arm_sets in ARMS.values() if arm_sets for s in arm_sets}
    return keys | {s.split("=", 1)[0] for s in common(K)} | {"seed", "name", "tracking.group"}


def run_all(arms: list[str], seeds: list[int], plan: Plan, may_run: bool = True,
            publish=None) -> list[Result]:
    """Every cell, seed by seed: first what is reused (run directories, then records), then
    the rest run one at a time, with ``publish(shown results)`` after each so an interrupted
    call loses at most the cell it was running."""
    trained = [(arm, seed) for seed in seeds for arm in arms
               if arm_settings(arm, plan.llm_judge) is not None]
    if not trained:
        trained = [(REFERENCE, seed) for seed in seeds]  # zero-shot alone still needs a base
    plan.out.mkdir(parents=True, exist_ok=True)
    results = [run_arm(arm, seed, plan, may_run=False, evaluate=may_run)
               for arm, seed in trained]
    for result in results:
        if not result.error:
            announce(result, plan.k, "(reused from the doc's json)" if result.from_record
                     else "(reused)")
    pending = deque(i for i, r in enumerate(results) if r.error or lacks_curve(r, plan))
    click.echo(f"ablation: {len(trained)} runs ({len(seeds)} seed(s) x "
               f"{len({a for a, _ in trained})} trained arm(s), {plan.budget.updates} RL "
               f"updates each) into {plan.out}; {len(pending)} "
               f"{'to run' if may_run else 'not run yet (--no-run)'}")
    t0, done = time.monotonic(), 0
    while may_run and pending:
        i = pending.popleft()
        arm, seed = results[i].arm, results[i].seed
        click.echo(f"{arm} seed {seed}: running (log "
                   f"{plan.out / (run_name(arm, seed) + '.log')}); {len(pending)} after it")
        results[i] = run_arm(arm, seed, plan, use_records=False)
        done += 1
        left = (time.monotonic() - t0) / done * len(pending)
        announce(results[i], plan.k, f"about {left / 60:.0f} min left")
        stale = [j for j in stale_records(results, results[i]) if j not in pending]
        if stale:
            click.echo(f"seed {seed}: the warm-start made again evaluates {results[i].warm} "
                       f"against {results[stale[0]].warm} recorded: the seed's "
                       f"{len(stale)} recorded run(s) are run again from it")
            pending.extendleft(reversed(stale))
        if publish is not None:
            publish(shown(results, arms, seeds))
    return shown(results, arms, seeds)


def announce(result: Result, k: int, note: str) -> None:
    head = f"{result.arm} seed {result.seed}"
    if result.error == NOT_RUN:
        return
    if result.error:
        click.echo(f"{head}: FAILED, {result.error}")
        return
    click.echo(f"{head}: held-out avg@{k} {result.base.get('avg', math.nan):.1%} -> warm-start "
               f"{result.warm.get('avg', math.nan):.1%} -> RL {result.final['avg']:.1%} "
               f"(best@{k} {result.final['best']:.1%}), {result.updates} updates, "
               f"{result.seconds / 60:.1f} min; {note}")


def shown(results: list[Result], arms: list[str], seeds: list[int]) -> list[Result]:
    """The asked arms' results, with zero-shot (read off each seed's runs) first if asked."""
    trained = [r for r in results if r.arm in arms]
    return [zero_shot(results, s) for s in seeds] + trained if "zero-shot" in arms else trained
