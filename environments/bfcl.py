"""``bfcl``: the multi-turn categories of the Berkeley Function Calling Leaderboard as an env.

A thin adapter over the ``bfcl-eval`` package (import name ``bfcl_eval``). The package's own
code loads the entries and ground truths, writes the system prompt, executes calls
(``execute_multi_turn_func_call``) and grades a finished conversation (``multi_turn_checker``);
this module adds what the RL loop needs on top of it: one episode per object, parsing of model
text that never evaluates it, a stable train/test split and JSON-able state snapshots.

An episode follows ``BaseHandler.inference_multi_turn_prompting``: the observation of ``reset``
is the first user turn; each action is a Python list of calls (``[cd(folder='docs'), ls()]``)
that runs against the entry's live API instances and answers with the tool results; an empty
action (or text that does not decode) ends the turn and the next user turn is the observation;
after the last turn the episode is done and ``evaluate`` runs the package's checker on the
calls of every step. A turn with more than ``max_steps_per_turn`` executed steps is force-quit,
which fails the entry (as the package intends).

Tasks: the 800 entries of ``multi_turn_base``, ``multi_turn_miss_func``,
``multi_turn_miss_param`` and ``multi_turn_long_context``; ``Task.goal`` is
``{"bfcl_entry": id}``. Synthetic tasks (self-questioning) have goals ``{"all": [[path, value],
...]}`` over :meth:`BFCLEnv.state` leaves and a single user turn, ``Task.query``, from the
initial state of entry number ``Task.seed``.
"""

from __future__ import annotations

import ast
import datetime
import functools
import importlib
import inspect
import json
import logging
import math
import random
import threading
import uuid
from dataclasses import dataclass

from environments.base import (
    ActionError,
    ArgSpec,
    Environment,
    GoalPart,
    ToolCall,
    ToolSpec,
    check_split,
    parse_action,
    register_env,
)
from environments.call_formats import json_calls, tool_instructions
from environments.call_grammar import call_grammar
from protocol.messages import SPLITS, Task

log = logging.getLogger(__name__)

__all__ = ["BFCLEnv", "CATEGORIES", "split_ids"]

CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
# Every class the multi-turn categories use (the package's web-search and memory classes are
# for other categories; the memory ones load a sentence encoder on import).
CLASSES = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TwitterAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "VehicleControlAPI",
)
SPLIT_SEED = 42
# The longest ground-truth turn (a long-context tweet quoting a diff) is 6,910 characters.
MAX_ACTION_CHARS = 8192
MAX_OBS_CHARS = 2000
MAX_CALLS = 64  # calls in one action
MAX_DEPTH = 16  # nesting of list/dict arguments
MAX_INT = 2**63
# Arguments with which one call of the package's own tools would run for hours or exhaust memory:
# ``power(base=10, exponent=10**15)`` (an exact int power), ``round_number(number=1,
# decimal_places=-10**9)``, ``logarithm``/``square_root`` at a precision of a billion digits
# (mpmath/decimal work, and they set the process-wide precision). The ground truths use
# precision <= 10 and small exponents; larger magnitudes are refused as bad arguments.
ARG_LIMITS = {("power", "exponent"): 10_000, ("round_number", "decimal_places"): 1_000,
              ("logarithm", "precision"): 1_000, ("square_root", "precision"): 1_000}
PREFIX = "autodidact_"  # start of every per-episode model name in the executor's globals
BFCL_TYPES = {
    "string": "str",
    "integer": "int",
    "float": "float",
    "boolean": "bool",
    "array": "list",
    "dict": "dict",
}


