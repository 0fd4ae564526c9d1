"""Hypothesis throws garbage at a live replay server: random bytes, truncated frames, flipped
bytes, deleted fields and values of the wrong type. Every frame is answered, every refusal is
counted, no handler crashes, and the stored groups are exactly what valid pushes sent."""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest
from helpers_replay import RawPeer, ServerProc, labels_for, make_group, push_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol.errors import REJECT_REASONS
from protocol.messages import (
    Ack,
    BatchRequest,
    Error,
    Group,
    JudgePull,
    LearnerHello,
    LedgerCommit,
    StatsRequest,
)
from replay.client import ReplayClient
from replay.store import Store

pytestmark = pytest.mark.slow

STORED = [make_group(i) for i in range(4)]
BASE = [  # valid frames the mutations start from
    codec.encode(make_group(10, "fuzz-base"), "f-group"),
    codec.encode(labels_for(STORED[0]), "f-labels"),
    codec.encode(JudgePull("fuzz-judge", 1, 0.01), "f-pull"),
    codec.encode(BatchRequest("fuzz-learner", 1, 3), "f-batch"),
    codec.encode(LedgerCommit("fuzz-learner", ["nope"]), "f-ledger"),
    codec.encode(LearnerHello("fuzz-learner", 3, []), "f-hello"),
    codec.encode(StatsRequest(), "f-stats"),
]
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

wrong_values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1), max_size=2),
    st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=24)),
)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = ServerProc(tmp_path_factory.mktemp("fuzz") / "run").start()
    client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    assert set(push_all(client, STORED).values()) == {"stored"}
    peer = RawPeer(server.address)
    seen: Counter = Counter()  # Error reasons the fuzzer got back
    yield server, client, peer, seen
    peer.close()
    client.close()
    server.kill()


def _ask(live, frame: bytes):
    _, _, peer, seen = live
    env, reply = peer.ask(frame)
    if isinstance(reply, Error):
        assert reply.reason in REJECT_REASONS, reply
        seen[reply.reason] += 1
    return reply


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


def _paths(obj, prefix=()):
    """Every (container, key) in a decoded msgpack tree: the places a mutation can hit."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        yield prefix + (key,)
        if isinstance(value, (dict, list)):
            yield from _paths(value, prefix + (key,))


@given(st.sampled_from(BASE), st.data())
@SETTINGS
def test_mutated_fields(live, frame, data):
    _, _, type_tag, msg_id, body = msgpack.unpackb(frame, raw=False)
    tree = msgpack.unpackb(body, raw=False)  # arrays stay opaque ExtType values
    paths = list(_paths(tree))
    if paths:
        path = data.draw(st.sampled_from(paths))
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(wrong_values)
    else:
        tree[data.draw(st.text(max_size=6))] = data.draw(wrong_values)
    mutated = codec.pack_frame(type_tag, msg_id, msgpack.packb(tree, use_bin_type=True))
    _ask(live, mutated)


def test_zz_still_serving_and_nothing_touched(live):
    """Runs after the fuzzers (file order): the server is alive and consistent."""
    server, client, _, seen = live
    assert sum(seen.values()) > 300
    new = make_group(999, "after-fuzz")
    assert push_all(client, [new]) == {"after-fuzz": "stored"}
    assert isinstance(_ask(live, codec.encode(make_group(998, "raw-ok"), "ok")), Ack)
    stats = client.stats()
    assert stats.get("errors/internal", 0) == 0  # every bad input was refused, none crashed
    for reason, n in seen.items():
        if reason != "store_full":
            assert stats[f"rejected/{reason}"] == n, reason
    server.stop()
    store = Store(server.run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            bodies = dict(store.iter_bodies(txn))
    finally:
        store.close()
    for g in STORED + [new]:
        assert bodies[g.group_id] == codec.encode_body(g)
    for body in bodies.values():  # whatever got in was a valid group
        assert isinstance(codec.decode_body(Group.TYPE, body), Group)
    assert stats["groups"] == len(bodies)
