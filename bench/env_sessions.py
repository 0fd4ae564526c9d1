"""Many concurrent episodes on one env server: per-call latency and the server's memory.

    python -m bench.env_sessions [--sessions 256] [--workers 2] [--steps 5] [--threads 16]
                                 [--json F]

Starts ``autodidact env serve files --workers W``, opens ``--sessions`` env sessions (one per
episode, each reset to a training task) so that all of them are open at once, then steps
every one of them ``--steps`` times, round by round, from ``--threads`` client threads (each
thread has its own socket, as an actor's rollout thread would). Every call is timed; the
server's resident memory (broker and workers) is read before the first session and with all
of them open, and the server says how many sessions it holds then (its ``EnvStats``: every
one opened, none evicted, is what "open at once" means) and once they are closed. The same
resets and steps on the env in this process give the baseline latency. What it cannot
say: rollouts per second of a training run (the actors' generation dominates those; that
comparison needs two runs).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil

from autodidact.env_serve import EnvServerProcess
from bench.output import command_line, write_result
from environments import FilesEnv, env_class
from protocol.config import EnvConfig


def resident_mib(pid: int) -> float:
    """Resident memory of ``pid`` and every process under it, in MiB."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


def action_of(task, turn: int) -> str:
    """The task's reference action for this turn, then a harmless one."""
    return task.reference[turn] if turn < len(task.reference) else "ls"


def timed(call, *args) -> float:
    t0 = time.perf_counter()
    call(*args)
    return time.perf_counter() - t0


def episodes(make_env, tasks, steps: int, threads: int) -> dict:
    """Open one env per task, reset all, then step all ``steps`` rounds: the seconds of every
    reset and step call, and the envs (still open)."""
    pool = ThreadPoolExecutor(threads)
    try:
        envs = list(pool.map(lambda _: make_env(), tasks))
        resets = list(pool.map(lambda pair: timed(pair[0].reset, pair[1]), zip(envs, tasks)))
        step_s = []
        for turn in range(steps):  # a round: every episode one step further
            actions = [action_of(task, turn) for task in tasks]
            step_s += pool.map(lambda pair: timed(pair[0].step, pair[1]), zip(envs, actions))
        return {"reset_s": resets, "step_s": step_s, "envs": envs}
    finally:
        pool.shutdown()


def percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1000
    return {"calls": len(ms), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def measure(sessions: int, workers: int, steps: int, threads: int) -> dict:
    train = FilesEnv().tasks("train")
    tasks = [train[i % len(train)] for i in range(sessions)]
    # Every session stays open: opens are not spread evenly over the workers, so each may
    # have to hold all of them before any is evicted.
    with EnvServerProcess("files", "--max-sessions", str(sessions), "--max-sessions-per-client",
                          str(sessions), workers=workers) as server:
        cfg = EnvConfig(name="files", address=server.address, call_timeout_s=60.0)
        served_cls = env_class(cfg)  # the hello waits until the workers are up
        idle_mib = resident_mib(server.proc.pid)
        t0 = time.perf_counter()
        served = episodes(served_cls, tasks, steps, threads)
        wall = time.perf_counter() - t0
        open_mib = resident_mib(server.proc.pid)
        held = served_cls._link.stats()  # what the server holds with every episode stepped
        for env in served.pop("envs"):
            env.close()
        after = served_cls._link.stats()  # the closes ride with this call, before it
    local = episodes(FilesEnv, tasks, steps, 1)
    local.pop("envs")
    return {"sessions": sessions,
            "server": {"sessions_open": held.sessions, "evicted": held.evicted,
                       "calls_failed": held.failures, "sessions_open_after_close":
                           after.sessions},
            "workers": workers, "steps": steps,
            "client_threads": threads, "wall_s": wall,
            "calls_per_s": (len(served["reset_s"]) + len(served["step_s"])) / wall,
            "server_resident_mib": {"idle": idle_mib, "all_open": open_mib,
                                    "per_session_kib": 1024 * (open_mib - idle_mib) / sessions},
            "served": {"reset": percentiles(served["reset_s"]),
                       "step": percentiles(served["step_s"])},
            "in_process": {"reset": percentiles(local["reset_s"]),
                           "step": percentiles(local["step_s"])}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = {"command": command_line("bench.env_sessions", argv),
              "machine": f"{os.cpu_count()} cores", **measure(args.sessions, args.workers,
                                                             args.steps, args.threads)}
    s, local = result["served"], result["in_process"]
    print(f"{result['server']['sessions_open']} of {args.sessions} sessions open at once on "
          f"the server ({result['server']['evicted']} evicted), {args.workers} workers, "
          f"{result['calls_per_s']:.0f} calls/s from {args.threads} threads; server "
          f"{result['server_resident_mib']['all_open']:.0f} MiB "
          f"({result['server_resident_mib']['per_session_kib']:.0f} KiB a session)")
    for call in ("reset", "step"):
        print(f"  {call}: served p50 {s[call]['p50_ms']:.2f} ms, p99 {s[call]['p99_ms']:.2f} ms;"
              f" in process p50 {local[call]['p50_ms']:.3f} ms, p99 "
              f"{local[call]['p99_ms']:.3f} ms")
    write_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
