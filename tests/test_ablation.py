"""``autodidact ablation``: the table's arithmetic on known numbers, the doc it rewrites, and one
real tiny ablation (two trained arms and zero-shot, each a whole ``autodidact run``)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from autodidact.ablation_cli import ablation, check_sets, parse_arms, parse_seeds, parse_versions
from autodidact.experiments.arms import (
    ARMS,
    LLM_JUDGE_ARM,
    NOT_RUN,
    REFERENCE,
    Budget,
    Plan,
    Records,
    Result,
    arm_settings,
    cell_stamp,
    lacks_curve,
    recorded_result,
    run_all,
    run_arm,
    run_name,
    shared_sets,
    stale_records,
    zero_shot,
)
from autodidact.experiments.page import (
    BEGIN,
    END,
    change_over_seeds,
    mean_std,
    paired_change,
    reference_pairs,
    rewrite_from_json,
    section,
    summarize,
    table,
    write_doc,
)
from metrics.jsonl import read_metrics


def _result(arm, seed, avg, best=None, base=0.02, warm=0.3):
    return Result(arm, seed, Path(f"/runs/{arm}-{seed}"), base={"avg": base, "best": 0.1},
                  warm={"avg": warm}, final={"avg": avg, "best": best or avg + 0.1},
                  updates=100, seconds=240.0)


def test_mean_std_is_the_sample_deviation():
    mean, std = mean_std([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and std == pytest.approx(0.1)
    assert mean_std([0.4]) == (0.4, 0.0)
    assert all(math.isnan(x) for x in mean_std([]))


def test_changes_are_paired_by_seed_and_skip_unfinished_seeds():
    results = [_result(REFERENCE, 0, 0.40), _result(REFERENCE, 1, 0.20),
               _result("full", 0, 0.45), _result("full", 1, 0.30), _result("full", 2, 0.9)]
    # Seed 2 has no reference run: it is left out rather than compared with another seed.
    assert paired_change(results, "full") == pytest.approx([0.05, 0.10])
    assert [(a.seed, b.seed) for a, b in reference_pairs(results, "full")] == [(0, 0), (1, 1)]


def _pairs(ref_avgs, arm_avgs):
    """Per-seed results of the reference and an arm, with per-seed numbers only."""
    return [(_result(REFERENCE, s, a), _result("full", s, b))
            for s, (a, b) in enumerate(zip(ref_avgs, arm_avgs))]


@pytest.mark.parametrize("ref, arm, expected", [
    ([0.40, 0.50, 0.60], [0.45, 0.54, 0.66], "helps"),      # +5, +4, +6: t-interval above 0
    ([0.40, 0.50, 0.60], [0.35, 0.46, 0.54], "hurts"),
    ([0.40, 0.50, 0.60], [0.45, 0.46, 0.66], "no change"),  # signs disagree
    # SmolLM2's +attributing: every seed's mean rises (+1.0, +0.25, +1.25), yet the
    # interval over three seeds holds 0; the old reading said "helps on all 3 seeds"
    ([0.34, 0.3975, 0.4325], [0.35, 0.40, 0.445], "no change"),
    ([0.40], [0.45], "no interval (one seed, no per-task records)"),
])
def test_without_per_task_records_the_reading_is_the_t_interval_over_seeds(ref, arm, expected):
    change = change_over_seeds(_pairs(ref, arm))
    assert change["label"] == expected and change["over"] == "seeds"


def _outcomes(solved_by_task, k=4):
    return {"split": "validation",
            "final": {t: f"{n}/{k}" for t, n in solved_by_task.items()}}


def test_with_per_task_records_the_change_is_paired_task_by_task():
    # Every seed's mean rises by one sample on one task of 40 (+0.6 points), below the noise
    # of the pairs' own samples: no change. Three tasks of every four one sample better on
    # every seed: helps.
    tasks = {f"t{i}": i % 5 for i in range(40)}
    pairs, clear = [], []
    for seed in range(3):
        ref = _result(REFERENCE, seed, 0.40)
        ref.outcomes = _outcomes(tasks)
        one_better = _result("full", seed, 0.406)
        one_better.outcomes = _outcomes({**tasks, "t0": 1})
        pairs.append((ref, one_better))
        many_better = _result("full", seed, 0.6)
        many_better.outcomes = _outcomes({t: n + (i % 4 != 0) if n < 4 else n
                                          for i, (t, n) in enumerate(tasks.items())})
        clear.append((ref, many_better))
    change = change_over_seeds(pairs)
    assert change["over"] == "tasks" and change["value"] == pytest.approx(0.25 / 40)
    assert change["low"] < 0 < change["high"] and change["label"] == "no change"
    assert change_over_seeds(clear)["label"] == "helps"
    # one seed without records: the whole change falls back to the seeds' numbers
    pairs[1][1].outcomes = {}
    assert change_over_seeds(pairs)["over"] == "seeds"


def test_summary_rows_and_table():
    results = [zero_shot([_result(REFERENCE, s, 0.3)], s) for s in (0, 1)]
    results += [_result(REFERENCE, 0, 0.40), _result(REFERENCE, 1, 0.20),
                _result("full", 0, 0.45), _result("full", 1, 0.30)]
    rows = {r["arm"]: r for r in summarize(results, 8)}
    assert list(rows) == ["zero-shot", REFERENCE, "full"]
    assert rows["zero-shot"]["avg"] == (pytest.approx(0.02), 0.0)
    assert rows[REFERENCE]["avg"][0] == pytest.approx(0.30)
    assert rows["full"]["change"]["value"] == pytest.approx(0.075)
    # +5 and +10 on two seeds: same sign, but t over 2 seeds (12.7) spans 0
    assert rows["full"]["verdict"] == "no change" and rows["full"]["change"]["low"] < 0
    assert rows["full"]["rl_gain"]["value"] == pytest.approx(0.075)  # from 0.30 warm-start
    assert "change" not in rows[REFERENCE] and "change" not in rows["zero-shot"]
    text = table(list(rows.values()), 8)
    lines = text.splitlines()
    assert lines[0].startswith("| setting | seeds | avg@8 | avg@8 95% interval | best@8 |")
    assert "| full | 2 | 37.5 ± 10.6 | " in text and "| 47.5 ± 10.6 |" in text
    assert "+7.5 points (95% -24.3 to +39.3) †" in text and "| reference |" in text
    assert lines[2].startswith("| zero-shot | 2 | 2.0 ± 0.0 | 2.0–2.0 † | 10.0 ± 0.0 |")


def test_zero_shot_is_the_base_model_of_the_seeds_runs():
    runs = [_result(REFERENCE, 0, 0.4, base=0.03), _result("full", 0, 0.5, base=0.03),
            _result(REFERENCE, 1, 0.4, base=0.05)]
    zs = zero_shot(runs, 0)
    assert zs.arm == "zero-shot" and zs.final["avg"] == pytest.approx(0.03)
    assert zero_shot(runs, 7).error  # no run of that seed finished


def test_doc_keeps_text_outside_the_generated_section(tmp_path):
    doc = tmp_path / "ablation.md"
    write_doc(doc, f"{BEGIN}\nfirst\n{END}")
    assert doc.read_text().startswith("# Ablation\n")
    doc.write_text("# Ablation\n\nintro by hand\n\n" + f"{BEGIN}\nfirst\n{END}" +
                   "\n\n## Reading\n\nwritten by hand\n")
    write_doc(doc, f"{BEGIN}\nsecond\n{END}")
    text = doc.read_text()
    assert "intro by hand" in text and "written by hand" in text
    assert "second" in text and "first" not in text
    assert text.count(BEGIN) == 1


def test_bad_options_are_refused():
    with pytest.raises(click.BadParameter):
        parse_seeds("0,x")
    with pytest.raises(click.BadParameter):
        parse_seeds("1,1")
    with pytest.raises(click.BadParameter, match="unknown arm"):
        parse_arms("full,+navigating")
    assert parse_arms(None) == list(ARMS)
    with pytest.raises(click.BadParameter, match="judge.workers"):
        check_sets(["judge.workers=3"])  # would make the arms all the same
    with pytest.raises(click.BadParameter, match="eval.k"):
        check_sets(["eval.k=2"])
    check_sets(["actor.num_actors=1"])
    result = CliRunner().invoke(ablation, ["--updates", "0"])
    assert result.exit_code == 2 and "--updates" in result.output
    with pytest.raises(click.BadParameter, match="versions start at 1"):
        parse_versions("0,5")
    assert parse_versions("10,5,5") == (5, 10)


# --- records: an ablation that outlives its run directories -----------------------------------


def _plan(tmp_path, **kw):
    return Plan(tmp_path / "abl", None, Budget(15), [], k=4, **kw)


def _record(arm, seed, stamp, warm=0.3, curve=None):
    return {"arm": arm, "seed": seed, "run_dir": f"runs/abl/{run_name(arm, seed)}",
            "base": {"avg": 0.04}, "warm": {"avg": warm, "best": 0.5, "greedy": 0.3},
            "final": {"avg": warm + 0.03, "best": 0.6, "greedy": 0.3}, "updates": 15,
            "seconds": 900.0, "error": "", "stamp": stamp, "curve": curve or {}}


def _stamp(arm, seed):
    return cell_stamp(None, 15, shared_sets(4, Budget(15), []), arm_settings(arm), seed)


def _write_run(run_dir, split="validation", stages=("base", "warm", "rl")):
    """A finished run's summary and its per-task held-out records."""
    from protocol.run_dir import RunDir

    rd = RunDir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        rd.heldout_records(split, stage).parent.mkdir(parents=True, exist_ok=True)
        rd.heldout_records(split, stage).write_text(
            json.dumps({"task_id": "a", "rewards": [1.0, 0.0, 1.0, 1.0]}) + "\n"
            + json.dumps({"task_id": "b", "rewards": [0.0, 0.0, 0.0, 0.5]}) + "\n")
    evaluation = {"avg": 0.375, "best": 0.5, "tasks": 2, "split": split}
    rd.summary.write_text(json.dumps({"success_base": evaluation, "success_warm": evaluation,
                                      "success_rl": evaluation,
                                      "learner": {"learner/updates": 3}}))


