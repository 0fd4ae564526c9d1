"""Self-questioning with an LLM: the LLM task proposer, the LLM explorer, llm_solves, the LLM
grader as outcome reward, and the task factory with a chat model.

The scripted server (tests/llm_stub.py) stands in for an LLM because no real LLM is available
on this machine. Everything else is real: inference.llm.OpenAIChat sends real HTTP requests over a
loopback socket and parses the scripted replies, the ``files`` env replays and verifies every
task, the task store is LMDB in a tmp run dir and the control plane a private redis-server.
"""

from __future__ import annotations

import json
import logging

import pytest
from llm_stub import ScriptedChatServer

from environments.base import verify_task
from environments.files import FilesEnv, make_world
from episodes.grader import LLMGrader
from episodes.reward import OutcomeReward, outcome_reward
from episodes.rollout import Episode
from inference.llm import OpenAIChat
from protocol.config import load_config
from protocol.messages import Step, Task
from questioning.explorer import (
    Exploration,
    Explorer,
    ExploreSettings,
    ExploreStep,
    LLMProposer,
    first_action_line,
    seed_tasks,
)
from questioning.factory import TaskFactory
from questioning.synthesis import LLM_REJECTS, LLMSynthesizer, Preferences, llm_solves
from questioning.task_store import TaskStore

SEED = 1  # make_world(1): poem.md diary.txt music/ src/ games/ (see tests/test_explore.py)
WORLD = make_world(SEED)
POEM = WORLD["poem.md"]
MOVE_GOAL = {"all": [{"absent": ["poem.md"]}, {"file": ["src", "poem.md"], "content": POEM}]}
GARBAGE = "Sure! Let me think about what would be interesting to do here first."
SMALL = ExploreSettings(breadth_steps=6, depth_steps=4)


def chat(url: str, **kw) -> OpenAIChat:
    kw.setdefault("backoff_s", 0.01)
    return OpenAIChat(url, "stub-model", api_key_env="AUTODIDACT_TEST_KEY", **kw)


def seed_task(goal: dict | None = None, reference=(), query: str = "q") -> Task:
    return Task(f"t/{SEED}", "files", query, SEED, goal=goal or {}, reference=list(reference))


def exploration_of(actions, seed: int = SEED) -> Exploration:
    env = FilesEnv()
    first = env.reset(Task("explore", "files", "", seed))
    exp = Exploration(f"{seed}/0", "files", seed, first, env.state())
    for action in actions:
        obs, _, info = env.step(action)
        exp.steps.append(ExploreStep(action, obs, info["valid"], info["tool"], info["error"],
                                     "breadth", "schema", env.state()))
    return exp


EXPLORATION = ["ls", "cd src", "cat draft.md", "cd ..", "mv poem.md src", "ls games"]


def tasks_reply(*tasks, fence: bool = True) -> str:
    body = json.dumps({"tasks": list(tasks)})
    return f"Here are new tasks.\n```json\n{body}\n```\nHope they help!" if fence else body


def user_text(request: dict) -> str:
    return "\n".join(m["content"] for m in request["messages"])


# --- LLMSynthesizer ---------------------------------------------------------------------------


