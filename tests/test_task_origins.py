"""Training tasks by origin (autodidact/task_origins.py) in ``report``, ``status`` and the viewer.

One small run directory, made in a fraction of a second: five groups stored by the real replay
server (three of hand-written tasks, two of self-made ones) with rewards chosen so every count
is known, ``split.json`` with three training tasks, ``tasks.lmdb`` with four self-made tasks,
and ``tasks.synthetic_share`` configured and resolved. Each of the three outputs must show the
same numbers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_replay import make_group
from starlette.testclient import TestClient

from autodidact import task_origins
from autodidact.report import make_report
from autodidact.status_cli import status
from autodidact.viewer.data import RunView
from autodidact.viewer.server import Viewer, make_app
from protocol import codec
from protocol.config import ReplayConfig
from protocol.messages import Task
from protocol.transport import Incoming
from questioning.task_store import TaskStore
from replay.server import ReplayServer

# (source, [(reward, success) per rollout]) for each stored group
GROUPS = [
    ("original", [(1.0, True), (0.0, False), (1.0, True), (0.0, False)]),  # informative
    ("original", [(0.0, False)] * 4),  # all failed: no signal
    ("original", [(1.0, True)] * 2),  # all succeeded: no signal
    ("synthetic", [(1.0, True), (0.0, False)]),  # informative
    ("synthetic", [(0.5, False), (0.2, False)]),  # none succeeded, rewards differ: informative
]
# What the table must say: origin -> (tasks, groups, successes, rollouts, informative)
EXPECTED = {"hand-written": (3, 3, 4, 10, 1), "self-made": (4, 2, 1, 4, 2)}


def _group(i: int, source: str, outcomes: list[tuple[float, bool]]):
    group = make_group(i, group_id=f"g{i}")
    template = group.trajectories[0]
    group.trajectories = [dataclasses.replace(template, traj_id=f"t{j}", reward=r, success=ok)
                          for j, (r, ok) in enumerate(outcomes)]
    meta = {"method": "hindsight", "exploration": "e1"} if source == "synthetic" else {}
    task_id = f"s{i % 4}" if source == "synthetic" else f"h{i % 3}"  # tasks of the pools below
    group.task = Task(task_id=task_id, env="files", query=f"task {i}", seed=i, source=source,
                      meta=meta)
    return group


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return origins_run(tmp_path)


def origins_run(tmp_path: Path) -> Path:
    """The run directory of these tests (also the viewer's browser test): see the top."""
    (tmp_path / "config.yaml").write_text("name: origins\ntasks:\n  synthetic_share: 0.4\n")
    (tmp_path / "summary.json").write_text(json.dumps({"synthetic_share": 0.4}))
    (tmp_path / "split.json").write_text(json.dumps(
        {"env": "files", "train": ["h0", "h1", "h2"], "validation": ["v0"], "test": []}))
    with TaskStore(tmp_path) as store:
        store.put_many([Task(task_id=f"s{i}", env="files", query=f"made {i}", seed=i,
                             source="synthetic") for i in range(4)])
    groups = [_group(i, source, outcomes) for i, (source, outcomes) in enumerate(GROUPS)]
    server = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        server.handle([Incoming([], g.group_id, msg=g, body=codec.encode_body(g))
                       for g in groups])
    finally:
        server.close()
    return tmp_path


def check_rows(origins: list[dict]) -> None:
    assert [r["origin"] for r in origins] == ["hand-written", "self-made"]
    for row in origins:
        tasks, groups, successes, rollouts, informative = EXPECTED[row["origin"]]
        assert (row["tasks"], row["groups"], row["successes"], row["rollouts"],
                row["informative"]) == (tasks, groups, successes, rollouts, informative)
        assert row["success"] == pytest.approx(successes / rollouts)
        assert row["informative_share"] == pytest.approx(informative / groups)


def test_the_table_counts_each_origin(run_dir):
    table = task_origins.run_origins(run_dir)
    check_rows(table["origins"])
    assert table["groups_counted"] == table["groups_stored"] == 5 and table["complete"]
    assert table["synthetic_share"] == {"configured": 0.4, "effective": 0.4,
                                        "drawn": pytest.approx(2 / 5)}
    assert not table["error"]


def test_a_budget_that_runs_out_says_how_much_was_counted(run_dir):
    table = task_origins.run_origins(run_dir, budget_s=-1)
    assert table["groups_counted"] == 0 and table["groups_stored"] == 5
    assert not table["complete"] and "0 read so far of the 5 groups stored" in \
        task_origins.counted_words(table)


def test_a_run_without_a_store_says_so(tmp_path):
    (tmp_path / "config.yaml").write_text("name: empty\n")
    table = task_origins.run_origins(tmp_path)
    assert "no replay store yet" in table["error"]
    assert [r["groups"] for r in table["origins"]] == [0, 0]
    assert table["synthetic_share"]["configured"] is None


def test_report_has_the_table(run_dir):
    out = make_report([run_dir])
    md = (out / "report.md").read_text()
    assert "## Tasks by origin" in md
    assert "| hand-written | 3 | 3 | 40.0% (4/10) | 33.3% (1/3) |" in md
    assert "| self-made | 4 | 2 | 25.0% (1/4) | 100.0% (2/2) |" in md
    assert "over the 5 groups stored in replay.lmdb; `tasks.synthetic_share` configured 0.4, " \
        "effective 0.4, drawn 40.0%" in md
    data = json.loads((out / "series.json").read_text())
    check_rows(data["task_origins"][run_dir.name]["origins"])


def test_status_shows_the_table(run_dir):
    result = CliRunner().invoke(status, ["--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    check_rows(json.loads(result.output)["task_origins"]["origins"])
    result = CliRunner().invoke(status, ["--run-dir", str(run_dir)])
    assert result.exit_code == 0, (result.output, result.exception)
    text = " ".join(result.output.split())  # rich may wrap a long line
    assert "hand-written 3 tasks, 3 groups, 40.0% success, 33.3% informative" in text
    assert "self-made 4 tasks, 2 groups, 25.0% success, 100.0% informative" in text
    assert "synthetic share configured 0.4, effective 0.4, drawn 40.0% (over the 5 groups " \
        "stored in replay.lmdb)" in text
    # Where the replay counts came from is printed, not eaten as terminal markup.
    assert "unjudged (replay.lmdb: stored - judged)" in text


def test_viewer_run_and_tasks_pages_have_the_table(run_dir):
    with TestClient(make_app(Viewer([RunView(run_dir, "origins")]))) as client:
        run = client.get("/api/run")
        assert run.status_code == 200, run.text[:300]
        check_rows(run.json()["task_origins"]["origins"])
        tasks = client.get("/api/tasks?per_page=200")
        assert tasks.status_code == 200, tasks.text[:300]
        body = tasks.json()
    check_rows(body["origins"]["origins"])
    origin = {t["task_id"]: t["origin"] for t in body["tasks"]}
    assert origin["h0"] == "hand-written" and origin["s0"].startswith("self-made")
