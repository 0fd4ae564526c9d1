"""The ``autodidact`` command line: one entry point, one sub-command per role.

``autodidact run`` composes a whole run from one config file and starts every role as its own
process; ``autodidact replay|actor|learner|judge ...`` start one role alone, so a multi-node
launch runs the same program on more machines.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import click

from autodidact.cli_common import (
    check_curve,
    check_model,
    config_option,
    load,
    load_run,
    private_run_dir,
    role_config,
    role_options,
    set_option,
    setup_logging,
)
from autodidact.engine_env import ensure_engine
from autodidact.resolve import Flags
from autodidact.supervisor import exit_when_orphaned
from protocol.config import RunConfig, to_dict
from protocol.messages import REPLAY_ROLES
from protocol.run_dir import RunDir, StoreDamaged, role_token

# Commands defined in their own modules, imported when asked for: every role process starts
# through this group, and the replay server, a judge or `autodidact status` need neither torch
# nor transformers (importing every command took 2 CPU-seconds a process).
LAZY_COMMANDS = {
    "ablation": "autodidact.ablation_cli:ablation",
    "env": "autodidact.env_serve:env",
    "eval": "autodidact.eval_cli:eval_command",
    "export": "autodidact.export_cli:export",
    "keys": "autodidact.keys_cli:keys",
    "llm-check": "autodidact.llm_check:llm_check",
    "model": "autodidact.model_cli:model",
    "node": "autodidact.node_cli:node",
    "report": "autodidact.report:report",
    "status": "autodidact.status_cli:status",
    "sweep": "autodidact.sweep_cli:sweep",
    "tasks": "autodidact.tasks_cli:tasks",
    "view": "autodidact.view_cli:view",
}


class LazyGroup(click.Group):
    """A group whose :data:`LAZY_COMMANDS` are imported on first use (help lists them all)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS and name not in self.commands:
            module, _, attr = LAZY_COMMANDS[name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Autodidact: LLM agents that teach themselves in tool-using environments."""
    setup_logging(verbose)
    exit_when_orphaned()  # a role whose launcher died goes within seconds


@main.command()
@config_option
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default runs/<name>).")
@set_option()
@click.option("--redis-url", default=None, help="Use this Redis; none is started.")
@click.option("--max-updates", type=int, default=None, help="Stop after this many learner updates.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in the run dir.")
@click.option("--final-test", is_flag=True,
              help="After RL, evaluate the base, warm-start and final policies once on the "
                   "test split (eval.final_test); without it the run looks at validation only.")
@click.option("--single-process", is_flag=True,
              help="Replay, one actor, the judge, the experience extractor and the learner as "
                   "threads of this process (the same classes; Redis stays a server): the "
                   "loop to read and step through in a debugger.")
def run(config, run_dir, sets, redis_url, max_updates, resume, final_test, single_process):
    """Run the whole job on one machine: Redis, replay, actors, learner."""
    if final_test:
        sets = (*sets, "eval.final_test=true")
    cfg, path = load_run(config, sets, run_dir,
                         Flags(redis_url=redis_url, redis_prefix=True, local_services=True),
                         make=False)
    check_model(cfg.model.path)
    ensure_engine(cfg)
    check_curve(cfg, cfg.replay.address)
    private_run_dir(path)
    from autodidact.launcher import claim_run_dir

    try:
        claim_run_dir(path)  # held until this process exits, however it exits
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    for role in REPLAY_ROLES:  # before replay starts: it serves each role's requests to it alone
        role_token(path, role, create=True)
    if single_process:
        from autodidact.single_process import run_single_process

        summary = run_single_process(cfg, path, max_updates=max_updates, resume=resume)
        sys.exit(summary["exit_code"])
    from autodidact.launcher import launch

    sys.exit(launch(cfg, path, max_updates=max_updates, resume=resume))


@main.command("config")
@config_option
@set_option()
def show_config(config, sets):
    """Print the resolved config (defaults + file + overrides) as YAML."""
    import yaml

    click.echo(yaml.safe_dump(to_dict(load(config, sets)), sort_keys=False))


# --- replay --------------------------------------------------------------------------------------


@main.group(invoke_without_command=True)
@config_option
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory holding replay.lmdb.")
@set_option()
@click.option("--address", default=None, help="ZeroMQ address to bind (default: replay.address).")
@click.pass_context
def replay(ctx, config, run_dir, sets, address):
    """Serve the replay store (the only writer of <run-dir>/replay.lmdb).

    \b
    autodidact replay --run-dir runs/x            serve
    autodidact replay stats --run-dir runs/x      print store statistics as JSON
    """
    if ctx.invoked_subcommand is not None:
        return
    from autodidact.wiring import replay_process
    from replay.server import RoleTokensMissing

    cfg, path = load_run(config, sets, run_dir)
    private_run_dir(path)
    address = address or cfg.replay.address or None
    try:
        replay_process(path, cfg, address, check_curve(cfg, address))
    except (StoreDamaged, RoleTokensMissing) as exc:
        raise click.ClickException(str(exc)) from None


@replay.command("stats")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Run directory holding replay.lmdb.")
def replay_stats(run_dir):
    """Print one JSON object: groups stored, judged, consumed, evicted, bytes, versions."""
    from replay.store import read_stats

    if not RunDir(run_dir).replay_store.exists():
        raise click.UsageError(f"no replay store at {RunDir(run_dir).replay_store}")
    try:
        click.echo(json.dumps(read_stats(run_dir), sort_keys=True))
    except StoreDamaged as exc:
        raise click.ClickException(str(exc)) from None


@replay.command("check")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Run directory holding replay.lmdb.")
def replay_check(run_dir):
    """Verify every stored group against its checksum (read-only; safe while replay runs).

    Prints what was checked and each damaged group; exits 1 when any is damaged."""
    from replay.store import check_store

    store = RunDir(run_dir).replay_store
    if not store.exists():
        raise click.UsageError(f"no replay store at {store}")
    try:
        found = check_store(run_dir)
    except StoreDamaged as exc:
        raise click.ClickException(str(exc)) from None
    for gid, why in sorted(found["damaged"].items()):
        click.echo(f"damaged {gid}: {why}")
    click.echo(f"replay check {store}: {found['groups']} groups, {found['verified']} verified, "
               f"{found['unchecked']} stored before checksums (decoded only), "
               f"{len(found['damaged'])} damaged")
    if found["damaged"]:
        raise click.ClickException(
            f"{len(found['damaged'])} damaged groups in {store}: restore it from a copy, or "
            f"stop the run and move it away to start an empty store")


# --- actor and learner ------------------------------------------------------------------------


@main.command()
@role_options
@click.option("--actor-id", default="actor-0", help="Stable id (kept across restarts).")
def actor(config, run_dir, sets, redis_url, replay_addr, weights_addr, actor_id):
    """Start one actor: roll out groups and stream them to replay."""
    from autodidact.wiring import actor_process

    cfg, path = role_config(config, sets, run_dir, redis_url, replay_addr, weights_addr)
    ensure_engine(cfg)
    actor_process(cfg, path, actor_id)


@main.command()
@role_options
@click.option("--max-updates", type=int, default=None, help="Stop after this many updates.")
@click.option("--resume", is_flag=True, help="Continue from <run-dir>/checkpoints/latest.pt.")
def learner(config, run_dir, sets, redis_url, replay_addr, weights_addr, max_updates,
            resume):
    """Start the learner: train on groups from replay and publish weights."""
    from autodidact.wiring import learner_process

    cfg, path = role_config(config, sets, run_dir, redis_url, replay_addr, weights_addr)
    learner_process(cfg, path, max_updates, resume)


@main.command()
@role_options
def experience(config, run_dir, sets, redis_url, replay_addr, weights_addr):
    """Start the experience extractor: every experience.update_every learner updates, turn the
    groups stored since its last pass (read from <run-dir>/replay.lmdb) into experiences and add
    them to the run's shared pool in Redis."""
    from autodidact.wiring import experience_process

    cfg, path = role_config(config, sets, run_dir, redis_url, replay_addr, weights_addr)
    experience_process(cfg, path)


@main.command()
@role_options
@click.option("--judge-id", default="judge-0", help="Stable id (kept across restarts).")
def judge(config, run_dir, sets, redis_url, replay_addr, weights_addr, judge_id):
    """Start one judge: lease unjudged groups from replay, label every step GOOD or BAD
    (judge.backend: reference, an LLM endpoint or the policy) and write the labels back."""
    from autodidact.wiring import judge_process

    cfg, path = role_config(config, sets, run_dir, redis_url, replay_addr, weights_addr)
    ensure_engine(cfg)
    judge_process(cfg, path, judge_id)


# --- self-questioning -----------------------------------------------------------------------------


@main.command()
@config_option
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default runs/<name>): explorations, profile, tasks.lmdb.")
@set_option()
@click.option("--redis-url", default=None,
              help="Also add tasks to this run's synthetic pool in Redis (redis.url).")
