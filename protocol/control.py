"""The Redis control plane: every key a run uses, in one place, under a run-scoped prefix.

Layout (``P`` is the prefix, ``autodidact:<run name>`` by default)::

    P:tasks                 list   task queue (encoded Task bodies); LPUSH in, BRPOP out
    P:synthetic             list   every verified synthetic task, in order (read by index)
    P:version               string current policy version published by the learner
    P:weights               string encoded WeightsAnnouncement of the current version
    P:hb:<role>:<id>        string heartbeat JSON, expires after the heartbeat TTL
    P:counters              hash   named integer counters for metrics (``actor/groups``, ...)
    P:acks:<version>        set    actor ids that loaded weights ``version`` (expires)
    P:admission             hash   the staleness bound's own counters: ``admitted``, ``stale``
                                   and ``ready`` (present only once they were initialised)
    P:claims                hash   groups each actor was admitted for that replay has not acked
    P:state                 hash   run state (phase, started_at, ...)
    P:exp:cursor            string next replay seq the experience worker extracts from
    P:exp:log               list   the experience pool (navigating/pool.py), oldest first
    P:exp:ids               set    exp_ids in ``P:exp:log``
    P:exp:uses              hash   exp_id -> rollouts it was injected into
    P:exp:successes         hash   exp_id -> of those, how many succeeded
    P:task:trials           hash   task_id -> rollouts the actors finished of it
    P:task:successes        hash   task_id -> of those, how many scored 1 or more
    P:warmstart:exp:*       ...    the warm-start's scratch pool (:func:`warmstart_prefix`)

Admission (the staleness bound) is one atomic script over ``P:admission``: an actor may start
``n`` more groups while ``admitted - stale + n <= (max_staleness + version + 1) * batch``, where
``admitted`` counts every group ever admitted (finished or running, less slots given back) and
``stale`` every group the learner had to skip as too old or that replay set aside as carrying
no signal, so skipped groups free their slots instead of wedging the run. These counters are
written only by :class:`ControlPlane`'s admission methods, never through
:meth:`ControlPlane.incr`: a metric can be renamed freely.

A Redis that lost its data must not start over at ``admitted = 0`` while the version (restored
from the weights files) says 50: that would grant the whole window at once. So the script
grants nothing until ``ready`` is set, which only :meth:`ControlPlane.init_admission` does,
with counters rebuilt from durable state (``autodidact/recovery.py``, at the start of every
run and after a loss of Redis).

Redis holds coordination state only; anything that must survive a loss of Redis also lives in
a durable store (LMDB, checkpoints) from which it can be restored.
"""

from __future__ import annotations

import json
import logging
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
        self.admission = f"{prefix}:admission"
        self.claims = f"{prefix}:claims"
        self.state = f"{prefix}:state"
        self.experience_cursor = f"{prefix}:exp:cursor"  # next replay seq to extract from
        # Per task id: rollouts the actors finished of it, and how many of them succeeded
        # (reward >= 1). The frontier feeder weighs tasks by them (autodidact/task_mix.py).
        self.task_trials = f"{prefix}:task:trials"
        self.task_successes = f"{prefix}:task:successes"
        self.experience = ExperienceKeys(prefix)  # the run's experience pool

    def heartbeat(self, role: str, member: str) -> str:
        return f"{self.prefix}:hb:{role}:{member}"

    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}:hb:*"

    def acks(self, version: int) -> str:
        return f"{self.prefix}:acks:{version}"


class ExperienceKeys:
    """Key names of one experience pool (navigating/pool.py) under ``prefix``."""

    def __init__(self, prefix: str):
        self.log = f"{prefix}:exp:log"
        self.ids = f"{prefix}:exp:ids"
        self.uses = f"{prefix}:exp:uses"
        self.successes = f"{prefix}:exp:successes"


def default_prefix(run_name: str) -> str:
    return f"autodidact:{run_name}"


def warmstart_prefix(prefix: str) -> str:
    """The prefix of the warm-start's scratch experience pool: apart from the run's own."""
    return f"{prefix}:warmstart"


# Admission fields of P:admission; 'ready' is the marker init_admission sets.
ADMITTED, STALE, READY = "admitted", "stale", "ready"

# KEYS: admission, version, claims. ARGV: wanted, max_staleness, batch_groups, member.
# Grants min(wanted, free slots), nothing while the counters are not initialised (a Redis
# that lost its data); returns the number granted.
_ADMIT = """
if not redis.call('HGET', KEYS[1], 'ready') then return 0 end
local admitted = tonumber(redis.call('HGET', KEYS[1], 'admitted') or '0')
local stale = tonumber(redis.call('HGET', KEYS[1], 'stale') or '0')
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
local bound = (tonumber(ARGV[2]) + version + 1) * tonumber(ARGV[3])
local granted = math.min(tonumber(ARGV[1]), bound - (admitted - stale))
if granted <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'admitted', granted)
redis.call('HINCRBY', KEYS[3], ARGV[4], granted)
return granted
"""

# KEYS: claims, admission. ARGV: member, n, give_back (1: release, 0: finish).
# Takes at most what the member holds, so a slot unknown here (granted before Redis lost its
# data) is never given back twice; returns how many were taken.
_SETTLE = """
local held = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local n = math.min(tonumber(ARGV[2]), held)
if n <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], -n)
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[2], 'admitted', -n) end
return n
"""


# A restarted embedded server is back within a second or two; an external one may take longer.
# Capped exponential back-off with jitter, ~40 s in all, rides out either without every role
# crashing (and being restarted) at once.
# How long a version's acks are kept: whoever asks which actors loaded a version asks within
# minutes of its publication (the fault and multi-node checks); the soak found them unbounded.
ACKS_TTL_S = 3600
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


