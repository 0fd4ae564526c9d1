"""``autodidact eval``: the reference solutions score 100% through the rollout code, a model's
per-task results and summary land on disk, and the split is written to the run directory."""

from __future__ import annotations

import json

from click.testing import CliRunner

from autodidact.cli import main


def _eval(*args):
    result = CliRunner().invoke(main, ["eval", *args])
    assert result.exit_code == 0, result.output
    return result


def test_ground_truth_policy_scores_everything(tmp_path, files_policy_path):
    out = tmp_path / "gt.jsonl"
    result = _eval("--run-dir", str(tmp_path), "--policy", "ground-truth", "-k", "2",
                   "--limit", "12", "--model", files_policy_path, "--out", str(out))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 12 and all(r["rewards"] == [1.0, 1.0] for r in records)
    assert "overall" in result.output and "100.0%" in result.output
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["avg"] == summary["best"] == 1.0 and summary["k"] == 2
    split = json.loads((tmp_path / "split.json").read_text())
    assert split["env"] == "files" and split["test"] and split["train"]
    assert not set(split["train"]) & set(split["test"])
    assert {r["task_id"] for r in records} <= set(split["test"])


def test_model_policy_reports_avg_and_best(tmp_path, files_policy_path):
    _eval("--run-dir", str(tmp_path), "-k", "3", "--limit", "6", "--temperature", "1.0",
          "--model", files_policy_path)
    path = tmp_path / "eval" / "files-test-model-k3.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6
    for r in records:
        assert len(r["rewards"]) == 3 and r["avg"] == sum(x >= 1 for x in r["rewards"]) / 3
        assert r["best"] == float(any(x >= 1 for x in r["rewards"]))
    summary = json.loads(path.with_suffix(".summary.json").read_text())
    assert summary["avg"] <= summary["best"] and summary["temperature"] == 1.0


def test_bad_k_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["eval", "--run-dir", str(tmp_path), "-k", "0"])
    assert result.exit_code == 2 and "-k" in result.output
