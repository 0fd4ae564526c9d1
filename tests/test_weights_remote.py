"""The weight channel across machines (``weights.address``): the learner's WeightServer serves
published versions chunk by chunk over ZeroMQ, actors fetch and check them instead of reading
the run directory. Real sockets on tcp://127.0.0.1, real Redis (tests/conftest.py), real
files; the actor side is never allowed to read the announced path."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

import protocol.weights as w
from protocol import codec
from protocol.config import RunConfig, SecurityConfig
from protocol.errors import ConfigError
from protocol.messages import (
    Ack,
    Error,
    StatsRequest,
    WeightsAnnouncement,
    WeightsChunk,
    WeightsFetch,
)
from protocol.security import CurveKeys
from protocol.transport import RouterServer
from protocol.weights import (
    CHUNK_BYTES,
    WeightClient,
    WeightPublisher,
    WeightSubscriber,
    connect_address,
    weights_path,
)

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
FLOATS = 1_300_000  # 5.2 MB of float32: two 4 MiB chunks
LOCAL = "tcp://127.0.0.1:*"


def weights(seed: int) -> dict:
    return {"w": torch.randn(FLOATS, generator=torch.Generator().manual_seed(seed)),
            "b": torch.full((3,), float(seed))}


class RecordingBackend:
    def __init__(self):
        self.loads: list[tuple[int, dict]] = []

    def load_weights(self, state, version):
        self.loads.append((version, state))


def loaded_equal(backend: RecordingBackend, version: int, state: dict) -> bool:
    got_version, got = backend.loads[-1]
    return got_version == version and all(torch.equal(got[k], v) for k, v in state.items())


def run_cfg(address: str, keys_dir="", keep: int = 3) -> RunConfig:
    cfg = RunConfig()
    cfg.weights.address, cfg.weights.keep = address, keep
    cfg.security = SecurityConfig(keys_dir=str(keys_dir))
    return cfg


def wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def no_file_reads(monkeypatch):
    """The actor side has no access to the learner's run directory: any read of the
    announced path fails the test (poll catches only OSError and ValueError)."""
    def forbidden(ann):
        raise AssertionError(f"the subscriber read {ann.path} instead of fetching it")

    monkeypatch.setattr(w, "read_announced", forbidden)


@pytest.fixture
def learner(tmp_path, control):
    """A publisher with its weight server, in this process (the learner's side)."""
    publisher = WeightPublisher.for_run(run_cfg(LOCAL, keep=2), tmp_path / "learner", control)
    yield publisher
    publisher.close()


def actor(control, address: str, **client) -> WeightSubscriber:
    client = {"timeout_s": 5.0, "retry_after_s": 0.5, **client}
    return WeightSubscriber(control, "actor-0", source=WeightClient(address, **client))


# --- following versions --------------------------------------------------------------------------

PUBLISHER = """
import sys
import redis, torch
from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.weights import WeightPublisher

control = ControlPlane(redis.Redis.from_url(sys.argv[1]), sys.argv[2])
cfg = RunConfig()
cfg.weights.address, cfg.weights.keep = "tcp://127.0.0.1:*", 2
publisher = WeightPublisher.for_run(cfg, sys.argv[3], control)
print(publisher.server.address, flush=True)
for line in sys.stdin:
    version, seed = map(int, line.split())
    if version < 0:
        break
    state = {"w": torch.randn(%d, generator=torch.Generator().manual_seed(seed)),
             "b": torch.full((3,), float(seed))}
    publisher.publish(state, version, wait=True)
    print("published", version, flush=True)
publisher.close()
print("closed", publisher.server.alive(), flush=True)
""" % FLOATS


@pytest.mark.timeout(90)
def test_actor_follows_a_learner_in_another_process_without_its_files(tmp_path, control,
                                                                     redis_url):
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, redis_url, control.keys.prefix,
                             str(tmp_path / "learner")], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address
        # The actor's own config: another run dir, the server's address (--weights-addr).
        subscriber = WeightSubscriber.for_run(run_cfg(address), control, "actor-0")
        backend = RecordingBackend()

        def publish(version, seed):
            proc.stdin.write(f"{version} {seed}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().split() == ["published", str(version)]

        for version in (1, 2, 3):
            publish(version, version)
            assert subscriber.follow(backend) == version
            assert loaded_equal(backend, version, weights(version))
        assert control.version_acks(3) == {"actor-0"}
        publish(2, 20)  # a learner resumed from an older checkpoint: the actor goes back
        assert subscriber.follow(backend) == 2 and loaded_equal(backend, 2, weights(20))
        assert subscriber.follow(backend) is None  # nothing new
        assert subscriber.rejected == 0 and len(backend.loads) == 4

        proc.stdin.write("-1 0\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["closed", "False"]
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait(10)
    subscriber.close()


# --- refusing bad bytes --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_file_changed_after_its_announcement_is_refused_and_the_old_version_kept(
        learner, control, caplog):
    subscriber, backend = actor(control, learner.server.address), RecordingBackend()
    learner.publish(weights(1), 1, wait=True)
    assert subscriber.follow(backend) == 1

    learner.publish(weights(2), 2, wait=True)
    path = weights_path(learner.run_dir, 2)
    with open(path, "r+b") as f:  # same size, one byte of the second chunk flipped
        f.seek(CHUNK_BYTES + 100)
        byte = f.read(1)
        f.seek(CHUNK_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="protocol.weights"):
        assert subscriber.follow(backend) is None
    assert subscriber.rejected == 1 and subscriber.version == 1
    assert len(backend.loads) == 1 and loaded_equal(backend, 1, weights(1))
    assert "changed on the server's disk" in caplog.text and "keeping v1" in caplog.text
    assert learner.server.stats()["changed_on_disk"] == 1
    assert subscriber.follow(backend) is None and subscriber.rejected == 1  # waits retry_s

    learner.publish(weights(3), 3, wait=True)  # the next announcement is followed at once
    assert subscriber.follow(backend) == 3 and loaded_equal(backend, 3, weights(3))
    subscriber.close()


class RogueServer:
    """Answers WeightsFetch from the real files, except chunk 0 of version 2: there it lies
    ``how``. Records every (version, index) asked for."""

    def __init__(self, files: dict[int, bytes], how: str):
        self.files, self.how = files, how
        self.asked: list[tuple[int, int]] = []
        self.rpc = RouterServer(LOCAL)
        self.address = self.rpc.bound_address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            for inc in self.rpc.poll(50):
                req = inc.msg
                self.asked.append((req.version, req.index))
                data = self.files[req.version][req.index * CHUNK_BYTES:][:CHUNK_BYTES]
                reply = WeightsChunk(req.version, req.index, data,
                                     hashlib.sha256(data).hexdigest())
                if req.version == 2 and req.index == 0:
                    reply = self._lie(reply)
                self.rpc.reply(inc, reply)
        self.rpc.close()

    def _lie(self, good: WeightsChunk):
        flipped = bytes([good.data[0] ^ 1]) + good.data[1:]
        if self.how == "flipped":  # wrong bytes under the digest the actor expects
            return WeightsChunk(good.version, good.index, flipped, good.sha256)
        if self.how == "flipped-honest":  # wrong bytes with their own digest
            return WeightsChunk(good.version, good.index, flipped,
                                hashlib.sha256(flipped).hexdigest())
        if self.how == "short":
            return WeightsChunk(good.version, good.index, good.data[:-1], good.sha256)
        if self.how == "wrong-index":  # a real chunk, but not the one asked for
            data = self.files[2][CHUNK_BYTES:2 * CHUNK_BYTES]
            return WeightsChunk(good.version, 1, data, hashlib.sha256(data).hexdigest())
        if self.how == "other-version":
            return WeightsChunk(1, good.index, good.data, good.sha256)
        assert self.how == "wrong-type"
        return Ack("stored")

    def close(self):
        self._stop.set()
        self._thread.join(5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["flipped", "flipped-honest", "short", "wrong-index",
                                 "other-version", "wrong-type"])
def test_a_server_serving_wrong_bytes_is_refused_and_counted(tmp_path, control, how):
    files = {}
    for version in (1, 2):  # real versions, announced as the learner would
        path = weights_path(tmp_path, version)
        path.parent.mkdir(exist_ok=True)
        files[version] = w.save_safetensors(weights(version))
        path.write_bytes(files[version])
    rogue = RogueServer(files, how)
    try:
        # One chunk in flight at a time, to see that a bad chunk ends the fetch at once.
        subscriber, backend = actor(control, rogue.address, window=1), RecordingBackend()
        w.announce(control, weights_path(tmp_path, 1), files[1], 1)
        assert subscriber.follow(backend) == 1
        w.announce(control, weights_path(tmp_path, 2), files[2], 2)
        assert subscriber.follow(backend) is None
        assert subscriber.rejected == 1 and subscriber.version == 1
        # Chunk 0 of v2 was refused on arrival: v2's chunk 1 was never asked for. (A slow
        # server's chunk may be asked twice: the client re-sends after retry_after_s.)
        assert list(dict.fromkeys(rogue.asked)) == [(1, 0), (1, 1), (2, 0)]
        assert len(backend.loads) == 1 and loaded_equal(backend, 1, weights(1))
        subscriber.close()
    finally:
        rogue.close()


# --- what is served --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_pruned_version_is_refused_clearly_then_the_next_is_followed(learner, control,
                                                                       caplog):
    subscriber, backend = actor(control, learner.server.address), RecordingBackend()
    learner.publish(weights(1), 1, wait=True)
    stale = control.r.get(control.keys.weights)  # what a slow actor read before v3 came out
    learner.publish(weights(2), 2, wait=True)
    learner.publish(weights(3), 3, wait=True)  # keep=2: v1 is gone, from disk and server
    assert learner.server.versions() == [2, 3]
    assert not weights_path(learner.run_dir, 1).exists()

    control.r.set(control.keys.weights, stale)
    control.r.set(control.keys.version, 1)
    with caplog.at_level(logging.WARNING, logger="protocol.weights"):
        assert subscriber.follow(backend) is None
    assert subscriber.rejected == 1 and subscriber.version == -1 and backend.loads == []
    assert "weights v1" in caplog.text and "already pruned" in caplog.text
    assert "serving [2, 3]" in caplog.text
    assert learner.server.stats()["not_served"] >= 1  # each chunk in flight was refused

    learner.publish(weights(4), 4, wait=True)
    assert subscriber.follow(backend) == 4 and loaded_equal(backend, 4, weights(4))
    assert learner.server.versions() == [3, 4]
    subscriber.close()


