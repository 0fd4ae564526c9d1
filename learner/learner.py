"""The learner role: draw groups from replay, take clipped off-policy steps, publish weights.

    hello(replay, ledger from checkpoint)           # a resume neither repeats nor skips
    while updates < max_updates and within budget:
        groups, labels = draw batch_groups / N      # oldest first, within the staleness bound;
                                                    # judged ones, or past judge.deadline_s;
                                                    # replay holds the request until it has some
        batch = build_batch(groups, labels, α(u))   # masks, step advantages (or plain GRPO)
        strip injected experience (experience.train_context=discard)
        proximal = logprobs under current params    # decoupled PPO
        per minibatch, per micro-batch:             # learner.accumulation of them
            backward(policy_loss summed)            # boosted clip on experience-guided rows
        then gradient /= tokens (or rows) of all ranks, optimizer step
        every k updates: publish weights, version += 1
        every m updates: checkpoint (+ ledger), then commit the ledger to replay

With ``torchrun --nproc-per-node N`` there are N such loops, one per GPU, in lockstep: each
draws its share of the batch, DDP (or FSDP) averages their gradients, and rank 0 alone says
hello, publishes, checkpoints, commits the ledger and writes metrics (learner/distributed.py).
With one process all of that reduces to the loop above.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference import lora
from learner.batching import build_batch, token_budget_parts
from learner.checkpoint import (  # noqa: F401  (CheckpointError, load_checkpoint: the API)
    CheckpointError,
    load_checkpoint,
    read_checkpoint,
    rng_states,
    save_checkpoint,
    set_rng_states,
)
from learner.distributed import SINGLE, Ranks
from learner.logprobs import prepare_for_training, token_logprobs
from learner.losses import navigation_terms, policy_loss
from metrics.jsonl import MetricsWriter
from protocol.config import LearnerConfig, RunConfig
from protocol.control import ControlPlane
from protocol.errors import TransportTimeout, exit_unrecoverable
from protocol.replay_client import ReplayClient
from protocol.run_dir import RunDir, single_writer_lock
from protocol.weights import AdapterMeta, WeightPublisher

log = logging.getLogger(__name__)

# How long replay may hold a batch request it cannot serve yet (BatchRequest.timeout_s): it
# answers as soon as a group is there, so this only bounds how late a stop is noticed.
BATCH_WAIT_S = 1.0
class Learner:
    # Class attributes, so subclasses that skip __init__ (bench/scale_actors.py) get one
    # process training the whole model.
    ranks: Ranks = SINGLE
    adapter: AdapterMeta | None = None

    def __init__(self, cfg: RunConfig, run_dir: Path, control: ControlPlane,
                 replay: ReplayClient, learner_id: str = "learner", ranks: Ranks = SINGLE):
        self.cfg: LearnerConfig = cfg.learner
        self.experience = cfg.experience
        self.judge_deadline_s = cfg.judge.deadline_s
        # Labels are only worth waiting for when some judge will write them.
        self.judge_workers = cfg.judge.workers
        self.judged = cfg.learner.advantage == "composite" and cfg.judge.workers > 0
        self.run_dir = Path(run_dir)
        self.control = control
        self.replay = replay
        self.ranks = ranks
        self.learner_id = ranks.member(learner_id)
        ranks.share(self.cfg.batch_groups)  # refuses a batch the ranks cannot split evenly
        self.device = ranks.device(self.cfg.device)
        self.autocast = autocast_dtype(self.cfg.autocast, self.device,
                                       cfg.actor.samples_in_low_precision)
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path).to(self.device)
        # With LoRA only the adapter trains and travels; the frozen base is also the KL
        # reference (adapters off), so no second copy of the model is kept.
        self.adapter = adapter_for(cfg)
        if self.adapter is not None:
            lora.attach(model, self.adapter, dropout=self.cfg.lora_dropout, init_seed=cfg.seed)
        prepare_for_training(model, self.cfg.logit_chunk_tokens, self.cfg.gradient_checkpointing)
        self.model = ranks.wrap(model.train(), self.cfg.parallel)
        self.pad_id = AutoTokenizer.from_pretrained(cfg.model.path).pad_token_id or 0
        # After wrapping: under FSDP the optimizer must hold the sharded parameters.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.cfg.lr,
                                           betas=(0.9, 0.99), weight_decay=0.0)
        warmup = max(self.cfg.warmup_updates, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup))
        # A frozen copy of the initial policy, only when a KL penalty to it is asked for.
        self.reference = None
        if self.cfg.kl_coef > 0 and self.adapter is None:
            reference = AutoModelForCausalLM.from_pretrained(cfg.model.path).to(self.device)
            self.reference = ranks.wrap_frozen(reference.eval().requires_grad_(False),
                                               self.cfg.parallel)
        # Rank 0 alone publishes (and binds the weight server) and writes metrics.
        self.publisher = WeightPublisher.for_run(cfg, self.run_dir, control) \
            if ranks.is_main else None
        self.metrics = MetricsWriter(self.run_dir, "learner", learner_id) \
            if ranks.is_main else None
        self.updates = 0
        self.version = 0
        self.consumed: list[str] = []  # the ledger: every group id trained on, in order
        self._consumed_ids: set[str] = set()  # the same ids, for the duplicate check
        self._uncommitted: list[str] = []
        self._stop = False
        self.judge_timeouts = 0  # groups of the current batch trained outcome-only: no labels

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
        check_checkpoint_adapter(state, self.adapter, path)
        self.ranks.load_model_state(self.model, state["model"], partial=self.adapter is not None)
        self.ranks.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates, self.version = state["updates"], state["version"]
        self.consumed = list(state["consumed"])
        self._consumed_ids = set(self.consumed)
        set_rng_states(state)
        log.info("resumed from %s at update %d, version %d, %d groups consumed",
                 path, self.updates, self.version, len(self.consumed))
        return True

    def checkpoint(self) -> None:
        """Write model, optimizer, RNG, version and ledger (learner/checkpoint.py), then tell
        replay. Every rank calls it (FSDP gathers the shards); rank 0 writes and commits."""
        model = self._trained_state()
        optimizer = self.ranks.optimizer_state(self.model, self.optimizer)
        if not self.ranks.is_main:
            return
        adapter = {"adapter": self.adapter.to_metadata()} if self.adapter is not None else {}
        try:
            save_checkpoint(self.run_dir, {
                "model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "updates": self.updates, "version": self.version, "consumed": self.consumed,
                **adapter, **rng_states()})
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

    def request_stop(self, *_):
        self._stop = True

    # --- the loop ---

    def run(self, max_updates: int | None = None) -> None:
        max_updates = max_updates or self.cfg.max_updates
        if self.ranks.is_main:
            self.replay.hello(self.learner_id, self.version, self.consumed)
        # The hello makes replay serve again what was delivered and not consumed: no rank
        # may draw before it, or its groups could be handed out twice.
        self.ranks.barrier()
        self._publish(wait=True)
        if self.judged:
            log.info("advantages: composite (judge labels + outcome), alpha %g", self.cfg.alpha)
        else:
            log.info("advantages: grpo (outcome only; learner.advantage=%s, judge.workers=%d)",
                     self.cfg.advantage, self.judge_workers)
        deadline = time.monotonic() + 60 * self.cfg.max_minutes
        while True:
            groups, labels, waited = self.draw(deadline, max_updates)
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
        """Finish the weight write in flight and stop its server; close the metrics. A
        publisher thread still writing when the interpreter exits dies inside torch's C++
        code and aborts the process ("terminate called without an active exception")."""
        if self.metrics is not None:
            self.metrics.close()
        if self.publisher is not None:
            self.publisher.close()  # stops the weight server, frees weights.address

    def alpha(self) -> float:
        """The process-reward weight now; 0 means outcome only."""
        return self.cfg.alpha_at(self.updates) if self.judged else 0.0

    def stopping(self, deadline: float, max_updates: int | None = None) -> bool:
        """Whether this process should stop drawing: asked to, out of time or updates, or
        another rank stopped."""
        return (self._stop or time.monotonic() > deadline or self.ranks.peer_stopped()
                or self.updates >= (max_updates or self.cfg.max_updates))

    def draw(self, deadline: float, max_updates: int | None = None):
        """Block until this process's share of ``batch_groups`` arrived: (groups, labels by
        group id, seconds waited); (None, None, _) when stopping."""
        groups, labels, drawn, t0 = [], {}, set(), time.monotonic()
        self.judge_timeouts = 0
        want_labels = self.alpha() > 0
        while len(groups) < self.share:
            if self.stopping(deadline, max_updates):
                return None, None, 0.0
            # Replay holds the request until it has a group (or a stale skip) to report: no
            # polling here, and no wait past the run's time budget.
            wait = min(BATCH_WAIT_S, max(deadline - time.monotonic(), 0.0))
            try:
                batch = self.replay.request_batch(
                    self.learner_id, self.share - len(groups), self.version,
                    self.cfg.max_staleness, require_labels=want_labels,
                    label_deadline_s=self.judge_deadline_s, timeout_s=wait)
            except TransportTimeout as exc:  # no answer, or a full disk (ReplayDiskFull)
                log.warning("batch request: %s; retrying", exc)
                continue
            if batch.stale_skipped:  # frees their admission slots (protocol/control.py)
                self.control.free_stale_slots(batch.stale_skipped)
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
        for rows in self._split(torch.arange(len(batch.input_ids)), self.cfg.minibatches):
            m, grad_norm, last = self._step(batch, rows, proximal, reference)
        self.scheduler.step()
        if self.cfg.probe_every and (self.updates + 1) % self.cfg.probe_every == 0:
            m.update(self._probe(*last))
        self.updates += 1
        self._record(groups)
        if self.updates % self.cfg.publish_every == 0:
            self.version += 1
            self._publish()
        if self.updates % self.cfg.checkpoint_every == 0:
            self.checkpoint()
        counts = self.ranks.sum({  # the whole batch's, not this rank's share
            "groups": len(groups), "judge_timeouts": self.judge_timeouts,
            "labelled_groups": len(groups) - stats.get("unlabelled_groups", len(groups)),
            "degenerate_groups": stats["degenerate_groups"], "tokens": stats["tokens"]})
        m.update(alpha=alpha, judge_timeouts=float(counts["judge_timeouts"]),
                 labelled_groups=float(counts["labelled_groups"]))
        self._log(groups, lags, counts, m, grad_norm, waited_s, time.monotonic() - t0)

    def _split(self, rows: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """``rows`` in ``parts`` slices; with several ranks always exactly ``parts`` (some may
        be empty), since every rank must take as many steps and backward passes as the rest."""
        out = list(rows.chunk(parts))
        if self.ranks.active:
            out += [rows[:0]] * (parts - len(out))
        return out

    def _step(self, batch, rows, proximal, reference):
        """One optimizer step on the minibatch ``rows``: (metrics, grad norm, what the probe
        needs).

        Each micro-batch backpropagates its loss *summed* over tokens (token-mean) or rows
        (seq-mean-token-mean), and the gradient is divided once by the number of those in all
        micro-batches of all ranks, known only after the last one. So the step is the one a
        single process would take on the whole minibatch, however its rows fell to ranks and
        micro-batches (a mean per part would weigh a short part's rows more). DDP averages
        over ranks, hence the factor ``world`` back.
        """
        self.optimizer.zero_grad(set_to_none=True)
        lengths = batch.lengths().cpu()  # sizes only: one read-back, not one per row
        parts = self._micro_batches(rows, lengths)
        totals = dict.fromkeys(("loss", "pg_loss", "denominator", "tokens"), 0.0)
        seen = []
        for i, part in enumerate(parts):
            with self.ranks.sync_grads(self.model, sync=i == len(parts) - 1):
                mb, index = self._micro(batch, part, lengths)
                width = mb.input_ids.shape[1]  # trimmed to its longest row
                with self._autocast():
                    logprobs = token_logprobs(self.model, mb.input_ids, mb.attention_mask,
                                              self.cfg.logit_chunk_tokens, mb.action_mask)
                # One step per batch: the proximal policy is this very forward pass, detached.
                prox = logprobs.detach() if proximal is None else proximal[index][:, :width]
                ref = None if reference is None else reference[index][:, :width]
                loss, m = self._loss(mb, logprobs, prox, ref, reduction="sum")
                loss.backward()
            totals = {k: totals[k] + m[k] for k in totals}
            if len(part) or not seen:  # a blank micro-batch says nothing about the policy
                seen.append(m)
        # The probe re-scores the last micro-batch: its own loss, as a mean, to compare with.
        probe = (mb, m["loss"] / max(m["denominator"], 1.0), prox, ref)
        totals = self.ranks.sum(totals)
        denominator = max(totals["denominator"], 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(self.ranks.world / denominator)
        grad_norm = self.ranks.clip_grad_norm(self.model, self.cfg.grad_clip)
        self.optimizer.step()
        m = _merge_metrics(seen)
        del m["denominator"]
        m.update(loss=totals["loss"] / denominator, pg_loss=totals["pg_loss"] / denominator,
                 tokens=totals["tokens"])
        return m, grad_norm, probe

    def _micro_batches(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """The minibatch ``rows`` as micro-batches: ``accumulation`` equal slices, or with
        ``micro_batch_tokens`` as many as that token budget needs (every rank takes as many
        as the rank that needs most)."""
        budget = self.cfg.micro_batch_tokens
        if not budget:
            return self._split(rows, self.cfg.accumulation)
        parts = token_budget_parts(rows, lengths, budget)
        if self.ranks.active:
            parts += [rows[:0]] * (self.ranks.max_int(len(parts)) - len(parts))
        return parts

    def _micro(self, batch, part, lengths: torch.Tensor):
        """The micro-batch of rows ``part``, trimmed to its longest row, and its row index.
        An empty ``part`` (a rank with fewer rows than slices) gives row 0 with nothing
        trained: it still runs the forward and backward the other ranks' collectives wait
        for, and adds zero."""
        if len(part):
            return batch.rows(part, int(lengths[part].max())), part
        index = torch.zeros(1, dtype=torch.long)
        blank = batch.rows(index)
        blank.action_mask = torch.zeros_like(blank.action_mask)
        blank.num_tokens = 0
        return blank, index

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _record(self, groups) -> None:
        """Add every rank's groups of this update to the ledger, in rank order."""
        ids = self.ranks.gather_strings([g.group_id for g in groups])
        self.consumed += ids
        self._consumed_ids.update(ids)
        if self.ranks.is_main:  # the one that commits
            self._uncommitted += ids

    def _trained_state(self) -> dict | None:
        """What this learner trains, on rank 0 (None elsewhere): the whole model's state, or
        with LoRA only the adapter's. Under FSDP every rank must call it (shards gather)."""
        return self.ranks.model_state(self.model, trainable_only=self.adapter is not None)

    def _publish(self, wait: bool = False) -> None:
        state = self._trained_state()
        if self.publisher is not None:
            self.publisher.publish(state, self.version, wait=wait, adapter=self.adapter)

    @torch.no_grad()
    def _fixed_logprobs(self, batch):
        """Proximal log-probs (only needed ahead with several minibatches) and the reference's."""
        proximal = None
        with self._autocast():
            if self.cfg.minibatches > 1:
                proximal = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                          self.cfg.logit_chunk_tokens, batch.action_mask)
            reference = None
            if self.reference is not None:
                reference = token_logprobs(self.reference, batch.input_ids,
                                           batch.attention_mask, self.cfg.logit_chunk_tokens,
                                           batch.action_mask)
            elif self.adapter is not None and self.cfg.kl_coef > 0:
                with lora.disabled(self.model):  # the base is the reference
                    reference = token_logprobs(self.model, batch.input_ids,
                                               batch.attention_mask, self.cfg.logit_chunk_tokens,
                                               batch.action_mask)
        return proximal, reference

    def _loss(self, batch, logprobs, proximal, reference, reduction: str = "mean"):
        behaviour, clip_high, nav = navigation_terms(batch, proximal, self.cfg.clip_high,
                                                     self.experience.clip_high, self.cfg.iw_cap)
        loss, m = policy_loss(
            logprobs, proximal, behaviour, batch.advantages, batch.action_mask,
            clip_low=self.cfg.clip_low, clip_high=clip_high,
            dual_clip=self.cfg.dual_clip, iw_cap=self.cfg.iw_cap,
            aggregation=self.cfg.loss_aggregation, kl_coef=self.cfg.kl_coef,
            ref_logprobs=reference, reduction=reduction, guided=batch.guided)
        return loss, {**m, **nav}

    @torch.no_grad()
    def _probe(self, batch, loss_before: float, proximal, reference) -> dict[str, float]:
        """Did the (last) step do what it was for? Re-score its (last) micro-batch with the
        new weights; with several ranks, rank 0's.

        A training-reward curve answers this too, but over a few dozen small batches it is
        mostly sampling noise; the loss on the batch the step was taken on is not.
        """
        with self._autocast():
            after = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                   self.cfg.logit_chunk_tokens, batch.action_mask)
        loss_after, _ = self._loss(batch, after, proximal, reference)
        mask = batch.action_mask.float()
        log_ratio = proximal - after  # KL(before || after), k1 estimate on the sampled tokens
        return {"step_gain": loss_before - float(loss_after),
                "step_kl": float((log_ratio * mask).sum() / mask.sum().clamp(min=1))}

    def _log(self, groups, lags, counts, m, grad_norm, waited_s, step_s):
        """Rank 0's metrics: losses, tokens and group counts of the whole batch; rewards,
        lags and timings of its own share."""
        if self.metrics is None:
            return
        rewards = [t.reward for g in groups for t in g.trajectories]
        self.metrics.log({
            **m, "grad_norm": grad_norm, "version": self.version, "updates": self.updates,
            "degenerate_groups": int(counts["degenerate_groups"]),
            "groups": int(counts["groups"]),
            "reward": float(np.mean(rewards)), "lag_min": min(lags),
            "lag_mean": float(np.mean(lags)),
            "lag_max": max(lags), "tokens_per_s": counts["tokens"] / max(step_s, 1e-9),
            "updates_per_s": 1.0 / max(step_s + waited_s, 1e-9), "step_s": step_s,
            "idle_s": waited_s, "idle_fraction": waited_s / max(waited_s + step_s, 1e-9),
            "lr": self.scheduler.get_last_lr()[0], "publish_s": self.publisher.last_publish_s,
            "publish_bytes": self.publisher.last_publish_bytes,
        }, step=self.updates)
        self.control.set_state(learner_updates=self.updates, version=self.version)


