"""Declared tools, parsed calls and the shell-style action parser: what every call format
(``environments.call_formats``) and every environment (``environments.base``) build on.

An action is untrusted text that is *parsed* into a declared tool and literal arguments,
never evaluated; what does not parse is an :class:`ActionError` whose observation the agent
sees.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAX_ACTION_CHARS = 256  # longer text is rejected before tokenizing: bounds parser work
MAX_OBS_WORDS = 40  # safety net on what step() returns; environments truncate sooner
# Shell-style actions can carry str, int, float and bool; list and dict arguments exist only in
# environments with their own call syntax (BFCL's Python calls), which override ``step``.
ARG_TYPES = ("str", "int", "float", "bool", "list", "dict")

_TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
# A literal str argument is one path-like word: no quotes, brackets, calls or spaces survive.
_STR_LITERAL = re.compile(r"[A-Za-z0-9_.~/+-]{1,64}")
_INT_LITERAL = re.compile(r"[+-]?[0-9]{1,9}")
_FLOAT_LITERAL = re.compile(r"[+-]?[0-9]{1,9}(\.[0-9]{1,9})?")
_BOOL_WORDS = {"true": True, "false": False}
MAX_TEXT_CHARS = 400  # a free-text argument (kind "text"): a note the agent writes


@dataclass(frozen=True)
class ArgSpec:
    """One tool argument: a name, a literal type (one of ARG_TYPES), whether it is required,
    and, where the environment knows it, its domain (what self-questioning draws from).

    The parser checks a value's type only (:func:`literal_arg`, in every call format): it
    enforces neither ``choices`` nor ``bounds``. They steer the explorer's drafting of
    arguments (``questioning.explorer.ArgumentDrafter``) and reach a model as the schema's
    enum, minimum and maximum; ``execute`` refuses a value outside them with
    :class:`ToolError`. docs/environments.md has the positional order and when to declare
    each."""

    name: str
    type: str = "str"
    description: str = ""
    required: bool = True
    # The values the argument can take, when the environment can list them (an enumeration:
    # colours, warehouse names); the explorer draws from these instead of guessing.
    choices: tuple = ()
    # For int and float arguments, the (low, high) range that makes sense, both included.
    bounds: tuple | None = None
    # "id": a str naming something the call *creates* (an order id, a new file name): the
    # explorer invents fresh values in the style of ids it has seen, not only seen names.
    # "text": a str of free text (printable, up to MAX_TEXT_CHARS; quoted in the text format),
    # not one word: what the agent's own context tools take (episodes/context.py).
    kind: str = ""

    def __post_init__(self):
        if self.type not in ARG_TYPES:
            raise ValueError(f"arg {self.name!r}: type must be one of {ARG_TYPES}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.bounds is not None:
            if self.type not in ("int", "float") or len(self.bounds) != 2 \
                    or self.bounds[0] > self.bounds[1]:
                raise ValueError(f"arg {self.name!r}: bounds is (low, high) with low <= high, "
                                 "for int and float arguments")
            object.__setattr__(self, "bounds", tuple(self.bounds))
        if self.kind not in ("", "id", "text"):
            raise ValueError(f"arg {self.name!r}: kind is '', 'id' or 'text'")
        if self.kind == "text" and self.type != "str":
            raise ValueError(f"arg {self.name!r}: a 'text' argument is a str")

    def usage(self) -> str:
        return self.name if self.required else f"[{self.name}]"


@dataclass(frozen=True)
class ToolSpec:
    """A declared tool: name, description and ordered args (required ones first)."""

    name: str
    description: str = ""
    args: tuple[ArgSpec, ...] = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "args", tuple(self.args))
        if not _TOOL_NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r} must match {_TOOL_NAME.pattern}")
        flags = [a.required for a in self.args]
        # Positional calls can only leave off a tail, so optional args must come last.
        if flags != sorted(flags, reverse=True):
            raise ValueError(f"tool {self.name!r}: required args must precede optional ones")

    @property
    def min_args(self) -> int:
        return sum(a.required for a in self.args)

    def usage(self) -> str:
        """``mv src dst`` / ``ls [folder]``: words a prompt or an error message can show."""
        return " ".join([self.name] + [a.usage() for a in self.args])

    def to_dict(self) -> dict:
        """JSON-able form, e.g. for a prompt or a function-calling schema."""
        return {
            "name": self.name,
            "description": self.description,
            "args": [
                {
                    "name": a.name,
                    "type": a.type,
                    "description": a.description,
                    "required": a.required,
                    **({"choices": list(a.choices)} if a.choices else {}),
                    **({"bounds": list(a.bounds)} if a.bounds else {}),
                    **({"kind": a.kind} if a.kind else {}),
                }
                for a in self.args
            ],
        }


@dataclass(frozen=True)
class ToolCall:
    """A parsed action: a declared tool and its literal (already typed) arguments."""

    tool: str
    args: tuple = ()

    def text(self) -> str:
        return " ".join([self.tool] + [str(a) for a in self.args])



class ActionError(Exception):
    """An action that did not parse; ``observation`` is the text the agent sees."""

    def __init__(self, kind: str, observation: str, tool: str | None = None):
        super().__init__(observation)
        self.kind = kind
        self.observation = observation
        self.tool = tool


class ToolError(Exception):
    """A well-formed call the environment refused (no such file...); the step stays valid."""

    def __init__(self, kind: str, observation: str):
        super().__init__(observation)
        self.kind = kind
        self.observation = observation


# --- parsing ----------------------------------------------------------------------------------


def parse_action(text, tools: Mapping[str, ToolSpec] | Sequence[ToolSpec]) -> ToolCall:
    """Split ``text`` shell-style into a declared tool and literal args, or raise ActionError."""
    specs = tools if isinstance(tools, Mapping) else {t.name: t for t in tools}
    words = _split(text)
    name, args = words[0], words[1:]
    spec = specs.get(name)
    if spec is None:
        raise ActionError("unknown_tool", "error : unknown tool")
    if not spec.min_args <= len(args) <= len(spec.args):
        raise ActionError("arity", f"error : usage : {spec.usage()}", tool=name)
    values = tuple(literal_arg(a, v, name) for a, v in zip(spec.args, args))
    return ToolCall(name, values)


# A call an instruct model writes inside prose: `cd docs`, or a fenced block (optionally with
# a language tag). Only these spans are tried; prose itself is never read as a call.
_CODE_SPAN = re.compile(r"```[A-Za-z]*\n?([^`]*?)```|`([^`\n]+)`")


def parse_reply(text, tools: Mapping[str, ToolSpec] | Sequence[ToolSpec]) -> ToolCall:
    """:func:`parse_action` on ``text``, else on each code span in it, in order (the first
    line of a fenced block): an instruct model answers ``You can use `ls docs` here``. The
    first span that parses is the call; when none does, the error is the whole text's."""
    try:
        return parse_action(text, tools)
    except ActionError as whole:
        if not isinstance(text, str) or len(text) > MAX_ACTION_CHARS:
            raise
        for match in _CODE_SPAN.finditer(text):
            span = (match.group(1) or match.group(2) or "").strip()
            lines = span.splitlines()
            try:
                return parse_action(lines[0] if lines else span, tools)
            except ActionError:
                continue
        raise whole from None


