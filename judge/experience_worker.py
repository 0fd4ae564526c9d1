"""The experience role: grow the shared experience pool from finished groups.

    once, before training: lessons from the explore stage's explorations (if any)
    while not stopped:
        wait until the learner has made update_every more updates (0 = frozen: stop here)
        groups = replay groups stored since the last pass (read-only LMDB, oldest first)
        experiences = extract(groups)            # rules, or the llm endpoint
        pool.add(experiences)                    # drops empty, too long, near-duplicates
        metrics experience/*

It reads the replay store directly (LMDB allows readers beside the one writer) instead of
asking the replay server, so extraction never competes with the learner's batches; where it
has read up to is kept in Redis, so a restarted worker does not extract the same groups twice.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from metrics.jsonl import MetricsWriter
from navigating.extraction import ExperienceExtractor, LLMExtractor
from protocol import codec
from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.errors import SchemaError
from replay.store import Store, store_path

log = logging.getLogger(__name__)

def make_extractor(cfg: RunConfig) -> ExperienceExtractor:
    choice = cfg.experience.extractor
    if choice == "auto":
        choice = "llm" if cfg.llm.url else "rules"
    if choice == "rules":
        return ExperienceExtractor()
    if not cfg.llm.url:
        raise ValueError("experience.extractor=llm needs llm.url (an OpenAI-compatible endpoint)")
    from inference.llm import OpenAIChat

    return ExperienceExtractor(LLMExtractor(OpenAIChat.from_config(cfg.llm)))


def seed_from_explorations(pool, run_dir: Path, extractor: ExperienceExtractor) -> dict:
    """Lessons from the explore stage's trajectories; nothing when it did not run."""
    from questioning.factory import read_explorations

    exps = [e for record in read_explorations(run_dir)
            for e in extractor.from_exploration(record)]
    return pool.add(exps) if exps else {"added": 0}


class ExperienceWorker:
    def __init__(self, cfg: RunConfig, run_dir: Path, control: ControlPlane, pool,
                 extractor: ExperienceExtractor | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.control = control
        self.pool = pool
        self.extractor = extractor or make_extractor(cfg)
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
                self.extract_once(version)
                done_at = version
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
        start = self.control.experience_cursor()
        if not store_path(self.run_dir).exists():
            return [], start
        store = Store(self.run_dir, readonly=True)
        groups, next_seq = [], start
        try:
            with store.env.begin() as txn:
                for seq, group_id, body in store.iter_since(txn, start):
                    next_seq = seq + 1
                    try:
                        groups.append(codec.decode_body("group", bytes(body)))
                    except SchemaError as exc:  # stored by an older schema: skip, count
                        self.malformed += 1
                        log.warning("experience: skipping group %s: %s", group_id, exc)
        finally:
            store.close()
        return groups, next_seq


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
        worker.metrics.close()
