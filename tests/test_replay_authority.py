"""Only the run's learner has the learner's powers on the replay socket (issue 21, part 6): on a
run directory with a learner token, a client without it (or with a wrong one) can still push
groups and judge them, but cannot take batches, commit the ledger or move the learner version
with a hello; the refusals are counted, and the real learner is served as before."""

from __future__ import annotations

import pytest
from helpers_replay import ServerProc, labels_for, make_group, push_all

from protocol.errors import RemoteError
from protocol.messages import MAX_VERSION
from protocol.replay_client import ReplayClient
from protocol.run_dir import RunDir, learner_token


@pytest.mark.timeout(60)
def test_only_the_token_holder_takes_batches_commits_or_says_hello(tmp_path):
    token = learner_token(tmp_path, create=True)
    assert len(token) == 48 and RunDir(tmp_path).learner_token.stat().st_mode & 0o077 == 0
    assert learner_token(tmp_path, create=True) == token  # made once
    groups = [make_group(i) for i in range(6)]
    with ServerProc(tmp_path) as server:
        actor = ReplayClient(server.address, timeout_s=10)
        impostors = [ReplayClient(server.address, timeout_s=10),
                     ReplayClient(server.address, timeout_s=10, learner_token="0" * 48)]
        learner = ReplayClient(server.address, timeout_s=10, learner_token=token)
        try:
            assert set(push_all(actor, groups).values()) == {"stored"}  # actors need no token
            work = actor.pull_judge_work("judge-0", max_groups=1)  # nor do judges
            assert actor.submit_labels(labels_for(work[0])) == "stored"
            for impostor in impostors:
                for attempt in (lambda c: c.request_batch("learner", 4, 0),
                                lambda c: c.commit_ledger("learner", [groups[0].group_id]),
                                lambda c: c.hello("learner", MAX_VERSION)):
                    with pytest.raises(RemoteError) as refused:
                        attempt(impostor)
                    assert refused.value.reason == "unauthorized"
                    assert "learner.token" in refused.value.detail
            stats = actor.stats()
            assert stats["rejected/unauthorized"] == 6
            assert stats["delivered"] == stats["consumed"] == 0
            assert stats["learner_version"] != MAX_VERSION
            assert "does not carry the run's learner token" in server.log_text()

            learner.hello("learner", 0)
            batch = learner.request_batch("learner", 6, 0)
            assert sorted(g.group_id for g in batch.groups) == sorted(g.group_id for g in groups)
            assert learner.commit_ledger("learner", [g.group_id for g in batch.groups],
                                         1)["consumed"] == 6
        finally:
            for client in (actor, learner, *impostors):
                client.close()


@pytest.mark.timeout(60)
def test_a_run_directory_without_a_token_serves_any_learner(tmp_path):
    """Stores made before tokens existed, and bare test directories, keep working."""
    with ServerProc(tmp_path) as server:
        client = ReplayClient(server.address, timeout_s=10)
        try:
            push_all(client, [make_group(1)])
            assert len(client.request_batch("learner", 1, 0).groups) == 1
        finally:
            client.close()
