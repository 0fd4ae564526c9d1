"""Metrics: namespaced JSONL lines shared by processes; the tail reader waits for whole lines."""

import json
import math

from metrics.jsonl import MetricsTail, MetricsWriter, read_metrics


def test_records_are_namespaced_and_tailed(tmp_path):
    learner = MetricsWriter(tmp_path, "learner")
    actor = MetricsWriter(tmp_path, "actor", "actor-1")
    tail = MetricsTail(tmp_path)
    learner.log({"loss": 0.5, "actor/other": 1, "bad": math.nan}, step=3)
    actor.log({"groups": 2})
    first = tail.read_new()
    assert [r["role"] for r in first] == ["learner", "actor"]
    assert first[0]["learner/loss"] == 0.5 and first[0]["actor/other"] == 1
    assert first[0]["learner/bad"] is None and first[0]["step"] == 3
    assert first[1]["id"] == "actor-1" and first[1]["actor/groups"] == 2
    assert tail.read_new() == []
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a writer caught mid-line
        f.write(json.dumps({"role": "learner", "learner/loss": 1.0})[:10])
    assert tail.read_new() == []
    assert [r["learner/loss"] for r in read_metrics(tmp_path, "learner")] == [0.5]
    learner.close()
    actor.close()
