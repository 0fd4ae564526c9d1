"""Faults with real processes (issue 8): roles SIGKILLed mid-work, torn weight broadcasts,
clock jumps, untrusted checkpoints.

- an actor killed mid-group comes back under the Supervisor, re-sends what was not
  acknowledged, re-queues the task it was rolling out; nothing is stored twice or lost;
- a learner killed past its last checkpoint resumes from it: by ids, no group trained twice
  and none skipped, version and step carry on;
- a weight broadcast torn in any way is refused and counted; the last complete version stays;
- staleness and admission are decided by versions: clock jumps change nothing there;
- checkpoints load with ``weights_only=True``: a pickle that would run code is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import redis
import torch
from helpers_replay import ROOT, ServerProc, make_group, push_all, stored_groups

from autodidact.roles import role_argv, write_resolved_config
from autodidact.supervisor import RoleSpec, Supervisor
from environments.files import FilesEnv
from metrics.jsonl import read_metrics
from protocol import codec
from protocol.config import ReplayConfig, RunConfig, load_config
from protocol.control import ControlPlane
from protocol.messages import BatchRequest, Group, Task
from protocol.replay_client import ReplayClient
from protocol.transport import Incoming
from protocol.weights import WeightPublisher, WeightSubscriber, weights_path
from replay.server import ReplayServer
from replay.store import Store

ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def wait_for(cond, timeout_s: float, what: str, tick=None):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if tick:
            tick()
        time.sleep(0.02)


def role_config(run_dir: Path, redis_url: str, replay_addr: str, prefix: str,
                model_path: str, *sets: str) -> Path:
    """A resolved config.yaml as the launcher writes it, for roles started with role_argv."""
    cfg = load_config(None, list(sets))
    cfg.redis.url, cfg.redis.prefix = redis_url, prefix
    cfg.replay.address, cfg.model.path = replay_addr, model_path
    return write_resolved_config(cfg, run_dir)


def store_index(run_dir: Path) -> tuple[dict, int]:
    """(group_id -> GroupRecord in ingest order, entries in the ingest-order table)."""
    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            return store.load_index(txn), txn.stat(store.db["order"])["entries"]
    finally:
        store.close()



def ack_lines(run_dir: Path, actor_id: str) -> list[tuple[str, str]]:
    path = run_dir / "acks" / f"{actor_id}.log"
    if not path.exists():
        return []
    return [tuple(line.split()) for line in path.read_text().splitlines() if line.strip()]


# --- an actor SIGKILLed mid-group ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_actor_killed_mid_group_resends_requeues_and_loses_nothing(tmp_path, redis_url,
                                                                   files_policy_path):
    run_dir = tmp_path / "run"
    server = ServerProc(run_dir).start()
    prefix = f"faults:{uuid.uuid4().hex[:8]}"
    control = ControlPlane(redis.Redis.from_url(redis_url), prefix)
    control.init_admission(0, 0)  # a fresh run: what the launcher does before actors start
    # No learner: version 0, so the bound (100 + 0 + 1) * 4 slots never binds here.
    config = role_config(run_dir, redis_url, server.address, prefix, files_policy_path,
                         "actor.group_size=2", "actor.groups_in_flight=1", "env.max_turns=3",
                         "experience.enabled=false", "learner.batch_groups=4",
                         "learner.max_staleness=100")
    tasks = FilesEnv().tasks("train")
    control.push_tasks(tasks)
    outbox = run_dir / "acks"
    pending_dir, held = outbox / "actor-0.pending", outbox / "actor-0.tasks"
    spec = RoleSpec("actor-0", role_argv("actor", run_dir, config, "--actor-id", "actor-0"),
                    log_path=run_dir / "actor-0.log", env=ENV)

    def mid_rollout() -> bool:
        """Tasks taken and none of their groups written yet: the actor is rolling out."""
        try:
            held_at = held.stat().st_mtime_ns
            return all(p.stat().st_mtime_ns < held_at for p in pending_dir.glob("*"))
        except FileNotFoundError:
            return False

    try:
        with Supervisor(backoff_s=0.2) as sup:
            first = sup.start(spec)
            wait_for(lambda: ack_lines(run_dir, "actor-0"), 120, "a first acknowledged group",
                     tick=lambda: first.poll() is None or pytest.fail(
                         (run_dir / "actor-0.log").read_text()[-3000:]))
            # Replay stops answering: what the actor pushes now stays unacknowledged.
            os.kill(server.proc.pid, signal.SIGSTOP)
            pushed = control.counters().get("actor/pushed", 0)
            wait_for(lambda: control.counters().get("actor/pushed", 0) >= pushed + 2, 60,
                     "two unacknowledged pushes")
            # Freeze the actor, look, and kill it only mid-rollout (never mid-bookkeeping).
            deadline = time.monotonic() + 60
            while True:
                first.send_signal(signal.SIGSTOP)
                if mid_rollout():
                    break
                first.send_signal(signal.SIGCONT)
                assert time.monotonic() < deadline, "never caught the actor mid-rollout"
                time.sleep(0.01)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            unacked = {codec.decode_body(Group.TYPE, p.read_bytes()).group_id
                       for p in pending_dir.glob("*.group")}
            in_flight = [codec.decode_body(Task.TYPE, b).task_id
                         for b in msgpack.unpackb(held.read_bytes())]
            acked_before = {gid for gid, _ in ack_lines(run_dir, "actor-0")}
            assert len(unacked) >= 2 and not unacked & acked_before and len(in_flight) == 1
            os.kill(server.proc.pid, signal.SIGCONT)

            def new_groups() -> set[str]:
                return {gid for gid, _ in ack_lines(run_dir, "actor-0")} - acked_before - unacked

            wait_for(lambda: len(new_groups()) >= 2 and unacked <= {
                gid for gid, _ in ack_lines(run_dir, "actor-0")}, 120,
                "the restarted actor's groups", tick=sup.check)
            assert sup.restart_log == [("actor-0", -signal.SIGKILL)]
            restarted = sup.roles["actor-0"].proc
            # SIGTERM: it finishes the group in hand and drains its acks. Beside a busy suite
            # that took longer than the supervisor's default 10 s grace (it was killed).
            t0 = time.monotonic()
            sup.stop(grace_s=60)
            stop_s = time.monotonic() - t0
        assert restarted.returncode == 0, f"killed after {stop_s:.0f} s"
        print(f"the restarted actor stopped in {stop_s:.1f} s")
        client = ReplayClient(server.address, timeout_s=10)
        replay_stats = client.stats()
        client.close()
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop()

    index, order_entries = store_index(run_dir)
    lines = ack_lines(run_dir, "actor-0")
    acked = {gid for gid, _ in lines}
    # Nothing stored twice, nothing acknowledged that is not stored, nothing stored unacknowledged.
    assert order_entries == len(index) == replay_stats["groups_stored"]
    assert acked == set(index)
    assert {status for _, status in lines} <= {"stored", "duplicate"}
    # The predecessor's unacknowledged groups were re-sent (stored now, or found stored).
    assert unacked <= acked and not list(pending_dir.glob("*")) and not held.exists()
    # Its task in flight went back to the queue (marked), and every task is now a stored group
    # or still queued: none lost, none rolled out twice.
    assert control.task_queue_len() + len(index) == len(tasks)
    queued = [codec.decode_body(Task.TYPE, b) for b in control.r.lrange(control.keys.tasks, 0, -1)]
    requeued = [t.task_id for t in queued + [g.task for g in stored_groups(run_dir)]
                if t.meta.get("requeued")]
    assert requeued == in_flight
    counters = control.counters()
    claims = int(control.r.hget(control.keys.claims, "actor-0") or 0)
    # Every admitted slot is a stored group or was given back: none leaked, none freed twice.
    assert claims == 0
    assert control.admission()["admitted"] == len(index) == counters["actor/pushed"]
    assert counters["actor/resent"] == len(unacked)
    assert counters["actor/accepted"] == sum(status == "stored" for _, status in lines)
    control.r.close()


# --- the learner SIGKILLed past its last checkpoint, then --resume ---------------------------


def scripted_groups(model_path: str, tasks: list[Task]) -> list[Group]:
    """One group per task in the tiny model's vocabulary: the reference solution (success) and
    its first action alone (mostly failure), replayed through the actors' episode code."""
    from transformers import AutoTokenizer

    from episodes.rollout import PromptCodec, RolloutSettings, scripted_episode, to_groups

    codec_ = PromptCodec(AutoTokenizer.from_pretrained(model_path))
    env, settings = FilesEnv(), RolloutSettings(max_turns=50, max_context=10_000)
    episodes = []
    for task in tasks:
        short = dataclasses.replace(task, reference=task.reference[:1])
        pair = [scripted_episode(task, env, codec_, settings),
                scripted_episode(short, env, codec_, settings)]
        pair[1].task = task
        episodes += pair
    return to_groups(episodes, 2, "scripted", time.time())


