"""environments/call_formats.py: every env's calls written and read back in every format, the
tools' JSON schemas, and refusals that say what was wrong."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from environments import FilesEnv, ToolCall
from environments.base import ActionError, ArgSpec, ToolSpec, parse_action
from environments.call_formats import FORMATS, call_format, tool_schema
from environments.shop import ShopEnv

ENVS = {"files": FilesEnv, "shop": ShopEnv}
TOOLS = {name: cls().tools() for name, cls in ENVS.items()}
# A typed tool with every literal type the text parser reads, an optional tail included.
TYPED = ToolSpec("put", "store a value", (
    ArgSpec("name"), ArgSpec("n", "int", bounds=(0, 99)), ArgSpec("price", "float"),
    ArgSpec("gift", "bool"), ArgSpec("colour", choices=("red", "blue"), required=False)))


@pytest.mark.parametrize("env", sorted(ENVS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_reference_action_reads_back_the_same_in_every_format(env, fmt):
    tools = {t.name: t for t in TOOLS[env]}
    references = {a for split in ("train", "validation") for t in ENVS[env]().tasks(split)
                  for a in t.reference}
    assert references
    for action in references:
        call = parse_action(action, tools)
        written = FORMATS[fmt].write(call, tools[call.tool])
        assert FORMATS[fmt].parse(written, tools) == call, written


_WORD = st.from_regex(r"[A-Za-z0-9_.~/+-]{1,20}", fullmatch=True).filter(
    lambda w: w.lower() not in ("true", "false"))
_FLOAT = st.one_of(st.from_regex(r"[+-]?[0-9]{1,6}(\.[0-9]{1,6})?", fullmatch=True),
                   st.sampled_from(["0.00001", "-0.000001", "100000.5", "0", "2.0"])).map(float)


def _calls_of(tool: ToolSpec):
    """Calls of ``tool`` with any literal arguments the text parser accepts, optional tails
    left off or not."""
    values = {"str": _WORD, "int": st.integers(-10**8, 10**8), "float": _FLOAT,
              "bool": st.booleans()}
    full = st.tuples(*(values[a.type] for a in tool.args))
    return st.builds(lambda args, keep: ToolCall(tool.name, args[:max(tool.min_args, keep)]),
                     full, st.integers(0, len(tool.args)))


_ALL = [TYPED, *TOOLS["files"], *TOOLS["shop"]]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_ALL).flatmap(_calls_of), st.sampled_from(sorted(FORMATS)))
def test_any_call_round_trips_in_any_format(call, fmt):
    tools = {t.name: t for t in _ALL}
    written = FORMATS[fmt].write(call, tools[call.tool])
    assert FORMATS[fmt].parse(written, tools) == call


def test_the_schema_carries_types_enums_bounds_and_what_is_required():
    schema = tool_schema(TYPED)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "put" and fn["description"] == "store a value"
    params = fn["parameters"]
    assert params["required"] == ["name", "n", "price", "gift"]
    assert params["properties"] == {
        "name": {"type": "string"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "price": {"type": "number"}, "gift": {"type": "boolean"},
        "colour": {"type": "string", "enum": ["red", "blue"]}}
    json.dumps([tool_schema(t) for t in _ALL])  # what a chat template is handed


@pytest.mark.parametrize(("fmt", "text", "says"), [
    ("json", "mv ideas.md music", "not json"),
    ("json", '{"tool": "mv"}', '"name"'),
    ("json", '{"name": "fly", "arguments": {}}', "unknown tool"),
    ("json", '{"name": "mv", "arguments": {"src": "a"}}', "usage : mv src dst"),
    ("json", '{"name": "mv", "arguments": {"src": "a", "to": "b"}}', "unknown argument to"),
    ("json", '{"name": "mv", "arguments": {"src": "a b", "dst": "c"}}', "bad argument src"),
    ("json", '{"name": "mv", "arguments": ["a", "b"]}', "must be an object"),
    ("hermes", '{"name": "ls", "arguments": {}}', "no <tool_call>"),
    ("pythonic", "[mv(src=", "not a python call"),
    ("pythonic", "[ls(), ls()]", "one call per action"),
    ("pythonic", "os.system('ls')", "expected tool(arg=value)"),
    ("pythonic", "[mv(src=__import__('os'), dst='x')]", "must be literals"),
    ("pythonic", "[mv(src=open('x').read(), dst='x')]", "must be literals"),
    ("pythonic", "[mv('a', src='a', dst='b')]", "each argument once"),
])
def test_a_refusal_says_what_was_wrong(fmt, text, says):
    with pytest.raises(ActionError) as info:
        call_format(fmt).parse(text, TOOLS["files"])
    assert says in info.value.observation


def test_an_argument_after_a_gap_is_refused_in_every_format_that_names_them():
    """Calls are positional: an optional argument given while one before it is not cannot
    be made, in JSON as in text."""
    tools = [ToolSpec("find", "", (ArgSpec("where", required=False),
                                   ArgSpec("what", required=False)))]
    for fmt, text in [("json", '{"name": "find", "arguments": {"what": "x"}}'),
                      ("pythonic", "[find(what='x')]")]:
        with pytest.raises(ActionError, match="usage : find"):
            call_format(fmt).parse(text, tools)
    assert call_format("json").parse('{"name": "find"}', tools) == ToolCall("find", ())


def test_the_same_call_in_prose_or_a_fence_is_found_and_nothing_is_evaluated(tmp_path):
    tools = TOOLS["files"]
    call = ToolCall("mv", ("ideas.md", "music"))
    fenced = 'Sure:\n```json\n{"name": "mv", "arguments": {"src": "ideas.md", "dst": "music"}}```'
    assert call_format("json").parse(fenced, tools) == call
    assert call_format("hermes").parse(
        'I will move it.\n<tool_call>\n{"name": "mv", "arguments": '
        '{"src": "ideas.md", "dst": "music"}}\n</tool_call>', tools) == call
    assert call_format("pythonic").parse("mv('ideas.md', dst='music')", tools) == call
    marker = tmp_path / "ran"
    with pytest.raises(ActionError):
        call_format("pythonic").parse(f"[mv(src=open({str(marker)!r}, 'w'), dst='x')]", tools)
    assert not marker.exists()
    with pytest.raises(ValueError, match="one of text, json, hermes, pythonic"):
        call_format("xml")