def _bfcl():
    """The package's modules, imported on first use (the registry imports this module lazily,
    but a plain ``import environments.bfcl`` should not cost the package's import time)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    return multi_turn_utils, multi_turn_checker


# --- the data, loaded once per process ----------------------------------------------------------


@dataclass(frozen=True)
class _Data:
    entries: dict  # id -> entry as load_dataset_entry returns it; shared, never mutated
    truths: dict  # id -> ground truth: per turn, the call strings
    category: dict  # id -> category
    order: tuple  # ids by global index (Task.seed): categories in CATEGORIES order, by id


_DATA: _Data | None = None
_DATA_LOCK = threading.Lock()


def _data() -> _Data:
    global _DATA
    with _DATA_LOCK:  # actors may build envs in threads; load the files once
        if _DATA is None:
            _DATA = _load()
        return _DATA


def _load() -> _Data:
    from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry, sort_key

    entries, truths, category, order = {}, {}, {}, []
    for cat in CATEGORIES:
        loaded = sorted(load_dataset_entry(cat), key=sort_key)
        truth = {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(cat)}
        for entry in loaded:
            entries[entry["id"]] = entry
            truths[entry["id"]] = truth[entry["id"]]
            category[entry["id"]] = cat
            order.append(entry["id"])
    return _Data(entries, truths, category, tuple(order))


@functools.lru_cache(maxsize=1)
def _splits() -> dict[str, str]:
    """id -> split: per category, ids shuffled with a fixed seed; the second half is test (as
    it was before there was a validation split, so test numbers stay comparable), the first
    half two thirds train and one third validation. Each entry is its own world."""
    data, out = _data(), {}
    for cat in CATEGORIES:
        ids = [i for i in data.order if data.category[i] == cat]
        random.Random(SPLIT_SEED).shuffle(ids)  # one rng per category: categories independent
        half = len(ids) // 2
        train = half * 2 // 3
        out.update({i: "train" for i in ids[:train]})
        out.update({i: "validation" for i in ids[train:half]})
        out.update({i: "test" for i in ids[half:]})
    return out


def split_ids() -> dict[str, list[str]]:
    """The entry ids of each split, in global (seed) order."""
    splits = _splits()
    return {s: [i for i in _data().order if splits[i] == s] for s in SPLITS}


def _turn_texts(entry: dict) -> list[str]:
    """Every user turn; a held-out turn of miss_func shows the functions it adds, as the
    package's prompting handler does."""
    from bfcl_eval.constants.default_prompts import (
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING as ADD_FUNCTIONS,
    )

    held_out = entry.get("missed_function", {})
    texts = []
    for turn, messages in enumerate(entry["question"]):
        if str(turn) in held_out:
            texts.append(ADD_FUNCTIONS.format(functions=held_out[str(turn)]))
        else:
            texts.append("\n".join(m["content"] for m in messages if m.get("role") == "user"))
    return texts


def _docs_at(entry: dict, turn: int) -> list[dict]:
    """The function docs declared at ``turn``: held-out ones only from their turn on."""
    starts = _held_out_starts(entry["id"])
    return list(entry["function"]) + [doc for doc, start in starts if start <= turn]


@functools.lru_cache(maxsize=None)
def _held_out_starts(entry_id: str) -> tuple[tuple[dict, int], ...]:
    """(doc, first turn it is declared) for each held-out function of a miss_func entry.

    One entry's data contradicts itself: ``multi_turn_miss_func_49`` holds ``tail`` out until
    turn 3, yet its ground truth calls ``tail`` in turn 1 (the package's executor runs any
    method of the entry's classes, declared or not, so its own grading never notices). A
    held-out function is therefore declared from the first turn its ground truth calls it, if
    that comes before the turn that reveals it, so that every reference stays solvable.
    """
    entry, truth = _data().entries[entry_id], _data().truths[entry_id]
    out = []
    for turn, docs in entry.get("missed_function", {}).items():
        for doc in docs:
            used = [t for t, calls in enumerate(truth)
                    if any(c.split("(", 1)[0].strip() == doc["name"] for c in calls)]
            out.append((doc, min([int(turn)] + used)))
    return tuple(sorted(out, key=lambda x: x[1]))


def _system_prompt(entry: dict, turn: int) -> str:
    """The package's system prompt with the functions declared at ``turn``."""
    from bfcl_eval.model_handler.utils import system_prompt_pre_processing_chat_model

    prompts = [{"role": "user", "content": _turn_texts(entry)[0]}]
    return system_prompt_pre_processing_chat_model(prompts, _docs_at(entry, turn),
                                                   entry["id"])[0]["content"]


