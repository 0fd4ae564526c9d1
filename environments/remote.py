"""A served environment: an :class:`~environments.base.Environment` whose every method is a call
to an env server (``autodidact env serve``), over the messages of ``protocol/env_wire.py``.

``environments.base.env_class(env_cfg)`` returns :func:`served_class` of an ``EnvConfig`` whose
``address`` is set: a subclass of :class:`RemoteEnv` bound to that server, whose instances are
sessions there (one env instance each, on one of its workers). Class-level facts (the served
name, ``vocabulary()``, ``query_in_prompt``, ``default_limits``) come with the server's hello,
once per process. What a method returns, and the exceptions the interface defines, are the
same as in process; a call the *service* fails (no answer within ``env.call_timeout_s``, a
worker that died, a reply that does not decode or fit) raises
:class:`~protocol.errors.EnvFailed` instead, after which the instance is unusable.

One DEALER socket per thread and server carries every session's calls (zmq sockets are not
thread-safe); a call is sent once and never re-sent, since env calls change state.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from environments.base import (
    ActionError,
    ArgSpec,
    Environment,
    GoalPart,
    ToolCall,
    ToolError,
    ToolSpec,
    register_served,
)
from protocol import env_wire as wire
from protocol.config import EnvConfig
from protocol.errors import ConfigError, EnvFailed
from protocol.messages import Error, Task
from protocol.security import CurveKeys
from protocol.transport import ZmqChannel

NEVER_RESEND_S = 1e9  # retry_after_s of the channel: an env call is not idempotent
POLL_S = 0.2  # how often a waiting call looks at the channel's refused-reply count


# --- the interface's values on the wire, both ways ------------------------------------------


def tool_to_wire(tool: ToolSpec) -> wire.WireTool:
    return wire.WireTool(tool.name, tool.description, [
        wire.WireArg(a.name, a.type, a.description, a.required, list(a.choices),
                     list(a.bounds) if a.bounds is not None else None, a.kind)
        for a in tool.args])


def tool_from_wire(tool: wire.WireTool) -> ToolSpec:
    return ToolSpec(tool.name, tool.description, tuple(
        ArgSpec(a.name, a.type, a.description, a.required, tuple(a.choices),
                tuple(a.bounds) if a.bounds is not None else None, a.kind)
        for a in tool.args))


def part_to_wire(part: GoalPart) -> wire.WirePart:
    return wire.WirePart(list(part.conditions), part.text, list(part.entities))


def part_from_wire(part: wire.WirePart) -> GoalPart:
    return GoalPart(tuple(part.conditions), part.text, tuple(part.entities))


def raised_to_wire(exc: Exception) -> wire.EnvRaised:
    """The reply that makes the client raise ``exc`` again: as its own type where the wire
    names it (``wire.RAISED``), else as the nearest builtin it derives from, so an ``except``
    that caught it in process catches it served too."""
    if isinstance(exc, ActionError):
        return wire.EnvRaised("ActionError", str(exc), exc.kind, exc.observation, exc.tool)
    if isinstance(exc, ToolError):
        return wire.EnvRaised("ToolError", str(exc), exc.kind, exc.observation)
    base = next(c for c in type(exc).__mro__ if wire.BUILTIN_ERRORS.get(c.__name__) is c)
    one_text = len(exc.args) == 1 and isinstance(exc.args[0], str)  # KeyError("x"): not "'x'"
    detail = exc.args[0] if one_text else str(exc)
    if base is not type(exc):
        detail = f"{type(exc).__name__}: {detail}"
    return wire.EnvRaised(base.__name__, detail)


def raise_from_wire(raised: wire.EnvRaised):
    if raised.error == "ActionError":
        raise ActionError(raised.kind, raised.observation, raised.tool)
    if raised.error == "ToolError":
        raise ToolError(raised.kind, raised.observation)
    raise _rebuilt(wire.BUILTIN_ERRORS[raised.error], raised.detail)


def _rebuilt(cls: type, detail: str) -> Exception:
    """``cls(detail)``, or of its nearest base that takes one message (UnicodeDecodeError
    wants five arguments; UnicodeError, also a ValueError, takes the message)."""
    for base in cls.__mro__:
        try:
            return base(detail)
        except TypeError:
            continue
    raise AssertionError("Exception takes a message")  # every builtin derives from it


# --- the link to one server -------------------------------------------------------------------


class EnvLink:
    """Calls to the env server at ``address``, each answered within ``timeout_s``; encrypted
    with the CURVE keys of ``keys_dir`` when given."""

    def __init__(self, address: str, timeout_s: float, keys_dir: str = ""):
        self.address, self.timeout_s = address, timeout_s
        self.curve = _client_keys(keys_dir) if keys_dir else None
        self._local = threading.local()
        # Sessions whose env objects were collected: closed by the next call from any thread.
        # A finalizer must not use a socket itself: it can run inside a call on this thread.
        self._to_close: collections.deque = collections.deque()

    def _channel(self) -> ZmqChannel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._local.channel = ZmqChannel(
                self.address, retry_after_s=NEVER_RESEND_S, curve=self.curve)
        return channel

    def call(self, request) -> Any:
        """The reply to ``request``; EnvFailed when the service fails it."""
        channel = self._channel()
        while self._to_close:  # fire and forget: the server drops an unknown one quietly
            channel.forget(channel.send(wire.EnvClose(self._to_close.popleft())))
        refused = sum(channel.dropped.values())
        msg_id = channel.send(request)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                channel.forget(msg_id)
                raise EnvFailed("timeout", f"{type(request).__name__} not answered within "
                                f"{self.timeout_s:g} s (env.call_timeout_s) by the env server "
                                f"at {self.address}")
            for rid, reply in channel.poll(min(left, POLL_S)):
                if rid == msg_id:
                    return self._checked(reply, request)
            if sum(channel.dropped.values()) > refused:  # one call in flight: that was ours
                channel.forget(msg_id)
                raise EnvFailed("bad_reply", f"the env server at {self.address} answered "
                                f"{type(request).__name__} with a frame that does not decode")

    def _checked(self, reply, request):
        if isinstance(reply, wire.EnvFailure):
            raise EnvFailed(reply.reason, reply.detail, reply.stderr)
        if isinstance(reply, Error):
            raise EnvFailed("refused", f"the env server at {self.address} refused "
                            f"{type(request).__name__}: {reply.reason}: {reply.detail}")
        return reply

    def close_later(self, session: str) -> None:
        """Close ``session`` with the next call (a finalizer's way: never blocks, never
        raises). Sessions never closed are evicted by the server in time."""
        self._to_close.append(session)

    def hello(self) -> wire.EnvServed:
        try:
            served = self.call(wire.EnvHello(wire.ENV_WIRE_VERSION))
        except EnvFailed as exc:
            if exc.reason != "timeout":
                raise
            raise EnvFailed("timeout", f"{exc.detail} (is `autodidact env serve` running "
                            "there?)") from None
        if not isinstance(served, wire.EnvServed):
            raise EnvFailed("bad_reply", f"EnvHello answered {type(served).__name__}")
        return served


def _client_keys(keys_dir: str) -> CurveKeys:
    try:
        return CurveKeys.load(keys_dir)
    except ConfigError as exc:
        raise ConfigError(f"env.keys_dir: {exc}") from None


# --- the env ---------------------------------------------------------------------------------


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_text_or_none(v) -> bool:
    return v is None or isinstance(v, str)


def _is_number(v) -> bool:
    return isinstance(v, (int, float))  # a bool too: an env may answer evaluate() True


def _is_texts(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_map(v) -> bool:
    return isinstance(v, dict)


class RemoteEnv(Environment):
    """One session on an env server; see the module docstring. Made by :func:`served_class`,
    which binds ``_link`` and the served class's facts."""

    _link: EnvLink
    _vocabulary: tuple[str, ...] = ()

    def __init__(self, **options):
        super().__init__()
        self._failed: EnvFailed | None = None
        opened = self._link.call(wire.EnvOpen(wire.ENV_WIRE_VERSION, dict(options)))
        if isinstance(opened, wire.EnvRaised):  # the constructor refused the options
            raise_from_wire(opened)
        if not isinstance(opened, wire.EnvOpened):
            raise EnvFailed("bad_reply", f"EnvOpen answered {type(opened).__name__}")
        self.session = opened.session
        self._closer = weakref.finalize(self, self._link.close_later, self.session)
        self._closer.atexit = False  # at exit the server drops every session anyway

    def close(self) -> None:
        """Drop the session on the server (with the link's next call; else once this object
        is collected)."""
        self._closer()

    def _call(self, request_cls, *args):
        if self._failed is not None:
            raise EnvFailed(self._failed.reason, f"this env failed before: "
                            f"{self._failed.detail}", self._failed.stderr)
        try:
            reply = self._link.call(request_cls(self.session, *args))
        except EnvFailed as exc:
            self._failed = exc
            raise
        if isinstance(reply, wire.EnvRaised):
            raise_from_wire(reply)
        return reply

    def _value(self, request_cls, *args, ok=lambda v: True, what: str = "a value"):
        reply = self._call(request_cls, *args)
        method = wire.SESSION_REQUESTS[request_cls]
        if not isinstance(reply, wire.EnvValue):
            raise self._fail(f"{method}() answered {type(reply).__name__}")
        self.responses.extend(reply.appended)
        if not ok(reply.value):
            raise self._fail(f"{method}() answered {type(reply.value).__name__} where {what} "
                             "was expected")
        return reply.value

    def _reply(self, request_cls, reply_cls, *args):
        reply = self._call(request_cls, *args)
        if not isinstance(reply, reply_cls):
            raise self._fail(f"{wire.SESSION_REQUESTS[request_cls]}() answered "
                             f"{type(reply).__name__}")
        return reply

    def _fail(self, detail: str) -> EnvFailed:
        self._failed = EnvFailed("bad_reply", detail)
        return self._failed

    # -- the interface --

    def reset(self, task: Task) -> str:
        self.responses = []
        observation = self._value(wire.EnvReset, task, ok=_is_str, what="an observation")
        self.task = task
        return observation

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        if not isinstance(action_text, str):  # the wire carries text; the parser's refusal
            return "error : action is not text", False, {"valid": False, "tool": None,
                                                         "error": "not_text"}
        stepped = self._reply(wire.EnvStep, wire.EnvStepped, action_text)
        self.responses.extend(stepped.appended)
        return stepped.observation, stepped.done, stepped.info

    def execute(self, call: ToolCall) -> str:
        return self._value(wire.EnvExecute, call.tool, list(call.args), ok=_is_str,
                           what="an observation")

    def tools(self) -> list[ToolSpec]:
        return [tool_from_wire(t) for t in self._reply(wire.EnvTools, wire.EnvToolList).tools]

    def state(self) -> dict:
        return self._value(wire.EnvState, ok=_is_map, what="a map")

    def evaluate(self, task: Task) -> float:
        return float(self._value(wire.EnvEvaluate, task, ok=_is_number, what="a number"))

    def goal_progress(self, task: Task) -> float:
        return float(self._value(wire.EnvGoalProgress, task, ok=_is_number, what="a number"))

    def tasks(self, split: str) -> list[Task]:
        return list(self._reply(wire.EnvTasks, wire.EnvTaskList, split).tasks)

    def candidate_actions(self) -> list[str]:
        return self._value(wire.EnvCandidateActions, ok=_is_texts, what="a list of texts")

    def instructions(self) -> str | None:
        return self._value(wire.EnvInstructions, ok=_is_text_or_none, what="text or None")

    def example_action(self) -> str | None:
        return self._value(wire.EnvExampleAction, ok=_is_text_or_none, what="text or None")

    def canonical_action(self, text: str) -> str:
        return self._value(wire.EnvCanonicalAction, text, ok=_is_str, what="text")

    @classmethod
    def vocabulary(cls) -> list[str]:
        return list(cls._vocabulary)

    def goal_from_states(self, before: dict, after: dict) -> dict:
        return self._value(wire.EnvGoalFromStates, before, after, ok=_is_map, what="a goal")

    def describe_changes(self, before: dict, after: dict) -> list[GoalPart]:
        parts = self._reply(wire.EnvDescribeChanges, wire.EnvParts, before, after).parts
        return [part_from_wire(p) for p in parts]

    def describe_event(self, action: str, observation: str, before: dict,
                       after: dict) -> GoalPart | None:
        return self._one_part(wire.EnvDescribeEvent, action, observation, before, after)

    def describe_response(self, action: str, observation: str, before: dict) -> GoalPart | None:
        return self._one_part(wire.EnvDescribeResponse, action, observation, before)

    def _one_part(self, request_cls, *args) -> GoalPart | None:
        parts = self._reply(request_cls, wire.EnvParts, *args).parts
        if len(parts) > 1:
            raise self._fail(f"{wire.SESSION_REQUESTS[request_cls]}() answered "
                             f"{len(parts)} parts where one at most was expected")
        return part_from_wire(parts[0]) if parts else None

    def entities(self, state: dict) -> list[dict]:
        return self._value(wire.EnvEntities, state, ok=lambda v: isinstance(v, list),
                           what="a list")

    def goal_of(self, conditions: Sequence) -> dict:
        return self._value(wire.EnvGoalOf, list(conditions), ok=_is_map, what="a goal")

    def query_of(self, texts: Sequence[str]) -> str:
        return self._value(wire.EnvQueryOf, list(texts), ok=_is_str, what="a query")


