"""``openenv``: an environment that is a session on an OpenEnv server (``openenv-core``).

Config (every option checked as a constructor keyword by ``check_env_options``)::

    env:
      name: openenv
      options: {url: "http://127.0.0.1:8000", seeds: 20}

**The episode.** One WebSocket session (``/ws``) per instance, opened on the first ``reset``
and kept for every later episode: only ``/ws`` keeps an environment between calls (HTTP
``/reset`` and ``/step`` each make a fresh one). ``reset(task)`` sends ``reset`` with
``{"seed": task.seed}``; ``step`` sends ``step`` and takes the reply's ``reward`` and ``done``.

**Tools.** A server that answers the MCP ``tools/list`` (an ``MCPEnvironment``) has its
JSON-schema tools made into ``ToolSpec``s (:func:`tool_from_schema`); the model writes
``tool arg ...``, parsed here, sent as ``{"type": "call_tool", "tool_name", "arguments"}``. A
text-action server (no MCP) gets the action text unparsed in its action's one string field
(``action_field``, else the one its ``/schema`` requires); its tools, where its reset
observation lists them in a ``tools`` field (``autodidact env serve --openenv`` does), are
shown to the model and checked by the server itself.

**Tasks.** OpenEnv has no task list: task ``openenv-<seed>`` resets with that seed, for seeds
``0 .. seeds-1``, each in the split ``world_split(seed)`` gives it (train, validation, test).
The reset observation carries the request (``query_in_prompt`` is False), and the goal is the
server's reward: ``evaluate(task)`` is the reward of the episode so far (``reward=last``: the
latest step's; ``sum``: their total), so 1.0 is success where the server's rewards are in
[0, 1].

**No state().** An OpenEnv server's ``state`` is an episode id and a step count, not a
snapshot goals can be checked on, so :meth:`state` raises ``NotImplementedError`` naming the
hooks that need one (:data:`NEEDS_STATE`); ``autodidact explore`` stops with that one line.
Train on the server's own tasks (``tasks.synthetic_share=0``, which also keeps ``autodidact
run`` from exploring). The server's own state is :meth:`server_state`.

**Failures.** A server that cannot be reached, goes away, answers late, refuses a message or
answers something that does not parse raises :class:`~protocol.errors.EnvFailed` (reasons
``no_worker``, ``worker_died``, ``timeout``, ``refused``, ``bad_reply``), and nothing else,
whatever the reply, ``/schema`` or tool list: a ``bad_reply`` is one line naming the field and
what it expected (``tool t: inputSchema.properties.x.anyOf: expected a list of schemas, got
null``), so an actor drops the episode as it does for a served env. Nothing from the wire is
evaluated: replies are JSON, read field by field (tests/test_openenv_hostile.py serves
thousands of hostile ones).

**Context.** The tools' schemas fill a chat model's prompt, so once an instance has them it
declares the ``max_context`` it needs in its own ``default_limits`` (:meth:`_declare_limits`);
``autodidact eval`` without a config file takes it, and every run and evaluation refuses at
start a context too short for one call (``autodidact.resolve.check_context``).

``websockets`` (a dependency of the ``openenv`` extra) is imported only when an instance is
made, so the default install never needs it.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import re
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping

from environments.base import (
    ActionError,
    ArgSpec,
    Environment,
    ToolCall,
    ToolError,
    ToolSpec,
    check_split,
    clip_words,
    register_env,
    world_split,
)
from environments.call_formats import call_format as format_named
from protocol.errors import EnvFailed
from protocol.messages import Task

# The hooks an env without state() cannot offer, and what each would have made (the docs'
# "OpenEnv, both ways" repeats this list).
NEEDS_STATE = ("state", "goal_from_states (hindsight tasks)", "describe_changes",
               "describe_event (event tasks)", "describe_response (read-only tasks, checked "
               "against the state at the call)", "entities", "task verification by replay")
NO_STATE = ("openenv: an OpenEnv server offers no state() snapshot to check goals on, so "
            "self-questioning (autodidact explore) cannot make tasks for it (it needs: "
            + ", ".join(NEEDS_STATE[1:]) + "); train on the server's own seeds with "
            "tasks.synthetic_share=0")
SERVER_GOAL = {"reward": "server"}  # a task whose success is the server's reward
JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
              "array": "list", "object": "dict"}
MAX_CANDIDATES = 64  # candidate_actions enumerates at most this many calls
MAX_REPLY_BYTES = 4 << 20  # a WebSocket message larger than this is refused
# Error codes after which an openenv-core server closes the session (others leave it open).
SESSION_ENDING = ("CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR")
# How long close() waits for the server to end the session it asked to end. openenv-core
# 0.3.0 logs a traceback for every session whose client closed the socket first.
CLOSE_WAIT_S = 5.0
# The context an instance declares it needs once it has the server's tools (its
# ``default_limits``, which a command without a config file takes): the tools' JSON schemas at
# about 3 characters a token, room for the request and instructions around them, and for
# TURN_ROOM calls, each with an observation of max_obs_words (about 2 tokens a word).
SCHEMA_CHARS_PER_TOKEN = 3
PROMPT_ROOM = 256
TURN_ROOM = 4
CALL_ROOM = 64


# --- JSON-schema tools as ToolSpecs -------------------------------------------------------------


def local_name(name: str) -> str:
    """An MCP tool name as a name the action parser takes (``get-weather`` -> ``get_weather``):
    MCP allows hyphens and dots, actions are shell words of ``[A-Za-z][A-Za-z0-9_]*``."""
    word = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return (word if word[:1].isalpha() else f"t_{word}")[:64]


def tool_from_schema(tool) -> ToolSpec:
    """The ToolSpec of one MCP tool (``{"name", "description", "inputSchema"}``; OpenEnv's own
    ``Tool`` spells it ``input_schema``), named by :func:`local_name`. Required arguments come
    first, in the schema's order. ValueError naming the field and what it should be when the
    tool does not fit (whatever the JSON: nothing else is raised)."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"tools[]: expected an object, got {_kind(tool)}")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tools[].name: expected a non-empty string, got {_kind(name)}")
    schema = tool.get("inputSchema", tool.get("input_schema")) or {}
    if not isinstance(schema, Mapping):
        raise ValueError(f"tool {name}: inputSchema: expected an object, got {_kind(schema)}")
    props, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(props, Mapping):
        raise ValueError(f"tool {name}: inputSchema.properties: expected an object, got "
                         f"{_kind(props)}")
    if not isinstance(required, list):
        raise ValueError(f"tool {name}: inputSchema.required: expected a list of names, got "
                         f"{_kind(required)}")
    args = [_arg(name, arg, spec, arg in required) for arg, spec in props.items()]
    args.sort(key=lambda a: not a.required)  # stable: the schema's order within each
    description = tool.get("description")
    return ToolSpec(local_name(name), description if isinstance(description, str) else "",
                    tuple(args))


