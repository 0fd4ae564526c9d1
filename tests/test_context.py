"""env.context: what each mode shows the model, and that training stays exact under every mode:
the learner's log-prob of every sampled token, recomputed on the batch it trains, equals the
sampler's (each rebuilt context is its own row), and a trajectory split into rows still weighs
once under seq-mean-token-mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llm_stub import ScriptedChatServer
from transformers import AutoModelForCausalLM

from environments.files import FilesEnv
from episodes.context import ContextManager, Turn
from episodes.rollout import RolloutSettings, rollout, start_episodes, to_groups
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from inference.codecs import make_codec
from inference.tiny_model import make_tiny_chat_model
from judge.step_judges import ReferenceJudge
from learner.advantages import grpo_advantages
from learner.batching import build_batch, split_contexts
from learner.logprobs import token_logprobs
from learner.losses import policy_loss
from protocol.errors import ConfigError, SchemaError
from protocol.messages import Step

CORPUS = ["ls docs mv ideas.md music cat notes.txt error : unknown tool ok moved into "
          "You operate the files environment tool user system assistant earlier turns left "
          "out summarised tokens cut"] * 40
MODES = {
    "linear": ContextManager("linear"),
    "window": ContextManager("window", keep=2),
    "truncate": ContextManager("truncate", observation_tokens=6),
    "summary": ContextManager("summary", keep=2),
    "window_stride": ContextManager("window", keep=2, stride=2),
}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("chat") / "m", CORPUS))


@pytest.fixture(scope="module")
def rolled(chat_path):
    """One group of 3 six-turn episodes per mode, sampled by the transformers engine."""
    out = {}
    with TransformersBackend(chat_path, device="cpu") as backend:
        codec = make_codec(backend.tokenizer)
        for mode, manager in MODES.items():
            settings = RolloutSettings(max_turns=6, max_context=4096, max_action_tokens=6,
                                       constrained=False, context=manager)
            episodes = start_episodes(FilesEnv().tasks("train")[:1], 3, FilesEnv, codec)
            params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7,
                                    stop_token_ids=(codec.eoa_id,), logprobs_mode="raw")
            rollout(backend, episodes, codec, params, settings)
            out[mode] = (episodes, codec)
    return out


def test_each_mode_shows_the_model_what_it_says(rolled):
    for mode, (episodes, codec) in rolled.items():
        for ep in episodes:
            traj = ep.to_trajectory()
            traj.validate()
            assert len(traj.steps) == 6
            rebuilt = len(traj.contexts)
            expected = {"window": 3, "summary": 3, "window_stride": 1}.get(mode, 0)
            assert rebuilt == expected, mode  # 6 turns, the last unanswered; stride 2: at 4
            last = codec.tokenizer.decode(traj.tokens[traj.context_bounds()[-1][0]:])
            if mode == "window":
                assert "[3 earlier turns left out]" in last
            if mode == "summary":
                assert "[earlier turns, summarised]" in last and "3. " in last
            if mode == "truncate":
                assert "tokens cut]" in codec.tokenizer.decode(traj.tokens)
            if mode in ("window", "summary"):  # the last context: the opening, 2 turns, no more
                assert last.count("<|im_start|>assistant") == 3
                assert last.startswith(codec.tokenizer.decode(ep.tokens[:traj.prompt_len])[:40])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_learner_recomputes_the_samplers_log_probs_in_every_mode(rolled, chat_path, mode):
    episodes, codec = rolled[mode]
    [group] = to_groups(episodes, 3, "a", 0.0)
    batch, stats = build_batch([group], codec.tokenizer.pad_token_id or 0)
    assert stats["rows"] == 3 + sum(len(t.contexts) for t in group.trajectories)
    model = AutoModelForCausalLM.from_pretrained(chat_path, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = token_logprobs(model, batch.input_ids, batch.attention_mask)
    trained = batch.action_mask.bool()
    assert int(trained.sum()) == sum(int(t.action_mask.sum()) for t in group.trajectories)
    diff = (learner - batch.behaviour_logprobs)[trained].abs().max().item()
    assert diff < TOLERANCE, f"{mode}: learner and sampler log-probs differ by {diff:.2e}"
    # The check can fail: the same tokens as one sequence (the contexts glued) differ.
    if group.trajectories[0].contexts:
        glued = build_batch([_glued(group)], codec.tokenizer.pad_token_id or 0)[0]
        with torch.no_grad():
            wrong = token_logprobs(model, glued.input_ids, glued.attention_mask)
        mask = glued.action_mask.bool()
        # (an order of magnitude past the tolerance: 8e-3 on the summary mode's draw)
        assert (wrong - glued.behaviour_logprobs)[mask].abs().max().item() > 10 * TOLERANCE


def _glued(group):
    from dataclasses import replace
    return replace(group, trajectories=[replace(t, contexts=[]) for t in group.trajectories])


def test_a_split_trajectory_weighs_once_under_seq_mean(rolled):
    """With ratio 1 the loss is -mean over trajectories of each one's token-mean advantage,
    however many rows (contexts) a trajectory became."""
    episodes, codec = rolled["window"]
    [group] = to_groups(episodes, 3, "a", 0.0)
    for i, t in enumerate(group.trajectories):
        t.reward = float(i)  # distinct rewards: non-zero GRPO advantages
    batch, _ = build_batch([group], 0)
    assert len(batch.row_weight) > 3 and abs(batch.row_weight.sum().item() - 3) < 1e-5
    behaviour = batch.behaviour_logprobs
    loss, _ = policy_loss(behaviour.clone(), None, behaviour, batch.advantages,
                          batch.action_mask, aggregation="seq-mean-token-mean",
                          row_weight=batch.row_weight)
    # every token of a trajectory carries its advantage: each one's token-mean is -A
    per_traj = -grpo_advantages([t.reward for t in group.trajectories])
    assert abs(loss.item() - np.mean(per_traj)) < 1e-5
    glued, _ = build_batch([_glued(group)], 0)  # unsplit, the same number
    loss_glued, _ = policy_loss(glued.behaviour_logprobs.clone(), None,
                                glued.behaviour_logprobs, glued.advantages, glued.action_mask,
                                aggregation="seq-mean-token-mean", row_weight=glued.row_weight)
    assert abs(loss.item() - loss_glued.item()) < 1e-5


def test_contexts_split_into_trajectories_of_their_own(rolled):
    episodes, _ = rolled["summary"]
    traj = episodes[0].to_trajectory()
    parts = split_contexts(traj)
    assert [b for b, _ in parts] == traj.context_bounds() and len(parts) == 4
    assert sum(len(p.steps) for _, p in parts) == len(traj.steps)
    for (lo, _), part in parts:
        part.validate()
        assert not part.contexts and part.action_mask[:part.prompt_len].sum() == 0
        for step, whole in zip(part.steps, [s for s in traj.steps if s.start >= lo]):
            assert (part.tokens[step.start:step.end] == traj.tokens[whole.start:whole.end]).all()


def test_a_step_that_crosses_a_context_is_refused(rolled):
    traj = rolled["window"][0][0].to_trajectory()
    start = traj.contexts[0][0]
    bad = Step(action="x", observation="y", start=start - 1, end=start + 1)
    traj.steps = [*traj.steps, bad]
    with pytest.raises(SchemaError, match="crosses"):
        traj.validate()
    traj.steps = traj.steps[:-1]
    traj.contexts = [[traj.prompt_len, 0, 0]]
    with pytest.raises(SchemaError, match="a context is"):
        traj.validate()


def test_the_notes_each_mode_writes():
    turns = [Turn([1], [2], f"cat f{i}.md", "word " * 30) for i in range(5)]
    assert ContextManager("linear").rebuild(turns) is None
    assert ContextManager("truncate", observation_tokens=5).rebuild(turns) is None
    assert ContextManager("window", keep=5).rebuild(turns) is None
    assert ContextManager("window", keep=4).rebuild(turns) == ("[1 earlier turn left out]",
                                                              turns[-4:])
    summary, kept = ContextManager("summary", keep=3).rebuild(turns)
    assert summary.splitlines() == ["[earlier turns, summarised]",
                                    "1. cat f0.md -> " + "word " * 11 + "word ...",
                                    "2. cat f1.md -> " + "word " * 11 + "word ..."]
    assert kept == turns[-3:]
    strided = ContextManager("window", keep=2, stride=3)
    assert [strided.rebuild(turns[:n]) is not None for n in range(1, 6)] == [
        False, False, False, False, True]  # rebuilt at 5 turns: 3 left out; grows at 3, 4
    assert strided.rebuild(turns)[1] == turns[-2:]
    with pytest.raises(ValueError, match="context must be one of"):
        ContextManager("forget")


# --- env.context=self: the agent's own context tools -------------------------------------------


def _self_episode(chat_path, actions: list[str]):
    """``actions`` played as the policy's replies under env.context=self."""
    from transformers import AutoTokenizer

    from episodes.rollout import apply_action

    codec = make_codec(AutoTokenizer.from_pretrained(chat_path))
    settings = RolloutSettings(max_turns=20, max_context=8192, constrained=False,
                               context=ContextManager("self"))
    env = FilesEnv()
    [ep] = start_episodes(env.tasks("train")[:1], 1, lambda: env, codec, settings=settings)
    for action in actions:
        apply_action(ep, codec, codec.action(action), None, 0, settings)
    return ep, codec, env


