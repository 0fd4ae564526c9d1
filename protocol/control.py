"""The Redis control plane: every key a run uses, in one place, under a run-scoped prefix.

Layout (``P`` is the prefix, ``autodidact:<run name>`` by default)::

    P:tasks                 list   task queue (encoded Task bodies); LPUSH in, BRPOP out
    P:version               string current policy version published by the learner
    P:weights               string encoded WeightsAnnouncement of the current version
    P:hb:<role>:<id>        string heartbeat JSON, expires after the heartbeat TTL
    P:counters              hash   named integer counters (``actor/groups``, ...)
    P:acks:<version>        set    actor ids that loaded weights ``version``
    P:state                 hash   run state (phase, started_at, ...)

Redis holds coordination state only; anything that must survive a loss of Redis also lives in
a durable store (LMDB, checkpoints) from which it can be restored.
"""

from __future__ import annotations

import json
import time

import redis

from protocol import codec
from protocol.messages import Task


class Keys:
    """Key names for one run."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.tasks = f"{prefix}:tasks"
        self.version = f"{prefix}:version"
        self.weights = f"{prefix}:weights"
        self.counters = f"{prefix}:counters"
        self.state = f"{prefix}:state"

    def heartbeat(self, role: str, member: str) -> str:
        return f"{self.prefix}:hb:{role}:{member}"

    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}:hb:*"

    def acks(self, version: int) -> str:
        return f"{self.prefix}:acks:{version}"


def default_prefix(run_name: str) -> str:
    return f"autodidact:{run_name}"


class ControlPlane:
    """Typed helpers over the key layout; every role talks to Redis through this."""

    def __init__(self, client: redis.Redis, prefix: str, heartbeat_ttl_s: float = 10.0):
        self.r = client
        self.keys = Keys(prefix)
        self.heartbeat_ttl_s = heartbeat_ttl_s

    @classmethod
    def connect(cls, url: str, prefix: str, heartbeat_ttl_s: float = 10.0) -> "ControlPlane":
        client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                      health_check_interval=30, retry_on_timeout=True)
        return cls(client, prefix, heartbeat_ttl_s)

    # --- task queue: FIFO of encoded Task bodies ---

    def push_tasks(self, tasks: list[Task]) -> int:
        if not tasks:
            return self.task_queue_len()
        return self.r.lpush(self.keys.tasks, *[codec.encode_body(t) for t in tasks])

    def pop_task(self, timeout_s: float = 0.0) -> Task | None:
        """Oldest task, waiting up to ``timeout_s`` (0 = don't wait)."""
        if timeout_s > 0:
            got = self.r.brpop([self.keys.tasks], timeout=timeout_s)
            body = got[1] if got else None
        else:
            body = self.r.rpop(self.keys.tasks)
        return None if body is None else codec.decode_body(Task.TYPE, body)

    def task_queue_len(self) -> int:
        return self.r.llen(self.keys.tasks)

    # --- policy version ---

    def set_version(self, version: int) -> None:
        self.r.set(self.keys.version, int(version))

    def get_version(self) -> int:
        value = self.r.get(self.keys.version)
        return int(value) if value is not None else 0

    def ack_version(self, version: int, member: str) -> None:
        """Record that ``member`` (an actor id) has loaded ``version``."""
        self.r.sadd(self.keys.acks(version), member)

    def version_acks(self, version: int) -> set[str]:
        return {m.decode() for m in self.r.smembers(self.keys.acks(version))}

    # --- heartbeats ---

    def heartbeat(self, role: str, member: str, **status) -> None:
        payload = json.dumps({"role": role, "id": member, "t": time.time(), **status})
        self.r.set(self.keys.heartbeat(role, member), payload,
                   px=max(1, int(self.heartbeat_ttl_s * 1000)))

    def alive(self) -> list[dict]:
        """Heartbeats that have not expired, one dict per live role instance."""
        found = []
        for key in self.r.scan_iter(match=self.keys.heartbeat_pattern(), count=100):
            raw = self.r.get(key)
            if raw is not None:
                found.append(json.loads(raw))
        return sorted(found, key=lambda h: (h["role"], h["id"]))

    # --- counters ---

    def incr(self, name: str, by: int = 1) -> int:
        return self.r.hincrby(self.keys.counters, name, by)

    def counters(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.counters).items()}

    # --- run state ---

    def set_state(self, **fields) -> None:
        self.r.hset(self.keys.state, mapping={k: json.dumps(v) for k, v in fields.items()})

    def state(self) -> dict:
        return {k.decode(): json.loads(v) for k, v in self.r.hgetall(self.keys.state).items()}
