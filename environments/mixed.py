"""Several envs as one: the environment of a run whose config sets ``env.mix``.

``environments.base.env_class(env_cfg)`` returns :func:`mixed_class` of an ``EnvConfig`` with
a mix: a subclass of :class:`MixedEnv` bound to its members (each ``EnvMember``: a name,
options, an address or none, a weight), so everything that makes the run's env (actors,
judges, the experience worker, the warm-start, evaluation) makes a mixture without knowing it.

- Its tasks (``tasks(split)``) are every member's, in the order of ``env.mix``, each with the
  member's id in ``Task.meta["env_member"]`` (``protocol.config.TASK_ENV_MEMBER``) and an id
  that starts ``<member id>/`` (the member's own id where it already does, as ``files/...``
  and ``shop/...`` do, else prefixed, the member's own kept in ``meta["member_task_id"]``):
  ids of two envs never collide. ``Task.env`` stays the member's registered name.
- An instance holds one instance of each member it has been reset into (made on first use,
  in process or a session on the member's env server). ``reset(task)`` picks the task's
  member, and every later call goes to it; a call that names a task (``evaluate``,
  ``goal_progress``) goes to that task's member, given the task as the member made it.
- ``call_all`` (what a rollout asks of all its episodes each turn) hands each call to its
  member's instance and sends them with ``environments.base.call_all``, so a served member's
  calls still go to its server together, new sessions opened with their first call.
- ``vocabulary()`` is the union of the members' (``[]``, open, when any member's is open).

Explore over a mix is not supported (``train_worlds`` is empty and the run refuses a mixture
that needs self-made tasks); a group is one task's rollouts, so always one env.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence

from environments.base import (
    Environment,
    EnvMaker,
    call_all,
    env_class,
    register_mixed,
)
from protocol.config import TASK_ENV_MEMBER, EnvConfig, task_member
from protocol.errors import EnvFailed
from protocol.messages import Task

MEMBER_TASK_ID = "member_task_id"  # Task.meta: the member's own id, where the mix's differs


def mixed_task(member_id: str, task: Task) -> Task:
    """``task`` of member ``member_id`` as the mix shows it (module docstring)."""
    prefix = f"{member_id}/"
    task_id = task.task_id if task.task_id.startswith(prefix) else prefix + task.task_id
    meta = {**task.meta, TASK_ENV_MEMBER: member_id}
    if task_id != task.task_id:
        meta[MEMBER_TASK_ID] = task.task_id
    return dataclasses.replace(task, task_id=task_id, meta=meta)


def member_task(task: Task) -> Task:
    """``task`` as its member made it: its own id, without the mix's meta keys."""
    meta = task.meta if isinstance(task.meta, dict) else {}
    if TASK_ENV_MEMBER not in meta:
        return task
    own = meta.get(MEMBER_TASK_ID)
    return dataclasses.replace(
        task, task_id=own if isinstance(own, str) and own else task.task_id,
        meta={k: v for k, v in meta.items() if k not in (TASK_ENV_MEMBER, MEMBER_TASK_ID)})


@dataclasses.dataclass(frozen=True)
class Member:
    """One env of the mix as the class holds it."""

    id: str
    config: EnvConfig  # its own env section (name, options, address, max_turns; no mix)
    weight: float
    maker: EnvMaker  # its instances: in process, or sessions on its server