def learner_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_learner_killed_resumes_without_training_a_group_twice_or_skipping_one(
        tmp_path, redis_url, files_policy_path):
    run_dir = tmp_path / "run"
    server = ServerProc(run_dir).start()
    client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    prefix = f"faults:{uuid.uuid4().hex[:8]}"
    # Scripted groups carry version 0: a wide bound keeps all of them trainable.
    config = role_config(run_dir, redis_url, server.address, prefix, files_policy_path,
                         "learner.batch_groups=2", "learner.checkpoint_every=2",
                         "learner.max_staleness=100", "judge.workers=0",
                         "experience.enabled=false")
    tasks = [t for t in FilesEnv().tasks("train") if len(t.reference) >= 2][:20]
    groups = scripted_groups(files_policy_path, tasks)
    ingest = [g.group_id for g in groups]
    ckpt_path = run_dir / "checkpoints" / "latest.pt"
    learner_log = open(run_dir / "learner.log", "ab")

    def start(*extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *role_argv("learner", run_dir, config,
                                                            "--max-updates", "8", *extra)],
                                cwd=ROOT, stdout=learner_log, stderr=subprocess.STDOUT,
                                env={**os.environ, **ENV})

    try:
        # 7 groups: updates 1-3 (checkpoint after 2), then the 7th is drawn and the learner
        # waits for an 8th. Killed there, 3 groups were delivered after its checkpoint.
        assert set(push_all(client, groups[:7]).values()) == {"stored"}
        first = start()
        wait_for(lambda: len(learner_rows(run_dir)) == 3 and client.stats()["delivered"] == 7,
                 120, "3 updates and a partial draw",
                 tick=lambda: first.poll() is None or pytest.fail(
                     (run_dir / "learner.log").read_text()[-3000:]))
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        assert (ckpt["updates"], ckpt["version"]) == (2, 2)
        assert ckpt["consumed"] == ingest[:4]
        # The dead learner's last request may still be held in replay (BatchRequest.timeout_s):
        # a group pushed now would go to it, and come back with the rest after the hello. Let
        # it run out, so exactly the 3 drawn before the kill are the ones delivered again.
        wait_for(lambda: client.stats()["batches_held"] == 0, 60, "the held request to lapse")

        assert set(push_all(client, groups[7:]).values()) == {"stored"}
        second = start("--resume")
        assert second.wait(120) == 0, (run_dir / "learner.log").read_text()[-3000:]
        stats = client.stats()
    finally:
        client.close()
        server.stop()
        learner_log.close()

    final = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    assert (final["updates"], final["version"]) == (8, 8)  # carried on from 2, not from 0
    assert all(int(s["step"]) == 8 for s in final["optimizer"]["state"].values())
    ledger = final["consumed"]
    # By ids: each trained once, oldest first, none skipped; the 3 delivered after the
    # checkpoint to the learner that died were delivered again.
    assert len(ledger) == len(set(ledger)) == 16
    assert ledger == ingest[:16]
    assert re.search(r"at version 2: \d+ consumed, 3 to deliver again",
                     server.log_text()), server.log_text()[-2000:]
    index, _ = store_index(run_dir)
    assert {g for g, r in index.items() if r.consumed} == set(ledger)
    rest = [r for g, r in index.items() if g not in ledger]
    assert len(rest) == 4 and not any(r.delivered or r.consumed for r in rest)  # deliverable
    assert stats["deliverable"] == 4
    # The resumed learner's first update is number 3 (the one the killed learner had done).
    assert [r["learner/updates"] for r in learner_rows(run_dir)] == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert [r["learner/version"] for r in learner_rows(run_dir)][3:] == [3, 4, 5, 6, 7, 8]


