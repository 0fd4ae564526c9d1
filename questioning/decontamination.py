"""Decontamination: no synthesized task may be a held-out task under another id.

The held-out splits (:data:`protocol.messages.HELD_OUT_SPLITS`: validation and test) are how a
run is scored. Exploration starts from the env's training worlds, and hindsight turns whatever
the explorer did into tasks, so it can rediscover a held-out task on its own: "go to folder
docs" in a world whose held-out task is exactly that. Training on it would score the policy on
what it was trained on. A synthesized task is **contaminated** when, in the same env and the
same world (seed), a held-out task has

* the same query, compared with case and whitespace normalised; or
* an overlapping goal. A goal ``{"all": [conditions...]}`` is compared as the set of its
  conditions (each as canonical JSON), and overlaps when one set contains the other:

  - equal: the same task under another id;
  - the synthesized set inside the held-out one (a sub-goal): training on it rehearses part
    of the held-out task's solution in that very world;
  - the held-out set inside the synthesized one: solving the synthesized task solves the
    held-out task on the way.

  Any other goal form (``{"bfcl_entry": ...}``, ``{"description": ...}``) overlaps only when
  it is equal as canonical JSON: nothing says what such a goal implies.

Another world is another task even with the same words (its files and folders differ), which
is also what makes the check cheap: :class:`HeldOutIndex` keeps the held-out tasks by
(env, seed), by query and by condition, so a check looks only at the held-out tasks of the
candidate's world that share a condition with it. Synthesis refuses a contaminated task with
the reason :data:`CONTAMINATED`; ``autodidact tasks check-contamination`` scans a stored pool.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from environments.base import Environment
from protocol.messages import HELD_OUT_SPLITS, Task

CONTAMINATED = "contaminated"  # the refusal reason, counted as ``rejected_contaminated``

SAME_GOAL = "same goal"
SAME_QUERY = "same query"
SUB_GOAL = "its goal is part of the held-out goal"
IMPLIES = "its goal includes the held-out goal"


@dataclass(frozen=True)
class Overlap:
    """Which held-out task a synthesized one overlaps, in which split, and why."""

    heldout_id: str
    split: str
    why: str


@dataclass(frozen=True)
class _HeldOut:
    task_id: str
    split: str
    conditions: frozenset[str]  # empty for a goal that is not a list of conditions


def canonical(value) -> str:
    """One text per JSON value: equal values (keys in any order), equal texts."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)


def conditions_of(goal) -> frozenset[str]:
    """The conditions of an ``{"all": [...]}`` goal as canonical texts; empty for any other
    form (and for an empty list, which implies nothing)."""
    if isinstance(goal, dict) and set(goal) == {"all"} and isinstance(goal["all"], list):
        return frozenset(canonical(c) for c in goal["all"])
    return frozenset()


def goal_text(goal) -> str:
    """Canonical text of a whole goal: conditions in any order give the same text."""
    conditions = conditions_of(goal)
    return canonical({"all": sorted(conditions)}) if conditions else canonical(goal)


def normal_query(query: str) -> str:
    return " ".join(query.lower().split())


class HeldOutIndex:
    """The held-out tasks of an env, looked up by world; see the module docstring."""

    def __init__(self, heldout: Iterable[Task]):
        self.size = 0
        self._by_query: dict[tuple[str, int, str], _HeldOut] = {}
        self._by_goal: dict[tuple[str, int, str], _HeldOut] = {}
        self._by_condition: dict[tuple[str, int, str], list[_HeldOut]] = {}
        for task in heldout:
            self._add(task)

    @classmethod
    def of_env(cls, env: Environment, splits: Iterable[str] = HELD_OUT_SPLITS) -> HeldOutIndex:
        """The index of ``env``'s own tasks of ``splits`` (by default every held-out split)."""
        tasks = []
        for split in splits:
            try:
                tasks += env.tasks(split)
            except ValueError as exc:
                raise ValueError(
                    f"env {env.name}: tasks({split!r}) failed ({exc}); an environment must "
                    f"accept the splits train, validation and test (an empty list for one "
                    f"it has no tasks of)") from None
        return cls(tasks)

    def _add(self, task: Task) -> None:
        conditions = conditions_of(task.goal)
        entry = _HeldOut(task.task_id, task.split, conditions)
        world = (task.env, task.seed)
        if task.query.strip():
            self._by_query.setdefault((*world, normal_query(task.query)), entry)
        self._by_goal.setdefault((*world, goal_text(task.goal)), entry)
        for condition in conditions:
            self._by_condition.setdefault((*world, condition), []).append(entry)
        self.size += 1

    def find(self, task: Task) -> Overlap | None:
        """The held-out task ``task`` overlaps, or None when it is clean."""
        world = (task.env, task.seed)
        same = self._by_goal.get((*world, goal_text(task.goal)))
        if same is not None:
            return Overlap(same.task_id, same.split, SAME_GOAL)
        same = self._by_query.get((*world, normal_query(task.query)))
        if same is not None:
            return Overlap(same.task_id, same.split, SAME_QUERY)
        return self._nested(world, conditions_of(task.goal))

    def _nested(self, world: tuple[str, int], conditions: frozenset[str]) -> Overlap | None:
        """A held-out goal whose conditions contain, or are contained in, ``conditions``
        (equal sets were found by :meth:`find` already). Only held-out tasks sharing at least
        one condition can be nested with it, so only they are looked at."""
        for condition in conditions:
            for held in self._by_condition.get((*world, condition), ()):
                if conditions < held.conditions:
                    return Overlap(held.task_id, held.split, SUB_GOAL)
                if held.conditions < conditions:
                    return Overlap(held.task_id, held.split, IMPLIES)
        return None

    def overlaps(self, tasks: Iterable[Task]) -> list[tuple[Task, Overlap]]:
        """Every task of ``tasks`` that overlaps a held-out one, with what it overlaps."""
        return [(task, found) for task in tasks if (found := self.find(task)) is not None]

    def overlap(self, task: Task) -> str | None:
        """The id of the held-out task ``task`` overlaps, or None."""
        found = self.find(task)
        return None if found is None else found.heldout_id
