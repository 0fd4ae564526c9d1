"""Self-made tasks in the shape of the env's own: an example re-grounded in another world.

Hindsight (synthesis.py) writes tasks from whatever an exploration did, so its tasks take the
shape of random walks: two changes joined into one query, one condition a goal. An env's own
training tasks, where it has some, are a user's examples of the tasks that matter; their shape
is what the self-made pool lacked on ``files`` (docs/questioning.md). What they lack is worlds:
the examples use a few, and a policy fitted to those few does worse on worlds it never saw.

:class:`ExampleRegrounder` puts an example into another training world. The names the example
uses (the entities of its own world that its query or reference mention) are mapped to
entities of the target world of the same type whose relations agree (an entity's attribute
that names another mapped entity names its image; with ``strict`` tries, every other
attribute is equal too: a folder of two entries for a folder of two entries). The mapped
reference must run cleanly there, and make the same change the example made, said in the same
words once the names are mapped (or, for an example that only reads, answer the same way); its
goal is then the target world's own hindsight goal for that change. Anything else is refused,
counted by reason. Nothing here knows an env: it reads ``entities()`` (or, for an env without
them, every name in the state), ``describe_changes`` and ``describe_response``.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from environments.base import Environment, GoalPart
from protocol.messages import Task
from questioning.synthesis import make_task, most_calls_on_one

TRIES = 24  # mappings tried per example and world; half strict, half by relations only
REFUSALS = ("criterion", "no_mapping", "invalid", "no_change", "other_change")


class ExampleRegrounder:
    """Re-grounds the env's training tasks in the worlds explore visits (module docstring)."""

    method = "example"

    def __init__(self, make_env: Callable[[], Environment], examples: Sequence[Task],
                 per_world: int, seed: int = 0, tries: int = TRIES):
        self.env = make_env()
        self.player = make_env()  # replays references; self.env reads worlds and describes
        self.examples = [t for t in examples if t.reference]
        self.per_world, self.tries = per_world, tries
        self.rng = random.Random(seed)
        self.stats: Counter = Counter()
        self._worlds: dict[int, dict[str, dict]] = {}  # seed -> name -> entity
        self._made: dict[str, list[GoalPart]] = {}  # example id -> the change it makes

    def propose(self, world: Task) -> list[Task]:
        """Up to ``per_world`` examples from other worlds, re-grounded in ``world``'s seed."""
        others = [t for t in self.examples if t.seed != world.seed]
        tasks = []
        for example in self.rng.sample(others, min(self.per_world, len(others))):
            task = self.reground(example, world.seed)
            if task is not None:
                tasks.append(task)
        self.stats["proposed"] += len(tasks)
        return tasks

    def reground(self, example: Task, seed: int) -> Task | None:
        source, target = self._entities(example.seed), self._entities(seed)
        calls = " ".join(example.reference)
        names = [n for n in sorted(source, key=len, reverse=True) if _mentions(calls, n)]
        if any(_mentions(example.query, n) for n in source if n not in names):
            # The query names what the reference never touches: a criterion that chose the
            # calls ("every file containing w"), which another world's names cannot keep true.
            return self._refuse("criterion")
        own_parts = self._asked(example)
        if not own_parts:
            return self._refuse("no_change")
        outcome = "no_mapping"
        # An example naming nothing of its world ("create file x.md") is tried there as it is.
        for attempt in range(self.tries if names else 1):
            mapping = self._mapping(names, source, target, strict=attempt < self.tries // 2)
            if mapping is None:
                continue
            reference = [substitute(a, mapping) for a in example.reference]
            parts = self._change(Task("probe", example.env, "", seed), reference)
            if isinstance(parts, str):
                outcome = parts
                continue
            parts = _matching(own_parts, parts, mapping)
            if parts is None:
                outcome = "other_change"
                continue
            return self._task(example, seed, substitute(example.query, mapping), parts,
                              reference)
        return self._refuse(outcome)

    def _task(self, example: Task, seed: int, query: str, parts: list[GoalPart],
              reference: list[str]) -> Task:
        goal = self.env.goal_of([c for p in parts for c in p.conditions])
        entities = {e for p in parts for e in p.entities}
        return make_task(self.env, seed, query, goal, reference, {
            "method": self.method, "example": example.task_id, "confidence": 1.0,
            "entities": len(entities), "parts": len(parts),
            "goal_kind": "read" if _is_answer(parts) else "state",
            "entity_calls": most_calls_on_one(reference, entities)})

    def _refuse(self, reason: str) -> None:
        self.stats[f"refused_{reason}"] += 1
        return None

    def _entities(self, seed: int) -> dict[str, dict]:
        """The named entities of world ``seed`` (cached: worlds do not change between resets)."""
        if seed not in self._worlds:
            self.env.reset(Task("probe", self.env.name, "", seed))
            self._worlds[seed] = world_names(self.env, self.env.state())
        return self._worlds[seed]

    def _asked(self, example: Task) -> list[GoalPart]:
        """The parts of the example's own change that its goal asks for ("go to folder x" on
        the way is a change no goal of a move asks for); every part when the goal is not a
        list of conditions."""
        if example.task_id not in self._made:
            parts = self._change(example, example.reference)
            parts = [] if isinstance(parts, str) else parts
            asked = goal_conditions(example.goal)
            if asked is not None:
                parts = [p for p in parts if p.conditions and set(map(_key, p.conditions)) <= asked]
            self._made[example.task_id] = parts
        return self._made[example.task_id]

    def _change(self, start: Task, reference: Sequence[str]) -> list[GoalPart] | str:
        """What ``reference`` does from ``start``'s world, in one replay: the parts of its
        change, or, when it changes nothing, its last call's answer; a refusal reason when it
        cannot run."""
        env = self.player
        env.reset(start)
        before = before_last = env.state()
        observation = ""
        for action in reference:
            before_last = env.state()
            observation, _, info = env.step(action)
            if not info["valid"] or info["error"] is not None:
                return "invalid"
        after = env.state()
        if after != before:
            return self.env.describe_changes(before, after) or "no_change"
        answer = self.env.describe_response(reference[-1], observation, before_last)
        return [answer] if answer is not None else "no_change"

    def _mapping(self, names: Sequence[str], source: Mapping[str, dict],
                 target: Mapping[str, dict], strict: bool) -> dict[str, str] | None:
        """An injective, type-preserving map of ``names`` into ``target`` whose relations
        agree, drawn at random, parents before children; None when a name has no image."""
        mapping: dict[str, str] = {}
        for name in _parents_first(names, source):
            ent = source[name]
            fits = [n for n, cand in target.items()
                    if cand["type"] == ent["type"] and n not in mapping.values()
                    and _attributes_agree(ent, cand, mapping, source, strict)]
            if not fits:
                return None
            mapping[name] = self.rng.choice(sorted(fits))
        return mapping


def world_names(env: Environment, state: Mapping) -> dict[str, dict]:
    """Name -> entity (``type``, ``attributes``) of a state: the env's own entities, or for an
    env without them every string key and short string value in the state, typed ``name``."""
    entities = env.entities(dict(state))
    if entities:
        return {e["name"]: {"type": e["type"], "attributes": dict(e.get("attributes") or {})}
                for e in entities if isinstance(e.get("name"), str) and e["name"]}
    return {n: {"type": "name", "attributes": {}} for n in _strings(state)}


def _strings(value) -> Iterable[str]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                yield key
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str) and 0 < len(value) <= 40 and " " not in value:
        yield value


