"""``autodidact env serve SPEC``: an environment served to other processes, each instance in a
worker process of its own pool, so an env that hangs or crashes takes no actor down.

Processes::

    clients (RemoteEnv) ──DEALER──► broker: this command ──ipc──► worker 0 .. N-1
                         env wire   RouterServer at --address    each holds its sessions' envs

The broker binds the env socket and validates every frame there (a frame that does not decode
is refused with one log line, counted, and the broker goes on); it starts ``--workers``
processes (``python -m autodidact.env_serve worker``), routes each session's calls to the
worker that opened it, and answers for a worker that cannot:

* a worker that exits (or is killed for running past ``--call-timeout-s``): each call it held
  is answered ``EnvFailure(worker_died)`` with its last output lines, its sessions are lost
  (later calls on them get the same answer), and it is started again after a back-off that
  doubles from 0.5 s to 30 s while it keeps dying soon after a start;
* a worker reply that does not decode: ``EnvFailure(bad_reply)``;
* no worker up: hello and open wait up to ``--no-worker-wait-s``, then ``EnvFailure(no_worker)``.

Authority, as on the replay socket (docs/security.md): every frame carries a client token, one
of the ``<client>.token`` files of ``--tokens-dir`` (default ``~/.autodidact/env_tokens``,
``$AUTODIDACT_ENV_TOKENS``; ``client.token`` is made there at the first start, 0600), or comes
over CURVE (``--keys-dir``), where the client's key stands for it. Anything else is refused
``unauthorized``, one log line, counted; there is no open mode. The token (or key) names the
client, and the broker keeps, per session, the client that opened it:

* another client's call on it is answered ``EnvFailure(not_yours)``, logged and counted;
* a client holds ``--max-sessions-per-client`` sessions at most; past it, and when no worker
  has room (``--max-sessions`` each), a new session closes that client's own least recently
  used one, never another client's; a client with none to close is answered ``full``;
* an open's options are the server's (``--set env.options.NAME=VALUE``) plus those the client
  chose among ``Environment.client_options``, within their bounds; anything else is answered
  ``EnvFailure(options)`` naming the field.

Frames past ``--max-frame-bytes`` are refused ``oversize`` (the hello tells clients the limit,
and they split their batches to fit); the counters answer ``EnvStatsRequest``.

Broker and worker speak over an ipc socket in a private temporary directory: one msgpack
list ``[ticket, frame, ticket, frame, ...]`` a message both ways, each frame the same codec
frame a client sends (the worker's first message is ``[b"ready", b""]``). The replies to a
client's batch go back to it in one ``EnvAnswers`` once all are in (or those in after 5 ms,
while a slow call is still worked on).

With ``--openenv`` none of this runs: the env is served as an OpenEnv server instead
(``autodidact/openenv_serve.py``), for OpenEnv clients.
"""

from __future__ import annotations

import collections
import hmac
import inspect
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import msgpack
import zmq

from protocol import codec
from protocol import env_wire as wire
from protocol.errors import ConfigError, SchemaError
from protocol.security import CurveKeys, is_loopback_host
from protocol.transport import LINGER_MS, Incoming, RouterServer

log = logging.getLogger(__name__)

READY = b"ready"  # a worker's first ticket: it has imported its env and takes calls
TAIL_LINES = 20  # a worker's last output lines kept for the failures it causes
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0
STABLE_S = 30.0  # a worker that lived this long starts its next back-off from the minimum
POLL_MS = 100  # the broker's longest wait before it looks at its workers again
MAX_LOST = 100_000  # lost sessions remembered, to answer their late calls worker_died
# Worker replies whose body the broker reads (besides every open's): a failure to count.
ACTED_ON = frozenset({wire.EnvFailure.TYPE})
FLUSH_S = 0.005  # a worker, and the broker, hold a batch's replies back this long at most


# --- the broker ---------------------------------------------------------------------------------


@dataclass
class Pending:
    """A client's call held by a worker."""

    incoming: Incoming  # the client's frame, decoded (its route and msg_id answer it)
    opens: bool = False  # an EnvOpen: a reply other than EnvOpened unroutes its session


@dataclass
class HeldReplies:
    """The replies to one client batch the broker holds until the batch is answered whole."""

    route: list[bytes]  # the client's
    left: int  # requests of the batch not answered yet
    frames: list[bytes] = field(default_factory=list)  # answered, not sent yet
    since: float = 0.0  # when the oldest of ``frames`` came (monotonic); 0 when none


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen | None = None
    identity: bytes = b""
    ready: bool = False
    started_at: float = 0.0
    next_start: float = 0.0  # when a dead worker may start again
    backoff_s: float = BACKOFF_MIN_S
    restarts: int = 0
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    sessions: dict = field(default_factory=dict)  # session -> None: the envs it holds
    inflight: dict = field(default_factory=dict)  # ticket -> Pending, in the order sent
    busy_since: float | None = None  # when the call it is working on now reached it


@dataclass
class ServeSettings:
    spec: str  # the env: a registered name or pkg.module:name
    address: str  # the env socket clients connect to
    workers: int = 2  # worker processes
    max_sessions: int = 4096  # env instances one worker holds
    call_timeout_s: float = 300.0  # a worker busy with one call longer than this is killed
    no_worker_wait_s: float = 30.0  # how long hello and open wait for a worker to be up
    keys_dir: str = ""  # CURVE keys (server.key_secret, authorized/): encrypted, clients vetted
    # sessions one client (token or key) holds; past it its own least recently used closes
    max_sessions_per_client: int = 4096
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES  # a longer frame is refused oversize
    tokens_dir: str = ""  # the clients' <name>.token files; "" = env_wire.tokens_dir()
    options: dict = field(default_factory=dict)  # the env's options this server fixes


