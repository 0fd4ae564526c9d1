"""Inference backends and the tiny local model: generation contract, log-probs, constraints,
in-place weight updates. Everything runs on CPU in a few seconds with a tiny random model."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from inference.backends import ActionTrie, Generation, SamplingParams, TransformersBackend
from inference.tiny_model import make_tiny_model, parameter_count

WORDS = "go north south east west take drop key door open look lamp box red blue inventory".split()
MARKERS = ["<exp>", "</exp>"]
ACTIONS = ["go north", "go north east", "take red key", "open door", "look"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", WORDS, MARKERS)


@pytest.fixture(scope="module")
def backend(model_path):
    with TransformersBackend(model_path) as b:
        yield b


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(backend):
    texts = [
        "go",
        "take key open door look",
        "[BOS] lamp box",
        "north south east west drop key red blue",
    ]
    return [_encode(backend.tokenizer, t) for t in texts]


def _teacher_forced(backend, prompt: list[int], gen: Generation, temperature: float = 1.0):
    """Log-probs of the generated ids from one unpadded forward pass over prompt + generation."""
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = backend.model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(gen.token_ids)[:, None]).squeeze(1)


# -- tiny model --------------------------------------------------------------------------


def test_tiny_model_round_trip(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    text = " ".join(WORDS)
    ids = _encode(tok, text)
    assert len(ids) == len(WORDS)  # word-level: one id per word
    assert tok.decode(ids) == text
    assert _encode(tok, "go xyzzy") == [_encode(tok, "go")[0], tok.unk_token_id]
    # Markers are single ids even without surrounding spaces, and skippable on decode.
    marked = _encode(tok, "look<exp>open door</exp>")
    assert len(marked) == 5
    assert tok.decode(marked, skip_special_tokens=True) == "look open door"
    assert None not in (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    assert model.get_input_embeddings().num_embeddings == len(tok)
    assert parameter_count(model_path) == sum(p.numel() for p in model.parameters())


def test_tiny_model_reused_and_rebuilt(model_path, tmp_path):
    weights = model_path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert make_tiny_model(model_path, WORDS, MARKERS) == model_path
    assert weights.stat().st_mtime_ns == before  # same words and config: untouched

    other = tmp_path / "other"
    make_tiny_model(other, WORDS, hidden=32, layers=1)
    make_tiny_model(other, WORDS + ["extra"], hidden=32, layers=1)  # new fingerprint: rebuilt
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(other))) == 4 + len(WORDS) + 1

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        make_tiny_model(foreign, WORDS)


# -- generation --------------------------------------------------------------------------


def test_generate_batch_of_different_lengths(backend, prompts):
    params = SamplingParams(max_new_tokens=8, seed=3)
    gens = backend.generate(prompts, params)
    eos = backend.tokenizer.eos_token_id
    assert len(gens) == len(prompts)
    for gen in gens:
        assert 1 <= len(gen.token_ids) == len(gen.logprobs) <= 8
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
        assert gen.version == backend.version
        assert eos not in gen.token_ids[:-1]  # nothing after a stop
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] == eos
        else:
            assert gen.finish_reason == "length" and len(gen.token_ids) == 8


def test_stop_tokens_and_length(backend, prompts):
    vocab = len(backend.tokenizer)
    # Every id is a stop id: each sequence ends after exactly one token.
    gens = backend.generate(
        prompts, SamplingParams(max_new_tokens=5, stop_token_ids=range(vocab), seed=0)
    )
    assert all(len(g.token_ids) == 1 and g.finish_reason == "stop" for g in gens)
    # Nothing stops: each sequence runs to max_new_tokens.
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=0))
    assert all(len(g.token_ids) == 6 and g.finish_reason == "length" for g in gens)


def test_same_seed_same_output(backend, prompts):
    params = SamplingParams(max_new_tokens=10, seed=11, top_p=0.9, top_k=8)
    first = backend.generate(prompts, params)
    assert backend.generate(prompts, params) == first
    other = backend.generate(
        prompts, SamplingParams(max_new_tokens=10, seed=12, top_p=0.9, top_k=8)
    )
    assert [g.token_ids for g in other] != [g.token_ids for g in first]


def test_logprobs_equal_teacher_forcing(backend, prompts):
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True))
    for prompt, gen in zip(prompts, gens):
        expected = _teacher_forced(backend, prompt, gen)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)



def test_generation_warns_nothing(backend, prompts):
    """No library deprecation reaches a run's terminal: the KV cache goes to the next forward
    under the name this transformers takes (``cache``, or ``past_key_values`` before it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.generate(prompts, SamplingParams(max_new_tokens=4, seed=0, ignore_eos=True))
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []

def test_logprobs_use_sampling_temperature(backend, prompts):
    gens = backend.generate(prompts, SamplingParams(temperature=0.5, max_new_tokens=6, seed=2))
    for prompt, gen in zip(prompts, gens):
        expected = _teacher_forced(backend, prompt, gen, temperature=0.5)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


def test_raw_logprobs_ignore_temperature_and_constraint(backend, prompts):
    trie = ActionTrie(ACTIONS, backend.tokenizer)
    params = SamplingParams(temperature=1.5, max_new_tokens=10, seed=3, logprobs_mode="raw")
    gens = backend.generate(prompts, params, [trie] * len(prompts))
    for prompt, gen in zip(prompts, gens):
        expected = _teacher_forced(backend, prompt, gen)  # T = 1, no mask: what a learner sees
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)
        assert backend.tokenizer.decode(gen.token_ids, skip_special_tokens=True) in ACTIONS


