"""Held-out evaluation: k episodes per task through the training rollout code; avg@k, best@k.

``policy="model"`` samples actions from the backend; ``policy="ground-truth"`` replays each
task's reference actions through the same episode code (a check of the environment and the
harness: it should score 100%).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from environments.base import Environment
from episodes.rollout import (
    Episode,
    RolloutSettings,
    apply_action,
    make_codec,
    rollout,
    start_episodes,
)
from inference.backends.base import InferenceBackend, SamplingParams
from inference.codecs import Codec
from protocol.messages import Task

POLICIES = ("model", "ground-truth")


def evaluate(backend: InferenceBackend | None, tasks: list[Task],
             make_env: Callable[[], Environment], settings: RolloutSettings,
             temperature: float = 0.0, k: int = 1, batch_tasks: int = 64, seed: int = 0,
             policy: str = "model", tokenizer=None,
             progress: Callable[[int, int], None] | None = None) -> dict:
    """avg@k and best@k success over ``tasks``, overall and per category, plus one record per
    task (``per_task``). ``tokenizer`` lays out ground-truth episodes when no backend is given.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    codec = make_codec(backend.tokenizer if backend is not None else tokenizer)
    params = SamplingParams(temperature=temperature, max_new_tokens=settings.max_action_tokens,
                            stop_token_ids=(codec.eoa_id,), seed=seed)
    records = []
    for i in range(0, len(tasks), batch_tasks):
        chunk = tasks[i:i + batch_tasks]
        episodes = start_episodes(chunk, k, make_env, codec)
        if policy == "model":
            rollout(backend, episodes, codec, params, settings)
        else:
            for ep in episodes:
                replay_reference(ep, codec, settings)
        records += [task_record(episodes[j:j + k]) for j in range(0, len(episodes), k)]
        if progress is not None:
            progress(len(records), len(tasks))
    return summarize(records)


def replay_reference(ep: Episode, codec: Codec, settings: RolloutSettings) -> None:
    """Feed the task's reference actions to the episode as if a policy had written them."""
    for action in ep.task.reference:
        if ep.done:
            break
        apply_action(ep, codec, codec.action(action), None, 0, settings)
    ep.reward = float(ep.env.evaluate(ep.task))


def task_record(episodes: list[Episode]) -> dict:
    task = episodes[0].task
    rewards = [float(ep.reward) for ep in episodes]
    return {"task_id": task.task_id, "category": task.meta.get("category", task.env),
            "rewards": rewards, "avg": sum(r >= 1.0 for r in rewards) / len(rewards),
            "best": float(any(r >= 1.0 for r in rewards)),
            "steps": [len(ep.steps) for ep in episodes],
            "truncated": sum(ep.truncated for ep in episodes),
            "actions": [ep.steps[0].action if ep.steps else "" for ep in episodes]}


def summarize(records: list[dict]) -> dict:
    by_category = defaultdict(list)
    for r in records:
        by_category[r["category"]].append(r)
    return {**_means(records),
            "categories": {c: _means(rs) for c, rs in sorted(by_category.items())},
            "per_task": records}


def _means(records: list[dict]) -> dict:
    n = max(len(records), 1)
    return {"tasks": len(records), "avg": sum(r["avg"] for r in records) / n,
            "best": sum(r["best"] for r in records) / n}