def test_a_runs_per_task_outcomes_are_read_compactly_and_handed_on(tmp_path):
    from autodidact.experiments.arms import copy_before_rl, read_result

    run = tmp_path / "questioning-s0"
    _write_run(run)
    result = read_result(REFERENCE, 0, run)
    assert result.outcomes == {"split": "validation", "base": {"a": "3/4", "b": "0/4"},
                               "warm": {"a": "3/4", "b": "0/4"},
                               "final": {"a": "3/4", "b": "0/4"}}
    assert result.per_task("final") == {"a": [1.0, 1.0, 1.0, 0.0], "b": [0.0] * 4}
    # zero-shot takes the base evaluation's outcomes as its own
    assert zero_shot([result], 0).per_task("final") == result.per_task("base")
    # through the doc's json and back
    again = recorded_result(json.loads(json.dumps({**result.__dict__, "run_dir": str(run)})))
    assert again.per_task("warm") == result.per_task("warm")
    # an arm starting from a kept warm-start takes the records of the stages before RL
    later = tmp_path / "attributing-s0"
    copy_before_rl(run, later, json.loads((run / "summary.json").read_text()))
    assert sorted(p.name for p in (later / "eval").iterdir()) == [
        "heldout-validation-base.jsonl", "heldout-validation-warm.jsonl"]
    # a run made before records were kept has none, and pairs over seeds
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text(json.dumps({"success_rl": {"avg": 0.4, "best": 0.5}}))
    assert read_result(REFERENCE, 0, old).outcomes == {}


