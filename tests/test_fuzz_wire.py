"""Bad input on the other side of the wire: what clients decode, and the weight channel.

* The codec, in process, on garbage for every registered message type (requests, replies,
  weights, tasks): it returns a validated message or raises SchemaError, nothing else.
* A rogue ROUTER answering a ZmqChannel / ReplayClient with garbage before (or instead of)
  the real answer: random bytes, truncated and flipped frames, extra parts, a broken body
  under the request's own id, answers to other ids, frames deeper than msgpack allows. The
  client drops what does not decode (and logs it), still takes the real answer when it comes,
  and raises nothing but TransportTimeout or RemoteError.
* The weight channel from the outside: random, truncated and mutated announcement bodies in
  Redis and random, truncated and mutated files at the announced path. WeightSubscriber.poll
  never raises and never returns a state other than the announced, digest-checked one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from helpers_replay import damage, labels_for, make_group, mutate_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol.errors import REJECT_REASONS, RemoteError, SchemaError, TransportTimeout
from protocol.messages import (
    Ack,
    Batch,
    Error,
    JudgeWork,
    Stats,
    StatsRequest,
    Step,
    StoredGroups,
    Trajectory,
    WeightsAnnouncement,
)
from protocol.transport import ZmqChannel

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])

# --- the codec, every registered type -----------------------------------------------------------

GROUP = make_group(3, "wire-group")
SAMPLES = {  # one valid body per registered type, the mutations' starting points
    tag: codec.encode_body(msg) for tag, msg in {
        "task": GROUP.task, "step": Step("cd docs", "ok", 0, 1, True, {"tool": "cd"}),
        "trajectory": GROUP.trajectories[0], "group": GROUP,
        "labels": labels_for(GROUP), "judge_work": JudgeWork([GROUP]),
        "batch": Batch([GROUP], [labels_for(GROUP)], 1, 2), "stats": Stats({"groups": 3}),
        "ack": Ack("stored", {"consumed": 1}), "error": Error("invalid", "x"),
        "stored_groups": StoredGroups([GROUP], next_seq=7, more=True, malformed=1),
        "weights": WeightsAnnouncement(3, 1, 10, "ab" * 32, ["cd" * 32], path="/w/v3"),
    }.items()
}
TAGS = sorted(codec.registered_types())

wrong_values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3), st.lists(st.lists(st.integers(0, 2))),
    st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1), max_size=2),
    st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=24)),
    # array payloads: [dtype, shape, data] with every part possibly wrong
    st.builds(lambda d, s, b: msgpack.ExtType(1, msgpack.packb([d, s, b])),
              st.sampled_from(["<i4", "<f4", "|u1", ">i4", "<i8", "O", "", "<U3"]),
              st.one_of(st.lists(st.integers(-2, 2**41), max_size=3), st.just([]),
                        st.just([True]), st.just("3")),
              st.binary(max_size=16)),
)


def _decode_only_schema_errors(frame: bytes, max_bytes=None):
    try:
        env, msg = codec.decode(frame, max_bytes)
    except SchemaError as exc:
        assert exc.reason in REJECT_REASONS
        return None
    # whatever decodes is a validated message that encodes again
    codec.decode(codec.encode(msg, env.msg_id))
    return msg


@given(st.sampled_from(sorted(SAMPLES)), st.sampled_from(TAGS), st.data())
@SETTINGS
def test_codec_raises_only_schema_errors(tag, claimed, data):
    """Mutated bodies of every type, under their own tag or another one."""
    tree = msgpack.unpackb(SAMPLES[tag], raw=False)
    for _ in range(data.draw(st.integers(1, 3))):
        mutate_tree(tree, data, wrong_values)
    body = msgpack.packb(tree, use_bin_type=True)
    _decode_only_schema_errors(codec.pack_frame(data.draw(st.sampled_from([tag, claimed])),
                                                "id", body))


@given(st.sampled_from(sorted(SAMPLES)), st.binary(max_size=64), st.data())
@SETTINGS
def test_codec_on_truncated_flipped_and_random_bytes(tag, noise, data):
    frame = codec.pack_frame(tag, "id", SAMPLES[tag])
    how = data.draw(st.sampled_from(["truncate", "flip", "random", "append", "body"]))
    if how in ("truncate", "flip"):
        frame = damage(frame, how, data, max_flips=4)
    elif how == "random":
        frame = noise
    elif how == "append":
        frame += noise or b"\x00"
    else:
        body = SAMPLES[tag][:data.draw(st.integers(0, len(SAMPLES[tag])))] + noise
        frame = codec.pack_frame(tag, "id", body)
    _decode_only_schema_errors(frame)


@pytest.mark.parametrize("case", [
    "0-d tokens", "2-d tokens", "shape overflow", "negative shape", "bool shape",
    "object dtype", "big-endian dtype", "deep body", "deep frame"])
def test_codec_edge_cases(case):
    t = msgpack.unpackb(codec.encode_body(GROUP.trajectories[0]), raw=False)

    def arr(dtype, shape, data):
        return msgpack.ExtType(1, msgpack.packb([dtype, shape, data]))

    frame = None
    if case == "0-d tokens":
        t["tokens"] = arr("<i4", [], b"\0\0\0\0")
    elif case == "2-d tokens":
        t["tokens"] = arr("<i4", [1, 1], b"\0\0\0\0")
    elif case == "shape overflow":
        t["tokens"] = arr("<i4", [2**39, 2**39, 2**39], b"")
    elif case == "negative shape":
        t["tokens"] = arr("<i4", [-1], b"")
    elif case == "bool shape":
        t["tokens"] = arr("<i4", [True], b"\0\0\0\0")
    elif case == "object dtype":
        t["tokens"] = arr("|O", [1], b"\0" * 8)
    elif case == "big-endian dtype":
        t["tokens"] = arr(">i4", [1], b"\0" * 4)
    elif case == "deep body":
        frame = codec.pack_frame("trajectory", "id", b"\x81\xa4info" + b"\x91" * 100_000)
    else:
        frame = b"\x91" * 100_000 + b"\xc0"
    frame = frame or codec.pack_frame("trajectory", "id", msgpack.packb(t, use_bin_type=True))
    with pytest.raises(SchemaError):
        codec.decode(frame)


def test_bool_is_not_a_schema_version():
    frame = msgpack.packb(["autodidact", True, "stats_request", "", b"\x80"], use_bin_type=True)
    with pytest.raises(SchemaError, match="bad_envelope"):
        codec.decode(frame)


# --- a rogue server answering a client ------------------------------------------------------------


class Rogue:
    """A ROUTER that answers each request by a plan: garbage frames first, then (maybe) an
    answer under the request's msg id."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.plans: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            route, frame = self.sock.recv_multipart()
            msg_id = codec.unpack_envelope(frame).msg_id
            try:
                garbage, answer = self.plans.get(timeout=5)
            except queue.Empty:
                continue
            for parts in garbage:
                self.sock.send_multipart([route, *_build(parts, msg_id)])
            if answer is not None:
                self.sock.send_multipart([route, codec.encode(answer, msg_id)])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)


