"""``autodidact status`` against a live run and against the same run once it has finished and
its Redis is gone.

One tiny real job (``autodidact run``: embedded Redis, replay, learner, one actor, one judge)
is made per test session by :func:`tiny_run` and shared with tests/test_report.py, which
reports on the finished directory; the live status is taken while it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import made_once

from autodidact.status_cli import status
from metrics.jsonl import read_metrics

pytestmark = pytest.mark.slow

QUICK = Path(__file__).resolve().parents[1] / "configs" / "quick.yaml"
UPDATES = 12
# The smallest job that still has every role and every stage's numbers: no warm-start steps
# (the "after warm-start" evaluation is then of the base model), 2 held-out tasks, batches of
# 2 groups of 4 rollouts, one actor, one judge, no experience extractor; the validation probe
# on 4 tasks every 4 versions (PROBE_EVERY). About 20 s alone on 2 cores; about 45 s when
# other jobs share them.
PROBE_EVERY = 4
TINY_SETS = ["name=tinystatus", "warmstart.steps=0", "eval.num_tasks=2", "eval.k=1",
             "eval.greedy=false", "learner.batch_groups=2", "actor.group_size=4",
             "actor.num_actors=1", "experience.enabled=false", "learner.probe_every=0",
             f"eval.probe_every={PROBE_EVERY}", "eval.probe_tasks=4",
             "tracking.wandb=offline", "tracking.group=tinygroup"]

_RUNS: dict[str, dict] = {}


def tiny_run(tmp_path_factory) -> dict:
    """The session's tiny job, run once (for every pytest-xdist worker too, see
    conftest.made_once): ``{"dir", "live", "live_text"}`` where ``live`` is ``status --json``
    taken while the learner was training."""
    if "run" not in _RUNS:
        made = made_once(tmp_path_factory, "tiny_run", _run_in)
        _RUNS["run"] = {**made, "dir": Path(made["dir"])}
    return _RUNS["run"]


def _run_in(folder: Path) -> dict:
    (run_dir := folder / "tiny_run").mkdir()
    return _run_and_watch(run_dir)


def _learner_updates(run_dir: Path) -> int:
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/updates" in r]
    return rows[-1]["learner/updates"] if rows else 0


def _status_json(run_dir: Path) -> dict:
    result = CliRunner().invoke(status, ["--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.output)


def _run_and_watch(run_dir: Path) -> dict:
    args = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(run_dir),
            "-c", str(QUICK), "--max-updates", str(UPDATES)]
    for s in TINY_SETS:
        args += ["--set", s]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    live = live_text = None
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            # The learner logs an update before its weights are announced (publishing runs
            # beside training), so wait for the announced version itself, not the log line.
            if _learner_updates(run_dir) >= 2:
                live = _status_json(run_dir)
                if (live.get("version") or 0) >= 2:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before the learner was seen training"
        assert live is not None, "the learner made no 2 updates in 150 s"
        text = CliRunner().invoke(status, ["--run-dir", str(run_dir)])
        live_text = text.output if text.exit_code == 0 else f"exit {text.exit_code}: {text}"
        assert proc.wait(timeout=150) == 0, Path(log.name).read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        log.close()
    return {"dir": str(run_dir), "live": live, "live_text": live_text}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


@pytest.mark.timeout(240)
def test_status_of_a_live_run(run):
    snap = run["live"]
    assert snap["phase"] == "rl" and not snap["finished"]
    assert snap["redis"]["reachable"] and "***@" in snap["redis"]["url"]
    assert isinstance(snap["version"], int) and 2 <= snap["version"] < UPDATES
    assert snap["learner_updates"] >= 2
    roles = {r["name"]: r for r in snap["roles"]}
    assert {"replay", "learner", "actor-0", "judge-0"} <= set(roles), roles
    for name in ("replay", "learner", "actor-0", "judge-0"):
        assert roles[name]["alive"] is True and roles[name]["process"] == "running", roles[name]
    # the actor's heartbeat (the only role that sends one) is fresh
    assert roles["actor-0"]["heartbeat_age_s"] is not None
    assert roles["actor-0"]["heartbeat_age_s"] < roles["actor-0"]["heartbeat_ttl_s"]
    assert snap["replay"]["source"] == "replay server"
    assert snap["replay"]["groups"] > 0 and snap["replay"]["max_groups"] == 100_000
    assert 0 < snap["replay"]["groups_fill"] < 1
    assert snap["judge_backlog"]["unjudged"] is not None
    assert snap["judge_backlog"]["source"] == "replay server"
    assert snap["groups_total"] > 0 and snap["actor_success_rate"] is not None
    assert snap["lag_mean"] is not None
    assert 0 <= snap["uninformative_share"] <= 1  # learner.skip_uninformative, on by default
    assert "set aside (no signal)" in run["live_text"]
    password = (run["dir"] / "redis" / "password").read_text().strip()
    assert password not in json.dumps(snap) and password not in run["live_text"]
    assert "phase rl" in run["live_text"] and "alive" in run["live_text"], run["live_text"]


@pytest.mark.timeout(240)
def test_status_of_the_finished_run_with_redis_gone(run):
    run_dir = run["dir"]
    result = CliRunner().invoke(status, ["--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0 and result.exception is None, result.output
    snap = json.loads(result.output)
    assert snap["finished"] and snap["phase"] == "done"
    assert not snap["redis"]["reachable"]
    assert any("Redis not reachable" in n for n in snap["notes"])
    assert snap["version"] == UPDATES  # from the learner's last metrics record
    assert all(r["alive"] is False for r in snap["roles"]), snap["roles"]
    assert snap["restarts_source"] == "summary.json" and snap["restarts"]["learner"] == 0
    assert snap["replay"]["source"] == "replay.lmdb" and snap["replay"]["groups"] > 0
    assert snap["judge_backlog"]["unjudged"] is not None
    assert set(snap["heldout"]) == {"base", "warm", "rl"}
    text = CliRunner().invoke(status, ["--run-dir", str(run_dir)])
    assert text.exit_code == 0 and text.exception is None, text.output
    assert "finished" in text.output and "stopped" in text.output
    assert "Traceback" not in text.output


def test_status_of_a_bare_or_missing_directory(tmp_path):
    missing = CliRunner().invoke(status, ["--run-dir", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "no run directory" in missing.output
    assert isinstance(missing.exception, SystemExit)  # a message, not a traceback
    # metrics only: no config, Redis, replay or pids
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"t": time.time() - 5, "role": "learner", "id": "learner", "step": 3,
                    "learner/loss": 0.5, "learner/updates": 3, "learner/version": 3,
                    "learner/lag_mean": 1.5, "learner/lag_max": 2}) + "\n"
        + json.dumps({"t": time.time(), "role": "actor", "id": "actor-0", "step": 4,
                      "actor/success_rate": 0.25, "actor/groups": 4}) + "\n" + "{cut")
    result = CliRunner().invoke(status, ["--run-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0 and result.exception is None, result.output
    snap = json.loads(result.output)
    assert (snap["version"], snap["lag_mean"], snap["actor_success_rate"]) == (3, 1.5, 0.25)
    assert {r["name"] for r in snap["roles"]} == {"learner", "actor-0"}
    assert all(r["alive"] is None for r in snap["roles"])  # nothing to tell it by
    assert snap["replay"]["source"] is None and not snap["redis"]["reachable"]
    assert CliRunner().invoke(status, ["--run-dir", str(tmp_path)]).exit_code == 0
