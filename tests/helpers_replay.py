"""Shared by the replay tests: deterministic random Groups and a replay server subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from protocol import codec
from protocol.messages import (
    BatchRequest,
    Group,
    GroupsSince,
    JudgePull,
    LearnerHello,
    LedgerCommit,
    StatsRequest,
    Step,
    StepLabels,
    Task,
    Trajectory,
)
from protocol.transport import free_tcp_port
from replay.store import Store

ROOT = Path(__file__).resolve().parents[1]


def make_group(key, group_id: str | None = None, versions: tuple[int, int] | None = None,
               max_tokens: int = 48) -> Group:
    """A valid random Group, the same for the same ``key`` (an int or a tuple of ints).

    ``versions`` = (lo, hi) bounds the policy version of generated tokens; ``(-1, -1)`` makes a
    group with no generated tokens at all.
    """
    rng = np.random.default_rng(key if isinstance(key, int) else list(key))
    gid = group_id or "g-" + "-".join(map(str, key if isinstance(key, tuple) else (key,)))
    lo, hi = versions or (0, 3)
    trajectories = []
    for t in range(int(rng.integers(1, 4))):
        n = int(rng.integers(4, max_tokens))
        prompt = int(rng.integers(1, n // 2 + 1))
        mask = np.zeros(n, np.uint8)
        if lo >= 0:
            mask[prompt:] = rng.integers(0, 2, n - prompt)
            mask[-1] = 1  # at least one generated token, so the versions bound it
        vers = np.where(mask == 1, rng.integers(lo, hi + 1, n), -1).astype(np.int32)
        bounds = np.sort(rng.choice(np.arange(prompt, n + 1), size=2, replace=False))
        steps = [Step(action=f"act{j}", observation="obs" * j, start=int(bounds[0]),
                      end=int(bounds[1]), valid=bool(j % 2), info={"j": j})
                 for j in range(int(rng.integers(0, 4)))]
        trajectories.append(Trajectory(
            traj_id=f"t{t}", tokens=rng.integers(0, 50_000, n).astype(np.int32),
            logprobs=(-rng.random(n)).astype(np.float32) * mask, versions=vers,
            action_mask=mask, prompt_len=prompt, steps=steps, reward=float(rng.random()),
            success=bool(rng.integers(0, 2)), info={"turns": len(steps)}))
    task = Task(task_id=f"task-{int(rng.integers(0, 10))}", env="files", query="do it",
                seed=int(rng.integers(0, 1000)))
    return Group(group_id=gid, task=task, trajectories=trajectories, actor_id="test",
                 created_at=1_700_000_000.0 + float(rng.integers(0, 10**6)))


def labels_for(group: Group, value: int = 1) -> StepLabels:
    """Well-shaped labels for ``group``: one per step of every trajectory."""
    return StepLabels(group_id=group.group_id, judge="reference",
                      labels=[[value] * len(t.steps) for t in group.trajectories])


def push_all(client, groups, timeout_s: float = 20.0) -> dict[str, str]:
    """Push ``groups`` pipelined and wait for every answer: group_id -> status."""
    for g in groups:
        client.push_group(g)
    statuses: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(statuses) < len({g.group_id for g in groups}):
        assert time.monotonic() < deadline, f"unanswered: {client.unacked()[:5]}"
        statuses.update(client.poll_acks(0.05))
    return statuses


class RawPeer:
    """A bare DEALER socket for sending frames no well-behaved client would send."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frame: bytes, timeout_s: float = 5.0):
        """Send one frame; the decoded reply (envelope, message). Fails if none comes."""
        self.sock.send(frame)
        assert self.sock.poll(int(timeout_s * 1000)), "no reply: is the server still alive?"
        return codec.decode(self.sock.recv())

    def close(self):
        self.sock.close(0)


class ServerProc:
    """``autodidact replay`` in a subprocess, on a fixed address so it can be restarted (also
    after SIGKILL) where clients keep reconnecting."""

    def __init__(self, run_dir, *sets: str, address: str | None = None):
        self.run_dir = Path(run_dir)
        self.sets = list(sets)
        self.address = address or f"tcp://127.0.0.1:{free_tcp_port()}"
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / "replay-server.log"

    def start(self, *extra_sets: str, timeout_s: float = 20.0) -> ServerProc:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        addr_file = self.run_dir / "replay.addr"
        addr_file.unlink(missing_ok=True)  # a SIGKILLed server leaves its file behind
        cmd = [sys.executable, "-m", "autodidact.cli", "replay", "--run-dir", str(self.run_dir),
               "--address", self.address]
        for item in self.sets + list(extra_sets):
            cmd += ["--set", item]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + timeout_s
        while not addr_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replay server did not start:\n{self.log_text()[-3000:]}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up at all, like a crashed node."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM and wait for the clean exit; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode

    def restart(self, *extra_sets: str) -> ServerProc:
        self.stop()
        return self.start(*extra_sets)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if exc[0] is None:
            self.stop()
        else:
            self.kill()


# --- fuzzing: shared by the hypothesis tests and scripts/fuzz_atheris.py -------------------------


def base_frames(targets: list[Group]) -> list[bytes]:
    """One valid frame of every type the replay server serves: what mutations start from.
    Labels, ledger and hello name ``targets[0..2]`` (stored groups they may touch)."""
    return [
        codec.encode(make_group(10, "fuzz-base"), "f-group"),
        codec.encode(labels_for(targets[0]), "f-labels"),
        codec.encode(JudgePull("fuzz-judge", 1, 0.01), "f-pull"),
        codec.encode(BatchRequest("fuzz-learner", 1, 3), "f-batch"),
        codec.encode(LedgerCommit("fuzz-learner", ["nope", targets[1].group_id]), "f-ledger"),
        codec.encode(LearnerHello("fuzz-learner", 3, [targets[2].group_id]), "f-hello"),
        codec.encode(StatsRequest(), "f-stats"),
        codec.encode(GroupsSince(0, 2), "f-since"),
    ]


def tree_paths(obj, prefix=()):
    """Every key path in a decoded msgpack tree: the places a mutation can hit."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        yield prefix + (key,)
        if isinstance(value, (dict, list)):
            yield from tree_paths(value, prefix + (key,))


def mutate_tree(tree, data, values) -> None:
    """One mutation of a decoded body (hypothesis ``data``): delete a field, or put one of
    ``values`` at any path (a new top-level key when the tree is empty)."""
    from hypothesis import strategies as st

    paths = list(tree_paths(tree))
    if not paths:
        tree[data.draw(st.text(max_size=6))] = data.draw(values)
        return
    path = data.draw(st.sampled_from(paths))
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(values)


def damage(blob: bytes, how: str, data, max_flips: int) -> bytes:
    """``blob`` cut short (``truncate``) or with 1..max_flips bytes xor-ed (``flip``)."""
    from hypothesis import strategies as st

    if how == "truncate":
        return blob[:data.draw(st.integers(0, len(blob) - 1))]
    buf = bytearray(blob)
    for _ in range(data.draw(st.integers(1, max_flips))):
        buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
    return bytes(buf)


def stored_groups(run_dir: Path) -> list[Group]:
    """Every group a run's replay store holds, decoded (read-only, beside a live writer)."""
    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            return [codec.decode_body(Group.TYPE, bytes(b)) for _, b in store.iter_bodies(txn)]
    finally:
        store.close()
