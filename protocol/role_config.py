"""What each role reads: its own config section plus the few shared values it needs.

``autodidact/resolve.py`` makes these once from the checked :class:`~protocol.config.RunConfig`
(``learner_settings(cfg)``, ...). A role's constructor takes its settings and its collaborators
(clients, engine, judge, pool), never the whole run config, so no role reads another role's
section: a value one role sets and another obeys (the staleness bound the actors' admission
enforces, the judge deadline the learner waits for) is named here, once, as a field.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.config import (
    ActorConfig,
    EnvConfig,
    ExperienceConfig,
    JudgeConfig,
    LearnerConfig,
    LLMConfig,
)


@dataclass(frozen=True)
class ActorSettings:
    actor: ActorConfig
    """The actor's own section."""

    env: EnvConfig
    """The environment it rolls out in, and the episode limits (turns, context)."""

    seed: int
    """The run's seed; each actor derives its own sampling stream from it and its id."""

    max_staleness: int
    """``learner.max_staleness``: admission keeps groups in flight within this many versions."""

    batch_groups: int
    """``learner.batch_groups``: the groups of one update, the unit admission counts in."""

    llm: LLMConfig | None = None
    """The endpoint that writes context summaries (``env.context_summary=llm``), else None."""


@dataclass(frozen=True)
class LearnerSettings:
    learner: LearnerConfig
    """The learner's own section."""

    model_path: str
    """The base (or warm-started) model it trains."""

    seed: int
    """The run's seed: initial weights of a LoRA adapter, dropout, shuffling."""

    max_updates: int
    """Updates to stop after: ``--max-updates``, else ``learner.max_updates``."""

    judged: bool
    """Step labels will come: composite advantages and at least one judge worker."""

    judge_deadline_s: float
    """``judge.deadline_s``: how long a group waits for its labels before it trains
    outcome-only."""

    experience_context: str
    """``experience.train_context``: ``discard`` strips injected experience before the loss."""

    guided_clip_high: float
    """``experience.clip_high``: the upper clip of experience-guided rows."""

    actors_low_precision: bool
    """The actors sample below float32 (``learner.autocast=auto`` follows them on CUDA)."""


@dataclass(frozen=True)
class JudgeSettings:
    judge: JudgeConfig
    """The judge's own section."""

    local_model: bool
    """The judge is the policy itself, one local model: its calls are made one at a time."""

    @property
    def concurrency(self) -> int:
        """Concurrent judge calls: one for a local model (concurrent calls only contend)."""
        return 1 if self.local_model else self.judge.concurrency


@dataclass(frozen=True)
class ExperienceSettings:
    experience: ExperienceConfig
    """The experience pool's section (``update_every``, extraction)."""

    env: EnvConfig
    """The environment whose tasks rule extraction replays: a plugin's module is imported
    (its env registered), a served env (``env.address``) replayed on its server."""
