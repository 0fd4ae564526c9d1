"""A replay store's groups as short summaries, for lists that page and filter fast.

The store is opened read-only, beside a live replay server. A group's body is unpacked once
(plain msgpack, without building arrays: a tenth of a full decode) into a :class:`Summary` kept
in memory; each refresh reads only the groups ingested since the last one, and re-reads the
index records, whose flags (judged, consumed, set aside) change as the run goes on. So a list
over 10,000 groups pays the unpacking once, and a page after that costs a filter over
summaries in memory (bench/viewer_pages.py measures both).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb
import msgpack

from protocol.errors import SchemaError
from protocol.messages import rewards_equal
from replay.store import GroupRecord, Store, store_path

OUTCOMES = ("all_success", "all_fail", "mixed")
YES_NO = ("yes", "no")


class ViewError(Exception):
    """A request the viewer cannot answer: one line that says what to do, and its HTTP status."""

    def __init__(self, message: str, status: int = 404):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Summary:
    group_id: str
    seq: int  # ingest order in the store
    created: float  # unix time the actor finished the group
    task_id: str
    source: str  # "original" (the env's own task) or "synthetic" (self-questioning)
    origin: str  # "hand-written", or how and from which exploration a self-made task came
    exploration: str  # the exploration id a synthetic task came from, "" otherwise
    query: str  # the task's instruction, cut to QUERY_CHARS
    rollouts: int
    successes: int
    mean_reward: float
    min_version: int  # over generated tokens; -1 when nothing was generated
    max_version: int
    guided: int  # rollouts whose prompt carried retrieved experience
    judged: bool = False
    delivered: bool = False
    consumed: bool = False
    set_aside: bool = False  # replay set it aside as carrying no signal
    uninformative: bool = False  # every rollout scored the same and every step label is equal
    outcome_equal: bool = False  # every rollout scored the same (Group.outcomes_equal)
    damaged: str = ""  # why the body could not be read; "" when it could


QUERY_CHARS = 160


def origin_of(task: dict) -> tuple[str, str]:
    """(origin, exploration id) of a task as stored: hand-written, or self-made and by what."""
    if task.get("source") != "synthetic":
        return "hand-written", ""
    meta = task.get("meta") or {}
    exploration = str(meta.get("exploration", ""))
    how = f"self-made ({meta.get('method', '?')})"
    return (f"{how}, exploration {exploration}" if exploration else how), exploration


def summarize(group_id: str, body: bytes, rec: GroupRecord, mask=None) -> Summary:
    """A group's summary from its stored body, without building its arrays. ``mask`` (text
    to text) hides secrets in the query before it is cut: a cut can split a secret, and the
    half kept would no longer be recognised."""
    summary = Summary(group_id, rec.seq, rec.created, rec.task_id, "", "", "", "", 0, 0, 0.0,
                      rec.min_version, rec.max_version, 0)
    _set_flags(summary, rec)
    try:
        group = msgpack.unpackb(body, raw=False, strict_map_key=True)
        task, trajs = group["task"], group["trajectories"]
        rewards = [float(t["reward"]) for t in trajs]
        summary.created = float(group.get("created_at") or rec.created)
        summary.source = str(task.get("source", "original"))
        summary.origin, summary.exploration = origin_of(task)
        query = str(task.get("query", ""))
        summary.query = (mask(query) if mask else query)[:QUERY_CHARS]
        summary.rollouts = len(trajs)
        summary.successes = sum(bool(t.get("success")) for t in trajs)
        summary.mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
        # from the rewards, not the record: a record stored before it had the flag says False
        summary.outcome_equal = rewards_equal(rewards)
        summary.guided = sum(bool(t.get("experience_ids") or t.get("experience_span"))
                             for t in trajs)
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        summary.damaged = f"body does not unpack ({type(exc).__name__})"
    return summary


def _set_flags(summary: Summary, rec: GroupRecord) -> None:
    summary.judged, summary.delivered = rec.judged, rec.delivered
    summary.consumed, summary.set_aside = rec.consumed, rec.set_aside
    summary.uninformative = rec.outcome_equal and rec.labels_equal


def outcome_of(s: Summary) -> str:
    if s.rollouts and s.successes == s.rollouts:
        return "all_success"
    return "all_fail" if s.successes == 0 else "mixed"


@dataclass
class Filters:
    """What a list keeps; an empty field keeps everything."""

    task: str = ""  # a substring of the task id or its query
    origin: str = ""  # "original" | "synthetic" | an exploration id
    outcome: str = ""  # one of OUTCOMES
    version: int | None = None  # groups whose generated tokens span this policy version
    guided: str = ""  # "yes": some rollout carried experience; "no": none did
    judged: str = ""  # "yes" | "no"

    @classmethod
    def parse(cls, params) -> Filters:
        """From query parameters; a value outside its choices is a 400 naming it."""
        f = cls(task=params.get("task", "").strip(), origin=params.get("origin", "").strip(),
                outcome=params.get("outcome", ""), guided=params.get("guided", ""),
                judged=params.get("judged", ""))
        for name, choices in (("outcome", OUTCOMES), ("guided", YES_NO), ("judged", YES_NO)):
            value = getattr(f, name)
            if value and value not in choices:
                raise ViewError(f"{name}={value!r}: use one of {', '.join(choices)} or leave "
                                "it empty", 400)
        version = params.get("version", "").strip()
        if version:
            try:
                f.version = int(version)
            except ValueError:
                raise ViewError(f"version={version!r}: give a policy version number", 400) \
                    from None
        return f

    def keeps(self, s: Summary) -> bool:
        if self.task and self.task.lower() not in f"{s.task_id}\n{s.query}".lower():
            return False
        if self.origin == "original" and s.source == "synthetic":
            return False
        if self.origin == "synthetic" and s.source != "synthetic":
            return False
        if self.origin not in ("", "original", "synthetic") and s.exploration != self.origin:
            return False
        if self.outcome and outcome_of(s) != self.outcome:
            return False
        if self.version is not None and not s.min_version <= self.version <= s.max_version:
            return False
        if self.guided and (s.guided > 0) != (self.guided == "yes"):
            return False
        return not self.judged or s.judged == (self.judged == "yes")


class GroupIndex:
    """The summaries of one run's stored groups, brought up to date on each :meth:`refresh`."""

    def __init__(self, run_dir: Path, mask=None):
        self.run_dir = Path(run_dir)
        self.mask = mask  # applied to each query before it is cut (summarize)
        self._by_id: dict[str, Summary] = {}
        self._next_seq = 0
        self.stored = 0  # groups in the store at the last refresh
        self._lock = threading.RLock()
        self.refreshed_at = 0.0

    @contextlib.contextmanager
    def reading(self):
        """The store, opened read-only for this block. One block at a time per process: LMDB
        refuses to open one environment twice in a process, and requests and the indexer
        read from their own threads."""
        if not (store_path(self.run_dir) / "data.mdb").exists():
            raise ViewError(f"{self.run_dir}: no replay store yet (replay.lmdb); the run has "
                            "not stored a group so far, look again in a moment", 404)
        with self._lock:
            try:
                store = Store(self.run_dir, readonly=True)
            except (lmdb.Error, SchemaError) as exc:
                raise ViewError(f"{store_path(self.run_dir)}: cannot be opened read-only "
                                f"({exc}); `autodidact replay check` says what is wrong", 503) \
                    from None
            try:
                yield store
            finally:
                store.close()

    def refresh(self, budget_s: float = float("inf")) -> bool:
        """Read what changed since the last refresh, for at most ``budget_s`` seconds of
        unpacking; True when every stored group is summarized."""
        with self.reading() as store:
            return self._read(store, time.monotonic() + budget_s)

    def _read(self, store: Store, deadline: float) -> bool:
        with store.begin_read() as txn:
            records = {key.decode(): GroupRecord.unpack(raw)
                       for key, raw in txn.cursor(db=store.db["index"])}
            done = True
            for seq, gid, body in store.iter_since(txn, self._next_seq):
                if time.monotonic() > deadline:
                    done = False
                    break
                rec = records.get(gid)
                if rec is not None:
                    self._by_id[gid] = summarize(gid, bytes(body), rec, self.mask)
                self._next_seq = seq + 1
        for gid in [g for g in self._by_id if g not in records]:  # evicted since
            del self._by_id[gid]
        for gid, summary in self._by_id.items():
            _set_flags(summary, records[gid])
        self.stored = len(records)
        self.refreshed_at = time.time()
        return done

    def page(self, filters: Filters, page: int, per_page: int) -> dict:
        """One page of the kept groups, newest first."""
        with self._lock:
            kept = [s for s in self._by_id.values() if filters.keeps(s)]
            stored, indexed = self.stored, len(self._by_id)
        kept.sort(key=lambda s: s.seq, reverse=True)
        pages = max(1, -(-len(kept) // per_page))
        if page >= pages and page > 0 and indexed >= stored:  # while indexing, maybe later
            raise ViewError(f"page {page} is past the last page ({pages - 1}) of "
                            f"{len(kept)} groups", 400)
        rows = kept[page * per_page:(page + 1) * per_page]
        return {"total": len(kept), "page": page, "per_page": per_page, "pages": pages,
                "stored": stored, "indexed": indexed, "indexing": indexed < stored,
                "groups": [{**asdict(s), "outcome": outcome_of(s)} for s in rows]}

    def summaries(self) -> tuple[list[Summary], int]:
        """The summaries indexed so far, and how many groups the store held at the last
        refresh (more than the summaries while indexing is under way)."""
        with self._lock:
            return list(self._by_id.values()), self.stored

    def task_queries(self) -> dict[str, str]:
        """task id -> its instruction, for the tasks the stored groups rolled out."""
        with self._lock:
            return {s.task_id: s.query for s in self._by_id.values()}

    def task_outcomes(self) -> dict[str, tuple[int, int]]:
        """task id -> (successful rollouts, rollouts) over the stored groups."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for s in self._by_id.values():
                ok, n = out.get(s.task_id, (0, 0))
                out[s.task_id] = (ok + s.successes, n + s.rollouts)
        return out

