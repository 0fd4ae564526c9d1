"""The experience worker builds only the run's own env (``env.name``): a stored task of another
env is skipped with one counted warning line, and the module its ``meta.env_spec`` names is
never imported. Replay serves whatever an actor stored, so a task naming ``pkg.module:name``
must not make the worker run ``pkg.module``.

The planted module writes a marker file when imported; it sits on ``sys.path`` under a name
no other test uses, so the marker appears if, and only if, something imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_experience_extraction import TASKS, ListPool, run, worker_group

from navigating.extraction import ExperienceExtractor, _run
from protocol.config import RunConfig
from protocol.messages import Group
from questioning.explorer import Exploration, ExploreStep


@pytest.fixture
def planted(tmp_path, monkeypatch) -> tuple[str, Path]:
    """A module that records its import: (its name, the marker file it writes)."""
    name = f"planted_env_{uuid.uuid4().hex[:10]}"
    marker = tmp_path / "imported.marker"
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n")
    monkeypatch.syspath_prepend(str(folder))
    return name, marker


class _Control:
    """The control plane as the worker uses it: a version and its cursor."""

    def __init__(self):
        self.cursor = 0

    def get_version(self) -> int:
        return 1

    def experience_cursor(self) -> int:
        return self.cursor

    def set_experience_cursor(self, seq: int) -> None:
        self.cursor = seq


class _Replay:
    """A replay reader holding ``groups``: what the worker pages through."""

    def __init__(self, groups):
        self.groups = groups

    def groups_since(self, seq: int, n: int):
        page = self.groups[seq:seq + n]
        return SimpleNamespace(groups=page, malformed=0, next_seq=seq + len(page),
                               more=seq + len(page) < len(self.groups))

    def close(self) -> None:
        pass


def _of_env(group: Group, env: str, spec: str) -> Group:
    task = dataclasses.replace(group.task, env=env, meta={**group.task.meta, "env_spec": spec})
    return dataclasses.replace(group, group_id=f"{group.group_id}-{env}", task=task)


def test_the_worker_skips_a_task_of_another_env_and_never_imports_its_module(
        tmp_path, planted, caplog):
    from autodidact.wiring import build_experience

    name, marker = planted
    cfg = RunConfig()  # env.name=files, rules extraction
    good = [worker_group(0), worker_group(1)]
    foreign = _of_env(worker_group(2), "planted", f"{name}:planted")
    # The run's env by name with another module in its spec: built as the run's env, the
    # spec is never read.
    renamed = _of_env(worker_group(3), "files", f"{name}:files")
    groups = [good[0], foreign, renamed, good[1]]
    pool = ListPool()
    (tmp_path / "run").mkdir()
    worker = build_experience(cfg, tmp_path / "run", _Control(),
                              replay=_Replay(groups), pool=pool)
    caplog.set_level(logging.WARNING, logger="navigating.extraction")
    try:
        worker.extract_once(1)
    finally:
        worker.close()
    assert not marker.exists(), "the worker imported the module a stored task named"
    assert worker.extractor.other_env == 1
    from metrics.jsonl import read_metrics
    assert read_metrics(tmp_path / "run", "experience")[-1]["experience/other_env"] == 1
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "\n" not in skipped[0], skipped
    assert foreign.group_id in skipped[0] and "'planted'" in skipped[0] and name in skipped[0]
    # The others gave what the rules make of them in the run's env.
    rules = ExperienceExtractor(env=cfg.env)
    want = [(e.kind, e.when_to_use, e.content)
            for g in (good[0], renamed, good[1]) for e in rules.from_group(g, 1)]
    assert want and [(e.kind, e.when_to_use, e.content) for e in pool.added] == want
    assert not marker.exists()


def test_an_exploration_of_another_env_is_skipped_too(planted):
    name, marker = planted
    record = Exploration(f"{name}/0", f"{name}:planted", 0, "", {},
                         [ExploreStep(action="ls", observation="", valid=True, tool="ls",
                                      error=None, phase="breadth", proposer="schema",
                                      state={})])
    extractor = ExperienceExtractor(env=RunConfig().env)
    assert extractor.from_exploration(record.to_dict()) == []
    assert extractor.other_env == 1 and not marker.exists()


def test_the_planted_module_is_imported_by_a_bare_replay(planted):
    """The control: a replay without the run's env (a bare call, as ``tasks verify`` of
    another env's task once did) builds the env the task names and imports its module, so
    the marker above would have shown an import."""
    name, marker = planted
    task = next(t for t in TASKS if t.reference)
    named = dataclasses.replace(task, env="planted", meta={"env_spec": f"{name}:planted"})
    assert _run(named, task.reference) is None  # imported, then no env registered by it
    assert marker.exists()
    assert run(task, task.reference).success  # the same task in its own env replays