def test_llm_synthesizer_good_reply_derives_goal_by_replay():
    exp = exploration_of(EXPLORATION)
    existing = [seed_task(query="go to folder games"), seed_task(query="delete diary.txt")]
    prefs = Preferences(min_steps=1, max_steps=3, difficulty="multi-step", style="terse")
    reply = tasks_reply({"query": "move diary.txt into games",
                         "reference": ["mv diary.txt games"]},
                        {"query": "move draft.md from src into root",
                         "reference": [" cd src", "mv draft.md .. "]})
    with ScriptedChatServer([reply]) as srv:
        synth = LLMSynthesizer(chat(srv.url), FilesEnv, prefs, toc=lambda: "PROFILE-MARKER")
        tasks = synth.propose(exp, existing)
    assert [t.query for t in tasks] == ["move diary.txt into games",
                                        "move draft.md from src into root"]
    diary = WORLD["diary.txt"]
    assert tasks[0].goal == {"all": [{"absent": ["diary.txt"]},
                                     {"file": ["games", "diary.txt"], "content": diary}]}
    assert tasks[1].reference == ["cd src", "mv draft.md .."]  # stripped
    for task in tasks:
        assert verify_task(FilesEnv, task) == (True, "ok")
        assert task.source == "synthetic" and task.seed == SEED
        assert task.task_id.startswith(f"synth/files/{SEED}/")
        assert task.meta["method"] == "llm" and task.meta["goal_from"] == "replay"
        assert task.meta["exploration"] == exp.exploration_id and task.meta["confidence"] == 0.7
    assert tasks[0].meta["entities"] == 2  # diary.txt, games
    assert synth.stats["proposed"] == 2
    assert not any(k.startswith("rejected_") for k in synth.stats)

    (request,) = srv.requests
    assert request["model"] == "stub-model" and request["max_tokens"] == 1024
    assert request["temperature"] == 0.7
    text = user_text(request)
    assert "PROFILE-MARKER" in text
    assert exp.initial_observation in text
    for i, step in enumerate(exp.steps, 1):
        assert f"{i}. {step.action} -> {step.observation}" in text
    assert "- go to folder games" in text and "- delete diary.txt" in text
    assert "between 1 and 3 steps" in text
    assert "difficulty: multi-step" in text and "style: terse" in text


def test_llm_synthesizer_response_goal_and_mixed_reply():
    exp = exploration_of(EXPLORATION)
    reply = tasks_reply({"query": "show the words of poem.md", "reference": ["cat poem.md"]},
                        {"query": "bad", "reference": ["cd photos"]},
                        "not a task", fence=False)
    with ScriptedChatServer([reply]) as srv:
        synth = LLMSynthesizer(chat(srv.url), FilesEnv, Preferences())
        tasks = synth.propose(exp)
    assert len(tasks) == 1
    assert tasks[0].goal == {"all": [{"response": POEM}]}
    assert verify_task(FilesEnv, tasks[0]) == (True, "ok")
    assert synth.stats["rejected_invalid_step"] == 1 and synth.stats["rejected_bad_task"] == 1
    assert "- (none yet)" in user_text(srv.requests[0])


def item(reference, query: str = "do it") -> dict:
    return {"query": query, "reference": reference}