def test_the_agent_forgets_and_notes_turns_away_and_the_env_never_sees_it(chat_path):
    ep, codec, env = _self_episode(chat_path, [
        "ls", "forget 1", "cd docs", 'note 3 3 "went into docs"', "forget 9", "pwd"])
    prompt = codec.tokenizer.decode(ep.tokens[:ep.prompt_len])
    assert "forget turn: leave a past turn" in prompt and 'note 1 3 "moved' in prompt
    steps = ep.steps
    assert [s.info.get("context", False) for s in steps] == [False, True, False, True, True,
                                                             False]
    assert steps[1].observation == "ok turn 1 left out"
    assert steps[3].observation == "ok turns 3 to 3 replaced by your note"
    assert steps[4].observation == "error : turns are numbered 1 to 4"
    assert env.responses == [steps[0].observation, steps[2].observation, steps[5].observation]
    traj = ep.to_trajectory()
    traj.validate()
    assert len(traj.contexts) == 2  # after the forget, after the note; not after the refusal
    bounds = traj.context_bounds()
    second = codec.tokenizer.decode(traj.tokens[bounds[1][0]:bounds[1][1]])
    third = codec.tokenizer.decode(traj.tokens[bounds[2][0]:])
    first_result = steps[0].observation
    assert "[left out: turns 1]" in second and f"[turn 1] {first_result}" not in second
    assert "[turn 2] ok turn 1 left out" in second
    assert "turns 3-3: went into docs" in third and "[turn 3]" not in third
    assert third.count("<|im_start|>assistant") == 4 + 1  # turns 2, 4, 5, 6 and the next
    judge = ReferenceJudge(FilesEnv)
    labels = judge.judge(ep.task, traj).labels
    assert labels[1] == labels[3] == 1 and labels[4] == 0  # by their own outcome, unreplayed


