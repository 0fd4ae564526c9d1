"""The learner role: draw groups from replay, take clipped off-policy steps, publish weights.

    hello(replay, ledger from checkpoint)           # a resume neither repeats nor skips
    while updates < max_updates and within budget:
        groups, labels = draw batch_groups          # oldest first, within the staleness bound;
                                                    # judged ones, or past judge.deadline_s
        batch = build_batch(groups, labels, α(u))   # masks, step advantages (or plain GRPO)
        strip injected experience (experience.train_context=discard)
        proximal = logprobs under current params    # decoupled PPO
        per minibatch: loss = policy_loss(...)      # boosted clip on experience-guided rows
                       optimizer step
        every k updates: publish weights, version += 1
        every m updates: checkpoint (+ ledger), then commit the ledger to replay
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import signal
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from autodidact.metrics import MetricsWriter
from learner.batching import build_batch
from learner.logprobs import token_logprobs
from learner.losses import navigation_terms, policy_loss
from protocol.config import LearnerConfig, RunConfig
from protocol.control import ControlPlane
from protocol.errors import TransportTimeout
from protocol.weights import WeightPublisher
from replay.client import ReplayClient

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoints/latest.pt"
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "updates", "version", "consumed",
                   "torch_rng", "numpy_rng", "python_rng")


# Checkpoints written before the RNG states were plain tensors hold numpy's as an ndarray.
# Rebuilding an ndarray runs no code from the file (torch documents this allowlist), so those
# still load, with weights_only=True all the same.
_NUMPY_GLOBALS = [getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct,
                  np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (refused, not the expected content)."""


