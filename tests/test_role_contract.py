"""Every role has one shape (protocol/role.py): built from its own settings and collaborators,
``run(stop)``, ``request_stop()``, ``close()``; after ``close()`` it holds no socket and no
thread. Checked on the real classes, with a real Redis, a real replay server and the tiny
model; and in the source: no role package takes the whole run config."""

from __future__ import annotations

import ast
import inspect
import os
import threading
import time
from pathlib import Path

import pytest

from actor.actor import Actor
from autodidact.resolve import judge_settings
from autodidact.wiring import build_actor, build_experience, build_judge, build_learner
from experience.worker import ExperienceWorker
from judge.judge_worker import JudgeWorker
from learner.learner import Learner
from protocol.config import ReplayConfig, RunConfig
from protocol.replay_client import ReplayClient
from protocol.role import Role, serve
from replay.server import ReplayServer

ROOT = Path(__file__).resolve().parents[1]
# The roles and the learner's step (learner/warmstart.py is a stage of the run, not a role).
ROLE_MODULES = ("actor/actor.py", "experience/worker.py", "judge/judge_worker.py",
                "learner/learner.py", "learner/step.py", "replay/server.py")
ROLE_CLASSES = (Actor, ExperienceWorker, JudgeWorker, Learner, ReplayServer)


@pytest.mark.parametrize("cls", ROLE_CLASSES, ids=lambda c: c.__name__)
def test_every_role_class_has_the_contract(cls):
    for method in ("run", "request_stop", "close"):
        assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {method}()"
    assert "stop" in inspect.signature(cls.run).parameters, f"{cls.__name__}.run takes no stop"
    assert not any("RunConfig" in str(p.annotation)
                   for p in inspect.signature(cls.__init__).parameters.values())


def test_no_role_module_reads_the_whole_run_config():
    """A role is given its own settings (protocol/role_config.py); the run config is turned
    into them in autodidact/ (resolve.py, wiring.py)."""
    found = []
    for name in ROLE_MODULES:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if "RunConfig" in names:
                found.append(f"{name}:{node.lineno}")
    assert found == []


# --- on the real classes ----------------------------------------------------------------------


def sockets() -> set[str]:
    """This process's open sockets (TCP, unix), by inode."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def settled(before: set, now, timeout_s: float = 5.0) -> set:
    """What ``now()`` holds beyond ``before``, once threads that were told to go have gone."""
    deadline = time.monotonic() + timeout_s
    while (extra := now() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


@pytest.fixture
def replay_server(tmp_path):
    server = ReplayServer(tmp_path / "replay", ReplayConfig(), "tcp://127.0.0.1:*")
    thread = threading.Thread(target=serve, args=(server,), daemon=True)
    thread.start()
    yield server
    server.request_stop()
    thread.join(10)


def run_config(model: str, redis_url: str, control, server) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = model
    cfg.replay.address = server.address
    cfg.redis.url, cfg.redis.prefix = redis_url, control.keys.prefix
    cfg.experience.enabled = False
    return cfg


def client(server) -> ReplayClient:
    return ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("role", ["actor", "judge", "experience", "learner", "replay"])
def test_a_closed_role_holds_no_socket_and_no_thread(role, tmp_path, redis_url, control,
                                                     replay_server, files_policy_path,
                                                     embedder):
    cfg = run_config(files_policy_path, redis_url, control, replay_server)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    control.r.ping()  # the shared control plane's connection is not the role's: open it first
    before_sockets, before_threads = sockets(), threads()
    if role == "actor":
        built = build_actor(cfg, run_dir, control, client(replay_server), "actor-0")
    elif role == "judge":
        built = build_judge(cfg, run_dir, control, client(replay_server))
    elif role == "experience":
        cfg.experience.enabled = True
        from navigating.pool import open_pool

        built = build_experience(cfg, run_dir, control, client(replay_server),
                                 pool=open_pool(cfg, embedder=embedder))
    elif role == "learner":
        cfg.learner.max_updates = 1
        built = build_learner(cfg, run_dir, control, client(replay_server))
    else:
        built = ReplayServer(run_dir, ReplayConfig(), "tcp://127.0.0.1:*")
    assert isinstance(built, Role)
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(built, stop), daemon=True)
    thread.start()
    time.sleep(1.0)  # in its loop: clients connected, pools and servers started
    assert sockets() - before_sockets, "the role opened no socket: nothing was checked"
    stop.set()
    built.request_stop()
    thread.join(60)
    assert not thread.is_alive(), f"{role} did not stop"
    assert settled(before_sockets, sockets) == set()
    assert settled(before_threads, threads) == set()
    built.close()  # a second close is harmless


def test_the_judge_closes_what_it_was_handed(tmp_path, replay_server):
    """Its replay client, its judges and its between-pulls hook, and its thread pool."""
    closed = []

    class Part:
        name = "part"
        stats: dict = {}

        def __init__(self, what):
            self.what = what

        def close(self):
            closed.append(self.what)

    before = sockets()
    worker = JudgeWorker(judge_settings(RunConfig()), tmp_path, client(replay_server),
                         Part("judge"), Part("cross-check"), between_pulls=Part("hook"))
    assert worker.replay.stats()["groups"] == 0  # connected
    worker.close()
    assert closed == ["judge", "cross-check", "hook"]
    assert settled(before, sockets) == set()
