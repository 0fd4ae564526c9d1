"""The coordinator: a run's control plane kept in order from the launcher's process.

Redis only coordinates, and the coordinator is what keeps it coordinating::

    open(stack, cfg, run_dir)   the run's Redis (embedded unless redis.url) and the coordinator,
                                connected, then start(); close() of both Redis clients is
                                registered on ``stack``, to run before the server stops
    start()                     right after the control plane is connected (fresh and
                                --resume): run state phase=starting, started_at, run_dir;
                                the admission counters are initialised here
    feed(original, share)       training begins: phase=rl; from now on the task queue holds
                                the training mixture (TaskFeeder, autodidact/task_mix.py)
    tick()                      every pass of the launcher's loop (0.5 s):
        redis_watch.check()         an embedded Redis that died is restarted on its URL;
                                    data Redis lost is refilled from the durable copies
                                    (RedisWatch, autodidact/recovery.py)
        feeder.top_up()             the queue below its low-water mark gets a fresh sample
                                    (a Redis being restarted: the next tick refills)
    publish_restarts(roles)     restarts per role (and of Redis) into the run state
    finishing(), done()         the run's phase for worker nodes: finishing once the learner
                                is over (their roles stop), done after the final evaluation
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import redis

from autodidact.embedded_redis import EmbeddedRedis
from autodidact.recovery import RedisWatch, init_admission
from autodidact.resolve import with_redis_url
from autodidact.task_mix import TaskFeeder
from protocol.config import RunConfig
from protocol.control import ControlPlane, connect_redis
from protocol.messages import Task

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, cfg: RunConfig, run_dir: Path, control: ControlPlane, embedded=None):
        """``cfg`` names the run's Redis (``redis.url`` set); ``embedded`` is the
        EmbeddedRedis serving it, None for an external server."""
        self.cfg, self.run_dir, self.control = cfg, Path(run_dir), control
        # What the loop only reports goes through a client that fails at once: with the
        # roles' back-off (~40 s a call) a Redis killed just before a progress line held the
        # loop that restarts it for minutes (test_run_integration's Redis kill, under load).
        self.glance = ControlPlane(connect_redis(cfg.redis.url, retries=0), cfg.redis.prefix,
                                   cfg.redis.heartbeat_ttl_s) if cfg.redis.url else control
        self.redis_watch = RedisWatch(cfg, self.run_dir, control, embedded)
        self.feeder: TaskFeeder | None = None

    @classmethod
    def connect(cls, cfg: RunConfig, run_dir: Path, embedded=None) -> Coordinator:
        control = ControlPlane.connect(cfg.redis.url, cfg.redis.prefix,
                                       cfg.redis.heartbeat_ttl_s)
        return cls(cfg, run_dir, control, embedded)

    @classmethod
    def open(cls, stack: contextlib.ExitStack, cfg: RunConfig,
             run_dir: Path) -> tuple[RunConfig, Coordinator]:
        """The run's Redis (``redis.url``, or a private server whose URL makes a new config)
        and the coordinator, connected and started, both released when ``stack`` closes;
        returns the config that names that Redis. Used by ``autodidact run`` and by
        ``--single-process``."""
        embedded = None
        if not cfg.redis.url:
            embedded = EmbeddedRedis(run_dir, bind=cfg.redis.bind)
            cfg = with_redis_url(cfg, stack.enter_context(embedded))
        coordinator = cls.connect(cfg, run_dir, embedded)
        stack.callback(coordinator.close)  # before the embedded server stops (LIFO)
        coordinator.start()
        return cfg, coordinator

    def close(self) -> None:
        """Release both Redis clients; the server itself belongs to whoever started it."""
        if self.glance is not self.control:
            self.glance.close()
        self.control.close()

    def start(self) -> None:
        """Once per run, fresh or resumed, before any role starts."""
        self.control.set_state(phase="starting", started_at=time.time(),
                               run_dir=str(self.run_dir))
        # Admission grants nothing until opened with counters rebuilt from disk. Before the
        # replay server starts: in one process, LMDB refuses a second open of replay.lmdb.
        init_admission(self.run_dir, self.control)

    def feed(self, original: list[Task], share: float) -> None:
        """Training begins: keep the task queue full of the mixture of the env's own
        ``original`` tasks and a ``share`` of synthetic ones."""
        self.control.set_state(phase="rl")
        self.feeder = TaskFeeder(self.cfg, self.control, original, share)

    def tick(self) -> None:
        self.redis_watch.check()
        if self.feeder is None:
            return
        try:
            self.feeder.top_up()
        except redis.RedisError as exc:  # Redis is being restarted: the next tick refills
            log.warning("task queue not topped up: %s", exc)

    @property
    def redis_restarts(self) -> int:
        return self.redis_watch.restarts

    def restarts(self, roles) -> dict[str, int]:
        """Restarts per supervised role and of the embedded Redis."""
        return {**roles.restarts(), "redis": self.redis_restarts}

    def publish_restarts(self, roles) -> None:
        with contextlib.suppress(redis.RedisError):
            self.glance.set_state(restarts=self.restarts(roles))

    def finishing(self) -> None:
        """Worker nodes (autodidact node) stop their roles on this; "done" comes only after
        the final evaluation, moments before Redis goes away with the launcher."""
        with contextlib.suppress(redis.RedisError):
            self.control.set_state(phase="finishing")

    def done(self) -> None:
        self.control.set_state(phase="done")
