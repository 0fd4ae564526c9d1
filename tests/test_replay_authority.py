"""Each role has only its own powers on the replay socket (issue 21, part 6): only actors push,
only judges lease and label, only the learner takes batches, commits the ledger and moves the
learner version with a hello. Without CURVE keys the role token in the frame's envelope
decides; with keys, the sender's key. Refusals are counted and named; every role is still
served its own requests.

Tokens fail closed (issue 36, part 6): once a run directory has any, a role without one is
refused; only a store made on a directory without tokens serves any role, until tokens are
made; an older store whose directory has none is refused at start, naming the command."""

from __future__ import annotations

import contextlib
import shutil
import threading

import pytest
from helpers_replay import ServerProc, labels_for, make_group, push_all

from protocol.config import ReplayConfig
from protocol.errors import RemoteError
from protocol.messages import MAX_VERSION, REPLAY_ROLES
from protocol.replay_client import ReplayClient
from protocol.run_dir import RunDir, role_token
from protocol.security import CurveKeys
from replay.server import ReplayServer
from replay.store import ROLES_BY_TOKEN, Store


def push_one(client: ReplayClient, group) -> str:
    """A push answered or refused, as a blocking call (pushes are pipelined)."""
    client.push_group(group)
    for _ in range(100):
        for _gid, status in client.poll_acks(0.1):
            if status.startswith("error:"):
                raise RemoteError(status[len("error:"):], "")
            return status
    raise AssertionError("push not answered")


# One request per writing role, sent as that role would.
ATTEMPTS = {
    "actor": lambda c, groups: push_one(c, groups[-1]),
    "judge": lambda c, groups: c.pull_judge_work("judge-0", max_groups=1),
    "learner": lambda c, groups: c.request_batch("learner", 1, 0),
}


def assert_refused(role: str, call, *args) -> None:
    """``call(*args)`` is refused as not coming from the run's ``role``."""
    with pytest.raises(RemoteError) as refused:
        call(*args)
    assert refused.value.reason == "unauthorized"
    if refused.value.detail:  # a push's refusal comes back as an ack status only
        assert f"{role}.token" in refused.value.detail and f"authorized/{role}/" \
            in refused.value.detail


@pytest.mark.timeout(60)
def test_role_tokens_give_each_role_its_own_requests_only(tmp_path):
    tokens = {role: role_token(tmp_path, role, create=True) for role in REPLAY_ROLES}
    assert len(set(tokens.values())) == 3 and all(len(t) == 48 for t in tokens.values())
    for role in REPLAY_ROLES:
        assert RunDir(tmp_path).role_token(role).stat().st_mode & 0o077 == 0
        assert role_token(tmp_path, role, create=True) == tokens[role]  # made once
    groups = [make_group(i) for i in range(6)]
    with ServerProc(tmp_path) as server:
        clients = {role: ReplayClient(server.address, timeout_s=10, credential=token)
                   for role, token in tokens.items()}
        strangers = [ReplayClient(server.address, timeout_s=10),
                     ReplayClient(server.address, timeout_s=10, credential="0" * 48)]
        actor, judge, learner = clients["actor"], clients["judge"], clients["learner"]
        try:
            assert set(push_all(actor, groups[:5]).values()) == {"stored"}
            work = judge.pull_judge_work("judge-0", max_groups=1)
            assert judge.submit_labels(labels_for(work[0])) == "stored"
            refused = 0
            for holder, client in [*clients.items(), ("none", strangers[0]),
                                   ("wrong", strangers[1])]:
                for role, attempt in ATTEMPTS.items():
                    if role != holder:
                        assert_refused(role, attempt, client, groups)
                        refused += 1
                if holder != "learner":
                    assert_refused("learner", client.hello, "learner", MAX_VERSION)
                    refused += 1
                if holder != "judge":
                    assert_refused("judge", client.submit_labels, labels_for(groups[1]))
                    refused += 1
            stats = strangers[0].stats()  # reads need no role
            assert stats["rejected/unauthorized"] == refused == 20
            assert stats["groups"] == 5 and stats["judged"] == 1  # nothing refused was stored
            assert stats["learner_version"] != MAX_VERSION
            assert "the sender is not the run's" in server.log_text()

            learner.hello("learner", 0)
            batch = learner.request_batch("learner", 6, 0)
            assert sorted(g.group_id for g in batch.groups) == \
                sorted(g.group_id for g in groups[:5])
            assert learner.commit_ledger("learner", [g.group_id for g in batch.groups],
                                         1)["consumed"] == 5
        finally:
            for client in (*clients.values(), *strangers):
                client.close()
    store = (tmp_path / "replay.lmdb" / "data.mdb").read_bytes()
    assert not any(t.encode() in store for t in tokens.values())  # envelopes are not stored


