"""Held-out evaluation: one greedy (or sampled) episode per task, success rate out."""

from __future__ import annotations

from collections.abc import Callable

from actor.backends.base import InferenceBackend, SamplingParams
from actor.envs.base import Environment
from actor.rollout import PromptCodec, RolloutSettings, rollout, start_episodes, success_rate
from protocol.messages import Task


def evaluate(backend: InferenceBackend, tasks: list[Task], make_env: Callable[[], Environment],
             settings: RolloutSettings, temperature: float = 0.0, k: int = 1,
             batch_tasks: int = 64, seed: int = 0) -> dict:
    """avg@k and best@k success over ``tasks`` (k episodes per task)."""
    codec = PromptCodec(backend.tokenizer)
    params = SamplingParams(temperature=temperature, max_new_tokens=settings.max_action_tokens,
                            stop_token_ids=(codec.eoa_id,), seed=seed)
    per_task = []
    for i in range(0, len(tasks), batch_tasks):
        chunk = tasks[i:i + batch_tasks]
        episodes = start_episodes(chunk, k, make_env, codec)
        rollout(backend, episodes, codec, params, settings)
        per_task += [episodes[j:j + k] for j in range(0, len(episodes), k)]
    return {
        "tasks": len(per_task),
        "avg": sum(success_rate(eps) for eps in per_task) / max(len(per_task), 1),
        "best": sum(any(ep.reward >= 1.0 for ep in eps) for eps in per_task)
        / max(len(per_task), 1),
    }
