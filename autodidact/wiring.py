"""Each role built from a run's config, and each role's process.

The one place that turns a :class:`~protocol.config.RunConfig` into a role: its settings
(``autodidact/resolve.py``) and its collaborators (engine, clients, judge, pool). A role takes
ownership of what it is handed and releases it in ``close()``, except the control plane, which
the roles of one process share and whoever connected it closes. The process entry points
(``autodidact actor|learner|judge|experience|replay``) and the single-process run
(``autodidact/single_process.py``) both build roles here and run them with
:func:`protocol.role.serve`::

    role = build_actor(cfg, run_dir, control, replay, "actor-0")
    serve(role, signals=True)          # a process of its own
    serve(role, shared_stop)           # a thread of the single-process run
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from autodidact.resolve import (
    actor_settings,
    experience_settings,
    judge_settings,
    learner_settings,
    learner_threads,
)
from protocol.config import RunConfig
from protocol.control import ControlPlane
from protocol.errors import exit_unrecoverable
from protocol.replay_client import ReplayClient
from protocol.role import serve
from protocol.run_dir import RunDir, single_writer_lock

log = logging.getLogger(__name__)


def connect_control(cfg: RunConfig) -> ControlPlane:
    return ControlPlane.connect(cfg.redis.url, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s)


# --- building roles --------------------------------------------------------------------------


def build_actor(cfg: RunConfig, run_dir: Path, control: ControlPlane, replay: ReplayClient,
                actor_id: str, backend=None, actor_class=None, **extra):
    """An actor on ``cfg``'s engine (or ``backend``); ``actor_class`` and ``extra`` let a bench
    run the real actor loop with one part replaced."""
    from actor.actor import Actor, actor_seed
    from episodes.reward import outcome_reward
    from inference.engines import make_backend
    from navigating.navigator import make_navigator
    from protocol.weights import WeightSubscriber

    with contextlib.ExitStack() as undo:  # a part that fails to build closes those before it
        backend = backend if backend is not None else make_backend(cfg)
        undo.callback(backend.close)
        weights = WeightSubscriber.for_run(cfg, control, actor_id)
        undo.callback(weights.close)
        navigator = make_navigator(cfg, actor_seed(cfg.seed, actor_id))
        if navigator is not None:
            undo.callback(navigator.close)
        probe = build_probe(cfg, run_dir, actor_id)
        if probe is not None:
            undo.callback(probe.close)
        actor = (actor_class or Actor)(
            actor_settings(cfg), run_dir, control, replay, backend, weights, actor_id,
            navigator=navigator, reward=outcome_reward(cfg), probe=probe, **extra)
        undo.pop_all()
    return actor


def build_probe(cfg: RunConfig, run_dir: Path, actor_id: str):
    """The validation probe of actor ``actor_id``: actor-0's alone (one actor pays for it
    however many run), None for the others and with ``eval.probe_every=0``."""
    from actor.probe import PROBE_ACTOR, ValidationProbe
    from episodes.evaluate import probe_tasks

    if not cfg.eval.probe_every or actor_id != PROBE_ACTOR:
        return None
    return ValidationProbe(probe_tasks(cfg), cfg.eval.probe_every, run_dir, actor_id, cfg.seed)


def build_learner(cfg: RunConfig, run_dir: Path, control: ControlPlane, replay: ReplayClient,
                  max_updates: int | None = None, ranks=None, step=None):
    """The learner, training ``cfg``'s model (or taking ``step`` in place of the policy step);
    rank 0 alone publishes."""
    from learner.distributed import SINGLE
    from learner.learner import Learner
    from learner.step import PolicyStep
    from protocol.weights import WeightPublisher

    ranks = ranks or SINGLE
    settings = learner_settings(cfg, max_updates)
    step = step if step is not None else PolicyStep(settings, ranks)
    publisher = WeightPublisher.for_run(cfg, Path(run_dir), control) if ranks.is_main else None
    return Learner(settings, run_dir, control, replay, step, publisher, ranks=ranks)


def build_judge(cfg: RunConfig, run_dir: Path, control: ControlPlane | None,
                replay: ReplayClient, judge_id: str = "judge-0"):
    from judge.judge_worker import JudgeWorker

    judge, cross_check, follow = make_judges(cfg, control, judge_id, run_dir)
    return JudgeWorker(judge_settings(cfg), run_dir, replay, judge, cross_check, judge_id,
                       control, follow)


def make_judges(cfg: RunConfig, control: ControlPlane | None = None, judge_id: str = "judge-0",
                run_dir: Path | None = None):
    """(judge, cross-check judge or None, hook to call between pulls or None).

    The cross-check is the reference judge, for LLM judges with ``judge.cross_check``; the
    hook makes the policy judge follow the learner's published weights (and closes with it)."""
    from environments.base import env_maker
    from judge.step_judges import FollowWeights, LLMJudge, ReferenceJudge

    reference = ReferenceJudge(env_maker(cfg.env))
    backend = cfg.judge.resolved_backend(cfg.llm.url)
    if backend == "reference":
        return reference, None, None
    hook = None
    if backend == "endpoint":
        from inference.llm import OpenAIChat

        replies = RunDir(run_dir).llm_replies(judge_id) if run_dir is not None else None
        chat = OpenAIChat.from_config(cfg.judge.endpoint(cfg.llm), reply_log=replies)
    else:
        from inference.engines import make_backend
        from inference.policy_chat import PolicyChat

        chat = PolicyChat(make_backend(cfg), max_context=cfg.env.max_context, seed=cfg.seed)
        if control is not None:
            from protocol.weights import WeightSubscriber

            hook = FollowWeights(WeightSubscriber.for_run(cfg, control, judge_id), chat.backend)
    judge = LLMJudge(chat, max_chars=cfg.judge.max_chars, max_attempts=cfg.judge.max_attempts,
                     temperature=cfg.judge.temperature)
    return judge, (reference if cfg.judge.cross_check else None), hook


