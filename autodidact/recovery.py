"""Keep a run's control plane alive: restart an embedded Redis that died, and refill a Redis
that lost its data from the durable copies.

Redis only coordinates; everything in it that a run cannot rebuild on the fly has a durable
copy on disk, which :func:`restore_control_plane` puts back:

==================  ===========================================  ==========================
Redis key            durable copy                                 rebuilt by
==================  ===========================================  ==========================
synthetic pool       ``tasks.lmdb`` (the explorer's task store)   re-appending missing tasks
experience pool      ``experiences.log`` (append-only entries)    :meth:`ExperiencePool.restore`
version, weights     ``weights/v*.safetensors``                   re-announcing the newest file
admission, claims    ``replay.lmdb`` and the actors' outboxes     :func:`init_admission`
task queue           the env's tasks and the pools above          the launcher's TaskFeeder
run state            the launcher                                 ``phase``/``run_dir`` again
==================  ===========================================  ==========================

Metric counters and heartbeats are not restored: heartbeats come back within a TTL, and the
counters only feed progress lines. Admission stays closed (grants nothing) from the moment
Redis lost its data until :func:`init_admission` has rebuilt its counters; the launcher also
calls it at the start of every run, fresh or resumed, since nothing else opens admission.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import lmdb
import msgpack
import redis

from actor.outbox import Outbox
from protocol import codec
from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.errors import SchemaError
from protocol.messages import Group, Task
from protocol.run_dir import RunDir
from protocol.weights import announce
from replay.store import (
    EVICTED_STALE,
    LAST_BATCH,
    LEARNER_VERSION,
    MAX_STALENESS,
    NEXT_SEQ,
    SET_ASIDE,
    Store,
    store_path,
)

log = logging.getLogger(__name__)

SENTINEL = "run_dir"  # a field of the run state the launcher always sets: missing = data lost


def restore_control_plane(cfg: RunConfig, run_dir: Path, control: ControlPlane,
                          phase: str = "rl") -> dict[str, int]:
    """Put back what Redis lost; idempotent (restores only what is missing). Returns counts."""
    restored = {"synthetic": restore_synthetic(run_dir, control),
                "experiences": restore_experiences(cfg, run_dir),
                "version": restore_weights(run_dir, control),
                "admission": int(init_admission(run_dir, control) is not None)}
    if not control.state().get(SENTINEL):
        control.set_state(phase=phase, run_dir=str(run_dir), restored_at=time.time())
    return restored


def restore_synthetic(run_dir: Path, control: ControlPlane) -> int:
    from questioning.task_store import TaskStore, exists

    if not exists(run_dir):
        return 0
    with TaskStore(run_dir, readonly=True) as store:
        tasks = store.all()
    have = control.synthetic_len()
    if have >= len(tasks):
        return 0
    control.add_synthetic(tasks[have:])
    return len(tasks) - have


def restore_experiences(cfg: RunConfig, run_dir: Path) -> int:
    from navigating.pool import ExperiencePool

    path = RunDir(run_dir).experiences
    if not cfg.experience.enabled or not path.exists():
        return 0
    # No embedding model is needed to re-append stored entries: they carry their vectors.
    pool = ExperiencePool.connect(cfg.redis.url, cfg.redis.prefix, embedder=None,
                                  max_pool=cfg.experience.max_pool, durable_path=path)
    try:
        return pool.restore()
    finally:
        pool.close()


def restore_weights(run_dir: Path, control: ControlPlane) -> int:
    """Re-announce the newest complete weights file when Redis announces an older version (or
    none); returns the version announced, 0 when nothing was needed."""
    files = RunDir(run_dir).published_weights()
    if not files:
        return 0
    newest = files[-1]
    version = int(newest.stem[1:])
    if control.get_version() >= version and control.r.get(control.keys.weights) is not None:
        return 0
    # A file under its final name was renamed in complete.
    announce(control, newest, newest.read_bytes(), version)
    log.warning("re-announced weights v%d from %s", version, newest)
    return version


# --- admission: rebuilt from disk, erring on the side of admitting fewer ---
#
# Admission allows ``admitted - stale <= (max_staleness + version + 1) * B``. What matters is
# the difference: the groups that still count against the window. Nothing in Redis survives a
# loss of its data; rebuilt from disk, each term is one the lost counters held or a bound that
# admits fewer:
#
# admitted = next_seq + in flight. replay's ``next_seq`` (LMDB meta) counts every group ever
#   stored, evicted ones included, and each was admitted first. In flight are the actors'
#   outboxes: groups pushed and not yet stored, and tasks being rolled out. Outboxes are read
#   before replay, so a group stored in between is counted by next_seq, not lost between
#   the two reads. Counting one twice (stored between the reads, or a crash between writing a
#   group and forgetting its task) only admits fewer. The claims set per actor are what it
#   will still finish or release: its pending groups, stored or not, and its unsent tasks.
# stale = evicted_stale + the stale groups replay has provably reported already. The learner
#   reports a stale group once (replay remembers which, in memory), so a group counted here
#   and reported again later would free its slot twice. Provably reported: still deliverable,
#   stale at the floor of the learner's last request, and no newer (in ingest order) than the
#   newest group of some learner's last batch, because a batch walks the queue oldest first.
#   Groups evicted as stale can never be reported again nor served: their slots are free
#   (the one way this frees more than the lost counter held: such a group evicted before the
#   learner walked past it, which eviction, oldest first and only over capacity, makes rare).
#   Stale groups that cannot be proven reported stay counted: fewer slots, never more.
#
# What this cannot see: outboxes on another machine (actors of ``autodidact node`` with their
# own run dir). Their groups in flight when Redis lost its data are not counted (a one-time
# surplus of at most those groups), and their ``finish``/``release`` of such slots is capped
# at what Redis knows they hold, so it takes nothing away.


def init_admission(run_dir: Path, control: ControlPlane) -> dict[str, int] | None:
    """Open admission with its counters and the actors' claims rebuilt from durable state,
    unless it is open already (a no-op then: call it as often as you like). The launcher
    calls it at the start of every run, fresh or ``--resume``, before any actor starts;
    :func:`restore_control_plane` after Redis lost its data. Returns what it set, or None."""
    if control.admission_ready():
        return None
    outboxes = read_outboxes(run_dir)  # before replay: see the comment above
    next_seq, stale, stored = replay_admission(run_dir)
    claims = {aid: len(groups) + tasks for aid, (groups, tasks) in outboxes.items()}
    in_flight = sum(tasks + sum(g not in stored for g in groups)
                    for groups, tasks in outboxes.values())
    control.init_admission(next_seq + in_flight, stale, claims)
    log.info("admission opened: %d admitted (%d in flight), %d stale, claims %s",
             next_seq + in_flight, in_flight, stale, claims)
    return {"admitted": next_seq + in_flight, "stale": stale, "in_flight": in_flight}


def read_outboxes(run_dir: Path) -> dict[str, tuple[list[str], int]]:
    """Per actor whose outbox is under ``run_dir``: (ids of the groups it has not seen
    acknowledged, how many of its held tasks have no such group yet)."""
    acks = RunDir(run_dir).acks
    ids = {p.name.rsplit(".", 1)[0] for p in acks.glob("*.pending")}
    ids |= {p.name.rsplit(".", 1)[0] for p in acks.glob("*.tasks")}
    return {aid: _outbox(Outbox(run_dir, aid)) for aid in sorted(ids)}


def _outbox(box: Outbox) -> tuple[list[str], int]:
    # Tasks before groups: the actor writes a turn's groups before it forgets the turn's
    # tasks, so a turn finishing between the two reads is seen (twice, and counted once).
    tasks = []
    if box.tasks_path.exists():
        try:
            tasks = [codec.decode_body(Task.TYPE, b)
                     for b in msgpack.unpackb(box.tasks_path.read_bytes())]
        except OSError:  # dropped meanwhile: its groups are pending, read below
            tasks = []
    groups = []
    for path in box.pending_dir.glob("*.group") if box.pending_dir.exists() else ():
        try:
            groups.append(codec.decode_body(Group.TYPE, path.read_bytes()))
        except OSError:  # acknowledged meanwhile: stored, so replay's next_seq counts it
            continue
        except (SchemaError, ValueError):  # cut by a crash: never pushed
            continue
    # A task whose group is already written is one slot, not two (as Outbox.recover counts).
    sent, unsent = Counter(g.task.task_id for g in groups), 0
    for task in tasks:
        if sent[task.task_id] > 0:
            sent[task.task_id] -= 1
        else:
            unsent += 1
    return [g.group_id for g in groups], unsent


def replay_admission(run_dir: Path) -> tuple[int, int, set[str]]:
    """From ``replay.lmdb``, read-only: (groups ever stored, groups whose slots are free as
    stale or set aside, ids stored now); zeros before replay has stored anything."""
    if not (store_path(run_dir) / "data.mdb").exists():
        return 0, 0, set()
    try:
        store = Store(run_dir, readonly=True)
    except lmdb.NotFoundError:  # created a moment ago; its sub-dbs are not committed yet
        return 0, 0, set()
    try:
        with store.env.begin() as txn:
            index = store.load_index(txn)
            next_seq = store.get_meta(txn, NEXT_SEQ, 0)
            # Slots free again: groups evicted or skipped as stale, and those set aside as
            # carrying no signal (BatchRequest.skip_uninformative).
            stale = (store.get_meta(txn, EVICTED_STALE, 0) + _reported_stale(store, txn, index)
                     + store.get_meta(txn, SET_ASIDE, 0))
    finally:
        store.close()
    return next_seq, stale, set(index)


def _reported_stale(store: Store, txn, index: dict) -> int:
    """Deliverable groups below the floor of the learner's last request that its last batch
    walked past (so replay has reported them); 0 when that cannot be told."""
    version = store.get_meta(txn, LEARNER_VERSION)
    staleness = store.get_meta(txn, MAX_STALENESS)
    if version is None or staleness is None:
        return 0
    floor = version - staleness
    walked = max((index[g].seq for g in _last_batch_ids(store, txn) if g in index), default=-1)
    return sum(1 for r in index.values()
               if not (r.consumed or r.delivered) and 0 <= r.min_version < floor
               and r.seq <= walked)


def _last_batch_ids(store: Store, txn) -> list[str]:
    """Group ids of every learner's last batch (meta ``last_batch/<learner id>``)."""
    prefix, ids = LAST_BATCH.encode(), []
    cursor = txn.cursor(db=store.db["meta"])
    if not cursor.set_range(prefix):
        return ids
    for key, raw in cursor:
        if not key.startswith(prefix):
            break
        try:
            ids += [g for g in msgpack.unpackb(raw)[1] if isinstance(g, str)]
        except Exception:  # a layout this code does not know: count nothing as reported
            continue
    return ids


