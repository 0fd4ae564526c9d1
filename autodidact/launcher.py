"""``autodidact run``: compose one run on one machine, every role its own process.

    model = tiny local model (made once) or cfg.model.path
    with private Redis (unless redis.url), Supervisor() as roles:
        start replay; wait until it answers
        explore and synthesize tasks when the task mixture needs them  (explore.stage)
        warm-start on verified references of the mixture; evaluate held-out success
                                                                         (skipped on --resume)
        start the learner, the actors, the judges, the experience extractor
        (and an explorer with explore.stage=alongside)
        until the learner finishes: keep the task queue full, restart dead actors, show progress
        evaluate held-out success with the final weights; print the summary
    everything is stopped on exit, Ctrl-C and error
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import time
from pathlib import Path

import redis
import yaml
from rich.console import Console

from autodidact.embedded_redis import EmbeddedRedis
from autodidact.recovery import RedisWatch, restore_synthetic
from autodidact.supervisor import RoleSpec, Supervisor
from autodidact.task_mix import TaskFeeder, synthetic_share, warmstart_tasks
from autodidact.tracking import WandbMirror
from metrics.jsonl import MetricsTail, MetricsWriter, read_metrics
from protocol.config import RunConfig, to_dict
from protocol.control import ControlPlane, default_prefix, redact
from protocol.errors import RemoteError, TransportTimeout
from protocol.transport import local_address

log = logging.getLogger(__name__)
console = Console(stderr=True, soft_wrap=True)


def write_resolved_config(cfg: RunConfig, run_dir: Path, name: str = "config.yaml") -> Path:
    """``<run_dir>/<name>`` for the roles; mode 0600, since ``redis.url`` carries the
    password."""
    path = run_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a config.yaml from before may be world-readable
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def shareable_config(cfg: RunConfig) -> dict:
    """The config for trackers and reports: the Redis password redacted."""
    values = to_dict(cfg)
    values["redis"]["url"] = redact(values["redis"]["url"])
    return values


def role_argv(role: str, run_dir: Path, config_path: Path, *extra: str) -> list[str]:
    """How the launcher starts a role: the same CLI a user runs on another machine."""
    return ["-m", "autodidact.cli", role, "--run-dir", str(run_dir), "-c", str(config_path),
            *extra]


def learner_argv(cfg: RunConfig, run_dir: Path, config_path: Path, *extra: str) -> list[str]:
    """The learner's command: one process, or ``learner.nproc`` of them under torchrun (one
    per GPU; each draws its share of every batch, rank 0 publishes and checkpoints)."""
    argv = role_argv("learner", run_dir, config_path, *extra)
    if cfg.learner.nproc == 1:
        return argv
    return ["-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={cfg.learner.nproc}", *argv]


def wait_for_replay(cfg: RunConfig, timeout_s: float) -> dict:
    from protocol.replay_client import ReplayClient

    client = ReplayClient.for_run(cfg, retry_after_s=0.5, timeout_s=timeout_s)
    try:
        return client.stats()
    finally:
        client.close()


def prepare_model(cfg: RunConfig, run_dir: Path) -> str:
    """The base model path: cfg.model.path, or a tiny model fitted to the env's vocabulary."""
    if cfg.model.path:
        return cfg.model.path
    from environments import env_class
    from inference.tiny_model import make_tiny_model
    from navigating.navigator import policy_vocabulary

    m = cfg.model
    words, special = policy_vocabulary(env_class(cfg.env.name))
    path = make_tiny_model(run_dir / "model", words, special_words=special, hidden=m.hidden,
                           layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                           intermediate=m.intermediate,
                           max_positions=m.max_positions, seed=cfg.seed)
    return str(path)


def write_split(run_dir: Path, env) -> Path:
    """``split.json``: which of the env's own tasks train and which are held out, by id, so a
    later run or evaluation can show it used the same split."""
    path = run_dir / "split.json"
    split = {"env": env.name, **{s: [t.task_id for t in env.tasks(s)] for s in ("train", "test")}}
    path.write_text(json.dumps(split, indent=1))
    return path


def held_out_eval(cfg: RunConfig, run_dir: Path, model_path: str, label: str,
                  updates: int) -> dict | None:
    """:func:`held_out_success`, also logged as ``eval/...`` at learner update ``updates`` so
    reports can put held-out success on the update and wall-time axes."""
    result = held_out_success(cfg, model_path, label)
    if result is not None:
        writer = MetricsWriter(run_dir, "eval")
        writer.log({"success_avg": result["avg"], "success_best": result["best"],
                    "success_greedy": result.get("greedy"), "tasks": result["tasks"]},
                   step=updates)
        writer.close()
    return result


