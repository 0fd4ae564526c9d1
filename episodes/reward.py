"""Outcome rewards: the environment's state check, or an LLM grader for goals in words.

``tasks.reward``: ``state`` always asks the environment; ``llm`` always asks the grader;
``auto`` asks the grader only for tasks whose goal is described in words alone (a synthesized
task the environment cannot check), and the environment otherwise.
"""

from __future__ import annotations

import logging

from environments.base import described_only
from episodes.rollout import Episode
from protocol.config import RunConfig

log = logging.getLogger(__name__)


class OutcomeReward:
    def __init__(self, mode: str = "auto", grader=None):
        self.mode, self.grader = mode, grader
        self.ungraded = 0  # episodes that wanted the grader when none was configured

    def __call__(self, ep: Episode) -> float:
        score = self.grade(ep)
        return float(ep.env.evaluate(ep.task)) if score is None else score

    def env_decides(self, task) -> bool:
        """Whether the environment's check scores ``task`` (else the grader does)."""
        return not (self.mode == "llm" or (self.mode == "auto" and described_only(task.goal)))

    def grade(self, ep: Episode) -> float | None:
        """The grader's score of ``ep``, or None where the environment's check decides (a
        rollout asks those envs itself, with the last step or all at once at the end)."""
        if self.env_decides(ep.task):
            return None
        if self.grader is None:
            self.ungraded += 1
            if self.ungraded == 1:
                log.warning("task %s needs the LLM grader but llm.url is not set; reward 0",
                            ep.task.task_id)
            return 0.0
        result = self.grader.grade(ep.task.query, ep.task.reference,
                                   [s.action for s in ep.steps],
                                   [s.observation for s in ep.steps])
        return result.score


def outcome_reward(cfg: RunConfig) -> OutcomeReward:
    grader = None
    if cfg.llm.url:
        from episodes.grader import LLMGrader
        from inference.llm import OpenAIChat

        grader = LLMGrader(OpenAIChat.from_config(cfg.llm), cfg.tasks.grader_max_repeats,
                           cfg.tasks.grader_repetition_cap)
    elif cfg.tasks.reward == "llm":
        raise ValueError("tasks.reward=llm needs llm.url (an OpenAI-compatible endpoint)")
    return OutcomeReward(cfg.tasks.reward, grader)
