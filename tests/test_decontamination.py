"""Decontamination (questioning/decontamination.py): the overlap rule on hand-made goals, the
explore run refusing a planted held-out task as ``contaminated`` and counting it, and
``autodidact tasks check-contamination`` / ``tasks stats`` on real stores.

Everything is real: the ``files`` env and its held-out splits, LMDB task stores in tmp run
dirs, explores of a few seeds through the ``autodidact`` command.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from autodidact.cli import main
from environments.files import FilesEnv
from protocol.config import load_config
from protocol.messages import HELD_OUT_SPLITS, Task
from protocol.run_dir import RunDir
from questioning.decontamination import (
    IMPLIES,
    SAME_GOAL,
    SAME_QUERY,
    SUB_GOAL,
    HeldOutIndex,
    Overlap,
)
from questioning.factory import TaskFactory
from questioning.synthesis import make_task
from questioning.task_store import TaskStore

# --- the rule on hand-made goals ---------------------------------------------------------------

IN_DOCS = {"file": ["docs", "report.txt"], "exists": True}
GONE = {"absent": ["report.txt"]}
CWD = {"cwd": ["docs"]}
OTHER = {"cwd": ["music"]}
HELD = Task("files/0003/move_into", "files", "move report.txt into docs", 3,
            goal={"all": [IN_DOCS, GONE]}, split="test")


def synth(goal: dict, query: str = "something else entirely", seed: int = 3,
          env: str = "files") -> Task:
    return Task(f"synth/{env}/{seed}/x", env, query, seed, goal=goal, source="synthetic")


@pytest.fixture(scope="module")
def index() -> HeldOutIndex:
    return HeldOutIndex([HELD, Task("bfcl/7", "bfcl", "book a flight", 0,
                                    goal={"bfcl_entry": "multi_turn_7"}, split="validation")])


@pytest.mark.parametrize("goal,why", [
    ({"all": [GONE, IN_DOCS]}, SAME_GOAL),  # conditions in another order
    ({"all": [{"exists": True, "file": ["docs", "report.txt"]}, GONE]}, SAME_GOAL),  # key order
    ({"all": [GONE]}, SUB_GOAL),  # part of the held-out goal
    ({"all": [IN_DOCS, GONE, CWD]}, IMPLIES),  # solving it solves the held-out task
])
def test_overlapping_goals_in_the_same_world(index, goal, why):
    assert index.find(synth(goal)) == Overlap(HELD.task_id, "test", why)
    assert index.overlap(synth(goal)) == HELD.task_id


@pytest.mark.parametrize("task", [
    synth({"all": [IN_DOCS, GONE]}, seed=4),  # the same goal in another world
    synth({"all": [IN_DOCS, GONE]}, query=HELD.query, seed=4),  # and the same words
    synth({"all": [IN_DOCS, GONE]}, env="shop"),  # another env
    synth({"all": [OTHER]}),  # a different goal
    synth({"all": [GONE, OTHER]}),  # shares a condition, but neither contains the other
    synth({"all": []}),  # implies nothing
    synth({"bfcl_entry": "multi_turn_8"}, seed=0, env="bfcl"),
])
def test_no_overlap(index, task):
    assert index.find(task) is None and index.overlap(task) is None


def test_the_same_query_with_another_goal(index):
    task = synth({"all": [OTHER]}, query="  Move REPORT.txt   into docs ")
    assert index.find(task) == Overlap(HELD.task_id, "test", SAME_QUERY)


def test_other_goal_forms_overlap_only_when_equal(index):
    assert index.find(synth({"bfcl_entry": "multi_turn_7"}, seed=0, env="bfcl")) == \
        Overlap("bfcl/7", "validation", SAME_GOAL)


# --- the index of a real env --------------------------------------------------------------------


@pytest.fixture(scope="module")
def heldout() -> list[Task]:
    env = FilesEnv()
    return [t for split in HELD_OUT_SPLITS for t in env.tasks(split)]


def test_every_held_out_split_is_indexed(heldout):
    index = HeldOutIndex.of_env(FilesEnv())
    assert index.size == len(heldout) > 0
    assert {t.split for t in heldout} == set(HELD_OUT_SPLITS)
    for task in heldout:
        found = index.find(dataclasses.replace(task, task_id="synth/x", source="synthetic"))
        assert found is not None and found.split == task.split, task.task_id
    for task in FilesEnv().tasks("train")[:50]:  # training worlds hold no held-out task
        assert index.find(task) is None, task.task_id


def test_an_env_without_the_held_out_splits_is_named():
    class OldEnv(FilesEnv):
        def tasks(self, split):
            if split != "train":
                raise ValueError(f"no split {split}")
            return []

    with pytest.raises(ValueError, match="env files: tasks\\('validation'\\) failed"):
        HeldOutIndex.of_env(OldEnv())


# --- synthesis refuses a planted overlap ---------------------------------------------------------


def planted(held: Task, conditions: list | None = None) -> Task:
    """A held-out task's goal (or part of it) as a synthesized task with other words."""
    goal = held.goal if conditions is None else {"all": conditions}
    return make_task(FilesEnv(), held.seed, f"planted {held.task_id}", goal, held.reference,
                     {"method": "hindsight", "confidence": 0.9, "entities": 1})