def _split(text) -> list[str]:
    if not isinstance(text, str):
        raise ActionError("not_text", "error : action is not text")
    if len(text) > MAX_ACTION_CHARS:
        raise ActionError("too_long", "error : action too long")
    # Only printable ASCII and plain whitespace: no unicode look-alikes, NULs or escapes.
    if not text.isascii() or any(not (c.isprintable() or c in " \t\r\n") for c in text):
        raise ActionError("bad_characters", "error : bad characters")
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""  # '#' is an ordinary character, not the start of a comment
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes or a trailing escape
        raise ActionError("syntax", "error : bad syntax") from None
    if not words:
        raise ActionError("empty", "error : empty action")
    return words


def literal_arg(spec: ArgSpec, word: str, tool: str):
    """``word`` as a literal of ``spec``'s type (a str: one path-like word), or ActionError:
    the rule every call format's arguments pass (``environments.call_formats``)."""
    if spec.type == "bool" and word.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[word.lower()]
    if spec.kind == "text":
        if not 0 < len(word) <= MAX_TEXT_CHARS or not word.isprintable():
            raise ActionError("bad_argument", f"error : bad argument {spec.name}", tool=tool)
        return word
    pattern = {"str": _STR_LITERAL, "int": _INT_LITERAL, "float": _FLOAT_LITERAL}.get(spec.type)
    if pattern is None or not pattern.fullmatch(word):
        raise ActionError("bad_argument", f"error : bad argument {spec.name}", tool=tool)
    return {"int": int, "float": float}.get(spec.type, str)(word)


def clip_words(text: str, limit: int = MAX_OBS_WORDS) -> str:
    """At most ``limit`` whitespace-separated words, with ``...`` marking a cut."""
    words = text.split()
    return " ".join(words if len(words) <= limit else words[: limit - 1] + ["..."])



# Every word of the parser's own refusals (the ActionError observations above) and of the mark
# clip_words leaves where it cuts an observation.
PARSER_WORDS = ("error", ":", "unknown", "tool", "usage", "bad", "argument", "syntax", "empty",
                "action", "is", "not", "text", "too", "long", "characters", "...")


def parser_words(tools: Sequence[ToolSpec]) -> list[str]:
    """Every word :meth:`Environment.step` itself can put in an observation, whatever the
    action: the parser's refusals (``error : bad syntax``), the usage lines and argument names
    they echo (``error : usage : add name n``, ``error : bad argument n``) and the ``...`` of a
    clipped observation. A closed :meth:`Environment.vocabulary` includes them all."""
    words = set(PARSER_WORDS)
    for tool in tools:
        words |= set(tool.usage().split()) | {a.name for a in tool.args}
    return sorted(words)
