"""Which tasks a run trains on: the env's own, the self-questioned ones, or a mixture.

``tasks.synthetic_share`` decides: each task handed to the actors (and each warm-start
reference) is synthetic with that probability. Synthetic tasks come from the run's pool in
Redis, which explorers keep growing; the feeder picks up new ones at every epoch.

``tasks.match_examples`` draws self-made tasks in the shape of the env's own training tasks
(:func:`example_weights`): a user's examples say what kinds and lengths of task matter.

``tasks.curriculum`` decides which tasks of each pool come up: ``uniform`` draws them alike;
``frontier`` weighs each by what the actors' rollouts of it scored so far
(:func:`frontier_weight`), so groups whose rollouts all fail or all succeed, which teach
the outcome-only objective nothing, are drawn less often.

Under ``env.mix`` each member env's tasks get its weight's share of the draws
(:func:`member_weights`), under either curriculum: under ``frontier`` the frontier weights
are normalised within each env, so an env whose tasks sit nearer the frontier is not drawn
more than its share; within an env, its tasks are drawn by frontier weight as in a run of one.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict

from protocol.config import RunConfig, task_member
from protocol.control import ControlPlane
from protocol.messages import Task
from questioning.coverage import goal_kind

MAX_SHAPE_CALLS = 5  # reference lengths from here up share one shape


def frontier_weight(successes: int, trials: int, floor: float) -> float:
    """A task's draw weight under ``tasks.curriculum=frontier``.

    With its success estimated as ``p = (successes + 1) / (trials + 2)`` (a uniform prior: a
    task never rolled out counts as 50%), the weight is ``floor + (1 - floor) * 4 p (1 - p)``:
    1 at 50%, falling towards ``floor`` as a task's rollouts keep failing or keep succeeding
    (4 failures: 0.60 with floor 0.1; 16: 0.29; 64: 0.15). The prior keeps a handful of
    rollouts from writing a task off."""
    p = (successes + 1) / (trials + 2)
    return floor + (1.0 - floor) * 4.0 * p * (1.0 - p)


def task_shape(task: Task) -> tuple[str, int]:
    """What :func:`example_weights` matches on: the kind of goal and the reference's calls."""
    return goal_kind(task.goal), min(len(task.reference), MAX_SHAPE_CALLS)


def example_weights(pool: list[Task], examples: list[Task], strength: float) -> list[float]:
    """A draw weight per task of ``pool`` that gives each shape (:func:`task_shape`) the share
    ``strength * examples' share + (1 - strength) * pool's share``: self-made tasks drawn in
    the shape of the env's own (``tasks.match_examples``). All 1.0 without examples."""
    if not (pool and examples and strength > 0):
        return [1.0] * len(pool)
    have, want = Counter(map(task_shape, pool)), Counter(map(task_shape, examples))
    n, m = len(pool), len(examples)
    return [(strength * want[s] / m + (1 - strength) * have[s] / n) / (have[s] / n)
            for s in map(task_shape, pool)]


def weighted_sample(rng: random.Random, pool: list[Task], weights: list[float],
                    k: int) -> list[Task]:
    """``k`` tasks of ``pool`` without replacement, each drawn with its weight (weighted
    random keys, Efraimidis and Spirakis); a task of weight 0 never."""
    keyed = [(rng.random() ** (1.0 / w), i) for i, w in enumerate(weights) if w > 0]
    return [pool[i] for _, i in sorted(keyed, reverse=True)[:k]]


def member_weights(cfg: RunConfig, pool: list[Task],
                   within: list[float] | None = None) -> list[float] | None:
    """Under ``env.mix``, a draw weight per task of ``pool`` that gives each member env the
    share ``weight / sum of weights`` of the draws however many tasks it has; None for a run
    of one env. Within an env its share goes to its tasks alike, or in proportion to
    ``within`` (a weight per task of ``pool``: the frontier weights), so ``within`` moves
    draws between one env's tasks, never between envs. A task of no member
    (``Task.meta["env_member"]``) is never drawn."""
    if not cfg.env.mix:
        return None
    weight = {mid: w for mid, _, w in cfg.env.members()}
    member = [task_member(t) for t in pool]
    within = within if within is not None else [1.0] * len(pool)
    total: dict = defaultdict(float)
    for m, w in zip(member, within):
        total[m] += w
    return [weight[m] * w / total[m] if m in weight and total[m] > 0 else 0.0
            for m, w in zip(member, within)]


AUTO_MIXED_SHARE = 0.5  # auto's share beside re-grounded examples (docs/evaluation.md)


def regrounds_examples(cfg: RunConfig, has_state: bool = True) -> bool:
    """Whether explore re-grounds the env's training tasks (``explore.from_examples``); an
    env mix, or an env without state snapshots (``Environment.has_state``), explores nothing."""
    return cfg.explore.from_examples > 0 and not cfg.env.mix and has_state


