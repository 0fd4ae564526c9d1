"""Experiences from finished groups and explorations: short advice keyed by its situation.

An :class:`~protocol.messages.Experience` is retrieved by the cosine similarity of a task
query's embedding to its ``when_to_use``, and its ``content`` is injected into the prompt. Two
extractors write them:

* Rules, no LLM (:func:`from_group` and the functions it combines):

  - ``success``: what worked, the successful trajectory's actions without refused calls and
    without detours (calls after which the trajectory came back to a state it had been in);
  - ``failure``: a refused call, later retried with success after other calls changed the
    state, gives a precondition lesson ("fixed by mkdir docs first"); a refused call retried
    with other arguments gives "use ... instead"; a call repeated after refusals with no fix in
    a failed trajectory gives "avoid repeating ...";
  - ``contrast``: where the best trajectory of a group parted from the worst;
  - ``exploration``: the same error -> fix detector (:func:`find_fixes`, one implementation)
    over an explore-stage record.

* :class:`LLMExtractor`: a chat model reads the group and writes the advice as JSON (parsed,
  never evaluated). :class:`ExperienceExtractor` uses it when given and falls back to the rules
  for a group it made nothing usable of.

Design choices:

* ``when_to_use`` of a trajectory's lesson is the task query itself. Measured with the pool's
  embedder (all-MiniLM-L6-v2) over the ``files`` training tasks: the query of a "create folder
  logs and move ideas.md into it" task reaches the 0.5 retrieval threshold against 70% of the
  same template's queries in other worlds, while a generic "about to call mv and got error : ..."
  reached none of any template (at most 0.33), and the bare actions 15%. Explorations have no
  query, so their lessons are keyed by the environment's own words for the change the fix and
  its retry made (``describe_changes``, the words hindsight task synthesis turns into queries).
* Rule-made text is built only from copied actions, observations and queries plus
  :data:`ADVICE_WORDS`: the default policy is a word-level model whose vocabulary is the env's.
* A trajectory carries no states, so the rules replay its actions in a fresh env from the task's
  seed and trust the states only if every recorded observation comes back. States tell which
  calls changed nothing (``ls``, a refused call, ``cd`` there and back) and which calls can have
  fixed a precondition. Without them (an env that cannot replay) the rules still work, on the
  recorded errors alone and with lower confidence.

Validation (length, dedup by embedding) is the pool's; this module only avoids empty texts and
keeps rule-made advice under :data:`MAX_CHARS`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from environments import Environment
from environments.base import task_env_maker, task_env_of_run
from environments.call_formats import rewrite
from inference.llm import ChatModel, LLMError, ReplyFormat, extract_json
from navigating.pool import env_tag, experience_id
from protocol.config import EnvConfig
from protocol.messages import Experience, Group, Step, Task, Trajectory
from questioning.explorer import Exploration

log = logging.getLogger(__name__)

# Every fixed word rule-made advice uses; all else is copied from actions, observations, queries.
ADVICE_WORDS: tuple[str, ...] = (
    "worked", ":", ";", ",", "->", "...", "after", "fixed", "by", "first", "then", "use",
    "instead", "avoid", "repeating", "do", "not",
)
MAX_CHARS = 400  # the pool rejects longer advice; rule-made text is cut to fit
OBS_WORDS = 12  # an observation is quoted up to this many words
MAX_FIX_CALLS = 6  # calls quoted as the fix of one refusal
KNOWN, UNKNOWN = 0.8, 0.6  # confidence of a fix lesson with and without replayed states


# --- calls and the error -> fix detector -------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call as the rules see it, from a trajectory step or an exploration step."""

    action: str
    observation: str
    tool: str | None
    valid: bool
    error: str | None
    changed: bool | None  # the call changed the env's state; None where states are unknown

    @property
    def ok(self) -> bool:
        return self.valid and not self.error

    @property
    def args(self) -> list[str]:
        return self.action.split()[1:]

    @property
    def tool_name(self) -> str:
        return self.tool or (self.action.split() or [""])[0]


@dataclass(frozen=True)
class Fix:
    """A refused call, the calls that made its retry work (none: the retry is an alternative),
    and the successful retry, as indices into the call list."""

    failed: int
    fixes: tuple[int, ...]
    retry: int