# --- torn weight broadcasts --------------------------------------------------------------------

WEIGHT_FLOATS = 2_300_000  # 9.2 MB of float32: three 4 MiB chunks


class RecordingBackend:
    def __init__(self):
        self.loads: list[tuple[int, dict]] = []

    def load_weights(self, state, version):
        self.loads.append((version, state))


def weights(seed: int) -> dict:
    return {"w": torch.randn(WEIGHT_FLOATS, generator=torch.Generator().manual_seed(seed)),
            "b": torch.full((3,), float(seed))}


def loaded_equal(backend: RecordingBackend, version: int, state: dict) -> bool:
    got_version, got = backend.loads[-1]
    return got_version == version and all(torch.equal(got[k], v) for k, v in state.items())


def tear_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def tear_one_chunk(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[5 * 1024 * 1024] ^= 0xFF  # a byte in the second chunk; the size still matches
    path.write_bytes(bytes(data))


def tear_missing(path: Path) -> None:
    path.unlink()


def tear_announcement(path: Path, control: ControlPlane) -> None:
    control.r.set(control.keys.weights, b"\xc1 not msgpack")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tear", [tear_truncated, tear_one_chunk, tear_missing,
                                  tear_announcement], ids=lambda f: f.__name__[5:])
def test_a_torn_broadcast_is_refused_and_counted_and_the_last_version_stays(
        tmp_path, control, tear, caplog, monkeypatch):
    publisher = WeightPublisher(tmp_path, control)
    subscriber, backend = WeightSubscriber(control, "actor-0"), RecordingBackend()
    v1 = weights(1)
    publisher.publish(v1, 1, wait=True)
    assert subscriber.follow(backend) == 1 and loaded_equal(backend, 1, v1)

    publisher.publish(weights(2), 2, wait=True)  # announced, then damaged on disk (or in Redis)
    path = weights_path(tmp_path, 2)
    tear(path, control) if tear is tear_announcement else tear(path)
    for _ in range(3):  # polled between every turn: refused once, not re-read every turn
        assert subscriber.follow(backend) is None
    assert subscriber.rejected == 1 and subscriber.version == 1 and len(backend.loads) == 1
    if tear is tear_one_chunk:
        assert "chunk 2/3 does not match" in caplog.text
    later = time.monotonic() + subscriber.retry_s + 1  # after the back-off it looks again
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert subscriber.follow(backend) is None and subscriber.rejected == 2

    v3 = weights(3)
    publisher.publish(v3, 3, wait=True)
    assert subscriber.follow(backend) == 3 and loaded_equal(backend, 3, v3)
    assert control.version_acks(3) == {"actor-0"} and control.version_acks(2) == set()


