"""Held-out evaluation: k episodes per task through the training rollout code; avg@k, best@k.

:func:`evaluate_model` is the one evaluation of a model folder on a config's environment:
``autodidact run`` (before and after warm-start, after RL) and ``autodidact eval`` both call
it and only present its result differently. :func:`evaluate` is the loop underneath, over any
backend. ``policy="model"`` samples actions from the backend; ``policy="ground-truth"``
replays each task's reference actions through the same episode code (a check of the
environment and the harness: it should score 100%).
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Callable

from environments.base import Environment, env_maker
from episodes.rollout import (
    Episode,
    RolloutSettings,
    env_call,
    make_codec,
    play_reference,
    rollout,
    rollout_settings,
    start_episodes,
)
from inference.backends.base import InferenceBackend, SamplingParams
from inference.codecs import Codec
from metrics.intervals import rate_interval
from protocol.config import RunConfig, task_member
from protocol.messages import Task

POLICIES = ("model", "ground-truth")


def select_tasks(cfg: RunConfig, split: str = "validation", limit: int = 0,
                 env: Environment | None = None, per_category: int = 0) -> list[Task]:
    """The ``split`` tasks of the config's env (or of ``env``, one already made); with
    ``per_category``, the first that many of each category in an order shuffled with the seed
    (so a larger ``per_category`` holds a smaller one's tasks); with ``limit``, that many of
    them. Draws use ``cfg.seed`` (the same draw every time, so runs and evaluations of one
    config share their tasks)."""
    tasks = (env or env_maker(cfg.env)()).tasks(split)
    rng = random.Random(cfg.seed)
    if per_category:
        by_category = defaultdict(list)
        for task in tasks:
            by_category[task_category(task)].append(task)
        tasks = []
        for _, group in sorted(by_category.items()):
            rng.shuffle(group)
            tasks += group[:per_category]
    if limit and cfg.env.mix:  # an env mix: that many of each member env's
        by_member: dict[str, list[Task]] = defaultdict(list)
        for task in tasks:
            by_member[task_member(task)].append(task)
        return [t for mid, _, _ in cfg.env.members()
                for t in rng.sample(by_member[mid], min(limit, len(by_member[mid])))]
    if limit:
        tasks = rng.sample(tasks, min(limit, len(tasks)))
    return tasks


def probe_tasks(cfg: RunConfig, env: Environment | None = None) -> list[Task]:
    """The validation probe's fixed sample (``eval.probe_tasks``, actor/probe.py): drawn from
    the validation split, never test, with the run's seed as :func:`select_tasks` draws the
    held-out evaluation's, so every probe of a run, and every actor that makes one, rolls
    out the same tasks."""
    return select_tasks(cfg, "validation", cfg.eval.probe_tasks, env)


def task_category(task: Task) -> str:
    """The category a task is reported under: the env's own, else the env's name."""
    return task.meta.get("category", task.env)


def evaluate_model(cfg: RunConfig, model_path: str, split: str = "validation", k: int = 1,
                   temperature: float = 0.0, *, limit: int = 0, tasks: list[Task] | None = None,
                   greedy: bool = False, policy: str = "model", batch_tasks: int = 64,
                   on_batch: Callable[[list[dict]], None] | None = None) -> dict:
    """avg@k and best@k of the model folder ``model_path`` on ``tasks`` (default:
    :func:`select_tasks` of ``split`` and ``limit``), with the config's env and rollout limits
    and the engine ``actor.backend`` names (:func:`inference.engines.make_backend`).

    The context guard is the smaller of ``env.max_context`` and the model's position limit, so
    no prompt outgrows the model. With ``greedy``, ``"greedy"`` is also the avg success at
    temperature 0 on the same tasks, with the same engine. ``policy="ground-truth"`` replays
    the references (no engine; the model folder's tokenizer lays the episodes out).
    ``on_batch`` gets each batch's task records as soon as the batch ends. Returns
    :func:`evaluate`'s result: ``tasks``, ``avg``, ``best``, ``categories``, ``per_task``.
    """
    from inference.engines import make_backend

    if tasks is None:
        tasks = select_tasks(cfg, split, limit)
    make_env = env_maker(cfg.env)
    settings = rollout_settings(cfg)
    # Replayed references are never read by a model: only a sampling model needs the guard.
    settings = dataclasses.replace(settings, max_context=(
        1 << 30 if policy == "ground-truth"
        else min(settings.max_context, model_positions(model_path))))
    if policy == "ground-truth":
        from transformers import AutoTokenizer

        return evaluate(None, tasks, make_env, settings, k=k, batch_tasks=batch_tasks,
                        seed=cfg.seed, policy=policy, on_batch=on_batch,
                        tokenizer=AutoTokenizer.from_pretrained(model_path))
    with make_backend(cfg, model_path) as backend:
        result = evaluate(backend, tasks, make_env, settings, temperature=temperature, k=k,
                          batch_tasks=batch_tasks, seed=cfg.seed, on_batch=on_batch)
        if greedy:
            result["greedy"] = evaluate(backend, tasks, make_env, settings, temperature=0.0,
                                        batch_tasks=batch_tasks, seed=cfg.seed)["avg"]
    return result


def model_positions(model_path: str) -> int:
    """The model's position limit (``max_position_embeddings``; unbounded when it has none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def evaluate(backend: InferenceBackend | None, tasks: list[Task],
             make_env: Callable[[], Environment], settings: RolloutSettings,
             temperature: float = 0.0, k: int = 1, batch_tasks: int = 64, seed: int = 0,
             policy: str = "model", tokenizer=None,
             on_batch: Callable[[list[dict]], None] | None = None) -> dict:
    """avg@k and best@k success over ``tasks``, overall and per category, plus one record per
    task (``per_task``). ``tokenizer`` lays out ground-truth episodes when no backend is given;
    ``on_batch`` receives each batch's records when it ends (a long evaluation keeps them).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    codec = make_codec(backend.tokenizer if backend is not None else tokenizer,
                       settings.tool_format)
    params = SamplingParams(temperature=temperature, max_new_tokens=settings.max_action_tokens,
                            stop_token_ids=(codec.eoa_id,), seed=seed)
    records = []
    for i in range(0, len(tasks), batch_tasks):
        chunk = tasks[i:i + batch_tasks]
        episodes = start_episodes(chunk, k, make_env, codec, settings=dataclasses.replace(
            settings, constrained=policy == "model" and settings.constrained))
        if policy == "model":
            # Seeded by its first task, so a resumed evaluation draws what an unbroken one would.
            rollout(backend, episodes, codec, params.fork(chunk[0].task_id), settings)
        else:
            for ep in episodes:
                replay_reference(ep, codec, settings)
        batch = [task_record(episodes[j:j + k]) for j in range(0, len(episodes), k)]
        records += batch
        if on_batch is not None:
            on_batch(batch)
    return summarize(records)


def replay_reference(ep: Episode, codec: Codec, settings: RolloutSettings) -> None:
    """Feed the task's reference actions to the episode as if a policy had written them."""
    play_reference(ep, codec, settings)
    score = env_call(ep, ep.env.evaluate, ep.task) if ep.failure is None else None
    ep.reward = 0.0 if score is None else float(score)


def task_record(episodes: list[Episode]) -> dict:
    task = episodes[0].task
    rewards = [float(ep.reward) for ep in episodes]
    member = task_member(task)
    return {"task_id": task.task_id, "category": task_category(task),
            **({"env": member} if member else {}),  # the member env of an env mix
            "rewards": rewards, "avg": sum(r >= 1.0 for r in rewards) / len(rewards),
            "best": float(any(r >= 1.0 for r in rewards)),
            "steps": [len(ep.steps) for ep in episodes],
            "truncated": sum(ep.truncated for ep in episodes),
            # actions the env accepted as a call of one of its tools (a model that cannot
            # write the action format scores low here long before it solves anything)
            "valid_steps": sum(s.valid for ep in episodes for s in ep.steps),
            "total_steps": sum(len(ep.steps) for ep in episodes),
            "actions": [ep.steps[0].action if ep.steps else "" for ep in episodes],
            # episodes a served env failed (EnvFailed): scored 0, though not the policy's doing
            "env_failed": sum(ep.failure is not None for ep in episodes)}


def summarize(records: list[dict]) -> dict:
    by_category = defaultdict(list)
    for r in records:
        by_category[r["category"]].append(r)
    return {**_means(records),
            "categories": {c: _means(rs) for c, rs in sorted(by_category.items())},
            "per_task": records}


def per_env(records: list[dict]) -> dict:
    """Under ``env.mix``: per member env (the records' ``env``), its avg@k and best@k with
    95% intervals and its number of tasks, and ``mean``, the unweighted mean of the envs'
    avg@k and best@k; {} for records of one env."""
    by_env: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("env"):
            by_env[r["env"]].append(r)
    if not by_env:
        return {}
    envs = {env: {**{k: v for k, v in _means(rs).items() if k in ("tasks", "avg", "best")},
                  **success_intervals(rs)} for env, rs in by_env.items()}
    return {"envs": envs,
            "mean_over_envs": {key: sum(e[key] for e in envs.values()) / len(envs)
                               for key in ("avg", "best")}}


def success_intervals(records: list[dict]) -> dict:
    """95% intervals from per-task records: ``avg_ci``, avg@k's over tasks and their k
    samples, and ``best_ci``, best@k's over tasks (:mod:`metrics.intervals`)."""
    return {"avg_ci": list(rate_interval([r["rewards"] for r in records])),
            "best_ci": list(rate_interval([[r["best"]] for r in records]))}


def _means(records: list[dict]) -> dict:
    n = max(len(records), 1)
    steps = sum(r.get("total_steps", 0) for r in records)
    return {"tasks": len(records), "avg": sum(r["avg"] for r in records) / n,
            "best": sum(r["best"] for r in records) / n,
            "valid_action_rate": sum(r.get("valid_steps", 0) for r in records) / max(steps, 1)}