def _arg(tool: str, name: str, spec, required: bool) -> ArgSpec:
    where = f"tool {tool}: inputSchema.properties.{name}"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected an object, got {_kind(spec)}")
    kind = _json_type(spec, where)
    if kind not in JSON_TYPES:
        raise ValueError(f"{where}.type: {kind!r} is not one of {', '.join(JSON_TYPES)}")
    arg_type = JSON_TYPES[kind]
    low, high = spec.get("minimum"), spec.get("maximum")
    bounds = (low, high) if arg_type in ("int", "float") and _numbers(low, high) else None
    choices = spec.get("enum", [])
    if not isinstance(choices, list) or not all(_is_scalar(c) for c in choices):
        raise ValueError(f"{where}.enum: expected a list of strings, numbers or booleans, got "
                         f"{_kind(choices)}")
    description = spec.get("description") or spec.get("title")
    return ArgSpec(name, arg_type, description if isinstance(description, str) else "",
                   required, tuple(c for c in choices if c is not None), bounds)


def _json_type(spec: Mapping, where: str = "schema"):
    """``type``: the one non-null type of ``type: [t, "null"]`` or of an ``anyOf`` (pydantic's
    ``Optional[int]``); None when there is not exactly one. ValueError naming ``where``'s
    ``anyOf`` when it is not a list."""
    kinds = spec.get("type")
    if kinds is None:
        any_of = spec.get("anyOf", [])
        if not isinstance(any_of, list):
            raise ValueError(f"{where}.anyOf: expected a list of schemas, got {_kind(any_of)}")
        kinds = [s.get("type") for s in any_of if isinstance(s, Mapping)]
    if not isinstance(kinds, list):
        return kinds if isinstance(kinds, str) else None
    kinds = [k for k in kinds if k != "null"]
    return kinds[0] if len(kinds) == 1 and isinstance(kinds[0], str) else None


