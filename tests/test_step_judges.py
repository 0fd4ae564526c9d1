"""Step judges (self-attributing): the reply parser, the reference judge, the LLM judge.

LLM tests talk to ScriptedChatServer (tests/llm_stub.py): it stands in for a remote LLM because
none is available on this machine. The HTTP client, the sockets and the parsing are real.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from llm_stub import ScriptedChatServer

from environments.base import Environment
from environments.files import FilesEnv
from episodes.rollout import RolloutSettings, apply_action, start_episodes
from inference.llm import ChatModel, OpenAIChat
from judge.step_judges import (
    SYSTEM_PROMPT,
    Judgement,
    LLMJudge,
    ReferenceJudge,
    agreement,
    build_judge_messages,
    parse_judgement,
)
from protocol.messages import Step, Task, Trajectory

TRAIN = FilesEnv().tasks("train")


def _task(template: str) -> Task:
    return next(t for t in TRAIN if t.meta["template"] == template)


# --- real trajectories, made by the rollout code ----------------------------------------------


def _episode(files_codec, task: Task, actions: list[str]) -> Trajectory:
    """``actions`` played as if the policy had produced them (as warm-start scripts them)."""
    settings = RolloutSettings(max_turns=50, max_context=10_000)
    env = FilesEnv()
    ep = start_episodes([task], 1, lambda: env, files_codec)[0]
    for action in actions:
        assert not ep.done, "the script goes on after the episode ended"
        apply_action(ep, files_codec, files_codec.action(action), None, 0, settings)
    ep.reward = env.evaluate(task)
    traj = ep.to_trajectory()
    assert [s.action for s in traj.steps] == actions  # every word is in the tokenizer
    return traj


def _traj(actions, observations=None, reward=0.0) -> Trajectory:
    """A trajectory with only what a judge reads: step texts and the outcome."""
    observations = observations or [f"obs {i}" for i in range(len(actions))]
    steps = [Step(action=a, observation=o, start=0, end=0) for a, o in zip(actions, observations)]
    empty = np.zeros(0)
    return Trajectory(traj_id="t", tokens=empty.astype(np.int32),
                      logprobs=empty.astype(np.float32), versions=empty.astype(np.int32),
                      action_mask=empty.astype(np.uint8), steps=steps, reward=reward,
                      success=reward >= 1.0)


# --- the parser ------------------------------------------------------------------------------


def test_parse_well_formed_is_strict():
    reply = "Analysis: the first move helped,\nthe listing did not.\nStep 1: GOOD\nStep 2: BAD\n"
    assert parse_judgement(reply, 2) == ([1, 0], "strict")


@pytest.mark.parametrize("reply", [
    "Analysis: ok\n**Step 1:** GOOD\n**Step 2:** BAD",
    "Analysis: ok\n  - **Step 1**: good.  \n  - *Step 2*: *bad*",
    "Analysis: ok\n\n### step 1 : Good\n\nSTEP 2:BAD\n```",
    "```\nAnalysis: ok\nStep 1: **GOOD**\nStep 2: **BAD**\n```",
])
def test_parse_strict_tolerates_markdown_and_whitespace(reply):
    assert parse_judgement(reply, 2) == ([1, 0], "strict")


def test_parse_strict_ignores_labels_in_the_analysis():
    reply = "Analysis: step 1 looks GOOD at first but it is BAD.\nStep 1: BAD\nStep 2: GOOD"
    assert parse_judgement(reply, 2) == ([0, 1], "strict")


@pytest.mark.parametrize("reply, k, labels", [
    ("Analysis: mostly GOOD\nStep 1: GOOD\nStep 3: BAD", 3, [1, 1, 0]),  # step 2 missing
    ("Analysis: x\nStep 1: GOOD\nStep 1: BAD", 2, [1, 0]),  # repeated index
    ("Analysis: x\nStep 1: GOOD\nStep 2: BAD\nStep 3: GOOD", 2, [1, 0]),  # an extra step
    ("Analysis: x\nStep 2: BAD\nStep 1: GOOD", 2, [0, 1]),  # out of order
    ("Step 1 GOOD, Step 2 BAD", 2, [1, 0]),  # no colon, one line
    ("Step 1: GOOD because it moved the file\nStep 2: BAD", 2, [1, 0]),  # words after a label
])
def test_parse_falls_back_to_tokens(reply, k, labels):
    assert parse_judgement(reply, k) == (labels, "tokens")


@pytest.mark.parametrize("reply, k", [
    ("I think the agent did fine.", 1),
    ("Step 1: GOOD", 2),  # too few labels
    ("the first was good and the second bad", 2),  # lower case prose is not a label
    ("GOODNESS and BADLY", 2),  # not whole words
    ("", 1),
])
def test_parse_garbage_fails(reply, k):
    assert parse_judgement(reply, k) == (None, "failed")


def test_parse_zero_steps_needs_no_reply():
    assert parse_judgement("", 0) == ([], "strict")
    assert parse_judgement("nonsense", 0) == ([], "strict")


def test_parse_is_fast_on_long_blank_runs():
    reply = "Step 1: GOOD" + " " * 50_000 + "x\nStep 2: BAD"
    assert parse_judgement(reply, 2) == ([1, 0], "tokens")


def test_agreement():
    assert agreement([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    assert agreement([], []) == 1.0
    with pytest.raises(ValueError):
        agreement([1], [1, 0])


# --- goal progress -----------------------------------------------------------------------------


def test_files_goal_progress_counts_conditions():
    task = _task("gather")  # four conditions, none true at the start
    env = FilesEnv()
    env.reset(task)
    assert env.goal_progress(task) == 0.0
    env.step(task.reference[0])
    assert env.goal_progress(task) == 0.5
    env.step(task.reference[1])
    assert env.goal_progress(task) == 1.0 == env.evaluate(task)


@pytest.mark.parametrize("goal", [{}, {"all": []}, {"all": "absent"}, {"description": "x"}])
def test_files_goal_progress_malformed_goal_is_zero(goal):
    task = Task(task_id="m", env="files", query="q", seed=0, goal=goal)
    env = FilesEnv()
    env.reset(task)
    assert env.goal_progress(task) == 0.0


def test_default_goal_progress_is_the_outcome():
    task = _task("touch")
    env = FilesEnv()
    env.reset(task)
    assert Environment.goal_progress(env, task) == 0.0
    env.step(task.reference[0])
    assert Environment.goal_progress(env, task) == 1.0


# --- the reference judge ---------------------------------------------------------------------


def test_reference_solution_is_all_good(files_codec):
    task = _task("move_across")  # cd f / mv x .. / cd .. / mv x g: two steps change no goal part
    traj = _episode(files_codec, task, task.reference)
    assert traj.success
    judge = ReferenceJudge(FilesEnv)
    assert judge.judge(task, traj) == Judgement([1, 1, 1, 1], "reference", 0)
    assert judge.name == "reference"
    assert judge.stats == {"trajectories": 1, "steps": 4, "good": 4}


def test_reference_labels_say_why():
    task = _task("move_out")
    wrong = ["cd nowhere_at_all", "ls", "frobnicate x"]
    result = ReferenceJudge(FilesEnv).judge(task, _traj(task.reference[:1] + wrong))
    assert result.labels == [1, 0, 0, 0]
    assert result.reasons[0] == "matches a step of the task's verified reference"
    assert result.reasons[1].startswith("the environment refused it: ")
    assert result.reasons[2].startswith("ran, but matched no reference step")
    assert result.reasons[3] == "not a well-formed call of a declared tool"


def test_every_builtin_reference_is_all_good():
    judge = ReferenceJudge(FilesEnv)
    for task in TRAIN:
        labels = judge.judge(task, _traj(task.reference)).labels
        assert labels == [1] * len(task.reference), task.task_id
    assert judge.stats["good"] == judge.stats["steps"] == sum(len(t.reference) for t in TRAIN)


def test_a_reference_step_may_pass_through_lower_progress(files_codec):
    # copy_across: "cp x .." puts a copy in root, breaking the goal's "x absent from root"
    # until the copy moves on; the step is still needed, so it stays GOOD.
    task = _task("copy_across")
    env = FilesEnv()
    env.reset(task)
    env.step(task.reference[0])
    before = env.goal_progress(task)
    env.step(task.reference[1])
    assert env.goal_progress(task) < before
    traj = _episode(files_codec, task, task.reference)
    assert traj.success and ReferenceJudge(FilesEnv).judge(task, traj).labels == [1, 1, 1, 1]


def test_useless_invalid_and_failing_steps_are_bad(files_codec):
    task = _task("move_across")
    ref = task.reference
    folder = ref[3].split()[-1]
    # "mv" alone does not parse; "cat <folder>" parses and the env refuses it.
    actions = [ref[0], "pwd", ref[1], "mv", f"cat {folder}", "ls", ref[2], ref[3]]
    traj = _episode(files_codec, task, actions)
    assert not traj.steps[3].valid and traj.steps[4].valid and "error" in traj.steps[4].info
    labels = ReferenceJudge(FilesEnv).judge(task, traj).labels
    assert labels == [1, 0, 1, 0, 0, 0, 1, 1]


def test_a_failing_reference_step_is_bad_and_leaves_the_reference_unused(files_codec):
    task = _task("move_across")
    ref = task.reference
    # Moving x out before entering its folder fails; the same text later works and counts.
    traj = _episode(files_codec, task, [ref[1], *ref])
    assert traj.steps[0].info["error"] is not None
    assert ReferenceJudge(FilesEnv).judge(task, traj).labels == [0, 1, 1, 1, 1]


def test_undoing_progress_is_bad(files_codec):
    task = _task("gather")  # mv x f / mv y f
    x, f = task.reference[0].split()[1:]
    actions = [task.reference[0], f"cd {f}", f"mv {x} ..", "cd ..", task.reference[0],
               task.reference[1]]
    traj = _episode(files_codec, task, actions)
    # Putting x back is progress again even though its reference step was used up.
    assert ReferenceJudge(FilesEnv).judge(task, traj).labels == [1, 0, 0, 0, 1, 1]


def test_a_reference_step_earns_credit_once(files_codec):
    task = _task("move_out")  # cd f / mv x ..
    actions = [task.reference[0], "cd ..", task.reference[0], task.reference[1]]
    traj = _episode(files_codec, task, actions)
    assert ReferenceJudge(FilesEnv).judge(task, traj).labels == [1, 0, 0, 1]


def test_words_only_goal_uses_the_reference_alone():
    real = _task("gather")
    task = Task(task_id="w", env="files", query=real.query, seed=real.seed,
                goal={"description": real.query}, reference=real.reference)
    traj = _traj([real.reference[0], "ls", real.reference[1], real.reference[1]])
    # The repeated move fails (y is gone): BAD as an error, and the reference is used up too.
    assert ReferenceJudge(FilesEnv).judge(task, traj).labels == [1, 0, 1, 0]


class ReadingCounts(FilesEnv):
    """Progress that any successful call raises: what a words-only goal must not trust."""

    def goal_progress(self, task):
        return min(1.0, len(self.responses) / 10)


def test_words_only_goal_ignores_progress():
    real = _task("gather")
    words = Task(task_id="w", env="files", query=real.query, seed=real.seed,
                 goal={"description": real.query}, reference=real.reference)
    traj = _traj(["ls", real.reference[0], "pwd"])
    assert ReferenceJudge(ReadingCounts).judge(words, traj).labels == [0, 1, 0]
    # The same env does move progress on a checkable goal, so the difference is the goal's.
    assert ReferenceJudge(ReadingCounts).judge(real, traj).labels == [1, 1, 1]


def test_reference_judge_empty_trajectory():
    judge = ReferenceJudge(FilesEnv)
    assert judge.judge(_task("gather"), _traj([])) == Judgement([], "reference", 0)
    assert judge.stats == {"trajectories": 1, "steps": 0, "good": 0}


# --- the LLM judge ---------------------------------------------------------------------------


def _chat(url: str, **kw) -> OpenAIChat:
    kw.setdefault("backoff_s", 0.01)
    return OpenAIChat(url, "judge-model", api_key_env="AUTODIDACT_TEST_KEY", **kw)


THREE = _traj(["cd games", "ls", "mv a.txt .."], reward=1.0)
GOOD_REPLY = "Analysis: the listing was not needed.\nStep 1: GOOD\nStep 2: BAD\nStep 3: GOOD"


def test_llm_judge_well_formed_reply():
    with ScriptedChatServer([GOOD_REPLY]) as srv:
        judge = LLMJudge(_chat(srv.url))
        result = judge.judge(_task("move_out"), THREE)
    assert result == Judgement([1, 0, 1], "strict", 1)
    # every label carries the reply's analysis as its reason (the run viewer shows it)
    assert result.reasons == ["the listing was not needed."] * 3
    assert judge.name == "llm:judge-model"
    assert len(srv.requests) == 1
    assert srv.requests[0]["temperature"] == 0.0 and srv.requests[0]["max_tokens"] == 512
    assert judge.stats["requests"] == 1 and judge.stats["strict"] == 1
    assert judge.stats["steps"] == 3 and judge.stats["good"] == 2


def test_llm_judge_retries_an_unparsable_reply():
    with ScriptedChatServer(["I am not sure.", GOOD_REPLY]) as srv:
        judge = LLMJudge(_chat(srv.url))
        result = judge.judge(_task("move_out"), THREE)
    assert result == Judgement([1, 0, 1], "strict", 2)
    assert len(srv.requests) == 2
    assert judge.stats["parse_failures"] == 1 and judge.stats["outcome_fallbacks"] == 0


@pytest.mark.parametrize("reward, label", [(1.0, 1), (0.0, 0)])
def test_llm_judge_falls_back_to_the_outcome(reward, label):
    traj = _traj(["ls", "pwd"], reward=reward)
    with ScriptedChatServer([], default="no idea, sorry") as srv:
        judge = LLMJudge(_chat(srv.url), max_attempts=3)
        result = judge.judge(_task("move_out"), traj)
    assert result == Judgement([label, label], "outcome", 3)
    assert all("no usable reply in 3 attempts" in why for why in result.reasons)
    assert len(result.reasons) == 2
    assert len(srv.requests) == 3
    assert judge.stats["parse_failures"] == 3 and judge.stats["outcome_fallbacks"] == 1


def test_llm_judge_counts_failed_requests():
    # Always HTTP 500: each judge attempt is the client's 1 try + 1 retry.
    with ScriptedChatServer([]) as srv:
        judge = LLMJudge(_chat(srv.url, max_retries=1), max_attempts=2)
        result = judge.judge(_task("move_out"), THREE)
    assert result == Judgement([1, 1, 1], "outcome", 2)
    assert len(srv.requests) == 4
    assert judge.stats["llm_errors"] == 2 and judge.stats["requests"] == 2
    assert judge.stats["outcome_fallbacks"] == 1


def test_llm_judge_recovers_after_a_failed_request():
    with ScriptedChatServer([{"status": 500}, {"status": 503}, GOOD_REPLY]) as srv:
        judge = LLMJudge(_chat(srv.url, max_retries=1))
        result = judge.judge(_task("move_out"), THREE)
    assert result == Judgement([1, 0, 1], "strict", 2)
    assert judge.stats["llm_errors"] == 1 and judge.stats["outcome_fallbacks"] == 0


def test_llm_judge_request_carries_truncated_steps():
    long_obs = " ".join(f"word{i}" for i in range(100))
    long_act = "cat " + "x" * 300
    traj = _traj(["ls", long_act], ["short one", long_obs], reward=0.0)
    task = _task("move_out")
    with ScriptedChatServer(["Analysis: none helped\nStep 1: BAD\nStep 2: BAD"]) as srv:
        result = LLMJudge(_chat(srv.url), max_chars=50).judge(task, traj)
    assert result.labels == [0, 0]
    system, user = srv.requests[0]["messages"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    text = user["content"]
    assert task.query in text and "failure" in text
    assert f"observation: {long_obs[:50]}...\n" in text and long_obs[:51] not in text
    assert f"action: {long_act[:50]}...\n" in text and long_act[:51] not in text
    assert "action: ls\n" in text and "observation: short one" in text
    assert text.index("Step 1") < text.index("Step 2")


def test_system_prompt_states_the_outcome_dependent_protocol():
    assert "reward > 0" in SYSTEM_PROMPT and "contributed to the success" in SYSTEM_PROMPT
    assert "irrelevant or harmful" in SYSTEM_PROMPT
    assert "reward <= 0" in SYSTEM_PROMPT and "reduced the distance" in SYSTEM_PROMPT
    assert "Analysis:" in SYSTEM_PROMPT and "'Step <i>: GOOD'" in SYSTEM_PROMPT
    user = build_judge_messages(_task("move_out"), THREE)[1]["content"]
    assert "Outcome: success (reward 1.00)" in user


def test_llm_judge_makes_no_call_for_an_empty_trajectory():
    with ScriptedChatServer([]) as srv:
        judge = LLMJudge(_chat(srv.url))
        assert judge.judge(_task("move_out"), _traj([])) == Judgement([], "strict", 0)
    assert srv.requests == [] and judge.stats["requests"] == 0
    assert judge.stats["trajectories"] == 1


def test_llm_judge_names():
    class Named(ChatModel):
        name = "policy"

        def complete(self, messages, temperature=0.7, max_tokens=512, reply_format=None):
            return "Step 1: GOOD"

    class Anonymous(Named):
        name = None

    assert LLMJudge(Named()).name == "policy"
    assert LLMJudge(Anonymous()).name == "llm"


def test_llm_judge_from_many_threads():
    trajs = [_traj(["ls", f"cd d{i}", "pwd"], reward=float(i % 2)) for i in range(8)]
    reply = {"delay": 0.1, "content": GOOD_REPLY}  # slow enough that the calls overlap
    with ScriptedChatServer([], default=reply) as srv:
        judge = LLMJudge(_chat(srv.url, timeout_s=10))
        results = [None] * 8

        def work(i):
            results[i] = judge.judge(_task("move_out"), trajs[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(r == Judgement([1, 0, 1], "strict", 1) for r in results)
    assert len(srv.requests) == 8
    sent = [json.dumps(r["messages"]) for r in srv.requests]
    asked = sorted(i for i in range(8) for body in sent if f"cd d{i}" in body)
    assert asked == list(range(8))  # each trajectory asked about exactly once
    assert judge.stats["trajectories"] == 8 and judge.stats["requests"] == 8
    assert judge.stats["strict"] == 8 and judge.stats["steps"] == 24 and judge.stats["good"] == 16