def _reference(truth: list[list[str]]) -> list[str]:
    """Ground truth as actions: per turn, its calls as one list (if any), then the empty action
    that ends the turn."""
    out = []
    for calls in truth:
        if calls:
            out.append("[" + ", ".join(calls) + "]")
        out.append("")
    return out


@functools.lru_cache(maxsize=8)
def _tasks(categories: tuple[str, ...]) -> tuple[Task, ...]:
    data, splits = _data(), _splits()
    tasks = []
    for seed, entry_id in enumerate(data.order):
        cat = data.category[entry_id]
        if cat not in categories:
            continue
        truth = data.truths[entry_id]
        tasks.append(Task(
            task_id=entry_id, env="bfcl", query=_turn_texts(data.entries[entry_id])[0],
            seed=seed, goal={"bfcl_entry": entry_id}, reference=_reference(truth),
            source="original", split=splits[entry_id],
            difficulty=float(sum(len(calls) for calls in truth)), meta={"category": cat}))
    return tuple(tasks)


# --- the API classes ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _api_class(name: str) -> type:
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    return getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)


@functools.lru_cache(maxsize=None)
def _params(class_name: str, method: str) -> tuple[tuple[str, bool], ...]:
    """(name, required) of a method's parameters, in signature order (required ones first)."""
    sig = inspect.signature(getattr(_api_class(class_name), method))
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple((p.name, p.default is inspect.Parameter.empty)
                 for p in list(sig.parameters.values())[1:] if p.kind in kinds)


@functools.lru_cache(maxsize=64)
def _owners(classes: tuple[str, ...]) -> dict[str, str]:
    """Public method -> its class; a later class wins a clash, as in the package's executor."""
    out = {}
    for name in classes:
        for method, _ in inspect.getmembers(_api_class(name), inspect.isfunction):
            if not method.startswith("_"):
                out[method] = name
    return out


def _tool_spec(doc: dict, class_name: str) -> ToolSpec:
    props = doc.get("parameters", {}).get("properties", {})
    args = tuple(
        ArgSpec(name, BFCL_TYPES.get(props.get(name, {}).get("type"), "str"),
                props.get(name, {}).get("description", ""), required)
        for name, required in _params(class_name, doc["name"]))
    return ToolSpec(doc["name"], doc.get("description", ""), args)


@functools.lru_cache(maxsize=1)
def _all_tools() -> tuple[ToolSpec, ...]:
    """Every function of the eight classes (what a fresh env offers before any reset)."""
    from bfcl_eval.constants.eval_config import MULTI_TURN_FUNC_DOC_PATH
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING
    from bfcl_eval.utils import load_file

    specs = {}
    for name in CLASSES:
        path = MULTI_TURN_FUNC_DOC_PATH / MULTI_TURN_FUNC_DOC_FILE_MAPPING[name]
        for doc in load_file(path):
            specs.setdefault(doc["name"], _tool_spec(doc, name))
    return tuple(specs.values())


# --- parsing model text ---------------------------------------------------------------------------

_SYNTAX = "error : write a python list of calls like [name(arg=value), ...]"
_LITERALS = "error : arguments must be literals (strings, numbers, booleans, None, lists, dicts)"


def _checked(value, depth: int = 0):
    """``value`` if it is plain data of bounded depth (tuples become lists), else ActionError."""
    if depth > MAX_DEPTH:
        raise ActionError("bad_argument", "error : argument nested too deeply")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if not _utf8(value):  # '\\ud800' in a literal: a lone surrogate, which no observation,
            # state snapshot or message could carry (they are UTF-8)
            raise ActionError("bad_argument", "error : strings must be valid unicode")
        return value
    if isinstance(value, int) and abs(value) < MAX_INT:
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_checked(v, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) and _utf8(k) for k in value):
        return {k: _checked(v, depth + 1) for k, v in value.items()}
    raise ActionError("bad_argument", _LITERALS)  # bytes, sets, complex, huge ints, inf, nan


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _literal(node: ast.AST):
    """An argument's value: ``ast.literal_eval`` reads constants and containers of constants
    and refuses names, calls, attributes, operators, comprehensions and f-strings."""
    if isinstance(node, ast.Starred):
        raise ActionError("bad_argument", _LITERALS)
    try:
        value = ast.literal_eval(node)
    except Exception:  # ValueError for non-literals; RecursionError/MemoryError for monsters
        raise ActionError("bad_argument", _LITERALS) from None
    return _checked(value)


