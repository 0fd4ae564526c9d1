"""The versioned weight channel between the learner and the actors.

The learner serializes its parameters (safetensors bytes) once per version, writes them to
``<run_dir>/weights/v<version>.safetensors`` through a temporary file and an atomic rename, and
then announces the version in Redis (``WeightsAnnouncement`` with per-chunk and whole-file
SHA-256). Actors poll the version between turns, read the file, check the digests, load the
tensors in place and acknowledge the version in Redis. A torn or half-written file never
matches its announced digest, so nobody loads a torn model; the previous version stays loaded.

Only the newest ``keep`` versions stay on disk: actors that fall further behind skip ahead to
the announced version. Actors follow the announcement, not a counter: a learner resumed from an
older checkpoint announces an older version, and the actors go back to it.

A subscriber never raises on a bad version: it counts the rejection (``rejected``), keeps what
it has loaded, and looks at the same announcement again only after ``retry_s`` (a file on a
shared file system may show up late; a re-publish of the version comes with a new announcement).

Nodes that do not share the learner's file system (``weights.address`` set, ``--weights-addr``)
fetch the bytes instead: the learner's :class:`WeightServer` (a thread with its own ROUTER
socket) serves the versions it has on disk and announced, chunk by chunk (``WeightsFetch`` ->
``WeightsChunk`` or ``Error``), and :class:`WeightClient` checks each chunk against its announced
digest as it arrives; the whole then goes through the same :func:`verify` as a file read.
See docs/weights.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import zmq
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from protocol import codec
from protocol.control import ControlPlane
from protocol.errors import ConfigError, SchemaError
from protocol.messages import (
    MAX_WEIGHTS_CHUNKS,
    WEIGHTS_CHUNK_BYTES,
    Error,
    Stats,
    StatsRequest,
    WeightsAnnouncement,
    WeightsChunk,
    WeightsFetch,
)
from protocol.run_dir import RunDir
from protocol.security import CurveKeys, curve_for
from protocol.transport import Incoming, RouterServer, ZmqChannel

log = logging.getLogger(__name__)

CHUNK_BYTES = WEIGHTS_CHUNK_BYTES  # 4 MiB: the unit of digests, fetches and replies


@dataclass(frozen=True)
class AdapterMeta:
    """What a LoRA version's file says about itself, in its safetensors metadata (strings, so
    covered by the file's digests): a published version holds either the whole model's
    tensors (no such metadata) or only an adapter's, which an engine applies to its own base
    model and refuses when that base is not the one the learner trained on."""

    rank: int  # r: the inner dimension of every A [r, in] and B [out, r]
    alpha: float  # the adapter adds (alpha / rank) · B A x
    targets: str  # the learner's lora_targets, comma-separated (module names or globs)
    base_id: str  # the base model as the learner named it (a folder path or a model name)
    base_sha256: str  # SHA-256 of the base's weight files (inference.lora.base_digest)

    KIND = "lora"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_tuple(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets.split(",") if t)

    def to_metadata(self) -> dict[str, str]:
        return {"kind": self.KIND, "lora_rank": str(self.rank), "lora_alpha": repr(self.alpha),
                "lora_targets": self.targets, "base_id": self.base_id,
                "base_sha256": self.base_sha256}

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None) -> AdapterMeta | None:
        """None for a whole-model file; SchemaError for an adapter file missing a field."""
        if not meta or meta.get("kind") != cls.KIND:
            return None
        try:
            return cls(rank=int(meta["lora_rank"]), alpha=float(meta["lora_alpha"]),
                       targets=meta["lora_targets"], base_id=meta["base_id"],
                       base_sha256=meta["base_sha256"])
        except (KeyError, ValueError) as exc:
            raise SchemaError("invalid", f"adapter metadata incomplete or malformed "
                                         f"({exc!r})") from None


def file_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (its JSON header), without loading tensors."""
    if len(data) < 8:
        raise ValueError("too short for a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("safetensors header runs past the end of the file")
    header = json.loads(data[8:8 + size])
    meta = header.get("__metadata__") or {} if isinstance(header, dict) else {}
    return {str(k): str(v) for k, v in meta.items()}


def weights_path(run_dir: Path, version: int) -> Path:
    return RunDir(run_dir).weights_file(version)


def chunk_digests(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    return [hashlib.sha256(data[i:i + chunk_bytes]).hexdigest()
            for i in range(0, max(len(data), 1), chunk_bytes)]


def verify(data: bytes, ann: WeightsAnnouncement, chunk_bytes: int = CHUNK_BYTES) -> str | None:
    """Why ``data`` is not the version ``ann`` announced (None when it is): size, then each
    chunk in order (stopping at the first bad one), then the whole-file digest, in one pass."""
    if len(data) != ann.total_bytes:
        return f"has {len(data)} bytes, {ann.total_bytes} announced"
    if not consistent(ann, chunk_bytes):
        return "announcement inconsistent with its chunk count"
    view, whole = memoryview(data), hashlib.sha256()
    for i, want in enumerate(ann.chunk_sha256):
        chunk = view[i * chunk_bytes:(i + 1) * chunk_bytes]
        if hashlib.sha256(chunk).hexdigest() != want:
            return f"chunk {i + 1}/{ann.num_chunks} does not match its digest"
        whole.update(chunk)
    if whole.hexdigest() != ann.sha256:
        return "the whole-file digest does not match"
    return None


def announce(control: ControlPlane, path: Path, data: bytes, version: int) -> WeightsAnnouncement:
    """Tell actors that ``path`` (holding ``data``, already under its final name) is
    ``version``: the announcement with its digests, and the version, in one round trip."""
    digests = chunk_digests(data)
    ann = WeightsAnnouncement(
        version=version, num_chunks=len(digests), total_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(), chunk_sha256=digests,
        path=str(path), published_at=time.time())
    pipe = control.r.pipeline()
    pipe.set(control.keys.weights, codec.encode_body(ann))
    pipe.set(control.keys.version, version)
    pipe.execute()
    return ann


def consistent(ann: WeightsAnnouncement, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Whether the announcement's chunk count agrees with its size and digest list."""
    return (0 < ann.num_chunks <= MAX_WEIGHTS_CHUNKS and ann.num_chunks == len(ann.chunk_sha256)
            == -(-max(ann.total_bytes, 1) // chunk_bytes))


def connect_address(address: str) -> str:
    """Where a client on the server's own machine connects for a bind address: ``tcp://*:p``
    and ``tcp://0.0.0.0:p`` mean 127.0.0.1 there (another node names the server's host)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if address.startswith(wildcard):
            return "tcp://127.0.0.1:" + address[len(wildcard):]
    return address


# --- the weight server (learner side) ------------------------------------------------------------


class WeightServer:
    """Serves published versions, chunk by chunk, to actors that cannot read the run directory.

    A daemon thread owns a ROUTER socket (:class:`RouterServer`: CURVE with the replay server's
    keys and ZAP check when ``curve`` is given) and answers ``WeightsFetch`` with
    ``WeightsChunk``, ``StatsRequest`` with ``Stats``, anything else with an ``Error`` (counted
    by reason, logged, never fatal). It serves only versions handed to :meth:`add` (on disk and
    announced) and not yet dropped by :meth:`retain`; a request for any other version, or for
    bytes of the same number but another digest, gets ``Error(reason="invalid")`` saying so.

    What it serves is capped: requests are tiny (``MAX_REQUEST_BYTES``), each reply is one chunk
    (at most ``CHUNK_BYTES``, re-read from the file and checked against its announced digest,
    so a file changed after its announcement is refused at the source), and at most
    ``send_hwm`` replies queue per peer; ZeroMQ drops the rest and the peer asks again.
    The learner's training thread never waits on it: the publisher's writer thread takes its
    lock only to register a version, the server thread only to look one up.
    """

    MAX_REQUEST_BYTES = 4096
    COUNTERS = (
        "chunks",  # chunks served
        "bytes",  # bytes served
        "not_served",  # requests for a version not (or no longer, or differently) served
        "bad_index",  # requests for a chunk past the version's last
        "changed_on_disk",  # chunks whose file no longer matched the announced digest
        "internal",  # unexpected failures of the server loop (logged)
    )
    SEND_HWM = 8  # replies queued per peer: 32 MiB at most

    def __init__(self, address: str, curve: CurveKeys | None = None,
                 send_hwm: int = SEND_HWM, max_batch: int = 16):
        try:
            self.rpc = RouterServer(address, max_frame_bytes=self.MAX_REQUEST_BYTES,
                                    curve=curve, send_hwm=send_hwm)
        except zmq.ZMQError as exc:  # in use, or not an address this machine has
            raise ConfigError(f"weights.address={address}: the weight server cannot bind it "
                              f"({exc})") from None
        self.address = self.rpc.bound_address
        self.max_batch = max_batch
        self.counters: Counter = Counter(dict.fromkeys(self.COUNTERS, 0))
        self._served: dict[int, WeightsAnnouncement] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self._thread.start()  # the socket is the thread's from here on
        log.info("weight server on %s (%s)", self.address,
                 f"CURVE, {len(curve.authorized)} authorized client keys" if curve
                 else "plaintext")

    # --- what is served (called from the publisher's writer thread) --------------------------

    @property
    def lock(self) -> threading.Lock:
        """Held while announcing and registering a version, so no actor can see the
        announcement of a version the server does not serve yet."""
        return self._lock

    def add(self, ann: WeightsAnnouncement) -> None:
        """Serve ``ann.path`` as ``ann.version`` (callers hold :attr:`lock` around the
        announcement and this call, or call it before announcing)."""
        self._served[ann.version] = ann

    def retain(self, keep) -> None:
        """Stop serving the versions for which ``keep(version)`` is false."""
        with self._lock:
            for version in [v for v in self._served if not keep(v)]:
                del self._served[version]

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._served)

    def stats(self) -> dict:
        # Copies first: the server thread may be counting meanwhile.
        values = {k: int(v) for k, v in dict(self.counters).items()}
        values.update(received=self.rpc.counters.received, replied=self.rpc.counters.replied)
        for reason, n in dict(self.rpc.counters.rejected).items():
            values[f"rejected/{reason}"] = n
        values["versions"] = self.versions()
        return values

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; it closes its socket (the port is free again once this returns)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("weight server thread did not stop in %.1fs", timeout_s)

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    for incoming in self.rpc.poll(timeout_ms=100, max_batch=self.max_batch):
                        self._handle(incoming)
                except zmq.ContextTerminated:  # the process is shutting ZeroMQ down
                    break
                except Exception:  # a bug here must not stop the learner's weight channel
                    self.counters["internal"] += 1
                    log.exception("weight server: unexpected failure; serving on")
                    time.sleep(0.05)
        finally:
            self.rpc.close()

    def _handle(self, incoming: Incoming) -> None:
        if incoming.error is not None:
            self.rpc.reject(incoming, incoming.error)
        elif isinstance(incoming.msg, WeightsFetch):
            self.rpc.reply(incoming, self._chunk(incoming.msg))
        elif isinstance(incoming.msg, StatsRequest):
            self.rpc.reply(incoming, Stats(self.stats()))
        else:
            self.rpc.reject(incoming, SchemaError(
                "unexpected_type", f"the weight server does not serve {type(incoming.msg).TYPE}"))

    def _chunk(self, req: WeightsFetch):
        with self._lock:
            ann = self._served.get(req.version)
            serving = sorted(self._served)
        if ann is None or ann.sha256 != req.sha256:
            self.counters["not_served"] += 1
            what = ("never announced here or already pruned" if ann is None
                    else "re-published since with other bytes")
            return Error("invalid", f"weights v{req.version} (sha256 {req.sha256[:12]}) are not "
                                    f"served: {what}; serving {serving}")
        if req.index >= ann.num_chunks:
            self.counters["bad_index"] += 1
            return Error("invalid", f"weights v{req.version} have {ann.num_chunks} chunks, "
                                    f"not chunk {req.index}")
        offset = req.index * CHUNK_BYTES
        size = min(CHUNK_BYTES, ann.total_bytes - offset)
        try:
            fd = os.open(ann.path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                data = os.pread(fd, size, offset)
            finally:
                os.close(fd)
        except OSError as exc:  # pruned between the lookup and the read
            self.counters["not_served"] += 1
            return Error("invalid", f"weights v{req.version} are not served: {exc.strerror}")
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != size or digest != ann.chunk_sha256[req.index]:
            self.counters["changed_on_disk"] += 1
            log.error("weights v%d chunk %d on disk (%s) no longer matches its announced digest",
                      req.version, req.index, ann.path)
            return Error("invalid", f"weights v{req.version} chunk {req.index} changed on the "
                                    "server's disk since its announcement")
        self.counters["chunks"] += 1
        self.counters["bytes"] += len(data)
        return WeightsChunk(version=req.version, index=req.index, data=data, sha256=digest)


# --- the weight client (actor side) --------------------------------------------------------------


class FetchError(OSError):
    """A version could not be fetched from the weight server, or what came back was wrong."""


class WeightClient:
    """Fetches an announced version from a :class:`WeightServer`, ``window`` chunks in flight,
    each checked against its announced digest as it arrives. Gives up (``FetchError``) when no
    chunk arrives for ``timeout_s``; lost requests are re-sent after ``retry_after_s``."""

    def __init__(self, address: str, curve: CurveKeys | None = None, timeout_s: float = 10.0,
                 retry_after_s: float = 3.0, window: int = 4):
        self.address = connect_address(address)
        self.timeout_s = timeout_s
        self.window = window
        # A reply is one chunk and its envelope: anything longer is a server gone wrong.
        self.channel = ZmqChannel(self.address, retry_after_s=retry_after_s, curve=curve,
                                  max_reply_bytes=CHUNK_BYTES + 64 * 1024)

    def fetch(self, ann: WeightsAnnouncement) -> bytes:
        """The announced bytes, each chunk matching its announced digest (callers still
        :func:`verify` the whole); raises :class:`FetchError`."""
        if not consistent(ann):
            raise FetchError("announcement inconsistent with its chunk count")
        chunks: list[bytes] = [b""] * ann.num_chunks
        asked: dict[str, int] = {}  # msg_id -> chunk index, in flight
        next_index = done = 0
        last_progress = time.monotonic()
        try:
            while done < ann.num_chunks:
                while next_index < ann.num_chunks and len(asked) < self.window:
                    req = WeightsFetch(version=ann.version, index=next_index, sha256=ann.sha256)
                    asked[self.channel.send(req)] = next_index
                    next_index += 1
                for msg_id, reply in self.channel.poll(0.2):
                    index = asked.pop(msg_id, None)
                    if index is not None:
                        chunks[index] = self._checked(reply, ann, index)
                        done += 1
                        last_progress = time.monotonic()
                if time.monotonic() - last_progress > self.timeout_s:
                    raise FetchError(f"no answer from the weight server at {self.address} in "
                                     f"{self.timeout_s:g}s ({done}/{ann.num_chunks} chunks)")
        finally:
            for msg_id in asked:  # stop re-sending what we no longer wait for
                self.channel.forget(msg_id)
        return b"".join(chunks)

    @staticmethod
    def _checked(reply, ann: WeightsAnnouncement, index: int) -> bytes:
        where = f"chunk {index + 1}/{ann.num_chunks}"
        if isinstance(reply, Error):
            raise FetchError(f"the weight server refused {where}: {reply.reason}: "
                             f"{reply.detail}")
        if not isinstance(reply, WeightsChunk):
            raise FetchError(f"the weight server answered {where} with {type(reply).TYPE}")
        if (reply.version, reply.index) != (ann.version, index):
            raise FetchError(f"the weight server answered {where} with chunk "
                             f"{reply.index + 1} of v{reply.version}")
        if hashlib.sha256(reply.data).hexdigest() != ann.chunk_sha256[index]:
            raise FetchError(f"{where} does not match its announced digest")
        return reply.data

    def close(self) -> None:
        self.channel.close()


class WeightPublisher:
    """Learner side. ``publish`` copies the tensors (the only part that blocks training) and
    hands serialization, disk write and announcement to a background thread."""

    def __init__(self, run_dir: Path, control: ControlPlane, keep: int = 3,
                 server: WeightServer | None = None):
        self.run_dir = Path(run_dir)
        self.control = control
        self.keep = keep
        self.server = server  # also serves the versions over ZeroMQ when set
        RunDir(self.run_dir).weights.mkdir(parents=True, exist_ok=True)
        for orphan in RunDir(self.run_dir).weights.glob("v*.tmp"):  # a writer killed mid-write
            orphan.unlink(missing_ok=True)
        self._thread: threading.Thread | None = None
        self.last_publish_s = 0.0
        self.last_publish_bytes = 0
        if server is not None:
            self._serve_announced()

    @classmethod
    def for_run(cls, cfg, run_dir: Path, control: ControlPlane) -> WeightPublisher:
        """The publisher a run's config asks for (``cfg.weights``): with ``weights.address``
        it also starts a :class:`WeightServer` bound there, CURVE keys from
        ``security.keys_dir`` (a plaintext address off this machine is refused)."""
        server = None
        if cfg.weights.address:
            server = WeightServer(cfg.weights.address,
                                  curve=curve_for(cfg.security, cfg.weights.address))
        return cls(run_dir, control, keep=cfg.weights.keep, server=server)

    def _serve_announced(self) -> None:
        """A restarted learner serves what Redis still announces, if it is its own file on
        disk, until its first publish: actors that are fetching it need not wait."""
        try:
            body = self.control.r.get(self.control.keys.weights)
            ann = None if body is None else codec.decode_body(WeightsAnnouncement.TYPE, body)
        except Exception as exc:  # Redis away or an undecodable announcement: nothing to serve
            log.debug("no announced weights to serve: %s", exc)
            return
        if (ann is not None and consistent(ann)
                and ann.path == str(weights_path(self.run_dir, ann.version))
                and os.path.isfile(ann.path) and os.path.getsize(ann.path) == ann.total_bytes):
            with self.server.lock:
                self.server.add(ann)

    def close(self) -> None:
        """Finish the write in flight and stop the weight server (if any)."""
        self.wait()
        if self.server is not None:
            self.server.close()

    def publish(self, state_dict, version: int, wait: bool = False,
                adapter: AdapterMeta | None = None) -> None:
        """Publish ``state_dict`` as ``version``: the whole model's tensors, or with
        ``adapter`` only a LoRA adapter's (its metadata goes into the file)."""
        snapshot = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
        self.wait()  # one write in flight at a time keeps versions in order
        metadata = {"version": str(version), **(adapter.to_metadata() if adapter else {})}
        self._thread = threading.Thread(target=self._write, args=(snapshot, version, metadata),
                                        daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, snapshot, version: int, metadata: dict[str, str]) -> None:
        t0 = time.perf_counter()
        data = save_safetensors(snapshot, metadata=metadata)
        path = weights_path(self.run_dir, version)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.server is None:
            announce(self.control, path, data, version)
        else:  # served from the moment it is announced: no actor sees it unserved
            with self.server.lock:
                self.server.add(announce(self.control, path, data, version))
        self._prune(version)
        self.last_publish_s = time.perf_counter() - t0
        self.last_publish_bytes = len(data)

    def _prune(self, version: int) -> None:
        """Drop versions older than the newest ``keep``, and any newer than ``version``: one
        learner publishes in order, so those came from a run that died after its checkpoint
        (a resume starts again from the checkpoint's version) and nobody may load them."""
        if self.server is not None:  # stop serving before the files go
            self.server.retain(lambda v: version - self.keep < v <= version)
        for old in RunDir(self.run_dir).published_weights():
            try:
                if not version - self.keep < int(old.stem[1:]) <= version:
                    old.unlink()
            except (ValueError, FileNotFoundError):
                pass


def read_announced(ann: WeightsAnnouncement) -> bytes:
    """The announced file's bytes; only a regular file of the announced size is read, so an
    announcement pointing at a FIFO or ``/dev/zero`` neither blocks nor fills memory."""
    fd = os.open(ann.path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{ann.path} is not a regular file")
        if info.st_size != ann.total_bytes:
            raise OSError(f"{info.st_size} bytes on disk, {ann.total_bytes} announced")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(ann.total_bytes + 1)
    finally:
        os.close(fd)


class WeightUpdate(NamedTuple):
    """A verified version, as :meth:`WeightSubscriber.poll` returns it."""

    version: int
    state: dict  # tensor name -> tensor: the whole model's, or only the adapter's
    adapter: AdapterMeta | None  # set when ``state`` is a LoRA adapter over a base model


def apply_update(backend, update: WeightUpdate) -> None:
    """Load ``update`` into an engine: whole weights, or an adapter over its base."""
    if update.adapter is None:
        backend.load_weights(update.state, update.version)
    else:
        backend.load_adapter(update.state, update.adapter, update.version)


def newest_published(run_dir: Path) -> WeightUpdate | None:
    """The newest version on the run's disk, for a process that starts the policy outside the
    training loop (the explore proposer): None when nothing was published. Its own run's
    file, read without an announcement to check it against; the file format is checked."""
    for path in reversed(RunDir(run_dir).published_weights()):
        try:
            data = path.read_bytes()
            adapter = AdapterMeta.from_metadata(file_metadata(data))
            return WeightUpdate(int(path.stem[1:]), load_safetensors(data), adapter)
        except Exception as exc:  # pruned meanwhile, or torn: the one before it then
            log.warning("published weights %s not usable (%s)", path, exc)
    return None


class WeightSubscriber:
    """Actor side: ``poll`` returns a verified :class:`WeightUpdate` when another version is
    announced; ``follow`` loads it into an engine (an adapter through ``load_adapter``, once
    its base digest matches the engine's own)."""

    def __init__(self, control: ControlPlane, member: str, retry_s: float = 5.0,
                 source: WeightClient | None = None):
        self.control = control
        self.member = member
        self.source = source  # fetch from the learner's weight server; None: read the file
        self.version = -1
        self.sha256 = ""  # of the version loaded
        self.rejected = 0  # announcements refused: unreadable, torn, or not matching digests
        self.retry_s = retry_s
        self._refused: tuple[bytes, float] | None = None  # (announcement, retry at)
        self._polled_sha256 = ""  # of the version the last poll returned

    @classmethod
    def for_run(cls, cfg, control: ControlPlane, member: str) -> WeightSubscriber:
        """The subscriber a run's config asks for (``cfg.weights``): with ``weights.address``
        it fetches announced versions from the learner's weight server (CURVE client keys from
        ``security.keys_dir``), else it reads the announced file."""
        source = None
        if cfg.weights.address:
            source = WeightClient(cfg.weights.address,
                                  curve=curve_for(cfg.security, cfg.weights.address))
        return cls(control, member, source=source)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def announced(self) -> WeightsAnnouncement | None:
        body = self.control.r.get(self.control.keys.weights)
        return None if body is None else codec.decode_body(WeightsAnnouncement.TYPE, body)

    def poll(self, base_sha256: Callable[[], str] | None = None) -> WeightUpdate | None:
        """A complete version other than the one loaded, or None. With ``base_sha256`` (gives
        the digest of the caller's base weights; asked only when an adapter arrives, since
        hashing a base is not free) an adapter for any other base is refused."""
        if self.control.get_version() == self.version:
            return None
        body = self.control.r.get(self.control.keys.weights)
        if body is None or (self._refused and self._refused[0] == body
                            and time.monotonic() < self._refused[1]):
            return None
        try:
            ann = codec.decode_body(WeightsAnnouncement.TYPE, body)
        except SchemaError as exc:
            return self._refuse(body, f"announcement does not decode: {exc}")
        if ann.version == self.version and ann.sha256 == self.sha256:
            return None
        try:
            data = read_announced(ann) if self.source is None else self.source.fetch(ann)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            how = "unreadable" if self.source is None else "not fetched"
            return self._refuse(body, f"v{ann.version} {how} ({exc})")
        why = verify(data, ann)
        if why is not None:
            return self._refuse(body, f"v{ann.version} {why}")
        try:
            adapter = AdapterMeta.from_metadata(file_metadata(data))
            state = load_safetensors(data)
        except Exception as exc:  # digests matched: the publisher wrote something odd
            return self._refuse(body, f"v{ann.version} does not load ({exc})")
        if adapter is not None and base_sha256 is not None:
            ours = base_sha256()
            if adapter.base_sha256 != ours:
                return self._refuse(body, f"v{ann.version} is a LoRA adapter for base "
                                          f"{adapter.base_id} (sha256 {adapter.base_sha256[:12]}"
                                          f"), but this engine's base has sha256 {ours[:12]}: "
                                          "start it on the learner's model.path")
        self._refused = None
        self._polled_sha256 = ann.sha256
        return WeightUpdate(ann.version, state, adapter)

    def _refuse(self, body: bytes, why: str):
        self.rejected += 1
        self._refused = (body, time.monotonic() + self.retry_s)
        log.warning("weights refused: %s; keeping v%d", why, self.version)
        return None

    def follow(self, backend) -> int | None:
        """Load a newer version into ``backend`` (an ``InferenceBackend``: ``load_weights``
        for a whole model, ``load_adapter`` and ``base_sha256`` for LoRA) if one is
        announced; returns the version loaded, else None."""
        got = self.poll(base_sha256=lambda: backend.base_sha256)
        if got is None:
            return None
        apply_update(backend, got)
        self.loaded(got.version, self._polled_sha256)
        return got.version

    def loaded(self, version: int, sha256: str = "") -> None:
        """Record (locally and in Redis) that ``version`` is now the one generating."""
        self.version = version
        self.sha256 = sha256
        self.control.ack_version(version, self.member)
