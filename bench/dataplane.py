"""Data-plane throughput on this machine, in one run.

1. raw ZeroMQ: PUSH -> PULL of ``--size``-byte messages between two processes;
2. raw LMDB: batched puts of ``--size``-byte values, ``replay.write_batch`` per durable commit;
3. full path: client process(es) -> replay server process -> committed LMDB -> ack, with
   groups of about ``--size`` bytes on the wire, ``--window`` pushes in flight per client.

Prints MB/s and messages (groups) per second for each, and ``full / min(raw zmq, raw lmdb)``;
the target is >= 0.5.

    .venv/bin/python -m bench.dataplane [--seconds 5] [--size 65536] [--clients 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np
import zmq

from protocol import codec
from protocol.config import ReplayConfig
from protocol.messages import Group, Step, Task, Trajectory

ROOT = Path(__file__).resolve().parents[1]

MAP_SIZE = 256 * 1024**3  # sparse; only what is written takes disk


@dataclasses.dataclass
class Result:
    name: str
    seconds: float
    messages: int
    nbytes: int

    @property
    def mb_s(self) -> float:
        return self.nbytes / self.seconds / 1e6

    @property
    def per_s(self) -> float:
        return self.messages / self.seconds


# --- 1. raw ZeroMQ ---------------------------------------------------------------------------


def _pull(address: str, out) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(address)
    out.put("ready")
    n = nbytes = 0
    first = last = 0.0
    while True:
        msg = sock.recv()  # copy=True, as the replay server's RouterServer receives
        if not msg:
            break
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
        nbytes += len(msg)
    out.put((n - 1, nbytes - len(msg), last - first))  # the first message starts the clock


def bench_zmq(address: str, seconds: float, size: int) -> Result:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    receiver = ctx.Process(target=_pull, args=(address, out))
    receiver.start()
    out.get(timeout=30)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    payload = os.urandom(size)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(64):
            sock.send(payload)
    sock.send(b"")
    n, nbytes, elapsed = out.get(timeout=60)
    receiver.join(10)
    sock.close()
    return Result("raw zmq", elapsed, n, nbytes)


# --- 2. raw LMDB -----------------------------------------------------------------------------


def bench_lmdb(path: Path, seconds: float, size: int, batch: int) -> Result:
    env = lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=8)  # durable defaults, as the store
    db = env.open_db(b"groups")
    rng = np.random.default_rng(0)
    values = [rng.bytes(size) for _ in range(16)]
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        with env.begin(write=True) as txn:
            for _ in range(batch):
                txn.put(b"g-%012d" % n, values[n % 16], db=db)
                n += 1
    elapsed = time.perf_counter() - start
    env.close()
    return Result("raw lmdb", elapsed, n, n * size)


# --- 3. full path ----------------------------------------------------------------------------


def make_group(size: int) -> Group:
    """One trajectory whose four token arrays (13 bytes a token) fill about ``size`` bytes."""
    rng = np.random.default_rng(0)
    n = max(16, (size - 900) // 13)
    mask = np.zeros(n, np.uint8)
    mask[n // 8:] = 1
    steps = [Step(action=f"call tool {i}", observation="ok", start=n // 8 + i * 100,
                  end=n // 8 + i * 100 + 50) for i in range(min(8, (n - n // 8) // 100))]
    traj = Trajectory(traj_id="t0", tokens=rng.integers(0, 150_000, n).astype(np.int32),
                      logprobs=(-rng.random(n)).astype(np.float32) * mask,
                      versions=np.where(mask == 1, 3, -1).astype(np.int32), action_mask=mask,
                      prompt_len=n // 8, steps=steps, reward=1.0, success=True)
    task = Task(task_id="bench", env="files", query="benchmark", seed=0)
    return Group(group_id="template", task=task, trajectories=[traj], actor_id="bench")


def _push(address: str, client: int, seconds: float, size: int, window: int, out) -> None:
    from protocol.replay_client import ReplayClient

    template = make_group(size)
    replay = ReplayClient(address, retry_after_s=30)
    out.put("ready")
    sent = acked = errors = 0
    frame_bytes = len(codec.encode(template, "group:c0-000000000"))
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        while sent - acked - errors < window:
            template.group_id = f"c{client}-{sent:09d}"
            replay.push_group(template)
            sent += 1
        for _, status in replay.poll_acks(0.01):
            if status in ("stored", "duplicate"):
                acked += 1
            else:
                errors += 1
    elapsed = time.perf_counter() - start
    out.put((acked, acked * frame_bytes, elapsed, errors, frame_bytes))
    replay.close()


def bench_full(run_dir: Path, seconds: float, size: int, clients: int, window: int,
               batch: int) -> tuple[Result, int, dict]:
    sets = [f"replay.map_size={MAP_SIZE}", f"replay.max_bytes={MAP_SIZE}",
            "replay.max_groups=100000000", f"replay.write_batch={batch}"]
    cmd = [sys.executable, "-m", "autodidact.cli", "replay", "--run-dir", str(run_dir),
           "--address", f"ipc://{run_dir}/replay.sock"]
    for item in sets:
        cmd += ["--set", item]
    with open(run_dir.parent / "server.log", "wb") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, stderr=log,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        while not (run_dir / "replay.addr").exists():
            if server.poll() is not None:
                raise RuntimeError("replay server did not start")
            time.sleep(0.02)
        address = (run_dir / "replay.addr").read_text().strip()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_push, args=(address, c, seconds, size, window, out))
                 for c in range(clients)]
        for p in procs:
            p.start()
        for _ in procs:
            assert out.get(timeout=60) == "ready"
        reports = [out.get(timeout=seconds + 60) for _ in procs]
        for p in procs:
            p.join(10)
    finally:
        server.terminate()
        server.wait(30)
    from replay.store import read_stats

    stats = read_stats(run_dir)
    acked = sum(r[0] for r in reports)
    assert stats["groups"] >= acked, (stats, acked)  # acks after the clock stopped: more
    errors = sum(r[3] for r in reports)
    elapsed = max(r[2] for r in reports)
    result = Result("full path", elapsed, acked, sum(r[1] for r in reports))
    return result, reports[0][4], {"errors": errors, "stored": stats["groups"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--size", type=int, default=65536, help="message / group bytes")
    parser.add_argument("--clients", type=int, default=1, help="pushing processes (full path)")
    parser.add_argument("--window", type=int, default=0,
                        help="pushes in flight per client (default: 2 x write_batch / clients)")
    parser.add_argument("--batch", type=int, default=ReplayConfig().write_batch,
                        help="frames per LMDB transaction (replay.write_batch)")
    parser.add_argument("--dir", default=None, help="where the LMDB files go (default: a tmp dir)")
    args = parser.parse_args()
    window = args.window or max(1, 2 * args.batch // args.clients)
    work = Path(tempfile.mkdtemp(prefix="dataplane-", dir=args.dir))
    try:
        zmq_r = bench_zmq(f"ipc://{work}/raw.sock", args.seconds, args.size)
        lmdb_r = bench_lmdb(work / "raw.lmdb", args.seconds, args.size, args.batch)
        shutil.rmtree(work / "raw.lmdb")
        (work / "run").mkdir()
        full_r, frame, extra = bench_full(work / "run", args.seconds, args.size, args.clients,
                                          window, args.batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = full_r.mb_s / min(zmq_r.mb_s, lmdb_r.mb_s)
    print(f"# {os.cpu_count()} cpus; --seconds {args.seconds} --size {args.size} "
          f"--clients {args.clients} window {window} write_batch {args.batch}; "
          f"group frame {frame} bytes")
    for r in (zmq_r, lmdb_r, full_r):
        print(f"{r.name:10s} {r.mb_s:9.1f} MB/s {r.per_s:10.0f} msg/s   ({r.messages} in "
              f"{r.seconds:.2f}s)")
    print(f"ratio full / min(raw zmq, raw lmdb) = {ratio:.2f}  (target >= 0.5)")
    print(json.dumps({"zmq_mb_s": round(zmq_r.mb_s, 1), "lmdb_mb_s": round(lmdb_r.mb_s, 1),
                      "full_mb_s": round(full_r.mb_s, 1), "full_groups_s": round(full_r.per_s),
                      "frame_bytes": frame, "ratio": round(ratio, 3), **extra}))


if __name__ == "__main__":
    main()
