"""ZeroMQ transport: a ROUTER server that never dies on a bad frame, and a DEALER client that
retries with the same message id until it gets an answer.

Two implementations of the client side share one small interface (:class:`Channel`): the real
ZeroMQ one, and :class:`LoopbackChannel`, which calls a handler in-process and records every
frame, for tests and single-process debugging.

Delivery contract: a request is retried with the *same* ``msg_id`` until answered, so servers
must treat a repeated id (or a repeated idempotency key in the body) as a no-op that answers
again. Replies carry the request's ``msg_id``.
"""

from __future__ import annotations

import abc
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import zmq

from protocol import codec
from protocol.errors import RemoteError, SchemaError, TransportTimeout
from protocol.messages import Error
from protocol.security import AUTH_REASON, CurveKeys

log = logging.getLogger(__name__)

LINGER_MS = 200  # how long close() waits to flush; bounded so exit never hangs
DEFAULT_MAX_FRAME = 256 * 1024 * 1024
MAX_REPLY_BYTES = 4 * DEFAULT_MAX_FRAME


def new_id() -> str:
    return uuid.uuid4().hex


# --- server side -------------------------------------------------------------------------------


@dataclass
class Incoming:
    """One received frame: decoded (``msg``) or refused (``error``)."""

    route: list[bytes]  # ZeroMQ routing frames to send the reply back
    msg_id: str
    msg: object | None = None
    error: SchemaError | None = None
    body: bytes = b""  # the raw body, for stores that keep exactly what was sent
    size: int = 0  # bytes on the wire
    credential: str = ""  # the sender's role token, from the envelope (codec v5)
    peer_key: bytes = b""  # the sender's CURVE public key (z85) on a CURVE server, else b""
    within: str = ""  # the msg_id of the frame this came inside (an env batch), else ""


@dataclass
class ServerCounters:
    received: int = 0
    replied: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count


class RouterServer:
    """A ROUTER socket that decodes and validates frames in batches.

    ``poll`` drains whatever is waiting (up to ``max_batch`` frames) so a caller can handle a
    burst in one storage transaction. Frames that fail to decode come back with ``error`` set;
    :meth:`reject` answers them with an Error reply and counts the reason.
    """

    def __init__(self, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME,
                 context: zmq.Context | None = None, curve: CurveKeys | None = None,
                 send_hwm: int | None = None):
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        # Replies queued per peer before ZeroMQ drops more (the peer's retry asks again); None
        # keeps ZeroMQ's default. A server of large replies bounds its memory with it.
        self.send_hwm = send_hwm
        self.counters = ServerCounters()
        # A CURVE server gets its own context: the ZAP handler is per context, one at most.
        self._own_ctx = curve is not None and context is None
        self._ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._curve = None
        try:
            self._setup(address, curve)
        except BaseException:  # a failed start stops the ZAP thread and frees the port
            self.close()
            raise
        self.bound_address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _setup(self, address: str, curve: CurveKeys | None) -> None:
        # With keys: encrypted, and only clients in authorized/ get past the handshake.
        if curve is not None:
            self._curve = curve.apply_server(self._sock)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        # Hard cap at the socket: ZeroMQ drops the connection of a peer sending more than this.
        # Frames between max_frame_bytes and the cap still get a polite "oversize" reply.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(2 * self.max_frame_bytes, 1 << 20))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.send_hwm is not None:
            self._sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        self._sock.bind(address)

    @property
    def socket(self) -> zmq.Socket:
        """The bound socket, for a caller that waits on it beside others (``zmq.Poller``, a
        broker); frames are still read with :meth:`poll`."""
        return self._sock

    def poll(self, timeout_ms: int = 100, max_batch: int = 256) -> list[Incoming]:
        if self._curve is not None:  # refused handshakes never reach us as frames: count them
            self.counters.rejected[AUTH_REASON] += self._curve.drain()
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return []
        batch = []
        while len(batch) < max_batch:
            try:
                # Frames (not bytes) on a CURVE socket: only a frame tells whose key sent it.
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=self._curve is None)
            except zmq.Again:
                break
            peer_key = b""
            if self._curve is not None:
                peer_key = parts[-1].get("User-Id").encode()  # z85, set by the ZAP handler
                parts = [p.bytes for p in parts]
            batch.append(self._decode(parts, peer_key))
        return batch

    def incoming(self, outer: Incoming, frame: bytes) -> Incoming:
        """A frame that came inside ``outer`` (an env server's batch), decoded as if it had
        come alone from the same peer."""
        inner = self._decode([*outer.route, frame], outer.peer_key)
        inner.within = outer.msg_id
        return inner

    def _decode(self, parts: list[bytes], peer_key: bytes = b"") -> Incoming:
        self.counters.received += 1
        # DEALER peers send [route, frame]; REQ peers add an empty delimiter frame.
        route, frame = parts[:-1], parts[-1]
        incoming = Incoming(route=route, msg_id="", size=len(frame), peer_key=peer_key)
        try:
            env = codec.unpack_envelope(frame, self.max_frame_bytes)
            incoming.msg_id = env.msg_id
            incoming.body = env.body
            incoming.credential = env.credential
            incoming.msg = codec.decode_body(env.type_tag, env.body)
        except SchemaError as exc:
            incoming.error = exc
        except Exception as exc:  # a decoder bug must not take the server down
            log.exception("unexpected decode failure")
            incoming.error = SchemaError("invalid", f"decoder: {type(exc).__name__}")
        return incoming

    def reply(self, incoming: Incoming, msg) -> None:
        self.reply_frame(incoming, codec.encode(msg, incoming.msg_id))

    def reply_frame(self, incoming: Incoming, frame: bytes) -> None:
        """Answer with a frame already encoded (with ``incoming.msg_id``): a broker passing
        on its worker's reply."""
        try:
            self._sock.send_multipart([*incoming.route, frame], zmq.NOBLOCK)
            self.counters.replied += 1
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will retry
            log.debug("reply dropped: %s", exc)

    def reject(self, incoming: Incoming, error: SchemaError) -> None:
        """Count, log and answer a refused frame."""
        self.counters.rejected[error.reason] += 1
        log.warning("rejected frame (%d bytes): %s", incoming.size, error)
        self.reply(incoming, Error(reason=error.reason, detail=str(error)[:500]))

    def close(self) -> None:
        if self._curve is not None:
            self._curve.close()
        self._sock.close(LINGER_MS)
        if self._own_ctx:
            self._ctx.term()