def _numbers(*values) -> bool:
    """Whether ``values`` are finite numbers (JSON's, not booleans), in order."""
    return all(isinstance(v, int) and not isinstance(v, bool)
               or isinstance(v, float) and math.isfinite(v) for v in values) \
        and values[0] <= values[1]


def _is_scalar(value) -> bool:
    """A value an enum may list: text, a finite number, a boolean; or null (left out)."""
    return value is None or isinstance(value, (str, bool, int)) \
        or isinstance(value, float) and math.isfinite(value)


def _kind(value) -> str:
    """``value``'s JSON type, for a message naming what came instead of what was expected."""
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
             str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def schema_tool(tool: ToolSpec) -> dict:
    """``tool`` as an MCP tool (name, description, JSON-schema inputSchema): the inverse of
    :func:`tool_from_schema`, for servers that list our tools."""
    kinds = {v: k for k, v in JSON_TYPES.items()}
    props = {}
    for arg in tool.args:
        prop = {"type": kinds[arg.type], "description": arg.description}
        if arg.choices:
            prop["enum"] = list(arg.choices)
        if arg.bounds is not None:
            prop["minimum"], prop["maximum"] = arg.bounds
        props[arg.name] = prop
    return {"name": tool.name, "description": tool.description, "inputSchema": {
        "type": "object", "properties": props,
        "required": [a.name for a in tool.args if a.required]}}


# --- the session ----------------------------------------------------------------------------------