class ControlPlane:
    """Typed helpers over the key layout; every role talks to Redis through this."""

    def __init__(self, client: redis.Redis, prefix: str, heartbeat_ttl_s: float = 10.0):
        self.r = client
        self.keys = Keys(prefix)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)

    @classmethod
    def connect(cls, url: str, prefix: str, heartbeat_ttl_s: float = 10.0) -> "ControlPlane":
        return cls(connect_redis(url), prefix, heartbeat_ttl_s)

    def close(self) -> None:
        """Drop the connection pool (the roles of one process may share this plane: only the
        code that connected it closes it)."""
        self.r.close()

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

    # --- per-task outcomes: what the actors' rollouts of each task scored ---
    # Kept with the run's Redis (durable across a resume); a Redis that lost its data starts
    # them again from nothing, which only makes the feeder uniform until they fill again.

    def record_outcomes(self, outcomes: dict[str, tuple[int, int]]) -> None:
        """Add ``{task_id: (successes, trials)}`` to the running counts."""
        if not outcomes:
            return
        pipe = self.r.pipeline(transaction=False)
        for task_id, (successes, trials) in outcomes.items():
            pipe.hincrby(self.keys.task_trials, task_id, trials)
            if successes:
                pipe.hincrby(self.keys.task_successes, task_id, successes)
        pipe.execute()

    def task_outcomes(self) -> dict[str, tuple[int, int]]:
        """``{task_id: (successes, trials)}`` of every task rolled out so far."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.task_trials)
        pipe.hgetall(self.keys.task_successes)
        trials, successes = pipe.execute()
        return {k.decode(): (int(successes.get(k, 0)), int(n)) for k, n in trials.items()}

    # --- experience extraction: where in replay's ingest order the worker is ---

    def experience_cursor(self) -> int:
        return int(self.r.get(self.keys.experience_cursor) or 0)

    def set_experience_cursor(self, seq: int) -> None:
        self.r.set(self.keys.experience_cursor, seq)

    # --- policy version ---

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
        """Record that ``member`` (an actor id) has loaded ``version``, for ACKS_TTL_S: a set
        per version kept for good grew Redis with every update of a long run."""
        key = self.keys.acks(version)
        self.r.pipeline(transaction=False).sadd(key, member).expire(key, ACKS_TTL_S).execute()

    def version_acks(self, version: int) -> set[str]:
        return {m.decode() for m in self.r.smembers(self.keys.acks(version))}

    # --- admission: the staleness bound ---

    def admit(self, member: str, wanted: int, max_staleness: int, batch_groups: int) -> int:
        """Atomically reserve up to ``wanted`` group slots for ``member``; returns how many
        (0 until :meth:`init_admission` has run)."""
        keys = [self.keys.admission, self.keys.version, self.keys.claims]
        return int(self._admit(keys=keys, args=[wanted, max_staleness, batch_groups, member]))

    def finish(self, member: str, n: int) -> None:
        """``n`` admitted groups of ``member`` are done (acknowledged by replay): they keep
        counting against the bound, and no longer against ``member``'s claims."""
        self._settle(keys=[self.keys.claims, self.keys.admission], args=[member, n, 0])

    def claimed(self, member: str) -> int:
        """Slots ``member`` holds: admitted, and not yet acknowledged or released."""
        return int(self.r.hget(self.keys.claims, member) or 0)

    def release(self, member: str, n: int | None = None) -> int:
        """Give back ``n`` slots that will never become groups (all of ``member``'s open claims
        when ``n`` is None: an actor restarting after a crash), at most what ``member``
        holds. Returns how many."""
        n = self.claimed(member) if n is None else n
        if n <= 0:
            return 0
        return int(self._settle(keys=[self.keys.claims, self.keys.admission],
                                args=[member, n, 1]))

    def free_stale_slots(self, n: int) -> None:
        """The learner skipped ``n`` groups, as too stale or (set aside by replay) as carrying
        no signal: they will never be trained, so their slots are free again."""
        if n > 0:
            self.r.hincrby(self.keys.admission, STALE, n)

    def init_admission(self, admitted: int, stale: int,
                       claims: dict[str, int] | None = None) -> None:
        """Set the admission counters (and every actor's claims) and open admission: at the
        start of a run and after Redis lost its data, from durable state (see
        ``autodidact.recovery.init_admission``). Replaces whatever was there."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.claims)
        if claims := {m: n for m, n in (claims or {}).items() if n > 0}:
            pipe.hset(self.keys.claims, mapping=claims)
        pipe.hset(self.keys.admission, mapping={ADMITTED: int(admitted), STALE: int(stale),
                                                READY: 1})
        pipe.execute()

    def admission_ready(self) -> bool:
        """Whether admission is open: False on a fresh or emptied Redis."""
        return bool(self.r.hexists(self.keys.admission, READY))

    def admission(self) -> dict[str, int]:
        """``admitted`` and ``stale`` (0 when unset) and ``ready`` (0 or 1), for status."""
        raw = self.r.hmget(self.keys.admission, [ADMITTED, STALE, READY])
        return {ADMITTED: int(raw[0] or 0), STALE: int(raw[1] or 0), READY: int(raw[2] is not None)}

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

    # --- counters: for metrics and progress only (admission keeps its own) ---

    def incr(self, name: str, by: int = 1) -> int:
        return self.r.hincrby(self.keys.counters, name, by)

    def counters(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.counters).items()}

    # --- run state ---

    def set_state(self, **fields) -> None:
        self.r.hset(self.keys.state, mapping={k: json.dumps(v) for k, v in fields.items()})

    def state(self) -> dict:
        return {k.decode(): json.loads(v) for k, v in self.r.hgetall(self.keys.state).items()}
