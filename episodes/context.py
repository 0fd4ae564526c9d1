"""How an episode's context grows (``env.context``), over episodes longer than a context.

``linear`` appends every turn (an action and the observation after it) to one token
sequence, until ``env.max_context``. The others keep what the model sees bounded:

* ``truncate``: each observation is cut to ``env.context_obs_tokens`` tokens, with a marker
  saying how many were cut. The context still only grows, so it stays one sequence.
* ``window``: once more than ``env.context_turns`` turns have passed, the context is rebuilt
  before each action: the opening prompt (instructions, experience, task, first observation)
  with a line saying how many turns were left out, then the last ``context_turns`` turns.
  With ``env.context_stride`` S > 1 it is rebuilt every S turns instead and grows between
  rebuilds (``context_turns`` to ``context_turns + S - 1`` turns shown), so the engine's
  prefix cache holds between rebuilds: a rebuilt context is prefilled again past the opening
  prompt, which on long observations is most of a step's cost.
* ``summary``: as ``window``, with the left-out turns summarised instead of counted: one
  rule-made line each (the call and the first words of what it returned), or a few lines the
  ``llm`` endpoint writes (``env.context_summary=llm``; the rule's where a request fails).
* ``self``: the agent manages its own context (AgentEvolver's self-context-managing template).
  Each observation it sees is numbered (``[turn 3] ...``) and it has two more tools, called
  like any env tool in its call format and answered by the rollout, not the env:
  ``forget turn`` leaves that turn out, ``note first last "text"`` replaces turns first to
  last with its note. From the next action on, the context is the opening prompt with the
  notes and what was left out listed after its first observation, then the turns still
  shown.

A rebuilt context is no prefix extension of the last one, so the rollout starts a new context
in the trajectory's tokens (``Trajectory.contexts``) and the learner trains every action
against exactly the context it was sampled in (``learner.batching``: one row per context).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Protocol

from environments.call_formats import usage
from environments.call_grammar import call_grammar
from environments.tools import ArgSpec, ToolCall, ToolError, ToolSpec
from inference.llm import ChatModel, LLMError, OpenAIChat
from protocol.config import CONTEXT_MODES, EnvConfig, LLMConfig

log = logging.getLogger(__name__)

SUMMARY_OBS_WORDS = 12  # words of an observation a summary line keeps
SUMMARY_MAX_CHARS = 1200  # the most of an LLM-written summary a context shows
SUMMARY_PROMPT = (
    "You keep the memory of an agent that calls tools. Summarise the calls below and what "
    "they returned in at most five short lines: what was found, what changed, what failed. "
    "Write only the summary.")


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
    stride: int = 1  # window / summary: a rebuild every `stride` turns past the window
    observation_tokens: int | None = None  # truncate: the most tokens of one observation
    summarizer: Summarizer | None = None  # summary: who writes it (None: the rule)

    def __post_init__(self):
        if self.mode not in CONTEXT_MODES:
            raise ValueError(f"context must be one of {CONTEXT_MODES}, not {self.mode!r}")

    def rebuild(self, turns: list[Turn], memory: Memory | None = None
                ) -> tuple[str, list[Turn]] | None:
        """None while the context grows by appending; else the note to put after the opening
        prompt's first observation and the turns to show after it, verbatim."""
        if self.mode == "self":
            return memory.rebuild(turns) if memory is not None else None
        left_out = len(turns) - self.keep
        if self.mode not in ("window", "summary") or left_out <= 0 \
                or left_out % self.stride:
            return None
        if self.mode == "window":
            note = f"[{left_out} earlier turn{'s' if left_out > 1 else ''} left out]"
        else:
            note = "[earlier turns, summarised]\n" + (
                self.summarizer or RuleSummary()).summary(turns[:left_out])
        return note, turns[-self.keep:]


class Summarizer(Protocol):
    """Who writes the summary of the turns a ``summary`` context leaves out."""

    def summary(self, turns: list[Turn]) -> str:
        """The left-out ``turns`` (the earliest of the episode, in order), summarised."""


class RuleSummary:
    """One line a turn: its number, the call and the first words of what it returned."""

    def summary(self, turns: list[Turn]) -> str:
        return "\n".join(f"{i + 1}. {t.action} -> {_clipped(t.observation)}"
                         for i, t in enumerate(turns))


