"""Experience extraction: rules over real ``files`` trajectories and explorations, and the LLM
extractor over real HTTP against a scripted chat server.

Every trajectory here is made by stepping a real FilesEnv with scripted or random actions; the
steps carry the env's real observations and infos (token arrays are empty: extraction reads
only the steps).
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
from llm_stub import ScriptedChatServer

from environments.files import FilesEnv
from inference.llm import OpenAIChat
from navigating.extraction import (
    ADVICE_WORDS,
    ExperienceExtractor,
    LLMExtractor,
    from_contrast,
    from_exploration,
    from_failure,
    from_group,
    from_success,
)
from protocol.messages import Experience, Group, Step, Task, Trajectory
from questioning.explorer import Exploration, Explorer, ExploreSettings, ExploreStep, seed_tasks

TASKS = FilesEnv().tasks("train")
READABLE = set(FilesEnv.vocabulary()) | set(ADVICE_WORDS)


def task_of(template: str, index: int = 0) -> Task:
    return [t for t in TASKS if t.meta["template"] == template][index]


def run(task: Task, actions, traj_id: str = "t0") -> Trajectory:
    """A trajectory of ``actions`` in a fresh env, cut where the goal first holds (as rollouts
    end)."""
    env = FilesEnv()
    env.reset(task)
    steps = []
    for action in actions:
        obs, done, info = env.step(action)
        steps.append(Step(action=action, observation=obs, start=0, end=0, valid=info["valid"],
                          info={k: v for k, v in info.items() if v is not None}))
        if done:
            break
    reward = env.evaluate(task)
    empty = np.zeros(0, np.int32)
    return Trajectory(traj_id=traj_id, tokens=empty, logprobs=empty.astype(np.float32),
                      versions=empty, action_mask=empty.astype(np.uint8), steps=steps,
                      reward=reward, success=reward >= 1.0)


def group(task: Task, *trajs: Trajectory) -> Group:
    return Group(group_id=f"g/{task.task_id}", task=task, trajectories=list(trajs))


def readable(exp: Experience) -> bool:
    return set(f"{exp.when_to_use} {exp.content}".split()) <= READABLE


# The running example: "create folder Z and move X into it", reference [mkdir Z, mv X Z].
MKDIR_MOVE = task_of("mkdir_move")
MK, MV = MKDIR_MOVE.reference
Z, X = MK.split()[1], MV.split()[1]
NOT_A_FILE = f"error : {Z} is not a file name"  # mv X Z before Z exists: Z reads as a new name


# --- error -> fix -----------------------------------------------------------------------------


def test_precondition_error_then_fix_names_both_calls():
    traj = run(MKDIR_MOVE, [MV, "ls", MK, MV], "A")
    assert traj.success and traj.steps[0].observation == NOT_A_FILE
    [exp] = from_failure(MKDIR_MOVE, traj, version=7)
    # ls changed nothing (the replay shows it), so it is no part of the fix
    assert exp.content == f"{NOT_A_FILE} after {MV} ; fixed by {MK} first"
    assert exp.when_to_use == MKDIR_MOVE.query
    assert exp.kind == "failure" and exp.tools == ["mv", "mkdir"]
    assert {"failure", "precondition", "bad_name"} <= set(exp.tags)
    assert exp.source_traj_ids == ["A"] and exp.created_version == 7
    assert exp.confidence == 0.8 and exp.exp_id


def test_fix_that_changes_folder_first():
    task = task_of("move_out")
    cd, mv = task.reference
    folder, name = cd.split()[1], mv.split()[1]
    [exp] = from_failure(task, run(task, [mv, cd, "pwd", mv]), 0)
    assert exp.content == f"error : no such file {name} after {mv} ; fixed by {cd} first"
    assert readable(exp) and folder in exp.content


def test_fix_keeps_every_needed_call_and_drops_unrelated_ones():
    task = task_of("remove_folder", 1)  # delete folder src and everything in it
    *emptying, rm_folder = task.reference
    unrelated = "touch plan.txt"
    # after the first related call, where only the replay can tell it was not needed
    actions = [rm_folder, *emptying, unrelated, rm_folder]
    traj = run(task, actions)
    assert traj.success and traj.steps[0].info["error"] == "not_empty"
    [exp] = from_failure(task, traj, 0)
    folder = rm_folder.split()[1]
    assert exp.content == (f"error : folder {folder} is not empty after {rm_folder} ; "
                           f"fixed by {' , '.join(emptying)} first")
    assert unrelated not in exp.content


def test_alternative_that_solved_the_task_is_an_instead_lesson():
    task = task_of("rename")  # rename X to Y, reference [mv X Y]
    [mv] = task.reference
    wrong = f"mv {mv.split()[1]} {mv.split()[1]}"  # same src and dst: refused
    [exp] = from_failure(task, run(task, [wrong, mv]), 0)
    assert exp.content == f"error : src and dst are the same after {wrong} ; use {mv} instead"
    assert "instead" in exp.tags
    # an alternative in a failed attempt is just another action, not advice
    failed = run(MKDIR_MOVE, [MV, f"mv {X} plan.txt"])
    assert not failed.success and failed.steps[1].info.get("error") is None
    assert from_failure(MKDIR_MOVE, failed, 0) == []


def test_repeated_refusal_in_a_failed_trajectory_is_avoid():
    traj = run(MKDIR_MOVE, [MV, "ls", MV], "C")
    assert not traj.success
    [exp] = from_failure(MKDIR_MOVE, traj, 0)
    assert exp.content == f"avoid repeating {MV} after {NOT_A_FILE}"
    assert {"failure", "avoid", "bad_name"} <= set(exp.tags) and exp.tools == ["mv"]
    # refused once only, or retried with success: no avoid lesson
    assert from_failure(MKDIR_MOVE, run(MKDIR_MOVE, [MV, "ls"]), 0) == []


# --- success ----------------------------------------------------------------------------------


def test_success_gives_worked_actions_in_order_without_detours():
    task = task_of("move_out")
    cd, mv = task.reference
    traj = run(task, ["ls", mv, cd, "cd ..", cd, "pwd", mv], "S")
    assert traj.success
    [exp] = from_success(task, traj, 3, success_rate=0.5)
    assert exp.content == f"worked : {cd} ; {mv}"
    assert exp.when_to_use == task.query and exp.kind == "success"
    assert exp.tools == ["cd", "mv"] and "success" in exp.tags
    assert exp.confidence == 0.75 and exp.source_traj_ids == ["S"]
    assert from_success(task, run(task, ["ls"]), 0) == []  # not a success: nothing worked


def test_success_keeps_a_final_read_the_goal_asks_for():
    text = FilesEnv().reset(MKDIR_MOVE).split("contents : ")[1]  # what ls answers at the root
    task = dataclasses.replace(MKDIR_MOVE, task_id="read", query="list the folder root",
                               goal={"all": [{"response": text}]})
    [exp] = from_success(task, run(task, ["pwd", "ls"]), 0)
    assert exp.content == "worked : ls"


def test_without_replay_rules_still_work_on_recorded_errors():
    # an env this process cannot build: no states, so no detour pruning and a guessed fix
    traj = run(MKDIR_MOVE, [MV, "ls", MK, MV], "A")
    task = dataclasses.replace(MKDIR_MOVE, env="elsewhere")
    [win] = from_success(task, traj, 0)
    assert win.content == f"worked : ls ; {MK} ; {MV}"
    [lesson] = from_failure(task, traj, 0)
    assert lesson.content == f"{NOT_A_FILE} after {MV} ; fixed by {MK} first"
    assert lesson.confidence == 0.6


# --- contrast and groups ----------------------------------------------------------------------


def test_contrast_names_the_diverging_action():
    best, worst = run(MKDIR_MOVE, [MK, MV], "B"), run(MKDIR_MOVE, [MV, MV, "ls"], "C")
    [exp] = from_contrast(group(MKDIR_MOVE, worst, best), 0)
    assert exp.content == f"first do {MK} ; not {MV}"
    assert exp.kind == "contrast" and exp.source_traj_ids == ["B", "C"]
    assert exp.tools == ["mkdir", "mv"] and exp.confidence == 1.0

    task = task_of("move_out")
    cd, mv = task.reference
    best, worst = run(task, [cd, mv], "B"), run(task, [cd, "ls", "cd ..", "pwd"], "C")
    [exp] = from_contrast(group(task, best, worst), 0)
    assert exp.content == f"after {cd} ; do {mv} ; not cd .."


def test_equal_rewards_give_no_contrast():
    wins = group(MKDIR_MOVE, run(MKDIR_MOVE, [MK, MV], "a"), run(MKDIR_MOVE, [MV, MK, MV], "b"))
    losses = group(MKDIR_MOVE, run(MKDIR_MOVE, ["ls"], "a"), run(MKDIR_MOVE, [MV], "b"))
    assert from_contrast(wins, 0) == [] and from_contrast(losses, 0) == []
    assert from_contrast(group(MKDIR_MOVE, run(MKDIR_MOVE, [MK, MV])), 0) == []


def test_group_combines_rules_and_merges_duplicates():
    a = run(MKDIR_MOVE, [MV, "ls", MK, MV], "A")
    b = run(MKDIR_MOVE, [MK, MV], "B")
    c = run(MKDIR_MOVE, [MV, MV, "ls"], "C")
    exps = from_group(group(MKDIR_MOVE, a, b, c), 5)
    by_kind = {}
    for e in exps:
        by_kind.setdefault(e.kind, []).append(e)
    [win] = by_kind["success"]  # A and B solved it the same way: one experience, both sources
    assert win.content == f"worked : {MK} ; {MV}" and win.source_traj_ids == ["A", "B"]
    assert win.confidence == pytest.approx(0.5 + 0.5 * 2 / 3, abs=1e-3)
    assert len(by_kind["failure"]) == 2  # A's precondition lesson, C's avoid lesson
    assert len(by_kind["contrast"]) == 1
    assert len({e.exp_id for e in exps}) == len(exps)
    assert all(e.created_version == 5 and e.when_to_use and e.content for e in exps)


def test_every_rule_made_word_is_readable_by_the_word_level_policy():
    """Rule-made advice over many random groups and real explorations stays inside the env's
    vocabulary plus ADVICE_WORDS."""
    assert all(w == w.lower() and " " not in w for w in ADVICE_WORDS)
    rng = random.Random(0)
    kinds, made = set(), 0
    for n, task in enumerate(rng.sample(TASKS, 40)):
        trajs = [run(task, _mixed_actions(task, rng), f"{n}/{i}") for i in range(3)]
        # a scripted error -> fix attempt too, so failure rules fire on every template
        trajs.append(run(task, [task.reference[-1], *task.reference], f"{n}/fix"))
        for exp in from_group(group(task, *trajs), 0):
            assert readable(exp), exp
            assert len(exp.content) <= 400
            kinds.add(exp.kind)
            made += 1
    explorer = Explorer(FilesEnv, ExploreSettings(breadth_steps=30, depth_steps=20), seed=1)
    for seed_task in seed_tasks(explorer.env, 3):
        for exp in from_exploration(explorer.explore(seed_task, 0)):
            assert readable(exp), exp
            kinds.add(exp.kind)
    assert {"success", "failure", "contrast"} <= kinds and made >= 40


def _mixed_actions(task: Task, rng: random.Random) -> list[str]:
    """Reference steps mixed with random well-formed calls on the initial world."""
    env = FilesEnv()
    env.reset(task)
    pool = env.candidate_actions()
    ref = list(task.reference)
    return [ref.pop(0) if ref and rng.random() < 0.5 else rng.choice(pool) for _ in range(6)]


# --- explorations -----------------------------------------------------------------------------


def scripted_exploration(task: Task, actions) -> Exploration:
    env = FilesEnv()
    first = env.reset(Task(f"explore/{task.seed}", "files", "", task.seed))
    rec = Exploration(f"{task.seed}/0", "files", task.seed, first, env.state())
    for action in actions:
        obs, _, info = env.step(action)
        rec.steps.append(ExploreStep(action, obs, info["valid"], info["tool"], info["error"],
                                     "breadth", "schema", env.state()))
    return rec


def test_exploration_gives_the_same_lesson_keyed_by_the_envs_words():
    rec = scripted_exploration(MKDIR_MOVE, [MV, "ls", MK, "pwd", MV])
    exps = from_exploration(json.loads(json.dumps(rec.to_dict())), version=-1)
    [exp] = exps
    assert exp.kind == "exploration" and exp.source_traj_ids == [rec.exploration_id]
    # one detector: the same lesson text as from the trajectory
    [lesson] = from_failure(MKDIR_MOVE, run(MKDIR_MOVE, [MV, "ls", MK, "pwd", MV]), 0)
    assert exp.content == lesson.content
    # keyed by the env's words for what the fix and the retry changed: reads like a task query
    assert exp.when_to_use == f"create folder {Z} in root and move {X} into {Z}"
    assert readable(exp) and {"exploration", "precondition", "bad_name"} <= set(exp.tags)
    assert from_exploration(rec) == exps  # the object and its JSON line agree


def test_exploration_skips_round_trips_and_alternatives():
    # rm of a missing file "fixed" by creating it: touch then rm is nothing a task wants
    rec = scripted_exploration(MKDIR_MOVE, ["rm plan.txt", "touch plan.txt", "rm plan.txt"])
    assert rec.steps[0].error == "no_such_entry" and rec.steps[2].error is None
    assert from_exploration(rec) == []
    # a refused mv retried with another destination: the explorer had no intent to fix
    rec = scripted_exploration(MKDIR_MOVE, [MV, f"mv {X} plan.txt"])
    assert rec.steps[1].error is None and from_exploration(rec) == []


# --- LLM extraction -----------------------------------------------------------------------------


def chat(url: str) -> OpenAIChat:
    return OpenAIChat(url, "test-model", api_key_env="AUTODIDACT_TEST_KEY", max_retries=0,
                      backoff_s=0.01)


def llm_group() -> Group:
    return group(MKDIR_MOVE, run(MKDIR_MOVE, [MV, MK, MV], "A"), run(MKDIR_MOVE, [MV, "ls"], "C"))


GOOD = {
    "experiences": [
        {"when_to_use": "Move a file into a folder that does not exist yet",
         "content": "Create the folder with mkdir before mv.", "tags": ["precondition"],
         "tools": ["mkdir", "mv"], "confidence": 0.9},
        {"when_to_use": "moving files", "content": "mv fails on a missing folder",
         "confidence": 1.7},
        {"when_to_use": "a third", "content": "beyond max_per_group"},
    ]
}


def test_llm_good_json_gives_llm_experiences():
    reply = "Here you go:\n```json\n" + json.dumps(GOOD) + "\n```"
    with ScriptedChatServer([reply]) as srv:
        llm = LLMExtractor(chat(srv.url), max_per_group=2)
        exps = llm.extract(llm_group(), version=4)
    assert [e.kind for e in exps] == ["llm", "llm"]
    first, second = exps
    assert first.when_to_use == GOOD["experiences"][0]["when_to_use"]
    assert first.tools == ["mkdir", "mv"] and first.tags == ["precondition"]
    assert first.confidence == 0.9 and second.confidence == 1.0  # clamped into [0, 1]
    assert first.source_traj_ids == ["A", "C"] and first.created_version == 4
    assert llm.malformed == 0 and llm.errors == 0
    prompt = srv.requests[0]["messages"][1]["content"]
    assert MKDIR_MOVE.query in prompt and f"{MV} -> {NOT_A_FILE}" in prompt
    assert "reward 1" in prompt and "reward 0" in prompt


def test_llm_malformed_items_are_counted_and_dropped():
    items = [{"when_to_use": "ok", "content": "fine"}, {"when_to_use": "no content"},
             {"when_to_use": "x", "content": "y", "confidence": "high"}, "not an object",
             {"when_to_use": "x", "content": "y", "tools": "mv"}]
    with ScriptedChatServer([json.dumps({"experiences": items})]) as srv:
        llm = LLMExtractor(chat(srv.url), max_per_group=5)
        exps = llm.extract(llm_group(), 0)
    assert [e.content for e in exps] == ["fine"] and llm.malformed == 4


@pytest.mark.parametrize("reply", ["no json here", '{"advice": []}', {"status": 400}])
def test_llm_failure_falls_back_to_rules(reply):
    with ScriptedChatServer([reply]) as srv:
        llm = LLMExtractor(chat(srv.url))
        extractor = ExperienceExtractor(llm)
        exps = extractor.from_group(llm_group(), 2)
    assert exps and all(e.kind != "llm" for e in exps)
    if isinstance(reply, dict):
        assert (llm.errors, llm.malformed) == (1, 0)
    else:
        assert (llm.errors, llm.malformed) == (0, 1)
    assert extractor.fallbacks == 1
    assert sum(extractor.counts.values()) == len(exps)
    assert set(extractor.counts) == {e.kind for e in exps}


def test_extractor_counts_kinds_with_llm_and_rules():
    with ScriptedChatServer([json.dumps(GOOD)]) as srv:
        extractor = ExperienceExtractor(LLMExtractor(chat(srv.url), max_per_group=3))
        assert len(extractor.from_group(llm_group(), 0)) == 3
    assert extractor.counts == {"llm": 3} and extractor.fallbacks == 0
    rules = ExperienceExtractor()
    made = rules.from_group(llm_group(), 0)
    made += rules.from_exploration(scripted_exploration(MKDIR_MOVE, [MV, MK, MV]))
    assert rules.counts["exploration"] == 1 and rules.counts["success"] == 1
    assert sum(rules.counts.values()) == len(made)




# --- the experience role, reading through the replay server ------------------------------------


class ListPool:
    """The pool as the worker uses it: everything added, in order."""

    def __init__(self):
        self.added: list[Experience] = []

    def add(self, exps):
        self.added += exps
        return {"added": len(exps)}

    def size(self) -> int:
        return len(self.added)

    def close(self) -> None:
        pass  # nothing held: the worker closes its pool, a Redis one has a connection


def worker_group(i: int) -> Group:
    """A finished group over a real files task: one solved rollout, one that failed."""
    task = TASKS[i]
    return Group(group_id=f"w-{i}", task=task, trajectories=[
        run(task, task.reference, "A"), run(task, ["ls", "ls"], "B")])


def lessons(groups, version):
    """What the rules make of ``groups`` in this order: (kind, when_to_use, content)."""
    return [(e.kind, e.when_to_use, e.content) for g in groups
            for e in ExperienceExtractor().from_group(g, version)]


def made(pool):
    return [(e.kind, e.when_to_use, e.content) for e in pool.added]


@pytest.fixture
def replay_server(tmp_path):
    from helpers_replay import ServerProc

    server = ServerProc(tmp_path / "replay-node" / "run", "replay.max_groups=4").start()
    yield server
    server.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_experience_worker_reads_groups_from_the_replay_server(tmp_path, control,
                                                                  replay_server):
    """No shared file system: the worker's run directory has no replay.lmdb. It extracts the
    groups an actor pushed, in ingest order, each once, and takes none from the learner."""
    from helpers_replay import push_all

    from autodidact.wiring import build_experience
    from metrics.jsonl import read_metrics
    from protocol.config import RunConfig
    from protocol.replay_client import ReplayClient

    groups = [worker_group(i) for i in range(5)]
    assert lessons(groups, 3)  # the rules make something of these groups
    actor = ReplayClient(replay_server.address, retry_after_s=0.5, timeout_s=10)
    assert set(push_all(actor, groups[:3]).values()) == {"stored"}
    cfg = RunConfig()
    cfg.replay.address = replay_server.address  # found as every role finds it
    worker_dir = tmp_path / "experience-node" / "run"
    worker_dir.mkdir(parents=True)
    pool = ListPool()
    worker = build_experience(cfg, worker_dir, control, pool=pool,
                              extractor=ExperienceExtractor())
    try:
        worker.extract_once(3)
        assert made(pool) == lessons(groups[:3], 3)
        assert control.experience_cursor() == 3
        # The learner trains on one; two more arrive; replay is over capacity (4): the
        # consumed one is evicted before the worker's next pass.
        batch = actor.request_batch("learner", 1, 0)
        actor.commit_ledger("learner", [g.group_id for g in batch.groups])
        push_all(actor, groups[3:])
        assert actor.stats()["evicted"] == 1
        pool.added.clear()
        worker.extract_once(4)
        assert made(pool) == lessons(groups[3:], 4)  # only what is new, nothing twice
        assert control.experience_cursor() == 5
        pool.added.clear()
        worker.extract_once(5)
        assert pool.added == [] and control.experience_cursor() == 5
    finally:
        worker.close()
    stats = actor.stats()
    # reading delivered nothing: only the learner's one, and the other four wait for it
    assert stats["groups_delivered"] == 1 and stats["deliverable"] == 4
    actor.close()
    assert [r["experience/groups"] for r in read_metrics(worker_dir, "experience")] == [3, 2, 0]
    assert not (worker_dir / "replay.lmdb").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_experience_worker_pages_skips_evicted_groups_and_resumes(
        tmp_path, control, replay_server, monkeypatch):
    from helpers_replay import push_all

    from autodidact.wiring import build_experience
    from experience import worker as experience_worker
    from protocol.config import RunConfig
    from protocol.errors import TransportTimeout
    from protocol.replay_client import ReplayClient
    from protocol.transport import free_tcp_port

    monkeypatch.setattr(experience_worker, "PAGE_GROUPS", 2)
    groups = [worker_group(i) for i in range(6)]
    actor = ReplayClient(replay_server.address, retry_after_s=0.5, timeout_s=10)
    push_all(actor, groups[:4])
    batch = actor.request_batch("learner", 2, 0)
    actor.commit_ledger("learner", [g.group_id for g in batch.groups])
    push_all(actor, groups[4:])  # 6 > 4: the two consumed ones are evicted, unread
    assert actor.stats()["evicted"] == 2
    actor.close()

    def worker(replay):
        run_dir = tmp_path / "worker"
        run_dir.mkdir(exist_ok=True)
        return build_experience(RunConfig(), run_dir, control, replay, pool=ListPool(),
                                extractor=ExperienceExtractor())

    first = worker(ReplayClient(replay_server.address, retry_after_s=0.5, timeout_s=10))
    first.extract_once(1)  # three pages of two
    assert made(first.pool) == lessons(groups[2:], 1)
    assert control.experience_cursor() == 6
    first.close()
    again = worker(ReplayClient(replay_server.address, retry_after_s=0.5, timeout_s=10))
    again.extract_once(2)  # a restarted worker: nothing twice
    assert again.pool.added == [] and control.experience_cursor() == 6
    again.close()
    # Replay not answering: the pass fails and the cursor stays for the next one.
    gone = worker(ReplayClient(f"tcp://127.0.0.1:{free_tcp_port()}", retry_after_s=0.1,
                               timeout_s=0.3))
    with pytest.raises(TransportTimeout):
        gone.extract_once(3)
    assert control.experience_cursor() == 6
    gone.close()


@pytest.mark.timeout(120)
def test_a_worker_told_to_stop_leaves_its_pass_to_the_next_one(tmp_path, control, replay_server):
    """SIGTERM mid-pass: the lessons are not embedded (which, the first time, loads the
    embedder and outlasted the supervisor's grace), and the cursor stays where it was, so a
    restarted worker extracts the same groups and none is lost."""
    from helpers_replay import push_all

    from autodidact.wiring import build_experience
    from protocol.config import RunConfig
    from protocol.replay_client import ReplayClient

    groups = [worker_group(i) for i in range(3)]
    actor = ReplayClient(replay_server.address, retry_after_s=0.5, timeout_s=10)
    push_all(actor, groups)
    actor.close()

    class Counting(ExperienceExtractor):
        replayed = 0

        def from_group(self, group, version):
            self.replayed += 1
            return super().from_group(group, version)

    def worker():
        return build_experience(RunConfig(), tmp_path, control,
                                ReplayClient(replay_server.address, retry_after_s=0.5,
                                             timeout_s=10),
                                pool=ListPool(), extractor=Counting())

    stopping = worker()
    stopping.request_stop()
    assert stopping.extract_once(1) == {"added": 0}
    assert stopping.pool.added == [] and control.experience_cursor() == 0
    assert stopping.extractor.replayed == 0  # not one group replayed (a served env: slow)
    stopping.close()
    after = worker()
    after.extract_once(2)
    assert made(after.pool) == lessons(groups, 2) and control.experience_cursor() == 3
    after.close()