def _build(item, msg_id: str) -> list[bytes]:
    """The frames of one garbage item (see ``garbage``) for a request with ``msg_id``."""
    kind, arg = item
    answer = codec.encode(Stats({"real": False}), msg_id)
    if kind == "raw":
        return [arg]
    if kind == "truncated":
        return [answer[:int(len(answer) * arg)]]
    if kind == "flipped":  # under another id: what still decodes must not pass for the answer
        frame = bytearray(codec.encode(Stats({"real": False}), "other-" + msg_id))
        for where, xor in arg:
            frame[int(where * len(frame))] ^= xor
        return [bytes(frame)]
    if kind == "other_id":
        return [codec.encode(Stats({"real": False}), arg + msg_id)]
    if kind == "bad_body":  # the request's own id, a body that does not validate
        return [codec.pack_frame(arg[0], msg_id, arg[1])]
    if kind == "version":
        return [codec.pack_frame("stats", msg_id, codec.encode_body(Stats({})), arg)]
    if kind == "parts":
        return [answer[:5], b"", arg]
    if kind == "deep":
        return [b"\x91" * arg + b"\xc0"]
    raise AssertionError(kind)


_bad_traj = msgpack.unpackb(codec.encode_body(GROUP.trajectories[0]), raw=False)
_bad_traj["tokens"] = msgpack.ExtType(1, msgpack.packb(["<i4", [], b"\0\0\0\0"]))
_bad_batch = msgpack.packb({"groups": [{**msgpack.unpackb(codec.encode_body(GROUP), raw=False),
                                        "trajectories": [_bad_traj]}]}, use_bin_type=True)
garbage = st.lists(st.one_of(
    st.tuples(st.just("raw"), st.binary(max_size=200)),
    st.tuples(st.just("raw"), st.sampled_from([b"", b"\x00" * 3_000_000])),
    st.tuples(st.just("truncated"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flipped"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                                                     st.integers(1, 255)), min_size=1,
                                           max_size=4)),
    st.tuples(st.just("other_id"), st.sampled_from(["x", "other-", "retry-"])),
    st.tuples(st.just("bad_body"), st.sampled_from([
        ("batch", _bad_batch), ("stats", b"\x93\x01\x02\x03"), ("stats", b""),
        ("stats", msgpack.packb({"values": 3})), ("nope", b"\x80"), ("ack", b"\xc1"),
        ("error", msgpack.packb({"reason": 7})), ("stats", b"\x81\xa6values" + b"\x91" * 5000),
    ])),
    st.tuples(st.just("version"), st.sampled_from([0, codec.SCHEMA_VERSION + 1, 2**40, -1])),
    st.tuples(st.just("parts"), st.binary(max_size=20)),
    st.tuples(st.just("deep"), st.sampled_from([100, 100_000])),
), max_size=6)


