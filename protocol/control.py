"""The Redis control plane: every key a run uses, in one place, under a run-scoped prefix.

Layout (``P`` is the prefix, ``autodidact:<run name>`` by default)::

    P:tasks                 list   task queue (encoded Task bodies); LPUSH in, BRPOP out
    P:version               string current policy version published by the learner
    P:weights               string encoded WeightsAnnouncement of the current version
    P:hb:<role>:<id>        string heartbeat JSON, expires after the heartbeat TTL
    P:counters              hash   named integer counters (``actor/groups``, ...)
    P:acks:<version>        set    actor ids that loaded weights ``version``
    P:claims                hash   groups each actor was admitted for that replay has not acked
    P:state                 hash   run state (phase, started_at, ...)

Admission (the staleness bound) is one atomic script over ``P:counters``: an actor may start
``n`` more groups while ``admitted - stale + n <= (max_staleness + version + 1) * batch``, where
``admitted`` counts every group ever admitted (finished or running) and ``stale`` every group the
learner had to skip as too old, so skipped groups free their slots instead of wedging the run.

Redis holds coordination state only; anything that must survive a loss of Redis also lives in
a durable store (LMDB, checkpoints) from which it can be restored.
"""

from __future__ import annotations

import json
import logging
import re
import time

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from protocol import codec
from protocol.messages import Task

log = logging.getLogger(__name__)


class Keys:
    """Key names for one run."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.tasks = f"{prefix}:tasks"
        self.synthetic = f"{prefix}:synthetic"
        self.version = f"{prefix}:version"
        self.weights = f"{prefix}:weights"
        self.counters = f"{prefix}:counters"
        self.claims = f"{prefix}:claims"
        self.state = f"{prefix}:state"
        self.experience_cursor = f"{prefix}:exp:cursor"  # next replay seq to extract from

    def heartbeat(self, role: str, member: str) -> str:
        return f"{self.prefix}:hb:{role}:{member}"

    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}:hb:*"

    def acks(self, version: int) -> str:
        return f"{self.prefix}:acks:{version}"


def default_prefix(run_name: str) -> str:
    return f"autodidact:{run_name}"


# KEYS: counters, version, claims. ARGV: wanted, max_staleness, batch_groups, member.
# Grants min(wanted, free slots); returns the number granted.
_ADMIT = """
local admitted = tonumber(redis.call('HGET', KEYS[1], 'actor/admitted') or '0')
local stale = tonumber(redis.call('HGET', KEYS[1], 'learner/stale_skipped') or '0')
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
local bound = (tonumber(ARGV[2]) + version + 1) * tonumber(ARGV[3])
local granted = math.min(tonumber(ARGV[1]), bound - (admitted - stale))
if granted <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'actor/admitted', granted)
redis.call('HINCRBY', KEYS[3], ARGV[4], granted)
return granted
"""


# A restarted embedded server is back within a second or two; an external one may take longer.
# Capped exponential back-off with jitter, ~40 s in all, rides out either without every role
# crashing (and being restarted) at once.
RECONNECT_RETRIES = 25
RECONNECT_CAP_S = 2.0


def connect_redis(url: str, retries: int = RECONNECT_RETRIES) -> redis.Redis:
    """A client for ``url`` (``redis://[:password@]host:port/db``,
    ``unix://[:password@]/path.sock``) that reconnects with back-off when the server goes away.
    """
    retry = Retry(ExponentialWithJitterBackoff(cap=RECONNECT_CAP_S, base=0.05), retries,
                  supported_errors=(redis.ConnectionError, redis.TimeoutError, TimeoutError,
                                    ConnectionError, redis.BusyLoadingError))
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                health_check_interval=30, retry=retry)


def redact(url: str) -> str:
    """``url`` with its password replaced, for logs and progress lines."""
    return re.sub(r"(//[^/@:]*:)[^@]*@", r"\1***@", url)


class ControlPlane:
    """Typed helpers over the key layout; every role talks to Redis through this."""

    def __init__(self, client: redis.Redis, prefix: str, heartbeat_ttl_s: float = 10.0):
        self.r = client
        self.keys = Keys(prefix)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._admit = client.register_script(_ADMIT)

    @classmethod
    def connect(cls, url: str, prefix: str, heartbeat_ttl_s: float = 10.0) -> "ControlPlane":
        return cls(connect_redis(url), prefix, heartbeat_ttl_s)

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

    # --- synthetic task pool: every verified task the explorers made, in order ---
    # The queue above is consumed; the pool is read by index so a feeder on any machine can
    # mix synthetic tasks into its epochs (the durable copy is the explorer's tasks.lmdb).

    def add_synthetic(self, tasks: list[Task]) -> int:
        if not tasks:
            return self.synthetic_len()
        return self.r.rpush(self.keys.synthetic, *[codec.encode_body(t) for t in tasks])

    def synthetic_len(self) -> int:
        return self.r.llen(self.keys.synthetic)

    def synthetic_since(self, start: int) -> list[Task]:
        """Pool entries from index ``start`` on (what a reader has not seen yet)."""
        return [codec.decode_body(Task.TYPE, b) for b in self.r.lrange(self.keys.synthetic,
                                                                       start, -1)]

    # --- policy version ---

    def experience_cursor(self) -> int:
        return int(self.r.get(self.keys.experience_cursor) or 0)

    def set_experience_cursor(self, seq: int) -> None:
        self.r.set(self.keys.experience_cursor, seq)

    def set_version(self, version: int) -> None:
        self.r.set(self.keys.version, int(version))

    def get_version(self) -> int:
        """The published version; 0 before the first, -1 (logged) if the key holds garbage."""
        value = self.r.get(self.keys.version)
        if value is None:
            return 0
        try:
            return int(value)
        except ValueError:
            log.warning("%s holds %r, not a version", self.keys.version, value[:40])
            return -1

    def ack_version(self, version: int, member: str) -> None:
        """Record that ``member`` (an actor id) has loaded ``version``."""
        self.r.sadd(self.keys.acks(version), member)

    def version_acks(self, version: int) -> set[str]:
        return {m.decode() for m in self.r.smembers(self.keys.acks(version))}

    # --- admission: the staleness bound ---

    def admit(self, member: str, wanted: int, max_staleness: int, batch_groups: int) -> int:
        """Atomically reserve up to ``wanted`` group slots for ``member``; returns how many."""
        keys = [self.keys.counters, self.keys.version, self.keys.claims]
        return int(self._admit(keys=keys, args=[wanted, max_staleness, batch_groups, member]))

    def finish(self, member: str, n: int) -> None:
        """``n`` admitted groups of ``member`` are done (acknowledged by replay)."""
        self.r.hincrby(self.keys.claims, member, -n)

    def claimed(self, member: str) -> int:
        """Slots ``member`` holds: admitted, and not yet acknowledged or released."""
        return int(self.r.hget(self.keys.claims, member) or 0)

    def release(self, member: str, n: int | None = None) -> int:
        """Give back ``n`` slots that will never become groups (all of ``member``'s open claims
        when ``n`` is None: an actor restarting after a crash). Returns how many."""
        if n is None:
            n = self.claimed(member)
        if n > 0:
            pipe = self.r.pipeline()
            pipe.hincrby(self.keys.counters, "actor/admitted", -n)
            pipe.hincrby(self.keys.claims, member, -n)
            pipe.execute()
        return max(n, 0)

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
