"""Exploration that learns an env's preconditions (questioning/preconditions.py), on a small
plugin env written here: ``ship`` works only on a crate opened, filled, sealed and labelled in
that order, which random walks over many crates and tools almost never do. With unlock probes the
stored tasks ship crates; without them (almost) none do."""

from __future__ import annotations

import random

import pytest

from environments import ArgSpec, Environment, GoalPart, ToolError, ToolSpec, register_env
from environments.base import verify_task
from protocol.config import load_config
from protocol.messages import Task
from questioning.coverage import tools_used
from questioning.factory import TaskFactory
from questioning.preconditions import PreconditionPlanner, failing_tools, mentions
from questioning.task_store import TaskStore

NAMES = tuple(f"{c}{i}" for c in "abcdef" for i in range(1, 11))
STAGES = ("closed", "open", "filled", "sealed", "labelled", "shipped")
# tool -> (the stage it needs, the stage it leaves); "new" makes a closed crate.
STEPS = {"open": (0, 1), "fill": (1, 2), "seal": (2, 3), "label": (3, 4), "ship": (4, 5)}
TOOLS = (ToolSpec("new", "make a crate", (ArgSpec("name", kind="id"),)),
         *(ToolSpec(tool, f"{tool} a crate", (ArgSpec("name"),)) for tool in STEPS),
         ToolSpec("look", "what stage a crate is at", (ArgSpec("name"),)),
         ToolSpec("drop", "throw a crate away", (ArgSpec("name"),)))


class Crates(Environment):
    """Crates that go closed -> open -> filled -> sealed -> labelled -> shipped, one step at a
    time; a refusal names the stage that is missing ("c1 is sealed, not labelled")."""

    train_worlds = range(6)

    def reset(self, task: Task) -> str:
        self.task, self.responses = task, []
        rng = random.Random(task.seed)
        self.crates = {name: 0 for name in rng.sample(NAMES, 5)}
        return "crates : " + " ".join(self.crates)

    def tools(self):
        return list(TOOLS)

    def execute(self, call):
        name = call.args[0]
        if name not in NAMES:
            raise ToolError("bad_name", "error : not a crate name")
        if call.tool == "new":
            if name in self.crates:
                raise ToolError("exists", f"error : {name} exists")
            self.crates[name] = 0
            return "ok"
        if name not in self.crates:
            raise ToolError("missing", f"error : no crate {name}")
        if call.tool == "look":
            return f"{name} is {STAGES[self.crates[name]]}"
        if call.tool == "drop":
            del self.crates[name]
            return "ok"
        needs, leaves = STEPS[call.tool]
        if self.crates[name] != needs:
            have = self.crates[name]
            raise ToolError("stage", f"error : {name} is {STAGES[have]}, not {STAGES[needs]}")
        self.crates[name] = leaves
        return "ok"

    def state(self):
        return {"crates": dict(self.crates)}

    def evaluate(self, task):
        conds = task.goal.get("all", [])
        return float(bool(conds) and all(self.crates.get(name) == stage
                                         for name, stage in conds))

    def describe_changes(self, before, after):
        parts = [GoalPart(([k, v],), f"make crate {k} {STAGES[v]}", (k,))
                 for k, v in after["crates"].items() if before["crates"].get(k) != v]
        parts += [GoalPart(([k, None],), f"throw crate {k} away", (k,))
                  for k in before["crates"] if k not in after["crates"]]
        return parts

    def candidate_actions(self):
        """Every tool on every crate here, and new crates among a few unused names."""
        calls = [f"{t.name} {c}" for t in TOOLS if t.name != "new" for c in self.crates]
        return calls + [f"new {n}" for n in NAMES if n not in self.crates][:5]

    @classmethod
    def vocabulary(cls):
        return []

    def tasks(self, split):
        if split == "train":
            return []
        seeds = {"validation": range(10, 12), "test": range(12, 14)}[split]
        return [Task(f"crates/{split}/{s}", "crates", "make crate a1 open", s,
                     goal={"all": [["a1", 1]]}, reference=["new a1", "open a1"], split=split)
                for s in seeds]


@pytest.fixture(scope="module", autouse=True)
def registered():
    """Registered for this module only (other modules parametrize over the package's envs)."""
    from environments.base import _ENVS

    register_env("crates")(Crates)
    yield
    _ENVS.pop("crates", None)


def _explore(tmp_path, unlock: bool) -> tuple[list[Task], dict]:
    cfg = load_config(None, ["env.name=crates", "explore.proposer=schema",
                             f"explore.unlock_probes={str(unlock).lower()}",
                             "explore.explorations_per_seed=8"])
    with TaskStore(tmp_path) as store:
        summary = TaskFactory(cfg, tmp_path, store, say=lambda _: None).run(rounds=1)
        return store.all(), summary


@pytest.fixture(scope="module")
def explored(registered, tmp_path_factory):
    return {unlock: _explore(tmp_path_factory.mktemp(f"unlock{unlock}"), unlock)
            for unlock in (False, True)}


