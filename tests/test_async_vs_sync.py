"""bench/async_vs_sync.py: the report's speed-up and the overlap bound from known busy times."""

from __future__ import annotations

import pytest

from bench.async_vs_sync import report


def mode(name, wall, samples, actor_s, learner_s, held=None):
    return {"mode": name, "updates": 10, "wall_s": wall, "samples_per_s": samples,
            "lag_mean": 0.0, "reward_last10": 0.5, "learner_step_s": learner_s,
            "learner_idle_s": 0.0, "actor_rollout_s": actor_s, "actor_idle_s": 0.0,
            "held_out": held, "warm": None}


def test_report_gives_the_speed_up_and_the_bound_of_the_sync_run():
    text = report([mode("sync", 100.0, 1.0, actor_s=60.0, learner_s=40.0),
                   mode("async", 80.0, 1.25, actor_s=70.0, learner_s=45.0,
                        held={"avg": 0.5, "best": 0.7, "tasks": 40})])
    assert "async/sync speed-up: 1.25x (wall 1.25x)" in text
    # (A + L) / max(A, L) of the sync run: (60 + 40) / 60
    assert "(60 + 40) / 60 = 1.67x" in text
    assert "held-out avg 50.0% (no interval)" in text


def test_report_gives_held_out_intervals_and_the_paired_change_with_its_label(tmp_path):
    import json

    from bench.async_vs_sync import held_out_change

    for name, solved in (("sync", [1.0, 1.0, 0.0, 0.0]), ("async", [1.0, 1.0, 1.0, 0.0])):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "eval" / "heldout-validation-rl.jsonl").write_text("".join(
            json.dumps({"task_id": f"t{i}", "rewards": [s]}) + "\n"
            for i, s in enumerate(solved)))
        (tmp_path / name / "summary.json").write_text(json.dumps({"success_rl": {
            "avg": sum(solved) / 4, "best": 0.5, "split": "validation"}}))
    change = held_out_change(tmp_path)
    # one task of four differs: a quarter of the paired draws miss it, so the interval
    # starts at 0 and the reading is no change
    assert change["over"] == "tasks" and change["value"] == 0.25 and change["low"] == 0.0
    text = report([mode("sync", 100.0, 1.0, 60.0, 40.0,
                        held={"avg": 0.5, "avg_ci": [0.25, 0.75]}),
                   mode("async", 80.0, 1.25, 70.0, 45.0, held={"avg": 0.75})], change=change)
    assert "held-out avg 50.0% (95% 25.0–75.0)" in text
    assert "held-out avg 75.0% (no interval)" in text  # a run made before intervals were kept
    assert "async − sync held-out avg after RL: +25.0 points (95% +0.0 to +75.0): no change" \
        in text


def test_time_to_level_reads_the_curve_then_the_clock_of_its_updates():
    from bench.async_vs_sync import seconds_to_level

    seconds = {1: 0.0, 2: 100.0, 4: 300.0, 8: 700.0}
    # the curve reaches 0.5 halfway from version 4 (0.4) to 8 (0.6): update 6, 500 s
    assert seconds_to_level({0: 0.3, 4: 0.4, 8: 0.6}, seconds, 0.5) == pytest.approx(500.0)
    # reached by the warm-start: before the first update, so 0 s on this clock
    assert seconds_to_level({0: 0.55, 8: 0.6}, seconds, 0.5) == 0.0
    assert seconds_to_level({0: 0.3, 8: 0.45}, seconds, 0.5) is None


def test_report_gives_the_ratio_of_the_times_to_the_same_success():
    from bench.async_vs_sync import report

    reached = {"level": 0.5, "modes": {
        "sync": {"curve": {0: 0.3, 12: 0.5}, "seconds_to_level": 600.0},
        "async": {"curve": {0: 0.3, 6: 0.5, 12: 0.55}, "seconds_to_level": 240.0}}}
    text = report([mode("sync", 600.0, 1.0, 60.0, 40.0), mode("async", 400.0, 1.5, 70.0, 45.0)],
                  reached)
    assert "sync/async time to that success: 2.50x" in text
    assert "async: v0:30.0%  v6:50.0%  v12:55.0%   reached at 240s" in text


def test_the_plot_draws_the_learners_time_and_the_curves(tmp_path):
    from bench.async_vs_sync import plot

    sync = {**mode("sync", 600.0, 1.0, 60.0, 40.0), "step_s_each": [30.0, 31.0],
            "idle_s_each": [12.0, 11.0], "seconds_at_versions": {1: 0.0, 2: 42.0}}
    asyn = {**mode("async", 400.0, 1.5, 70.0, 45.0), "step_s_each": [41.0, 40.0],
            "idle_s_each": [0.0, 0.0], "seconds_at_versions": {1: 0.0, 2: 40.0}}
    reached = {"level": 0.5, "modes": {"sync": {"curve": {0: 0.3, 2: 0.5}},
                                       "async": {"curve": {0: 0.3, 2: 0.45}}}}
    for name, curves in (("both.png", reached), ("speed.png", None)):
        path = plot([sync, asyn], curves, tmp_path / name)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
