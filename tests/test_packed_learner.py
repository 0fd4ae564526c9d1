"""The learner's packed layouts (``learner.layout``: ``packed``, ``shared_prefix``;
learner/packing.py) against today's padded rows: the same per-token log-probs, and after one
whole update (PolicyStep.update) the same loss, metrics, token log and gradients of every
trained parameter, within float tolerance. On the tiny model (full and LoRA, whole logits
and the chunked head, with and without activation checkpointing, token budgets, several
minibatches, a KL reference, experience-guided rows kept or stripped, a trajectory cut into
contexts), and on SmolLM2 (``slow``). The last tests break the layout on purpose and check
that the comparison fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from autodidact.resolve import learner_settings
from learner import packing
from learner.logprobs import prepare_for_training, token_logprobs
from learner.packing import (
    check_packing,
    enable_packing,
    layout_logprobs,
    pack_rows,
    packed_budget_parts,
    prefix_tree,
)
from learner.step import PolicyStep
from protocol.config import RunConfig
from protocol.messages import Group, Step, Task, Trajectory

PACKED = ("packed", "shared_prefix")
LOGPROB_ATOL = 1e-5  # fp32
SMOLLM2_LOGPROB_ATOL = 5e-5  # 30 layers, 49,152 words: measured up to 2e-5


# --- what the batches look like ---------------------------------------------------------------


def make_groups(vocab: int, seed: int = 0, n_groups: int = 2, size: int = 4,
                scale: int = 1) -> list[Group]:
    """``n_groups`` GRPO groups of ``size`` rollouts in the shape the actors send: every
    group's prompt starts with the same system prompt, then its task; rollout 1 of each group
    had experience injected after the system prompt; the last rollout's context was rebuilt
    once (its second context starts with the opening prompt again); then actions and
    observations of random lengths. Rewards alternate, so every advantage is ±1. ``scale``
    multiplies the lengths."""
    rng = np.random.default_rng(seed)

    def ids(n):
        return [int(x) for x in rng.integers(4, vocab, n)]

    system = ids(12 * scale)
    groups = []
    for g in range(n_groups):
        prompt = system + ids(int(rng.integers(6, 12)) * scale)
        trajs = []
        for i in range(size):
            tokens, span, exp_ids = list(prompt), [], []
            if i == 1:  # guided: an experience block after the system prompt
                at = len(system)
                tokens[at:at] = ids(5)
                span, exp_ids = [at, at + 5], ["e1"]
            mask, steps, contexts = [0] * len(tokens), [], []
            prompt_len = len(tokens)
            for turn in range(int(rng.integers(1, 4)) + (i == size - 1)):
                if i == size - 1 and turn == 1:  # the context is rebuilt
                    contexts.append([len(tokens)] * 3)
                    rebuilt = prompt + ids(3)
                    tokens += rebuilt
                    mask += [0] * len(rebuilt)
                act, obs = int(rng.integers(2, 7)) * scale, int(rng.integers(0, 6)) * scale
                steps.append(Step(action="a", observation="o", start=len(tokens),
                                  end=len(tokens) + act))
                tokens += ids(act + obs)
                mask += [1] * act + [0] * obs
            mask = np.array(mask, dtype=np.uint8)
            trajs.append(Trajectory(
                traj_id=f"{g}/{i}", tokens=np.array(tokens, dtype=np.int32),
                logprobs=np.where(mask, -rng.uniform(0.1, 3.0, len(mask)), 0.0
                                  ).astype(np.float32),
                versions=np.where(mask, 0, -1).astype(np.int32), action_mask=mask,
                prompt_len=prompt_len, steps=steps, reward=float(i % 2),
                experience_span=span, experience_ids=exp_ids, contexts=contexts))
        for t in trajs:
            t.validate()
        groups.append(Group(group_id=f"g{g}", task=Task(task_id=f"t{g}", env="files",
                                                        query="q", seed=g),
                            trajectories=trajs))
    return groups


def random_rows(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows (ids, attention mask, generated-token mask): three share a prompt of
    15, one shares 20 tokens with the first, one only 5, one is a prefix of another and
    one equals another."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [40, 30, 25, 17, 33, 10, 30, 16]
    ids = torch.randint(4, vocab, (len(lengths), max(lengths)), generator=gen)
    ids[1:4, :15] = ids[0, :15]
    ids[4, :20] = ids[0, :20]
    ids[5, :5] = ids[0, :5]
    ids[6] = ids[1]
    ids[7, :16] = ids[0, :16]
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    needed = (torch.rand(ids.shape, generator=gen) < 0.5).long() * mask
    return ids * mask, mask, needed


@pytest.fixture(scope="module")
def tiny(files_policy_path):
    return files_policy_path


def _model(path, checkpointing: bool = False, chunk: int = 0):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).float()
    enable_packing(model)
    prepare_for_training(model, chunk, checkpointing)
    return model.train()


def _scored_with_grads(model, ids, mask, needed, chunk, layout):
    model.zero_grad(set_to_none=True)
    logprobs = layout_logprobs(model, ids, mask, chunk, needed, layout)
    weights = torch.linspace(0.1, 1.0, ids.shape[1])  # every position its own gradient weight
    (logprobs * needed * weights).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


def assert_same_grads(got: dict, want: dict, rtol=1e-4, atol=1e-6, of_largest=0.0):
    """Every gradient elementwise within ``rtol`` and ``atol`` (plus ``of_largest`` times the
    tensor's largest entry), and within ``rtol`` as a whole (relative norm of the error)."""
    assert got.keys() == want.keys()
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=rtol,
                                   atol=atol + of_largest * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")
        error = float((got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30))
        assert error <= rtol, (name, error)


# --- the prefix tree --------------------------------------------------------------------------


def test_prefix_tree_lays_out_shared_tokens_once():
    a = np.array([1, 2, 3, 4, 5, 6])
    rows = [a, np.array([1, 2, 3, 4, 9]), np.array([1, 2, 7]), np.array([1, 2, 3, 4, 5, 6]),
            np.array([1, 2, 3]), np.array([8, 8]), np.array([], dtype=np.int64)]
    nodes, paths = prefix_tree(rows)
    spans = [(n.lo, n.hi) for n in nodes]
    # Every row's path covers its tokens in order, and every row ends in a node of its own.
    for row, path in zip(rows, paths):
        assert [i for k in path for i in range(nodes[k].lo, nodes[k].hi)] == \
            list(range(len(row)))
        if len(row):
            assert sum(paths[k].count(path[-1]) for k in range(len(rows))) == 1
            for k in path:
                n = nodes[k]
                assert (rows[n.row][n.lo:n.hi] == row[n.lo:n.hi]).all()
    assert paths[6] == []
    # [1, 2] once for rows 0-4; [3, 4] once for rows 0, 1, 3 (row 4 ends at 3: its own node)
    assert paths[0][0] == paths[1][0] == paths[2][0] == paths[4][0]
    assert spans[paths[0][0]] == (0, 2)
    assert paths[0][1] == paths[1][1] == paths[3][1] and spans[paths[0][1]] == (2, 4)
    # [1 2] [3] (row 4) [3 4] [5] (rows 0, 3) [6] (row 0) [6] (row 3) [9] [7] [8 8]
    assert sum(n.hi - n.lo for n in nodes) == 2 + 1 + 2 + 1 + 1 + 1 + 1 + 1 + 2
    plain, plain_paths = prefix_tree(rows, share=False)
    assert [(n.lo, n.hi) for n in plain] == [(0, len(r)) for r in rows if len(r)]
    assert plain_paths[6] == [] and plain_paths[5] == [5]


def test_packed_rows_positions_and_index():
    ids, mask, _ = random_rows(50)
    lengths = mask.sum(1).numpy()
    for share in (False, True):
        packed = pack_rows(ids.numpy(), lengths, share)
        index = packed.index
        assert packed.row_tokens == int(lengths.sum())
        for b, n in enumerate(lengths):
            # each row token is where the index says, at its own position
            assert (packed.input_ids[0, index[b, :n]] == ids[b, :n]).all()
            assert (packed.position_ids[0, index[b, :n]] == torch.arange(n)).all()
            assert (index[b, n:] == -1).all()
        assert sorted(packed.attention.order.tolist()) == list(range(packed.tokens))
    assert pack_rows(ids.numpy(), lengths, False).tokens == int(lengths.sum())
    shared = pack_rows(ids.numpy(), lengths, True)
    assert shared.tokens < int(lengths.sum()) - 3 * 15


def test_budget_parts_count_packed_tokens():
    ids, mask, _ = random_rows(50)
    lengths = mask.sum(1)
    rows = torch.arange(len(ids))
    for share in (False, True):
        parts = packed_budget_parts(rows, lengths, ids, 60, share)
        assert sorted(torch.cat(parts).tolist()) == rows.tolist()
        for part in parts:
            packed = pack_rows(ids[part].numpy(), lengths[part].numpy(), share)
            assert packed.tokens <= 60 or len(part) == 1
    # sharing fits the same rows into fewer parts
    assert len(packed_budget_parts(rows, lengths, ids, 60, True)) < \
        len(packed_budget_parts(rows, lengths, ids, 60, False))


# --- log-probs and gradients of one forward ----------------------------------------------------


@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize("chunk,checkpointing", [(0, False), (7, False), (0, True), (7, True)])
def test_logprobs_and_gradients_equal_padded(tiny, layout, chunk, checkpointing):
    model = _model(tiny, checkpointing, chunk)
    ids, mask, needed = random_rows(model.config.vocab_size)
    want, want_grads = _scored_with_grads(model, ids, mask, needed, chunk, "padded")
    got, grads = _scored_with_grads(model, ids, mask, needed, chunk, layout)
    torch.testing.assert_close(got, want, rtol=0, atol=LOGPROB_ATOL)
    assert (got[mask == 0] == 0).all() and (got[:, 0] == 0).all()
    if chunk:  # only the needed positions are scored
        assert (got[(needed == 0)] == 0).all()
    assert_same_grads(grads, want_grads)


def test_a_forward_without_a_layout_is_transformers_sdpa(tiny):
    plain = AutoModelForCausalLM.from_pretrained(tiny).float().eval()
    model = _model(tiny).eval()
    ids, mask, _ = random_rows(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, ids, mask),
                                   token_logprobs(plain, ids, mask), rtol=0, atol=0)


