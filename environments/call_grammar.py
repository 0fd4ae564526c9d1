"""Every well-formed call of a set of tools, in one call format, as a grammar: what constrained
decoding holds a model to where an env cannot list its calls (BFCL: free-form arguments).

The grammar is written in the Lark dialect of llguidance (``%json`` embeds a JSON schema), which
``inference.backends.constraint.GrammarConstraint`` compiles against the model's tokenizer. It
follows the tools' schemas (:func:`~environments.call_formats.tool_schema`): a call names a
declared tool, gives its required arguments and then any of its optional ones in order (the
parser refuses a gap, so the grammar never makes one), and each value has its argument's type:
``choices`` as alternatives, ``bounds`` as alternatives too where the range is small, a ``str``
as one path-like word where the env's parser wants that (``strings="word"``, the default) or
any string literal (``strings="any"``: BFCL's Python calls).

A grammar may be stricter than the parser (keyword order, spacing) but never looser: every
string it admits is a call the env's ``step`` accepts in that format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from environments.tools import MAX_TEXT_CHARS, ToolSpec

STRING_KINDS = ("word", "any")
WORD = r"[A-Za-z0-9_.~/+-]{1,64}"  # the text parser's str literal (environments.tools)
_WORD_RE = WORD.replace("/", r"\/")  # inside a Lark /regex/
MAX_ENUMERATED = 200  # int bounds spanning at most this many values become alternatives
_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
               "list": "array", "dict": "object"}


def call_grammar(tools: Sequence[ToolSpec], fmt: str, strings: str = "word",
                 several: bool = False, may_end: bool = False) -> str:
    """The grammar of one reply calling ``tools`` in format ``fmt``: one call, or with
    ``several`` one or more (BFCL runs a list of calls a reply); with ``may_end`` also a
    reply with no call (BFCL ends a turn on one)."""
    if strings not in STRING_KINDS:
        raise ValueError(f"strings must be one of {STRING_KINDS}, not {strings!r}")
    if not tools:
        raise ValueError("a call grammar needs at least one tool")
    rules = _FORMATS[fmt](list(tools), strings, several)
    start = "calls | empty" if may_end else "calls"
    return "\n".join([f"start: {start}", 'empty: ""', *rules])


def either(*grammars: str) -> str:
    """One grammar whose strings are those of any of ``grammars`` (each in the Lark dialect, as
    :func:`call_grammar` writes them): llguidance's top-level form, each a named sub-grammar,
    so their rule names never meet. The env's calls beside the rollout's own (the context
    tools of ``env.context=self``)."""
    if any(g.lstrip().startswith("{") for g in grammars):
        raise ValueError("either() combines Lark grammars, not a combined one")
    names = [f"calls_{i}" for i in range(len(grammars))]
    top = {"lark_grammar": "start: " + " | ".join(f"@{name}" for name in names)}
    return json.dumps({"grammars": [top, *({"name": name, "lark_grammar": grammar}
                                          for name, grammar in zip(names, grammars))]})


# --- text: tool arg arg ------------------------------------------------------------------------


def _text(tools, strings, several):
    if strings != "word":
        raise ValueError("the text format spells str arguments as words only")
    rules = [f"calls: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        args = _args([_text_value(a) for a in tool.args], tool.min_args, _lit(" "), True)
        rules.append(f"call_{i}: {_lit(tool.name)} {args}")
    return rules


def _text_value(arg) -> str:
    if arg.kind == "text":  # free text, quoted as the shell-style parser reads it
        return f'/"[^"\\\\\\n]{{1,{MAX_TEXT_CHARS}}}"/'
    if arg.choices:
        return _alternatives(arg.choices)
    if arg.type == "int" and _enumerable(arg):
        return _alternatives(range(arg.bounds[0], arg.bounds[1] + 1))
    return {"str": f"/{_WORD_RE}/", "int": r"/[+-]?[0-9]{1,9}/",
            "float": r"/[+-]?[0-9]{1,9}(\.[0-9]{1,9})?/", "bool": '("true" | "false")'}[arg.type]


# --- json and hermes: {"name": ..., "arguments": {...}} --------------------------------------


# JSON written as call_formats writes it (", " and ": "): no whitespace for the model to spend
# its action tokens on (llguidance's extension; a parser reads any JSON whitespace).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(tools, strings, several):
    schema = {"anyOf": [_call_schema(t, strings) for t in tools]}
    if several:
        schema = {"anyOf": [*schema["anyOf"], {"type": "array", "minItems": 1,
                                              "items": schema}]}
    return [f"calls: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}"]


def _hermes(tools, strings, several):
    one = json.dumps({"anyOf": [_call_schema(t, strings) for t in tools],
                      "x-guidance": _COMPACT})
    block = f'"<tool_call>" %json {one} "</tool_call>"'
    return [f"calls: block{'+' if several else ''}", f"block: {block}"]


def _call_schema(tool: ToolSpec, strings: str) -> dict:
    properties = {a.name: _value_schema(a, strings) for a in tool.args}
    return {"type": "object", "additionalProperties": False,
            "properties": {"name": {"const": tool.name},
                           "arguments": {"type": "object", "properties": properties,
                                         "required": [a.name for a in tool.args if a.required],
                                         "additionalProperties": False}},
            "required": ["name", "arguments"]}


def _value_schema(arg, strings: str) -> dict:
    schema: dict = {"type": _JSON_TYPES[arg.type]}
    if arg.choices:
        return {"enum": list(arg.choices)}
    if arg.type == "str" and strings == "word":
        schema["pattern"] = f"^{WORD}$"
    if arg.bounds is not None:
        schema["minimum"], schema["maximum"] = arg.bounds
    return schema


# --- pythonic: [tool(arg=value, ...)] ---------------------------------------------------------


def _pythonic(tools, strings, several):
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = ['calls: "[" call ("," " "? call)* "]"' if several else 'calls: "[" call "]"',
             f"call: {calls}",
             *_PY_LITERALS]
    for i, tool in enumerate(tools):
        args = _args([f"{_lit(a.name + '=')} {_py_value(a, strings)}" for a in tool.args],
                     tool.min_args, _lit(", "), False)
        rules.append(f"call_{i}: {_lit(tool.name + '(')} {args} {_lit(')')}")
    return rules


# Python literals of any shape (BFCL's list and dict arguments; strings of any kind).
_PY_LITERALS = [
    r'''py_str: /'([^'\\\n]|\\.)*'/ | /"([^"\\\n]|\\.)*"/''',
    r"py_int: /[+-]?[0-9]{1,18}/",
    r"py_float: /[+-]?[0-9]{1,18}\.[0-9]{1,18}([eE][+-]?[0-9]{1,3})?/",
    'py_bool: "True" | "False"',
    'py_any: py_str | py_int | py_float | py_bool | "None" | py_list | py_dict',
    'py_list: "[" (py_any (", " py_any)*)? "]"',
    'py_dict: "{" (py_str ": " py_any (", " py_str ": " py_any)*)? "}"',
]


def _py_value(arg, strings: str) -> str:
    if arg.choices:
        return _alternatives([repr(c) for c in arg.choices])
    if arg.type == "int" and _enumerable(arg):
        return _alternatives(range(arg.bounds[0], arg.bounds[1] + 1))
    if arg.type == "str":
        return "py_str" if strings == "any" else f"(/'{_WORD_RE}'/ | /\"{_WORD_RE}\"/)"
    return {"int": "py_int", "float": "(py_float | py_int)", "bool": "py_bool",
            "list": "py_list", "dict": "py_dict"}[arg.type]


_FORMATS = {"text": _text, "json": _json, "hermes": _hermes, "pythonic": _pythonic}


# --- pieces ------------------------------------------------------------------------------------


def _args(values: list[str], required: int, sep: str, leading: bool) -> str:
    """``values`` joined by ``sep`` (and led by one where ``leading``), the optional ones
    nested after the required so only a tail is ever left off."""
    parts = [f"{sep} {v}" if j or leading else v for j, v in enumerate(values)]
    optional = ""
    for part in reversed(parts[required:]):
        optional = f"({part} {optional})?"
    return " ".join([*parts[:required], optional]).strip()


def _enumerable(arg) -> bool:
    return arg.bounds is not None and arg.bounds[1] - arg.bounds[0] < MAX_ENUMERATED


def _alternatives(values) -> str:
    return "(" + " | ".join(_lit(str(v)) for v in values) + ")"


def _lit(text: str) -> str:
    return json.dumps(text)
