"""How an episode's context grows (``env.context``), over episodes longer than a context.

``linear`` appends every turn (an action and the observation after it) to one token
sequence, until ``env.max_context``. The others keep what the model sees bounded:

* ``truncate``: each observation is cut to ``env.context_obs_tokens`` tokens, with a marker
  saying how many were cut. The context still only grows, so it stays one sequence.
* ``window``: once more than ``env.context_turns`` turns have passed, the context is rebuilt
  before each action: the opening prompt (instructions, experience, task, first observation)
  with a line saying how many turns were left out, then the last ``context_turns`` turns.
* ``summary``: as ``window``, with the left-out turns as one rule-made line each (the call
  and the first words of what it returned) instead of their count.

A rebuilt context is no prefix extension of the last one, so the rollout starts a new context
in the trajectory's tokens (``Trajectory.contexts``) and the learner trains every action
against exactly the context it was sampled in (``learner.batching``: one row per context).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.config import CONTEXT_MODES, EnvConfig

SUMMARY_OBS_WORDS = 12  # words of an observation a summary line keeps


@dataclass(frozen=True)
class Turn:
    """One finished turn as the model saw it: its action and the observation after it."""

    action_ids: list[int]  # the generated tokens, end-of-action included
    observation_ids: list[int]  # the observation and the cue for the next action
    action: str
    observation: str


@dataclass(frozen=True)
class ContextManager:
    """What an episode's next context is, given its turns so far."""

    mode: str = "linear"
    keep: int = 4  # window / summary: turns kept verbatim
    observation_tokens: int | None = None  # truncate: the most tokens of one observation

    def __post_init__(self):
        if self.mode not in CONTEXT_MODES:
            raise ValueError(f"context must be one of {CONTEXT_MODES}, not {self.mode!r}")

    def note(self, turns: list[Turn]) -> str | None:
        """None while the context grows by appending; else the context is rebuilt from the
        opening prompt with this note after its first observation and the last ``keep``
        turns."""
        left_out = len(turns) - self.keep
        if self.mode not in ("window", "summary") or left_out <= 0:
            return None
        if self.mode == "window":
            return f"[{left_out} earlier turn{'s' if left_out > 1 else ''} left out]"
        lines = [f"{i + 1}. {t.action} -> {_clipped(t.observation)}"
                 for i, t in enumerate(turns[:left_out])]
        return "\n".join(["[earlier turns, summarised]", *lines])

    def kept(self, turns: list[Turn]) -> list[Turn]:
        """The turns a rebuilt context shows verbatim."""
        return turns[-self.keep:]


def _clipped(text: str) -> str:
    words = " ".join(text.split()).split(" ")
    return " ".join(words[:SUMMARY_OBS_WORDS]) + (" ..." if len(words) > SUMMARY_OBS_WORDS
                                                  else "")


def context_manager(env: EnvConfig) -> ContextManager:
    """The context manager a run's env section sets."""
    return ContextManager(env.context, env.context_turns,
                          env.context_obs_tokens if env.context == "truncate" else None)