def _call_nodes(text: str) -> list[ast.AST]:
    """The elements of the action's call list, decoded as the package's
    ``default_decode_execute_prompting`` does (strip, wrap in brackets, parse)."""
    src = text.strip("`\n ")
    src = src if src.startswith("[") else "[" + src
    src = src if src.endswith("]") else src + "]"
    try:
        body = ast.parse(src, mode="eval").body
    except Exception:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        raise ActionError("syntax", _SYNTAX) from None
    if not isinstance(body, ast.List):
        raise ActionError("syntax", _SYNTAX)
    nodes = []
    for elt in body.elts:  # a tuple of calls inside the list is accepted too
        nodes += elt.elts if isinstance(elt, ast.Tuple) else [elt]
    if len(nodes) > MAX_CALLS:
        raise ActionError("too_many_calls", f"error : at most {MAX_CALLS} calls per action")
    return nodes


def _python_calls(objects: list[dict]) -> str:
    """JSON call objects as the Python call list ``_call_nodes`` decodes; their names and
    argument names must be identifiers (the values are JSON, so ``repr`` spells literals)."""
    parts = []
    for obj in objects:
        name, args = obj["name"], obj.get("arguments", {})
        if not (isinstance(name, str) and name.isidentifier()):
            raise ActionError("syntax", "error : a call's name is a function name")
        if not all(k.isidentifier() for k in args):
            raise ActionError("unknown_argument", "error : argument names are identifiers",
                              tool=name)
        parts.append(f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})")
    return f"[{', '.join(parts)}]"