@pytest.mark.parametrize("reply,reason", [
    ("I would rather not write tasks today.", "not_json"),
    ({"raw": "<html>oops</html>"}, "llm_error"),
    ({"status": 500}, "llm_error"),
    ('{"ideas": ["move things"]}', "no_tasks"),
    ('{"tasks": []}', "no_tasks"),
    (tasks_reply({"query": "move poem.md into src"}), "bad_task"),
    (tasks_reply({"query": "move poem.md into src", "reference": "mv poem.md src"}), "bad_task"),
    (tasks_reply({"query": "", "reference": ["mv poem.md src"]}), "bad_task"),
    (tasks_reply({"query": "x", "reference": ["mv poem.md src"], "goal": "moved"}), "bad_task"),
    (tasks_reply(item(["ls"] * 21)), "bad_task"),
    (tasks_reply(item(["rm $(reboot)"])), "unparseable_action"),
    (tasks_reply(item(["__import__('os').system('reboot')"])), "unparseable_action"),
    (tasks_reply(item(["ls", "mv poem.md; rm -rf /"])), "unparseable_action"),
    (tasks_reply(item(["cd photos"])), "invalid_step"),
    (tasks_reply(item(["mv poem.md src", "rm poem.md"])), "invalid_step"),
    (tasks_reply(item(["cd music", "cd .."])), "no_checkable_goal"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None)
def test_llm_synthesizer_rejects_malformed_replies(reply, reason):
    assert reason in LLM_REJECTS
    exp = exploration_of(EXPLORATION)
    with ScriptedChatServer([reply]) as srv:
        synth = LLMSynthesizer(chat(srv.url, max_retries=0), FilesEnv, Preferences())
        assert synth.propose(exp) == []
    assert len(srv.requests) == 1
    rejected = {k: v for k, v in synth.stats.items() if k.startswith("rejected_")}
    assert rejected == {f"rejected_{reason}": 1}
    assert synth.stats["proposed"] == 0


@pytest.mark.parametrize("goal,reason", [
    ({"all": [{"absent": ["diary.txt"]}]}, "goal_not_reached"),
    ({"all": [{"file": ["src", "poem.md"], "content": "wrong words"}]}, "goal_not_reached"),
    ({"all": "poem.md in src"}, "goal_not_reached"),
    ({"all": [{"folder": ["src"]}]}, "satisfied_at_start"),
    ({"description": "put the poem with the sources"}, "ok"),
])
def test_llm_given_goal_is_checked_by_verify_task(goal, reason):
    exp = exploration_of(EXPLORATION)
    reply = tasks_reply({"query": "move poem.md into src", "reference": ["mv poem.md src"],
                         "goal": goal})
    with ScriptedChatServer([reply]) as srv:
        (task,) = LLMSynthesizer(chat(srv.url), FilesEnv, Preferences()).propose(exp)
    assert task.goal == goal and task.meta["goal_from"] == "llm"
    assert verify_task(FilesEnv, task) == (reason == "ok", reason)


# --- the LLM explorer ---------------------------------------------------------------------------


def test_first_action_line():
    assert first_action_line("```\nls src\n```") == "ls src"
    assert first_action_line("Action: cd docs\nbecause...") == "cd docs"
    assert first_action_line("\n\n1. `pwd`") == "pwd"
    assert first_action_line("- 'cat poem.md'") == "cat poem.md"
    assert first_action_line("") is None and first_action_line(None) is None


def test_llm_proposer_drives_the_explorer():
    replies = ["Action: `pwd`", "ls src", "cd src"]
    with ScriptedChatServer(replies, default="ls") as srv:
        proposer = LLMProposer(chat(srv.url), FilesEnv().tools(), "stub-llm", probe=4,
                               toc=lambda: "PROFILE-MARKER")
        explorer = Explorer(FilesEnv, SMALL, seed=0, llm=proposer)
        exp = explorer.explore(seed_tasks(explorer.env, 2)[1], 0)
    steps = SMALL.breadth_steps + SMALL.depth_steps
    assert [s.action for s in exp.steps] == ["pwd", "ls src", "cd src"] + ["ls"] * (steps - 3)
    assert all(s.proposer == "stub-llm" and s.valid and s.error is None for s in exp.steps)
    assert explorer.counts["llm_actions"] == steps and explorer.counts["schema_actions"] == 0
    assert proposer.enabled and proposer.valid == steps
    assert len(srv.requests) == steps
    first, last = user_text(srv.requests[0]), user_text(srv.requests[-1])
    assert "PROFILE-MARKER" in first and "Phase: breadth" in first
    assert "- mv src dst: move src into folder dst" in first
    assert exp.initial_observation in first
    assert "Phase: depth" in last and "ok path : / src" in user_text(srv.requests[3])
    assert srv.requests[0]["max_tokens"] == 48
    assert srv.requests[0]["temperature"] == SMALL.breadth_temperature
    assert srv.requests[-1]["temperature"] == SMALL.depth_temperature


@pytest.mark.parametrize("default", [GARBAGE, {"status": 500}])
def test_llm_proposer_that_cannot_write_calls_falls_back_to_schema(default, caplog):
    caplog.set_level(logging.WARNING, logger="questioning.explorer")
    with ScriptedChatServer([], default=default) as srv:
        proposer = LLMProposer(chat(srv.url, max_retries=0), FilesEnv().tools(), "stub-llm",
                               probe=4)
        explorer = Explorer(FilesEnv, SMALL, seed=0, llm=proposer)
        exps = [explorer.explore(s, 0) for s in seed_tasks(explorer.env, 2)]
    assert len(srv.requests) == 4 and not proposer.enabled
    assert explorer.counts["llm_invalid"] == 4 and explorer.counts["llm_actions"] == 0
    assert explorer.counts["schema_actions"] == explorer.counts["steps"] == 20
    assert all(s.proposer == "schema" and s.valid for e in exps for s in e.steps)
    fell_back = [r for r in caplog.records if r.name == "questioning.explorer"
                 and r.levelno == logging.WARNING and "tool schemas" in r.getMessage()]
    assert len(fell_back) == 1
    assert "stub-llm produced 0/4 valid calls" in fell_back[0].getMessage()


def test_llm_proposer_at_the_valid_fraction_stays_on():
    with ScriptedChatServer(["ls", GARBAGE, "pwd", GARBAGE], default="pwd") as srv:
        proposer = LLMProposer(chat(srv.url), FilesEnv().tools(), "stub-llm", probe=4)
        explorer = Explorer(FilesEnv, SMALL, seed=0, llm=proposer)
        exp = explorer.explore(seed_tasks(explorer.env, 1)[0], 0)
    assert proposer.enabled and len(srv.requests) == 10
    assert explorer.counts["llm_invalid"] == 2 and explorer.counts["llm_actions"] == 8
    assert [s.proposer for s in exp.steps[:4]] == ["stub-llm", "schema", "stub-llm", "schema"]


# --- llm_solves ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reply,solved", [
    ('Sure:\n```json\n{"actions": ["ls", "mv poem.md src"]}\n```', True),
    ('["mv poem.md src", "ls"]', True),
    ('{"actions": ["ls", "cp poem.md src"]}', False),
    ('{"actions": ["mv poem.md games"]}', False),
    ('{"actions": ["rm $(reboot)"]}', False),
    ('{"actions": [1, 2]}', False),
    ('{"steps": ["mv poem.md src"]}', False),
    (GARBAGE, False),
    ({"status": 500}, False),
])
def test_llm_solves(reply, solved):
    task = seed_task(MOVE_GOAL, ["mv poem.md src"], query="move poem.md into src")
    with ScriptedChatServer([reply]) as srv:
        assert llm_solves(chat(srv.url, max_retries=0), FilesEnv, task, toc="PROFILE") is solved
    text = user_text(srv.requests[0])
    assert "Task: move poem.md into src" in text and "mv poem.md src" in text
    assert "PROFILE" in text


