"""bench/explore_kinds.py: two small explore runs a seed, each kind's share with an interval."""

from __future__ import annotations

import json

import pytest

from bench.explore_kinds import main
from questioning.coverage import TASK_KINDS


def test_each_arm_and_the_paired_difference_per_kind(tmp_path):
    out = tmp_path / "kinds.json"
    assert main(["--env", "shop", "--seeds", "2", "--set", "explore.seeds=1",
                 "--set", "explore.explorations_per_seed=3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m bench.explore_kinds --env shop")
    for name in ("a", "b"):
        arm = result[name]
        assert len(arm["runs"]) == 2 and all(r["tasks"] > 0 for r in arm["runs"])
        for kind in TASK_KINDS:
            low, high = arm[kind]["ci"]
            assert 0 <= arm[kind]["mean"] <= 1 and low <= arm[kind]["mean"] <= high
    assert result["b"]["kind_target"] == pytest.approx(0.1)
    for kind in TASK_KINDS:
        runs = zip(result["a"]["runs"], result["b"]["runs"])
        diffs = [b["shares"][kind] - a["shares"][kind] for a, b in runs]
        assert result["b_minus_a"][kind]["diff"] == pytest.approx(sum(diffs) / 2)
