"""The environment interface over the wire: one request per method of
``environments.base.Environment``, the replies, and their version.

``autodidact env serve SPEC`` answers these on one ZeroMQ ROUTER socket through the project's
codec (msgpack frames, every field validated on decode, nothing evaluated or unpickled; CURVE
with ``--keys-dir`` / ``env.keys_dir``);
``environments.remote.RemoteEnv`` sends them. A served env behaves like the same class in
process: what a method returns comes back as that value, and the exceptions the interface
defines (``ActionError``, ``ToolError``, ``NotImplementedError`` of a hook an env lacks, the
``ValueError`` of a bad split) come back as :class:`EnvRaised` and are raised again, as the
same types, by the client.

A conversation::

    EnvHello(version)                -> EnvServed: the env's name, vocabulary, class facts
    EnvOpen(version, session, options) -> EnvOpened(session, worker): one env instance on one
                                        worker, under the id the client chose (so the calls
                                        after it can ride in the same batch)
    EnvReset(session, task)          -> EnvValue(first observation)
    EnvStep(session, action, call_format) -> EnvStepped(observation, done, info,
                                        appended)
    ...                              (any request below, naming the session)
    EnvClose(session)                -> EnvValue(None)
    EnvBatch([frame, frame, ...])    -> EnvAnswers([frame, ...]), usually one: each request's
                                        own reply, as if sent one by one (those ready go out
                                        early while another call is slow)
    EnvStatsRequest()                -> EnvStats: the server's counters (alone or in a batch)

Any request may instead be answered :class:`EnvRaised` (the env raised) or
:class:`EnvFailure` (the service failed it: its worker died, the session is unknown, the
env's answer would not encode), and a frame that does not decode is answered
``protocol.messages.Error`` like on every other socket.

Authority (v6). Every frame to an env server carries, in its envelope's ``credential``, a
client token: one of the ``<name>.token`` files of the server's tokens directory
(:func:`tokens_dir`, made by the server at its first start; a batch's frames ride on the
batch's). A frame without one is refused ``unauthorized``; with CURVE keys the client's key
stands for it instead. The token (or key) names the *client*: a session belongs to the client
that opened it, another client's call on it is answered ``EnvFailure(not_yours)``, and each
client has a quota of sessions of its own (past it, its own least recently used closes).

Versions: :data:`ENV_WIRE_VERSION` names this set of messages. ``EnvHello`` and ``EnvOpen``
carry the client's; a server refuses another (:class:`EnvFailure` ``version``) rather than
serve a client it may misread. The frames themselves carry ``codec.SCHEMA_VERSION`` as
everywhere; adding these types needed no bump of it (an older server refuses them as
``unknown_type``).
"""

from __future__ import annotations

import builtins
import os
from dataclasses import field
from pathlib import Path
from typing import Any

from protocol.codec import message
from protocol.config import TOOL_FORMATS
from protocol.errors import SchemaError
from protocol.messages import Task
from protocol.run_dir import make_token_file

# v2: EnvBatch. v3: a batch's replies come bundled (EnvAnswers); the client names a new session
# (EnvOpen.session). v4: a step and the instructions name the call format the agent speaks;
# EnvCallGrammar. v5: the hello carries the class's train_worlds. v6: every frame carries a
# client token (or comes over CURVE); sessions belong to their client; the hello says the
# server's frame limit; EnvStatsRequest; failures not_yours, full, options.
# Bump on any incompatible change to a message below.
ENV_WIRE_VERSION = 6
# The largest frame a server reads unless started with --max-frame-bytes: a batch of a
# rollout's calls is a few KiB an episode (a files state about 2 KiB), and a client splits its
# batches to fit the limit the hello names.
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024

