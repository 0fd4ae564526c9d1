"""``autodidact env serve SPEC --openenv --address http://HOST:PORT``: an Autodidact env as an
OpenEnv server, built with openenv-core's own classes (``create_app``, run by uvicorn), so
OpenEnv clients (``EnvClient``, ``GenericEnvClient``, our ``env.name=openenv``) can use it.

The server is text-action style: one WebSocket session (``/ws``) holds one instance of the env.

* ``reset`` takes ``task_id`` (any split's task, by id) or ``seed`` (the seed-th task of
  ``split``, default ``train``, counted round) and answers the prompt's text (the query, then
  the first observation, as a rollout shows them) with ``query``, ``task_id`` and ``tools``
  (each declared tool as an MCP tool: name, description, JSON-schema ``inputSchema``).
* ``step`` takes ``{"action": "tool arg ..."}``, the action text the env parses itself, and
  answers ``text``, ``valid``, ``tool`` and ``error`` as ``Environment.step`` gives them, with
  ``reward`` = ``goal_progress(task)`` (partial credit where the env has it) and ``done`` once
  ``evaluate(task)`` reaches 1.0.
* ``state`` is the episode id and step count with ``task_id`` and ``world``: the env's own
  ``state()`` snapshot.

Unlike ``env serve`` without ``--openenv``, there are no worker processes: every session's env
lives in this one process (openenv-core runs each call in a thread), so an env that hangs or
crashes takes the server with it. openenv-core (the ``openenv`` extra) is imported only here.
"""

from __future__ import annotations

import socket
import uuid
from urllib.parse import urlsplit

from environments.base import Environment as AutodidactEnv
from environments.openenv_adapter import schema_tool
from protocol.messages import SPLITS, Task


def parse_http_address(address: str) -> tuple[str, int]:
    """(host, port) of ``http://HOST:PORT``; ValueError naming what is wrong."""
    parts = urlsplit(address)
    if parts.scheme != "http" or not parts.hostname or parts.port is None \
            or parts.path not in ("", "/"):
        raise ValueError(f"--address with --openenv is http://HOST:PORT, got {address!r}")
    return parts.hostname, parts.port


def pick_task(env: AutodidactEnv, seed: int | None, task_id: str | None, split: str) -> Task:
    """The task a reset asks for: ``task_id`` in any split, else the ``seed``-th of ``split``."""
    if task_id is not None:
        for name in SPLITS:
            for task in env.tasks(name):
                if task.task_id == task_id:
                    return task
        raise ValueError(f"reset: no task {task_id!r} in {env.name}'s {', '.join(SPLITS)}")
    tasks = env.tasks(split)
    if not tasks:
        raise ValueError(f"reset: {env.name} has no {split} tasks; pass task_id or split")
    return tasks[(seed or 0) % len(tasks)]


def openenv_app(cls: type[AutodidactEnv], max_sessions: int):
    """The FastAPI app of an OpenEnv server whose sessions are instances of ``cls``."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State

    class TextAction(Action):
        action: str  # "tool arg ...": parsed by the env, as a rollout's action is

    class EnvObservation(Observation):
        text: str = ""
        query: str = ""
        task_id: str = ""
        tools: list[dict] = []
        valid: bool = True
        tool: str | None = None
        error: str | None = None

    class Served(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # every session has an env instance of its own

        def __init__(self):
            super().__init__()
            self.env = cls()
            self.task: Task | None = None
            self.episode_id, self.steps = "", 0

        def reset(self, seed: int | None = None, episode_id: str | None = None,
                  task_id: str | None = None, split: str = "train", **_) -> EnvObservation:
            self.task = pick_task(self.env, seed, task_id, split)
            first = self.env.reset(self.task)
            self.episode_id, self.steps = episode_id or uuid.uuid4().hex, 0
            text = f"{self.task.query}\n{first}" if cls.query_in_prompt else first
            return EnvObservation(text=text, query=self.task.query, task_id=self.task.task_id,
                                  tools=[schema_tool(t) for t in self.env.tools()])

        def step(self, action: TextAction, timeout_s: float | None = None,
                 **_) -> EnvObservation:
            if self.task is None:
                raise RuntimeError("step before reset: send reset first")
            text, done, info = self.env.step(action.action)
            self.steps += 1
            return EnvObservation(
                text=text, valid=bool(info.get("valid")), tool=info.get("tool"),
                error=info.get("error"), reward=float(self.env.goal_progress(self.task)),
                done=bool(done or self.env.evaluate(self.task) >= 1.0))

        @property
        def state(self) -> State:
            extra = {"task_id": self.task.task_id} if self.task is not None else {}
            try:
                extra["world"] = self.env.state()
            except (NotImplementedError, RuntimeError):  # an env without one, or not reset
                pass
            return State(episode_id=self.episode_id, step_count=self.steps, **extra)

    return create_app(Served, TextAction, EnvObservation, env_name=cls.name,
                      max_concurrent_envs=max_sessions)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here, so a taken port is one usage line, not a uvicorn
    traceback after the app is built)."""
    return socket.create_server((host, port), reuse_port=False)


def serve_openenv(cls: type[AutodidactEnv], sock: socket.socket, max_sessions: int) -> None:
    """Serve ``cls`` on ``sock`` until SIGTERM or Ctrl-C (uvicorn's own handlers)."""
    import uvicorn

    # A session still open at SIGTERM is closed after 5 s rather than waited for.
    server = uvicorn.Server(uvicorn.Config(openenv_app(cls, max_sessions), log_level="warning",
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