@pytest.fixture(scope="module")
def rogue():
    server = Rogue()
    yield server
    server.close()


@pytest.fixture(scope="module")
def channel(rogue):
    ch = ZmqChannel(rogue.address, retry_after_s=30)
    yield ch
    ch.close()


@given(garbage, st.integers(0, 10**6))
@settings(SETTINGS, max_examples=150)
def test_client_drops_garbage_and_takes_the_real_answer(rogue, channel, caplog, junk, n):
    rogue.plans.put((junk, Stats({"real": True, "n": n})))
    counted = sum(channel.dropped.values())
    with caplog.at_level(logging.WARNING, logger="protocol.transport"):
        caplog.clear()
        reply = channel.request(StatsRequest(), timeout_s=10)
    assert reply == Stats({"real": True, "n": n})
    assert channel.pending == {}
    dropped = [r for r in caplog.records if "undecodable" in r.getMessage()]
    undecodable = sum(kind in ("raw", "truncated", "bad_body", "version", "parts", "deep")
                      for kind, _ in junk)
    assert len(dropped) >= undecodable  # each one logged
    assert sum(channel.dropped.values()) - counted == len(dropped)  # and counted by reason


@given(garbage)
@settings(SETTINGS, max_examples=10)
def test_client_given_only_garbage_times_out_cleanly(rogue, channel, junk):
    rogue.plans.put((junk, None))
    with pytest.raises(TransportTimeout):
        channel.request(StatsRequest(), timeout_s=0.15)
    assert channel.pending == {}


def test_client_given_an_error_raises_remote_error(rogue, channel):
    rogue.plans.put(([("raw", b"junk")], Error("invalid", "no")))
    with pytest.raises(RemoteError, match="invalid"):
        channel.request(StatsRequest(), timeout_s=5)


@pytest.mark.parametrize("call, wrong", [
    ("stats", Ack()), ("pull_judge_work", Stats({})), ("request_batch", Ack()),
    ("hello", Stats({})), ("submit_labels", Batch([])), ("groups_since", Batch([])),
    ("request_batch", StoredGroups([], 0))])
def test_replay_client_given_a_reply_of_the_wrong_type(rogue, call, wrong):
    from protocol.replay_client import ReplayClient

    client = ReplayClient(rogue.address, retry_after_s=30, timeout_s=2)
    args = {"stats": (), "pull_judge_work": ("j",), "request_batch": ("L", 1, 0),
            "hello": ("L", 0), "submit_labels": (labels_for(GROUP),),
            "groups_since": (0,)}[call]
    try:
        rogue.plans.put(([], wrong))
        with pytest.raises(RemoteError, match="unexpected_type"):
            getattr(client, call)(*args)
    finally:
        client.close()


# --- the weight channel, from the outside ---------------------------------------------------------


@pytest.fixture
def published(control, tmp_path):
    """A real published version (WeightPublisher), its file bytes and its announcement."""
    import torch

    from protocol.weights import WeightPublisher

    pub = WeightPublisher(tmp_path, control)
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    pub.publish(state, version=1, wait=True)
    body = control.r.get(control.keys.weights)
    ann = codec.decode_body(WeightsAnnouncement.TYPE, body)
    with open(ann.path, "rb") as f:
        data = f.read()
    return state, data, body, ann


def _announce(control, body: bytes, version=2) -> None:
    control.r.set(control.keys.weights, body)
    control.r.set(control.keys.version, version)


def _poll_checked(control, published):
    """poll() on a fresh subscriber: never raises; a state only if it is the published one."""
    from protocol.weights import WeightSubscriber

    state, data, _, _ = published
    got = WeightSubscriber(control, "fuzz-actor").poll()
    if got is not None:
        version, loaded, _ = got
        assert sorted(loaded) == sorted(state)
        for k in state:
            assert np.array_equal(loaded[k].numpy(), state[k].numpy())
    return got


def test_published_version_loads(control, published):
    assert _poll_checked(control, published)[0] == 1


def _digests_of(data: bytes, ann: WeightsAnnouncement, path: str) -> bytes:
    """An announcement that matches ``data`` exactly: a publisher that wrote garbage."""
    from protocol.weights import chunk_digests

    digests = chunk_digests(data)
    return codec.encode_body(WeightsAnnouncement(
        version=ann.version + 1, num_chunks=len(digests), total_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(), chunk_sha256=digests, path=path))


