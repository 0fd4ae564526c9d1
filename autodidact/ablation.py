"""``autodidact ablation``: AgentEvolver's ablation table at our scale, on the built-in env.

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

After every run it writes the table (mean ± std over seeds of avg@k and best@k, and each arm's
change against +questioning paired by seed) with a plot into the doc
(``docs/results/ablation.md`` by default) between markers, keeping any text outside them, and
every cell into the doc's json.
Committed beside the doc, that json is the record a fresh checkout goes on from (``Records``):
run directories are git-ignored. With ``--curve-versions`` the reference and attributing arms
also get held-out points at those weight versions (``autodidact/heldout.py``), recorded with the
cell. At the end it overlays the seed-0 runs in ``OUT/report`` with ``autodidact report``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import click

from autodidact.heldout import curve
from protocol.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]

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
                  seconds=float(summary.get("ablation_seconds", 0.0)))


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
        points = {int(v): s for v, s in (record.get("curve") or {}).items()}
        run_dir = Path(record["run_dir"]) if record.get("run_dir") else None
        return Result(arm, seed, run_dir, base=record["base"], warm=record["warm"],
                      final=record["final"], updates=record["updates"],
                      seconds=record["seconds"], reused=True, stamp=stamp, curve=points,
                      from_record=True)


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
        (self.folder / "record.json").write_text(json.dumps({
            "stamp": self.stamp, "source": str(run_dir),
            "success_base": summary.get("success_base"),
            "success_warm": summary.get("success_warm")}, indent=1))


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
    summary.write_text(json.dumps(data, indent=2, default=str))
    RunDir(run_dir).ablation_argv.write_text(json.dumps(argv[1:]))
    if warm is not None and kept is None:
        warm.keep_from(run_dir, data)
    return read_result(label, seed, run_dir, data)


def zero_shot(results: list[Result], seed: int) -> Result:
    """The zero-shot arm at ``seed``: the base-model evaluation of that seed's trained runs.

    Every run of a seed builds the same base model and evaluates it on the same tasks with the
    same sampling seed, so the runs agree; should they not, their mean is taken."""
    bases = [r.base for r in results if r.seed == seed and r.base]
    if not bases:
        return Result("zero-shot", seed, None, error=NOT_RUN)  # no run of this seed finished
    final = {key: sum(b[key] for b in bases) / len(bases)
             for key in ("avg", "best", "greedy") if all(key in b for b in bases)}
    return Result("zero-shot", seed, None, base=bases[0], final=final)


# --- the table -------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def paired_change(results: list[Result], arm: str, key: str = "avg") -> list[float]:
    """``arm`` minus the reference arm on the same seed, for every seed both finished."""
    ref = {r.seed: r.final[key] for r in results if r.arm == REFERENCE and key in r.final}
    return [r.final[key] - ref[r.seed] for r in results
            if r.arm == arm and key in r.final and r.seed in ref]


def verdict(changes: list[float]) -> str:
    """A plain reading of paired changes: a direction is claimed only when every seed agrees
    and the mean change is larger than its spread."""
    if len(changes) < 2:
        return "too few seeds to say"
    mean, std = mean_std(changes)
    same_sign = all(c > 0 for c in changes) or all(c < 0 for c in changes)
    if same_sign and abs(mean) > std:
        return ("helps" if mean > 0 else "hurts") + f" on all {len(changes)} seeds"
    return "no consistent effect"


def summarize(results: list[Result], k: int) -> list[dict]:
    """One row per arm: mean ± std over seeds, and the change against the reference arm."""
    rows = []
    for arm in dict.fromkeys(r.arm for r in results):
        done = [r for r in results if r.arm == arm and r.final]
        row = {"arm": arm, "seeds": len(done)}
        for key in ("avg", "best", "greedy"):
            row[key] = mean_std([r.final[key] for r in done if key in r.final])
        row["warm"] = mean_std([r.warm["avg"] for r in done if "avg" in r.warm])
        row["rl_gain"] = mean_std([r.final["avg"] - r.warm["avg"] for r in done
                                   if "avg" in r.warm and "avg" in r.final])
        row["updates"] = mean_std([float(r.updates) for r in done if r.run_dir])
        row["minutes"] = mean_std([r.seconds / 60 for r in done if r.seconds])
        if arm != REFERENCE and arm != "zero-shot":
            changes = paired_change(results, arm)
            row["change"] = mean_std(changes)
            row["verdict"] = verdict(changes)
        rows.append(row)
    return rows


def _pm(pair: tuple[float, float], scale: float = 100.0, spec: str = ".1f") -> str:
    mean, std = pair
    if math.isnan(mean):
        return "–"
    return f"{mean * scale:{spec}} ± {std * scale:{spec}}"


def _signed(pair: tuple[float, float]) -> str:
    mean, std = pair
    return "–" if math.isnan(mean) else f"{mean * 100:+.1f} ± {std * 100:.1f}"


def table(rows: list[dict], k: int) -> str:
    """The markdown table: success in percent, mean ± std over seeds."""
    lines = [f"| setting | seeds | avg@{k} | best@{k} | greedy | Δ avg@{k} vs {REFERENCE} "
             f"(paired) | reading | after warm-start avg@{k} | RL gain (after RL − warm-start) "
             "| RL updates | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        trained = row["arm"] != "zero-shot"
        lines.append(" | ".join([
            f"| {row['arm']}", str(row["seeds"]), _pm(row["avg"]), _pm(row["best"]),
            _pm(row["greedy"]), _signed(row["change"]) if "change" in row else "",
            row.get("verdict", "reference" if row["arm"] == REFERENCE else ""),
            _pm(row["warm"]) if trained else "",
            _signed(row["rl_gain"]) if trained else "",
            _pm(row["updates"], 1.0, ".0f") if trained else "",
            _pm(row["minutes"], 1.0) if trained else ""]) + " |")
    return "\n".join(lines)


def per_seed_table(results: list[Result], k: int) -> str:
    seeds = sorted({r.seed for r in results})
    lines = ["| setting | " + " | ".join(f"seed {s} avg@{k} / best@{k}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for arm in dict.fromkeys(r.arm for r in results):
        cells = []
        for s in seeds:
            r = next((r for r in results if r.arm == arm and r.seed == s), None)
            if r is None or not r.final:
                cells.append(f"failed: {r.error}" if r and r.error and r.error != NOT_RUN
                             else "–")
            else:
                cells.append(f"{r.final['avg']:.1%} / {r.final['best']:.1%}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the plot --------------------------------------------------------------------------------


def plot(results: list[Result], rows: list[dict], k: int, path: Path) -> Path:
    """Left: held-out avg@k and best@k per arm (bars: mean over seeds, whiskers: std, dots:
    seeds). Right: avg@k before training, after the warm-start and after RL, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [row["arm"] for row in rows]
    fig, (bars, stages) = plt.subplots(1, 2, figsize=(13, 4.8),
                                       gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for offset, key, colour in ((-width / 2, "avg", "tab:blue"), (width / 2, "best", "tab:orange")):
        means = [row[key][0] * 100 for row in rows]
        stds = [row[key][1] * 100 for row in rows]
        xs = [i + offset for i in range(len(arms))]
        drawn = bars.bar(xs, means, width, yerr=stds, capsize=4, color=colour, alpha=0.75,
                         label=f"{key}@{k}")
        bars.bar_label(drawn, fmt="%.1f", fontsize=7, padding=2)
        for x, arm in zip(xs, arms):
            ys = [r.final[key] * 100 for r in results if r.arm == arm and key in r.final]
            bars.scatter([x] * len(ys), ys, color="black", s=10, zorder=3)
    bars.set_xticks(range(len(arms)), [a.replace("+", "\n+").strip() for a in arms], fontsize=8)
    bars.set_ylabel("held-out success (%)")
    bars.set_title("held-out original tasks, mean ± std over seeds (dots: seeds)")
    bars.legend()
    for arm in arms[1:] if arms and arms[0] == "zero-shot" else arms:
        done = [r for r in results if r.arm == arm and r.final and r.warm]
        if done:
            ys = [mean_std([r.base.get("avg", math.nan) for r in done])[0] * 100,
                  mean_std([r.warm["avg"] for r in done])[0] * 100,
                  mean_std([r.final["avg"] for r in done])[0] * 100]
            stages.plot([0, 1, 2], ys, marker="o", label=arm)
    stages.set_xticks([0, 1, 2], ["zero-shot", "warm-start", "after RL"])
    stages.set_ylabel(f"held-out avg@{k} (%)")
    stages.set_title("where the gain comes from")
    if stages.get_legend_handles_labels()[0]:  # nothing finished yet: no lines to name
        stages.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the doc ---------------------------------------------------------------------------------

BEGIN = "<!-- ablation:begin (written by `autodidact ablation`; text outside is kept) -->"
END = "<!-- ablation:end -->"


def section(results: list[Result], rows: list[dict], k: int, command: str, plot_name: str,
            budget: Budget, sets: list[str], nav_sets: tuple[str, ...] = ()) -> str:
    shared = shared_sets(k, budget, sets)
    nav_text = f" The arms that navigate also: `{' '.join(nav_sets)}`." if nav_sets else ""
    seeds = sorted({r.seed for r in results})
    failed = [r for r in results if r.error and r.error != NOT_RUN]
    pending = [r for r in results if r.error == NOT_RUN]
    minutes = sum(r.seconds for r in results) / 60
    lines = [
        BEGIN, "",
        f"Made by `{command}` on {date.today().isoformat()}: {len(seeds)} seed(s) "
        f"({', '.join(map(str, seeds))}), {budget.updates} RL updates per run, "
        f"{minutes:.0f} min of runs in all on {_machine()}, one run at a time.",
        "",
        "Every arm trains only on tasks the agent wrote itself (`tasks.synthetic_share=1.0`) "
        "and is scored on the built-in env's held-out original tasks: success in percent, "
        f"avg@{k} and best@{k} over {k} sampled episodes per task, greedy with temperature 0. "
        f"Settings shared by every run: `{' '.join(shared)}`.{nav_text}",
        "", table(rows, k), "",
        f"The change against {REFERENCE} is paired by seed (the same seed builds the same base "
        "model, explores the same way and evaluates the same tasks); the reading claims a "
        "direction only when every seed agrees and the mean change exceeds its spread.",
        "", "Per seed:", "", per_seed_table(results, k), "",
        f"![ablation]({plot_name})", ""]
    if failed:
        lines += ["Runs that failed: " + "; ".join(f"{r.arm} seed {r.seed} ({r.error})"
                                                    for r in failed), ""]
    if pending:
        lines += [f"Not run yet ({len(pending)} of {len(results)}; the same command without "
                  "`--no-run` runs them): " + ", ".join(f"{r.arm} seed {r.seed}"
                                                        for r in pending), ""]
    return "\n".join([*lines, END])


def _machine() -> str:
    import os

    return f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"


def write_doc(doc: Path, body: str) -> None:
    """Replace the generated section of ``doc`` (or create the doc), keeping the rest."""
    old = doc.read_text() if doc.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + body + rest.split(END, 1)[1]
    else:
        new = (old.rstrip() + "\n\n" if old else "# Ablation\n\n") + body + "\n"
    doc.write_text(new)


# --- the command -----------------------------------------------------------------------------


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise click.BadParameter("give at least one seed, each once")
    return seeds


def controlled_keys() -> set[str]:
    """Config keys the ablation sets itself: what defines an arm, the score and the seed."""
    keys = {s.split("=", 1)[0] for arm_sets in ARMS.values() if arm_sets for s in arm_sets}
    return keys | {s.split("=", 1)[0] for s in common(K)} | {"seed", "name", "tracking.group"}


def check_sets(sets: list[str]) -> None:
    taken = sorted({s.split("=", 1)[0].strip() for s in sets} & controlled_keys())
    if taken:
        raise click.BadParameter(f"the ablation sets {', '.join(taken)} itself (they define "
                                 "the arms, the score or the seeds)", param_hint="--set")


def parse_arms(text: str | None, llm_judge: str | None = None) -> list[str]:
    known = [*ARMS, LLM_JUDGE_ARM] if llm_judge else list(ARMS)
    if not text:
        return known
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in known]
    if unknown:
        hint = f" ({LLM_JUDGE_ARM} needs --llm-judge MODEL)" if LLM_JUDGE_ARM in unknown else ""
        raise click.BadParameter(f"unknown arm(s) {', '.join(unknown)}; choose from "
                                 f"{', '.join(known)}{hint}")
    return arms


