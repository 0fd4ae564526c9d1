"""Training on experience-guided rollouts: stripping the advice, keeping it, boosted clipping and
the behaviour weight of stripped rows, against hand-built token layouts and hand-computed losses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.batching import TrainBatch, build_batch, strip_experience
from learner.losses import navigation_terms, policy_loss
from protocol.messages import Group, Step, StepLabels, Task, Trajectory

LN = math.log

# Token ids as episodes/rollout.py's PromptCodec would lay them out.
BOS, TASK, OBS, ACT, EOA, EXP, EXP_END = 1, 2, 3, 4, 5, 6, 7
QUERY, FIRST_OBS, ADVICE = [40, 41], [50], [60, 61]
# (action ids without <eoa>, their log-probs incl. <eoa>, version, observation ids)
TURNS = [([70, 71], [-0.1, -0.2, -0.3], 3, [51]), ([72], [-0.4, -0.5], 4, [52, 53])]


def rollout(advice: list[int] | None, tid: str = "a", reward: float = 1.0,
            ids: list[str] | None = None) -> Trajectory:
    """A trajectory built piece by piece like ``PromptCodec.start`` / ``apply_action``."""
    block = [EXP, *advice, EXP_END] if advice else []
    tokens = [BOS, *block, TASK, *QUERY, OBS, *FIRST_OBS, ACT]
    span = [1, 1 + len(block)] if block else []
    prompt_len = len(tokens)
    logprobs, versions, mask = [0.0] * prompt_len, [-1] * prompt_len, [0] * prompt_len
    steps = []
    for i, (action, lps, version, obs) in enumerate(TURNS):
        start = len(tokens)
        tokens += [*action, EOA]
        logprobs += lps
        versions += [version] * len(lps)
        mask += [1] * len(lps)
        steps.append(Step(action=f"a{i}", observation=f"o{i}", start=start, end=len(tokens)))
        if i + 1 < len(TURNS):  # the last observation ends the episode and is not appended
            tokens += [OBS, *obs, ACT]
            logprobs += [0.0] * (len(obs) + 2)
            versions += [-1] * (len(obs) + 2)
            mask += [0] * (len(obs) + 2)
    return Trajectory(
        traj_id=tid, tokens=np.array(tokens, np.int32), logprobs=np.array(logprobs, np.float32),
        versions=np.array(versions, np.int32), action_mask=np.array(mask, np.uint8),
        prompt_len=prompt_len, steps=steps, reward=reward, experience_span=span,
        experience_ids=list(ids if ids is not None else (["e1"] if advice else [])))


def group(gid: str, trajs: list[Trajectory]) -> Group:
    return Group(group_id=gid, task=Task(task_id="t", env="files", query="q", seed=0),
                 trajectories=trajs)


def assert_same_layout(got: Trajectory, want: Trajectory) -> None:
    for name in ("tokens", "logprobs", "versions", "action_mask"):
        arr = getattr(got, name)
        assert arr.dtype == getattr(want, name).dtype, name
        np.testing.assert_array_equal(arr, getattr(want, name), err_msg=name)
    assert got.prompt_len == want.prompt_len
    assert [(s.start, s.end) for s in got.steps] == [(s.start, s.end) for s in want.steps]


# --- stripping ----------------------------------------------------------------------------------


def test_strip_gives_exactly_the_unguided_trajectory():
    guided, plain = rollout(ADVICE), rollout(None)
    assert guided.experience_span == [1, 5] and guided.prompt_len == plain.prompt_len + 4
    stripped = strip_experience(guided)
    assert_same_layout(stripped, plain)
    assert stripped.experience_span == [] and stripped.experience_ids == ["e1"]
    # the input is untouched
    assert guided.experience_span == [1, 5] and len(guided.tokens) == len(plain.tokens) + 4
    assert guided.steps[0].start == plain.steps[0].start + 4


def test_strip_without_span_is_an_unshared_copy():
    plain = rollout(None)
    copy = strip_experience(plain)
    assert_same_layout(copy, plain)
    assert copy.tokens is not plain.tokens and copy.steps[0] is not plain.steps[0]
    copy.tokens[0] = 99
    assert plain.tokens[0] == BOS


def test_strip_rejects_spans_outside_the_prompt_or_over_actions():
    bad = rollout(ADVICE)
    bad.experience_span = [5, bad.prompt_len + 2]  # runs into the first action
    with pytest.raises(ValueError, match="inside"):
        strip_experience(bad)
    # a (corrupt) prompt_len that swallows the actions: the span is in the prompt but covers
    # generated tokens
    bad = rollout(ADVICE)
    bad.prompt_len = len(bad.tokens)
    bad.experience_span = [8, 14]
    with pytest.raises(ValueError, match="generated"):
        strip_experience(bad)
    with pytest.raises(ValueError):
        build_batch([group("g", [bad, rollout(None, "b", 0.0)])], pad_id=0)


def test_build_batch_rejects_unknown_experience_mode():
    with pytest.raises(ValueError, match="experience"):
        build_batch([group("g", [rollout(None)])], pad_id=0, experience="drop")


# --- build_batch --------------------------------------------------------------------------------


def guided_and_unguided_groups() -> tuple[Group, Group]:
    """The same two rollouts, the first once with advice in its prompt and once without."""
    other = rollout(None, "b", reward=0.0)
    return (group("g", [rollout(ADVICE, "a"), other]),
            group("g", [rollout(None, "a"), rollout(None, "b", reward=0.0)]))


def assert_rows_equal(a: TrainBatch, b: TrainBatch) -> None:
    for name in ("input_ids", "attention_mask", "action_mask", "behaviour_logprobs",
                 "advantages", "versions"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), msg=name)
    assert a.num_tokens == b.num_tokens


def test_discard_trains_on_the_unguided_rows_grpo():
    with_exp, without = guided_and_unguided_groups()
    batch, stats = build_batch([with_exp], pad_id=0)  # "discard" is the default
    want, want_stats = build_batch([without], pad_id=0)
    assert_rows_equal(batch, want)
    assert batch.input_ids[0].tolist() == rollout(None).tokens.tolist()
    # GRPO: +1 (up to the std epsilon) on the generated tokens, 0 on the prompt
    np.testing.assert_allclose(batch.advantages[0].numpy(), rollout(None).action_mask, rtol=1e-5)
    assert batch.guided.tolist() == [1.0, 0.0] and batch.stripped.tolist() == [1.0, 0.0]
    assert stats["guided_trajectories"] == 1 and stats["stripped_trajectories"] == 1
    assert want.guided.sum() == 0 and want_stats["guided_trajectories"] == 0
    assert stats["tokens"] == want_stats["tokens"]


def test_discard_lines_up_step_label_advantages():
    with_exp, without = guided_and_unguided_groups()
    labels = [StepLabels("g", [[1, 0], [0, 1]])]
    batch, _ = build_batch([with_exp], pad_id=0, labels=labels, alpha=0.5)
    want, _ = build_batch([without], pad_id=0, labels=labels, alpha=0.5)
    assert_rows_equal(batch, want)
    plain = rollout(None)
    adv = batch.advantages[0]
    s0, s1 = plain.steps
    assert adv[s0.start] != adv[s1.start]  # two different step advantages, each on its span
    assert (adv[s0.start:s0.end] == adv[s0.start]).all()
    assert adv[: plain.prompt_len].abs().sum() == 0


def test_discard_cuts_per_token_given_advantages():
    with_exp, without = guided_and_unguided_groups()
    n_with, n_without = len(with_exp.trajectories[0].tokens), len(without.trajectories[0].tokens)
    # per-token arrays index each trajectory as sent: the guided one includes the advice
    given_with = [[np.arange(n_with, dtype=np.float32), np.float32(-1.0)]]
    given_without = [[np.delete(np.arange(n_with, dtype=np.float32), range(1, 5)),
                      np.float32(-1.0)]]
    assert given_without[0][0].shape == (n_without,)
    batch, _ = build_batch([with_exp], pad_id=0, advantages=given_with)
    want, _ = build_batch([without], pad_id=0, advantages=given_without)
    assert_rows_equal(batch, want)
    first_action = rollout(None).steps[0].start
    assert batch.advantages[0, first_action].item() == first_action + 4


def test_keep_trains_with_the_advice_in_context():
    with_exp, _ = guided_and_unguided_groups()
    guided = with_exp.trajectories[0]
    batch, stats = build_batch([with_exp], pad_id=0, experience="keep")
    assert batch.input_ids[0].tolist() == guided.tokens.tolist()
    assert batch.action_mask[0].tolist() == guided.action_mask.astype(float).tolist()
    np.testing.assert_allclose(batch.advantages[0].numpy(), guided.action_mask, rtol=1e-5)
    assert batch.guided.tolist() == [1.0, 0.0] and batch.stripped.tolist() == [0.0, 0.0]
    assert stats["guided_trajectories"] == 1 and stats["stripped_trajectories"] == 0
    moved = batch.to("cpu")
    assert moved.guided.tolist() == [1.0, 0.0] and moved.stripped.dtype == torch.float32


def test_guided_without_a_span_is_guided_but_not_stripped():
    traj = rollout(None, ids=["e7"])  # experience recorded, span unknown: nothing to cut
    batch, stats = build_batch([group("g", [traj, rollout(None, "b", 0.0)])], pad_id=0)
    assert batch.guided.tolist() == [1.0, 0.0] and batch.stripped.tolist() == [0.0, 0.0]
    assert batch.input_ids[0].tolist() == traj.tokens.tolist()


# --- loss ---------------------------------------------------------------------------------------


def hand_batch(logp_minus_prox, prox_minus_behav, adv, mask, guided, stripped):
    """A two-row TrainBatch plus current / proximal log-probs with chosen ratios."""
    mask = torch.tensor(mask)
    behav = torch.full(mask.shape, -1.0) * mask
    prox = behav + torch.tensor(prox_minus_behav)
    logp = (prox + torch.tensor(logp_minus_prox)).requires_grad_(True)
    batch = TrainBatch(
        input_ids=torch.zeros(mask.shape, dtype=torch.long), attention_mask=mask.long(),
        action_mask=mask, behaviour_logprobs=behav, advantages=torch.tensor(adv),
        versions=torch.zeros(mask.shape, dtype=torch.long), num_tokens=int(mask.sum()),
        group_index=torch.zeros(len(mask), dtype=torch.long),
        guided=torch.tensor(guided), stripped=torch.tensor(stripped),
        row_weight=torch.ones(len(mask)))
    return batch, logp, prox


def boost_batch():
    """Row 0 guided, row 1 plain; the same ratio/advantage pairs in both; w = 1 everywhere.

    token:   0           1            2           3
    row 0:   r=1.5 A=+1  r=1.5 A=-1   r=1.8 A=+1  r=0.5 A=-1
    row 1:   r=1.5 A=+1  r=1.5 A=-1   r=1.8 A=+1  padding
    """
    ratios = [LN(1.5), LN(1.5), LN(1.8), LN(0.5)]
    return hand_batch(
        logp_minus_prox=[ratios, ratios[:3] + [0.0]], prox_minus_behav=[[0.0] * 4] * 2,
        adv=[[1.0, -1.0, 1.0, -1.0], [1.0, -1.0, 1.0, 0.0]],
        mask=[[1.0, 1, 1, 1], [1, 1, 1, 0]], guided=[1.0, 0.0], stripped=[0.0, 0.0])


def test_boosted_clip_only_on_guided_positive_advantage_tokens():
    batch, logp, prox = boost_batch()
    behav, clip, nav = navigation_terms(batch, prox, clip_high=0.28, experience_clip_high=0.6)
    torch.testing.assert_close(behav, batch.behaviour_logprobs)  # nothing stripped
    torch.testing.assert_close(clip, torch.tensor([[0.6] * 4, [0.28] * 4]))
    assert nav == pytest.approx({"boosted_token_fraction": 4 / 7, "guided_fraction": 0.5,
                                 "stripped_fraction": 0.0})
    loss, m = policy_loss(logp, prox, behav, batch.advantages, batch.action_mask,
                          clip_high=clip)
    # s = -min(r·A, clip(r, 0.8, 1 + clip_high)·A), then the dual clip (3·|A|, not binding)
    # row 0 (clip_high 0.6): -min(1.5, 1.5) = -1.5 | A<0: -min(-1.5, -1.5) = +1.5 |
    #                        -min(1.8, 1.6) = -1.6 | clip low: -min(-0.5, -0.8) = +0.8
    # row 1 (clip_high 0.28): -min(1.5, 1.28) = -1.28 | A<0: -min(-1.5, -1.28) = +1.5 (as in
    #                        row 0: the upper clip never binds when A < 0) | -1.28
    row0, row1 = [-1.5, 1.5, -1.6, 0.8], [-1.28, 1.5, -1.28]
    assert loss.item() == pytest.approx((sum(row0) + sum(row1)) / 7, rel=1e-5)
    # clipped term binding: row 0 tokens 2, 3; row 1 tokens 0, 2
    assert m["clip_fraction"] == pytest.approx(4 / 7)
    loss.backward()
    # d(-r·A)/dlogp = -r·A / 7 where unclipped: the boosted r = 1.5 token still moves, the plain
    # one does not; the A < 0 tokens move alike in both rows
    want = torch.tensor([[-1.5, 1.5, 0.0, 0.0], [0.0, 1.5, 0.0, 0.0]]) / 7
    torch.testing.assert_close(logp.grad, want, rtol=1e-5, atol=1e-7)

    seq, _ = policy_loss(logp, prox, behav, batch.advantages, batch.action_mask,
                         clip_high=clip, aggregation="seq-mean-token-mean")
    assert seq.item() == pytest.approx((sum(row0) / 4 + sum(row1) / 3) / 2, rel=1e-5)


def test_uniform_clip_tensor_matches_the_float_clip():
    batch, logp, prox = boost_batch()
    _, clip, _ = navigation_terms(batch, prox, clip_high=0.28, experience_clip_high=0.28)
    args = (logp, prox, batch.behaviour_logprobs, batch.advantages, batch.action_mask)
    by_tensor, m_tensor = policy_loss(*args, clip_high=clip)
    by_float, m_float = policy_loss(*args, clip_high=0.28)
    assert by_tensor.item() == pytest.approx(by_float.item(), rel=1e-6)
    assert m_tensor == pytest.approx(m_float)
    # row 0 unboosted: -1.28 + 1.5 - 1.28 + 0.8
    assert by_float.item() == pytest.approx((-1.28 + 1.5 - 1.28 + 0.8 - 1.28 + 1.5 - 1.28) / 7)


def test_stripped_rows_are_not_importance_weighted():
    # Both rows: token 0 has w = 10 (over iw_cap = 5), token 1 has w = 2; r = 1, A = +1;
    # token 2 is padding. Row 0 was stripped, row 1 was not.
    batch, logp, prox = hand_batch(
        logp_minus_prox=[[0.0] * 3] * 2,
        prox_minus_behav=[[LN(10.0), LN(2.0), 0.0]] * 2,
        adv=[[1.0, 1.0, 0.0]] * 2, mask=[[1.0, 1, 0], [1, 1, 0]],
        guided=[1.0, 0.0], stripped=[1.0, 0.0])
    behav, _, nav = navigation_terms(batch, prox, clip_high=0.28, experience_clip_high=0.6)
    torch.testing.assert_close(behav[0, :2], prox[0, :2])  # w = 1 on the stripped row
    assert behav[0, 2].item() == 0.0  # still 0 off the generated tokens
    torch.testing.assert_close(behav[1], batch.behaviour_logprobs[1])
    assert nav["stripped_fraction"] == 0.5 and nav["guided_fraction"] == 0.5
    loss, m = policy_loss(logp, prox, behav, batch.advantages, batch.action_mask, iw_cap=5.0)
    # row 0: -1, -1 (w = 1); row 1: token 0 dropped (w = 10 > 5), token 1 weighted: -2
    assert loss.item() == pytest.approx((-1 - 1 - 2) / 3, rel=1e-5)
    assert m["tokens"] == 3
    assert m["iw_masked_fraction"] == pytest.approx(1 / 4)
    assert m["iw_mean"] == pytest.approx((1 + 1 + 10 + 2) / 4, rel=1e-5)
    # without the override the stripped row would be dropped and weighted the same way
    plain, m_plain = policy_loss(logp, prox, batch.behaviour_logprobs, batch.advantages,
                                 batch.action_mask, iw_cap=5.0)
    assert plain.item() == pytest.approx((-2 - 2) / 2, rel=1e-5)
    assert m_plain["iw_masked_fraction"] == pytest.approx(2 / 4)


def test_stripped_rows_report_the_weight_the_correction_leaves_out():
    # Row 0 stripped: w = 10, 0.1, 1 (advice made token 1 ten times likelier); row 1 plain.
    batch, logp, prox = hand_batch(
        logp_minus_prox=[[0.0] * 3] * 2,
        prox_minus_behav=[[LN(10.0), LN(0.1), 0.0], [LN(10.0), 0.0, 0.0]],
        adv=[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], mask=[[1.0, 1, 1], [1, 1, 0]],
        guided=[1.0, 0.0], stripped=[1.0, 0.0])
    behav, _, nav = navigation_terms(batch, prox, clip_high=0.28, experience_clip_high=0.6,
                                     iw_cap=5.0)
    assert nav["stripped_log_w_mean"] == pytest.approx((LN(10.0) + LN(0.1)) / 3, abs=1e-6)
    assert nav["stripped_w_over_cap_fraction"] == pytest.approx(1 / 3)
    assert nav["stripped_w_under_fraction"] == pytest.approx(1 / 3)
    _, m = policy_loss(logp, prox, behav, batch.advantages, batch.action_mask, iw_cap=5.0,
                       guided=batch.guided)
    # the stripped row keeps every token (w = 1); the plain row loses its w = 10 token
    assert m["iw_masked_fraction_guided"] == 0.0
    assert m["iw_masked_fraction_unguided"] == pytest.approx(1 / 2)


def test_clip_fractions_are_split_by_row_kind():
    batch, logp, prox = boost_batch()
    behav, clip, nav = navigation_terms(batch, prox, clip_high=0.28, experience_clip_high=0.6)
    assert "stripped_log_w_mean" not in nav  # nothing stripped, nothing to report
    _, m = policy_loss(logp, prox, behav, batch.advantages, batch.action_mask,
                       clip_high=clip, guided=batch.guided)
    # binding clips (see the test above): guided row tokens 2, 3 of 4; plain row tokens 0, 2 of 3
    assert m["clip_fraction_guided"] == pytest.approx(2 / 4)
    assert m["clip_fraction_unguided"] == pytest.approx(2 / 3)
    _, only_plain = policy_loss(logp[1:], prox[1:], behav[1:], batch.advantages[1:],
                                batch.action_mask[1:], guided=batch.guided[1:])
    assert "clip_fraction_guided" not in only_plain and "clip_fraction_unguided" in only_plain


def test_no_experience_leaves_the_loss_unchanged():
    plain = group("g", [rollout(None, "a"), rollout(None, "b", 0.0)])
    batch, _ = build_batch([plain], pad_id=0)
    assert batch.guided.sum() == 0 and batch.stripped.sum() == 0
    torch.manual_seed(0)
    prox = batch.behaviour_logprobs + 0.3 * torch.randn(batch.action_mask.shape)
    logp = prox + 0.5 * torch.randn(batch.action_mask.shape)
    behav, clip, nav = navigation_terms(batch, prox, clip_high=0.28, experience_clip_high=0.6)
    assert torch.equal(behav, batch.behaviour_logprobs)
    assert nav["boosted_token_fraction"] == 0.0
    args = (logp, prox)
    rest = (batch.advantages, batch.action_mask)
    got, m_got = policy_loss(*args, behav, *rest, clip_high=clip)
    want, m_want = policy_loss(*args, batch.behaviour_logprobs, *rest, clip_high=0.28)
    assert got.item() == want.item()
    assert m_got == m_want
