"""The ``autodidact`` command line: one entry point, one sub-command per role.

``autodidact run`` composes a whole run from one config file and starts every role as its own
process; ``autodidact replay|actor|learner|judge ...`` start one role alone, so a multi-node
launch runs the same program on more machines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from autodidact.resolve import resolve_config
from protocol.config import RunConfig, to_dict
from protocol.errors import ConfigError

CONFIG_HELP = "YAML config file (default: embedded defaults, as in configs/default.yaml)."
SET_HELP = "Override one config value, e.g. --set replay.max_groups=1000 (repeatable)."


def _setup_logging(verbose: bool) -> None:
    # Progress bars from transformers' loaders would drown the run's own progress lines.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def _load(config: str | None, sets: tuple[str, ...]) -> RunConfig:
    try:
        return resolve_config(config, list(sets))
    except (ConfigError, OSError) as exc:
        raise click.UsageError(f"config: {exc}") from None


def _curve(cfg: RunConfig, *addresses: str | None):
    """CURVE keys from security.keys_dir (None: plain sockets); a plaintext address that leaves
    this machine, or a broken keys directory, is refused here, at start."""
    from protocol.security import curve_for

    try:
        return curve_for(cfg.security, *addresses)
    except ConfigError as exc:
        raise click.UsageError(f"config: {exc}") from None


def resolve_run_dir(cfg: RunConfig, run_dir: str | None) -> Path:
    path = Path(run_dir) if run_dir else Path("runs") / cfg.name
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Autodidact: LLM agents that teach themselves in tool-using environments."""
    _setup_logging(verbose)


@main.command()
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default runs/<name>).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--redis-url", default=None, help="Use this Redis; none is started.")
@click.option("--max-updates", type=int, default=None, help="Stop after this many learner updates.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in the run dir.")
def run(config, run_dir, sets, redis_url, max_updates, resume):
    """Run the whole job on one machine: Redis, replay, actors, learner."""
    from autodidact.launcher import launch

    cfg = _load(config, sets)
    if redis_url:
        cfg.redis.url = redis_url
    _curve(cfg, cfg.replay.address)
    code = launch(cfg, resolve_run_dir(cfg, run_dir), max_updates=max_updates, resume=resume)
    sys.exit(code)


@main.command("config")
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def show_config(config, sets):
    """Print the resolved config (defaults + file + overrides) as YAML."""
    import yaml

    click.echo(yaml.safe_dump(to_dict(_load(config, sets)), sort_keys=False))


# --- replay --------------------------------------------------------------------------------------


@main.group(invoke_without_command=True)
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory holding replay.lmdb.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
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
    from replay.server import serve

    cfg = _load(config, sets)
    address = address or cfg.replay.address or None
    serve(resolve_run_dir(cfg, run_dir), cfg.replay, address, _curve(cfg, address))


@replay.command("stats")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Run directory holding replay.lmdb.")
def replay_stats(run_dir):
    """Print one JSON object: groups stored, judged, consumed, evicted, bytes, versions."""
    from replay.store import read_stats

    if not (Path(run_dir) / "replay.lmdb").exists():
        raise click.UsageError(f"no replay store at {Path(run_dir) / 'replay.lmdb'}")
    click.echo(json.dumps(read_stats(run_dir), sort_keys=True))


# --- actor and learner ------------------------------------------------------------------------


def _role_config(config, sets, redis_url, replay_addr, weights_addr=None) -> RunConfig:
    cfg = _load(config, sets)
    if redis_url:
        cfg.redis.url = redis_url
    if replay_addr:
        cfg.replay.address = replay_addr
    if weights_addr:
        cfg.weights.address = weights_addr
    if not cfg.redis.url or not cfg.replay.address:
        raise click.UsageError("a role started alone needs --redis-url and --replay-addr "
                               "(or redis.url / replay.address in its config)")
    _curve(cfg, cfg.replay.address, cfg.weights.address)
    _default_prefix(cfg)
    return cfg


def _default_prefix(cfg: RunConfig) -> None:
    """Keys under ``autodidact:<run name>`` unless the config names a prefix."""
    if not cfg.redis.prefix:
        from protocol.control import default_prefix

        cfg.redis.prefix = default_prefix(cfg.name)


