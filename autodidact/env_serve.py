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
from protocol.errors import SchemaError
from protocol.security import CurveKeys
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
    # session -> None, least recently used first (the eviction order)
    sessions: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    inflight: dict = field(default_factory=dict)  # ticket -> Pending, in the order sent
    busy_since: float | None = None  # when the call it is working on now reached it


@dataclass
class ServeSettings:
    spec: str  # the env: a registered name or pkg.module:name
    address: str  # the env socket clients connect to
    workers: int = 2  # worker processes
    max_sessions: int = 4096  # env instances one worker holds; the least recently used goes
    call_timeout_s: float = 300.0  # a worker busy with one call longer than this is killed
    no_worker_wait_s: float = 30.0  # how long hello and open wait for a worker to be up
    keys_dir: str = ""  # CURVE keys (server.key_secret, authorized/): encrypted, clients vetted


class EnvBroker:
    """The env socket, the worker pool and the routing between them."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.ctx = zmq.Context()
        # A CURVE server gets a context of its own (its ZAP handler is per context).
        curve = CurveKeys.load(settings.keys_dir) if settings.keys_dir else None
        self.front = RouterServer(settings.address, context=None if curve else self.ctx,
                                  curve=curve)
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
        self.lost: collections.OrderedDict = collections.OrderedDict()  # session -> failure
        self.waiting: collections.deque = collections.deque()  # (since, Incoming) for a worker
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
        msg = incoming.msg
        if type(msg) not in wire.REQUESTS:
            self.front.reject(incoming, SchemaError(
                "unexpected_type", f"{type(msg).__name__} is not an env request (this is an "
                "env socket: protocol/env_wire.py)"))
            return
        if isinstance(msg, wire.EnvBatch):
            self._from_batch(incoming)
        else:
            self._route(incoming)

    def _route(self, incoming: Incoming) -> None:
        if isinstance(incoming.msg, (wire.EnvHello, wire.EnvOpen)):
            self._to_any_worker(incoming)
        else:
            self._to_session(incoming)

    def _from_batch(self, batch: Incoming) -> None:
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
            for request in inner:
                self._from_client(request)
        finally:
            outbox, self._outbox = self._outbox, None
            for identity, parts in outbox.items():
                self.back.send_multipart([identity, _packed(parts)])

    def _to_any_worker(self, incoming: Incoming) -> None:
        if incoming.msg.version != wire.ENV_WIRE_VERSION:
            self._fail(incoming, "version", f"this server speaks env wire "
                       f"v{wire.ENV_WIRE_VERSION}, the client v{incoming.msg.version}")
            return
        opens = isinstance(incoming.msg, wire.EnvOpen)
        session = incoming.msg.session if opens else ""
        if opens and (session in self.route or session in self.opening):
            self._fail(incoming, "session_taken", f"session {session[:64]} is open already: "
                       "a new env names a new one")
            return
        ready = [w for w in self.workers if w.ready]
        if not ready:
            self.waiting.append((time.monotonic(), incoming))
            if opens:  # its session's calls wait behind it
                self.opening.add(session)
            return
        # An idle worker first (one stuck in a call would hold the new session behind it),
        # then the one with the fewest sessions.
        worker = min(ready, key=lambda w: (len(w.inflight), len(w.sessions)))
        if opens:  # routed from now on: the calls after it in its batch follow it there
            if len(worker.sessions) >= self.settings.max_sessions:
                self._evict(worker)
            worker.sessions[session] = None
            self.route[session] = worker
        self._send(worker, incoming, opens)

    def _to_session(self, incoming: Incoming) -> None:
        session = incoming.msg.session
        worker = self.route.get(session)
        if worker is not None:
            worker.sessions.move_to_end(session)
            self._send(worker, incoming)
        elif session in self.opening:  # its open waits for a worker: so does it
            self.waiting.append((time.monotonic(), incoming))
        elif isinstance(incoming.msg, wire.EnvClose):  # gone already: nothing left to close
            self.lost.pop(session, None)
            self._reply(incoming, wire.EnvValue(None))
        elif session in self.lost:
            detail, tail = self.lost[session]
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

    def _evict(self, worker: Worker) -> None:
        """Close the worker's least recently used session to make room (no client waits)."""
        session, _ = worker.sessions.popitem(last=False)
        self.route.pop(session, None)
        log.info("env worker %d holds %d sessions: closing the least recently used, %s",
                 worker.index, self.settings.max_sessions, session)
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
        for _, incoming in waiting:  # in order: an open before its session's calls
            self._route(incoming)

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
            worker.sessions.pop(pending.incoming.msg.session, None)
            self.route.pop(pending.incoming.msg.session, None)
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
            _, incoming = self.waiting.popleft()
            if isinstance(incoming.msg, wire.EnvOpen):
                self.opening.discard(incoming.msg.session)
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
        for session in worker.sessions:
            self.route.pop(session, None)
            self.lost[session] = (f"{detail}; this session's env was in it", tail)
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
             self.back_address, worker.identity.decode()],
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

    def __init__(self, spec: str, identity: str):
        from environments import env_class

        self.cls = env_class(spec)
        self.identity = identity  # EnvOpened names it: where a session lives
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
            return served_facts(self.cls)
        if isinstance(msg, wire.EnvOpen):
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


