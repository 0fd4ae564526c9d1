"""A run's configuration, resolved once: the YAML file, ``--set`` overrides, the command's own
flags and the defaults known at start, checked as a whole.

``protocol.config`` checks what a config can check on its own (types, ranges, cross-field
rules); the environment's options can only be checked against the environment registry, which
lives above the protocol, so this is where the two meet. Every command loads its config here,
and nothing assigns to the result. Precedence, lowest first::

    embedded defaults < config file < --set < flags (--redis-url, --env, ...) < start defaults

but for ``--env``: it switches env first and the ``--set`` beside it still apply (all but
``env.name``, which ``--env`` gives): ``--env openenv --set env.options.url=...`` keeps the url,
and the env's own limits give way to a ``--set env.max_context``.

At start, once the model is known, :func:`check_context` measures one episode's opening on the
model's tokenizer and refuses an ``env.max_context`` too short for it.

Start defaults fill what the config leaves empty: ``redis.prefix`` (``autodidact:<name>``) for
commands that talk to Redis, ``replay.address`` (a socket in the run directory) for a run
whose services start here. Values learned only later make a new checked config at an explicit
point (:func:`with_redis_url` once the embedded Redis is up, :func:`with_model` after the
warm-start), never a mutation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from environments import check_env_options
from protocol.config import RunConfig, load_config, with_values
from protocol.control import default_prefix
from protocol.errors import ConfigError
from protocol.role_config import ActorSettings, ExperienceSettings, JudgeSettings, LearnerSettings
from protocol.transport import local_address


@dataclass(frozen=True)
class Flags:
    """What a command line sets beside ``--set``; ``None``/``False`` leaves the config's."""

    redis_url: str | None = None
    """--redis-url: the run's Redis (``redis.url``)."""

    replay_addr: str | None = None
    """--replay-addr: the replay server (``replay.address``)."""

    weights_addr: str | None = None
    """--weights-addr: the learner's weight server (``weights.address``)."""

    env: str | None = None
    """--env: another environment; its options are reset to that env's defaults, but for
    those a ``--set env.options...`` beside it gives."""

    env_limits: bool = False
    """Take the env's own rollout limits (``default_limits``: turns, context, action tokens)
    where the command does not ``--set`` them: ``env``'s, or without it the configured env's.
    For a command run without a config file (``eval``, ``explore``)."""

    device: str | None = None
    """--device: the actors' torch device (``actor.device``)."""

    gpu_actors: bool = False
    """Actors pinned to GPUs (``autodidact node --gpus-per-node``): ``actor.device=cuda`` for
    the transformers engine."""

    llm_url: str | None = None
    """--proposer-url: an OpenAI-compatible endpoint (``llm.url``)."""

    llm_model: str | None = None
    """--proposer-model (``llm.model``)."""

    redis_prefix: bool = False
    """The command talks to Redis: ``redis.prefix`` defaults to ``autodidact:<name>``."""

    local_services: bool = False
    """Replay (and Redis) start here, in the run directory: ``replay.address`` defaults to a
    socket in it (``autodidact run``)."""


def resolve_config(path: str | Path | None = None, overrides: list[str] = (),
                   flags: Flags = Flags(), run_dir: Path | None = None) -> RunConfig:
    """The checked config for ``path`` plus ``section.key=value`` overrides, ``flags`` and
    the start defaults (those of a run directory need ``run_dir``); raises
    :class:`~protocol.errors.ConfigError` naming the first bad key."""
    cfg = load_config(path, list(overrides))
    values = flag_values(cfg, flags, run_dir, set_keys(overrides))
    if values:
        cfg = with_values(cfg, values)
    check_env_options(cfg.env)
    return cfg