@click.command("ablation")
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Config every run starts from (default: embedded defaults).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config value in every run (repeatable).")
@click.option("--seeds", default=None, metavar="0,1,2",
              help="Seeds, one run per arm each (default 0,1,2; --quick: 0).")
@click.option("--arms", default=None, metavar="A,B",
              help=f"Arms to run (default all: {', '.join(ARMS)}).")
@click.option("--nav-set", "nav_sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config value in the arms that navigate only (repeatable): "
                   "e.g. experience.min_similarity=0.5 where tasks rarely repeat.")
@click.option("--llm-judge", default=None, metavar="MODEL",
              help=f"Add the arm {LLM_JUDGE_ARM}: +attributing with MODEL (a local folder or "
                   "packaged name) served by vllm serve as the step judge.")
@click.option("--k", "k", type=click.IntRange(min=1), default=K, show_default=True,
              help="Episodes per held-out task: the table's avg@k and best@k.")
@click.option("--updates", type=int, default=None,
              help=f"RL updates per run (default {DEFAULT_BUDGET.updates}; --quick "
                   f"{QUICK_BUDGET.updates}).")
@click.option("--quick", is_flag=True,
              help="A smaller budget and one seed: within 10 minutes on 2 cores.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the runs go (default runs/ablation, --quick runs/ablation-quick).")
