"""Step judges (self-attributing): label every step of a trajectory GOOD (1) or BAD (0).

Two judges share one interface, :class:`StepJudge`:

* :class:`ReferenceJudge` needs no model. It replays the trajectory in a fresh environment and
  calls a step GOOD when it ran cleanly and either matched a not-yet-used step of the task's
  verified reference or moved the state toward the task's goal (``Environment.goal_progress``
  rose); any other step (useless, failing, or undoing progress) is BAD.
* :class:`LLMJudge` asks a chat model once per trajectory, given the task, the outcome and the
  steps. The protocol depends on the outcome: after a positive reward, GOOD means the step
  contributed to the success; otherwise GOOD only if the step genuinely brought the agent
  closer to a solution. The reply is an ``Analysis:`` then one ``Step <i>: GOOD|BAD`` line per
  step. It is parsed strictly, then leniently (the first GOOD/BAD tokens); a reply that still
  fails, or a failed request, is retried, and after ``max_attempts`` every step takes the
  outcome's label. Model output is only matched with regular expressions, never evaluated.

Neither judge raises for bad model output or a failed request; what happened is counted in
``stats`` and in each :class:`Judgement`'s ``how``.
"""

from __future__ import annotations

import logging
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from environments.base import Environment, described_only
from environments.call_formats import rewrite
from inference.llm import ChatModel, LLMError, ReplyFormat, clip_text
from protocol.messages import Step, Task, Trajectory

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You judge the steps of an agent's attempt at a task. You are shown the task, the outcome "
    "of the attempt (its reward) and the agent's steps, each an action and the observation it "
    "got back. Label every step GOOD or BAD.\n"
    "If the outcome is positive (reward > 0): a step is GOOD if it contributed to the success, "
    "BAD if it was irrelevant or harmful.\n"
    "If the outcome is not positive (reward <= 0): a step is GOOD only if it genuinely reduced "
    "the distance to a solution of the task, BAD otherwise.\n"
    "Reply in exactly this format: first a line 'Analysis: ...' with your reasoning (it may "
    "take several lines), then exactly one line per step, in order, 'Step <i>: GOOD' or "
    "'Step <i>: BAD' for i = 1 to the number of steps, and nothing after the last step line."
)

# A line that is only a step label. Markdown a model tends to add (bullets, headings, bold
# or italics around the number or the label, a final period) is tolerated; any other words
# on the line make it prose, not a label. One character class between the parts (not
# "\s*[*_]*\s*") keeps matching linear on long runs of blanks; the index is bounded so that
# int() never sees thousands of digits.
_STEP_LINE = re.compile(
    r"[\s>#*_-]*step\s*(\d{1,6})[\s*_]*:[\s*_]*(good|bad)[\s*_.]*", re.IGNORECASE
)
# Upper case only: "good" and "bad" are common words in an analysis.
_TOKEN = re.compile(r"\b(GOOD|BAD)\b")


@dataclass
class Judgement:
    """One trajectory's labels and how they were obtained."""

    labels: list[int]  # one per step: 1 GOOD, 0 BAD
    how: str  # "strict" | "tokens" | "outcome" | "reference"
    attempts: int = 1  # LLM calls made (0 for the reference judge)
    # one per step: why it got its label, in a line a person reads (the run viewer shows it)
    reasons: list[str] = field(default_factory=list, compare=False)


class StepJudge(ABC):
    """Labels every step of a trajectory; safe to call from several threads at once."""

    name: str = ""

    def __init__(self, counters: tuple[str, ...]):
        self.stats: dict[str, int] = dict.fromkeys(counters, 0)
        self._lock = threading.Lock()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, n in deltas.items():
                self.stats[key] = self.stats.get(key, 0) + n

    @abstractmethod
    def judge(self, task: Task, traj: Trajectory) -> Judgement:
        """Labels for ``traj``'s steps; never raises for bad model output or failed requests."""


# --- the reference judge -----------------------------------------------------------------------


