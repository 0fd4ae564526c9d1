"""``autodidact run``: compose one run on one machine, every role its own process.

    cfg: resolved once (autodidact/resolve.py); a new config once Redis, then the model, is known
    the CLI holds the run directory's launcher lock (claim_run_dir) for the whole run
    with private Redis (unless redis.url), Supervisor() as roles:
        coordinator.start()                        run state, admission counters
        start replay; wait until it answers
        stages.up_to_training: base model, split.json, then explore, seed the experience
            pool, evaluate held-out success, warm-start on verified references of the task
            mixture, evaluate again                                     (skipped on --resume)
        with judge.serve: vllm serve on that model for the judges' endpoint (served_judge)
        start the learner, the actors, the judges, the experience extractor
            (and an explorer with explore.stage=alongside)               (roles.training_roles)
        until the learner finishes (supervise):
            coordinator.tick()    Redis alive and refilled, the task queue full
            roles.check()         dead roles restarted
            reporter.tick(roles)  every 10 s: progress line, replay stats, wandb, restarts
        stages.after_training: export the final weights, evaluate held-out success;
            summary.json; the summary line
    everything is stopped on exit, Ctrl-C and error; every child, Redis included, also has
    the parent-death signal, so a launcher killed outright takes its roles with it
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from rich.console import Console

from autodidact.cli_common import library_logs_to
from autodidact.coordinator import Coordinator
from autodidact.node_cli import worker_hint
from autodidact.progress import Reporter, checkpoint_fallbacks, print_summary
from autodidact.roles import replay_role, training_roles, wait_for_replay, write_resolved_config
from autodidact.stages import StartRefused, after_training, up_to_training
from autodidact.supervisor import Supervisor, stop_signals_interrupt
from autodidact.tracking import WandbMirror, read_summary
from autodidact.vllm_serve import served_judge
from protocol.config import RunConfig, redact_url, redacted_config
from protocol.errors import TransportTimeout
from protocol.run_dir import RunDir, single_writer_lock

console = Console(stderr=True, soft_wrap=True)


def launch(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
           resume: bool = False) -> int:
    """Start the services and roles of a run; returns a process exit code. ``cfg`` is resolved
    for a run started here (``resolve.Flags(redis_prefix=True, local_services=True)``)."""
    if not (cfg.replay.address and cfg.redis.prefix):
        raise ValueError("launch needs a config resolved for a local run "
                         "(replay.address and redis.prefix set)")
    rd = RunDir(run_dir)
    rd.logs.mkdir(exist_ok=True)
    library_logs_to(rd.log("libraries"))
    console.print(f"[bold]autodidact run[/] {cfg.name} in {run_dir}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(stop_signals_interrupt())
        try:
            cfg, coordinator = start_control_plane(stack, cfg, run_dir)
            roles = stack.enter_context(Supervisor(pids_path=rd.pids))
            start_replay(cfg, run_dir, roles)
            return train(cfg, run_dir, coordinator, roles, max_updates, resume)
        except TransportTimeout:
            console.print(f"[red]replay server did not answer; see {rd.log('replay')}[/]")
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every role (the learner checkpoints)[/]")
            return 130


def claim_run_dir(run_dir: Path) -> int:
    """The run directory's launcher lock (an fd; held until closed or this process dies);
    RuntimeError naming the holder's pid when another launcher has it. Two launchers on one
    directory would run two Redis servers on one AOF and two learners on one ledger."""
    rd = RunDir(run_dir)
    return single_writer_lock(rd.path, rd.launcher_lock.name,
                              f"{run_dir} is in use by another autodidact run (pid {{pid}}); "
                              f"stop it first, or use another --run-dir")


def start_control_plane(stack: contextlib.ExitStack, cfg: RunConfig,
                        run_dir: Path) -> tuple[RunConfig, Coordinator]:
    """The run's Redis and the coordinator, started and released with ``stack``
    (Coordinator.open); returns the config that names that Redis."""
    cfg, coordinator = Coordinator.open(stack, cfg, run_dir)
    console.print(f"  redis   {redact_url(cfg.redis.url)}")
    return cfg, coordinator


def start_replay(cfg: RunConfig, run_dir: Path, roles: Supervisor) -> None:
    """Start the replay server and wait until it answers (TransportTimeout after 60 s)."""
    roles.start(replay_role(run_dir, write_resolved_config(cfg, run_dir)))
    stats = wait_for_replay(cfg, timeout_s=60)
    console.print(f"  replay  {cfg.replay.address}  ({stats.get('groups', 0)} groups)")
    if cfg.actor.num_actors == 0 or cfg.redis.bind:  # actors run on other nodes
        console.print(worker_hint(cfg, run_dir), highlight=False)


def train(cfg: RunConfig, run_dir: Path, coordinator: Coordinator, roles: Supervisor,
          max_updates: int | None, resume: bool) -> int:
    summary = read_summary(run_dir) if resume else {}
    try:
        start = up_to_training(cfg, run_dir, coordinator.control, summary, resume)
    except StartRefused as exc:  # no synthetic tasks, a context too short
        console.print(f"[red]{exc}[/]")
        return 1
    with contextlib.ExitStack() as judge_llm:
        try:  # the LLM judge's server, when judge.serve asks for one
            cfg = judge_llm.enter_context(served_judge(start.cfg, run_dir))
        except (RuntimeError, TimeoutError, OSError) as exc:
            console.print(f"[red]judge.serve: {exc}[/]")
            return 1
        if cfg.judge.serve and cfg.judge.workers:
            console.print(f"  judge   vllm serve {cfg.judge.serve} at {cfg.judge.url}")
        return _train_and_finish(cfg, run_dir, coordinator, roles, max_updates, resume,
                                 start, summary)


def _train_and_finish(cfg: RunConfig, run_dir: Path, coordinator: Coordinator,
                      roles: Supervisor, max_updates: int | None, resume: bool, start,
                      summary: dict) -> int:
    """Start the RL roles on ``cfg`` (the config they read from here on), supervise them
    until the learner finishes, then evaluate and summarise."""
    config_path = write_resolved_config(cfg, run_dir)
    for spec in training_roles(cfg, run_dir, config_path, max_updates, resume):
        roles.start(spec)
    coordinator.feed(start.original, start.share)
    mirror = WandbMirror(run_dir, cfg.tracking.wandb, redacted_config(cfg), cfg.name,
                         cfg.tracking.group)
    try:
        try:
            failed = supervise(cfg, run_dir, coordinator, roles, mirror)
        finally:
            coordinator.finishing()
            roles.stop()
        code = 1 if failed else 0
        summary["restarts"] = coordinator.restarts(roles)
        summary["failed_roles"] = failed
        # Each one's own reason, quoted from its log: the run's output says why, not only who.
        summary["failure_reasons"] = {name: roles.failure(name) for name in failed}
        summary["checkpoint_fallbacks"] = checkpoint_fallbacks(run_dir)
        for key in ("success_rl", "test"):  # an earlier run's, when this one was a resume
            summary.pop(key, None)
        summary.update(after_training(cfg, run_dir, learner_finished=not failed,
                                      base=start.base))
        RunDir(run_dir).summary.write_text(json.dumps(summary, indent=2, default=str))
    finally:
        mirror.close(summary)  # after the final evaluation, so wandb's summary has it
    print_summary(summary)
    coordinator.done()
    return code


def supervise(cfg: RunConfig, run_dir: Path, coordinator: Coordinator, roles: Supervisor,
              mirror: WandbMirror) -> list[str]:
    """Keep Redis and the task queue, restart dead roles and report progress until the
    learner has finished (exited 0: returns []) or roles failed for good (returns them)."""
    reporter = Reporter(cfg, run_dir, coordinator, mirror)
    try:
        while True:
            coordinator.tick()
            failed = roles.check()
            if roles.exited("learner") == 0:
                return []
            if failed:
                console.print(f"[red]roles failed for good: {', '.join(failed)}; stopping the "
                              f"others[/]")
                return failed
            reporter.tick(roles)
            time.sleep(0.5)
    finally:
        reporter.close()
