"""Hypothesis throws garbage at a live replay server: random bytes, truncated frames, flipped
bytes, deleted fields, values of the wrong type, extreme values (huge and negative ints, NaN,
inf, huge strings and lists, deep nesting), broken envelopes (schema versions, unknown and
reply-only type tags, the body of another type), for every message type the server accepts:
Group, StepLabels, JudgePull, LearnerHello, BatchRequest, LedgerCommit, StatsRequest and
GroupsSince. A batch request that asks to wait (``timeout_s``) and finds nothing to serve is
held; the fuzzer then sends the same learner a newer request, which must release it with an
empty batch.

Every frame is answered; a frame the codec refuses gets exactly the codec's reason; every
refusal is counted by reason in the server's stats; no handler crashes. At the end the server
serves valid traffic correctly, and its store is exactly explained by the frames it
acknowledged: the groups are the ones whose push was answered ``stored`` (byte for byte), the
judged ones are those whose labels were answered ``stored``, only groups named by an
acknowledged ledger commit or hello are consumed, and the protected groups (ids no fuzzed frame
ever contains) are neither judged nor consumed."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

import msgpack
import numpy as np
import pytest
from helpers_replay import (
    RawPeer,
    ServerProc,
    base_frames,
    labels_for,
    make_group,
    mutate_tree,
    push_all,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol.errors import REJECT_REASONS, SchemaError
from protocol.messages import (
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
    Step,
    StepLabels,
    StoredGroups,
    Task,
)
from protocol.replay_client import ReplayClient
from replay.store import Store

pytestmark = pytest.mark.slow

MAX_FRAME = 2_000_000  # the fuzzed server's replay.max_frame_bytes (ZeroMQ drops past 2x)
# Ids no fuzzed frame contains (and no mutation of one can reach): these groups must come out
# neither judged nor consumed. The decoys are named by the frames the mutations start from.
PROTECTED = [make_group(i, f"protected-{i}-" + hashlib.sha256(bytes([i])).hexdigest())
             for i in range(3)]
DECOY = [make_group(100 + i, f"decoy-{i}") for i in range(3)]
STORED = PROTECTED + DECOY
BASE = base_frames(DECOY)  # valid frames the mutations start from: every type served
REPLIES = {Group: Ack, StepLabels: Ack, LedgerCommit: Ack, LearnerHello: Ack,
           JudgePull: JudgeWork, BatchRequest: Batch, StatsRequest: Stats,
           GroupsSince: StoredGroups}
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

wrong_values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1), max_size=2),
    st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=24)),
)
# Values of a plausible type that no well-behaved peer sends, by the type they stand in for.
EXTREME = {
    int: st.sampled_from([-2**63, -2**31 - 1, -1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1,
                          2**64 - 1, 10**9, -10**9]),
    float: st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e308, 5e-324,
                            -1e-9, 0.0, 1e12]),
    str: st.one_of(st.sampled_from(["x" * 600, "\u00fc" * 300, "\U0001f642" * 200,
                                    "y" * 100_000]),  # past LMDB's 511-byte keys
                   st.sampled_from(["", "\x00", "nope", "decoy-0", "decoy-1", "fuzz-base",
                                    "\u202e", "a/b", "../..", "last_batch/fuzz-learner"]),
                   st.text(max_size=40)),
    list: st.one_of(
        st.lists(st.sampled_from(["decoy-0", "nope", "", "x" * 600]), max_size=50),
        st.lists(st.lists(st.integers(-1, 2), max_size=5), max_size=5),  # label rows, any shape
        st.builds(lambda n: ["nope"] * n, st.sampled_from([1000, 50_000])),
        st.builds(lambda n: [[]] * n, st.sampled_from([1000, 50_000]))),
}
extreme_values = st.one_of(*EXTREME.values())


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = ServerProc(tmp_path_factory.mktemp("fuzz") / "run",
                        f"replay.max_frame_bytes={MAX_FRAME}").start()
    client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    assert set(push_all(client, STORED).values()) == {"stored"}
    peer = RawPeer(server.address)
    seen: Counter = Counter()  # Error reasons the fuzzer got back
    accepted: list = []  # (message, raw body, reply) of every frame the server did not refuse
    yield server, client, peer, seen, accepted
    peer.close()
    client.close()
    server.kill()


def _ask(live, frame: bytes):
    """Send one frame; check the answer against what the codec makes of the frame, count
    refusals and record what was accepted (the store must be explained by exactly that)."""
    _, _, peer, seen, accepted = live
    try:
        env, msg = codec.decode(frame, MAX_FRAME)
        refused = None
    except SchemaError as exc:
        refused = exc.reason
    if refused is None and isinstance(msg, BatchRequest) and msg.timeout_s > 0 and env.msg_id:
        reply = _ask_held(peer, frame, msg, env.msg_id)
    else:
        _, reply = peer.ask(frame)
    if refused is not None:  # the server decodes with the same codec: the same refusal
        assert isinstance(reply, Error) and reply.reason == refused, (refused, reply)
    elif type(msg) not in REPLIES:
        assert isinstance(reply, Error) and reply.reason == "unexpected_type", reply
    elif isinstance(reply, Error):  # decodes, but inconsistent with what is stored
        assert reply.reason == "invalid", reply
    else:
        assert isinstance(reply, REPLIES[type(msg)]), (msg, reply)
        accepted.append((msg, env.body, reply))
    if isinstance(reply, Error):
        assert reply.reason in REJECT_REASONS, reply
        seen[reply.reason] += 1
    return reply


def _ask_held(peer, frame: bytes, msg: BatchRequest, msg_id: str):
    """A batch request that may be held (nothing to serve, time to wait): if no answer comes
    at once, a newer request of the same learner (which serves nothing: 0 groups) releases it,
    and both are answered."""
    peer.sock.send(frame)
    if peer.sock.poll(300):
        env, reply = codec.decode(peer.sock.recv())
        assert env.msg_id == msg_id
        return reply
    release = "release-" + msg_id[:100] + "-"  # an id of its own
    newer = BatchRequest(msg.learner_id, 0, msg.version, msg.max_staleness)
    first = peer.ask(codec.encode(newer, release))
    replies = {env.msg_id: reply for env, reply in (first, _recv(peer))}
    assert set(replies) == {msg_id, release}, replies
    assert replies[release] == Batch(groups=[])
    return replies[msg_id]


def _recv(peer, timeout_s: float = 5.0):
    assert peer.sock.poll(int(timeout_s * 1000)), "no reply: is the server still alive?"
    return codec.decode(peer.sock.recv())


@given(st.binary(max_size=600))
@SETTINGS
def test_random_bytes(live, data):
    assert isinstance(_ask(live, data), Error)


@given(st.sampled_from(BASE), st.floats(0, 1, exclude_max=True))
@SETTINGS
def test_truncated_frames(live, frame, cut):
    assert isinstance(_ask(live, frame[:int(len(frame) * cut)]), Error)


@given(st.sampled_from(BASE),
       st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                min_size=1, max_size=4))
@SETTINGS
def test_flipped_bytes(live, frame, flips):
    data = bytearray(frame)
    for where, xor in flips:
        data[int(where * len(data))] ^= xor
    _ask(live, bytes(data))  # may still be valid (e.g. a token id changed): any answer will do


@given(st.sampled_from(BASE), st.data())
@SETTINGS
def test_mutated_fields(live, frame, data):
    _, _, type_tag, msg_id, body, _credential = msgpack.unpackb(frame, raw=False)
    tree = msgpack.unpackb(body, raw=False)  # arrays stay opaque ExtType values
    mutate_tree(tree, data, wrong_values)
    mutated = codec.pack_frame(type_tag, msg_id, msgpack.packb(tree, use_bin_type=True))
    _ask(live, mutated)


@pytest.mark.parametrize("which", range(len(BASE)), ids=[
    codec.unpack_envelope(f).type_tag for f in BASE])
@given(data=st.data())
@SETTINGS
def test_extreme_field_values(live, which, data):
    """Fields of a valid frame of each type set to extreme values of their type (num_groups
    2**64-1, lease_s inf, version -1, a 600-byte learner_id...): one top-level field alone, or
    each with even odds and then up to two anywhere (values of any type)."""
    _, _, type_tag, msg_id, body, _credential = msgpack.unpackb(BASE[which], raw=False)
    tree = msgpack.unpackb(body, raw=False)
    values = st.one_of(extreme_values, wrong_values)
    names = [n for n in sorted(tree) if type(tree[n]) in EXTREME]
    if names and data.draw(st.booleans()):  # one top-level field, the rest left valid
        name = data.draw(st.sampled_from(names))
        tree[name] = data.draw(EXTREME[type(tree[name])])
    else:  # each top-level field (the ones handlers read) with even odds, then anywhere
        for name in names:
            if data.draw(st.booleans()):
                kind = type(tree[name])
                tree[name] = data.draw(EXTREME[kind] if data.draw(st.integers(0, 3)) else values)
        for _ in range(data.draw(st.integers(0, 2))):
            mutate_tree(tree, data, values)
    _ask(live, codec.pack_frame(type_tag, msg_id, msgpack.packb(tree, use_bin_type=True)))


TAGS = sorted(codec.registered_types())


@given(st.sampled_from(range(len(BASE))), st.data())
@SETTINGS
def test_broken_envelopes(live, which, data):
    """The envelope around a valid body: schema versions, type tags (unknown, reply-only,
    another type's), the body of another message, ids and magic of the wrong type, missing or
    extra elements, a body that is not bytes."""
    outer = msgpack.unpackb(BASE[which], raw=False)
    other = msgpack.unpackb(BASE[data.draw(st.sampled_from(range(len(BASE))))], raw=False)
    how = data.draw(st.sampled_from(["version", "tag", "body", "msg_id", "magic", "length",
                                     "body_type", "credential"]))
    if how == "version":
        outer[1] = data.draw(st.sampled_from([0, -1, 1, 3, 99, 2**63 - 1, 2**64 - 1, True,
                                              1.0, 2.0, "2", None, [2]]))
    elif how == "tag":
        outer[2] = data.draw(st.one_of(st.sampled_from(TAGS), st.text(max_size=12),
                                       st.sampled_from(["", "Group", "group ", "\x00",
                                                        "x" * 10_000]),
                                       st.none(), st.integers(-2**63, 2**63 - 1)))
    elif how == "body":  # a valid envelope whose body is another type's
        outer[4] = other[4]
    elif how == "msg_id":
        outer[3] = data.draw(st.sampled_from([None, 5, b"x", ["x"], "", "x" * 100_000,
                                              "\x00", "group:decoy-0"]))
    elif how == "magic":
        outer[0] = data.draw(st.sampled_from(["Autodidact", "", None, b"autodidact", 0]))
    elif how == "credential":  # not a string, far too long, or another role's made-up one
        outer[5] = data.draw(st.sampled_from([None, 5, b"x", ["x"], "x" * 100_000, "0" * 48]))
    elif how == "length":
        outer = outer[:data.draw(st.integers(0, 5))] if data.draw(st.booleans()) \
            else outer + [data.draw(wrong_values)]
    else:
        outer[4] = data.draw(st.one_of(
            wrong_values, st.just(msgpack.unpackb(outer[4], raw=False)),
            st.just(msgpack.packb([1, 2, 3])), st.just(msgpack.packb({1: 2})),
            st.just(msgpack.packb({"a": 1}) + b"trailing")))
    _ask(live, msgpack.packb(outer, use_bin_type=True))


def _deep(depth: int, array: bool = True) -> bytes:
    """msgpack bytes of ``depth`` nested one-element arrays (maps) around nil: deeper than
    msgpack.packb would ever write, so made by hand."""
    return (b"\x91" * depth if array else b"\x81\xa1k" * depth) + b"\xc0"


def _body_with(msg, field: str, raw_value: bytes) -> bytes:
    """``msg``'s body with ``field`` replaced by raw msgpack bytes."""
    tree = msgpack.unpackb(codec.encode_body(msg), raw=False)
    tree.pop(field, None)
    head = msgpack.packb(tree, use_bin_type=True)
    n = len(tree) + 1
    assert n < 16 and head[0] == 0x80 + len(tree)  # a fixmap: one more entry is one byte off
    return bytes([0x80 + n]) + head[1:] + msgpack.packb(field) + raw_value


_BASE_MSGS = [codec.decode(f)[1] for f in BASE]
DEEP = [(type(m).TYPE, f, d, a) for m in _BASE_MSGS
        for f in [f for f in msgpack.unpackb(codec.encode_body(m), raw=False)][:2] or ["x"]
        for d in (40, 3000, 200_000) for a in (True, False)]


@pytest.mark.parametrize("tag, field, depth, array", DEEP, ids=[
    f"{t}.{f}-{d}-{'list' if a else 'map'}" for t, f, d, a in DEEP])
def test_deep_nesting(live, tag, field, depth, array):
    msg = next(m for m in _BASE_MSGS if type(m).TYPE == tag)
    body = _body_with(msg, field, _deep(depth, array))
    assert isinstance(_ask(live, codec.pack_frame(tag, "deep", body)), Error)
    # and the whole frame nested instead of its body
    assert isinstance(_ask(live, _deep(depth, array)), Error)


def _frame(msg, msg_id="named"):
    return codec.encode(msg, msg_id)


_N7 = len(make_group(7).trajectories[0].tokens)


def _group_with(**traj):
    """A valid group with its first trajectory's fields replaced (arrays included)."""
    g = make_group(7, "hostile-group")
    t = g.trajectories[0]
    for key, value in traj.items():
        setattr(t, key, value)
    return g


NAMED = [  # (case, frame, expected reply type or Error reason)
    ("batch num_groups 10**9", _frame(BatchRequest("fuzz-learner", 10**9, 3)), Batch),
    ("batch num_groups -1", _frame(BatchRequest("fuzz-learner", -1, 3)), "invalid"),
    ("batch num_groups -2**63", _frame(BatchRequest("fuzz-learner", -2**63, 3)), "invalid"),
    ("batch num_groups 2**64-1", _frame(BatchRequest("fuzz-learner", 2**64 - 1, 3)), "invalid"),
    ("batch version -1", _frame(BatchRequest("fuzz-learner", 1, -1)), "invalid"),
    ("batch version 2**40", _frame(BatchRequest("fuzz-learner", 1, 2**40)), "invalid"),
    ("batch max_staleness -5", _frame(BatchRequest("fuzz-learner", 1, 3, -5)), "invalid"),
    ("batch deadline nan", _frame(BatchRequest("fuzz-learner", 1, 3, 4, True, float("nan"))),
     "invalid"),
    ("batch deadline -inf", _frame(BatchRequest("fuzz-learner", 1, 3, 4, True, -float("inf"))),
     "invalid"),
    ("batch timeout inf", _frame(BatchRequest("fuzz-learner", 1, 3, timeout_s=float("inf"))),
     "invalid"),
    ("batch timeout 61", _frame(BatchRequest("fuzz-learner", 1, 3, timeout_s=61.0)),
     "invalid"),
    ("batch timeout -1", _frame(BatchRequest("fuzz-learner", 1, 3, timeout_s=-1.0)), "invalid"),
    ("batch learner_id 600 bytes", _frame(BatchRequest("L" * 600, 1, 3)), "invalid"),
    # held (nothing to serve, time to wait), then released by a newer request (see _ask_held)
    ("batch held 0 groups", _frame(BatchRequest("fuzz-waiter", 0, 3, timeout_s=60)), Batch),
    ("batch held judged only", _frame(BatchRequest("fuzz-waiter", 10**6, 3, 4, True,
                                                   timeout_s=60), "named-2"), Batch),
    ("since seq -1", _frame(GroupsSince(-1, 1)), "invalid"),
    ("since seq 2**63", _frame(GroupsSince(2**63, 1)), "invalid"),
    ("since seq 2**63-1", _frame(GroupsSince(2**63 - 1, 1)), StoredGroups),
    ("since max_groups 0", _frame(GroupsSince(0, 0)), "invalid"),
    ("since max_groups 10**6", _frame(GroupsSince(0, 10**6)), "invalid"),
    ("since max_groups 4096", _frame(GroupsSince(0, 4096)), StoredGroups),
    ("batch learner_id unicode", _frame(BatchRequest("\U0001f642" * 10, 1, 3)), Batch),
    ("pull lease -1", _frame(JudgePull("fuzz-judge", 1, -1.0)), "invalid"),
    ("pull lease inf", _frame(JudgePull("fuzz-judge", 1, float("inf"))), "invalid"),
    ("pull lease nan", _frame(JudgePull("fuzz-judge", 1, float("nan"))), "invalid"),
    ("pull lease 1e12", _frame(JudgePull("fuzz-judge", 1, 1e12)), "invalid"),
    ("pull max_groups -3", _frame(JudgePull("fuzz-judge", -3, 0.01)), "invalid"),
    ("pull max_groups 10**9", _frame(JudgePull("fuzz-judge", 10**9, 0.01)), JudgeWork),
    ("pull judge_id 1 MB", _frame(JudgePull("j" * 2**20, 1, 0.01)), "invalid"),
    ("ledger unknown ids", _frame(LedgerCommit("fuzz-learner", ["nope", "", "x" * 600])), Ack),
    ("ledger 100k unknown ids", _frame(LedgerCommit("fuzz-learner", ["nope"] * 100_000)), Ack),
    ("ledger version -7", _frame(LedgerCommit("fuzz-learner", ["nope"], -7)), "invalid"),
    ("hello version -1", _frame(LearnerHello("fuzz-learner", -1, [])), "invalid"),
    ("hello learner_id 600 bytes", _frame(LearnerHello("L" * 600, 0, [])), "invalid"),
    ("group id 600 bytes", _frame(make_group(8, "g" * 600)), "invalid"),
    ("group id empty", _frame(dataclasses.replace(make_group(8), group_id="")), "invalid"),
    ("group id unicode", _frame(make_group(8, "\U0001f642\u202e\u00fc-group")), Ack),
    ("group id NUL", _frame(make_group(8, "nul\x00group")), Ack),
    ("group duplicate id, other body", _frame(make_group(9, "decoy-0")), Ack),
    ("group no trajectories", _frame(Group("no-trajs", DECOY[0].task, [])), "invalid"),
    ("group negative token", _frame(_group_with(tokens=-np.ones(_N7, np.int32))), "invalid"),
    ("group mask 7", _frame(_group_with(action_mask=np.full(_N7, 7, np.uint8))), "invalid"),
    ("group reward nan", _frame(_group_with(reward=float("nan"))), "invalid"),
    ("group reward inf", _frame(_group_with(reward=float("inf"))), "invalid"),
    ("group logprobs nan", _frame(_group_with(logprobs=np.full(_N7, np.nan, np.float32))),
     "invalid"),
    ("group 0-d tokens", _frame(_group_with(tokens=np.array(3, np.int32))), "invalid"),
    ("group 2-d tokens", _frame(_group_with(tokens=np.zeros((2, 2), np.int32))), "invalid"),
    ("group step past the end", _frame(_group_with(steps=[Step("a", "o", 0, 10**6)])),
     "invalid"),
    ("group 1 MB query", _frame(Group("big-query", Task("t", "files", "q" * 2**20, 0),
                                      make_group(1).trajectories)), Ack),
    ("labels rows wrong shape", _frame(StepLabels(DECOY[1].group_id, [[1] * 50])), "invalid"),
    ("labels value 2", _frame(StepLabels(DECOY[1].group_id, [[2]])), "invalid"),
    ("labels unknown group", _frame(StepLabels("nope", [[1]])), "invalid"),
    ("labels 50k rows", _frame(StepLabels(DECOY[1].group_id, [[]] * 50_000)), "invalid"),
    ("stats", _frame(StatsRequest()), Stats),
]


@pytest.mark.parametrize("frame, expected", [c[1:] for c in NAMED], ids=[c[0] for c in NAMED])
def test_named_hostile_requests(live, frame, expected):
    reply = _ask(live, frame)
    if isinstance(expected, str):
        assert isinstance(reply, Error) and reply.reason == expected, reply
    else:
        assert isinstance(reply, expected), reply


def test_oversize_frames(live):
    """Over replay.max_frame_bytes: refused as oversize. Over twice that: ZeroMQ drops the
    sender's connection before the server sees it; the server serves on."""
    assert _ask(live, b"\x00" * (MAX_FRAME + 1)).reason == "oversize"
    frame = codec.pack_frame("group", "big", b"\x80" + b"\x00" * MAX_FRAME)
    assert _ask(live, frame).reason == "oversize"
    server = live[0]
    rogue = RawPeer(server.address)
    try:
        rogue.sock.send(b"\x00" * (3 * MAX_FRAME))
        assert not rogue.sock.poll(300), "a frame past the socket cap was answered"
    finally:
        rogue.close()
    assert isinstance(_ask(live, _frame(StatsRequest())), Stats)


def test_zz_still_serving_and_nothing_touched(live):
    """Runs after the fuzzers (file order): the server serves valid traffic correctly, and its
    store is exactly what the acknowledged frames explain."""
    server, client, _, seen, accepted = live
    assert sum(seen.values()) > 1000
    # What the fuzzed frames the server accepted may have done.
    stored = {g.group_id: codec.encode_body(g) for g in STORED}
    judged, may_consume = {}, set()
    for msg, body, reply in accepted:
        if isinstance(msg, Group) and reply.status == "stored":
            assert msg.group_id not in stored, msg.group_id  # stored once, first one wins
            stored[msg.group_id] = body
        elif isinstance(msg, StepLabels) and reply.status == "stored":
            assert msg.group_id not in judged
            judged[msg.group_id] = body
        elif isinstance(msg, (LedgerCommit, LearnerHello)):
            may_consume |= set(msg.group_ids if isinstance(msg, LedgerCommit) else msg.consumed)
    assert not may_consume & {g.group_id for g in PROTECTED}

    # Valid traffic, answered correctly: a learner restarting at version 0 (fuzzed requests
    # moved the learner version; this resets it, and redelivers what was delivered)...
    client.hello("after-learner", 0, [])
    new = make_group(999, "after-fuzz")
    assert push_all(client, [new]) == {"after-fuzz": "stored"}
    assert isinstance(_ask(live, codec.encode(make_group(998, "raw-ok"), "ok")), Ack)
    stored.update({g.group_id: codec.encode_body(g) for g in (new, make_group(998, "raw-ok"))})
    # ...a judge gets the new group (nothing else holds a lease on it) and labels it...
    work = client.pull_judge_work("after-judge", 10**6, lease_s=30)
    assert "after-fuzz" in {g.group_id for g in work}
    assert not {g.group_id for g in work} & set(judged)
    assert client.submit_labels(labels_for(new)) == "stored"
    judged[new.group_id] = codec.encode_body(labels_for(new))
    # ...and the learner gets every unconsumed group, byte-identical, with its labels.
    stats = client.stats()
    batch = client.request_batch("after-learner", 10**6, version=0, max_staleness=10)
    got = [g.group_id for g in batch.groups]
    assert len(got) == len(set(got)) == stats["groups"] - stats["consumed"]
    assert {"after-fuzz", "raw-ok", *(g.group_id for g in PROTECTED)} <= set(got)
    for g in batch.groups:
        if g.group_id in {s.group_id for s in STORED} | {"after-fuzz", "raw-ok"}:
            assert codec.encode_body(g) == stored[g.group_id], g.group_id
    assert {lab.group_id for lab in batch.labels} == set(judged) & set(got)
    assert client.commit_ledger("after-learner", ["after-fuzz"]) == {"consumed": 1,
                                                                      "unknown": 0}
    may_consume.add("after-fuzz")

    stats = client.stats()
    assert stats.get("errors/internal", 0) == 0  # every bad input was refused, none crashed
    assert stats["batch_held"] >= 1 and stats["batches_held"] == 0  # held ones all answered
    assert stats.get("errors/store", 0) == 0
    for reason, n in seen.items():
        if reason != "store_full":
            assert stats[f"rejected/{reason}"] == n, reason
    assert sum(v for k, v in stats.items() if k.startswith("rejected/")) == sum(seen.values())
    assert server.stop() == 0

    store = Store(server.run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            bodies = dict(store.iter_bodies(txn))
            index = store.load_index(txn)
            labels = {gid: store.labels(txn, gid) for gid in index}
    finally:
        store.close()
    assert bodies == stored  # no group lost, altered or let in unacknowledged
    assert {gid for gid, rec in index.items() if rec.judged} == set(judged)
    assert {gid: body for gid, body in labels.items() if body is not None} == judged
    consumed = {gid for gid, rec in index.items() if rec.consumed}
    assert consumed <= may_consume
    for g in PROTECTED:
        assert not (index[g.group_id].judged or index[g.group_id].consumed), g.group_id
    for body in bodies.values():  # whatever got in was a valid group
        assert isinstance(codec.decode_body(Group.TYPE, body), Group)
