"""Waiting on a condition and stopping a server process the tests started (its whole process
group: a server's workers go with it)."""

from __future__ import annotations

import os
import signal
import subprocess
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