def test_llm_solves_stops_at_max_turns():
    task = seed_task(MOVE_GOAL, ["mv poem.md src"], query="move poem.md into src")
    reply = json.dumps({"actions": ["ls", "pwd", "mv poem.md src"]})
    with ScriptedChatServer([reply, reply]) as srv:
        assert not llm_solves(chat(srv.url), FilesEnv, task, max_turns=2)
        assert llm_solves(chat(srv.url), FilesEnv, task, max_turns=3)


# --- outcome reward -----------------------------------------------------------------------------


def episode(task: Task, actions) -> Episode:
    env = FilesEnv()
    env.reset(task)
    ep = Episode(task, env, "traj-0")
    for i, action in enumerate(actions):
        obs, done, info = env.step(action)
        ep.steps.append(Step(action, obs, i, i + 1, info["valid"], info))
    return ep


GRADE = '{"relevant": true, "score": 0.75, "reason": "moved the right file"}'


def test_outcome_reward_auto_grades_described_goals_only():
    described = seed_task({"description": "put the poem with the sources"}, ["mv poem.md src"],
                          query="tidy up the poem")
    state_goal = seed_task(MOVE_GOAL, ["mv poem.md src"], query="move poem.md into src")
    with ScriptedChatServer([GRADE]) as srv:
        reward = OutcomeReward("auto", LLMGrader(chat(srv.url)))
        assert reward(episode(described, ["ls", "mv poem.md src"])) == 0.75
        assert len(srv.requests) == 1
        text = user_text(srv.requests[0])
        assert "Task: tidy up the poem" in text and "1. mv poem.md src" in text
        assert "2. action: mv poem.md src" in text and "ok moved poem.md into src" in text
        assert reward(episode(state_goal, ["mv poem.md src"])) == 1.0
        assert reward(episode(state_goal, ["ls"])) == 0.0
        assert len(srv.requests) == 1  # the env's check asks nobody
    assert reward.ungraded == 0


