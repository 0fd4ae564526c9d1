"""Goal-directed explorations towards a tool that keeps failing: its preconditions, learnt
from its refusals.

A tool random walks keep calling and the env keeps refusing ("box b3 is not sealed") is a gap
to plan for, not a coin to keep tossing: no stored task can use a tool that never worked. An
``unlock`` probe sets out from a world's reset state to make such a tool (the *target*)
succeed, by backward chaining over refusals:

1. call the target, on a well-formed call the env lists (``candidate_actions()``) when it
   lists some, else with drafted arguments;
2. refused: pick a *fixer*, a call of another tool on the same arguments, ranked by whether
   the refusal names the tool ("not sealed" names ``seal``), then by whether the tool was
   seen deleting what it acts on (last), then by how often it was tried for this call, then
   by how often it changed the state; after a fixer that changed the state, call the
   refused call again;
3. a fixer the refusal named, refused in turn, becomes the call to unlock (up to
   ``max_depth`` deep), so a chain open -> fill -> seal -> ship is found from ship's refusal
   alone when each refusal names the next missing step; where none does, the state-changing
   tools are tried one by one and each that works is followed by the waiting call again;
4. the target worked: start over on another call of it, while steps are left.

Hindsight synthesis then makes tasks of the probe like any other exploration, so the target's
calls, with the chain that enables them, reach the stored tasks.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from os.path import commonprefix

from environments.base import ToolSpec
from questioning.probes import compose_call, is_number

MAX_DEPTH = 5  # refused calls waiting on one another
FIXER_TRIES = 2  # calls of one fixer tool per refused call
MAX_RESTARTS = 3  # chains given up before the probe goes on as a random walk
_WORD = re.compile(r"[a-z]+")


class PreconditionPlanner:
    """The calls of one ``unlock`` probe towards ``target``: :meth:`next_call` before each
    step, :meth:`observe` after it (the same protocol as ``probes.ProbePlanner``).

    ``effects`` (tool -> [calls that changed the state, calls that worked]) and ``draft`` (a
    value for a tool's argument slot, or None) come from the schema sampler; ``candidates``
    returns the env's well-formed calls now, or [] where it lists none."""

    def __init__(self, target: ToolSpec, tools: list[ToolSpec], effects: dict[str, list[int]],
                 draft: Callable, rng: random.Random,
                 candidates: Callable[[], list[str]] = list, max_depth: int = MAX_DEPTH,
                 removers: set[str] | None = None):
        self.target, self.tools, self.effects = target, tools, effects
        self.draft, self.rng, self.candidates = draft, rng, candidates
        self.by_name = {t.name: t for t in tools}
        self.max_depth = max_depth
        # Tools seen making their argument vanish from the state (a delete): tried last as
        # fixers, since what is gone cannot be unlocked. Shared across probes by the explorer.
        self.removers = set() if removers is None else removers
        self.stack: list[str] = []  # refused calls waiting for a precondition; target first
        self.refusal: dict[str, str] = {}  # a waiting call -> what the env answered it
        self.fixers_tried: dict[str, Counter] = {}  # a waiting call -> fixer tools tried
        self.retry = False  # the last fixer changed the state: call the waiting one again
        self.last_fixer: str | None = None
        self.last_named = False  # the last fixer was named by the refusal it answers
        self.unlocked = 0  # successful calls of the target
        self.restarts = 0  # chains given up
        self.done = False

    def next_target(self) -> bool:
        """After the target worked: go on with another call of it (each success is a task)."""
        self.stack.clear()
        self.refusal.clear()
        self.fixers_tried.clear()
        self.retry, self.last_fixer, self.done = False, None, False
        return True

    def next_call(self, fallback: Callable[[], str]) -> str:
        if not self.stack:
            call = self._target_call() if self.restarts <= MAX_RESTARTS else None
            if call is None:
                return fallback()
            self.stack.append(call)
            return call
        if self.retry:
            self.retry = False
            return self.stack[-1]
        fixer = self._fixer(self.stack[-1])
        while fixer is None and self.stack:  # nothing left to try for it: give it up
            self.refusal.pop(self.stack.pop(), None)
            fixer = self._fixer(self.stack[-1]) if self.stack else None
        if fixer is None:  # the whole chain given up: another call of the target, or a walk
            self.restarts += 1
            return self.next_call(fallback) if self.restarts <= MAX_RESTARTS else fallback()
        self.last_fixer = fixer
        return fixer

    def observe(self, call: str, ok: bool, before: dict, after: dict,
                observation: str = "") -> None:
        if self.stack and call == self.stack[-1]:
            if ok:
                self.stack.pop()
                self.refusal.pop(call, None)
                self.retry = bool(self.stack)  # what waited on it may work now
                if not self.stack:
                    self.unlocked += 1
                    self.done = True
            else:
                self.refusal[call] = observation
            return
        if call != self.last_fixer:
            return
        self.last_fixer = None
        if ok:
            self.retry = after != before
            if self.retry:  # a new state: every fixer may work now
                self.fixers_tried.get(self.stack[-1], Counter()).clear()
            if _removed(call.split()[1:], before, after):
                self.removers.add(call.split()[0])
        elif self.last_named and len(self.stack) < self.max_depth and call not in self.stack:
            # A fixer the refusal named has a precondition of its own: unlock it first. One
            # picked blindly and refused is just a wrong guess (a search, not a chain).
            self.stack.append(call)
            self.refusal[call] = observation

    # --- choosing calls ---

    def _target_call(self) -> str | None:
        """A call of the target the env lists (one not given up on first), else drafted."""
        listed = [c for c in self.candidates() if c.split()[:1] == [self.target.name]]
        fresh = [c for c in listed if c not in self.fixers_tried]
        if listed:
            return self.rng.choice(fresh or listed)
        return self._drafted(self.target, {})

    def _fixer(self, waiting: str) -> str | None:
        """A call of another tool on ``waiting``'s arguments, the tools its refusal names
        first, then those that change the state most often; None when all were tried."""
        words = waiting.split()
        tool, values = self.by_name.get(words[0]), words[1:]
        if tool is None:
            return None
        named = dict(zip((a.name for a in tool.args), values))
        entities = [v for v in values if not is_number(v)]
        tried = self.fixers_tried.setdefault(waiting, Counter())
        busy = {c.split()[0] for c in self.stack}
        refusal = self.refusal.get(waiting, "")
        ranked = sorted(
            (t for t in self.tools if t.name not in busy and tried[t.name] < FIXER_TRIES),
            key=lambda t: (-mentions(t.name, refusal), t.name in self.removers,
                           tried[t.name], -self._change_rate(t.name), self.rng.random()))
        for fixer in ranked:
            if self._change_rate(fixer.name) == 0.0 and not mentions(fixer.name, refusal):
                continue  # seen often and never changing anything: a read cannot unlock
            tried[fixer.name] += 1
            call = self._listed_on(fixer, entities) or self._drafted(fixer, named, entities)
            if call is not None:
                self.last_named = mentions(fixer.name, refusal)
                return call
        return None

    def _listed_on(self, tool: ToolSpec, entities: list[str]) -> str | None:
        """A call of ``tool`` the env lists that names one of ``entities``."""
        mine = [c for c in self.candidates() if c.split()[:1] == [tool.name]
                and set(c.split()[1:]) & set(entities)]
        return self.rng.choice(mine) if mine else None

    def _drafted(self, tool: ToolSpec, named: dict[str, str],
                 entities: list[str] = ()) -> str | None:
        """``tool`` with the waiting call's values where an argument has the same name, its
        entities in the other name slots, drafted values elsewhere."""
        free = list(entities)

        def value(slot, arg):
            if arg.name in named:
                return named[arg.name]
            if arg.type == "str" and not arg.choices and free:
                return free.pop(0)
            return self.draft(tool.name, slot, arg)

        return compose_call(tool, value)

    def _change_rate(self, tool: str) -> float:
        """How often ``tool`` changed the state when it worked: 0.5 unseen; 0.0 only after
        five or more working calls that changed nothing (a read)."""
        changed, calls = self.effects.get(tool, [0, 0])
        if calls >= 5 and not changed:
            return 0.0
        return (changed + 1) / (calls + 2)


def mentions(tool: str, text: str) -> bool:
    """Whether ``text`` names ``tool``: a word sharing its first four letters (all of a
    shorter name), as "not sealed" names ``seal`` and "is not open" ``open``."""
    stem = tool.lower()[:4]
    return any(len(commonprefix([w, stem])) >= len(stem) for w in _WORD.findall(text.lower()))


def failing_tools(tools: list[ToolSpec], tries: dict[str, list[int]], ok: Counter,
                  min_tries: int = 8, max_success: float = 0.1) -> list[str]:
    """Tools called at least ``min_tries`` times that worked in at most ``max_success`` of
    them, most tried first: the targets of ``unlock`` probes."""
    out = [(tries[t.name][1], t.name) for t in tools if t.name in tries
           and tries[t.name][1] >= min_tries and ok[t.name] <= max_success * tries[t.name][1]]
    return [name for _, name in sorted(out, reverse=True)]


def _removed(words: list[str], before: dict, after: dict) -> bool:
    """Whether a word of the call was in the state before it and is nowhere in it after."""
    was, now = json.dumps(before), json.dumps(after)
    return any(f'"{w}"' in was and f'"{w}"' not in now for w in words)
