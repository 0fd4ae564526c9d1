"""The LMDB layer on its own, and ReplayServer.handle on bursts built by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from helpers_replay import labels_for, make_group

from protocol import codec
from protocol.config import ReplayConfig
from protocol.messages import Error, JudgePull, StatsRequest
from protocol.run_dir import RunDir, StoreDamaged, check_lmdb_store
from protocol.transport import Incoming
from replay.server import ReplayServer
from replay.store import (
    EVICTED,
    GroupRecord,
    Store,
    read_stats,
    seq_key,
    store_path,
)


def test_record_round_trip():
    rec = GroupRecord(seq=7, task_id="t", min_version=-1, max_version=-1, nbytes=10,
                      judged=True, delivered=False, consumed=True, created=1.5)
    assert GroupRecord.unpack(rec.pack()) == rec


def test_index_loads_in_ingest_order_and_delete_removes_everything(tmp_path):
    store = Store(tmp_path, map_size=1 << 24)
    names = ["b", "a", "d", "c"]  # key order differs from ingest order
    with store.env.begin(write=True) as txn:
        for seq, name in enumerate(names):
            rec = GroupRecord(seq, "task", 0, 1, 3)
            store.put_group(txn, name, b"abc", rec)
            store.put_labels(txn, name, b"lab", rec)
        store.put_meta(txn, EVICTED, 5)
    with store.env.begin(write=True) as txn:
        index = store.load_index(txn)
        assert list(index) == names
        store.delete_group(txn, "d", index["d"])
    with store.env.begin() as txn:
        assert list(store.load_index(txn)) == ["b", "a", "c"]
        assert store.body(txn, "d") is None and store.labels(txn, "d") is None
        assert store.get_meta(txn, EVICTED) == 5 and store.get_meta(txn, "nothing", 1) == 1
    store.close()
    stats = read_stats(tmp_path)
    assert (stats["groups"], stats["bytes"], stats["evicted"]) == (3, 9, 5)
    assert (stats["oldest_version"], stats["newest_version"]) == (0, 1)


def test_read_stats_without_a_store(tmp_path):
    stats = read_stats(tmp_path)
    assert stats["groups"] == 0 and stats["oldest_version"] is None
    assert not store_path(tmp_path).exists()  # reading never creates one


def test_read_stats_ignores_groups_without_generated_tokens(tmp_path):
    store = Store(tmp_path, map_size=1 << 24)
    with store.env.begin(write=True) as txn:
        store.put_group(txn, "p", b"x", GroupRecord(0, "t", -1, -1, 1))
    store.close()
    stats = read_stats(tmp_path)
    assert stats["groups"] == 1 and stats["newest_version"] is None


def _grow_the_map(run_dir: str, map_size: int) -> None:
    """A writer (another process, as the replay server is) that grows the map and commits."""
    store = Store(run_dir, map_size=map_size)
    with store.env.begin(write=True) as txn:
        store.put_group(txn, "big", b"x" * (2 << 20), GroupRecord(0, "t", 0, 0, 1))
    store.close()


def test_a_reader_adopts_the_map_a_live_writer_grew(tmp_path):
    """status and read_stats open the store read-only beside the server; a map the server grew
    after the reader's env was opened must not fail the reader (MDB_MAP_RESIZED)."""
    import multiprocessing as mp

    store = Store(tmp_path, map_size=1 << 20)
    store.close()
    reader = Store(tmp_path, map_size=1 << 20, readonly=True)
    try:
        writer = mp.get_context("spawn").Process(target=_grow_the_map,
                                                 args=(str(tmp_path), 64 << 20))
        writer.start()
        writer.join(60)
        assert writer.exitcode == 0
        reader.db = reader._open_dbs(readonly=True)  # what Store() does right after opening
        with reader.env.begin() as txn:
            assert txn.get(b"big", db=reader.db["groups"]) == b"x" * (2 << 20)
    finally:
        reader.close()


def test_a_reader_opening_mid_growth_retries_instead_of_failing(tmp_path, monkeypatch):
    """The race CI hit: the env open itself reads a meta page the writer has just outgrown.
    The read-only open tries again; a writer's open still fails at once."""
    import lmdb

    from replay import store as store_mod

    Store(tmp_path, map_size=1 << 20).close()
    real_open, failures = lmdb.open, []

    def open_resized_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(store_mod.lmdb, "open", open_resized_once)
    assert read_stats(tmp_path)["groups"] == 0
    assert failures == [1]
    failures.clear()
    with pytest.raises(lmdb.MapResizedError):
        Store(tmp_path, map_size=1 << 20)


@pytest.fixture
def server(tmp_path):
    srv = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    yield srv
    srv.close()


def incoming(msg, msg_id="m"):
    return Incoming(route=[], msg_id=msg_id, msg=msg, body=codec.encode_body(msg))


def test_a_burst_with_the_same_group_twice_stores_it_once(server):
    g = make_group(1)
    replies = server.handle([incoming(g, "a"), incoming(g, "b"), incoming(StatsRequest())])
    assert [r.status for _, r in replies[:2]] == ["stored", "duplicate"]
    assert replies[2][1].values["groups"] == 1  # reads run after the commit: they see it
    assert server.counters["write_txns"] == 1


def test_second_server_on_the_same_store_is_refused(server, tmp_path):
    with pytest.raises(RuntimeError, match="another replay server"):
        ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")