# Python's own exception types by name (not BaseException's others: a worker that is told to
# exit, exits). A served env's raise of one is raised again by the client as that type.
BUILTIN_ERRORS: dict[str, type] = {
    name: cls for name, cls in vars(builtins).items()
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, Warning)}
# The exceptions a served env's call may end in, raised again by the client as these types:
# the two the interface defines (ActionError, ToolError) and the builtins (its defaults raise
# NotImplementedError and ValueError). An env's own exception type comes back as the nearest
# builtin it derives from, its own name in the detail ("Exception" at the least).
RAISED = ("ActionError", "ToolError", *sorted(BUILTIN_ERRORS))

# Why the service, not the env, failed a call (EnvFailure.reason), and why a client gave up
# on one (environments.remote.EnvFailed.reason adds "timeout").
FAILURE_REASONS = (
    "worker_died",  # the worker holding the session exited (or was killed) during or before it
    "bad_reply",  # the env's answer would not encode, or a reply did not decode or fit
    "no_session",  # no such session: never opened, closed, or evicted for a newer one
    "session_taken",  # an EnvOpen named a session that is open already
    "version",  # the client speaks another ENV_WIRE_VERSION
    "no_worker",  # every worker is down and none came back within the server's wait
    "not_yours",  # the session was opened by another client (another token or CURVE key)
    "full",  # no worker has room for a new session and the client holds none to close
    "options",  # EnvOpen.options names an option this server keeps, or a value out of bounds
)
MAX_APPENDED = 1024  # observations one call may add to env.responses (a step adds one)


def _check_session(session: str) -> None:
    if not 0 < len(session) <= 64:
        raise SchemaError("invalid", "session is 1 to 64 characters", "session")


def _check_choice(value: str, allowed: tuple, name: str) -> None:
    if value not in allowed:
        raise SchemaError("invalid", f"{name} must be one of {', '.join(allowed)}", name)


# --- class-level ------------------------------------------------------------------------------


@message("env_hello")
class EnvHello:
    version: int  # the client's ENV_WIRE_VERSION


@message("env_served")
class EnvServed:
    version: int  # the server's ENV_WIRE_VERSION
    env: str  # the registered name of the served class (what Task.env holds)
    vocabulary: list[str]  # the class's vocabulary(): every word it can show, [] when open
    query_in_prompt: bool = True  # the class attribute of that name (see Environment)
    default_limits: dict = field(default_factory=dict)  # the class's default_limits
    # train_worlds of an env made with the server's options (an option may declare them)
    train_worlds: list[int] = field(default_factory=list)
    # the largest frame the server reads: a client splits its batches to stay under it
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # the constructor options a client may choose (Environment.client_options), described:
    # name -> "1 to 200" / "'world', 'task'"; every other option is the server's
    client_options: dict = field(default_factory=dict)


# --- sessions ---------------------------------------------------------------------------------


@message("env_open")
class EnvOpen:
    version: int  # the client's ENV_WIRE_VERSION
    # names the new env instance in every later request: chosen by the client (random, as
    # unguessable as a server's would be), so its first calls can follow in the same batch
    session: str
    # keyword arguments of the env's constructor the client chooses: only those the class
    # declares (Environment.client_options), within their bounds, and none the server fixed
    # to another value (``env serve --set env.options.x=...``); else EnvFailure(options)
    options: dict = field(default_factory=dict)

    def validate(self):
        _check_session(self.session)


@message("env_opened")
class EnvOpened:
    session: str  # the EnvOpen's
    worker: str = ""  # the worker holding it (its logs name the session): for diagnosis

    def validate(self):
        _check_session(self.session)


@message("env_close")
class EnvClose:
    session: str  # the instance to drop; closing an unknown one is not an error

    def validate(self):
        _check_session(self.session)


# --- one request per method: each names its session; the method's arguments follow ----------


@message("env_reset")
class EnvReset:
    session: str
    task: Task  # reset(task): build the task's world; answered with the first observation

    def validate(self):
        _check_session(self.session)


@message("env_tools")
class EnvTools:
    session: str  # tools(): answered EnvToolList

    def validate(self):
        _check_session(self.session)