class OpenEnvSession:
    """One WebSocket session on the OpenEnv server at ``url`` (``http://host:port``), each
    message answered within ``timeout_s``. Every failure is an EnvFailed."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.ws_url = "ws" + self.url[len("http"):] + "/ws"
        self._ws = None

    def send(self, kind: str, data: dict | None = None) -> dict:
        """The ``data`` of the reply to one ``{"type": kind, "data": data}`` message."""
        from websockets.exceptions import ConnectionClosed

        ws = self._connect()
        message = {"type": kind} if data is None else {"type": kind, "data": data}
        try:
            try:
                ws.send(json.dumps(message))
            except ConnectionClosed:  # it may have said why before closing (at capacity)
                pass
            raw = ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            self.close()
            raise EnvFailed("timeout", f"{kind} not answered within {self.timeout_s:g} s "
                            f"(env.options.timeout_s) by the OpenEnv server at {self.url}"
                            ) from None
        except ConnectionClosed as exc:
            self.close()
            raise EnvFailed("worker_died", f"the OpenEnv server at {self.url} closed the "
                            f"session during {kind} ({exc})") from None
        return self._data(kind, raw)

    def _connect(self):
        if self._ws is None:
            from websockets.exceptions import WebSocketException
            from websockets.sync.client import connect

            try:
                # Entered by hand: the connection outlives any one block (websockets >= 17.1
                # warns about a connect() never entered); close() ends it.
                self._ws = connect(self.ws_url, open_timeout=self.timeout_s,
                                   max_size=MAX_REPLY_BYTES).__enter__()
            except (OSError, TimeoutError, WebSocketException) as exc:  # WebSocketException:
                # something answers there, but not a WebSocket at /ws (no OpenEnv server)
                raise EnvFailed("no_worker", f"no OpenEnv server answers at {self.ws_url} "
                                f"({exc}); env.options.url names it") from None
        return self._ws

    def _data(self, kind: str, raw) -> dict:
        reply = _json(raw, f"the OpenEnv server at {self.url} answered {kind} with a message")
        if not isinstance(reply, dict):
            raise EnvFailed("bad_reply", f"OpenEnv reply to {kind}: expected an object with "
                            f"field data, got {_kind(reply)}")
        if not isinstance(reply.get("data"), dict):
            raise EnvFailed("bad_reply", f"OpenEnv reply to {kind}: field data: expected an "
                            f"object, got {_kind(reply.get('data'))}")
        if reply.get("type") == "error":
            error = reply["data"]
            code = error.get("code")
            if code in SESSION_ENDING:  # the server closes it: so do we
                self.close()
            raise EnvFailed("refused", f"the OpenEnv server at {self.url} refused {kind}: "
                            f"{_words(code, '?')}: {_words(error.get('message'))}"
                            + _capacity_hint(error))
        return reply["data"]

    def schema(self) -> dict:
        """The server's ``GET /schema`` (``action``, ``observation``, ``state`` schemas)."""
        try:
            with urllib.request.urlopen(self.url + "/schema", timeout=self.timeout_s) as r:
                raw = r.read(MAX_REPLY_BYTES)
        except (OSError, urllib.error.URLError) as exc:  # URLError: gone, or answered 4xx/5xx
            raise EnvFailed("no_worker", f"GET {self.url}/schema: {exc}") from None
        except (http.client.HTTPException, ValueError) as exc:  # not HTTP, or a bad URL
            raise EnvFailed("bad_reply", f"GET {self.url}/schema: not an HTTP reply "
                            f"({type(exc).__name__})") from None
        body = _json(raw, f"GET {self.url}/schema answered")
        action = body.get("action") if isinstance(body, dict) else None
        if not isinstance(action, dict):
            raise EnvFailed("bad_reply", f"GET {self.url}/schema: field action: expected an "
                            f"object, got {_kind(action)}")
        return body

    def close(self) -> None:
        """Say close (the server then ends the session itself) and close the socket."""
        if self._ws is not None:
            ws, self._ws = self._ws, None
            deadline = time.monotonic() + CLOSE_WAIT_S
            try:
                ws.send(json.dumps({"type": "close"}))
                while (left := deadline - time.monotonic()) > 0:  # the server closes first
                    ws.recv(timeout=left)  # a late reply (after a timeout) is dropped
            except Exception:  # closed (as asked), gone already or slow: nothing more to end
                pass
            ws.close()