def build_experience(cfg: RunConfig, run_dir: Path, control: ControlPlane,
                     replay: ReplayClient | None = None, pool=None, extractor=None):
    """The experience worker over the run's pool (restored first: a Redis that lost its data
    gets the pool back) with the extractor ``experience.extractor`` asks for."""
    from experience.worker import ExperienceWorker
    from navigating.extraction import make_extractor
    from navigating.pool import open_pool

    if pool is None:
        pool = open_pool(cfg, run_dir=run_dir)
        pool.restore()
    return ExperienceWorker(experience_settings(cfg), run_dir, control, pool,
                            extractor or make_extractor(cfg, run_dir),
                            replay or ReplayClient.for_run(cfg))


# --- each role's process -----------------------------------------------------------------------


def actor_process(cfg: RunConfig, run_dir: Path, actor_id: str) -> None:
    import torch

    torch.set_num_threads(cfg.actor.torch_threads)
    with contextlib.closing(connect_control(cfg)) as control:
        replay = ReplayClient.for_run(cfg, role="actor", run_dir=run_dir)
        serve(build_actor(cfg, run_dir, control, replay, actor_id), signals=True)


def judge_process(cfg: RunConfig, run_dir: Path, judge_id: str = "judge-0") -> None:
    with contextlib.closing(connect_control(cfg)) as control:
        replay = ReplayClient.for_run(cfg, role="judge", run_dir=run_dir)
        worker = build_judge(cfg, run_dir, control, replay, judge_id)
        log.info("%s: %s judge%s, %d groups per pull, lease %.0fs", judge_id, worker.judge.name,
                 " + reference cross-check" if worker.cross_check else "",
                 cfg.judge.max_groups, cfg.judge.lease_s)
        serve(worker, signals=True)


def experience_process(cfg: RunConfig, run_dir: Path) -> None:
    with contextlib.closing(connect_control(cfg)) as control:
        serve(build_experience(cfg, run_dir, control), signals=True)


def replay_process(run_dir: Path, cfg: RunConfig, address: str | None, curve) -> None:
    """The replay server until SIGTERM or SIGINT. Its bound address is written to
    ``<run_dir>/replay.addr`` (removed again on a clean stop) so other processes on this
    machine can find it."""
    from replay.server import ReplayServer

    server = ReplayServer(run_dir, cfg.replay, address, curve)
    addr_file = RunDir(run_dir).replay_addr
    tmp = addr_file.with_suffix(".addr.tmp")
    tmp.write_text(server.address + "\n")
    tmp.replace(addr_file)  # readers never see half an address
    try:
        serve(server, signals=True)
    finally:
        addr_file.unlink(missing_ok=True)


def learner_process(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
                    resume: bool = False) -> None:
    """One learner process; under ``torchrun`` (``WORLD_SIZE`` > 1) one rank of several. Rank 0
    holds the run directory's learner lock: a second learner would train the same groups and
    write the same checkpoint."""
    import torch

    from learner.checkpoint import CheckpointError
    from learner.distributed import Ranks

    torch.set_num_threads(learner_threads(cfg, torch.cuda.is_available()))
    ranks = Ranks.from_env()
    if ranks.is_main:
        try:
            rd = RunDir(run_dir)
            single_writer_lock(rd.path, rd.learner_lock.name,
                               f"another learner (pid {{pid}}) is training {run_dir}; stop it "
                               f"first (two learners would train the same groups twice)")
        except RuntimeError as exc:  # the lock stays held until this process exits
            exit_unrecoverable(f"learner: {exc}")
    ranks.start(ranks.device(cfg.learner.device))
    try:
        with contextlib.closing(connect_control(cfg)) as control:
            replay = ReplayClient.for_run(cfg, role="learner", run_dir=run_dir)
            try:
                learner = build_learner(cfg, run_dir, control, replay, max_updates, ranks)
            except BaseException:
                replay.close()
                raise
            with contextlib.ExitStack() as on_failure:
                on_failure.callback(learner.close)
                if resume:
                    try:
                        learner.resume()
                    except CheckpointError as exc:
                        exit_unrecoverable(f"learner: {exc}")
                # Every rank reads the checkpoint itself: on nodes that do not share the run
                # directory they would start from different states, and the lockstep would
                # break.
                if not ranks.agree(f"{learner.updates}/{learner.version}/"
                                   f"{len(learner.consumed)}"):
                    raise SystemExit(f"learner: the ranks resumed from different checkpoints; "
                                     f"every rank must see {RunDir(run_dir).checkpoint}")
                on_failure.pop_all()
            serve(learner, signals=True)
    finally:
        ranks.close()