UNAUTHORIZED = ("this env server serves only clients whose frames carry one of its tokens "
                "(<tokens dir>/<client>.token: a client of its machine and user reads "
                "~/.autodidact/env_tokens/client.token by itself, or the file "
                "$AUTODIDACT_ENV_TOKEN_FILE names) or, served with --keys-dir, an authorized "
                "CURVE key; see docs/environments.md")


def load_tokens(folder: Path) -> tuple[dict[str, str], bool]:
    """The clients' tokens of ``folder`` (client name -> token), ``client.token`` made when
    it has none, and whether it was made now. ConfigError, failing closed, where another user
    could read or add one."""
    made = not any(folder.glob(f"*{wire.TOKEN_SUFFIX}"))
    if made:
        wire.make_token(folder / f"{wire.CLIENT}{wire.TOKEN_SUFFIX}")
    where = f"env tokens directory {folder}"
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(f"{where}: owned by another user or writable by others (anyone "
                          f"could add a client): chmod 700 it, or give --tokens-dir")
    tokens: dict[str, str] = {}
    for path in sorted(folder.glob(f"*{wire.TOKEN_SUFFIX}")):
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"{path}: owned by another user or readable by others: "
                              f"chmod 600 it")
        token = wire.read_token(path)
        if not 16 <= len(token) <= codec.MAX_CREDENTIAL_CHARS:
            raise ConfigError(f"{path}: a token is 16 to {codec.MAX_CREDENTIAL_CHARS} "
                              "characters; delete it and restart to make client.token anew")
        tokens[path.name[:-len(wire.TOKEN_SUFFIX)]] = token
    return tokens, made


def client_options(cls, fixed: dict, chosen: dict) -> tuple[dict | None, str]:
    """The options an env of ``cls`` is made with (the server's ``fixed``, then those of a
    client's ``chosen`` that ``cls.client_options`` allows), or None and the one line saying
    which field was refused and what to do."""
    merged = dict(fixed)
    declared = getattr(cls, "client_options", {}) or {}
    for name, value in chosen.items():
        if name in fixed:
            if value == fixed[name] and type(value) is type(fixed[name]):
                continue
            return None, (f"env.options.{name}: this server fixes it to {fixed[name]!r}; leave "
                          f"it out of env.options (or serve with --set env.options.{name}=...)")
        allowed = declared.get(name)
        if allowed is None:
            mine = ", ".join(f"{k} ({wire.describe_allowed(v)})" for k, v in declared.items())
            return None, (f"env.options.{name}: not an option a client of this {cls.name} "
                          f"server may set (it may set: {mine or 'none'}); leave it out, or "
                          f"start the server with --set env.options.{name}=VALUE")
        if not wire.allows(allowed, value):
            return None, (f"env.options.{name}={value!r}: {cls.name} lets a client choose "
                          f"{wire.describe_allowed(allowed)}; choose one of those, or start the "
                          f"server with --set env.options.{name}=VALUE")
        merged[name] = value
    return merged, ""


