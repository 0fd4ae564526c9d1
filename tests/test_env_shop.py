"""The ``shop`` environment (issue 22): a stateful order service unlike ``files`` — ids the
agent must invent, quantities above 3, reversible operations — and what self-questioning makes
of it: event goals for tasks that leave the shop as it was, references the constrained policy
can produce, no coverage gaps."""

from __future__ import annotations

import pytest

from environments import make_env, verify_task
from environments.shop import ShopEnv, build_tasks, make_world
from protocol.messages import Task
from questioning.coverage import count_tool_uses, coverage
from questioning.explorer import Exploration, Explorer, ExploreSettings, ExploreStep, seed_tasks
from questioning.synthesis import HindsightSynthesizer, Preferences

TASKS = build_tasks()
VOCAB = set(ShopEnv.vocabulary())


def run(actions, seed: int = 0, goal=None) -> tuple[ShopEnv, Task, list[str]]:
    env, task = ShopEnv(), Task("t", "shop", "", seed, goal=goal or {})
    observations = [env.reset(task)]
    for action in actions:
        observations.append(env.step(action)[0])
    return env, task, observations


def test_own_tasks_verify_and_hold_out_whole_worlds():
    assert make_env("shop").name == "shop"
    assert all(verify_task(ShopEnv, t) == (True, "ok") for t in TASKS)
    test = [t for t in TASKS if t.split == "test"]
    assert len(test) >= 50 and {t.seed % 5 for t in test} == {4}
    assert {t.meta["template"] for t in test} >= {"reserve_cancel", "reserve_more", "restock"}


def test_every_word_it_says_or_asks_is_in_its_vocabulary():
    env = ShopEnv()
    for task in TASKS:
        assert set(task.query.split()) <= VOCAB, task.query
        words = set(env.reset(task).split())
        for action in task.reference + ["reserve o1 pipe 99", "cancel o12", "fly", "stock o3"]:
            words |= set(env.step(action)[0].split())
        assert words <= VOCAB, words - VOCAB


def test_reserve_then_cancel_is_a_goal_only_events_can_state():
    task = next(t for t in TASKS if t.meta["template"] == "reserve_cancel")
    reserve, cancel = task.reference
    env, _, _ = run([])
    start = env.state()
    for actions, reached in [([reserve, cancel], True), ([reserve], False),
                             ([cancel], False), ([], False)]:
        env.reset(task)
        for action in actions:
            env.step(action)
        assert env.evaluate(task) == float(reached), actions
    env.reset(task)
    for action in task.reference:
        env.step(action)
    assert env.state() == start  # the end state says nothing of what happened


def test_hindsight_over_events_makes_the_reserve_cancel_task():
    world = make_world(0)
    item = next(iter(world["stock"]))
    actions = ["stock", f"reserve o7 {item} 2", "orders", "cancel o7"]
    env, task, observations = run(actions)
    exp = Exploration("0/0", "shop", 0, observations[0], make_world(0))
    env.reset(task)
    for action in actions:
        obs, _, info = env.step(action)
        exp.steps.append(ExploreStep(action, obs, True, action.split()[0], info["error"],
                                     "breadth", "schema", env.state()))
    made = {t.query: t for t in HindsightSynthesizer(ShopEnv, Preferences()).propose(exp)}
    task = made[f"reserve 2 {item} for order o7 and then cancel order o7"]
    assert task.reference == [f"reserve o7 {item} 2", "cancel o7"]
    assert task.goal == {"all": [{"event": f"reserve o7 {item} 2"}, {"event": "cancel o7"}]}
    assert verify_task(ShopEnv, task) == (True, "ok")


@pytest.fixture(scope="module")
def explored() -> tuple[Explorer, list[Task]]:
    explorer = Explorer(ShopEnv, ExploreSettings(), seed=0)
    synth = HindsightSynthesizer(ShopEnv, Preferences(max_steps=4))
    tasks = []
    for seed in seed_tasks(explorer.env)[:20]:
        tasks += [t for t in synth.propose(explorer.explore(seed, 0))
                  if verify_task(ShopEnv, t)[0]]
    return explorer, tasks


@pytest.mark.slow
def test_self_made_tasks_invent_order_ids_use_big_quantities_and_cover_every_tool(explored):
    explorer, tasks = explored
    reserves = [a.split() for t in tasks for a in t.reference if a.startswith("reserve ")]
    assert reserves, "no task reserves anything"
    used_ids = {w[1] for w in reserves}
    assert len(used_ids) >= 4  # not one id seen in an observation, reused
    assert any(int(w[3]) > 3 for w in reserves) or any(
        int(a.split()[2]) > 3 for t in tasks for a in t.reference if a.startswith("restock"))
    assert any(any("event" in c for c in t.goal["all"]) for t in tasks)
    report = coverage(explorer.env.tools(), explorer.sampler.tool_ok,
                      explorer.sampler.drafter.tried, count_tool_uses(tasks), len(tasks))
    assert report["gaps"] == {"tools": [], "args": []}


def test_the_constrained_policy_can_produce_every_reference(explored):
    """Constrained decoding allows only ``candidate_actions()``: a reference action outside it
    could never be sampled during RL (55% of the synthetic references of the user's env)."""
    _, tasks = explored
    for task in tasks + [t for t in TASKS if t.split == "test"]:
        env = ShopEnv()
        env.reset(task)
        for action in task.reference:
            assert action in env.candidate_actions(), (task.task_id, action)
            env.step(action)