def test_outcome_reward_llm_mode_grades_everything():
    state_goal = seed_task(MOVE_GOAL, ["mv poem.md src"], query="move poem.md into src")
    with ScriptedChatServer([GRADE]) as srv:
        reward = OutcomeReward("llm", LLMGrader(chat(srv.url)))
        assert reward(episode(state_goal, ["mv poem.md src"])) == 0.75
    assert len(srv.requests) == 1


def test_outcome_reward_without_grader(caplog):
    described = seed_task({"description": "put the poem with the sources"}, ["mv poem.md src"])
    reward = OutcomeReward("auto", None)
    caplog.set_level(logging.WARNING, logger="episodes.reward")
    assert reward(episode(described, ["mv poem.md src"])) == 0.0
    assert reward(episode(described, [])) == 0.0
    assert reward.ungraded == 2
    assert sum("needs the LLM grader" in r.getMessage() for r in caplog.records) == 1
    assert OutcomeReward("state", None)(episode(described, ["mv poem.md src"])) == 0.0


def test_outcome_reward_from_config():
    assert outcome_reward(load_config(None, [])).grader is None
    cfg = load_config(None, ["llm.url=http://127.0.0.1:9/v1", "llm.model=m"])
    assert isinstance(outcome_reward(cfg).grader, LLMGrader)
    with pytest.raises(ValueError, match="llm.url"):
        outcome_reward(load_config(None, ["tasks.reward=llm"]))


# --- the task factory with a chat model ---------------------------------------------------------


def factory_cfg(*extra: str):
    # hindsight tasks beside the LLM's, no re-grounded example (the default re-grounds files'
    # training tasks, and then makes no hindsight task)
    return load_config(None, ["explore.from_examples=0",
                              "explore.seeds=5", "explore.explorations_per_seed=2",
                              "explore.proposer=llm", "explore.probe_calls=3",
                              "explore.breadth_steps=20", "explore.depth_steps=10", *extra])


def kinds(srv: ScriptedChatServer) -> list[str]:
    """Who sent each request: the explorer, the task proposer or the solve check."""
    out = []
    for request in srv.requests:
        system = request["messages"][0]["content"]
        out.append("explore" if system.startswith("You explore") else
                   "propose" if system.startswith("You write training tasks") else
                   "solve" if system.startswith("You solve") else "?")
    return out


def test_task_factory_with_an_llm_that_writes_garbage(tmp_path, control):
    cfg = factory_cfg()
    with ScriptedChatServer([], default=GARBAGE) as srv, TaskStore(tmp_path) as store:
        llm = chat(srv.url, max_retries=0)
        llm.name = "llm:stub"
        factory = TaskFactory(cfg, tmp_path, store, chat=llm, control=control,
                              say=lambda _: None)
        summary = factory.run(rounds=1)
        stored = store.all()
    assert summary["explorations"] == 10
    assert stored and all(t.meta["method"] == "hindsight" for t in stored)
    assert all(verify_task(FilesEnv, t) == (True, "ok") for t in stored)
    assert {t.task_id for t in control.synthetic_since(0)} == {t.task_id for t in stored}
    # probe_calls explorer proposals, then schema sampling; probe_calls proposer replies, then
    # the factory stops asking.
    assert kinds(srv) == ["explore"] * 3 + ["propose"] * 3
    assert summary["llm_invalid"] == 3 and summary.get("llm_actions", 0) == 0
    assert summary["synth_rejected_not_json"] == 3
    assert not factory.explorer.llm.enabled


