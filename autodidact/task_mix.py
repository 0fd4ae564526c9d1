"""Which tasks a run trains on: the env's own, the self-questioned ones, or a mixture.

``tasks.synthetic_share`` decides: each task handed to the actors (and each warm-start
reference) is synthetic with that probability. Synthetic tasks come from the run's pool in
Redis, which explorers keep growing; the feeder picks up new ones at every epoch.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.messages import Task


def synthetic_share(cfg: RunConfig, original: list[Task]) -> float:
    """The configured share, or for ``-1`` (auto): 0 when the env has training tasks, else 1."""
    if cfg.tasks.synthetic_share >= 0:
        return cfg.tasks.synthetic_share
    return 0.0 if original else 1.0


def warmstart_tasks(cfg: RunConfig, original: list[Task], synthetic: list[Task],
                    share: float) -> list[Task] | None:
    """Reference tasks for the warm-start in the training mixture (None: the env's own)."""
    if share == 0.0:
        return None
    rng = random.Random(cfg.seed)
    n = cfg.warmstart.max_examples
    n_synth = n if share == 1.0 else round(share * n)
    picked = rng.sample(synthetic, min(n_synth, len(synthetic)))
    picked += rng.sample(original, min(n - len(picked), len(original))) if share < 1.0 else []
    return picked


class _Epochs:
    """Endless shuffled passes over a pool that may grow between passes."""

    def __init__(self, pool: Callable[[], list[Task]], rng: random.Random):
        self.pool, self.rng = pool, rng
        self.order: list[Task] = []

    def next(self) -> Task:
        if not self.order:
            self.order = list(self.pool())
            self.rng.shuffle(self.order)
        return self.order.pop()


class TaskFeeder:
    """Keeps the Redis task queue topped up with the training mixture, epoch after epoch."""

    def __init__(self, cfg: RunConfig, control: ControlPlane, original: list[Task],
                 share: float):
        self.control, self.share = control, share
        self.original, self.synthetic = original, []
        self.rng = random.Random(cfg.seed)
        self.low_water = 4 * cfg.actor.num_actors * cfg.actor.groups_in_flight
        self._original = _Epochs(lambda: self.original, self.rng)
        self._synthetic = _Epochs(lambda: self.synthetic, self.rng)

    def refresh(self) -> int:
        """Take in tasks the explorers added since the last call; returns the pool size."""
        self.synthetic += self.control.synthetic_since(len(self.synthetic))
        return len(self.synthetic)

    def top_up(self) -> None:
        if self.control.task_queue_len() >= self.low_water:
            return
        self.refresh()
        batch = [t for t in (self._draw() for _ in range(4 * self.low_water)) if t is not None]
        if batch:
            self.control.push_tasks(batch)

    def _draw(self) -> Task | None:
        synthetic = bool(self.synthetic) and (not self.original or self.rng.random() < self.share)
        if synthetic:
            return self._synthetic.next()
        return self._original.next() if self.original and self.share < 1.0 else None
