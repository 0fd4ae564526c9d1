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
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from pathlib import Path

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from protocol import codec
from protocol.control import ControlPlane
from protocol.errors import SchemaError
from protocol.messages import WeightsAnnouncement

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024


def weights_path(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"v{version:06d}.safetensors"


def chunk_digests(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    return [hashlib.sha256(data[i:i + chunk_bytes]).hexdigest()
            for i in range(0, max(len(data), 1), chunk_bytes)]


def verify(data: bytes, ann: WeightsAnnouncement, chunk_bytes: int = CHUNK_BYTES) -> str | None:
    """Why ``data`` is not the version ``ann`` announced (None when it is): size, then each
    chunk in order (stopping at the first bad one), then the whole-file digest, in one pass."""
    if len(data) != ann.total_bytes:
        return f"has {len(data)} bytes, {ann.total_bytes} announced"
    if not ann.num_chunks == len(ann.chunk_sha256) == -(-max(len(data), 1) // chunk_bytes):
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


def announce(control: ControlPlane, path: Path, data: bytes, version: int) -> None:
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


class WeightPublisher:
    """Learner side. ``publish`` copies the tensors (the only part that blocks training) and
    hands serialization, disk write and announcement to a background thread."""

    def __init__(self, run_dir: Path, control: ControlPlane, keep: int = 3):
        self.run_dir = Path(run_dir)
        self.control = control
        self.keep = keep
        (self.run_dir / "weights").mkdir(parents=True, exist_ok=True)
        for orphan in (self.run_dir / "weights").glob("v*.tmp"):  # a writer killed mid-write
            orphan.unlink(missing_ok=True)
        self._thread: threading.Thread | None = None
        self.last_publish_s = 0.0

    @classmethod
    def for_run(cls, cfg, run_dir: Path, control: ControlPlane) -> WeightPublisher:
        """The publisher a run's config asks for (``cfg.weights``)."""
        return cls(run_dir, control, keep=cfg.weights.keep)

    def publish(self, state_dict, version: int, wait: bool = False) -> None:
        snapshot = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
        self.wait()  # one write in flight at a time keeps versions in order
        self._thread = threading.Thread(target=self._write, args=(snapshot, version), daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, snapshot, version: int) -> None:
        t0 = time.perf_counter()
        data = save_safetensors(snapshot, metadata={"version": str(version)})
        path = weights_path(self.run_dir, version)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        announce(self.control, path, data, version)
        self._prune(version)
        self.last_publish_s = time.perf_counter() - t0

    def _prune(self, version: int) -> None:
        """Drop versions older than the newest ``keep``, and any newer than ``version``: one
        learner publishes in order, so those came from a run that died after its checkpoint
        (a resume starts again from the checkpoint's version) and nobody may load them."""
        for old in (self.run_dir / "weights").glob("v*.safetensors"):
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


class WeightSubscriber:
    """Actor side: ``poll`` returns a verified state dict when another version is announced."""

    def __init__(self, control: ControlPlane, member: str, retry_s: float = 5.0):
        self.control = control
        self.member = member
        self.version = -1
        self.sha256 = ""  # of the version loaded
        self.rejected = 0  # announcements refused: unreadable, torn, or not matching digests
        self.retry_s = retry_s
        self._refused: tuple[bytes, float] | None = None  # (announcement, retry at)
        self._polled_sha256 = ""  # of the version the last poll returned

    @classmethod
    def for_run(cls, cfg, control: ControlPlane, member: str) -> WeightSubscriber:
        """The subscriber a run's config asks for (``cfg.weights``)."""
        return cls(control, member)

    def announced(self) -> WeightsAnnouncement | None:
        body = self.control.r.get(self.control.keys.weights)
        return None if body is None else codec.decode_body(WeightsAnnouncement.TYPE, body)

    def poll(self):
        """(version, state_dict) of a complete version other than the one loaded, or None."""
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
            data = read_announced(ann)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            return self._refuse(body, f"v{ann.version} unreadable ({exc})")
        why = verify(data, ann)
        if why is not None:
            return self._refuse(body, f"v{ann.version} {why}")
        try:
            state = load_safetensors(data)
        except Exception as exc:  # digests matched: the publisher wrote something odd
            return self._refuse(body, f"v{ann.version} does not load ({exc})")
        self._refused = None
        self._polled_sha256 = ann.sha256
        return ann.version, state

    def _refuse(self, body: bytes, why: str):
        self.rejected += 1
        self._refused = (body, time.monotonic() + self.retry_s)
        log.warning("weights refused: %s; keeping v%d", why, self.version)
        return None

    def follow(self, backend) -> int | None:
        """Load a newer version into ``backend`` (anything with ``load_weights(state,
        version)``) if one is announced; returns the version loaded, else None."""
        got = self.poll()
        if got is None:
            return None
        version, state = got
        backend.load_weights(state, version)
        self.loaded(version, self._polled_sha256)
        return version

    def loaded(self, version: int, sha256: str = "") -> None:
        """Record (locally and in Redis) that ``version`` is now the one generating."""
        self.version = version
        self.sha256 = sha256
        self.control.ack_version(version, self.member)