def test_truncation_to_one_token_is_greedy(backend, prompts):
    greedy = backend.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    top_k1 = backend.generate(prompts, SamplingParams(top_k=1, max_new_tokens=6, seed=1))
    top_p0 = backend.generate(prompts, SamplingParams(top_p=1e-6, max_new_tokens=6, seed=2))
    assert [g.token_ids for g in top_k1] == [g.token_ids for g in greedy]
    assert [g.token_ids for g in top_p0] == [g.token_ids for g in greedy]


# -- constraints -------------------------------------------------------------------------


def test_action_trie_walk(backend):
    tok = backend.tokenizer
    trie = ActionTrie(ACTIONS, tok)
    go, north, east = (_encode(tok, w)[0] for w in ("go", "north", "east"))
    assert sorted(trie.allowed([])) == sorted({_encode(tok, a)[0] for a in ACTIONS})
    assert trie.allowed([go]) == [north]
    assert sorted(trie.allowed([go, north])) == sorted([tok.eos_token_id, east])
    assert trie.allowed([go, north, tok.eos_token_id]) == []
    assert trie.match([go, north, east, tok.eos_token_id]) == "go north east"
    with pytest.raises(ValueError):
        trie.allowed([east])


def test_constrained_generation_yields_allowed_actions(backend, prompts):
    tok = backend.tokenizer
    trie = ActionTrie(ACTIONS, tok)
    batch = prompts * 4
    # Mixed batch: constrained rows must obey, the unconstrained row is left alone.
    constraints = [trie] * (len(batch) - 1) + [None]
    gens = backend.generate(
        batch, SamplingParams(temperature=1.5, max_new_tokens=10, seed=7), constraints
    )
    for gen in gens[:-1]:
        assert gen.finish_reason == "stop" and gen.token_ids[-1] == tok.eos_token_id
        assert tok.decode(gen.token_ids, skip_special_tokens=True) in ACTIONS
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    # A forced step (one allowed id) has probability one under the masked distribution.
    go_north = [g for g in gens[:-1] if trie.match(g.token_ids) == "go north"]
    assert all(abs(g.logprobs[1]) < 1e-6 for g in go_north)