def test_a_record_stands_in_for_its_run_only_with_the_same_stamp(tmp_path):
    path = tmp_path / "abl.json"
    path.write_text(json.dumps({"runs": [
        _record(REFERENCE, 0, _stamp(REFERENCE, 0)),
        _record("full", 0, _stamp("full", 0)[:-1] + ["seed=9"]),  # made with other settings
        {**_record("full", 1, _stamp("full", 1)), "error": "exit code 1"}]}))
    records = Records(path)
    found = records.lookup(REFERENCE, 0, _stamp(REFERENCE, 0))
    assert found.from_record and found.reused and found.final["avg"] == pytest.approx(0.33)
    assert found.run_dir == Path("runs/abl/questioning-s0") and found.seconds == 900.0
    assert records.lookup("full", 0, _stamp("full", 0)) is None
    assert records.lookup("full", 1, _stamp("full", 1)) is None  # a failure is not a result
    assert records.lookup(REFERENCE, 1, _stamp(REFERENCE, 1)) is None
    # the same cell with a flag of the run (not of the experiment) still has the same stamp
    run = run_arm(REFERENCE, 0, _plan(tmp_path, records=records), may_run=False)
    assert run.from_record and run.stamp == _stamp(REFERENCE, 0)


def test_a_narrower_call_keeps_the_records_of_the_cells_it_does_not_ask(tmp_path):
    from autodidact.experiments.page import write_outputs

    doc = tmp_path / "abl.md"
    doc.with_suffix(".json").write_text(json.dumps({"runs": [
        _record(REFERENCE, 0, _stamp(REFERENCE, 0)), _record(REFERENCE, 1, _stamp(REFERENCE, 1)),
        _record("full", 0, _stamp("full", 0))]}))
    plan = _plan(tmp_path, records=Records(doc.with_suffix(".json")))
    only = [plan.records.lookup(REFERENCE, 0, _stamp(REFERENCE, 0))]  # --arms/--seeds narrower
    write_outputs(only, plan, doc, "autodidact ablation --seeds 0 --arms +questioning")
    data = json.loads(doc.with_suffix(".json").read_text())
    assert [(r["arm"], r["seed"]) for r in data["runs"]] == [(REFERENCE, 0)]
    assert {(r["arm"], r["seed"]) for r in data["other_records"]} == {(REFERENCE, 1),
                                                                       ("full", 0)}
    again = Records(doc.with_suffix(".json"))  # and the next call finds all three
    assert again.lookup("full", 0, _stamp("full", 0)) is not None
    assert again.lookup(REFERENCE, 1, _stamp(REFERENCE, 1)) is not None


