"""One learner update on experience-guided groups: stripping, metrics, minibatches, boosting.

A real tiny model, real rollouts of the files env and a real Redis control plane; the replay
client is not needed for ``Learner.update`` (groups are handed in directly).
"""

from __future__ import annotations

import pytest
import torch

from environments.files import FilesEnv
from episodes.rollout import (
    Guidance,
    PromptCodec,
    RolloutSettings,
    rollout,
    start_episodes,
    to_groups,
)
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from learner.learner import Learner
from metrics.jsonl import read_metrics
from protocol.config import RunConfig

# Large enough that the first minibatch moves some good tokens past ratio 1.28, small enough
# that they stay under 1.6 (past both bounds the two clips agree: no gradient either way).
LR = 0.003


@pytest.fixture(scope="module")
def model_path(files_policy_path):
    return files_policy_path


@pytest.fixture(scope="module")
def guided_groups(model_path):
    """Two groups of 4, rollouts 1 and 3 guided, rewards alternating so advantages are ±1."""
    backend = TransformersBackend(model_path, device="cpu")
    codec = PromptCodec(backend.tokenizer)
    tasks = FilesEnv().tasks("train")[:2]
    plan = [[Guidance(f"worked : {' ; '.join(t.reference)}", [f"e{t.task_id}"])
             if i in (1, 3) else None for i in range(4)] for t in tasks]
    episodes = start_episodes(tasks, 4, FilesEnv, codec, plan)
    settings = RolloutSettings(max_turns=2)
    rollout(backend, episodes, codec,
            SamplingParams(temperature=1.0, max_new_tokens=settings.max_action_tokens,
                           stop_token_ids=(codec.eoa_id,), seed=0, logprobs_mode="raw"),
            settings)
    for i, ep in enumerate(episodes):
        ep.reward = float(i % 2)  # the guided ones (odd positions) succeed
    backend.close()
    return to_groups(episodes, 4, "a", 0.0)


def _learner(model_path, tmp_path, control, **learner_sets) -> Learner:
    cfg = RunConfig()
    cfg.model.path = model_path
    cfg.learner.warmup_updates = 1
    for key, value in learner_sets.items():
        section, name = key.split("__") if "__" in key else ("learner", key)
        setattr(getattr(cfg, section), name, value)
    return Learner(cfg, tmp_path, control, replay=None)


def _params(learner: Learner) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in learner.model.parameters()])


def test_update_strips_and_reports_navigation_metrics(model_path, tmp_path, control,
                                                      guided_groups):
    learner = _learner(model_path, tmp_path, control, probe_every=1, minibatches=2)
    before = _params(learner)
    learner.update(guided_groups, 0.0)
    learner.metrics.close()
    row = read_metrics(tmp_path, "learner")[-1]
    assert row["learner/stripped_fraction"] == pytest.approx(0.5)  # 2 of 4 per group
    assert 0 < row["learner/boosted_token_fraction"] < 1
    assert row["learner/step_gain"] > 0  # the step lowered its own loss
    assert not torch.equal(before, _params(learner))


def test_boosted_clip_acts_only_from_the_second_minibatch(model_path, tmp_path, control,
                                                          guided_groups):
    """One step per batch: ratio 1 at the step, so the clip (and boosting) cannot matter.
    Two minibatches: the second is scored against the proximal policy the first step moved
    away from, and the guided rows' positive-advantage tokens clip at 1.6 instead of 1.28.
    The batch is one group twice, so the first step raised exactly the second's good tokens."""
    batch = [guided_groups[0], guided_groups[0]]

    def trained(minibatches: int, boost: float) -> torch.Tensor:
        torch.manual_seed(0)
        learner = _learner(model_path, tmp_path, control, minibatches=minibatches, lr=LR,
                           experience__clip_high=boost)
        learner.update(batch, 0.0)
        learner.metrics.close()
        return _params(learner)

    assert torch.equal(trained(1, 0.28), trained(1, 0.6))
    assert not torch.equal(trained(2, 0.28), trained(2, 0.6))
