"""Waiting on a condition and stopping a server process the tests started (its whole process
group: a server's workers go with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace_s``; gone already is fine."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def serve_until(role, done, timeout_s: float = 240.0, what: str = "condition") -> None:
    """Run ``role`` (``protocol.role.serve``) on a thread until ``done()`` or the thread ends,
    then stop it and check it stopped."""
    from protocol.role import serve

    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(role, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: done() or not thread.is_alive(), timeout_s, what)
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive()
