"""Held-out splits are whole worlds: no built-in env's validation or test world is a training
world, and exploration (which visits the training worlds: its training tasks' and those it
declares, ``train_worlds``) never enters one. The explorations of a real default
`autodidact explore` are checked in test_explore_integration.
"""

from __future__ import annotations

import importlib.util

import pytest

from environments import env_class, env_names, make_env, world_split
from environments.base import check_split
from protocol.messages import HELD_OUT_SPLITS, SPLITS
from questioning.explorer import seed_tasks

# The package's own envs (not those a test module registers), bfcl where its package is here.
BUILT_IN = [n for n in env_names() if env_class(n).__module__.startswith("environments.")
            and (n != "bfcl" or importlib.util.find_spec("bfcl_eval"))]


def worlds(env, split: str) -> set[int]:
    """The worlds of ``split``'s tasks, and for ``train`` those the env declares as well."""
    declared = set(env.train_worlds) if split == "train" else set()
    return {t.seed for t in env.tasks(split)} | declared


@pytest.mark.parametrize("name", BUILT_IN)
def test_held_out_worlds_are_never_training_worlds(name):
    env = make_env(name)
    train = worlds(env, "train")
    assert train, f"{name} has no training worlds"
    for split in HELD_OUT_SPLITS:
        held = worlds(env, split)
        assert held, f"{name} has no {split} tasks"
        assert not held & train, f"{name}: {split} worlds {sorted(held & train)} also train"
        assert all(t.split == split for t in env.tasks(split))
    assert not worlds(env, "validation") & worlds(env, "test")


@pytest.mark.parametrize("name", BUILT_IN)
def test_exploration_starts_only_in_training_worlds(name):
    env = make_env(name)
    explored = {t.seed for t in seed_tasks(env)}
    assert explored == worlds(env, "train")
    assert not explored & (worlds(env, "validation") | worlds(env, "test"))


def test_world_split_keeps_three_in_five_for_training_and_never_moves_a_world():
    assert [world_split(s) for s in range(10)] == ["train"] * 3 + ["validation", "test"] + [
        "train"] * 3 + ["validation", "test"]
    assert all(world_split(s) == world_split(s + 5 * 37) for s in range(5))


def test_task_holdout_shares_worlds_so_only_world_holdout_is_the_default():
    by_task = make_env("files", holdout="task")
    assert worlds(by_task, "test") & worlds(by_task, "train")  # what decontamination is for
    assert make_env("files").holdout == "world"


def test_an_unknown_split_is_refused_with_the_names_there_are():
    for split in SPLITS:
        assert check_split(split) == split
    with pytest.raises(ValueError, match="train, validation, test.*'held_out'"):
        make_env("files").tasks("held_out")


def test_a_run_refuses_a_synthetic_pool_holding_a_held_out_task(tmp_path):
    from dataclasses import replace

    from autodidact.stages import NoSyntheticTasks, refuse_contaminated
    from protocol.config import RunConfig

    cfg = RunConfig()
    env = make_env("files")
    held_out = env.tasks("validation")[0]
    clean = [replace(t, task_id=f"synthetic/{t.task_id}", source="synthetic", split="train")
             for t in env.tasks("train")[:20]]
    refuse_contaminated(cfg, tmp_path, clean)  # training worlds only: nothing to refuse
    planted = replace(held_out, task_id="synthetic/planted", source="synthetic", split="train")
    with pytest.raises(NoSyntheticTasks, match=r"1 of 21 .*synthetic/planted ~ "
                       + held_out.task_id + ".*check-contamination"):
        refuse_contaminated(cfg, tmp_path, [*clean, planted])