# --- client side -------------------------------------------------------------------------------


class Channel(abc.ABC):
    """Client side of a request/reply link with retries: the interface roles program against.

    ``send`` queues a request and returns its id; ``poll`` returns ``(msg_id, reply)`` pairs
    as answers arrive, re-sending unanswered requests after ``retry_after_s``. ``request`` is the
    blocking form. Error replies raise :class:`RemoteError` from ``request`` and are returned
    as ``Error`` messages from ``poll`` (and not retried: the frame was refused, not lost).
    """

    @abc.abstractmethod
    def send(self, msg, msg_id: str | None = None) -> str: ...

    def __init__(self):
        self._pending: dict[str, object] = {}
        self._early: list[tuple[str, object]] = []  # answers that arrived during a request()

    @property
    def pending(self) -> dict[str, object]:
        """Requests sent and not yet answered, by id."""
        return self._pending

    def request(self, msg, timeout_s: float = 30.0, msg_id: str | None = None):
        """Send and wait for this request's answer. Answers to other requests that arrive
        meanwhile are kept and handed out by the next ``poll``, never dropped."""
        msg_id = self.send(msg, msg_id)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.forget(msg_id)
                raise TransportTimeout(f"no answer to {type(msg).__name__} in {timeout_s:.1f}s")
            for rid, reply in self._poll_wire(min(left, 0.5)):
                if rid != msg_id:
                    self._early.append((rid, reply))
                elif isinstance(reply, Error):
                    raise RemoteError(reply.reason, reply.detail)
                else:
                    return reply

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, object]]:
        early, self._early = self._early, []
        return early + self._poll_wire(0.0 if early else timeout_s)

    @abc.abstractmethod
    def _poll_wire(self, timeout_s: float) -> list[tuple[str, object]]:
        """Answers that arrived (waiting up to ``timeout_s``), re-sending overdue requests."""

    def forget(self, msg_id: str) -> None:
        self.pending.pop(msg_id, None)

    def close(self) -> None:  # noqa: B027 - optional hook; in-process channels hold nothing
        pass


@dataclass
class _Pending:
    msg: object
    frame: bytes
    last_sent: float
    attempts: int = 1
    many: bool = False  # answered in parts: every answer taken until it is forgotten