def _json(raw, what: str):
    """``raw`` (text or bytes) as JSON, its text made UTF-8 clean (a lone surrogate, which
    JSON can escape and no tokenizer takes, becomes ``?``); EnvFailed when it is not JSON."""
    try:
        value = json.loads(raw)
        text = json.dumps(value, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            value = json.loads(text.encode("utf-8", "replace"))
        return value
    except (TypeError, ValueError, RecursionError):  # RecursionError: nested too deep
        raise EnvFailed("bad_reply", f"{what} that is not JSON (or nests too deep)") from None


def _words(value, default: str = "") -> str:
    """A server's code or message as text for an error line (nothing else is quoted)."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)[:500]
    return default


def _capacity_hint(error: dict) -> str:
    if error.get("code") != "CAPACITY_REACHED":
        return ""
    return (" (each env instance is one session: start the server with max_concurrent_envs "
            "at least actors x actor.group_size)")


def _field(data: dict, name: str, ok, what: str, where: str):
    value = data.get(name)
    if not ok(value):
        raise EnvFailed("bad_reply", f"OpenEnv reply to {where}: field {name}: expected "
                        f"{what}, got {_kind(value) if name in data else 'nothing'}")
    return value


def _is_reward(v) -> bool:
    # a bool too (Observation allows one); JSON's NaN and Infinity are no reward
    return v is None or (isinstance(v, (int, float)) and math.isfinite(v))


# --- the env ----------------------------------------------------------------------------------


@register_env("openenv")
class OpenEnvEnv(Environment):
    """A session on an OpenEnv server; see the module docstring."""

    query_in_prompt = False  # the server's reset observation carries the request
    client_options: dict = {}  # served: url and all are the server's, never a client's
    has_state = False  # state() raises NO_STATE

    def __init__(self, url: str = "", seeds: int = 10, timeout_s: float = 30.0,
                 reward: str = "last", action_field: str = "", max_obs_words: int = 200):
        """``url``: the server (``http://host:port``); ``seeds``: tasks are seeds 0 ..
        seeds-1; ``timeout_s``: the most one message may take; ``reward``: ``last`` (the
        latest step's reward is the outcome) or ``sum``; ``action_field``: a text-action
        server's string field (default: the one its action schema requires);
        ``max_obs_words``: observations are clipped to this many words."""
        super().__init__()
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"env.options.url must be the OpenEnv server's http:// address, "
                             f"got {url!r}")
        if seeds < 1 or timeout_s <= 0 or max_obs_words < 1:
            raise ValueError("env.options.seeds, timeout_s and max_obs_words must be positive")
        if reward not in ("last", "sum"):
            raise ValueError(f"env.options.reward must be last or sum, got {reward!r}")
        self.seeds, self.reward_mode, self.max_obs_words = seeds, reward, max_obs_words
        self.action_field = action_field
        self.session = OpenEnvSession(url, timeout_s)
        self._closer = weakref.finalize(self, self.session.close)
        self._tools: list[ToolSpec] | None = None
        self._mcp: bool | None = None  # whether the server lists MCP tools; None: not asked
        self._listed: dict = {}  # its tools/list result
        self._remote: dict[str, str] = {}  # a tool's local name -> the server's name for it
        self._rewards: list[float] = []
        self.done = False

    def close(self) -> None:
        """End the WebSocket session (the server frees its env)."""
        self._closer()

    # -- the episode --

    def reset(self, task: Task) -> str:
        self.responses, self._rewards, self.done = [], [], False
        data = self.session.send("reset", {"seed": int(task.seed)})
        self.task = task
        observation = _field(data, "observation", lambda v: isinstance(v, dict), "an object",
                             "reset")
        if self._mcp is None:
            self._mcp = self._lists_tools()
        if not self._mcp:  # a text-action server's tools are in its reset observation
            self._tools = self._listed_tools(observation)
            self._declare_limits()
            self._text_field()  # asked now, while the session is known to be up
        return self._text(observation)

    def step(self, action_text: str, call_format: str = "text") -> tuple[str, bool, dict]:
        """An MCP server's call parsed in ``call_format``; a text-action server gets the
        text as it is (it reads calls in its own syntax)."""
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        if self._mcp:
            try:
                call = format_named(call_format).parse(action_text,
                                                       {t.name: t for t in self.tools()})
            except ActionError as err:
                return err.observation, False, {"valid": False, "tool": err.tool,
                                                "error": err.kind}
            obs, error = self._call(call)
            return obs, self.done, {"valid": True, "tool": call.tool, "error": error}
        if not isinstance(action_text, str):
            return "error : action is not text", False, {"valid": False, "tool": None,
                                                         "error": "not_text"}
        data = self._step({self._text_field(): action_text})
        text, info = self._text(data), {
            "valid": data.get("valid") is not False, "tool": _text_or_none(data.get("tool")),
            "error": _text_or_none(data.get("error"))}
        if info["valid"] and info["error"] is None:  # what a response goal could ask for
            self.responses.append(text)
        return text, self.done, info

    def execute(self, call: ToolCall) -> str:
        if not self._mcp:  # a text-action server parses the call's text itself
            obs, _, info = self.step(call.text())
            if info["error"] is not None:
                raise ToolError(info["error"], obs)
            return obs
        obs, error = self._call(call)
        if error is not None:
            raise ToolError(error, obs)
        return obs

    def _call(self, call: ToolCall) -> tuple[str, str | None]:
        """One tool call through ``step``, so the server's reward and done come with it:
        (observation, the error kind or None)."""
        spec = {t.name: t for t in self.tools()}[call.tool]
        arguments = {a.name: v for a, v in zip(spec.args, call.args)}
        data = self._step({"type": "call_tool", "tool_name": self._remote[call.tool],
                           "arguments": arguments})
        error = data.get("error")
        if isinstance(error, dict):  # the tool failed: a refusal, the step stays valid
            text = self._clip(f"error : {_words(error.get('message'))}")
            return text, _words(error.get("error_type")) or "tool_error"
        text = self._text(data)
        self.responses.append(text)
        return text, None

    def _step(self, action: dict) -> dict:
        reply = self.session.send("step", action)
        observation = _field(reply, "observation", lambda v: isinstance(v, dict), "an object",
                             "step")
        reward = _field(reply, "reward", _is_reward, "a number", "step")
        self.done = bool(_field(reply, "done", lambda v: isinstance(v, bool), "true or false",
                                "step"))
        if reward is not None:
            self._rewards.append(float(reward))
        return observation

    # -- outcome --

    def evaluate(self, task: Task) -> float:
        """The server's reward for this episode (``reward`` option), for a task of this env's
        (:data:`SERVER_GOAL`); 0.0 for any other goal (exploration's empty one)."""
        if task.goal != SERVER_GOAL or not self._rewards:
            return 0.0
        return self._rewards[-1] if self.reward_mode == "last" else sum(self._rewards)

    def tasks(self, split: str) -> list[Task]:
        check_split(split)
        return [Task(f"openenv-{seed}", self.name, f"openenv episode {seed}", seed,
                     dict(SERVER_GOAL), split=split)
                for seed in range(self.seeds) if world_split(seed) == split]

    # -- tools --

    def tools(self) -> list[ToolSpec]:
        """An MCP server's tools (asked once); a text-action server's as its last reset
        observation listed them (none before a reset)."""
        if self._mcp is None:
            self._mcp = self._lists_tools()
        if self._mcp and self._tools is None:
            self._tools = self._mcp_tools()
            self._declare_limits()
        return list(self._tools or [])

    def _declare_limits(self) -> None:
        """This instance's ``default_limits`` once its tools are known: the ``max_context``
        their schemas, the request and :data:`TURN_ROOM` calls with their observations need
        (see the constants above), rounded up to a multiple of 256."""
        chars = len(json.dumps([schema_tool(t) for t in self._tools or []]))
        need = -(-chars // SCHEMA_CHARS_PER_TOKEN) + PROMPT_ROOM \
            + TURN_ROOM * (CALL_ROOM + 2 * self.max_obs_words)
        self.default_limits = {"max_context": -(-need // 256) * 256}

    def _lists_tools(self) -> bool:
        """Whether the server answers MCP ``tools/list`` (an MCP-tool server)."""
        reply = self.session.send("mcp", {"jsonrpc": "2.0", "method": "tools/list", "id": 1})
        self._listed = reply.get("result")
        return isinstance(self._listed, dict) and reply.get("error") is None

    def _mcp_tools(self) -> list[ToolSpec]:
        tools = self._listed.get("tools")
        if not isinstance(tools, list):
            raise EnvFailed("bad_reply", "OpenEnv tools/list: field result.tools: expected a "
                            f"list of tools, got {_kind(tools)}")
        return self._specs(tools, "tools/list")

    def _listed_tools(self, observation: dict) -> list[ToolSpec]:
        tools = observation.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise EnvFailed("bad_reply", "OpenEnv reset observation: field tools: expected a "
                            f"list of tools, got {_kind(tools)}")
        return self._specs(tools, "reset observation") if tools else []

    def _specs(self, tools: list, where: str) -> list[ToolSpec]:
        try:
            specs = [tool_from_schema(t) for t in tools]
        except ValueError as exc:
            raise EnvFailed("bad_reply", f"OpenEnv {where}: {exc}") from None
        remote = {s.name: t["name"] for s, t in zip(specs, tools)}
        if len(remote) < len(specs):
            raise EnvFailed("bad_reply", f"OpenEnv {where}: two tools share the name "
                            "(after - and . become _) of one of "
                            + ", ".join(t["name"] for t in tools))
        self._remote = remote
        return specs

    def _text_field(self) -> str:
        if not self.action_field:
            action = self.session.schema()["action"]
            props, required = action.get("properties", {}), action.get("required", [])
            if not isinstance(props, dict) or not isinstance(required, list):
                field, got = ("properties", props) if not isinstance(props, dict) \
                    else ("required", required)
                raise EnvFailed("bad_reply", f"OpenEnv /schema: field action.{field}: expected "
                                f"{'an object' if field == 'properties' else 'a list of names'}"
                                f", got {_kind(got)}")
            try:
                text = [n for n, p in props.items() if n in required and isinstance(p, dict)
                        and _json_type(p, f"/schema action.properties.{n}") == "string"]
            except ValueError as exc:
                raise EnvFailed("bad_reply", f"OpenEnv {exc}") from None
            if len(text) != 1:
                raise EnvFailed("bad_reply", f"OpenEnv /schema: the action requires "
                                f"{len(text)} string fields ({', '.join(text) or 'none'}); "
                                "set env.options.action_field")
            self.action_field = text[0]
        return self.action_field

    def candidate_actions(self) -> list[str]:
        """The calls it can enumerate: tools whose arguments all have choices (or are bool),
        at most :data:`MAX_CANDIDATES`. Others take free values: leave actor.constrained off."""
        out = []
        for tool in self.tools():
            domains = [a.choices or ((True, False) if a.type == "bool" else None)
                       for a in tool.args if a.required]
            if all(d is not None for d in domains):
                out += [" ".join([tool.name, *map(str, c)]) for c in
                        itertools.islice(itertools.product(*domains), MAX_CANDIDATES)]
        return out[:MAX_CANDIDATES]

    @classmethod
    def vocabulary(cls) -> list[str]:
        return []  # open: whatever the server says

    # -- what an OpenEnv server cannot offer --

    def state(self) -> dict:
        raise NotImplementedError(NO_STATE)

    def goal_from_states(self, before: dict, after: dict) -> dict:
        raise NotImplementedError(NO_STATE)

    def server_state(self) -> dict:
        """The server's own ``state`` of this session (episode id, step count, what else
        the env adds): for looking at, not a snapshot goals are checked on."""
        return self.session.send("state")

    # -- observations as text --

    def _text(self, observation: dict) -> str:
        """An observation as the text the model reads: its ``text`` field (``env serve
        --openenv``), a tool result's text content, its one text field, or its fields as
        JSON."""
        try:
            return self._clip(_render(observation))
        except RecursionError:
            raise EnvFailed("bad_reply", "OpenEnv observation: nests too deep to show") from None

    def _clip(self, text: str) -> str:
        """``text`` as the server wrote it (its line breaks too) unless it is too long."""
        words = len(text.split())
        return text if words <= self.max_obs_words else clip_words(text, self.max_obs_words)


def _render(observation: dict) -> str:
    if isinstance(observation.get("text"), str):
        return observation["text"]
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [c.get("text") for c in result["content"] if isinstance(c, dict)]
        return " ".join(t for t in texts if isinstance(t, str))
    if result is not None and "tool_name" in observation:
        return json.dumps(result, sort_keys=True, default=str)
    texts = [v for k, v in observation.items() if isinstance(v, str) and k != "tool_name"]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(observation, sort_keys=True, default=str)


def _text_or_none(value) -> str | None:
    return value if isinstance(value, str) else None
