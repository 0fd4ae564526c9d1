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
task queue           the env's tasks and the pools above          the launcher's TaskFeeder
run state            the launcher                                 ``phase``/``run_dir`` again
==================  ===========================================  ==========================

Counters, heartbeats and admission claims are not restored: heartbeats come back within a
TTL, and admission only ever errs on the side of admitting fewer groups until the learner
publishes its next version.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import redis

from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.weights import announce

log = logging.getLogger(__name__)

SENTINEL = "run_dir"  # a field of the run state the launcher always sets: missing = data lost


def restore_control_plane(cfg: RunConfig, run_dir: Path, control: ControlPlane,
                          phase: str = "rl") -> dict[str, int]:
    """Put back what Redis lost; idempotent (restores only what is missing). Returns counts."""
    restored = {"synthetic": restore_synthetic(run_dir, control),
                "experiences": restore_experiences(cfg, run_dir),
                "version": restore_weights(run_dir, control)}
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
    from navigating.pool import DURABLE_FILE, ExperiencePool

    path = Path(run_dir) / DURABLE_FILE
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
    files = sorted((Path(run_dir) / "weights").glob("v*.safetensors"))
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