HALF_WRITER = """
import signal, sys, time
import redis, torch
import protocol.weights as w
from protocol.control import ControlPlane

real_open = open

class HalfWriter:  # writes half of the file, says so, then hangs until killed
    def __init__(self, path, mode):
        self.f = real_open(path, mode)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        print("half", len(data), flush=True)
        time.sleep(120)

w.open = HalfWriter
control = ControlPlane(redis.Redis.from_url(sys.argv[1]), sys.argv[2])
state = {"w": torch.randn(%d), "b": torch.zeros(3)}
w.WeightPublisher(sys.argv[3], control).publish(state, 2, wait=True)
""" % WEIGHT_FLOATS


@pytest.mark.timeout(60)
def test_a_publisher_killed_mid_write_never_announces_and_its_tmp_is_cleared(
        tmp_path, control, redis_url):
    publisher = WeightPublisher(tmp_path, control)
    subscriber, backend = WeightSubscriber(control, "actor-0"), RecordingBackend()
    v1 = weights(1)
    publisher.publish(v1, 1, wait=True)
    assert subscriber.follow(backend) == 1

    writer = subprocess.Popen([sys.executable, "-c", HALF_WRITER, redis_url,
                               control.keys.prefix, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    try:
        line = writer.stdout.readline()
        assert line.startswith("half"), line
        tmp = weights_path(tmp_path, 2).with_suffix(".tmp")
        assert 0 < tmp.stat().st_size < int(line.split()[1])
    finally:
        writer.kill()
        writer.wait(10)
    assert not weights_path(tmp_path, 2).exists() and tmp.exists()
    assert control.get_version() == 1 and subscriber.announced().version == 1
    assert subscriber.follow(backend) is None
    assert subscriber.version == 1 and subscriber.rejected == 0 and len(backend.loads) == 1

    restarted = WeightPublisher(tmp_path, control)  # a learner starting again
    assert not tmp.exists()
    v2 = weights(2)
    restarted.publish(v2, 2, wait=True)
    assert subscriber.follow(backend) == 2 and loaded_equal(backend, 2, v2)


@pytest.mark.timeout(60)
def test_actors_follow_a_learner_resumed_at_an_older_version(tmp_path, control):
    """A learner resumed from its checkpoint announces an older version than the actors hold
    (the newer ones came from the run that died): the actors go back to it."""
    publisher = WeightPublisher(tmp_path, control)
    subscriber, backend = WeightSubscriber(control, "actor-0"), RecordingBackend()
    for v in (1, 2, 3):
        publisher.publish(weights(v), v, wait=True)
    assert subscriber.follow(backend) == 3
    resumed = weights(20)
    WeightPublisher(tmp_path, control).publish(resumed, 2, wait=True)  # replaces v2's file
    assert subscriber.follow(backend) == 2 and loaded_equal(backend, 2, resumed)
    assert subscriber.follow(backend) is None  # the same announcement: nothing to do
    # v3 came from the run that died: gone, so nothing (final evaluation, a Redis restore
    # re-announcing the newest file) can pick it up.
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "v000001.safetensors", "v000002.safetensors"]


# --- clocks: staleness and admission count versions, not seconds -------------------------------
#
# Wall time and the monotonic clock are used only where a duration is the point, never for
# staleness: the judge deadline (a group stored more than judge.deadline_s ago by the replay
# server's wall clock is trained on its outcome alone: a jump changes whether labels are waited
# for, never which groups are trainable), judge leases and log rate limits (monotonic, in the
# replay server's memory: a lease ending early means a second judge, and the first label
# wins), heartbeat TTLs (Redis' own clock), and the learner's max_minutes budget.

CLOCKS = {"real": (0.0, 0.0), "wall+30y": (1e9, 0.0), "wall-50y": (-1.6e9, 0.0),
          "monotonic-back": (0.0, -1e7), "both-forward": (3e8, 3e8)}


def shift_clocks(monkeypatch, wall: float, mono: float) -> None:
    real_time, real_mono = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + wall)
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() + mono)


