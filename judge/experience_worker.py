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
import signal
import time
from pathlib import Path

from environments.base import env_class
from metrics.jsonl import MetricsWriter
from navigating.extraction import ExperienceExtractor, LLMExtractor
from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.errors import TransportTimeout
from protocol.replay_client import ReplayClient
from protocol.run_dir import RunDir

log = logging.getLogger(__name__)

PAGE_GROUPS = 256  # groups asked for per GroupsSince request

def make_extractor(cfg: RunConfig, run_dir: Path | None = None) -> ExperienceExtractor:
    choice = cfg.experience.extractor
    if choice == "auto":
        choice = "llm" if cfg.llm.url else "rules"
    if choice == "rules":
        return ExperienceExtractor()
    if not cfg.llm.url:
        raise ValueError("experience.extractor=llm needs llm.url (an OpenAI-compatible endpoint)")
    from inference.llm import OpenAIChat

    replies = RunDir(run_dir).llm_replies("experience") if run_dir is not None else None
    return ExperienceExtractor(LLMExtractor(OpenAIChat.from_config(cfg.llm, reply_log=replies)))


def seed_from_explorations(pool, run_dir: Path, extractor: ExperienceExtractor) -> dict:
    """Lessons from the explore stage's trajectories; nothing when it did not run."""
    from questioning.factory import read_explorations

    exps = [e for record in read_explorations(run_dir)
            for e in extractor.from_exploration(record)]
    return pool.add(exps) if exps else {"added": 0}


class ExperienceWorker:
    def __init__(self, cfg: RunConfig, run_dir: Path, control: ControlPlane, pool,
                 extractor: ExperienceExtractor | None = None,
                 replay: ReplayClient | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # Rule extraction replays tasks in their env: a plugin's module must be imported (and
        # its env registered) before a task of the env's own can name it.
        env_class(cfg.env.name)
        self.control = control
        self.pool = pool
        self.extractor = extractor or make_extractor(cfg, run_dir)
        self.replay = replay or ReplayClient.for_run(cfg)
        self.metrics = MetricsWriter(run_dir, "experience", "experience")
        self.malformed = 0
        self._stop = False

    def request_stop(self, *_):
        self._stop = True

    def run(self, poll_s: float = 1.0) -> None:
        every = self.cfg.experience.update_every
        if every == 0:
            log.info("experience.update_every=0: the pool stays as initialised")
            return
        done_at = self.control.get_version()
        while not self._stop:
            version = self.control.get_version()
            if version - done_at >= every:
                try:
                    self.extract_once(version)
                    done_at = version
                except TransportTimeout as exc:  # replay away: the same pass, next time round
                    log.warning("experience: replay did not answer (%s); retrying", exc)
            time.sleep(poll_s)

    def extract_once(self, version: int) -> dict:
        """Extract from every group stored since the last pass; returns the pool's counts."""
        t0 = time.monotonic()
        groups, next_seq = self._new_groups()
        exps = [e for g in groups for e in self.extractor.from_group(g, version)]
        counts = self.pool.add(exps) if exps else {"added": 0}
        self.control.set_experience_cursor(next_seq)
        self.metrics.log({"groups": len(groups), "candidates": len(exps),
                          **{k: float(v) for k, v in counts.items()},
                          "pool_size": float(self.pool.size()), "malformed": self.malformed,
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
        self.metrics.close()
        self.replay.close()


def main(cfg: RunConfig, run_dir: Path) -> None:
    from navigating.pool import open_pool

    control = ControlPlane.connect(cfg.redis.url, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s)
    pool = open_pool(cfg, run_dir=run_dir)
    pool.restore()  # a Redis that lost its data gets the pool back first
    worker = ExperienceWorker(cfg, run_dir, control, pool)
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    try:
        worker.run()
    finally:
        worker.close()
