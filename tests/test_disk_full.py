"""A full disk is an answer (issue 21, part 4), on a real full file system: the run directory
on a small tmpfs, filled up. The replay server answers ``disk_full`` (never an ack for what it
did not store), keeps serving, says so in its stats, and stores again once space returns;
nothing acknowledged is lost and everything refused is stored when sent again.

Skipped, with the reason, where a tmpfs cannot be mounted (not root, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from helpers_replay import ServerProc, make_group, push_all

from protocol.replay_client import ReplayClient
from replay.store import Store


@pytest.fixture
def small_fs(tmp_path) -> Path:
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount: Path, leave_bytes: int) -> Path:
    """A file taking all of the file system's space but ``leave_bytes``."""
    import os

    st = os.statvfs(mount)
    filler = mount / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(st.f_bavail * st.f_frsize - leave_bytes, 0))
    return filler


@pytest.mark.timeout(120)
def test_a_full_disk_is_answered_and_the_store_writes_again_when_space_returns(small_fs):
    run_dir = small_fs / "run"
    # One group per write transaction: a transaction that does not fit is refused whole, so
    # with the default burst a loaded machine (more frames waiting per poll) could batch every
    # group into transactions larger than the space left and store none (seen in CI).
    server = ServerProc(run_dir, f"replay.map_size={64 << 20}", "replay.write_batch=1").start()
    client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    try:
        filler = fill(small_fs, leave_bytes=512 << 10)
        groups = [make_group(i, max_tokens=3000) for i in range(60)]  # ~40 KB each
        statuses = push_all(client, groups, timeout_s=60)
        stored = {g for g, s in statuses.items() if s == "stored"}
        refused = {g for g, s in statuses.items() if s == "error:disk_full"}
        assert stored and refused and stored | refused == set(statuses), set(statuses.values())
        stats = client.stats()  # the server still answers
        assert stats["disk_full_now"] == 1 and stats["disk_full"] >= len(refused)
        assert stats["groups"] == len(stored)
        assert "no space left on the file system" in server.log_text()

        filler.unlink()  # space returns: the refused groups, sent again, are stored
        again = push_all(client, [g for g in groups if g.group_id in refused], timeout_s=60)
        assert set(again.values()) == {"stored"}
        stats = client.stats()
        assert stats["disk_full_now"] == 0 and stats["groups"] == len(groups)
    finally:
        client.close()
        server.stop()
    store = Store(run_dir, readonly=True)  # every group, acknowledged once, is on disk
    try:
        with store.env.begin() as txn:
            assert sorted(gid for gid, _ in store.iter_bodies(txn)) == \
                sorted(g.group_id for g in groups)
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_a_disk_full_reply_backs_off_and_raises_a_transport_timeout(monkeypatch):
    from protocol.errors import ReplayDiskFull, TransportTimeout
    from protocol.messages import Error, StatsRequest

    class Refusing:  # a channel whose server answers every request with disk_full
        pending: dict = {}

        def send(self, msg, msg_id=None):
            self.sent = msg_id or "m1"
            return self.sent

        def recv(self, timeout_s):
            return [(self.sent, Error("disk_full", "no space"))]

    client = ReplayClient(channel=Refusing())
    client.disk_full_backoff_s = 0.3
    monkeypatch.setattr(client, "_collect", lambda t: client._replies.update(
        client.channel.recv(t)))
    t0 = time.monotonic()
    with pytest.raises(ReplayDiskFull, match="no space") as caught:
        client._request(StatsRequest(), object)
    assert isinstance(caught.value, TransportTimeout) and time.monotonic() - t0 >= 0.3
