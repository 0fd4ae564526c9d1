"""Self-questioning without an LLM: change descriptions, task verification, exploration, the
environment profile, hindsight synthesis, de-duplication, the task factory and the task mix.

Everything here is real: the ``files`` env, replays in fresh envs, an LMDB task store in a tmp
run dir and a private redis-server (the ``control`` fixture of conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from autodidact.task_mix import (
    TaskFeeder,
    rl_synthetic_share,
    synthetic_share,
    warmstart_tasks,
)
from environments.base import VERIFY_REASONS, described_only, verify_task
from environments.files import FilesEnv, make_world
from learner.warmstart import pick_references
from protocol.config import ConfigError, load_config
from protocol.messages import Task
from questioning.explorer import Exploration, Explorer, ExploreSettings, ExploreStep, seed_tasks
from questioning.factory import TaskFactory, explorations_path, profile_path, read_explorations
from questioning.profile import build_profile, render_toc
from questioning.synthesis import (
    HindsightSynthesizer,
    Preferences,
    Replayer,
    TaskDeduper,
    goal_key,
    jaccard,
    make_task,
)
from questioning.task_store import TaskStore

# Seed 1's world (make_world(1)), the ground of the scripted cases below:
#   poem.md  diary.txt
#   music/ recipe.txt todo.txt backup/ideas.md
#   src/   draft.md story.md
#   games/ report.txt diary.md recipe.md
# Unused anywhere in it: the folder names data, docs, ... and the file names plan.txt, list.md.
SEED = 1
WORLD = make_world(SEED)
POEM = WORLD["poem.md"]
TOOLS = [t.name for t in FilesEnv().tools()]
VOCAB = set(FilesEnv.vocabulary())


def seed_task(seed: int = SEED, goal: dict | None = None, reference=()) -> Task:
    return Task(f"t/{seed}", "files", "q", seed, goal=goal or {}, reference=list(reference))


def run_actions(actions, seed: int = SEED) -> tuple[FilesEnv, dict]:
    """A fresh env after ``actions`` (each must succeed), and its state before them."""
    env = FilesEnv()
    env.reset(seed_task(seed))
    before = env.state()
    for action in actions:
        obs, _, info = env.step(action)
        assert info["valid"] and info["error"] is None, (action, obs)
    return env, before


def holds_after(goal: dict, actions, seed: int = SEED) -> bool:
    """Whether ``goal`` holds after running ``actions`` from a fresh reset of ``seed``."""
    env = FilesEnv()
    task = seed_task(seed, goal)
    env.reset(task)
    for action in actions:
        env.step(action)
    return env.evaluate(task) >= 1.0


def exploration_of(actions, seed: int = SEED, exp_id: str = "1/0") -> Exploration:
    """A hand-made exploration: ``actions`` run from a fresh reset, with state snapshots."""
    env = FilesEnv()
    first = env.reset(seed_task(seed))
    exp = Exploration(exp_id, "files", seed, first, env.state())
    for action in actions:
        obs, _, info = env.step(action)
        exp.steps.append(ExploreStep(action, obs, info["valid"], info["tool"], info["error"],
                                     "breadth", "schema", env.state()))
    return exp


def test_seed_world_is_what_the_cases_assume():
    assert set(WORLD) == {"poem.md", "diary.txt", "music", "src", "games"}
    assert set(WORLD["music"]) == {"recipe.txt", "todo.txt", "backup"}
    assert set(WORLD["music"]["backup"]) == {"ideas.md"}
    assert set(WORLD["src"]) == {"draft.md", "story.md"}
    names = json.dumps(WORLD)
    assert all(n not in names for n in ("data", "plan.txt", "list.md"))


# --- describe_changes -----------------------------------------------------------------------

CHANGES = [
    (["mv poem.md src"], "move poem.md into src"),
    (["cd src", "mv draft.md ..", "cd .."], "move draft.md from src into root"),
    (["cd music", "cd backup", "mv ideas.md ..", "cd /"], "move ideas.md from backup into music"),
    (["mv poem.md plan.txt"], "rename poem.md to plan.txt"),
    (["cp poem.md src"], "copy poem.md into src"),
    (["cp poem.md list.md"], "copy poem.md to list.md"),
    (["rm poem.md"], "delete poem.md"),
    (["cd src", "rm draft.md", "cd .."], "delete draft.md from src"),
    (["mkdir data"], "create folder data in root"),
    (["cd games", "mkdir data", "cd .."], "create folder data in games"),
    (["touch list.md"], "create file list.md in root"),
    (["cd src", "touch list.md", "cd .."], "create file list.md in src"),
    (["mv src games"], "move src into games"),
    (["mv music data"], "rename music to data"),
    (["cd music", "mv backup ..", "cd .."], "move backup from music into root"),
    (["cd music", "cd backup", "rm ideas.md", "cd ..", "rm backup", "cd .."],
     "delete folder backup from music and everything in it"),
    (["cd games"], "go to folder games"),
    (["cd music", "cd backup"], "go to folder backup in music"),
]


@pytest.mark.parametrize("actions,text", CHANGES, ids=[t for _, t in CHANGES])
def test_describe_changes_names_one_change(actions, text):
    env, before = run_actions(actions)
    parts = env.describe_changes(before, env.state())
    assert [p.text for p in parts] == [text]
    part = parts[0]
    assert part.entities and all(isinstance(e, str) for e in part.entities)
    goal = env.goal_of(part.conditions)
    assert goal == {"all": list(part.conditions)}
    assert not holds_after(goal, [])  # a goal that held at the start would be no task
    assert holds_after(goal, actions)
    assert verify_task(FilesEnv, seed_task(goal=goal, reference=actions)) == (True, "ok")


def test_describe_changes_splits_several_changes_and_queries_join_them():
    actions = ["mv poem.md src", "mkdir data", "cd games"]
    env, before = run_actions(actions)
    parts = env.describe_changes(before, env.state())
    texts = [p.text for p in parts]
    assert sorted(texts) == sorted(["move poem.md into src", "create folder data in root",
                                    "go to folder games"])
    for part in parts:  # each part alone holds after the actions, not at the start
        assert holds_after(env.goal_of(part.conditions), actions)
        assert not holds_after(env.goal_of(part.conditions), [])
    assert env.query_of(texts[:2]) == f"{texts[0]} and {texts[1]}"
    all_conditions = [c for p in parts for c in p.conditions]
    assert holds_after(env.goal_of(all_conditions), actions)
    assert not holds_after(env.goal_of(all_conditions), actions[:2])


def test_describe_changes_of_nothing_is_nothing():
    env, before = run_actions(["ls", "cd src", "cd ..", "cat poem.md"])
    assert env.describe_changes(before, env.state()) == []


def test_describe_changes_delete_inside_a_moved_folder_pins_the_deletion():
    actions = ["mv music games", "cd games", "cd music", "rm recipe.txt"]
    env, before = run_actions(actions)
    parts = {p.text: p for p in env.describe_changes(before, env.state())}
    delete = parts["delete recipe.txt from music"]
    goal = env.goal_of(delete.conditions)
    assert holds_after(goal, actions)
    # Only moving the folder keeps recipe.txt (now games/music/recipe.txt): not a deletion.
    assert not holds_after(goal, ["mv music games"])


# --- describe_response ------------------------------------------------------------------------

RESPONSES = [
    ([], "cat poem.md", "show the words of poem.md"),
    (["cd src"], "cat draft.md", "show the words of draft.md in src"),
    ([], "ls", "list the folder root"),
    ([], "ls games", "list the folder games"),
    (["cd src"], "ls", "list the folder src"),
    (["cd src"], "ls ..", "list the folder root"),
    ([], "grep tiger games", "list files that contain tiger in games"),
    (["cd music"], "grep stone", "list files that contain stone in music"),
    ([], "pwd", "show the current path"),
    (["cd music"], "pwd", "go to folder music and show the current path"),
]


@pytest.mark.parametrize("before_actions,action,text", RESPONSES,
                         ids=[f"{a}:{t}" for _, a, t in RESPONSES])
def test_describe_response_goal_holds_only_after_the_call(before_actions, action, text):
    env, _ = run_actions(before_actions)
    at_call = env.state()
    obs, _, info = env.step(action)
    assert info["error"] is None
    part = env.describe_response(action, obs, at_call)
    assert part is not None and part.text == text
    assert part.conditions == ({"response": obs},)
    goal = env.goal_of(part.conditions)
    assert not holds_after(goal, before_actions)
    assert holds_after(goal, before_actions + [action])


@pytest.mark.parametrize("action", ["mv poem.md src", "cd src", "cat poem.md 2", "nonsense !"])
def test_describe_response_only_for_reads(action):
    env, _ = run_actions([])
    state = env.state()
    obs, _, _ = env.step(action)
    assert env.describe_response(action, obs, state) is None


# --- verify_task --------------------------------------------------------------------------------

MOVE_GOAL = {"all": [{"absent": ["poem.md"]}, {"file": ["src", "poem.md"], "content": POEM}]}


@pytest.mark.parametrize("goal,reference,expected", [
    (MOVE_GOAL, ["mv poem.md src"], (True, "ok")),
    (MOVE_GOAL, ["ls", "cd src", "cd ..", "mv poem.md src"], (True, "ok")),
    (MOVE_GOAL, ["cp poem.md src"], (False, "goal_not_reached")),
    (MOVE_GOAL, ["cd photos", "mv poem.md src"], (False, "invalid_step")),  # no such folder
    (MOVE_GOAL, ["mv poem.md src", "rm nothing.txt"], (False, "invalid_step")),  # bad name
    (MOVE_GOAL, ["rm $(reboot)"], (False, "invalid_step")),  # does not parse
    ({"all": [{"folder": ["src"]}]}, ["ls"], (False, "satisfied_at_start")),
    (MOVE_GOAL, [], (False, "no_reference")),
    ({"description": "tidy up the poems"}, ["mv poem.md src"], (True, "ok")),
    ({"description": "tidy up the poems"}, ["mv poem.md photos"], (False, "invalid_step")),
])
def test_verify_task_reasons(goal, reference, expected):
    assert verify_task(FilesEnv, seed_task(goal=goal, reference=reference)) == expected
    assert expected[1] in VERIFY_REASONS


def test_described_only():
    assert described_only({"description": "x"})
    assert not described_only({"description": "x", "all": []})
    assert not described_only(MOVE_GOAL)
    assert not described_only("move it")


# --- the explorer -----------------------------------------------------------------------------

SMALL = ExploreSettings(breadth_steps=12, depth_steps=8)
FULL = ExploreSettings(breadth_steps=30, depth_steps=20)


@pytest.fixture(scope="module")
def explorations() -> list[Exploration]:
    """10 seeds x 2 explorations of 30 + 20 steps with the schema sampler."""
    explorer = Explorer(FilesEnv, FULL, seed=0)
    return [explorer.explore(s, i) for s in seed_tasks(explorer.env, 10) for i in range(2)]


def test_seed_tasks():
    env = FilesEnv(explore_worlds=0)  # no declared worlds: those of the training tasks
    seeds = seed_tasks(env)
    assert [t.seed for t in seeds] == sorted({t.seed for t in env.tasks("train")})
    assert [t.seed for t in seed_tasks(env, 3)] == [0, 1, 2]
    assert all(t.env == "files" and t.task_id == f"explore/{t.seed}" for t in seeds)


def test_seed_tasks_visit_the_declared_training_worlds_and_no_held_out_one(caplog):
    class Declared(FilesEnv):
        train_worlds = range(0, 60)  # files' held-out worlds among them

    env = Declared(explore_worlds=0)  # the class's worlds, not files' option's
    held_out = {t.seed for split in ("validation", "test") for t in env.tasks(split)}
    with caplog.at_level("WARNING", logger="questioning.explorer"):
        seeds = [t.seed for t in seed_tasks(env)]
    assert seeds == sorted(set(range(60)) - held_out) and len(seeds) > 30
    assert "leaves them out" in caplog.text
    assert [t.seed for t in seed_tasks(env, 4)] == seeds[:4]

    class NoTasks(FilesEnv):
        def tasks(self, split):
            return []

    assert [t.seed for t in seed_tasks(NoTasks(explore_worlds=0))] == [0]  # nothing declared
    NoTasks.train_worlds = (9, 3, 3)
    assert [t.seed for t in seed_tasks(NoTasks(explore_worlds=0))] == [3, 9]


def test_a_served_class_carries_its_training_worlds():
    from environments.remote import _bind, served_facts
    from protocol import codec

    class Declared(FilesEnv):
        train_worlds = range(2, 5)

    frame = codec.encode(served_facts(Declared), "hello")
    served = codec.decode(frame)[1]
    link = SimpleNamespace(hello=lambda: served, address="tcp://127.0.0.1:1")
    assert _bind(link).train_worlds == (2, 3, 4)


def test_files_explore_worlds_declares_training_worlds_no_built_in_task_uses():
    env = FilesEnv(explore_worlds=200)
    held_out = {t.seed for split in ("validation", "test") for t in env.tasks(split)}
    seeds = [t.seed for t in seed_tasks(env)]
    assert len(seeds) == 120 and max(seeds) > 190 and not set(seeds) & held_out
    assert {t.seed for t in env.tasks("train")} < set(seeds)  # the built-in ones among them
    assert FilesEnv().train_worlds == env.train_worlds  # the default: 200 seeds' 120
    assert FilesEnv(explore_worlds=0).train_worlds == ()  # the built-in worlds only
    by_task = FilesEnv(holdout="task", explore_worlds=60).train_worlds
    assert by_task == tuple(range(50, 60))  # every built-in world holds held-out tasks
    with pytest.raises(ValueError, match="explore_worlds"):
        FilesEnv(explore_worlds=-1)


def test_a_served_env_carries_the_training_worlds_of_the_servers_options():
    from autodidact.env_serve import EnvWorker
    from protocol import env_wire as wire

    hello = wire.EnvHello(wire.ENV_WIRE_VERSION)
    served = EnvWorker("files", "w0", options={"explore_worlds": 20}).answer(hello)
    assert served.train_worlds == [s for s in range(20) if s % 5 < 3]
    # without options, the default instance's: the 120 training worlds of seeds 0-199
    assert EnvWorker("files", "w0").answer(hello).train_worlds == list(FilesEnv().train_worlds)
    refused = EnvWorker("files", "w0", options={"explore_worlds": -1}).answer(hello)
    assert isinstance(refused, wire.EnvRaised) and "explore_worlds" in str(refused)


def test_explorer_steps_phases_and_snapshots_replay():
    explorer = Explorer(FilesEnv, SMALL, seed=3)
    seeds = seed_tasks(explorer.env, 4)
    exps = [explorer.explore(s, i) for s in seeds for i in range(2)]
    assert [e.exploration_id for e in exps[:2]] == ["0/0", "0/1"]
    for exp in exps:
        assert len(exp.steps) == SMALL.breadth_steps + SMALL.depth_steps
        assert [s.phase for s in exp.steps] == (["breadth"] * SMALL.breadth_steps
                                                + ["depth"] * SMALL.depth_steps)
        assert all(s.proposer == "schema" for s in exp.steps)
        env = FilesEnv()
        assert env.reset(seed_task(exp.seed)) == exp.initial_observation
        assert env.state() == exp.initial_state
        for step in exp.steps:
            obs, _, info = env.step(step.action)
            assert (obs, info["valid"], info["tool"], info["error"]) == (
                step.observation, step.valid, step.tool, step.error)
            assert env.state() == step.state
    counts = explorer.counts
    assert counts["explorations"] == len(exps)
    assert counts["steps"] == counts["schema_actions"] == len(exps) * 20
    assert counts["ok"] + counts["errors"] == counts["steps"] and counts["ok"] > 0


def test_explorer_calls_every_tool(explorations):
    called = Counter(s.tool for e in explorations for s in e.steps)
    assert set(TOOLS) <= set(called)
    assert all(s.valid for e in explorations for s in e.steps)  # schema calls always parse


def test_exploration_round_trips(explorations):
    for exp in explorations[:3]:
        raw = exp.to_dict()
        assert Exploration.from_dict(raw) == exp
        assert Exploration.from_dict(json.loads(json.dumps(raw))) == exp


# --- the profile ----------------------------------------------------------------------------


def test_profile_tools_entities_and_preconditions(explorations):
    profile = build_profile(FilesEnv(), explorations)
    assert profile["env"] == "files"
    assert profile["explorations"] == 20 and profile["steps"] == 20 * 50
    by_tool = {t["name"]: t for t in profile["tools"]}
    assert list(by_tool) == TOOLS
    called = Counter(s.tool for e in explorations for s in e.steps)
    for name, tool in by_tool.items():
        assert tool["calls"] == called[name] > 0
        errors = sum(e["count"] for e in tool["errors"].values())
        assert tool["ok"] + errors == tool["calls"]
    assert {"file", "folder", "word"} <= set(profile["entities"])
    assert "cat.file" in profile["entities"]["file"]["operations"]
    assert "cd.folder" in profile["entities"]["folder"]["operations"]
    assert "extension" in profile["entities"]["file"]["attributes"]
    for spec in FilesEnv().tools():
        pre = [p for p in profile["preconditions"] if p["tool"] == spec.name]
        if not spec.args:
            assert pre == []
            continue
        assert pre, f"no refusal of {spec.name} observed"
        for p in pre:
            assert p["count"] > 0 and p["action"].split()[0] == spec.name
            assert p["observation"].startswith("error :")
    toc = render_toc(profile)
    for spec in FilesEnv().tools():
        assert f"- {spec.usage()}: {spec.description}" in toc
    assert "file (" in toc and "folder (" in toc


def test_profile_without_entity_hook_falls_back_to_argument_names(explorations, monkeypatch):
    monkeypatch.setattr(FilesEnv, "entities", lambda self, state: [])
    profile = build_profile(FilesEnv(), explorations)
    arg_names = {a.name for t in FilesEnv().tools() for a in t.args}
    assert profile["entities"] and set(profile["entities"]) <= arg_names
    for kind, info in profile["entities"].items():  # named after the argument that took it
        assert all(op.split(".")[1] == kind for op in list(info["operations"])
                   + [e.split(":")[0] for e in info["errors"]])


def test_profile_without_entity_hook_names_every_argument(explorations, monkeypatch):
    monkeypatch.setattr(FilesEnv, "entities", lambda self, state: [])
    profile = build_profile(FilesEnv(), explorations)
    specs = {t.name: t for t in FilesEnv().tools()}
    used = {arg.name for e in explorations for s in e.steps
            for arg, _ in zip(specs[s.tool].args, s.action.split()[1:])}
    assert used >= {"file", "folder", "src", "dst", "name", "word"}
    assert set(profile["entities"]) >= {"file", "folder", "src", "dst", "name", "word"}


# --- hindsight synthesis ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hindsight_explorations(explorations) -> list[Exploration]:
    """The 20 explorations above and 40 more by explorers with other rng seeds."""
    out = list(explorations)
    for rng_seed in (1, 2):
        explorer = Explorer(FilesEnv, FULL, seed=rng_seed)
        out += [explorer.explore(s, i) for s in seed_tasks(explorer.env, 10) for i in range(2)]
    return out


@pytest.fixture(scope="module")
def hindsight_tasks(hindsight_explorations) -> list[Task]:
    synth = HindsightSynthesizer(FilesEnv, Preferences(max_steps=10))
    tasks = [t for e in hindsight_explorations for t in synth.propose(e)]
    assert synth.stats["proposed"] == len(tasks)
    return tasks


@pytest.mark.slow
def test_hindsight_tasks_verify(hindsight_tasks):
    assert len(hindsight_tasks) >= 100
    assert len({t.seed for t in hindsight_tasks}) == 10
    for task in hindsight_tasks:
        assert verify_task(FilesEnv, task) == (True, "ok"), task


def removable_steps(task: Task) -> list[int]:
    """Reference steps whose removal leaves a reference that still verifies."""
    return [i for i in range(len(task.reference))
            if verify_task(FilesEnv, dataclasses.replace(
                task, reference=task.reference[:i] + task.reference[i + 1:]))[0]]


def test_hindsight_references_are_minimal(hindsight_tasks):
    not_minimal = [(t.query, t.reference, steps) for t in hindsight_tasks
                   if (steps := removable_steps(t))]
    assert not_minimal == []


def test_hindsight_task_fields_and_meta(hindsight_tasks, hindsight_explorations):
    ids = {e.exploration_id for e in hindsight_explorations}
    for task in hindsight_tasks:
        assert task.source == "synthetic" and task.split == "train" and task.env == "files"
        assert task.task_id == f"synth/files/{task.seed}/{task.task_id.rsplit('/', 1)[1]}"
        meta = task.meta
        assert meta["method"] == "hindsight" and meta["seed"] == task.seed
        assert meta["exploration"] in ids and meta["exploration"].startswith(f"{task.seed}/")
        assert meta["steps"] == len(task.reference) >= 1
        assert meta["confidence"] in (0.9, 0.5)
        assert isinstance(meta["entities"], int) and meta["entities"] >= 0
        assert 0 <= meta["dependent_ops"] < len(task.reference)  # no call follows the last
        assert task.difficulty == len(task.reference) + 0.5 * meta["dependent_ops"]
    assert any(t.meta["dependent_ops"] > 0 for t in hindsight_tasks)
    # One id per (seed, goal, query): the same task found by two explorations shares its id.
    by_id = {}
    for task in hindsight_tasks:
        key = (task.seed, goal_key(task.goal), task.query)
        assert by_id.setdefault(task.task_id, key) == key
    assert len(by_id) == len({(t.seed, goal_key(t.goal), t.query) for t in hindsight_tasks})


def test_hindsight_worded_queries_stay_in_the_vocabulary(hindsight_tasks):
    worded = [t for t in hindsight_tasks if t.meta["confidence"] == 0.9]
    assert len(worded) >= 100
    for task in worded:
        assert set(task.query.split()) <= VOCAB, task.query


def test_hindsight_wordless_queries_stay_in_the_vocabulary():
    exp = exploration_of(["rm poem.md", "touch poem.md"])
    tasks = HindsightSynthesizer(FilesEnv, Preferences()).propose(exp)
    assert tasks
    for task in tasks:
        assert set(task.query.split()) <= VOCAB, task.query


def test_hindsight_ids_are_stable(explorations):
    # Every goal, not the 40 a seeded shuffle keeps: the ids, not the cut, are under test.
    a = HindsightSynthesizer(FilesEnv, Preferences(max_steps=10), max_candidates=1000,
                             seed=0).propose(explorations[0])
    b = HindsightSynthesizer(FilesEnv, Preferences(max_steps=10), max_candidates=1000,
                             seed=7).propose(explorations[0])
    assert a and {t.task_id for t in a} == {t.task_id for t in b}
    task = a[0]
    goal = task.goal
    shuffled = {"all": list(reversed(goal["all"]))}
    env = FilesEnv()
    same = make_task(env, task.seed, task.query, shuffled, task.reference, {})
    assert same.task_id == task.task_id
    other = make_task(env, task.seed, task.query + " and go to root", goal, task.reference, {})
    assert other.task_id != task.task_id


def test_hindsight_from_a_scripted_exploration():
    exp = exploration_of(["ls", "cd src", "pwd", "cat draft.md", "mv draft.md ..", "cd ..",
                          "mv poem.md games"])
    tasks = {t.query: t for t in HindsightSynthesizer(FilesEnv, Preferences()).propose(exp)}
    out = tasks["move draft.md from src into root"]
    assert out.reference == ["cd src", "mv draft.md .."]
    assert out.meta["dependent_ops"] == 1 and out.meta["parts"] == 1
    both = tasks["move draft.md from src into root and move poem.md into games"]
    assert both.reference == ["cd src", "mv draft.md ..", "cd ..", "mv poem.md games"]
    assert both.meta["dependent_ops"] == 2 and both.meta["parts"] == 2
    read = tasks["go to folder src and show the words of draft.md in src"]
    assert read.reference == ["cd src", "cat draft.md"]
    assert read.goal["all"][-1] == {"response": WORLD["src"]["draft.md"]}
    assert tasks["go to folder src and show the current path"].reference == ["cd src", "pwd"]
    assert tasks["list the folder root"].reference == ["ls"]
    assert "move poem.md into games" in tasks
    for task in tasks.values():
        assert verify_task(FilesEnv, task) == (True, "ok")


def test_hindsight_reference_minimal_after_a_pruned_step():
    exp = exploration_of(["ls", "cd src", "pwd", "cat draft.md", "mv draft.md ..", "cd ..",
                          "mv poem.md games"])
    tasks = {t.query: t for t in HindsightSynthesizer(FilesEnv, Preferences()).propose(exp)}
    assert tasks["move poem.md into games"].reference == ["mv poem.md games"]


def test_hindsight_references_minimal_after_cd_chains():
    exp = exploration_of(["mv music games", "cd games", "cd music", "rm recipe.txt"])
    tasks = HindsightSynthesizer(FilesEnv, Preferences(max_steps=10)).propose(exp)
    moved = [t for t in tasks if t.query == "move music into games"]
    assert moved
    for task in moved:
        assert task.reference == ["mv music games"], task.reference


# --- Replayer.prune -----------------------------------------------------------------------------


def test_prune_drops_no_effect_steps_and_keeps_dependent_ones():
    draft = WORLD["src"]["draft.md"]
    goal = {"all": [{"absent": ["src", "draft.md"]}, {"file": ["draft.md"], "content": draft}]}
    replayer = Replayer(FilesEnv)
    actions = ["ls", "cd src", "pwd", "cat draft.md", "mv draft.md ..", "ls", "pwd"]
    assert replayer.prune(seed_task(goal=goal), actions) == (["cd src", "mv draft.md .."], 1)
    assert replayer.prune(seed_task(goal=MOVE_GOAL),
                          ["cat poem.md", "mv poem.md src", "ls src"]) == (["mv poem.md src"], 0)
    assert replayer.prune(seed_task(goal=MOVE_GOAL), ["ls", "cp poem.md src"]) is None
    assert replayer.prune(seed_task(goal=MOVE_GOAL), ["cd photos", "mv poem.md src"]) is None
    assert replayer.run(seed_task(goal=MOVE_GOAL), ["mv poem.md src"]) == "reached"
    assert replayer.run(seed_task(goal=MOVE_GOAL), ["ls"]) == "missed"
    assert replayer.run(seed_task(goal=MOVE_GOAL), ["ls photos"]) == "invalid"


def test_prune_result_is_minimal():
    replayer = Replayer(FilesEnv)
    pruned = replayer.prune(seed_task(goal=MOVE_GOAL),
                            ["mkdir data", "cd data", "cd ..", "mv poem.md src"])
    assert pruned == (["mv poem.md src"], 0)


# --- preferences and de-duplication -----------------------------------------------------------


def test_preferences_accepts():
    def task(steps, entities=0):
        return Task("x", "files", "q", 0, reference=["ls"] * steps, meta={"entities": entities})

    prefs = Preferences(min_steps=2, max_steps=3)
    assert [prefs.accepts(task(n)) for n in range(5)] == [False, False, True, True, False]
    limited = Preferences(max_steps=5, max_entities=2)
    assert limited.accepts(task(1, 2)) and not limited.accepts(task(1, 3))
    assert Preferences(max_steps=5).accepts(task(1, 99))  # 0 = any number of entities
    assert Preferences().accepts(Task("x", "files", "q", 0, reference=["ls"]))  # no meta


def synth_task(seed: int, query: str, goal: dict) -> Task:
    return make_task(FilesEnv(), seed, query, goal, ["ls"], {"method": "hindsight"})


def test_task_deduper():
    dedup = TaskDeduper(0.8)
    g = [{"all": [{"folder": [f"f{i}"]}]} for i in range(6)]
    base = "move poem.md into src and go to folder games"
    assert dedup.add(synth_task(1, base, g[0]))
    close = base + " now"  # 8 of 9 words shared: Jaccard 0.89
    assert jaccard(frozenset(base.split()), frozenset(close.split())) >= 0.8
    assert not dedup.add(synth_task(1, close, g[1]))
    assert dedup.stats["duplicate_query"] == 1
    far = "move poem.md into src and delete diary.txt"  # Jaccard 5/10
    assert dedup.add(synth_task(1, far, g[2]))
    assert dedup.add(synth_task(2, base, g[3]))  # same words, another world: another task
    reordered = {"all": [{"absent": ["poem.md"]}, {"folder": ["f0"]}]}
    assert dedup.add(synth_task(3, "first", reordered))
    assert not dedup.add(synth_task(3, "something else entirely",
                                    {"all": list(reversed(reordered["all"]))}))
    assert dedup.stats["duplicate_goal"] == 1
    assert goal_key(reordered) == goal_key({"all": list(reversed(reordered["all"]))})
    assert TaskDeduper(0.8).add(synth_task(1, base.upper(), g[4]))


# --- the task factory ---------------------------------------------------------------------------

# Two explorations of each of 5 worlds a round (the default's four took twice the time): the
# second round still adds explorations 2 and 3 of each world after the first round's 0 and 1.
FACTORY_OVERRIDES = ["explore.seeds=5", "explore.explorations_per_seed=2",
                     "explore.proposer=schema"]


def test_task_factory_end_to_end_and_resume(tmp_path, control):
    cfg = load_config(None, FACTORY_OVERRIDES)
    n = cfg.explore.explorations_per_seed
    said = []
    with TaskStore(tmp_path) as store:
        factory = TaskFactory(cfg, tmp_path, store, control=control, say=said.append)
        summary = factory.run(rounds=1)
        first = store.all()
    seeds = [t.seed for t in seed_tasks(FilesEnv(), 5)]  # training worlds: not 0..4
    assert summary["tasks_stored"] == len(first) > 0
    assert summary["explorations"] == 5 * n
    assert said and "5 seeds" in said[0]
    for task in first:
        assert verify_task(FilesEnv, task) == (True, "ok"), task
        assert cfg.explore.min_steps <= len(task.reference) <= cfg.env.max_turns
    assert len({(t.seed, goal_key(t.goal)) for t in first}) == len(first)
    assert {t.task_id for t in control.synthetic_since(0)} == {t.task_id for t in first}
    assert profile_path(tmp_path).exists()
    profile = json.loads(profile_path(tmp_path).read_text())
    assert profile["explorations"] == 5 * n
    ids = [e.exploration_id for e in read_explorations(tmp_path)]
    assert sorted(ids) == sorted(f"{s}/{i}" for s in seeds for i in range(n))

    with TaskStore(tmp_path) as store:  # reopened by a second factory: it resumes
        again = TaskFactory(cfg, tmp_path, store, control=control, say=said.append)
        assert again.profile.explorations == 5 * n
        assert all((t.seed, goal_key(t.goal)) in again.dedup.goals for t in first)
        assert sum(len(v) for v in again.by_seed.values()) == len(first)
        assert not any(again.dedup.add(t) for t in first[:5])
        again.run(rounds=1)
        second = store.all()
    ids = [e.exploration_id for e in read_explorations(tmp_path)]
    assert len(ids) == len(set(ids)) == 10 * n
    assert set(ids) == {f"{s}/{i}" for s in seeds for i in range(2 * n)}
    assert [t.task_id for t in second[:len(first)]] == [t.task_id for t in first]
    assert len({t.task_id for t in second}) == len(second)
    assert len({(t.seed, goal_key(t.goal)) for t in second}) == len(second)
    assert {t.task_id for t in control.synthetic_since(0)} == {t.task_id for t in second}
    assert len(explorations_path(tmp_path).read_text().splitlines()) == 10 * n


def test_read_explorations_skips_a_damaged_line(tmp_path, explorations):
    path = explorations_path(tmp_path)
    path.parent.mkdir(parents=True)
    lines = [json.dumps(e.to_dict()) for e in explorations[:2]]
    path.write_text(f"{lines[0]}\n{lines[1][:40]}\n{lines[1]}\n")
    assert read_explorations(tmp_path) == [explorations[0], explorations[1]]
    assert read_explorations(tmp_path / "nowhere") == []


def test_task_factory_resumes_after_a_line_cut_short(tmp_path):
    cfg = load_config(None, ["explore.seeds=1", "explore.explorations_per_seed=1",
                             "explore.proposer=schema", "explore.breadth_steps=5",
                             "explore.depth_steps=5"])
    with TaskStore(tmp_path) as store:
        TaskFactory(cfg, tmp_path, store, say=lambda _: None).run(rounds=1)
    path = explorations_path(tmp_path)
    with path.open("a") as f:  # a crash in the middle of writing the next exploration
        f.write(path.read_text().splitlines()[0][:50])
    with TaskStore(tmp_path) as store:
        TaskFactory(cfg, tmp_path, store, say=lambda _: None).run(rounds=1)
    assert [e.exploration_id for e in read_explorations(tmp_path)] == ["0/0", "0/1"]


# --- the task mix -------------------------------------------------------------------------------


def originals(n: int = 6) -> list[Task]:
    return FilesEnv().tasks("train")[:n]


def synthetics(n: int, start: int = 0) -> list[Task]:
    return [synth_task(i, f"go to folder f{i}", {"all": [{"cwd": [f"f{i}"]}]})
            for i in range(start, start + n)]


def drain(control) -> list[Task]:
    out = []
    while (task := control.pop_task()) is not None:
        out.append(task)
    return out


@pytest.mark.parametrize("share,want", [(1.0, {"synthetic"}), (0.0, {"original"}),
                                        (0.5, {"synthetic", "original"})])
def test_task_feeder_mixture(control, share, want):
    cfg = load_config(None, [])
    control.add_synthetic(synthetics(3))
    feeder = TaskFeeder(cfg, control, originals(), share)
    feeder.top_up()
    pushed = drain(control)
    assert len(pushed) == 4 * feeder.low_water
    assert {t.source for t in pushed} == want
    if share == 1.0:
        assert {t.task_id for t in pushed} == {t.task_id for t in synthetics(3)}


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_a_mixed_feeder_draws_both_origins_in_the_configured_share(control, share):
    """What a mixed run's actors pop, over many top-ups, is self-made in the configured
    share (binomial: within 4 standard errors), and both pools are cycled through."""
    cfg = load_config(None, [f"tasks.synthetic_share={share}"])
    control.add_synthetic(synthetics(40))
    feeder = TaskFeeder(cfg, control, originals(30), share)
    drawn = []
    for _ in range(20):
        feeder.top_up()
        drawn += drain(control)
    made = sum(t.source == "synthetic" for t in drawn) / len(drawn)
    assert abs(made - share) < 4 * (share * (1 - share) / len(drawn)) ** 0.5, (made, len(drawn))
    assert {t.task_id for t in drawn} == {t.task_id for t in synthetics(40) + originals(30)}


def _shaped(n: int, calls: int, start: int = 0) -> list[Task]:
    return [dataclasses.replace(t, reference=["pwd"] * calls) for t in synthetics(n, start)]


def test_self_made_tasks_are_drawn_in_the_shape_of_the_examples():
    """90 one-call and 10 three-call self-made tasks; the examples are all three-call: with
    match_examples 1 only three-call tasks are drawn, with 0.5 half of them, with 0 a tenth."""
    from autodidact.task_mix import example_weights, task_shape, weighted_sample

    pool = _shaped(90, 1) + _shaped(10, 3, start=90)
    examples = [dataclasses.replace(t, reference=["cd a", "cd b", "cd c"]) for t in originals(4)]
    assert task_shape(examples[0]) == ("state", 3)
    for strength, want in ((1.0, 1.0), (0.5, 0.55), (0.0, 0.1)):
        weights = example_weights(pool, examples, strength)
        three = sum(w for t, w in zip(pool, weights) if len(t.reference) == 3) / sum(weights)
        assert three == pytest.approx(want), strength
    rng = random.Random(0)
    picked = weighted_sample(rng, pool, example_weights(pool, examples, 1.0), 20)
    assert len(picked) == 10 and all(len(t.reference) == 3 for t in picked)
    assert example_weights(pool, [], 1.0) == [1.0] * 100  # no examples: drawn alike


def test_the_feeder_and_the_warm_start_follow_the_example_shape(control):
    cfg = load_config(None, ["tasks.synthetic_share=1.0", "tasks.match_examples=1.0",
                             "warmstart.max_examples=10"])
    examples = [dataclasses.replace(t, reference=["cd a", "cd b", "cd c"]) for t in originals(4)]
    pool = _shaped(90, 1) + _shaped(10, 3, start=90)
    warm = warmstart_tasks(cfg, examples, pool, 1.0)
    assert len(warm) == 10 and all(len(t.reference) == 3 for t in warm)
    control.add_synthetic(pool)
    feeder = TaskFeeder(cfg, control, examples, 1.0)
    feeder.top_up()
    assert {len(t.reference) for t in drain(control)} == {3}


def test_rl_does_not_start_on_the_tasks_the_warm_start_trained_on(control):
    # Same seed, same pool: the feeder's draws must not repeat the warm-start's picks (they
    # did, when both seeded a Random with cfg.seed: the first 4 top-ups were all warm-start
    # tasks in the SmolLM2 config).
    cfg = load_config(None, ["warmstart.max_examples=200", "actor.num_actors=1",
                             "actor.groups_in_flight=1"])
    pool = synthetics(2000)
    warm = {t.task_id for t in warmstart_tasks(cfg, originals(30), pool, 1.0)}
    control.add_synthetic(pool)
    feeder = TaskFeeder(cfg, control, originals(30), 1.0)
    drawn = []
    for _ in range(4):
        feeder.top_up()
        drawn += drain(control)
    share = sum(t.task_id in warm for t in drawn) / len(drawn)
    assert share < 0.25  # 10% expected (200 of 2000); it was 100%


def test_task_feeder_picks_up_new_synthetic_tasks(control):
    cfg = load_config(None, [])
    feeder = TaskFeeder(cfg, control, [], 1.0)
    feeder.top_up()
    assert control.task_queue_len() == 0  # nothing to hand out yet
    control.add_synthetic(synthetics(2))
    feeder.top_up()
    assert {t.task_id for t in drain(control)} == {t.task_id for t in synthetics(2)}
    control.add_synthetic(synthetics(2, start=10))
    assert feeder.refresh() == 4
    feeder.top_up()
    assert {t.task_id for t in drain(control)} == {t.task_id for t in synthetics(4)[:2]
                                                    + synthetics(2, start=10)}


def test_task_feeder_stops_at_low_water(control):
    cfg = load_config(None, [])
    feeder = TaskFeeder(cfg, control, originals(), 0.0)
    feeder.top_up()
    n = control.task_queue_len()
    assert n >= feeder.low_water
    feeder.top_up()
    assert control.task_queue_len() == n


def test_synthetic_share():
    auto = load_config(None, [])
    assert auto.tasks.synthetic_share == -1 and auto.explore.from_examples > 0
    # auto: the re-grounded examples mixed in when the env has training tasks ...
    assert synthetic_share(auto, originals()) == 0.5
    assert rl_synthetic_share(auto, 0.5) == 0.0  # ... and RL on the env's own tasks alone
    assert synthetic_share(auto, []) == 1.0  # no training tasks: self-made ones alone
    assert synthetic_share(auto, originals(), has_state=False) == 0.0  # nothing to explore
    assert rl_synthetic_share(auto, 1.0) == 1.0
    # nothing re-grounded: the env's own tasks alone
    hindsight = load_config(None, ["explore.from_examples=0"])
    assert synthetic_share(hindsight, originals()) == 0.0
    assert rl_synthetic_share(hindsight, 0.0) == 0.0
    assert synthetic_share(hindsight, []) == 1.0
    # an env mix explores nothing: its members' own tasks
    mix = load_config(None, ["env.mix=[{name: files}, {name: shop}]"])
    assert synthetic_share(mix, originals()) == 0.0
    assert rl_synthetic_share(mix, 0.0) == 0.0
    fixed = load_config(None, ["tasks.synthetic_share=0.3"])
    assert synthetic_share(fixed, originals()) == 0.3
    assert synthetic_share(fixed, []) == 0.3
    assert rl_synthetic_share(fixed, 0.3) == 0.3  # the same share in RL unless one is set
    half = load_config(None, ["tasks.synthetic_share=0.5"])
    assert rl_synthetic_share(half, 0.5) == 0.5  # RL apart only under auto's mixture


@pytest.mark.parametrize("mixing,share,n_synth,want", [
    ("replace", 0.0, 20, None),
    ("replace", 1.0, 20, (10, 0)),
    ("replace", 1.0, 4, (4, 0)),
    ("replace", 0.5, 20, (5, 5)),
    ("replace", 0.3, 20, (3, 7)),
    ("replace", 0.5, 2, (2, 8)),
    ("add", 0.0, 20, None),
    ("add", 1.0, 20, (10, 0)),
    ("add", 0.5, 20, (10, 10)),
    ("add", 0.3, 20, (4, 10)),  # 0.3 of the whole: 10 * 0.3 / 0.7 = 4.3 self-made
    ("add", 0.5, 2, (2, 10)),
])
def test_warmstart_tasks_mixture(mixing, share, n_synth, want):
    cfg = load_config(None, ["warmstart.max_examples=10", f"tasks.warmstart_mixing={mixing}"])
    picked = warmstart_tasks(cfg, originals(30), synthetics(n_synth), share)
    if want is None:
        assert picked is None
        return
    sources = Counter(t.source for t in picked)
    assert (sources["synthetic"], sources["original"]) == want
    assert len({t.task_id for t in picked}) == len(picked)
    assert picked == warmstart_tasks(cfg, originals(30), synthetics(n_synth), share)


def test_added_self_made_references_keep_the_hand_written_ones():
    """``add``: the hand-written references are the very ones the warm-start takes with no
    self-made tasks at all, so the mixture differs from the hand-written arm by what it adds."""
    cfg = load_config(None, ["warmstart.max_examples=10"])
    alone = {t.task_id for t in pick_references(originals(30), cfg.seed, 10)}
    mixed = warmstart_tasks(cfg, originals(30), synthetics(20), 0.25)
    assert {t.task_id for t in mixed if t.source == "original"} == alone
    assert len(alone) == 10


def test_rl_draws_its_own_share_when_one_is_set():
    same = load_config(None, ["tasks.synthetic_share=0.25"])
    assert rl_synthetic_share(same, 0.25) == 0.25
    apart = load_config(None, ["tasks.synthetic_share=0.25", "tasks.rl_synthetic_share=0"])
    assert rl_synthetic_share(apart, 0.25) == 0.0
    with pytest.raises(ConfigError, match="rl_synthetic_share"):
        load_config(None, ["tasks.rl_synthetic_share=1.5"])


def test_warmstart_mixing_refuses_other_values():
    with pytest.raises(ConfigError, match="warmstart_mixing must be one of add, replace"):
        load_config(None, ["tasks.warmstart_mixing=swap"])