# --- the server's end: one request answered by one env instance -----------------------------


def _parts(part: GoalPart | None) -> wire.EnvParts:
    return wire.EnvParts([] if part is None else [part_to_wire(part)])


# What each session request calls, and the reply that carries its result.
_CALLS: dict[type, Callable[[Environment, Any], Any]] = {
    wire.EnvReset: lambda env, m: wire.EnvValue(env.reset(m.task)),
    wire.EnvTools: lambda env, m: wire.EnvToolList([tool_to_wire(t) for t in env.tools()]),
    wire.EnvStep: lambda env, m: wire.EnvStepped(*env.step(m.action)),
    wire.EnvExecute: lambda env, m: wire.EnvValue(env.execute(ToolCall(m.tool,
                                                                      tuple(m.args)))),
    wire.EnvState: lambda env, m: wire.EnvValue(env.state()),
    wire.EnvEvaluate: lambda env, m: wire.EnvValue(env.evaluate(m.task)),
    wire.EnvGoalProgress: lambda env, m: wire.EnvValue(env.goal_progress(m.task)),
    wire.EnvCandidateActions: lambda env, m: wire.EnvValue(list(env.candidate_actions())),
    wire.EnvInstructions: lambda env, m: wire.EnvValue(env.instructions()),
    wire.EnvExampleAction: lambda env, m: wire.EnvValue(env.example_action()),
    wire.EnvCanonicalAction: lambda env, m: wire.EnvValue(env.canonical_action(m.text)),
    wire.EnvTasks: lambda env, m: wire.EnvTaskList(list(env.tasks(m.split))),
    wire.EnvGoalFromStates: lambda env, m: wire.EnvValue(env.goal_from_states(m.before,
                                                                               m.after)),
    wire.EnvDescribeChanges: lambda env, m: wire.EnvParts(
        [part_to_wire(p) for p in env.describe_changes(m.before, m.after)]),
    wire.EnvDescribeEvent: lambda env, m: _parts(
        env.describe_event(m.action, m.observation, m.before, m.after)),
    wire.EnvDescribeResponse: lambda env, m: _parts(
        env.describe_response(m.action, m.observation, m.before)),
    wire.EnvEntities: lambda env, m: wire.EnvValue(list(env.entities(m.state))),
    wire.EnvGoalOf: lambda env, m: wire.EnvValue(env.goal_of(m.conditions)),
    wire.EnvQueryOf: lambda env, m: wire.EnvValue(env.query_of(m.texts)),
}