def test_curves_are_asked_of_the_curve_arms_below_the_last_version(tmp_path):
    plan = _plan(tmp_path, curve_versions=(5, 10, 15, 20), curve_arms=(REFERENCE,))
    assert plan.curve_asked(REFERENCE) == [5, 10] and plan.curve_asked("full") == []
    recorded = Result(REFERENCE, 0, None, final={"avg": 0.3}, from_record=True,
                      curve={0: 0.3, 15: 0.33})
    assert lacks_curve(recorded, plan)
    recorded.curve = {0: 0.3, 5: 0.31, 10: 0.32, 15: 0.33}
    assert not lacks_curve(recorded, plan)
    # a run directory's curve is evaluated on the spot, never a reason to run again
    assert not lacks_curve(Result(REFERENCE, 0, tmp_path, final={"avg": 0.3}), plan)


def test_a_warm_start_made_again_that_evaluates_otherwise_makes_its_seeds_records_stale():
    warm = {"avg": 0.3, "best": 0.5, "greedy": 0.3}
    results = [Result(REFERENCE, 0, None, warm=warm, final={"avg": 0.3}, from_record=True),
               Result("full", 0, None, warm=dict(warm), final={"avg": 0.3}, from_record=True),
               Result(REFERENCE, 1, None, warm=warm, final={"avg": 0.3}, from_record=True)]
    same = Result("+questioning+attributing", 0, Path("/r"), warm={**warm, "tasks": 100})
    assert stale_records(results, same) == []
    other = Result("+questioning+attributing", 0, Path("/r"), warm={**warm, "greedy": 0.31})
    assert stale_records(results, other) == [0, 1]  # seed 1 started elsewhere


