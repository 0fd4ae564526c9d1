"""Groups that carry no signal (learner.skip_uninformative): replay sets them aside instead of
serving them, for good (a restarted learner does not get them back), counts them durably so
admission frees their slots even after Redis lost its data, and the learner fills its batch
with the others and logs the share."""

from __future__ import annotations

import dataclasses
import time

import pytest
from helpers_replay import ServerProc, labels_for, make_group, push_all

from protocol import codec
from protocol.config import LearnerConfig, ReplayConfig, RunConfig
from protocol.messages import BatchRequest, LearnerHello
from protocol.replay_client import ReplayClient
from protocol.transport import Incoming
from replay.server import ReplayServer


def _group(key: int, rewards: list[float]):
    """A stored-shaped group with exactly these rollout rewards (versions 0)."""
    base = make_group((key, 7), f"g{key}", versions=(0, 0))
    while len(base.trajectories) < len(rewards):  # make_group draws 1-3 rollouts
        base.trajectories.append(dataclasses.replace(base.trajectories[0]))
    trajectories = [dataclasses.replace(t, traj_id=f"t{i}", reward=r)
                    for i, (t, r) in enumerate(zip(base.trajectories, rewards))]
    return dataclasses.replace(base, trajectories=trajectories)


def _send(server: ReplayServer, msg, msg_id: str):
    replies = server.handle([Incoming(route=[], msg_id=msg_id, msg=msg,
                                      body=codec.encode_body(msg))]) + server.release_held()
    return {inc.msg_id: reply for inc, reply in replies}.get(msg_id)


@pytest.fixture
def server(tmp_path):
    srv = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    yield srv
    srv.close()


def _ask(n: int, **kw) -> BatchRequest:
    return BatchRequest("L", n, 0, skip_uninformative=True, **kw)


def test_outcome_only_serves_the_groups_whose_rollouts_differ(server):
    mixed, same, single = _group(1, [1.0, 0.0]), _group(2, [1.0, 1.0]), _group(3, [0.0])
    for i, g in enumerate([same, mixed, single]):
        _send(server, g, f"push-{i}")
    batch = _send(server, _ask(5), "m1")
    assert [g.group_id for g in batch.groups] == ["g1"] and batch.uninformative_skipped == 2
    assert server.stats()["set_aside"] == 2
    assert {g: server.index[g].set_aside for g in ("g1", "g2", "g3")} == {
        "g1": False, "g2": True, "g3": True}
    # Never served again, and a learner restarting from a checkpoint without them (they were
    # never trained) does not get them back; g1, delivered and not covered, comes back.
    _send(server, LearnerHello("L", 0, []), "hello")
    again = _send(server, _ask(5, timeout_s=0.0), "m2")
    assert [g.group_id for g in again.groups] == ["g1"] and again.uninformative_skipped == 0
    # Asked without the flag, what is left is served as before.
    _send(server, _group(4, [0.5, 0.5]), "push-4")
    plain = _send(server, BatchRequest("L", 5, 0), "m3")
    assert [g.group_id for g in plain.groups] == ["g4"]


def test_with_labels_a_group_of_equal_outcomes_is_kept_when_its_steps_differ(server):
    good = _group(1, [1.0, 1.0])
    split = _group(2, [1.0, 1.0])
    for i, g in enumerate([good, split]):
        _send(server, g, f"push-{i}")
    steps = [len(t.steps) for t in split.trajectories]
    assert sum(steps) >= 2  # make_group is seeded: this group always has steps to differ
    _send(server, labels_for(good, 1), "lab-0")
    varied = labels_for(split, 1)
    varied.labels[[i for i, n in enumerate(steps) if n][0]][0] = 0
    _send(server, varied, "lab-1")
    batch = _send(server, _ask(5, require_labels=True), "m1")
    assert [g.group_id for g in batch.groups] == ["g2"] and batch.uninformative_skipped == 1


def test_a_retried_request_reports_its_set_aside_groups_again(server):
    _send(server, _group(1, [0.0, 0.0]), "push")
    first = _send(server, _ask(2), "m1")
    retry = _send(server, _ask(2), "m1")  # the answer was lost: the same msg id again
    assert first.uninformative_skipped == retry.uninformative_skipped == 1
    assert server.stats()["set_aside"] == 1  # counted once


def test_admission_rebuilt_from_replay_frees_the_set_aside_slots(tmp_path):
    from autodidact.recovery import replay_admission

    srv = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        for i, rewards in enumerate([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]):
            _send(srv, _group(i, rewards), f"push-{i}")
        _send(srv, _ask(3), "m1")
    finally:
        srv.close()
    stored, freed, _ = replay_admission(tmp_path)
    assert (stored, freed) == (3, 2)


class _Slots:
    def __init__(self):
        self.freed = []

    def free_stale_slots(self, n: int) -> None:
        self.freed.append(n)


@pytest.mark.timeout(120)
def test_the_learner_fills_its_batch_with_informative_groups(tmp_path):
    from autodidact.resolve import learner_settings
    from learner.learner import Learner

    srv = ServerProc(tmp_path / "run").start()
    replay = ReplayClient(srv.address, retry_after_s=0.5, timeout_s=10)
    actor = ReplayClient(srv.address, retry_after_s=0.5, timeout_s=10)
    try:
        cfg = RunConfig()
        cfg.learner = LearnerConfig(batch_groups=2, advantage="grpo")
        cfg.judge.deadline_s = 0.0
        slots = _Slots()
        learner = Learner(learner_settings(cfg), tmp_path, slots, replay, step=None,
                          publisher=None, learner_id="L")
        push_all(actor, [_group(1, [1.0, 1.0]), _group(2, [0.0, 1.0]), _group(3, [0.0, 0.0]),
                         _group(4, [1.0, 0.0])])
        groups, _, _ = learner.draw(time.monotonic() + 60)
        assert [g.group_id for g in groups] == ["g2", "g4"]
        assert learner.uninformative == 2 and sum(slots.freed) == 2
        learner.close()  # closes the replay client it was handed
    finally:
        replay.close()
        actor.close()
        srv.kill()
