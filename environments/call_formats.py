"""How a model writes a tool call, and the tools as JSON schemas (the function-calling shape).

A call format is a property of the model and the config, not of the env: every env's tools
(:class:`~environments.base.ToolSpec`) can be called in every format, and each format parses
into the same :class:`~environments.base.ToolCall` the env executes::

    text      mv ideas.md music                                   (shell-style words)
    json      {"name": "mv", "arguments": {"src": "ideas.md", "dst": "music"}}
    hermes    <tool_call>{"name": "mv", "arguments": {...}}</tool_call>
    pythonic  [mv(src="ideas.md", dst="music")]                   (BFCL's form)

Nothing a model writes is evaluated: JSON goes through ``json.loads``, a Python-style call
through ``ast.parse`` of one expression whose function must be a bare name and whose
arguments must be literal nodes (``ast.literal_eval`` of each; a name, an attribute or a
call anywhere is refused). Arguments are checked against the tool's ``ArgSpec`` types as the
text parser checks its words (a ``str`` argument is one path-like word in every format), so
the same call is accepted or refused whatever its format. A refusal is an
:class:`~environments.base.ActionError` whose observation says what was wrong.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from environments.tools import (
    MAX_ACTION_CHARS,
    ActionError,
    ArgSpec,
    ToolCall,
    ToolSpec,
    literal_arg,
    parse_reply,
)

MAX_CALL_CHARS = 4 * MAX_ACTION_CHARS  # a JSON call spells out its argument names: room for it
JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
              "list": "array", "dict": "object"}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCE = re.compile(r"```[A-Za-z]*\n?(.*?)```", re.DOTALL)


def tool_schema(tool: ToolSpec) -> dict:
    """``tool`` in the function-calling shape chat templates take (``tools=[...]``): its
    arguments typed, ``choices`` as an enum, ``bounds`` as minimum and maximum."""
    properties = {}
    for arg in tool.args:
        prop: dict = {"type": JSON_TYPES[arg.type]}
        if arg.description:
            prop["description"] = arg.description
        if arg.choices:
            prop["enum"] = list(arg.choices)
        if arg.bounds is not None:
            prop["minimum"], prop["maximum"] = arg.bounds
        properties[arg.name] = prop
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": {"type": "object", "properties": properties,
                       "required": [a.name for a in tool.args if a.required],
                       "additionalProperties": False}}}


class CallFormat(ABC):
    """One way of writing a call: ``write`` what a model would, ``parse`` what it wrote."""

    name: str

    @abstractmethod
    def write(self, call: ToolCall, tool: ToolSpec) -> str:
        """``call`` of ``tool`` as this format spells it."""

    @abstractmethod
    def parse(self, text, tools: Mapping[str, ToolSpec] | Sequence[ToolSpec]) -> ToolCall:
        """The call ``text`` writes, or ActionError saying what is wrong with it."""


class TextFormat(CallFormat):
    """Today's: the tool and its arguments as words (a code span inside prose is found)."""

    name = "text"

    def write(self, call: ToolCall, tool: ToolSpec) -> str:
        return " ".join([call.tool, *(_quoted(_word(v)) for v in call.args)])

    def parse(self, text, tools) -> ToolCall:
        return parse_reply(text, tools)


class JsonFormat(CallFormat):
    """``{"name": tool, "arguments": {arg: value}}``, alone or in a fenced block."""

    name = "json"

    def write(self, call: ToolCall, tool: ToolSpec) -> str:
        return json.dumps({"name": call.tool, "arguments": _named(call, tool)})

    def parse(self, text, tools) -> ToolCall:
        text = _checked_text(text)
        fenced = _FENCE.search(text)
        return _from_json(fenced.group(1) if fenced and not text.lstrip().startswith("{")
                          else text, _by_name(tools))


class HermesFormat(JsonFormat):
    """The JSON call inside ``<tool_call>...</tool_call>`` (Hermes, Qwen and many others)."""

    name = "hermes"

    def write(self, call: ToolCall, tool: ToolSpec) -> str:
        return f"<tool_call>{super().write(call, tool)}</tool_call>"

    def parse(self, text, tools) -> ToolCall:
        found = _HERMES.search(_checked_text(text))
        if found is None:
            raise ActionError("syntax", "error : no <tool_call> ... </tool_call> block")
        return _from_json(found.group(1), _by_name(tools))


