"""The versioned weight channel between the learner and the actors.

The learner serializes its parameters (safetensors bytes) once per version, writes them to
``<run_dir>/weights/v<version>.safetensors`` through a temporary file and an atomic rename, and
then announces the version in Redis (``WeightsAnnouncement`` with per-chunk and whole-file
SHA-256). Actors poll the version between turns, read the file, check the digests, load the
tensors in place and acknowledge the version in Redis. A torn or half-written file never
matches its announced digest, so nobody loads a torn model; the previous version stays loaded.

Only the newest ``keep`` versions stay on disk: actors that fall further behind skip ahead to
the announced version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from protocol import codec
from protocol.control import ControlPlane
from protocol.messages import WeightsAnnouncement

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024


def weights_path(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"v{version:06d}.safetensors"


def chunk_digests(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    return [hashlib.sha256(data[i:i + chunk_bytes]).hexdigest()
            for i in range(0, max(len(data), 1), chunk_bytes)]


class WeightPublisher:
    """Learner side. ``publish`` copies the tensors (the only part that blocks training) and
    hands serialization, disk write and announcement to a background thread."""

    def __init__(self, run_dir: Path, control: ControlPlane, keep: int = 3):
        self.run_dir = Path(run_dir)
        self.control = control
        self.keep = keep
        (self.run_dir / "weights").mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self.last_publish_s = 0.0

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
        digests = chunk_digests(data)
        ann = WeightsAnnouncement(
            version=version, num_chunks=len(digests), total_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(), chunk_sha256=digests,
            path=str(path), published_at=time.time())
        pipe = self.control.r.pipeline()
        pipe.set(self.control.keys.weights, codec.encode_body(ann))
        pipe.set(self.control.keys.version, version)
        pipe.execute()
        self._prune(version)
        self.last_publish_s = time.perf_counter() - t0

    def _prune(self, version: int) -> None:
        for old in (self.run_dir / "weights").glob("v*.safetensors"):
            try:
                if int(old.stem[1:]) <= version - self.keep:
                    old.unlink()
            except (ValueError, FileNotFoundError):
                pass


class WeightSubscriber:
    """Actor side: ``poll`` returns a verified state dict when a newer version is announced."""

    def __init__(self, control: ControlPlane, member: str):
        self.control = control
        self.member = member
        self.version = -1
        self.rejected = 0  # announced versions whose bytes did not match their digests

    def announced(self) -> WeightsAnnouncement | None:
        body = self.control.r.get(self.control.keys.weights)
        return None if body is None else codec.decode_body(WeightsAnnouncement.TYPE, body)

    def poll(self):
        """(version, state_dict) of a newer complete version, or None."""
        if self.control.get_version() <= self.version:
            return None
        ann = self.announced()
        if ann is None or ann.version <= self.version:
            return None
        try:
            data = Path(ann.path).read_bytes()
        except OSError as exc:
            log.warning("weights v%d unreadable (%s); keeping v%d", ann.version, exc, self.version)
            return None
        if len(data) != ann.total_bytes or chunk_digests(data) != ann.chunk_sha256 \
                or hashlib.sha256(data).hexdigest() != ann.sha256:
            self.rejected += 1
            log.warning("weights v%d failed its checksum; keeping v%d", ann.version, self.version)
            return None
        return ann.version, load_safetensors(data)

    def follow(self, backend) -> int | None:
        """Load a newer version into ``backend`` (anything with ``load_weights(state,
        version)``) if one is announced; returns the version loaded, else None."""
        got = self.poll()
        if got is None:
            return None
        version, state = got
        backend.load_weights(state, version)
        self.loaded(version)
        return version

    def loaded(self, version: int) -> None:
        """Record (locally and in Redis) that ``version`` is now the one generating."""
        self.version = version
        self.control.ack_version(version, self.member)