class ReferenceJudge(StepJudge):
    """Replays the trajectory and labels steps by goal progress and the task's reference."""

    name = "reference"

    def __init__(self, env_factory: Callable[[], Environment]):
        super().__init__(("trajectories", "steps", "good"))
        self.env_factory = env_factory

    def judge(self, task: Task, traj: Trajectory) -> Judgement:
        judged = self._replay(task, traj.steps,
                              traj.info.get("call_format", "text")) if traj.steps else []
        labels = [label for label, _ in judged]
        self._count(trajectories=1, steps=len(labels), good=sum(labels))
        return Judgement(labels, "reference", attempts=0, reasons=[why for _, why in judged])

    def _replay(self, task: Task, steps: list[Step], call_format: str) -> list[tuple[int, str]]:
        env = self.env_factory()
        env.reset(task)
        # A goal in words only cannot be measured on the state: the reference alone decides.
        measured = not described_only(task.goal)
        unmatched = [_normalise(a) for a in task.reference]
        progress = env.goal_progress(task) if measured else 0.0
        labels = []
        for step in steps:
            if step.info.get("context"):  # the agent's own context tool: not the env's to replay
                labels.append((int(_clean(step.info)), "a context tool: GOOD when it ran "
                                                       "cleanly"))
                continue
            action = step.action
            # references are text-format calls: a call in another format is matched as one
            said = action if call_format == "text" else rewrite(action, env.tools(), "text",
                                                                 call_format)
            _, _, info = env.step(action, call_format)
            after = env.goal_progress(task) if measured else 0.0
            labels.append(_reference_label(info, self._match(said, unmatched) if _clean(info)
                                           else False, progress, after))
            progress = after
        return labels

    @staticmethod
    def _match(action: str, unmatched: list[str]) -> bool:
        """Whether ``action`` is a reference step not yet matched; consumes it, so repeating a
        reference step earns credit only once.

        A match stands even where progress fell: a verified reference may pass through a state
        further from the goal (``copy_across`` copies a file out of its folder, then moves the
        copy on), so only unmatched steps must raise progress, and one that lowers it is BAD.
        """
        text = _normalise(action)
        if text not in unmatched:
            return False
        unmatched.remove(text)
        return True


def _reference_label(info: dict, matched: bool, before: float, after: float) -> tuple[int, str]:
    """A replayed step's label and the reason for it."""
    if not info.get("valid"):
        return 0, "not a well-formed call of a declared tool"
    if info.get("error") is not None:
        return 0, f"the environment refused it: {str(info['error'])[:120]}"
    if matched:
        return 1, "matches a step of the task's verified reference"
    if after > before:
        return 1, f"moved the state toward the goal (progress {before:.2f} -> {after:.2f})"
    return 0, "ran, but matched no reference step and did not move toward the goal"


def _clean(info: dict) -> bool:
    """The step parsed and the environment carried it out without error."""
    return bool(info.get("valid")) and info.get("error") is None


def _normalise(action: str) -> str:
    return " ".join(str(action).split())


# --- the LLM judge -----------------------------------------------------------------------------


class LLMJudge(StepJudge):
    """Asks a chat model to label the steps, with retries and an outcome fallback."""

    def __init__(
        self,
        chat: ChatModel,
        max_chars: int = 200,
        max_attempts: int = 3,
        temperature: float = 0.0,
        max_tokens: int = 512,
    ):
        super().__init__((
            "trajectories", "requests", "strict", "tokens", "parse_failures", "llm_errors",
            "outcome_fallbacks", "good", "steps",
        ))
        self.chat = chat
        self.max_chars = max_chars
        self.max_attempts = max(1, max_attempts)
        self.temperature = temperature
        self.max_tokens = max_tokens
        model = getattr(chat, "model", None)
        self.name = getattr(chat, "name", None) or (f"llm:{model}" if model else "llm")

    def close(self) -> None:
        self.chat.close()

    def judge(self, task: Task, traj: Trajectory) -> Judgement:
        k = len(traj.steps)
        if k == 0:  # nothing to label: no reason to spend a request
            self._count(trajectories=1)
            return Judgement([], "strict", attempts=0)
        result = self._ask(build_judge_messages(task, traj, self.max_chars), k)
        if result is None:
            self._count(outcome_fallbacks=1)
            why = f"no usable reply in {self.max_attempts} attempts: the outcome's label"
            result = Judgement([int(traj.reward > 0)] * k, "outcome", self.max_attempts,
                               [why] * k)
        self._count(trajectories=1, steps=k, good=sum(result.labels))
        return result

    def _ask(self, messages: list[dict], k: int) -> Judgement | None:
        for attempt in range(1, self.max_attempts + 1):
            self._count(requests=1)
            try:
                reply = self.chat.complete(
                    messages, temperature=self.temperature, max_tokens=self.max_tokens,
                    reply_format=judgement_format(k),
                )
            except LLMError as e:  # the client has already retried transport errors
                self._count(llm_errors=1)
                log.warning("step judge request failed (attempt %d): %s", attempt, e)
                continue
            labels, how = parse_judgement(reply, k)
            if labels is not None:
                self._count(**{how: 1})
                return Judgement(labels, how, attempt, [analysis_of(reply)] * k)
            self._count(parse_failures=1)
            log.warning("step judge reply unparsable (attempt %d): %.200r", attempt, reply)
        return None


