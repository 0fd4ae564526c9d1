"""The clipped policy-gradient loss with off-policy correction (decoupled PPO, AReaL-style)."""

from __future__ import annotations

import torch

from learner.batching import TrainBatch

# Log-ratios are clamped to ±this before exp: a stale token with a huge ratio would otherwise
# overflow to inf, and inf·0 in the backward pass of an unselected branch is NaN.
_MAX_LOG_RATIO = 20.0

RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | torch.Tensor = 0.28,
    dual_clip: float | None = 3.0,
    iw_cap: float | None = 5.0,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
    aggregation: str = "token-mean",
    reduction: str = "mean",
    guided: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    ratio_level: str = "token",
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled clipped surrogate, token-mean over the trained tokens.

    Three policies: the behaviour policy ``π_b`` that sampled the tokens (possibly several
    versions old), the proximal policy ``π_prox`` (the learner's weights before this update; the
    trust region is centred on it) and the current ``π_θ``. All inputs are ``[B, L]``; only
    ``logprobs`` (log π_θ) receives gradient, everything else is detached. Per token::

        r      = exp(log π_θ - log π_prox)                         ratio to the proximal policy
        s      = -min(r·A, clip(r, 1 - clip_low, 1 + clip_high)·A)   asymmetric PPO clip
        s      = min(s, dual_clip·|A|)          if A < 0             dual clip: cap the loss
        w      = exp(log π_prox - log π_b)      (detached)           off-policy correction
        keep   = mask ∧ (w ≤ iw_cap)                                 drop too-stale tokens
        kl     = exp(q) - q - 1,  q = log π_ref - log π_θ            k3 estimator of KL(π_θ‖π_ref)
        ℓ      = w·s + kl_coef·kl - entropy_coef·H                  H: entropy of π_θ at the token

        loss   = Σ keep·ℓ / Σ keep          (or / num_tokens when given)        token-mean
        loss   = mean_i [Σ_t keep·ℓ / Σ_t keep]  over rows i with kept tokens   seq-mean-token-mean

    ``clip_high`` may be a per-token tensor (``[B, L]`` or broadcastable to it; detached), e.g.
    a wider bound on the tokens of experience-guided rows (:func:`navigation_terms`);
    ``clip_low`` is always one number. The upper clip binds only where ``A > 0``: for ``A < 0``
    and ``r > 1 + clip_high`` the unclipped ``r·A`` is the smaller term, so the min picks it (the
    dual clip caps it instead). Widening it therefore lets positive-advantage tokens move further
    and changes nothing for the others.

    ``aggregation="seq-mean-token-mean"`` weights every trajectory equally whatever its length
    (the original GRPO form). A trajectory whose context was rebuilt is several rows
    (``learner.batching.split_contexts``); ``row_weight`` (``[B]``, 1 by default) is each row's
    share of its trajectory's generated tokens, so its rows weigh one trajectory together.
    Under token-mean, long failed episodes outweigh short successes,
    which pushes the sampled tokens down on net and raises entropy; on small policies that
    drift can compound into a collapse, which the per-sequence mean avoids.

    ``ratio_level="sequence"`` (GSPO, Zheng et al. 2025) takes one ratio and one importance
    weight per row, the geometric means of its tokens' over ``mask``::

        log s_i = mean_t (log π_θ - log π_prox)     log w_i = mean_t (log π_prox - log π_b)

    and uses them, detached, in place of every token's, with the token's own gradient: ``r_t =
    sg[s_i]·π_θ(t)/sg[π_θ(t)]`` (GSPO-token), whose value is ``s_i`` and whose gradient is
    ``s_i·∇log π_θ(t)``. With one advantage along the row this is GSPO's sequence objective
    exactly; with step advantages (composite) each token keeps its own. The clip then decides
    per sequence, and ``iw_cap`` drops whole rows. A row is a trajectory's generated tokens in
    one context (a trajectory whose context was rebuilt is one sequence per context): rows are
    never split across micro-batches or ranks, so every layout computes the same ``s_i``.

    ``kl_estimator`` names the penalty's estimator of KL(π_θ‖π_ref) on the sampled tokens
    (:func:`kl_estimate`: k1, k2 or k3); the ``kl_ref`` metric is k3 whatever it is, and a
    penalty with another logs its own mean as ``kl_penalty``. ``entropy`` (``[B, L]``, with
    gradient) is π_θ's entropy at each token; with ``entropy_coef`` > 0 the loss subtracts
    ``entropy_coef`` times its aggregate over the kept tokens, raising the entropy.

    The KL and entropy terms are not importance-weighted: they are regularisers, not
    estimates of the return.
    ``proximal_logprobs=None`` means ``π_prox = π_b`` (plain PPO, ``w = 1``). ``dual_clip`` /
    ``iw_cap`` set to ``None`` disable those parts. ``num_tokens`` overrides the denominator so
    that micro-batches of one batch add up to the token-mean of the whole batch.

    ``reduction="sum"`` returns the numerator of either mean (``Σ keep·ℓ``, or the sum of the
    rows' token-means) and adds ``denominator`` to the metrics (kept tokens, or rows with a
    kept token): what micro-batches and ranks sum before dividing once, when the whole batch's
    count is known (learner/step.py, ``PolicyStep._step``). ``loss`` and ``pg_loss`` in the
    metrics are sums too then.

    Metrics (floats): ``loss``; ``pg_loss`` (the surrogate part); ``clip_fraction`` (kept tokens
    where the clipped term is the binding one); ``dual_clip_fraction`` (kept tokens capped by the
    dual clip); ``iw_mean``, ``iw_max``, ``iw_masked_fraction`` (over ``mask``, before the cap);
    ``kl_behaviour`` (k3 estimate of KL(π_b‖π_θ), mean over ``mask``: ``ρ - 1 - log ρ`` with
    ``ρ = π_θ/π_b``, unbiased under samples from π_b and ≥ 0); ``kl_ref`` (when
    ``ref_logprobs`` is given); ``tokens`` (kept tokens). With ``guided`` (``[B]``, 1 on rows
    whose prompt had experience injected) also ``clip_fraction`` and ``iw_masked_fraction`` of
    those rows' tokens and of the others', as ``*_guided`` / ``*_unguided``, each only when the
    micro-batch has such rows: does the correction treat the two kinds alike?
    """
    behaviour = behaviour_logprobs.detach().float()
    proximal = behaviour if proximal_logprobs is None else proximal_logprobs.detach().float()
    adv = advantages.detach().float()
    logp = logprobs.float()
    valid = mask.detach() > 0

    log_iw, log_ratio = _log_ratios(logp, proximal, behaviour, valid, ratio_level)
    iw = _exp_log_ratio(log_iw)
    keep = valid & (iw <= iw_cap) if iw_cap is not None else valid

    ratio = _exp_log_ratio(log_ratio)
    unclipped = -ratio * adv
    clipped = -_clip_ratio(ratio, clip_low, clip_high) * adv
    surrogate = torch.maximum(unclipped, clipped)  # -min(rA, clip(r)A)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual = (adv < 0) & (surrogate > cap)
        surrogate = torch.where(dual, cap, surrogate)
    else:
        dual = torch.zeros_like(valid)

    pg_token = iw * surrogate
    token_loss, kl_ref, penalty = _regularised(pg_token, logp, ref_logprobs, kl_coef,
                                               kl_estimator, entropy, entropy_coef)

    # where, not multiply: a dropped token's loss may be huge and must not leak in as inf·0.
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be mean or sum, not {reduction!r}")
    zero = torch.zeros_like(token_loss)
    if aggregation == "seq-mean-token-mean":
        per_row = keep.sum(dim=-1, keepdim=True).float()
        share = torch.ones_like(per_row) if row_weight is None else \
            row_weight.reshape(-1, 1).to(per_row)
        count = torch.where(per_row > 0, share, 0.0).sum()
        weight = torch.where(per_row > 0, share / per_row.clamp(min=1), 0.0)
        if reduction == "mean":
            weight = weight / count.clamp(min=1)
        loss = torch.where(keep, token_loss * weight, zero).sum()
        pg = torch.where(keep, pg_token * weight, zero).sum()
    elif aggregation == "token-mean":
        count = keep.sum()
        denom = count.clamp(min=1).float() if num_tokens is None else float(max(num_tokens, 1))
        if reduction == "sum":
            denom = 1.0
        loss = torch.where(keep, token_loss, zero).sum() / denom
        pg = torch.where(keep, pg_token, zero).sum() / denom
    else:
        raise ValueError(f"aggregation must be token-mean or seq-mean-token-mean, "
                         f"not {aggregation!r}")

    metrics = _metrics(
        loss=loss, pg=pg, keep=keep, valid=valid,
        clipped=clipped > unclipped, dual=dual, iw=iw, kl_behaviour=k3(logp - behaviour),
        kl_ref=kl_ref, denominator=count if reduction == "sum" else None,
    )
    if penalty is not None:
        metrics["kl_penalty"] = _kept_mean(penalty, keep)
    if guided is not None:
        metrics.update(_by_row_kind(guided, valid, keep, clipped > unclipped))
    return loss, metrics


def navigation_terms(
    batch: TrainBatch, proximal: torch.Tensor, clip_high: float, experience_clip_high: float,
    iw_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """What self-navigating changes in :func:`policy_loss`: its behaviour log-probs and clip.

    Returns ``(behaviour_logprobs, clip_high, metrics)`` to pass on to ``policy_loss``:

    * behaviour log-probs — ``batch.behaviour_logprobs``, except on rows whose experience was
      stripped (``batch.stripped``), where they are ``proximal``'s (detached), i.e. ``w = 1``.
      The behaviour policy sampled those tokens with the experience in its context and the
      learner scores them without it, so ``exp(log π_prox - log π_b)`` would measure how much
      the advice changed the token's probability, not how stale the policy is; it would mostly
      down-weight (or, over ``iw_cap``, drop) exactly the tokens the advice made likely;
    * ``[B, L]`` upper clip — ``experience_clip_high`` on the generated tokens of guided rows
      (``batch.guided``), ``clip_high`` everywhere else (selective boosting; it binds only where
      the advantage is positive, see :func:`policy_loss`);
    * metrics — ``boosted_token_fraction`` (generated tokens of guided rows / all generated
      tokens), ``guided_fraction`` and ``stripped_fraction`` (of the rows); and, when some row
      was stripped, what the plain correction would have done to its tokens (the weight
      ``w = π_prox(a | stripped) / π_b(a | with experience)`` that is *not* applied):
      ``stripped_log_w_mean`` (mean ``log w``: how much less likely the advice-free context
      makes the sampled tokens), ``stripped_w_over_cap_fraction`` (tokens ``iw_cap`` would
      drop) and ``stripped_w_under_fraction`` (tokens it would weigh below ``1/iw_cap``, i.e.
      nearly ignore).
    """
    act = batch.action_mask > 0
    stripped = (batch.stripped > 0)[:, None] & act
    boosted = (batch.guided > 0)[:, None] & act
    # The importance weight would compare contexts, not policies on stripped rows: drop it there.
    behaviour = torch.where(stripped, proximal.detach().to(batch.behaviour_logprobs.dtype),
                            batch.behaviour_logprobs)
    clip = torch.full(act.shape, float(clip_high), device=act.device)
    clip = clip.masked_fill(boosted, float(experience_clip_high))
    values = torch.stack([
        boosted.sum() / act.sum().clamp(min=1),
        batch.guided.float().mean(),
        batch.stripped.float().mean(),
        stripped.sum().float(),
        *_context_weight(proximal, batch.behaviour_logprobs, stripped, iw_cap),
    ]).tolist()  # one device→host transfer
    metrics = dict(zip(("boosted_token_fraction", "guided_fraction", "stripped_fraction"), values))
    if values[3]:  # some token was stripped: what its weight would have been
        metrics.update(zip(("stripped_log_w_mean", "stripped_w_over_cap_fraction",
                            "stripped_w_under_fraction"), values[4:]))
    return behaviour, clip, metrics


@torch.no_grad()
def _context_weight(proximal: torch.Tensor, behaviour: torch.Tensor, stripped: torch.Tensor,
                    iw_cap: float | None) -> list[torch.Tensor]:
    """The importance weight stripped rows would get, were the behaviour log-probs (taken
    with the experience in context) used as they are, over the stripped rows' generated
    tokens: mean ``log w``, and the fractions over ``iw_cap`` and under ``1/iw_cap``."""
    log_w = (proximal.detach().float() - behaviour.float()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    cap = float("inf") if iw_cap is None else float(iw_cap)
    n = stripped.sum().clamp(min=1)
    return [(log_w * stripped).sum() / n,
            ((log_w.exp() > cap) & stripped).sum() / n,
            ((log_w.exp() < 1.0 / cap) & stripped).sum() / n]


@torch.no_grad()
def _by_row_kind(guided: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
                 clipped: torch.Tensor) -> dict[str, float]:
    """``clip_fraction`` and ``iw_masked_fraction`` on guided and on unguided rows, for the
    kinds present (a fraction of no tokens is left out rather than written as 0)."""
    rows = (guided > 0)[:, None].expand_as(valid)
    counts = []
    for where in (rows, ~rows):
        mask, kept = valid & where, keep & where
        counts += [(clipped & kept).sum(), kept.sum(), (mask & ~keep).sum(), mask.sum()]
    values = torch.stack(counts).tolist()  # one device→host transfer for both kinds
    out = {}
    for kind, (clip_n, kept_n, dropped_n, mask_n) in zip(("guided", "unguided"),
                                                          (values[:4], values[4:])):
        if mask_n:
            out[f"clip_fraction_{kind}"] = clip_n / max(kept_n, 1)
            out[f"iw_masked_fraction_{kind}"] = dropped_n / mask_n
    return out


def _clip_ratio(ratio: torch.Tensor, clip_low: float, clip_high: float | torch.Tensor
                ) -> torch.Tensor:
    """``clip(ratio, 1 - clip_low, 1 + clip_high)`` for a number or a per-token ``clip_high``."""
    if not isinstance(clip_high, torch.Tensor):
        return ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # torch.clamp takes both bounds as numbers or both as tensors, never one of each.
    upper = 1.0 + clip_high.detach().to(device=ratio.device, dtype=ratio.dtype)
    return torch.minimum(ratio.clamp(min=1.0 - float(clip_low)), upper)


def _log_ratios(logp: torch.Tensor, proximal: torch.Tensor, behaviour: torch.Tensor,
                valid: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log w, log r)``: the log importance weight ``log π_prox - log π_b`` (detached) and
    the log ratio ``log π_θ - log π_prox``, per token, or with ``level="sequence"`` each
    row's mean over ``valid`` in every token's place, the ratio keeping each token's own
    gradient (:func:`policy_loss`)."""
    log_iw, log_ratio = proximal - behaviour, logp - proximal
    if level == "token":
        return log_iw, log_ratio
    if level != "sequence":
        raise ValueError(f"ratio_level must be token or sequence, not {level!r}")
    # GSPO-token: the value is the row's mean, the gradient the token's own log-prob's.
    own = logp - logp.detach()
    return _row_mean(log_iw, valid), _row_mean(log_ratio.detach(), valid) + own


