"""The task store (questioning/task_store.py) on real LMDB, and the `autodidact tasks` commands."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autodidact.tasks_cli import tasks as tasks_cli
from protocol.errors import SchemaError
from protocol.messages import Task
from protocol.run_dir import RunDir
from questioning.task_store import TaskStore

ROOT = Path(__file__).resolve().parents[1]


def make_task(i: int, method: str = "hindsight", split: str = "train",
              source: str = "synthetic") -> Task:
    return Task(
        task_id=f"syn/{i:04d}", env="files", query=f"move report.txt into docs {i}", seed=i % 3,
        goal={"all": [{"file": ["docs", "report.txt"], "content": "apple river"},
                      {"absent": ["report.txt"]}]},
        reference=["mv report.txt docs"] * (1 + i % 2), source=source, split=split,
        difficulty=1.5 + i,
        meta={"method": method, "seed": i % 3, "exploration": f"exp-{i}", "confidence": 0.75,
              "steps": 1 + i % 2, "entities": ["report.txt", "docs"], "dependent_ops": 0},
    )


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path


def fill(run_dir: Path, n: int = 4) -> list[Task]:
    made = [make_task(i, method="llm" if i % 2 else "hindsight") for i in range(n)]
    with TaskStore(run_dir) as store:
        assert store.put_many(made) == n
    return made


# --- the store ---------------------------------------------------------------------------------


def test_round_trip_keeps_every_field(run_dir):
    made = fill(run_dir)
    with TaskStore(run_dir, readonly=True) as store:
        assert store.count() == len(made)
        assert store.get(made[1].task_id) == made[1]
        assert store.get("nope") is None
        assert store.all() == made
        assert list(store) == made


def test_put_is_idempotent(run_dir):
    with TaskStore(run_dir) as store:
        assert store.put(make_task(0)) is True
        assert store.put(make_task(0)) is False
        changed = make_task(0)
        changed.query = "something else"
        assert store.put_many([changed, make_task(1), make_task(1)]) == 1
        assert store.count() == 2
        assert store.get("syn/0000").query == make_task(0).query  # the first copy is kept
        assert [t.task_id for t in store.all()] == ["syn/0000", "syn/0001"]


def test_insertion_order_survives_reopen(run_dir):
    ids = [7, 2, 9, 0]
    with TaskStore(run_dir) as store:
        store.put_many(make_task(i) for i in ids[:2])
    with TaskStore(run_dir) as store:  # the counter resumes from the stored order index
        store.put_many(make_task(i) for i in ids[2:])
        assert [t.task_id for t in store] == [f"syn/{i:04d}" for i in ids]


def test_filter_by_source_and_split(run_dir):
    with TaskStore(run_dir) as store:
        store.put_many([make_task(0), make_task(1, split="test"),
                        make_task(2, source="original"), make_task(3, split="test")])
        ids = lambda ts: [t.task_id for t in ts]  # noqa: E731
        assert ids(store.all(split="test")) == ["syn/0001", "syn/0003"]
        assert ids(store.all(source="original")) == ["syn/0002"]
        assert ids(store.all(source="synthetic", split="train")) == ["syn/0000"]
        assert store.all(source="synthetic", split="nope") == []


def test_unreadable_task_refused_before_writing(run_dir):
    import numpy as np

    bad = make_task(0)
    bad.meta["arr"] = np.zeros(2, dtype="int32")
    with TaskStore(run_dir) as store:
        with pytest.raises(SchemaError):
            store.put_many([make_task(1), bad])
        assert store.count() == 0  # nothing of the batch went in
        with pytest.raises(TypeError):
            store.put({"task_id": "x"})
        with pytest.raises(ValueError, match="task_id"):
            store.put(dataclasses.replace(make_task(0), task_id=""))


def test_second_writer_refused_while_first_open(run_dir):
    with TaskStore(run_dir) as store:
        store.put(make_task(0))
        with pytest.raises(RuntimeError, match="writer.lock"):
            TaskStore(run_dir)
    with TaskStore(run_dir) as store:  # closing the first released the lock
        assert store.count() == 1


def test_readonly_store_refuses_writes(run_dir):
    fill(run_dir, 1)
    with TaskStore(run_dir, readonly=True) as store:
        with pytest.raises(PermissionError):
            store.put(make_task(5))


def test_missing_store(tmp_path):
    assert not TaskStore.exists(tmp_path)
    with pytest.raises(FileNotFoundError, match="no task store at .*autodidact explore"):
        TaskStore(tmp_path, readonly=True)
    assert not (tmp_path / "tasks.lmdb").exists()  # a reader never creates it
    fill(tmp_path, 1)
    assert TaskStore.exists(tmp_path)


READER = """
import json, sys
from questioning.task_store import TaskStore
with TaskStore(sys.argv[1], readonly=True) as store:
    print(json.dumps([store.count(), [t.task_id for t in store], store.get("syn/0001").query]))