def test_a_model_that_ignores_the_layout_is_refused(tiny):
    model = _model(tiny)
    check_packing(model)
    model.set_attn_implementation("sdpa")  # the layout never reaches its attention
    with pytest.raises(ValueError, match="learner.layout=padded"):
        check_packing(model)


# --- one whole update --------------------------------------------------------------------------


def make_step(model_path: str, layout: str, experience: str = "discard", **learner) -> PolicyStep:
    cfg = RunConfig()
    cfg.model.path = model_path
    cfg.experience.train_context = experience
    cfg.learner.warmup_updates = 1
    cfg.learner.layout = layout
    # No KL penalty unless a test asks for one (the default's 0.1): the hand computations,
    # layout comparisons and diagnostics of the tests that use this step are of the loss
    # without it.
    cfg.learner.kl_coef = 0.0
    for name, value in learner.items():
        setattr(cfg.learner, name, value)
    cfg.learner.check()
    return PolicyStep(learner_settings(cfg))


def compare_updates(model_path: str, layout: str, groups, experience="discard", rtol=1e-4,
                    atol=1e-6, logprob_atol=LOGPROB_ATOL, of_largest=0.0, **learner):
    """One update (probe on) of a padded step and of a ``layout`` step from the same start:
    the same metrics, token log and gradients (as the optimizer step used them)."""
    done = {}
    for name in ("padded", layout):
        step = make_step(model_path, name, experience, **learner)
        metrics, stats = step.update(groups, None, 0.0, probe=True)
        grads = {n: p.grad.clone() for n, p in step.model.named_parameters()
                 if p.grad is not None}
        done[name] = (metrics, stats, grads)
        del step
    (want_m, want_s, want_g), (got_m, got_s, got_g) = done["padded"], done[layout]
    assert want_g, "nothing trained"
    assert got_m.keys() == want_m.keys()
    # A token budget cuts the rows into other micro-batches in a packed layout (it counts the
    # packed tokens): the step's loss and gradient are the same, but the other metrics are
    # means of the micro-batches' means, and the probe re-scores the last micro-batch.
    same = want_m.keys() if not learner.get("micro_batch_tokens") else \
        ("loss", "pg_loss", "tokens", "grad_norm")
    for key in same:
        assert got_m[key] == pytest.approx(want_m[key], rel=rtol, abs=max(atol, 1e-6)), key
    assert {k: v for k, v in got_s.items() if k != "token_logprobs"} == \
        {k: v for k, v in want_s.items() if k != "token_logprobs"}
    for got_group, want_group in zip(got_s["token_logprobs"], want_s["token_logprobs"]):
        for got, want in zip(got_group, want_group):
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_allclose(got, want, rtol=0, atol=logprob_atol, equal_nan=True)
    assert_same_grads(got_g, want_g, rtol=rtol, atol=atol, of_largest=of_largest)
    return want_m, want_s