def run_worker(spec: str, address: str, identity: str) -> None:
    """A worker's process: connect to the broker, say ready, answer until told to stop."""
    # SIGTERM (the broker stopping, or its death: the parent-death signal) ends the worker
    # even inside an env call that would not return for long; an env holds nothing durable.
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the broker, which stops us
    worker = EnvWorker(spec, identity)
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
              help="Env instances one worker holds; past it the least recently used closes.")
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
def serve(spec, address, workers, max_sessions, call_timeout_s, no_worker_wait_s, keys_dir,
          allow_plaintext_remote, openenv):
    """Serve the env SPEC (a registered name such as `files`, or `pkg.module:name`) at
    --address until SIGTERM or Ctrl-C."""
    from protocol.errors import ConfigError
    from protocol.security import leaves_loopback

    if openenv:
        given = click.get_current_context().get_parameter_source
        for name in ("workers", "call_timeout_s", "no_worker_wait_s"):
            if given(name) is not click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"--{name.replace('_', '-')} does not apply to "
                                       "--openenv (one process, no workers)")
        _serve_openenv(spec, address, max_sessions, keys_dir, allow_plaintext_remote)
        return
    if leaves_loopback(address) and not keys_dir and not allow_plaintext_remote:
        raise click.UsageError(f"{address} leaves this machine: give --keys-dir (keys from "
                               "`autodidact keys generate`) or --allow-plaintext-remote")
    from environments import env_class

    try:
        name = env_class(spec).name  # fail here, not in N workers, on a name that is wrong
    except (KeyError, ImportError) as exc:
        raise click.UsageError(f"{spec}: {exc}") from None
    try:
        broker = EnvBroker(ServeSettings(spec, address, workers, max_sessions, call_timeout_s,
                                         no_worker_wait_s, keys_dir))
    except ConfigError as exc:  # keys that cannot serve (no server.key_secret, no clients)
        raise click.UsageError(f"--keys-dir: {exc}") from None
    except zmq.ZMQError as exc:  # the address is taken, or not one this machine has
        raise click.UsageError(f"--address {address}: cannot bind ({exc})") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(f"env serve: {name} at {broker.front.bound_address}, {workers} workers "
               f"(env wire v{wire.ENV_WIRE_VERSION}, {'CURVE' if keys_dir else 'plaintext'})",
               err=True)
    try:
        broker.serve(stop)
    finally:
        rejected = dict(broker.front.counters.rejected)
        broker.close()
        click.echo(f"env serve: stopped; frames refused {rejected or 'none'}, calls failed "
                   f"{dict(broker.failures) or 'none'}", err=True)


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
    if not _loopback_host(host) and not allow_plaintext_remote:
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


def _loopback_host(host: str) -> bool:
    from protocol.security import leaves_loopback

    return not leaves_loopback(f"tcp://{host}:0")


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    run_worker(*sys.argv[2:5])
