"""bench/run_seeds.py: reuse of finished seeds and the reading of RL's change."""

import json

from autodidact.experiments.arms import Result, run_argv
from bench.run_seeds import run_seed, summarize, table
from protocol.run_dir import RunDir


def result(seed, base, warm, final):
    return Result("cfg", seed, None, base={"avg": base, "greedy": base},
                  warm={"avg": warm, "greedy": warm}, final={"avg": final, "greedy": final},
                  updates=30, seconds=600.0)


def test_rl_is_said_to_help_only_when_every_seed_agrees():
    helped = summarize([result(0, .1, .5, .6), result(1, .1, .5, .62), result(2, .1, .5, .58)])
    assert helped["rl_verdict"] == "helps on all 3 seeds"
    assert abs(helped["rl_change"][0] - 0.1) < 1e-9
    mixed = summarize([result(0, .1, .5, .6), result(1, .1, .5, .4), result(2, .1, .5, .55)])
    assert mixed["rl_verdict"] == "no consistent effect"
    hurt = summarize([result(0, .1, .5, .3), result(1, .1, .6, .4)])
    assert hurt["rl_verdict"] == "hurts on all 2 seeds"


def test_table_has_a_line_per_seed_and_the_mean():
    results = [result(0, .1, .5, .6), Result("cfg", 1, None, error="not run yet")]
    text = table(results, summarize(results), k=4)
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 1
    assert lines[2].startswith("| 0 | 10.0 | 50.0 | 60.0 | +10.0 |")
    assert "not run yet" in lines[3]
    assert lines[4].startswith("| mean ± std (1) | 10.0 ± 0.0")


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