@pytest.fixture(scope="module")
def self_rolled(chat_path):
    """Sampled under env.context=self, constrained to candidates that include forgetting."""
    class Forgetful(FilesEnv):
        """Lists pwd until stepped once, then nothing of its own: the choice is among the
        forget calls the rollout adds (a random model would not draw them beside pwd)."""

        stepped = False

        def step(self, action_text, call_format="text"):
            self.stepped = True
            return super().step(action_text, call_format)

        def candidate_actions(self):
            return ["cat nothing.md"] if self.stepped else ["pwd"]

    with TransformersBackend(chat_path, device="cpu") as backend:
        codec = make_codec(backend.tokenizer)
        settings = RolloutSettings(max_turns=6, max_context=4096, max_action_tokens=16,
                                   constrained=True, context=ContextManager("self"))
        episodes = start_episodes(FilesEnv().tasks("train")[:1], 4, Forgetful, codec,
                                  settings=settings)
        rollout(backend, episodes, codec, SamplingParams(
            temperature=1.0, max_new_tokens=16, seed=3, stop_token_ids=(codec.eoa_id,),
            logprobs_mode="raw"), settings)
    return episodes, codec


def test_the_learner_recomputes_the_samplers_log_probs_when_the_agent_edits_its_context(
        self_rolled, chat_path):
    episodes, codec = self_rolled
    [group] = to_groups(episodes, 4, "a", 0.0)
    assert sum(len(t.contexts) for t in group.trajectories) >= 2
    batch, _ = build_batch([group], codec.tokenizer.pad_token_id or 0)
    model = AutoModelForCausalLM.from_pretrained(chat_path, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = token_logprobs(model, batch.input_ids, batch.attention_mask)
    trained = batch.action_mask.bool()
    assert (learner - batch.behaviour_logprobs)[trained].abs().max().item() < TOLERANCE


# --- summary written by an LLM endpoint ---------------------------------------------------------


def test_an_llm_writes_the_summary_and_the_rule_stands_in_when_it_fails(chat_path):
    """env.context_summary=llm against a scripted endpoint (no LLM on this machine; the HTTP,
    the client and the rollout are real): each new set of left-out turns is asked once, the
    reply is the summary; a failed request leaves the rule's lines."""
    from transformers import AutoTokenizer

    from episodes.context import LLMSummary
    from episodes.rollout import apply_action
    from inference.llm import OpenAIChat
    from protocol.config import LLMConfig

    replies = ["you listed the root", {"status": 500}, "you listed the root, then docs twice"]
    with ScriptedChatServer(replies) as server:
        summarizer = LLMSummary(OpenAIChat.from_config(
            LLMConfig(url=server.url, model="m", max_retries=0)))
        codec = make_codec(AutoTokenizer.from_pretrained(chat_path))
        settings = RolloutSettings(max_turns=20, max_context=8192, constrained=False,
                                   context=ContextManager("summary", keep=2,
                                                          summarizer=summarizer))
        env = FilesEnv()
        [ep] = start_episodes(env.tasks("train")[:1], 1, lambda: env, codec, settings=settings)
        for action in ["ls", "ls docs", "pwd", "ls docs", "pwd"]:
            apply_action(ep, codec, codec.action(action), None, 0, settings)
        asked = [r["messages"][-1]["content"] for r in server.requests]
    traj = ep.to_trajectory()
    contexts = [codec.tokenizer.decode(traj.tokens[lo:hi]) for lo, hi in traj.context_bounds()]
    assert len(contexts) == 4  # rebuilt after turns 3, 4 and 5
    assert "[earlier turns, summarised]\nyou listed the root" in contexts[1]
    assert "1. ls -> " in contexts[2] and "2. ls docs -> " in contexts[2]  # the rule, for 500
    assert "you listed the root, then docs twice" in contexts[3]
    assert summarizer.requests == 3 and summarizer.failures == 1
    assert asked[0].startswith("1. ls -> ") and asked[2].count("\n") == 2  # 3 turns asked


def test_an_llm_summary_needs_an_endpoint():
    from protocol.config import load_config

    with pytest.raises(ConfigError, match="context_summary=llm needs llm.url"):
        load_config(None, ["env.context=summary", "env.context_summary=llm"])
    load_config(None, ["env.context=window", "env.context_summary=llm"])  # unused: no need