@click.option("--doc", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Markdown file the table goes into, with the plot beside it (default "
                   "docs/results/ablation.md; --quick: OUT/ablation.md).")
@click.option("--curve-versions", default="", metavar="5,10",
              help="Also evaluate these weight versions of the --curve-arms runs on the held-out "
                   "tasks (needs weights.keep >= --updates): a learning curve per run, recorded "
                   "in the doc's json for bench/heldout_curve.py --ablation.")
@click.option("--curve-arms", default=None, metavar="A,B",
              help=f"Arms whose runs get --curve-versions (default {REFERENCE} and the "
                   "attributing arms: attribution's data efficiency).")
@click.option("--fresh", is_flag=True, help="Run again even where a finished run exists.")
@click.option("--no-run", "no_run", is_flag=True,
              help="Run nothing: write the table from the runs finished so far.")
def ablation(config, sets, seeds, arms, nav_sets, llm_judge, k, updates, quick, out, doc,
             curve_versions, curve_arms, fresh, no_run):
    """Run the ablation table (zero-shot, +questioning, +navigating, +attributing, full) on
    held-out original tasks, and write it with a plot into docs/results/ablation.md.

    \b
    autodidact ablation                 3 seeds x 4 trained arms (about an hour on 2 cores)
    autodidact ablation --quick         1 seed, small budget (under 10 minutes)
    autodidact ablation --seeds 0,1,2,3,4 --updates 200 --out runs/abl-long

    Finished cells are recorded in the doc's json (committed beside the doc), so the same
    command on a fresh checkout goes on where the last one stopped.
    """
    budget = QUICK_BUDGET if quick else DEFAULT_BUDGET
    if updates is not None:
        if updates < 1:
            raise click.BadParameter("must be at least 1", param_hint="--updates")
        budget = Budget(updates, budget.sets)
    seed_list = parse_seeds(seeds or ("0" if quick else "0,1,2"))
    arm_list = parse_arms(arms, llm_judge)
    check_sets([*sets, *nav_sets])
    out = out or Path("runs") / ("ablation-quick" if quick else "ablation")
    doc = doc or (out / "ablation.md" if quick else Path("docs") / "results" / "ablation.md")
    attributing = [a for a in arm_list if "attributing" in a]
    plan = Plan(out, config, budget, list(sets), k, llm_judge, tuple(nav_sets), fresh,
                Records(doc.with_suffix(".json")), parse_versions(curve_versions),
                tuple(parse_arms(curve_arms, llm_judge) if curve_arms
                      else [REFERENCE, *attributing]))
    command = "autodidact ablation " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["ablation"] \
        else "autodidact ablation"

    def publish(results: list[Result]) -> Path:
        return write_outputs(results, plan, doc, command.strip())

    results = run_all(arm_list, seed_list, plan, may_run=not no_run, publish=publish)
    click.echo("\n" + table(summarize(results, k), k))
    plot_path = publish(results)
    overlay(results, out)
    click.echo(f"table and plot written to {doc} and {plot_path}")
    if any(r.error and r.error != NOT_RUN for r in results):
        raise SystemExit(1)


def parse_versions(text: str) -> tuple[int, ...]:
    try:
        versions = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}",
                                 param_hint="--curve-versions") from None
    if any(v < 1 for v in versions):
        raise click.BadParameter("versions start at 1 (0 is the warm-start, always on the "
                                 "curve)", param_hint="--curve-versions")
    return versions


