"""The interface every tool-use sandbox implements, and the env registry.

An environment is untrusted ground for model output: an action is text that is *parsed*, in
the call format the agent speaks (``environments.call_formats``), into a declared tool and
literal arguments (``environments.tools``), never evaluated. Anything that does not parse
becomes an error observation with ``info["valid"] = False``; nothing the model writes can raise.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import logging
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from environments.call_formats import call_format as format_named
from environments.call_formats import reply_form, rewrite, tool_instructions
from environments.call_grammar import call_grammar
from environments.tools import (  # noqa: F401  (the names envs have always imported from here)
    ARG_TYPES,
    MAX_ACTION_CHARS,
    MAX_OBS_WORDS,
    PARSER_WORDS,
    ActionError,
    ArgSpec,
    ToolCall,
    ToolError,
    ToolSpec,
    clip_words,
    literal_arg,
    parse_action,
    parse_reply,
    parser_words,
)
from protocol.config import EnvConfig, coerce, task_member
from protocol.errors import ConfigError, EnvFailed
from protocol.messages import SPLITS, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GoalPart:
    """One change an exploration made, as goal conditions plus the environment's words for it.

    Task synthesis combines a few parts into one task: their conditions become the goal (via
    :meth:`Environment.goal_of`) and their texts the query (via :meth:`Environment.query_of`).
    """

    conditions: tuple  # env-specific, JSON-able goal conditions that pin this change
    text: str | None = None  # the change in the env's own words; None: it cannot say it
    entities: tuple[str, ...] = ()  # names of the entities involved (preference filters)


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
    # Seeds of the worlds training may use besides those of the "train" tasks: explore visits
    # them too (questioning/explorer.py, seed_tasks). An env with no training tasks declares
    # them to be explored in more than one world (a range will do); a declared seed that a
    # validation or test task uses is never visited.
    train_worlds: Sequence[int] = ()
    # Whether state() gives a snapshot goals are checked on: explore needs one, so an env
    # without (an OpenEnv server) is never explored, and tasks.synthetic_share auto leaves it
    # to its own training tasks.
    has_state: bool = True
    # Constructor options a client of the served env may choose (``autodidact env serve``;
    # every other option is the server's: ``--set env.options.NAME=VALUE``): name -> the values
    # allowed, a ``range`` of ints or a tuple of choices. Declare only options that are cheap
    # and bounded whatever the value, never one the server would reach out with (a url).
    client_options: dict = {}

    def __init_subclass__(cls, **kwargs):
        """An env written before call formats (``def step(self, action_text)``, ``def
        instructions(self)``) is called in every format all the same: its ``step`` is given
        the call rewritten as text, and its instructions are followed by the format's own
        reply form (:func:`_speaks_formats`)."""
        super().__init_subclass__(**kwargs)
        _speaks_formats(cls)

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

    def instructions(self, call_format: str = "text", list_tools: bool = True) -> str | None:
        """The system prompt for the current task (tool documentation, output format), or None.

        Chat-template prompts put it in the system message; the word-level marker prompt of
        the tiny policy leaves it out (its vocabulary cannot spell tool documentation). The
        default, made from :meth:`tools`, tells an instruct model the tools, their arguments
        (left out with ``list_tools=False``: the chat template shows their schemas), the
        one-call-per-turn form of ``call_format`` and one example call written in it."""
        return tool_instructions(self.name or type(self).__name__, self.tools(),
                                 self.example_action(), call_format, list_tools)

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

    def call_grammar(self, call_format: str = "text") -> str | None:
        """Every well-formed call now, written in ``call_format``, as a grammar
        (``environments.call_grammar``: llguidance's Lark dialect): what constrained decoding
        holds the model to where :meth:`candidate_actions` lists none. The default is one call
        of :meth:`tools`, each argument of its type (a ``str`` one path-like word, as the
        parser wants); None where the env has no tools."""
        tools = self.tools()
        return call_grammar(tools, call_format) if tools else None

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

    def step(self, action_text: str, call_format: str = "text") -> tuple[str, bool, dict]:
        """Parse ``action_text``, a call written in ``call_format`` (``environments.
        call_formats``), and run it: (observation, done, info with valid / tool / error)."""
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        try:
            call = format_named(call_format).parse(action_text,
                                                   {t.name: t for t in self.tools()})
        except ActionError as err:
            return err.observation, False, {"valid": False, "tool": err.tool, "error": err.kind}
        try:
            obs, error = clip_words(self.execute(call)), None
            self.responses.append(obs)
        except ToolError as err:
            obs, error = clip_words(err.observation), err.kind
        done = self.evaluate(self.task) >= 1.0
        return obs, done, {"valid": True, "tool": call.tool, "error": error}


def _speaks_formats(cls: type) -> None:
    """Wrap ``cls``'s own ``step`` / ``instructions`` where they take no call format."""
    step, instructions = cls.__dict__.get("step"), cls.__dict__.get("instructions")
    if step is not None and not _takes(step, "call_format"):
        def step_in_format(self, action_text, call_format="text", _step=step):
            if call_format != "text":
                action_text = rewrite(action_text, self.tools(), "text", call_format)
            return _step(self, action_text)
        cls.step = functools.wraps(step)(step_in_format)
    if instructions is not None and not _takes(instructions, "call_format"):
        def instructions_in_format(self, call_format="text", list_tools=True,
                                   _instructions=instructions):
            text = _instructions(self)
            if call_format == "text" or text is None:
                return text
            return f"{text}\n\n{reply_form(call_format)}"
        cls.instructions = functools.wraps(instructions)(instructions_in_format)


def _takes(function, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): leave it as it is
        return True


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


# Makes the class of a mixture of envs from an EnvConfig with a mix (``env.mix``).
# environments/mixed.py sets it when the package is imported, for the reason above.
_mixed_class: Callable[[EnvConfig], type[Environment]] | None = None


def register_mixed(factory: Callable[[EnvConfig], type[Environment]]) -> None:
    """Make ``factory`` the maker of mixed env classes (:func:`env_class` of an EnvConfig
    whose ``mix`` is set)."""
    global _mixed_class
    _mixed_class = factory


def env_class(spec: str | EnvConfig) -> type[Environment]:
    """The class ``spec`` names: a registered name (``"pkg.module:name"`` imports the module
    first), or an ``EnvConfig``: with ``address`` set, the class whose instances are sessions on
    the env server there (``environments/remote.py``); with ``mix`` set, the mixture of its
    members (``environments/mixed.py``); else the class its ``name`` names.

    The one place an env's class is resolved: every command and role that makes an env from
    a run's config comes here (through :func:`env_maker`), so a served env is used the same
    way by all of them."""
    if isinstance(spec, EnvConfig):
        if spec.mix:
            if _mixed_class is None:
                raise RuntimeError("environments.mixed is not imported (import environments)")
            return _mixed_class(spec)
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


def task_env_of_run(task: Task, env_cfg: EnvConfig | None) -> bool:
    """Whether ``task`` is of the run's env (``env_cfg``): :func:`task_env_maker` builds the
    run's env for it, never importing what its ``meta.env_spec`` names. A role that must not
    import code a stored task names (the experience worker) replays only such tasks."""
    if env_cfg is not None and env_cfg.mix:  # a mix: a task of one of its members
        member = task_member(task)
        if member:
            return member in {m.member_id() for m in env_cfg.mix}
        return task.env in {m.name.rpartition(":")[2] for m in env_cfg.mix}
    # A plugin's "pkg.module:name" registers as "name", which Task.env holds.
    return env_cfg is not None and task.env == env_cfg.name.rpartition(":")[2]


def task_env_class(task: Task, env_cfg: EnvConfig | None = None) -> type[Environment]:
    """The class to replay ``task`` in: the run's (``env_cfg``, served or not) for a task of
    the env it names, else the class the task names (:func:`task_env_name`)."""
    return env_class(env_cfg if task_env_of_run(task, env_cfg) else task_env_name(task))


def task_env_maker(task: Task, env_cfg: EnvConfig | None = None) -> Callable[[], Environment]:
    """Fresh envs to replay ``task`` in: the run's (``env_cfg``: served or not, with its
    options) for a task of the env it names, else the class the task names, with its
    defaults."""
    return env_maker(env_cfg) if task_env_of_run(task, env_cfg) else env_class(task_env_name(task))


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
    a session on the env server at ``env_cfg.address`` when that is set; with ``env_cfg.mix``,
    the mixture (each member made with its own options)."""
    return EnvMaker(env_class(env_cfg), {} if env_cfg.mix else dict(env_cfg.options))


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
    is asked only then, so neither is checked here. A mix has each member checked so."""
    if env.mix:
        for i, (_, member, _) in enumerate(env.members()):
            try:
                check_env_options(member)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("env.", f"env.mix[{i}].", 1)) from None
        return
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