def test_records_are_run_again_for_their_curve_and_never_dropped_meanwhile(tmp_path,
                                                                         monkeypatch):
    """The order of work and what is published after each run, with runs faked: a recorded
    cell without the asked curve is run again and keeps its record until replaced; a
    re-made warm-start that evaluates otherwise sends the seed's other records back."""
    import autodidact.experiments.arms as abl

    warm, remade = {"avg": 0.3, "best": 0.5, "greedy": 0.3}, {"avg": 0.32, "best": 0.5,
                                                             "greedy": 0.3}
    recorded = {REFERENCE: Result(REFERENCE, 0, None, warm=warm, final={"avg": 0.33, "best": 0.5},
                                  from_record=True, reused=True),
                "full": Result("full", 0, None, warm=warm, final={"avg": 0.35, "best": 0.5},
                               from_record=True, reused=True)}
    ran, published = [], []

    def fake_run_arm(arm, seed, plan, may_run=True, use_records=True, evaluate=True):
        if use_records and arm in recorded:
            return recorded[arm]
        if not may_run:
            return Result(arm, seed, None, error=NOT_RUN)
        ran.append(arm)
        return Result(arm, seed, plan.out / arm, warm=remade, final={"avg": 0.4, "best": 0.5},
                      curve={5: 0.35} if arm == REFERENCE else {})

    monkeypatch.setattr(abl, "run_arm", fake_run_arm)
    plan = _plan(tmp_path, curve_versions=(5,), curve_arms=(REFERENCE,))
    arms = [REFERENCE, "+questioning+attributing", "full"]
    results = run_all(arms, [0], plan, publish=lambda rs: published.append(
        [(r.arm, r.final.get("avg"), r.from_record) for r in rs]))
    # the reference for its curve; its warm-start differs from full's record, so full runs
    # again right after it, before the cell that was never run
    assert ran == [REFERENCE, "full", "+questioning+attributing"]
    assert published[0] == [(REFERENCE, 0.4, False), ("+questioning+attributing", None, False),
                            ("full", 0.35, True)]
    assert [r.final["avg"] for r in results] == [0.4, 0.4, 0.4]
    assert not any(r.from_record for r in results)


# --- a real tiny ablation ---------------------------------------------------------------------

# Three trained arms (outcome-only, +attributing and full) at one seed, each a whole
# `autodidact run` with a short exploration (4 worlds, one exploration each: about 110 tasks),
# a 10-step warm-start, 3 RL updates and 4 held-out tasks, each episode scored k=2 times.
# learner.probe_every=1: each update logs its step gain (what RL moved; three cheap forwards).
# Hindsight tasks and no KL penalty, as the gains below were measured (the default run's
# re-grounded examples and learner.kl_coef 0.1 came later).
TINY = ["explore.seeds=4", "explore.explorations_per_seed=1", "warmstart.steps=10",
        "eval.num_tasks=4", "eval.greedy=false",
        "learner.batch_groups=2", "actor.group_size=4", "actor.num_actors=1",
        "tracking.wandb=offline", "learner.probe_every=1",
        "explore.from_examples=0", "learner.kl_coef=0"]


