"""What the ``autodidact`` sub-commands share: option texts and decorators, logging, and the
step from command-line arguments to a checked config and a run directory.

``autodidact/cli.py`` is the top of the command line and imports every command module; the
command modules import this module, never ``cli.py``.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

import click

from autodidact.resolve import Flags, resolve_config, resolve_run
from protocol.config import RunConfig
from protocol.errors import ConfigError

CONFIG_HELP = "YAML config file (default: embedded defaults, as in configs/default.yaml)."
SET_HELP = "Override one config value, e.g. --set replay.max_groups=1000 (repeatable)."


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise click.BadParameter("give at least one seed, each once")
    return seeds


def invoked_as(command: str) -> str:
    """``autodidact COMMAND ARGS``, as this process was started (the line a result records);
    ``autodidact COMMAND`` alone when started otherwise (a test's CliRunner)."""
    if sys.argv[1:2] != [command]:
        return f"autodidact {command}"
    return " ".join(["autodidact", command, *(shlex.quote(a) for a in sys.argv[2:])])


def setup_logging(verbose: bool) -> None:
    # Progress bars from transformers' loaders would drown the run's own progress lines.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


# Loggers of libraries whose lines a user cannot act on: the engine's start-up (vLLM prints
# ~40 lines per engine, three engines a run) and deprecation notices (``py.warnings``).
LIBRARY_LOGGERS = ("vllm", "py.warnings", "transformers", "torch", "accelerate")


def library_logs_to(path: Path) -> None:
    """Send the :data:`LIBRARY_LOGGERS` to ``path`` instead of the terminal, warnings included
    (a library's error still reaches the user: as the exception our code reports)."""
    # vLLM configures its logging (a stdout handler) whenever it makes an engine, unless this
    # says not to; its lines then reach the handler below. Children inherit it: a role's vLLM
    # lines go to the role's log through its root logger; `vllm serve` sets it back.
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    logging.captureWarnings(True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]  # vLLM imported before this had its stdout handler
        logger.propagate = False


def config_option(f):
    return click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False),
                        help=CONFIG_HELP)(f)


def set_option(example: str = "replay.max_groups=1000"):
    def decorate(f):
        return click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                            help=f"Override one config value, e.g. --set {example} "
                                 "(repeatable).")(f)
    return decorate


def load(config: str | None, sets: tuple[str, ...] | list[str],
         flags: Flags | None = None) -> RunConfig:
    """:func:`~autodidact.resolve.resolve_config`, a bad value turned into a usage error."""
    try:
        return resolve_config(config, list(sets), flags or Flags())
    except (ConfigError, OSError) as exc:
        raise click.UsageError(f"config: {exc}") from None


def load_run(config: str | None, sets: tuple[str, ...] | list[str], run_dir: str | None,
             flags: Flags | None = None, make: bool = True) -> tuple[RunConfig, Path]:
    """:func:`~autodidact.resolve.resolve_run`: the checked config of a command that works in
    a run directory, and that directory (default ``runs/<name>``; made unless ``make`` is
    false)."""
    try:
        cfg, path = resolve_run(config, list(sets), run_dir, flags or Flags())
    except (ConfigError, OSError) as exc:
        raise click.UsageError(f"config: {exc}") from None
    if make:
        path.mkdir(parents=True, exist_ok=True)
    return cfg, path


def check_model(path: str | None) -> None:
    """Refuse at once a model path that holds no model, before any process starts."""
    from inference.models import ModelNotFound, check_model_path

    try:
        check_model_path(path or "")
    except ModelNotFound as exc:
        raise click.UsageError(str(exc)) from None


def check_curve(cfg: RunConfig, *addresses: str | None):
    """CURVE keys from security.keys_dir (None: plain sockets); a plaintext address that leaves
    this machine, or a broken keys directory, is refused here, at start."""
    from protocol.security import curve_for

    try:
        return curve_for(cfg.security, *addresses)
    except ConfigError as exc:
        raise click.UsageError(f"config: {exc}") from None


def role_config(config, sets, run_dir, redis_url, replay_addr, weights_addr=None,
                gpu_actors: bool = False) -> tuple[RunConfig, Path]:
    """The config of a role started alone (or of a worker node's roles) and its run
    directory: the run's addresses are required, the CURVE keys checked."""
    cfg, path = load_run(config, sets, run_dir,
                         Flags(redis_url=redis_url, replay_addr=replay_addr,
                               weights_addr=weights_addr, redis_prefix=True,
                               gpu_actors=gpu_actors), make=False)
    if not cfg.redis.url or not cfg.replay.address:
        raise click.UsageError("a role started alone needs --redis-url and --replay-addr "
                               "(or redis.url / replay.address in its config)")
    check_curve(cfg, cfg.replay.address, cfg.weights.address)
    private_run_dir(path)
    return cfg, path


def private_run_dir(path: Path) -> None:
    """Make the run directory (mode 0700) and give this process, and every process it starts,
    umask 077: stores, Redis's AOF, checkpoints and logs are the run owner's alone (0600)."""
    os.umask(0o077)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def role_options(f):
    for option in reversed([
        config_option,
        click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory."),
        set_option(),
        click.option("--redis-url", default=None, help="Redis of the run (redis.url)."),
        click.option("--replay-addr", default=None, help="Replay server (replay.address)."),
        click.option("--weights-addr", default=None,
                     help="The learner's weight server (weights.address): the learner binds "
                          "it, actors and judges fetch weights from it. Default: read "
                          "<run-dir>/weights/ directly."),
    ]):
        f = option(f)
    return f
