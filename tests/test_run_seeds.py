"""bench/run_seeds.py: reuse of finished seeds and the reading of RL's change."""

import json
from pathlib import Path

import pytest

from autodidact.experiments.arms import Result, run_argv
from bench.run_seeds import main, run_seed, summarize, table
from protocol.run_dir import RunDir


def result(seed, base, warm, final):
    return Result("cfg", seed, None, base={"avg": base, "greedy": base},
                  warm={"avg": warm, "greedy": warm}, final={"avg": final, "greedy": final},
                  updates=30, seconds=600.0)


def test_rl_is_said_to_help_only_when_its_interval_lies_above_zero():
    helped = summarize([result(0, .1, .5, .6), result(1, .1, .5, .62), result(2, .1, .5, .58)])
    assert helped["rl_verdict"] == "helps" and helped["rl_change"]["over"] == "seeds"
    assert helped["rl_change"]["value"] == pytest.approx(0.1)
    assert helped["rl_change"]["low"] == pytest.approx(0.1 - 4.302653 * 0.02 / 3 ** 0.5)
    mixed = summarize([result(0, .1, .5, .6), result(1, .1, .5, .4), result(2, .1, .5, .55)])
    assert mixed["rl_verdict"] == "no change"
    hurt = summarize([result(0, .1, .5, .3), result(1, .1, .6, .35), result(2, .1, .55, .3)])
    assert hurt["rl_verdict"] == "hurts"
    # Every seed rises (+1.0, +0.25, +1.25 points) but the interval over 3 seeds spans 0.
    rising = summarize([result(0, .1, .34, .35), result(1, .1, .3975, .40),
                        result(2, .1, .4325, .445)])
    assert rising["rl_change"]["low"] < 0 < rising["rl_change"]["high"]
    assert rising["rl_verdict"] == "no change"
    assert summarize([result(0, .1, .5, .6)])["rl_verdict"].startswith("no interval")


def with_records(r, warm_solved, final_solved, k=4):
    """``r`` with per-task outcomes of its warm-start and final evaluations."""
    r.outcomes = {"split": "validation",
                  "warm": {f"t{i}": f"{n}/{k}" for i, n in enumerate(warm_solved)},
                  "final": {f"t{i}": f"{n}/{k}" for i, n in enumerate(final_solved)}}
    return r


def test_with_per_task_records_rls_change_is_paired_task_by_task():
    # 50 tasks, two samples better after RL on one of them per seed: every seed's mean rises
    # by 1 point, within the noise of its own samples.
    warm = [i % 5 for i in range(50)]
    runs = [with_records(result(s, .1, .5, .51), warm, [warm[0] + 2] + warm[1:])
            for s in range(3)]
    row = summarize(runs)
    assert row["rl_change"]["over"] == "tasks" and row["rl_verdict"] == "no change"
    assert row["final_avg_ci"]["over"] == "tasks"
    assert row["rl_change"]["value"] == pytest.approx(0.5 / 50)
    text = table(runs, row, k=4)
    assert "| 0 | 10.0 | 50.0 | 51.0 | +1.0 points (95% " in text and "): no change |" in text
    better = [min(n + 2, 4) for n in warm]
    clear = summarize([with_records(result(s, .1, .5, .6), warm, better) for s in range(3)])
    assert clear["rl_verdict"] == "helps"


def test_table_has_a_line_per_seed_and_the_mean():
    results = [result(0, .1, .5, .6), Result("cfg", 1, None, error="not run yet")]
    text = table(results, summarize(results), k=4)
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 2
    assert lines[2].startswith("| 0 | 10.0 | 50.0 | 60.0 | +10.0 |")
    assert "not run yet" in lines[3]
    assert lines[4].startswith("| mean ± std (1) | 10.0 ± 0.0")
    assert lines[5].startswith("| 95% interval | 10.0% (no interval) †")
    assert "+10.0 points (no interval) †: no interval (one seed" in lines[5]


def test_a_recorded_json_is_summarized_again_without_its_runs(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("name: cfg\n")
    runs = [{**result(s, .1, .5, .5 + d).__dict__, "run_dir": f"cfg-s{s}"}
            for s, d in enumerate([.01, .0025, .0125])]
    recorded = tmp_path / "seeds.json"
    recorded.write_text(json.dumps({"config": str(config), "sets": [], "runs": runs,
                                    "summary": {"rl_verdict": "helps on all 3 seeds"}}))
    main(["--from-json", str(recorded)])
    data = json.loads(recorded.read_text())
    assert data["summary"]["rl_verdict"] == "no change"
    assert [r["final"] for r in data["runs"]] == [r["final"] for r in runs]
    assert "RL change (avg@4, after RL − after warm-start): +0.8 points (95% -0.5 to +2.1) †, " \
        "no change" in capsys.readouterr().out


def test_a_finished_seed_is_reused_only_for_the_same_command(tmp_path):
    config = tmp_path / "cfg.yaml"
    run_dir = (tmp_path / "cfg-s3").resolve()
    run_dir.mkdir()
    summary = {"success_base": {"avg": .1}, "success_warm": {"avg": .5},
               "success_rl": {"avg": .7}, "learner": {"learner/updates": 12}}
    RunDir(run_dir).summary.write_text(json.dumps(summary))
    argv = run_argv(config, run_dir, None, ["a=1", "seed=3", "name=cfg-s3"])
    RunDir(run_dir).ablation_argv.write_text(json.dumps(argv[1:]))

    reused = run_seed(config, "cfg", 3, ["a=1"], may_run=False, runs=tmp_path)
    assert reused.reused and reused.final == {"avg": .7} and reused.updates == 12
    other = run_seed(config, "cfg", 3, ["a=2"], may_run=False, runs=tmp_path)
    assert not other.reused and other.error == "not run yet"


def test_a_name_keeps_another_measurements_runs_apart(capsys):
    """``--name`` puts seeds in runs/<name>-sN, so a second measurement of one config never
    finds (and replaces) the first one's runs."""
    config = Path(__file__).resolve().parents[1] / "configs" / "quick.yaml"
    main(["-c", str(config), "--seeds", "7", "--name", "quick-elsewhere", "--no-run"])
    out = capsys.readouterr().out
    assert "runs/quick-elsewhere-s7" in out and "name=quick-elsewhere-s7" in out
    assert "runs/quick-s7" not in out
