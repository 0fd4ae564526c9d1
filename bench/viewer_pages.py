"""How fast the run viewer answers on a large store: ``autodidact view`` over 10,000 groups.

Builds a run directory whose replay store holds ``--groups`` judged groups (8 rollouts of
``--tokens`` tokens and 4 steps each, written by the real replay server), starts the real
``autodidact view`` process on it, and times each page's request over HTTP: the groups list
just after start (the index still filling), then warm: the first page, a deep page, a filtered
page, one group, one rollout's tokens, the tasks and the run. The baseline, measured in the
same run, is what a page would cost without the index: decoding every stored group once.

    python -m bench.viewer_pages --json docs/results/viewer_pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.output import command_line, write_result
from protocol import codec
from protocol.config import ReplayConfig
from protocol.messages import Group, Step, StepLabels, Task, Trajectory
from protocol.transport import Incoming, free_tcp_port
from replay.server import ReplayServer
from replay.store import Store

PAGES = {
    "groups, first page": "/api/groups?per_page=50",
    "groups, a middle page": "/api/groups?per_page=50&page={middle}",
    "groups, filtered (mixed outcome, judged)": "/api/groups?outcome=mixed&judged=yes",
    "groups, filtered (task substring)": "/api/groups?task=task-7",
    "one group": "/api/group/{gid}",
    "one rollout's tokens": "/api/tokens/{gid}/0",
    "tasks": "/api/tasks",
    "run": "/api/run",
}


def make_group(i: int, tokens: int, rng: np.random.Generator) -> Group:
    trajs = []
    for t in range(8):
        mask = np.zeros(tokens, np.uint8)
        mask[tokens // 2:] = 1
        steps = [Step(action=f"mv a{j} b{j}", observation=f"moved a{j}", start=tokens // 2,
                      end=tokens // 2 + 8) for j in range(4)]
        success = bool(rng.integers(0, 2))
        trajs.append(Trajectory(
            traj_id=f"{i}/{t}", tokens=rng.integers(0, 49_000, tokens).astype(np.int32),
            logprobs=(-rng.random(tokens)).astype(np.float32) * mask,
            versions=np.where(mask == 1, i // 100, -1).astype(np.int32), action_mask=mask,
            prompt_len=tokens // 2, steps=steps, reward=float(success), success=success))
    task = Task(task_id=f"task-{i % 500}", env="files", query=f"move file {i % 500}", seed=i)
    return Group(f"g{i:06d}", task, trajs, actor_id="bench", created_at=time.time())


def build_store(run_dir: Path, n: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    (run_dir / "config.yaml").write_text("name: bench\n")
    server = ReplayServer(run_dir, ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        for start in range(0, n, 200):
            burst = []
            for i in range(start, min(start + 200, n)):
                g = make_group(i, tokens, rng)
                labels = StepLabels(g.group_id, [[1, 0, 1, 0]] * 8, "reference")
                burst += [Incoming([], f"g{i}", msg=g, body=codec.encode_body(g)),
                          Incoming([], f"l{i}", msg=labels, body=codec.encode_body(labels))]
            server.handle(burst)
    finally:
        server.close()


def full_decode_s(run_dir: Path) -> float:
    """The baseline: every stored group decoded once (what a page would cost unindexed)."""
    store = Store(run_dir, readonly=True)
    t0 = time.perf_counter()
    with store.begin_read() as txn:
        for _, body in store.iter_bodies(txn):
            codec.decode_body(Group.TYPE, bytes(body))
    took = time.perf_counter() - t0
    store.close()
    return took


def fetch(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as reply:
        reply.read()
    return time.perf_counter() - t0


def wait_indexed(base: str, timeout_s: float = 300) -> float:
    """When the viewer's index holds every stored group (perf_counter time)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        with urllib.request.urlopen(base + "/api/groups?per_page=1", timeout=60) as reply:
            if not json.loads(reply.read())["indexing"]:
                return time.perf_counter()
        time.sleep(0.05)
    raise RuntimeError(f"the index was not complete after {timeout_s} s")


def serve(run_dir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "autodidact.cli", "view", "--run-dir",
                             str(run_dir), "--port", str(port)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if not line.startswith("viewer: "):
        proc.kill()
        raise RuntimeError(f"the viewer did not start: {line!r}")
    return proc


def measure(run_dir: Path, groups: int, repeats: int) -> dict:
    port = free_tcp_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = serve(run_dir, port)
    try:
        started = time.perf_counter() - t0
        cold = fetch(base + PAGES["groups, first page"])
        indexed = wait_indexed(base)
        pages = {}
        for name, path in PAGES.items():
            path = path.format(gid="g000123", middle=groups // 100)
            times = [fetch(base + path) for _ in range(repeats)]
            pages[name] = {"median_s": statistics.median(times), "max_s": max(times)}
    finally:
        proc.terminate()
        proc.wait(10)
    return {"start_s": started, "groups_first_request_s": cold,
            "index_complete_after_start_s": indexed - t0, "pages": pages}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rollout")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--note", default="", help="the conditions it ran in (what else ran)")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="viewer-bench-"))
    try:
        t0 = time.perf_counter()
        build_store(folder, args.groups, args.tokens)
        built = time.perf_counter() - t0
        baseline = full_decode_s(folder)
        timed = measure(folder, args.groups, args.repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    slowest = max(p["max_s"] for p in timed["pages"].values())
    result = {
        "command": command_line("bench.viewer_pages", argv),
        "groups": args.groups, "rollouts_per_group": 8, "tokens_per_rollout": args.tokens,
        "store_build_s": built, "baseline_full_decode_s": baseline, **timed,
        "slowest_page_s": slowest, "slowest_page_over_baseline": slowest / baseline,
        "machine": f"{os.cpu_count()} cores", "load_average_1m": os.getloadavg()[0],
        "note": args.note,
    }
    write_result(result, args.json, echo=True)
    return result


if __name__ == "__main__":
    main()