@pytest.mark.slow
# A guard against a hang, not a speed check: 275 s in a clean-clone run of the suite, over 400 s
# in the suite run beside an hour's soak of the default job.
@pytest.mark.timeout(700)
def test_a_tiny_ablation_end_to_end(tmp_path):
    out = tmp_path / "abl"
    doc = tmp_path / "docs" / "ablation.md"
    args = ["--arms", f"zero-shot,{REFERENCE},+questioning+attributing,full", "--seeds", "3",
            "--updates", "3", "--k", "2", "--out", str(out), "--doc", str(doc),
            "--curve-versions", "2", "--curve-arms", REFERENCE,
            *[a for s in TINY for a in ("--set", s)]]
    result = CliRunner().invoke(ablation, args)
    assert result.exit_code == 0, (result.output, result.exception)

    ref, full = out / "questioning-s3", out / "full-s3"
    configs = {d: yaml.safe_load((d / "config.yaml").read_text()) for d in (ref, full)}
    for cfg in configs.values():
        assert cfg["seed"] == 3 and cfg["tasks"]["synthetic_share"] == 1.0
        assert cfg["eval"]["k"] == 2
    assert configs[ref]["tracking"]["group"] == f"abl/{REFERENCE}"
    assert configs[full]["tracking"]["group"] == "abl/full"
    # The arms differ in exactly what they claim to.
    assert (configs[ref]["learner"]["advantage"], configs[ref]["judge"]["workers"],
            configs[ref]["experience"]["enabled"]) == ("grpo", 0, False)
    assert (configs[full]["learner"]["advantage"], configs[full]["judge"]["workers"],
            configs[full]["experience"]["enabled"]) == ("composite", 1, True)
    assert not read_metrics(ref, "judge") and read_metrics(full, "judge")

    # +attributing warm-starts exactly as the reference does, so it starts from the reference's
    # policy (the same files) instead of warm-starting again; full shows experiences in its
    # warm-start (experience.warmstart_share=0.5 by default), so it makes its own.
    attr = out / "questioning-attributing-s3"
    summaries = {d: json.loads((d / "summary.json").read_text()) for d in (ref, attr, full)}
    # A run whose mixture needs synthetic tasks and whose store has none explores first
    # (explore.stage=auto); a run that finds enough stored: tests/test_explore_integration.py.
    for d in (ref, full):
        assert summaries[d]["explore"]["tasks_stored"] > 0
    assert [summaries[d]["ablation_shared_warmstart"] for d in (ref, attr, full)] == \
        [False, True, False]
    weights = next((ref / "policy_init").glob("*.safetensors")).name
    assert (attr / "policy_init" / weights).samefile(ref / "policy_init" / weights)
    assert not (full / "policy_init" / weights).samefile(ref / "policy_init" / weights)
    ref_log, attr_log = ((out / f"{d.name}.log").read_text() for d in (ref, attr))
    assert "warm-start step" in ref_log and "warm-start step" not in attr_log
    # ... nor evaluates that policy again: it carries the reference run's evaluations
    assert "validation success base" in ref_log
    assert "validation success" not in attr_log.split("validation success after RL")[0]
    assert yaml.safe_load((attr / "config.yaml").read_text())["eval"]["before_rl"] is False
    for key in ("success_base", "success_warm"):
        assert summaries[attr][key] == summaries[ref][key] and summaries[ref][key]

    data = json.loads(doc.with_suffix(".json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    runs = {r["arm"]: r for r in data["runs"]}
    assert set(runs) == {"zero-shot", REFERENCE, "+questioning+attributing", "full"}
    for arm in (REFERENCE, "full"):
        summary = json.loads((Path(runs[arm]["run_dir"]) / "summary.json").read_text())
        # Trained: the learner reached its budget, and the table's number is the run's own.
        assert runs[arm]["updates"] == summary["learner"]["learner/updates"] == 3
        assert runs[arm]["final"] == summary["success_rl"]
        assert summary["success_rl"]["tasks"] == 4
    # RL moved the step-labelled arms' policies towards their objective, beyond the shared
    # warm-start: an update re-scores its batch after the step, deterministically, so one that
    # moved nothing logs exactly 0.0. Measured: +attributing 1.1e-3, 3.3e-4, 8.2e-4 and full
    # 1.1e-3, 3.0e-4, 2.5e-4; 1e-5 is far above rounding and far below those. The outcome-only
    # reference logged 0.0 three times: after 10 warm-start steps every rollout of its batches
    # failed, so no group had an advantage to move towards (and it is not asserted).
    for arm in ("+questioning+attributing", "full"):
        gains = [r["learner/step_gain"] for r in read_metrics(runs[arm]["run_dir"], "learner")
                 if "learner/step_gain" in r]
        assert len(gains) == 3 and max(gains) > 1e-5, (arm, gains)
    # Same seed, same base model, same tasks: zero-shot is both runs' first evaluation.
    assert runs["zero-shot"]["base"] == runs[REFERENCE]["base"] == runs["full"]["base"]
    assert runs["zero-shot"]["final"]["avg"] == runs[REFERENCE]["base"]["avg"]
    # Every cell keeps its per-task outcomes for paired intervals; +attributing, which started
    # from the reference's warm-start, took that warm-start's records with its evaluations.
    for arm in (REFERENCE, "+questioning+attributing", "full"):
        assert set(runs[arm]["outcomes"]) == {"split", "base", "warm", "final"}
        assert len(runs[arm]["outcomes"]["final"]) == 4
    attr_outcomes = runs["+questioning+attributing"]["outcomes"]
    assert attr_outcomes["warm"] == runs[REFERENCE]["outcomes"]["warm"]
    assert runs["zero-shot"]["outcomes"]["final"] == runs[REFERENCE]["outcomes"]["base"]

    text = doc.read_text()
    assert BEGIN in text and END in text and "![ablation](ablation.png)" in text
    # the intervals are over the runs' tasks (no † over seeds), the changes paired per seed too
    assert "marks an interval over seeds" not in text
    assert f"| Δ avg@2 vs {REFERENCE} | seed 3 (paired, 95% interval) |" in text
    for arm in ("zero-shot", REFERENCE, "full"):
        assert f"| {arm} | 1 |" in text
    assert doc.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert (out / "report" / "report.md").exists()

    # Asked again: the finished runs are reused, not run again, and the doc is rewritten.
    stamp = (ref / "summary.json").stat().st_mtime_ns
    again = CliRunner().invoke(ablation, args)
    assert again.exit_code == 0, (again.output, again.exception)
    assert again.output.count("(reused)") == 3
    assert (ref / "summary.json").stat().st_mtime_ns == stamp
    assert doc.read_text().count(BEGIN) == 1

    # The curve: version 2 evaluated for the reference (the arm asked), beside the run's own
    # points after the warm-start (0) and after RL (3); the other arms have none.
    curves = {r["arm"]: r["curve"] for r in data["runs"]}
    assert set(curves[REFERENCE]) == {"0", "2", "3"}
    assert curves["full"] == curves["+questioning+attributing"] == {}
    assert curves[REFERENCE]["3"] == runs[REFERENCE]["final"]["avg"]
    from bench.heldout_curve import ablation_curves

    read, intervals = ablation_curves(doc.with_suffix(".json"), {"grpo": REFERENCE})
    assert read == {"grpo": {"seed 3": {int(v): a for v, a in curves[REFERENCE].items()}}}
    assert set(intervals["grpo"]["seed 3"]) == {0, 3}  # the run's own evaluations kept records

    # A fresh checkout has the doc and its json but no runs: nothing runs again, and the
    # table is the same.
    table_before = doc.read_text().split(BEGIN)[1]
    shutil.rmtree(out)
    fresh = CliRunner().invoke(ablation, args)
    assert fresh.exit_code == 0, (fresh.output, fresh.exception)
    assert fresh.output.count("(reused from the doc's json)") == 3 and "running" not in fresh.output
    assert not ref.exists()
    assert doc.read_text().split(BEGIN)[1] == table_before


def test_the_llm_judge_arm_is_attributing_with_a_served_judge_and_needs_a_model():
    with pytest.raises(click.BadParameter, match="needs --llm-judge"):
        parse_arms(f"{REFERENCE},{LLM_JUDGE_ARM}")
    assert parse_arms(None, llm_judge="smollm2-135m")[-1] == LLM_JUDGE_ARM
    assert LLM_JUDGE_ARM not in parse_arms(None)
    sets = arm_settings(LLM_JUDGE_ARM, "smollm2-135m")
    # the +attributing arm exactly, with the judge served instead of the reference one
    assert sets[:len(ARMS["+questioning+attributing"])] == ARMS["+questioning+attributing"]
    assert "judge.serve=smollm2-135m" in sets and "llm.structured_outputs=vllm" in sets
    assert run_name(LLM_JUDGE_ARM, 2) == "questioning-llm-attributing-s2"


def test_nav_sets_reach_the_navigating_arms_alone():
    nav = ("experience.min_similarity=0.5",)
    assert arm_settings("+questioning+navigating", nav_sets=nav)[-1] == nav[0]
    assert arm_settings("full", nav_sets=nav)[-1] == nav[0]
    for arm in (REFERENCE, "+questioning+attributing"):
        assert arm_settings(arm, nav_sets=nav) == ARMS[arm]
    assert arm_settings("zero-shot", nav_sets=nav) is None


def test_the_section_names_the_shared_and_the_navigating_settings():
    results = [_result(REFERENCE, 0, 0.4), _result("full", 0, 0.45)]
    setup = {"updates": 15, "sets": shared_sets(4, Budget(15, ("eval.num_tasks=100",)),
                                                ["learner.lora_rank=16"]),
             "nav_sets": ["experience.min_similarity=0.5"]}
    made = {"command": "autodidact ablation", "date": "2026-11-26", "machine": "2 CPU cores"}
    text = section(results, summarize(results, 4), 4, "a.png", setup, made)
    assert "`tasks.synthetic_share=1.0 eval.k=4 eval.num_tasks=100 learner.lora_rank=16`" in text
    assert "The arms that navigate also: `experience.min_similarity=0.5`." in text
    assert "avg@4" in text and text.startswith(BEGIN) and text.endswith(END)
    assert "Made by `autodidact ablation` on 2026-11-26" in text and "on 2 CPU cores" in text
    # cells without a named split held out tasks of the training worlds, and say so
    assert "held out tasks, not worlds" in text and "† marks an interval over seeds" in text
    assert "written again" not in text


def test_from_json_the_page_is_written_again_with_the_new_reading_and_nothing_run(tmp_path):
    """A page whose json holds per-seed numbers only (its runs gone) is read again: the old
    "helps on all 3 seeds" becomes the label of the t-interval over seeds."""
    doc = tmp_path / "abl.md"
    doc.write_text(f"# Ablation\n\nby hand\n\n{BEGIN}\nold table: helps on all 3 seeds\n{END}\n")
    ref, arm = [0.34, 0.3975, 0.4325], [0.35, 0.40, 0.445]
    runs = [{**_record(REFERENCE, s, [], warm=0.3), "final": {"avg": a, "best": 0.6}}
            for s, a in enumerate(ref)]
    runs += [{**_record("+questioning+attributing", s, [], warm=0.3),
              "final": {"avg": a, "best": 0.6}} for s, a in enumerate(arm)]
    made = {"command": "autodidact ablation -c configs/smollm2.yaml", "date": "2026-11-26",
            "machine": "2 CPU cores"}
    doc.with_suffix(".json").write_text(json.dumps({
        "budget": {"updates": 15, "sets": ["tasks.synthetic_share=1.0", "eval.k=4"],
                   "nav_sets": []}, "made": made, "rows": [], "runs": runs}))
    result = CliRunner().invoke(ablation, ["--from-json", "--doc", str(doc)])
    assert result.exit_code == 0, (result.output, result.exception)
    text = doc.read_text()
    assert "by hand" in text and "helps on all 3 seeds" not in text
    assert "| +questioning+attributing | 3 |" in text
    assert "+0.8 points (95% -0.5 to +2.1) † | no change |" in text
    assert "Made by `autodidact ablation -c configs/smollm2.yaml` on 2026-11-26" in text
    assert "written again on" in text and "nothing was run again" in text
    data = json.loads(doc.with_suffix(".json").read_text())
    assert data["made"] == made and data["rewritten"]["command"] == "autodidact ablation"
    assert [r["final"] for r in data["runs"]] == [r["final"] for r in runs]
    assert data["rows"][1]["verdict"] == "no change"
    assert rewrite_from_json(doc, "again")[1] == table(summarize(
        [recorded_result(r) for r in runs], 4), 4)
    missing = CliRunner().invoke(ablation, ["--from-json", "--doc", str(tmp_path / "x.md")])
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_no_run_writes_the_table_of_what_finished_and_runs_nothing(tmp_path):
    out, doc = tmp_path / "abl", tmp_path / "abl.md"
    result = CliRunner().invoke(ablation, ["--no-run", "--seeds", "0,1", "--arms",
                                           f"zero-shot,{REFERENCE}", "--out", str(out),
                                           "--doc", str(doc)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "not run yet" in result.output and "running" not in result.output
    assert not list(out.glob("*-s*"))  # no run directory was made
    text = doc.read_text()
    assert "Not run yet (4 of 4;" in text and f"{REFERENCE} seed 1" in text