class PythonicFormat(CallFormat):
    """``[tool(arg=value, ...)]`` (BFCL's form; the brackets may be left off), arguments by
    keyword or, in order, by position; literals only."""

    name = "pythonic"

    def write(self, call: ToolCall, tool: ToolSpec) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in _named(call, tool).items())
        return f"[{call.tool}({args})]"

    def parse(self, text, tools) -> ToolCall:
        text = _checked_text(text).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ActionError("syntax", "error : not a python call") from None
        if isinstance(tree, ast.List):
            if len(tree.elts) != 1:
                raise ActionError("syntax", "error : one call per action")
            tree = tree.elts[0]
        if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name)):
            raise ActionError("syntax", "error : expected tool(arg=value)")
        specs = _by_name(tools)
        spec = _spec(specs, tree.func.id)
        named = {}
        for arg, node in zip(spec.args, tree.args):
            named[arg.name] = _python_value(node, spec.name)
        if len(tree.args) > len(spec.args):
            raise ActionError("arity", f"error : usage : {spec.usage()}", tool=spec.name)
        for keyword in tree.keywords:
            if keyword.arg is None or keyword.arg in named:
                raise ActionError("syntax", "error : each argument once, by name",
                                  tool=spec.name)
            named[keyword.arg] = _python_value(keyword.value, spec.name)
        return _call(spec, named)


FORMATS: dict[str, CallFormat] = {f.name: f for f in (TextFormat(), JsonFormat(),
                                                        HermesFormat(), PythonicFormat())}


def rewrite(text: str, tools: Sequence[ToolSpec], fmt: str, source: str = "text") -> str:
    """``text``, a call written in format ``source`` (a reference step, a candidate action:
    text), as ``fmt`` writes the same call; text that is no call of ``tools`` in ``source``
    (BFCL's own Python calls, an empty turn end, a refused reply) is returned as it is."""
    if fmt == source:
        return text
    specs = _by_name(tools)
    try:
        call = call_format(source).parse(text, specs)
    except ActionError:
        return text
    return call_format(fmt).write(call, specs[call.tool])


_FORM = {
    "text": "A call is the tool name followed by its arguments, separated by spaces, and "
            "nothing else: no explanation, no quotes, no code block.",
    "json": 'A call is one JSON object, {"name": <tool>, "arguments": {<argument>: <value>, '
            '...}}, and nothing else.',
    "hermes": 'A call is one JSON object, {"name": <tool>, "arguments": {<argument>: <value>, '
              '...}}, inside <tool_call></tool_call> tags.',
    "pythonic": "A call is one Python-style call in brackets, [tool(argument=value, ...)], "
                "with literal values, and nothing else.",
}


def reply_form(fmt: str) -> str:
    """One sentence saying how a call is written in format ``fmt``."""
    return _FORM[call_format(fmt).name]


def tool_instructions(env_name: str, tools: Sequence[ToolSpec], example: str | None = None,
                      fmt: str = "text", list_tools: bool = True) -> str:
    """A system prompt an instruct model can act on: the reply form of call format ``fmt``,
    each tool with its arguments (optional ones in brackets) and what it does (left out with
    ``list_tools=False``, where the chat template shows the tools' schemas itself), and
    ``example`` (a text-format call) as one reply, written in ``fmt``."""
    lines = [f"You operate the {env_name} environment by calling its tools, one call per "
             f"reply. {reply_form(fmt)}"]
    if list_tools:
        lines += ["", "Tools:"]
        lines += [f"- {usage(tool, fmt)}: {tool.description}" if tool.description
                  else f"- {usage(tool, fmt)}" for tool in tools]
    if example:
        lines += ["", "Example reply:", rewrite(example, tools, fmt)]
    lines += ["", "After each call you see what it returned. Keep calling tools until the task "
              "is done."]
    return "\n".join(lines)


def usage(tool: ToolSpec, fmt: str) -> str:
    """``mv src dst`` in the text format, ``mv(src: str, dst: str)`` in the others."""
    if fmt == "text":
        return tool.usage()
    args = ", ".join(f"{a.name}: {a.type}" if a.required else f"[{a.name}: {a.type}]"
                     for a in tool.args)
    return f"{tool.name}({args})"