@message("env_step")
class EnvStep:
    session: str
    action: str  # step(action, call_format): the model's action text; answered EnvStepped
    call_format: str = "text"  # how that text writes a call: one of config.TOOL_FORMATS

    def validate(self):
        _check_session(self.session)
        _check_choice(self.call_format, TOOL_FORMATS, "call_format")


@message("env_execute")
class EnvExecute:
    session: str
    tool: str  # execute(ToolCall(tool, args)): a parsed call, answered with its observation
    args: list[Any] = field(default_factory=list)  # the call's literal, typed arguments

    def validate(self):
        _check_session(self.session)


@message("env_state")
class EnvState:
    session: str  # state(): answered with the JSON-like snapshot

    def validate(self):
        _check_session(self.session)


@message("env_evaluate")
class EnvEvaluate:
    session: str
    task: Task  # evaluate(task): answered with the outcome reward

    def validate(self):
        _check_session(self.session)


@message("env_goal_progress")
class EnvGoalProgress:
    session: str
    task: Task  # goal_progress(task): answered with the fraction of the goal that holds

    def validate(self):
        _check_session(self.session)


@message("env_candidate_actions")
class EnvCandidateActions:
    session: str  # candidate_actions(): answered with a list of action texts

    def validate(self):
        _check_session(self.session)


@message("env_instructions")
class EnvInstructions:
    session: str  # instructions(call_format, list_tools): the system prompt or None
    call_format: str = "text"  # the reply form the prompt asks for: one of TOOL_FORMATS
    list_tools: bool = True  # False: the chat template shows the tools' schemas itself

    def validate(self):
        _check_session(self.session)
        _check_choice(self.call_format, TOOL_FORMATS, "call_format")


@message("env_call_grammar")
class EnvCallGrammar:
    session: str  # call_grammar(call_format): the grammar of its calls now, or None
    call_format: str = "text"  # the format the grammar writes calls in: one of TOOL_FORMATS

    def validate(self):
        _check_session(self.session)
        _check_choice(self.call_format, TOOL_FORMATS, "call_format")


@message("env_example_action")
class EnvExampleAction:
    session: str  # example_action(): answered with one action text or None

    def validate(self):
        _check_session(self.session)


@message("env_canonical_action")
class EnvCanonicalAction:
    session: str
    text: str  # canonical_action(text): answered with the text in the env's own syntax

    def validate(self):
        _check_session(self.session)


@message("env_tasks")
class EnvTasks:
    session: str
    split: str  # tasks(split): answered EnvTaskList (a name outside SPLITS: ValueError)

    def validate(self):
        _check_session(self.session)


@message("env_goal_from_states")
class EnvGoalFromStates:
    session: str
    before: dict  # goal_from_states(before, after): answered with the goal
    after: dict

    def validate(self):
        _check_session(self.session)


@message("env_describe_changes")
class EnvDescribeChanges:
    session: str
    before: dict  # describe_changes(before, after): answered EnvParts, one per change
    after: dict

    def validate(self):
        _check_session(self.session)


@message("env_describe_event")
class EnvDescribeEvent:
    session: str
    action: str  # describe_event(action, observation, before, after): EnvParts, 0 or 1
    observation: str
    before: dict
    after: dict

    def validate(self):
        _check_session(self.session)


@message("env_describe_response")
class EnvDescribeResponse:
    session: str
    action: str  # describe_response(action, observation, before): EnvParts, 0 or 1
    observation: str
    before: dict

    def validate(self):
        _check_session(self.session)


@message("env_entities")
class EnvEntities:
    session: str
    state: dict  # entities(state): answered with a list of {"type", "name", "attributes"}

    def validate(self):
        _check_session(self.session)


@message("env_goal_of")
class EnvGoalOf:
    session: str
    conditions: list[Any]  # goal_of(conditions): answered with the goal

    def validate(self):
        _check_session(self.session)


@message("env_query_of")
class EnvQueryOf:
    session: str
    texts: list[str]  # query_of(texts): answered with one query

    def validate(self):
        _check_session(self.session)