def adapter_for(cfg: RunConfig) -> AdapterMeta | None:
    """The LoRA adapter ``learner.lora_*`` asks for, tied to the base it trains on; None for
    full fine-tuning."""
    if not cfg.learner.lora_rank:
        return None
    return AdapterMeta(rank=cfg.learner.lora_rank, alpha=cfg.learner.lora_alpha,
                       targets=",".join(cfg.learner.lora_targets), base_id=cfg.model.path,
                       base_sha256=lora.base_digest(cfg.model.path))


def check_checkpoint_adapter(state: dict, adapter: AdapterMeta | None, path: Path) -> None:
    """Refuse to resume a checkpoint trained otherwise than this learner trains: full weights
    into a LoRA learner or back, another rank or targets, or an adapter of another base."""
    saved = AdapterMeta.from_metadata(state.get("adapter"))
    if saved is None and adapter is None:
        return
    if saved is None or adapter is None:
        what = "full fine-tuning" if saved is None else f"a LoRA adapter (rank {saved.rank})"
        now = "full fine-tuning" if adapter is None else f"LoRA rank {adapter.rank}"
        raise CheckpointError(f"{path} holds {what}, but this run trains {now}: resume with "
                              f"the learner.lora_rank it was trained with")
    for field_name in ("rank", "targets", "base_sha256"):
        if getattr(saved, field_name) != getattr(adapter, field_name):
            raise CheckpointError(
                f"{path} holds an adapter with {field_name}={getattr(saved, field_name)!r}, "
                f"this run asks for {getattr(adapter, field_name)!r}: resume with the "
                f"learner.lora_* settings and model.path it was trained with")