def resolve_run(path: str | Path | None, overrides: list[str], run_dir: str | Path | None,
                flags: Flags = Flags()) -> tuple[RunConfig, Path]:
    """:func:`resolve_config` for a command working in a run directory, and that directory
    (``runs/<name>`` unless ``run_dir``; absolute, not made here)."""
    cfg = load_config(path, list(overrides))
    directory = run_directory(cfg.name, run_dir)
    values = flag_values(cfg, flags, directory, set_keys(overrides))
    if values:
        cfg = with_values(cfg, values)
    check_env_options(cfg.env)
    return cfg, directory


def run_directory(name: str, run_dir: str | Path | None = None) -> Path:
    """``run_dir`` (default ``runs/<name>``) as an absolute path."""
    return (Path(run_dir) if run_dir else Path("runs") / name).resolve()


def set_keys(overrides: list[str]) -> frozenset[str]:
    """The ``section.key`` of each ``section.key=value`` override."""
    return frozenset(o.partition("=")[0].strip() for o in overrides)


def flag_values(cfg: RunConfig, flags: Flags, run_dir: Path | None = None,
                explicit: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``{"section.key": value}`` that ``flags`` and the start defaults set on ``cfg``; the
    env's own limits (``--env``) leave alone the ``explicit`` keys the user set."""
    values: dict[str, Any] = {}
    if flags.env and cfg.env.mix:  # a mix never reads env.name: --env would change nothing
        raise ConfigError(f"--env {flags.env}: the config runs an env mix "
                          f"({cfg.env.label()}); drop --env, or set env.mix=[] beside it")
    if flags.env:
        values.update(env_values(cfg, flags.env, flags.env_limits, explicit))
    elif flags.env_limits:
        values.update(configured_env_limits(cfg, explicit))
    for key, value in (("redis.url", flags.redis_url), ("replay.address", flags.replay_addr),
                       ("weights.address", flags.weights_addr), ("actor.device", flags.device)):
        if value:
            values[key] = value
    if flags.gpu_actors and cfg.actor.backend == "transformers":
        values["actor.device"] = "cuda"
    if flags.llm_url:
        if not (flags.llm_model or cfg.llm.model):
            raise ConfigError("--proposer-url needs --proposer-model (or llm.model)")
        values["llm.url"] = flags.llm_url
        values["llm.model"] = flags.llm_model or cfg.llm.model
    if flags.redis_prefix and not cfg.redis.prefix:
        values["redis.prefix"] = default_prefix(cfg.name)
    if flags.local_services:
        if run_dir is None:
            raise ValueError("local services need the run directory")
        if not values.get("replay.address", cfg.replay.address):
            values["replay.address"] = local_address(run_dir, "replay")
    return values


def env_values(cfg: RunConfig, name: str, limits: bool,
               explicit: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Switch to env ``name``: its options reset (another env's options mean nothing to it)
    but for those the command sets itself, and with ``limits`` the env's own rollout limits
    (e.g. bfcl: long contexts and actions), again but for those the command sets itself
    (``explicit``: ``--set env.options.url=...`` and ``--set env.max_turns=8`` win): as if
    ``--env`` were applied first and the ``--set`` after it."""
    from environments import env_class

    try:
        cls = env_class(name)
    except KeyError as exc:
        raise ConfigError(f"--env: {exc.args[0]}") from None
    values: dict[str, Any] = {}
    if name != cfg.env.name:
        values.update({"env.name": name, "env.options": set_options(cfg, explicit)})
    if limits:
        values.update(own_limits(cls, explicit))
    return values


def set_options(cfg: RunConfig, explicit: frozenset[str]) -> dict[str, Any]:
    """The env options among ``cfg``'s that a ``--set`` gave (``env.options.KEY=...``, or
    ``env.options={...}`` for all of them): what ``--env`` keeps."""
    if "env.options" in explicit:
        return dict(cfg.env.options)
    given = {key.split(".")[2] for key in explicit if key.startswith("env.options.")}
    return {key: value for key, value in cfg.env.options.items() if key in given}


def own_limits(cls, explicit: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``{"section.key": value}`` of env class ``cls``'s ``default_limits`` but the
    ``explicit`` keys the command sets itself."""
    own = dict(getattr(cls, "default_limits", {}))
    values = {f"env.{key}": value for key, value in own.items() if key != "max_action_tokens"}
    if "max_action_tokens" in own:
        values["actor.max_action_tokens"] = own["max_action_tokens"]
    return {key: value for key, value in values.items() if key not in explicit}


def configured_env_limits(cfg: RunConfig, explicit: frozenset[str]) -> dict[str, Any]:
    """The configured env's own limits (``env.name``, or the server at ``env.address``), for a
    command run without a config file and without ``--env``."""
    from environments import env_class

    try:
        cls = env_class(cfg.env)
    except KeyError as exc:
        raise ConfigError(f"env.name: {exc.args[0]}") from None
    return own_limits(cls, explicit)


def with_redis_url(cfg: RunConfig, url: str) -> RunConfig:
    """The run's config once its Redis is known (the embedded server started): a new one."""
    return with_values(cfg, {"redis.url": url})


def with_model(cfg: RunConfig, path: str) -> RunConfig:
    """The run's config with the model the roles start from (the warm-started policy, or the
    base model made here): a new one."""
    return with_values(cfg, {"model.path": path})


# --- what each role reads (protocol/role_config.py) ----------------------------------------------


def learner_threads(cfg: RunConfig, gpu: bool, cores: int | None = None) -> int:
    """``learner.torch_threads``, with ``auto`` made a number for a machine of ``cores``
    (default: the cores this process may run on): every core for a synchronous run
    (``max_staleness`` 0: the roles never overlap), else what the actors started on this
    machine leave free, at least 1. Actors count ``actor.torch_threads`` each where they
    compute on the CPU: the transformers engine on ``cpu``, or vLLM on a machine without a
    GPU (``gpu``)."""
    wanted = cfg.learner.torch_threads
    if wanted != "auto":
        return int(wanted)
    cores = cores or len(os.sched_getaffinity(0))
    if cfg.learner.max_staleness == 0:
        return cores
    on_cpu = cfg.actor.device == "cpu" if cfg.actor.backend == "transformers" else not gpu
    actor_threads = cfg.actor.num_actors * cfg.actor.torch_threads if on_cpu else 0
    return max(1, cores - actor_threads)


def actor_settings(cfg: RunConfig) -> ActorSettings:
    writes_summaries = cfg.env.context == "summary" and cfg.env.context_summary == "llm"
    return ActorSettings(actor=cfg.actor, env=cfg.env, seed=cfg.seed,
                         max_staleness=cfg.learner.max_staleness,
                         batch_groups=cfg.learner.batch_groups,
                         llm=cfg.llm if writes_summaries else None)


def learner_settings(cfg: RunConfig, max_updates: int | None = None) -> LearnerSettings:
    """``max_updates``: the command's ``--max-updates`` (None: ``learner.max_updates``)."""
    return LearnerSettings(
        learner=cfg.learner, model_path=cfg.model.path, seed=cfg.seed,
        max_updates=cfg.learner.max_updates if max_updates is None else max_updates,
        # Labels are only worth waiting for when some judge will write them.
        judged=cfg.learner.advantage == "composite" and cfg.judge.workers > 0,
        judge_deadline_s=cfg.judge.deadline_s,
        experience_context=cfg.experience.train_context,
        guided_clip_high=cfg.experience.clip_high,
        actors_low_precision=cfg.actor.samples_in_low_precision)


def judge_settings(cfg: RunConfig) -> JudgeSettings:
    return JudgeSettings(judge=cfg.judge,
                         local_model=cfg.judge.resolved_backend(cfg.llm.url) == "policy")


def experience_settings(cfg: RunConfig) -> ExperienceSettings:
    return ExperienceSettings(experience=cfg.experience, env=cfg.env)


# --- what one episode needs of the context, checked at start -------------------------------------


@dataclass(frozen=True)
class ContextNeed:
    """The tokens one episode needs at least, measured on one task with the model's own
    tokenizer and the run's rollout settings: the opening prompt (request, first observation,
    and the tools' schemas and instructions where the model reads them), one call
    (``actor.max_action_tokens``), its observation (counted as long as the first one) and room
    for the call that reads it (the rollout appends an observation only with that room left);
    and the ``max_context`` the env itself declares it needs (``default_limits``, which an env
    may learn once it has its tools: the OpenEnv adapter's from the server's schemas), 0 if
    none."""

    prompt: int
    call: int
    observation: int
    declared: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.call + self.observation + self.call


def context_need(cfg: RunConfig, model_path: str, task) -> ContextNeed | None:
    """:class:`ContextNeed` of ``task`` in the configured env, through the rollout's own
    opening (:func:`episodes.rollout.start_episodes`); None when the env fails the episode (a
    served env that is down: the run says so itself, where it would have failed anyway)."""
    from transformers import AutoTokenizer

    from environments.base import env_maker
    from episodes.rollout import env_call, rollout_settings, start_episodes
    from inference.codecs import make_codec

    settings = rollout_settings(cfg)
    codec = make_codec(AutoTokenizer.from_pretrained(model_path), settings.tool_format)
    (ep,) = start_episodes([task], 1, env_maker(cfg.env), codec, settings=settings)
    try:
        if ep.failure is not None:
            return None
        observation = codec.observation(ep.opening[1], "tool",
                                        settings.context.observation_tokens)
        env_call(ep, ep.env.tools)  # an env may learn its needs from its tools (openenv)
        if ep.failure is not None:
            return None
        declared = dict(getattr(ep.env, "default_limits", None) or {}).get("max_context", 0)
        return ContextNeed(ep.prompt_len, settings.max_action_tokens, len(observation),
                           int(declared))
    finally:
        close = getattr(ep.env, "close", None)
        if close is not None:
            close()


def check_context(cfg: RunConfig, model_path: str, task, own_limits: bool = False,
                  positions: int | None = None) -> RunConfig:
    """``cfg`` once its ``env.max_context`` is known to hold an episode of ``task`` past its
    first call (:class:`ContextNeed`, measured on ``model_path``'s tokenizer); with
    ``own_limits`` (a command without a config file whose ``--set`` leaves
    ``env.max_context`` alone) a larger ``max_context`` the env declares is taken: a new
    config. ``positions``: the model's position limit where the rollout caps the context at
    it (``autodidact eval``). ConfigError, one line with the numbers and the setting to
    change, when the context is too short."""
    need = context_need(cfg, model_path, task)
    if need is None:
        return cfg
    if own_limits and need.declared > cfg.env.max_context:
        cfg = with_values(cfg, {"env.max_context": need.declared})
    if need.total <= min(cfg.env.max_context, positions or cfg.env.max_context):
        return cfg
    if positions is not None and positions < need.total:
        raise ConfigError(
            f"the model {model_path} holds {positions} positions, too few for an episode of "
            f"{cfg.env.name} past its first call: {_need_words(need)}; use a model with a "
            f"longer context")
    wanted = max(need.total, need.declared)
    raise ConfigError(
        f"env.max_context={cfg.env.max_context} is too short for an episode of "
        f"{cfg.env.name} past its first call: {_need_words(need)}"
        + (f" (the env declares {need.declared})" if need.declared else "")
        + f"; set env.max_context to at least {wanted} (--set env.max_context={wanted})")


def _need_words(need: ContextNeed) -> str:
    return (f"its opening prompt takes {need.prompt} tokens, a call up to {need.call} "
            f"(actor.max_action_tokens), its observation about {need.observation} and the "
            f"next call {need.call}: {need.total} in all")
