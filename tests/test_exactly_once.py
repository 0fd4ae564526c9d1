"""Nothing lost, nothing twice: 4 actor processes push 2,000 groups each, re-sending some at
random, while the replay server is SIGKILLed and restarted twice mid-stream. Afterwards LMDB
holds exactly the 8,000 groups, byte-identical to what was sent, and every push was acked."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections import Counter

import pytest
from helpers_replay import ServerProc, make_group

from protocol import codec
from protocol.replay_client import ReplayClient
from replay.store import Store, read_stats

CLIENTS = 4
PER_CLIENT = 2000
WINDOW = 16  # pushes in flight per client
DUP_PROB = 0.1  # chance that a push is followed by a re-send of an earlier group


def push_worker(address: str, client: int, results) -> None:
    """Push groups (client, 0..PER_CLIENT-1) with random re-sends until all are acked."""
    rng = random.Random(client)
    replay = ReplayClient(address, retry_after_s=0.3)
    acked: dict[str, str] = {}
    statuses: Counter = Counter()
    sent = resent = 0
    deadline = time.monotonic() + 150
    while len(acked) < PER_CLIENT and time.monotonic() < deadline:
        while sent < PER_CLIENT and len(replay.unacked()) < WINDOW:
            replay.push_group(make_group((client, sent)))
            sent += 1
            if rng.random() < DUP_PROB:  # an actor that lost track and sends again
                replay.push_group(make_group((client, rng.randrange(sent))))
                resent += 1
        for gid, status in replay.poll_acks(0.05):
            statuses[status] += 1
            acked.setdefault(gid, status)
    results.put({"client": client, "acked": sorted(acked), "statuses": dict(statuses),
                 "resent": resent, "transport_resends": replay.channel.resends})
    replay.close()


def _wait_for(run_dir, groups: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while read_stats(run_dir)["groups"] < groups:  # read-only, beside the live writer
        assert time.monotonic() < deadline, f"stuck below {groups} groups"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_exactly_once_across_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    server = ServerProc(run_dir, "replay.write_batch=64").start()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    workers = [ctx.Process(target=push_worker, args=(server.address, c, results))
               for c in range(CLIENTS)]
    try:
        for w in workers:
            w.start()
        total = CLIENTS * PER_CLIENT
        for fraction in (0.2, 0.6):  # both kills land while the clients are mid-stream
            _wait_for(run_dir, int(total * fraction))
            server.kill()
            assert read_stats(run_dir)["groups"] < total
            time.sleep(0.3)  # clients keep sending into the void, then retry
            server.start()
        reports = [results.get(timeout=180) for _ in workers]
        for w in workers:
            w.join(10)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
        server.stop()

    for report in reports:
        print({k: v for k, v in report.items() if k != "acked"})
        assert len(report["acked"]) == PER_CLIENT, report["statuses"]
        assert set(report["statuses"]) <= {"stored", "duplicate"}, report["statuses"]
    assert sum(r["resent"] for r in reports) > 0
    assert sum(r["statuses"].get("duplicate", 0) for r in reports) > 0

    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            stored = dict(store.iter_bodies(txn))
            index = store.load_index(txn)
    finally:
        store.close()
    assert len(stored) == len(index) == CLIENTS * PER_CLIENT
    for c in range(CLIENTS):
        for i in range(PER_CLIENT):
            group = make_group((c, i))
            assert stored[group.group_id] == codec.encode_body(group), group.group_id
    seqs = sorted(rec.seq for rec in index.values())
    assert len(set(seqs)) == len(seqs)  # one ingest slot per group, none reused after a kill
    stats = read_stats(run_dir)
    assert stats["groups"] == CLIENTS * PER_CLIENT
    assert stats["bytes"] == sum(map(len, stored.values()))
