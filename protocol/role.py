"""The shape every role has, and the one way a role is served.

A role (actor, judge worker, experience worker, learner, replay server) is built from its own
settings (``protocol/role_config.py``) and the collaborators it is handed, then::

    role.run(stop)        # its loop, until ``stop`` is set, request_stop() is called, or
                          # (the learner) its budget is spent
    role.request_stop()   # from a signal handler or another thread: finish the current step
    role.close()          # release everything it opened or was handed: sockets, clients,
                          # threads, pools, files (the control plane excepted: roles of one
                          # process may share it, so whoever connected it closes it)

:func:`serve` is that sequence. The process entry points (``autodidact <role>``) call it with
the stop signals wired; the single-process run (``autodidact/single_process.py``) calls it in
one thread per role with a stop event the roles share. Neither repeats a role's shutdown.
"""

from __future__ import annotations

import signal
import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class Role(Protocol):
    def run(self, stop: threading.Event | None = None) -> None:
        """The role's loop. ``stop``, when given, replaces the role's own stop event, so one
        event can stop several roles."""

    def request_stop(self, *_) -> None:
        """Ask the loop to end after its current step (safe from a signal handler)."""

    def close(self) -> None:
        """Release what the role holds; safe to call twice, and after a failed ``run``."""


class StopEvent:
    """A role's stop flag: an event that ``run(stop)`` may swap for a shared one."""

    def __init__(self):
        self.event = threading.Event()

    def use(self, stop: threading.Event | None) -> None:
        if stop is not None:
            self.event = stop

    def set(self, *_) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, waking early when stopped; whether it is stopped."""
        return self.event.wait(timeout_s)


def serve(role: Role, stop: threading.Event | None = None, *, signals: bool = False) -> None:
    """Run ``role`` until it ends, then close it, whatever ended it. With ``signals`` (a process
    of its own, main thread) SIGTERM and SIGINT ask it to stop: it finishes its step first."""
    if signals:
        signal.signal(signal.SIGTERM, role.request_stop)
        signal.signal(signal.SIGINT, role.request_stop)
    try:
        role.run(stop)
    finally:
        role.close()
