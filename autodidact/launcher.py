"""``autodidact run``: compose one run on one machine, every role its own process.

    with private Redis (unless redis.url), Supervisor() as roles:
        start replay; wait until it answers
        start actors and learner          (issue 3)
        until budget spent: restart dead roles, show progress
    everything is stopped on exit, Ctrl-C and error
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import yaml
from rich.console import Console

from autodidact.embedded_redis import EmbeddedRedis
from autodidact.supervisor import RoleSpec, Supervisor
from protocol.config import RunConfig, to_dict
from protocol.control import ControlPlane, default_prefix
from protocol.errors import TransportTimeout
from protocol.messages import Stats, StatsRequest
from protocol.transport import ZmqChannel, local_address

log = logging.getLogger(__name__)
console = Console(stderr=True)


def write_resolved_config(cfg: RunConfig, run_dir: Path) -> Path:
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def role_argv(role: str, run_dir: Path, config_path: Path, *extra: str) -> list[str]:
    """How the launcher starts a role: the same CLI a user runs on another machine."""
    return ["-m", "autodidact.cli", role, "--run-dir", str(run_dir), "-c", str(config_path),
            *extra]


def wait_for_replay(address: str, timeout_s: float) -> dict:
    channel = ZmqChannel(address, retry_after_s=0.5)
    try:
        reply = channel.request(StatsRequest(), timeout_s=timeout_s)
    finally:
        channel.close()
    assert isinstance(reply, Stats)
    return reply.values


def launch(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
           resume: bool = False) -> int:
    """Start the services and roles of a run; returns a process exit code."""
    if not cfg.replay.address:
        cfg.replay.address = local_address(run_dir, "replay")
    if not cfg.redis.prefix:
        cfg.redis.prefix = default_prefix(cfg.name)
    config_path = write_resolved_config(cfg, run_dir)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    console.print(f"[bold]autodidact run[/] {cfg.name} in {run_dir}")
    with contextlib.ExitStack() as stack:
        try:
            redis_url = cfg.redis.url or stack.enter_context(EmbeddedRedis(run_dir))
            control = ControlPlane.connect(redis_url, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s)
            control.set_state(phase="starting", started_at=time.time(), run_dir=str(run_dir))
            console.print(f"  redis   {redis_url}" + ("" if cfg.redis.url else "  (private)"))
            roles = stack.enter_context(Supervisor())
            roles.start(RoleSpec("replay", role_argv("replay", run_dir, config_path),
                                 log_path=logs / "replay.log"))
            stats = wait_for_replay(cfg.replay.address, timeout_s=60)
            console.print(f"  replay  {cfg.replay.address}  ({stats.get('groups', 0)} groups "
                          f"stored)")
            console.print("[yellow]not yet implemented: actors and learner (see issue 3); "
                          "services started and healthy, stopping.[/]")
            control.set_state(phase="stopped")
            return 0
        except TransportTimeout:
            console.print(f"[red]replay server did not answer; see {logs / 'replay.log'}[/]")
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every role[/]")
            return 130

