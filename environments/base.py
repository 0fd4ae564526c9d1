"""The interface every tool-use sandbox implements, its action parser, and the env registry.

An environment is untrusted ground for model output: an action is text that is *parsed* into a
declared tool and literal arguments, never evaluated. Anything that does not parse becomes an
error observation with ``info["valid"] = False``; nothing the model writes can raise.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import logging
import re
import shlex
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from protocol.config import EnvConfig, coerce
from protocol.errors import ConfigError, EnvFailed
from protocol.messages import SPLITS, Task

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class ArgSpec:
    """One tool argument: a name, a literal type (one of ARG_TYPES), whether it is required,
    and, where the environment knows it, its domain (what self-questioning draws from)."""

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
        if self.kind not in ("", "id"):
            raise ValueError(f"arg {self.name!r}: kind is '' or 'id'")

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


@dataclass(frozen=True)
class GoalPart:
    """One change an exploration made, as goal conditions plus the environment's words for it.

    Task synthesis combines a few parts into one task: their conditions become the goal (via
    :meth:`Environment.goal_of`) and their texts the query (via :meth:`Environment.query_of`).
    """

    conditions: tuple  # env-specific, JSON-able goal conditions that pin this change
    text: str | None = None  # the change in the env's own words; None: it cannot say it
    entities: tuple[str, ...] = ()  # names of the entities involved (preference filters)


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

# --- the interface ----------------------------------------------------------------------------


class Environment(ABC):
    """A multi-step tool sandbox: reset to a task, step with action text, evaluate the outcome.

    Subclasses declare their tools and implement :meth:`execute` for one parsed call; the
    concrete :meth:`step` does the parsing, turns refusals into error observations and reports
    ``done`` once the current task's goal holds. The turn limit belongs to the caller.
    """

    name: str = ""  # registry name, set by @register_env
    # False where reset()'s observation already carries the request (BFCL's user turns): the
    # prompt then shows the observation alone instead of query + observation.
    query_in_prompt: bool = True
    # Rollout limits this env needs when no config sets them (``autodidact eval --env``):
    # keys max_turns and max_context (env section) and max_action_tokens (actor section).
    default_limits: dict = {}

    def __init__(self):
        self.task: Task | None = None
        # Observations of successful calls this episode; goals may ask for a response (a task
        # answered by reading, not by changing state). ``reset`` must start a new list.
        self.responses: list[str] = []

    @abstractmethod
    def reset(self, task: Task) -> str:
        """Build the task's initial state (from ``task.seed``), clear ``self.responses`` and
        return the first observation."""

    @abstractmethod
    def execute(self, call: ToolCall) -> str:
        """Apply one parsed call and return its observation; raise ToolError to refuse it."""

    @abstractmethod
    def tools(self) -> list[ToolSpec]:
        """The declared tools; only these can be called."""

    @abstractmethod
    def state(self) -> dict:
        """A JSON-able snapshot of the state, comparable with ``==``; goals are checked on it."""

    @abstractmethod
    def evaluate(self, task: Task) -> float:
        """Outcome reward of the current state for ``task`` (1.0 success, 0.0 failure)."""

    def instructions(self) -> str | None:
        """The system prompt for the current task (tool documentation, output format), or None.

        Chat-template prompts put it in the system message; the word-level marker prompt of
        the tiny policy leaves it out (its vocabulary cannot spell tool documentation). The
        default, made from :meth:`tools`, tells an instruct model the tools, their arguments,
        the one-call-per-turn form :func:`parse_action` reads and one example call."""
        return tool_instructions(self.name or type(self).__name__, self.tools(),
                                 self.example_action())

    def example_action(self) -> str | None:
        """One call to show in the instructions: the first candidate action now that takes
        an argument (None: the instructions show none)."""
        candidates = self.candidate_actions()
        with_args = [a for a in candidates if " " in a.strip()]
        return (with_args or candidates or [None])[0]

    def canonical_action(self, text: str) -> str:
        """``text`` in the action syntax this env trains on. Explorers propose shell-style
        ``tool arg ...`` text; an env with its own syntax (Python calls) rewrites it here so
        synthesized references read like the actions the policy is asked for."""
        return text

    def goal_progress(self, task: Task) -> float:
        """Fraction of the task's goal that holds now, in [0, 1].

        Step judges compare it before and after each step to see which steps moved the state
        toward the goal. The default knows only all-or-nothing: ``self.evaluate(task)``;
        environments whose goals have parts override it."""
        return self.evaluate(task)

    @abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """The environment's own tasks of ``split``: ``"train"`` (trained on and explored),
        ``"validation"`` (held out; settings are chosen on it) or ``"test"`` (held out; looked
        at once, when asked). Held-out splits should be whole worlds (seeds) no training task
        uses (:func:`world_split` does it by seed); :func:`check_split` refuses other names."""

    @abstractmethod
    def candidate_actions(self) -> list[str]:
        """Every well-formed call the agent could make now, as action text (bounded)."""

    @classmethod
    @abstractmethod
    def vocabulary(cls) -> list[str]:
        """Every whitespace-separated word of any query, observation or action this env makes,
        its refusals included (:func:`parser_words` lists the parser's own); ``[]`` for an open
        vocabulary."""

    def goal_from_states(self, before: dict, after: dict) -> dict:
        """A goal that holds exactly where ``after`` differs from ``before`` (hindsight tasks)."""
        raise NotImplementedError(f"{type(self).__name__} cannot derive goals from states")

    # -- hooks for self-questioning; the defaults work for any env with goal_from_states --

    def describe_changes(self, before: dict, after: dict) -> list[GoalPart]:
        """Split the change from ``before`` to ``after`` into parts a task can ask for.

        The default is one part without words (the whole state difference); environments that
        can name their changes ("move x into f") return one part per change."""
        conditions = self.goal_from_states(before, after).get("all", [])
        return [GoalPart(tuple(conditions))] if conditions else []

    def describe_response(self, action: str, observation: str, before: dict) -> GoalPart | None:
        """A part asking for what a read-only call answered (``before``: state at the call)."""
        return None

    def describe_event(self, action: str, observation: str, before: dict,
                       after: dict) -> GoalPart | None:
        """A part asking that this successful call *happened* ("reserve 2 pipe for order o3"),
        whatever the end state: hindsight over events makes tasks whose end state equals the
        start ("reserve, then cancel") expressible. None (the default): the env's goals are
        over states only. An env that returns parts checks their conditions in ``evaluate``."""
        return None

    def goal_of(self, conditions: Sequence) -> dict:
        """The goal (``Task.goal``) that holds when every condition does."""
        return {"all": list(conditions)}

    def query_of(self, texts: Sequence[str]) -> str:
        """One query asking for several parts."""
        return " and ".join(texts)

    def entities(self, state: dict) -> list[dict]:
        """Entities in ``state`` as ``{"type", "name", "attributes"}`` (for the profile).

        The default knows none; the profile then names entities by the tool arguments that
        took them."""
        return []

    @classmethod
    def open_many(cls, n: int, options: Mapping) -> list:
        """``n`` instances made with ``options`` (see :func:`make_envs`)."""
        return _each_made(lambda: cls(**options), n)

    @classmethod
    def call_all(cls, calls: Sequence[tuple[Environment, str, tuple]]) -> list:
        """``env.method(*args)`` for each ``(env, method, args)`` of this class, in order; an
        EnvFailed in place of a result the service failed. One by one here; a served env
        sends them to its server together."""
        results = []
        for env, method, args in calls:
            try:
                results.append(getattr(env, method)(*args))
            except EnvFailed as exc:
                results.append(exc)
        return results

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        """Parse and run one action: (observation, done, info with valid / tool / error)."""
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        try:
            call = parse_reply(action_text, {t.name: t for t in self.tools()})
        except ActionError as err:
            return err.observation, False, {"valid": False, "tool": err.tool, "error": err.kind}
        try:
            obs, error = clip_words(self.execute(call)), None
            self.responses.append(obs)
        except ToolError as err:
            obs, error = clip_words(err.observation), err.kind
        done = self.evaluate(self.task) >= 1.0
        return obs, done, {"valid": True, "tool": call.tool, "error": error}


VERIFY_REASONS = ("ok", "no_reference", "satisfied_at_start", "invalid_step", "goal_not_reached")


SPLIT_PERIOD = 5  # of every 5 consecutive worlds: 3 train, 1 validation, 1 test


def world_split(seed: int, period: int = SPLIT_PERIOD) -> str:
    """The split of world ``seed`` when whole worlds are held out: of every ``period``
    consecutive seeds the last is ``test``, the one before it ``validation``, the rest
    ``train``. Adding worlds never moves an existing one to another split."""
    position = seed % period
    return "test" if position == period - 1 else "validation" if position == period - 2 \
        else "train"


def check_split(split: str) -> str:
    """``split`` itself, or a ValueError naming the splits there are."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    return split


def described_only(goal) -> bool:
    """A goal given only in words (``{"description": ...}``): no state check can grade it; an
    LLM grader compares the trajectory with the reference instead."""
    return isinstance(goal, dict) and set(goal) == {"description"}


def verify_task(env_cls: type[Environment], task: Task, **env_kwargs) -> tuple[bool, str]:
    """Replay ``task.reference`` in a fresh env from the task's seed: (ok, reason).

    A task passes when its goal does not hold at the start (else there is nothing to do), every
    reference step is valid and error-free, and the goal holds afterwards. A goal described
    only in words cannot be checked on the state: its reference must just run cleanly.
    ``reason`` is one of :data:`VERIFY_REASONS`.
    """
    if not task.reference:
        return False, "no_reference"
    env = env_cls(**env_kwargs)
    env.reset(task)
    words_only = described_only(task.goal)
    if not words_only and env.evaluate(task) >= 1.0:
        return False, "satisfied_at_start"
    for action in task.reference:
        _, _, info = env.step(action)
        if not info["valid"] or info["error"] is not None:
            return False, "invalid_step"
    if not words_only and env.evaluate(task) < 1.0:
        return False, "goal_not_reached"
    return True, "ok"


def verify_reference(env_cls: type[Environment], task: Task, **env_kwargs) -> bool:
    """Whether ``task`` passes :func:`verify_task`."""
    return verify_task(env_cls, task, **env_kwargs)[0]


# --- registry ---------------------------------------------------------------------------------

_ENVS: dict[str, type[Environment]] = {}


def tool_instructions(env_name: str, tools: Sequence[ToolSpec],
                      example: str | None = None) -> str:
    """A system prompt an instruct model can act on: each tool with its arguments (optional
    ones in brackets) and what it does, the reply form, and ``example`` as one reply."""
    lines = [f"You operate the {env_name} environment by calling its tools, one call per "
             "reply. A call is the tool name followed by its arguments, separated by spaces, "
             "and nothing else: no explanation, no quotes, no code block.",
             "", "Tools:"]
    lines += [f"- {tool.usage()}: {tool.description}" if tool.description
              else f"- {tool.usage()}" for tool in tools]
    if example:
        lines += ["", "Example reply:", example]
    lines += ["", "After each call you see what it returned. Keep calling tools until the task "
              "is done."]
    return "\n".join(lines)


def register_env(name: str):
    """Class decorator: make an Environment subclass constructible by ``name`` from config."""

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"{cls!r} is not an Environment subclass")
        old = _ENVS.get(name)
        # A module reloaded in place re-registers the "same" class; anything else is a clash.
        if old is not None and (old.__module__, old.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise ValueError(f"environment {name!r} already registered by {old.__qualname__}")
        cls.name = name
        _ENVS[name] = cls
        return cls

    return wrap


def env_names() -> list[str]:
    """The environments that make a world with their defaults alone (what a check of every
    env iterates over); service envs (:data:`_SERVICE_ENVS`) are named by ``known_envs``."""
    return sorted((set(_ENVS) | set(_LAZY_ENVS)) - set(_SERVICE_ENVS))


def known_envs() -> str:
    """Every name :func:`env_class` resolves without a plugin module, for error messages."""
    return ", ".join(sorted(set(env_names()) | set(_SERVICE_ENVS))) or "none"


# Built-in environments whose modules import optional packages: imported on first use only.
_LAZY_ENVS = {"bfcl": "environments.bfcl"}
# Built-in envs that are clients of a service whose address their options give (``openenv``:
# a session on an OpenEnv server): imported on first use, and not in env_names(), since without
# a server they have no world to make.
_SERVICE_ENVS = {"openenv": "environments.openenv_adapter"}


# Makes the class of a served env from an EnvConfig with an address. environments/remote.py
# sets it when the package is imported: it subclasses Environment, so this module cannot
# import it.
_served_class: Callable[[EnvConfig], type[Environment]] | None = None


def register_served(factory: Callable[[EnvConfig], type[Environment]]) -> None:
    """Make ``factory`` the maker of served env classes (:func:`env_class` of an EnvConfig
    whose ``address`` is set)."""
    global _served_class
    _served_class = factory


def env_class(spec: str | EnvConfig) -> type[Environment]:
    """The class ``spec`` names: a registered name (``"pkg.module:name"`` imports the module
    first), or an ``EnvConfig``: with ``address`` set, the class whose instances are sessions on
    the env server there (``environments/remote.py``), else the class its ``name`` names.

    The one place an env's class is resolved: every command and role that makes an env from
    a run's config comes here (through :func:`env_maker`), so a served env is used the same
    way by all of them."""
    if isinstance(spec, EnvConfig):
        if spec.address:
            if _served_class is None:
                raise RuntimeError("environments.remote is not imported (import environments)")
            return _served_class(spec)
        spec = spec.name
    name = spec
    if ":" in name:
        module, name = name.split(":", 1)
        importlib.import_module(module)  # config-named plugin; its decorator registers it
    elif name not in _ENVS and name in (lazy := {**_LAZY_ENVS, **_SERVICE_ENVS}):
        importlib.import_module(lazy[name])
    try:
        return _ENVS[name]
    except KeyError:
        raise KeyError(f"unknown environment {name!r}; known: {known_envs()}") from None


def task_env_name(task: Task) -> str:
    """The name to look a task's env up by: the ``pkg.module:name`` a synthesized task keeps in
    ``meta.env_spec`` (so a plugin's module is imported from the task alone), else
    ``Task.env`` (the registered name)."""
    spec = task.meta.get("env_spec") if isinstance(task.meta, dict) else None
    return spec if isinstance(spec, str) and spec else task.env


def _of_run_env(task: Task, env_cfg: EnvConfig | None) -> bool:
    # A plugin's "pkg.module:name" registers as "name", which Task.env holds.
    return env_cfg is not None and task.env == env_cfg.name.rpartition(":")[2]


def task_env_class(task: Task, env_cfg: EnvConfig | None = None) -> type[Environment]:
    """The class to replay ``task`` in: the run's (``env_cfg``, served or not) for a task of
    the env it names, else the class the task names (:func:`task_env_name`)."""
    return env_class(env_cfg if _of_run_env(task, env_cfg) else task_env_name(task))


def task_env_maker(task: Task, env_cfg: EnvConfig | None = None) -> Callable[[], Environment]:
    """Fresh envs to replay ``task`` in: the run's (``env_cfg``: served or not, with its
    options) for a task of the env it names, else the class the task names, with its
    defaults."""
    return env_maker(env_cfg) if _of_run_env(task, env_cfg) else env_class(task_env_name(task))


def call_all(calls: Sequence[tuple[Environment, str, tuple]]) -> list:
    """``env.method(*args)`` for every ``(env, method, args)``: the results in order, an
    EnvFailed in place of each the service failed. What a rollout asks of all its episodes
    each turn: the calls to one env server are sent together, so the server answers them side
    by side instead of one round trip after another, and one session's calls in the order
    given."""
    results: list = [None] * len(calls)
    by_class: dict[type, list[int]] = {}
    for i, (env, _, _) in enumerate(calls):
        by_class.setdefault(type(env), []).append(i)
    for cls, members in by_class.items():
        for i, answer in zip(members, cls.call_all([calls[i] for i in members])):
            results[i] = answer
    return results


def call_each(envs: Sequence[Environment], method: str,
              args: Sequence[tuple] | None = None) -> list:
    """:func:`call_all` of ``envs[i].method(*args[i])`` (no arguments when ``args`` is None)."""
    args = [()] * len(envs) if args is None else args
    return call_all([(env, method, a) for env, a in zip(envs, args)])


@dataclass(frozen=True)
class EnvMaker:
    """A zero-argument factory of ``cls`` with ``options``; :func:`make_envs` makes many."""

    cls: type[Environment]
    options: dict = field(default_factory=dict)

    def __call__(self) -> Environment:
        return self.cls(**self.options)


def env_maker(env_cfg: EnvConfig) -> EnvMaker:
    """A zero-argument factory for the environment an ``EnvConfig`` names, with its options:
    a session on the env server at ``env_cfg.address`` when that is set."""
    return EnvMaker(env_class(env_cfg), dict(env_cfg.options))


def make_envs(make_env: Callable[[], Environment], n: int) -> list:
    """``n`` envs from ``make_env`` (an :class:`EnvMaker`, an env class or any factory), an
    EnvFailed in place of each the service could not open; a served env's sessions are
    opened together."""
    if isinstance(make_env, EnvMaker):
        return make_env.cls.open_many(n, make_env.options)
    if isinstance(make_env, type) and issubclass(make_env, Environment):
        return make_env.open_many(n, {})
    return _each_made(make_env, n)


def _each_made(factory: Callable[[], Environment], n: int) -> list:
    made: list = []
    for _ in range(n):
        try:
            made.append(factory())
        except EnvFailed as exc:
            made.append(exc)
    return made


class FreshEnvs:
    """One env at a time from ``make_env`` for work done an item after another (explore's
    explorations, the warm-start's scripts): an item the served env fails (EnvFailed: a
    deadline, a worker that died, a reply that does not decode) is logged with the worker's
    last lines, counted per reason (``failures``; the latest is ``last_failure``) and skipped,
    and the next goes on with a fresh instance. ``max_in_a_row`` items failed one after
    another mean the service is gone: the last failure is raised."""

    def __init__(self, make_env: Callable[[], Environment], what: str, max_in_a_row: int = 3):
        self.make_env, self.what, self.max_in_a_row = make_env, what, max_in_a_row
        self.failures: collections.Counter = collections.Counter()  # reason -> items failed
        self.last_failure: EnvFailed | None = None
        self._env: Environment | None = None
        self._in_a_row = 0

    @property
    def env(self) -> Environment:
        if self._env is None:
            self._env = self.make_env()
        return self._env

    def run(self, item: str, work: Callable[[Environment], typing.Any]):
        """``work(env)``, or None when the service failed it (the env is then replaced)."""
        try:
            done = work(self.env)
        except EnvFailed as exc:
            self._env, self.last_failure = None, exc
            self.failures[exc.reason] += 1
            self._in_a_row += 1
            if self._in_a_row >= self.max_in_a_row:
                raise
            log.warning("%s: the served env failed %s; skipped, going on with a fresh "
                        "instance: %s", self.what, item, exc)
            return None
        self._in_a_row = 0
        return done


def make_env(spec: str | EnvConfig, **kwargs) -> Environment:
    """A new instance of the environment ``spec`` names (see :func:`env_class`)."""
    return env_class(spec)(**kwargs)


def check_env_options(env: EnvConfig) -> None:
    """``env.name`` names a known environment and ``env.options`` only its constructor's
    keyword arguments (of the declared type where that is a plain one). A plugin
    (``module:name``) is imported only when an env is made, and a served env (``address``)
    is asked only then, so neither is checked here."""
    if ":" in env.name or env.address:
        return
    try:
        cls = env_class(env.name)
    except KeyError:
        raise ConfigError(f"env.name: unknown environment {env.name!r}; known: "
                          f"{known_envs()}") from None
    except ImportError:  # this machine lacks the env's extra; the role that makes it will say
        return
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [n for n, p in params.items() if n != "self"
             and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            inspect.Parameter.KEYWORD_ONLY)]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # annotations this interpreter cannot evaluate: check names only
        hints = {}
    for key, value in env.options.items():
        if key not in known:
            raise ConfigError(f"env.options.{key}: unknown option of environment {env.name!r} "
                              f"(known: {', '.join(known) or 'none'})")
        if hints.get(key) in (int, float, str, bool):
            coerce(hints[key], value, f"env.options.{key}")
