"""bench/async_vs_sync.py: the report's speed-up and the overlap bound from known busy times."""

from __future__ import annotations

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
    assert "held-out avg 50.0%" in text
