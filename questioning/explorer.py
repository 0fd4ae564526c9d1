"""Self-questioning, first half: act in an unknown environment and record what happens.

The explorer visits seeds (initial states). From each it acts for ``breadth_steps`` at a high
temperature, preferring tool x entity pairs it has not tried yet, then for ``depth_steps`` at a
lower temperature, chaining actions on the names the last ``k`` observations showed. Actions
come from an LLM when one is configured (an OpenAI-compatible endpoint, or the policy itself);
a model that cannot yet write valid calls is replaced by :class:`SchemaSampler`, which samples
well-formed calls from the declared tool schemas with typed arguments (see
:class:`ArgumentDrafter`). Every exploration keeps its actions, observations and state
snapshots.
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from environments.base import ActionError, Environment, FreshEnvs, ToolSpec, parse_action
from protocol.messages import HELD_OUT_SPLITS, Task
from questioning.preconditions import PreconditionPlanner, failing_tools
from questioning.probes import Inverses, ProbePlanner

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.~+-]{1,64}")
_NUMBER = re.compile(r"(?<![\w.])[0-9]{1,6}(?![\w.])")
_DIGITS = re.compile(r"[0-9]+")
SMALL_INTS = (0, 1, 2, 3)
SMALL_FLOATS = ("0.5", "1.0", "2.5", "10.0")
FRESH_SHARE = 0.15  # str draws that invent an identifier where the schema does not say "id"
_SHELL_TYPES = ("str", "int", "float", "bool")  # what one shell word can carry
UNLOCK = "unlock:"  # a goal-directed exploration towards a tool: "unlock:<tool>"


@dataclass
class ExploreStep:
    action: str  # the action text as proposed
    observation: str  # what the environment answered
    valid: bool  # the action parsed into a declared tool with literal arguments
    tool: str | None  # the tool it named, when known
    error: str | None  # the env's refusal kind (a precondition that failed), None on success
    # "breadth", "depth", "probe:<kind>" (a goal-directed exploration) or "probe:unlock:<tool>"
    # (one towards a tool that keeps failing, questioning/preconditions.py)
    phase: str
    proposer: str  # "schema" or the LLM's name
    state: dict  # snapshot of env.state() after the action


@dataclass
class Exploration:
    exploration_id: str  # "<seed>/<index>", unique within a run
    env: str  # environment registry name
    seed: int  # the initial state's seed
    initial_observation: str
    initial_state: dict
    steps: list[ExploreStep] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> Exploration:
        steps = [ExploreStep(**s) for s in raw.get("steps", [])]
        return cls(**{**raw, "steps": steps})


@dataclass
class ExploreSettings:
    breadth_steps: int = 30
    depth_steps: int = 20
    breadth_temperature: float = 1.2
    depth_temperature: float = 0.8
    context_observations: int = 3  # ``k``: observations the depth phase builds on
    probe_steps: int = 16  # the most steps of a goal-directed exploration (questioning/probes.py)


def seed_tasks(env: Environment, limit: int = 0) -> list[Task]:
    """Initial states to explore, one per world in seed order: the seeds of the env's training
    tasks and the worlds it declares for training (``train_worlds``) but those a held-out task
    uses, or a plain reset state (seed 0) for an environment with neither. ``limit``: the
    first that many."""
    declared = set(env.train_worlds)
    if declared:
        held_out = {t.seed for split in HELD_OUT_SPLITS for t in env.tasks(split)}
        if declared & held_out:
            log.warning("%s: train_worlds holds %d seeds of held-out tasks (%s...); explore "
                        "leaves them out", env.name, len(declared & held_out),
                        ", ".join(map(str, sorted(declared & held_out)[:5])))
        declared -= held_out
    seeds = sorted({t.seed for t in env.tasks("train")} | declared) or [0]
    seeds = seeds[:limit] if limit else seeds
    return [Task(f"explore/{seed}", env.name, "", seed) for seed in seeds]


# --- proposers ----------------------------------------------------------------------------------


class ArgumentDrafter:
    """Typed values for one argument slot, learned from what the environment showed.

    * declared ``choices`` (an enumeration the env knows) are drawn from directly;
    * ints come from the declared ``bounds``, else from small numbers, every number seen in an
      observation or a refusal ("only 5 left") and its neighbours, up to twice the largest;
    * ``kind="id"`` arguments (and a share of other str ones) get *fresh* identifiers in the
      style of those this slot accepted or the env showed (``ord-0042`` -> ``ord-0917``): a
      task that creates something needs a name nobody has used yet. In an env with a closed
      vocabulary (``Environment.vocabulary()`` not empty) a fresh name is an unused word of
      it with the same pattern (``o2`` -> ``o7``), else the same shape (``budget.md`` ->
      ``plan.txt``), never a made-up one;
    * other str arguments are, half the time, a value an argument of the same name took in a
      call that worked and the world still shows (the order ``reserve`` created, for
      ``cancel``), else names seen in observations (chosen by the sampler's weights).
    """

    def __init__(self, rng: random.Random, vocabulary: Sequence[str] = ()):
        self.rng = rng
        self.vocabulary = sorted({w for w in vocabulary if _NAME.fullmatch(w)})
        self.numbers: Counter = Counter()  # numbers seen in any observation
        self.accepted: dict[tuple, Counter] = {}  # (tool, slot) -> values of calls that worked
        self.accepted_as: dict[str, Counter] = {}  # arg name -> values of calls that worked
        self.tried: dict[tuple, set] = {}  # (tool, arg name) -> values tried (for coverage)

    def observe_numbers(self, text: str) -> None:
        self.numbers.update(int(n) for n in _NUMBER.findall(text))

    def integer(self, arg) -> int:
        if arg.choices:
            return self.rng.choice(arg.choices)
        if arg.bounds:
            lo, hi = int(arg.bounds[0]), int(arg.bounds[1])
            return self.rng.choice((lo, hi)) if self.rng.random() < 0.2 else \
                self.rng.randint(lo, hi)
        seen = list(self.numbers)
        if seen and self.rng.random() < 0.6:
            n = self.rng.choice(seen)
            return max(0, n + self.rng.choice((-1, 0, 0, 1)))
        top = max([3, *seen])
        return self.rng.choice(SMALL_INTS) if self.rng.random() < 0.5 else \
            self.rng.randint(0, 2 * top)

    def decimal(self, arg) -> str:
        if arg.choices:
            return str(self.rng.choice(arg.choices))
        if arg.bounds:
            return f"{self.rng.uniform(*map(float, arg.bounds)):.2f}"
        return self.rng.choice(SMALL_FLOATS)

    def fresh_id(self, tool: str, slot: int, names: Sequence[str], taken,
                 declared_id: bool = False) -> str | None:
        """A value for ``tool``'s ``slot`` that is not in ``taken``, shaped like the ids it
        accepted before (else like a seen name with digits — for a ``kind="id"`` argument
        also a vocabulary word with letters and digits — else any seen name); None when a
        closed vocabulary has no unused word of that shape."""
        accepted = list(self.accepted.get((tool, slot), ()))
        with_digits = [n for n in names if _DIGITS.search(n) and not n.isdigit()]
        if declared_id:  # in a closed vocabulary, words mixing letters and digits are ids
            with_digits = with_digits or [w for w in self.vocabulary
                                          if _DIGITS.search(w) and not w.isdigit()]
        template = self.rng.choice(accepted or with_digits or list(names) or ["item"])
        if self.vocabulary:
            unused = [w for w in self.vocabulary if w not in taken]
            alike = [w for w in unused if _DIGITS.sub("#", w) == _DIGITS.sub("#", template)]
            alike = alike or [w for w in unused if _shape(w) == _shape(template)]
            return self.rng.choice(alike) if alike else None
        for _ in range(20):
            value = _restyle(template, self.rng)
            if value not in taken and _NAME.fullmatch(value):
                return value
        return f"new{self.rng.randint(100, 999)}"

    def record(self, tool: str, args: Sequence[tuple], ok: bool) -> None:
        """``args``: (slot, arg name, value) of one call."""
        for slot, name, value in args:
            self.tried.setdefault((tool, name), set()).add(value)
            if ok:
                self.accepted.setdefault((tool, slot), Counter())[value] += 1
                self.accepted_as.setdefault(name, Counter())[value] += 1

    def known_as(self, name: str, here) -> list[str]:
        """Values an argument called ``name`` took in calls that worked (any tool), that the
        current world still shows: the order id ``reserve`` created is what ``cancel`` needs."""
        return [v for v in self.accepted_as.get(name, ()) if v in here]


def _restyle(template: str, rng: random.Random) -> str:
    """``template`` with its last digit run replaced by a new number of the same width (or a
    number appended, joined as the template joins its words)."""
    runs = list(_DIGITS.finditer(template))
    if runs:
        last = runs[-1]
        width = len(last.group())
        number = str(rng.randint(0, 10 ** max(width, 2) - 1)).zfill(width)
        return template[:last.start()] + number + template[last.end():]
    joiner = "-" if "-" in template else "_" if "_" in template else ""
    return f"{template[:56]}{joiner}{rng.randint(2, 999)}"


class SchemaSampler:
    """Well-formed calls from the tool schemas, arguments drafted by :class:`ArgumentDrafter`.

    Names are remembered across seeds (a name seen in one world can be new in another, which is
    how ``mkdir``/``touch`` find names to create). Words that appeared only in refusals
    ("cannot", "qty") are not names. Breadth prefers tool x name pairs tried least; names that
    keep failing lose weight, names that worked gain it.
    """

    name = "schema"

    def __init__(self, tools: Sequence[ToolSpec], rng: random.Random, candidates: int = 16,
                 vocabulary: Sequence[str] = ()):
        # A required list or dict argument cannot be written as one word: such tools are left
        # to an LLM proposer.
        self.tools = [t for t in tools
                      if all(a.type in _SHELL_TYPES for a in t.args if a.required)]
        if not self.tools:
            raise ValueError("no tool can be called with shell-word arguments")
        self.rng = rng
        self.candidates = candidates
        self.names: Counter = Counter()  # name -> times seen
        self.worked: Counter = Counter()  # name -> successful calls that used it
        self.failed: Counter = Counter()  # name -> refused calls that used it
        self.coverage: Counter = Counter()  # (tool, first arg) -> calls that succeeded
        self.tool_ok: Counter = Counter()  # tool -> calls that succeeded
        self.here: Counter = Counter()  # names seen in the current exploration
        self.last_calls: deque[str] = deque(maxlen=4)
        # (tool, arg position, word shape) -> [ok, refused]: learns, say, that a slot takes
        # dotted names, without knowing what a file is.
        self.slot_fit: dict[tuple, list[int]] = {}
        self.effects: dict[str, list[int]] = {}  # tool -> [calls that changed state, calls]
        # ... over the calls that worked: what a tool does (a refused `sub` is not a read)
        self.effects_ok: dict[str, list[int]] = {}
        self.drafter = ArgumentDrafter(rng, vocabulary)
        self.by_name = {t.name: t for t in self.tools}
        # Share of stored tasks using each tool (set by the task factory from the coverage
        # report): tools few tasks use, gaps above all, are favoured.
        self.task_share: dict[str, float] = {}

    def start(self, first_observation: str) -> None:
        """A new exploration: forget which names belong to the current state."""
        self.here.clear()
        self.last_calls.clear()
        self.observe(first_observation)

    def observe(self, text: str, refused: bool = False) -> None:
        """An observation; a refusal's words are not names (its numbers still count)."""
        self.drafter.observe_numbers(text)
        if refused:
            return
        found = names_in(text)
        self.names.update(found)
        self.here.update(found)

    def record(self, action: str, ok: bool, changed: bool = False) -> None:
        words = action.split()
        if not words:
            return
        spec = self.by_name.get(words[0])
        if spec is not None:
            self.drafter.record(words[0], [(i, a.name, w) for i, (a, w)
                                           in enumerate(zip(spec.args, words[1:]))], ok)
        if ok:
            self.coverage[(words[0], words[1] if len(words) > 1 else "")] += 1
            self.tool_ok[words[0]] += 1
        for slot, word in enumerate(words[1:]):
            (self.worked if ok else self.failed)[word] += 1
            fit = self.slot_fit.setdefault((words[0], slot, _shape(word)), [0, 0])
            fit[0 if ok else 1] += 1
        effect = self.effects.setdefault(words[0], [0, 0])
        effect[0] += changed
        effect[1] += 1
        if ok:
            effect = self.effects_ok.setdefault(words[0], [0, 0])
            effect[0] += changed
            effect[1] += 1
        self.last_calls.append(action)

    def propose(self, phase: str, temperature: float, recent: Sequence[str],
                listed: Sequence[str] = ()) -> str:
        """One call: drafted candidates, and where the env lists its well-formed calls now
        (``listed``, from ``candidate_actions()``) as many again drawn from those, a tool at a
        time; the pick is scored as every candidate is (:meth:`_score`)."""
        local = [n for text in recent for n in names_in(text)]
        # Breadth mostly uses names of this world, sometimes names from other worlds (which is
        # where new names for creating things come from); depth uses the last observations.
        if phase == "depth" and local:
            pool = local
        elif self.rng.random() < 0.3 or not self.here:
            pool = list(self.names)
        else:
            pool = list(self.here)
        latest = set(names_in(recent[-1])) if recent else set()
        calls = [self._sample_call(pool, latest) for _ in range(self.candidates)]
        calls += self._from_listed(listed)
        scores = [self._score(c, phase) for c in calls]
        return calls[_softmax_choice(scores, temperature, self.rng)]

    def _from_listed(self, listed: Sequence[str]) -> list[str]:
        """``self.candidates`` calls the env listed, each of a tool drawn alike among those
        listed: the env's own values reach exploration (``mv x ..`` in ``files``, where
        ``..`` appears in no observation), and no tool's many combinations crowd out the
        rest."""
        by_tool: dict[str, list[str]] = {}
        for call in listed:
            words = call.split()
            if words and words[0] in self.by_name:
                by_tool.setdefault(words[0], []).append(call)
        if not by_tool:
            return []
        tools = sorted(by_tool)
        return [self.rng.choice(by_tool[self.rng.choice(tools)]) for _ in range(self.candidates)]

    def draft(self, tool: str, slot: int, arg):
        """A value for ``tool``'s argument ``slot`` from the names of the current world."""
        return self._value(tool, slot, arg, list(self.here), set())

    def _sample_call(self, pool: list[str], latest: set[str]) -> str:
        tool = self.rng.choice(self.tools)
        words = [tool.name]
        for slot, arg in enumerate(tool.args):
            if arg.type not in _SHELL_TYPES or not arg.required and self.rng.random() < 0.5:
                break
            value = self._value(tool.name, slot, arg, pool, latest)
            if value is None:
                break
            words.append(str(value))
        return " ".join(words)

    def _value(self, tool: str, slot: int, arg, pool: list[str], latest: set[str]):
        d = self.drafter
        if arg.type == "int":
            return d.integer(arg)
        if arg.type == "float":
            return d.decimal(arg)
        if arg.type == "bool":
            return self.rng.choice(("true", "false"))
        if arg.choices:
            # The declared domain, but what this world shows first: a world holds a few items
            # of the many an enumeration lists.
            shown = [c for c in arg.choices if str(c) in self.here]
            return self.rng.choice(shown if shown and self.rng.random() < 0.8 else arg.choices)
        if arg.kind == "id" or pool and self.rng.random() < FRESH_SHARE:
            # New in this world: a name used in another world is free here.
            fresh = d.fresh_id(tool, slot, pool or list(self.names), self.here,
                               declared_id=arg.kind == "id")
            if fresh is not None:
                return fresh
        known = d.known_as(arg.name, self.here)
        if known and self.rng.random() < 0.5:
            return self.rng.choice(known)
        if not pool:
            return None
        return self.rng.choices(pool, self._weights(tool, slot, pool, latest))[0]

    def _weights(self, tool: str, slot: int, pool: list[str], latest: set[str]) -> list[float]:
        """Names that worked, of a shape this slot accepted, just seen: drawn more often."""
        out = []
        for name in pool:
            ok, bad = self.slot_fit.get((tool, slot, _shape(name)), [0, 0])
            w = (1 + self.worked[name]) / (1 + self.failed[name]) * (1 + ok) / (1 + bad)
            out.append(w * (3.0 if name in latest else 1.0))
        return out

    def _score(self, call: str, phase: str) -> float:
        """Which candidate to pick: untried tool x entity pairs and tools first. (How likely
        the arguments are to work already shaped the candidates, in :meth:`_weights`.)"""
        words = call.split()
        novelty = 1.0 / (1 + self.coverage[(words[0], words[1] if len(words) > 1 else "")])
        novelty += 1.0 / (1 + self.tool_ok[words[0]]) ** 0.5
        repeat = 2.0 if call in self.last_calls else 0.0
        rare = 1.0 - self.task_share.get(words[0], 1.0) if self.task_share else 0.0
        if phase == "breadth":
            return 2.0 * novelty + rare - repeat
        # Depth chains on what it found: calls that change the state are worth more there.
        changed, calls = self.effects.get(words[0], [0, 0])
        return 0.5 * novelty + 2.0 * (changed + 1) / (calls + 2) + 2.0 * rare - repeat


class LLMProposer:
    """Actions from a chat model, prompted with the profile and the recent observations.

    After ``probe`` proposals it judges the model: below ``min_valid`` valid calls it is
    switched off for the rest of the run (a tiny or untrained model cannot write calls yet) and
    the explorer says so in its log; until then invalid proposals fall back per step.
    """

    def __init__(self, chat, tools: Sequence[ToolSpec], name: str, probe: int = 8,
                 min_valid: float = 0.5, toc: Callable[[], str] = lambda: ""):
        self.chat, self.tools, self.name = chat, list(tools), name
        self.probe, self.min_valid, self.toc = probe, min_valid, toc
        self.valid = self.invalid = 0
        self.enabled = True
        self.quiet = False  # a caller that probes it says the verdict itself

    def propose(self, phase: str, temperature: float, recent: Sequence[str]) -> str | None:
        from inference.llm import LLMError

        try:
            reply = self.chat.complete(self._messages(phase, recent), temperature=temperature,
                                       max_tokens=48)
        except LLMError as exc:
            log.warning("explorer LLM failed (%s); sampling from the schema for this step", exc)
            reply = ""
        action = first_action_line(reply)
        ok = action is not None and _parses(action, self.tools)
        self.valid, self.invalid = self.valid + ok, self.invalid + (not ok)
        tried = self.valid + self.invalid
        if tried == self.probe and self.valid < self.min_valid * tried:
            self.enabled = False
            if not self.quiet:
                log.warning("explorer: %s produced %d/%d valid calls; sampling valid calls "
                            "from the tool schemas instead", self.name, self.valid, tried)
        return action if ok else None

    def _messages(self, phase: str, recent: Sequence[str]) -> list[dict]:
        goal = ("try tools and entities you have not tried yet" if phase == "breadth"
                else "build on what you just found: act on the names it showed")
        tools = "\n".join(f"- {t.usage()}: {t.description}" for t in self.tools)
        seen = "\n".join(f"- {o}" for o in recent) or "- (nothing yet)"
        return [
            {"role": "system", "content": "You explore an unknown tool environment to learn "
             "what it contains and what its tools do. Reply with exactly one action on one "
             "line: a tool name followed by its arguments."},
            {"role": "user", "content": f"{self.toc()}\nTools:\n{tools}\n\nRecent observations:"
             f"\n{seen}\n\nPhase: {phase}: {goal}.\nAction:"},
        ]


def first_action_line(reply: str) -> str | None:
    """The first non-empty line of a reply, without code fences, quotes or a leading marker."""
    for line in (reply or "").splitlines():
        line = line.strip().strip("`").strip()
        line = re.sub(r"^(action\s*:|[-*>]|\d+[.)])\s*", "", line, flags=re.I).strip("`'\" ")
        if line:
            return line
    return None


def _parses(action: str, tools: Sequence[ToolSpec]) -> bool:
    try:
        parse_action(action, tools)
        return True
    except ActionError:
        return False


def names_in(text: str) -> list[str]:
    """Words of an observation that could be names (``docs/`` in a listing names ``docs``)."""
    words = (w.rstrip("/") for w in text.split())
    return [w for w in words if _NAME.fullmatch(w) and not w.isdigit()]


def _shape(word: str) -> tuple[bool, bool]:
    return "." in word, any(c.isdigit() for c in word)


def _softmax_choice(scores: list[float], temperature: float, rng: random.Random) -> int:
    top = max(scores)
    weights = [math.exp((s - top) / max(temperature, 1e-6)) for s in scores]
    return rng.choices(range(len(scores)), weights)[0]


# --- the explorer -------------------------------------------------------------------------------


class Explorer:
    """Explores seeds one episode at a time.

    ::

        for each seed, for each of its explorations:
            obs = env.reset(seed)
            breadth_steps x: action = propose("breadth", T_breadth, recent obs); step; record
            depth_steps x:   action = propose("depth", T_depth, last k obs); step; record
            yield the exploration (actions, observations, state snapshots)
    """

    def __init__(self, make_env: Callable[[], Environment], settings: ExploreSettings,
                 seed: int = 0, llm: LLMProposer | None = None):
        self.settings = settings
        self.envs = FreshEnvs(make_env, "explore")
        self.rng = random.Random(seed)
        self.sampler = SchemaSampler(self.env.tools(), self.rng,
                                     vocabulary=type(self.env).vocabulary())
        self.llm = llm
        self.inverses = Inverses()
        self.removers: set[str] = set()  # tools seen deleting what they act on (unlock probes)
        self.counts: Counter = Counter()

    @property
    def env(self) -> Environment:
        """The env explorations run in now (a fresh one after a served env failed one)."""
        return self.envs.env

    def explore(self, seed_task: Task, index: int, probe: str | None = None) -> Exploration | None:
        """One exploration of ``seed_task``'s world, a random walk or a goal-directed one
        (``probe``: one of ``PROBE_KINDS``, or ``unlock:<tool>`` towards a tool that keeps
        failing); None when a served env failed it (counted as
        ``env_failed/<reason>``; the next goes on with a fresh instance)."""
        exp = self.envs.run(f"exploration {seed_task.seed}/{index}",
                            lambda env: self._explore(env, seed_task, index, probe))
        if exp is None:
            self.counts[f"env_failed/{self.envs.last_failure.reason}"] += 1
        return exp

    def _explore(self, env: Environment, seed_task: Task, index: int,
                 probe: str | None = None) -> Exploration:
        t0, s = time.monotonic(), self.settings
        first = env.reset(seed_task)
        self.sampler.start(first)
        exp = Exploration(f"{seed_task.seed}/{index}", env.name, seed_task.seed, first,
                          env.state())
        recent: deque[str] = deque([first], maxlen=s.context_observations)
        if probe is None:
            planner = None
            phases = [("breadth", s.breadth_temperature)] * s.breadth_steps
            phases += [("depth", s.depth_temperature)] * s.depth_steps
        else:
            planner = self._planner(env, probe)
            phases = [(f"probe:{probe}", s.depth_temperature)] * s.probe_steps
            self.counts[f"probes/{probe.split(':')[0]}"] += 1
        before, undoable = exp.initial_state, None
        for phase, temperature in phases:
            if planner is None:
                action, proposer = self._propose(phase, temperature, list(recent),
                                                 lambda: env.candidate_actions() or [])
            else:
                action = planner.next_call(lambda t=temperature: self.sampler.propose(
                    "depth", t, list(recent)))
                proposer = "probe"
            obs, _, info = env.step(action)
            ok = info["valid"] and info["error"] is None
            after = env.state()
            self.sampler.observe(obs, refused=not ok)
            self.sampler.record(action, ok, after != before)
            undoable = self._learn_inverse(undoable, action, ok, before, after)
            self.counts["steps"] += 1
            self.counts["errors" if not ok else "ok"] += 1
            exp.steps.append(ExploreStep(env.canonical_action(action), obs, bool(info["valid"]),
                                         info.get("tool"), info.get("error"), phase, proposer,
                                         after))
            recent.append(obs)
            if planner is not None:
                planner.observe(action, ok, before, after, obs)
                if planner.done:
                    self.counts[f"probes_done/{probe.split(':')[0]}"] += 1
                    if not planner.next_target():
                        break
            before = after
        exp.seconds = time.monotonic() - t0
        self.counts["explorations"] += 1
        return exp

    def _planner(self, env: Environment, probe: str):
        """The planner of a goal-directed exploration: ``unlock:<tool>`` or a probe kind."""
        if probe.startswith(UNLOCK):
            target = self.sampler.by_name[probe.removeprefix(UNLOCK)]
            return PreconditionPlanner(target, self.sampler.tools, self.sampler.effects_ok,
                                       self.sampler.draft, self.rng,
                                       candidates=lambda: env.candidate_actions() or [],
                                       removers=self.removers)
        return ProbePlanner(probe, self.sampler.tools, self.sampler.effects_ok,
                            self.inverses, self.sampler.draft, self.rng)

    def failing_tools(self) -> list[str]:
        """Tools that kept being refused: what ``unlock`` probes go after."""
        return failing_tools(self.sampler.tools, self.sampler.effects, self.sampler.tool_ok)

    def _learn_inverse(self, undoable, action: str, ok: bool, before: dict, after: dict):
        """Two state-changing calls in a row, the second putting back the state the first
        found: the second's tool undoes the first's (``Inverses``). Returns what the next
        call may undo: (this tool, the state before it), or None."""
        if not ok or after == before:
            return None
        tool = action.split()[0]
        if undoable is not None and after == undoable[1]:
            self.inverses.observe(undoable[0], tool)
        return tool, before

    def _propose(self, phase: str, temperature: float, recent: list[str],
                 listed: Callable[[], Sequence[str]] = tuple) -> tuple[str, str]:
        """An LLM's call when one is on and writes a valid one, else the schema sampler's;
        ``listed`` (the env's calls now) is asked only for the sampler: a served env answers
        it over the wire."""
        if self.llm is not None and self.llm.enabled:
            action = self.llm.propose(phase, temperature, recent)
            if action is not None:
                self.counts["llm_actions"] += 1
                return action, self.llm.name
            self.counts["llm_invalid"] += 1
        self.counts["schema_actions"] += 1
        return self.sampler.propose(phase, temperature, recent, listed()), self.sampler.name