SETTINGS = {
    "plain": {},
    "chunked+checkpointing+budget": {"logit_chunk_tokens": 16, "gradient_checkpointing": True,
                                     "micro_batch_tokens": 80},
    "minibatches+kl+token-mean": {"minibatches": 2, "kl_coef": 0.1,
                                  "loss_aggregation": "token-mean", "accumulation": 2},
}


@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_update_equals_padded(tiny, layout, lora_rank, settings):
    vocab = AutoModelForCausalLM.from_pretrained(tiny).config.vocab_size
    groups = make_groups(vocab)
    _, stats = compare_updates(tiny, layout, groups, lora_rank=lora_rank,
                               **SETTINGS[settings])
    assert stats["stripped_trajectories"] == 2 and stats["rows"] == 10  # 2 rows cut in two


@pytest.mark.parametrize("layout", PACKED)
def test_update_equals_padded_with_guided_rows_kept(tiny, layout):
    vocab = AutoModelForCausalLM.from_pretrained(tiny).config.vocab_size
    _, stats = compare_updates(tiny, layout, make_groups(vocab, seed=1), experience="keep",
                               logit_chunk_tokens=16, micro_batch_tokens=120)
    assert stats["guided_trajectories"] == 2 and stats["stripped_trajectories"] == 0


# --- the tests can fail ------------------------------------------------------------------------


