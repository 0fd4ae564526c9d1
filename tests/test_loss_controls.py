"""The loss's controls of issue 54 (learner.ratio_level, entropy_coef, advantage_std,
lr_schedule, kl_estimator): each one's math against a hand computation on small tensors, the
defaults giving exactly the loss from before they existed, the configs refused, the learning
rate across a checkpoint, and one tiny learner step per setting in every layout.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_learner_diagnostics import hand_entropy
from test_packed_learner import _model, make_groups, make_step, random_rows
from transformers import AutoModelForCausalLM

from learner.advantages import composite_step_advantages, grpo_advantages
from learner.batching import build_batch
from learner.checkpoint import read_checkpoint, rng_states, save_checkpoint
from learner.logprobs import _entropy_grad, token_logprobs
from learner.losses import kl_estimate, policy_loss
from learner.packing import LAYOUTS, layout_logprobs
from learner.step import lr_factor
from protocol.config import ConfigError, load_config
from protocol.messages import StepLabels

LN = math.log


# --- the defaults: exactly the loss from before the controls ---------------------------------


def golden_inputs():
    """Small ``[3, 6]`` tensors made without a random generator (the same on every machine):
    importance weights above ``iw_cap`` on some tokens, ratios past the dual clip on others,
    per-token advantages on the last row, a padded position on each row."""
    b, n = 3, 6
    i = torch.arange(b * n, dtype=torch.float64).reshape(b, n)
    behaviour = (-1.0 - 0.5 * torch.sin(i)).float()
    proximal = (behaviour.double() + 1.9 * torch.sin(1.7 * i + 0.3)).float()
    logp = (proximal.double() + 1.3 * torch.cos(2.3 * i)).float()
    ref = (logp.double() - 0.4 * torch.sin(0.7 * i + 1.0)).float()
    adv = torch.tensor([[1.0] * n, [-0.5] * n, [0.2, 0.2, -1.3, -1.3, 0.7, 0.7]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0]]).float()
    clip = torch.full((b, n), 0.28)
    clip[1] = 0.6
    guided, row_weight = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([1.0, 0.4, 0.6])
    return logp, proximal, behaviour, ref, adv, mask, clip, guided, row_weight


GOLDEN_CASES = {
    "defaults": lambda x: {},
    "kl_guided_token": lambda x: dict(kl_coef=0.1, ref_logprobs=x[3], clip_high=x[6],
                                      guided=x[7]),
    "seq_sum": lambda x: dict(aggregation="seq-mean-token-mean", reduction="sum",
                              row_weight=x[8], kl_coef=0.05, ref_logprobs=x[3]),
    "plain_ppo": lambda x: dict(dual_clip=None, iw_cap=None, num_tokens=20),
}

# (loss, pg_loss, clip_fraction, dual_clip_fraction, iw_masked_fraction, d loss / d logp),
# written by policy_loss as it was before issue 54's controls (commit 5e5c53f) on
# golden_inputs().
GOLDEN = {
    "defaults": (-0.2614845931529999, -0.2614845931529999, 0.5, 0.10000000149011612,
                 0.1666666716337204,
                 [0.0, 0.0, -0.031585034, 0.0, -0.112495661, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                  0.0, 0.0, -0.0100912768, 0.0638442636, 0.0, 0.0, -0.0]),
    "kl_guided_token": (-0.2570874094963074, -0.2614845931529999, 0.5, 0.10000000149011612,
                        0.1666666716337204,
                        [0.0, 0.0, -0.0292174146, 0.000164947473, -0.115268596,
                         -0.00478476472, 0.0, 0.0, 0.0, 0.00288354, 0.0, 0.00232938072, 0.0,
                         -0.0129318936, 0.0590393431, -0.00419324264, -0.00154066458, -0.0]),
    "seq_sum": (-0.8261803388595581, -0.8304563760757446, 0.5, 0.10000000149011612,
                0.1666666716337204,
                [0.0, 0.0, -0.0760030597, 0.000206184573, -0.284705311, -0.00598095451, 0.0,
                 0.0, 0.0, 0.00288354, 0.0, 0.00232938072, 0.0, -0.0172673762, 0.092162706,
                 -0.00314493198, -0.00115549844, -0.0]),
    "plain_ppo": (0.47865891456604004, 0.47865891456604004, 0.3333333432674408, 0.0, 0.0,
                  [0.0, 0.0, -0.015792517, -0.0332552716, -0.0562478304, 0.0, 0.0, 0.0,
                   0.511078, 0.0214298647, 0.0, 0.119761325, 0.0, -0.00504563842, 0.0,
                   0.057530988, 0.0, 0.0]),
}


@pytest.mark.parametrize("name", list(GOLDEN))
@pytest.mark.parametrize("explicit", [False, True], ids=["implicit", "explicit"])
def test_the_defaults_give_the_loss_from_before_the_controls(name, explicit):
    """Left out or named at their defaults, the new arguments change no value or gradient."""
    x = golden_inputs()
    logp = x[0].clone().requires_grad_(True)
    kwargs = GOLDEN_CASES[name](x)
    if explicit:
        kwargs.update(ratio_level="token", kl_estimator="k3", entropy=None, entropy_coef=0.0)
    loss, m = policy_loss(logp, None if name == "plain_ppo" else x[1], x[2], x[4], x[5],
                          **kwargs)
    loss.backward()
    want_loss, want_pg, clip, dual, masked, grad = GOLDEN[name]
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert m["pg_loss"] == pytest.approx(want_pg, rel=1e-6)
    assert (m["clip_fraction"], m["dual_clip_fraction"], m["iw_masked_fraction"]) == \
        pytest.approx((clip, dual, masked), rel=1e-6)
    torch.testing.assert_close(logp.grad.flatten(), torch.tensor(grad), rtol=1e-6, atol=1e-8)
    assert "kl_penalty" not in m


def test_the_constant_schedule_is_the_warmup_from_before():
    for warmup_updates in (0, 1, 3, 10):
        warmup = max(warmup_updates, 1)  # the lambda learner/step.py had before lr_schedule
        new = lr_factor("constant", warmup_updates, 7, 0.0)
        assert [new(k) for k in range(40)] == [min(1.0, (k + 1) / warmup) for k in range(40)]


def test_group_std_is_the_default_advantage():
    rewards = [0.2, 1.0, 0.0, 0.7]
    r = np.array(rewards)
    np.testing.assert_array_equal(grpo_advantages(rewards),
                                  (r - r.mean()) / (r.std() + 1e-6))
    np.testing.assert_array_equal(grpo_advantages(rewards), grpo_advantages(rewards, std="group"))


# --- sequence-level ratio (GSPO) -----------------------------------------------------------


def sequence_inputs():
    """Two rows of 3 trained tokens (a padded 4th), one advantage per row."""
    behaviour = torch.full((2, 4), -1.0)
    prox = behaviour + torch.tensor([[0.1, -0.3, 0.5, 0.0], [0.2, 0.0, -0.2, 0.0]])
    logp = prox + torch.tensor([[0.05, -0.02, 0.03, 0.0], [-0.01, 0.004, 0.0, 0.0]])
    adv = torch.tensor([[1.0] * 4, [-2.0] * 4])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0]])
    return logp.requires_grad_(True), prox, behaviour, adv, mask


def test_sequence_ratio_value_and_gradient_by_hand():
    """GSPO: one ratio and one importance weight per row, the geometric means of its tokens';
    each token's gradient is ``-w_i·s_i·A_i / (n_i·rows)`` where the clip does not bind."""
    logp, prox, behav, adv, mask = sequence_inputs()
    loss, m = policy_loss(logp, prox, behav, adv, mask, clip_low=0.1, clip_high=0.1,
                          aggregation="seq-mean-token-mean", ratio_level="sequence")
    loss.backward()
    d = (logp - prox).detach()[:, :3].mean(1)  # mean log ratio per row
    s = torch.exp(d)
    w = torch.exp((prox - behav)[:, :3].mean(1))
    assert (s - 1).abs().max() < 0.1  # inside the clip: the surrogate is s·A
    want = ((-w * s * adv[:, 0]).sum() / 2).item()
    assert loss.item() == pytest.approx(want, rel=1e-6)
    grad = (-w * s * adv[:, 0] / (3 * 2))[:, None].expand(2, 3)
    torch.testing.assert_close(logp.grad[:, :3], grad, rtol=1e-5, atol=1e-8)
    assert (logp.grad[:, 3] == 0).all()
    # GSPO's own objective, s_i through the mean of the row's log-ratios: the same gradient
    exact = logp.detach().clone().requires_grad_(True)
    s_exact = torch.exp(((exact - prox)[:, :3]).mean(1))
    (-(w * s_exact * adv[:, 0]).sum() / 2).backward()
    torch.testing.assert_close(logp.grad, exact.grad, rtol=1e-5, atol=1e-8)
    assert m["iw_mean"] == pytest.approx(float(w.mean()), rel=1e-5)


