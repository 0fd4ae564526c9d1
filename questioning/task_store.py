"""The durable task store: synthesized tasks in ``<run_dir>/tasks.lmdb``, one LMDB environment.

=========  ==========================  =====================================================
sub-db     key                         value
=========  ==========================  =====================================================
tasks      task_id (utf-8)             the Task body (msgpack, :func:`protocol.codec.encode_body`)
order      seq (8 bytes, big-endian)   task_id: insertion order, so scans go oldest-first
=========  ==========================  =====================================================

One writer per store (the explorer), held by an ``flock`` on ``tasks.lmdb/writer.lock``; any
number of read-only openers, also in other processes while the writer runs. A task's
provenance lives in ``Task.meta`` (``method``, ``seed``, ``exploration``, ``confidence``,
``steps``, ``entities``, ``dependent_ops``); the store reads none of it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb

from protocol.codec import decode_body, encode_body
from protocol.messages import Task
from protocol.run_dir import RunDir, check_lmdb_store, single_writer_lock

LOCK_FILE = "writer.lock"
MAX_DBS = 4  # two sub-dbs today, room for a couple more without touching existing stores
MAX_KEY = 511  # LMDB's default key size limit; task ids are keys
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is insertion order


def store_path(run_dir) -> Path:
    return RunDir(run_dir).task_store


def exists(run_dir) -> bool:
    """Whether ``run_dir`` holds a task store (written at least once by a writer)."""
    return (store_path(run_dir) / "data.mdb").exists()


class TaskStore:
    """Tasks by id, in insertion order. ``readonly=True`` takes no lock and never writes."""

    exists = staticmethod(exists)

    def __init__(self, run_dir, readonly: bool = False, map_size: int = 1 << 30):
        self.path = store_path(run_dir)
        self.readonly = readonly
        self._lock: int | None = None
        self.env = None
        if readonly:
            if not exists(run_dir):
                raise FileNotFoundError(
                    f"no task store at {self.path} (run `autodidact explore` first)")
        else:
            # Two explorers on one run is a launch mistake that would interleave their tasks.
            lock = self.path / LOCK_FILE
            self._lock = single_writer_lock(self.path, LOCK_FILE,
                                            f"another writer (pid {{pid}}) holds the task "
                                            f"store {self.path} "
                                            f"(lock {lock}); open it with readonly=True to read")
        try:
            check_lmdb_store(self.path)
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=MAX_DBS, subdir=True,
                                 readonly=readonly, create=not readonly)
            self._db = self._open_dbs()
        except BaseException:
            self.close()
            raise

    def _open_dbs(self) -> dict | None:
        try:
            return {name: self.env.open_db(name.encode(), create=not self.readonly)
                    for name in ("tasks", "order")}
        except lmdb.NotFoundError:
            # A writer created the file a moment ago and has not committed its sub-dbs yet.
            return None

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # after env.close: only now may another writer open the store
            self._lock = None

    def __enter__(self) -> TaskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing ---------------------------------------------------------------------------

    def put_many(self, tasks: Iterable[Task]) -> int:
        """Store every task not stored yet, in one transaction; returns how many were new."""
        if self.readonly:
            raise PermissionError(f"task store {self.path} was opened read-only")
        bodies = [_encode(t) for t in tasks]  # all checked before anything is written
        added = 0
        with self.env.begin(write=True) as txn:
            seq = self._next_seq(txn)
            for key, body in bodies:
                if txn.put(key, body, db=self._db["tasks"], overwrite=False):
                    txn.put(_SEQ.pack(seq), key, db=self._db["order"])
                    seq, added = seq + 1, added + 1
        return added

    def put(self, task: Task) -> bool:
        """Store one task; False when its id was already stored."""
        return self.put_many([task]) == 1

    def _next_seq(self, txn) -> int:
        cursor = txn.cursor(db=self._db["order"])
        return _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0

    # --- reading ---------------------------------------------------------------------------

    def _ready(self) -> bool:
        if self._db is None:
            self._db = self._open_dbs()
        return self._db is not None

    def get(self, task_id: str) -> Task | None:
        if not self._ready():
            return None
        with self.env.begin() as txn:
            body = txn.get(task_id.encode(), db=self._db["tasks"])
        return None if body is None else decode_body(Task.TYPE, body)

    def count(self) -> int:
        if not self._ready():
            return 0
        with self.env.begin() as txn:
            return txn.stat(self._db["tasks"])["entries"]

    def all(self, source: str | None = None, split: str | None = None) -> list[Task]:
        """Every task in insertion order, optionally only one ``source`` and/or ``split``."""
        if not self._ready():
            return []
        out = []
        with self.env.begin() as txn:
            for _, key in txn.cursor(db=self._db["order"]):
                task = decode_body(Task.TYPE, txn.get(key, db=self._db["tasks"]))
                if (source is None or task.source == source) and (
                        split is None or task.split == split):
                    out.append(task)
        return out

    def __iter__(self) -> Iterator[Task]:
        # A snapshot: holding a read transaction across the caller's loop would pin old pages.
        return iter(self.all())


def _encode(task: Task) -> tuple[bytes, bytes]:
    """(key, body) of a task."""
    if not isinstance(task, Task):
        raise TypeError(f"expected a Task, got {type(task).__name__}")
    body = encode_body(task)
    # Refuse now what could not be read back later (e.g. an array inside meta).
    decode_body(Task.TYPE, body)
    key = task.task_id.encode()
    if not 0 < len(key) <= MAX_KEY:
        raise ValueError(f"task_id must be 1..{MAX_KEY} bytes of utf-8, got {len(key)}")
    return key, body