def held_out_success(cfg: RunConfig, model_path: str, label: str) -> dict | None:
    """avg@k and best@k (sampled) and greedy success on held-out tasks."""
    if cfg.eval.num_tasks == 0:
        return None
    from environments.base import env_maker
    from episodes.evaluate import evaluate
    from episodes.rollout import rollout_settings
    from inference.backends.hf import TransformersBackend

    make_env = env_maker(cfg.env)
    tasks = make_env().tasks("test")
    tasks = random.Random(cfg.seed).sample(tasks, min(cfg.eval.num_tasks, len(tasks)))
    e = cfg.eval
    with TransformersBackend(model_path, device=cfg.actor.device) as backend:
        sampled = evaluate(backend, tasks, make_env, rollout_settings(cfg),
                           temperature=e.temperature, k=e.k, seed=cfg.seed)
        result = {"avg": sampled["avg"], "best": sampled["best"], "tasks": sampled["tasks"]}
        if e.greedy:
            greedy = evaluate(backend, tasks, make_env, rollout_settings(cfg),
                              temperature=0.0, seed=cfg.seed)
            result["greedy"] = greedy["avg"]
    greedy_text = f", greedy {result['greedy']:.1%}" if "greedy" in result else ""
    console.print(f"  held-out success {label}: [bold]avg@{e.k} {result['avg']:.1%}[/] "
                  f"(best@{e.k} {result['best']:.1%}{greedy_text}; {result['tasks']} tasks)")
    return result


def warm_start_stage(cfg: RunConfig, run_dir: Path, base_path: str,
                     tasks: list | None = None) -> str:
    from episodes.rollout import rollout_settings
    from learner.warmstart import warm_start

    out = run_dir / "policy_init"
    if cfg.warmstart.steps == 0:
        return base_path
    if (out / "config.json").exists():
        console.print(f"  warm-start: reusing {out}")
        return str(out)

    def progress(step, loss):
        console.print(f"  warm-start step {step}/{cfg.warmstart.steps}  loss {loss:.3f}",
                      highlight=False)

    info = warm_start(cfg, base_path, out, rollout_settings(cfg), progress, tasks)
    console.print(f"  warm-start: {info['examples']} verified references, "
                  f"{info['steps']} steps in {info['seconds']:.0f}s")
    return str(out)


def experience_stage(cfg: RunConfig, run_dir: Path) -> dict | None:
    """Seed the experience pool from the explore stage's trajectories (when there are)."""
    if not (cfg.experience.enabled and cfg.experience.init_from_explorations):
        return None
    from judge.experience_worker import make_extractor, seed_from_explorations
    from navigating.pool import open_pool

    pool = open_pool(cfg, run_dir=run_dir)
    counts = seed_from_explorations(pool, run_dir, make_extractor(cfg))
    console.print(f"  experience pool: {pool.size()} experiences "
                  f"({counts.get('added', 0)} from explorations)")
    return {"pool_size": pool.size(), **counts}


def explore_stage(cfg: RunConfig, run_dir: Path, control: ControlPlane, policy_path: str,
                  share: float) -> dict | None:
    """Explore before training when the config asks for it; the pool in Redis mirrors the
    durable task store either way (a fresh Redis gets the stored tasks back)."""
    from questioning.factory import run_explore

    restore_synthetic(run_dir, control)
    stored = control.synthetic_len()
    stage = cfg.explore.stage
    wanted = stage in ("before", "alongside") or (
        stage == "auto" and share > 0 and stored < cfg.explore.min_tasks)
    if not wanted:
        return None
    console.print(f"  explore: {stored} synthetic tasks stored; exploring "
                  f"({cfg.explore.rounds or 1} round(s))")
    return run_explore(cfg, run_dir, cfg.explore.rounds or 1, policy_path=policy_path,
                       say=lambda m: console.print(f"  {m}", highlight=False))


