"""``autodidact run --single-process``: the roles of a run wired in one process ("mono").

The same classes as the multi-process run (autodidact/launcher.py, "poly"), the same stages
around RL, the same summary.json; only the wiring differs::

    redis   = EmbeddedRedis(run_dir) unless redis.url          a service: a real redis-server
    coordinator.start()                                         run state; admission opened
    replay  = InProcessReplay(ReplayServer(run_dir, ...))      no socket loop: each request is
              handled in the thread that sends it, one at a time (LoopbackChannel)
    stages.up_to_training: base model, split.json, explore, experience pool, held-out eval,
        warm-start, held-out eval                               (skipped on resume)
    one thread per role, each running the role's own loop with its own ReplayClient on the
    in-process channel:
        learner     serve(build_learner(...))                   checkpoints when it ends
        actor-0     serve(build_actor(...))                     one actor, whatever num_actors
        judge-0     serve(build_judge(...))                     when judge.workers > 0
        experience  serve(build_experience(...))                when experience.update_every
    (autodidact/wiring.py builds each role as its process does; serve() runs it, then closes
    it: the same shutdown in a thread as in a process)
    main thread, until the learner's loop returns (supervise):
        coordinator.tick()       Redis alive and refilled, the task queue full
        a role thread that died  ends the run (exit code 1)
        every 10 s               a progress line
    stop: request_stop() every role, wait for each thread, close the replay server
    stages.after_training: held-out eval of the final weights; summary.json
    Ctrl-C or SIGTERM stops the same way (the learner checkpoints); the run returns 130.
    A second Ctrl-C while stopping does not wait for the roles.

Threads, not a round-robin loop: the roles' loops block inside themselves (an actor waits in
``take_tasks`` until admitted, the learner in ``draw`` until replay has a batch), so stepping
them in turn would deadlock or need copies of those loops. Each thread can still be followed
in a debugger (break in the role's loop); the GIL makes them take turns anyway.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import torch

from autodidact.coordinator import Coordinator
from autodidact.progress import print_summary
from autodidact.resolve import learner_threads
from autodidact.stages import (  # the stages around RL, shared with `autodidact run`
    StartRefused,
    after_training,
    console,
    up_to_training,
)
from autodidact.supervisor import stop_signals_interrupt
from autodidact.tracking import read_summary
from autodidact.wiring import build_actor, build_experience, build_judge, build_learner
from protocol.config import RunConfig
from protocol.messages import Error
from protocol.replay_client import ReplayClient
from protocol.role import serve
from protocol.run_dir import RunDir, role_token
from protocol.transport import Incoming, LoopbackChannel
from replay.server import HELD_TICK_S, ReplayServer

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # how long an in-process poll with nothing to deliver waits (a socket's would)
KEEP_FRAMES = 32  # frames each in-process channel keeps for a debugger to look at
JOIN_S = 60.0  # per role thread, at stop (the learner writes its checkpoint)
PROGRESS_S = 10.0


# --- replay in-process ---------------------------------------------------------------------------


class InProcessReplay:
    """The replay server without its socket loop (``ReplayServer.run``).

    Each request goes through the real codec (LoopbackChannel) and is handled in the thread
    that sends it, one at a time, in the server's own transactions. A batch request the
    server holds (the learner's long poll) keeps its sender waiting here, lock released,
    until a later request makes it servable or its time is up.
    """

    def __init__(self, server: ReplayServer):
        self.server = server
        self._cond = threading.Condition()
        self._answers: dict[int, object] = {}  # id(Incoming) -> reply, for held requests

    def client(self, run_dir: Path, role: str | None = None) -> ReplayClient:
        """A client acting as ``role`` (its token from ``run_dir``; None: a reader)."""
        token = role_token(run_dir, role) if role else ""
        return ReplayClient(channel=_PacedLoopback(self._handle, token))

    def _handle(self, inc: Incoming) -> object:
        with self._cond:
            self._collect(self.server.handle([inc]))
            while id(inc) not in self._answers:
                if not any(h.incoming is inc for h in self.server.held.values()):
                    # refused (a type replay does not serve) or its write failed
                    return Error("internal", "replay answered nothing; see its log")
                self._cond.wait(HELD_TICK_S)
                self._collect([])
            return self._answers.pop(id(inc))

    def _collect(self, replies) -> None:
        """Keep ``replies``, and those of held requests the server lets go now, for their
        senders."""
        replies = [*replies, *self.server.release_held()]
        for inc, reply in replies:
            self._answers[id(inc)] = reply
        if replies:
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return self.server.stats()

    def close(self) -> None:
        with self._cond:
            self.server.close()


class _PacedLoopback(LoopbackChannel):
    """A LoopbackChannel whose poll, with nothing to deliver, waits a little as a socket's
    poll does: the roles pace their idle loops on it (an actor not admitted polls acks). It
    keeps only the last frames it recorded: a run sends gigabytes."""

    def __init__(self, handler, credential: str = ""):
        super().__init__(handler, credential)
        self.sent, self.received = deque(maxlen=KEEP_FRAMES), deque(maxlen=KEEP_FRAMES)

    def _poll_wire(self, timeout_s: float) -> list[tuple[str, object]]:
        out = super()._poll_wire(timeout_s)
        if not out and timeout_s > 0:
            time.sleep(min(timeout_s, IDLE_POLL_S))
        return out


# --- roles as threads ----------------------------------------------------------------------------


class RoleThread(threading.Thread):
    """One role served (``protocol.role.serve``: its loop, then its ``close``) as its process
    would serve it. ``error`` holds what ended it, if anything did.

    ``done`` is waited on, never ``join()``: on Python 3.11 a join that Ctrl-C interrupts marks
    the still-running thread as stopped (bpo-45274), and the next join would not wait."""

    def __init__(self, name: str, role, stop: threading.Event):
        super().__init__(name=name, daemon=True)  # daemon: a hung role cannot hold the exit
        self.role, self.stop = role, stop
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            serve(self.role, self.stop)
        except BaseException as exc:
            self.error = exc
            log.exception("%s failed", self.name)
        finally:
            self.done.set()

    def request_stop(self) -> None:
        self.role.request_stop()


def start_roles(cfg: RunConfig, run_dir: Path, control, replay: InProcessReplay,
                max_updates: int | None, resume: bool) -> dict[str, RoleThread]:
    """The learner, one actor, the judge and the experience extractor, started. Each has its
    own stop event: the learner must checkpoint before the others' clients go."""
    built: dict[str, object] = {}
    with contextlib.ExitStack() as undo:  # a role that fails to build closes those before it
        undo.callback(lambda: [role.close() for role in built.values()])
        built["learner"] = build_learner(cfg, run_dir, control,
                                         replay.client(run_dir, "learner"), max_updates)
        if resume:
            built["learner"].resume()
        built["actor-0"] = build_actor(cfg, run_dir, control, replay.client(run_dir, "actor"),
                                       "actor-0")
        if cfg.judge.workers > 0:
            built["judge-0"] = build_judge(cfg, run_dir, control,
                                           replay.client(run_dir, "judge"), "judge-0")
        if cfg.experience.enabled and cfg.experience.update_every:
            built["experience"] = build_experience(cfg, run_dir, control,
                                                   replay.client(run_dir))
        undo.pop_all()
    roles = {name: RoleThread(name, role, threading.Event()) for name, role in built.items()}
    for thread in roles.values():
        thread.start()
    return roles


def stop_roles(roles: dict[str, RoleThread]) -> list[str]:
    """Ask every role to stop, then wait for each; returns the names still running."""
    for role in roles.values():
        role.request_stop()
    for role in roles.values():
        role.done.wait(JOIN_S)
    left = [name for name, role in roles.items() if not role.done.is_set()]
    for name, role in roles.items():
        if name not in left:
            role.join(1.0)  # done: only the thread's own exit is left
    if left:
        log.error("roles still running after %.0fs: %s", JOIN_S, left)
    return left


def supervise(roles: dict[str, RoleThread], coordinator: Coordinator) -> int:
    """Keep Redis and the task queue and show progress until the learner's loop returns: 0,
    or 1 when a role failed (any other role's loop returns only when asked to stop)."""
    t0 = last = time.monotonic()
    while True:
        coordinator.tick()
        failed = [name for name, role in roles.items()
                  if role.error is not None or (name != "learner" and role.done.is_set())]
        if failed:
            console.print(f"[red]roles failed: {failed}; see the log above[/]")
            return 1
        if roles["learner"].done.is_set():
            return 0
        if time.monotonic() - last > PROGRESS_S:
            last = time.monotonic()
            with contextlib.suppress(Exception):  # Redis may be restarting
                state, counters = coordinator.control.state(), coordinator.control.counters()
                console.print(f"  [{last - t0:5.0f}s] update {state.get('learner_updates', 0):>4}"
                              f"  version {state.get('version', 0):>4}  groups "
                              f"{counters.get('actor/accepted', 0):>6}  judged "
                              f"{counters.get('judge/groups_labelled', 0)}", highlight=False)
        roles["learner"].done.wait(0.5)


# --- the run -------------------------------------------------------------------------------------


def run_single_process(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
                       resume: bool = False) -> dict:
    """One run in this process; returns the summary (also ``<run_dir>/summary.json``) with
    ``exit_code``: 0 done, 1 a stage or role failed, 130 interrupted (Ctrl-C, SIGTERM)."""
    if not cfg.redis.prefix:
        raise ValueError("run_single_process needs a config resolved for a local run "
                         "(resolve.Flags(redis_prefix=True))")
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    summary = read_summary(run_dir) if resume else {}
    console.print(f"[bold]autodidact run --single-process[/] {cfg.name} in {run_dir}")
    torch.set_num_threads(max(cfg.actor.torch_threads,
                              learner_threads(cfg, torch.cuda.is_available())))
    with contextlib.ExitStack() as stack:
        stack.enter_context(stop_signals_interrupt())
        try:
            # run state, admission opened (before replay.lmdb is opened)
            cfg, coordinator = Coordinator.open(stack, cfg, run_dir)
            # Bound (a server needs an address) but never polled: requests come in-process.
            replay = InProcessReplay(ReplayServer(run_dir, cfg.replay,
                                                  address=f"inproc://replay-{uuid.uuid4().hex}"))
            stack.callback(replay.close)
            code = train(cfg, run_dir, coordinator, replay, summary, max_updates, resume)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopped (a learner that had started "
                          "checkpointed)[/]")
            code = 130
        summary["exit_code"] = code
        rd.summary.write_text(json.dumps(summary, indent=2, default=str))
        if code == 0:
            print_summary(summary)
            coordinator.done()
    return summary


def train(cfg: RunConfig, run_dir: Path, coordinator: Coordinator, replay: InProcessReplay,
          summary: dict, max_updates: int | None, resume: bool) -> int:
    """The launcher's stages around RL (autodidact/stages.py), the roles as threads; fills
    ``summary``, returns the exit code."""
    try:
        start = up_to_training(cfg, run_dir, coordinator.control, summary, resume)
    except StartRefused as exc:  # no synthetic tasks, a context too short
        console.print(f"[red]{exc}[/]")
        return 1
    cfg = start.cfg  # the config the roles read from here on
    coordinator.feed(start.original, start.share)
    coordinator.tick()  # the first tasks, before the actor asks
    roles = start_roles(cfg, run_dir, coordinator.control, replay, max_updates, resume)
    try:
        code = supervise(roles, coordinator)
    finally:
        coordinator.finishing()
        left = stop_roles(roles)
    if code == 0 and (left or roles["learner"].error):
        code = 1
    summary["restarts"] = {"redis": coordinator.redis_restarts}
    summary["replay"] = replay.stats()
    summary.update(after_training(cfg, run_dir, learner_finished=code == 0,
                                  base=start.base))
    return code