def test_sequence_clip_decides_per_row_where_tokens_would_differ():
    """Row 0's tokens move by +0.05, -0.02, +0.03 (mean +0.02): past a 0.01 clip as a
    sequence, so all its (positive-advantage) tokens stop; token by token the -0.02 one
    would still train. Row 1's mean (-0.002) is inside it: every token trains."""
    logp, prox, behav, adv, mask = sequence_inputs()
    kwargs = dict(clip_low=0.01, clip_high=0.01, dual_clip=None)
    loss, m = policy_loss(logp, prox, behav, adv, mask, ratio_level="sequence", **kwargs)
    loss.backward()
    assert (logp.grad[0] == 0).all() and (logp.grad[1, :3] != 0).all()
    assert m["clip_fraction"] == pytest.approx(3 / 6)
    by_token = logp.detach().clone().requires_grad_(True)
    policy_loss(by_token, prox, behav, adv, mask, **kwargs)[0].backward()
    assert by_token.grad[0, 1] != 0  # the token-level clip lets the -0.02 token train


def test_sequence_importance_weight_drops_whole_rows():
    """iw_cap applies to the row's geometric-mean weight: a row whose one token is over the
    cap is kept when its mean is under it, and a row under it token by token on two of three
    tokens but over it on the mean is dropped whole."""
    logp = torch.zeros(2, 3, requires_grad=True)
    behav = torch.tensor([[-LN(9.0), 0.0, 0.0], [-LN(4.0), -LN(4.0), -LN(1000.0)]])
    prox = torch.zeros(2, 3)
    adv, mask = torch.ones(2, 3), torch.ones(2, 3)
    _, token = policy_loss(logp, prox, behav, adv, mask, iw_cap=5.0)
    loss, seq = policy_loss(logp, prox, behav, adv, mask, iw_cap=5.0, ratio_level="sequence")
    assert token["iw_masked_fraction"] == pytest.approx(2 / 6)  # the 9 and the 1000
    assert seq["iw_masked_fraction"] == pytest.approx(3 / 6)  # row 1: (4·4·1000)^(1/3) ≈ 25
    assert seq["tokens"] == 3
    loss.backward()
    assert (logp.grad[1] == 0).all() and (logp.grad[0] != 0).all()
    w0 = 9.0 ** (1 / 3)  # row 0's weight: the geometric mean of 9, 1, 1
    torch.testing.assert_close(logp.grad[0], torch.full((3,), -w0 / 3), rtol=1e-5, atol=0)


