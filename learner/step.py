"""The learner's step: what one update does to the policy, apart from the loop around it.

:class:`PolicyStep` owns the model (loaded once), its LoRA adapter, the optimizer and
scheduler, autocast and the loss; :class:`learner.learner.Learner` is given one and does the
rest (drawing, the ledger, publishing, checkpoints, metrics)::

    metrics, stats = step.update(groups, labels, alpha, probe)   # one optimizer update
                                  # stats["token_logprobs"]: what it scored (token log)
    step.trained_state()          # what is published: the whole model, or the adapter alone
    step.state() / step.load_state(state, path)   # its part of a checkpoint
    step.lr, step.adapter

One update::

    batch = build_batch(groups, labels, α)      # masks, step advantages (or plain GRPO)
    strip injected experience (experience.train_context=discard)
    proximal = logprobs under current params    # decoupled PPO
    per minibatch, per micro-batch:             # learner.accumulation of them
        logprobs in learner.layout              # padded rows, or packed (shared prefixes once)
        backward(policy_loss summed)            # boosted clip on experience-guided rows
    then gradient /= tokens (or rows) of all ranks, optimizer step

The loss's controls (``learner.ratio_level``, ``kl_estimator``, ``entropy_coef``) are passed
to :func:`learner.losses.policy_loss`, ``advantage_std`` to ``build_batch``, and the learning
rate follows ``lr_schedule`` (:func:`lr_factor`) through a scheduler whose count every
checkpoint keeps.

Besides the loss's own metrics, every update logs ``entropy`` (of π_θ at the trained tokens,
read off the logits the loss already made), and every ``learner.diagnostics_every`` updates
``kl_initial`` (KL to the initial policy, when no ``kl_coef`` penalty logs it as ``kl_ref``):
what ``autodidact report`` reads to say why RL moved or stalled (autodidact/diagnosis.py).

With several ranks each holds a :class:`PolicyStep` of its own on its share of the batch; DDP
(or FSDP) averages their gradients (learner/distributed.py). A stand-in step (the scaling
bench's fixed-cost one, bench/scale_actors.py) needs only the methods of :class:`Step`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoModelForCausalLM

from inference import lora
from learner.batching import build_batch, to_trajectories, token_budget_parts
from learner.checkpoint import CheckpointError
from learner.distributed import SINGLE, Ranks
from learner.logprobs import prepare_for_training, token_logprobs
from learner.losses import k3, navigation_terms, policy_loss
from learner.packing import check_packing, enable_packing, layout_logprobs, packed_budget_parts
from protocol.role_config import LearnerSettings
from protocol.weights import AdapterMeta


class Step(Protocol):
    """What the learner loop asks of its step."""

    adapter: AdapterMeta | None
    """The LoRA adapter published weights belong to; None when they are the whole model."""

    @property
    def lr(self) -> float:
        """The learning rate now (after the last update)."""

    def update(self, groups, labels, alpha: float, probe: bool) -> tuple[dict, dict]:
        """One update on this process's ``groups``: (metrics, batch stats). The metrics are
        the whole batch's (summed over ranks) and include ``grad_norm``; the stats are this
        process's (``degenerate_groups``, ``tokens``, ``unlabelled_groups`` with labels), and
        may hold ``token_logprobs``: per group, per trajectory, the log-prob the step scored
        each token at under the policy it started from, NaN where it scored none
        (``learner.token_log_groups``; :class:`learner.token_log.TokenLog` writes them)."""

    def trained_state(self) -> dict | None:
        """What is published, on rank 0 (None elsewhere); every rank calls it."""

    def state(self) -> dict | None:
        """The step's part of a checkpoint, on rank 0 (None elsewhere); every rank calls it."""

    def load_state(self, state: dict, path: Path) -> None:
        """Restore :meth:`state` from the checkpoint at ``path`` (CheckpointError if it was
        trained otherwise)."""


