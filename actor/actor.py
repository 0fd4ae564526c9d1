"""The actor role: take tasks, roll out groups, stream them to replay, follow new weights.

    while not stopped:
        load newer weights if announced            # also between turns, mid-trajectory
        admit: reserve group slots while admitted - stale <= (max_staleness + version + 1) * B
        tasks = pop groups_in_flight tasks from the Redis queue
        guidance = retrieve experience per task    # injected into a share of each group
        groups = rollout(tasks, n per task)        # one batched generate per turn
        push groups to replay (retried until acknowledged), keep rolling meanwhile
        heartbeat, metrics
        actor-0 only, every eval.probe_every versions: the validation probe (actor/probe.py),
        rolled out and logged, never pushed

A group's admission slot stays claimed until replay acknowledges it; until then the group also
waits in the actor's outbox on disk (actor/outbox.py), so an actor restarted after a crash
re-sends what its predecessor had not seen acknowledged, re-queues the tasks it was rolling out,
and gives back only the slots of those.

A served env that fails an episode (``EnvFailed``: a deadline, a worker that died, a reply
that does not decode) ends it as ``env_failed``: its whole group is dropped (never pushed,
never trained on) and its slot given back, so the ledger counts only groups that exist; each
failure is counted by reason (``actor/env_failed/<reason>``) and logged with the worker's last
output. When a whole batch of groups failed, the actor waits a moment before taking more tasks,
and says so in its heartbeat (``waiting: env_failed``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from actor.outbox import Outbox
from actor.probe import ValidationProbe, env_success
from environments.base import env_maker
from episodes.reward import OutcomeReward
from episodes.rollout import make_codec, rollout, settings_of, start_episodes, to_groups
from inference.backends.base import InferenceBackend, SamplingParams
from metrics.jsonl import MetricsWriter, RateMeter
from navigating.navigator import Navigator
from protocol.control import ControlPlane
from protocol.replay_client import ReplayClient
from protocol.role import StopEvent
from protocol.role_config import ActorSettings
from protocol.weights import WeightSubscriber

log = logging.getLogger(__name__)

ENV_FAILED_WAIT_S = 5.0  # the pause after a batch whose every group the env failed


def actor_seed(seed: int, actor_id: str) -> int:
    """The sampling stream of actor ``actor_id``: crc32, not hash() (str hashes differ
    between processes; seeds must not)."""
    return seed * 1000 + zlib.crc32(actor_id.encode()) % 1000


def task_outcomes(episodes) -> dict[str, tuple[int, int]]:
    """``{task_id: (successes, rollouts)}`` of finished episodes, a success being a reward of
    1 or more (as the held-out evaluation counts one): what the frontier feeder weighs."""
    out: dict[str, tuple[int, int]] = {}
    for ep in episodes:
        successes, trials = out.get(ep.task.task_id, (0, 0))
        out[ep.task.task_id] = (successes + int(ep.reward >= 1.0), trials + 1)
    return out


class Actor:
    """Built from its settings and what it rolls out with: ``backend`` (the engine),
    ``weights`` (follows the learner's versions), ``navigator`` (retrieves experience; None
    when self-navigating is off), ``reward`` and ``probe`` (the validation probe, actor-0's
    alone; None for the others and with ``eval.probe_every=0``). It owns them, and its replay
    client, from here on: :meth:`close` releases them all."""

    def __init__(self, settings: ActorSettings, run_dir: Path, control: ControlPlane,
                 replay: ReplayClient, backend: InferenceBackend, weights: WeightSubscriber,
                 actor_id: str, *, navigator: Navigator | None = None,
                 reward: OutcomeReward | None = None, probe: ValidationProbe | None = None):
        self.settings = settings
        self.control = control
        self.replay = replay
        self.backend = backend
        self.weights = weights
        self.actor_id = actor_id
        self.rollout = settings_of(settings.env, settings.actor, settings.llm)
        self.codec = make_codec(backend.tokenizer, self.rollout.tool_format)
        self.make_env = env_maker(settings.env)
        self.reward = reward or OutcomeReward()
        self._seed = actor_seed(settings.seed, actor_id)
        self.navigator = navigator
        self._navigation: dict[str, float] = {}
        self.probe = probe
        self.metrics = MetricsWriter(run_dir, "actor", actor_id)
        self.outbox = Outbox(run_dir, actor_id)
        self.tokens = RateMeter()
        self.groups_done = 0
        self._resend_at: dict[str, float] = {}  # group id -> when to push it again (disk_full)
        self._stop = StopEvent()
        self._idle_s = 0.0
        self._load_s = 0.0  # seconds the last weight version took to load
        self.env_failed: Counter = Counter()  # episodes a served env failed, by reason
        self._closed = False

    def request_stop(self, *_):
        self._stop.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for part in (self.replay, self.backend, self.weights, self.metrics, self.outbox,
                     self.navigator, self.probe):
            if part is not None:
                part.close()

    # --- weights ---

    def maybe_load_weights(self) -> None:
        t0 = time.perf_counter()
        version = self.weights.follow(self.backend)
        if version is not None:
            self._load_s = time.perf_counter() - t0  # fetch, verify and apply: what a turn waits
            log.info("%s loaded weights v%d in %.2fs", self.actor_id, version, self._load_s)

    # --- the loop ---

    def recover(self) -> None:
        """Take over from a killed predecessor: re-send its unacknowledged groups (their slots
        stay claimed until acknowledged), queue its unfinished tasks again, free the rest."""
        groups, tasks = self.outbox.recover()
        claimed = self.control.claimed(self.actor_id)
        released = self.control.release(self.actor_id, claimed - len(groups))
        if tasks:
            self.control.push_tasks(tasks)
        for g in groups:
            self.replay.push_group(g)
        if groups or tasks or released:
            log.warning("%s after a restart: re-sent %d groups, re-queued %d tasks, released "
                        "%d slots", self.actor_id, len(groups), len(tasks), released)
            self.control.incr("actor/resent", len(groups))

    def run(self, stop: threading.Event | None = None) -> None:
        self._stop.use(stop)
        self.recover()
        self.maybe_load_weights()
        while not self._stop.is_set():
            self.drain_acks(0.0)
            self.maybe_probe()
            tasks = self.take_tasks()
            if not tasks:
                continue
            t0 = time.monotonic()
            groups = self.roll(tasks)
            for g in groups:
                self.outbox.add(g)
                self.replay.push_group(g)
            self.outbox.drop_tasks()
            self._give_back(len(tasks) - len(groups))
            self.control.incr("actor/pushed", len(groups))
            self.groups_done += len(groups)
            if groups:
                self._log(groups, time.monotonic() - t0)
            else:  # the env failed every group: a server down or restarting; do not race it
                self.control.heartbeat("actor", self.actor_id, groups=self.groups_done,
                                       waiting="env_failed", env_failed=dict(self.env_failed))
                self._stop.wait(ENV_FAILED_WAIT_S)
        self.drain_acks(5.0, until_empty=True)

    def maybe_probe(self) -> dict | None:
        """The validation probe, when one is due at the version generating now: its rollouts
        are only counted (no replay, outbox, curriculum counts or navigator) and no weights
        load during it, so one probe is one version. Returns its record, else None."""
        if self.probe is None:
            return None
        self.maybe_load_weights()  # the newest announced version, not the last roll's
        if not self.probe.due(self.backend.version):
            return None
        ac = self.settings.actor
        params = SamplingParams(temperature=ac.temperature, top_p=ac.top_p,
                                max_new_tokens=ac.max_action_tokens,
                                stop_token_ids=(self.codec.eoa_id,), logprobs_mode="raw")
        with self._beating():
            found = self.probe.run(self.backend, self.codec, self.make_env, self.rollout,
                                   params, ac.groups_in_flight * ac.group_size)
        log.info("%s validation probe at v%d: %.1f%% of %d tasks", self.actor_id,
                 found["eval/version"], 100 * found["eval/probe_success"],
                 found["eval/probe_tasks"])
        return found

    def _give_back(self, dropped: int) -> None:
        """The slots of groups dropped because the env failed them: no group will use them."""
        if dropped:
            self.control.release(self.actor_id, dropped)
            self.control.incr("actor/dropped_env_failed", dropped)

    def take_tasks(self):
        """Reserve slots under the staleness bound, then pop that many tasks."""
        s = self.settings
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.maybe_load_weights()
            granted = self.control.admit(self.actor_id, s.actor.groups_in_flight,
                                         s.max_staleness, s.batch_groups)
            if granted:
                tasks = [t for t in (self.control.pop_task(0.2) for _ in range(granted)) if t]
                if tasks:
                    self.outbox.hold_tasks(tasks)
                self.control.release(self.actor_id, granted - len(tasks))
                if tasks:
                    self._idle_s += time.monotonic() - t0
                    return tasks
            self.drain_acks(0.1)
            self.control.heartbeat("actor", self.actor_id, groups=self.groups_done, waiting=True)
        return []

    def roll(self, tasks):
        ac = self.settings.actor
        n = ac.group_size
        guidance = self.navigator.guide(tasks, n) if self.navigator else None
        self._seed += 1
        params = SamplingParams(temperature=ac.temperature, top_p=ac.top_p,
                                max_new_tokens=ac.max_action_tokens,
                                stop_token_ids=(self.codec.eoa_id,), seed=self._seed,
                                logprobs_mode="raw")
        with self._beating():
            episodes = start_episodes(tasks, n, self.make_env, self.codec, guidance,
                                      self.rollout)
            rollout(self.backend, episodes, self.codec, params, self.rollout,
                    between_turns=self.maybe_load_weights, reward=self.reward)
        self.tokens.add(sum(sum(ep.mask) for ep in episodes))
        episodes = self._without_failed_groups(episodes, n)
        self.control.record_outcomes(task_outcomes(episodes))
        if self.navigator:
            self.navigator.record(episodes)
            self._navigation = self.navigator.metrics(episodes, n)
        return to_groups(episodes, n, self.actor_id, time.time())

    @contextlib.contextmanager
    def _beating(self):
        """The heartbeat refreshed from a thread while a rollout runs: one call of a served env
        may take up to ``env.call_timeout_s``, longer than the heartbeat lives."""
        done = threading.Event()

        def beat():
            while not done.wait(self.control.heartbeat_ttl_s / 3):
                try:
                    self.control.heartbeat("actor", self.actor_id, groups=self.groups_done,
                                           rolling=True)
                except Exception as exc:  # Redis away: the loop's own calls ride it out
                    log.debug("%s heartbeat: %s", self.actor_id, exc)

        threading.Thread(target=beat, daemon=True, name=f"{self.actor_id}-heartbeat").start()
        try:
            yield
        finally:
            done.set()  # not joined: a beat blocked on a Redis outage ends on its own

    def _without_failed_groups(self, episodes, n: int):
        """The episodes of the groups the env failed none of; each failed episode counted by
        reason and logged with the worker's last output lines."""
        kept = []
        for i in range(0, len(episodes), n):
            group = episodes[i:i + n]
            failed = [ep for ep in group if ep.failure is not None]
            if not failed:
                kept += group
            for ep in failed:
                exc = ep.failure
                self.env_failed[exc.reason] += 1
                self.control.incr(f"actor/env_failed/{exc.reason}")
                log.warning("%s: env_failed (%s) in task %s, its group of %d dropped: %s%s",
                            self.actor_id, exc.reason, ep.task.task_id, len(group), exc.detail,
                            "".join(f" | {line}" for line in exc.stderr[-5:]))
        return kept

    def drain_acks(self, timeout_s: float, until_empty: bool = False) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if until_empty and not self.replay.unacked():  # nothing to wait for (at a stop)
                return
            acks = self.replay.poll_acks(max(0.0, deadline - time.monotonic())
                                         if until_empty else timeout_s)
            acks = self._hold_back_disk_full(acks)
            if acks:
                self.outbox.acked(acks)  # logged before the slot is given up
                stored = sum(status == "stored" for _, status in acks)
                done = stored + sum(status == "duplicate" for _, status in acks)
                if done:
                    self.control.finish(self.actor_id, done)
                if stored:
                    self.control.incr("actor/accepted", stored)
            for _, status in acks:
                if status.startswith("error"):
                    # a refused group will never be trained: give its slot back
                    self.control.incr("actor/rejected")
                    self.control.release(self.actor_id, 1)
                    log.error("replay refused a group: %s", status)
            if not until_empty or not self.replay.unacked() or time.monotonic() > deadline:
                return

    def _hold_back_disk_full(self, acks: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Groups replay could not store for want of disk stay in the outbox and are pushed
        again after a back-off; returns the other acks. Due ones are pushed here."""
        now = time.monotonic()
        rest = []
        for gid, status in acks:
            if status == "error:disk_full":
                self._resend_at[gid] = now + self.replay.disk_full_backoff_s
                self.control.incr("actor/disk_full")
                log.warning("replay's disk is full: %s kept, pushed again in %.0f s", gid,
                            self.replay.disk_full_backoff_s)
            else:
                rest.append((gid, status))
        for gid in [g for g, at in self._resend_at.items() if at <= now]:
            del self._resend_at[gid]
            self.replay.push_group(self.outbox.group(gid))
        return rest

    def _log(self, groups, rollout_s: float) -> None:
        rewards = [t.reward for g in groups for t in g.trajectories]
        turns = [len(t.steps) for g in groups for t in g.trajectories]
        versions = [g.policy_versions() for g in groups]
        self.metrics.log({
            "success_rate": float(np.mean([r >= 1.0 for r in rewards])),
            "reward": float(np.mean(rewards)), "turns": float(np.mean(turns)),
            "tokens_per_s": self.tokens.rate(), "groups": self.groups_done,
            "rollout_s": rollout_s, "idle_s": self._idle_s,
            "idle_fraction": self._idle_s / max(self._idle_s + rollout_s, 1e-9),
            "version": self.backend.version, "weights_load_s": self._load_s,
            "mixed_version_groups": sum(lo != hi for lo, hi in versions),
            "unacked": len(self.replay.unacked()), **self._navigation,
            **{f"env_failed/{reason}": n for reason, n in self.env_failed.items()},
            # an env mix: each member env's success in these groups (none for one env)
            **env_success(((g.task, t.reward) for g in groups for t in g.trajectories),
                          "actor/env/{}/success"),
        }, step=self.groups_done)
        self._idle_s = 0.0
        self.control.heartbeat("actor", self.actor_id, groups=self.groups_done,
                               version=self.backend.version)