@pytest.mark.timeout(30)
def test_a_restarted_learner_serves_the_announced_version_until_it_publishes(
        tmp_path, control):
    first = WeightPublisher.for_run(run_cfg(LOCAL), tmp_path / "learner", control)
    first.publish(weights(5), 5, wait=True)
    first.close()
    again = WeightPublisher.for_run(run_cfg(LOCAL), tmp_path / "learner", control)
    try:
        assert again.server.versions() == [5]
        subscriber, backend = actor(control, again.server.address), RecordingBackend()
        assert subscriber.follow(backend) == 5 and loaded_equal(backend, 5, weights(5))
        subscriber.close()
    finally:
        again.close()


def garbage_frames() -> dict[str, bytes]:
    fetch = WeightsFetch(1, 0, "0" * 64)
    return {
        "empty": b"",
        "not msgpack": b"\xc1\xc1\xc1",
        "bytes": os.urandom(200),
        "no envelope": msgpack.packb({"hello": 1}),
        "future": codec.pack_frame("weights_fetch", "x", codec.encode_body(fetch), version=99),
        "unknown type": codec.pack_frame("give_me_everything", "x", b"\x80"),
        "unexpected type": codec.encode(Ack("stored"), "x"),
        "negative index": codec.encode(WeightsFetch(1, -1, "0" * 64), "x"),
        "huge version": codec.encode(WeightsFetch(2**40, 0, "0" * 64), "x"),
        "bad digest": codec.encode(WeightsFetch(1, 0, "../../etc/passwd"), "x"),
        "extra field": codec.pack_frame("weights_fetch", "x", msgpack.packb(
            {"version": 1, "index": 0, "sha256": "0" * 64, "path": "/etc/shadow"})),
        "oversize": codec.encode(WeightsFetch(1, 0, "0" * 64), "x" * 5000),
    }


