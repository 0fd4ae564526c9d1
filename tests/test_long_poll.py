"""Long-poll batch requests (``BatchRequest.timeout_s``): the replay server holds a request it
cannot serve yet and answers it when a group (or a label, or a stale skip) arrives, or empty
when its time is up, without ever handing one request id two batches.

The server's state machine is driven in process (``handle`` and ``release_held``, the clock
moved by hand, nothing slept); the learner's side runs against a real server process.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers_replay import ServerProc, labels_for, make_group, push_all

from protocol import codec
from protocol.config import LearnerConfig, ReplayConfig, RunConfig
from protocol.errors import SchemaError
from protocol.messages import (
    MAX_BATCH_WAIT_S,
    Ack,
    Batch,
    BatchRequest,
    LearnerHello,
)
from protocol.replay_client import ReplayClient
from protocol.transport import Incoming
from replay.server import ReplayServer
from replay.store import LAST_BATCH

# --- the server, in process ----------------------------------------------------------------------


@pytest.fixture
def server(tmp_path):
    srv = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    yield srv
    srv.close()


def frame(msg, msg_id: str) -> Incoming:
    return Incoming(route=[], msg_id=msg_id, msg=msg, body=codec.encode_body(msg))


def send(server: ReplayServer, *items) -> dict[str, object]:
    """One burst of (message, msg id), then what the loop does after it: the replies sent, by
    msg id (held requests have none)."""
    replies = server.handle([frame(msg, mid) for msg, mid in items]) + server.release_held()
    out = {inc.msg_id: reply for inc, reply in replies}
    assert len(out) == len(replies), "two replies to one request id"
    return out


def ask(learner="L", n=2, version=0, timeout_s=30.0, **kw) -> BatchRequest:
    return BatchRequest(learner, n, version, timeout_s=timeout_s, **kw)


def ids(batch: Batch) -> list[str]:
    return [g.group_id for g in batch.groups]


def last_batch(server: ReplayServer, learner: str = "L"):
    with server.store.env.begin() as txn:
        return server.store.get_meta(txn, LAST_BATCH + learner)


def move_clocks(monkeypatch, mono: float = 0.0, wall: float = 0.0) -> None:
    real_mono, real_time = time.monotonic, time.time
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() + mono)
    monkeypatch.setattr(time, "time", lambda: real_time() + wall)


def test_a_held_request_is_answered_by_the_burst_that_brings_a_group(server):
    assert send(server, (ask(), "m1")) == {}  # nothing stored: held, not answered
    assert list(server.held) == ["L"] and server.stats()["batches_held"] == 1
    assert last_batch(server) is None  # nothing recorded, nothing delivered while held
    g0 = make_group(0)
    replies = send(server, (g0, "push-0"))
    assert replies["push-0"] == Ack("stored")
    assert ids(replies["m1"]) == ["g-0"]  # one group is enough: not held until the batch fills
    assert codec.encode_body(replies["m1"].groups[0]) == codec.encode_body(g0)
    assert server.held == {} and last_batch(server) == ["m1", ["g-0"], 0]  # none set aside
    assert server.index["g-0"].delivered
    # A request and a group in one burst: the request is held first, then served after it.
    replies = send(server, (ask(), "m2"), (make_group(1), "push-1"))
    assert ids(replies["m2"]) == ["g-1"] and server.held == {}


def test_a_retried_held_request_is_served_once(server):
    assert send(server, (ask(n=5), "m1")) == {}
    deadline = server.held["L"].deadline
    assert send(server, (ask(n=5), "m1")) == {}  # the client's retry: still one held request
    assert len(server.held) == 1 and server.held["L"].deadline == deadline  # no extension
    replies = send(server, (make_group(0), "p0"), (make_group(1), "p1"))
    assert ids(replies["m1"]) == ["g-0", "g-1"]
    assert set(send(server, (make_group(2), "p2"))) == {"p2"}  # nothing held: g-2 waits
    # The answer was lost: the retry gets the same groups, not g-2.
    assert ids(send(server, (ask(n=5, timeout_s=0.0), "m1"))["m1"]) == ["g-0", "g-1"]
    assert ids(send(server, (ask(n=5, timeout_s=0.0), "m2"))["m2"]) == ["g-2"]
    stats = server.stats()
    assert stats["groups_delivered"] == 3 and stats["batch_retries"] == 1


def test_a_newer_request_releases_the_held_one_empty(server):
    assert send(server, (ask(), "m1")) == {}
    replies = send(server, (ask(), "m2"))  # the client gave m1 up and asks again
    assert replies == {"m1": Batch(groups=[])} and server.held["L"].incoming.msg_id == "m2"
    assert last_batch(server) is None  # the released one recorded nothing
    replies = send(server, (make_group(0), "p0"))
    assert ids(replies["m2"]) == ["g-0"] and "m1" not in replies
    # A late retry of an answered request is answered from the record and holds nothing.
    assert send(server, (ask(), "m3")) == {}
    replies = send(server, (ask(), "m2"))
    assert ids(replies["m2"]) == ["g-0"] and server.held["L"].incoming.msg_id == "m3"
    assert server.stats()["batch_held_superseded"] == 1


def test_an_unservable_request_is_answered_empty_when_its_time_is_up(server, monkeypatch):
    assert send(server, (ask(timeout_s=5.0), "m1")) == {}
    assert send(server) == {}  # a tick before the deadline: still held
    move_clocks(monkeypatch, mono=6.0)
    assert send(server) == {"m1": Batch(groups=[])}
    assert server.held == {} and last_batch(server) == ["m1", [], 0]
    assert send(server, (make_group(0), "p0")) == {"p0": Ack("stored")}  # to nobody
    assert send(server, (ask(timeout_s=0.0), "m1")) == {"m1": Batch(groups=[])}  # retry: same
    assert ids(send(server, (ask(timeout_s=0.0), "m2"))["m2"]) == ["g-0"]


def test_labels_landing_serve_a_request_waiting_for_judged_groups(server):
    g0 = next(g for g in map(make_group, range(50)) if any(t.steps for t in g.trajectories))
    send(server, (g0, "p0"))
    assert send(server, (ask(require_labels=True), "m1")) == {}  # g0 is not judged yet
    replies = send(server, (labels_for(g0), "lab"))
    assert replies["lab"] == Ack("stored")
    assert ids(replies["m1"]) == [g0.group_id]
    assert [lab.group_id for lab in replies["m1"].labels] == [g0.group_id]


def test_the_label_deadline_passing_serves_a_held_request(server, monkeypatch):
    send(server, (make_group(0), "p0"))
    request = ask(require_labels=True, label_deadline_s=20.0)
    assert send(server, (request, "m1")) == {}
    move_clocks(monkeypatch, mono=1.0, wall=100.0)  # held 1 s of its 30; stored 100 s ago
    replies = send(server)
    assert ids(replies["m1"]) == ["g-0"] and replies["m1"].judge_timeouts == 1


def test_stale_skips_are_answered_at_once(server):
    send(server, (make_group(0, versions=(0, 0)), "p0"))
    replies = send(server, (ask(version=10, max_staleness=2), "m1"))
    assert replies["m1"] == Batch(groups=[], stale_skipped=1)  # frees an admission slot now
    assert send(server, (ask(version=10, max_staleness=2), "m2")) == {}  # counted once: held


def test_a_learner_hello_releases_every_held_request(server):
    assert send(server, (ask("L"), "m1"), (ask("L.r1"), "r1")) == {}
    replies = send(server, (LearnerHello("L", 0, []), "hello"))
    assert replies["m1"] == replies["r1"] == Batch(groups=[]) and server.held == {}
    assert set(send(server, (make_group(0), "p0"))) == {"p0"}
    assert not server.index["g-0"].delivered  # nothing went to the learner that is gone


def test_a_failed_transaction_keeps_the_request_held(server, monkeypatch):
    assert send(server, (ask(), "m1")) == {}
    real = server.store.put_meta

    def disk_error(*args):
        raise OSError("disk")

    monkeypatch.setattr(server.store, "put_meta", disk_error)
    assert send(server, (make_group(0), "p0")) == {}  # not committed: nothing answered
    assert list(server.held) == ["L"] and "g-0" not in server.index
    monkeypatch.setattr(server.store, "put_meta", real)
    replies = send(server, (make_group(0), "p0"))  # the actor's retry
    assert replies["p0"] == Ack("stored") and ids(replies["m1"]) == ["g-0"]


def test_timeout_is_bounded():
    BatchRequest("L", 1, 0, timeout_s=MAX_BATCH_WAIT_S)
    for bad in (MAX_BATCH_WAIT_S + 1, -1.0, float("nan"), float("inf")):
        with pytest.raises(SchemaError):
            codec.decode(codec.encode(BatchRequest("L", 1, 0, timeout_s=bad), "x"))


# --- the learner's side, against a real server process ------------------------------------------


@pytest.fixture
def live(tmp_path):
    srv = ServerProc(tmp_path / "run").start()
    clients = []

    def client():
        c = ReplayClient(srv.address, retry_after_s=0.5, timeout_s=10)
        clients.append(c)
        return c

    yield srv, client
    for c in clients:
        c.close()
    srv.kill()


def wait_held(client: ReplayClient, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    while client.stats()["batches_held"] != n:
        assert time.monotonic() < deadline, "the request was never held"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_waiting_request_returns_with_the_group_that_arrives(live):
    _, client = live
    learner, actor = client(), client()
    got = []
    # Held far longer than this test may take: only the group's arrival can end the wait (the
    # join below is a guard against a hang, not a measurement).
    waiter = threading.Thread(target=lambda: got.append(
        learner.request_batch("L", 4, 0, timeout_s=MAX_BATCH_WAIT_S)))
    waiter.start()
    wait_held(actor)
    group = make_group(1)
    assert push_all(actor, [group]) == {"g-1": "stored"}
    waiter.join(MAX_BATCH_WAIT_S / 2)
    assert not waiter.is_alive()
    [batch] = got
    assert ids(batch) == ["g-1"]  # one of the 4 asked for: answered on arrival, not when full
    assert codec.encode_body(batch.groups[0]) == codec.encode_body(group)
    stats = actor.stats()
    assert stats["batch_held"] == 1 and stats["batches_held"] == 0
    assert stats["groups_delivered"] == 1  # the client's retries while held took nothing more
    assert learner.request_batch("L", 4, 0).groups == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_unfillable_request_returns_empty_after_its_timeout(live):
    _, client = live
    c = client()
    push_all(c, [make_group(0, versions=(9, 9))])
    # Judged groups only, and none is: nothing to serve for the whole wait.
    batch = c.request_batch("L", 2, 9, require_labels=True, timeout_s=0.5)
    assert batch == Batch(groups=[])
    stats = c.stats()
    assert stats["batch_held"] == 1 and stats["batches_held"] == 0
    assert stats["groups_delivered"] == 0
    assert ids(c.request_batch("L", 2, 9)) == ["g-0"]  # still there for the next request


class _Slots:
    """The part of the control plane the draw uses: admission slots freed by stale skips."""

    def __init__(self):
        self.freed = []

    def free_stale_slots(self, n: int) -> None:
        self.freed.append(n)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_learner_draw_waits_on_replay_instead_of_polling(live, monkeypatch, tmp_path):
    from autodidact.resolve import learner_settings
    from learner.learner import BATCH_WAIT_S, Learner

    _, client = live
    replay, actor = client(), client()
    cfg = RunConfig()
    cfg.learner = LearnerConfig(batch_groups=3, max_staleness=2, advantage="grpo")
    cfg.judge.deadline_s = 0.0
    # The draw alone: no step (no model), no publisher.
    learner = Learner(learner_settings(cfg), tmp_path, _Slots(), replay, step=None,
                      publisher=None, learner_id="L")
    learner.version = 10
    asked = []
    request = replay.request_batch

    def spy(*args, **kw):
        asked.append(kw["timeout_s"])
        return request(*args, **kw)

    monkeypatch.setattr(replay, "request_batch", spy)
    push_all(actor, [make_group(0, "old", versions=(0, 0))])  # stale at version 10
    fresh = [make_group(i, f"fresh-{i}", versions=(10, 10)) for i in range(3)]
    out = []
    drawer = threading.Thread(target=lambda: out.append(
        learner.draw(time.monotonic() + 600)))
    drawer.start()
    wait_held(actor)  # the stale skip was reported, then the draw waits in replay
    push_all(actor, fresh[:1])
    wait_held(actor)
    push_all(actor, fresh[1:])
    drawer.join(60)
    assert not drawer.is_alive()
    [(groups, labels, _)] = out
    assert [g.group_id for g in groups] == ["fresh-0", "fresh-1", "fresh-2"] and labels is None
    assert learner.control.freed == [1]
    assert asked and all(t == BATCH_WAIT_S for t in asked)
    assert replay.timeout_s > 0  # the client's own deadline is on top of the wait
    learner.close()


def test_the_client_waits_longer_than_the_server_holds(monkeypatch):
    client = ReplayClient(channel=object(), timeout_s=7.0)
    seen = []
    monkeypatch.setattr(client, "_request",
                        lambda msg, expect, timeout_s=None: seen.append((msg, timeout_s)))
    client.request_batch("L", 1, 0, timeout_s=5.0)
    assert seen == [(BatchRequest("L", 1, 0, timeout_s=5.0), 12.0)]