class PolicyStep:
    """The clipped off-policy policy-gradient step on the model ``settings.model_path``."""

    def __init__(self, settings: LearnerSettings, ranks: Ranks = SINGLE):
        self.settings = settings
        self.cfg = cfg = settings.learner
        self.ranks = ranks
        ranks.share(cfg.batch_groups)  # refuses a batch the ranks cannot split, before loading
        self.device = ranks.device(cfg.device)
        self.autocast = autocast_dtype(cfg.autocast, self.device, settings.actors_low_precision)
        torch.manual_seed(settings.seed)
        # The one load of the model from disk: the KL reference is a copy of it, and the pad
        # id is in its config.
        model = AutoModelForCausalLM.from_pretrained(settings.model_path).to(self.device)
        self.pad_id = pad_token_id(model)
        self.layout = cfg.layout
        if self.layout != "padded":  # before the reference copy: it runs packed rows too
            enable_packing(model)
        # With LoRA only the adapter trains and travels; the frozen base is also the KL
        # reference (adapters off), so no second copy of the model is kept. Without it, the
        # reference is a frozen copy of the initial policy, taken before anything is attached
        # or switched on for training, and only when a KL penalty to it, or the KL diagnostic
        # (learner.diagnostics_every), is asked for.
        self.adapter = adapter_for(settings)
        reference = None
        if self.adapter is None and (cfg.kl_coef > 0 or cfg.diagnostics_every):
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        if self.adapter is not None:
            lora.attach(model, self.adapter, dropout=cfg.lora_dropout, init_seed=settings.seed)
        prepare_for_training(model, cfg.logit_chunk_tokens, cfg.gradient_checkpointing)
        if self.layout != "padded":
            check_packing(model)
        self.model = ranks.wrap(model.train(), cfg.parallel)
        # After wrapping: under FSDP the optimizer must hold the sharded parameters.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr,
                                           betas=(0.9, 0.99), weight_decay=0.0)
        # A function, not a callable object: LambdaLR's state then holds only its count, and
        # the schedule is always the one this run's config names.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(
            cfg.lr_schedule, cfg.warmup_updates, settings.max_updates, cfg.lr_min_ratio))
        self.reference = None if reference is None else ranks.wrap_frozen(reference,
                                                                          cfg.parallel)
        # The token log (learner/token_log.py) is rank 0's: it keeps what this rank scored.
        self.keeps_token_logprobs = cfg.token_log_groups > 0 and ranks.is_main

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # --- what the loop calls ----------------------------------------------------------------

    def update(self, groups, labels, alpha: float, probe: bool) -> tuple[dict, dict]:
        """One update: one optimizer step per minibatch; with ``probe`` the last one's
        micro-batch is scored again after it (``step_gain``, ``step_kl``)."""
        batch, stats = build_batch(groups, self.pad_id, labels=labels, alpha=alpha,
                                   experience=self.settings.experience_context,
                                   advantage_std=self.cfg.advantage_std)
        rows_from = batch  # on the CPU: where each row came from, for the token log
        batch = batch.to(self.device)
        proximal, reference = self._fixed_logprobs(batch, self._diagnosing())
        scored = None
        if self.keeps_token_logprobs:  # the proximal log-probs, as the steps come to them
            scored = proximal if proximal is not None else \
                torch.full_like(batch.behaviour_logprobs, float("nan"))
        for rows in self._split(torch.arange(len(batch.input_ids)), self.cfg.minibatches):
            m, last = self._step(batch, rows, proximal, reference, scored)
        self.scheduler.step()
        if probe:
            m.update(self._probe(*last))
        if scored is not None:
            scored = torch.where(batch.action_mask.bool(), scored, float("nan"))
            stats["token_logprobs"] = to_trajectories(rows_from, scored.cpu().numpy(), groups)
        return m, stats

    def trained_state(self) -> dict | None:
        """What this learner trains, on rank 0 (None elsewhere): the whole model's state, or
        with LoRA only the adapter's. Under FSDP every rank must call it (shards gather)."""
        return self.ranks.model_state(self.model, trainable_only=self.adapter is not None)

    def state(self) -> dict | None:
        """Model (or adapter), optimizer and scheduler, with the adapter's description, on
        rank 0 (None elsewhere). Every rank calls it (FSDP gathers the shards)."""
        model = self.trained_state()
        optimizer = self.ranks.optimizer_state(self.model, self.optimizer)
        if not self.ranks.is_main:
            return None
        adapter = {"adapter": self.adapter.to_metadata()} if self.adapter is not None else {}
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                **adapter}

    def load_state(self, state: dict, path: Path) -> None:
        check_checkpoint_adapter(state, self.adapter, path)
        self.ranks.load_model_state(self.model, state["model"], partial=self.adapter is not None)
        self.ranks.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    # --- one update ---------------------------------------------------------------------------

    def _diagnosing(self) -> bool:
        """Whether this update measures the KL to the initial policy: every
        ``diagnostics_every`` updates from the first (the scheduler counts them, and a
        checkpoint keeps its count), unless the KL penalty measures it every update."""
        every = self.cfg.diagnostics_every
        return bool(every) and self.cfg.kl_coef == 0 and self.scheduler.last_epoch % every == 0

    def _split(self, rows: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """``rows`` in ``parts`` slices; with several ranks always exactly ``parts`` (some may
        be empty), since every rank must take as many steps and backward passes as the rest."""
        out = list(rows.chunk(parts))
        if self.ranks.active:
            out += [rows[:0]] * (parts - len(out))
        return out

    def _step(self, batch, rows, proximal, reference, scored=None):
        """One optimizer step on the minibatch ``rows``: (metrics with the grad norm, what the
        probe needs). With ``scored`` (``[B, L]``), each micro-batch's proximal log-probs
        are copied into its rows there.

        Each micro-batch backpropagates its loss *summed* over tokens (token-mean) or rows
        (seq-mean-token-mean), and the gradient is divided once by the number of those in all
        micro-batches of all ranks, known only after the last one. So the step is the one a
        single process would take on the whole minibatch, however its rows fell to ranks and
        micro-batches (a mean per part would weigh a short part's rows more). DDP averages
        over ranks, hence the factor ``world`` back. The entropy and ``kl_initial`` are summed
        over the trained tokens the same way, then divided by their count.

        ``reference``: the reference's log-probs of the batch, for the KL penalty
        (``kl_coef`` > 0) or, without one, for ``kl_initial`` alone.
        """
        self.optimizer.zero_grad(set_to_none=True)
        lengths = batch.lengths().cpu()  # sizes only: one read-back, not one per row
        parts = self._micro_batches(rows, lengths, batch)
        totals = dict.fromkeys(("loss", "pg_loss", "denominator", "tokens"), 0.0)
        watched = dict.fromkeys(("trained", "entropy") + (
            ("kl_initial",) if reference is not None and not self.cfg.kl_coef else ()), 0.0)
        seen = []
        for i, part in enumerate(parts):
            with self.ranks.sync_grads(self.model, sync=i == len(parts) - 1):
                mb, index = self._micro(batch, part, lengths)
                width = mb.input_ids.shape[1]  # trimmed to its longest row
                with self._autocast():  # the entropy with gradient only for its loss term
                    logprobs, entropy = self._logprobs(self.model, mb, entropy=True,
                                                       entropy_grad=self.cfg.entropy_coef > 0)
                # One step per batch: the proximal policy is this very forward pass, detached.
                prox = logprobs.detach() if proximal is None else proximal[index][:, :width]
                if scored is not None and proximal is None and len(part):
                    scored[index.to(scored.device), :width] = prox
                ref = None if reference is None else reference[index][:, :width]
                penalty_ref = ref if self.cfg.kl_coef > 0 else None  # else kl_initial's alone
                loss, m = self._loss(mb, logprobs, prox, penalty_ref, reduction="sum",
                                     entropy=entropy)
                loss.backward()
            totals = {k: totals[k] + m[k] for k in totals}
            sums = _watched_sums(mb.action_mask, entropy, logprobs,
                                 ref if "kl_initial" in watched else None)
            watched = {k: watched[k] + sums[k] for k in watched}
            if len(part) or not seen:  # a blank micro-batch says nothing about the policy
                seen.append(m)
        # The probe re-scores the last micro-batch: its own loss, as a mean, to compare with.
        probe = (mb, m["loss"] / max(m["denominator"], 1.0), prox, penalty_ref)
        totals = self.ranks.sum({**totals, **{f"watched_{k}": v for k, v in watched.items()}})
        denominator = max(totals["denominator"], 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(self.ranks.world / denominator)
        grad_norm = self.ranks.clip_grad_norm(self.model, self.cfg.grad_clip)
        self.optimizer.step()
        m = _merge_metrics(seen)
        del m["denominator"]
        m.update(loss=totals["loss"] / denominator, pg_loss=totals["pg_loss"] / denominator,
                 tokens=totals["tokens"], grad_norm=grad_norm)
        trained = max(totals.pop("watched_trained"), 1.0)
        m.update({k[len("watched_"):]: v / trained for k, v in totals.items()
                  if k.startswith("watched_")})
        return m, probe

    def _micro_batches(self, rows: torch.Tensor, lengths: torch.Tensor,
                       batch) -> list[torch.Tensor]:
        """The minibatch ``rows`` as micro-batches: ``accumulation`` equal slices, or with
        ``micro_batch_tokens`` as many as that token budget needs (every rank takes as many
        as the rank that needs most): padded tokens, or in a packed layout the tokens the
        packed sequence holds."""
        budget = self.cfg.micro_batch_tokens
        if not budget:
            return self._split(rows, self.cfg.accumulation)
        if self.layout == "padded":
            parts = token_budget_parts(rows, lengths, budget)
        else:
            parts = packed_budget_parts(rows, lengths, batch.input_ids, budget,
                                        share=self.layout == "shared_prefix")
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

    def _logprobs(self, model, batch, entropy: bool = False, entropy_grad: bool = False):
        """The log-probs of ``batch``'s rows under ``model``, ``[B, L]``, in the learner's
        layout (learner/packing.py); only the generated tokens are scored with the chunked
        head. With ``entropy``, (log-probs, entropies) from the same logits
        (:func:`learner.logprobs.token_logprobs`), with gradient under ``entropy_grad``."""
        if self.layout == "padded":
            return token_logprobs(model, batch.input_ids, batch.attention_mask,
                                  self.cfg.logit_chunk_tokens, batch.action_mask, entropy,
                                  entropy_grad)
        return layout_logprobs(model, batch.input_ids, batch.attention_mask,
                               self.cfg.logit_chunk_tokens, batch.action_mask, self.layout,
                               entropy, entropy_grad)

    @torch.no_grad()
    def _fixed_logprobs(self, batch, diagnose: bool = False):
        """Proximal log-probs (only needed ahead with several minibatches) and the
        reference's: for the KL penalty, or with ``diagnose`` for ``kl_initial``."""
        proximal = reference = None
        if self.cfg.minibatches > 1:
            proximal = self._scored_in_parts(batch, self.model)
        if self.cfg.kl_coef > 0 or diagnose:
            if self.reference is not None:
                reference = self._scored_in_parts(batch, self.reference)
            else:  # LoRA: the initial policy is the base with its adapter off
                with lora.disabled(self.model):
                    reference = self._scored_in_parts(batch, self.model)
        return proximal, reference

    def _scored_in_parts(self, batch, model) -> torch.Tensor:
        """``batch``'s log-probs under ``model``, ``[B, L]``, scored in the micro-batches a
        step takes (``micro_batch_tokens`` or ``accumulation``): a forward without gradient
        over the whole batch would hold every row's activations at once, past the budget
        the step keeps to. Every rank runs as many forwards as the rank that needs most."""
        rows = torch.arange(len(batch.input_ids))
        lengths = batch.lengths().cpu()
        out = None
        for part in self._micro_batches(rows, lengths, batch):
            mb, index = self._micro(batch, part, lengths)
            with self._autocast():
                logprobs = self._logprobs(model, mb)
            if out is None:
                out = logprobs.new_zeros(batch.input_ids.shape[:2])
            if len(part):  # a blank micro-batch only keeps the ranks in step
                out[index.to(out.device), :logprobs.shape[1]] = logprobs
        return out

    def _loss(self, batch, logprobs, proximal, reference, reduction: str = "mean",
              entropy=None):
        cfg = self.cfg
        clip_low, clip_high, guided_high = self._clip_range()
        behaviour, clip_high, nav = navigation_terms(batch, proximal, clip_high, guided_high,
                                                     cfg.iw_cap)
        loss, m = policy_loss(
            logprobs, proximal, behaviour, batch.advantages, batch.action_mask,
            clip_low=clip_low, clip_high=clip_high,
            dual_clip=cfg.dual_clip, iw_cap=cfg.iw_cap,
            aggregation=cfg.loss_aggregation, kl_coef=cfg.kl_coef,
            ref_logprobs=reference, reduction=reduction, guided=batch.guided,
            row_weight=batch.row_weight, ratio_level=cfg.ratio_level,
            kl_estimator=cfg.kl_estimator, entropy=entropy, entropy_coef=cfg.entropy_coef)
        return loss, {**m, **nav}

    def _clip_range(self) -> tuple[float, float, float]:
        """``(low, high, high on experience-guided rows)`` at the loss's ratio level: at
        sequence level GSPO's own range, the guided rows' widened in proportion as
        ``experience.clip_high`` widens ``clip_high`` at token level."""
        cfg, guided = self.cfg, self.settings.guided_clip_high
        if cfg.ratio_level == "token":
            return cfg.clip_low, cfg.clip_high, guided
        widening = guided / cfg.clip_high if cfg.clip_high > 0 else 1.0  # 0: no range to scale
        return cfg.seq_clip_low, cfg.seq_clip_high, cfg.seq_clip_high * widening

    @torch.no_grad()
    def _probe(self, batch, loss_before: float, proximal, reference) -> dict[str, float]:
        """Did the (last) step do what it was for? Re-score its (last) micro-batch with the
        new weights; with several ranks, rank 0's.

        A training-reward curve answers this too, but over a few dozen small batches it is
        mostly sampling noise; the loss on the batch the step was taken on is not.
        """
        entropy = None
        with self._autocast():  # the entropy only where the loss has a term for it
            if self.cfg.entropy_coef > 0:
                after, entropy = self._logprobs(self.model, batch, entropy=True)
            else:
                after = self._logprobs(self.model, batch)
        loss_after, _ = self._loss(batch, after, proximal, reference, entropy=entropy)
        mask = batch.action_mask.float()
        log_ratio = proximal - after  # KL(before || after), k1 estimate on the sampled tokens
        return {"step_gain": loss_before - float(loss_after),
                "step_kl": float((log_ratio * mask).sum() / mask.sum().clamp(min=1))}


def lr_factor(schedule: str, warmup_updates: int, max_updates: int, floor: float):
    """The learning rate's multiplier as a function of the updates taken before this one
    (``k``, what LambdaLR passes): a linear warm-up to 1 at update ``warmup - 1`` (over
    ``warmup_updates``, at least 1), then 1 (``constant``), or a ``cosine`` or ``linear``
    decay reaching ``floor`` at update ``max_updates - 1``, the last, and staying there
    (a run resumed with a larger budget)."""
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"lr schedule must be constant, cosine or linear, not {schedule!r}")
    warmup = max(warmup_updates, 1)
    span = max(max_updates - warmup, 1)

    def factor(step: int) -> float:
        if schedule == "constant" or step < warmup:
            return min(1.0, (step + 1) / warmup)
        done = min((step + 1 - warmup) / span, 1.0)
        left = 0.5 * (1.0 + math.cos(math.pi * done)) if schedule == "cosine" else 1.0 - done
        return floor + (1.0 - floor) * left

    return factor


def pad_token_id(model) -> int:
    """The id that pads batch rows: the model config's ``pad_token_id`` (the tiny model and
    the converted SmolLM2 folder carry their tokenizer's there), else the generation
    config's, else 0. Rows are right-padded and the loss reads no padding position, so
    the id only has to be a valid one; it is taken from the loaded model so the tokenizer
    is not loaded as well."""
    for config in (model.config, getattr(model, "generation_config", None)):
        token = getattr(config, "pad_token_id", None)
        if isinstance(token, int) and 0 <= token < model.config.vocab_size:
            return token
    return 0


def adapter_for(settings: LearnerSettings) -> AdapterMeta | None:
    """The LoRA adapter ``learner.lora_*`` asks for, tied to the base it trains on; None for
    full fine-tuning."""
    cfg = settings.learner
    if not cfg.lora_rank:
        return None
    return AdapterMeta(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                       targets=",".join(cfg.lora_targets), base_id=settings.model_path,
                       base_sha256=lora.base_digest(settings.model_path))


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


@torch.no_grad()
def _watched_sums(mask: torch.Tensor, entropy: torch.Tensor, logprobs: torch.Tensor,
                  reference: torch.Tensor | None) -> dict[str, float]:
    """A micro-batch's sums over its trained tokens (``mask``): how many (``trained``), their
    entropy, and with ``reference`` their k3 estimate of KL(π_θ ‖ π_ref), as the KL penalty
    computes it (learner/losses.py). One device→host transfer."""
    mask = mask.float()
    named = {"trained": mask.sum(), "entropy": (entropy * mask).sum()}
    if reference is not None:
        named["kl_initial"] = (k3(reference.float() - logprobs.detach().float()) * mask).sum()
    return dict(zip(named, torch.stack(list(named.values())).tolist()))


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
