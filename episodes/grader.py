"""LLM grading of trajectories for tasks whose goal is described only in words."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from inference.llm import ChatModel, LLMError, extract_json

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You grade an agent's attempt at a task. You are shown the task, a reference solution "
    "(one valid sequence of actions, not the only one) and the agent's actions with what it "
    "observed after each. Decide whether the agent's actions are relevant to the task at all, "
    "and how fully it achieved the task's goal, from 0 (nothing) to 1 (fully). Reply with only "
    'a JSON object: {"relevant": true|false, "score": <number 0..1>, "reason": "<one sentence>"}'
)


@dataclass
class GradeResult:
    """A grade: ``capped`` marks a score lowered by the repetition cap."""

    score: float
    relevant: bool
    capped: bool
    reason: str


class LLMGrader:
    """Scores a trajectory against a reference solution by asking a chat model.

    Never raises for a bad model reply or a failed request: those grade 0 and are counted in
    ``stats``, so one flaky call cannot stall the actor that asked for the grade.
    """

    def __init__(
        self,
        chat: ChatModel,
        max_repeats: int = 3,
        repetition_cap: float = 0.3,
        temperature: float = 0.0,
    ):
        self.chat = chat
        self.max_repeats = max_repeats
        self.repetition_cap = repetition_cap
        self.temperature = temperature
        self.stats: dict[str, int] = {"graded": 0, "malformed": 0, "llm_errors": 0, "capped": 0}

    def grade(
        self, query: str, reference: list[str], actions: list[str], observations: list[str]
    ) -> GradeResult:
        self.stats["graded"] += 1
        messages = build_messages(query, reference, actions, observations)
        try:
            reply = self.chat.complete(messages, temperature=self.temperature)
        except LLMError as e:
            self.stats["llm_errors"] += 1
            log.warning("grader request failed: %s", e)
            return GradeResult(0.0, False, False, f"llm error: {e}")
        try:
            relevant, score, reason = parse_grade(reply)
        except ValueError as e:
            self.stats["malformed"] += 1
            log.warning("grader reply malformed: %s", e)
            return GradeResult(0.0, False, False, f"malformed reply: {e}")
        if not relevant:
            score = 0.0
        return self._apply_cap(GradeResult(score, relevant, False, reason), actions)

    def _apply_cap(self, result: GradeResult, actions: list[str]) -> GradeResult:
        # A policy can farm a lenient grader by repeating one plausible action.
        if not actions or max(Counter(actions).values()) <= self.max_repeats:
            return result
        self.stats["capped"] += 1
        result.score = min(result.score, self.repetition_cap)
        result.capped = True
        return result


def build_messages(
    query: str, reference: list[str], actions: list[str], observations: list[str]
) -> list[dict]:
    """The system and user messages that ask for a grade."""
    ref = "\n".join(f"{i}. {a}" for i, a in enumerate(reference, 1)) or "(none)"
    steps = []
    for i, action in enumerate(actions, 1):
        obs = observations[i - 1] if i - 1 < len(observations) else "(no observation)"
        steps.append(f"{i}. action: {action}\n   observation: {obs}")
    user = (
        f"Task: {query}\n\nReference solution:\n{ref}\n\n"
        f"Agent trajectory:\n{chr(10).join(steps) or '(no actions)'}\n\n"
        "Reply with the JSON object only."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_grade(reply: str) -> tuple[bool, float, str]:
    """(relevant, score clamped to [0, 1], reason) from a reply; ValueError if malformed."""
    data = extract_json(reply)
    if not isinstance(data, dict):
        raise ValueError("reply JSON is not an object")
    missing = [k for k in ("relevant", "score", "reason") if k not in data]
    if missing:
        raise ValueError(f"missing keys {missing}")
    relevant, score, reason = data["relevant"], data["score"], data["reason"]
    if not isinstance(relevant, bool):
        raise ValueError("'relevant' is not a boolean")
    # bool is an int subclass; a true/false score is a confused reply, not a number.
    if isinstance(score, bool) or not isinstance(score, (int, float)) or score != score:
        raise ValueError("'score' is not a number")
    if not isinstance(reason, str):
        raise ValueError("'reason' is not a string")
    return relevant, min(1.0, max(0.0, float(score))), reason