def find_fixes(calls: Sequence[Call], states: Sequence[dict] | None = None,
               task: Task | None = None) -> list[Fix]:
    """Error -> fix pairs, one per successful retry.

    A retry is a later successful call of the same tool on the same first argument (a different
    tool on the same name is another intent: ``cd docs`` does not replace a refused
    ``rm docs``). Of several refusals one retry answers, the lesson keeps the latest with the
    retry's exact action, else the latest: a precondition beats an alternative. ``states`` (the
    initial one first, then one after each call) drop fixes the retry undoes (``touch x`` to
    ``rm x``: nothing a task wants); ``task``, given when replaying the calls from it reproduces
    them, lets :func:`_fix_calls` test which calls the retry needed."""
    best: dict[int, tuple[tuple[bool, int], Fix]] = {}
    for i, call in enumerate(calls):
        if not call.valid or call.ok:
            continue  # an unparsable call has no precondition to learn
        k = _retry_of(calls, i)
        if k is None:
            continue
        fixes = _fix_calls(calls, i, k, task)
        same = calls[k].action == call.action
        if not fixes and same:
            continue  # it worked again with no change in between: nothing to learn
        if fixes and states is not None and _undone(calls, states, task, fixes, k):
            continue
        rank = (same, i)
        if k not in best or rank > best[k][0]:
            best[k] = (rank, Fix(i, fixes, k))
    return [best[k][1] for k in sorted(best)]


def _retry_of(calls: Sequence[Call], i: int) -> int | None:
    failed = calls[i]
    for k in range(i + 1, len(calls)):
        call = calls[k]
        if not call.ok or call.tool_name != failed.tool_name:
            continue
        if call.action == failed.action or call.args[:1] == failed.args[:1] != []:
            return k
    return None


def _fix_calls(calls: Sequence[Call], i: int, k: int, task: Task | None) -> tuple[int, ...]:
    """The calls between a refusal and its retry that the retry needed.

    Candidates are the calls that changed the state (any successful one where changes are
    unknown). With a replayable ``task`` each is left out in turn, latest first, and kept only
    if the retry then fails: what remains is a fix that caused the success, not wandering.
    Otherwise a guess: the changes from the first one touching a name the refusal mentioned,
    or the last change alone."""
    between = [j for j in range(i + 1, k) if calls[j].ok and calls[j].changed is not False]
    needed = _needed(task, [c.action for c in calls], k, between) if task else None
    if needed is not None:
        return needed[:MAX_FIX_CALLS]
    names = set(calls[i].args) | set(calls[i].observation.split())
    related = [j for j in between if names & set(calls[j].args)]
    chosen = between[between.index(related[0]):] if related else between[-1:]
    return tuple(chosen[:MAX_FIX_CALLS])


def _undone(calls: Sequence[Call], states: Sequence[dict], task: Task | None,
            fixes: tuple[int, ...], k: int) -> bool:
    """Whether the retry undoes its fixes (``touch x`` then ``rm x``). With a replayable task,
    the fixes and the retry alone are replayed after the calls before them, so unrelated
    changes in between do not hide the round trip."""
    if task is None:
        return states[fixes[0]] == states[k + 1]
    actions = [c.action for c in calls]
    replay = _run(task, actions[: fixes[0]] + [actions[j] for j in fixes] + [actions[k]])
    return replay is not None and replay.states[-1] == states[fixes[0]]


def _needed(task: Task, actions: Sequence[str], k: int,
            between: Sequence[int]) -> tuple[int, ...] | None:
    dropped: set[int] = set()
    for j in reversed(between):
        trial = [actions[n] for n in range(k + 1) if n != j and n not in dropped]
        replay = _run(task, trial)
        if replay is None:
            return None
        if replay.ok[-1]:
            dropped.add(j)
    return tuple(j for j in between if j not in dropped)


def _fix_content(calls: Sequence[Call], fix: Fix) -> str:
    failed, retry = calls[fix.failed], calls[fix.retry]
    head = f"{_quote(failed.observation)} after {failed.action}"
    if not fix.fixes:
        return f"{head} ; use {retry.action} instead"
    text = f"{head} ; fixed by {' , '.join(calls[j].action for j in fix.fixes)} first"
    return text if retry.action == failed.action else f"{text} then {retry.action}"


