"""``tasks.curriculum``: the actors' per-task outcomes in Redis, and a frontier feeder that
draws the tasks whose rollouts both fail and succeed more often than the rest, while still
drawing the rest."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from actor.actor import task_outcomes
from autodidact.task_mix import TaskFeeder, frontier_weight
from protocol.config import ConfigError, load_config
from protocol.messages import Task


def _tasks(n: int) -> list[Task]:
    return [Task(task_id=f"t{i}", query=f"make folder f{i}", env="files", seed=i)
            for i in range(n)]


def _drawn(control, feeder, top_ups: int) -> Counter:
    seen: Counter = Counter()
    for _ in range(top_ups):
        feeder.top_up()
        while (task := control.pop_task()) is not None:
            seen[task.task_id] += 1
    return seen


def test_the_weight_peaks_at_even_odds_and_never_reaches_zero():
    assert frontier_weight(0, 0, 0.1) == pytest.approx(1.0)  # never rolled out: even odds
    assert frontier_weight(20, 40, 0.1) == pytest.approx(1.0)
    failing = [frontier_weight(0, n, 0.1) for n in (4, 16, 64, 10_000)]
    assert failing == sorted(failing, reverse=True) and failing[-1] > 0.1
    assert failing[:3] == pytest.approx([0.6, 0.289, 0.154], abs=1e-3)
    assert frontier_weight(64, 64, 0.1) == pytest.approx(frontier_weight(0, 64, 0.1))


def test_outcomes_add_up_per_task_in_redis(control):
    def episode(task_id, reward):
        return SimpleNamespace(task=SimpleNamespace(task_id=task_id), reward=reward)

    rolled = [episode("a", 1.0), episode("a", 0.0), episode("a", 1.5), episode("b", 0.9)]
    assert task_outcomes(rolled) == {"a": (2, 3), "b": (0, 1)}  # 0.9 is not a success
    control.record_outcomes(task_outcomes(rolled))
    control.record_outcomes({"b": (1, 4)})
    assert control.task_outcomes() == {"a": (2, 3), "b": (1, 5)}


def test_a_planted_always_solved_task_is_drawn_less_and_still_drawn(control):
    tasks = _tasks(8)
    control.record_outcomes({"t0": (200, 200), "t1": (100, 200), "t2": (0, 200)})
    frontier = TaskFeeder(load_config(None, ["tasks.curriculum=frontier"]), control, tasks, 0.0)
    seen = _drawn(control, frontier, 20)
    # t0 and t2 weigh about 0.12, t1 and the five unseen tasks 1: t0 about a tenth of t1.
    assert seen["t0"] < seen["t1"] / 4 and seen["t2"] < seen["t1"] / 4
    assert seen["t0"] > 0 and seen["t2"] > 0  # the floor: still revisited
    assert all(seen[f"t{i}"] > seen["t0"] for i in range(3, 8))
    # The same outcomes under the uniform curriculum: drawn alike.
    uniform = TaskFeeder(load_config(None, []), control, tasks, 0.0)
    even = _drawn(control, uniform, 20)
    assert max(even.values()) - min(even.values()) <= 1


def test_the_feeder_reads_new_outcomes_at_each_top_up(control):
    tasks = _tasks(2)
    feeder = TaskFeeder(load_config(None, ["tasks.curriculum=frontier"]), control, tasks, 0.0)
    before = _drawn(control, feeder, 10)
    assert before["t0"] > before["t1"] / 2  # nothing known: about even
    control.record_outcomes({"t0": (0, 500)})
    after = _drawn(control, feeder, 10)
    assert after["t0"] < after["t1"] / 4


def test_a_curriculum_the_feeder_does_not_know_is_refused():
    with pytest.raises(ConfigError, match="curriculum must be one of uniform, frontier"):
        load_config(None, ["tasks.curriculum=hardest"])
    with pytest.raises(ConfigError, match="frontier_floor must be above 0"):
        load_config(None, ["tasks.frontier_floor=0"])