def autocast_dtype(setting: str, device: torch.device,
                   actors_low_precision: bool) -> torch.dtype | None:
    """``learner.autocast``: bf16 on request, or by default on CUDA behind actors that sample
    in low precision themselves; None for float32."""
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"
                             and actors_low_precision):
        return torch.bfloat16
    return None


def _merge_metrics(ms: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its micro-batches': the mean, but the largest ``iw_max``; a
    metric some micro-batches lack (one of guided rows, say) is the mean over those that have
    it."""
    if len(ms) == 1:
        return dict(ms[0])
    keys = dict.fromkeys(k for m in ms for k in m)
    return {k: (max if k == "iw_max" else _mean)([m[k] for m in ms if k in m]) for k in keys}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(cfg: RunConfig, run_dir: Path, max_updates: int | None = None,
         resume: bool = False) -> None:
    """One learner process; under ``torchrun`` (``WORLD_SIZE`` > 1) one rank of several. Rank 0
    holds the run directory's learner lock: a second learner would train the same groups and
    write the same checkpoint."""
    torch.set_num_threads(cfg.learner.torch_threads)
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
    control = ControlPlane.connect(cfg.redis.url, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s)
    replay = ReplayClient.for_run(cfg, role="learner", run_dir=run_dir)
    learner = None
    try:
        learner = Learner(cfg, run_dir, control, replay, ranks=ranks)
        signal.signal(signal.SIGTERM, learner.request_stop)
        signal.signal(signal.SIGINT, learner.request_stop)
        if resume:
            try:
                learner.resume()
            except CheckpointError as exc:
                exit_unrecoverable(f"learner: {exc}")
        # Every rank reads the checkpoint itself: on nodes that do not share the run
        # directory they would start from different states, and the lockstep would break.
        if not ranks.agree(f"{learner.updates}/{learner.version}/{len(learner.consumed)}"):
            raise SystemExit(f"learner: the ranks resumed from different checkpoints; every "
                             f"rank must see {RunDir(run_dir).checkpoint}")
        learner.run(max_updates)
    finally:
        replay.close()
        if learner is not None:
            learner.close()
        ranks.close()
