"""The Redis control plane against a real redis-server."""

import time

import redis

from autodidact.embedded_redis import EmbeddedRedis
from protocol.control import ControlPlane, ExperienceKeys, Keys, warmstart_prefix
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
    # kept for an hour, not for the run's life: one set per version grew Redis in the soak
    assert 0 < control.r.ttl(control.keys.acks(7)) <= 3600


def test_heartbeats_expire(control):
    # A TTL of its own, long enough that a loaded machine reads the heartbeat before it
    # expires; then polled until it has gone, which must not be before the TTL.
    plane = ControlPlane(control.r, control.keys.prefix, heartbeat_ttl_s=3.0)
    start = time.monotonic()
    plane.heartbeat("actor", "a0", groups=3)
    alive = plane.alive()
    assert [(h["role"], h["id"], h["groups"]) for h in alive] == [("actor", "a0", 3)]
    while plane.alive() and time.monotonic() < start + 60:
        time.sleep(0.1)
    assert plane.alive() == [] and time.monotonic() - start >= 2.9


def test_counters_and_state(control):
    control.incr("actor/groups")
    control.incr("actor/groups", 4)
    assert control.counters() == {"actor/groups": 5}
    control.set_state(phase="rl", updates=3)
    assert control.state() == {"phase": "rl", "updates": 3}


def _key_names(keys) -> list[str]:
    return [v for v in vars(keys).values() if isinstance(v, str)]


def test_keys_are_run_scoped():
    a, b = Keys("autodidact:a"), Keys("autodidact:b")
    assert a.tasks != b.tasks and a.tasks.startswith("autodidact:a:")
    assert a.heartbeat("actor", "0").startswith("autodidact:a:hb:")
    names = _key_names(a)[1:] + _key_names(a.experience) + [a.acks(3), a.heartbeat("r", "i")]
    assert all(n.startswith("autodidact:a:") for n in names)
    assert len(set(names)) == len(names)  # no two purposes share a key
    assert not set(names) & set(_key_names(b) + _key_names(b.experience))
    # The warm-start's scratch pool never touches the run's own pool.
    scratch = ExperienceKeys(warmstart_prefix("autodidact:a"))
    assert not set(_key_names(scratch)) & set(names)


def test_the_layout_docstring_lists_every_key():
    import protocol.control as module

    keys = Keys("P")
    documented = module.__doc__
    for name in _key_names(keys)[1:] + _key_names(keys.experience):
        assert f"\n    {name} " in documented, name


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
    control.init_admission(0, 0)
    # bound = (max_staleness + version + 1) * batch = (1 + 0 + 1) * 4 = 8 slots
    assert control.admit("a0", 3, 1, 4) == 3
    assert control.admit("a1", 3, 1, 4) == 3
    assert control.admit("a0", 3, 1, 4) == 2  # only what is left is granted
    assert control.admit("a1", 1, 1, 4) == 0
    control.finish("a0", 5)
    assert control.admit("a1", 1, 1, 4) == 0  # finished groups still count
    control.free_stale_slots(2)  # the learner skipped two stale groups
    assert control.admit("a1", 5, 1, 4) == 2
    control.set_version(1)  # one more batch of slots
    assert control.admit("a1", 5, 1, 4) == 4
    assert control.admission() == {"admitted": 14, "stale": 2, "ready": 1}


def test_admission_reads_its_own_counters_not_metrics(control):
    control.init_admission(0, 0)
    assert control.admit("a0", 8, 1, 4) == 8
    control.incr("learner/stale_skipped", 5)  # a metric, not a freed slot
    control.incr("actor/admitted", -5)
    assert control.admit("a0", 1, 1, 4) == 0
    assert control.counters() == {"learner/stale_skipped": 5, "actor/admitted": -5}


def test_admission_is_closed_until_initialised(control):
    control.set_version(50)
    assert not control.admission_ready()
    assert control.admit("a0", 1000, 4, 16) == 0  # not the whole (4 + 50 + 1) * 16 window
    control.free_stale_slots(3)  # counted meanwhile, replaced by the initialisation
    control.finish("a0", 2)
    assert control.claimed("a0") == 0  # never negative: there was nothing to finish
    control.init_admission(860, 10, {"a0": 2, "a1": 0})
    assert control.admission() == {"admitted": 860, "stale": 10, "ready": 1}
    assert control.admit("a1", 1000, 4, 16) == 880 - 850
    assert control.claimed("a0") == 2 and control.claimed("a1") == 30


def test_release_after_a_crash_returns_open_claims(control):
    control.init_admission(0, 0)
    assert control.admit("a0", 4, 0, 4) == 4
    control.finish("a0", 1)
    assert control.release("a0") == 3  # the restarted actor gives back what it never finished
    assert control.admission()["admitted"] == 1
    assert control.admit("a1", 4, 0, 4) == 3


def test_release_and_finish_take_at_most_what_a_member_holds(control):
    # Slots granted before Redis lost its data are unknown to it: giving them back must not
    # free slots that the rebuilt counters never counted.
    control.init_admission(10, 0, {"a0": 2})
    assert control.release("a0", 5) == 2
    assert control.release("a1", 3) == 0 and control.release("a1") == 0
    assert control.admission()["admitted"] == 8
    control.finish("a0", 4)
    assert control.claimed("a0") == 0
    assert control.admission()["admitted"] == 8


def test_concurrent_admission_never_overshoots(redis_url, control):
    import threading

    control.init_admission(0, 0)
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
