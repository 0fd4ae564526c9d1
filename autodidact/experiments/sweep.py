"""``autodidact sweep`` (the command: ``autodidact/sweep_cli.py``): settings chosen on
validation, in one command.

    arms      the cartesian product of the ``--grid KEY=V1,V2`` values, checked before any run
    runs      one ``autodidact run`` per arm and seed, one at a time (2 cores), each reused when
              it finished before with the same command (``arms.run_or_reuse``), so a sweep cut
              off goes on where it stopped
    pairing   each arm against the baseline, task by task on validation, every seed's tasks
              pooled and the t-interval over seeds beside it (``pairing.py``, as
              ``bench.compare_arms`` pairs)
    choice    :data:`RULE`, read off the paired intervals alone

It never looks at test: every run gets ``eval.final_test=false`` and a setting of it is
refused (no other config key evaluates on test: the split a run evaluates on is not a
setting), only validation records are read, and a run whose ``eval/test_looks.jsonl`` holds a
line fails the sweep (:func:`runs_that_looked`).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import click

from autodidact.experiments.arms import NOT_RUN, ROOT, Result, compact, run_argv, run_or_reuse
from autodidact.experiments.page import (
    change_over_seeds,
    change_text,
    mean_std,
    no_nan,
    rate_over_seeds,
    rate_text,
)
from autodidact.experiments.pairing import compare_pair, over_seeds, records
from autodidact.resolve import resolve_config
from autodidact.stages import test_looks as count_test_looks
from metrics.intervals import format_diff
from protocol.config import RunConfig
from protocol.errors import ConfigError

SPLIT = "validation"  # the only split a sweep reads
NO_TEST = "eval.final_test=false"  # given to every run, after everything else
RESULT_STAGE = {"rl": "final", "warm": "warm"}  # --stage -> the Result's evaluation
STAGE_WORDS = {"rl": "after RL", "warm": "after the warm-start"}
RULE = ("the chosen arm is the one whose paired 95% interval against the baseline (every "
        "seed's validation tasks pooled) lies above 0, with the largest mean gain; when no arm's "
        "does, the baseline: no arm beats the baseline")

# Keys the sweep sets itself, and why a --set or --grid may not.
CONTROLLED = {
    "seed": "--seeds gives the seeds",
    "name": "--name names the sweep and its runs",
    "eval.final_test": "a sweep never looks at test (every run gets eval.final_test=false; "
                       "look once after choosing: autodidact eval --final-test --run-dir RUN)",
}

Arm = tuple[tuple[str, str], ...]  # ((key, value), ...) in the grid's order


# --- the grid ----------------------------------------------------------------------------------


def parse_grid(texts: tuple[str, ...] | list[str]) -> dict[str, list[str]]:
    """``{key: values}`` from ``--grid KEY=V1,V2`` texts, in the order given."""
    grid: dict[str, list[str]] = {}
    for text in texts:
        key, sep, values = (part.strip() for part in text.partition("="))
        listed = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(listed):
            raise click.BadParameter(f"{text!r} is not KEY=V1,V2,... (values separated by "
                                     "commas, none empty)", param_hint="--grid")
        if key in grid:
            raise click.BadParameter(f"{key} is given twice: list all its values in one "
                                     "--grid", param_hint="--grid")
        if len(set(listed)) != len(listed):
            raise click.BadParameter(f"{key} lists a value twice", param_hint="--grid")
        grid[key] = listed
    if math.prod(len(v) for v in grid.values()) < 2:
        raise click.BadParameter("the grid makes a single arm: give some key two values or "
                                 "more", param_hint="--grid")
    return grid


def grid_arms(grid: dict[str, list[str]]) -> list[Arm]:
    """Every combination of the grid's values: the sweep's arms, the first key slowest."""
    return [tuple(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def parse_baseline(text: str | None, grid: dict[str, list[str]]) -> Arm:
    """The arm ``--baseline KEY=V,...`` names; every key it leaves out takes its first grid
    value (with no ``--baseline``: the arm of every key's first value)."""
    chosen = {key: values[0] for key, values in grid.items()}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in grid:
            raise click.BadParameter(f"{item!r}: give KEY=VALUE with KEY one of the grid's "
                                     f"({', '.join(grid)})", param_hint="--baseline")
        if value not in grid[key]:
            raise click.BadParameter(f"{key}={value} is not in the grid; {key} takes "
                                     f"{', '.join(grid[key])}", param_hint="--baseline")
        chosen[key] = value
    return tuple(chosen.items())


def arm_sets(arm: Arm) -> list[str]:
    return [f"{key}={value}" for key, value in arm]


def arm_text(arm: Arm | dict[str, str]) -> str:
    """``key=value ...``: an arm, or its json form (a mapping)."""
    return " ".join(arm_sets(tuple(dict(arm).items())))


def slug(arm: Arm) -> str:
    """The arm's name in run directories: each key's last part and its value, file-safe."""
    return "_".join(re.sub(r"[^A-Za-z0-9._+-]", "-", f"{key.rpartition('.')[2]}-{value}")
                    for key, value in arm)


# --- refusing a sweep before any run -----------------------------------------------------------


def problems(config: Path, sets: list[str], grid: dict[str, list[str]], stage: str) -> list[str]:
    """Every reason to refuse the sweep, one line each, found without running anything: keys
    the sweep controls, a key both set and gridded, a value the config refuses, an arm whose
    combination it refuses, and settings that leave nothing to compare."""
    set_keys = [s.partition("=")[0].strip() for s in sets]
    found = [f"--set {key}: {CONTROLLED[key]}" for key in set_keys if key in CONTROLLED]
    found += [f"--grid {key}: {CONTROLLED[key]}" for key in grid if key in CONTROLLED]
    found += [f"--grid {key}: every arm is scored alike; give eval settings with --set"
              for key in grid if key.startswith("eval.") and key not in CONTROLLED]
    found += [f"--grid {key}: also given with --set; give it in one of them" for key in grid
              if key in set_keys]
    names = [slug(arm) for arm in grid_arms(grid)]
    if len(set(names)) < len(names):
        found.append(f"--grid: two arms would share a run directory name ({', '.join(names)}); "
                     "give values that differ in letters, digits or ._+-")
    cfg, problem = checked(config, sets)
    if problem:
        return [*found, f"--set: {problem}"]
    return [*found, *scored(cfg, stage), *grid_problems(config, sets, grid)]


def checked(config: Path, sets: list[str]) -> tuple[RunConfig | None, str | None]:
    """The resolved config of ``sets`` as every run of the sweep gets it, or why not."""
    try:
        return resolve_config(config, [*sets, NO_TEST]), None
    except (ConfigError, OSError) as exc:
        return None, str(exc)


def grid_problems(config: Path, sets: list[str], grid: dict[str, list[str]]) -> list[str]:
    """The grid's values and arms the config refuses: one line per bad value (one per key when
    every value is refused alike: an unknown key), then one per arm refused only as a
    combination. A value is bad when the config refuses it alone and in every arm holding
    it: one that needs another key's value (learner.kl_estimator=k2 needs kl_coef > 0) is
    judged by its arms."""
    arms = grid_arms(grid)
    refused = {arm: checked(config, [*sets, *arm_sets(arm)])[1] for arm in arms}
    lines, blamed = [], set()
    for key, values in grid.items():
        bad = {value: problem for value in values
               if (problem := checked(config, [*sets, f"{key}={value}"])[1])
               and all(refused[arm] for arm in arms if (key, value) in arm)}
        blamed.update(arm for arm in arms for value in bad if (key, value) in arm)
        if len(values) > 1 and len(bad) == len(values) and len(set(bad.values())) == 1:
            lines.append(f"--grid {key}: {bad[values[0]]}")
        else:
            lines += [f"--grid {key}={value}: {problem}" for value, problem in bad.items()]
    return lines + [f"arm {arm_text(arm)}: {problem}" for arm, problem in refused.items()
                    if problem and arm not in blamed]


def scored(cfg: RunConfig, stage: str) -> list[str]:
    """Why runs of ``cfg`` would leave no validation records of ``stage`` to pair."""
    if cfg.eval.num_tasks == 0:
        return ["--set eval.num_tasks: 0 evaluates nothing; a sweep pairs validation tasks "
                "(set it above 0)"]
    if stage == "warm" and not cfg.eval.before_rl:
        return ["--stage warm: eval.before_rl=false skips the evaluation after the warm-start"]
    return []


# --- the runs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    """What every run of one ``autodidact sweep`` shares."""

    config: Path
    sets: list[str]
    grid: dict[str, list[str]]
    baseline: Arm
    seeds: list[int]
    name: str
    root: Path
    stage: str = "rl"

    def run_dir(self, arm: Arm, seed: int) -> Path:
        return (self.root / self.name / f"{slug(arm)}-s{seed}").resolve()

    def argv(self, arm: Arm, seed: int) -> list[str]:
        """The run's ``autodidact run``: also its reuse stamp. The config is named relative to
        the repository (runs start there), so the stamp holds on another checkout."""
        sets = [*self.sets, *arm_sets(arm), f"seed={seed}",
                f"name={self.name}-{slug(arm)}-s{seed}", NO_TEST]
        return run_argv(repo_path(self.config), self.run_dir(arm, seed), None, sets)


def repo_path(path: Path) -> Path:
    """``path`` relative to the repository when inside it, else absolute."""
    absolute = path.resolve()
    return absolute.relative_to(ROOT) if absolute.is_relative_to(ROOT) else absolute


def run_all(sweep: Sweep, may_run: bool = True) -> list[Result]:
    """Every arm at every seed, seed by seed and one run at a time: reused when finished with
    the same command, else run (with ``may_run``; else left as not run)."""
    results = []
    for seed in sweep.seeds:
        for arm in grid_arms(sweep.grid):
            results.append(run_cell(sweep, arm, seed, may_run))
    return results


def run_cell(sweep: Sweep, arm: Arm, seed: int, may_run: bool) -> Result:
    run_dir, argv = sweep.run_dir(arm, seed), sweep.argv(arm, seed)
    log = run_dir.parent / f"{run_dir.name}.log"
    result = run_or_reuse(slug(arm), seed, run_dir, argv, log, may_run=False)
    if result.error == NOT_RUN and may_run:
        click.echo(f"sweep: {arm_text(arm)} seed {seed}: running (log {log})")
        result = run_or_reuse(slug(arm), seed, run_dir, argv, log)
    if result.error:
        state = "not run yet (--no-run)" if result.error == NOT_RUN else f"FAILED, {result.error}"
    else:
        state = (f"{'reused' if result.reused else 'done'}: validation avg@k "
                 f"{result.final['avg']:.1%} after RL, {result.seconds / 60:.1f} min")
    click.echo(f"sweep: {arm_text(arm)} seed {seed}: {state}")
    return result


def runs_that_looked(results: list[Result]) -> dict[str, int]:
    """``{run directory: looks at test}`` of every run that has looked (none should)."""
    dirs = [r.run_dir for r in results if r.run_dir is not None and r.run_dir.exists()]
    return {str(d): n for d in dirs if (n := count_test_looks(d))}


# --- reading: each arm against the baseline ----------------------------------------------------


def against(base: list[Result], arm: list[Result], stage: str) -> dict | None:
    """``arm`` − baseline on validation at ``stage``, paired per task on every seed both
    finished: compare_arms' pairs (each with its per-task outcomes) and over-seeds reading;
    None where no seed finished on both sides."""
    by_seed = {r.seed: r for r in base if r.final}
    pairs = [(by_seed[r.seed], r) for r in arm if r.final and r.seed in by_seed]
    if not pairs:
        return None
    a_runs = [records(a.run_dir, SPLIT, stage) for a, _ in pairs]
    b_runs = [records(b.run_dir, SPLIT, stage) for _, b in pairs]
    compared = []
    for (a, b), a_tasks, b_tasks in zip(pairs, a_runs, b_runs):
        pair = compare_pair(a_tasks, b_tasks, a.run_dir, b.run_dir)
        pair["seed"] = a.seed
        pair["per_task"] = {task: {"baseline": compact(a_tasks[task]),
                                   "arm": compact(b_tasks[task])}
                            for task in sorted(set(a_tasks) & set(b_tasks))}
        compared.append(pair)
    return {"seeds": [a.seed for a, _ in pairs], "pairs": compared,
            "over_seeds": over_seeds(a_runs, b_runs, compared)}


def summarize(sweep: Sweep, results: list[Result]) -> list[dict]:
    """One row per arm: its validation avg@k at the stage with its interval, RL − warm-start,
    its runs' minutes, and (other than the baseline) the paired change against the baseline
    and its reading."""
    by_arm = {slug(arm): [r for r in results if r.arm == slug(arm)]
              for arm in grid_arms(sweep.grid)}
    base = by_arm[slug(sweep.baseline)]
    rows = []
    for arm in grid_arms(sweep.grid):
        runs = by_arm[slug(arm)]
        done = [r for r in runs if r.final]
        row = {"arm": dict(arm), "slug": slug(arm), "is_baseline": arm == sweep.baseline,
               "seeds": [r.seed for r in done],
               "rate": rate_over_seeds(done, RESULT_STAGE[sweep.stage]),
               "rl_gain": change_over_seeds([(r, r) for r in done], "warm", "final"),
               "minutes": mean_std([r.seconds / 60 for r in done if r.seconds]),
               "run_dirs": [str(r.run_dir) for r in runs]}
        if arm != sweep.baseline:
            row["vs_baseline"] = against(base, runs, sweep.stage)
            row["reading"] = row["vs_baseline"]["over_seeds"]["pooled"]["label"] \
                if row["vs_baseline"] else "nothing to compare"
        rows.append(row)
    return rows


def choose(rows: list[dict], results: list[Result]) -> dict:
    """:data:`RULE` applied to the rows; no choice while a run is missing."""
    missing = [r for r in results if not r.final]
    if missing:
        return {"arm": None, "reason": f"{len(missing)} of {len(results)} runs not finished: "
                                       "no choice yet"}
    beating = [row for row in rows if row.get("reading") == "helps"]
    if not beating:
        base = next(row for row in rows if row["is_baseline"])
        return {"arm": base["arm"], "slug": base["slug"], "is_baseline": True,
                "reason": "no arm beats the baseline"}
    best = max(beating, key=lambda row: row["vs_baseline"]["over_seeds"]["pooled"]["diff"])
    return {"arm": best["arm"], "slug": best["slug"], "is_baseline": False,
            "reason": "its paired interval against the baseline lies above 0 with the largest "
                      "mean gain"}


# --- what it writes ----------------------------------------------------------------------------


def pooled_text(row: dict) -> str:
    """The row's change against the baseline, every seed's tasks pooled, with its interval."""
    pooled = row["vs_baseline"]["over_seeds"]["pooled"]
    return format_diff(pooled["diff"], pooled["ci"])


def gain_text(gain: dict) -> str:
    """RL − warm-start with its interval and reading, "–" where nothing was measured."""
    return "–" if math.isnan(gain["value"]) else f"{change_text(gain)}: {gain['label']}"


def table(rows: list[dict], stage: str, k: int) -> str:
    """The markdown table: one line per arm."""
    when = STAGE_WORDS[stage]
    lines = [f"| arm | seeds | validation avg@{k} {when} (95% interval) | Δ vs baseline (paired "
             "per task, seeds pooled, 95% interval) | Δ per seed | Δ t-interval over seeds | "
             "reading | RL − warm-start (paired, 95% interval) | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join([*lines, *(row_line(row) for row in rows)])


def row_line(row: dict) -> str:
    over = row["vs_baseline"]["over_seeds"] if row.get("vs_baseline") else None
    if over is None:
        per_seed = t_text = "–"
    else:
        per_seed = ", ".join(f"{100 * d:+.1f}" for d in over["per_seed"])
        t_text = format_diff(over["mean"], over["t_ci"]) if over["t_ci"] else over["t_label"]
    change = "baseline" if row["is_baseline"] else pooled_text(row) if over else "–"
    minutes = "–" if math.isnan(row["minutes"][0]) else f"{row['minutes'][0]:.1f}"
    return " | ".join([f"| {arm_text(row['arm'])}", str(len(row["seeds"])),
                       rate_text(row["rate"]), change, per_seed, t_text,
                       row.get("reading", "baseline"), gain_text(row["rl_gain"]),
                       minutes]) + " |"


def chosen_line(sweep: Sweep, rows: list[dict], choice: dict, k: int,
                written: Path | None) -> str | None:
    """The ``# Chosen on validation:`` line a config made with the choice carries (None while
    there is no choice)."""
    if choice["arm"] is None:
        return None
    grid = " ".join(f"--grid {key}={','.join(values)}" for key, values in sweep.grid.items())
    made = f"(autodidact sweep {grid}{f'; {repo_path(written)}' if written else ''})"
    how = (f"avg@{k} {STAGE_WORDS[sweep.stage]}, paired per task on validation over "
           f"{len(sweep.seeds)} seed(s)")
    if not choice["is_baseline"]:
        row = next(row for row in rows if row["slug"] == choice["slug"])
        return (f"# Chosen on validation: {arm_text(choice['arm'])} over "
                f"{arm_text(sweep.baseline)}: {pooled_text(row)} {how} {made}")
    compared = [row for row in rows if row.get("vs_baseline")]
    best = max(compared, key=lambda r: r["vs_baseline"]["over_seeds"]["pooled"]["diff"])
    return (f"# Chosen on validation: {arm_text(sweep.baseline)}: no arm beats it on {how} "
            f"(closest: {arm_text(best['arm'])} {pooled_text(best)}) {made}")


def outcome(sweep: Sweep, results: list[Result], command: str, k: int,
            written: Path | None) -> dict:
    """Everything the sweep found: the json's contents (:func:`write` turns NaN to null)."""
    rows = summarize(sweep, results)
    choice = choose(rows, results)
    choice["line"] = chosen_line(sweep, rows, choice, k, written)
    return {
        "what": f"autodidact sweep {sweep.name}: each arm against the baseline on validation",
        "command": command, "config": str(repo_path(sweep.config)), "sets": sweep.sets,
        "grid": sweep.grid, "seeds": sweep.seeds, "split": SPLIT, "stage": sweep.stage, "k": k,
        "baseline": dict(sweep.baseline), "rule": RULE, "choice": choice, "arms": rows,
        "runs": [{**r.__dict__, "run_dir": str(r.run_dir)} for r in results]}


def markdown(found: dict) -> str:
    """The table page: what was run, the table, the rule and the choice."""
    choice = found["choice"]
    named = arm_text(choice["arm"] or {})
    lines = [f"Made by `{found['command']}`: seeds {', '.join(map(str, found['seeds']))}, "
             f"scored on the `{found['split']}` split {STAGE_WORDS[found['stage']]}; the test "
             "split was not looked at.", "",
             table(found["arms"], found["stage"], found["k"]), "",
             f"Rule: {found['rule']}. Readings come from the paired interval alone.", "",
             f"Choice: {named + ' (' + choice['reason'] + ')' if named else choice['reason']}"]
    if choice.get("line"):
        lines += ["", "```", choice["line"], "```"]
    return "\n".join(lines) + "\n"


def write(found: dict, out: Path | None, table_path: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(no_nan(found), indent=1, default=str) + "\n")
    if table_path:
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table_path.write_text(markdown(found))