def test_sequence_with_step_advantages_keeps_each_tokens_own():
    """GSPO-token: the ratio is the row's, the advantage and gradient each token's own."""
    logp, prox, behav, adv, mask = sequence_inputs()
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.0], [0.5, 0.5, -0.5, 0.0]])
    loss, _ = policy_loss(logp, prox, behav, adv, mask, clip_low=0.1, clip_high=0.1,
                          iw_cap=None, ratio_level="sequence")
    loss.backward()
    s = torch.exp((logp - prox).detach()[:, :3].mean(1, keepdim=True))
    w = torch.exp((prox - behav)[:, :3].mean(1, keepdim=True))
    torch.testing.assert_close(logp.grad[:, :3], -w * s * adv[:, :3] / 6, rtol=1e-5,
                               atol=1e-8)
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(logp, prox, behav, adv, mask, ratio_level="row")


# --- entropy bonus -----------------------------------------------------------------------------


def test_entropy_term_value_and_gradient_by_hand():
    logp = torch.zeros(2, 3, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, 0.5], [0.3, 0.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    zero = torch.zeros(2, 3)
    loss, m = policy_loss(logp, None, zero, zero, mask, entropy=entropy, entropy_coef=0.1,
                          aggregation="seq-mean-token-mean")
    # the pg term is 0 (A = 0): -0.1 times the mean of the row means over trained tokens
    assert loss.item() == pytest.approx(-0.1 * ((1.0 + 2.0 + 0.5) / 3 + 0.3) / 2, rel=1e-6)
    assert m["pg_loss"] == 0
    loss.backward()
    want = -0.1 * torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0]])
    torch.testing.assert_close(entropy.grad, want, rtol=1e-6, atol=0)  # descent raises H
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, None, zero, zero, mask, entropy_coef=0.1)