def test_a_policy_that_fails_the_probe_is_not_asked_for_tasks(tmp_path, caplog):
    """The policy as proposer (no llm.url): its probe replies are prose, so neither the explorer
    nor the task proposer asks it again; one log line says so, and hindsight tasks still come."""
    cfg = factory_cfg("explore.proposer=policy")
    with ScriptedChatServer([], default=GARBAGE) as srv, TaskStore(tmp_path) as store:
        factory = TaskFactory(cfg, tmp_path, store, chat=chat(srv.url, max_retries=0),
                              say=lambda _: None)
        summary = factory.run(rounds=1)
        stored = store.all()
    assert kinds(srv) == ["explore"] * 3  # the probe, then nothing
    assert summary["proposer_skipped"] == 1 and summary.get("synth_rejected_not_json", 0) == 0
    assert stored and all(t.meta["method"] == "hindsight" for t in stored)
    assert [r.message for r in caplog.records if "valid calls" in r.message] == [
        "explore: the policy wrote 0 of 3 valid calls in the probe; exploring with schema "
        "sampling and hindsight tasks only (set llm.url or --proposer-url for an LLM proposer)"]


def test_task_factory_keeps_verified_llm_tasks(tmp_path):
    # "backup" is no name in the first 5 training worlds (seeds 0 1 2 5 6), the ones explored:
    # the task is valid in each of them.
    reply = tasks_reply({"query": "create folder backup in root",
                         "reference": ["mkdir backup"]},
                        {"query": "go nowhere", "reference": ["cd photos", "cd .."]})
    with ScriptedChatServer([], default=reply) as srv, TaskStore(tmp_path) as store:
        factory = TaskFactory(factory_cfg(), tmp_path, store, chat=chat(srv.url),
                              say=lambda _: None)
        summary = factory.run(rounds=1)
        stored = store.all()
    from_llm = [t for t in stored if t.meta["method"] == "llm"]
    assert sorted(t.seed for t in from_llm) == [0, 1, 2, 5, 6]  # once per seed: dedup
    assert all(t.goal == {"all": [{"folder": ["backup"]}]} for t in from_llm)
    assert all(verify_task(FilesEnv, t) == (True, "ok") for t in stored)
    assert any(t.meta["method"] == "hindsight" for t in stored)
    assert kinds(srv).count("propose") == 10  # useful: asked for every exploration
    # "cd photos" is refused where there is no photos folder, a no-op round trip elsewhere.
    assert (summary["synth_rejected_invalid_step"]
            + summary["synth_rejected_no_checkable_goal"]) == 10
    assert summary["rejected_duplicate"] >= 5


def test_task_factory_llm_verify_drops_tasks_the_llm_cannot_solve(tmp_path):
    reply = tasks_reply({"query": "create folder backup in root",
                         "reference": ["mkdir backup"]})
    with ScriptedChatServer([], default=reply) as srv, TaskStore(tmp_path) as store:
        factory = TaskFactory(factory_cfg("explore.llm_verify=true"), tmp_path, store,
                              chat=chat(srv.url), say=lambda _: None)
        summary = factory.run(rounds=1)
        stored = store.all()
    # The reply to the solve request has no "actions": the LLM did not solve the task.
    assert stored and all(t.meta["method"] == "hindsight" for t in stored)
    assert summary["rejected_llm_unsolved"] == 10
    assert kinds(srv).count("solve") == 10
