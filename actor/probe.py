"""The validation probe: validation success along a run, measured by one actor off the
learner's path (``eval.probe_every``, ``eval.probe_tasks``).

    at the first version the actor runs, then at the first it holds in each later block
    of probe_every versions (0, n, 2n, ... when it loads every version):
        one rollout of each probe task (a fixed validation sample), the actor's sampling
        settings, no experience, no weight loads in between, scored by the env's check
        log eval/probe_success, eval/probe_tasks, eval/version (role "eval", step = version)
        and, over an env mix, eval/env/<id>/probe_success for each member env's tasks

Only actor-0 is handed a probe (``autodidact/wiring.py``), so N actors do not pay N times.
Its rollouts go nowhere but the metrics: never to replay (so never trained on, judged or
mined for experience), never to the outbox, the curriculum's per-task counts or the
navigator. They are held-out tasks: training on them, or on lessons drawn from them, would
score the run on what it trained on.

The sampling settings are the actor's own, not greedy: training-task success is measured at
them, and the probe is read beside it (:mod:`autodidact.diagnosis`). A greedy probe would stay
flat while sampled success rises from a policy only growing surer of answers it already gave
greedily, which would read as overfitting where there is none.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from environments.base import Environment
from episodes.rollout import RolloutSettings, rollout, start_episodes
from inference.backends.base import InferenceBackend, SamplingParams
from inference.codecs import Codec
from metrics.jsonl import MetricsWriter
from protocol.config import task_member
from protocol.messages import Task

PROBE_ACTOR = "actor-0"  # the one actor that probes: autodidact run's first (autodidact/roles.py)


def env_success(outcomes: Iterable[tuple[Task, float]], key: str) -> dict[str, float]:
    """Over an env mix, the success rate (reward >= 1) of each member env's rollouts, as
    ``{key.format(env): rate}`` (``key`` e.g. ``"actor/env/{}/success"``), from ``(task,
    reward)`` pairs; {} where no task is a mix member's (``Task.meta["env_member"]``)."""
    by_env: dict[str, list[bool]] = defaultdict(list)
    for task, reward in outcomes:
        member = task_member(task)
        if member:
            by_env[member].append(reward >= 1.0)
    return {key.format(env): sum(oks) / len(oks) for env, oks in by_env.items()}


class ValidationProbe:
    """``tasks`` (the fixed sample) rolled out every ``every`` policy versions; records go to
    ``run_dir``'s metrics as role ``eval``, member ``member`` (the actor's id)."""

    def __init__(self, tasks: list[Task], every: int, run_dir: Path, member: str, seed: int):
        if every < 1 or not tasks:
            raise ValueError(f"a probe needs every >= 1 and tasks, got {every}, {len(tasks)}")
        self.tasks = list(tasks)
        self.every = every
        self.seed = seed
        self.metrics = MetricsWriter(run_dir, "eval", member)
        self.last: int | None = None  # the version probed last

    def due(self, version: int) -> bool:
        """Whether ``version`` opens a block of ``every`` versions not probed yet (the first
        version seen always does)."""
        return self.last is None or version // self.every > self.last // self.every

    def run(self, backend: InferenceBackend, codec: Codec, make_env: Callable[[], Environment],
            settings: RolloutSettings, params: SamplingParams, batch: int) -> dict:
        """Roll out every probe task once with ``backend``'s current weights, ``batch``
        episodes per generate call (the actor's own batch); log and return the record."""
        version, t0 = backend.version, time.monotonic()
        # seeded by the version: an actor restarted at a version draws what it drew there
        params = dataclasses.replace(params, seed=self.seed).fork(f"probe/{version}")
        rewards, failed, tasks = [], 0, []
        for i in range(0, len(self.tasks), batch):
            episodes = start_episodes(self.tasks[i:i + batch], 1, make_env, codec, None,
                                      settings)
            rollout(backend, episodes, codec, params.fork(i), settings)  # the env's check
            rewards += [ep.reward if ep.failure is None else 0.0 for ep in episodes]
            tasks += [ep.task for ep in episodes]
            failed += sum(ep.failure is not None for ep in episodes)
        self.last = version
        return self.metrics.log({
            "probe_success": sum(r >= 1.0 for r in rewards) / len(rewards),
            "probe_tasks": len(rewards), "version": version, "probe_env_failed": failed,
            "probe_s": time.monotonic() - t0,
            **env_success(zip(tasks, rewards), "eval/env/{}/probe_success")}, step=version)

    def close(self) -> None:
        self.metrics.close()