# The requests that name a session, by the Environment method each one calls.
SESSION_REQUESTS: dict[type, str] = {
    EnvClose: "close", EnvReset: "reset", EnvTools: "tools", EnvStep: "step",
    EnvExecute: "execute", EnvState: "state", EnvEvaluate: "evaluate",
    EnvGoalProgress: "goal_progress", EnvCandidateActions: "candidate_actions",
    EnvInstructions: "instructions", EnvCallGrammar: "call_grammar",
    EnvExampleAction: "example_action",
    EnvCanonicalAction: "canonical_action", EnvTasks: "tasks",
    EnvGoalFromStates: "goal_from_states", EnvDescribeChanges: "describe_changes",
    EnvDescribeEvent: "describe_event", EnvDescribeResponse: "describe_response",
    EnvEntities: "entities", EnvGoalOf: "goal_of", EnvQueryOf: "query_of",
}
MAX_BATCH_CALLS = 4096  # requests in one EnvBatch


@message("env_batch")
class EnvBatch:
    """Several requests in one frame: what a rollout asks of all its episodes in one turn. The
    server handles each as if it had come alone, in the order given (one session's calls run
    in that order), and answers each with its own reply frame under its own msg_id, those
    frames bundled in :class:`EnvAnswers` under the batch's msg_id as they are ready (one
    message per worker's share, not one per call); a batch refused whole gets one ``Error``
    instead."""

    frames: list[bytes]  # whole codec frames, each an EnvOpen or a session request

    def validate(self):
        if not 0 < len(self.frames) <= MAX_BATCH_CALLS:
            raise SchemaError("invalid", f"a batch holds 1 to {MAX_BATCH_CALLS} requests",
                              "frames")


@message("env_stats_request")
class EnvStatsRequest:
    """The server's counters, answered :class:`EnvStats` (a client with a token may ask)."""


@message("env_stats")
class EnvStats:
    rejected: dict = field(default_factory=dict)  # frames refused, by reason (unauthorized,
    # oversize, not_msgpack, ...: protocol.errors.REJECT_REASONS; auth: CURVE handshakes)
    failures: dict = field(default_factory=dict)  # calls failed, by FAILURE_REASONS
    sessions: int = 0  # sessions open on the server, every client's
    yours: int = 0  # of them, the asking client's
    evicted: int = 0  # sessions closed to make room for their own client's newer ones
    clients: int = 0  # clients (tokens or keys) the server serves


BATCHED = (EnvOpen, EnvStatsRequest, *SESSION_REQUESTS)  # what an EnvBatch may carry
REQUESTS = (EnvHello, EnvBatch, *BATCHED)  # everything an env server is sent


@message("env_answers")
class EnvAnswers:
    """Replies to requests of one EnvBatch (under its msg_id), each a whole codec frame under
    its request's msg_id; a batch is answered by one or more of these, every request once."""

    frames: list[bytes]  # reply frames, any order across sessions, one session's in order

    def validate(self):
        if not 0 < len(self.frames) <= MAX_BATCH_CALLS:
            raise SchemaError("invalid", f"1 to {MAX_BATCH_CALLS} replies", "frames")


# --- replies ----------------------------------------------------------------------------------


@message("env_value")
class EnvValue:
    value: Any = None  # the method's return value (JSON-like: str, number, list, map, None)
    # observations the call added to env.responses (reset clears the list; step adds one per
    # successful call), so the client's copy stays the server's
    appended: list[str] = field(default_factory=list)

    def validate(self):
        if len(self.appended) > MAX_APPENDED:
            raise SchemaError("invalid", f"more than {MAX_APPENDED} observations", "appended")


@message("env_stepped")
class EnvStepped:
    observation: str  # step()'s (observation, done, info)
    done: bool
    info: dict = field(default_factory=dict)  # valid, tool, error (and env-specific keys)
    appended: list[str] = field(default_factory=list)  # as EnvValue.appended