def _row_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's mean of ``x`` over ``valid``, broadcast back to ``[B, L]`` (0 on a row
    without a valid token). ``where``, not multiply: a padding value may be anything."""
    total = torch.where(valid, x, torch.zeros_like(x)).sum(dim=-1, keepdim=True)
    return (total / valid.sum(dim=-1, keepdim=True).clamp(min=1)).expand_as(x)


def _regularised(pg_token: torch.Tensor, logp: torch.Tensor, ref_logprobs, kl_coef: float,
                 kl_estimator: str, entropy, entropy_coef: float):
    """``(ℓ, kl_ref, penalty)``: the per-token loss ``pg + kl_coef·kl - entropy_coef·H``,
    k3's KL to the reference (None without one) and, under another estimator, the penalty's
    own estimate (else None)."""
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, not {kl_estimator!r}")
    token_loss, kl_ref, penalty = pg_token, None, None
    if ref_logprobs is not None:
        q = ref_logprobs.detach().float() - logp
        kl_ref = k3(q)
        penalty = None if kl_estimator == "k3" else kl_estimate(q, kl_estimator)
        token_loss = token_loss + kl_coef * (kl_ref if penalty is None else penalty)
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef needs the entropy of each token (with gradient)")
        token_loss = token_loss - entropy_coef * entropy.float()
    return token_loss, kl_ref, penalty


@torch.no_grad()
def _kept_mean(x: torch.Tensor, keep: torch.Tensor) -> float:
    return float(torch.where(keep, x, torch.zeros_like(x)).sum() / keep.sum().clamp(min=1))


def _exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator ``e^q - q - 1`` of KL(p‖s) for ``q = log s - log p``, x ~ p."""
    q = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(q) - q - 1.0


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators of KL(p‖s) per sample x ~ p, for ``q = log s - log p``:

    * ``k1 = -q``: unbiased, but negative on about half the samples (high variance);
    * ``k2 = q²/2``: biased (low when p and s are close), never negative;
    * ``k3 = e^q - q - 1``: unbiased and never negative.

    As a loss term (p = π_θ, s = π_ref, samples from π_θ) their gradients differ more than
    their values: ``∇k1 = ∇log π_θ``, zero in expectation (no pull towards π_ref at all);
    ``∇k2 = (log π_θ - log π_ref)·∇log π_θ``, in expectation the gradient of KL(π_θ‖π_ref);
    ``∇k3 = (1 - π_ref/π_θ)·∇log π_θ``, in expectation that of KL(π_ref‖π_θ)."""
    q = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -q
    if estimator == "k2":
        return 0.5 * q * q
    if estimator == "k3":
        return k3(q)
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, not {estimator!r}")


@torch.no_grad()
def _metrics(*, loss, pg, keep, valid, clipped, dual, iw, kl_behaviour, kl_ref,
             denominator=None) -> dict[str, float]:
    def mean_over(x, where):
        return (x.float() * where).sum() / where.sum().clamp(min=1)

    zero = torch.zeros_like(iw)
    named = {
        "loss": loss.detach(),
        "pg_loss": pg.detach(),
        "clip_fraction": mean_over(clipped & keep, keep),
        "dual_clip_fraction": mean_over(dual & keep, keep),
        "iw_mean": mean_over(torch.where(valid, iw, zero), valid),
        "iw_max": torch.where(valid, iw, zero).max() if valid.any() else iw.new_zeros(()),
        "iw_masked_fraction": mean_over(valid & ~keep, valid),
        "kl_behaviour": mean_over(torch.where(valid, kl_behaviour.detach(), zero), valid),
        "tokens": keep.sum(),
    }
    if kl_ref is not None:
        named["kl_ref"] = mean_over(torch.where(keep, kl_ref.detach(), zero), keep)
    if denominator is not None:
        named["denominator"] = denominator
    # One device→host transfer for all of them instead of one sync per metric.
    values = torch.stack([v.float() for v in named.values()]).tolist()
    return dict(zip(named, values))
