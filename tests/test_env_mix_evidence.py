"""Per-env evidence of an env mix (issue 55 part 2): ``status``, the viewer's Run page and
``report`` show each env's held-out success with its interval and the mean over envs; the
actors and the validation probe log success per env, and report draws it; the frontier
feeder keeps each env's share of the draws at its weight.

The summary.json of a mix run is made by the code the launcher uses
(:func:`autodidact.stages.heldout_result` over per-task records of two envs, each stage's
numbers different, so a table that shows the wrong stage or env fails); the run of one env is
the same without ``env`` in its records. The feeder draws through the real Redis of
tests/conftest.py.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from autodidact.stages import heldout_result
from autodidact.status_cli import collect, status
from episodes.evaluate import summarize
from metrics.intervals import format_rate

# per stage, per env: the avg@k of each of the env's 4 tasks (k=2 rollouts each)
STAGES = {"base": {"files": [0.0, 0.0, 0.5, 0.0], "shop": [0.0, 0.0, 0.0, 0.0]},
          "warm": {"files": [1.0, 0.5, 0.5, 0.0], "shop": [0.5, 0.0, 0.0, 0.0]},
          "rl": {"files": [1.0, 1.0, 0.5, 1.0], "shop": [0.5, 0.5, 0.0, 1.0]}}
TEST_RL = {"files": [1.0, 1.0, 1.0, 0.5], "shop": [0.0, 0.5, 0.0, 0.0]}


def task_records(per_env: dict[str, list[float]], mix: bool = True) -> list[dict]:
    """Per-task records as episodes.evaluate.task_record writes them (k=2)."""
    out = []
    for env, avgs in per_env.items():
        for i, avg in enumerate(avgs):
            rewards = [1.0] * round(2 * avg) + [0.0] * (2 - round(2 * avg))
            out.append({"task_id": f"{env}/{i:04d}/t", "category": "c",
                        **({"env": env} if mix else {}), "rewards": rewards, "avg": avg,
                        "best": float(avg > 0)})
    return out


def write_summary(run_dir: Path, mix: bool = True) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {f"success_{stage}": heldout_result("validation", summarize(task_records(v, mix)))
               for stage, v in STAGES.items()}
    summary["eval_split"] = "validation"
    summary["looked_at_test"] = 1
    summary["test"] = {"rl": heldout_result("test", summarize(task_records(TEST_RL, mix)))}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text("name: mixtest\n")
    return summary


@pytest.fixture
def mix_run(tmp_path) -> tuple[Path, dict]:
    run_dir = tmp_path / "mix"
    return run_dir, write_summary(run_dir)


# --- status and the viewer ---------------------------------------------------------------------


def test_status_shows_each_envs_held_out_success_and_the_mean(mix_run):
    run_dir, summary = mix_run
    rows = collect(run_dir, replay_timeout_s=0.1)["heldout_envs"]
    got = {(r["split"], r["stage"], r["env"]): r for r in rows}
    assert set(got) == {(split, stage, env) for split, stages in
                        (("validation", ("base", "warm", "rl")), ("test", ("rl",)))
                        for stage in stages for env in ("files", "shop", "mean over envs")}
    for stage in ("base", "warm", "rl"):
        for env in ("files", "shop"):
            one = summary[f"success_{stage}"]["envs"][env]
            row = got[("validation", stage, env)]
            assert (row["avg"], row["ci"], row["tasks"]) == (one["avg"], one["avg_ci"], 4)
        assert got[("validation", stage, "mean over envs")]["avg"] == pytest.approx(
            sum(STAGES[stage]["files"] + STAGES[stage]["shop"]) / 8)
    assert got[("test", "rl", "shop")]["avg"] == 0.125
    assert got[("test", "rl", "files")]["avg"] == 0.875

    text = CliRunner().invoke(status, ["--run-dir", str(run_dir)],
                           env={"COLUMNS": "400"}).output
    lines = {line.split("  ")[0].strip(): line for line in text.splitlines()}
    shop_rl = summary["success_rl"]["envs"]["shop"]
    assert f"rl {format_rate(shop_rl['avg'], shop_rl['avg_ci'])}, 4 tasks" in \
        lines["validation shop"]
    assert "base 0.0%" in lines["validation shop"] and "warm 12.5%" in lines["validation shop"]
    assert "rl 87.5%" in lines["test files"] and "base" not in lines["test files"]
    assert "rl 68.8%" in lines["validation mean over envs"]  # (87.5 + 50) / 2


def test_a_run_of_one_env_shows_what_it_showed(tmp_path):
    run_dir = tmp_path / "one"
    write_summary(run_dir, mix=False)
    snap = collect(run_dir, replay_timeout_s=0.1)
    assert "heldout_envs" not in snap
    assert set(snap["heldout"]) == {"base", "warm", "rl"}
    text = CliRunner().invoke(status, ["--run-dir", str(run_dir)],
                           env={"COLUMNS": "400"}).output
    assert "held-out avg" in text and "validation files" not in text and "mean over" not in text


def test_the_viewers_run_page_gets_each_envs_rows(mix_run, tmp_path):
    from starlette.testclient import TestClient

    from autodidact.viewer.data import RunView
    from autodidact.viewer.server import Viewer, make_app

    run_dir, summary = mix_run
    one = tmp_path / "one"
    write_summary(one, mix=False)
    with TestClient(make_app(Viewer([RunView(run_dir, "mix"), RunView(one, "one")]))) as c:
        info = c.get("/api/run?run=0").json()
        rows = {(r["split"], r["stage"], r["env"]): r for r in info["heldout_envs"]}
        assert rows[("validation", "warm", "shop")]["ci"] == \
            summary["success_warm"]["envs"]["shop"]["avg_ci"]
        assert rows[("test", "rl", "mean over envs")]["avg"] == 0.5
        assert "heldout_envs" not in c.get("/api/run?run=1").json()
    js = (Path(__file__).parents[1] / "autodidact/viewer/static/app.js").read_text()
    assert "info.heldout_envs" in js and "Held-out success per env" in js