class EnvBroker:
    """The env socket, the worker pool and the routing between them."""

    def __init__(self, settings: ServeSettings):
        from environments import env_class

        self.settings = settings
        self.cls = env_class(settings.spec)  # its client_options: what a client may choose
        # Who may call: with CURVE keys the client's key, else one of the tokens.
        curve = CurveKeys.load(settings.keys_dir) if settings.keys_dir else None
        self.tokens_dir = Path(settings.tokens_dir).expanduser() if settings.tokens_dir \
            else wire.tokens_dir()
        self.tokens, self.token_made = ({}, False) if curve else load_tokens(self.tokens_dir)
        self.clients = len(curve.authorized) if curve else len(self.tokens)
        self.ctx = zmq.Context()
        # A CURVE server gets a context of its own (its ZAP handler is per context).
        self.front = RouterServer(settings.address, settings.max_frame_bytes,
                                  context=None if curve else self.ctx, curve=curve)
        self.dir = Path(tempfile.mkdtemp(prefix="autodidact-env-"))
        self.back_address = f"ipc://{self.dir}/workers.sock"
        self.back = self.ctx.socket(zmq.ROUTER)
        self.back.setsockopt(zmq.LINGER, LINGER_MS)
        self.back.bind(self.back_address)
        self.poller = zmq.Poller()
        self.poller.register(self.front.socket, zmq.POLLIN)
        self.poller.register(self.back, zmq.POLLIN)
        self.workers = [Worker(i) for i in range(settings.workers)]
        self.route: dict[str, Worker] = {}  # session -> the worker holding it
        self.owner: dict[str, str] = {}  # session (routed or opening) -> the client of it
        # client -> its sessions on workers, least recently used first (its eviction order)
        self.owned: dict[str, collections.OrderedDict] = collections.defaultdict(
            collections.OrderedDict)
        self.evicted = 0  # sessions closed to make room for their client's newer ones
        # session -> (failure detail, worker tail, client)
        self.lost: collections.OrderedDict = collections.OrderedDict()
        # (since, Incoming, client) waiting for a worker
        self.waiting: collections.deque = collections.deque()
        self.opening: set[str] = set()  # sessions whose EnvOpen is among the waiting
        self.failures: collections.Counter = collections.Counter()  # reason -> calls failed
        self.last_tail: list[str] = []  # the last output of the worker that died last
        self._tickets = 0
        # worker identity -> [ticket, frame, ...] while a batch is read
        self._outbox: dict | None = None
        # (client route, batch msg_id) -> the replies of a batch held until it is answered
        # whole: a client waits for all of them, so one message wakes it, not one per worker
        self.held: dict[tuple, HeldReplies] = {}

    # -- the loop --

    def serve(self, stop: threading.Event) -> None:
        for worker in self.workers:
            self._start(worker)
        while not stop.is_set():
            events = dict(self.poller.poll(self._poll_ms()))
            if self.front.socket in events:
                for incoming in self.front.poll(0):
                    self._from_client(incoming)
            if self.back in events:
                self._from_workers()
            self._watch()
            self._flush_held()

    def close(self) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                worker.proc.terminate()
        for worker in self.workers:
            if worker.proc is not None:
                try:
                    worker.proc.wait(5)
                except subprocess.TimeoutExpired:
                    worker.proc.kill()
                    worker.proc.wait()
        self.front.close()
        self.back.close(LINGER_MS)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- clients --

    def _from_client(self, incoming: Incoming) -> None:
        if incoming.error is not None:
            self.front.reject(incoming, incoming.error)
            return
        client = self._client(incoming)
        if client is None:
            self.front.reject(incoming, SchemaError("unauthorized", UNAUTHORIZED))
            return
        msg = incoming.msg
        if type(msg) not in wire.REQUESTS:
            self.front.reject(incoming, SchemaError(
                "unexpected_type", f"{type(msg).__name__} is not an env request (this is an "
                "env socket: protocol/env_wire.py)"))
            return
        if isinstance(msg, wire.EnvBatch):
            self._from_batch(incoming, client)
        else:
            self._route(incoming, client)

    def _client(self, incoming: Incoming) -> str | None:
        """The client a frame comes from: its CURVE key's, or the name of the token its
        envelope carries; None for none (refused)."""
        if incoming.peer_key:  # on a CURVE socket only, set by the ZAP handler
            return f"key:{incoming.peer_key.decode()}"
        given = incoming.credential.encode()
        found = None
        for name, token in self.tokens.items():  # every one compared: no timing of a match
            if hmac.compare_digest(given, token.encode()) and found is None:
                found = name
        return found

    def stats(self, client: str = "") -> wire.EnvStats:
        return wire.EnvStats(dict(self.front.counters.rejected), dict(self.failures),
                             len(self.route), len(self.owned.get(client, ())), self.evicted,
                             self.clients)

    def _route(self, incoming: Incoming, client: str) -> None:
        if isinstance(incoming.msg, wire.EnvStatsRequest):  # the broker's own: answered now
            self._reply(incoming, self.stats(client))
        elif isinstance(incoming.msg, (wire.EnvHello, wire.EnvOpen)):
            self._to_any_worker(incoming, client)
        else:
            self._to_session(incoming, client)

    def _from_batch(self, batch: Incoming, client: str) -> None:
        """Each request of a batch as if it had come alone, those for one worker sent to it in
        one message. A request that does not decode refuses the batch whole, none sent."""
        inner = [self.front.incoming(batch, frame) for frame in batch.msg.frames]
        for i, request in enumerate(inner):
            error = request.error or (None if type(request.msg) in wire.BATCHED else SchemaError(
                "unexpected_type", f"{type(request.msg).__name__} cannot be batched"))
            if error is not None:
                self.front.reject(batch, SchemaError(error.reason, f"request {i} of the batch: "
                                                     f"{error}"))
                return
        self._outbox = collections.defaultdict(list)
        try:
            self.held[tuple(batch.route), batch.msg_id] = HeldReplies(batch.route, len(inner))
            for request in inner:  # the batch's client is theirs
                self._route(request, client)
        finally:
            outbox, self._outbox = self._outbox, None
            for identity, parts in outbox.items():
                self.back.send_multipart([identity, _packed(parts)])

    def _to_any_worker(self, incoming: Incoming, client: str) -> None:
        msg = incoming.msg
        if msg.version != wire.ENV_WIRE_VERSION:
            self._fail(incoming, "version", f"this server speaks env wire "
                       f"v{wire.ENV_WIRE_VERSION}, the client v{msg.version}")
            return
        opens = isinstance(msg, wire.EnvOpen)
        session = msg.session if opens else ""
        if opens and (session in self.route or session in self.opening):
            self._fail(incoming, "session_taken", f"session {session[:64]} is open already: "
                       "a new env names a new one")
            return
        if opens:  # the worker makes the env with the server's options and the client's own
            options, refused = client_options(self.cls, self.settings.options, msg.options)
            if options is None:
                log.warning("refused an open of client %s: %s", client[:16], refused)
                self._fail(incoming, "options", refused)
                return
            incoming.body = codec.encode_body(wire.EnvOpen(msg.version, session, options))
        ready = [w for w in self.workers if w.ready]
        if not ready:
            self.waiting.append((time.monotonic(), incoming, client))
            if opens:  # its session's calls wait behind it
                self.opening.add(session)
                self.owner[session] = client
            return
        worker = self._place(session, client, ready) if opens else \
            min(ready, key=lambda w: (len(w.inflight), len(w.sessions)))
        if worker is None:
            self.owner.pop(session, None)
            log.warning("refused an open of client %s: every worker holds --max-sessions %d "
                        "and the client has none to close", client[:16],
                        self.settings.max_sessions)
            self._fail(incoming, "full", f"every env worker holds its "
                       f"{self.settings.max_sessions} sessions (--max-sessions) and none is "
                       "this client's to close: close sessions, or serve more workers")
            return
        if opens:  # routed from now on: the calls after it in its batch follow it there
            worker.sessions[session] = None
            self.route[session] = worker
            self.owner[session] = client
            self.owned[client][session] = None
        self._send(worker, incoming, opens)

    def _place(self, session: str, client: str, ready: list[Worker]) -> Worker | None:
        """The worker a new session of ``client`` goes to, after closing that client's own
        least recently used sessions where it holds its quota or no worker has room; None
        when no worker has room and the client holds none to close (the others' stay)."""
        mine = self.owned[client]
        while mine and len(mine) >= self.settings.max_sessions_per_client:
            self._evict(next(iter(mine)), "--max-sessions-per-client "
                        f"{self.settings.max_sessions_per_client}")
        room = [w for w in ready if len(w.sessions) < self.settings.max_sessions]
        if room:  # an idle worker first (one stuck in a call would hold the new session
            # behind it), then the one with the fewest sessions
            return min(room, key=lambda w: (len(w.inflight), len(w.sessions)))
        oldest = next((s for s in mine if self.route[s].ready), None)
        if oldest is None:
            return None
        worker = self.route[oldest]
        self._evict(oldest, f"--max-sessions {self.settings.max_sessions} on every worker")
        return worker

    def _to_session(self, incoming: Incoming, client: str) -> None:
        session = incoming.msg.session
        owner = self.owner.get(session) or self.lost.get(session, (None, None, None))[2]
        if owner is not None and owner != client:
            method = wire.SESSION_REQUESTS[type(incoming.msg)]
            log.warning("refused %s of client %s: session %s is another client's", method,
                        client[:16], session[:64])
            self._fail(incoming, "not_yours", f"session {session[:64]} was opened by another "
                       "client of this server: a client calls only the sessions it opened")
            return
        worker = self.route.get(session)
        if worker is not None:
            if isinstance(incoming.msg, wire.EnvClose):  # gone now: its room is free
                self._forget(session)
            else:
                self.owned[client].move_to_end(session)
            self._send(worker, incoming)
        elif session in self.opening:  # its open waits for a worker: so does it
            self.waiting.append((time.monotonic(), incoming, client))
        elif isinstance(incoming.msg, wire.EnvClose):  # gone already: nothing left to close
            self.lost.pop(session, None)
            self._reply(incoming, wire.EnvValue(None))
        elif session in self.lost:
            detail, tail, _ = self.lost[session]
            self._fail(incoming, "worker_died", detail, tail)
        else:
            self._fail(incoming, "no_session", f"no session {session[:64]} here: never "
                       "opened, closed, evicted, or opened before this server started; "
                       "make a new env")

    def _fail(self, incoming: Incoming, reason: str, detail: str, tail=()) -> None:
        self.failures[reason] += 1
        self._reply(incoming, wire.EnvFailure(reason, detail, list(tail)))

    def _reply(self, incoming: Incoming, msg) -> None:
        self._reply_frame(incoming, codec.encode(msg, incoming.msg_id))

    def _reply_frame(self, incoming: Incoming, frame: bytes) -> None:
        held = self.held.get((tuple(incoming.route), incoming.within)) \
            if incoming.within else None
        if held is None:  # a request that came alone
            self.front.reply_frame(incoming, frame)
            return
        held.frames.append(frame)
        held.since = held.since or time.monotonic()
        held.left -= 1
        if held.left <= 0:
            del self.held[tuple(incoming.route), incoming.within]
            self._answers(held.route, incoming.within, held.frames)

    def _flush_held(self) -> None:
        """Send the replies a batch has held for FLUSH_S while others are still worked on:
        a slow call does not hold back its batch's answered ones (the client's deadline runs
        from its last answer)."""
        now = time.monotonic()
        for (_, batch_id), held in self.held.items():
            if held.frames and now - held.since >= FLUSH_S:
                self._answers(held.route, batch_id, held.frames)
                held.frames, held.since = [], 0.0

    def _poll_ms(self) -> int:
        """How long the loop may wait for a frame: until the next held replies are due."""
        due = [held.since + FLUSH_S for held in self.held.values() if held.frames]
        if not due:
            return POLL_MS
        return max(0, min(POLL_MS, math.ceil(1000 * (min(due) - time.monotonic()))))

    def _answers(self, route: list[bytes], batch_id: str, frames: list[bytes]) -> None:
        for start in range(0, len(frames), wire.MAX_BATCH_CALLS):
            self.front.reply_frame(Incoming(route, batch_id), codec.encode(
                wire.EnvAnswers(frames[start:start + wire.MAX_BATCH_CALLS]), batch_id))

    # -- workers --

    def _send(self, worker: Worker, incoming: Incoming, opens: bool = False) -> None:
        self._tickets += 1
        ticket = self._tickets.to_bytes(8, "big")
        if not worker.inflight:
            worker.busy_since = time.monotonic()
        worker.inflight[ticket] = Pending(incoming, opens)
        # The client's body as it came (validated on receipt), under the broker's envelope.
        frame = codec.pack_frame(incoming.msg.TYPE, incoming.msg_id, incoming.body)
        if self._outbox is not None:  # a batch's: sent with the rest of its worker's share
            self._outbox[worker.identity] += [ticket, frame]
        else:
            self.back.send_multipart([worker.identity, _packed([ticket, frame])])

    def _forget(self, session: str) -> tuple[Worker | None, str | None]:
        """Unroute ``session``: (the worker that held it, its client)."""
        worker, client = self.route.pop(session, None), self.owner.pop(session, None)
        if worker is not None:
            worker.sessions.pop(session, None)
        if client is not None:
            self.owned[client].pop(session, None)
            if not self.owned[client]:
                del self.owned[client]
        return worker, client

    def _evict(self, session: str, why: str) -> None:
        """Close ``session``, its client's least recently used, to make room for that
        client's new one (no client waits for the close)."""
        worker, client = self._forget(session)
        self.evicted += 1
        log.info("client %s: closing its least recently used session %s (%s)",
                 (client or "")[:16], session, why)
        self._tickets += 1
        frame = codec.encode(wire.EnvClose(session), "")
        self.back.send_multipart([worker.identity,
                                  _packed([self._tickets.to_bytes(8, "big"), frame])])

    def _from_workers(self) -> None:
        while True:
            try:
                identity, *payload = self.back.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            worker = next((w for w in self.workers if w.identity == identity), None)
            pairs = _unpacked(payload)
            if worker is None or pairs is None:  # not one of our workers' [ticket, frame]s
                continue
            for ticket, frame in zip(pairs[0::2], pairs[1::2]):
                if ticket == READY:
                    self._ready(worker)
                else:
                    self._answer(worker, worker.inflight.pop(ticket, None), frame)

    def _ready(self, worker: Worker) -> None:
        worker.ready = True
        log.info("env worker %d up (pid %d)", worker.index, worker.proc.pid)
        waiting, self.waiting = self.waiting, collections.deque()
        self.opening.clear()
        for _, incoming, client in waiting:  # in order: an open before its session's calls
            self._route(incoming, client)

    def _answer(self, worker: Worker, pending: Pending | None, frame: bytes) -> None:
        worker.busy_since = time.monotonic() if worker.inflight else None
        if pending is None:  # the reply to an eviction's close
            return
        # A worker checks that its reply decodes before sending it (EnvWorker.reply_frame), so
        # the broker reads only the envelope, and the body of the few replies it acts on.
        try:
            envelope = codec.unpack_envelope(frame)
            reply = codec.decode_body(envelope.type_tag, envelope.body) \
                if pending.opens or envelope.type_tag in ACTED_ON else None
        except SchemaError as exc:
            log.warning("env worker %d answered %s with a frame that does not decode (%s)",
                        worker.index, type(pending.incoming.msg).__name__, exc)
            self._fail(pending.incoming, "bad_reply", f"env worker {worker.index} answered "
                       f"with a frame that does not decode ({exc})", worker.tail)
            return
        if (pending.opens and not isinstance(reply, wire.EnvOpened)) \
                or isinstance(pending.incoming.msg, wire.EnvClose):  # no session (any more)
            if self.route.get(pending.incoming.msg.session) is worker:
                self._forget(pending.incoming.msg.session)
        if isinstance(reply, wire.EnvFailure):
            self.failures[reply.reason] += 1
            reply.stderr = list(worker.tail)
            log.warning("env worker %d failed %s: %s: %s", worker.index,
                        type(pending.incoming.msg).__name__, reply.reason, reply.detail)
            self._reply(pending.incoming, reply)
        else:
            self._reply_frame(pending.incoming, frame)

    def _watch(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is not None:
                self._died(worker, f"exited with code {worker.proc.returncode}")
            elif worker.busy_since is not None \
                    and now - worker.busy_since > self.settings.call_timeout_s:
                worker.proc.kill()
                worker.proc.wait()
                self._died(worker, f"was killed: one call ran past --call-timeout-s "
                           f"{self.settings.call_timeout_s:g} s")
            if worker.proc is None and now >= worker.next_start:
                self._start(worker)
        while self.waiting and now - self.waiting[0][0] > self.settings.no_worker_wait_s:
            _, incoming, _ = self.waiting.popleft()
            if isinstance(incoming.msg, wire.EnvOpen):
                self.opening.discard(incoming.msg.session)
                self.owner.pop(incoming.msg.session, None)
            self._fail(incoming, "no_worker", f"no env worker came up within "
                       f"{self.settings.no_worker_wait_s:g} s; see the server's log",
                       self.last_tail)

    def _died(self, worker: Worker, why: str) -> None:
        if worker.reader is not None:
            worker.reader.join(1.0)  # its last lines, written just before it went
        tail = self.last_tail = list(worker.tail)
        lived = time.monotonic() - worker.started_at
        worker.backoff_s = BACKOFF_MIN_S if lived > STABLE_S else min(
            BACKOFF_MAX_S, worker.backoff_s * 2 if worker.restarts else BACKOFF_MIN_S)
        detail = f"env worker {worker.index} (pid {worker.proc.pid}) {why}"
        log.warning("%s; %d calls and %d sessions lost; restarting it in %.1f s; last "
                    "output: %s", detail, len(worker.inflight), len(worker.sessions),
                    worker.backoff_s, " | ".join(tail[-3:]) or "none")
        for pending in worker.inflight.values():
            self._fail(pending.incoming, "worker_died", f"{detail} during this call", tail)
        for session in list(worker.sessions):
            _, client = self._forget(session)
            self.lost[session] = (f"{detail}; this session's env was in it", tail, client)
        while len(self.lost) > MAX_LOST:
            self.lost.popitem(last=False)
        worker.sessions.clear()
        worker.inflight.clear()
        worker.proc, worker.ready, worker.busy_since = None, False, None
        worker.next_start = time.monotonic() + worker.backoff_s
        worker.restarts += 1

    def _start(self, worker: Worker) -> None:
        from autodidact.supervisor import parent_death_preexec

        worker.identity = f"w{worker.index}.{worker.restarts}".encode()
        worker.tail = collections.deque(maxlen=TAIL_LINES)
        worker.proc = subprocess.Popen(
            [sys.executable, "-m", "autodidact.env_serve", "worker", self.settings.spec,
             self.back_address, worker.identity.decode(), str(self.settings.max_frame_bytes),
             json.dumps(self.settings.options)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=parent_death_preexec())
        worker.started_at = time.monotonic()
        worker.reader = threading.Thread(target=_echo, args=(worker.proc.stdout, worker.tail,
                                                             worker.index), daemon=True)
        worker.reader.start()


def _echo(stream, tail: collections.deque, index: int) -> None:
    """A worker's output: into ``tail`` (the failures quote it) and onto this process's
    stderr, each line marked with the worker."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        tail.append(line)
        print(f"[env worker {index}] {line}", file=sys.stderr, flush=True)
    stream.close()


# --- a worker -----------------------------------------------------------------------------------


class EnvWorker:
    """The env instances of the sessions the broker routes here, one call at a time."""

    def __init__(self, spec: str, identity: str,
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES, options: dict | None = None):
        from environments import env_class

        self.cls = env_class(spec)
        self.identity = identity  # EnvOpened names it: where a session lives
        self.max_frame_bytes = max_frame_bytes  # the broker's, which the hello tells clients
        self.options = options or {}  # the server's: an env's train_worlds may follow them
        self.sessions: dict = {}

    def reply_frame(self, frame: bytes) -> bytes:
        """The frame answering ``frame``: one that decodes, checked here (in parallel over the
        workers) so that the broker can pass it on unread."""
        env, msg = codec.decode(frame)  # the broker validated it: this cannot fail
        reply = self.answer(msg)
        try:
            out = codec.encode(reply, env.msg_id)
            codec.decode(out)
            return out
        except Exception as exc:  # the env returned what the wire cannot carry
            method = wire.SESSION_REQUESTS.get(type(msg), type(msg).__name__)
            return codec.encode(wire.EnvFailure(
                "bad_reply", f"{self.cls.name}.{method}() returned a value the env wire "
                f"cannot carry, its reply does not decode ({type(exc).__name__}: {exc}); "
                "env values must be JSON-like"), env.msg_id)

    def answer(self, msg):
        from environments.remote import answer, raised_to_wire, served_facts

        if isinstance(msg, wire.EnvHello):
            try:  # an instance's, as a session's: files declares them in __init__
                worlds = self.cls(**self.options).train_worlds
            except Exception as exc:  # options the constructor refuses
                return raised_to_wire(exc)
            return served_facts(self.cls, self.max_frame_bytes, worlds)
        if isinstance(msg, wire.EnvOpen):  # its options: the broker's (client_options)
            try:
                self.sessions[msg.session] = self.cls(**msg.options)
            except Exception as exc:  # options the constructor refuses
                return raised_to_wire(exc)
            return wire.EnvOpened(msg.session, self.identity)
        if isinstance(msg, wire.EnvClose):
            self.sessions.pop(msg.session, None)
            return wire.EnvValue(None)
        env = self.sessions.get(msg.session)
        if env is None:
            return wire.EnvFailure("no_session", f"no session {msg.session} on this worker")
        return answer(env, msg)


def run_worker(spec: str, address: str, identity: str, max_frame_bytes: str = "",
               options: str = "") -> None:
    """A worker's process: connect to the broker, say ready, answer until told to stop."""
    # SIGTERM (the broker stopping, or its death: the parent-death signal) ends the worker
    # even inside an env call that would not return for long; an env holds nothing durable.
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the broker, which stops us
    worker = EnvWorker(spec, identity, int(max_frame_bytes or wire.DEFAULT_MAX_FRAME_BYTES),
                       json.loads(options or "{}"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(address)
    sock.send(_packed([READY, b""]))
    try:
        while True:
            # [ticket, frame] pairs, several from a batch: their replies go back together,
            # or as they come once an env call takes longer (the broker's deadline and the
            # client's see progress).
            parts = _unpacked([sock.recv()]) or []
            replies, flushed = [], time.monotonic()
            for ticket, frame in zip(parts[0::2], parts[1::2]):
                replies += [ticket, worker.reply_frame(frame)]
                if time.monotonic() - flushed > FLUSH_S:
                    sock.send(_packed(replies))
                    replies, flushed = [], time.monotonic()
            if replies:
                sock.send(_packed(replies))
    finally:
        sock.close(0)
        ctx.term()


def _packed(pairs: list[bytes]) -> bytes:
    """``[ticket, frame, ticket, frame, ...]`` as the one frame a broker-worker message is
    (one ZeroMQ part, not two per call: parts cost a copy and a call each)."""
    return msgpack.packb(pairs)


def _unpacked(payload: list[bytes]) -> list[bytes] | None:
    """The pairs of a broker-worker message; None for anything else."""
    try:
        pairs = msgpack.unpackb(payload[0]) if len(payload) == 1 else None
    except Exception:  # msgpack raises several unrelated types
        return None
    ok = isinstance(pairs, list) and len(pairs) % 2 == 0 \
        and all(isinstance(p, bytes) for p in pairs)
    return pairs if ok else None


def _exit_now(*_):
    raise SystemExit(0)


# --- a server as a child process ---------------------------------------------------------------


class EnvServerProcess:
    """``autodidact env serve SPEC`` started by this process (a bench, a test), in a process
    group of its own so that stopping it takes its workers too, and dying with its parent.

    ``address`` defaults to a free loopback TCP port; its output goes to ``log`` (appended)
    or nowhere; ``pythonpath`` is put before the inherited one (where a plugin env lives)."""

    def __init__(self, spec: str, *options: str, workers: int = 2, address: str = "",
                 log: Path | None = None, pythonpath: str = ""):
        from protocol.transport import free_tcp_port

        self.address = address or f"tcp://127.0.0.1:{free_tcp_port()}"
        self.log = log
        self.argv = [sys.executable, "-m", "autodidact.cli", "env", "serve", spec,
                     "--address", self.address, "--workers", str(workers), *options]
        self.pythonpath = pythonpath
        self.proc: subprocess.Popen | None = None

    def start(self) -> EnvServerProcess:
        from autodidact.supervisor import parent_death_preexec

        root = str(Path(__file__).resolve().parents[1])
        paths = [p for p in (self.pythonpath, root, os.environ.get("PYTHONPATH", "")) if p]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.argv, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=parent_death_preexec(),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
        finally:
            if self.log:
                out.close()
        return self

    def stop(self) -> None:
        """SIGTERM to the group (the broker stops its workers), SIGKILL to what is left."""
        from autodidact.supervisor import stop_process_group

        if self.proc is not None:
            stop_process_group(self.proc, grace_s=10.0, kill_wait_s=5.0)

    def text(self) -> str:
        """What the server has printed so far (its log)."""
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def __enter__(self) -> EnvServerProcess:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()


# --- the command --------------------------------------------------------------------------------


@click.group("env")
def env() -> None:
    """Serve an environment to other processes (docs/environments.md)."""


@env.command("serve")
@click.argument("spec")
@click.option("--address", required=True,
              help="ZeroMQ address to bind, e.g. tcp://127.0.0.1:5560 or ipc:///tmp/env.sock; "
                   "runs name it as env.address. With --openenv: http://HOST:PORT.")
@click.option("--workers", type=click.IntRange(1, 1024), default=2, show_default=True,
              help="Worker processes; each holds the env instances of its sessions.")
@click.option("--max-sessions", type=click.IntRange(1), default=4096, show_default=True,
              help="Env instances one worker holds; past it on every worker, a client's new "
                   "session closes its own least recently used (never another client's).")
@click.option("--max-sessions-per-client", type=click.IntRange(1), default=4096,
              show_default=True,
              help="Sessions one client (token or CURVE key) holds; past it its own least "
                   "recently used closes.")
@click.option("--max-frame-bytes", type=click.IntRange(64 * 1024, 256 * 1024 * 1024),
              default=wire.DEFAULT_MAX_FRAME_BYTES, show_default=True,
              help="A longer frame is refused (oversize); clients split their batches to fit.")
@click.option("--tokens-dir", default="", type=click.Path(file_okay=False),
              help="The clients' <name>.token files (client.token made when there is none); "
                   "default $AUTODIDACT_ENV_TOKENS or ~/.autodidact/env_tokens, where this "
                   "machine's clients look. Not used with --keys-dir.")
@click.option("--set", "sets", multiple=True, metavar="env.options.NAME=VALUE",
              help="An option of the env's constructor, fixed for every session (a client "
                   "chooses only those the env declares in client_options). Repeatable.")
@click.option("--call-timeout-s", type=click.FloatRange(min=0.1), default=300.0,
              show_default=True, help="A worker busy with one call longer than this is "
                                      "killed and restarted (its sessions are lost).")
@click.option("--no-worker-wait-s", type=click.FloatRange(min=0.0), default=30.0,
              show_default=True, help="How long a new session waits while no worker is up.")
@click.option("--keys-dir", default="", type=click.Path(file_okay=False),
              help="CURVE keys from `autodidact keys generate` (with server.key_secret): the "
                   "link is encrypted and only clients in its authorized/ are served; runs "
                   "name the same directory as env.keys_dir.")
@click.option("--allow-plaintext-remote", is_flag=True,
              help="Bind an address off this machine without --keys-dir.")
@click.option("--openenv", is_flag=True,
              help="Serve it as an OpenEnv server (openenv-core, the [openenv] extra) at "
                   "--address http://HOST:PORT, for OpenEnv clients; --max-sessions bounds "
                   "its WebSocket sessions. No workers, no keys: one process, plain HTTP.")
def serve(spec, address, workers, max_sessions, max_sessions_per_client, max_frame_bytes,
          tokens_dir, sets, call_timeout_s, no_worker_wait_s, keys_dir, allow_plaintext_remote,
          openenv):
    """Serve the env SPEC (a registered name such as `files`, or `pkg.module:name`) at
    --address until SIGTERM or Ctrl-C."""
    from protocol.security import leaves_loopback

    if openenv:
        given = click.get_current_context().get_parameter_source
        for name in ("workers", "call_timeout_s", "no_worker_wait_s",
                     "max_sessions_per_client", "max_frame_bytes", "tokens_dir", "sets"):
            if given(name) is not click.core.ParameterSource.DEFAULT:
                flag = "set" if name == "sets" else name.replace("_", "-")
                raise click.UsageError(f"--{flag} does not apply to "
                                       "--openenv (one process, no workers)")
        _serve_openenv(spec, address, max_sessions, keys_dir, allow_plaintext_remote)
        return
    if leaves_loopback(address) and not keys_dir and not allow_plaintext_remote:
        raise click.UsageError(f"{address} leaves this machine: give --keys-dir (keys from "
                               "`autodidact keys generate`) or --allow-plaintext-remote")
    from environments import env_class

    try:
        cls = env_class(spec)  # fail here, not in N workers, on a name that is wrong
    except (KeyError, ImportError) as exc:
        raise click.UsageError(f"{spec}: {exc}") from None
    options = fixed_options(cls, sets)
    try:
        broker = EnvBroker(ServeSettings(
            spec, address, workers, max_sessions, call_timeout_s, no_worker_wait_s, keys_dir,
            max_sessions_per_client, max_frame_bytes, tokens_dir, options))
    except ConfigError as exc:  # keys that cannot serve, tokens others could read
        raise click.UsageError(f"--{'keys' if keys_dir else 'tokens'}-dir: {exc}") from None
    except zmq.ZMQError as exc:  # the address is taken, or not one this machine has
        raise click.UsageError(f"--address {address}: cannot bind ({exc})") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if keys_dir:
        who = f"clients by CURVE key ({broker.clients} authorized)"
    else:
        who = (f"clients by token: {', '.join(sorted(broker.tokens))} in {broker.tokens_dir}"
               + (" (client.token made now)" if broker.token_made else ""))
    click.echo(f"env serve: {cls.name} at {broker.front.bound_address}, {workers} workers "
               f"(env wire v{wire.ENV_WIRE_VERSION}, {'CURVE' if keys_dir else 'plaintext'}; "
               f"{who}; options {options or 'the defaults'}; a client may set "
               f"{', '.join(cls.client_options) or 'none'}; frames up to {max_frame_bytes} "
               "bytes)", err=True)
    try:
        broker.serve(stop)
    finally:
        rejected = dict(broker.front.counters.rejected)
        broker.close()
        click.echo(f"env serve: stopped; frames refused {rejected or 'none'}, calls failed "
                   f"{dict(broker.failures) or 'none'}, sessions evicted {broker.evicted}",
                   err=True)


def fixed_options(cls, sets) -> dict:
    """``--set env.options.NAME=VALUE`` as options of ``cls``'s constructor (values read as
    YAML, as a run's --set reads them); a usage error for anything else."""
    import yaml

    options = {}
    for item in sets:
        key, sep, value = item.partition("=")
        name = key.strip().removeprefix("env.options.")
        if not sep or name == key.strip() or not name or "." in name:
            raise click.UsageError(f"--set {item}: an env serve --set is "
                                   "env.options.NAME=VALUE")
        try:
            options[name] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise click.UsageError(f"--set {item}: the value is not valid YAML") from None
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        raise click.UsageError(f"--set: {cls.name} takes no such options ({exc})") from None
    return options


def _serve_openenv(spec: str, address: str, max_sessions: int, keys_dir: str,
                   allow_plaintext_remote: bool) -> None:
    """``env serve --openenv``: SPEC as an OpenEnv server (autodidact/openenv_serve.py)."""
    from autodidact import openenv_serve

    try:
        host, port = openenv_serve.parse_http_address(address)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if keys_dir:  # OpenEnv clients speak plain HTTP and WebSocket: no CURVE there
        raise click.UsageError("--keys-dir does not apply to --openenv (plain HTTP); keep "
                               "the server on loopback or behind a TLS proxy")
    if not is_loopback_host(host) and not allow_plaintext_remote:
        raise click.UsageError(f"{address} leaves this machine unencrypted: bind 127.0.0.1 "
                               "or give --allow-plaintext-remote")
    try:
        import openenv.core.env_server  # noqa: F401  (the extra; fail before binding)
    except ImportError:
        raise click.UsageError("--openenv needs openenv-core: pip install -e '.[openenv]' "
                               "(scripts/setup.sh installs it)") from None
    from environments import env_class

    try:
        cls = env_class(spec)
    except (KeyError, ImportError) as exc:
        raise click.UsageError(f"{spec}: {exc}") from None
    try:
        sock = openenv_serve.bind(host, port)
    except OSError as exc:
        raise click.UsageError(f"--address {address}: cannot bind ({exc})") from None
    click.echo(f"env serve: {cls.name} at {address} as an OpenEnv server (WebSocket /ws, "
               f"{max_sessions} sessions at most)", err=True)
    openenv_serve.serve_openenv(cls, sock, max_sessions)
    click.echo("env serve: stopped", err=True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    run_worker(*sys.argv[2:7])