def test_constraint_end_without_stop_token(backend, prompts):
    tok = backend.tokenizer
    # End the actions with a token that is not a stop id: the trie's [] ends the sequence.
    end = _encode(tok, "lamp")[0]
    trie = ActionTrie(["open door", "look"], tok, end_token_id=end)
    gens = backend.generate(
        prompts, SamplingParams(max_new_tokens=10, seed=1), [trie] * len(prompts)
    )
    for gen in gens:
        assert gen.finish_reason == "stop" and gen.token_ids[-1] == end
        assert trie.match(gen.token_ids) in ("open door", "look")


# -- weights -----------------------------------------------------------------------------


def test_load_weights_from_state_dict_and_file(model_path, prompts, tmp_path):
    from safetensors.torch import save_model

    backend = TransformersBackend(model_path, version=0)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    base = backend.generate(prompts, params)
    original = {k: v.clone() for k, v in backend.model.state_dict().items()}
    save_model(backend.model, str(tmp_path / "v0.safetensors"))  # drops the tied duplicate

    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    params_before = [p.data_ptr() for p in backend.model.parameters()]
    backend.load_weights(noisy, version=1)
    assert backend.version == 1
    assert [p.data_ptr() for p in backend.model.parameters()] == params_before  # in place
    changed = backend.generate(prompts, params)
    assert all(g.version == 1 for g in changed)
    assert [g.logprobs for g in changed] != [g.logprobs for g in base]

    backend.load_weights(tmp_path / "v0.safetensors", version=2)
    restored = backend.generate(prompts, params)
    assert backend.version == 2 and all(g.version == 2 for g in restored)
    assert [g.token_ids for g in restored] == [g.token_ids for g in base]
    for got, want in zip(restored, base):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
    backend.close()


def test_bad_weights_are_rejected_intact(model_path, prompts):
    backend = TransformersBackend(model_path, version=4)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    base = backend.generate(prompts, params)
    state = backend.model.state_dict()
    bad_shape = {
        k: torch.zeros(3) if k.endswith("norm.weight") else torch.zeros_like(v)
        for k, v in state.items()
    }
    with pytest.raises(ValueError):
        backend.load_weights(bad_shape, version=5)
    with pytest.raises(KeyError):
        backend.load_weights({"not.a.weight": torch.zeros(1)}, version=5)
    with pytest.raises(KeyError):  # strict: a partial update is refused
        backend.load_weights({"model.norm.weight": torch.ones_like(state["model.norm.weight"])}, 5)
    assert backend.version == 4
    assert backend.generate(prompts, params) == base
    backend.close()
    with pytest.raises(RuntimeError):
        backend.generate(prompts, params)


def test_invalid_inputs(backend, prompts):
    with pytest.raises(ValueError):
        backend.generate([[]], SamplingParams())
    with pytest.raises(ValueError):
        backend.generate(prompts, SamplingParams(), constraints=[None])
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert backend.generate([], SamplingParams()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_cuda(model_path, prompts):
    backend = TransformersBackend(model_path, device="cuda", dtype=torch.float32)
    params = SamplingParams(max_new_tokens=8, seed=0, ignore_eos=True)
    gens = backend.generate(prompts, params)
    assert backend.generate(prompts, params) == gens
    for prompt, gen in zip(prompts, gens):
        ids = torch.tensor([prompt + gen.token_ids], device="cuda")
        with torch.no_grad():
            logits = backend.model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        assert torch.allclose(torch.tensor(gen.logprobs), expected.cpu(), atol=1e-3, rtol=0)
    trie = ActionTrie(ACTIONS, backend.tokenizer)
    for gen in backend.generate(prompts, params, [trie] * len(prompts)):
        assert trie.match(gen.token_ids) in ACTIONS
    backend.close()


def test_default_dtype_is_float32_on_every_device():
    """bf16 on GPU broke the equal-log-probs assumption (docs/results/gpu_check.md)."""
    import torch

    from inference.backends.hf import _resolve_dtype

    for device in ("cpu", "cuda"):
        assert _resolve_dtype(None, torch.device(device)) is torch.float32
    assert _resolve_dtype("bfloat16", torch.device("cuda")) is torch.bfloat16
