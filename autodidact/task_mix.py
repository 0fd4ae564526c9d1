"""Which tasks a run trains on: the env's own, the self-questioned ones, or a mixture.

``tasks.synthetic_share`` decides: each task handed to the actors (and each warm-start
reference) is synthetic with that probability. Synthetic tasks come from the run's pool in
Redis, which explorers keep growing; the feeder picks up new ones at every epoch.

``tasks.curriculum`` decides which tasks of each pool come up: ``uniform`` draws them alike;
``frontier`` weighs each by what the actors' rollouts of it scored so far
(:func:`frontier_weight`), so groups whose rollouts all fail or all succeed, which teach
the outcome-only objective nothing, are drawn less often.
"""

from __future__ import annotations

import random
import time

from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.messages import Task


def frontier_weight(successes: int, trials: int, floor: float) -> float:
    """A task's draw weight under ``tasks.curriculum=frontier``.

    With its success estimated as ``p = (successes + 1) / (trials + 2)`` (a uniform prior: a
    task never rolled out counts as 50%), the weight is ``floor + (1 - floor) * 4 p (1 - p)``:
    1 at 50%, falling towards ``floor`` as a task's rollouts keep failing or keep succeeding
    (4 failures: 0.60 with floor 0.1; 16: 0.29; 64: 0.15). The prior keeps a handful of
    rollouts from writing a task off."""
    p = (successes + 1) / (trials + 2)
    return floor + (1.0 - floor) * 4.0 * p * (1.0 - p)


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


class TaskFeeder:
    """Keeps the Redis task queue topped up with the training mixture.

    Each top-up is a fresh random sample (a task may come back in a later top-up, as a
    training set is revisited); a pool smaller than the top-up is cycled through. Under the
    frontier curriculum each draw is weighted by :func:`frontier_weight` of the task's
    outcomes in Redis (read at each top-up), with replacement.
    """

    def __init__(self, cfg: RunConfig, control: ControlPlane, original: list[Task],
                 share: float):
        self.control, self.share = control, share
        self.frontier = cfg.tasks.curriculum == "frontier"
        self.floor = cfg.tasks.frontier_floor
        self._outcomes: dict[str, tuple[int, int]] = {}
        self.original, self.synthetic = original, []
        # Its own stream: seeded with cfg.seed alone, as warmstart_tasks is, its first draws
        # came from the same Mersenne Twister words as the warm-start's picks, so the first
        # tasks RL saw were those the warm-start had just trained on.
        self.rng = random.Random(f"task-feeder:{cfg.seed}")
        # Sized for every actor drawing from the queue: this machine's and, counted from their
        # heartbeats, other nodes' (autodidact node); at least one.
        self.per_actor = 4 * cfg.actor.groups_in_flight
        self.local_actors = cfg.actor.num_actors
        self.low_water = self.per_actor * max(self.local_actors, 1)
        self._counted_at = float("-inf")

    def count_actors(self, every_s: float = 10.0) -> None:
        now = time.monotonic()
        if now - self._counted_at < every_s:
            return
        self._counted_at = now
        live = sum(h.get("role") == "actor" for h in self.control.alive())
        self.low_water = self.per_actor * max(self.local_actors, live, 1)

    def refresh(self) -> int:
        """Take in tasks the explorers added since the last call; returns the pool size."""
        self.synthetic += self.control.synthetic_since(len(self.synthetic))
        return len(self.synthetic)

    def top_up(self) -> None:
        self.count_actors()
        if self.control.task_queue_len() >= self.low_water:
            return
        self.refresh()
        if self.frontier:
            self._outcomes = self.control.task_outcomes()
        n = 4 * self.low_water
        n_synthetic = sum(self._draws_synthetic() for _ in range(n))
        originals = self.original if self.share < 1.0 else []
        batch = self._take(self.synthetic, n_synthetic) + self._take(originals, n - n_synthetic)
        self.rng.shuffle(batch)
        if batch:
            self.control.push_tasks(batch)

    def _draws_synthetic(self) -> bool:
        return bool(self.synthetic) and (not self.original or self.rng.random() < self.share)

    def _take(self, pool: list[Task], k: int) -> list[Task]:
        if self.frontier and pool and k > 0:
            weights = [frontier_weight(*self._outcomes.get(t.task_id, (0, 0)), self.floor)
                       for t in pool]
            return self.rng.choices(pool, weights, k=k)
        out: list[Task] = []
        while pool and len(out) < k:
            out += self.rng.sample(pool, min(len(pool), k - len(out)))
        return out
