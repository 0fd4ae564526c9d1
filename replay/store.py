"""The durable replay store: one LMDB environment, ``<run_dir>/replay.lmdb``, with named sub-dbs.

=========  ==========================  =====================================================
sub-db     key                         value
=========  ==========================  =====================================================
groups     group_id (utf-8)            the Group body exactly as the actor sent it (msgpack)
index      group_id                    :class:`GroupRecord` (msgpack list): seq, versions, flags
order      seq (8 bytes, big-endian)   group_id: ingest order, so scans go oldest-first
labels     group_id                    the StepLabels body exactly as the judge sent it
meta       name (utf-8)                msgpack value: next seq, eviction counters, learner
                                       version seen, last batch per learner
=========  ==========================  =====================================================

The replay server (:mod:`replay.server`) is the only writer. Anyone may read, also while it
runs: :func:`read_stats` opens the environment read-only.
"""

from __future__ import annotations

import dataclasses
import struct
import time
import zlib
from pathlib import Path

import lmdb
import msgpack

from protocol import codec
from protocol.errors import SchemaError
from protocol.run_dir import RunDir, check_lmdb_store

MAX_DBS = 8  # five sub-dbs today, room to add a few without touching existing stores
_SUBDBS = ("groups", "index", "order", "labels", "meta")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is ingest order

# meta keys
NEXT_SEQ = "next_seq"
EVICTED = "evicted"
EVICTED_STALE = "evicted_stale"
LEARNER_VERSION = "learner_version"  # newest policy version a learner told us about
MAX_STALENESS = "max_staleness"  # the bound the learner last asked for
LAST_BATCH = "last_batch/"  # + learner_id: [msg_id, [group ids], set aside] of the last Batch
SET_ASIDE = "set_aside"  # groups ever set aside as uninformative: their admission slots are free
# True once the store was served with role tokens, False for one made on a directory without
# any (served open); see ReplayServer._token_authority. Absent: made before the record existed.
ROLES_BY_TOKEN = "roles_by_token"


@dataclasses.dataclass(slots=True)  # one per stored group in the server's memory
class GroupRecord:
    """What the server keeps in memory (and in ``index``) per stored group."""

    seq: int  # ingest order
    task_id: str
    min_version: int  # over generated tokens; -1 when nothing was generated
    max_version: int
    nbytes: int  # stored body size
    judged: bool = False
    delivered: bool = False  # handed to the learner (and not reset by a LearnerHello since)
    consumed: bool = False  # covered by a learner checkpoint: never delivered again
    created: float = 0.0  # unix time the server stored it
    # zlib.crc32 of the stored group body and labels body; -1 = none (stored before
    # checksums, or no labels yet). ``autodidact replay check`` verifies them.
    crc32: int = -1
    labels_crc32: int = -1
    # Whether every rollout scored the same, and every step label is the same (known once
    # judged): what BatchRequest.skip_uninformative reads. Set aside: never served, never
    # counted against admission again; a LearnerHello leaves it consumed.
    outcome_equal: bool = False
    labels_equal: bool = False
    set_aside: bool = False

    def pack(self) -> bytes:
        return msgpack.packb([getattr(self, name) for name in _RECORD_FIELDS])

    @classmethod
    def unpack(cls, raw: bytes) -> GroupRecord:
        return cls(*msgpack.unpackb(raw))


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(GroupRecord))


def store_path(run_dir) -> Path:
    return RunDir(run_dir).replay_store


def seq_key(seq: int) -> bytes:
    return _SEQ.pack(seq)


_RESIZE_RETRIES = 5


def _open_env(path: Path, map_size: int, readonly: bool) -> lmdb.Environment:
    # A reader opening beside a live writer can read a meta page whose map size the writer has
    # already outgrown; opening again reads the newer meta. Bounded, because each retry only
    # races a writer that grew in the instant between two opens.
    for attempt in range(_RESIZE_RETRIES):
        try:
            return lmdb.open(str(path), map_size=map_size, max_dbs=MAX_DBS, subdir=True,
                             readonly=readonly, create=not readonly)
        except lmdb.MapResizedError:
            if not readonly or attempt == _RESIZE_RETRIES - 1:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


