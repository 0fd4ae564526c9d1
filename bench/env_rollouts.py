"""Rollouts per second of the default ``files`` run's actors, the env in process vs served.

    python -m bench.env_rollouts [--actors 2] [--batches 16] [--repeats 2] [--workers 2]
                                 [--policy PATH] [--json F]

Two arms, the same in all but where the env lives: the default run's actors (its config's
``actor`` and ``env`` sections: transformers on CPU, ``group_size`` x ``groups_in_flight``
episodes a batch, constrained decoding, 5 turns) roll out ``--batches`` batches each, every
actor its own processes, all starting together. In process, each actor makes ``FilesEnv``
objects as a run without ``env.address`` does; served, each env is a session on one
``autodidact env serve files --workers W`` the bench started (on this machine, so its
workers share the cores with the actors, as they would in such a run). Same tasks, same
seeds: the rollouts of the two arms must be the same token for token (checked, reported as
``same_rollouts``). The arms alternate (in process, served, in process, ...) ``--repeats``
times; each pair gives a ratio, served over in process.

The policy is the default config's base model (the tiny model fitted to the env, untrained:
every episode runs all its turns, the most env calls a rollout makes) unless ``--policy``
names a folder (a run's ``policy_init``). For the served arm it also reports the env
socket's latency per call, all calls and per request type, as the actors saw it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from autodidact.env_serve import EnvServerProcess
from bench.env_sessions import percentiles
from bench.output import command_line, write_result
from metrics.intervals import seed_interval
from protocol.config import load_config

START_TIMEOUT_S = 600.0  # loading a policy and the first batch, on a loaded machine


def actor(job: dict, ready, go, results) -> None:
    """One actor's batches (after one untimed batch that loads everything); its counts,
    wall time, rollout digest and, served, the env socket's call timings."""
    import torch

    from environments import env_class, env_maker
    from episodes.rollout import rollout, rollout_settings, start_episodes
    from inference.backends.base import SamplingParams
    from inference.codecs import make_codec
    from inference.engines import make_backend

    cfg = load_config(None, job["overrides"])
    torch.set_num_threads(cfg.actor.torch_threads)
    env_s = _time_env_calls()
    env_cfg = dataclasses.replace(cfg.env, address=job["address"], call_timeout_s=60.0)
    backend = make_backend(cfg, job["policy"])
    codec, settings, make = make_codec(backend.tokenizer), rollout_settings(cfg), env_maker(env_cfg)
    tasks = env_class(cfg.env)(**cfg.env.options).tasks("train")
    order = np.random.default_rng([cfg.seed, job["index"]]).permutation(len(tasks))
    per_batch = cfg.actor.groups_in_flight

    def batch(b: int):
        chosen = [tasks[i] for i in order[b * per_batch:(b + 1) * per_batch]]
        episodes = start_episodes(chosen, cfg.actor.group_size, make, codec, settings=settings)
        params = SamplingParams(temperature=cfg.actor.temperature, top_p=cfg.actor.top_p,
                                max_new_tokens=cfg.actor.max_action_tokens,
                                stop_token_ids=(codec.eoa_id,), logprobs_mode="raw",
                                seed=cfg.seed * 1000 + job["index"] * 100 + b)
        return rollout(backend, episodes, codec, params, settings)

    batch(job["batches"])  # untimed: first calls, allocations (tasks past the timed ones)
    served = env_class(env_cfg) if job["address"] else None
    if served is not None:
        served.drain_timings()
    ready.put(job["index"])
    go.wait()
    env_s[0] = 0.0
    t0, cpu0 = time.perf_counter(), time.process_time()
    episodes = [ep for b in range(job["batches"]) for ep in batch(b)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    digest = hashlib.sha256(json.dumps([[ep.tokens, ep.reward] for ep in episodes]).encode())
    results.put({"index": job["index"], "wall_s": wall, "cpu_s": cpu, "env_s": env_s[0],
                 "rollouts": len(episodes),
                 "steps": sum(len(ep.steps) for ep in episodes),
                 "failed": sum(ep.failure is not None for ep in episodes),
                 "digest": digest.hexdigest(),
                 "timings": served.drain_timings() if served is not None else []})


def _time_env_calls() -> list[float]:
    """Seconds the rollouts spend in env calls (making envs and every call of theirs), summed
    into the returned one-element list: the env's share of an actor's time, either arm."""
    from episodes import rollout

    spent = [0.0]

    def timed(call):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return call(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    rollout.call_all, rollout.make_envs = timed(rollout.call_all), timed(rollout.make_envs)
    return spent


def arm(address: str, args, policy: str) -> dict:
    """Every actor's batches, started together; rollouts/s over the slowest actor's wall."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per actor, as a run's roles are
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=actor, args=({"index": i, "address": address,
                                               "overrides": args.set, "policy": policy,
                                               "batches": args.batches}, ready, go, results))
             for i in range(args.actors)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=START_TIMEOUT_S)
        go.set()
        done = sorted((results.get(timeout=START_TIMEOUT_S) for _ in procs),
                      key=lambda r: r["index"])
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    wall = max(r["wall_s"] for r in done)
    rollouts = sum(r["rollouts"] for r in done)
    return {"served": bool(address), "rollouts": rollouts, "wall_s": wall,
            "rollouts_per_s": rollouts / wall,
            "env_share": sum(r["env_s"] for r in done) / sum(r["wall_s"] for r in done),
            "actor_cpu_s": sum(r["cpu_s"] for r in done),
            "steps": sum(r["steps"] for r in done),
            "failed": sum(r["failed"] for r in done), "digests": [r["digest"] for r in done],
            "timings": [t for r in done for t in r["timings"]]}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process under it (the env server's
    broker and workers)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())


def latency(timings: list) -> dict:
    """p50/p99 in ms of every call, and of each request type."""
    kinds = sorted({kind for kind, _ in timings})
    return {"all": percentiles([s for _, s in timings]),
            **{kind: percentiles([s for k, s in timings if k == kind]) for kind in kinds}}


def measure(args) -> dict:
    cfg = load_config(None, args.set)
    with tempfile.TemporaryDirectory(prefix="env-rollouts-") as tmp:
        from autodidact.base_model import prepare_model

        policy = args.policy or prepare_model(cfg, Path(tmp))
        arms = []
        with EnvServerProcess(cfg.env.name, workers=args.workers) as server:
            for _ in range(args.repeats):
                for address in ("", server.address):
                    cpu0 = _cpu_s(server.proc.pid)
                    arms.append(arm(address, args, str(policy)))
                    arms[-1]["env_server_cpu_s"] = _cpu_s(server.proc.pid) - cpu0
                    print(f"  {'served    ' if address else 'in process'}: "
                          f"{arms[-1]['rollouts_per_s']:.2f} rollouts/s "
                          f"({arms[-1]['rollouts']} in {arms[-1]['wall_s']:.1f} s, "
                          f"{arms[-1]['env_share']:.0%} of it in env calls; CPU s: actors "
                          f"{arms[-1]['actor_cpu_s']:.1f}, env server "
                          f"{arms[-1]['env_server_cpu_s']:.1f})", flush=True)
    local = [a for a in arms if not a["served"]]
    served = [a for a in arms if a["served"]]
    ratios = [s["rollouts_per_s"] / i["rollouts_per_s"] for i, s in zip(local, served)]
    timings = [t for a in served for t in a.pop("timings")]
    for a in local:
        a.pop("timings")
    return {
        "actors": args.actors, "batches_per_actor": args.batches, "env_workers": args.workers,
        "episodes_per_batch": cfg.actor.group_size * cfg.actor.groups_in_flight,
        "policy": args.policy or "the default config's base model (untrained)",
        "arms": arms,
        "ratio_served_to_in_process": {"per_pair": ratios, "mean": float(np.mean(ratios)),
                                       # Student's t over the pairs' ratios (one pair: None)
                                       "mean_ci95": list(seed_interval(ratios))
                                       if len(ratios) > 1 else None,
                                       "pooled": sum(a["rollouts"] for a in served)
                                       / sum(a["wall_s"] for a in served)
                                       / (sum(a["rollouts"] for a in local)
                                          / sum(a["wall_s"] for a in local))},
        "same_rollouts": len({tuple(a["digests"]) for a in arms}) == 1,
        "env_socket_latency": latency(timings),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--batches", type=int, default=16, help="timed batches per actor and arm")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of arms")
    ap.add_argument("--workers", type=int, default=2, help="env server worker processes")
    ap.add_argument("--policy", default="", help="a policy folder (default: the base model)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = {"command": command_line("bench.env_rollouts", argv),
              "machine": f"{os.cpu_count()} cores", **measure(args)}
    r, lat = result["ratio_served_to_in_process"], result["env_socket_latency"]["all"]
    ci = r["mean_ci95"] and f"95% {r['mean_ci95'][0]:.2f} to {r['mean_ci95'][1]:.2f}; "
    print(f"served / in process: {r['pooled']:.2f}x pooled, {r['mean']:.2f}x the pairs' mean "
          f"({ci or ''}pairs: "
          f"{', '.join(f'{x:.2f}' for x in r['per_pair'])}); same rollouts: "
          f"{result['same_rollouts']}; env socket p50 {lat['p50_ms']:.2f} ms, p99 "
          f"{lat['p99_ms']:.2f} ms over {lat['calls']} calls")
    write_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