def _fix_tags(calls: Sequence[Call], fix: Fix) -> list[str]:
    return ["precondition" if fix.fixes else "instead", calls[fix.failed].error or "error"]


def _fix_tools(calls: Sequence[Call], fix: Fix) -> list[str]:
    return _tools(calls[j].action for j in (fix.failed, *fix.fixes, fix.retry))


def _tools(actions: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(a.split()[0] for a in actions if a.split()))


# --- replay ------------------------------------------------------------------------------------


class _Replay(NamedTuple):
    observations: list[str]
    ok: list[bool]  # each call parsed and was not refused
    states: list[dict]  # the initial state first, then one after each action
    reward: float


# The run's env while an ExperienceExtractor extracts: the replays of its tasks go to it (a
# served env to its server, with the run's options). Set for the extractor's call only, so the
# rule functions keep their signatures and a bare call replays each task's env by name.
_RUN_ENV: ContextVar[EnvConfig | None] = ContextVar("run_env", default=None)


@contextmanager
def _replaying_in(env_cfg: EnvConfig | None) -> Iterator[None]:
    token = _RUN_ENV.set(env_cfg)
    try:
        yield
    finally:
        _RUN_ENV.reset(token)


class OtherEnv(Exception):
    """A task that is not of the run's env, met while replaying in the run's env: it is never
    built (building it would import what its ``meta.env_spec`` names)."""


def _task_env(task: Task) -> Environment:
    """A fresh env to replay ``task`` in: with the run's env set (an ExperienceExtractor's
    call) only that env, and a task of another raises :class:`OtherEnv`; without it (a bare
    call) the env the task names, by name."""
    run_env = _RUN_ENV.get()
    if run_env is not None and not task_env_of_run(task, run_env):
        raise OtherEnv(f"task {task.task_id} is of env {task.env!r}, not the run's "
                       f"{run_env.name!r}")
    return task_env_maker(task, run_env)()


