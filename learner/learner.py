"""The learner role: draw groups from replay, take clipped off-policy steps, publish weights.

    hello(replay, ledger from checkpoint)           # a resume neither repeats nor skips
    while updates < max_updates and within budget:
        groups, labels = draw batch_groups / N      # oldest first, within the staleness bound;
                                                    # judged ones, or past judge.deadline_s;
                                                    # replay holds the request until it has some
        step.update(groups, labels, α(u))           # the policy step (learner/step.py)
        token log: what it scored, per token         # learner_tokens/ (learner/token_log.py)
        every k updates: publish weights, version += 1
        every m updates: checkpoint (+ ledger), then commit the ledger to replay

:class:`Learner` is that loop; what an update does to the model (loss, optimizer, autocast,
LoRA) is the step it is given, :class:`learner.step.PolicyStep` (or a stand-in: the scaling
bench's fixed-cost step). ``autodidact.wiring.build_learner`` builds both from a run's config.

With ``torchrun --nproc-per-node N`` there are N such loops, one per GPU, in lockstep: each
draws its share of the batch, DDP (or FSDP) averages their gradients, and rank 0 alone says
hello, publishes, checkpoints, commits the ledger and writes metrics (learner/distributed.py).
With one process all of that reduces to the loop above.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np

from learner.checkpoint import (  # noqa: F401  (CheckpointError, load_checkpoint: the API)
    CheckpointError,
    load_checkpoint,
    read_checkpoint,
    rng_states,
    save_checkpoint,
    set_rng_states,
)
from learner.distributed import SINGLE, Ranks
from learner.step import Step
from learner.token_log import TokenLog
from metrics.jsonl import MetricsWriter
from protocol.control import ControlPlane
from protocol.errors import TransportTimeout
from protocol.replay_client import ReplayClient
from protocol.role import StopEvent
from protocol.role_config import LearnerSettings
from protocol.run_dir import RunDir
from protocol.weights import WeightPublisher

log = logging.getLogger(__name__)

# How long replay may hold a batch request it cannot serve yet (BatchRequest.timeout_s): it
# answers as soon as a group is there, so this only bounds how late a stop is noticed.
BATCH_WAIT_S = 1.0


class Learner:
    """The learner loop around ``step``. It owns what it is handed: ``close()`` releases the
    publisher (None on ranks > 0), the replay client (None in tests that hand groups to
    :meth:`update` directly), the metrics and the token log it writes (rank 0); the control
    plane stays its opener's."""

    def __init__(self, settings: LearnerSettings, run_dir: Path, control: ControlPlane,
                 replay: ReplayClient | None, step: Step, publisher: WeightPublisher | None,
                 *, ranks: Ranks = SINGLE, learner_id: str = "learner"):
        self.settings = settings
        self.cfg = settings.learner
        self.run_dir = Path(run_dir)
        self.control = control
        self.replay = replay
        self.step = step
        self.publisher = publisher
        self.ranks = ranks
        self.learner_id = ranks.member(learner_id)
        ranks.share(self.cfg.batch_groups)  # refuses a batch the ranks cannot split evenly
        # Rank 0 alone writes metrics (and publishes: the others are handed no publisher).
        self.metrics = MetricsWriter(self.run_dir, "learner", learner_id) \
            if ranks.is_main else None
        # Rank 0's too: the log-probs its step scored on its share of each batch.
        self.token_log = TokenLog(self.run_dir,
                                  self.cfg.token_log_groups if ranks.is_main else 0)
        self.updates = 0
        self.version = 0
        self.consumed: list[str] = []  # the ledger: every group id trained on, in order
        self._consumed_ids: set[str] = set()  # the same ids, for the duplicate check
        self._uncommitted: list[str] = []
        self._stop = StopEvent()
        self.judge_timeouts = 0  # groups of the current batch trained outcome-only: no labels
        self.uninformative = 0  # groups replay set aside while this batch was drawn: no signal
        self.uninformative_total = 0

    @property
    def share(self) -> int:
        """Groups this process draws per update."""
        return self.ranks.share(self.cfg.batch_groups)

    # --- lifecycle ---

    def resume(self) -> bool:
        """Restore the newest good checkpoint if there is one (every rank reads it, so all
        start from the same weights, optimizer, RNG and ledger)."""
        found = read_checkpoint(self.run_dir)
        if found is None:
            return False
        state, path = found
        self.step.load_state(state, path)
        self.updates, self.version = state["updates"], state["version"]
        if path != RunDir(self.run_dir).checkpoint and self.metrics is not None:
            # The latest was damaged: the run's own output says so (autodidact/progress.py),
            # not only this role's log.
            self.metrics.log({"checkpoint_fallback": 1, "resumed_at_update": self.updates},
                             step=self.updates)
        self.consumed = list(state["consumed"])
        self._consumed_ids = set(self.consumed)
        set_rng_states(state)
        log.info("resumed from %s at update %d, version %d, %d groups consumed",
                 path, self.updates, self.version, len(self.consumed))
        return True

    def checkpoint(self) -> None:
        """Write the step's state (model, optimizer, ...), RNG, version and ledger
        (learner/checkpoint.py), then tell replay. Every rank calls it (FSDP gathers the
        shards); rank 0 writes and commits."""
        state = self.step.state()
        if not self.ranks.is_main:
            return
        try:
            save_checkpoint(self.run_dir, {
                **state, "updates": self.updates, "version": self.version,
                "consumed": self.consumed, **rng_states()})
        except OSError as exc:  # a full disk: train on, the next checkpoint tries again
            log.error("checkpoint at update %d not written (%s); the previous one stands",
                      self.updates, exc)
            return
        if self._uncommitted:
            try:
                self.replay.commit_ledger(self.learner_id, self._uncommitted, self.version)
                self._uncommitted = []
            except TransportTimeout as exc:  # kept: the next checkpoint commits them all
                log.warning("ledger commit deferred: %s", exc)

    def request_stop(self, *_) -> None:
        self._stop.set()

    # --- the loop ---

    def run(self, stop: threading.Event | None = None) -> None:
        """Train until ``settings.max_updates`` updates, ``learner.max_minutes``, or a stop
        (``stop`` set, :meth:`request_stop`, or another rank stopping); then a last
        checkpoint."""
        self._stop.use(stop)
        if self.ranks.is_main:
            self.replay.hello(self.learner_id, self.version, self.consumed)
        # The hello makes replay serve again what was delivered and not consumed: no rank
        # may draw before it, or its groups could be handed out twice.
        self.ranks.barrier()
        self._publish(wait=True)
        if self.settings.judged:
            log.info("advantages: composite (judge labels + outcome), alpha %g", self.cfg.alpha)
        else:
            log.info("advantages: grpo (outcome only; learner.advantage=%s%s)",
                     self.cfg.advantage,
                     ", no judge workers" if self.cfg.advantage == "composite" else "")
        deadline = time.monotonic() + 60 * self.cfg.max_minutes
        while True:
            groups, labels, waited = self.draw(deadline)
            if self.ranks.agree_to_stop(groups is None):  # all ranks stop, or none
                break
            self.update(groups, waited, labels)
        if self.publisher is not None:
            self.publisher.wait()
        self.checkpoint()
        if self.metrics is not None:
            self.metrics.log({"done": 1, "updates": self.updates, "version": self.version},
                             step=self.updates)

    def close(self) -> None:
        """Finish the weight write in flight and stop its server; close the metrics and the
        replay client. Safe to call twice. A publisher thread still writing when the
        interpreter exits dies inside torch's C++ code and aborts the process ("terminate
        called without an active exception")."""
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()  # stops the weight server, frees weights.address
        if self.metrics is not None:
            self.metrics.close()
        self.token_log.close()
        replay, self.replay = self.replay, None
        if replay is not None:
            replay.close()

    def alpha(self) -> float:
        """The process-reward weight now; 0 means outcome only."""
        return self.cfg.alpha_at(self.updates) if self.settings.judged else 0.0

    def stopping(self, deadline: float) -> bool:
        """Whether this process should stop drawing: asked to, out of time or updates, or
        another rank stopped."""
        return (self._stop.is_set() or time.monotonic() > deadline
                or self.ranks.peer_stopped() or self.updates >= self.settings.max_updates)

    def draw(self, deadline: float):
        """Block until this process's share of ``batch_groups`` arrived: (groups, labels by
        group id, seconds waited); (None, None, _) when stopping."""
        groups, labels, drawn, t0 = [], {}, set(), time.monotonic()
        self.judge_timeouts = self.uninformative = 0
        want_labels = self.alpha() > 0
        while len(groups) < self.share:
            if self.stopping(deadline):
                return None, None, 0.0
            # Replay holds the request until it has a group (or a stale skip) to report: no
            # polling here, and no wait past the run's time budget.
            wait = min(BATCH_WAIT_S, max(deadline - time.monotonic(), 0.0))
            try:
                batch = self.replay.request_batch(
                    self.learner_id, self.share - len(groups), self.version,
                    self.cfg.max_staleness, require_labels=want_labels,
                    label_deadline_s=self.settings.judge_deadline_s, timeout_s=wait,
                    skip_uninformative=self.cfg.skip_uninformative)
            except TransportTimeout as exc:  # no answer, or a full disk (ReplayDiskFull)
                log.warning("batch request: %s; retrying", exc)
                continue
            # Their admission slots are free (protocol/control.py). Replay counted the set-aside
            # ones durably first: a Redis that lost its data just then is rebuilt with them
            # counted and freed once more here (the bound loosens by those few), and a learner
            # killed before this line frees nothing (tightens by as many), as for stale skips.
            skipped = batch.stale_skipped + batch.uninformative_skipped
            if skipped:
                self.control.free_stale_slots(skipped)
            self.uninformative += batch.uninformative_skipped
            self.judge_timeouts += batch.judge_timeouts
            labels.update((lab.group_id, lab) for lab in batch.labels)
            for g in batch.groups:
                if g.group_id in self._consumed_ids or g.group_id in drawn:
                    # defence in depth: replay already guarantees once-only delivery
                    log.error("replay delivered %s twice; dropped", g.group_id)
                    continue
                drawn.add(g.group_id)
                groups.append(g)
        return groups, (labels if want_labels else None), time.monotonic() - t0

    def update(self, groups, waited_s: float = 0.0, labels=None) -> None:
        """One update on ``groups`` (this process's share): the step, the ledger, publishing
        and checkpointing when due, metrics."""
        t0 = time.monotonic()
        lags = [self.version - g.policy_versions()[0] for g in groups]  # versions behind, at use
        alpha = self.alpha()
        probe = bool(self.cfg.probe_every) and (self.updates + 1) % self.cfg.probe_every == 0
        m, stats = self.step.update(groups, labels, alpha, probe)
        scored = stats.pop("token_logprobs", None)
        if scored is not None:  # under the weights this update started from
            self.token_log.write(groups, scored, self.version)
        self.updates += 1
        self._record(groups)
        if self.updates % self.cfg.publish_every == 0:
            self.version += 1
            self._publish()
        if self.updates % self.cfg.checkpoint_every == 0:
            self.checkpoint()
        counts = self.ranks.sum({  # the whole batch's, not this rank's share
            "groups": len(groups), "judge_timeouts": self.judge_timeouts,
            "uninformative_groups": self.uninformative,
            "labelled_groups": len(groups) - stats.get("unlabelled_groups", len(groups)),
            "degenerate_groups": stats["degenerate_groups"], "tokens": stats["tokens"]})
        skipped = counts["uninformative_groups"]
        self.uninformative_total += skipped
        m.update(alpha=alpha, judge_timeouts=float(counts["judge_timeouts"]),
                 labelled_groups=float(counts["labelled_groups"]),
                 uninformative_groups=float(skipped),
                 uninformative_share=skipped / max(skipped + counts["groups"], 1))
        if self.token_log.enabled:
            m["token_log_errors"] = float(self.token_log.errors)
        self._log(groups, lags, counts, m, waited_s, time.monotonic() - t0)

    def _record(self, groups) -> None:
        """Add every rank's groups of this update to the ledger, in rank order."""
        ids = self.ranks.gather_strings([g.group_id for g in groups])
        self.consumed += ids
        self._consumed_ids.update(ids)
        if self.ranks.is_main:  # the one that commits
            self._uncommitted += ids

    def _publish(self, wait: bool = False) -> None:
        state = self.step.trained_state()  # every rank: FSDP gathers the shards
        if self.publisher is not None:
            self.publisher.publish(state, self.version, wait=wait, adapter=self.step.adapter)

    def _log(self, groups, lags, counts, m, waited_s, step_s):
        """Rank 0's metrics: the step's (losses, tokens, grad norm: the whole batch's) and
        group counts of the whole batch; rewards, lags and timings of its own share."""
        if self.metrics is None:
            return
        rewards = [t.reward for g in groups for t in g.trajectories]
        self.metrics.log({
            **m, "version": self.version, "updates": self.updates,
            "degenerate_groups": int(counts["degenerate_groups"]),
            "groups": int(counts["groups"]),
            "reward": float(np.mean(rewards)), "lag_min": min(lags),
            "lag_mean": float(np.mean(lags)),
            "lag_max": max(lags), "tokens_per_s": counts["tokens"] / max(step_s, 1e-9),
            "updates_per_s": 1.0 / max(step_s + waited_s, 1e-9), "step_s": step_s,
            "idle_s": waited_s, "idle_fraction": waited_s / max(waited_s + step_s, 1e-9),
            "lr": self.step.lr, "publish_s": self.publisher.last_publish_s,
            "publish_bytes": self.publisher.last_publish_bytes,
        }, step=self.updates)
        self.control.set_state(learner_updates=self.updates, version=self.version,
                               learner_uninformative=self.uninformative_total)
