"""bench/env_rollouts.py: the default run's actors with the env in process and served."""

from __future__ import annotations

import json

import pytest

from bench.env_rollouts import main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_arms_roll_out_the_same_episodes_and_the_served_calls_are_timed(tmp_path):
    out = tmp_path / "rollouts.json"
    result = main(["--actors", "1", "--batches", "1", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    local, served = result["arms"]
    assert not local["served"] and served["served"]
    assert local["rollouts"] == served["rollouts"] == result["episodes_per_batch"] == 16
    assert local["failed"] == served["failed"] == 0
    assert result["same_rollouts"]  # the served env answered exactly as the one in process
    # Every call of the served arm timed, by type: an open, a reset and a check per episode.
    latency = result["env_socket_latency"]
    for kind in ("EnvOpen", "EnvReset", "EnvEvaluate"):
        assert latency[kind]["calls"] == 16
    assert latency["EnvStep"]["calls"] == served["steps"]
    assert 0 < latency["all"]["p50_ms"] <= latency["all"]["p99_ms"]
    assert 0 < local["env_share"] < 1 and 0 < served["env_share"] < 1
    assert result["ratio_served_to_in_process"]["per_pair"] == [
        served["rollouts_per_s"] / local["rollouts_per_s"]]