def two_part_task(heldout: list[Task]) -> Task:
    """A held-out task with two or more conditions, the first of which is not true at the
    start (so that alone, as a sub-goal, it passes verification)."""
    env = FilesEnv()
    for task in heldout:
        conds = task.goal["all"]
        if len(conds) >= 2 and 1 <= len(task.reference) <= 5:
            env.reset(task)
            if env.evaluate(Task("p", "files", "", task.seed, goal={"all": conds[:1]})) < 1:
                return task
    raise AssertionError("no held-out task with two conditions")


def test_explore_refuses_a_planted_overlap_and_counts_it(tmp_path, heldout):
    cfg = load_config(None, ["explore.seeds=1", "explore.explorations_per_seed=1",
                             "explore.proposer=schema", "explore.breadth_steps=5",
                             "explore.depth_steps=5"])
    held = two_part_task(heldout)
    clean = planted(FilesEnv().tasks("train")[0])
    candidates = [planted(held), planted(held, held.goal["all"][:1]), clean]
    with TaskStore(tmp_path) as store:
        factory = TaskFactory(cfg, tmp_path, store, say=lambda _: None)
        assert [t.task_id for t in factory.keep(candidates)] == [clean.task_id]
        assert factory.counts["rejected_contaminated"] == 2
        factory.run(rounds=1)
        stored = store.all()
    assert all(factory.heldout.find(t) is None for t in stored)
    report = json.loads(RunDir(tmp_path).coverage.read_text())
    assert report["refused"]["contaminated"] >= 2  # the explore report keeps the count

    with TaskStore(tmp_path) as store:  # a resumed explore adds to what the last one counted
        again = TaskFactory(cfg, tmp_path, store, say=lambda _: None)
        again.keep([planted(held)])
        assert again.refused()["contaminated"] == report["refused"]["contaminated"] + 1


# --- the commands on real stores ---------------------------------------------------------------

TASK_HOLDOUT = ["--set", "env.options.holdout=task"]  # held-out tasks in the explored worlds


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def explored(tmp_path_factory):
    """A real explore of 5 worlds whose held-out tasks share those worlds (holdout=task), so
    exploration meets held-out tasks and must refuse them."""
    run_dir = tmp_path_factory.mktemp("explored")
    res = cli("explore", "--run-dir", run_dir, *TASK_HOLDOUT, "--set", "explore.seeds=5",
              "--set", "explore.proposer=schema")
    assert res.exit_code == 0, res.output
    return run_dir, res.output


def test_a_default_store_is_clean(explored):
    run_dir, said = explored
    refused = json.loads(RunDir(run_dir).coverage.read_text())["refused"]
    assert refused.get("contaminated", 0) > 0, refused  # there was something to refuse
    assert f"contaminated {refused['contaminated']}" in said
    res = cli("tasks", "check-contamination", "--run-dir", run_dir, *TASK_HOLDOUT)
    assert res.exit_code == 0, res.output
    with TaskStore(run_dir, readonly=True) as store:
        n = store.count()
    assert f"checked {n} stored tasks against" in res.output and "no overlap" in res.output


def test_tasks_stats_shows_the_refusals(explored):
    run_dir, _ = explored
    refused = json.loads(RunDir(run_dir).coverage.read_text())["refused"]
    res = cli("tasks", "stats", "--run-dir", run_dir)
    assert res.exit_code == 0, res.output
    assert "in 5 worlds" in res.output
    assert f"contaminated {refused['contaminated']}" in res.output
    data = json.loads(cli("tasks", "stats", "--run-dir", run_dir, "--json").output)
    assert data["refused"] == refused and data["worlds"] == 5


def test_check_contamination_names_a_planted_overlap(tmp_path, heldout):
    held = two_part_task(heldout)
    bad = [planted(held), planted(held, held.goal["all"][:1])]
    with TaskStore(tmp_path) as store:
        store.put_many([planted(FilesEnv().tasks("train")[0]), *bad])
    res = cli("tasks", "check-contamination", "--run-dir", tmp_path)
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert lines[:2] == [f"{bad[0].task_id}  {held.task_id}  {held.split}  {SAME_GOAL}",
                         f"{bad[1].task_id}  {held.task_id}  {held.split}  {SUB_GOAL}"]
    assert lines[2].startswith("2 of 3 stored tasks against")


def test_stats_of_a_store_explored_before_the_counts(tmp_path):
    with TaskStore(tmp_path) as store:
        store.put(planted(FilesEnv().tasks("train")[0]))
    res = cli("tasks", "stats", "--run-dir", tmp_path)
    assert res.exit_code == 0 and "refused at synthesis: not recorded" in res.output