def admissions(control: ControlPlane) -> list[int]:
    control.init_admission(0, 0)
    control.set_version(1)  # bound (1 + 1 + 1) * 2 = 6 slots
    got = [control.admit("a", 3, max_staleness=1, batch_groups=2) for _ in range(4)]
    control.set_version(2)  # 8 slots
    got += [control.admit("a", 3, 1, 2) for _ in range(2)]
    control.free_stale_slots(2)  # skipped groups free their slots
    return got + [control.admit("a", 3, 1, 2)]


def batches(run_dir: Path) -> list[tuple[list[str], int, int]]:
    """Store groups whose tokens are versions 0..5, then draw at learner version 6 with
    max_staleness 2: (ids, stale skipped, judge timeouts) per draw."""
    server = ReplayServer(run_dir, ReplayConfig(), "tcp://127.0.0.1:*")

    def send(msg, msg_id: str):
        [(_, reply)] = server.handle([Incoming(route=[], msg_id=msg_id, msg=msg,
                                               body=codec.encode_body(msg))])
        return reply

    try:
        for i, v in enumerate([0, 3, 1, 4, 5, 2, 6, 3, 0, 5]):
            assert send(make_group(i, versions=(v, v)), f"g{i}").status == "stored"
        out = []
        for k in range(4):
            batch = send(BatchRequest("L", 3, 6, 2, False, 0.0), f"b{k}")
            out.append(([g.group_id for g in batch.groups], batch.stale_skipped,
                        batch.judge_timeouts))
        return out
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_clock_jumps_change_neither_admission_nor_which_groups_are_stale(
        tmp_path, redis_url, monkeypatch):
    client = redis.Redis.from_url(redis_url)
    results = {}
    for name, (wall, mono) in CLOCKS.items():
        with monkeypatch.context() as m:
            shift_clocks(m, wall, mono)
            control = ControlPlane(client, f"clock:{uuid.uuid4().hex[:8]}")
            results[name] = (admissions(control), batches(tmp_path / name))
    client.close()
    admitted, drawn = results["real"]
    assert admitted == [3, 3, 0, 0, 2, 0, 2]
    fresh = [f"g-{i}" for i, v in enumerate([0, 3, 1, 4, 5, 2, 6, 3, 0, 5]) if v >= 4]
    assert [gid for ids, _, _ in drawn for gid in ids] == fresh
    assert sum(skipped for _, skipped, _ in drawn) == 6 and drawn[-1] == ([], 0, 0)
    for name, got in results.items():
        assert got == results["real"], name