class Store:
    """Thin typed access to the sub-dbs; transactions are the caller's (``store.env.begin``)."""

    def __init__(self, run_dir, map_size: int = 10 * 1024**2, readonly: bool = False):
        path = store_path(run_dir)
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        check_lmdb_store(path)
        # Defaults keep sync and metasync on: a commit is on disk when it returns, which is what
        # lets the server ack a group right after committing it.
        self.env = _open_env(path, map_size, readonly)
        try:
            self.db = self._open_dbs(readonly)
        except lmdb.Error:
            self.env.close()
            raise

    def _open_dbs(self, readonly: bool) -> dict:
        def open_all() -> dict:
            return {name: self.env.open_db(name.encode(), create=not readonly)
                    for name in _SUBDBS}

        try:
            return open_all()
        except lmdb.MapResizedError:
            # A reader beside a live writer whose map outgrew the size this env was opened
            # with: size 0 adopts the writer's current size (LMDB's documented answer).
            self.env.set_mapsize(0)
            return open_all()

    def begin_read(self) -> lmdb.Transaction:
        """A read transaction that survives the writer having grown the map since this env
        (or its last transaction) was opened."""
        try:
            return self.env.begin()
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)
            return self.env.begin()

    def close(self) -> None:
        self.env.close()

    # --- groups ----------------------------------------------------------------------------

    def put_group(self, txn, group_id: str, body: bytes, rec: GroupRecord) -> None:
        key = group_id.encode()
        rec.crc32 = zlib.crc32(body)
        txn.put(key, body, db=self.db["groups"])
        txn.put(key, rec.pack(), db=self.db["index"])
        txn.put(seq_key(rec.seq), key, db=self.db["order"])

    def put_record(self, txn, group_id: str, rec: GroupRecord) -> None:
        txn.put(group_id.encode(), rec.pack(), db=self.db["index"])

    def body(self, txn, group_id: str) -> bytes | None:
        return txn.get(group_id.encode(), db=self.db["groups"])

    def delete_group(self, txn, group_id: str, rec: GroupRecord) -> None:
        key = group_id.encode()
        for name in ("groups", "index", "labels"):
            txn.delete(key, db=self.db[name])
        txn.delete(seq_key(rec.seq), db=self.db["order"])

    def load_index(self, txn) -> dict[str, GroupRecord]:
        """Every record, oldest first (dicts keep insertion order)."""
        index = {}
        groups_index = self.db["index"]
        for _, key in txn.cursor(db=self.db["order"]):
            index[key.decode()] = GroupRecord.unpack(txn.get(key, db=groups_index))
        return index

    def iter_since(self, txn, seq: int):
        """(seq, group_id, body) of the groups ingested at ``seq`` or later, oldest first."""
        cursor = txn.cursor(db=self.db["order"])
        if not cursor.set_range(seq_key(seq)):
            return
        for key, group_id in cursor:
            body = txn.get(group_id, db=self.db["groups"])
            if body is not None:  # evicted meanwhile
                yield _SEQ.unpack(key)[0], group_id.decode(), body

    def iter_bodies(self, txn):
        """(group_id, body) for every stored group, in key order."""
        for key, body in txn.cursor(db=self.db["groups"]):
            yield key.decode(), body

    # --- labels ----------------------------------------------------------------------------

    def put_labels(self, txn, group_id: str, body: bytes, rec: GroupRecord) -> None:
        """The labels and their checksum (in ``rec``: the caller writes the record)."""
        rec.labels_crc32 = zlib.crc32(body)
        txn.put(group_id.encode(), body, db=self.db["labels"])

    def labels(self, txn, group_id: str) -> bytes | None:
        return txn.get(group_id.encode(), db=self.db["labels"])

    # --- meta ------------------------------------------------------------------------------

    def get_meta(self, txn, name: str, default=None):
        raw = txn.get(name.encode(), db=self.db["meta"])
        return default if raw is None else msgpack.unpackb(raw)

    def put_meta(self, txn, name: str, value) -> None:
        txn.put(name.encode(), msgpack.packb(value), db=self.db["meta"])

    def delete_meta(self, txn, name: str) -> None:
        txn.delete(name.encode(), db=self.db["meta"])