@pytest.mark.timeout(60)
def test_a_role_without_a_token_is_refused_when_the_run_has_tokens(tmp_path):
    """The judge's token is missing: its requests are refused whatever they carry, one line
    naming the file and the command, counted and logged; the other roles are served on."""
    tokens = {role: role_token(tmp_path, role, create=True) for role in ("learner", "actor")}
    groups = [make_group(i) for i in range(3)]
    with ServerProc(tmp_path) as server:
        actor = ReplayClient(server.address, timeout_s=10, credential=tokens["actor"])
        learner = ReplayClient(server.address, timeout_s=10, credential=tokens["learner"])
        judges = [ReplayClient(server.address, timeout_s=10, credential=c)
                  for c in ("", tokens["actor"], "0" * 48)]
        try:
            assert set(push_all(actor, groups).values()) == {"stored"}
            for judge in judges:
                for call, args in ((judge.pull_judge_work, ("judge-0",)),
                                   (judge.submit_labels, (labels_for(groups[0]),))):
                    with pytest.raises(RemoteError) as refused:
                        call(*args)
                    assert refused.value.reason == "unauthorized"
                    detail = refused.value.detail
                    assert "\n" not in detail and "no judge.token" in detail
                    assert "autodidact keys tokens --run-dir" in detail
            stats = learner.stats()
            assert stats["rejected/unauthorized"] == 6 and stats["judged"] == 0
            assert len(learner.request_batch("learner", 3, 0).groups) == 3  # served on
        finally:
            for client in (actor, learner, *judges):
                client.close()
        log = server.log_text()
    assert "roles by token (learner, actor); no judge token: those requests are refused" in log
    assert "refused judge_pull: the sender is not the run's judge" in log
    assert f"{tmp_path} has no judge.token" in log


@pytest.mark.timeout(90)
def test_a_store_made_without_tokens_serves_any_role_until_tokens_are_made(tmp_path):
    """A bare store (tests, benches) is served open, with a warning; once `autodidact keys
    tokens` made tokens it is closed, and deleting them later does not open it again."""
    with ServerProc(tmp_path) as server:
        client = ReplayClient(server.address, timeout_s=10)
        try:
            push_all(client, [make_group(1)])
            assert len(client.request_batch("learner", 1, 0).groups) == 1
        finally:
            client.close()
    assert "has no role tokens: any client may act as any role" in server.log_text()
    assert_keys_tokens_makes(tmp_path, made=REPLAY_ROLES)
    with server, anonymous_and_learner(server, tmp_path) as (anonymous, learner):
        assert_refused("actor", push_one, anonymous, make_group(2))
        assert len(learner.request_batch("learner", 1, 0).groups) == 0  # served, as learner
    for role in REPLAY_ROLES:
        RunDir(tmp_path).role_token(role).unlink()
    assert_refused_at_start(server)


@pytest.mark.timeout(90)
def test_an_old_store_without_tokens_is_refused_at_start_naming_the_command(tmp_path):
    """A store written before tokens existed, in a directory without any, must not be served
    to everyone: the server exits with one line naming `autodidact keys tokens`; after it,
    the store is served by token, its groups kept."""
    server = ServerProc(tmp_path)
    with server:
        client = ReplayClient(server.address, timeout_s=10)
        try:
            push_all(client, [make_group(1)])
        finally:
            client.close()
    forget_the_token_record(tmp_path)  # as an older server left it
    assert_refused_at_start(server)
    assert_keys_tokens_makes(tmp_path, made=REPLAY_ROLES)
    with server, anonymous_and_learner(server, tmp_path) as (anonymous, learner):
        assert_refused("learner", anonymous.request_batch, "learner", 1, 0)
        assert [g.group_id for g in learner.request_batch("learner", 1, 0).groups] == \
            [make_group(1).group_id]