def write_outputs(results: list[Result], plan: Plan, doc: Path, command: str) -> Path:
    """The doc's generated section, its plot, and its json: the table's rows and every cell,
    the records a later call reuses. Returns the plot's path."""
    rows = summarize(results, plan.k)
    doc.parent.mkdir(parents=True, exist_ok=True)
    plot_path = plot(results, rows, plan.k, doc.with_suffix(".png"))
    write_doc(doc, section(results, rows, plan.k, command, plot_path.name, plan.budget,
                           plan.sets, plan.nav_sets))
    doc.with_suffix(".json").write_text(json.dumps(
        {"budget": {"updates": plan.budget.updates,
                    "sets": shared_sets(plan.k, plan.budget, plan.sets),
                    "nav_sets": list(plan.nav_sets)},
         "run_seconds": sum(r.seconds for r in results), "rows": _no_nan(rows),
         "runs": [{**r.__dict__, "run_dir": _shown_path(r.run_dir)} for r in results],
         "other_records": plan.records.others(results) if plan.records else []},
        indent=1, default=str))
    return plot_path


def _no_nan(value):
    """``value`` with NaN (a statistic of nothing) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def _shown_path(path: Path | None) -> str | None:
    """``path`` relative to the working directory when inside it (for a committed doc)."""
    if path is None:
        return None
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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


def overlay(results: list[Result], out: Path) -> None:
    """``autodidact report`` of the first seed's runs, overlaid, in ``OUT/report``."""
    from autodidact.report import make_report

    first = min((r.seed for r in results), default=None)
    runs = [r for r in results if r.seed == first and r.run_dir and r.final
            and RunDir(r.run_dir).summary.exists()]  # a recorded cell's directory may be gone
    if len(runs) < 1:
        return
    path = make_report([r.run_dir for r in runs], [r.arm for r in runs], out / "report")
    click.echo(f"training curves of seed {first}, overlaid: {path / 'report.md'}")
