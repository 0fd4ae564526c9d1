"""Goal-directed explorations: short walks from a world's reset state that set out to make the
kinds of task random walks rarely leave behind.

A random walk changes many things, so hindsight finds end states, but seldom a change undone
(an event task), a read after few enough changes to ask for (a read task) or one entity
changed three times over (a longer plan). A probe fixes an entity first, the one the first
call that changes the state acts on, and then keeps to it:

``repeat``  three more state-changing calls on that entity;
``undo``    calls on it until the state is back where the first left it, tools already seen
            undoing that tool first (:class:`Inverses`); once some tool is known to be
            undone, most undo probes start with it, and one whose undo candidates are all
            spent starts over with the next change (``restock`` may have no inverse at all);
``read``    a call that leaves the state as it is on it (a read), after the one change, then
            reads of anything (each answer after that one change is a read task of its own).

Arguments other than the entity are drafted as the schema sampler drafts them; what tools
change the state, and which undo which, is what the explorer learnt so far. Hindsight
synthesis then makes tasks of a probe like any other exploration.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable

from environments.base import ToolSpec

PROBE_KINDS = ("repeat", "undo", "read")
# The kind of stored task (questioning.coverage.task_kinds) each probe sets out to make.
PROBE_MAKES = {"repeat": "long", "undo": "event", "read": "read"}
_NAME_TYPES = ("str",)
# Undo probes that start from the explorer's own proposal even once an inverse is known: a
# tool's inverse is only found by trying it.
UNKNOWN_FIRST_SHARE = 0.25


class Inverses:
    """Which tool was seen undoing which: ``tool -> Counter(undoing tool)``, from any two
    successful calls in a row where the second put the state back as it was before the
    first."""

    def __init__(self):
        self.seen: dict[str, Counter] = defaultdict(Counter)

    def observe(self, first_tool: str, second_tool: str) -> None:
        self.seen[first_tool][second_tool] += 1

    def of(self, tool: str) -> list[str]:
        return [name for name, _ in self.seen[tool].most_common()]


class ProbePlanner:
    """The calls of one probe, one at a time: :meth:`next_call` before each step and
    :meth:`observe` after it.

    ``effects`` (tool -> [calls that changed the state, calls that worked]) and ``draft`` (a
    value for a tool's argument slot, or None) come from the schema sampler."""

    def __init__(self, kind: str, tools: list[ToolSpec], effects: dict[str, list[int]],
                 inverses: Inverses, draft: Callable, rng: random.Random,
                 changes_wanted: int = 3):
        if kind not in PROBE_KINDS:
            raise ValueError(f"probe kind must be one of {PROBE_KINDS}, not {kind!r}")
        self.kind, self.tools, self.effects = kind, tools, effects
        self.inverses, self.draft, self.rng = inverses, draft, rng
        self.changes_wanted = changes_wanted
        self.entity: str | None = None  # the entity the probe keeps to, once fixed
        self.first_tool: str | None = None
        self.first_args: list[str] = []  # the first change's arguments: an undo often repeats them
        self.start_state: dict | None = None  # before the first change
        self.changes = 0
        self.reads = 0
        self._read_tries, self._read_calls = 0, set()
        self.done = False
        self._tried_undo: Counter = Counter()

    def next_target(self) -> bool:
        """After a ``repeat`` or ``undo`` probe reached its goal: go on with another entity
        (each such run makes tasks of its own; an event pair is replayed alone). A ``read``
        cannot: a second change would make the next read's query ask for both."""
        if self.kind == "read":
            return False
        self.entity = self.first_tool = self.start_state = None
        self.first_args, self.changes, self.done = [], 0, False
        self._tried_undo.clear()
        return True

    def next_call(self, fallback: Callable[[], str]) -> str:
        """The next call: ``fallback()`` (a depth-phase proposal) until the entity is fixed,
        then one on the entity (or the fallback where no tool can take it)."""
        if self.entity is None:
            first = self._undoable() if self.kind == "undo" else None
            return first if first is not None else fallback()
        pick = {"repeat": self._changing, "undo": self._undoing, "read": self._reading}
        call = pick[self.kind]()
        if call is None and self.kind == "undo":
            self.next_target()  # nothing left to try on this change: start from the next one
        return call if call is not None else fallback()

    def observe(self, call: str, ok: bool, before: dict, after: dict,
                observation: str = "") -> None:
        """What the last call did; fixes the entity at the first successful change. (The
        answer, ``observation``, is for planners that read refusals: not this one.)"""
        words = call.split()
        if not ok or not words:
            return
        changed = after != before
        if self.entity is None:
            names = [w for w in words[1:] if not is_number(w)]
            if changed and names:
                self.entity, self.first_tool = names[0], words[0]
                self.first_args = words[1:]
                self.start_state, self.changes = before, 1
            return
        if self.kind == "read":  # a read of anything after the one change: a read task each
            self.reads += not changed
            self._read_calls.add(call)
            self.done = changed or self.reads >= self.changes_wanted
            return
        if self.entity not in words[1:]:
            return
        if self.kind == "repeat" and changed:
            self.changes += 1
            self.done = self.changes > self.changes_wanted
        elif self.kind == "undo" and after == self.start_state:
            self.inverses.observe(self.first_tool, words[0])
            self.done = True

    # --- calls on the entity ---

    def _changing(self) -> str | None:
        return self._on_entity(lambda t: self._change_rate(t.name) > 0.0)

    def _undoing(self) -> str | None:
        """A seen inverse of the first change's tool first, then any other tool that changes
        the state; each first with the first change's own arguments (``sub x 2`` undoes
        ``add x 2``), then with drafted ones."""
        seen = self.inverses.of(self.first_tool)
        others = [t for t in self.tools if t.name != self.first_tool and t.name not in seen
                  and self._change_rate(t.name) > 0.0 and _name_slots(t)]
        self.rng.shuffle(others)
        for tool in [t for name in seen for t in self.tools if t.name == name] + others:
            tries = self._tried_undo[tool.name]
            if tries >= 3:
                continue
            self._tried_undo[tool.name] += 1
            same = len(tool.args) == len(self.first_args) and tries == 0
            call = " ".join([tool.name, *self.first_args]) if same else self._call(tool)
            if call is not None:
                return call
        return None

    def _undoable(self) -> str | None:
        """Most of the time, a call of a tool already seen undone (with drafted arguments):
        the first change of an undo probe decides whether it can succeed at all. The rest of
        the time (and before any inverse is known) None: the explorer's own proposal."""
        known = [t for t in self.tools if self.inverses.of(t.name)]
        if not known or self.rng.random() < UNKNOWN_FIRST_SHARE:
            return None
        return self._drafted(self.rng.choice(known))

    def _drafted(self, tool: ToolSpec) -> str | None:
        return compose_call(tool, lambda slot, arg: self.draft(tool.name, slot, arg))

    def _reading(self) -> str | None:
        """A read on the entity first (three tries: the change may have deleted it), then
        reads of whatever the drafts name, each call once."""
        self._read_tries += 1
        if not self.reads and self._read_tries <= 3:
            return self._on_entity(self._reads)
        tools = [t for t in self.tools if self._reads(t)]
        for _ in range(4 * bool(tools)):
            call = self._drafted(self.rng.choice(tools))
            if call is not None and call not in self._read_calls:
                self._read_calls.add(call)
                return call
        return None

    def _reads(self, tool: ToolSpec) -> bool:
        return self._change_rate(tool.name) < 0.5

    def _on_entity(self, fits: Callable[[ToolSpec], bool]) -> str | None:
        tools = [t for t in self.tools if fits(t) and _name_slots(t)]
        self.rng.shuffle(tools)
        for tool in tools:
            call = self._call(tool)
            if call is not None:
                return call
        return None

    def _call(self, tool: ToolSpec) -> str | None:
        slots = _name_slots(tool)
        if not slots:
            return None
        at = self.rng.choice(slots)
        words = [tool.name]
        for slot, arg in enumerate(tool.args):
            if slot == at:
                words.append(self.entity)
                continue
            if not arg.required and slot > at:
                break
            value = self.draft(tool.name, slot, arg)
            if value is None:
                return None
            words.append(str(value))
        return " ".join(words)

    def _change_rate(self, tool: str) -> float:
        """How often ``tool`` changed the state, with one pseudo-call each way: 0.5 unseen."""
        changed, calls = self.effects.get(tool, [0, 0])
        return (changed + 1) / (calls + 2)


def compose_call(tool: ToolSpec, value: Callable) -> str | None:
    """``tool`` with ``value(slot, arg)`` for its arguments in order, up to the first None: the
    call as far as it goes, or None when that argument is required."""
    words = [tool.name]
    for slot, arg in enumerate(tool.args):
        word = value(slot, arg)
        if word is None:
            if arg.required:
                return None
            break
        words.append(str(word))
    return " ".join(words)


def _name_slots(tool: ToolSpec) -> list[int]:
    """Argument slots that may hold an entity's name: strings without a fixed domain."""
    return [i for i, a in enumerate(tool.args) if a.type in _NAME_TYPES and not a.choices]


def is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