def _broken_masks(how: str):
    real = packing._attention

    def broken(nodes, index, total):
        attention = real(nodes, index, total)
        if how == "see siblings":  # every query sees every key of its batch
            attention.masks = [torch.ones_like(m) for m in attention.masks]
        return attention

    return broken


@pytest.mark.parametrize("how", ["see siblings", "positions run on"])
def test_a_broken_layout_fails_the_comparison(tiny, monkeypatch, how):
    if how == "see siblings":
        monkeypatch.setattr(packing, "_attention", _broken_masks(how))
    else:
        real = packing.pack_rows

        def restarted(input_ids, lengths, share):  # one long sequence's positions
            packed = real(input_ids, lengths, share)
            packed.position_ids = torch.arange(packed.tokens)[None]
            return packed

        monkeypatch.setattr(packing, "pack_rows", restarted)
    model = _model(tiny)
    ids, mask, needed = random_rows(model.config.vocab_size)
    want, _ = _scored_with_grads(model, ids, mask, needed, 0, "padded")
    got, _ = _scored_with_grads(model, ids, mask, needed, 0, "shared_prefix")
    assert (got - want).abs().max() > 100 * LOGPROB_ATOL
    with pytest.raises(ValueError, match="differ from the padded ones"):
        check_packing(model)


# --- SmolLM2 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path():
    from inference.models import model_folder

    return model_folder("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_padded(smollm2_path):
    """SmolLM2 with the chunked head and checkpointing, random rows, and the padded path's
    log-probs and gradients on them: loaded and scored once for both layouts."""
    model = _model(smollm2_path, checkpointing=True, chunk=64)
    ids, mask, needed = random_rows(model.config.vocab_size, seed=1)
    return model, (ids, mask, needed), _scored_with_grads(model, ids, mask, needed, 64, "padded")


@pytest.mark.slow
@pytest.mark.parametrize("layout", PACKED)
def test_smollm2_logprobs_and_gradients_equal_padded(smollm2_padded, layout):
    """The whole model, chunked head and activation checkpointing, as configs/smollm2.yaml.
    30 layers and a 49,152-word head in float32 round differently in another layout: log-probs
    within 5e-5 (measured up to 2e-5), every gradient within 1e-4 of its norm (measured up to
    1.3e-5) and elementwise within 1e-5 of its largest entry."""
    model, (ids, mask, needed), (want, want_grads) = smollm2_padded
    got, grads = _scored_with_grads(model, ids, mask, needed, 64, layout)
    torch.testing.assert_close(got, want, rtol=0, atol=SMOLLM2_LOGPROB_ATOL)
    assert_same_grads(grads, want_grads, rtol=1e-4, atol=0.0, of_largest=1e-5)


@pytest.mark.slow
def test_smollm2_lora_update_equals_padded(smollm2_path):
    """configs/smollm2.yaml's learner with a LoRA adapter, one update, shared prefixes."""
    groups = make_groups(49152, seed=2, n_groups=2, size=3)
    compare_updates(smollm2_path, "shared_prefix", groups, rtol=1e-4, atol=0.0,
                    of_largest=1e-5, logprob_atol=SMOLLM2_LOGPROB_ATOL, lora_rank=8,
                    lora_alpha=16.0, logit_chunk_tokens=64, gradient_checkpointing=True,
                    micro_batch_tokens=160)
