"""The experience role: grow the shared experience pool from finished groups.

    once, before training: lessons from the explore stage's explorations (if any)
    while not stopped:
        wait until the learner has made update_every more updates (0 = frozen: stop here)
        groups = replay groups stored since the last pass (GroupsSince, oldest first)
        experiences = extract(groups)            # rules, or the llm endpoint
        pool.add(experiences)                    # drops empty, too long, near-duplicates
        metrics experience/*

It asks the replay server for the groups (``ReplayClient.groups_since``: read-only, in ingest
order, evicted ones skipped, in pages), so it needs no file system in common with it and takes
nothing from the learner: reading marks no group delivered. Where it has read up to (the next
ingest sequence number) is kept in Redis, so a restarted worker does not extract the same
groups twice.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from environments.base import env_class
from metrics.jsonl import MetricsWriter
from navigating.extraction import ExperienceExtractor
from protocol.control import ControlPlane
from protocol.errors import TransportTimeout
from protocol.replay_client import ReplayClient
from protocol.role import StopEvent
from protocol.role_config import ExperienceSettings

log = logging.getLogger(__name__)

PAGE_GROUPS = 256  # groups asked for per GroupsSince request

class ExperienceWorker:
    """Built from its settings, the run's ``pool``, an ``extractor`` and a replay client
    (a reader). It owns the pool and the client from here on: :meth:`close` releases them."""

    def __init__(self, settings: ExperienceSettings, run_dir: Path, control: ControlPlane,
                 pool, extractor: ExperienceExtractor, replay: ReplayClient):
        self.settings = settings
        self.run_dir = Path(run_dir)
        # Rule extraction replays tasks in their env: a plugin's module must be imported (and
        # its env registered) before a task of the env's own can name it; a served env must
        # answer (the extractor replays on it, make_extractor(cfg)).
        env_class(settings.env)
        self.control = control
        self.pool = pool
        self.extractor = extractor
        self.replay = replay
        self.metrics = MetricsWriter(run_dir, "experience", "experience")
        self.malformed = 0
        self._stop = StopEvent()
        self._closed = False

    def request_stop(self, *_):
        self._stop.set()

    def run(self, stop: threading.Event | None = None, poll_s: float = 1.0) -> None:
        self._stop.use(stop)
        every = self.settings.experience.update_every
        if every == 0:
            log.info("experience.update_every=0: the pool stays as initialised")
            return
        done_at = self.control.get_version()
        while not self._stop.is_set():
            version = self.control.get_version()
            if version - done_at >= every:
                try:
                    self.extract_once(version)
                    done_at = version
                except TransportTimeout as exc:  # replay away: the same pass, next time round
                    log.warning("experience: replay did not answer (%s); retrying", exc)
            self._stop.wait(poll_s)

    def extract_once(self, version: int) -> dict:
        """Extract from every group stored since the last pass; returns the pool's counts."""
        t0 = time.monotonic()
        groups, next_seq = self._new_groups()
        exps = []
        for group in groups:
            if self._stop.is_set():
                break
            exps += self.extractor.from_group(group, version)
        if groups and self._stop.is_set():
            # Told to stop: replaying the rest (one served-env call after another) or embedding
            # the lessons (the first time, loading the embedder) would outlast the supervisor's
            # grace. The cursor stays, so a next worker reads them all.
            log.info("experience: stopping; %d groups left for the next pass", len(groups))
            return {"added": 0}
        counts = self.pool.add(exps) if exps else {"added": 0}
        self.control.set_experience_cursor(next_seq)
        self.metrics.log({"groups": len(groups), "candidates": len(exps),
                          **{k: float(v) for k, v in counts.items()},
                          "pool_size": float(self.pool.size()), "malformed": self.malformed,
                          "other_env": self.extractor.other_env,
                          "extract_s": time.monotonic() - t0, "version": version},
                         step=version)
        log.info("experience: %d groups -> %d candidates, %s; pool %d", len(groups), len(exps),
                 counts, self.pool.size())
        return counts

    def _new_groups(self):
        """Every group stored since the cursor, oldest first, and the cursor after them."""
        next_seq = self.control.experience_cursor()
        groups = []
        while True:
            page = self.replay.groups_since(next_seq, PAGE_GROUPS)
            groups += page.groups
            if page.malformed:  # stored by an older schema: skipped by replay, counted here
                self.malformed += page.malformed
                log.warning("experience: %d stored groups no longer decode; skipped",
                            page.malformed)
            if not page.more or page.next_seq <= next_seq:  # read to the end (or no progress)
                return groups, max(next_seq, page.next_seq)
            next_seq = page.next_seq

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.metrics.close()
        self.replay.close()
        self.pool.close()