def role_options(f):
    for option in reversed([
        click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False),
                     help=CONFIG_HELP),
        click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP),
        click.option("--redis-url", default=None, help="Redis of the run (redis.url)."),
        click.option("--replay-addr", default=None, help="Replay server (replay.address)."),
        click.option("--weights-addr", default=None,
                     help="The learner's weight server (weights.address): the learner binds "
                          "it, actors and judges fetch weights from it. Default: read "
                          "<run-dir>/weights/ directly."),
    ]):
        f = option(f)
    return f


@main.command()
@role_options
@click.option("--actor-id", default="actor-0", help="Stable id (kept across restarts).")
def actor(config, run_dir, sets, redis_url, replay_addr, weights_addr, actor_id):
    """Start one actor: roll out groups and stream them to replay."""
    from actor.actor import main as actor_main

    cfg = _role_config(config, sets, redis_url, replay_addr, weights_addr)
    actor_main(cfg, resolve_run_dir(cfg, run_dir), actor_id)


@main.command()
@role_options
@click.option("--max-updates", type=int, default=None, help="Stop after this many updates.")
@click.option("--resume", is_flag=True, help="Continue from <run-dir>/checkpoints/latest.pt.")
def learner(config, run_dir, sets, redis_url, replay_addr, weights_addr, max_updates,
            resume):
    """Start the learner: train on groups from replay and publish weights."""
    from learner.learner import main as learner_main

    cfg = _role_config(config, sets, redis_url, replay_addr, weights_addr)
    learner_main(cfg, resolve_run_dir(cfg, run_dir), max_updates, resume)


@main.command()
@role_options
def experience(config, run_dir, sets, redis_url, replay_addr, weights_addr):
    """Start the experience extractor: every experience.update_every learner updates, turn the
    groups stored since its last pass (read from <run-dir>/replay.lmdb) into experiences and add
    them to the run's shared pool in Redis."""
    from judge.experience_worker import main as experience_main

    cfg = _role_config(config, sets, redis_url, replay_addr, weights_addr)
    experience_main(cfg, resolve_run_dir(cfg, run_dir))


@main.command()
@role_options
@click.option("--judge-id", default="judge-0", help="Stable id (kept across restarts).")
def judge(config, run_dir, sets, redis_url, replay_addr, weights_addr, judge_id):
    """Start one judge: lease unjudged groups from replay, label every step GOOD or BAD
    (judge.backend: reference, an LLM endpoint or the policy) and write the labels back."""
    from judge.judge_worker import main as judge_main

    cfg = _role_config(config, sets, redis_url, replay_addr, weights_addr)
    judge_main(cfg, resolve_run_dir(cfg, run_dir), judge_id)


# --- self-questioning -----------------------------------------------------------------------------


@main.command()
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default runs/<name>): explorations, profile, tasks.lmdb.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--redis-url", default=None,
              help="Also add tasks to this run's synthetic pool in Redis (redis.url).")
@click.option("--env", "env_name", default=None,
              help="Environment to explore (default env.name), e.g. bfcl.")
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

    cfg = _load(config, sets)
    if env_name and env_name != cfg.env.name:
        cfg.env.name, cfg.env.options = env_name, {}
    if redis_url:
        cfg.redis.url = redis_url
    if proposer_url:
        cfg.llm.url, cfg.llm.model = proposer_url, proposer_model or cfg.llm.model
        if not cfg.llm.model:
            raise click.UsageError("--proposer-url needs --proposer-model (or llm.model)")
    if cfg.redis.url:
        _default_prefix(cfg)
    path = resolve_run_dir(cfg, run_dir)
    if profile_only:
        from questioning.profile import render_toc

        profile = task_factory.profile_only(cfg, path)
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
    from autodidact.launcher import prepare_model

    return prepare_model(cfg, run_dir)


def _register_tasks():
    from autodidact.ablation import ablation
    from autodidact.eval_cli import eval_command
    from autodidact.keys_cli import keys
    from autodidact.node_cli import node
    from autodidact.report import report
    from autodidact.status_cli import status
    from autodidact.tasks_cli import tasks

    main.add_command(tasks)
    main.add_command(eval_command)
    main.add_command(keys)
    main.add_command(node)
    main.add_command(status)
    main.add_command(report)
    main.add_command(ablation)


_register_tasks()


if __name__ == "__main__":
    main()
