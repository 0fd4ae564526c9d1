"""The roles of a run as processes: the config file they read, the command each is started
with (the same CLI a user runs on another machine), and which of them a run starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from autodidact.supervisor import RoleSpec
from protocol.config import RunConfig, dump_resolved
from protocol.run_dir import RunDir


def write_resolved_config(cfg: RunConfig, run_dir: Path, path: Path | None = None) -> Path:
    """The config the roles read: ``config.yaml`` in the run directory (or ``path``), with its
    digest line (:func:`protocol.config.dump_resolved`); mode 0600, since ``redis.url``
    carries the password; replaced whole, so a role never reads half of it."""
    path = Path(path) if path is not None else RunDir(run_dir).config
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a leftover from before may be world-readable
    with os.fdopen(fd, "w") as f:
        f.write(dump_resolved(cfg))
    os.replace(tmp, path)
    return path


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


def replay_role(run_dir: Path, config_path: Path) -> RoleSpec:
    return RoleSpec("replay", role_argv("replay", run_dir, config_path),
                    log_path=RunDir(run_dir).log("replay"))


def wait_for_replay(cfg: RunConfig, timeout_s: float) -> dict:
    """The replay server's stats once it answers; TransportTimeout after ``timeout_s``."""
    from protocol.replay_client import ReplayClient

    client = ReplayClient.for_run(cfg, retry_after_s=0.5, timeout_s=timeout_s)
    try:
        return client.stats()
    finally:
        client.close()


def training_roles(cfg: RunConfig, run_dir: Path, config_path: Path,
                   max_updates: int | None = None, resume: bool = False) -> list[RoleSpec]:
    """The roles of the training phase: the learner (restarted from its checkpoint and
    ledger, ``--resume``, when it crashes), ``actor.num_actors`` actors, ``judge.workers``
    judges, the experience extractor (``experience.update_every``) and, with
    ``explore.stage=alongside``, an explorer that runs until stopped."""
    rd = RunDir(run_dir)
    learner_extra = [] if max_updates is None else ["--max-updates", str(max_updates)]
    resumed = learner_argv(cfg, run_dir, config_path, *learner_extra, "--resume")
    specs = [RoleSpec("learner", resumed if resume else resumed[:-1], restart_argv=resumed,
                      max_restarts=5, log_path=rd.log("learner"),
                      process_group=cfg.learner.nproc > 1)]
    for kind, count, flag in (("actor", cfg.actor.num_actors, "--actor-id"),
                              ("judge", cfg.judge.workers, "--judge-id")):
        specs += [RoleSpec(f"{kind}-{i}", role_argv(kind, run_dir, config_path, flag,
                                                    f"{kind}-{i}"),
                           log_path=rd.log(f"{kind}-{i}")) for i in range(count)]
    if cfg.experience.enabled and cfg.experience.update_every:
        specs.append(RoleSpec("experience", role_argv("experience", run_dir, config_path),
                              log_path=rd.log("experience")))
    if cfg.explore.stage == "alongside":
        specs.append(RoleSpec("explore", role_argv("explore", run_dir, config_path,
                                                   "--rounds", "0"),
                              log_path=rd.log("explore")))
    return specs
