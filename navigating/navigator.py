"""Self-navigating on the actor side: which rollouts of a group see experience, and what.

    for each task of a batch:
        hits = pool.retrieve(task.query, top_k)          # cosine of query vs when_to_use
        if hits: guidance = join (or LLM-rewrite) their advice
        guided slots = round(share * n) random positions of the group; the rest get nothing
    after the rollouts: record each injected experience's use and whether it helped

Only part of each group is guided so that the same group holds rollouts with and without
experience: their success rates (``success_with_exp`` / ``success_without_exp``) compare the
two on the same task, with the same policy version, and the learner still sees rollouts whose
context it can train on unchanged.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import numpy as np

from episodes.rollout import Episode, Guidance
from navigating.pool import env_tag
from protocol.config import ExperienceConfig
from protocol.messages import Task

log = logging.getLogger(__name__)

SEPARATOR = "|"  # between advice items; one word in the tiny model's vocabulary

REWRITE_PROMPT = """You help an agent that acts in a tool-using environment.
Task: {query}
Advice from earlier attempts:
{items}
Rewrite the advice that applies to this task as one short guidance text (at most {max_chars}
characters). Reply with the guidance only."""


def guided_slots(n: int, share: float, rng: random.Random) -> set[int]:
    """``round(share * n)`` distinct positions out of ``n``, at random."""
    k = min(n, int(round(share * n)))
    return set(rng.sample(range(n), k))


class Navigator:
    def __init__(self, pool, cfg: ExperienceConfig, seed: int = 0, rewriter=None):
        self.pool = pool
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.rewriter = rewriter  # a inference.llm.ChatModel, when experiences are rewritten
        self.rewrite_errors = 0
        self._hits: list[int] = []
        self._similarities: list[float] = []

    def close(self) -> None:
        self.pool.close()

    def retrieve(self, task: Task) -> Guidance | None:
        # an env mix: the lessons of the task's own env only (unless experience.across_envs)
        own_env = "" if self.cfg.across_envs else env_tag(task)
        hits = self.pool.retrieve(task.query, self.cfg.top_k, self.cfg.min_similarity,
                                  self.cfg.kind_order, **({"env_tag": own_env} if own_env
                                                          else {}))
        self._hits.append(int(bool(hits)))
        if not hits:
            return None
        self._similarities += [sim for _, sim in hits]
        exps = [e for e, _ in hits]
        return Guidance(text=self._text(task, [e.content for e in exps]),
                        exp_ids=[e.exp_id for e in exps])

    def guide(self, tasks: Sequence[Task], n: int) -> list[list[Guidance | None]]:
        """Per task, ``n`` entries: the guidance for that rollout, or None."""
        plan = []
        for task in tasks:
            guidance = self.retrieve(task)
            slots = guided_slots(n, self.cfg.share, self.rng) if guidance else set()
            plan.append([guidance if i in slots else None for i in range(n)])
        return plan

    def record(self, episodes: Sequence[Episode]) -> None:
        """Count each injected experience's use and whether the rollout succeeded."""
        for ep in episodes:
            if ep.experience_ids:
                self.pool.record_use(ep.experience_ids, ep.reward >= 1.0)

    def metrics(self, episodes: Sequence[Episode], n: int) -> dict[str, float]:
        """Retrieval and with/without-experience success since the last call."""
        with_exp, without_exp = [], []
        for i in range(0, len(episodes), n):
            group = episodes[i:i + n]
            guided = [ep.reward >= 1.0 for ep in group if ep.guided]
            plain = [ep.reward >= 1.0 for ep in group if not ep.guided]
            if guided and plain:  # only groups holding both compare like with like
                with_exp += guided
                without_exp += plain
        out = {"retrieval_hit_rate": _mean(self._hits),
               "retrieval_similarity": _mean(self._similarities),
               "guided_fraction": _mean([ep.guided for ep in episodes]),
               "pool_size": float(self.pool.size()), "rewrite_errors": self.rewrite_errors}
        if with_exp:
            out.update(success_with_exp=_mean(with_exp), success_without_exp=_mean(without_exp),
                       compared_rollouts=len(with_exp) + len(without_exp))
        self._hits, self._similarities = [], []
        return out

    def _text(self, task: Task, contents: list[str]) -> str:
        joined = f" {SEPARATOR} ".join(contents)
        if self.rewriter is None:
            return joined[: self.cfg.max_chars]
        from inference.llm import LLMError

        items = "\n".join(f"- {c}" for c in contents)
        prompt = REWRITE_PROMPT.format(query=task.query, items=items, max_chars=self.cfg.max_chars)
        try:
            text = self.rewriter.complete([{"role": "user", "content": prompt}],
                                          temperature=0.2, max_tokens=200).strip()
        except LLMError as exc:
            self.rewrite_errors += 1
            log.warning("experience rewrite failed (%s); injecting the advice as retrieved", exc)
            return joined[: self.cfg.max_chars]
        return (text or joined)[: self.cfg.max_chars]


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def make_navigator(cfg, seed: int, embedder=None) -> Navigator | None:
    """The actor's navigator for a run config (``RunConfig``), or None when it is off."""
    if not cfg.experience.enabled:
        return None
    from navigating.pool import open_pool

    xc = cfg.experience
    pool = open_pool(cfg, embedder=embedder)
    rewriter = None
    if xc.rewrite:
        if not cfg.llm.url:
            raise ValueError("experience.rewrite needs llm.url (an OpenAI-compatible endpoint)")
        from inference.llm import OpenAIChat

        rewriter = OpenAIChat.from_config(cfg.llm)
    return Navigator(pool, xc, seed, rewriter)

