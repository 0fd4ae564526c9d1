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
    assert summary["avg_ci"] == summary["best_ci"] == [1.0, 1.0]  # nothing left to vary
    assert all(c["avg_ci"] == [1.0, 1.0] for c in summary["categories"].values())
    assert summary["valid_action_rate"] == 1.0  # every reference action is a tool call
    assert sum(r["valid_steps"] for r in records) == sum(r["total_steps"] for r in records) > 0
    split = json.loads((tmp_path / "split.json").read_text())
    assert split["env"] == "files" and split["test"] and split["train"]
    assert not set(split["train"]) & set(split["test"])
    assert {r["task_id"] for r in records} <= set(split["validation"])  # eval's default split


def test_model_policy_reports_avg_and_best(tmp_path, files_policy_path):
    _eval("--run-dir", str(tmp_path), "-k", "3", "--limit", "6", "--temperature", "1.0",
          "--model", files_policy_path)
    path = tmp_path / "eval" / "files-validation-model-k3.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6
    for r in records:
        assert len(r["rewards"]) == 3 and r["avg"] == sum(x >= 1 for x in r["rewards"]) / 3
        assert r["best"] == float(any(x >= 1 for x in r["rewards"]))
    summary = json.loads(path.with_suffix(".summary.json").read_text())
    assert summary["avg"] <= summary["best"] and summary["temperature"] == 1.0


def test_results_land_batch_by_batch_and_resume_runs_only_the_missing_tasks(
        tmp_path, files_policy_path, monkeypatch):
    import episodes.evaluate as evaluation

    out = tmp_path / "gt.jsonl"
    args = ["--run-dir", str(tmp_path), "--policy", "ground-truth", "-k", "1",
            "--model", files_policy_path, "--out", str(out), "--batch-tasks", "2"]
    seen = []
    loop = evaluation.evaluate

    def spy(backend, tasks, *a, on_batch=None, **kw):
        def recorded(records):
            seen.append(len(out.read_text().splitlines()))  # on disk before this batch
            on_batch(records)
        return loop(backend, tasks, *a, on_batch=recorded, **kw)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    _eval(*args, "--limit", "6")
    assert seen == [0, 2, 4] and len(out.read_text().splitlines()) == 6
    # Killed after four tasks, the fifth line half written:
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    summary_path = out.with_suffix(".summary.json")
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "complete": False}))
    seen.clear()
    result = _eval(*args, "--limit", "6", "--resume")
    assert "4 kept" in result.output and seen == [4]  # one batch: the two missing tasks
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["task_id"] for r in records) == sorted(json.loads(line)["task_id"]
                                                           for line in lines)
    resumed = json.loads(summary_path.read_text())
    assert resumed["complete"] and resumed["kept_from_before"] == 4 and resumed["tasks"] == 6
    assert resumed["avg"] == 1.0
    # Other settings: refused, nothing touched.
    before = out.read_text()
    refused = CliRunner().invoke(main, ["eval", *args, "--limit", "6", "--resume",
                                        "--temperature", "0.5"])
    assert refused.exit_code == 1 and "temperature" in refused.output
    assert "drop --resume" in refused.output and out.read_text() == before


def test_the_summary_and_table_carry_intervals_overall_and_per_category():
    from autodidact.eval_cli import render_table, with_intervals
    from episodes.evaluate import summarize

    records = [{"task_id": f"{c}{i}", "category": c, "rewards": r, "avg": sum(r) / 2,
                "best": float(any(r))}
               for c, r in [("a", [1.0, 1.0]), ("a", [0.0, 0.0]), ("b", [1.0, 0.0])]
               for i in range(2)]
    summary = {"k": 2, **with_intervals(summarize(records))}
    assert "per_task" not in summary
    low, high = summary["avg_ci"]
    assert low < summary["avg"] == 0.5 < high
    assert summary["categories"]["a"]["avg_ci"] == [0.0, 1.0]  # two solved, two failed tasks
    b_low, b_high = summary["categories"]["b"]["avg_ci"]  # [1, 0] twice: only samples vary
    assert b_low < 0.5 < b_high and summary["categories"]["b"]["best_ci"] == [1.0, 1.0]
    lines = render_table(summary).splitlines()
    assert "avg@2 (95% interval)" in lines[0]
    assert lines[1].split()[:3] == ["a", "4", "50.0%"] and "(95% 0.0–100.0)" in lines[1]
    assert lines[3].startswith("overall") and f"(95% {100 * low:.1f}–{100 * high:.1f})" \
        in lines[3]


def test_bad_k_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["eval", "--run-dir", str(tmp_path), "-k", "0"])
    assert result.exit_code == 2 and "-k" in result.output


def test_run_and_eval_share_one_evaluation(tmp_path, files_policy_path, monkeypatch):
    """`autodidact run`'s held-out evaluation and `autodidact eval` are one function: the same
    tasks, k, temperature, seed and rollout limits reach the one evaluation loop, and give
    the same numbers; run's result is also logged as eval/..."""
    import episodes.evaluate as evaluation
    from autodidact.resolve import resolve_config
    from autodidact.stages import held_out_eval
    from metrics.jsonl import read_metrics

    calls = []
    loop = evaluation.evaluate

    def spy(backend, tasks, make_env, settings, **kw):
        calls.append(([t.task_id for t in tasks], settings, kw["temperature"], kw.get("k", 1),
                      kw["seed"]))
        return loop(backend, tasks, make_env, settings, **kw)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    cfg = resolve_config(None, ["eval.num_tasks=5", "eval.k=2", "eval.temperature=0.7",
                                "eval.greedy=true"])
    lines = []
    held = held_out_eval(cfg, tmp_path, files_policy_path, "now", 7, say=lines.append)
    assert set(held) == {"avg", "avg_ci", "best", "best_ci", "tasks", "greedy", "split"}
    assert held["tasks"] == 5 and held["split"] == "validation"
    assert "validation success now" in lines[0] and "5 tasks" in lines[0]
    assert [c[2:] for c in calls] == [(0.7, 2, 0), (0.0, 1, 0)]  # sampled, then greedy
    _eval("--run-dir", str(tmp_path), "-k", "2", "--limit", "5", "--temperature", "0.7",
          "--batch-tasks", "64", "--model", files_policy_path)
    assert len(calls) == 3 and calls[2] == calls[0]
    summary = json.loads((tmp_path / "eval" / "files-validation-model-k2.summary.json")
                         .read_text())
    assert (summary["avg"], summary["avg_ci"], summary["best"], summary["tasks"]) == \
        (held["avg"], held["avg_ci"], held["best"], held["tasks"])
    (logged,) = read_metrics(tmp_path, "eval")
    assert logged["step"] == 7 and logged["eval/success_avg"] == held["avg"]
    assert logged["eval/success_greedy"] == held["greedy"]
