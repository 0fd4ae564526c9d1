"""One learner update on experience-guided groups: stripping, metrics, minibatches, boosting;
and what the learner holds: the model loaded from disk once, everything released by close().

A real tiny model, real rollouts of the files env and a real Redis control plane; the replay
client is not needed for ``Learner.update`` (groups are handed in directly).
"""

from __future__ import annotations

import pytest
import torch
from helpers_rollouts import guided_files_groups, learner_for

from learner.learner import Learner
from metrics.jsonl import read_metrics

# Large enough that the first minibatch moves some good tokens past ratio 1.28, small enough
# that they stay under 1.6 (past both bounds the two clips agree: no gradient either way).
LR = 0.003


@pytest.fixture(scope="module")
def model_path(files_policy_path):
    return files_policy_path


@pytest.fixture(scope="module")
def guided_groups(model_path):
    """Two groups of 4, rollouts 1 and 3 guided, rewards alternating so advantages are ±1."""
    return guided_files_groups(model_path)


def _learner(model_path, tmp_path, control, replay=None, **learner_sets) -> Learner:
    return learner_for(model_path, tmp_path, control, replay, **learner_sets)


def _params(learner: Learner) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in learner.step.model.parameters()])


def test_update_strips_and_reports_navigation_metrics(model_path, tmp_path, control,
                                                      guided_groups):
    learner = _learner(model_path, tmp_path, control, probe_every=1, minibatches=2)
    before = _params(learner)
    learner.update(guided_groups, 0.0)
    learner.close()
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
        learner.close()
        return _params(learner)

    assert torch.equal(trained(1, 0.28), trained(1, 0.6))
    assert not torch.equal(trained(2, 0.28), trained(2, 0.6))


class _Channel:
    """A replay client's channel that records being closed."""

    def __init__(self):
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_the_model_is_loaded_once_and_close_releases_what_the_learner_holds(
        model_path, tmp_path, control, monkeypatch):
    """With a KL penalty the learner needs the policy, a frozen reference and the pad id: one
    read of the model from disk (the reference is a copy, the pad id in its config), no
    tokenizer. close() closes the replay client, the metrics and the publisher; twice is
    harmless."""
    from transformers import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from protocol.replay_client import ReplayClient

    loads = []

    def spy(owner):
        real = owner.from_pretrained.__func__

        def from_pretrained(cls, *args, **kw):
            loads.append((cls.__name__, args[0] if args else kw))
            return real(cls, *args, **kw)

        monkeypatch.setattr(owner, "from_pretrained", classmethod(from_pretrained))

    spy(PreTrainedModel)  # every model class's from_pretrained, Auto* ones included
    spy(PreTrainedTokenizerBase)
    channel = _Channel()
    learner = _learner(model_path, tmp_path, control, ReplayClient(channel=channel),
                       kl_coef=0.1)
    assert [path for _, path in loads] == [model_path]  # one model, no tokenizer
    step = learner.step
    assert step.reference is not None and step.pad_id == 0  # the tiny model's [PAD]
    reference, policy = step.reference.state_dict(), step.model.state_dict()
    assert reference.keys() == policy.keys()
    assert all(torch.equal(reference[k], policy[k]) for k in policy)  # the initial policy...
    assert not any(p.requires_grad for p in step.reference.parameters())
    assert all(r.data_ptr() != p.data_ptr()
               for r, p in zip(step.reference.parameters(), step.model.parameters()))  # ...a copy
    publisher = learner.publisher
    learner.close()
    assert channel.closed == 1 and learner.metrics._fd == -1 and publisher._thread is None
    learner.close()
    assert channel.closed == 1
