"""The Redis control plane against a real redis-server."""

import time

import redis

from autodidact.embedded_redis import EmbeddedRedis
from protocol.control import ControlPlane, Keys
from protocol.messages import Task


def _task(i):
    return Task(task_id=f"t{i}", env="files", query=f"do {i}", seed=i, goal={"x": i})


def test_task_queue_is_fifo_and_typed(control):
    control.push_tasks([_task(i) for i in range(3)])
    assert control.task_queue_len() == 3
    got = [control.pop_task() for _ in range(3)]
    assert [t.task_id for t in got] == ["t0", "t1", "t2"]
    assert got[1].goal == {"x": 1}
    assert control.pop_task() is None
    assert control.pop_task(timeout_s=0.1) is None


def test_version_and_acks(control):
    assert control.get_version() == 0
    control.set_version(7)
    assert control.get_version() == 7
    control.ack_version(7, "actor-0")
    control.ack_version(7, "actor-1")
    assert control.version_acks(7) == {"actor-0", "actor-1"}
    assert control.version_acks(8) == set()


def test_heartbeats_expire(control):
    control.heartbeat("actor", "a0", groups=3)
    alive = control.alive()
    assert [(h["role"], h["id"], h["groups"]) for h in alive] == [("actor", "a0", 3)]
    time.sleep(0.7)  # TTL is 0.5 s in the fixture
    assert control.alive() == []


def test_counters_and_state(control):
    control.incr("actor/groups")
    control.incr("actor/groups", 4)
    assert control.counters() == {"actor/groups": 5}
    control.set_state(phase="rl", updates=3)
    assert control.state() == {"phase": "rl", "updates": 3}


def test_keys_are_run_scoped():
    a, b = Keys("autodidact:a"), Keys("autodidact:b")
    assert a.tasks != b.tasks and a.tasks.startswith("autodidact:a:")
    assert a.heartbeat("actor", "0").startswith("autodidact:a:hb:")


def test_embedded_redis_persists_across_restart(tmp_path):
    with EmbeddedRedis(tmp_path) as url:
        ControlPlane.connect(url, "p").set_version(42)
    with EmbeddedRedis(tmp_path) as url:
        assert ControlPlane.connect(url, "p").get_version() == 42


def test_embedded_redis_stops(tmp_path):
    server = EmbeddedRedis(tmp_path)
    url = server.start()
    proc = server.proc
    server.stop()
    assert proc.poll() is not None
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        raise AssertionError("server still answers after stop")
    except redis.ConnectionError:
        pass


def test_admission_is_bounded_atomic_and_frees_stale_slots(control):
    # bound = (max_staleness + version + 1) * batch = (1 + 0 + 1) * 4 = 8 slots
    assert control.admit("a0", 3, 1, 4) == 3
    assert control.admit("a1", 3, 1, 4) == 3
    assert control.admit("a0", 3, 1, 4) == 2  # only what is left is granted
    assert control.admit("a1", 1, 1, 4) == 0
    control.finish("a0", 5)
    control.incr("learner/stale_skipped", 2)  # the learner skipped two stale groups
    assert control.admit("a1", 5, 1, 4) == 2
    control.set_version(1)  # one more batch of slots
    assert control.admit("a1", 5, 1, 4) == 4


def test_release_after_a_crash_returns_open_claims(control):
    assert control.admit("a0", 4, 0, 4) == 4
    control.finish("a0", 1)
    assert control.release("a0") == 3  # the restarted actor gives back what it never finished
    assert control.counters()["actor/admitted"] == 1
    assert control.admit("a1", 4, 0, 4) == 3


def test_concurrent_admission_never_overshoots(redis_url, control):
    import threading

    granted = []

    def grab(member):
        c = ControlPlane(redis.Redis.from_url(redis_url), control.keys.prefix)
        for _ in range(20):
            granted.append(c.admit(member, 2, 0, 16))

    threads = [threading.Thread(target=grab, args=(f"a{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 16