@given(st.data())
@settings(SETTINGS, max_examples=120)
def test_torn_random_and_mutated_files_never_load(control, published, tmp_path, data):
    _, good, body, ann = published
    how = data.draw(st.sampled_from(["truncate", "flip", "random", "empty", "append",
                                     "matching-garbage"]))
    if how in ("truncate", "flip"):
        bad = damage(good, how, data, max_flips=3)
    elif how in ("random", "matching-garbage"):
        bad = data.draw(st.one_of(st.binary(max_size=300), st.just(b"\xff" * 8 + b"{}"),
                                  st.just(len(good).to_bytes(8, "little") + good[8:])))
    elif how == "empty":
        bad = b""
    else:
        bad = good + data.draw(st.binary(min_size=1, max_size=50))
    path = tmp_path / "weights" / "fuzzed.safetensors"
    path.write_bytes(bad)
    if how == "matching-garbage":  # digests computed over the garbage itself
        _announce(control, _digests_of(bad, ann, str(path)))
    else:  # the real announcement, pointing at bytes that are not what it announced
        tree = msgpack.unpackb(body, raw=False)
        tree["path"], tree["version"] = str(path), ann.version + 1
        _announce(control, msgpack.packb(tree, use_bin_type=True))
    got = _poll_checked(control, published)
    assert got is None or bad == good


@given(st.data())
@settings(SETTINGS, max_examples=150)
def test_garbage_announcements_never_raise(control, published, tmp_path, data):
    _, good, body, ann = published
    how = data.draw(st.sampled_from(["random", "truncate", "flip", "field", "path"]))
    if how == "random":
        bad = data.draw(st.binary(max_size=200))
    elif how == "truncate":
        bad = body[:data.draw(st.integers(0, len(body) - 1))]
    elif how == "flip":
        buf = bytearray(body)
        for _ in range(data.draw(st.integers(1, 3))):
            buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
        bad = bytes(buf)
    else:
        tree = msgpack.unpackb(body, raw=False)
        if how == "field":
            key = data.draw(st.sampled_from(sorted(tree)))
            tree[key] = data.draw(st.one_of(wrong_values, st.sampled_from(
                [-1, 0, 2**63 - 1, -2**63, "", [""], ["zz"] * 3, float("nan")])))
        else:
            tree["path"] = data.draw(st.sampled_from([
                "", "/", str(tmp_path), str(tmp_path / "missing"), "relative/v1",
                "x" * 5000, "/proc/self/status", "\u00fc\U0001f642"]))
            tree["version"] = ann.version + 1
        bad = msgpack.packb(tree, use_bin_type=True)
    version = data.draw(st.sampled_from([2, 10**12, -5]))
    _announce(control, bad, version)
    _poll_checked(control, published)


@pytest.mark.parametrize("path", ["\x00", "/tmp/\x00/v1", "{good}\x00"])
def test_announced_path_with_a_nul_byte_never_raises(control, published, path):
    _, _, body, ann = published
    tree = msgpack.unpackb(body, raw=False)
    tree["path"], tree["version"] = path.format(good=ann.path), ann.version + 1
    _announce(control, msgpack.packb(tree, use_bin_type=True))
    assert _poll_checked(control, published) is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_announced_path_that_is_not_a_regular_file_never_blocks(control, published, tmp_path,
                                                                 kind):
    """A FIFO would block a plain read forever and /dev/zero would fill memory."""
    _, _, body, ann = published
    path = {"fifo": tmp_path / "fifo", "dev_zero": Path("/dev/zero"), "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    tree = msgpack.unpackb(body, raw=False)
    tree["path"], tree["version"] = str(path), ann.version + 1
    _announce(control, msgpack.packb(tree, use_bin_type=True))
    assert _poll_checked(control, published) is None


@pytest.mark.parametrize("version", [
    b"9" * 400, b"-3", b"abc", b"", b"1.5", b"\xff\xfe"])
def test_garbage_version_key_never_raises(control, published, version):
    """The version key is the first thing poll reads (``int(...)`` of a Redis string)."""
    control.r.set(control.keys.version, version)
    _poll_checked(control, published)


def test_trajectory_arrays_must_match_its_dtype():
    """A reply built by hand with int64 tokens is refused, not coerced (sanity for the rogue
    cases above, which rely on the codec refusing what the schema does not allow)."""
    t = GROUP.trajectories[0]
    frame = codec.encode(Trajectory(traj_id="x", tokens=t.tokens.astype(np.int64),
                                    logprobs=t.logprobs, versions=t.versions,
                                    action_mask=t.action_mask), "id")
    with pytest.raises(SchemaError, match="wrong_dtype"):
        codec.decode(frame)