class FollowWeights:
    """Between pulls, the policy judge loads the learner's newest weights into its engine."""

    def __init__(self, weights, backend):
        self.weights, self.backend = weights, backend  # a protocol.weights.WeightSubscriber

    def __call__(self) -> int | None:
        """The version loaded now, None when there was none newer."""
        return self.weights.follow(self.backend)

    def close(self) -> None:
        self.weights.close()  # the engine is the judge's chat model's: it closes it


def build_judge_messages(task: Task, traj: Trajectory, max_chars: int = 200) -> list[dict]:
    """The system and user messages asking for one label per step of ``traj``."""
    if traj.reward > 0:
        outcome = "success" if traj.success else "partial success"
    else:
        outcome = "failure"
    steps = [
        f"Step {i}\n"
        + (f"  thought: {clip_text(s.thought, max_chars)}\n" if s.thought else "")
        + f"  action: {clip_text(s.action, max_chars)}\n"
        f"  observation: {clip_text(s.observation, max_chars)}"
        for i, s in enumerate(traj.steps, 1)
    ]
    user = (
        f"Task: {task.query}\n\nOutcome: {outcome} (reward {traj.reward:.2f})\n\n"
        f"Steps ({len(steps)}):\n" + "\n".join(steps) + "\n\n"
        f"Reply with the analysis, then exactly {len(steps)} lines 'Step <i>: GOOD' or "
        "'Step <i>: BAD'."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def judgement_format(num_steps: int) -> ReplyFormat:
    """Exactly the strict form :func:`parse_judgement` reads first, one line per step."""
    lines = "\n".join(f"Step {i}: (GOOD|BAD)" for i in range(1, num_steps + 1))
    return ReplyFormat("step_labels", regex=lines)


def parse_judgement(reply: str, num_steps: int) -> tuple[list[int] | None, str]:
    """``(labels, how)`` from a judge's reply: how is "strict", "tokens" or "failed".

    Strict: the lines that are nothing but a step label (``Step 3: BAD``, case-insensitive,
    with optional markdown such as ``- **Step 3:** BAD`` or ``**Step 3**: bad.``) are exactly
    Step 1 .. Step ``num_steps``, in order, no index missing, repeated or extra; all other
    lines (the analysis, code fences) are ignored. Otherwise, tokens: the first ``num_steps``
    upper-case words GOOD/BAD anywhere in the reply, if there are that many. Else failed.
    """
    if num_steps == 0:
        return [], "strict"
    if not isinstance(reply, str):
        return None, "failed"
    found = [m for m in map(_STEP_LINE.fullmatch, reply.splitlines()) if m]
    if [int(m.group(1)) for m in found] == list(range(1, num_steps + 1)):
        return [int(m.group(2).upper() == "GOOD") for m in found], "strict"
    tokens = _TOKEN.findall(reply)
    if len(tokens) >= num_steps:
        return [int(t == "GOOD") for t in tokens[:num_steps]], "tokens"
    return None, "failed"


ANALYSIS_CHARS = 400


def analysis_of(reply: str) -> str:
    """The judge's reasoning: the reply up to its first step line, without the 'Analysis:'
    prefix, cut to ANALYSIS_CHARS (the reason shown beside each of its labels)."""
    lines = []
    for line in reply.splitlines():
        if _STEP_LINE.fullmatch(line):
            break
        lines.append(line)
    text = " ".join(" ".join(lines).split())
    text = re.sub(r"^\W*analysis\W*:\s*", "", text, flags=re.IGNORECASE)
    return text[:ANALYSIS_CHARS]


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions where two label lists agree (1.0 for two empty lists)."""
    if len(a) != len(b):
        raise ValueError(f"label lists differ in length: {len(a)} != {len(b)}")
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 1.0
