"""bench/scale_actors.py: its fixed-policy groups are valid messages, and the bench, run small
(1 and 2 actor processes for a few seconds, real Redis, replay server, learner loop), measures
what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.scale_actors import fixed_group, trajectory_layout
from protocol import codec
from protocol.messages import Group, Task

ROOT = Path(__file__).resolve().parents[1]

FIELDS = {"actors", "seconds", "groups", "groups_per_s", "consumed_per_s", "acked_by_actors",
          "ratio_to_1", "ratio_to_linear", "learner_idle_fraction", "learner_updates",
          "replay_cpu", "replay_write_txns_per_s", "ack_ms_mean", "actor_wait_fraction",
          "actors_cpu", "learner_cpu", "redis_cpu", "machine_busy", "fixed_policy_ceiling_per_s",
          "replay_groups_total", "versions", "stale_skipped", "admission_blocked_fraction",
          "roles_cpu", "replay_backlog_mean", "learner_draw_rpc_fraction"}


def test_fixed_group_is_a_valid_group_of_the_layout():
    layout = trajectory_layout(tokens=256, turns=5, action_tokens=16)
    prompt, spans = layout
    assert prompt == 64 and len(spans) == 5 and spans[-1][2] == 256
    task = Task(task_id="t", env="files", query="q", seed=3)
    group = fixed_group(task, 8, layout, [4, 4, 5, 5, 6], np.random.default_rng(0), (8, 197),
                        "actor-0")
    back = codec.decode_body(Group.TYPE, codec.encode_body(group))  # validates on decode
    assert len(back.trajectories) == 8
    t = back.trajectories[0]
    assert len(t.tokens) == 256 and t.tokens.min() >= 8 and t.tokens.max() < 197
    assert int(t.action_mask.sum()) == 5 * 16 and len(t.steps) == 5
    assert back.policy_versions() == (4, 6)
    assert sorted(tr.reward for tr in back.trajectories) == [0.0] * 4 + [1.0] * 4


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_scale_bench_two_actors_store_about_twice_what_one_does(tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "bench.scale_actors", "--counts", "1,2", "--seconds", "4",
           "--warmup", "1", "--group-seconds", "0.2", "--update-seconds", "0.05",
           "--set", "learner.batch_groups=4", "--out", str(out), "--no-plot"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "groups/s" in proc.stdout and "/ linear" in proc.stdout
    report = json.loads(out.read_text())
    assert report["learner"] == "fixed" and report["machine"]["cpus"] >= 1
    one, two = report["results"]
    for r, n in ((one, 1), (two, 2)):
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["actors"] == n
        assert r["groups"] > 0 and r["groups_per_s"] > 0
        assert r["replay_groups_total"] >= r["groups"]  # stored in LMDB, counted by replay
        assert r["acked_by_actors"] > 0  # the actors had acks back
        # the fixed policy offers 5 groups/s per actor; the count can't beat it by much
        assert r["groups_per_s"] <= 1.3 * r["fixed_policy_ceiling_per_s"]
        assert r["learner_updates"] > 0 and r["versions"] > 0 and r["consumed_per_s"] > 0
        assert 0.0 <= r["learner_idle_fraction"] <= 1.0
        assert r["replay_cpu"] > 0 and r["ack_ms_mean"] > 0
    assert two["groups"] > one["groups"]
    assert two["groups_per_s"] > 1.3 * one["groups_per_s"], (one, two)
    assert one["ratio_to_1"] == 1.0
    assert two["ratio_to_linear"] == pytest.approx(two["ratio_to_1"] / 2)