"""


def read_in_other_process(run_dir: Path) -> list:
    out = subprocess.run([sys.executable, "-c", READER, str(run_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_reader_in_other_process_while_writer_open(run_dir):
    with TaskStore(run_dir) as store:
        store.put_many([make_task(0), make_task(1)])
        assert read_in_other_process(run_dir) == [2, ["syn/0000", "syn/0001"],
                                                  make_task(1).query]
        store.put(make_task(2))  # committed while the writer stays open: the next reader sees it
        count, ids, _ = read_in_other_process(run_dir)
        assert (count, ids) == (3, ["syn/0000", "syn/0001", "syn/0002"])


# --- the CLI -----------------------------------------------------------------------------------


def invoke(*args):
    return CliRunner().invoke(tasks_cli, [str(a) for a in args])


def test_list_table(run_dir):
    made = fill(run_dir, 4)
    res = invoke("list", "--run-dir", run_dir)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split()[:5] == ["TASK_ID", "SEED", "METHOD", "STEPS", "DIFFICULTY"]
    assert lines[1].split()[:5] == ["syn/0000", "0", "hindsight", "1", "1.5"]
    assert made[0].query in lines[1]
    assert lines[-1] == "4 tasks (4 shown)"

    res = invoke("list", "--run-dir", run_dir, "--method", "llm", "--limit", 1)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1] == "2 tasks (1 shown)"
    assert "syn/0001" in res.output and "syn/0003" not in res.output

    res = invoke("list", "--run-dir", run_dir, "--seed", 0, "--limit", 0)
    assert res.output.splitlines()[-1] == "2 tasks (2 shown)"  # syn/0000 and syn/0003


def test_list_json(run_dir):
    made = fill(run_dir, 3)
    res = invoke("list", "--run-dir", run_dir, "--json")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    assert [Task(**r) for r in rows] == made


def test_show(run_dir):
    made = fill(run_dir, 2)
    res = invoke("show", made[1].task_id, "--run-dir", run_dir)
    assert res.exit_code == 0, res.output
    assert Task(**json.loads(res.output)) == made[1]
    assert "\n  " in res.output  # indented

    res = invoke("show", "syn/9999", "--run-dir", run_dir)
    assert res.exit_code != 0
    assert "no task 'syn/9999'" in res.output


def test_export_jsonl_round_trips(run_dir, tmp_path):
    made = fill(run_dir, 3)
    res = invoke("export", "--run-dir", run_dir)
    assert res.exit_code == 0, res.output
    # output holds stdout and stderr together on every click version; the JSON lines are ours
    lines = [line for line in res.output.splitlines() if line.startswith("{")]
    assert [Task(**json.loads(line)) for line in lines] == made
    assert "wrote 3 tasks to <stdout>" in res.output

    out = tmp_path / "tasks.jsonl"
    res = invoke("export", "--run-dir", run_dir, "--out", out)
    assert res.exit_code == 0, res.output
    assert [Task(**json.loads(line)) for line in out.read_text().splitlines()] == made

    out = tmp_path / "tasks.json"
    res = invoke("export", "--run-dir", run_dir, "--out", out, "--format", "json")
    assert res.exit_code == 0, res.output
    assert [Task(**d) for d in json.loads(out.read_text())] == made


@pytest.mark.parametrize("command", [["list"], ["show", "syn/0000"], ["export"], ["verify"]])
def test_missing_store_is_a_clear_error(tmp_path, command):
    res = invoke(*command, "--run-dir", tmp_path)
    assert res.exit_code != 0
    assert "no task store at" in res.output and "autodidact explore" in res.output


def test_verify(run_dir):
    from environments.files import build_tasks

    good = [t for t in build_tasks(num_worlds=2) if t.reference][:3]
    broken = dataclasses.replace(good[0], task_id="syn/broken", reference=[])
    with TaskStore(run_dir) as store:
        store.put_many(good)
    res = invoke("verify", "--run-dir", run_dir)
    assert res.exit_code == 0, res.output
    assert f"verified {len(good)}/{len(good)} tasks" in res.output

    with TaskStore(run_dir) as store:
        store.put(broken)
    res = invoke("verify", "--run-dir", run_dir)
    assert res.exit_code == 1, res.output
    assert f"verified {len(good)}/{len(good) + 1} tasks" in res.output
    assert "no_reference: 1 (syn/broken)" in res.output


def test_verify_never_imports_what_a_task_of_another_env_names(run_dir, tmp_path, monkeypatch):
    """A stored task of another env is reported (other_env), not built: the module its
    ``meta.env_spec`` names, which writes a marker when imported, stays unimported."""
    from environments.files import build_tasks

    plugins, marker = tmp_path / "plugins", tmp_path / "imported.marker"
    plugins.mkdir()
    (plugins / "planted_verify_env.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n")
    monkeypatch.syspath_prepend(str(plugins))
    good = [t for t in build_tasks(num_worlds=1) if t.reference][:2]
    other = dataclasses.replace(good[0], task_id="syn/other", env="planted",
                                meta={"env_spec": "planted_verify_env:planted"})
    with TaskStore(run_dir) as store:
        store.put_many([*good, other])
    res = invoke("verify", "--run-dir", run_dir)
    assert res.exit_code == 1, res.output
    assert f"verified {len(good)}/{len(good) + 1} tasks" in res.output
    assert "other_env:'planted': 1 (syn/other)" in res.output
    assert "give theirs with -c or --set env.name=MODULE:NAME" in res.output
    assert not marker.exists()


def test_a_cut_short_task_store_is_refused_in_one_line_not_a_sigbus(run_dir):
    """The task store is LMDB too: a truncated data file is refused before it is mapped (in a
    subprocess, so a regression's SIGBUS cannot take the test runner down)."""
    fill(run_dir, n=200)
    data = RunDir(run_dir).task_store / "data.mdb"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)
    done = subprocess.run([sys.executable, "-m", "autodidact.cli", "tasks", "list",
                           "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and str(data) in errors[0] and "cut short" in errors[0]