@pytest.mark.timeout(30)
def test_garbage_frames_are_answered_counted_and_serving_goes_on(learner, control):
    learner.publish(weights(1), 1, wait=True)
    ann = codec.decode_body(WeightsAnnouncement.TYPE, control.r.get(control.keys.weights))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(learner.server.address)
    frames = garbage_frames()
    wrong_chunk = WeightsFetch(1, ann.num_chunks, ann.sha256)  # well formed, no such chunk
    replies = []
    for frame in [*frames.values(), codec.encode(wrong_chunk, "y")]:
        sock.send(frame)  # one at a time: a peer's replies queue up to SEND_HWM, no more
        assert sock.poll(3000), "no answer to a garbage frame"
        replies.append(codec.decode(sock.recv())[1])
    assert all(isinstance(r, Error) for r in replies)
    assert "not chunk" in replies[-1].detail
    # A frame past the socket's own cap: ZeroMQ drops that peer's connection, nothing else.
    flood = ctx.socket(zmq.DEALER)
    flood.connect(learner.server.address)
    flood.send(b"\x00" * (2 * 1024 * 1024))
    time.sleep(0.2)

    stats = learner.server.stats()
    rejected = {k.split("/", 1)[1]: v for k, v in stats.items() if k.startswith("rejected/")}
    assert sum(rejected.values()) == len(frames)
    assert {"oversize", "not_msgpack", "bad_envelope", "future_version", "unknown_type",
            "unexpected_type", "invalid", "unknown_field"} <= set(rejected)
    assert stats["bad_index"] == 1 and stats["chunks"] == 0 and learner.server.alive()

    subscriber, backend = actor(control, learner.server.address), RecordingBackend()
    assert subscriber.follow(backend) == 1 and loaded_equal(backend, 1, weights(1))
    assert learner.server.stats()["chunks"] == ann.num_chunks
    sock.close(0)
    flood.close(0)
    subscriber.close()


