"""The validation probe (actor/probe.py, ``eval.probe_every``): its fixed sample of validation
tasks, when it is due, that only actor-0 makes one, and, on the real actor loop with the tiny
model, that its rollouts reach nothing but the metrics: not replay (so no judge and no
experience worker ever reads them), not the navigator, not the curriculum's counts.

The probe on a real run (records at the configured versions, drawn by report and viewer) is
checked on the session's tiny run (tests/test_status.py, tests/test_report.py,
tests/test_viewer.py)."""

from __future__ import annotations

import json

import pytest
from helpers_procs import serve_until

from actor.actor import Actor
from actor.probe import ValidationProbe
from autodidact.resolve import actor_settings
from autodidact.stages import write_split
from autodidact.wiring import build_probe
from environments.files import FilesEnv
from episodes.evaluate import probe_tasks
from inference.backends.hf import TransformersBackend
from metrics.jsonl import read_metrics
from protocol.config import RunConfig


def _cfg(probe_tasks: int = 4, every: int = 2, seed: int = 0) -> RunConfig:
    cfg = RunConfig(seed=seed)
    cfg.eval.probe_every, cfg.eval.probe_tasks = every, probe_tasks
    return cfg


def test_the_sample_is_fixed_from_validation_and_never_test(tmp_path):
    env = FilesEnv()
    split = json.loads(write_split(tmp_path, env).read_text())
    ids = [t.task_id for t in probe_tasks(_cfg(16))]
    assert len(ids) == len(set(ids)) == 16
    assert set(ids) <= set(split["validation"]) and not set(ids) & set(split["test"])
    assert [t.task_id for t in probe_tasks(_cfg(16))] == ids  # the same draw every time
    assert [t.task_id for t in probe_tasks(_cfg(16, seed=1))] != ids  # drawn with the seed
    everything = probe_tasks(_cfg(10 ** 6))  # more than the split holds: all of it
    assert sorted(t.task_id for t in everything) == sorted(split["validation"])


def test_it_is_due_at_the_first_version_then_once_per_block(tmp_path):
    probe = ValidationProbe(probe_tasks(_cfg()), 5, tmp_path, "actor-0", 0)
    try:
        assert probe.due(0)
        probe.last = 0
        assert [v for v in range(1, 13) if probe.due(v)] == [5, 6, 7, 8, 9, 10, 11, 12]
        probe.last = 7  # an actor that skipped version 5
        assert not probe.due(9) and probe.due(10)
        resumed = ValidationProbe(probe_tasks(_cfg()), 5, tmp_path, "actor-0", 0)
        assert resumed.due(37)  # a restarted actor probes where it starts
        resumed.close()
        with pytest.raises(ValueError):
            ValidationProbe([], 5, tmp_path, "actor-0", 0)
    finally:
        probe.close()


def test_only_actor_0_gets_a_probe_and_only_when_it_is_on(tmp_path):
    assert build_probe(_cfg(), tmp_path, "actor-1") is None
    assert build_probe(_cfg(), tmp_path, "node-a-actor-0") is None  # a worker node's
    assert build_probe(_cfg(every=0), tmp_path, "actor-0") is None
    probe = build_probe(_cfg(), tmp_path, "actor-0")
    try:
        assert [t.task_id for t in probe.tasks] == [t.task_id for t in probe_tasks(_cfg())]
        assert probe.every == 2
    finally:
        probe.close()


# --- on the real actor loop ------------------------------------------------------------------


class StoringReplay:
    """The replay client, faked: keeps every pushed group and acknowledges it as stored."""

    disk_full_backoff_s = 1.0

    def __init__(self):
        self.pushed, self._unacked = [], []

    def push_group(self, group):
        self.pushed.append(group)
        self._unacked.append(group.group_id)
        return group.group_id

    def poll_acks(self, timeout_s: float = 0.0):
        acks, self._unacked = [(gid, "stored") for gid in self._unacked], []
        return acks

    def unacked(self):
        return list(self._unacked)

    def close(self):
        pass


class VersionPerGroup:
    """The weight channel, faked: the version is the number of groups pushed so far (the
    weights stay the same), so versions move while the actor rolls."""

    def __init__(self, replay: StoringReplay):
        self.replay = replay

    def follow(self, backend):
        version = len(self.replay.pushed)
        if version == backend.version:
            return None
        backend.load_weights({}, version, strict=False)
        return version

    def close(self):
        pass


class SpyNavigator:
    """Records the tasks it is asked to guide and the episodes it is told of; guides none."""

    def __init__(self):
        self.guided, self.recorded = [], []

    def guide(self, tasks, n):
        self.guided += [t.task_id for t in tasks]
        return [[None] * n for _ in tasks]

    def record(self, episodes):
        self.recorded += [ep.task.task_id for ep in episodes]

    def metrics(self, episodes, n):
        return {}

    def close(self):
        pass


@pytest.mark.timeout(300)
def test_probe_rollouts_reach_neither_replay_nor_the_pool(tmp_path, control, files_policy_path):
    cfg = _cfg(probe_tasks=4, every=2)
    cfg.env.max_turns = 2
    cfg.actor.group_size, cfg.actor.groups_in_flight = 2, 1
    train = FilesEnv().tasks("train")[:12]
    control.init_admission(0, 0)
    control.push_tasks(train)
    replay, navigator = StoringReplay(), SpyNavigator()
    actor = Actor(actor_settings(cfg), tmp_path, control, replay,
                  TransformersBackend(files_policy_path), VersionPerGroup(replay), "actor-0",
                  navigator=navigator, probe=build_probe(cfg, tmp_path, "actor-0"))
    probe_ids = {t.task_id for t in actor.probe.tasks}
    # 5 groups: the loop has passed versions 0 to at least 3, two blocks of 2
    serve_until(actor, lambda: len(replay.pushed) >= 5, what="5 groups")
    probes = [r for r in read_metrics(tmp_path, "eval") if "eval/probe_success" in r]
    versions = [r["eval/version"] for r in probes]
    assert versions[0] == 0 and len(versions) >= 2, versions
    assert [v // 2 for v in versions] == sorted({v // 2 for v in versions})  # one per block
    assert all(r["id"] == "actor-0" and r["step"] == r["eval/version"]
               and r["eval/probe_tasks"] == 4 and 0 <= r["eval/probe_success"] <= 1
               for r in probes)
    # the probe's rollouts went nowhere else: replay (judges and the experience worker read
    # only what it stores), the navigator, the curriculum's per-task counts, the counters
    pushed = {g.task.task_id for g in replay.pushed}
    assert pushed <= {t.task_id for t in train} and not pushed & probe_ids
    assert navigator.guided and not set(navigator.guided) & probe_ids
    assert navigator.recorded and not set(navigator.recorded) & probe_ids
    assert set(control.task_outcomes()) == pushed
    assert control.counters()["actor/pushed"] == len(replay.pushed)
