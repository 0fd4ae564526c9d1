"""The learner's pure math against hand-computed values: advantages, batching, log-probs, loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.advantages import composite_step_advantages, grpo_advantages
from learner.batching import build_batch
from learner.logprobs import token_logprobs
from learner.losses import policy_loss
from protocol.messages import Group, Step, StepLabels, Task, Trajectory, rewards_equal

# --- advantages ---------------------------------------------------------------------------------


def test_grpo_advantages_normalise_within_group():
    # mean 0.5, population std 0.5 → ±1
    adv = grpo_advantages([1.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(adv, [1, -1, 1, -1], rtol=1e-5)
    # mean 2, std sqrt(2/3)
    adv = grpo_advantages([1.0, 2.0, 3.0])
    s = math.sqrt(2 / 3)
    np.testing.assert_allclose(adv, [-1 / s, 0, 1 / s], rtol=1e-5)


def test_grpo_degenerate_group_is_all_zeros():
    assert rewards_equal([0.7, 0.7, 0.7]) and rewards_equal([0.7, 0.7 + 1e-12])
    assert rewards_equal([1.0])
    assert not rewards_equal([0.0, 1.0])
    np.testing.assert_array_equal(grpo_advantages([0.7, 0.7, 0.7]), [0, 0, 0])


def test_composite_step_advantages_hand_worked():
    # labels [[GOOD, BAD], [GOOD]] → p = [[+1, -1], [+1]]
    # per-trajectory means 0 and 1 → μ = 0.5
    # variance: traj0 mean(0.5², 1.5²) = 1.25, traj1 0.5² = 0.25 → σ² = 0.75
    # p̃ = [[0.5/σ, -1.5/σ], [0.5/σ]];  outcomes [1, 0] → Õ = [+1, -1]
    # α = 0.5: r0 = [0.25/σ, -0.75/σ + 1], r1 = [0.25/σ - 1]
    # A = return-to-go of r
    sigma = math.sqrt(0.75)
    out = composite_step_advantages([[1, 0], [1]], [1.0, 0.0], alpha=0.5)
    r0 = [0.25 / sigma, -0.75 / sigma + 1]
    np.testing.assert_allclose(out[0], [r0[0] + r0[1], r0[1]], rtol=1e-5)
    np.testing.assert_allclose(out[1], [0.25 / sigma - 1], rtol=1e-5)


def test_composite_all_labels_equal_leaves_only_outcome():
    out = composite_step_advantages([[1, 1], [1, 1, 1]], [1.0, 0.0], alpha=0.2)
    np.testing.assert_allclose(out[0], [1, 1], rtol=1e-5)
    np.testing.assert_allclose(out[1], [-1, -1, -1], rtol=1e-5)


def test_composite_all_equal_outcomes_leaves_only_process_reward():
    # outcomes [0, 0, 0] → Õ = 0; labels [[GOOD, GOOD, BAD], [BAD], [GOOD, BAD]]
    # p = [[1, 1, -1], [-1], [1, -1]]; per-trajectory means 1/3, -1, 0 → μ = -2/9
    # σ² = mean over trajectories of mean_t (p - μ)²:
    #   traj0: (2·(11/9)² + (7/9)²)/3 = 291/243, traj1: (7/9)² = 49/81,
    #   traj2: ((11/9)² + (7/9)²)/2 = 85/81
    mu = -2 / 9
    var = (291 / 243 + 49 / 81 + 85 / 81) / 3
    alpha = 0.3
    pt = [[(1 - mu), (1 - mu), (-1 - mu)], [(-1 - mu)], [(1 - mu), (-1 - mu)]]
    want = [np.cumsum([alpha * x / math.sqrt(var) for x in row][::-1])[::-1] for row in pt]
    out = composite_step_advantages([[1, 1, 0], [0], [1, 0]], [0.0, 0.0, 0.0], alpha=alpha)
    for got, expected in zip(out, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    # a GOOD step of a failed rollout is still pushed up, a BAD one down
    assert out[2][1] < 0 < out[2][0]


def test_composite_one_step_trajectories_get_outcome_plus_their_step():
    # labels [[GOOD], [BAD]] → p̃ = [+1, -1] (μ 0, σ 1); outcomes [1, 0] → Õ = [+1, -1]
    out = composite_step_advantages([[1], [0]], [1.0, 0.0], alpha=0.1)
    np.testing.assert_allclose([out[0][0], out[1][0]], [1.1, -1.1], rtol=1e-5)


# --- batching -----------------------------------------------------------------------------------


def make_traj(prompt: int, steps: list[tuple[int, int]], reward: float, tid: str, version=3):
    """A trajectory of ``prompt`` tokens then (action, observation) token runs."""
    tokens, mask, spans, pos = list(range(10, 10 + prompt)), [0] * prompt, [], prompt
    for act, obs in steps:
        spans.append(Step(action="a", observation="o", start=pos, end=pos + act))
        tokens += [20 + i for i in range(act + obs)]
        mask += [1] * act + [0] * obs
        pos += act + obs
    mask = np.array(mask, dtype=np.uint8)
    return Trajectory(
        traj_id=tid,
        tokens=np.array(tokens, dtype=np.int32),
        logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        versions=np.where(mask, version, -1).astype(np.int32),
        action_mask=mask,
        prompt_len=prompt,
        steps=spans,
        reward=reward,
    )


def make_group(gid: str, trajs: list[Trajectory]) -> Group:
    task = Task(task_id="t", env="files", query="q", seed=0)
    return Group(group_id=gid, task=task, trajectories=trajs)


def two_groups():
    # g0: lengths 2+2+1+1+1 = 7 and 2+1+1 = 4; rewards differ. g1: all-equal rewards.
    g0 = make_group("g0", [
        make_traj(2, [(2, 1), (1, 1)], reward=1.0, tid="a"),
        make_traj(2, [(1, 1)], reward=0.0, tid="b"),
    ])
    g1 = make_group("g1", [make_traj(1, [(2, 0)], reward=0.5, tid="c")] * 2)
    return [g0, g1]


def test_build_batch_grpo_padding_and_masks():
    groups = two_groups()
    batch, stats = build_batch(groups, pad_id=0)
    assert batch.input_ids.shape == (4, 7)
    assert batch.input_ids.dtype == torch.long and batch.versions.dtype == torch.long
    assert batch.action_mask.dtype == torch.float32

    # row 1 (4 tokens) is right-padded
    assert batch.input_ids[1].tolist() == [10, 11, 20, 21, 0, 0, 0]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 1, 0, 0, 0]
    # action mask only on generated tokens: row 0 = prompt 2, act 2, obs 1, act 1, obs 1
    assert batch.action_mask[0].tolist() == [0, 0, 1, 1, 0, 1, 0]
    assert batch.action_mask[1].tolist() == [0, 0, 1, 0, 0, 0, 0]
    assert batch.versions[0].tolist() == [-1, -1, 3, 3, -1, 3, -1]
    assert batch.behaviour_logprobs[1].tolist() == [0, 0, -0.5, 0, 0, 0, 0]

    # GRPO: the scalar advantage (±1) on every generated token, 0 elsewhere; g1 degenerate → 0
    torch.testing.assert_close(batch.advantages[0], batch.action_mask[0] * 1.0, rtol=1e-5, atol=0)
    torch.testing.assert_close(batch.advantages[1], batch.action_mask[1] * -1.0, rtol=1e-5, atol=0)
    assert batch.advantages[2:].abs().sum() == 0

    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.num_tokens == 3 + 1 + 2 + 2
    assert stats["degenerate_groups"] == 1
    assert stats["trajectories"] == 4
    assert stats["tokens"] == 7 + 4 + 3 + 3
    assert stats["action_tokens"] == batch.num_tokens


def test_build_batch_step_labels_put_step_advantage_on_its_span():
    groups = two_groups()
    labels = [StepLabels(group_id="g0", labels=[[1, 0], [1]])]
    batch, stats = build_batch(groups, pad_id=0, labels=labels, alpha=0.5)
    a0, a1 = composite_step_advantages([[1, 0], [1]], [1.0, 0.0], alpha=0.5)
    # row 0: prompt 2 | step0 action [2:4] | obs [4] | step1 action [5] | obs [6]
    expect0 = [0, 0, a0[0], a0[0], 0, a0[1], 0]
    expect1 = [0, 0, a1[0], 0, 0, 0, 0]
    np.testing.assert_allclose(batch.advantages[0].numpy(), expect0, rtol=1e-6)
    np.testing.assert_allclose(batch.advantages[1].numpy(), expect1, rtol=1e-6)
    # g1 has no labels: GRPO fallback (degenerate → zeros), counted
    assert stats["unlabelled_groups"] == 1
    assert batch.advantages[2:].abs().sum() == 0


def test_build_batch_step_span_tokens_not_generated_get_nothing():
    traj = make_traj(1, [(3, 1)], reward=1.0, tid="a")
    traj.action_mask[3] = 0  # e.g. a forced stop token inside the action span
    other = make_traj(1, [(3, 1)], reward=0.0, tid="b")
    groups = [make_group("g", [traj, other])]
    batch, _ = build_batch(groups, pad_id=0, labels={"g": StepLabels("g", [[1], [0]])})
    adv = batch.advantages[0].tolist()
    assert adv[1] != 0 and adv[2] != 0 and adv[3] == 0 and adv[0] == 0 and adv[4] == 0


def test_build_batch_precomputed_and_max_len():
    groups = two_groups()[:1]
    given = [[np.float32(2.0), np.arange(4, dtype=np.float32)]]
    batch, stats = build_batch(groups, pad_id=9, advantages=given, max_len=5)
    assert batch.input_ids.shape == (2, 5)
    assert stats["truncated"] == 1
    assert batch.advantages[0].tolist() == [0, 0, 2, 2, 0]
    assert batch.advantages[1].tolist() == [0, 0, 2, 0, 0]  # per-token array, masked
    assert batch.input_ids[1, 4].item() == 9


def test_build_batch_label_count_mismatch_raises():
    with pytest.raises(ValueError):
        build_batch(two_groups(), pad_id=0, labels=[StepLabels("g0", [[1], [1]])])


# --- log-probs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg).eval()


def test_token_logprobs_match_naive_loop(tiny_lm):
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (2, 9))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0  # right padding
    ids[1, 6:] = 0
    with torch.no_grad():
        got = token_logprobs(tiny_lm, ids, attn)
        chunked = token_logprobs(tiny_lm, ids, attn, chunk_tokens=3)
        for b, n in [(0, 9), (1, 6)]:
            assert got[b, 0] == 0
            for t in range(1, n):
                logits = tiny_lm(input_ids=ids[b : b + 1, :t]).logits[0, -1]
                want = torch.log_softmax(logits.float(), -1)[ids[b, t]]
                torch.testing.assert_close(got[b, t], want, rtol=1e-4, atol=1e-5)
    assert got[1, 6:].abs().sum() == 0
    torch.testing.assert_close(chunked, got)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 1000])
def test_chunked_head_gives_the_same_gradients(tiny_lm, chunk_tokens):
    """Chunking the output head (checkpointed per chunk) changes memory, not the step."""
    import copy

    torch.manual_seed(2)
    ids = torch.randint(0, 50, (3, 8))
    attn = torch.ones_like(ids)
    attn[2, 5:] = 0
    weights = torch.rand(3, 8)
    grads = []
    for chunk in (0, chunk_tokens):
        model = copy.deepcopy(tiny_lm).train()
        logp = token_logprobs(model, ids, attn, chunk_tokens=chunk)
        (logp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_scoring_only_needed_positions_gives_the_same_values_and_gradients(tiny_lm):
    """The head at generated tokens only: equal there, 0 elsewhere, the same step."""
    import copy

    torch.manual_seed(3)
    ids = torch.randint(0, 50, (3, 8))
    attn = torch.ones_like(ids)
    attn[2, 5:] = 0
    needed = torch.zeros_like(ids)
    needed[0, 3:5] = needed[1, 6:] = needed[2, 2] = needed[2, 6] = 1  # [2, 6] is padding
    weights = torch.rand(3, 8) * needed
    outs, grads = [], []
    for kwargs in ({}, {"needed": needed}):
        model = copy.deepcopy(tiny_lm).train()
        logp = token_logprobs(model, ids, attn, chunk_tokens=4, **kwargs)
        (logp * weights).sum().backward()
        outs.append(logp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    keep = needed.bool() & attn.bool()
    torch.testing.assert_close(outs[1][keep], outs[0][keep])
    assert outs[1][~keep].abs().sum() == 0 and outs[0][keep].abs().min() > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_a_head_that_is_not_plain_is_refused(tiny_lm):
    import copy

    from learner.logprobs import check_chunked_head

    check_chunked_head(tiny_lm)  # Qwen2: logits = lm_head(decoder(x))
    scaled = copy.deepcopy(tiny_lm)
    forward = scaled.forward

    def soft_capped(*args, **kwargs):  # as Gemma-2 caps its logits after the head
        out = forward(*args, **kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    scaled.forward = soft_capped
    with pytest.raises(ValueError, match="logit_chunk_tokens=0"):
        check_chunked_head(scaled)


def test_row_lengths_on_the_batchs_own_device():
    """The learner moves the batch to its device before it measures rows (on a GPU once a
    mix of devices); ``meta`` stands in for a GPU here."""
    batch, _ = build_batch(two_groups(), pad_id=0)
    assert batch.lengths().tolist() == [7, 4, 3, 3]
    assert batch.to("meta").lengths().device.type == "meta"


def test_token_budget_parts_pack_rows_by_length():
    from learner.batching import token_budget_parts

    lengths = torch.tensor([5, 30, 12, 11, 40, 3])
    parts = token_budget_parts(torch.arange(6), lengths, budget=40)
    # longest first; a part holds rows while rows x its longest row fits in 40 tokens
    assert [p.tolist() for p in parts] == [[4], [1], [2, 3, 0], [5]]
    for part in parts:
        assert len(part) * int(lengths[part].max()) <= 40
    assert sorted(int(r) for p in parts for r in p) == list(range(6))  # each row once
    # a row longer than the budget is a part of its own, never dropped
    assert [p.tolist() for p in token_budget_parts(torch.arange(2), torch.tensor([50, 4]),
                                                   budget=10)] == [[0], [1]]


# --- loss ---------------------------------------------------------------------------------------

LN = math.log


def loss_inputs():
    """Seven token slots in two rows, one for each case (values chosen to hand-compute).

    row 0: unclipped (r=1.1, A=+1) | clip high (r=1.5, A=+1) | clip low (r=0.5, A=-1) |
           dual clip (r=5, A=-1)
    row 1: iw capped (w=10) | weighted (w=2, r=1, A=0.5) | padding (mask 0, garbage)
    """
    logp_minus_prox = [[LN(1.1), LN(1.5), LN(0.5), LN(5.0)], [0.0, 0.0, 50.0, 0.0]]
    prox_minus_behav = [[0.0, 0.0, 0.0, 0.0], [LN(10.0), LN(2.0), 30.0, 0.0]]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, 0.5, -7.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    behav = torch.full((2, 4), -1.0)
    prox = behav + torch.tensor(prox_minus_behav)
    logp = (prox + torch.tensor(logp_minus_prox)).requires_grad_(True)
    return logp, prox, behav, adv, mask


def test_policy_loss_hand_computed():
    logp, prox, behav, adv, mask = loss_inputs()
    loss, m = policy_loss(logp, prox, behav, adv, mask)
    # per-token surrogates: -1.1, -1.28, +0.8, min(5, 3·1) = 3, [dropped], 2·(-0.5) = -1
    # token-mean over the 5 kept tokens of the whole batch (not a mean of row means)
    want = (-1.1 - 1.28 + 0.8 + 3.0 - 1.0) / 5
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert m["loss"] == pytest.approx(want, rel=1e-5)
    assert m["tokens"] == 5
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    assert m["dual_clip_fraction"] == pytest.approx(1 / 5)
    assert m["iw_masked_fraction"] == pytest.approx(1 / 6)
    assert m["iw_max"] == pytest.approx(10.0, rel=1e-5)
    assert m["iw_mean"] == pytest.approx((1 + 1 + 1 + 1 + 10 + 2) / 6, rel=1e-5)
    assert "kl_ref" not in m
    assert math.isfinite(m["kl_behaviour"]) and m["kl_behaviour"] >= 0


def test_policy_loss_sequence_mean_weights_rows_equally():
    logp, prox, behav, adv, mask = loss_inputs()
    loss, m = policy_loss(logp, prox, behav, adv, mask, aggregation="seq-mean-token-mean")
    # row 0 keeps 4 tokens, row 1 keeps 1 (the w=10 token is capped): mean of the row means
    want = ((-1.1 - 1.28 + 0.8 + 3.0) / 4 + (-1.0) / 1) / 2
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert m["tokens"] == 5
    with pytest.raises(ValueError):
        policy_loss(logp, prox, behav, adv, mask, aggregation="sum")


def test_policy_loss_gradient_only_through_logprobs():
    logp, prox, behav, adv, mask = loss_inputs()
    for t in (prox, behav, adv):
        t.requires_grad_(True)
    loss, _ = policy_loss(logp, prox, behav, adv, mask)
    loss.backward()
    assert prox.grad is None and behav.grad is None and adv.grad is None
    # d(-w·r·A)/dlogp = -w·r·A / N on unclipped tokens; clipped, capped, dropped, padded → 0
    want = torch.tensor([[-1.1 / 5, 0, 0, 0], [0, -2 * 0.5 / 5, 0, 0]])
    torch.testing.assert_close(logp.grad, want, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(logp.grad).all()


def test_policy_loss_kl_terms():
    logp = torch.zeros(1, 2, requires_grad=True)
    behav = torch.tensor([[-LN(2.0), 0.0]])  # ρ = π_θ/π_b = 2 on token 0, 1 on token 1
    ref = torch.tensor([[LN(0.5), 0.0]])
    adv = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    loss, m = policy_loss(logp, None, behav, adv, mask, kl_coef=0.1, ref_logprobs=ref, iw_cap=None)
    k3_ref = 0.5 + LN(2.0) - 1  # e^q - q - 1, q = ln 0.5
    assert m["kl_ref"] == pytest.approx(k3_ref / 2, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * k3_ref / 2, rel=1e-5)
    assert m["kl_behaviour"] == pytest.approx((1 - LN(2.0)) / 2, rel=1e-5)  # ρ - 1 - ln ρ


def test_policy_loss_num_tokens_and_empty_mask():
    logp, prox, behav, adv, mask = loss_inputs()
    loss, _ = policy_loss(logp, prox, behav, adv, mask, num_tokens=10)
    assert loss.item() == pytest.approx((-1.1 - 1.28 + 0.8 + 3.0 - 1.0) / 10, rel=1e-5)
    loss, m = policy_loss(logp, prox, behav, adv, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0 and m["tokens"] == 0 and m["iw_max"] == 0