@pytest.mark.timeout(30)
def test_stats_over_the_wire(learner, control):
    learner.publish(weights(1), 1, wait=True)
    client = WeightClient(learner.server.address)
    stats = client.channel.request(StatsRequest(), timeout_s=5)
    assert stats.values["versions"] == [1] and stats.values["chunks"] == 0
    client.close()


# --- closing, addresses, keys ------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_close_stops_the_server_thread_and_frees_the_port(tmp_path, control):
    publisher = WeightPublisher.for_run(run_cfg(LOCAL), tmp_path / "learner", control)
    address = publisher.server.address
    publisher.publish(weights(1), 1, wait=True)
    assert any(t.name == "weight-server" for t in threading.enumerate())
    publisher.close()
    assert not publisher.server.alive()
    assert not any(t.name == "weight-server" for t in threading.enumerate())

    subscriber, backend = actor(control, address, timeout_s=1.0), RecordingBackend()
    t0 = time.monotonic()
    assert subscriber.follow(backend) is None  # nobody answers any more
    assert subscriber.rejected == 1 and time.monotonic() - t0 < 5
    subscriber.close()
    again = WeightPublisher.for_run(run_cfg(address), tmp_path / "learner", control)
    try:  # the port is free again; a second server on it is refused, naming the key
        with pytest.raises(ConfigError, match="weights.address=tcp://127.0.0.1:"):
            WeightPublisher.for_run(run_cfg(address), tmp_path / "other", control)
    finally:
        again.close()


def test_plaintext_addresses_off_this_machine_are_refused_on_both_sides(tmp_path, control):
    with pytest.raises(ConfigError, match="security.keys_dir"):
        WeightPublisher.for_run(run_cfg("tcp://*:5556"), tmp_path, control)
    with pytest.raises(ConfigError, match="security.keys_dir"):
        WeightSubscriber.for_run(run_cfg("tcp://head:5556"), control, "actor-0")
    assert connect_address("tcp://*:5556") == "tcp://127.0.0.1:5556"
    assert connect_address("tcp://0.0.0.0:5556") == "tcp://127.0.0.1:5556"
    assert connect_address("tcp://head:5556") == "tcp://head:5556"


def test_without_an_address_nothing_is_served_and_files_are_read(tmp_path, control):
    publisher = WeightPublisher.for_run(run_cfg(""), tmp_path, control)
    subscriber = WeightSubscriber.for_run(run_cfg(""), control, "actor-0")
    assert publisher.server is None and subscriber.source is None
    publisher.close()


@pytest.mark.timeout(40)
def test_curve_serves_authorized_nodes_only(tmp_path, control, keys_dir):
    publisher = WeightPublisher.for_run(run_cfg(LOCAL, keys_dir), tmp_path / "learner", control)
    try:
        address = publisher.server.address
        publisher.publish(weights(1), 1, wait=True)
        chunks = codec.decode_body(WeightsAnnouncement.TYPE,
                                   control.r.get(control.keys.weights)).num_chunks

        # A node with its own copy of nodes/gpu1/ (server public key, its client pair).
        node = WeightSubscriber.for_run(run_cfg(address, keys_dir / "nodes" / "gpu1"), control,
                                        "actor-gpu1")
        backend = RecordingBackend()
        assert node.follow(backend) == 1 and loaded_equal(backend, 1, weights(1))
        node.close()

        known = CurveKeys.load(keys_dir)
        public, secret = zmq.curve_keypair()  # a valid pair the server never heard of
        strangers = [
            CurveKeys(known.server_public, public, secret),
            None,  # plaintext
        ]
        for curve in strangers:
            stranger = actor(control, address, curve=curve, timeout_s=1.0)
            assert stranger.follow(RecordingBackend()) is None
            assert stranger.rejected == 1 and stranger.version == -1
            stranger.close()
        wait_until(lambda: publisher.server.stats().get("rejected/auth", 0) >= 2)
        stats = publisher.server.stats()
        assert stats["chunks"] == chunks  # the authorized node's fetch, nothing more
        assert stats["received"] == chunks  # not one stranger frame got through
    finally:
        publisher.close()
    assert not publisher.server.alive()
