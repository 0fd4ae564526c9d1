"""The replay server as its users see it: a real server process, real LMDB, real sockets."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from helpers_replay import RawPeer, ServerProc, labels_for, make_group, push_all

from protocol import codec
from protocol.errors import RemoteError
from protocol.messages import Ack, Batch, BatchRequest, Error, LedgerCommit, StepLabels
from protocol.replay_client import ReplayClient
from protocol.transport import Incoming
from replay.server import ReplayServer
from replay.store import Store, read_stats

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    srv = ServerProc(tmp_path / "run", "replay.judge_lease_s=0.5").start()
    yield srv
    srv.kill()


@pytest.fixture
def client(server):
    c = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    yield c
    c.close()


def stored_bodies(run_dir) -> dict[str, bytes]:
    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            return dict(store.iter_bodies(txn))
    finally:
        store.close()


def ids(batch: Batch) -> list[str]:
    return [g.group_id for g in batch.groups]


# --- learner -------------------------------------------------------------------------------


def test_batches_are_oldest_first_and_never_repeat(client):
    groups = [make_group(i) for i in range(60)]
    assert set(push_all(client, groups).values()) == {"stored"}
    seen = []
    while batch := ids(client.request_batch("L", num_groups=7, version=3)):
        assert len(batch) <= 7
        seen += batch
    assert seen == [g.group_id for g in groups]  # each once, in ingest order
    assert client.request_batch("L", 7, version=3).groups == []
    first = client.stats()
    assert first["groups"] == first["delivered"] == 60 and first["deliverable"] == 0


def test_batch_groups_are_byte_identical_and_carry_labels(client):
    groups = [make_group(i) for i in range(5)]
    push_all(client, groups)
    for g in groups[1:3]:
        assert client.submit_labels(labels_for(g)) == "stored"
    batch = client.request_batch("L", 10, version=3, require_labels=True)
    assert ids(batch) == [groups[1].group_id, groups[2].group_id]
    assert [lab.group_id for lab in batch.labels] == ids(batch)
    assert batch.labels[0].labels == labels_for(groups[1]).labels
    for sent, got in zip(groups[1:3], batch.groups):
        assert codec.encode_body(got) == codec.encode_body(sent)
    # the unjudged ones stay deliverable for a learner that does not need labels
    rest = client.request_batch("L", 10, version=3)
    assert ids(rest) == [groups[i].group_id for i in (0, 3, 4)] and rest.labels == []


def test_staleness_filter_counts_each_stale_group_once(client):
    groups = [make_group(0, "old", versions=(0, 1)), make_group(1, "new", versions=(8, 9)),
              make_group(2, "prompt-only", versions=(-1, -1)),
              make_group(3, "edge", versions=(6, 9)), make_group(4, "old2", versions=(2, 5))]
    push_all(client, groups)
    batch = client.request_batch("L", 10, version=10, max_staleness=4)
    assert ids(batch) == ["new", "prompt-only", "edge"]  # min version >= 10 - 4, or none
    assert batch.stale_skipped == 2
    again = client.request_batch("L", 10, version=10, max_staleness=4)
    assert again.groups == [] and again.stale_skipped == 0
    assert client.stats()["stale_skipped"] == 2
    # a learner that allows more staleness still gets them: skipped is not deleted
    assert ids(client.request_batch("L", 10, version=10, max_staleness=10)) == ["old", "old2"]


def test_ledger_resume_neither_repeats_nor_skips(server, client):
    groups = [make_group(i) for i in range(30)]
    gid = [g.group_id for g in groups]
    push_all(client, groups)
    assert client.hello("L", 0)["redeliver"] == 0
    first = ids(client.request_batch("L", 10, version=0))
    assert first == gid[:10]
    assert client.commit_ledger("L", first, version=1) == {"consumed": 10, "unknown": 0}
    assert ids(client.request_batch("L", 10, version=1)) == gid[10:20]  # trained, not committed

    server.kill()  # the replay server crashes; the learner goes on
    server.start()
    assert ids(client.request_batch("L", 5, version=1)) == gid[20:25]  # no re-delivery

    # The learner crashes and resumes from its checkpoint, which covers `first` only.
    info = client.hello("L", 1, consumed=first)
    assert info == {"consumed": 0, "redeliver": 15, "unconsumed": 0, "unknown": 0}
    resumed = []
    while batch := client.request_batch("L", 4, version=1).groups:
        resumed += [g.group_id for g in batch]
    assert resumed == gid[10:]  # delivered after the commit: again, exactly once
    client.commit_ledger("L", resumed, version=2)

    server.stop()  # a clean restart, and a learner that resumes from the newest checkpoint
    server.start()
    assert client.hello("L", 2, consumed=gid)["redeliver"] == 0
    assert client.request_batch("L", 100, version=2).groups == []
    server.stop()
    stats = read_stats(server.run_dir)
    assert stats["consumed"] == stats["delivered"] == stats["groups"] == 30


def test_lost_batch_reply_is_answered_with_the_same_groups(client):
    push_all(client, [make_group(i) for i in range(6)])
    request = BatchRequest("L", num_groups=2, version=3)
    channel = client.channel
    first = channel.request(request, timeout_s=5, msg_id="batch-1")
    retry = channel.request(request, timeout_s=5, msg_id="batch-1")  # same id: a retry
    assert ids(first) == ids(retry) == ["g-0", "g-1"]
    assert ids(channel.request(request, timeout_s=5, msg_id="batch-2")) == ["g-2", "g-3"]


# --- readers (the experience role) ---------------------------------------------------------


def test_groups_since_pages_in_ingest_order_and_takes_nothing_from_the_learner(client):
    groups = [make_group(i) for i in range(7)]
    push_all(client, groups)
    assert ids(client.request_batch("L", 2, version=3)) == ["g-0", "g-1"]
    pages, seq = [], 0
    while True:
        page = client.groups_since(seq, max_groups=3)
        pages.append(([g.group_id for g in page.groups], page.next_seq, page.more))
        if not page.more:
            break
        seq = page.next_seq
    assert pages == [(["g-0", "g-1", "g-2"], 3, True), (["g-3", "g-4", "g-5"], 6, True),
                     (["g-6"], 7, False)]
    # byte-identical, delivered or not
    got = [codec.encode_body(g) for g in client.groups_since(0, 10).groups]
    assert got == [codec.encode_body(g) for g in groups]
    nothing_new = client.groups_since(7)
    assert (nothing_new.groups, nothing_new.next_seq, nothing_new.more) == ([], 7, False)
    stats = client.stats()
    assert stats["delivered"] == 2 and stats["groups_read"] == 14
    assert ids(client.request_batch("L", 10, version=3)) == [f"g-{i}" for i in range(2, 7)]


def test_groups_since_skips_evicted_groups(tmp_path):
    with ServerProc(tmp_path / "run", "replay.max_groups=4") as server:
        client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
        push_all(client, [make_group(i) for i in range(4)])
        client.commit_ledger("L", ids(client.request_batch("L", 2, version=3)))
        push_all(client, [make_group(i) for i in range(4, 6)])  # 6 > 4: g-0, g-1 evicted
        page = client.groups_since(0)
        assert [g.group_id for g in page.groups] == ["g-2", "g-3", "g-4", "g-5"]
        assert page.next_seq == 6 and client.stats()["evicted"] == 2
        assert [g.group_id for g in client.groups_since(1).groups][:1] == ["g-2"]
        client.close()


def test_groups_since_is_bounded_and_counts_what_no_longer_decodes(tmp_path, monkeypatch):
    from protocol.config import ReplayConfig
    from protocol.messages import GroupsSince
    from replay import server as server_module
    from replay.store import GroupRecord

    server = ReplayServer(tmp_path / "run", ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        groups = [make_group(i) for i in range(4)]
        server.handle([Incoming(route=[], msg_id=g.group_id, msg=g, body=codec.encode_body(g))
                       for g in groups[:2]])
        with server.store.env.begin(write=True) as txn:  # a body from an older schema
            server.store.put_group(txn, "old", msgpack.packb({"group_id": "old"}),
                                   GroupRecord(seq=2, task_id="t", min_version=-1,
                                               max_version=-1, nbytes=20))
            server.store.put_meta(txn, "next_seq", 3)
        server._reload()
        server.handle([Incoming(route=[], msg_id=g.group_id, msg=g, body=codec.encode_body(g))
                       for g in groups[2:]])

        def read(since, n):
            [(_, reply)] = server.handle([Incoming(route=[], msg_id="r",
                                                   msg=GroupsSince(since, n))])
            return [g.group_id for g in reply.groups], reply.next_seq, reply.more, \
                reply.malformed

        assert read(0, 10) == (["g-0", "g-1", "g-2", "g-3"], 5, False, 1)
        assert read(1, 2) == (["g-1"], 3, True, 1)  # the undecodable one counts as read
        # At most READ_REPLY_BYTES of bodies, but always one group: never stuck.
        monkeypatch.setattr(server_module, "READ_REPLY_BYTES", 1)
        assert read(0, 10) == (["g-0"], 1, True, 0)
        assert read(3, 10) == (["g-2"], 4, True, 0)
    finally:
        server.close()


# --- judges --------------------------------------------------------------------------------


def test_judge_leases_expire_and_work_is_served_again(client):
    groups = [make_group(i) for i in range(3)]
    push_all(client, groups)
    # 5 s: the lines up to "everything is leased" run well within it on a loaded machine.
    start = time.monotonic()
    a = client.pull_judge_work("j1", max_groups=2, lease_s=5)
    assert [g.group_id for g in a] == ["g-0", "g-1"]
    assert codec.encode_body(a[0]) == codec.encode_body(groups[0])
    assert [g.group_id for g in client.pull_judge_work("j2", 5, lease_s=30)] == ["g-2"]
    assert client.pull_judge_work("j3", 5, lease_s=30) == []  # everything is leased
    assert client.submit_labels(labels_for(groups[0])) == "stored"
    # g-0 is judged, g-2 still leased to j2: only g-1 comes back, once j1's lease has run out
    back = []
    while not back and time.monotonic() < start + 60:
        time.sleep(0.2)
        back = client.pull_judge_work("j3", 5, lease_s=30)
    assert [g.group_id for g in back] == ["g-1"] and time.monotonic() - start >= 4.9
    assert client.submit_labels(labels_for(groups[0], 0)) == "duplicate"  # first one wins
    stats = client.stats()
    assert stats["judged"] == 1 and stats["leases_granted"] == 4


def test_labels_are_validated_against_the_group(client):
    group = next(g for g in map(make_group, range(100)) if any(t.steps for t in g.trajectories))
    push_all(client, [group])
    good = labels_for(group)
    bad = [
        StepLabels("no-such-group", good.labels),
        StepLabels(group.group_id, good.labels + [[1]]),  # one trajectory too many
        StepLabels(group.group_id, [row + [1] for row in good.labels]),  # a step too many
    ]
    for labels in bad:
        with pytest.raises(RemoteError) as err:
            client.submit_labels(labels)
        assert err.value.reason == "invalid"
    with pytest.raises(RemoteError) as err:  # 2 is neither GOOD nor BAD: refused by the schema
        client.submit_labels(StepLabels(group.group_id, [[2] * len(r) for r in good.labels]))
    assert err.value.reason == "invalid"
    assert client.stats()["rejected/invalid"] == 4
    assert client.submit_labels(good) == "stored"
    assert client.stats()["judged"] == 1


# --- capacity ------------------------------------------------------------------------------


def test_eviction_consumed_first_then_stale_never_fresh(tmp_path):
    run_dir = tmp_path / "run"
    with ServerProc(run_dir, "replay.max_groups=10") as server:
        client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
        old = [make_group(i, f"old{i}", versions=(0, 0)) for i in range(4)]
        fresh = [make_group(10 + i, f"fresh{i}", versions=(10, 10)) for i in range(6)]
        push_all(client, old + fresh)
        client.hello("L", 10)
        batch = client.request_batch("L", 3, version=10, max_staleness=4)
        assert ids(batch) == ["fresh0", "fresh1", "fresh2"] and batch.stale_skipped == 4
        client.commit_ledger("L", ["fresh0", "fresh1"], version=10)
        more = [make_group(20 + i, f"more{i}", versions=(10, 10)) for i in range(8)]

        push_all(client, more[:4])  # 14 > 10: the 2 consumed go, then the 2 oldest stale
        stats = client.stats()
        assert stats["groups"] == 10
        assert (stats["evicted"], stats["evicted_stale"]) == (4, 2)
        push_all(client, more[4:])  # the 2 other stale go; the rest is fresh: over capacity
        stats = client.stats()
        assert stats["groups"] == 12 and stats["over_capacity"] >= 1
        assert (stats["evicted"], stats["evicted_stale"]) == (6, 4)
        client.close()
    left = set(stored_bodies(run_dir))
    assert left == {g.group_id for g in fresh[2:] + more}  # fresh2 delivered, not consumed
    stats = read_stats(run_dir)
    assert (stats["groups"], stats["evicted"], stats["evicted_stale"]) == (12, 6, 4)
    with ServerProc(run_dir, "replay.max_groups=10") as server:  # counters survive a restart
        client = ReplayClient(server.address, timeout_s=10)
        assert client.stats()["evicted"] == 6
        client.close()


def test_map_full_refuses_pushes_then_a_bigger_map_takes_them(tmp_path):
    run_dir = tmp_path / "run"
    groups = [make_group(i, max_tokens=8000) for i in range(20)]  # ~100 KiB each
    server = ServerProc(run_dir, f"replay.map_size={1 << 20}").start()
    client = ReplayClient(server.address, retry_after_s=1, timeout_s=10)
    statuses = {}
    for g in groups:  # one at a time, so "the first refused" is well defined
        statuses.update(push_all(client, [g]))
    stored = [g for g in groups if statuses[g.group_id] == "stored"]
    refused = [g for g in groups if statuses[g.group_id] == "error:store_full"]
    assert stored and refused and len(stored) + len(refused) == len(groups)
    stats = client.stats()  # reads go on
    assert stats["groups"] == len(stored) and stats["store_full"] == len(refused)
    assert len(client.pull_judge_work("j", 2)) == 2
    assert "replay.map_size" in server.log_text()
    client.close()
    server.stop()
    bodies = stored_bodies(run_dir)  # nothing half-written
    assert bodies == {g.group_id: codec.encode_body(g) for g in stored}

    server.start(f"replay.map_size={64 << 20}")
    client = ReplayClient(server.address, retry_after_s=1, timeout_s=10)
    assert set(push_all(client, refused).values()) == {"stored"}
    assert set(push_all(client, stored[:2]).values()) == {"duplicate"}
    client.close()
    server.stop()
    assert stored_bodies(run_dir) == {g.group_id: codec.encode_body(g) for g in groups}
    assert read_stats(run_dir)["groups"] == len(groups)


# --- bad input -----------------------------------------------------------------------------


def _group_body_without(field: str) -> bytes:
    body = msgpack.unpackb(codec.encode_body(make_group(1)), raw=False)
    del body[field]
    return msgpack.packb(body, use_bin_type=True)


def _frame_with_int64_tokens() -> bytes:
    group = make_group(2, "wide")
    group.trajectories[0].tokens = group.trajectories[0].tokens.astype(np.int64)
    return codec.encode(group, "m-dtype")


BAD_FRAMES = {
    "not_msgpack": b"\xc1\x00not msgpack at all",
    "bad_envelope": msgpack.packb(["autodidact", 1, "group"]),
    "unknown_type": codec.pack_frame("no_such_type", "m-unknown", msgpack.packb({})),
    "future_version": codec.pack_frame("group", "m-future", codec.encode_body(make_group(3)),
                                       version=codec.SCHEMA_VERSION + 1),
    "missing_field": codec.pack_frame("group", "m-missing", _group_body_without("task")),
    "wrong_type": codec.pack_frame("group", "m-type", msgpack.packb(
        {**msgpack.unpackb(codec.encode_body(make_group(4)), raw=False), "created_at": "now"},
        use_bin_type=True)),
    "wrong_dtype": _frame_with_int64_tokens(),
    "oversize": codec.encode(make_group(5, "big", max_tokens=20_000), "m-big"),
    "unexpected_type": codec.encode(Batch(groups=[]), "m-batch"),
}


def test_bad_frames_are_refused_with_their_reason_and_counted(tmp_path):
    run_dir = tmp_path / "run"
    assert len(BAD_FRAMES["oversize"]) > 100_000
    with ServerProc(run_dir, "replay.max_frame_bytes=100000") as server:
        client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
        keep = [make_group(i) for i in range(3)]
        push_all(client, keep)
        peer = RawPeer(server.address)
        for reason, frame in BAD_FRAMES.items():
            _, reply = peer.ask(frame)
            assert isinstance(reply, Error) and reply.reason == reason, (reason, reply)
        _, reply = peer.ask(codec.encode(make_group(99), "m-ok"))  # the same peer, still served
        assert isinstance(reply, Ack) and reply.status == "stored"
        peer.close()
        stats = client.stats()
        for reason in BAD_FRAMES:
            assert stats[f"rejected/{reason}"] == 1, reason
        assert stats["groups"] == 4
        assert push_all(client, [make_group(100)]) == {"g-100": "stored"}
        assert "rejected frame" in server.log_text()
        client.close()
    expect = {g.group_id: codec.encode_body(g) for g in keep + [make_group(99), make_group(100)]}
    assert stored_bodies(run_dir) == expect


def test_handler_crash_is_answered_and_the_rest_of_the_burst_is_kept(tmp_path, monkeypatch):
    """In-process, to make a handler fail on purpose; the burst shares one LMDB txn."""
    from protocol.config import ReplayConfig

    server = ReplayServer(tmp_path / "run", ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        def boom(txn, inc):
            server.store.put_group(txn, "half-written", b"x", server.index[keep[0].group_id])
            raise RuntimeError("a bug")

        server._handlers[LedgerCommit] = boom
        keep = [make_group(i) for i in range(2)]
        burst = [Incoming(route=[], msg_id=f"m{i}", msg=g, body=codec.encode_body(g))
                 for i, g in enumerate(keep)]
        burst.insert(1, Incoming(route=[], msg_id="crash", msg=LedgerCommit("L", ["g-0"])))
        replies = {inc.msg_id: reply for inc, reply in server.handle(burst)}
        assert replies["m0"].status == replies["m1"].status == "stored"
        assert isinstance(replies["crash"], Error) and replies["crash"].reason == "invalid"
        assert server.stats()["errors/internal"] == 1
        with server.store.env.begin() as txn:
            assert server.store.body(txn, "half-written") is None
            assert server.store.body(txn, "g-1") == codec.encode_body(keep[1])
        assert not server.index["g-0"].consumed
    finally:
        server.close()


def test_read_stats_matches_the_store(server, client):
    groups = [make_group(i, versions=(i, i + 2)) for i in range(8)]
    push_all(client, groups)
    for g in groups[:3]:
        client.submit_labels(labels_for(g))
    client.hello("L", 5)
    batch = client.request_batch("L", 4, version=5, max_staleness=10)
    client.commit_ledger("L", ids(batch)[:2])
    live = client.stats()
    server.stop()
    stats = read_stats(server.run_dir)
    assert stats == {
        "groups": 8, "judged": 3, "consumed": 2, "delivered": 4, "set_aside": 0, "evicted": 0,
        "evicted_stale": 0, "bytes": sum(len(codec.encode_body(g)) for g in groups),
        "oldest_version": min(g.policy_versions()[0] for g in groups),
        "newest_version": max(g.policy_versions()[1] for g in groups)}
    assert {k: live[k] for k in stats} == stats


def test_default_address_and_addr_file(tmp_path):
    import subprocess
    import sys

    from helpers_replay import ROOT

    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "autodidact.cli", "replay", "--run-dir",
                             str(run_dir)], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not (run_dir / "replay.addr").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        address = (run_dir / "replay.addr").read_text().strip()
        assert address == f"ipc://{run_dir.resolve()}/replay.sock" or address.startswith("tcp://")
        client = ReplayClient(address, timeout_s=10)
        assert client.stats()["groups"] == 0
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    assert not (run_dir / "replay.addr").exists()
