"""Advantage estimators: plain GRPO and the attribution composite (process + outcome).

Both are pure numpy functions over one GRPO group (the ``n`` rollouts of one task); turning
them into per-token tensors is :mod:`learner.batching`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocol.messages import REWARD_ATOL, rewards_equal

ADVANTAGE_STD = ("group", "none")


def grpo_advantages(rewards: Sequence[float] | np.ndarray, eps: float = 1e-6,
                    std: str = "group") -> np.ndarray:
    """Outcome rewards centred, and by default normalised, within their group.

    ``std="group"``: ``A_i = (R_i - mean(R)) / (std(R) + eps)`` with the population std
    (``ddof=0``), GRPO's. ``std="none"``: ``A_i = R_i - mean(R)`` (Dr. GRPO, Liu et al. 2025):
    the push a group gets scales with how far apart its rewards are, where dividing by the
    std gives a group whose rewards barely differ the same push as one whose rewards differ
    by the whole range.
    A group whose rewards are all equal (:func:`protocol.messages.rewards_equal`) gets all
    zeros either way: every rollout did equally
    well, so there is nothing to prefer, and dividing by a ~0 std would only amplify noise.
    Returns float64 of the same length as ``rewards``.
    """
    if std not in ADVANTAGE_STD:
        raise ValueError(f"std must be one of {ADVANTAGE_STD}, not {std!r}")
    r = np.asarray(rewards, dtype=np.float64)
    if rewards_equal(r):
        return np.zeros_like(r)
    if std == "none":
        return r - r.mean()
    return (r - r.mean()) / (r.std() + eps)


def composite_step_advantages(
    step_labels: Sequence[Sequence[int]],
    outcomes: Sequence[float] | np.ndarray,
    alpha: float,
    eps: float = 1e-6,
    std: str = "group",
) -> list[np.ndarray]:
    """Per-step advantages from judge labels plus the outcome (the attribution composite).

    For trajectory ``i`` with steps ``t = 0..T_i-1`` and label ``l_{i,t}`` (1 GOOD, 0 BAD):

    * process reward ``p_{i,t} = 2·l_{i,t} - 1`` (GOOD → +1, BAD → −1);
    * z-scored within the group, every trajectory weighted equally (a long trajectory must not
      dominate the statistics just because it has more steps), over the ``N`` trajectories
      that have at least one step::

          μ  = (1/N) Σ_i mean_t p_{i,t}
          σ² = (1/N) Σ_i mean_t (p_{i,t} - μ)²
          p̃_{i,t} = (p_{i,t} - μ) / (σ + eps)         (all zeros when σ ≈ 0: no signal)

    * outcomes z-scored separately across the group: ``Õ = grpo_advantages(outcomes, eps,
      std)`` (with ``std="none"`` only centred; the process reward stays z-scored, its scale
      being the labels' ±1 whatever the env's rewards);
    * step reward ``r_{i,t} = α·p̃_{i,t} + 1[t = T_i - 1]·Õ_i``;
    * advantage, undiscounted return-to-go (γ = 1): ``A_{i,t} = Σ_{k≥t} r_{i,k}``.

    Returns one float64 array of length ``T_i`` per trajectory. A trajectory with no steps gets
    an empty array: its outcome has no step to land on.
    """
    if len(step_labels) != len(outcomes):
        raise ValueError(f"{len(step_labels)} label rows for {len(outcomes)} outcomes")
    p = [2.0 * np.asarray(row, dtype=np.float64) - 1.0 for row in step_labels]
    p_tilde = _zscore_equal_weight(p, eps)
    o_tilde = grpo_advantages(outcomes, eps, std)
    out = []
    for pt, o in zip(p_tilde, o_tilde):
        r = alpha * pt
        if r.size:
            r[-1] += o
        # Return-to-go: reverse cumulative sum.
        out.append(np.cumsum(r[::-1])[::-1].copy())
    return out


def _zscore_equal_weight(rows: list[np.ndarray], eps: float) -> list[np.ndarray]:
    """Z-score ragged rows with each non-empty row weighted equally (formula above)."""
    present = [r for r in rows if r.size]
    if not present:
        return [r.copy() for r in rows]
    mu = float(np.mean([r.mean() for r in present]))
    var = float(np.mean([((r - mu) ** 2).mean() for r in present]))
    sigma = var**0.5
    if sigma <= REWARD_ATOL:
        return [np.zeros_like(r) for r in rows]
    return [(r - mu) / (sigma + eps) for r in rows]