def served_facts(cls: type[Environment]) -> wire.EnvServed:
    """The hello a server of ``cls`` answers: its name and class-level facts."""
    return wire.EnvServed(wire.ENV_WIRE_VERSION, cls.name, list(cls.vocabulary()),
                          bool(cls.query_in_prompt), dict(cls.default_limits))


def answer(env: Environment, request):
    """The reply to one session request, made by calling ``env``: its result, or EnvRaised
    for what it raised. The observations the call added to ``env.responses`` ride along."""
    kept, count = env.responses, len(env.responses)
    try:
        reply = _CALLS[type(request)](env, request)
    except Exception as exc:  # the env's own refusal or bug: the client raises it again
        return raised_to_wire(exc)
    if isinstance(reply, (wire.EnvValue, wire.EnvStepped)):
        reply.appended = list(env.responses[count:] if env.responses is kept
                              else env.responses)
    return reply


# --- the class an EnvConfig with an address names ---------------------------------------------

_SERVED: dict[tuple[str, float, str], type[RemoteEnv]] = {}
_SERVED_LOCK = threading.Lock()


def served_class(env_cfg: EnvConfig) -> type[RemoteEnv]:
    """The class of sessions on the env server at ``env_cfg.address`` (its hello asked once per
    process and server). ConfigError when the server serves another env than ``env.name``."""
    key = (env_cfg.address, float(env_cfg.call_timeout_s), env_cfg.keys_dir)
    with _SERVED_LOCK:
        cls = _SERVED.get(key)
        if cls is None:
            cls = _SERVED[key] = _bind(EnvLink(*key))
    wanted = env_cfg.name.rpartition(":")[2]  # a plugin "pkg.module:name" registers "name"
    if cls.name != wanted:
        raise ConfigError(f"env.name is {env_cfg.name!r} but the env server at "
                          f"{env_cfg.address} serves {cls.name!r}: set env.name={cls.name}")
    return cls


def _bind(link: EnvLink) -> type[RemoteEnv]:
    served = link.hello()
    if served.version != wire.ENV_WIRE_VERSION:
        raise EnvFailed("version", f"the env server at {link.address} speaks env wire "
                        f"v{served.version}, this client v{wire.ENV_WIRE_VERSION}")
    return type(f"Served_{served.env}", (RemoteEnv,), {
        "name": served.env, "_link": link, "_vocabulary": tuple(served.vocabulary),
        "query_in_prompt": served.query_in_prompt,
        "default_limits": dict(served.default_limits),
        "__module__": __name__,
    })


register_served(served_class)
