"""The replay server: the only writer of ``<run_dir>/replay.lmdb``.

Actors push groups, judges pull work and write labels back, the learner asks for batches and
commits its consumed ledger, all over one ZeroMQ ROUTER socket. Everything a burst of frames
changes is written in one LMDB transaction, and nothing is acknowledged before that
transaction commits: an ack means "on disk".

Each writing request belongs to one role (``protocol.messages.REPLAY_SENDER``): only actors
push, only judges lease and label, and only the learner says hello, takes batches and commits
the ledger (its requests move what every other role sees: the stale floor, what is consumed).
With CURVE keys the sender's key decides (``authorized/<role>/``); without, the role token in
the frame's envelope (``<run-dir>/<role>.token``, made by ``autodidact run`` or ``autodidact
keys tokens``). Anything else is refused ``unauthorized``, counted and logged. Tokens fail
closed: once a run directory has any, every role needs its own, and a store served with tokens
is never served open again. Only a store made on a directory without tokens (tests, benches, a
bare ``autodidact replay``) serves any client as any role, and says so at start; an older
store in a directory without tokens is refused at start (docs/security.md).

A write transaction that fails because the file system is full answers every write in it with
``disk_full`` (nothing of it was stored; clients keep what they sent and try again after a
back-off) and the stats say ``disk_full_now: 1`` until a write commits again: the run goes on
writing by itself once space returns.

LMDB is the truth. The server keeps an in-memory copy of the small per-group index (loaded at
start) to pick work without scanning the store; whenever a write transaction aborts, the copy
is reloaded from LMDB rather than patched.

A batch request that cannot be served yet (nothing fresh, or nothing judged) and asks to wait
(``BatchRequest.timeout_s``) is *held*: not answered, one per learner id, and tried again after
every burst that stored something and on every tick, in a write transaction of its own, until
it can be answered or its time is up. The loop never blocks on it. See :meth:`_on_batch_request`.

Start it with ``autodidact replay --run-dir DIR [--address A] [--set key=value ...]``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import lmdb

from protocol import codec
from protocol.config import ReplayConfig
from protocol.errors import SchemaError
from protocol.messages import (
    REPLAY_ROLES,
    REPLAY_SENDER,
    Ack,
    Batch,
    BatchRequest,
    Error,
    Group,
    GroupsSince,
    JudgePull,
    JudgeWork,
    LearnerHello,
    LedgerCommit,
    Stats,
    StatsRequest,
    StepLabels,
    StoredGroups,
)
from protocol.role import StopEvent
from protocol.run_dir import role_token, single_writer_lock
from protocol.security import CurveKeys
from protocol.transport import Incoming, RouterServer, local_address
from replay.store import (
    EVICTED,
    EVICTED_STALE,
    LAST_BATCH,
    LEARNER_VERSION,
    MAX_STALENESS,
    NEXT_SEQ,
    ROLES_BY_TOKEN,
    SET_ASIDE,
    GroupRecord,
    Store,
    store_path,
)

log = logging.getLogger("replay.server")

MAX_KEY_BYTES = 500  # LMDB refuses keys longer than 511 bytes
WRITES = (Group, StepLabels, LearnerHello, BatchRequest, LedgerCommit)  # handled in the txn
READS = (JudgePull, StatsRequest, GroupsSince)  # handled after the commit: they see its writes
STORE_FULL = "replay store is full: grow replay.map_size and restart the replay server"
UNAUTHORIZED = ("only the run's {role} may send {request}: its frames carry "
                "<run-dir>/{role}.token, or with CURVE keys it holds a key in authorized/{role}/")
NO_ROLE_TOKEN = ("only the run's {role} may send {request}, and the run directory has no "
                 "{role}.token to prove it by: make it with `autodidact keys tokens --run-dir "
                 "<run-dir>`, then restart the replay server and the {role}")
DISK_FULL = "no space left on the replay store's file system: nothing stored; send it again later"
# LMDB reports a write the file system refused as a generic I/O error; with less than this
# free on the store's file system it is taken for a full disk.
DISK_FULL_FREE_BYTES = 16 << 20
MAX_HELD = 1024  # batch requests held at once (one per learner id); past it they are answered
HELD_TICK_S = 0.05  # how often held requests are tried again when nothing was stored meanwhile
READ_REPLY_BYTES = 64 * 1024**2  # stored bodies in one StoredGroups reply (at least one group)


@dataclass(frozen=True)
class _Held:
    """A batch request waiting for something to serve: answered by a later write txn."""

    incoming: Incoming
    deadline: float  # monotonic: answered (maybe empty) once this passes


HOLD = object()  # a handler's "no reply yet": the request is in ReplayServer.held


class RoleTokensMissing(RuntimeError):
    """A run directory without role tokens whose store must not be served open."""


class _HandlerCrash(Exception):
    """A handler raised something unexpected; its transaction must not commit."""

    def __init__(self, incoming: Incoming, exc: Exception):
        super().__init__(repr(exc))
        self.incoming, self.exc = incoming, exc


def _uninformative(rec: GroupRecord, req: BatchRequest, kind: str) -> bool:
    """A group that would carry no signal to ``req``'s learner: equal rewards and, where it
    trains on labels (``require_labels``, a group not served unjudged), equal labels."""
    if not rec.outcome_equal:
        return False
    return kind == "overdue" or not req.require_labels or rec.labels_equal


class ReplayServer:
    """Serves actors, judges and the learner from one thread; see :meth:`run`."""

    def __init__(self, run_dir, cfg: ReplayConfig, address: str | None = None,
                 curve: CurveKeys | None = None):
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        with contextlib.ExitStack() as undo:  # a failed start releases what it took
            # Two servers would each trust their own in-memory index of the same store.
            path = store_path(run_dir)
            self._lock = single_writer_lock(
                path, "server.lock", f"another replay server (pid {{pid}}) is serving {path}")
            undo.callback(os.close, self._lock)
            self.store = Store(run_dir, map_size=cfg.map_size)
            undo.callback(self.store.close)
            self.store.env.reader_check()  # clear reader slots of a killed predecessor
            # with keys a frame's sender key says which roles it may act as; without, tokens
            self.tokens, self.open_roles = ({}, False) if curve else self._token_authority()
            self.rpc = RouterServer(address or cfg.address or local_address(run_dir, "replay"),
                                    max_frame_bytes=cfg.max_frame_bytes, curve=curve)
            undo.pop_all()
        self.address = self.rpc.bound_address
        self.counters: Counter = Counter()
        self.leases: dict[str, float] = {}  # group_id -> monotonic deadline; memory only
        self.stale_seen: set[str] = set()  # passed over as too stale (counted once each)
        self._stale_added: list[str] = []  # stale_seen additions of the open txn, for undo
        self.held: dict[str, _Held] = {}  # learner_id -> its batch request waiting for groups
        self._released: list[tuple[Incoming, object]] = []  # held ones let go by the open txn
        self._held_stale = True  # something was stored: held requests may be servable now
        self._next_held_try = 0.0
        self._stop = StopEvent()
        self._next_lease_sweep = 0.0
        self._nothing_evictable: tuple | None = None  # see _evict
        self._last_logged: dict[str, float] = {}
        self.disk_full = False  # the last write transaction failed for want of space
        self.curve = curve
        self._handlers = {Group: self._on_group, StepLabels: self._on_labels,
                          LearnerHello: self._on_hello, BatchRequest: self._on_batch_request,
                          LedgerCommit: self._on_ledger, JudgePull: self._on_judge_pull,
                          StatsRequest: self._on_stats, GroupsSince: self._on_groups_since}
        self._reload()
        log.info("replay server on %s: %d groups in %s; %s; %s", self.address,
                 len(self.index), store_path(run_dir),
                 f"CURVE, {len(curve.authorized)} authorized client keys"
                 if curve else "plaintext (security.keys_dir empty)", self._authority_line())
        if self.open_roles:
            log.warning("%s has no role tokens: any client may act as any role (learner, actor, "
                        "judge); `autodidact keys tokens --run-dir %s` makes them and closes "
                        "this store to clients without one for good", self.run_dir, self.run_dir)

    def _token_authority(self) -> tuple[dict[str, str], bool]:
        """Each role's token, and whether roles are open to any client. Open only for a store
        made on a directory without tokens; the store records which it is (ROLES_BY_TOKEN), so
        tokens deleted later, or a store from before the record whose directory has none,
        refuse to start instead of serving everyone (RoleTokensMissing)."""
        tokens = {role: t for role in REPLAY_ROLES if (t := role_token(self.run_dir, role))}
        with self.store.env.begin() as txn:
            recorded = self.store.get_meta(txn, ROLES_BY_TOKEN)
            fresh = recorded is None and self.store.get_meta(txn, NEXT_SEQ) is None
        if not tokens and not fresh and recorded is not False:
            made = ", ".join(f"{role}.token" for role in REPLAY_ROLES)
            raise RoleTokensMissing(
                f"{self.run_dir} has no role tokens ({made}) and its replay store was served "
                f"with them or made before they existed, so it is not served to any client as "
                f"any role: make them with `autodidact keys tokens --run-dir {self.run_dir}` "
                f"(`autodidact run --resume` also does), then start the run's roles again")
        if recorded != bool(tokens):
            with self.store.env.begin(write=True) as txn:
                self.store.put_meta(txn, ROLES_BY_TOKEN, bool(tokens))
        return tokens, not tokens

    def _authority_line(self) -> str:
        if self.curve:
            return "roles by client key"
        if self.open_roles:
            return "roles open: no role tokens"
        missing = [role for role in REPLAY_ROLES if role not in self.tokens]
        return (f"roles by token ({', '.join(self.tokens)})" +
                (f"; no {', '.join(missing)} token: those requests are refused" if missing
                 else ""))

    # --- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set or :meth:`request_stop` is called::

            while not stopped:
                burst = rpc.poll(max_batch=cfg.write_batch)    # frames waiting, decoded
                for incoming, reply in self.handle(burst):     # one LMDB txn, committed
                    rpc.reply(incoming, reply)                 # so acks follow the commit
                for incoming, reply in self.release_held():    # held batch requests now
                    rpc.reply(incoming, reply)                 # servable or out of time
                self._expire_leases()
        """
        self._stop.use(stop)
        while not self._stop.is_set():
            timeout_ms = 100 if not self.held else int(HELD_TICK_S * 1000)
            burst = self.rpc.poll(timeout_ms=timeout_ms, max_batch=self.cfg.write_batch)
            for incoming, reply in self.handle(burst) + self.release_held():
                self.rpc.reply(incoming, reply)
            self._expire_leases()
        log.info("replay server stopped: %s", self.stats())

    def request_stop(self, *_) -> None:
        self._stop.set()

    def handle(self, burst: list[Incoming]) -> list[tuple[Incoming, object]]:
        """Replies for one burst; every write in it is committed before this returns."""
        writes, reads = [], []
        for inc in burst:
            if inc.error is not None:
                self.rpc.reject(inc, inc.error)  # nothing stored was touched
            elif isinstance(inc.msg, WRITES):
                writes.append(inc)
            elif isinstance(inc.msg, READS):
                reads.append(inc)
            else:
                self.rpc.reject(inc, SchemaError(
                    "unexpected_type", f"the replay server does not serve {type(inc.msg).TYPE!r}"))
        replies = self._commit(writes) if writes else []
        return replies + [(inc, self._dispatch(None, inc)) for inc in reads]

    def release_held(self) -> list[tuple[Incoming, object]]:
        """Answers to held batch requests that can be served now or whose time is up, each
        handled again as it was first (one write transaction); the rest stay held. Looks at
        what is stored only after a burst stored something or a tick passed."""
        if not self.held:
            return []
        now = time.monotonic()
        look = self._held_stale or now >= self._next_held_try
        if look:
            self._held_stale = False
            self._next_held_try = now + HELD_TICK_S
        due = [h.incoming for h in self.held.values()
               if h.deadline <= now or (look and self._servable(h.incoming.msg))]
        return self._commit(due) if due else []

    def _commit(self, writes: list[Incoming]) -> list[tuple[Incoming, object]]:
        """Handle ``writes`` in one transaction. A full map refuses pushes first, then every
        write (reads go on); a handler that crashes is answered alone and the rest redone."""
        refused: tuple[type, ...] = ()
        crashed: dict[int, Exception] = {}
        while True:
            undo = (self.counters.copy(), self.rpc.counters.rejected.copy(), dict(self.held))
            self._stale_added, self._released = [], []
            try:
                replies = self._write_txn(writes, refused, crashed)
                return self._settle(replies) + self._released
            except Exception as exc:
                self._rollback(*undo)  # the txn was aborted: memory follows LMDB
                if isinstance(exc, _HandlerCrash):
                    crashed[id(exc.incoming)] = exc.exc
                elif isinstance(exc, lmdb.MapFullError) and refused != WRITES:
                    self._log_store_full()
                    refused = (Group,) if not refused else WRITES
                elif isinstance(exc, lmdb.Error) and self._no_space():
                    return self._refuse_for_space(writes)
                else:
                    # Not one frame's fault (disk trouble, or a bug outside the handlers):
                    # answer nothing, so clients retry.
                    log.error("write transaction failed; nothing acknowledged", exc_info=exc)
                    self.counters["errors/store" if isinstance(exc, lmdb.Error)
                                  else "errors/internal"] += 1
                    return []

    def _settle(self, replies: list[tuple[Incoming, object]]) -> list[tuple[Incoming, object]]:
        """The committed replies to send: held requests have none yet; a batch request
        answered any other way (also refused: store_full, a crash) is no longer held."""
        out = []
        for inc, reply in replies:
            if reply is HOLD:
                continue
            if isinstance(inc.msg, BatchRequest):
                held = self.held.get(inc.msg.learner_id)
                if held is not None and held.incoming.msg_id == inc.msg_id:
                    del self.held[inc.msg.learner_id]
            out.append((inc, reply))
        return out

    def _rollback(self, counters: Counter, rejected: Counter, held: dict) -> None:
        self.counters, self.rpc.counters.rejected = counters, rejected
        self.stale_seen.difference_update(self._stale_added)
        self.held, self._released = held, []
        self._reload()

    def _write_txn(self, writes, refused, crashed) -> list[tuple[Incoming, object]]:
        replies = []
        with self.store.env.begin(write=True) as txn:  # aborts if anything raises
            for inc in writes:
                if id(inc) in crashed:
                    replies.append((inc, self._internal_error(crashed[id(inc)])))
                elif isinstance(inc.msg, refused):
                    self.counters["store_full"] += 1
                    replies.append((inc, Error("store_full", STORE_FULL)))
                else:
                    replies.append((inc, self._dispatch(txn, inc)))
            if not refused:
                self._evict(txn)
            self._save_counters(txn)
        self.counters["write_txns"] += 1
        if self.disk_full:
            self.disk_full = False
            log.warning("replay store writes again: space returned on %s", self.run_dir)
        return replies

    def _dispatch(self, txn, inc: Incoming):
        role = REPLAY_SENDER.get(type(inc.msg))
        if role is not None and (why := self._refusal(inc, role)):
            self.rpc.counters.rejected["unauthorized"] += 1
            if self._due("unauthorized"):
                log.warning("refused %s: the sender is not the run's %s (%s)", type(inc.msg).TYPE,
                            role, why)
            text = NO_ROLE_TOKEN if self._missing_token(role) else UNAUTHORIZED
            return Error("unauthorized", text.format(role=role, request=type(inc.msg).TYPE))
        try:
            return self._handlers[type(inc.msg)](txn, inc)
        except SchemaError as exc:  # well-formed but inconsistent with what is stored
            self.rpc.counters.rejected[exc.reason] += 1
            log.warning("refused %s: %s", type(inc.msg).TYPE, exc)
            return Error(exc.reason, str(exc)[:500])
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            if txn is None:
                return self._internal_error(exc)
            raise _HandlerCrash(inc, exc) from exc

    def _refusal(self, inc: Incoming, role: str) -> str:
        """Why ``inc`` may not act as ``role``; "" when it may."""
        if self.curve is not None:
            return "" if role in self.curve.roles_of(inc.peer_key) else \
                f"its key is not in authorized/{role}"
        if self.open_roles:
            return ""
        token = self.tokens.get(role)
        if token is None:
            return f"{self.run_dir} has no {role}.token: `autodidact keys tokens` makes it"
        if not inc.credential:
            return "the frame carries no token"
        if not hmac.compare_digest(inc.credential.encode(), token.encode()):
            return f"the frame's token is not {role}.token"
        return ""

    def _missing_token(self, role: str) -> bool:
        return self.curve is None and not self.open_roles and role not in self.tokens

    def _internal_error(self, exc: Exception) -> Error:
        self.counters["errors/internal"] += 1
        log.error("handler failed: %r", exc, exc_info=exc)
        return Error("invalid", f"internal error: {type(exc).__name__}")

    # --- in-memory view --------------------------------------------------------------------

    def _reload(self) -> None:
        """Rebuild the in-memory view from what LMDB holds now."""
        with self.store.env.begin() as txn:
            self.index: dict[str, GroupRecord] = self.store.load_index(txn)
            get = self.store.get_meta
            self.next_seq = get(txn, NEXT_SEQ, 0)
            self.evicted = get(txn, EVICTED, 0)
            self.evicted_stale = get(txn, EVICTED_STALE, 0)
            self.set_aside = get(txn, SET_ASIDE, 0)
            self.learner_version = get(txn, LEARNER_VERSION)
            self.max_staleness = get(txn, MAX_STALENESS)
        self._saved = (self.next_seq, self.evicted, self.evicted_stale,
                       self.learner_version, self.max_staleness)
        self.nbytes = sum(r.nbytes for r in self.index.values())
        self._rebuild_queues()
        self.stale_seen &= self.index.keys()

    def _rebuild_queues(self) -> None:
        # Insertion-ordered dicts used as ordered sets: oldest first, O(1) removal.
        self.deliverable = {g: None for g, r in self.index.items()
                            if not (r.delivered or r.consumed)}
        self.unjudged = {g: None for g, r in self.index.items()
                         if not (r.judged or r.consumed)}

    def _save_counters(self, txn) -> None:
        now = (self.next_seq, self.evicted, self.evicted_stale,
               self.learner_version, self.max_staleness)
        if now != self._saved:
            for key, value in zip((NEXT_SEQ, EVICTED, EVICTED_STALE, LEARNER_VERSION,
                                   MAX_STALENESS), now):
                self.store.put_meta(txn, key, value)
            self._saved = now

    def _stale_floor(self) -> int | None:
        """Groups whose oldest token version is below this will never be trained."""
        if self.learner_version is None or self.max_staleness is None:
            return None
        return self.learner_version - self.max_staleness

    def _is_stale(self, rec: GroupRecord, floor: int | None) -> bool:
        # A group with no generated tokens (min_version -1) carries no staleness: fresh.
        return floor is not None and 0 <= rec.min_version < floor

    # --- writes ----------------------------------------------------------------------------

    def _on_group(self, txn, inc: Incoming):
        group: Group = inc.msg
        gid = group.group_id
        if gid in self.index:
            self.counters["duplicates"] += 1
            return Ack(status="duplicate")
        if len(gid.encode()) > MAX_KEY_BYTES:
            raise SchemaError("invalid", f"group_id longer than {MAX_KEY_BYTES} bytes", "group_id")
        vmin, vmax = group.policy_versions()
        rec = GroupRecord(seq=self.next_seq, task_id=group.task.task_id, min_version=vmin,
                          max_version=vmax, nbytes=len(inc.body), created=time.time(),
                          outcome_equal=group.outcomes_equal())
        # The body exactly as sent: what the learner reads back is byte-identical.
        self.store.put_group(txn, gid, inc.body, rec)
        self.next_seq += 1
        self.index[gid] = rec
        self.deliverable[gid] = None
        self.unjudged[gid] = None
        self.nbytes += rec.nbytes
        self.counters["groups_stored"] += 1
        self._held_stale = True
        if self._is_stale(rec, self._stale_floor()):
            self.counters["stale_at_ingest"] += 1
        return Ack(status="stored")

    def _on_labels(self, txn, inc: Incoming):
        labels: StepLabels = inc.msg
        rec = self.index.get(labels.group_id)
        if rec is None:
            raise SchemaError("invalid", f"no stored group {labels.group_id[:80]!r}", "group_id")
        if rec.judged:  # a retry, or a second judge after a lease ran out: first one wins
            return Ack(status="duplicate")
        group = codec.decode_body(Group.TYPE, self.store.body(txn, labels.group_id))
        want = [len(t.steps) for t in group.trajectories]
        got = [len(row) for row in labels.labels]
        if got != want:
            raise SchemaError("invalid", f"labels per step {got} for a group with steps {want}",
                              "labels")
        self.store.put_labels(txn, labels.group_id, inc.body, rec)
        rec.judged, rec.labels_equal = True, labels.all_equal()
        self.store.put_record(txn, labels.group_id, rec)
        self.unjudged.pop(labels.group_id, None)
        self.leases.pop(labels.group_id, None)
        self.counters["labels_stored"] += 1
        self._held_stale = True
        return Ack(status="stored")

    def _on_batch_request(self, txn, inc: Incoming):
        """Serve a batch, or hold the request (:data:`HOLD`) while nothing can be served and
        its ``timeout_s`` has not run out; :meth:`release_held` hands it back here later.

        What holding keeps: nothing is marked delivered or recorded until the request is
        answered, in the transaction that answers it; a learner has at most one request held
        (its newest: an older one, given up by its client, is answered empty and records
        nothing); a retry of the held request (same msg id) only refreshes where the answer
        goes and keeps its deadline; a retry of an answered one gets the recorded groups again
        (``last_batch/``), so no request id is ever answered with two different batches.
        """
        req: BatchRequest = inc.msg
        if self.learner_version is None or req.version > self.learner_version:
            self.learner_version = req.version
        self.max_staleness = req.max_staleness
        last = self.store.get_meta(txn, LAST_BATCH + req.learner_id)
        if last is not None and inc.msg_id and last[0] == inc.msg_id:
            # The learner retried because our reply was lost: the same groups again, so none
            # is marked delivered without having reached it.
            ids, skipped, timeouts = [g for g in last[1] if g in self.index], 0, 0
            set_aside = last[2] if len(last) > 2 else 0  # the learner frees their slots once
            self.counters["batch_retries"] += 1
        else:
            held = self.held.get(req.learner_id)
            if held is not None and held.incoming.msg_id != inc.msg_id:
                self._release(req.learner_id, "batch_held_superseded")
                held = None
            now = time.monotonic()
            deadline = held.deadline if held is not None else now + req.timeout_s
            ids, skipped, timeouts, uninformative = self._pick_batch(req)
            if (not ids and not skipped and not uninformative and now < deadline and inc.msg_id
                    and (held is not None or len(self.held) < MAX_HELD)):
                if held is None:
                    self.counters["batch_held"] += 1
                self.held[req.learner_id] = _Held(inc, deadline)
                return HOLD
            self.held.pop(req.learner_id, None)  # answered now, if it was held
            for gid in ids:
                self.index[gid].delivered = True
                self.store.put_record(txn, gid, self.index[gid])
                self.deliverable.pop(gid)
            self.counters["groups_delivered"] += len(ids)
            self._set_aside(txn, uninformative)
            set_aside = len(uninformative)
            self.store.put_meta(txn, LAST_BATCH + req.learner_id, [inc.msg_id, ids, set_aside])
        groups = [codec.decode_body(Group.TYPE, self.store.body(txn, g)) for g in ids]
        raw_labels = [self.store.labels(txn, g) for g in ids]
        labels = [codec.decode_body(StepLabels.TYPE, raw) for raw in raw_labels if raw]
        return Batch(groups=groups, labels=labels, stale_skipped=skipped,
                     judge_timeouts=timeouts, uninformative_skipped=set_aside)

    def _set_aside(self, txn, group_ids: list[str]) -> None:
        """Groups that carry no signal leave every queue for good: consumed without training
        (a LearnerHello leaves them so), their count kept for admission's rebuild."""
        if not group_ids:
            return
        for gid in group_ids:
            rec = self.index[gid]
            rec.set_aside = rec.consumed = rec.delivered = True
            self.store.put_record(txn, gid, rec)
            self.deliverable.pop(gid, None)
            self.unjudged.pop(gid, None)
        self.set_aside += len(group_ids)
        self.store.put_meta(txn, SET_ASIDE, self.set_aside)

    def _release(self, learner_id: str, why: str) -> None:
        """Let a held request go unserved: answered with an empty batch, nothing recorded (its
        client has given it up, or the learner restarted)."""
        held = self.held.pop(learner_id)
        self._released.append((held.incoming, Batch(groups=[])))
        self.counters[why] += 1

    def _candidates(self, req: BatchRequest):
        """What ``req`` could be answered with, oldest first, without changing anything:
        ``(group_id, kind)``, kind ``serve``, ``overdue`` (unjudged, served past the label
        deadline) or ``stale`` (passed over, counted once: not yet in stale_seen)."""
        floor = req.version - req.max_staleness
        overdue_before = time.time() - req.label_deadline_s if req.label_deadline_s > 0 else None
        for gid in self.deliverable:
            rec = self.index[gid]
            if self._is_stale(rec, floor):
                if gid not in self.stale_seen:
                    yield gid, "stale"
                continue
            if rec.judged or not req.require_labels:
                kind = "serve"
            elif overdue_before is not None and rec.created <= overdue_before:
                # The judges are behind or gone: the learner trains it on the outcome alone
                # rather than stall; a late label is still stored but no longer used.
                kind = "overdue"
            else:
                continue
            if req.skip_uninformative and _uninformative(rec, req, kind):
                kind = "uninformative"
            yield gid, kind

    def _servable(self, req: BatchRequest) -> bool:
        """Whether answering ``req`` now would serve a group or report a stale skip."""
        return req.num_groups > 0 and next(self._candidates(req), None) is not None

    def _pick_batch(self, req: BatchRequest) -> tuple[list[str], int, int, list[str]]:
        """Oldest deliverable groups within the staleness bound: (ids, stale skipped, served
        unjudged past the label deadline, uninformative ones to set aside). Counts each stale
        one once."""
        ids, skipped, timeouts, uninformative = [], 0, 0, []
        for gid, kind in self._candidates(req):
            if len(ids) >= req.num_groups:
                break
            if kind == "stale":
                self.stale_seen.add(gid)
                self._stale_added.append(gid)
                skipped += 1
            elif kind == "uninformative":
                uninformative.append(gid)
            else:
                ids.append(gid)
                timeouts += kind == "overdue"
        self.counters["stale_skipped"] += skipped
        self.counters["judge_timeouts"] += timeouts
        return ids, skipped, timeouts, uninformative

    def _on_ledger(self, txn, inc: Incoming):
        commit: LedgerCommit = inc.msg
        marked, unknown = self._consume(txn, commit.group_ids)
        return Ack(status="ok", info={"consumed": marked, "unknown": unknown})

    def _on_hello(self, txn, inc: Incoming):
        """A learner (re)starts from a checkpoint: what it covers is consumed, and only that.
        Whatever was delivered after it was trained by a learner whose state is gone, so it is
        served again; so are groups consumed under a newer checkpoint than the one it resumed
        from (a damaged latest it fell back from): the weights that learned them are gone."""
        hello: LearnerHello = inc.msg
        self.learner_version = hello.version  # a resume may go back to an older version
        marked, unknown = self._consume(txn, hello.consumed)
        covered = set(hello.consumed)
        reset = unconsumed = 0
        for gid, rec in self.index.items():
            if rec.consumed and gid not in covered and not rec.set_aside:
                rec.consumed = False
                unconsumed += 1
            if rec.delivered and not rec.consumed:
                rec.delivered = False
                self.store.put_record(txn, gid, rec)
                reset += 1
        if reset:
            self._rebuild_queues()
        # Requests held from before the restart would take groups for a learner that is gone.
        for learner_id in list(self.held):
            self._release(learner_id, "batch_held_dropped")
        self._held_stale = True
        self.store.delete_meta(txn, LAST_BATCH + hello.learner_id)
        log.info("learner %s at version %d: %d consumed, %d to deliver again (%d of them "
                 "consumed under a newer checkpoint), %d unknown ids", hello.learner_id,
                 hello.version, marked, reset, unconsumed, unknown)
        return Ack(status="ok", info={"consumed": marked, "redeliver": reset,
                                      "unconsumed": unconsumed, "unknown": unknown})

    def _consume(self, txn, group_ids) -> tuple[int, int]:
        marked = unknown = 0
        for gid in group_ids:
            rec = self.index.get(gid)
            if rec is None:  # evicted, or never stored here
                unknown += 1
            elif not rec.consumed:
                rec.consumed = rec.delivered = True
                self.store.put_record(txn, gid, rec)
                self.deliverable.pop(gid, None)
                self.unjudged.pop(gid, None)
                marked += 1
        self.counters["groups_consumed"] += marked
        return marked, unknown

    def _evict(self, txn) -> None:
        """Oldest consumed groups first, then unconsumed ones past the staleness bound; fresh
        unconsumed data is never evicted, even over capacity."""
        if not self._over_capacity():
            return
        if self._nothing_evictable != self._eviction_epoch():
            floor = self._stale_floor()
            for evictable in (lambda r: r.consumed, lambda r: self._is_stale(r, floor)):
                for gid, rec in list(self.index.items()):  # oldest first
                    if not self._over_capacity():
                        return
                    if evictable(rec):
                        self._delete(txn, gid, rec, stale=not rec.consumed)
            # Until something is consumed or goes stale, a rescan would find nothing.
            self._nothing_evictable = self._eviction_epoch()
        self.counters["over_capacity"] += 1
        if self._due("over_capacity"):
            log.warning("over capacity (%d groups, %d bytes; limits %d, %d) and nothing left "
                        "to evict: all unconsumed and fresh", len(self.index), self.nbytes,
                        self.cfg.max_groups, self.cfg.max_bytes)

    def _eviction_epoch(self) -> tuple:
        return (self.counters["groups_consumed"], self.counters["stale_at_ingest"],
                self.learner_version, self.max_staleness)

    def _over_capacity(self) -> bool:
        return len(self.index) > self.cfg.max_groups or self.nbytes > self.cfg.max_bytes

    def _delete(self, txn, gid: str, rec: GroupRecord, stale: bool) -> None:
        self.store.delete_group(txn, gid, rec)
        del self.index[gid]
        for view in (self.deliverable, self.unjudged, self.leases):
            view.pop(gid, None)
        self.stale_seen.discard(gid)
        self.nbytes -= rec.nbytes
        self.evicted += 1
        self.evicted_stale += stale

    def _no_space(self) -> bool:
        try:
            st = os.statvfs(store_path(self.run_dir))
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < DISK_FULL_FREE_BYTES

    def _refuse_for_space(self, writes: list[Incoming]) -> list[tuple[Incoming, object]]:
        """Every write of the failed transaction answered ``disk_full`` (none was stored)."""
        self.disk_full = True
        self.counters["disk_full"] += len(writes)
        if self._due("disk_full"):
            log.error("no space left on the file system of %s: %d writes refused with "
                      "disk_full; free space there and the run goes on by itself",
                      store_path(self.run_dir), len(writes))
        return self._settle([(inc, Error("disk_full", DISK_FULL)) for inc in writes])

    def _log_store_full(self) -> None:
        if self._due("store_full"):
            log.error("LMDB map full at replay.map_size=%d bytes (%s): pushes are refused with "
                      "store_full until replay.map_size is grown and the server restarted",
                      self.cfg.map_size, store_path(self.run_dir))

    def _due(self, what: str, every_s: float = 10.0) -> bool:
        """Rate limit for warnings that would otherwise repeat on every burst."""
        now = time.monotonic()
        if now - self._last_logged.get(what, -every_s) < every_s:
            return False
        self._last_logged[what] = now
        return True

    # --- reads (after the commit) ----------------------------------------------------------

    def _on_judge_pull(self, _txn, inc: Incoming):
        pull: JudgePull = inc.msg
        now = time.monotonic()
        floor = self._stale_floor()
        picked = []
        for gid in self.unjudged:
            if len(picked) >= pull.max_groups:
                break
            # Stale groups will never be trained, delivered ones were trained without labels
            # (past the deadline): no judge time for either.
            rec = self.index[gid]
            if (self.leases.get(gid, 0.0) <= now and not rec.delivered
                    and not self._is_stale(rec, floor)):
                picked.append(gid)
        with self.store.env.begin() as txn:
            groups = [codec.decode_body(Group.TYPE, self.store.body(txn, g)) for g in picked]
        lease_s = pull.lease_s if pull.lease_s > 0 else self.cfg.judge_lease_s
        for gid in picked:
            self.leases[gid] = now + lease_s
        self.counters["leases_granted"] += len(picked)
        return JudgeWork(groups=groups)

    def _on_stats(self, _txn, _inc: Incoming):
        return Stats(values=self.stats())

    def _on_groups_since(self, _txn, inc: Incoming):
        """Stored groups from ingest seq ``since_seq`` on, oldest first, read-only: at most
        ``max_groups`` and about READ_REPLY_BYTES of bodies (always at least one group)."""
        ask: GroupsSince = inc.msg
        groups, malformed, nbytes = [], 0, 0
        next_seq, more = ask.since_seq, False
        with self.store.env.begin() as txn:
            for seq, group_id, body in self.store.iter_since(txn, ask.since_seq):
                if (len(groups) + malformed >= ask.max_groups
                        or (groups and nbytes + len(body) > READ_REPLY_BYTES)):
                    more = True
                    break
                next_seq = seq + 1
                try:
                    groups.append(codec.decode_body(Group.TYPE, bytes(body)))
                    nbytes += len(body)
                except SchemaError as exc:  # stored by an older schema: left out, counted
                    malformed += 1
                    log.warning("groups_since: stored group %s no longer decodes: %s",
                                group_id[:80], exc)
        self.counters["groups_read"] += len(groups)
        return StoredGroups(groups=groups, next_seq=next_seq, more=more, malformed=malformed)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        if now < self._next_lease_sweep:
            return
        self._next_lease_sweep = now + 1.0
        expired = [g for g, deadline in self.leases.items() if deadline <= now]
        for gid in expired:
            del self.leases[gid]
        self.counters["leases_expired"] += len(expired)

    def stats(self) -> dict:
        recs = self.index.values()
        versions = [v for r in recs if r.min_version >= 0 for v in (r.min_version, r.max_version)]
        values = {
            "groups": len(self.index), "bytes": self.nbytes,
            "judged": sum(r.judged for r in recs), "delivered": sum(r.delivered for r in recs),
            "consumed": sum(r.consumed and not r.set_aside for r in recs),
            "deliverable": len(self.deliverable),
            "unjudged": len(self.unjudged), "leased": len(self.leases),
            "batches_held": len(self.held),
            "evicted": self.evicted, "evicted_stale": self.evicted_stale,
            "set_aside": self.set_aside,
            "oldest_version": min(versions, default=None),
            "newest_version": max(versions, default=None),
            "learner_version": self.learner_version, "disk_full_now": int(self.disk_full),
            "received": self.rpc.counters.received, "replied": self.rpc.counters.replied,
        }
        values.update(self.counters)
        values.update({f"rejected/{r}": n for r, n in self.rpc.counters.rejected.items()})
        return values

    def close(self) -> None:
        if self._lock is not None:
            self.rpc.close()
            self.store.close()
            os.close(self._lock)  # only now may another server open the store
            self._lock = None