def test_the_entropy_term_raises_the_entropy():
    """Gradient descent on the loss with only the entropy term (A = 0), through the
    learner's differentiable entropy of real logits: the distributions flatten."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 11)).requires_grad_(True)
    entropies = []
    for _ in range(3):
        h = _entropy_grad(logits[None])  # [1, 5]
        zero = torch.zeros(1, 5)
        loss, _ = policy_loss(zero.clone().requires_grad_(True), None, zero, zero,
                              torch.ones(1, 5), entropy=h, entropy_coef=1.0)
        logits.grad = None
        loss.backward()
        entropies.append(float(h.detach().mean()))
        with torch.no_grad():
            logits -= 0.5 * logits.grad
    assert entropies[0] < entropies[1] < entropies[2]


@pytest.fixture(scope="module")
def tiny(files_policy_path):
    return files_policy_path


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [0, 7])
def test_differentiable_entropy_matches_a_hand_computation(tiny, layout, chunk):
    """``entropy_grad``: the same values as the detached entropy at the trained positions,
    and the gradient of their sum is the one autograd gives through the model's own
    logits."""
    model = _model(tiny, False, chunk)
    ids, mask, needed = random_rows(model.config.vocab_size)
    _, entropy = layout_logprobs(model, ids, mask, chunk, needed, layout, entropy_grad=True)
    scored = mask.bool() & needed.bool()
    scored[:, 0] = False
    want = hand_entropy(model, ids, mask)
    torch.testing.assert_close(entropy[scored].double(), want[scored], rtol=0, atol=1e-4)
    assert (entropy[~scored] == 0).all() and entropy.requires_grad
    weights = torch.linspace(0.1, 1.0, ids.shape[1])
    model.zero_grad(set_to_none=True)
    (entropy * weights).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    p = torch.softmax(logits, -1)
    h = -(p * torch.log_softmax(logits, -1)).sum(-1)
    h = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    (torch.where(scored, h, 0.0) * weights).sum().backward()
    assert got
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(got[name], param.grad, rtol=1e-3, atol=1e-5)


# --- advantages without the std (Dr. GRPO) -----------------------------------------------------


def test_advantages_without_std_are_only_centred():
    np.testing.assert_allclose(grpo_advantages([1.0, 0, 0, 0], std="none"),
                               [0.75, -0.25, -0.25, -0.25])
    np.testing.assert_array_equal(grpo_advantages([0.4, 0.4], std="none"), [0, 0])
    # a small spread stays small without the std, and becomes ±1 with it
    np.testing.assert_allclose(grpo_advantages([0.50, 0.52], std="none"), [-0.01, 0.01],
                               atol=1e-12)
    np.testing.assert_allclose(grpo_advantages([0.50, 0.52]), [-1, 1], atol=1e-4)
    with pytest.raises(ValueError, match="std"):
        grpo_advantages([1.0, 0.0], std="batch")


def test_composite_without_std_centres_only_the_outcome():
    """Labels [[GOOD, BAD], [GOOD]], outcomes [1, 0], α = 0.5: the process reward is
    z-scored as before (μ = 0.5, σ = √0.75), the outcome only centred (±0.5)."""
    sigma = math.sqrt(0.75)
    p0 = [(1 - 0.5) / sigma, (-1 - 0.5) / sigma]
    p1 = [(1 - 0.5) / sigma]
    r0 = [0.5 * p0[0], 0.5 * p0[1] + 0.5]
    r1 = [0.5 * p1[0] - 0.5]
    a0, a1 = composite_step_advantages([[1, 0], [1]], [1.0, 0.0], alpha=0.5, std="none")
    np.testing.assert_allclose(a0, [r0[0] + r0[1], r0[1]], rtol=1e-5)
    np.testing.assert_allclose(a1, r1, rtol=1e-5)
    g0, _ = composite_step_advantages([[1, 0], [1]], [1.0, 0.0], alpha=0.5)
    assert g0[-1] == pytest.approx(0.5 * p0[1] + 1.0, rel=1e-5)  # ±1 with the std


def test_build_batch_passes_the_std_choice_to_both_estimators(tiny):
    vocab = AutoModelForCausalLM.from_pretrained(tiny).config.vocab_size
    groups = make_groups(vocab, n_groups=1)
    labels = [StepLabels(group_id="g0", labels=[[1] * len(t.steps)
                                                for t in groups[0].trajectories])]
    for given in (None, labels):
        group, _ = build_batch(groups, 0, labels=given, alpha=0.1)
        none, _ = build_batch(groups, 0, labels=given, alpha=0.1, advantage_std="none")
        # rewards 0, 1, 0, 1: std 0.5, so without it every outcome advantage halves
        torch.testing.assert_close(none.advantages, group.advantages * (0.5 + 1e-6),
                                   rtol=1e-5, atol=1e-7)
        assert group.advantages.abs().max() > 0.9


# --- KL estimators ----------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    q = torch.tensor([LN(0.5), 0.0, LN(3.0)])
    torch.testing.assert_close(kl_estimate(q, "k1"), -q)
    torch.testing.assert_close(kl_estimate(q, "k2"), 0.5 * q * q)
    torch.testing.assert_close(kl_estimate(q, "k3"), q.exp() - q - 1)
    with pytest.raises(ValueError):
        kl_estimate(q, "k4")


@pytest.mark.parametrize("estimator, target", [("k1", None), ("k2", "reverse"),
                                               ("k3", "forward")])
def test_kl_estimators_expected_gradients(estimator, target):
    """What each estimator's gradient is in expectation as a loss term, exactly, over a
    categorical π_θ = softmax(θ) with samples from π_θ: k1 none at all, k2 the gradient
    of KL(π_θ‖π_ref), k3 that of KL(π_ref‖π_θ) (the docstring of kl_estimate)."""
    theta = torch.tensor([0.3, -1.0, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5, 0.7], dtype=torch.float64), 0)
    log_pi = torch.log_softmax(theta, 0)
    expected = (log_pi.detach().exp() * kl_estimate(log_ref - log_pi, estimator)).sum()
    (got,) = torch.autograd.grad(expected, theta)
    if target is None:
        torch.testing.assert_close(got, torch.zeros(4, dtype=torch.float64))
        return
    log_pi = torch.log_softmax(theta, 0)  # a graph of its own for the exact KL
    pi, ref = log_pi.exp(), log_ref.exp()
    kl = (pi * (log_pi - log_ref)).sum() if target == "reverse" else \
        (ref * (log_ref - log_pi)).sum()
    (want,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(got, want)
    assert want.abs().max() > 0.1


def test_kl_penalty_with_another_estimator_keeps_kl_ref_on_k3():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[LN(0.5), LN(2.0)]])
    zero, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, m = policy_loss(logp, None, zero, zero, mask, kl_coef=0.1, ref_logprobs=ref,
                          kl_estimator="k2")
    k2 = 0.5 * LN(2.0) ** 2  # the same on both tokens
    assert m["kl_penalty"] == pytest.approx(k2, rel=1e-6)
    assert m["kl_ref"] == pytest.approx(((0.5 + LN(2) - 1) + (2 - LN(2) - 1)) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k2, rel=1e-6)
    loss.backward()  # k2's gradient, q·∇q: towards the reference on each token
    torch.testing.assert_close(logp.grad, 0.1 * torch.tensor([[LN(2.0), -LN(2.0)]]) / 2)
    k1_loss, _ = policy_loss(logp.detach().requires_grad_(True), None, zero, zero, mask,
                             kl_coef=0.1, ref_logprobs=ref, kl_estimator="k1")
    assert k1_loss.item() == pytest.approx(0.1 * (LN(2.0) - LN(2.0)) / 2, abs=1e-7)


# --- learning-rate schedules -------------------------------------------------------------------


def test_decaying_schedules_by_hand():
    """Warm-up of 2, 6 updates, floor 0.1: 0.5, 1, then down to 0.1 at the sixth (k = 5)
    over 4 steps, and 0.1 after (a resumed run with more updates)."""
    cosine = lr_factor("cosine", 2, 6, 0.1)
    linear = lr_factor("linear", 2, 6, 0.1)
    done = [0.25, 0.5, 0.75, 1.0]
    want_cos = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * d)) for d in done]
    want_lin = [0.5, 1.0] + [0.1 + 0.9 * (1 - d) for d in done]
    assert [cosine(k) for k in range(6)] == pytest.approx(want_cos)
    assert [linear(k) for k in range(6)] == pytest.approx(want_lin)
    assert cosine(9) == pytest.approx(0.1) and linear(100) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        lr_factor("step", 2, 6, 0.1)


def _lrs(step, n: int, groups) -> list[float]:
    out = []
    for _ in range(n):
        out.append(step.optimizer.param_groups[0]["lr"])  # what this update steps with
        step.update(groups, None, 0.0, probe=False)
    return out


def test_a_resumed_step_goes_on_down_the_schedule(tiny, tmp_path):
    """Cosine over 6 updates: 3, a checkpoint through its files, a new step that loads it, 3
    more: the learning rates of one uninterrupted run, by hand. A new step that does not
    load it starts the schedule again (what the check would catch)."""
    vocab = AutoModelForCausalLM.from_pretrained(tiny).config.vocab_size
    groups = make_groups(vocab, n_groups=1, size=2)
    settings = dict(lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, max_updates=6)
    factor = lr_factor("cosine", 1, 6, 0.1)
    want = [1e-3 * factor(k) for k in range(6)]
    first = make_step(tiny, "padded", **settings)
    before = _lrs(first, 3, groups)
    save_checkpoint(tmp_path, {**first.state(), "updates": 3, "version": 3, "consumed": [],
                               **rng_states()})
    state, path = read_checkpoint(tmp_path)
    resumed = make_step(tiny, "padded", **settings)
    resumed.load_state(state, path)
    assert before + _lrs(resumed, 3, groups) == pytest.approx(want)
    assert resumed.lr == pytest.approx(1e-4)  # the floor, after the last update
    restarted = make_step(tiny, "padded", **settings)
    assert _lrs(restarted, 1, groups)[0] == pytest.approx(want[0])
    assert want[0] != pytest.approx(want[3])


# --- config refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, names", [
    (["learner.ratio_level=row"], "learner.ratio_level"),
    (["learner.kl_estimator=k4", "learner.kl_coef=0.1"], "learner.kl_estimator"),
    (["learner.advantage_std=batch"], "learner.advantage_std"),
    (["learner.lr_schedule=step"], "learner.lr_schedule"),
    (["learner.seq_clip_low=1.5"], "learner.seq_clip_low"),
    (["learner.seq_clip_high=2"], "learner.seq_clip_high"),
    (["learner.lr_min_ratio=1.5", "learner.lr_schedule=cosine"], "learner.lr_min_ratio"),
    (["learner.entropy_coef=-0.01"], "learner.entropy_coef"),
    # settings that would do nothing
    (["learner.kl_estimator=k2", "learner.kl_coef=0"], "learner.kl_estimator=k2"),
    (["learner.lr_min_ratio=0.1"], "learner.lr_min_ratio"),
    (["learner.lr_schedule=cosine", "learner.warmup_updates=10", "learner.max_updates=10"],
     "learner.lr_schedule=cosine"),
    (["learner.lr_schedule=linear", "learner.warmup_updates=0", "learner.max_updates=1"],
     "learner.lr_schedule=linear"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_controls_that_cannot_work_are_refused_naming_the_field(overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert names in message and "\n" not in message, message


def test_the_controls_load_where_they_work():
    cfg = load_config(overrides=[
        "learner.ratio_level=sequence", "learner.kl_estimator=k1", "learner.kl_coef=0.01",
        "learner.advantage_std=none", "learner.lr_schedule=cosine", "learner.lr_min_ratio=0.1",
        "learner.entropy_coef=0.001", "learner.seq_clip_low=0", "learner.layout=shared_prefix",
        "learner.loss_aggregation=token-mean"])
    assert (cfg.learner.ratio_level, cfg.learner.kl_estimator, cfg.learner.lr_schedule) == \
        ("sequence", "k1", "cosine")


# --- one tiny step per setting, in every layout ------------------------------------------------


@pytest.fixture(scope="module")
def groups(tiny):
    return make_groups(AutoModelForCausalLM.from_pretrained(tiny).config.vocab_size)


def _batch(step, groups):
    return build_batch(groups, step.pad_id, labels=None, alpha=0.0,
                       experience=step.settings.experience_context,
                       advantage_std=step.cfg.advantage_std)[0]


def _row_means(x: torch.Tensor, keep: torch.Tensor, row_weight: torch.Tensor) -> float:
    """seq-mean-token-mean of ``x`` over ``keep``, rows weighted by ``row_weight``."""
    n = keep.sum(1)
    rows = n > 0
    means = (x * keep).sum(1)[rows] / n[rows]
    return float((means * row_weight[rows]).sum() / row_weight[rows].sum())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_sequence_level_loss_by_hand(tiny, groups, layout):
    """One step at ratio 1 (one minibatch): the surrogate is ``-w_i·A`` with ``w_i`` each
    row's geometric-mean importance weight (stripped rows 1), rows over iw_cap dropped."""
    # The tiny model's rows weigh 0.014 to 0.061 (stripped rows 1): a cap between drops some.
    step = make_step(tiny, layout, ratio_level="sequence", iw_cap=0.0195)
    batch = _batch(step, groups)
    plain = AutoModelForCausalLM.from_pretrained(tiny).float().eval()
    with torch.no_grad():
        logp = token_logprobs(plain, batch.input_ids, batch.attention_mask).double()
    act = batch.action_mask.double()
    behaviour = torch.where(batch.stripped[:, None] > 0, logp, batch.behaviour_logprobs)
    w = torch.exp(((logp - behaviour) * act).sum(1) / act.sum(1).clamp(min=1))
    keep = act * (w <= 0.0195)[:, None]
    assert 0 < keep.sum() < act.sum(), "every row kept or none: the cap would not be tested"
    want = _row_means(-w[:, None] * batch.advantages.double(), keep, batch.row_weight.double())
    metrics, _ = step.update(groups, None, 0.0, probe=True)
    assert metrics["pg_loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert metrics["iw_masked_fraction"] == pytest.approx(float(1 - keep.sum() / act.sum()),
                                                          abs=1e-6)
    assert metrics["step_gain"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_entropy_bonus(tiny, groups, layout):
    """``loss - pg_loss`` is ``-entropy_coef`` times the aggregated entropy of the trained
    tokens; with every advantage 0 the term alone moves the policy, and raises its entropy."""
    step = make_step(tiny, layout, entropy_coef=0.5, iw_cap=1e9, lr=1e-2)
    batch = _batch(step, groups)
    plain = AutoModelForCausalLM.from_pretrained(tiny).float().eval()
    h = hand_entropy(plain, batch.input_ids, batch.attention_mask)
    want = -0.5 * _row_means(h, batch.action_mask.double(), batch.row_weight.double())
    metrics, _ = step.update(groups, None, 0.0, probe=False)
    assert metrics["loss"] - metrics["pg_loss"] == pytest.approx(want, abs=1e-4)
    same = [dataclasses.replace(g, trajectories=[dataclasses.replace(t, reward=1.0)
                                                 for t in g.trajectories]) for g in groups]
    # lr 1e-3: the tiny model is near the uniform distribution, and Adam's steps of 1e-2
    # overshoot it (the entropy falls back by the third).
    for coef, rises in ((0.5, True), (0.0, False)):
        step = make_step(tiny, layout, entropy_coef=coef, lr=1e-3)
        seen = [step.update(same, None, 0.0, probe=False)[0]["entropy"] for _ in range(3)]
        if rises:
            assert seen[0] < seen[1] < seen[2], seen
        else:
            assert seen[0] == pytest.approx(seen[2], abs=1e-6), seen  # nothing else moves it


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_advantages_without_std(tiny, groups, layout):
    """Rewards 0, 1, 0, 1 (std 0.5): at ratio 1 the loss is linear in the advantages, so
    without the std it is the loss with it times 0.5 + 1e-6."""
    pg = {std: make_step(tiny, layout, advantage_std=std).update(groups, None, 0.0, False)[0]
          ["pg_loss"] for std in ("group", "none")}
    assert abs(pg["group"]) > 1e-3
    assert pg["none"] == pytest.approx(pg["group"] * (0.5 + 1e-6), rel=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_kl_estimator(tiny, groups, layout):
    """After two steps away from the initial policy, the third logs the penalty's k2 and the
    diagnostic k3 of the tokens it trains, each against a hand computation with the step's
    own weights and its frozen reference."""
    step = make_step(tiny, layout, kl_coef=0.5, kl_estimator="k2", iw_cap=1e9, lr=1e-2)
    for _ in range(2):
        step.update(groups, None, 0.0, probe=False)
    batch = _batch(step, groups)
    with torch.no_grad():
        logp = token_logprobs(step.model, batch.input_ids, batch.attention_mask).double()
        ref = token_logprobs(step.reference, batch.input_ids, batch.attention_mask).double()
    act = batch.action_mask.double()
    q = ref - logp
    metrics, _ = step.update(groups, None, 0.0, probe=False)
    k2 = float((0.5 * q * q * act).sum() / act.sum())
    assert k2 > 1e-5  # the policy moved: the comparison bites
    assert metrics["kl_penalty"] == pytest.approx(k2, rel=1e-3)
    assert metrics["kl_ref"] == pytest.approx(float(((q.exp() - q - 1) * act).sum() / act.sum()),
                                              rel=1e-3)


def test_sequence_level_clips_with_its_own_range(tiny):
    """GSPO's range at sequence level, the guided rows' upper bound widened in the same
    proportion as experience.clip_high widens clip_high (0.6 / 0.28); token level unchanged."""
    token = make_step(tiny, "padded")
    assert token._clip_range() == (0.2, 0.28, 0.6)
    sequence = make_step(tiny, "padded", ratio_level="sequence")
    low, high, guided = sequence._clip_range()
    assert (low, high) == (3e-4, 4e-4)
    assert guided == pytest.approx(4e-4 * 0.6 / 0.28)
