"""What the learner logs for "why RL moved or stalled" (autodidact/diagnosis.py), on the tiny
model: ``learner/entropy`` against a hand computation in every layout, without anything more
kept for the backward pass, and ``learner/kl_initial`` (0 at the first update, > 0 after the
policy moved; every ``learner.diagnostics_every`` updates; with and without LoRA)."""

from __future__ import annotations

import pytest
import torch
from test_packed_learner import _model, make_groups, make_step, random_rows
from transformers import AutoModelForCausalLM

from learner.batching import build_batch
from learner.packing import LAYOUTS, layout_logprobs


@pytest.fixture(scope="module")
def tiny(files_policy_path):
    return files_policy_path


@pytest.fixture(scope="module")
def groups(tiny):
    return make_groups(AutoModelForCausalLM.from_pretrained(tiny).config.vocab_size)


def hand_entropy(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``H[b, t]`` of the distribution token t was drawn from, in float64 from the model's own
    logits: ``-Σ p log p`` with ``p = softmax(logits[b, t - 1])``; 0 at position 0."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    p = torch.softmax(logits, dim=-1)
    h = -(p * torch.log(p)).sum(-1)
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk,checkpointing", [(0, False), (7, True)])
def test_entropy_equals_a_hand_computation(tiny, layout, chunk, checkpointing):
    model = _model(tiny, checkpointing, chunk)
    ids, mask, needed = random_rows(model.config.vocab_size)
    logprobs, entropy = layout_logprobs(model, ids, mask, chunk, needed, layout, entropy=True)
    want = hand_entropy(model, ids, mask)
    scored = mask.bool() & needed.bool() if chunk else mask.bool().clone()
    scored[:, 0] = False
    torch.testing.assert_close(entropy[scored].double(), want[scored], rtol=0, atol=1e-4)
    assert (entropy[~scored] == 0).all()
    assert float(want[scored].min()) > 1.0  # a tiny random model: far from 0, the check bites
    assert not entropy.requires_grad
    # the log-probs are the ones asked for alone, and still train
    alone = layout_logprobs(model, ids, mask, chunk, needed, layout)
    torch.testing.assert_close(logprobs, alone, rtol=0, atol=0)
    (logprobs * needed).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [0, 7])
def test_entropy_keeps_nothing_for_the_backward_pass(tiny, layout, chunk):
    """The tensors autograd saves for the backward pass are the same, to the byte, with the
    entropy asked for and without it."""
    model = _model(tiny, False, chunk)
    ids, mask, needed = random_rows(model.config.vocab_size)

    def saved(entropy: bool) -> list[tuple]:
        shapes = []

        def pack(t):
            shapes.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layout_logprobs(model, ids, mask, chunk, needed, layout, entropy=entropy)
        return shapes

    plain = saved(False)
    assert plain, "the hook saw nothing saved: the comparison would pass vacuously"
    assert saved(True) == plain


STEP_SETTINGS = {
    "padded": ("padded", {}),
    "packed": ("packed", {}),
    "shared_prefix+chunked+budget": ("shared_prefix", {"logit_chunk_tokens": 16,
                                                       "micro_batch_tokens": 80}),
    "padded+lora": ("padded", {"lora_rank": 4}),
}


@pytest.mark.parametrize("name", list(STEP_SETTINGS))
def test_the_step_logs_the_entropy_of_its_trained_tokens(tiny, groups, name):
    layout, extra = STEP_SETTINGS[name]
    step = make_step(tiny, layout, **extra)
    batch, _ = build_batch(groups, step.pad_id, labels=None, alpha=0.0,
                           experience=step.settings.experience_context)
    plain = AutoModelForCausalLM.from_pretrained(tiny).float().eval()
    h = hand_entropy(plain, batch.input_ids, batch.attention_mask)
    trained = batch.action_mask.double()
    want = float((h * trained).sum() / trained.sum())
    metrics, _ = step.update(groups, None, 0.0, probe=False)
    assert metrics["entropy"] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_kl_initial_is_zero_at_first_and_grows_as_the_policy_moves(tiny, groups, lora_rank):
    step = make_step(tiny, "padded", lora_rank=lora_rank, diagnostics_every=2, lr=1e-2)
    seen = [step.update(groups, None, 0.0, probe=False)[0] for _ in range(5)]
    assert [("kl_initial" in m) for m in seen] == [True, False, True, False, True]
    first, *later = [m["kl_initial"] for m in seen if "kl_initial" in m]
    assert first == pytest.approx(0.0, abs=1e-6)  # version 0 is the initial policy
    assert all(k > 1e-4 for k in later), later
    assert later[-1] > later[0]  # five steps of lr 1e-2 on one batch: further each time
    assert all("kl_ref" not in m for m in seen)  # no penalty: the loss has no KL term


def test_no_diagnostics_keeps_no_reference_and_a_penalty_logs_kl_ref(tiny, groups):
    off = make_step(tiny, "padded", diagnostics_every=0)
    assert off.reference is None
    assert "kl_initial" not in off.update(groups, None, 0.0, probe=False)[0]
    penalised = make_step(tiny, "padded", kl_coef=0.1, diagnostics_every=1)
    m = penalised.update(groups, None, 0.0, probe=False)[0]
    assert "kl_ref" in m and "kl_initial" not in m
