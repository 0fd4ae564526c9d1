"""Self-questioning, second half: turn explorations into verified training tasks.

Two proposers write candidate tasks from an exploration:

* :class:`HindsightSynthesizer` (no LLM needed): a state the exploration reached, or a few of
  the changes that led there, becomes the goal; the actions that caused them, with every action
  that had no effect pruned, become the reference; the query is the environment's own words for
  the changes. A read-only call's answer can be the goal too ("show the words of x").
* :class:`LLMSynthesizer`: a chat model reads the profile, the exploration and the tasks
  already made from that seed, and writes tasks as JSON; malformed replies are counted and
  dropped, never evaluated.

Every candidate is then verified in a fresh environment (:func:`environments.base.verify_task`:
the goal must fail at the start and hold after the reference), filtered by the user's
preferences and de-duplicated per seed (:class:`TaskDeduper`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from environments.base import ActionError, Environment, GoalPart, parse_action
from inference.llm import ReplyFormat
from protocol.messages import Task
from questioning.explorer import Exploration
from questioning.probes import PROBE_MAKES

log = logging.getLogger(__name__)

MAX_QUERY_CHARS = 300
MAX_REFERENCE = 20
MAX_PAIR_SEARCH = 12  # longest sequence whose action pairs pruning tries to drop
LLM_REJECTS = ("llm_error", "not_json", "no_tasks", "bad_task", "unparseable_action",
               "invalid_step", "no_checkable_goal", "llm_unsolved")


@dataclass
class Preferences:
    """What the user wants from synthesized tasks."""

    min_steps: int = 1
    max_steps: int = 5
    max_entities: int = 0  # 0 = any
    max_parts: int = 2  # changes combined into one hindsight task
    difficulty: str = ""  # words for an LLM proposer
    style: str = ""  # words for an LLM proposer

    def accepts(self, task: Task) -> bool:
        steps, entities = len(task.reference), int(task.meta.get("entities", 0))
        if not self.min_steps <= steps <= self.max_steps:
            return False
        return not self.max_entities or entities <= self.max_entities


def goal_key(goal: dict) -> str:
    """A canonical text of a goal: equal goals, equal keys (conditions in any order)."""
    if isinstance(goal, dict) and isinstance(goal.get("all"), list):
        conds = sorted(json.dumps(c, sort_keys=True) for c in goal["all"])
        return json.dumps({**goal, "all": conds}, sort_keys=True)
    return json.dumps(goal, sort_keys=True)


def make_task(env: Environment, seed: int, query: str, goal: dict, reference: list[str],
              meta: dict) -> Task:
    digest = hashlib.sha1(f"{goal_key(goal)}|{query}".encode()).hexdigest()[:12]
    steps, dependent = len(reference), int(meta.get("dependent_ops", 0))
    return Task(task_id=f"synth/{env.name}/{seed}/{digest}", env=env.name, query=query,
                seed=seed, goal=goal, reference=list(reference), source="synthetic",
                split="train", difficulty=steps + 0.5 * dependent,
                meta={"seed": seed, "steps": steps, **meta})


# --- replaying action sequences -------------------------------------------------------------


class Replayer:
    """Replays action sequences from a seed in a fresh environment each time."""

    def __init__(self, make_env: Callable[[], Environment]):
        self.env = make_env()
        self.replays = 0

    def _play(self, task: Task, actions: Sequence[str]) -> bool:
        """Reset to ``task`` and act; False at the first refused call."""
        self.replays += 1
        self.env.reset(task)
        for action in actions:
            _, _, info = self.env.step(action)
            if not info["valid"] or info["error"] is not None:
                return False
        return True

    def run(self, task: Task, actions: Sequence[str]) -> str:
        """``"reached"``, ``"missed"`` (ran cleanly, goal false) or ``"invalid"`` (a refusal)."""
        if not self._play(task, actions):
            return "invalid"
        return "reached" if self.env.evaluate(task) >= 1.0 else "missed"

    def end_state(self, task: Task, actions: Sequence[str]) -> tuple[str, dict, list[str]]:
        """(``"ran"`` for a clean run or ``"invalid"``, final state, answers)."""
        outcome = "ran" if self._play(task, actions) else "invalid"
        return outcome, self.env.state(), list(self.env.responses)

    def prune(self, task: Task, actions: Sequence[str]) -> tuple[list[str], int] | None:
        """A minimal sub-sequence of the actions that still reaches the goal: no single action
        and no pair of actions can be dropped (a pair that undoes itself, "reserve x; cancel
        x", survives every single removal). Also how many of the rest others depend on
        (removing one makes a later call fail). None if the actions do not reach the goal."""
        seq = list(actions)
        if self.run(task, seq) != "reached":
            return None
        while True:  # dropping a pair can free a single step that only the pair needed
            seq = self._drop_singles(task, seq)
            pair = self._droppable_pair(task, seq)
            if pair is None:
                break
            seq = pair
        dependent = sum(self.run(task, seq[:i] + seq[i + 1:]) == "invalid"
                        for i in range(len(seq)))
        return seq, dependent

    def _drop_singles(self, task: Task, seq: list[str]) -> list[str]:
        shorter = True
        while shorter:  # removing a step can free an earlier one that only it needed
            shorter, i = False, 0
            while i < len(seq):
                trial = seq[:i] + seq[i + 1:]
                if trial and self.run(task, trial) == "reached":
                    seq, shorter = trial, True
                else:
                    i += 1
        return seq

    def _droppable_pair(self, task: Task, seq: list[str]) -> list[str] | None:
        """``seq`` without the first pair of actions whose removal still reaches the goal."""
        if len(seq) > MAX_PAIR_SEARCH:  # quadratic in replays: references stay short anyway
            return None
        for i, j in itertools.combinations(range(len(seq)), 2):
            trial = [a for k, a in enumerate(seq) if k not in (i, j)]
            if trial and self.run(task, trial) == "reached":
                return trial
        return None


# --- hindsight --------------------------------------------------------------------------------


class HindsightSynthesizer:
    """Tasks from what an exploration did (see the module docstring)."""

    method = "hindsight"

    def __init__(self, make_env: Callable[[], Environment], prefs: Preferences,
                 max_candidates: int = 40, seed: int = 0):
        self.make_env, self.prefs = make_env, prefs
        self.env = make_env()
        self.replayer = Replayer(make_env)
        self.max_candidates = max_candidates
        self.rng = random.Random(seed)
        self.stats: Counter = Counter()

    def propose(self, exp: Exploration) -> list[Task]:
        tasks = []
        for cut, parts, kind in self._goals(exp):
            task = self._task(exp, cut, parts, kind)
            if task is not None:
                tasks.append(task)
        self.stats["proposed"] += len(tasks)
        return tasks

    def _goals(self, exp: Exploration) -> list[tuple[int, tuple[GoalPart, ...], str]]:
        """Distinct goals the exploration reached: (step index, the parts asked for, the
        goal's kind: ``state``, ``read`` or ``event``)."""
        found: dict[str, tuple[int, tuple[GoalPart, ...], str]] = {}
        states = [exp.initial_state] + [s.state for s in exp.steps]
        for t, step in enumerate(exp.steps):
            if not step.valid or step.error is not None:
                continue
            if step.state != states[t]:
                parts = self._worded(self.env.describe_changes(exp.initial_state, step.state))
                combos = [c for r in range(1, self.prefs.max_parts + 1)
                          for c in itertools.combinations(parts, r)]
                kind = "state"
            else:
                combos, kind = self._answer_goal(states[t], step), "read"
            for combo in combos:
                key = goal_key(self.env.goal_of([c for p in combo for c in p.conditions]))
                found.setdefault(key, (t, combo, kind))
        for t, combo in self._event_goals(exp):
            key = goal_key(self.env.goal_of([c for p in combo for c in p.conditions]))
            found.setdefault(key, (t, combo, "event"))
        goals = list(found.values())
        self.rng.shuffle(goals)
        # A probe's own kind first: an undo probe also reaches dozens of state goals, and cut
        # at random to max_candidates the one event pair it set out to make was mostly lost.
        aimed = aimed_kind(exp)
        goals.sort(key=lambda goal: goal[2] != aimed)
        return goals[:self.max_candidates]

    def _event_goals(self, exp: Exploration) -> list[tuple[int, tuple[GoalPart, ...]]]:
        """Goals over what the exploration *did*: pairs of described events where the second
        undoes the first (played alone from the seed, the two leave the state as they found
        it: a reservation made and later cancelled, whatever happened between). End-state
        hindsight cannot ask for these; other event pairs it already can."""
        if self.prefs.max_parts < 2:
            return []
        states = [exp.initial_state] + [s.state for s in exp.steps]
        events = []
        for t, step in enumerate(exp.steps):
            if step.valid and step.error is None:
                part = self.env.describe_event(step.action, step.observation, states[t],
                                               states[t + 1])
                if part is not None:
                    events.append((t, step.action, part))
        seed = Task("probe", exp.env, "", exp.seed)
        goals = []
        for (t1, a1, p1), (t2, a2, p2) in itertools.combinations(events, 2):
            if states[t2 + 1] == states[t1 + 1]:
                continue  # the second event changed nothing the first did: no undo
            ran, end, _ = self.replayer.end_state(seed, [a1, a2])
            if ran == "ran" and end == exp.initial_state:
                goals.append((t2, (p1, p2)))
        return goals

    def _worded(self, parts: list[GoalPart]) -> list[GoalPart]:
        """An env that names its changes names every change a task may ask for: a wordless
        part there would need a query outside its language. Other envs keep every part."""
        names_changes = type(self.env).describe_changes is not Environment.describe_changes
        return [p for p in parts if p.text is not None] if names_changes else parts

    def _answer_goal(self, now: dict, step) -> list[tuple[GoalPart, ...]]:
        """A read-only call's answer as a goal. The changes made before it that the answer
        depends on join it in :meth:`_task`, once pruning has shown which those are."""
        answer = self.env.describe_response(step.action, step.observation, now)
        return [] if answer is None else [(answer,)]

    def _read_parts(self, exp: Exploration, reference: list[str],
                    answer: tuple[GoalPart, ...]) -> tuple[GoalPart, ...] | None:
        """The answer with the changes its pruned ``reference`` makes: those the answer
        depends on (every other was pruned away, so "change A, then tell me B" where A never
        touches B is asked as "tell me B"). A query must say each of them, so None when one
        has no words or they are more than ``max_parts - 1``."""
        ran, end, _ = self.replayer.end_state(Task("probe", exp.env, "", exp.seed), reference)
        if ran != "ran":
            return None
        texts = [p.text for p in answer if p.text]
        changes = [p for p in self.env.describe_changes(exp.initial_state, end)
                   if not (p.text and any(p.text in t for t in texts))]
        if len(changes) > self.prefs.max_parts - 1 or any(p.text is None for p in changes):
            self.stats["read_needs_too_much"] += 1
            return None
        return (*changes, *answer)

    def _task(self, exp: Exploration, cut: int, parts: tuple[GoalPart, ...],
              kind: str = "state") -> Task | None:
        goal = self.env.goal_of([c for p in parts for c in p.conditions])
        states = [exp.initial_state] + [s.state for s in exp.steps]
        # Calls with no effect are dropped before pruning: only state changes and the answer
        # the goal may ask for (the call at the cut) can matter.
        actions = [s.action for t, s in enumerate(exp.steps[:cut + 1])
                   if s.valid and s.error is None and (s.state != states[t] or t == cut)]
        probe = Task("probe", exp.env, "", exp.seed, goal=goal)
        pruned = self.replayer.prune(probe, actions)
        if pruned is None:
            self.stats["not_reproducible"] += 1
            return None
        reference, dependent = pruned
        if kind == "read":
            parts = self._read_parts(exp, reference, parts)
            if parts is None:
                return None
            goal = self.env.goal_of([c for p in parts for c in p.conditions])
        texts = [p.text for p in parts]
        worded = all(t is not None for t in texts)
        query = (self.env.query_of(texts) if worded
                 else f"reach the goal {json.dumps(goal, sort_keys=True)}")
        entities = {e for p in parts for e in p.entities}
        return make_task(self.env, exp.seed, query, goal, reference, {
            "method": self.method, "exploration": exp.exploration_id,
            "confidence": 0.9 if worded else 0.5, "entities": len(entities),
            "dependent_ops": dependent, "parts": len(parts), "goal_kind": kind,
            "entity_calls": most_calls_on_one(reference, entities)})


def aimed_kind(exp: Exploration) -> str | None:
    """The kind of task a goal-directed exploration set out to make (its steps' phase is
    ``probe:<probe>``, questioning/probes.py); None for a random walk."""
    probes = {s.phase.removeprefix("probe:") for s in exp.steps if s.phase.startswith("probe:")}
    return PROBE_MAKES.get(probes.pop()) if len(probes) == 1 else None


def most_calls_on_one(reference: Sequence[str], entities) -> int:
    """The most reference calls that name one of ``entities`` as an argument word: 3 or more
    is a longer plan on one thing (create it, then change it twice)."""
    counts = Counter(e for action in reference for e in set(action.split()[1:]) & set(entities))
    return max(counts.values(), default=0)


# --- LLM proposer -------------------------------------------------------------------------------


class LLMSynthesizer:
    """Tasks written by a chat model from the profile and one exploration."""

    method = "llm"

    def __init__(self, chat, make_env: Callable[[], Environment], prefs: Preferences,
                 toc: Callable[[], str] = lambda: "", temperature: float = 0.7,
                 tasks_per_reply: int = 3):
        self.chat, self.prefs, self.toc = chat, prefs, toc
        self.env = make_env()
        self.replayer = Replayer(make_env)
        self.temperature, self.tasks_per_reply = temperature, tasks_per_reply
        self.stats: Counter = Counter()

    def propose(self, exp: Exploration, existing: Sequence[Task] = ()) -> list[Task]:
        from inference.llm import LLMError

        try:
            reply = self.chat.complete(self.messages(exp, existing),
                                       temperature=self.temperature, max_tokens=1024,
                                       reply_format=tasks_format(self.tasks_per_reply))
        except LLMError as exc:
            self._reject("llm_error", str(exc))
            return []
        items = self._items(reply)
        tasks = [t for t in (self._task(exp, item) for item in items) if t is not None]
        self.stats["proposed"] += len(tasks)
        return tasks

    def messages(self, exp: Exploration, existing: Sequence[Task]) -> list[dict]:
        p = self.prefs
        pairs = "\n".join(f"{i + 1}. {s.action} -> {s.observation}"
                          for i, s in enumerate(exp.steps[:60]))
        made = "\n".join(f"- {t.query}" for t in existing[-30:]) or "- (none yet)"
        wants = [f"between {p.min_steps} and {p.max_steps} steps"]
        wants += [f"at most {p.max_entities} entities"] if p.max_entities else []
        wants += [f"difficulty: {p.difficulty}"] if p.difficulty else []
        wants += [f"style: {p.style}"] if p.style else []
        return [
            {"role": "system", "content": "You write training tasks for an agent acting in a "
             "tool environment. A task is a natural-language query plus a reference solution: "
             "the list of actions (tool calls, exactly as the agent would type them) that "
             "solves it from the initial state. Optionally give the goal as the environment's "
             "goal condition. Reply with JSON only: {\"tasks\": [{\"query\": \"...\", "
             "\"reference\": [\"...\"]}]}."},
            {"role": "user", "content": f"{self.toc()}\n\nExploration from seed {exp.seed} "
             f"(initial observation: {exp.initial_observation}):\n{pairs}\n\nTasks already "
             f"made from this seed (do not repeat them):\n{made}\n\nPreferences: "
             f"{'; '.join(wants)}.\nWrite up to {self.tasks_per_reply} new tasks."},
        ]

    def _items(self, reply: str) -> list[dict]:
        from inference.llm import extract_json

        try:
            data = extract_json(reply)
        except ValueError as exc:
            self._reject("not_json", str(exc))
            return []
        items = data.get("tasks") if isinstance(data, dict) else data
        if not isinstance(items, list) or not items:
            self._reject("no_tasks", "reply has no task list")
            return []
        return items

    def _task(self, exp: Exploration, item) -> Task | None:
        if not _well_formed(item):
            return self._reject("bad_task", f"{str(item)[:80]}")
        reference = [a.strip() for a in item["reference"]]
        try:
            for action in reference:
                parse_action(action, self.env.tools())
        except ActionError as exc:
            return self._reject("unparseable_action", exc.observation)
        start = Task("probe", exp.env, "", exp.seed)
        outcome, state, answers = self.replayer.end_state(start, reference)
        if outcome == "invalid":
            return self._reject("invalid_step", " ; ".join(reference))
        goal = item.get("goal") or self._derived_goal(exp.initial_state, state, reference,
                                                      answers)
        if not goal:
            return self._reject("no_checkable_goal", item["query"])
        return make_task(self.env, exp.seed, item["query"].strip(), goal, reference, {
            "method": self.method, "exploration": exp.exploration_id, "confidence": 0.7,
            "entities": len(set(" ".join(reference).split()) - {a.split()[0] for a in
                                                                  reference}),
            "goal_from": "llm" if item.get("goal") else "replay"})

    def _derived_goal(self, before: dict, after: dict, reference: list[str],
                      answers: list[str]) -> dict | None:
        """The goal a reference achieves: its state change, else the last call's answer."""
        parts = self.env.describe_changes(before, after) if before != after else []
        if not parts and answers:
            part = self.env.describe_response(reference[-1], answers[-1], after)
            parts = [part] if part is not None else []
        return self.env.goal_of([c for p in parts for c in p.conditions]) if parts else None

    def _reject(self, reason: str, detail: str) -> None:
        self.stats[f"rejected_{reason}"] += 1
        log.info("proposer reply rejected (%s): %s", reason, detail[:120])
        return None


def tasks_format(max_tasks: int) -> ReplyFormat:
    """The JSON :func:`_well_formed` accepts, as a schema an endpoint can enforce."""
    task = {"type": "object", "required": ["query", "reference"],
            "properties": {"query": {"type": "string", "minLength": 1,
                                     "maxLength": MAX_QUERY_CHARS},
                           "reference": {"type": "array", "minItems": 1,
                                         "maxItems": MAX_REFERENCE,
                                         "items": {"type": "string", "minLength": 1}},
                           "goal": {"type": "object"}}}
    return ReplyFormat("tasks", json_schema={
        "type": "object", "required": ["tasks"],
        "properties": {"tasks": {"type": "array", "items": task, "minItems": 1,
                                 "maxItems": max_tasks}}})


def _well_formed(item) -> bool:
    if not isinstance(item, dict):
        return False
    query, reference, goal = item.get("query"), item.get("reference"), item.get("goal")
    if not isinstance(query, str) or not query.strip() or len(query) > MAX_QUERY_CHARS:
        return False
    if not isinstance(reference, list) or not 0 < len(reference) <= MAX_REFERENCE:
        return False
    if not all(isinstance(a, str) and a.strip() for a in reference):
        return False
    return goal is None or isinstance(goal, dict)


def llm_solves(chat, make_env: Callable[[], Environment], task: Task, toc: str = "",
               max_turns: int = 10) -> bool:
    """Ask the LLM to solve ``task`` with its reference as a hint; run its actions."""
    from inference.llm import LLMError, extract_json

    hint = "; ".join(task.reference)
    messages = [
        {"role": "system", "content": "You solve tasks in a tool environment. Reply with JSON "
         "only: {\"actions\": [\"...\"]}, the tool calls in order."},
        {"role": "user", "content": f"{toc}\n\nTask: {task.query}\nHint, a known solution: "
         f"{hint}"}]
    try:
        data = extract_json(chat.complete(messages, temperature=0.0, max_tokens=512))
    except (LLMError, ValueError):
        return False
    actions = data.get("actions") if isinstance(data, dict) else data
    if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
        return False
    env = make_env()
    env.reset(task)
    for action in actions[:max_turns]:
        if env.step(action)[1]:
            return True
    return env.evaluate(task) >= 1.0


# --- de-duplication -----------------------------------------------------------------------------


class TaskDeduper:
    """Per seed: one task per goal, and no two queries with word-set Jaccard >= ``threshold``.

    Queries are compared only within a seed: the same words in another world are another task.
    """

    def __init__(self, threshold: float = 0.8):
        self.threshold = threshold
        self.goals: set[tuple[int, str]] = set()
        self.queries: dict[int, list[frozenset]] = {}
        self.stats: Counter = Counter()

    def add(self, task: Task) -> bool:
        key = (task.seed, goal_key(task.goal))
        if key in self.goals:
            self.stats["duplicate_goal"] += 1
            return False
        words = frozenset(task.query.lower().split())
        seen = self.queries.setdefault(task.seed, [])
        if any(jaccard(words, other) >= self.threshold for other in seen):
            self.stats["duplicate_query"] += 1
            return False
        self.goals.add(key)
        seen.append(words)
        return True


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0