def _source(value) -> str:
    """Python source for a checked value, like ``repr`` but with every ``(`` inside a string
    written ``\\x28``: the package's executor prefixes each ``name(`` of the call text with the
    instance that owns ``name``, inside string literals too, which would rewrite an argument
    such as ``'run ls(x)'`` (and embed the episode's instance name in the state)."""
    if isinstance(value, str):
        return repr(value).replace("(", "\\x28")  # never part of an escape sequence in a repr
    if isinstance(value, list):
        return "[" + ", ".join(_source(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_source(k)}: {_source(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _shown(name: str) -> str:
    """A callee name safe to echo in an observation."""
    return name if name.isascii() and name.isidentifier() and len(name) <= 64 else "?"


# --- state snapshots and goals --------------------------------------------------------------------


def _plain(value, ancestors: frozenset = frozenset()):
    """JSON-able copy of an API attribute: objects through their public ``vars`` (a reference
    back to an object being converted, like a directory's ``parent``, is left out), sets as
    sorted lists, dict keys as strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v, ancestors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, ancestors) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v, ancestors) for v in value), key=repr)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if hasattr(value, "__dict__"):
        inner = ancestors | {id(value)}
        return {k: _plain(v, inner) for k, v in vars(value).items()
                if not k.startswith("_") and id(v) not in inner}
    return repr(value)


def _leaves(node, path: tuple = ()) -> dict[tuple, object]:
    """Flattened state: path -> value for every scalar, list or empty dict."""
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out.update(_leaves(value, path + (key,)))
        return out
    return {path: node}


def _lookup(state, path):
    for key in path:
        if not isinstance(state, dict) or key not in state:
            return None  # removed (or never there): conditions write that as None
        state = state[key]
    return state


def _holds(state: dict, cond) -> bool:
    """``[path, value]``: the state has ``value`` at ``path`` (None: absent); a malformed
    condition (from a synthesized task) never holds."""
    if not isinstance(cond, (list, tuple)) or len(cond) != 2:
        return False
    path, value = cond
    if not isinstance(path, (list, tuple)) or not path or not all(isinstance(p, str)
                                                                  for p in path):
        return False
    return _lookup(state, path) == value


def _change_words(path, value) -> str:
    where = " ".join(path)
    return f"remove {where}" if value is None else f"set {where} to {json.dumps(value)}"


def _is_error(result: str) -> bool:
    """Whether an execution result is a refusal: the executor's exception text or an API's
    ``{"error": ...}`` answer."""
    if result.startswith("Error during execution"):
        return True
    if result.startswith("{") and '"error"' in result:
        try:
            return "error" in json.loads(result)
        except ValueError:
            return False
    return False


# --- the environment ------------------------------------------------------------------------------


@register_env("bfcl")
class BFCLEnv(Environment):
    """BFCL multi-turn entries (see the module docstring).

    Options (``env.options`` in config): ``categories`` (a subset of :data:`CATEGORIES`),
    ``max_steps_per_turn`` (default the package's ``MAXIMUM_STEP_LIMIT``), ``max_action_chars``,
    ``max_obs_chars`` (tool results longer than this are cut; user turns never are: they are
    the task), ``irrelevance_check`` (also apply ``multi_turn_irrelevance_checker``; off, as in
    the package's own eval runner, which imports it but does not call it).
    """

    query_in_prompt = False  # reset's observation is the first user turn itself
    # Entries run 2-8 user turns of several steps each; calls and tool docs are long.
    default_limits = {"max_turns": 64, "max_context": 16384, "max_action_tokens": 256}

    def __init__(self, categories=CATEGORIES, max_steps_per_turn: int | None = None,
                 max_action_chars: int = MAX_ACTION_CHARS, max_obs_chars: int = MAX_OBS_CHARS,
                 irrelevance_check: bool = False):
        super().__init__()
        unknown = set(categories) - set(CATEGORIES)
        if unknown or not categories:
            raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}")
        if max_steps_per_turn is None:
            from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT

            max_steps_per_turn = MAXIMUM_STEP_LIMIT
        self.categories = tuple(c for c in CATEGORIES if c in categories)
        self.max_steps_per_turn = int(max_steps_per_turn)
        self.max_action_chars = int(max_action_chars)
        self.max_obs_chars = int(max_obs_chars)
        self.irrelevance_check = bool(irrelevance_check)
        self.entry: dict | None = None
        self.model_name: str | None = None  # per episode: names its instances in the executor
        self.instances: dict = {}
        self.questions: list[str] = []
        self.synthetic = False
        self._new_episode_counters()

    def _new_episode_counters(self):
        self.turn = 0
        self.turn_steps = 0  # executed steps in this turn (the package's ``count``)
        self.calls: list[list[list[str]]] = [[]]  # per turn, per step: canonical call strings
        self.finished = False  # every turn ended (or a force quit)
        self.force_quit = False
        self._score: float | None = None
        self._tools: tuple[int, list[ToolSpec]] | None = None

    # -- episode --

    def reset(self, task: Task) -> str:
        if task.env != self.name:
            raise ValueError(f"task {task.task_id!r} is for env {task.env!r}, not {self.name!r}")
        self._purge()
        data = _data()
        goal = task.goal if isinstance(task.goal, dict) else {}
        entry_id = goal.get("bfcl_entry")
        self.synthetic = entry_id is None
        if self.synthetic:  # any integer seed names an entry's initial state
            entry_id = data.order[task.seed % len(data.order)]
        elif entry_id not in data.entries:
            raise ValueError(f"unknown BFCL entry {entry_id!r}")
        self.task, self.entry, self.responses = task, data.entries[entry_id], []
        self._new_episode_counters()
        self.model_name = f"{PREFIX}{uuid.uuid4().hex}"  # fresh instances, never shared
        texts = _turn_texts(self.entry)
        self.questions = [task.query or texts[0]] if self.synthetic else texts
        self._execute([])  # builds the instances from the entry's initial config
        return self.questions[0]

    def close(self) -> None:
        """Drop this episode's instances from the executor's globals."""
        self._purge()
        self.model_name = None

    def __del__(self):
        try:
            self._purge()
        except Exception:  # interpreter shutdown: the modules may already be gone
            pass

    def _purge(self) -> None:
        """Delete every global the executor and checker made for this episode: the live
        instances and the checker's ``_eval`` / ``_ground_truth_eval`` copies."""
        if not self.model_name:
            return
        space = vars(_bfcl()[0])
        prefix = self.model_name + "_"
        for _ in range(3):  # other threads may add their own names while we list
            try:
                names = [k for k in tuple(space) if k.startswith(prefix)]
                break
            except RuntimeError:
                continue
        else:
            return
        for key in names:
            space.pop(key, None)

    def _execute(self, calls: list[str]) -> list[str]:
        entry = self.entry
        results, self.instances = _bfcl()[0].execute_multi_turn_func_call(
            calls, entry.get("initial_config", {}), entry["involved_classes"], self.model_name,
            entry["id"], long_context=self._long_context(), is_evaL_run=False)
        return results

    def _long_context(self) -> bool:
        return "long_context" in _data().category[self.entry["id"]]

    # -- acting --

    def execute(self, call: ToolCall) -> str:
        """One shell-style parsed call (the base interface); :meth:`step` is the real path."""
        return self.step(self._python_text(call))[0]

    def _python_text(self, call: ToolCall) -> str:
        """A shell-style parsed call as Python call text, arguments named by the tool spec."""
        spec = next(t for t in self.tools() if t.name == call.tool)
        kwargs = ", ".join(f"{a.name}={v!r}" for a, v in zip(spec.args, call.args))
        return f"[{call.tool}({kwargs})]"

    def step(self, action_text: str, call_format: str = "text") -> tuple[str, bool, dict]:
        """One reply: its calls run in order; a reply with none ends the turn. ``text`` and
        ``pythonic`` replies are the package's Python call lists (a shell-style call is taken
        too); ``json`` and ``hermes`` ones name each call as ``{"name", "arguments"}``."""
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        if self.finished and not self.synthetic:
            return ("error : the conversation is over", True,
                    {"valid": False, "tool": None, "error": "episode_over", "role": "end"})
        try:
            calls = self._decode(action_text, call_format)
        except ActionError as err:
            # The package ends the turn on text it cannot decode; the error is shown first.
            obs, done, role = self._end_turn()
            obs = f"{err.observation}\n{obs}" if obs else err.observation
            return obs, done, {"valid": False, "tool": err.tool, "error": err.kind, "role": role}
        if not calls:
            obs, done, role = self._end_turn()
            return obs, done, {"valid": True, "tool": None, "error": None, "role": role}
        return self._run(calls)

    def _run(self, calls: list[str]) -> tuple[str, bool, dict]:
        results = self._execute(calls)
        self.calls[self.turn].append(calls)
        self.turn_steps += 1
        obs = self._clip(repr([{"role": "tool", "name": c, "content": r}
                               for c, r in zip(calls, results)]))
        error = "tool_error" if any(_is_error(r) for r in results) else None
        if error is None:
            self.responses.append(obs)
        info = {"valid": True, "tool": calls[0].split("(", 1)[0], "error": error,
                "role": "tool", "calls": calls}
        done = False
        if self.turn_steps > self.max_steps_per_turn:  # the package's force quit
            self.force_quit = self.finished = done = True
            obs += f"\nerror : more than {self.max_steps_per_turn} steps in one turn"
            info["force_quit"] = True
        elif self.synthetic:
            done = self.evaluate(self.task) >= 1.0
        return obs, done, info

    def _end_turn(self) -> tuple[str, bool, str]:
        """Close the current turn: (next user turn or "", done, role)."""
        if self.synthetic:  # one turn; the state stays usable (explorers keep acting)
            return "", True, "end"
        self.turn += 1
        self.turn_steps = 0
        if self.turn >= len(self.questions):
            self.finished = True
            return "", True, "end"
        self.calls.append([])
        return self.questions[self.turn], False, "user"

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_obs_chars:
            return text
        return text[: max(self.max_obs_chars - 20, 0)] + " ... [truncated]"

    # -- decoding --

    def _decode(self, text, call_format: str = "text") -> list[str]:
        """Canonical call strings ``name(arg=repr(value), ...)`` for the action, or ActionError.

        Python calls are tried first; text that is not one may be a shell-style call
        (``cd docs``), as explorers write them. JSON calls are checked as the Python call
        each one spells."""
        if not isinstance(text, str):
            raise ActionError("not_text", "error : action is not text")
        if len(text) > self.max_action_chars:
            raise ActionError("too_long", "error : action too long")
        if call_format in ("json", "hermes"):
            return self._decode_python(_python_calls(json_calls(text, call_format)))
        try:
            return self._decode_python(text)
        except ActionError as err:
            try:
                return self._decode_shell(text)
            except ActionError as shell_err:
                # The shell error is the better message when the text names a declared tool
                # shell-style (``cd`` without its folder): parse_action then names the tool.
                better = err.kind == "syntax" and shell_err.tool is not None
                raise (shell_err if better else err) from None

    def _decode_python(self, text: str) -> list[str]:
        return [self._canonical(node) for node in _call_nodes(text)]

    def _decode_shell(self, text: str) -> list[str]:
        call = parse_action(text, self.tools())
        return self._decode_python(self._python_text(call))  # one canonical path

    def _canonical(self, node: ast.AST) -> str:
        if not isinstance(node, ast.Call):
            raise ActionError("syntax", _SYNTAX)
        if not isinstance(node.func, ast.Name):  # attribute access: os.system, x.__class__
            raise ActionError("bad_callee", "error : call a listed function by its plain name")
        name = node.func.id
        if name not in self._available():
            raise ActionError("unknown_tool", f"error : unknown function {_shown(name)}")
        owner = _owners(tuple(self.entry["involved_classes"]))[name] if self.entry else None
        params = [p for p, _ in _params(owner, name)] if owner else self._spec_args(name)
        if len(node.args) > len(params):
            raise ActionError("arity", f"error : {name} takes at most {len(params)} arguments",
                              tool=name)
        values = {p: _literal(a) for p, a in zip(params, node.args)}
        for kw in node.keywords:
            if kw.arg is None or kw.arg not in params:
                raise ActionError("unknown_argument",
                                  f"error : {name} has no argument {_shown(kw.arg or '**')}",
                                  tool=name)
            if kw.arg in values:
                raise ActionError("duplicate_argument", f"error : {kw.arg} given twice", tool=name)
            values[kw.arg] = _literal(kw.value)
        for p, value in values.items():
            limit = ARG_LIMITS.get((name, p))
            if limit is not None and isinstance(value, (int, float)) and abs(value) > limit:
                raise ActionError("bad_argument", f"error : {p} must be at most {limit} in size",
                                  tool=name)
        args = ", ".join(f"{p}={_source(values[p])}" for p in params if p in values)
        return f"{name}({args})"

    def _spec_args(self, name: str) -> list[str]:
        return [a.name for t in self.tools() if t.name == name for a in t.args]

    def _available(self) -> set[str]:
        return {t.name for t in self.tools()}

    def canonical_action(self, text: str) -> str:
        """Python-call text as it is; a shell-style call as ``[name(arg=value, ...)]``."""
        try:
            self._decode_python(text)
            return text
        except (ActionError, AttributeError, TypeError):
            pass
        try:
            return "[" + ", ".join(self._decode_shell(text)) + "]"
        except ActionError:
            return text

    # -- what the agent sees --

    def tools(self) -> list[ToolSpec]:
        if self.entry is None:
            return list(_all_tools())
        turn = self._declared_turn()
        if self._tools is None or self._tools[0] != turn:
            owners = _owners(tuple(self.entry["involved_classes"]))
            specs = [_tool_spec(d, owners[d["name"]]) for d in _docs_at(self.entry, turn)
                     if d["name"] in owners]
            self._tools = (turn, specs)
        return list(self._tools[1])

    def _declared_turn(self) -> int:
        """The turn whose functions are declared now (after the last turn: the last one's)."""
        return 0 if self.synthetic else min(self.turn, len(self.questions) - 1)

    def instructions(self, call_format: str = "text", list_tools: bool = True) -> str | None:
        """``text``: the package's system prompt with the functions declared now (each as its
        whole JSON doc: up to 9,560 SmolLM2 tokens, past that model's 8,192 positions on 89
        of the first 400 test entries). The other formats: the generic prompt of the format
        over the same functions, one line each (at most 2,539 tokens there), which says how a
        turn ends."""
        if self.entry is None:
            return None
        if call_format == "text":
            return _system_prompt(self.entry, self._declared_turn())
        return (tool_instructions("BFCL", self.tools(), None, call_format, list_tools)
                + "\nWhen the request is done, reply without a call to end your turn.")

    def candidate_actions(self) -> list[str]:
        return []  # free-form generation: the call space has no useful finite list

    def call_grammar(self, call_format: str = "text") -> str | None:
        """One or more calls of the functions declared now, any string literal in a ``str``
        argument, or no call (the turn ends); ``text`` is the package's Python call list."""
        if self.entry is None:
            return None
        fmt = "pythonic" if call_format == "text" else call_format
        return call_grammar(self.tools(), fmt, strings="any", several=True, may_end=True)

    # -- state and outcome --

    def state(self) -> dict:
        return {name: _plain(inst) for name, inst in self.instances.items()}

    def evaluate(self, task: Task) -> float:
        goal = task.goal if isinstance(task.goal, dict) else {}
        if "bfcl_entry" in goal:
            return self._entry_score(task)
        conds = goal.get("all")
        if not isinstance(conds, list) or not conds or self.entry is None:
            return 0.0
        state = self.state()
        return 1.0 if all(_holds(state, c) for c in conds) else 0.0

    def goal_progress(self, task: Task) -> float:
        goal = task.goal if isinstance(task.goal, dict) else {}
        conds = goal.get("all")
        if not isinstance(conds, list) or not conds or self.entry is None:
            return self.evaluate(task)
        state = self.state()
        return sum(_holds(state, c) for c in conds) / len(conds)

    def _entry_score(self, task: Task) -> float:
        """1.0 iff this episode played ``task``'s entry to the end and the package's checker
        accepts its calls; computed once (the checker's instances are then deleted)."""
        if self.entry is None or task.goal.get("bfcl_entry") != self.entry["id"]:
            return 0.0
        if self.synthetic or not self.finished or self.force_quit:
            return 0.0
        if self._score is None:
            self._score = self._check()
            self._purge()  # self.instances keeps the live objects for state()
        return self._score

    def _check(self) -> float:
        _, checker = _bfcl()
        entry, truth = self.entry, _data().truths[self.entry["id"]]
        if len(self.calls) != len(truth):
            return 0.0
        category = _data().category[entry["id"]]
        try:
            result = checker.multi_turn_checker(self.calls, truth, entry, category,
                                                self.model_name)
            if result["valid"] and self.irrelevance_check:
                result = checker.multi_turn_irrelevance_checker(self.calls, truth)
        except Exception as exc:  # the checker asserts; a model must not crash the actor
            log.warning("bfcl checker failed on %s: %s", entry["id"], exc)
            return 0.0
        return 1.0 if result["valid"] else 0.0

    # -- self-questioning --

    def goal_from_states(self, before: dict, after: dict) -> dict:
        old, new = _leaves(before), _leaves(after)
        missing = object()
        paths = sorted(set(old) | set(new))
        return {"all": [[list(p), new.get(p)] for p in paths
                        if old.get(p, missing) != new.get(p, missing)]}

    def describe_changes(self, before: dict, after: dict) -> list[GoalPart]:
        """One part per changed object (the conditions sharing a parent path), in words."""
        groups: dict[tuple, list] = {}
        for path, value in self.goal_from_states(before, after)["all"]:
            groups.setdefault(tuple(path[:-1]), []).append([path, value])
        return [GoalPart(tuple(conds), " and ".join(_change_words(p, v) for p, v in conds),
                         tuple(k for k in parent[1:] if k != "contents"))
                for parent, conds in groups.items()]

    # -- tasks --

    def tasks(self, split: str) -> list[Task]:
        check_split(split)
        return [t for t in _tasks(self.categories) if t.split == split]

    @classmethod
    def vocabulary(cls) -> list[str]:
        return list(_vocabulary())


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Words of every user turn, every system prompt an entry can show and every
    ground-truth action."""
    data, words = _data(), set()
    for entry_id in data.order:
        entry = data.entries[entry_id]
        for turn in sorted({0} | {start for _, start in _held_out_starts(entry_id)}):
            words.update(_system_prompt(entry, turn).split())
        for text in _turn_texts(entry) + _reference(data.truths[entry_id]):
            words.update(text.split())
    return tuple(sorted(words))
