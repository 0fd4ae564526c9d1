"""The judge pool as a running system: a real replay server process, real sockets, real judge
processes, and real files-env trajectories scripted through the actors' episode code."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers_replay import ROOT, ServerProc, push_all
from llm_stub import ScriptedChatServer

from autodidact.resolve import judge_settings
from autodidact.wiring import make_judges
from environments.files import FilesEnv
from episodes.rollout import RolloutSettings, scripted_episode, to_groups
from judge.judge_worker import JudgeWorker
from judge.step_judges import ReferenceJudge
from protocol.config import RunConfig
from protocol.replay_client import ReplayClient

pytestmark = pytest.mark.slow


def make_groups(files_codec, count: int):
    """``count`` groups of two rollouts: the task's reference, and the same with a useless
    ``pwd`` slipped in before its last step."""
    env, settings = FilesEnv(), RolloutSettings(max_turns=50, max_context=10_000)
    tasks = [t for t in env.tasks("train") if len(t.reference) >= 2][:count]
    groups = []
    for task in tasks:
        detour = dataclasses.replace(task, reference=[*task.reference[:-1], "pwd",
                                                      task.reference[-1]])
        episodes = [scripted_episode(task, env, files_codec, settings),
                    scripted_episode(detour, env, files_codec, settings)]
        episodes[1].task = task  # the judge grades against the real task and its reference
        groups += to_groups(episodes, 2, "test", time.time())
    return groups


@pytest.fixture
def server(tmp_path):
    srv = ServerProc(tmp_path / "run").start()
    yield srv
    srv.kill()


@pytest.fixture
def client(server):
    c = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    yield c
    c.close()


def run_worker(worker: JudgeWorker, until, timeout_s: float = 30.0) -> None:
    thread = threading.Thread(target=worker.run, kwargs={"log_every_s": 0.2}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.request_stop()
    thread.join(10)
    worker.close()
    assert until(), "the judge did not finish in time"


def reference_worker(server, tmp_path, judge_id: str = "judge-0") -> JudgeWorker:
    """A reference judge in this process, on a client of its own (the worker closes it)."""
    return JudgeWorker(judge_settings(RunConfig()), tmp_path,
                       ReplayClient(server.address, retry_after_s=0.5, timeout_s=10),
                       ReferenceJudge(FilesEnv), judge_id=judge_id)


def test_judge_labels_every_step_and_the_learner_gets_the_labels(server, client, files_codec,
                                                                 tmp_path):
    groups = make_groups(files_codec, 3)
    assert set(push_all(client, groups).values()) == {"stored"}
    worker = reference_worker(server, tmp_path)
    run_worker(worker, lambda: client.stats()["judged"] == 3)

    batch = client.request_batch("learner", 3, 0, require_labels=True)
    assert {g.group_id for g in batch.groups} == {g.group_id for g in groups}
    labels = {lab.group_id: lab for lab in batch.labels}
    for group in batch.groups:
        reference, detour = labels[group.group_id].labels
        assert reference == [1] * len(group.trajectories[0].steps)
        pwd = [s.action for s in group.trajectories[1].steps].index("pwd")
        assert detour[pwd] == 0 and sum(detour) == len(detour) - 1
        assert labels[group.group_id].judge == "reference"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    judged = [r for r in records if "judge/groups_per_s" in r]
    assert judged and all(r["role"] == "judge" for r in judged)
    assert sum(r["judge/groups"] for r in judged) == 3
    assert judged[-1]["judge/good_frac_success"] < 1.0  # the pwd detours were marked BAD


def test_groups_wait_for_labels_until_the_deadline_then_go_outcome_only(client, files_codec):
    (group,) = make_groups(files_codec, 1)
    push_all(client, [group])
    batch = client.request_batch("learner", 1, 0, require_labels=True, label_deadline_s=60)
    assert batch.groups == [] and batch.judge_timeouts == 0
    time.sleep(0.3)
    batch = client.request_batch("learner", 1, 0, require_labels=True, label_deadline_s=0.2)
    assert [g.group_id for g in batch.groups] == [group.group_id]
    assert batch.judge_timeouts == 1 and batch.labels == []
    # Trained already: no judge time is spent on it any more.
    assert client.pull_judge_work("late-judge", 5) == []
    assert client.stats()["judge_timeouts"] == 1


def test_a_judge_killed_mid_group_loses_no_labels(server, client, files_codec, tmp_path,
                                                  redis_url):
    (group,) = make_groups(files_codec, 1)
    push_all(client, [group])
    # The scripted server stands in for a remote LLM (none is available on this machine); it
    # holds the judge's request long enough for the judge to be killed waiting on it.
    with ScriptedChatServer([], default={"delay": 30, "content": "Step 1: GOOD"}) as llm:
        sets = ["judge.backend=endpoint", f"llm.url={llm.url}", "llm.model=stub",
                "judge.lease_s=1", "judge.cross_check=false", "llm.max_retries=0"]
        cmd = [sys.executable, "-m", "autodidact.cli", "judge", "--run-dir", str(tmp_path),
               "--redis-url", redis_url, "--replay-addr", server.address, "--judge-id", "doomed",
               *[a for s in sets for a in ("--set", s)]]
        with open(tmp_path / "judge.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 60
            while not llm.requests:
                assert proc.poll() is None, (tmp_path / "judge.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "the judge never asked the LLM"
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    # The dead judge held a lease and wrote nothing. Whether its lease is still running when
    # this line reads the stats depends on the machine's load (1 s): not asserted.
    stats = client.stats()
    assert stats["judged"] == 0 and stats["leases_granted"] == 1
    # A second judge gets the group once the dead one's lease has run out.
    worker = reference_worker(server, tmp_path, "next")
    run_worker(worker, lambda: client.stats()["judged"] == 1)
    batch = client.request_batch("learner", 1, 0, require_labels=True)
    assert [lab.group_id for lab in batch.labels] == [group.group_id]
    assert batch.labels[0].judge == "reference"
    assert client.stats()["leases_granted"] == 2  # the dead judge's lease, then the next one's


def test_make_judges_follows_the_backend_setting():
    judge, cross, hook = make_judges(RunConfig())
    assert judge.name == "reference" and cross is None and hook is None
    cfg = RunConfig()
    cfg.llm.url, cfg.llm.model = "http://127.0.0.1:9/v1", "m"
    judge, cross, _ = make_judges(cfg)
    assert judge.name == "llm:m" and cross.name == "reference"
    cfg.judge.cross_check = False
    assert make_judges(cfg)[1] is None


def test_the_judge_uses_its_own_endpoint_over_the_proposers():
    cfg = RunConfig()
    cfg.llm.url, cfg.llm.model = "http://127.0.0.1:9/v1", "proposer"
    cfg.judge.url, cfg.judge.model = "http://127.0.0.1:10/v1", "judge-llm"
    judge, _, _ = make_judges(cfg)
    assert judge.name == "llm:judge-llm" and "127.0.0.1:10/" in judge.chat.endpoint
    assert cfg.llm.url == "http://127.0.0.1:9/v1"  # the proposer's stays as it was
    only_judge = RunConfig()
    only_judge.judge.url = "http://127.0.0.1:10/v1"
    assert only_judge.judge.resolved_backend(only_judge.llm.url) == "endpoint"
    assert only_judge.judge.endpoint(only_judge.llm).model == ""  # no name given anywhere


def test_the_policy_as_judge_falls_back_to_the_outcome_on_nonsense(files_codec, files_policy_path):
    cfg = RunConfig()
    cfg.judge.backend, cfg.model.path, cfg.judge.max_attempts = "policy", files_policy_path, 2
    judge, cross, _ = make_judges(cfg)
    assert judge.name == "policy" and cross.name == "reference"
    (group,) = make_groups(files_codec, 1)
    traj = group.trajectories[0]
    got = judge.judge(group.task, traj)
    # The tiny policy's word-level vocabulary has no GOOD or BAD, so its replies never parse:
    # every attempt is counted and the steps get the outcome's labels (the reference solved it).
    assert got.how == "outcome" and got.attempts == 2
    assert got.labels == [1] * len(traj.steps)
    assert judge.stats["requests"] == 2 and judge.stats["outcome_fallbacks"] == 1
