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
thread-safe); a call is sent once and never re-sent, since env calls change state. The calls a
rollout makes of all its episodes at once (``environments.base.call_all``) go in one
``EnvBatch`` frame, each still answered, and failed, on its own; their replies come back
bundled (``EnvAnswers``). The client names each session: a constructor opens it at once (and
raises what refused it), while sessions made together (``open_many``, what a rollout does)
send their open with their first call, in the same batch.

Every frame carries this client's token (``env_wire.client_token_file()``: the
``client.token`` an env server of this machine and user makes, or the file
``$AUTODIDACT_ENV_TOKEN_FILE`` names), which the server serves it by; with ``env.keys_dir`` the
CURVE key does. A batch stays under the frame limit the server's hello names.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence
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
from protocol import codec
from protocol import env_wire as wire
from protocol.config import EnvConfig
from protocol.errors import ConfigError, EnvFailed, SchemaError
from protocol.messages import Error, Task
from protocol.security import CurveKeys
from protocol.transport import ZmqChannel, new_id

log = logging.getLogger(__name__)

NEVER_RESEND_S = 1e9  # retry_after_s of the channel: an env call is not idempotent
POLL_S = 0.2  # how often a waiting call looks at the channel's refused-reply count
TIMINGS_KEPT = 100_000  # call timings a link keeps (the oldest go first)
BATCH_CALLS = wire.MAX_BATCH_CALLS // 2  # calls in one EnvBatch, and as many closes before them


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
    with the CURVE keys of ``keys_dir`` when given. Every frame carries ``token`` (default:
    the one in ``env_wire.client_token_file()``, "" where there is none)."""

    def __init__(self, address: str, timeout_s: float, keys_dir: str = "",
                 token: str | None = None):
        self.address, self.timeout_s = address, timeout_s
        self.curve = _client_keys(keys_dir) if keys_dir else None
        self.token_file = None if token is not None else wire.client_token_file()
        self.token = token if token is not None else wire.read_token(self.token_file)
        # the server's limit (its hello says it): a batch is split to stay under it
        self.max_frame_bytes = wire.DEFAULT_MAX_FRAME_BYTES
        self._local = threading.local()
        # Sessions whose env objects were collected: closed by the next call from any thread.
        # A finalizer must not use a socket itself: it can run inside a call on this thread.
        self._to_close: collections.deque = collections.deque()
        # (request type, seconds to its answer) of recent calls, any thread: what the env
        # socket costs a rollout (bench/env_rollouts.py reads it).
        self.timings: collections.deque = collections.deque(maxlen=TIMINGS_KEPT)

    def _channel(self) -> ZmqChannel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._local.channel = ZmqChannel(
                self.address, retry_after_s=NEVER_RESEND_S, curve=self.curve,
                credential=self.token)
        channel.credential = self.token  # read again since (reread_token)
        return channel

    def reread_token(self) -> bool:
        """Read the token file again (a server started just now makes it); whether the
        token changed."""
        if self.token_file is None:
            return False
        token, self.token = self.token, wire.read_token(self.token_file)
        return token != self.token

    def call(self, request) -> Any:
        """The reply to ``request``; EnvFailed when the service fails it."""
        reply = self.call_many([request])[0]
        if isinstance(reply, EnvFailed):
            raise reply
        return reply

    def call_many(self, requests: Sequence) -> list:
        """The reply to each request, or the EnvFailed that fails it, in order. They go out
        in one frame (``EnvBatch``; the server works on them side by side where they are on
        different workers); each must be answered within ``timeout_s`` of the last answer,
        as one call would."""
        sizes = [len(codec.encode_body(r)) + 64 for r in requests]  # its frame, about
        replies: list = [None] * len(requests)
        fits = []
        for i, size in enumerate(sizes):
            if size <= self.max_frame_bytes - 1024:
                fits.append(i)
            else:  # the server would refuse its frame: not sent
                replies[i] = EnvFailed("refused", f"{type(requests[i]).__name__} of {size} "
                                       f"bytes is over the frame limit of the env server at "
                                       f"{self.address} ({self.max_frame_bytes} bytes, its "
                                       "--max-frame-bytes): not sent")
        for batch in self._batches(fits, sizes):
            for i, reply in zip(batch, self._call_batch([requests[i] for i in batch])):
                replies[i] = reply
        return replies

    def _batches(self, indices: list[int], sizes: list[int]):
        """``indices`` in batches of at most BATCH_CALLS requests and half the server's frame
        limit (the other half for the closes that ride along, and the envelopes)."""
        budget, batch, size = self.max_frame_bytes // 2, [], 0
        for i in indices:
            if batch and (len(batch) >= BATCH_CALLS or size + sizes[i] > budget):
                yield batch
                batch, size = [], 0
            batch.append(i)
            size += sizes[i]
        if batch:
            yield batch

    def _call_batch(self, requests: Sequence) -> list:
        channel = self._channel()
        refused = sum(channel.dropped.values())
        sent = time.perf_counter()
        batch_id, waiting = self._send(channel, requests)
        replies: list = [None] * len(requests)
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail_waiting(waiting, requests, replies, False)
                break
            for rid, reply in _opened(channel, batch_id, channel.poll(min(left, POLL_S))):
                i = waiting.pop(rid, None)
                if i is not None:
                    what = type(requests[i]).__name__
                    self.timings.append((what, time.perf_counter() - sent))
                    replies[i] = self._checked(reply, what)
                    deadline = time.monotonic() + self.timeout_s
                elif rid == batch_id:  # the server refused the batch whole: none of it ran
                    failed = self._checked(reply, "a batch")
                    for i in waiting.values():
                        replies[i] = failed
                    waiting.clear()
            if waiting and sum(channel.dropped.values()) > refused:
                # a reply that did not decode: which calls it answered cannot be known
                self._fail_waiting(waiting, requests, replies, True)
        if batch_id is not None:
            channel.forget(batch_id)
        return replies

    def _send(self, channel: ZmqChannel, requests: Sequence) -> tuple[str | None, dict]:
        """Send ``requests``: one alone as itself, else in one EnvBatch after the sessions
        waiting to be closed (fire and forget: their replies are dropped unread, and the
        server drops an unknown session quietly). Returns the batch's msg_id (None when there
        is none) and each request's msg_id -> its index."""
        batchable = all(type(r) in wire.BATCHED for r in requests)  # a hello goes alone
        closes = [codec.encode(wire.EnvClose(session), "")
                  for session in (self._closes() if batchable else ())]
        if len(requests) == 1 and not closes:
            return None, {channel.send(requests[0]): 0}
        waiting = {new_id(): i for i in range(len(requests))}
        batch = wire.EnvBatch(closes + [codec.encode(requests[i], msg_id)
                                        for msg_id, i in waiting.items()])
        batch_id = channel.send(batch)
        channel.expect_parts(batch_id, batch)  # answered in parts (EnvAnswers)
        return batch_id, waiting

    def _fail_waiting(self, waiting: dict, requests, replies, refused: bool) -> None:
        """Fail every call still waiting: a reply that did not decode (``refused``, which of
        them it answered unknown) or none in time."""
        for i in waiting.values():
            what = type(requests[i]).__name__
            replies[i] = EnvFailed("bad_reply", f"the env server at {self.address} answered "
                                   f"{what} with a frame that does not decode") if refused \
                else EnvFailed("timeout", f"{what} not answered within {self.timeout_s:g} s "
                               f"(env.call_timeout_s) by the env server at {self.address}")
        waiting.clear()

    def _checked(self, reply, what: str):
        """The reply to a ``what`` request, or the EnvFailed it stands for."""
        if isinstance(reply, wire.EnvFailure):
            return EnvFailed(reply.reason, reply.detail, reply.stderr)
        if isinstance(reply, Error):
            presented = "" if reply.reason != "unauthorized" else (
                f" (this client presented {'no token' if not self.token else 'a token'}"
                f"{f' from {self.token_file}' if self.token_file else ''})")
            return EnvFailed("refused", f"the env server at {self.address} refused "
                             f"{what}: {reply.reason}: {reply.detail}{presented}")
        return reply

    def _closes(self) -> list[str]:
        """Sessions to close, taken off the queue (at most a batch's worth). Every thread's
        calls take from the one queue: each pop is its own, never a count read before."""
        taken: list[str] = []
        most = min(BATCH_CALLS, self.max_frame_bytes // 4 // 128)  # a close is < 128 bytes
        while len(taken) < most:
            try:
                taken.append(self._to_close.popleft())
            except IndexError:
                break
        return taken

    def close_later(self, session: str) -> None:
        """Close ``session`` with the next call (a finalizer's way: never blocks, never
        raises). Sessions never closed are evicted by the server in time."""
        self._to_close.append(session)

    def hello(self) -> wire.EnvServed:
        try:
            try:
                served = self.call(wire.EnvHello(wire.ENV_WIRE_VERSION))
            except EnvFailed as exc:  # a token made after this link read the file: again
                if not (exc.reason == "refused" and ": unauthorized:" in exc.detail
                        and self.reread_token()):
                    raise
                served = self.call(wire.EnvHello(wire.ENV_WIRE_VERSION))
        except EnvFailed as exc:
            if exc.reason != "timeout":
                raise
            raise EnvFailed("timeout", f"{exc.detail} (is `autodidact env serve` running "
                            "there?)") from None
        if not isinstance(served, wire.EnvServed):
            raise EnvFailed("bad_reply", f"EnvHello answered {type(served).__name__}")
        self.max_frame_bytes = max(64 * 1024, served.max_frame_bytes)
        return served

    def stats(self) -> wire.EnvStats:
        """The server's counters (refusals, failures, sessions: this client's among them)."""
        stats = self.call(wire.EnvStatsRequest())
        if not isinstance(stats, wire.EnvStats):
            raise EnvFailed("bad_reply", f"EnvStatsRequest answered {type(stats).__name__}")
        return stats


def _opened(channel: ZmqChannel, batch_id: str | None, replies: list) -> list:
    """``replies`` with each EnvAnswers to the batch ``batch_id`` opened into the
    (msg_id, reply) pairs it bundles; a bundled reply that does not decode is counted
    where the channel counts its own (``dropped``)."""
    opened = []
    for rid, reply in replies:
        if rid != batch_id or not isinstance(reply, wire.EnvAnswers):
            opened.append((rid, reply))
            continue
        for frame in reply.frames:
            try:
                envelope, inner = codec.decode(frame)
            except SchemaError as exc:
                channel.dropped[exc.reason] += 1
                log.warning("dropping an undecodable reply in a batch's answers: %s", exc)
                continue
            opened.append((envelope.msg_id, inner))
    return opened


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


def _session_call(calls: Callable[..., Generator]):
    """A session method written as a generator that yields its request and is sent back the
    reply, run here as one call; ``RemoteEnv.call_all`` runs many side by side."""
    @functools.wraps(calls)
    def method(self, *args):
        result = _run_calls(self._link, [self], [calls(self, *args)])[0]
        if isinstance(result, EnvFailed):
            raise result
        return result

    method.calls = calls
    return method


class RemoteEnv(Environment):
    """One session on an env server; see the module docstring. Made by :func:`served_class`,
    which binds ``_link`` and the served class's facts."""

    _link: EnvLink
    _vocabulary: tuple[str, ...] = ()

    def __init__(self, **options):
        """A session opened now: a refusal (the constructor's, or the service's) is raised
        here, as an in-process constructor's would be."""
        self._begin(options)
        self._opened(self._link.call(self._take_opening()))

    @classmethod
    def open_many(cls, n: int, options) -> list:
        """``n`` sessions, nothing asked yet: each is opened with its first call, in the same
        batch (an open refused fails that call)."""
        made: list = []
        for _ in range(n):
            env = cls.__new__(cls)
            env._begin(options)
            made.append(env)
        return made

    def _begin(self, options) -> None:
        super().__init__()
        self._failed: EnvFailed | None = None
        self.session = new_id()  # the client names it: its first calls follow its open
        self.worker = ""  # the worker holding it, once opened (for diagnosis)
        self._opening: wire.EnvOpen | None = wire.EnvOpen(wire.ENV_WIRE_VERSION, self.session,
                                                          dict(options))
        self._closer = weakref.finalize(self, self._link.close_later, self.session)
        self._closer.atexit = False  # at exit the server drops every session anyway

    def _take_opening(self) -> wire.EnvOpen | None:
        """This session's EnvOpen while it is still to be sent (once)."""
        opening, self._opening = self._opening, None
        return opening

    def _opened(self, reply) -> None:
        """Take the reply to this session's EnvOpen; raise what refused it, and fail every
        later call of the session."""
        if isinstance(reply, wire.EnvOpened) and reply.session == self.session:
            self.worker = reply.worker
            return
        if isinstance(reply, EnvFailed):
            self._failed = reply
            raise reply
        if isinstance(reply, wire.EnvRaised):  # the constructor refused the options
            self._failed = EnvFailed("no_session", f"it was never opened: {reply.error}: "
                                     f"{reply.detail}")
            raise_from_wire(reply)
        raise self._fail(f"EnvOpen answered {type(reply).__name__}")

    @classmethod
    def drain_timings(cls) -> list[tuple[str, float]]:
        """(request type, seconds to its answer) of the calls this process made to this
        server since the last drain, every session's."""
        timings = cls._link.timings
        return [timings.popleft() for _ in range(len(timings))]

    def close(self) -> None:
        """Drop the session on the server (with the link's next call; else once this object
        is collected)."""
        self._closer()

    @classmethod
    def call_all(cls, calls: Sequence[tuple[Environment, str, tuple]]) -> list:
        """Every call's request sent to the server together, one session's in the order
        given (see :func:`environments.base.call_all`)."""
        generators = [getattr(getattr(cls, method), "calls", None) for _, method, _ in calls]
        if None in generators:
            return super().call_all(calls)  # not all session calls (vocabulary)
        return _run_calls(cls._link, [env for env, _, _ in calls],
                          [calls_of(env, *args) for calls_of, (env, _, args)
                           in zip(generators, calls)])

    def _request(self, request_cls, *args):
        if self._failed is not None:
            raise EnvFailed(self._failed.reason, f"this env failed before: "
                            f"{self._failed.detail}", self._failed.stderr)
        return request_cls(self.session, *args)

    def _value(self, request_cls, *args, ok=lambda v: True, what: str = "a value"):
        reply = yield from self._reply(request_cls, wire.EnvValue, *args)
        self.responses.extend(reply.appended)
        if not ok(reply.value):
            raise self._fail(f"{wire.SESSION_REQUESTS[request_cls]}() answered "
                             f"{type(reply.value).__name__} where {what} was expected")
        return reply.value

    def _reply(self, request_cls, reply_cls, *args):
        reply = yield self._request(request_cls, *args)
        if isinstance(reply, wire.EnvRaised):
            raise_from_wire(reply)
        if not isinstance(reply, reply_cls):
            raise self._fail(f"{wire.SESSION_REQUESTS[request_cls]}() answered "
                             f"{type(reply).__name__}")
        return reply

    def _fail(self, detail: str) -> EnvFailed:
        self._failed = EnvFailed("bad_reply", detail)
        return self._failed

    # -- the interface: each a session call (one request, its reply read back) --

    @_session_call
    def reset(self, task: Task) -> str:
        self.responses = []
        observation = yield from self._value(wire.EnvReset, task, ok=_is_str,
                                             what="an observation")
        self.task = task
        return observation

    @_session_call
    def step(self, action_text: str, call_format: str = "text") -> tuple[str, bool, dict]:
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        if not isinstance(action_text, str):  # the wire carries text; the parser's refusal
            return "error : action is not text", False, {"valid": False, "tool": None,
                                                         "error": "not_text"}
        stepped = yield from self._reply(wire.EnvStep, wire.EnvStepped, action_text,
                                         call_format)
        self.responses.extend(stepped.appended)
        return stepped.observation, stepped.done, stepped.info

    @_session_call
    def execute(self, call: ToolCall) -> str:
        return (yield from self._value(wire.EnvExecute, call.tool, list(call.args), ok=_is_str,
                                       what="an observation"))

    @_session_call
    def tools(self) -> list[ToolSpec]:
        listed = yield from self._reply(wire.EnvTools, wire.EnvToolList)
        return [tool_from_wire(t) for t in listed.tools]

    @_session_call
    def state(self) -> dict:
        return (yield from self._value(wire.EnvState, ok=_is_map, what="a map"))

    @_session_call
    def evaluate(self, task: Task) -> float:
        return float((yield from self._value(wire.EnvEvaluate, task, ok=_is_number,
                                             what="a number")))

    @_session_call
    def goal_progress(self, task: Task) -> float:
        return float((yield from self._value(wire.EnvGoalProgress, task, ok=_is_number,
                                             what="a number")))

    @_session_call
    def tasks(self, split: str) -> list[Task]:
        return list((yield from self._reply(wire.EnvTasks, wire.EnvTaskList, split)).tasks)

    @_session_call
    def candidate_actions(self) -> list[str]:
        return (yield from self._value(wire.EnvCandidateActions, ok=_is_texts,
                                       what="a list of texts"))

    @_session_call
    def instructions(self, call_format: str = "text", list_tools: bool = True) -> str | None:
        return (yield from self._value(wire.EnvInstructions, call_format, list_tools,
                                       ok=_is_text_or_none, what="text or None"))

    @_session_call
    def call_grammar(self, call_format: str = "text") -> str | None:
        return (yield from self._value(wire.EnvCallGrammar, call_format, ok=_is_text_or_none,
                                       what="text or None"))

    @_session_call
    def example_action(self) -> str | None:
        return (yield from self._value(wire.EnvExampleAction, ok=_is_text_or_none,
                                       what="text or None"))

    @_session_call
    def canonical_action(self, text: str) -> str:
        return (yield from self._value(wire.EnvCanonicalAction, text, ok=_is_str, what="text"))

    @classmethod
    def vocabulary(cls) -> list[str]:
        return list(cls._vocabulary)

    @_session_call
    def goal_from_states(self, before: dict, after: dict) -> dict:
        return (yield from self._value(wire.EnvGoalFromStates, before, after, ok=_is_map,
                                       what="a goal"))

    @_session_call
    def describe_changes(self, before: dict, after: dict) -> list[GoalPart]:
        parts = (yield from self._reply(wire.EnvDescribeChanges, wire.EnvParts, before,
                                        after)).parts
        return [part_from_wire(p) for p in parts]

    @_session_call
    def describe_event(self, action: str, observation: str, before: dict,
                       after: dict) -> GoalPart | None:
        return (yield from self._one_part(wire.EnvDescribeEvent, action, observation, before,
                                          after))

    @_session_call
    def describe_response(self, action: str, observation: str, before: dict) -> GoalPart | None:
        return (yield from self._one_part(wire.EnvDescribeResponse, action, observation,
                                          before))

    def _one_part(self, request_cls, *args):
        parts = (yield from self._reply(request_cls, wire.EnvParts, *args)).parts
        if len(parts) > 1:
            raise self._fail(f"{wire.SESSION_REQUESTS[request_cls]}() answered "
                             f"{len(parts)} parts where one at most was expected")
        return part_from_wire(parts[0]) if parts else None

    @_session_call
    def entities(self, state: dict) -> list[dict]:
        return (yield from self._value(wire.EnvEntities, state,
                                       ok=lambda v: isinstance(v, list), what="a list"))

    @_session_call
    def goal_of(self, conditions: Sequence) -> dict:
        return (yield from self._value(wire.EnvGoalOf, list(conditions), ok=_is_map,
                                       what="a goal"))

    @_session_call
    def query_of(self, texts: Sequence[str]) -> str:
        return (yield from self._value(wire.EnvQueryOf, list(texts), ok=_is_str,
                                       what="a query"))


def _run_calls(link: EnvLink, envs: Sequence[RemoteEnv], calls: list[Generator]) -> list:
    """Run session calls side by side: each generator yields its request (a method may ask
    more than once), every round's requests go out together, and each gets its reply back.
    Returns each call's result, or the EnvFailed that failed it, in order; any other exception
    (the env's own, raised again here) propagates."""
    results: list = [None] * len(calls)
    replies: list = [None] * len(calls)
    live = list(range(len(calls)))
    while live:
        asked = []
        for i in live:
            try:
                asked.append((i, calls[i].send(replies[i])))
            except StopIteration as done:
                results[i] = done.value
            except EnvFailed as exc:
                results[i] = exc
        answers = _with_opens(link, envs, asked)
        live = []
        for (i, _), reply in zip(asked, answers):
            if isinstance(reply, EnvFailed):
                envs[i]._failed = results[i] = reply
                calls[i].close()
            else:
                replies[i] = reply
                live.append(i)
    return results


def _with_opens(link: EnvLink, envs: Sequence[RemoteEnv], asked: list[tuple[int, Any]]) -> list:
    """The replies to ``asked`` (env index, request), sent together, each session's EnvOpen
    still to be sent just before its request; a call whose session's open failed gets that
    failure, and one whose constructor refused raises that refusal here."""
    requests, opens = [], set()
    for i, request in asked:
        opening = envs[i]._take_opening()
        if opening is not None:
            opens.add(i)
            requests.append(opening)
        requests.append(request)
    answers = iter(link.call_many(requests) if requests else [])
    replies = []
    for i, _ in asked:
        if i in opens:
            try:
                envs[i]._opened(next(answers))
            except EnvFailed as exc:
                next(answers)  # the call itself, failed too (no such session)
                replies.append(exc)
                continue
        replies.append(next(answers))
    return replies


# --- the server's end: one request answered by one env instance -----------------------------


def _parts(part: GoalPart | None) -> wire.EnvParts:
    return wire.EnvParts([] if part is None else [part_to_wire(part)])


# What each session request calls, and the reply that carries its result.
_CALLS: dict[type, Callable[[Environment, Any], Any]] = {
    wire.EnvReset: lambda env, m: wire.EnvValue(env.reset(m.task)),
    wire.EnvTools: lambda env, m: wire.EnvToolList([tool_to_wire(t) for t in env.tools()]),
    wire.EnvStep: lambda env, m: wire.EnvStepped(*env.step(m.action, m.call_format)),
    wire.EnvExecute: lambda env, m: wire.EnvValue(env.execute(ToolCall(m.tool,
                                                                      tuple(m.args)))),
    wire.EnvState: lambda env, m: wire.EnvValue(env.state()),
    wire.EnvEvaluate: lambda env, m: wire.EnvValue(env.evaluate(m.task)),
    wire.EnvGoalProgress: lambda env, m: wire.EnvValue(env.goal_progress(m.task)),
    wire.EnvCandidateActions: lambda env, m: wire.EnvValue(list(env.candidate_actions())),
    wire.EnvInstructions: lambda env, m: wire.EnvValue(
        env.instructions(m.call_format, m.list_tools)),
    wire.EnvCallGrammar: lambda env, m: wire.EnvValue(env.call_grammar(m.call_format)),
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


def served_facts(cls: type[Environment],
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 train_worlds=None) -> wire.EnvServed:
    """The hello a server of ``cls`` answers: its name and class-level facts, and the
    largest frame it reads. ``train_worlds``: those of an env made with the server's options,
    where they differ from the class's."""
    worlds = cls.train_worlds if train_worlds is None else train_worlds
    return wire.EnvServed(wire.ENV_WIRE_VERSION, cls.name, list(cls.vocabulary()),
                          bool(cls.query_in_prompt), dict(cls.default_limits),
                          [int(seed) for seed in worlds], max_frame_bytes,
                          {name: wire.describe_allowed(allowed)
                           for name, allowed in cls.client_options.items()})


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
        "train_worlds": tuple(served.train_worlds),
        "__module__": __name__,
    })


register_served(served_class)
