"""actor.think: a thought before each call. The reply splits into thought and call, the env
gets the call, the step keeps the thought (and the step judge and the experience extractor
read it), the thought's tokens are trained or kept as context only, and constrained decoding
opens, bounds and closes the thought before holding the call to the env's candidates or
grammar."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from environments.call_formats import FORMATS
from environments.files import FilesEnv
from episodes.rollout import RolloutSettings, rollout, scripted_episode, start_episodes
from episodes.thinking import THINK_INSTRUCTION, split_thought
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from inference.codecs import make_codec
from inference.tiny_model import make_tiny_chat_model
from judge.step_judges import build_judge_messages
from navigating.extraction import build_messages
from protocol.messages import Group

CORPUS = ["<think> the file is in docs so move it </think> mv ideas.md music ls docs "
          '{"name": "mv", "arguments": {"src": "a.md"}} tool user system assistant'] * 40


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("chat") / "m", CORPUS))


@pytest.mark.parametrize("reply, thought, call", [
    ("<think>ls first</think>ls docs", "ls first", "ls docs"),
    ("<think> a </think>\n [mv(src='a')] ", "a", "[mv(src='a')]"),
    ("ls docs", "", "ls docs"),
    ("<think>unclosed thought ls docs", "", "<think>unclosed thought ls docs"),
    ("<think>one</think><think>two</think>pwd", "one</think><think>two", "pwd"),
    ("no open tag</think>cd docs", "no open tag", "cd docs"),
])
def test_a_reply_splits_into_its_thought_and_its_call(reply, thought, call):
    assert split_thought(reply) == (thought, call)


def _rolled(chat_path, fmt: str, trained: bool, constrained: bool = True, free_form=False):
    class FreeFormFiles(FilesEnv):
        def candidate_actions(self):
            return []

    env_cls = FreeFormFiles if free_form else FilesEnv
    with TransformersBackend(chat_path, device="cpu") as backend:
        codec = make_codec(backend.tokenizer, fmt)
        settings = RolloutSettings(max_turns=2, max_context=4096, max_action_tokens=48,
                                   constrained=constrained, tool_format=fmt, think=True,
                                   think_trained=trained, think_tokens=12)
        episodes = start_episodes(FilesEnv().tasks("train")[:1], 3, env_cls, codec,
                                  settings=settings)
        rollout(backend, episodes, codec, SamplingParams(
            temperature=1.0, max_new_tokens=48, stop_token_ids=(codec.eoa_id,), seed=2),
            settings)
    return episodes, codec


@pytest.mark.parametrize("fmt, free_form", [("text", False), ("json", True)])
def test_a_constrained_reply_is_a_bounded_thought_then_a_call_that_parses(chat_path, fmt,
                                                                          free_form):
    """A random-weight model: whatever it draws, the constraint writes ``<think>``, at most
    12 tokens of untagged thought, ``</think>``, then one of the env's calls (its candidates;
    free-form, its grammar)."""
    episodes, codec = _rolled(chat_path, fmt, trained=True, free_form=free_form)
    tools = FilesEnv().tools()
    assert THINK_INSTRUCTION in codec.tokenizer.decode(episodes[0].tokens[:episodes[0].prompt_len])
    for ep in episodes:
        for step in ep.steps:
            reply = codec.decode_action(ep.tokens[step.start:step.end])
            assert reply.startswith("<think>") and "</think>" in reply
            ids, opening, close = (ep.tokens[step.start:step.end], codec.encode("<think>"),
                                   codec.encode("</think>"))
            assert ids[:len(opening)] == opening
            ends = next(i for i in range(len(ids)) if ids[i:i + len(close)] == close)
            assert ends - len(opening) <= 12  # the thought, in the tokens drawn
            assert step.valid, reply
            FORMATS[fmt].parse(step.action, tools)
            assert step.action == split_thought(reply)[1] and step.thought == \
                split_thought(reply)[0]


def test_a_masked_thought_is_context_and_a_trained_one_is_trained(chat_path):
    trained, codec = _rolled(chat_path, "text", trained=True)
    masked, _ = _rolled(chat_path, "text", trained=False)
    for a, b in zip(trained, masked):
        assert a.tokens == b.tokens  # the same draws: the seed, the constraint
        for step in b.steps:
            span = slice(step.start, step.end)
            close = codec.encode("</think>")
            ids = a.tokens[span]
            cut = next(i + len(close) for i in range(len(ids))
                       if ids[i:i + len(close)] == close)
            assert all(a.mask[span]) and not any(b.mask[step.start:step.start + cut])
            assert all(b.mask[step.start + cut:step.end])
            assert all(v == -1 for v in b.versions[step.start:step.start + cut])
        traj = b.to_trajectory()
        traj.validate()
        assert int(traj.action_mask.sum()) < int(a.to_trajectory().action_mask.sum())


def test_the_judge_and_the_extractor_read_the_thought(chat_path):
    episodes, _ = _rolled(chat_path, "text", trained=True)
    traj = episodes[0].to_trajectory()
    traj.steps[0].thought = "the report must go to docs"
    judged = build_judge_messages(episodes[0].task, traj)[-1]["content"]
    assert "thought: the report must go to docs" in judged
    group = Group("g", episodes[0].task, [traj], "a", 0.0)
    assert "(thought: the report must go to docs)" in build_messages(group, 3)[-1]["content"]


def test_warm_start_scripts_write_an_empty_thought_before_each_reference_call(chat_path):
    codec = make_codec(AutoTokenizer.from_pretrained(chat_path), "text")
    task = next(t for t in FilesEnv().tasks("train") if len(t.reference) >= 2)
    settings = RolloutSettings(max_turns=10, max_context=8192, think=True)
    ep = scripted_episode(task, FilesEnv(), codec, settings)
    assert ep.reward == 1.0
    for step, reference in zip(ep.steps, task.reference):
        assert codec.decode_action(ep.tokens[step.start:step.end]) == \
            f"<think></think>{reference}"
        assert step.action == reference and step.thought == ""


def test_the_marker_policy_cannot_think(files_codec):
    with pytest.raises(ValueError, match="actor.think needs a model with a chat template"):
        start_episodes(FilesEnv().tasks("train")[:1], 1, FilesEnv, files_codec,
                       settings=RolloutSettings(think=True))