def rng_states() -> dict:
    """The RNG states as tensors, ints and lists only, so checkpoints load with
    ``weights_only=True`` (numpy's state holds an ndarray, which that refuses)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch_rng": torch.get_rng_state(),
            "numpy_rng": [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(gauss)],
            "python_rng": [version, list(internal), gauss_next]}


def set_rng_states(state: dict) -> None:
    torch.set_rng_state(state["torch_rng"])
    name, keys, pos, has_gauss, gauss = state["numpy_rng"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python_rng"]
    random.setstate((version, tuple(internal), gauss_next))


def load_checkpoint(path: Path) -> dict:
    """Tensors and plain data only (``weights_only=True``): a checkpoint that would need any
    other object unpickled is refused, before anything in it runs."""
    try:
        # CPU first: the saved RNG state must stay a CPU ByteTensor (set_rng_state refuses a
        # CUDA one); load_state_dict moves model and optimizer tensors to the model's device.
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it asks to unpickle {found.group(1)}" if found else str(exc).splitlines()[0]
        raise CheckpointError(
            f"refused to load {path}: not a plain tensor checkpoint ({what}); checkpoints are "
            "loaded with weights_only=True and never run code from the file") from None
    missing = [k for k in CHECKPOINT_KEYS if k not in state] if isinstance(state, dict) \
        else list(CHECKPOINT_KEYS)
    if missing:
        raise CheckpointError(f"{path} is not a learner checkpoint: missing {missing}")
    return state


class Learner:
    def __init__(self, cfg: RunConfig, run_dir: Path, control: ControlPlane,
                 replay: ReplayClient, learner_id: str = "learner"):
        self.cfg: LearnerConfig = cfg.learner
        self.experience = cfg.experience
        self.judge_deadline_s = cfg.judge.deadline_s
        # Labels are only worth waiting for when some judge will write them.
        self.judge_workers = cfg.judge.workers
        self.judged = cfg.learner.advantage == "composite" and cfg.judge.workers > 0
        self.run_dir = Path(run_dir)
        self.control = control
        self.replay = replay
        self.learner_id = learner_id
        self.device = torch.device(self.cfg.device)
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path).to(self.device)
        self.model.train()
        self.pad_id = AutoTokenizer.from_pretrained(cfg.model.path).pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           betas=(0.9, 0.99), weight_decay=0.0)
        warmup = max(self.cfg.warmup_updates, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup))
        # A frozen copy of the initial policy, only when a KL penalty to it is asked for.
        self.reference = None
        if self.cfg.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(cfg.model.path).to(self.device)
            self.reference.eval().requires_grad_(False)
        self.publisher = WeightPublisher.for_run(cfg, self.run_dir, control)
        self.metrics = MetricsWriter(self.run_dir, "learner", learner_id)
        self.updates = 0
        self.version = 0
        self.consumed: list[str] = []  # the ledger: every group id trained on, in order
        self._consumed_ids: set[str] = set()  # the same ids, for the duplicate check
        self._uncommitted: list[str] = []
        self._stop = False
        self.judge_timeouts = 0  # groups of the current batch trained outcome-only: no labels

    # --- lifecycle ---

    def resume(self) -> bool:
        """Restore the latest checkpoint if there is one."""
        path = self.run_dir / CHECKPOINT
        if not path.exists():
            return False
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates, self.version = state["updates"], state["version"]
        self.consumed = list(state["consumed"])
        self._consumed_ids = set(self.consumed)
        set_rng_states(state)
        log.info("resumed at update %d, version %d, %d groups consumed",
                 self.updates, self.version, len(self.consumed))
        return True

    def checkpoint(self) -> None:
        """Write model, optimizer, RNG, version and ledger atomically, then tell replay."""
        path = self.run_dir / CHECKPOINT
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(),
                 "updates": self.updates, "version": self.version, "consumed": self.consumed,
                 **rng_states()}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if self._uncommitted:
            self.replay.commit_ledger(self.learner_id, self._uncommitted, self.version)
            self._uncommitted = []

    def request_stop(self, *_):
        self._stop = True

    # --- the loop ---

    def run(self, max_updates: int | None = None) -> None:
        max_updates = max_updates or self.cfg.max_updates
        self.replay.hello(self.learner_id, self.version, self.consumed)
        self.publisher.publish(self.model.state_dict(), self.version, wait=True)
        if self.judged:
            log.info("advantages: composite (judge labels + outcome), alpha %g", self.cfg.alpha)
        else:
            log.info("advantages: grpo (outcome only; learner.advantage=%s, judge.workers=%d)",
                     self.cfg.advantage, self.judge_workers)
        deadline = time.monotonic() + 60 * self.cfg.max_minutes
        while self.updates < max_updates and time.monotonic() < deadline and not self._stop:
            groups, labels, waited = self.draw(deadline)
            if groups is None:
                break
            self.update(groups, waited, labels)
        self.publisher.wait()
        self.checkpoint()
        self.metrics.log({"done": 1, "updates": self.updates, "version": self.version},
                         step=self.updates)

    def alpha(self) -> float:
        """The process-reward weight now; 0 means outcome only."""
        return self.cfg.alpha_at(self.updates) if self.judged else 0.0

    def draw(self, deadline: float):
        """Block until ``batch_groups`` groups arrived: (groups, labels by group id, seconds
        waited); (None, None, _) when stopping."""
        groups, labels, drawn, t0 = [], {}, set(), time.monotonic()
        self.judge_timeouts = 0
        want_labels = self.alpha() > 0
        while len(groups) < self.cfg.batch_groups:
            if self._stop or time.monotonic() > deadline:
                return None, None, 0.0
            try:
                batch = self.replay.request_batch(
                    self.learner_id, self.cfg.batch_groups - len(groups), self.version,
                    self.cfg.max_staleness, require_labels=want_labels,
                    label_deadline_s=self.judge_deadline_s)
            except TransportTimeout:
                log.warning("replay did not answer a batch request; retrying")
                continue
            if batch.stale_skipped:  # frees their admission slots (protocol/control.py)
                self.control.incr("learner/stale_skipped", batch.stale_skipped)
            if not batch.groups:
                time.sleep(0.05)  # nothing fresh (or judged) yet
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

    def update(self, groups, waited_s: float, labels=None) -> None:
        t0 = time.monotonic()
        lags = [self.version - g.policy_versions()[0] for g in groups]  # versions behind, at use
        alpha = self.alpha()
        batch, stats = build_batch(groups, self.pad_id, labels=labels, alpha=alpha,
                                   experience=self.experience.train_context)
        batch = batch.to(self.device)
        proximal, reference = self._fixed_logprobs(batch)
        m: dict[str, float] = {}
        for rows in torch.arange(len(batch.input_ids)).chunk(self.cfg.minibatches):
            mb = batch.rows(rows)
            logprobs = token_logprobs(self.model, mb.input_ids, mb.attention_mask)
            # One step per batch: the proximal policy is this very forward pass, detached.
            prox = logprobs.detach() if proximal is None else proximal[rows]
            ref = None if reference is None else reference[rows]
            loss, m = self._loss(mb, logprobs, prox, ref)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.cfg.grad_clip)
            self.optimizer.step()
        self.scheduler.step()
        if self.cfg.probe_every and (self.updates + 1) % self.cfg.probe_every == 0:
            m.update(self._probe(mb, loss.item(), prox, ref))
        self.updates += 1
        ids = [g.group_id for g in groups]
        self.consumed += ids
        self._consumed_ids.update(ids)
        self._uncommitted += ids
        if self.updates % self.cfg.publish_every == 0:
            self.version += 1
            self.publisher.publish(self.model.state_dict(), self.version)
        if self.updates % self.cfg.checkpoint_every == 0:
            self.checkpoint()
        m.update(alpha=alpha, judge_timeouts=float(self.judge_timeouts),
                 labelled_groups=float(len(groups) - stats.get("unlabelled_groups", len(groups))))
        self._log(groups, lags, stats, m, float(grad_norm), waited_s, time.monotonic() - t0)

    @torch.no_grad()
    def _fixed_logprobs(self, batch):
        """Proximal log-probs (only needed ahead with several minibatches) and the reference's."""
        proximal = None
        if self.cfg.minibatches > 1:
            proximal = token_logprobs(self.model, batch.input_ids, batch.attention_mask)
        reference = None
        if self.reference is not None:
            reference = token_logprobs(self.reference, batch.input_ids, batch.attention_mask)
        return proximal, reference

    def _loss(self, batch, logprobs, proximal, reference):
        behaviour, clip_high, nav = navigation_terms(batch, proximal, self.cfg.clip_high,
                                                     self.experience.clip_high)
        loss, m = policy_loss(
            logprobs, proximal, behaviour, batch.advantages, batch.action_mask,
            clip_low=self.cfg.clip_low, clip_high=clip_high,
            dual_clip=self.cfg.dual_clip, iw_cap=self.cfg.iw_cap,
            aggregation=self.cfg.loss_aggregation, kl_coef=self.cfg.kl_coef,
            ref_logprobs=reference)
        return loss, {**m, **nav}

    @torch.no_grad()
    def _probe(self, batch, loss_before: float, proximal, reference) -> dict[str, float]:
        """Did the (last) step do what it was for? Re-score its minibatch with the new weights.

        A training-reward curve answers this too, but over a few dozen small batches it is
        mostly sampling noise; the loss on the batch the step was taken on is not.
        """
        after = token_logprobs(self.model, batch.input_ids, batch.attention_mask)
        loss_after, _ = self._loss(batch, after, proximal, reference)
        mask = batch.action_mask.float()
        log_ratio = proximal - after  # KL(before || after), k1 estimate on the sampled tokens
        return {"step_gain": loss_before - float(loss_after),
                "step_kl": float((log_ratio * mask).sum() / mask.sum().clamp(min=1))}

    def _log(self, groups, lags, stats, m, grad_norm, waited_s, step_s):
        rewards = [t.reward for g in groups for t in g.trajectories]
        tokens = stats["tokens"]
        self.metrics.log({
            **m, "grad_norm": grad_norm, "version": self.version, "updates": self.updates,
            "degenerate_groups": stats["degenerate_groups"], "groups": len(groups),
            "reward": float(np.mean(rewards)), "lag_min": min(lags),
            "lag_mean": float(np.mean(lags)),
            "lag_max": max(lags), "tokens_per_s": tokens / max(step_s, 1e-9),
            "updates_per_s": 1.0 / max(step_s + waited_s, 1e-9), "step_s": step_s,
            "idle_s": waited_s, "idle_fraction": waited_s / max(waited_s + step_s, 1e-9),
            "lr": self.scheduler.get_last_lr()[0], "publish_s": self.publisher.last_publish_s,
        }, step=self.updates)
        self.control.set_state(learner_updates=self.updates, version=self.version)


def main(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
         resume: bool = False) -> None:
    torch.set_num_threads(cfg.learner.torch_threads)
    control = ControlPlane.connect(cfg.redis.url, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s)
    replay = ReplayClient.for_run(cfg)
    learner = Learner(cfg, run_dir, control, replay)
    signal.signal(signal.SIGTERM, learner.request_stop)
    signal.signal(signal.SIGINT, learner.request_stop)
    if resume:
        try:
            learner.resume()
        except CheckpointError as exc:
            replay.close()
            raise SystemExit(f"learner: {exc}") from None
    try:
        learner.run(max_updates)
    finally:
        replay.close()
        learner.metrics.close()