class RedisWatch:
    """The launcher's eye on Redis, checked every supervision tick.

    An embedded server that died is restarted on the same URL; either kind is checked for
    lost data (the sentinel field of the run state) every ``check_every_s`` and refilled from
    the durable copies. Roles meanwhile ride out the gap on their clients' back-off.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, control: ControlPlane, embedded=None,
                 check_every_s: float = 5.0):
        self.cfg, self.run_dir, self.control = cfg, Path(run_dir), control
        self.embedded = embedded  # an EmbeddedRedis, or None for an external server
        self.check_every_s = check_every_s
        self.restores = 0
        self._next_check = 0.0

    @property
    def restarts(self) -> int:
        return self.embedded.restarts if self.embedded is not None else 0

    def check(self) -> None:
        restarted = False
        if self.embedded is not None and not self.embedded.alive():
            self.embedded.restart()
            restarted = True
        now = time.monotonic()
        if not restarted and now < self._next_check:
            return
        self._next_check = now + self.check_every_s
        try:
            if restarted or not self.control.state().get(SENTINEL):
                counts = restore_control_plane(self.cfg, self.run_dir, self.control)
                self.restores += 1
                log.warning("control plane checked after a Redis %s: restored %s",
                            "restart" if restarted else "data loss", counts)
        except redis.RedisError as exc:  # still away: the next tick tries again
            log.warning("redis unavailable: %s", exc)
            self._next_check = now
