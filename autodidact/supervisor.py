"""Start role processes, restart the ones that die (with back-off), stop them all on exit.

Each role is a separate OS process running ``python -m <module> ...``; the supervisor only
watches exit codes. Stopping sends SIGTERM (roles finish their current unit of work and close
their sockets), then SIGKILL after a grace period. Every child also gets the kernel's
parent-death signal (:func:`die_with_parent`): a supervisor killed with SIGKILL, which runs
no clean-up of its own, still takes its roles with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import EXIT_UNRECOVERABLE

# Set in every supervised child's environment: the supervisor's pid (see exit_when_orphaned).
PARENT_ENV = "AUTODIDACT_SUPERVISOR_PID"
ORPHAN_GRACE_S = 10.0
REASON_CHARS = 2000  # the most of a role's log line a failure quotes (paths included)
REASON_TAIL_BYTES = 64 * 1024  # how far back from the end of a role's log the reason is sought
_LOGGED_ERROR = re.compile(r" (ERROR|CRITICAL) ")  # cli_common's logging format

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
try:  # resolved here, not in the child: between fork and exec only the call itself is safe
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: stop() and process groups still clean up
    _prctl = None


def exit_when_orphaned(grace_s: float = ORPHAN_GRACE_S) -> None:
    """In a supervised role: once the supervisor is gone (the parent-death SIGTERM has asked
    the role to stop), give it ``grace_s`` to stop cleanly, then exit outright. A role whose
    Redis and replay server went down with the launcher would otherwise retry for a minute.
    Does nothing in a process a supervisor did not start (a role started by hand, nohup'd)."""
    parent = os.environ.get(PARENT_ENV)
    if parent != str(os.getppid()):
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.5)
        time.sleep(grace_s)
        log.error("supervisor %s is gone and this role did not stop within %.0f s: exiting",
                  parent, grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def die_with_parent() -> None:
    """``preexec_fn`` for every child of a run: SIGTERM when the parent dies, however it
    dies (the child then stops as if the run were stopped)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def parent_death_preexec():
    """``die_with_parent`` when called from the main thread, else None. The kernel sends the
    signal when the *thread* that forked the child ends: a child started from a short-lived
    thread (a timer restarting Redis) would be killed when that thread returns."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def stop_process_group(proc: subprocess.Popen, grace_s: float, kill_wait_s: float = 10.0,
                       reap_s: float = 10.0) -> None:
    """Stop a child started with ``start_new_session``: SIGTERM to its group, SIGKILL after
    ``grace_s``, then SIGKILL to whatever is left of the group until it is empty (a child of
    the child may outlive it; an orphan is gone only once init has reaped it)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + reap_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.1)
    proc.poll()


@dataclass
class RoleSpec:
    name: str  # unique label, e.g. "replay" or "actor-1"
    argv: list[str]  # arguments after the Python executable
    restart: bool = True  # restart when it exits with a non-zero code
    max_restarts: int = 20
    log_path: Path | None = None  # stdout+stderr of the process go here (appended)
    env: dict[str, str] = field(default_factory=dict)
    restart_argv: list[str] | None = None  # argv for restarts, e.g. the learner adds --resume
    # Its own process group, signalled as a whole: torchrun forwards SIGTERM to its ranks but
    # a SIGKILL to torchrun alone would leave them running.
    process_group: bool = False


@dataclass
class _Running:
    spec: RoleSpec
    proc: subprocess.Popen
    started: float
    restarts: int = 0
    next_start: float = 0.0  # when a dead role may be restarted (back-off)
    log_start: int = 0  # the log's size when this attempt started: what it wrote follows


class Supervisor:
    """``with Supervisor() as sup: sup.start(spec); ...; sup.check()`` — stops all on exit."""

    def __init__(self, backoff_s: float = 0.5, backoff_max_s: float = 10.0,
                 pids_path: Path | None = None):
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.pids_path = pids_path  # role -> pid, rewritten on every (re)start, for operators
        self.roles: dict[str, _Running] = {}
        self.restart_log: list[tuple[str, int]] = []  # (role, exit code) of every restart

    def start(self, spec: RoleSpec) -> subprocess.Popen:
        log_start = _size(spec.log_path)
        proc = self._spawn(spec, spec.argv)
        self.roles[spec.name] = _Running(spec, proc, time.monotonic(), log_start=log_start)
        self._write_pids()
        return proc

    def _spawn(self, spec: RoleSpec, argv: list[str]) -> subprocess.Popen:
        out = open(spec.log_path, "ab") if spec.log_path else subprocess.DEVNULL
        try:
            return subprocess.Popen([sys.executable, *argv], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **spec.env,
                                         PARENT_ENV: str(os.getpid())},
                                    start_new_session=spec.process_group,
                                    preexec_fn=parent_death_preexec())
        finally:
            if spec.log_path:
                out.close()

    def _write_pids(self) -> None:
        if self.pids_path is None:
            return
        tmp = self.pids_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({n: r.proc.pid for n, r in self.roles.items()}, indent=1))
        os.replace(tmp, self.pids_path)

    def restarts(self) -> dict[str, int]:
        """Restarts so far, per role."""
        return {name: run.restarts for name, run in self.roles.items()}

    def check(self) -> list[str]:
        """Restart dead roles whose back-off has passed; returns the names of failed roles
        (those out of restarts, and at once those that exited with EXIT_UNRECOVERABLE)."""
        failed = []
        now = time.monotonic()
        for name, run in self.roles.items():
            code = run.proc.poll()
            if code is None:
                continue
            if code == 0 or not run.spec.restart or code == EXIT_UNRECOVERABLE:
                if code != 0:
                    failed.append(name)
                continue
            if run.restarts >= run.spec.max_restarts:
                failed.append(name)
                continue
            if run.next_start == 0.0:
                delay = min(self.backoff_max_s, self.backoff_s * 2 ** run.restarts)
                run.next_start = now + delay
                log.warning("%s exited with %s; restarting in %.1fs", name, code, delay)
            elif now >= run.next_start:
                self.restart_log.append((name, code))
                run.restarts += 1
                run.log_start = _size(run.spec.log_path)
                run.proc = self._spawn(run.spec, run.spec.restart_argv or run.spec.argv)
                run.started, run.next_start = now, 0.0
                self._write_pids()
        return failed

    def exited(self, name: str) -> int | None:
        return self.roles[name].proc.poll()

    def failure(self, name: str) -> str:
        """Why role ``name`` stopped, in one line: how it exited and, quoted from its log,
        what its last attempt said last (see :func:`last_words`)."""
        run = self.roles[name]
        code = run.proc.poll()
        how = ("still running" if code is None
               else f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}")
        said = last_words(run.spec.log_path, run.log_start,
                          one_line_exit=code == EXIT_UNRECOVERABLE)
        return f"{how}: {said}" if said else how

    def stop(self, grace_s: float = 10.0, together: bool = False) -> None:
        """Stop roles in reverse start order, so producers (actors) flush to their consumers
        (replay) before those go away. ``together``: SIGTERM them all at once and wait under
        one shared grace period (roles that are all producers, such as a worker node's)."""
        runs = list(reversed(self.roles.items()))
        if together:
            for _, run in runs:
                if run.proc.poll() is None:
                    _signal(run, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, run in runs:
            if not together:
                if run.proc.poll() is None:
                    _signal(run, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
            try:
                run.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", name, grace_s)
                _signal(run, signal.SIGKILL)
                run.proc.wait()
            if run.spec.process_group:  # ranks that outlived their torchrun
                _signal(run, signal.SIGKILL)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def last_words(log_path: Path | None, start: int = 0, one_line_exit: bool = False) -> str | None:
    """What a role's log says of its failure, from ``start`` (where its last attempt began) to
    the end: with ``one_line_exit`` (an :data:`EXIT_UNRECOVERABLE` exit, which prints one line
    naming the file and what to do, last) its last line; else the exception line its last
    traceback ends with, else its last line logged at ERROR or CRITICAL, else its last line.
    None without a log or with nothing written."""
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as f:
            f.seek(max(start, _size(log_path) - REASON_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    said = lines[-1]
    if not one_line_exit:
        tracebacks = [i for i, line in enumerate(lines)
                      if line.startswith("Traceback (most recent call last)")]
        errors = [line for line in lines if _LOGGED_ERROR.search(line)]
        if tracebacks:  # the first unindented line after the header names the exception
            said = next((line for line in lines[tracebacks[-1] + 1:]
                         if not line[:1].isspace()), said)
        elif errors:
            said = errors[-1]
    return said if len(said) <= REASON_CHARS else said[:REASON_CHARS - 3] + "..."


def _size(path: Path | None) -> int:
    try:
        return os.path.getsize(path) if path is not None else 0
    except OSError:
        return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal(run: _Running, sig: int) -> None:
    """Signal the role's process, or its whole group when it has one."""
    try:
        if run.spec.process_group:
            os.killpg(run.proc.pid, sig)
        else:
            run.proc.send_signal(sig)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def stop_signals_interrupt():
    """SIGTERM (a scheduler, ``kill``) stops a run as Ctrl-C does: every role stops, the learner
    checkpoints. SIGINT is re-armed too: a shell starting us in the background ignores it."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