@contextlib.contextmanager
def _stop_signals_interrupt():
    """SIGTERM (a scheduler, ``kill``) stops a run as Ctrl-C does: every role stops, the learner
    checkpoints. SIGINT is re-armed too: a shell starting us in the background ignores it."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def launch(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
           resume: bool = False) -> int:
    """Start the services and roles of a run; returns a process exit code."""
    if not cfg.replay.address:
        cfg.replay.address = local_address(run_dir, "replay")
    if not cfg.redis.prefix:
        cfg.redis.prefix = default_prefix(cfg.name)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    console.print(f"[bold]autodidact run[/] {cfg.name} in {run_dir}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_stop_signals_interrupt())
        try:
            embedded = None
            if not cfg.redis.url:
                embedded = EmbeddedRedis(run_dir, bind=cfg.redis.bind)
                cfg.redis.url = stack.enter_context(embedded)
            control = ControlPlane.connect(cfg.redis.url, cfg.redis.prefix,
                                           cfg.redis.heartbeat_ttl_s)
            control.set_state(phase="starting", started_at=time.time(), run_dir=str(run_dir))
            console.print(f"  redis   {redact(cfg.redis.url)}")
            redis_watch = RedisWatch(cfg, run_dir, control, embedded)
            roles = stack.enter_context(Supervisor(pids_path=run_dir / "pids.json"))
            config_path = write_resolved_config(cfg, run_dir)
            roles.start(RoleSpec("replay", role_argv("replay", run_dir, config_path),
                                 log_path=logs / "replay.log"))
            stats = wait_for_replay(cfg, timeout_s=60)
            console.print(f"  replay  {cfg.replay.address}  ({stats.get('groups', 0)} groups)")
            if cfg.actor.num_actors == 0 or cfg.redis.bind:  # actors run on other nodes
                from autodidact.node_cli import worker_hint

                console.print(worker_hint(cfg, run_dir), highlight=False)
            return train(cfg, run_dir, control, roles, redis_watch, logs, max_updates, resume)
        except TransportTimeout:
            console.print(f"[red]replay server did not answer; see {logs / 'replay.log'}[/]")
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every role (the learner checkpoints)[/]")
            return 130


def train(cfg, run_dir, control, roles, redis_watch, logs, max_updates, resume) -> int:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if resume and summary_path.exists() else {}
    from environments.base import env_maker

    base = prepare_model(cfg, run_dir)
    env = env_maker(cfg.env)()
    write_split(run_dir, env)
    original = env.tasks("train")
    share = synthetic_share(cfg, original)
    if not resume or "success_warm" not in summary:
        summary["synthetic_share"] = share
        summary["explore"] = explore_stage(cfg, run_dir, control, base, share)
        synthetic = control.synthetic_since(0)
        if share > 0 and not synthetic:
            console.print("[red]tasks.synthetic_share > 0 but there are no synthetic tasks: "
                          "run `autodidact explore` or set explore.stage[/]")
            return 1
        summary["experience_init"] = experience_stage(cfg, run_dir)
        summary["success_base"] = held_out_eval(cfg, run_dir, base, "before warm-start", 0)
        cfg.model.path = warm_start_stage(cfg, run_dir, base,
                                          warmstart_tasks(cfg, original, synthetic, share))
        summary["success_warm"] = held_out_eval(cfg, run_dir, cfg.model.path,
                                                "after warm-start", 0)
        summary_path.write_text(json.dumps(summary, indent=2))
    else:
        cfg.model.path = str(run_dir / "policy_init") if cfg.warmstart.steps else base
    config_path = write_resolved_config(cfg, run_dir)
    learner_extra = ["--max-updates", str(max_updates)] if max_updates else []
    # A learner that crashes comes back from its last checkpoint and ledger (--resume).
    resumed = learner_argv(cfg, run_dir, config_path, *learner_extra, "--resume")
    roles.start(RoleSpec("learner", resumed if resume else resumed[:-1], restart_argv=resumed,
                         max_restarts=5, log_path=logs / "learner.log",
                         process_group=cfg.learner.nproc > 1))
    for i in range(cfg.actor.num_actors):
        roles.start(RoleSpec(f"actor-{i}", role_argv("actor", run_dir, config_path,
                                                     "--actor-id", f"actor-{i}"),
                             log_path=logs / f"actor-{i}.log"))
    for i in range(cfg.judge.workers):
        roles.start(RoleSpec(f"judge-{i}", role_argv("judge", run_dir, config_path,
                                                     "--judge-id", f"judge-{i}"),
                             log_path=logs / f"judge-{i}.log"))
    if cfg.experience.enabled and cfg.experience.update_every:
        roles.start(RoleSpec("experience", role_argv("experience", run_dir, config_path),
                             log_path=logs / "experience.log"))
    if cfg.explore.stage == "alongside":
        roles.start(RoleSpec("explore", role_argv("explore", run_dir, config_path, "--rounds",
                                                  "0"), log_path=logs / "explore.log"))
    control.set_state(phase="rl")
    feeder = TaskFeeder(cfg, control, original, share)
    mirror = WandbMirror(run_dir, cfg.tracking.wandb, shareable_config(cfg), cfg.name,
                         cfg.tracking.group)
    try:
        try:
            code = supervise(cfg, run_dir, control, roles, redis_watch, feeder, mirror)
        finally:
            # Worker nodes (autodidact node) stop their roles on this; "done" comes only
            # after the final evaluation, moments before Redis goes away with the launcher.
            with contextlib.suppress(redis.RedisError):
                control.set_state(phase="finishing")
            roles.stop()
        summary["restarts"] = {**roles.restarts(), "redis": redis_watch.restarts}
        learner_rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
        summary["learner"] = learner_rows[-1] if learner_rows else {}
        final = _latest_weights(run_dir, cfg.model.path)
        if code == 0 and final is not None:
            summary["success_rl"] = held_out_eval(cfg, run_dir, final, "after RL",
                                                  summary["learner"].get("learner/updates", 0))
        summary_path.write_text(json.dumps(summary, indent=2, default=str))
    finally:
        mirror.close(summary)  # after the final evaluation, so wandb's summary has it
    _print_summary(summary)
    control.set_state(phase="done")
    return code


def supervise(cfg, run_dir, control, roles, redis_watch, feeder, mirror) -> int:
    """Restart dead roles and Redis, keep tasks flowing, show progress until the learner has
    finished (exited 0)."""
    t0, last_print = time.monotonic(), 0.0
    progress = Progress(run_dir)
    replay_stats = ReplayMonitor(run_dir, cfg)
    try:
        while True:
            redis_watch.check()
            try:
                feeder.top_up()
            except redis.RedisError as exc:  # Redis is being restarted: the next tick refills
                log.warning("task queue not topped up: %s", exc)
            failed = roles.check()
            if roles.exited("learner") == 0:
                return 0
            if failed:
                console.print(f"[red]roles failed for good: {failed}; see {run_dir / 'logs'}[/]")
                return 1
            if time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                replay_stats.log()
                mirror.sync(progress.update())
                with contextlib.suppress(redis.RedisError):
                    control.set_state(restarts={**roles.restarts(),
                                                "redis": redis_watch.restarts})
                    progress.show(control, roles, time.monotonic() - t0)
            time.sleep(0.5)
    finally:
        replay_stats.close()
        mirror.sync(progress.update())


class ReplayMonitor:
    """Logs the replay server's stats (sizes, rejections) and ingest rate as ``replay/...``."""

    def __init__(self, run_dir: Path, cfg: RunConfig):
        from protocol.replay_client import ReplayClient

        self.client = ReplayClient.for_run(cfg, timeout_s=5.0)
        self.metrics = MetricsWriter(run_dir, "replay")
        self._last: tuple[float, int] | None = None

    def log(self) -> None:
        try:
            stats = self.client.stats()
        except (TransportTimeout, RemoteError) as exc:
            log.warning("replay stats unavailable: %s", exc)
            return
        now, groups = time.monotonic(), int(stats.get("groups", 0))
        if self._last is not None:
            stats["groups_per_s"] = (groups - self._last[1]) / max(now - self._last[0], 1e-9)
        self._last = (now, groups)
        self.metrics.log({k: v for k, v in stats.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        self.client.close()
        self.metrics.close()


class Progress:
    """The live progress line, fed from the new records of metrics.jsonl."""

    def __init__(self, run_dir: Path):
        self.tail = MetricsTail(run_dir)
        self.learner: dict = {}
        self.actors: list[dict] = []

    def update(self) -> list[dict]:
        records = self.tail.read_new()
        for rec in records:
            if rec.get("role") == "learner" and "learner/loss" in rec:
                self.learner = rec
            elif rec.get("role") == "actor":
                self.actors = (self.actors + [rec])[-20:]
        return records

    def show(self, control, roles, elapsed_s) -> None:
        rates = [a.get("actor/success_rate", 0) for a in self.actors]
        success = sum(rates) / max(len(rates), 1)
        counters = control.counters()
        groups = counters.get("actor/accepted", 0)
        judged = counters.get("judge/groups_labelled", 0)
        lr = self.learner
        console.print(
            f"  [{elapsed_s:5.0f}s] update {lr.get('learner/updates', 0):>4}  "
            f"version {lr.get('learner/version', 0):>4}  actor success {success:6.1%}  "
            f"groups {groups:>6} ({groups / max(elapsed_s, 1e-9):.1f}/s, judged {judged})  "
            f"lag {lr.get('learner/lag_mean', 0):.2f}  restarts {len(roles.restart_log)}",
            highlight=False)


def _latest_weights(run_dir: Path, init: str) -> str | None:
    """Save the newest published weights over the model ``init`` as a loadable directory."""
    files = sorted((run_dir / "weights").glob("v*.safetensors"))
    if not files:
        return None
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(init)
    model.load_state_dict(load_file(files[-1]))
    out = run_dir / "policy_final"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(init).save_pretrained(out)
    return str(out)


def _print_summary(summary: dict) -> None:
    def pct(stage, key="avg"):
        v = (summary.get(f"success_{stage}") or {}).get(key)
        return "n/a" if v is None else f"{v:.1%}"

    learner = summary.get("learner", {})
    console.print(f"[bold]summary[/]  held-out avg@k: base {pct('base')} -> warm-start "
                  f"{pct('warm')} -> RL {pct('rl')}   (greedy: {pct('base', 'greedy')} -> "
                  f"{pct('warm', 'greedy')} -> {pct('rl', 'greedy')})   "
                  f"{learner.get('learner/updates', 0)} updates, "
                  f"version {learner.get('learner/version', 0)}")