class MixedEnv(Environment):
    """The mixture of ``members`` (set on the subclass :func:`mixed_class` makes)."""

    name = "mix"
    members: tuple[Member, ...] = ()

    def __init__(self):
        super().__init__()
        self._envs: dict[str, Environment] = {}  # member id -> its instance here
        self._on: Environment | None = None  # the instance of the current task's member
        self._on_id = ""

    # -- which member ----------------------------------------------------------------------

    @classmethod
    def member_of(cls, task: Task) -> Member:
        """The member ``task`` is of: by its ``env_member`` id, else the one member of the env
        it names; ValueError where there is none (or more than one)."""
        wanted = task_member(task)
        if wanted:
            found = [m for m in cls.members if m.id == wanted]
        else:
            found = [m for m in cls.members if m.config.name.rpartition(":")[2] == task.env]
        if len(found) != 1:
            ids = ", ".join(m.id for m in cls.members)
            raise ValueError(f"task {task.task_id!r} (env {task.env!r}"
                             f"{f', member {wanted!r}' if wanted else ''}) is of no single "
                             f"member of this mix ({ids})")
        return found[0]

    def _instance(self, member: Member) -> Environment:
        env = self._envs.get(member.id)
        if env is None:
            env = self._envs[member.id] = member.maker()
        return env

    def _current(self) -> Environment:
        """The current task's member instance; before any reset, the first member's."""
        if self._on is None:
            self._on_id = self.members[0].id
            self._on = self._instance(self.members[0])
        return self._on

    def _select(self, task: Task, env: Environment | None = None) -> Task:
        member = self.member_of(task)
        if env is not None:
            self._envs[member.id] = env
        self._on, self._on_id = self._instance(member), member.id
        self.task = task
        return member_task(task)

    @property
    def turn_limit(self) -> int:
        """Actions per episode of the current task's member (its ``max_turns``): what a
        rollout ends this episode at (``episodes.rollout``; 0 before the first reset or
        call)."""
        return next((m.config.max_turns for m in self.members if m.id == self._on_id), 0)

    @property
    def member_id(self) -> str:
        """The id of the member the current task is of ("" before the first reset or call;
        a call before any reset goes to the first member)."""
        return self._on_id

    def close(self) -> None:
        """Close each member instance that can be closed (a served member's session)."""
        for env in self._envs.values():
            close = getattr(env, "close", None)
            if callable(close):
                close()

    # -- the interface, routed ---------------------------------------------------------------

    @property
    def query_in_prompt(self) -> bool:  # the current member's
        return bool(self._current().query_in_prompt)

    @property
    def responses(self) -> list[str]:
        return self._on.responses if self._on is not None else self._own_responses

    @responses.setter
    def responses(self, value: list[str]) -> None:
        self._own_responses = value  # Environment.__init__'s; a member keeps its own

    def reset(self, task: Task) -> str:
        own = self._select(task)
        return self._on.reset(own)

    def step(self, action_text: str, call_format: str = "text"):
        return self._current().step(action_text, call_format)

    def execute(self, call):
        return self._current().execute(call)

    def tools(self):
        return self._current().tools()

    def state(self):
        return self._current().state()

    def evaluate(self, task: Task) -> float:
        return self._instance(self.member_of(task)).evaluate(member_task(task))

    def goal_progress(self, task: Task) -> float:
        return self._instance(self.member_of(task)).goal_progress(member_task(task))

    def instructions(self, call_format: str = "text", list_tools: bool = True):
        return self._current().instructions(call_format, list_tools)

    def example_action(self):
        return self._current().example_action()

    def canonical_action(self, text: str) -> str:
        return self._current().canonical_action(text)

    def candidate_actions(self):
        return self._current().candidate_actions()

    def call_grammar(self, call_format: str = "text"):
        return self._current().call_grammar(call_format)

    def goal_from_states(self, before, after):
        return self._current().goal_from_states(before, after)

    def describe_changes(self, before, after):
        return self._current().describe_changes(before, after)

    def describe_response(self, action, observation, before):
        return self._current().describe_response(action, observation, before)

    def describe_event(self, action, observation, before, after):
        return self._current().describe_event(action, observation, before, after)

    def goal_of(self, conditions):
        return self._current().goal_of(conditions)

    def query_of(self, texts):
        return self._current().query_of(texts)

    def entities(self, state):
        return self._current().entities(state)

    def tasks(self, split: str) -> list[Task]:
        """Every member's ``split`` tasks, in the order of the mix (module docstring)."""
        return [mixed_task(m.id, t) for m in self.members
                for t in self._instance(m).tasks(split)]

    @classmethod
    def vocabulary(cls) -> list[str]:
        """The union of the members' words; ``[]`` (open) when any member's is open."""
        words: set[str] = set()
        for member in cls.members:
            own = member.maker.cls.vocabulary()
            if not own:
                return []
            words.update(own)
        return sorted(words)

    @classmethod
    def open_vocabulary_members(cls) -> list[str]:
        """The ids of the members whose vocabulary is open (``[]``)."""
        return [m.id for m in cls.members if not m.maker.cls.vocabulary()]

    @classmethod
    def call_all(cls, calls: Sequence[tuple[Environment, str, tuple]]) -> list:
        """Each call handed to its member's instance, all of them sent together
        (``environments.base.call_all``): a served member's calls in one batch, the sessions
        a reset needs first opened with it (``open_many``)."""
        fresh: dict[str, list[int]] = {}  # member id -> resets that need an instance made
        chosen: dict[int, Member] = {}
        for i, (env, method, args) in enumerate(calls):
            if method == "reset":
                member = chosen[i] = cls.member_of(args[0])
                if member.id not in env._envs:
                    fresh.setdefault(member.id, []).append(i)
        made: dict[int, Environment | EnvFailed] = {}
        for mid, positions in fresh.items():
            maker = next(m.maker for m in cls.members if m.id == mid)
            # one instance per env: two resets of one env in a batch share it
            envs: dict[int, list[int]] = {}
            for i in positions:
                envs.setdefault(id(calls[i][0]), []).append(i)
            opened = maker.cls.open_many(len(envs), maker.options)
            for same, instance in zip(envs.values(), opened):
                for i in same:
                    made[i] = instance
        routed: list = []
        results: list = [None] * len(calls)
        for i, (env, method, args) in enumerate(calls):
            if method == "reset":
                instance = made.get(i)
                if isinstance(instance, EnvFailed):
                    results[i] = instance
                    continue
                task = env._select(args[0], instance)
                routed.append((i, (env._on, "reset", (task,))))
            elif method in ("evaluate", "goal_progress"):
                member = cls.member_of(args[0])
                routed.append((i, (env._instance(member), method,
                                   (member_task(args[0]), *args[1:]))))
            else:
                routed.append((i, (env._current(), method, args)))
        for (i, _), answer in zip(routed, call_all([call for _, call in routed])):
            results[i] = answer
        return results


_MIXED: dict[str, type[MixedEnv]] = {}
_MIXED_LOCK = threading.Lock()


def mixed_class(env_cfg: EnvConfig) -> type[MixedEnv]:
    """The class of the mixture ``env_cfg.mix`` names (one per process and mix)."""
    key = json.dumps([dataclasses.asdict(m) for m in env_cfg.mix] + [
        env_cfg.call_timeout_s, env_cfg.keys_dir], sort_keys=True, default=str)
    with _MIXED_LOCK:
        cls = _MIXED.get(key)
    if cls is not None:
        return cls
    members = tuple(Member(mid, member, weight,
                           EnvMaker(env_class(member), dict(member.options)))
                    for mid, member, weight in env_cfg.members())
    cls = type(f"Mixed_{'_'.join(m.id for m in members)}", (MixedEnv,), {
        "name": env_cfg.label(), "members": members, "__module__": __name__})
    with _MIXED_LOCK:
        return _MIXED.setdefault(key, cls)


register_mixed(mixed_class)
