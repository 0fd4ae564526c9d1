"""Did RL itself move the policy, beyond what the warm-start gave it? Shared by the whole-run
tests, read from the run they already made (no run of its own).

Held-out success after RL beating the base model proves little: the warm-start alone does that.
What only RL does is move the policy towards the rollouts that beat their group and away from
those that did not. So take the groups the run's first policies sampled (versions 0 to 5: the
warm-started policy and its first updates) and score their tokens again under the final policy:
for each rollout, the mean change in log-probability of its generated tokens (final policy minus
the one that sampled them, whose log-probs the rollout carries). Only RL changed the policy
between the two. It raises the rollouts above their group's mean reward more than those below
it; the contrast is the difference of the two means.

Its noise is measured on the run itself: the same contrast with "above" and "below" shuffled
within each group, many times. That is what a policy that moved just as far, but not towards
reward, would show (its mean is above 0: groups that mostly succeeded moved up as a whole). A
warm-start with no RL shows exactly 0 (nothing moved).

Version 0 alone gave too few groups with unequal rewards for a steady answer (4 in the
synthetic-task run, whose warm-started policy mostly succeeds: z 4.3); versions 0 to 5 give
14 to 52 groups there and in the other runs measured (z 7.8 to 12.9), and cost a forward pass
of the tiny model over a few hundred rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from learner.logprobs import token_logprobs
from protocol import codec
from protocol.messages import Group
from protocol.run_dir import RunDir
from replay.store import Store

SHUFFLES = 1000
FIRST_VERSIONS = range(0, 6)  # the policies whose rollouts are scored again


@dataclass(frozen=True)
class Contrast:
    value: float  # nats per generated token: above-mean rollouts' change minus below-mean's
    null_mean: float  # the same with above/below shuffled within each group
    null_std: float
    above: int  # rollouts above their group's mean reward
    below: int
    groups: int

    def z(self) -> float:
        return (self.value - self.null_mean) / self.null_std

    def __str__(self) -> str:
        return (f"contrast {self.value:.3f} nats/token over {self.above} above-mean and "
                f"{self.below} below-mean rollouts of {self.groups} groups; shuffled "
                f"{self.null_mean:.3f} ± {self.null_std:.3f} (z {self.z():.1f})")


def groups_of_versions(run_dir: Path, versions: range) -> list[Group]:
    """Stored groups whose every generated token one of ``versions`` sampled."""
    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            groups = [codec.decode_body(Group.TYPE, bytes(b)) for _, b in store.iter_bodies(txn)]
    finally:
        store.close()
    return [g for g in groups
            if (sampled := _generated_versions(g)) and sampled <= set(versions)]


def _generated_versions(group: Group) -> set[int]:
    return {int(v) for t in group.trajectories for v in t.versions[t.action_mask == 1]}


def reward_contrast(run_dir: Path, versions: range = FIRST_VERSIONS, seed: int = 0) -> Contrast:
    """The contrast (module docstring) of the run's final policy on the groups ``versions``
    sampled: what RL moved since they sampled them."""
    groups = [g for g in groups_of_versions(run_dir, versions)
              if len({t.reward for t in g.trajectories}) > 1]  # a tie pushes nothing
    if not groups:
        raise AssertionError(f"no group of versions {versions} with unequal rewards in "
                             f"{run_dir}")
    trajectories = [t for g in groups for t in g.trajectories]
    changes = _mean_logprob_changes(RunDir(run_dir).policy_final, trajectories)
    signs, members = [], []
    for i, g in enumerate(groups):
        mean = np.mean([t.reward for t in g.trajectories])
        signs += [np.sign(t.reward - mean) for t in g.trajectories]
        members += [i] * len(g.trajectories)
    signs, members = np.array(signs), np.array(members)
    rng = np.random.default_rng(seed)
    null = [_contrast(changes, _shuffled_within(signs, members, rng)) for _ in range(SHUFFLES)]
    return Contrast(_contrast(changes, signs), float(np.mean(null)), float(np.std(null)),
                    int((signs > 0).sum()), int((signs < 0).sum()), len(groups))


def _contrast(changes: np.ndarray, signs: np.ndarray) -> float:
    return float(changes[signs > 0].mean() - changes[signs < 0].mean())


def _shuffled_within(signs: np.ndarray, members: np.ndarray, rng) -> np.ndarray:
    out = signs.copy()
    for i in np.unique(members):
        where = np.flatnonzero(members == i)
        out[where] = rng.permutation(out[where])
    return out


def _mean_logprob_changes(policy: Path, trajectories) -> np.ndarray:
    """Per rollout: mean over its generated tokens of log p_policy - the sampler's log-prob."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    longest = max(len(t.tokens) for t in trajectories)
    ids = torch.zeros(len(trajectories), longest, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, t in enumerate(trajectories):  # right-padded, as token_logprobs wants
        ids[row, :len(t.tokens)] = torch.from_numpy(t.tokens.astype(np.int64))
        attention[row, :len(t.tokens)] = 1
    with torch.no_grad():
        scored = token_logprobs(model, ids, attention).numpy()
    changes = []
    for row, t in enumerate(trajectories):
        generated = t.action_mask == 1
        changes.append((scored[row, :len(t.tokens)][generated] - t.logprobs[generated]).mean())
    return np.array(changes)