@pytest.mark.timeout(60)
def test_a_wall_clock_jump_only_moves_the_judge_deadline(tmp_path, monkeypatch):
    """The one wall-time decision in batch picking: unjudged groups wait for labels until
    judge.deadline_s after they were stored. Jumping the clock forward serves them early
    (outcome only), but a stale group stays stale."""
    server = ReplayServer(tmp_path, ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        for i, v in enumerate([0, 6, 6]):
            g = make_group(i, versions=(v, v))
            server.handle([Incoming(route=[], msg_id=f"g{i}", msg=g, body=codec.encode_body(g))])
        ask = BatchRequest("L", 5, 6, 2, True, 20.0)
        [(_, batch)] = server.handle([Incoming(route=[], msg_id="b0", msg=ask)])
        assert batch.groups == [] and batch.stale_skipped == 1  # fresh ones wait for labels
        shift_clocks(monkeypatch, 1e9, 0.0)
        [(_, batch)] = server.handle([Incoming(route=[], msg_id="b1", msg=ask)])
        assert [g.group_id for g in batch.groups] == ["g-1", "g-2"]
        assert batch.judge_timeouts == 2 and batch.stale_skipped == 0  # g-0 counted once
    finally:
        server.close()


# --- checkpoints: plain tensors only -----------------------------------------------------------


def tiny_learner(model_path: str, run_dir: Path, control: ControlPlane):
    from autodidact.wiring import build_learner

    cfg = RunConfig()
    cfg.model.path = model_path
    return build_learner(cfg, run_dir, control, replay=None)


class CreatesAFile:
    """What a malicious checkpoint would hold: unpickling it creates ``path``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(120)
def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, control, files_policy_path):
    from learner.learner import CheckpointError

    learner = tiny_learner(files_policy_path, tmp_path, control)
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoints" / "latest.pt"
    path.parent.mkdir(parents=True)
    good = learner.step.model.state_dict()
    torch.save({"model": good, "optimizer": CreatesAFile(marker), "updates": 7}, path)
    refused = r"not a plain tensor checkpoint \(it asks to unpickle io\.open\)"
    with pytest.raises(CheckpointError, match=refused):
        learner.resume()
    assert not marker.exists() and learner.updates == 0
    learner.metrics.close()


@pytest.mark.timeout(120)
def test_checkpoint_round_trips_rng_state_with_weights_only(tmp_path, control,
                                                            files_policy_path):
    import random

    import numpy as np

    learner = tiny_learner(files_policy_path, tmp_path, control)
    learner.updates, learner.version, learner.consumed = 5, 4, ["a", "b"]
    np.random.normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)
    learner.checkpoint()
    expected = (torch.rand(3), np.random.rand(3), np.random.normal(), random.random(),
                random.gauss(0, 1))
    state = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=True)
    assert state["consumed"] == ["a", "b"]
    resumed = tiny_learner(files_policy_path, tmp_path, control)
    assert resumed.resume() and (resumed.updates, resumed.version) == (5, 4)
    again = (torch.rand(3), np.random.rand(3), np.random.normal(), random.random(),
             random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]

    # A checkpoint of the older format (numpy's RNG state as an ndarray, no digests) still
    # resumes.
    state.update(numpy_rng=np.random.get_state(), python_rng=random.getstate())
    torch.save(state, tmp_path / "checkpoints" / "latest.pt")
    (tmp_path / "checkpoints" / "digests.json").unlink()
    expected = np.random.rand(3)
    assert resumed.resume() and np.array_equal(np.random.rand(3), expected)
    learner.metrics.close()
    resumed.metrics.close()


def test_nothing_is_unpickled_anywhere():
    """The wire is msgpack (protocol/codec.py), weights are safetensors, checkpoints load with
    weights_only=True: no source file may load a pickle."""
    banned = re.compile(r"pickle\.loads?\(|weights_only\s*=\s*False|recv_pyobj|allow_pickle\s*="
                        r"\s*True|joblib\.load|dill\.|cloudpickle")
    hits = [f"{path.relative_to(ROOT)}:{n}"
            for top in ("actor", "autodidact", "judge", "learner", "protocol", "replay", "bench")
            for path in (ROOT / top).rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if banned.search(line)]
    assert hits == []


def test_outbox_recovery_resends_or_rerolls_never_both(tmp_path):
    """The states a SIGKILL can leave the actor's outbox in, and what a successor makes of them."""
    from actor.outbox import MAX_REQUEUES, Outbox

    a, b, c = FilesEnv().tasks("train")[:3]
    box = Outbox(tmp_path, "actor-0")
    box.hold_tasks([a, b])
    sent = dataclasses.replace(make_group(1), task=a)
    box.add(sent)  # a's group written, then killed: a is re-sent, b rolled out again
    (box.pending_dir / "deadbeef.tmp").write_bytes(b"\x93half")  # cut mid-write: never pushed
    groups, tasks = Outbox(tmp_path, "actor-0").recover()
    assert [g.group_id for g in groups] == [sent.group_id]
    assert [t.task_id for t in tasks] == [b.task_id] and tasks[0].meta["requeued"] == 1
    assert not box.tasks_path.exists() and len(list(box.pending_dir.glob("*"))) == 1

    box.acked([(sent.group_id, "duplicate")])  # the successor's re-send was found stored
    box.close()
    assert not list(box.pending_dir.glob("*"))
    assert box.log_path.read_text() == f"{sent.group_id} duplicate\n"
    # A task that was in flight in every crash may be the cause: dropped after MAX_REQUEUES.
    box.hold_tasks([dataclasses.replace(c, meta={"requeued": MAX_REQUEUES}), *tasks])
    assert [t.task_id for t in Outbox(tmp_path, "actor-0").recover()[1]] == [b.task_id]
