"""``autodidact sweep``: the grid and its refusals (nothing run), the pairing per task and the
choice rule on planted runs, and one real tiny sweep whose second call reuses its runs."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from autodidact.experiments import arms as arms_module
from autodidact.experiments.sweep import (
    RULE,
    Sweep,
    grid_arms,
    parse_baseline,
    parse_grid,
    problems,
    slug,
)
from autodidact.sweep_cli import sweep
from protocol.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "configs" / "quick.yaml"


@pytest.fixture
def no_runs(monkeypatch):
    """Any `autodidact run` the sweep would start fails the test instead."""
    def refuse(argv, log_path):
        pytest.fail(f"the sweep started a run: {argv}")
    monkeypatch.setattr(arms_module, "run_once", refuse)


def invoke(*args: str):
    return CliRunner().invoke(sweep, list(args))


# --- the grid and its refusals -----------------------------------------------------------------


def test_the_arms_are_every_combination_and_the_baseline_defaults_to_first_values():
    grid = parse_grid(["learner.lr=3e-5,1e-4", " learner.kl_coef = 0, 0.1 "])
    assert grid == {"learner.lr": ["3e-5", "1e-4"], "learner.kl_coef": ["0", "0.1"]}
    arms = grid_arms(grid)
    assert [slug(a) for a in arms] == ["lr-3e-5_kl_coef-0", "lr-3e-5_kl_coef-0.1",
                                       "lr-1e-4_kl_coef-0", "lr-1e-4_kl_coef-0.1"]
    assert parse_baseline(None, grid) == arms[0]
    # a key left out of --baseline takes its first value
    assert parse_baseline("learner.kl_coef=0.1", grid) == arms[1]
    assert parse_baseline("learner.lr=1e-4,learner.kl_coef=0.1", grid) == arms[3]


@pytest.mark.parametrize("texts, match", [
    (["learner.lr"], "is not KEY=V1,V2"),
    (["learner.lr=1e-4,"], "none empty"),
    (["learner.lr=1e-4,3e-4", "learner.lr=1e-3,3e-3"], "given twice"),
    (["learner.lr=1e-4,1e-4"], "lists a value twice"),
    (["learner.lr=1e-4"], "a single arm"),
])
def test_a_malformed_grid_is_refused(texts, match):
    with pytest.raises(click.BadParameter, match=match):
        parse_grid(texts)


@pytest.mark.parametrize("text, match", [
    ("learner.kl_coef=0", "one of the grid's"),
    ("learner.lr=2e-4", r"not in the grid; learner.lr takes 3e-5, 1e-4"),
])
def test_a_baseline_outside_the_grid_is_refused(text, match):
    with pytest.raises(click.BadParameter, match=match):
        parse_baseline(text, {"learner.lr": ["3e-5", "1e-4"]})


def test_every_bad_field_is_refused_at_once_before_any_run(tmp_path, no_runs):
    result = invoke("-c", str(QUICK), "--root", str(tmp_path / "runs"), "--seeds", "0",
                    "--grid", "learner.lrr=1e-4,3e-4", "--grid", "learner.kl_coef=-1,0.1",
                    "--grid", "eval.k=1,2", "--grid", "actor.group_size=4,5",
                    "--set", "actor.group_size=8", "--set", "seed=3")
    assert result.exit_code == 2, result.output
    lines = result.output.split("nothing was run:\n")[1].strip().splitlines()
    assert lines[:3] == ["--set seed: --seeds gives the seeds",
                         "--grid eval.k: every arm is scored alike; give eval settings with "
                         "--set",
                         "--grid actor.group_size: also given with --set; give it in one of "
                         "them"]
    # an unknown key once, not once per value
    assert lines[3].startswith("--grid learner.lrr: unknown key learner.lrr (known here: ")
    # the bad value alone, not its key's good one
    assert lines[4:] == ["--grid learner.kl_coef=-1: learner.kl_coef must be >= 0, got -1.0"]
    assert not (tmp_path / "runs").exists()


def test_values_are_judged_in_their_arms_and_a_refused_combination_is_named():
    # k2 alone is refused (the config's kl_coef is 0), yet with kl_coef > 0 it is an arm
    grid = {"learner.kl_estimator": ["k2", "k1"], "learner.kl_coef": ["0.1", "0.2"]}
    assert problems(QUICK, [], grid, "rl") == []
    grid = {"learner.kl_estimator": ["k3", "k2"], "learner.kl_coef": ["0", "0.1"]}
    assert problems(QUICK, [], grid, "rl") == [
        "arm learner.kl_estimator=k2 learner.kl_coef=0: learner.kl_estimator=k2 estimates the "
        "KL penalty, which kl_coef=0 turns off: set kl_coef > 0 or leave it at k3"]


@pytest.mark.parametrize("args", [
    ["--set", "eval.final_test=true"],
    ["--set", "eval.final_test=false"],  # the sweep sets it itself, and only it
    ["--grid", "eval.final_test=false,true"],
])
def test_a_setting_that_would_look_at_test_is_refused(tmp_path, no_runs, args):
    result = invoke("-c", str(QUICK), "--root", str(tmp_path), "--grid", "learner.lr=1e-4,3e-4",
                    *args)
    assert result.exit_code == 2
    assert "eval.final_test: a sweep never looks at test" in result.output


def test_settings_that_leave_nothing_to_pair_are_refused(tmp_path, no_runs):
    result = invoke("-c", str(QUICK), "--root", str(tmp_path), "--grid", "learner.lr=1e-4,3e-4",
                    "--set", "eval.num_tasks=0")
    assert result.exit_code == 2 and "eval.num_tasks: 0 evaluates nothing" in result.output
    result = invoke("-c", str(QUICK), "--root", str(tmp_path), "--grid", "learner.lr=1e-4,3e-4",
                    "--set", "eval.before_rl=false", "--stage", "warm")
    assert result.exit_code == 2 and "eval.before_rl=false skips" in result.output


# --- pairing and choosing, on planted runs -------------------------------------------------------


def write_records(path: Path, per_task: dict[str, list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"task_id": t, "rewards": r}) + "\n"
                            for t, r in per_task.items()))


def plant(plan: Sweep, arm, seed: int, validation: dict, test: dict | None = None) -> Path:
    """A finished run of ``arm`` at ``seed`` as the sweep would have made it: its stamp, its
    summary and its per-task validation records (and, with ``test``, test records it must
    never read)."""
    run_dir = plan.run_dir(arm, seed)
    rd = RunDir(run_dir)
    warm = {t: [0] * len(r) for t, r in validation.items()}
    for stage, rows in (("base", warm), ("warm", warm), ("rl", validation)):
        write_records(rd.heldout_records("validation", stage), rows)
    if test is not None:
        write_records(rd.heldout_records("test", "rl"), test)
    avg = sum(sum(r) / len(r) for r in validation.values()) / len(validation)
    rd.summary.write_text(json.dumps({
        "success_base": {"avg": 0.0, "best": 0.0, "split": "validation"},
        "success_warm": {"avg": 0.0, "best": 0.0, "split": "validation"},
        "success_rl": {"avg": avg, "best": avg, "split": "validation"},
        "learner": {"learner/updates": 2}, "ablation_seconds": 60.0}))
    rd.ablation_argv.write_text(json.dumps(plan.argv(arm, seed)[1:]))
    return run_dir


TASKS = [f"t{i}" for i in range(40)]


def planted_sweep(tmp_path: Path, solved: dict[str, int], seeds=(0, 1)) -> Sweep:
    """Three arms of learner.lr, each solving ``solved[value]`` of 4 samples on every task."""
    grid = {"learner.lr": list(solved)}
    plan = Sweep(QUICK, [], grid, parse_baseline(None, grid), list(seeds), "planted",
                 tmp_path / "runs")
    for seed in seeds:
        for arm in grid_arms(grid):
            n = solved[arm[0][1]]
            plant(plan, arm, seed, {t: [1] * n + [0] * (4 - n) for t in TASKS},
                  test={t: [1, 1, 1, 1] if arm == plan.baseline else [0] * 4 for t in TASKS})
    return plan


def run_planted(plan: Sweep, tmp_path: Path):
    out, table = tmp_path / "sweep.json", tmp_path / "sweep.md"
    args = ["-c", str(QUICK), "--root", str(plan.root), "--name", plan.name,
            "--seeds", ",".join(map(str, plan.seeds)), "--out", str(out), "--table", str(table)]
    for key, values in plan.grid.items():
        args += ["--grid", f"{key}={','.join(values)}"]
    result = invoke(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result, json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(c)), \
        table.read_text()


def test_the_largest_gain_whose_interval_lies_above_zero_is_chosen(tmp_path, no_runs):
    # baseline 1 of 4 on every task; 2e-4 solves 3 of 4 (+50 points), 3e-4 2 of 4 (+25),
    # 4e-4 none (-25): both gains lie above 0, the larger is chosen. The test records say
    # the opposite (the baseline alone solves test), and are never read.
    plan = planted_sweep(tmp_path, {"1e-4": 1, "2e-4": 3, "3e-4": 2, "4e-4": 0})
    result, found, table = run_planted(plan, tmp_path)
    assert result.output.count(": reused: validation avg@k") == 8
    rows = {row["slug"]: row for row in found["arms"]}
    assert [rows[s].get("reading") for s in ("lr-2e-4", "lr-3e-4", "lr-4e-4")] == \
        ["helps", "helps", "hurts"]
    assert found["choice"]["arm"] == {"learner.lr": "2e-4"} and not found["choice"]["is_baseline"]
    assert found["rule"] == RULE and RULE in table
    over = rows["lr-2e-4"]["vs_baseline"]["over_seeds"]
    assert over["pooled"]["tasks"] == 80 and over["pooled"]["diff"] == pytest.approx(0.5)
    assert over["per_seed"] == pytest.approx([0.5, 0.5])
    assert found["choice"]["line"].startswith(
        "# Chosen on validation: learner.lr=2e-4 over learner.lr=1e-4: +50.0 points (95% ")
    assert "sweep.json)" in found["choice"]["line"]
    assert found["choice"]["line"] in result.output.splitlines()
    assert found["command"].startswith("autodidact sweep") and found["split"] == "validation"


def test_no_arm_beating_the_baseline_chooses_the_baseline(tmp_path, no_runs):
    plan = planted_sweep(tmp_path, {"1e-4": 2, "3e-4": 2, "1e-3": 1}, seeds=(0,))
    _, found, table = run_planted(plan, tmp_path)
    assert found["choice"]["arm"] == {"learner.lr": "1e-4"} and found["choice"]["is_baseline"]
    assert found["choice"]["reason"] == "no arm beats the baseline"
    assert found["choice"]["line"].startswith(
        "# Chosen on validation: learner.lr=1e-4: no arm beats it on avg@2 after RL")
    assert "Choice: learner.lr=1e-4 (no arm beats the baseline)" in table


def test_arms_are_paired_task_by_task_on_the_tasks_both_evaluated(tmp_path, no_runs):
    # The same rate on both sides, reached on other tasks: paired per task, every task
    # differs, and only the tasks both evaluated are paired.
    grid = {"learner.lr": ["1e-4", "3e-4"]}
    plan = Sweep(QUICK, [], grid, parse_baseline(None, grid), [0], "pairs", tmp_path / "runs")
    base, arm = grid_arms(grid)
    plant(plan, base, 0, {**{f"t{i}": [i % 2] * 2 for i in range(20)}, "only-base": [1, 1]})
    plant(plan, arm, 0, {**{f"t{i}": [1 - i % 2] * 2 for i in range(20)}, "only-arm": [0, 0]})
    _, found, _ = run_planted(plan, tmp_path)
    [pair] = found["arms"][1]["vs_baseline"]["pairs"]
    assert set(pair["per_task"]) == {f"t{i}" for i in range(20)}
    assert pair["per_task"]["t1"] == {"baseline": "2/2", "arm": "0/2"}
    assert pair["per_task"]["t2"] == {"baseline": "0/2", "arm": "2/2"}
    assert pair["b_minus_a"]["tasks"] == 20 and pair["b_minus_a"]["tasks_that_differ"] == 20
    assert pair["b_minus_a"]["diff"] == 0.0 and pair["b_minus_a"]["label"] == "no change"


def test_a_run_that_looked_at_test_fails_the_sweep(tmp_path, no_runs):
    plan = planted_sweep(tmp_path, {"1e-4": 1, "3e-4": 3}, seeds=(0,))
    looked = plan.run_dir(grid_arms(plan.grid)[1], 0)
    RunDir(looked).test_looks.write_text(json.dumps({"who": "autodidact eval"}) + "\n")
    result = invoke("-c", str(QUICK), "--root", str(plan.root), "--name", plan.name, "--seeds",
                    "0", "--grid", "learner.lr=1e-4,3e-4", "--out", str(tmp_path / "s.json"))
    assert result.exit_code == 1
    assert f"runs looked at the test split, so this sweep chooses nothing: {looked} (1 look" \
        in result.output
    assert not (tmp_path / "s.json").exists()


def test_no_run_reads_only_what_finished_and_chooses_nothing_yet(tmp_path, no_runs):
    plan = planted_sweep(tmp_path, {"1e-4": 1, "3e-4": 3}, seeds=(0,))
    result = invoke("-c", str(QUICK), "--root", str(plan.root), "--name", plan.name, "--seeds",
                    "0,1", "--grid", "learner.lr=1e-4,3e-4", "--no-run")
    assert result.exit_code == 0, result.output
    assert result.output.count("not run yet (--no-run)") == 2
    assert "2 of 4 runs not finished: no choice yet" in result.output
    assert "# Chosen on validation" not in result.output


# --- one real tiny sweep ---------------------------------------------------------------------

# The cheapest whole `autodidact run` (tests/test_status.py's tiny job, shorter): no warm-start
# steps, 2 RL updates of 2 groups of 4 rollouts, 4 validation tasks scored once each.
TINY = ["warmstart.steps=0", "eval.num_tasks=4", "eval.k=1", "eval.greedy=false",
        "learner.batch_groups=2", "actor.group_size=4", "actor.num_actors=1",
        "experience.enabled=false", "judge.workers=0", "learner.probe_every=0",
        "learner.max_updates=2", "tracking.wandb=offline"]


@pytest.mark.slow
@pytest.mark.timeout(400)  # a guard against a hang, not a speed check
def test_a_tiny_sweep_runs_its_arms_once_and_never_looks_at_test(tmp_path, monkeypatch):
    out = tmp_path / "sweep.json"
    args = ["-c", str(QUICK), "--root", str(tmp_path / "runs"), "--name", "tiny", "--seeds",
            "0", "--grid", "learner.lr=1e-4,3e-4", "--out", str(out),
            *[a for s in TINY for a in ("--set", s)]]
    first = invoke(*args)
    assert first.exit_code == 0, (first.output, first.exception)
    runs = [tmp_path / "runs" / "tiny" / f"lr-{lr}-s0" for lr in ("1e-4", "3e-4")]
    for run_dir, lr in zip(runs, (1e-4, 3e-4)):
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["learner"]["lr"] == lr and cfg["eval"]["final_test"] is False
        assert json.loads((run_dir / "summary.json").read_text())["looked_at_test"] is False
        assert not RunDir(run_dir).test_looks.exists()
        assert not list((run_dir / "eval").glob("heldout-test-*"))
    found = json.loads(out.read_text())
    [pair] = found["arms"][1]["vs_baseline"]["pairs"]
    assert len(pair["per_task"]) == 4 and pair["b_minus_a"]["tasks"] == 4
    assert found["choice"]["line"] in first.output.splitlines()

    # cut off and started again: both runs are read back, none is made again
    stamps = [RunDir(d).summary.stat().st_mtime_ns for d in runs]
    monkeypatch.setattr(arms_module, "run_once",
                        lambda argv, log: pytest.fail(f"ran again: {argv}"))
    again = invoke(*args)
    assert again.exit_code == 0, (again.output, again.exception)
    assert again.output.count(": reused: validation avg@k") == 2
    assert [RunDir(d).summary.stat().st_mtime_ns for d in runs] == stamps
    assert json.loads(out.read_text())["arms"] == found["arms"]