def in_text_format(task: Task, trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """``trajs`` (of ``task``) with each call their policy wrote in another format
    (``info["call_format"]``) rewritten as the text-format call it makes: the rules read,
    replay and quote text-format calls. A reply that is no call stays as it was (a replay
    refuses it again)."""
    trajs = [_without_context_steps(t) for t in trajs]
    if all(t.info.get("call_format", "text") == "text" or not t.steps for t in trajs):
        return list(trajs)
    try:
        env = _task_env(task)
        env.reset(task)
        tools = env.tools()
    except Exception as exc:  # as in _run: extraction goes on with what it has
        log.debug("cannot list the tools of task %s: %r", task.task_id, exc)
        return list(trajs)
    return [t if t.info.get("call_format", "text") == "text" else replace(
        t, info={**t.info, "call_format": "text"},
        steps=[replace(s, action=rewrite(s.action, tools, "text", t.info["call_format"]))
               for s in t.steps]) for t in trajs]


def _without_context_steps(traj: Trajectory) -> Trajectory:
    """``traj`` without the steps that called the agent's own context tools (env.context
    self): the env never saw them, so no replay or rule may."""
    if not any(s.info.get("context") for s in traj.steps):
        return traj
    return replace(traj, steps=[s for s in traj.steps if not s.info.get("context")])


def _run(task: Task, actions: Sequence[str]) -> _Replay | None:
    """``actions`` replayed in a fresh env from the task's seed; None when the env cannot."""
    try:
        env = _task_env(task)
        env.reset(task)
        observations, ok, states = [], [], [env.state()]
        for action in actions:
            obs, _, info = env.step(action)
            observations.append(obs)
            ok.append(bool(info.get("valid")) and info.get("error") is None)
            states.append(env.state())
        return _Replay(observations, ok, states, float(env.evaluate(task)))
    except Exception as exc:  # replay only sharpens the rules: it must never stop extraction
        log.debug("cannot replay task %s: %r", task.task_id, exc)
        return None


def _replayed_states(task: Task, steps: Sequence[Step]) -> list[dict] | None:
    """The trajectory's states, when a replay reproduces every observation it recorded."""
    replay = _run(task, [s.action for s in steps])
    if replay is None or replay.observations != [s.observation for s in steps]:
        return None
    return replay.states


def _trajectory_calls(steps: Sequence[Step], states: list[dict] | None) -> list[Call]:
    return [
        Call(s.action, s.observation, s.info.get("tool"), bool(s.valid), s.info.get("error"),
              None if states is None else states[j + 1] != states[j])
        for j, s in enumerate(steps)
    ]


def _state_key(state: dict) -> str:
    return json.dumps(state, sort_keys=True, default=str)


def _without_detours(actions: Sequence[str], states: Sequence[dict]) -> list[str]:
    """Cut every stretch of calls that ends in a state seen before it: a refused call, a read,
    ``cd`` there and back. The env is deterministic, so the rest still reaches the end state."""
    path, kept = [_state_key(states[0])], []
    for action, state in zip(actions, states[1:]):
        key = _state_key(state)
        if key in path:
            cut = path.index(key)
            path, kept = path[: cut + 1], kept[:cut]
        else:
            path.append(key)
            kept.append(action)
    return kept


def _worked_actions(task: Task, steps: Sequence[Step]) -> list[str]:
    """The shortest replay-verified way the trajectory reached its goal: without detours, then
    with its last call put back (a read the goal asks for changes no state), else every
    successful call."""
    ok = [s.action for s in steps if s.valid and not s.info.get("error")]
    states = _replayed_states(task, steps)
    if states is None or not steps:
        return ok
    short = _without_detours([s.action for s in steps], states)
    for candidate in (short, short + [steps[-1].action]):
        replay = _run(task, candidate)
        if candidate and replay is not None and replay.reward >= 1.0:
            return candidate
    return ok


# --- rules over trajectories -------------------------------------------------------------------


def from_success(task: Task, traj: Trajectory, version: int,
                 success_rate: float | None = None) -> list[Experience]:
    """What worked: the task query, and ``worked : a ; b ; c`` with the actions that solved it.

    Confidence grows with the group's success rate (a solution most attempts found is a safe
    one to copy); a single verified success starts at 0.5."""
    if not traj.success:
        return []
    traj = in_text_format(task, [traj])[0]
    actions = _worked_actions(task, traj.steps)
    if not actions:
        return []
    confidence = 0.75 if success_rate is None else 0.5 + 0.5 * _unit(success_rate)
    exp = _make(task.query, _joined("worked :", actions), "success", ["success", task.env],
                _tools(actions), confidence, [traj.traj_id], version)
    return [exp] if exp else []


def from_failure(task: Task, traj: Trajectory, version: int) -> list[Experience]:
    """Lessons from refusals in any trajectory: error -> fix pairs (:func:`find_fixes`), and for a
    failed trajectory, calls it repeated after refusals (``avoid repeating ...``).

    A precondition lesson holds whatever the outcome (the replay shows the fix made the retry
    work); "use <retry> instead" only when the retry is part of a solution, since an untried
    alternative is just another action."""
    traj = in_text_format(task, [traj])[0]
    states = _replayed_states(task, traj.steps)
    calls = _trajectory_calls(traj.steps, states)
    solution = set(_worked_actions(task, traj.steps)) if traj.success else set()
    fixes = [
        fix for fix in find_fixes(calls, states, task if states is not None else None)
        if fix.fixes or calls[fix.retry].action in solution
    ]
    confidence = KNOWN if states is not None else UNKNOWN
    out = [
        _make(task.query, _fix_content(calls, fix), "failure",
              ["failure", *_fix_tags(calls, fix), task.env], _fix_tools(calls, fix), confidence,
              [traj.traj_id], version)
        for fix in fixes
    ]
    if not traj.success:
        out += _avoid(task, traj, calls, version)
    return [e for e in out if e]


def _avoid(task: Task, traj: Trajectory, calls: Sequence[Call],
           version: int) -> list[Experience | None]:
    """``avoid repeating <call> after <error>`` for each call refused at least twice and never
    retried with success. Only the identical call: whether a call fails depends on the state,
    so "avoid cd docs" could forbid a step the task needs, while repeating a refusal is never
    the fix."""
    unfixed: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        if not call.ok and _retry_of(calls, i) is None:
            unfixed.setdefault(call.action, []).append(i)
    out = []
    for action, idx in unfixed.items():
        if len(idx) < 2:
            continue
        last = calls[idx[-1]]
        content = f"avoid repeating {action} after {_quote(last.observation)}"
        out.append(_make(task.query, content, "failure",
                         ["failure", "avoid", last.error or "error", task.env], _tools([action]),
                         min(0.8, 0.3 + 0.1 * len(idx)), [traj.traj_id], version))
    return out


def from_contrast(group: Group, version: int) -> list[Experience]:
    """What the best trajectory did where it parted from the worst (only when rewards differ):
    ``after <last shared call> ; do <best's call> ; not <worst's call>``.

    The best is the shortest of the top reward; the worst, of the lowest reward, the one that
    followed it longest (the latest parting point says the most). The best's calls are those
    that moved it on (:func:`_worked_actions`); the worst's keep its refusals, which are often
    what went wrong, and drop only successful calls that changed nothing."""
    trajs = in_text_format(group.task, group.trajectories)
    if len(trajs) < 2 or max(t.reward for t in trajs) <= min(t.reward for t in trajs):
        return []
    top, low = max(t.reward for t in trajs), min(t.reward for t in trajs)
    best = min((t for t in trajs if t.reward == top), key=lambda t: len(t.steps))
    a = _worked_actions(group.task, best.steps)
    worsts = {t.traj_id: _tried_actions(group.task, t) for t in trajs if t.reward == low}
    worst_id = max(worsts, key=lambda tid: _shared(a, worsts[tid]))
    b = worsts[worst_id]
    d = _shared(a, b)
    if d >= len(a):
        return []  # the best did nothing the worst did not
    text = (f"after {a[d - 1]} ; do {a[d]}" if d else f"first do {a[d]}")
    text += f" ; not {b[d]}" if d < len(b) else ""
    exp = _make(group.task.query, text, "contrast", ["contrast", group.task.env],
                _tools([a[d]] + b[d:d + 1]),
                0.5 + 0.5 * _unit(top - low), [best.traj_id, worst_id], version)
    return [exp] if exp else []


def _tried_actions(task: Task, traj: Trajectory) -> list[str]:
    calls = _trajectory_calls(traj.steps, _replayed_states(task, traj.steps))
    return [c.action for c in calls if not (c.ok and c.changed is False)]


def _shared(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def from_group(group: Group, version: int) -> list[Experience]:
    """Every rule over one finished group, duplicates merged.

    Of the successful trajectories only the shortest solution is kept: all of them share the
    task query as ``when_to_use``, so they would compete for one retrieval slot anyway."""
    task, trajs = group.task, in_text_format(group.task, group.trajectories)
    group = replace(group, trajectories=trajs)
    rate = sum(t.success for t in trajs) / len(trajs) if trajs else None
    wins = _merge([e for t in trajs for e in from_success(task, t, version, rate)])
    out = [min(wins, key=lambda e: len(e.content))] if wins else []
    for traj in trajs:
        out += from_failure(task, traj, version)
    return _merge(out + from_contrast(group, version))


# --- rules over explorations -------------------------------------------------------------------


def from_exploration(record: Exploration | dict, version: int = -1,
                     env: Environment | None = None) -> list[Experience]:
    """Precondition lessons (kind ``exploration``) from one explore-stage record (an
    :class:`~questioning.explorer.Exploration` or its ``to_dict()`` line).

    Only a refused call that worked again unchanged after a fix counts: an explorer pursues no
    task, so a retry with other arguments is another intent, not an alternative. ``when_to_use``
    is the env's description of what the fix and the retry did, so it reads like the task
    queries it should be retrieved for; ``env`` (default: a fresh one of the record's env)
    supplies those words."""
    rec = record if isinstance(record, Exploration) else Exploration.from_dict(record)
    states = [rec.initial_state] + [s.state for s in rec.steps]
    calls = [
        Call(s.action, s.observation, s.tool, s.valid, s.error, states[j + 1] != states[j])
        for j, s in enumerate(rec.steps)
    ]
    seed_task = Task(f"explore/{rec.seed}", rec.env, "", rec.seed)
    replay = _run(seed_task, [c.action for c in calls])
    reproduced = replay is not None and replay.observations == [c.observation for c in calls]
    env = env if env is not None else _env_named(rec.env)
    out = []
    for fix in find_fixes(calls, states, seed_task if reproduced else None):
        if not fix.fixes or calls[fix.retry].action != calls[fix.failed].action:
            continue
        out.append(_make(_situation(env, calls, states, fix), _fix_content(calls, fix),
                         "exploration", ["exploration", *_fix_tags(calls, fix), rec.env],
                         _fix_tools(calls, fix), KNOWN if reproduced else UNKNOWN,
                         [rec.exploration_id], version))
    return _merge([e for e in out if e])


def _env_named(name: str) -> Environment | None:
    try:
        return _task_env(Task("", name, "", 0))
    except Exception:  # an env that cannot be built here: lessons keep their action keys
        return None


def _situation(env: Environment | None, calls: Sequence[Call], states: Sequence[dict],
               fix: Fix) -> str:
    """The env's words for what each fix call and the retry did (each call's own change, so
    unrelated changes in between stay out), or their actions when it has none."""
    texts: list[str | None] = []
    try:
        for j in (*fix.fixes, fix.retry):
            texts += [p.text for p in env.describe_changes(states[j], states[j + 1])]
        retry = calls[fix.retry]
        if not retry.changed:  # a read: the words for what it asked
            read = env.describe_response(retry.action, retry.observation, states[fix.retry])
            texts += [read.text] if read is not None else []
        if texts and all(texts):
            return env.query_of(list(dict.fromkeys(texts)))
    except Exception as exc:  # no env, or a plugin's description hook failing: action words
        log.debug("no description for an exploration fix: %r", exc)
    return " ; ".join(calls[j].action for j in (*fix.fixes, fix.retry))


# --- shared helpers ----------------------------------------------------------------------------


def _make(when: str, content: str, kind: str, tags: list[str], tools: list[str],
          confidence: float, sources: list[str], version: int) -> Experience | None:
    when, content = " ".join(when.split()), _fit(" ".join(content.split()))
    if not when or not content:
        return None
    return Experience(
        exp_id=experience_id(when, content), when_to_use=when, content=content, kind=kind,
        tags=list(dict.fromkeys(t for t in tags if t)), tools=tools,
        confidence=round(_unit(confidence), 3), source_traj_ids=list(sources),
        created_version=version,
    )


def _merge(exps: Sequence[Experience]) -> list[Experience]:
    """One experience per id, with the sources of all its copies."""
    out: dict[str, Experience] = {}
    for e in exps:
        kept = out.setdefault(e.exp_id, e)
        if kept is not e:
            kept.source_traj_ids = list(dict.fromkeys(kept.source_traj_ids + e.source_traj_ids))
            kept.confidence = max(kept.confidence, e.confidence)
    return list(out.values())


def _quote(text: str) -> str:
    words = text.split()
    return " ".join(words if len(words) <= OBS_WORDS else words[:OBS_WORDS] + ["..."])


def _joined(head: str, actions: Sequence[str]) -> str:
    return f"{head} {' ; '.join(actions)}"


def _fit(text: str) -> str:
    """At most MAX_CHARS, cut at a word with ``...`` marking the cut."""
    if len(text) <= MAX_CHARS:
        return text
    words = text[: MAX_CHARS - 4].split()[:-1]
    return " ".join(words + ["..."])


def _unit(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


# --- LLM extraction ----------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You turn an agent's attempts at one task into short advice for later attempts at similar "
    "tasks. You see the task, each attempt's actions with what the environment answered, and "
    "its reward (1 = solved). Write at most {n} experiences covering what worked, what went "
    "wrong and how it was fixed, and what the best attempt did that the worst did not. Each "
    "has: when_to_use (one sentence phrased like a task request, naming the situations it "
    "helps), content (the advice, under 60 words, naming the exact actions), tags, tools (the "
    "tool names it is about) and confidence (0 to 1). Reply with only a JSON object: "
    '{{"experiences": [{{"when_to_use": "...", "content": "...", "tags": ["..."], '
    '"tools": ["..."], "confidence": 0.8}}]}}'
)
PROMPT_TRAJECTORIES = 8  # attempts shown per group
PROMPT_STEPS = 12  # steps shown per attempt
PROMPT_OBS_WORDS = 24  # words shown per observation


def build_messages(group: Group, max_items: int) -> list[dict]:
    """The system and user messages asking for a group's experiences."""
    parts = [f"Task: {group.task.query}"]
    for n, traj in enumerate(group.trajectories[:PROMPT_TRAJECTORIES], 1):
        status = "solved" if traj.success else "not solved"
        lines = [f"Attempt {n} (reward {traj.reward:g}, {status}):"]
        for i, step in enumerate(traj.steps[:PROMPT_STEPS], 1):
            obs = " ".join(step.observation.split()[:PROMPT_OBS_WORDS])
            thought = (f"(thought: {' '.join(step.thought.split()[:PROMPT_OBS_WORDS])}) "
                       if step.thought else "")
            lines.append(f"{i}. {thought}{step.action} -> {obs}")
        if len(traj.steps) > PROMPT_STEPS:
            lines.append(f"... {len(traj.steps) - PROMPT_STEPS} more steps")
        parts.append("\n".join(lines))
    parts.append("Reply with the JSON object only.")
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(n=max_items)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


class LLMExtractor:
    """Experiences (kind ``llm``) written by a chat model from a whole group.

    Never raises for a bad reply or a failed request: a reply that is not the asked-for JSON
    and each unusable item count in ``malformed``, a failed request in ``errors``, and they
    are dropped, so one flaky call cannot stall the extraction loop."""

    def __init__(self, chat: ChatModel, max_per_group: int = 3, temperature: float = 0.2,
                 max_tokens: int = 768):
        self.chat = chat
        self.max_per_group = max_per_group
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.requests = self.malformed = self.errors = 0

    def extract(self, group: Group, version: int) -> list[Experience]:
        self.requests += 1
        try:
            reply = self.chat.complete(build_messages(group, self.max_per_group),
                                       temperature=self.temperature, max_tokens=self.max_tokens,
                                       reply_format=experiences_format(self.max_per_group))
        except LLMError as exc:
            self.errors += 1
            log.warning("experience extraction request failed: %s", exc)
            return []
        try:
            items = _reply_items(reply)
        except ValueError as exc:
            self.malformed += 1
            log.warning("experience extraction reply malformed: %s", exc)
            return []
        return self._experiences(items, group, version)

    def _experiences(self, items: list, group: Group, version: int) -> list[Experience]:
        out: list[Experience] = []
        sources = [t.traj_id for t in group.trajectories]
        for item in items:
            if len(out) == self.max_per_group:
                break
            try:
                out.append(_llm_experience(item, sources, version))
            except ValueError as exc:
                self.malformed += 1
                log.warning("experience extraction item dropped: %s", exc)
        return _merge(out)


def experiences_format(max_items: int) -> ReplyFormat:
    """The JSON :func:`_llm_experience` reads, as a schema an endpoint can enforce."""
    strings = {"type": "array", "items": {"type": "string"}}
    item = {"type": "object", "required": ["when_to_use", "content", "confidence"],
            "properties": {"when_to_use": {"type": "string", "minLength": 1},
                           "content": {"type": "string", "minLength": 1},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                           "tags": strings, "tools": strings}}
    return ReplyFormat("experiences", json_schema={
        "type": "object", "required": ["experiences"],
        "properties": {"experiences": {"type": "array", "items": item,
                                       "minItems": 1, "maxItems": max_items}}})


def _reply_items(reply: str) -> list:
    data = extract_json(reply)
    items = data.get("experiences") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError("no 'experiences' list in the reply")
    return items


def _llm_experience(item, sources: list[str], version: int) -> Experience:
    """One reply item as an Experience; ValueError when it is not usable."""
    if not isinstance(item, dict):
        raise ValueError("item is not an object")
    when, content = _text(item, "when_to_use"), _text(item, "content")
    confidence = item.get("confidence", 0.5)
    # bool is an int subclass; true/false is a confused reply, not a number
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)):
        raise ValueError("'confidence' is not a number")
    if confidence != confidence:
        raise ValueError("'confidence' is NaN")
    return Experience(
        exp_id=experience_id(when, content), when_to_use=when, content=content, kind="llm",
        tags=_strings(item, "tags"), tools=_strings(item, "tools"),
        confidence=round(_unit(confidence), 3), source_traj_ids=list(sources),
        created_version=version,
    )