def _pattern(name: str) -> str:
    # A name is a whole word: "docs" is not in "docs.md", "mail" not in "email".
    return rf"(?<![\w.\-]){re.escape(name)}(?![\w\-]|\.\w)"


def _mentions(text: str, name: str) -> bool:
    return re.search(_pattern(name), text) is not None


def substitute(text: str, mapping: Mapping[str, str]) -> str:
    """Every mapped name in ``text`` replaced at once (a name mapped onto another mapped name
    is not replaced twice)."""
    if not mapping:
        return text
    names = sorted(mapping, key=len, reverse=True)
    pattern = "|".join(_pattern(n) for n in names)
    return re.sub(pattern, lambda m: mapping[m.group(0)], text)


def _parents_first(names: Sequence[str], source: Mapping[str, dict]) -> list[str]:
    """Names ordered so that an entity whose attributes name another comes after it."""
    ordered: list[str] = []
    pending = list(names)
    while pending:
        ready = [n for n in pending
                 if not any(v in pending and v != n
                            for v in source[n]["attributes"].values())]
        step = ready or pending[:1]  # a cycle: break it anywhere
        ordered += step
        pending = [n for n in pending if n not in step]
    return ordered


def _attributes_agree(ent: dict, cand: dict, mapping: Mapping[str, str],
                      source: Mapping[str, dict], strict: bool) -> bool:
    for key, value in ent["attributes"].items():
        theirs = cand["attributes"].get(key)
        if value in mapping:
            if theirs != mapping[value]:
                return False
        elif value in source:
            continue  # names an entity the example never mentions: any will do
        elif strict and theirs != value:
            return False
    return True


def _is_answer(parts: Sequence[GoalPart]) -> bool:
    return len(parts) == 1 and not parts[0].conditions


def _matching(asked: Sequence[GoalPart], made: Sequence[GoalPart],
              mapping: Mapping[str, str]) -> list[GoalPart] | None:
    """The parts of ``made`` that are the example's ``asked`` parts under ``mapping`` (the
    same words once the example's names are mapped; the same condition keys where the env has
    no words, or for an answer, whose words hold the world's own value); None unless each
    asked part has its image."""
    if _is_answer(asked) or _is_answer(made):
        same = _is_answer(asked) == _is_answer(made) and \
            _condition_keys(asked[0]) == _condition_keys(made[0])
        return list(made) if same else None
    if all(p.text for p in asked):
        texts = [substitute(p.text, mapping) for p in asked]
        found = [next((p for p in made if p.text == t), None) for t in texts]
    else:
        keys = list(map(_condition_keys, made))
        found = [made[keys.index(k)] if k in keys else None
                 for k in map(_condition_keys, asked)]
    return None if any(p is None for p in found) else found


def goal_conditions(goal) -> set[str] | None:
    """A goal's conditions as canonical JSON; None for a goal that is no list of them."""
    if isinstance(goal, Mapping) and isinstance(goal.get("all"), list):
        return set(map(_key, goal["all"]))
    return None


def _key(condition) -> str:
    return json.dumps(condition, sort_keys=True)


def _condition_keys(part: GoalPart) -> list[str]:
    return sorted(",".join(sorted(c)) if isinstance(c, Mapping) else type(c).__name__
                  for c in part.conditions)
