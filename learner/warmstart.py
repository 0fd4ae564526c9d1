"""The supervised warm-start: teach the policy verified reference solutions before RL.

A random tiny model never earns a reward, so outcome-only RL would have nothing to learn from.
Replaying each training task's verified reference through the same episode code the actors use
gives token sequences with exactly the actors' format and action masks; the warm-start
minimises the negative log-likelihood of the action tokens only.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from environments.base import FreshEnvs, env_maker
from episodes.rollout import Codec, RolloutSettings, make_codec, scripted_episode, to_groups
from learner.batching import build_batch
from learner.logprobs import prepare_for_training, token_logprobs
from protocol.config import RunConfig, task_member
from protocol.messages import Group, Task

log = logging.getLogger(__name__)


def reference_groups(cfg: RunConfig, codec: Codec, settings: RolloutSettings,
                     tasks: Sequence[Task] | None = None) -> list[Group]:
    """One single-trajectory group per task whose reference solves it: of ``tasks`` (all that
    have a reference; autodidact/task_mix.py decides them), or by default of
    :func:`pick_references` from the env's training tasks."""
    envs = FreshEnvs(env_maker(cfg.env), "warm-start")
    pool = envs.env.tasks("train") if tasks is None else tasks
    limit = cfg.warmstart.max_examples if tasks is None else len(tasks)
    picked = pick_references(pool, cfg.seed, limit) if tasks is not None or not cfg.env.mix \
        else pick_by_member(pool, cfg, limit)
    groups = []
    for task in picked:
        ep = envs.run(f"the reference of {task.task_id}",
                      lambda env, task=task: scripted_episode(task, env, codec, settings))
        if ep is not None and ep.reward >= 1.0:
            groups += to_groups([ep], 1, "warmstart", 0.0)
    _say_failures(envs)
    return groups


def pick_references(tasks: Sequence[Task], seed: int, n: int) -> list[Task]:
    """``n`` of ``tasks`` that have a reference, in an order fixed by ``seed``: the warm-start's
    pick of the env's training tasks, and the hand-written share of a mixture that adds
    self-made references to it (``tasks.warmstart_mixing=add``)."""
    with_reference = [t for t in tasks if t.reference]
    random.Random(seed).shuffle(with_reference)
    return with_reference[:n]


def pick_by_member(tasks: Sequence[Task], cfg: RunConfig, n: int) -> list[Task]:
    """:func:`pick_references` of an env mix (``env.mix``): each member's share of the ``n``
    in proportion to its weight (``Task.meta["env_member"]`` says whose a task is), the
    shares a member cannot fill left unfilled."""
    members = cfg.env.members()
    total = sum(weight for _, _, weight in members)
    picked: list[Task] = []
    for mid, _, weight in members:
        own = [t for t in tasks if task_member(t) == mid]
        picked += pick_references(own, cfg.seed, round(n * weight / total))
    return picked


def _say_failures(envs: FreshEnvs) -> None:
    if envs.failures:
        log.warning("%s: %d examples skipped, the served env failed them (%s)", envs.what,
                    sum(envs.failures.values()), dict(envs.failures))


def with_experience(cfg: RunConfig, groups: list[Group], codec: Codec,
                    settings: RolloutSettings) -> list[Group]:
    """Re-script a share (``experience.warmstart_share``) of the examples with experiences in
    their prompt, retrieved from the references' own "what worked" lessons, so the policy has
    learned to read the experience block before RL shows it one.

    The lessons live under a scratch prefix in the run's Redis, never in the run's pool: the
    actors' pool holds only what the agent found out by itself.
    """
    xc = cfg.experience
    if not (xc.enabled and xc.warmstart_share > 0 and groups and cfg.redis.url):
        return groups
    from navigating.extraction import from_success, with_env_tag
    from navigating.navigator import Navigator
    from navigating.pool import open_pool

    pool = open_pool(cfg, prefix=f"{cfg.redis.prefix}:warmstart")
    pool.add([e for g in groups  # an env mix: each lesson tagged with its env, kept to it
              for e in with_env_tag(g.task, from_success(g.task, g.trajectories[0], -1))])
    navigator = Navigator(pool, xc, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    envs = FreshEnvs(env_maker(cfg.env), "warm-start with experience")
    out = []
    for g in groups:
        guidance = navigator.retrieve(g.task) if rng.random() < xc.warmstart_share else None
        if guidance is None:
            out.append(g)
            continue
        ep = envs.run(f"the reference of {g.task.task_id}", lambda env, g=g, guidance=guidance:
                      scripted_episode(g.task, env, codec, settings, guidance))
        out += to_groups([ep], 1, "warmstart", 0.0) if ep is not None and ep.reward >= 1.0 \
            else [g]
    _say_failures(envs)
    log.info("warm-start: %d of %d examples carry experience (pool %d)",
             sum(bool(g.trajectories[0].experience_ids) for g in out), len(out), pool.size())
    return out


def warm_start(cfg: RunConfig, model_path: str, out_path: Path, settings: RolloutSettings,
               progress: Callable[[int, float], None] | None = None,
               tasks: Sequence[Task] | None = None) -> dict:
    """Fine-tune ``model_path`` on reference solutions of ``tasks`` (default: the env's
    training tasks) and save it to ``out_path``."""
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).to(cfg.learner.device)
    lc = cfg.learner
    prepare_for_training(model, lc.logit_chunk_tokens, lc.gradient_checkpointing)
    codec = make_codec(tokenizer, settings.tool_format)
    groups = with_experience(cfg, reference_groups(cfg, codec, settings, tasks), codec, settings)
    if not groups:
        raise RuntimeError(f"no verified reference solutions to warm-start on (env "
                           f"{cfg.env.name!r}); explore first or set warmstart.steps=0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart.lr)
    rng = random.Random(cfg.seed)
    t0, loss_value = time.monotonic(), float("nan")
    model.train()
    for step in range(cfg.warmstart.steps):
        batch, _ = build_batch(rng.sample(groups, min(len(groups), cfg.warmstart.batch_size)),
                               tokenizer.pad_token_id or 0, experience="keep")
        batch = batch.to(cfg.learner.device)
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, lc.logit_chunk_tokens,
                              batch.action_mask)
        loss = -(logp * batch.action_mask).sum() / batch.action_mask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()
        if progress is not None and (step % 20 == 0 or step == cfg.warmstart.steps - 1):
            progress(step + 1, loss_value)
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    guided = sum(bool(g.trajectories[0].experience_ids) for g in groups)
    return {"examples": len(groups), "with_experience": guided,
            "steps": cfg.warmstart.steps, "loss": loss_value,
            "seconds": time.monotonic() - t0,
            "task_ids": [g.task.task_id for g in groups],
            **({"per_env": dict(collections.Counter(task_member(g.task)
                                                    for g in groups))}
               if cfg.env.mix else {})}
