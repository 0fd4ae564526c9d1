"""An actor's outbox: what it must not lose to a crash, kept under ``<run_dir>/acks/``.

- ``<actor_id>.pending/``: one file per group pushed and not yet acknowledged by replay;
- ``<actor_id>.tasks``: the tasks being rolled out right now;
- ``<actor_id>.log``: acknowledged group ids, ``<group_id> stored|duplicate`` per line.

A restarted actor re-sends the pending groups (replay stores an id once, so a copy it already
has is answered ``duplicate``) and rolls its unfinished tasks out again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from pathlib import Path

import msgpack

from protocol import codec
from protocol.errors import SchemaError
from protocol.messages import Group, Task
from protocol.run_dir import RunDir

log = logging.getLogger(__name__)

MAX_REQUEUES = 2  # a task in flight in this many actor crashes is dropped, not queued again


class Outbox:
    """One actor's outbox (the files in the module docstring)."""

    def __init__(self, run_dir: Path, actor_id: str):
        root = RunDir(run_dir).acks
        self.pending_dir = root / f"{actor_id}.pending"
        self.tasks_path = root / f"{actor_id}.tasks"
        self.log_path = root / f"{actor_id}.log"
        self._log = None  # opened on the first ack

    def _file(self, group_id: str) -> Path:
        return self.pending_dir / (hashlib.sha1(group_id.encode()).hexdigest() + ".group")

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        # A SIGKILL leaves a whole file or a .tmp; page cache outlives the process.
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def hold_tasks(self, tasks: list[Task]) -> None:
        self._write(self.tasks_path, msgpack.packb([codec.encode_body(t) for t in tasks]))

    def drop_tasks(self) -> None:
        self.tasks_path.unlink(missing_ok=True)

    def add(self, group: Group) -> None:
        self._write(self._file(group.group_id), codec.encode_body(group))

    def group(self, group_id: str) -> Group:
        """A group still waiting for its acknowledgement."""
        return codec.decode_body(Group.TYPE, self._file(group_id).read_bytes())

    def recover(self) -> tuple[list[Group], list[Task]]:
        """(groups to re-send, tasks to roll out again) a killed predecessor left behind."""
        tasks = []
        if self.tasks_path.exists():
            for body in msgpack.unpackb(self.tasks_path.read_bytes()):
                task = codec.decode_body(Task.TYPE, body)
                # A task that was being rolled out in every crash may be what crashes us.
                tries = int(task.meta.get("requeued", 0))
                if tries >= MAX_REQUEUES:
                    log.error("outbox: dropping task %s, in flight in %d crashes",
                              task.task_id, tries + 1)
                    continue
                task.meta = {**task.meta, "requeued": tries + 1}
                tasks.append(task)
            self.drop_tasks()
        groups = []
        for path in sorted(self.pending_dir.glob("*")) if self.pending_dir.exists() else ():
            try:
                if path.suffix != ".group":
                    raise SchemaError("invalid", "partial write")
                groups.append(codec.decode_body(Group.TYPE, path.read_bytes()))
            except (SchemaError, ValueError) as exc:  # cut by the crash: never pushed
                log.warning("outbox: dropping %s (%s)", path.name, exc)
                path.unlink(missing_ok=True)
        # Killed between writing a task's group and forgetting the task: re-send, not re-roll.
        sent = Counter(g.task.task_id for g in groups)
        again = []
        for task in tasks:
            if sent[task.task_id] > 0:
                sent[task.task_id] -= 1
            else:
                again.append(task)
        return sorted(groups, key=lambda g: g.created_at), again

    def acked(self, acks: list[tuple[str, str]]) -> None:
        """Forget acknowledged groups, appending them to the log first."""
        if self._log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "a", buffering=1)
        for gid, status in acks:
            if status in ("stored", "duplicate"):
                self._log.write(f"{gid} {status}\n")
        self._log.flush()
        for gid, _ in acks:
            self._file(gid).unlink(missing_ok=True)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