class ZmqChannel(Channel):
    """DEALER socket to a :class:`RouterServer`; reconnects by itself when the server restarts."""

    def __init__(self, address: str, retry_after_s: float = 2.0,
                 context: zmq.Context | None = None, identity: str | None = None,
                 curve: CurveKeys | None = None, max_reply_bytes: int = MAX_REPLY_BYTES,
                 credential: str = ""):
        super().__init__()
        self.address = address
        self.credential = credential  # this role's token, in every frame's envelope
        self.retry_after_s = retry_after_s
        self.resends = 0
        self.dropped: Counter = Counter()  # replies refused, by reason: a confused server
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # A reply (a learner's batch is the largest) past this is a server gone wrong: ZeroMQ
        # drops the connection instead of buffering it, and the request is retried.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        if identity:
            self._sock.setsockopt(zmq.IDENTITY, identity.encode()[:255])
        if curve is not None:  # encrypted; talks only to the server holding server.key
            curve.apply_client(self._sock)
        self._sock.connect(address)

    def send(self, msg, msg_id: str | None = None) -> str:
        msg_id = msg_id or new_id()
        frame = codec.encode(msg, msg_id, self.credential)
        self._pending[msg_id] = _Pending(msg, frame, time.monotonic())
        self._send_frame(frame)
        return msg_id

    def expect_parts(self, msg_id: str, msg) -> None:
        """Take every answer to ``msg`` under ``msg_id`` until it is forgotten (an env server
        answers a batch in parts); it is never re-sent."""
        self._pending[msg_id] = _Pending(msg, b"", float("inf"), many=True)

    def _send_frame(self, frame: bytes) -> None:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # queue full while the server is away: the retry timer re-sends it

    def _poll_wire(self, timeout_s: float) -> list[tuple[str, object]]:
        out = []
        if self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            while True:
                try:
                    frame = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = self._accept(frame)
                if got is not None:
                    out.append(got)
        self._resend_overdue()
        return out

    def _accept(self, frame: bytes):
        try:
            env, reply = codec.decode(frame)
        except SchemaError as exc:
            self.dropped[exc.reason] += 1
            log.warning("dropping undecodable reply: %s", exc)
            return None
        pending = self._pending.get(env.msg_id)
        if pending is None:
            return None  # answer to a retry already answered
        if not pending.many:
            del self._pending[env.msg_id]
        return env.msg_id, reply

    def _resend_overdue(self) -> None:
        now = time.monotonic()
        for p in self._pending.values():
            if now - p.last_sent >= self.retry_after_s:
                p.last_sent = now
                p.attempts += 1
                self.resends += 1
                self._send_frame(p.frame)

    def close(self) -> None:
        self._sock.close(LINGER_MS)


class LoopbackChannel(Channel):
    """In-process channel: frames go through the real codec to ``handler(incoming)``, which
    gets what a :class:`RouterServer` would have decoded and returns the reply.

    Every frame sent and received is recorded in ``sent`` / ``received`` so tests and debugging
    sessions can inspect exactly what crossed the boundary.
    """

    def __init__(self, handler: Callable[[Incoming], object], credential: str = ""):
        super().__init__()
        self._handler = handler
        self.credential = credential  # this role's token, in every frame's envelope
        self._replies: list[tuple[str, object]] = []
        self.sent: list[bytes] = []
        self.received: list[bytes] = []

    def send(self, msg, msg_id: str | None = None) -> str:
        msg_id = msg_id or new_id()
        frame = codec.encode(msg, msg_id, self.credential)
        self.sent.append(frame)
        env, decoded = codec.decode(frame)
        reply = self._handler(Incoming(route=[], msg_id=msg_id, msg=decoded, body=env.body,
                                       size=len(frame), credential=env.credential))
        self.received.append(codec.encode(reply, msg_id))
        self._replies.append((msg_id, reply))
        return msg_id

    def _poll_wire(self, timeout_s: float) -> list[tuple[str, object]]:
        out, self._replies = self._replies, []
        return out



def free_tcp_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_address(run_dir, name: str) -> str:
    """A single-machine address for a server of this run: an ipc socket in the run directory,
    or 127.0.0.1 on a free port where that path would be too long for a unix socket."""
    path = os.path.join(os.path.abspath(str(run_dir)), f"{name}.sock")
    if len(path) <= 100:
        return f"ipc://{path}"
    return f"tcp://127.0.0.1:{free_tcp_port()}"