def _shipping(tasks: list[Task]) -> list[Task]:
    return [t for t in tasks if "ship" in tools_used(t)]


def test_random_walks_alone_rarely_ship_a_crate(explored):
    tasks, summary = explored[False]
    tools = summary["coverage"]["tools"]
    # Measured: ship tried 728 times, worked 0 times; none of 560 stored tasks ships.
    assert tools["ship"]["tries"] >= 40 and tools["ship"]["ok_calls"] <= 0.02 * \
        tools["ship"]["tries"], tools["ship"]
    assert len(_shipping(tasks)) <= 0.005 * len(tasks), len(_shipping(tasks))


def test_unlock_probes_put_the_failing_tool_into_stored_tasks(explored):
    tasks, summary = explored[True]
    walks = _shipping(explored[False][0])
    shipping = _shipping(tasks)
    # Measured: 24 unlock probes, ship worked 22 times, 18 of 561 stored tasks ship a crate.
    assert len(shipping) >= 6 and len(shipping) > 5 * max(len(walks), 1), len(shipping)
    assert summary["probes/unlock"] > 0
    for task in shipping[:10]:  # the whole chain is in the reference, and it verifies
        assert task.reference[-1].startswith("ship ")
        assert [a.split()[0] for a in task.reference[-5:]] == [
            "open", "fill", "seal", "label", "ship"]
        assert verify_task(Crates, task) == (True, "ok"), task
    assert {t.seed for t in tasks} <= set(range(6))  # never a held-out world


def test_the_coverage_report_counts_tries_and_successes_per_tool(explored):
    tools = explored[True][1]["coverage"]["tools"]
    assert set(tools) == {t.name for t in TOOLS}
    for name, row in tools.items():
        assert 0 <= row["ok_calls"] <= row["tries"], (name, row)
    assert tools["ship"]["ok_calls"] > 0 and tools["look"]["ok_calls"] > 0


EFFECTS = {"new": [5, 5], "open": [5, 5], "fill": [5, 5], "seal": [5, 5], "ship": [5, 5],
           "look": [0, 9], "drop": [5, 5]}


def _play(planner: PreconditionPlanner, steps: int = 20) -> list[str]:
    env = Crates()
    env.reset(Task("p", "crates", "", 0))
    env.crates = {"c1": 0, "d2": 0}
    calls, before = [], env.state()
    for _ in range(steps):
        call = planner.next_call(lambda: "look c1")
        obs, _, info = env.step(call)
        after = env.state()
        planner.observe(call, info["error"] is None, before, after, obs)
        calls.append(call)
        before = after
        if planner.done:
            break
    return calls


def test_backward_chaining_follows_the_refusals_to_the_missing_steps():
    target = next(t for t in TOOLS if t.name == "ship")
    planner = PreconditionPlanner(target, list(TOOLS), EFFECTS,
                                  lambda tool, slot, arg: "c1", random.Random(0))
    calls = _play(planner)
    assert planner.done and planner.unlocked == 1
    assert calls == ["ship c1", "label c1", "seal c1", "fill c1", "open c1", "fill c1",
                     "seal c1", "label c1", "ship c1"]


def test_without_words_to_follow_it_tries_the_tools_that_change_the_state():
    """Refusals that name nothing ("refused"): the fixers are tried by how often they changed
    the state, a tool seen deleting the crate last and never a read; a two-step chain is
    still found, in more calls."""

    class Mute(Crates):
        def execute(self, call):
            try:
                return super().execute(call)
            except ToolError as err:
                raise ToolError(err.kind, "error : refused") from None

    target = next(t for t in TOOLS if t.name == "ship")
    planner = PreconditionPlanner(target, list(TOOLS), EFFECTS,
                                  lambda tool, slot, arg: "c1", random.Random(0))
    env = Mute()
    env.reset(Task("p", "crates", "", 0))
    env.crates = {"c1": 2}  # filled: seal, label, then ship
    before, calls = env.state(), []
    for _ in range(60):
        call = planner.next_call(lambda: "look c1")
        obs, _, info = env.step(call)
        planner.observe(call, info["error"] is None, before, env.state(), obs)
        calls.append(call)
        before = env.state()
        if planner.done:
            break
    assert planner.done, calls
    assert not any(c.startswith("look") for c in calls)


def test_a_refusal_names_a_tool_by_its_stem():
    assert mentions("seal", "error : c1 is filled, not sealed")
    assert mentions("label", "c1 is sealed, not labelled")
    assert mentions("open", "c1 is not open") and not mentions("open", "c1 is closed")
    assert mentions("add", "nothing added yet") and not mentions("fill", "c1 is sealed")


def test_failing_tools_are_those_tried_often_that_rarely_worked():
    tries = {"ship": [0, 30], "open": [20, 30], "look": [0, 3]}
    ok = {"ship": 1, "open": 25, "look": 0}
    from collections import Counter

    assert failing_tools(list(TOOLS), tries, Counter(ok)) == ["ship"]