@message("env_arg")
class WireArg:
    name: str  # environments.base.ArgSpec, field by field
    type: str = "str"
    description: str = ""
    required: bool = True
    choices: list[Any] = field(default_factory=list)
    bounds: list[Any] | None = None  # [low, high] of an int or float argument
    kind: str = ""


@message("env_tool")
class WireTool:
    name: str  # environments.base.ToolSpec, field by field
    description: str = ""
    args: list[WireArg] = field(default_factory=list)


@message("env_tool_list")
class EnvToolList:
    tools: list[WireTool]  # tools(), in the env's order


@message("env_task_list")
class EnvTaskList:
    tasks: list[Task]  # tasks(split), in the env's order


@message("env_part")
class WirePart:
    conditions: list[Any]  # environments.base.GoalPart, field by field
    text: str | None = None
    entities: list[str] = field(default_factory=list)


@message("env_parts")
class EnvParts:
    # describe_changes' parts; describe_event and describe_response answer [] for None
    parts: list[WirePart] = field(default_factory=list)


@message("env_raised")
class EnvRaised:
    error: str  # one of RAISED: the exception type the client raises again
    detail: str = ""  # its message ("ZeroDivisionError: ..." where error is "Exception")
    kind: str = ""  # ActionError / ToolError: their kind
    observation: str = ""  # ActionError / ToolError: the text the agent sees
    tool: str | None = None  # ActionError: the tool the action named, if any

    def validate(self):
        _check_choice(self.error, RAISED, "error")


@message("env_failure")
class EnvFailure:
    reason: str  # one of FAILURE_REASONS
    detail: str = ""  # one line: what failed and what to do
    stderr: list[str] = field(default_factory=list)  # the worker's last stderr lines

    def validate(self):
        _check_choice(self.reason, FAILURE_REASONS, "reason")



# --- what a client may choose: Environment.client_options ----------------------------------


def allows(allowed, value) -> bool:
    """Whether ``value`` is among what an ``Environment.client_options`` entry allows: a
    ``range`` of ints, or a collection of choices (a bool is no int here, nor 1 True)."""
    if isinstance(allowed, range):
        return type(value) is int and value in allowed
    return any(type(value) is type(c) and value == c for c in allowed)


def describe_allowed(allowed) -> str:
    """An ``Environment.client_options`` entry as words: ``1 to 200``, ``'world', 'task'``."""
    if isinstance(allowed, range):
        return f"{allowed.start} to {allowed.stop - 1}"
    return ", ".join(repr(c) for c in allowed)


# --- authority: the client tokens --------------------------------------------------------------

TOKENS_ENV = "AUTODIDACT_ENV_TOKENS"  # the tokens directory, where not ~/.autodidact/env_tokens
TOKEN_FILE_ENV = "AUTODIDACT_ENV_TOKEN_FILE"  # a client's token file, where not the default
CLIENT = "client"  # the token a server makes at its first start; what a client presents
TOKEN_SUFFIX = ".token"


def tokens_dir() -> Path:
    """Where an env server keeps its clients' tokens (``<client>.token``, mode 0600, in a
    0700 directory) unless started with ``--tokens-dir``: ``$AUTODIDACT_ENV_TOKENS``, else
    ``~/.autodidact/env_tokens``. The same place on the clients' side is where they look."""
    return Path(os.environ.get(TOKENS_ENV) or "~/.autodidact/env_tokens").expanduser()


def client_token_file() -> Path:
    """The token file a client presents: ``$AUTODIDACT_ENV_TOKEN_FILE``, else
    ``<tokens_dir()>/client.token`` (the one a server of this machine and user makes)."""
    named = os.environ.get(TOKEN_FILE_ENV)
    return Path(named).expanduser() if named else tokens_dir() / f"{CLIENT}{TOKEN_SUFFIX}"


def read_token(path: Path) -> str:
    """The token in ``path``; "" when there is none (the server then refuses the client)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def make_token(path: Path) -> str:
    """A new token at ``path`` (its directory made 0700), mode 0600, never replacing one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    make_token_file(path)
    return read_token(path)