def synthetic_share(cfg: RunConfig, original: list[Task], has_state: bool = True) -> float:
    """The configured share, or for ``-1`` (auto): 1 when the env has no training tasks; with
    them, :data:`AUTO_MIXED_SHARE` when explore re-grounds them, else 0."""
    if cfg.tasks.synthetic_share >= 0:
        return cfg.tasks.synthetic_share
    if not original:
        return 1.0
    return AUTO_MIXED_SHARE if regrounds_examples(cfg, has_state) else 0.0


def rl_synthetic_share(cfg: RunConfig, share: float) -> float:
    """The self-made share of RL's draws: ``tasks.rl_synthetic_share``, or when it is -1
    ``share`` (the warm-start's, :func:`synthetic_share`), except under auto's mixture: there
    the re-grounded examples join the warm-start and RL draws the env's own tasks alone."""
    if cfg.tasks.rl_synthetic_share >= 0:
        return cfg.tasks.rl_synthetic_share
    return 0.0 if cfg.tasks.synthetic_share < 0 and 0 < share < 1 else share


def warmstart_tasks(cfg: RunConfig, original: list[Task], synthetic: list[Task],
                    share: float) -> list[Task] | None:
    """Reference tasks for the warm-start in the training mixture (None: the env's own).

    ``tasks.warmstart_mixing=add`` keeps the hand-written references the warm-start takes
    alone and adds self-made ones to make up ``share`` of the whole; ``replace`` takes
    ``warmstart.max_examples`` in all, ``share`` of them self-made."""
    if share == 0.0:
        return None
    rng = random.Random(cfg.seed)
    n = cfg.warmstart.max_examples
    if 0.0 < share < 1.0 and cfg.tasks.warmstart_mixing == "add":
        from learner.warmstart import pick_references  # torch: not for the viewer's imports

        hand = pick_references(original, cfg.seed, n)
        return _self_made(cfg, rng, original, synthetic, round(share / (1 - share) * len(hand))) \
            + hand
    n_synth = n if share == 1.0 else round(share * n)
    picked = _self_made(cfg, rng, original, synthetic, n_synth)
    picked += rng.sample(original, min(n - len(picked), len(original))) if share < 1.0 else []
    return picked


def _self_made(cfg: RunConfig, rng: random.Random, original: list[Task],
               synthetic: list[Task], k: int) -> list[Task]:
    """``k`` self-made references, drawn in the shape of the env's own (match_examples)."""
    weights = example_weights(synthetic, original, cfg.tasks.match_examples)
    if all(w == 1.0 for w in weights):  # drawn alike: the plain sample earlier runs drew
        return rng.sample(synthetic, min(k, len(synthetic)))
    return weighted_sample(rng, synthetic, weights, k)


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
        # env.mix: each member's share of the draws by its weight (None: one env)
        self.cfg = cfg
        self.original_weights = member_weights(cfg, original)
        self.match = cfg.tasks.match_examples
        self.synthetic_weights: list[float] = []  # example_weights of the pool, kept current
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
        new = self.control.synthetic_since(len(self.synthetic))
        if new:
            self.synthetic += new
            self.synthetic_weights = example_weights(self.synthetic, self.original, self.match)
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
        batch = (self._take(self.synthetic, n_synthetic, self.synthetic_weights)
                 + self._take(originals, n - n_synthetic, self.original_weights,
                              by_member=self.original_weights is not None))
        self.rng.shuffle(batch)
        if batch:
            self.control.push_tasks(batch)

    def _draws_synthetic(self) -> bool:
        return bool(self.synthetic) and (not self.original or self.rng.random() < self.share)

    def _take(self, pool: list[Task], k: int, shaped: list[float] | None = None,
              by_member: bool = False) -> list[Task]:
        """``k`` draws from ``pool``: by frontier weight, times the shape weight ``shaped``
        where given; with neither, the pool cycled through. ``by_member`` (an env mix's
        tasks): each env keeps its weight's share, the frontier weights normalised within
        each env (:func:`member_weights`)."""
        weights = shaped if shaped and any(w != 1.0 for w in shaped) else None
        if self.frontier and pool and k > 0:
            frontier = [frontier_weight(*self._outcomes.get(t.task_id, (0, 0)), self.floor)
                        for t in pool]
            weights = member_weights(self.cfg, pool, frontier) if by_member else \
                [f * (weights[i] if weights else 1.0) for i, f in enumerate(frontier)]
        if weights and pool and k > 0:
            return self.rng.choices(pool, weights, k=k)
        out: list[Task] = []
        while pool and len(out) < k:
            out += self.rng.sample(pool, min(len(pool), k - len(out)))
        return out