class LLMSummary:
    """The summary an LLM endpoint writes (``env.context_summary=llm``), asked once per set of
    left-out turns; where a request fails, the rule's lines (counted in ``failures``)."""

    def __init__(self, chat: ChatModel, max_tokens: int = 200):
        self.chat, self.max_tokens = chat, max_tokens
        self.requests = self.failures = 0
        self._written: dict[tuple, str] = {}

    def summary(self, turns: list[Turn]) -> str:
        key = tuple((t.action, t.observation) for t in turns)
        if key not in self._written:
            self._written[key] = self._ask(turns)
        return self._written[key]

    def _ask(self, turns: list[Turn]) -> str:
        self.requests += 1
        calls = RuleSummary().summary([Turn([], [], t.action, " ".join(t.observation.split()))
                                       for t in turns])
        try:
            text = self.chat.complete([{"role": "system", "content": SUMMARY_PROMPT},
                                       {"role": "user", "content": calls}],
                                      temperature=0.0, max_tokens=self.max_tokens).strip()
        except LLMError as exc:
            text = ""
            log.warning("context summary request failed (the rule's lines instead): %s", exc)
        if not text:
            self.failures += 1
            return RuleSummary().summary(turns)
        return text[:SUMMARY_MAX_CHARS]


# The agent's own context tools (env.context=self), answered by the rollout.
CONTEXT_TOOLS = (
    ToolSpec("forget", "leave a past turn (its call and what it returned) out of what you see",
             (ArgSpec("turn", "int", "the turn's number"),)),
    ToolSpec("note", "replace turns first to last with a note you write",
             (ArgSpec("first", "int", "the first turn's number"),
              ArgSpec("last", "int", "the last turn's number"),
              ArgSpec("text", "str", "the note", kind="text"))),
)


@functools.cache  # asked each turn of each episode; the same string for a format
def context_call_grammar(fmt: str) -> str:
    """The grammar of one context call in format ``fmt`` (a note's text free: quoted in
    ``text``, any string literal in the others), for a free-form env's constraint."""
    return call_grammar(CONTEXT_TOOLS, fmt, strings="word" if fmt == "text" else "any")


@dataclass
class Memory:
    """What an agent did to its own context (``env.context=self``): turns it left out, turns
    it replaced by notes, and whether the context shows its last change yet."""

    dropped: set[int] = field(default_factory=set)  # 0-based turn indices
    notes: list[tuple[int, int, str]] = field(default_factory=list)  # 0-based first, last
    changed: bool = False  # an edit the current context does not show yet

    def apply(self, call: ToolCall, turns: int) -> str:
        """Carry out a context tool's call over ``turns`` past turns: its observation, or
        ToolError for a turn that does not exist (numbers are 1-based, as shown)."""
        numbers = call.args[:1] if call.tool == "forget" else call.args[:2]
        if any(not 1 <= n <= turns for n in numbers) or numbers[0] > numbers[-1]:
            raise ToolError("no_turn", f"error : turns are numbered 1 to {turns}")
        first, last = numbers[0] - 1, numbers[-1] - 1
        if call.tool == "forget":
            self.dropped.add(first)
            said = f"ok turn {first + 1} left out"
        else:
            self.notes.append((first, last, call.args[2]))
            said = f"ok turns {first + 1} to {last + 1} replaced by your note"
        self.changed = True
        return said

    def rebuild(self, turns: list[Turn]) -> tuple[str, list[Turn]] | None:
        if not self.changed:
            return None
        self.changed = False
        hidden = set(self.dropped)
        lines = ["[your notes]"] if self.notes else []
        for first, last, text in sorted(self.notes):
            hidden |= set(range(first, last + 1))
            lines.append(f"turns {first + 1}-{last + 1}: {text}")
        if self.dropped:
            lines.append("[left out: turns " + ", ".join(
                str(i + 1) for i in sorted(self.dropped)) + "]")
        return "\n".join(lines), [t for i, t in enumerate(turns) if i not in hidden]


def context_tool_instructions(fmt: str) -> str:
    """What the system prompt says of the context tools, in call format ``fmt``."""
    lines = ["Your context is yours to manage. Each result you see is numbered [turn N]; two "
             "more tools change what you see from your next call on:"]
    lines += [f"- {usage(t, fmt)}: {t.description}" for t in CONTEXT_TOOLS]
    if fmt == "text":
        lines.append('Quote a note: note 1 3 "moved the reports to archive"')
    return "\n".join(lines)


def _clipped(text: str) -> str:
    words = " ".join(text.split()).split(" ")
    return " ".join(words[:SUMMARY_OBS_WORDS]) + (" ..." if len(words) > SUMMARY_OBS_WORDS
                                                  else "")


def context_manager(env: EnvConfig, llm: LLMConfig | None = None) -> ContextManager:
    """The context manager a run's env section sets; ``llm``, the endpoint that writes
    summaries where ``env.context_summary=llm``."""
    writes = env.context == "summary" and env.context_summary == "llm"
    if writes and llm is None:
        raise ValueError("env.context_summary=llm needs the llm section's endpoint")
    return ContextManager(env.context, env.context_turns, env.context_stride,
                          env.context_obs_tokens if env.context == "truncate" else None,
                          LLMSummary(OpenAIChat.from_config(llm)) if writes else None)