def read_stats(run_dir) -> dict:
    """Counts over the store at ``run_dir``, read-only: safe while the server runs.

    ``consumed`` counts the stored groups a learner trained on (its committed ledger),
    ``set_aside`` every group replay ever set aside as carrying no signal. ``evicted`` counts
    every group evicted so far, ``evicted_stale`` the unconsumed ones among them that were
    evicted for being past the staleness bound. Versions are over generated tokens of the
    groups still stored (null when none has any).
    """
    out = {"groups": 0, "judged": 0, "consumed": 0, "delivered": 0, "set_aside": 0,
           "evicted": 0, "evicted_stale": 0, "bytes": 0, "oldest_version": None,
           "newest_version": None}
    if not (store_path(run_dir) / "data.mdb").exists():
        return out
    try:
        store = Store(run_dir, readonly=True)
    except lmdb.NotFoundError:  # created a moment ago; its sub-dbs are not committed yet
        return out
    try:
        with store.begin_read() as txn:
            versions = []
            for _, raw in txn.cursor(db=store.db["index"]):
                rec = GroupRecord.unpack(raw)
                out["groups"] += 1
                out["judged"] += rec.judged
                out["consumed"] += rec.consumed and not rec.set_aside
                out["delivered"] += rec.delivered
                out["bytes"] += rec.nbytes
                if rec.min_version >= 0:
                    versions += (rec.min_version, rec.max_version)
            out["evicted"] = store.get_meta(txn, EVICTED, 0)
            out["evicted_stale"] = store.get_meta(txn, EVICTED_STALE, 0)
            out["set_aside"] = store.get_meta(txn, SET_ASIDE, 0)
            if versions:
                out["oldest_version"], out["newest_version"] = min(versions), max(versions)
    finally:
        store.close()
    return out


def check_store(run_dir) -> dict:
    """Verify every stored group of the store at ``run_dir``, read-only (also while the server
    runs): its body and labels against their checksums, that each decodes, and that index,
    order and bodies agree. Returns counts and the ids of damaged groups with why."""
    out = {"groups": 0, "verified": 0, "unchecked": 0, "damaged": {}}
    store = Store(run_dir, readonly=True)
    try:
        with store.begin_read() as txn:
            index = {key.decode(): GroupRecord.unpack(raw)
                     for key, raw in txn.cursor(db=store.db["index"])}
            ordered = {key.decode() for _, key in txn.cursor(db=store.db["order"])}
            for gid, rec in index.items():
                out["groups"] += 1
                problem = _record_problem(txn, store, gid, rec)
                if gid not in ordered:
                    problem = problem or "missing from the ingest order"
                if problem:
                    out["damaged"][gid] = problem
                elif rec.crc32 < 0:
                    out["unchecked"] += 1
                else:
                    out["verified"] += 1
            for gid in sorted(ordered - set(index)):
                out["damaged"][gid] = "in the ingest order but has no index record"
    finally:
        store.close()
    return out


def _record_problem(txn, store: Store, gid: str, rec: GroupRecord) -> str:
    """Why the stored group ``gid`` is damaged; "" when it is not."""
    body = store.body(txn, gid)
    if body is None:
        return "indexed, but its body is missing"
    if rec.crc32 >= 0 and zlib.crc32(body) != rec.crc32:
        return "body does not match its checksum"
    labels = store.labels(txn, gid)
    if rec.labels_crc32 >= 0 and (labels is None or zlib.crc32(labels) != rec.labels_crc32):
        return "labels do not match their checksum"
    try:
        codec.decode_body("group", bytes(body))
    except SchemaError as exc:
        return f"body does not decode ({exc})"
    return ""