def test_map_full_refuses_the_pushes_of_the_burst_and_serves_reads(tmp_path):
    srv = ReplayServer(tmp_path, ReplayConfig(map_size=1 << 20), "tcp://127.0.0.1:*")
    try:
        first = make_group(0)
        srv.handle([incoming(first)])
        big = [make_group(i, max_tokens=8000) for i in range(1, 12)]
        replies = srv.handle([incoming(g, g.group_id) for g in big] +
                             [incoming(labels_for(first), "lab"), incoming(JudgePull("j", 1))])
        by_id = {inc.msg_id: r for inc, r in replies}
        assert all(isinstance(by_id[g.group_id], Error) and by_id[g.group_id].reason ==
                   "store_full" for g in big)  # the whole burst's pushes: nothing half-written
        assert by_id["lab"].status == "stored"  # the small write still fits
        assert [g.group_id for g in by_id["m"].groups] == []  # judged already: nothing to do
        assert list(srv.index) == [first.group_id]
    finally:
        srv.close()
    assert read_stats(tmp_path)["groups"] == 1 and read_stats(tmp_path)["judged"] == 1


def _store_with_pages(run_dir) -> Path:
    store = Store(run_dir, map_size=64 * 1024**2)
    with store.env.begin(write=True) as txn:
        for i in range(200):
            txn.put(seq_key(i), bytes([i % 251]) * 4000, db=store.db["groups"])
    store.close()
    return RunDir(run_dir).replay_store / "data.mdb"


def _cut(fraction: float):
    def damage(f, size):
        f.truncate(int(size * fraction))
    return damage


def _zero_the_meta_pages(f, size):
    f.write(bytes(8192))


@pytest.mark.parametrize("damage, reason", [(_cut(0.5), "cut short"), (_cut(0.001), "cut short"),
                                            (_zero_the_meta_pages, "not an LMDB data file")])
def test_a_damaged_store_is_refused_in_one_line_not_a_sigbus(tmp_path, damage, reason):
    """Mapping a truncated data.mdb and reading past its end kills the process with SIGBUS;
    the command must refuse it first (run in a subprocess, so a regression cannot take the
    test runner down with it)."""
    data = _store_with_pages(tmp_path)
    check_lmdb_store(data.parent)  # whole: accepted
    size = data.stat().st_size
    with data.open("r+b") as f:
        damage(f, size)
    with pytest.raises(StoreDamaged, match=str(data)):
        check_lmdb_store(data.parent)
    done = subprocess.run([sys.executable, "-m", "autodidact.cli", "replay", "stats",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and str(data) in errors[0]
    assert reason in errors[0]


def test_replay_check_verifies_every_group_and_names_a_damaged_one(tmp_path):
    from click.testing import CliRunner

    from autodidact.cli import main

    server = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    groups = [make_group(i) for i in range(5)]
    server.handle([incoming(g, g.group_id) for g in groups])
    server.handle([incoming(labels_for(groups[0]), "lab")])
    server.close()
    ok = CliRunner().invoke(main, ["replay", "check", "--run-dir", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "5 groups, 5 verified, 0 stored before checksums (decoded only), 0 damaged" in \
        ok.output

    store = Store(tmp_path, map_size=1 << 24)
    with store.env.begin(write=True) as txn:
        # One body with a flipped byte (same length), one label body altered, and one record
        # as stored before checksums existed.
        body = bytearray(store.body(txn, groups[1].group_id))
        body[len(body) // 2] ^= 0xFF
        txn.put(groups[1].group_id.encode(), bytes(body), db=store.db["groups"])
        txn.put(groups[0].group_id.encode(), b"not the labels", db=store.db["labels"])
        old = GroupRecord.unpack(txn.get(groups[2].group_id.encode(), db=store.db["index"]))
        old.crc32 = old.labels_crc32 = -1
        txn.put(groups[2].group_id.encode(), msgpack.packb(
            [getattr(old, name) for name in ("seq", "task_id", "min_version", "max_version",
                                             "nbytes", "judged", "delivered", "consumed",
                                             "created")]), db=store.db["index"])
    store.close()
    bad = CliRunner().invoke(main, ["replay", "check", "--run-dir", str(tmp_path)])
    assert bad.exit_code == 1
    assert f"damaged {groups[1].group_id}: body does not match its checksum" in bad.output
    assert f"damaged {groups[0].group_id}: labels do not match their checksum" in bad.output
    assert "5 groups, 2 verified, 1 stored before checksums (decoded only), 2 damaged" in \
        bad.output
    assert "restore it from a copy" in bad.output


def test_a_hello_from_an_older_checkpoint_serves_again_what_only_a_newer_one_covered(server):
    """A learner that fell back to its previous checkpoint (the latest was damaged) says hello
    with the older ledger: groups consumed under the lost checkpoint are trained again, once."""
    from protocol.messages import BatchRequest, LearnerHello, LedgerCommit

    groups = [make_group(i) for i in range(3)]
    ids = [g.group_id for g in groups]
    server.handle([incoming(g, g.group_id) for g in groups])
    server.handle([incoming(LearnerHello("learner", 0), "h1")])
    (_, batch), = server.handle([incoming(BatchRequest("learner", 3, 0), "b1")])
    assert sorted(g.group_id for g in batch.groups) == sorted(ids)
    server.handle([incoming(LedgerCommit("learner", ids, 1), "c1")])
    (_, ack), = server.handle([incoming(LearnerHello("learner", 0, ids[:1]), "h2")])
    assert ack.info["unconsumed"] == 2 and ack.info["redeliver"] == 2
    (_, again), = server.handle([incoming(BatchRequest("learner", 3, 0), "b2")])
    assert sorted(g.group_id for g in again.groups) == sorted(ids[1:])