def json_calls(text, fmt: str) -> list[dict]:
    """Every call a ``json`` or ``hermes`` reply makes, as ``{"name", "arguments"}`` objects
    checked for shape only (for envs that run several calls a turn, BFCL's): a ``json`` reply
    is one object or a list of them, a ``hermes`` reply has one per ``<tool_call>`` block;
    a reply with no call at all (blank, or hermes text without a block) makes none."""
    text = _checked_text(text)
    if fmt == "hermes":
        objects = [_json(block) for block in _HERMES.findall(text)]
    else:
        found = _json(text) if text.strip() else []
        objects = found if isinstance(found, list) else [found]
    for obj in objects:
        _shape(obj)
    return objects


def call_format(name: str) -> CallFormat:
    """The format ``name`` (one of :data:`FORMATS`)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"tool format must be one of {', '.join(FORMATS)}, not "
                         f"{name!r}") from None


# --- pieces -----------------------------------------------------------------------------------


def _checked_text(text) -> str:
    if not isinstance(text, str):
        raise ActionError("not_text", "error : action is not text")
    if len(text) > MAX_CALL_CHARS:
        raise ActionError("too_long", "error : action too long")
    return text


def _by_name(tools) -> Mapping[str, ToolSpec]:
    return tools if isinstance(tools, Mapping) else {t.name: t for t in tools}


def _spec(specs: Mapping[str, ToolSpec], name) -> ToolSpec:
    spec = specs.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ActionError("unknown_tool", "error : unknown tool")
    return spec


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ActionError("syntax", "error : not json") from None


def _shape(obj) -> None:
    """``obj`` is ``{"name": str, "arguments": {str: value}}`` or ActionError."""
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"} or "name" not in obj:
        raise ActionError("syntax", 'error : expected {"name": ..., "arguments": {...}}')
    if not isinstance(obj.get("arguments", {}), dict):
        raise ActionError("syntax", "error : arguments must be an object",
                          tool=obj["name"] if isinstance(obj["name"], str) else None)


def _from_json(text: str, specs: Mapping[str, ToolSpec]) -> ToolCall:
    obj = _json(text)
    _shape(obj)
    spec = _spec(specs, obj["name"])
    return _call(spec, obj.get("arguments", {}))


def _call(spec: ToolSpec, named: dict) -> ToolCall:
    """The positional call ``named`` (argument name -> value) makes of ``spec``: unknown names
    and a gap before a given argument are refused, as the text parser's arity is."""
    unknown = set(named) - {a.name for a in spec.args}
    if unknown:
        raise ActionError("bad_argument", f"error : unknown argument {sorted(unknown)[0]}",
                          tool=spec.name)
    given = [a for a in spec.args if a.name in named]
    if len(given) < spec.min_args or spec.args[:len(given)] != tuple(given):
        raise ActionError("arity", f"error : usage : {spec.usage()}", tool=spec.name)
    return ToolCall(spec.name, tuple(_typed(a, named[a.name], spec.name) for a in given))


def _typed(arg: ArgSpec, value, tool: str):
    """``value`` as the text parser would have made it of ``arg``'s word: the same types and
    the same literal rules (a str is one path-like word), or ActionError."""
    if arg.type in ("list", "dict"):
        if isinstance(value, list if arg.type == "list" else dict):
            return value
    elif arg.type == "bool":
        if isinstance(value, bool):
            return value
    elif arg.type == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return literal_arg(arg, str(value), tool)
    elif arg.type == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return literal_arg(arg, _word(float(value)), tool)
    elif isinstance(value, str):
        return literal_arg(arg, value, tool)
    raise ActionError("bad_argument", f"error : bad argument {arg.name}", tool=tool)


def _named(call: ToolCall, tool: ToolSpec) -> dict:
    return {a.name: v for a, v in zip(tool.args, call.args)}


def _quoted(word: str) -> str:
    """A word as the shell-style parser reads it back: free text (a note) quoted."""
    return shlex.quote(word) if any(c.isspace() or c in "'\"\\" for c in word) else word


def _word(value) -> str:
    """A value as the text parser reads it back: a float in fixed notation (``1e-05`` is not
    a literal there), a bool as ``true``/``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, ".9f").rstrip("0").rstrip(".") or "0"
    return str(value)


def _python_value(node: ast.AST, tool: str):
    """A literal argument node's value; anything that is not one (a name, a call, an
    attribute, an operator other than a sign) is refused."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ActionError("bad_argument", "error : arguments must be literals",
                          tool=tool) from None
    if not _json_like(value):
        raise ActionError("bad_argument", "error : arguments must be literals", tool=tool)
    return value


def _json_like(value, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, list):
        return all(_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False