@click.option("--env", "env_name", default=None,
              help="Environment to explore (default env.name), e.g. bfcl. Without -c, the "
                   "env's own rollout limits apply where --set does not set them.")
@click.option("--rounds", type=int, default=None,
              help="Rounds over the seeds (default explore.rounds; 0 = until stopped).")
@click.option("--proposer-url", default=None,
              help="OpenAI-compatible endpoint for proposing actions and tasks (llm.url); the "
                   "API key is read from $OPENAI_API_KEY (llm.api_key_env).")
@click.option("--proposer-model", default=None, help="Model name at that endpoint (llm.model).")
@click.option("--profile-only", is_flag=True,
              help="Print the environment profile (exploring first if nothing is stored).")
@click.option("--json", "as_json", is_flag=True, help="With --profile-only: print JSON.")
def explore(config, run_dir, sets, env_name, redis_url, rounds, proposer_url, proposer_model,
            profile_only, as_json):
    """Explore the environment and write verified synthetic tasks (self-questioning).

    \b
    autodidact explore --run-dir runs/x                 explore, synthesize, verify, store
    autodidact explore --env bfcl --run-dir runs/b      the same from BFCL's multi-turn seeds
    autodidact explore --run-dir runs/x --profile-only  print the environment profile
    autodidact tasks list --run-dir runs/x              read the tasks it made
    """
    import signal

    from questioning import factory as task_factory

    cfg, path = load_run(config, sets, run_dir,
                         Flags(env=env_name, env_limits=config is None, redis_url=redis_url,
                               llm_url=proposer_url, llm_model=proposer_model,
                               redis_prefix=True))
    check_model(cfg.model.path)
    if profile_only:
        from questioning.profile import render_toc

        try:
            profile = task_factory.profile_only(cfg, path)
        except (ValueError, RuntimeError) as exc:  # as below: an env without state(), say
            raise click.ClickException(str(exc)) from None
        click.echo(json.dumps(profile, indent=1) if as_json else render_toc(profile))
        return
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    policy = cfg.model.path or _explore_policy(cfg, path)
    try:
        task_factory.run_explore(cfg, path, rounds, policy_path=policy,
                                 say=lambda m: click.echo(m, err=True),
                                 stop=lambda: bool(stopping))
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None


def _explore_policy(cfg: RunConfig, run_dir: Path) -> str | None:
    """The policy an ``auto``/``policy`` proposer uses: the run's model, made if missing."""
    if cfg.explore.proposer not in ("auto", "policy") or cfg.llm.url:
        return None
    from autodidact.base_model import prepare_model

    return prepare_model(cfg, run_dir)


if __name__ == "__main__":
    main()