@contextlib.contextmanager
def anonymous_and_learner(server: ServerProc, run_dir):
    """Two clients of a running server: one presenting no token, one the learner's."""
    anonymous = ReplayClient(server.address, timeout_s=10)
    learner = ReplayClient(server.address, timeout_s=10,
                           credential=role_token(run_dir, "learner"))
    try:
        yield anonymous, learner
    finally:
        anonymous.close()
        learner.close()


def forget_the_token_record(run_dir) -> None:
    store = Store(run_dir)
    try:
        with store.env.begin(write=True) as txn:
            store.delete_meta(txn, ROLES_BY_TOKEN)
    finally:
        store.close()


def assert_refused_at_start(server: ServerProc) -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        server.start()
    assert server.proc.returncode != 0
    last = server.log_text().strip().splitlines()[-1]
    assert last.startswith("Error: ") and "has no role tokens" in last, last
    assert f"autodidact keys tokens --run-dir {server.run_dir}" in last


def assert_keys_tokens_makes(run_dir, made) -> None:
    from click.testing import CliRunner

    from autodidact.cli import main

    result = CliRunner().invoke(main, ["keys", "tokens", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert f"made {', '.join(f'{r}.token' for r in made)}" in result.output
    for role in REPLAY_ROLES:
        assert RunDir(run_dir).role_token(role).stat().st_mode & 0o077 == 0
    again = CliRunner().invoke(main, ["keys", "tokens", "--run-dir", str(run_dir)])
    assert "made nothing" in again.output  # existing tokens are kept, never replaced


@pytest.mark.timeout(60)
def test_with_curve_keys_the_sender_key_decides_the_role(tmp_path, keys_dir):
    """Keys from ``autodidact keys generate``: the head's learner pair takes batches, a worker
    node's actor pair only pushes, its judge pair only judges, a client pair only reads; a key
    of the older flat authorized/ layout may act as every role. Tokens play no part."""
    keys = shutil.copytree(keys_dir, tmp_path / "keys")
    node = keys / "nodes" / "gpu1"
    shutil.copyfile(node / "client.key", keys / "authorized" / "old.key")  # flat: any role
    (tmp_path / "run").mkdir()
    role_token(tmp_path / "run", "learner", create=True)  # ignored when keys are on
    server = ReplayServer(tmp_path / "run", ReplayConfig(), "tcp://127.0.0.1:*",
                          curve=CurveKeys.load(keys))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def client(keys: CurveKeys) -> ReplayClient:
        return ReplayClient(server.address, retry_after_s=0.5, timeout_s=10, curve=keys)

    actor, judge = client(CurveKeys.load(node, "actor")), client(CurveKeys.load(node, "judge"))
    learner = client(CurveKeys.load(keys, "learner"))
    reader = client(CurveKeys.load(keys))  # the head's client pair: authorized/reader/ only
    old = client(CurveKeys.load(node))
    groups = [make_group(i) for i in range(4)]
    try:
        assert set(push_all(actor, groups[:3]).values()) == {"stored"}
        assert_refused("learner", actor.request_batch, "learner", 1, 0)
        assert_refused("actor", push_one, judge, groups[3])
        work = judge.pull_judge_work("judge-0", max_groups=1)
        assert judge.submit_labels(labels_for(work[0])) == "stored"
        assert_refused("judge", learner.pull_judge_work, "judge-1")
        for role, attempt in ATTEMPTS.items():
            assert_refused(role, attempt, reader, groups)
        assert reader.stats()["groups"] == 3
        assert len(learner.request_batch("learner", 2, 0).groups) == 2
        assert push_one(old, groups[3]) == "stored"  # the flat layout: any role
        assert len(old.request_batch("learner", 2, 0).groups) == 2
        assert reader.stats()["rejected/unauthorized"] == 3 + 3
    finally:
        for c in (actor, judge, learner, reader, old):
            c.close()
        server.request_stop()
        thread.join(5)
        server.close()