def _text(item: dict, key: str) -> str:
    value = item.get(key)
    text = " ".join(value.split()) if isinstance(value, str) else ""
    if not text:
        raise ValueError(f"'{key}' is missing or empty")
    return text


def _strings(item: dict, key: str) -> list[str]:
    value = item.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"'{key}' is not a list of strings")
    return list(dict.fromkeys(v.strip() for v in value if v.strip()))


# --- the extractor ------------------------------------------------------------------------------


def with_env_tag(task: Task, exps: list[Experience]) -> list[Experience]:
    """``exps`` tagged with the env-mix member of ``task`` (:func:`env_tag`), so retrieval
    can keep to the member's own lessons (``navigating.pool.ExperiencePool.retrieve``)."""
    tag = env_tag(task)
    if not tag:
        return exps
    return [e if tag in e.tags else replace(e, tags=[*e.tags, tag]) for e in exps]



class ExperienceExtractor:
    """Experiences from groups (the LLM when given, else the rules) and from explorations.

    A group the LLM made nothing usable of (a failed request, a malformed reply) falls back to
    the rules, so a flaky endpoint still leaves the pool growing; ``fallbacks`` counts those and
    ``counts`` the experiences made, per kind."""

    def __init__(self, llm: LLMExtractor | None = None, env: EnvConfig | None = None):
        self.llm = llm
        self.env = env  # the run's env: its tasks are replayed there (None: by name, here)
        self.counts: Counter[str] = Counter()
        self.fallbacks = 0
        self.other_env = 0  # groups and explorations skipped: not of the run's env

    def from_group(self, group: Group, version: int) -> list[Experience]:
        if self._other_env(group.task, f"group {group.group_id!r}"):
            return []
        exps = self.llm.extract(group, version) if self.llm is not None else []
        if self.llm is not None and not exps:
            self.fallbacks += 1
        if not exps:
            with _replaying_in(self.env):
                exps = from_group(group, version)
        return self._counted(with_env_tag(group.task, exps))

    def from_exploration(self, record: Exploration | dict, version: int = -1) -> list[Experience]:
        rec = record if isinstance(record, Exploration) else Exploration.from_dict(record)
        if self._other_env(Task(f"explore/{rec.seed}", rec.env, "", rec.seed),
                           f"exploration {rec.exploration_id!r}"):
            return []
        with _replaying_in(self.env):
            return self._counted(from_exploration(rec, version))

    def _other_env(self, task: Task, what: str) -> bool:
        """With the run's env set, a task of another env is skipped (one warning line, counted
        in ``other_env``) and never built: its ``meta.env_spec`` could name any module, and
        replay serves whatever was stored."""
        if self.env is None or task_env_of_run(task, self.env):
            return False
        self.other_env += 1
        spec = task.meta.get("env_spec") if isinstance(task.meta, dict) else None
        log.warning("experience: skipped %s: its task %r is of env %r%s, not the run's %r "
                    "(%d skipped so far)", what, task.task_id, task.env,
                    f" ({spec!r})" if spec else "", self.env.name, self.other_env)
        return True

    def _counted(self, exps: list[Experience]) -> list[Experience]:
        self.counts.update(e.kind for e in exps)
        return exps


# --- for a run -----------------------------------------------------------------------------------


def make_extractor(cfg, run_dir: Path | None = None) -> ExperienceExtractor:
    """The extractor ``experience.extractor`` asks for, for a run config (``RunConfig``)."""
    choice = cfg.experience.extractor
    if choice == "auto":
        choice = "llm" if cfg.llm.url else "rules"
    if choice == "rules":
        return ExperienceExtractor(env=cfg.env)
    if not cfg.llm.url:
        raise ValueError("experience.extractor=llm needs llm.url (an OpenAI-compatible endpoint)")
    from inference.llm import OpenAIChat
    from protocol.run_dir import RunDir

    replies = RunDir(run_dir).llm_replies("experience") if run_dir is not None else None
    return ExperienceExtractor(LLMExtractor(OpenAIChat.from_config(cfg.llm, reply_log=replies)),
                               env=cfg.env)


def seed_from_explorations(pool, run_dir: Path, extractor: ExperienceExtractor) -> dict:
    """Lessons from the explore stage's trajectories; nothing when it did not run."""
    from questioning.factory import read_explorations

    exps = [e for record in read_explorations(run_dir)
            for e in extractor.from_exploration(record)]
    return pool.add(exps) if exps else {"added": 0}
