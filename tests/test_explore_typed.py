"""Self-questioning on an environment nobody tuned it for (issue 22): typed argument drafts
from the tool schemas (declared choices and bounds, integers learned from observations, fresh
identifiers in the style of accepted ones), refusal words kept out of the name pool, and
pruning that drops a pair of actions undoing each other.

``Orders`` is a minimal stateful service written here against the documented interface, the
way a user's plugin would be: ids the agent must invent, quantities above 3, reversible
operations, and a goal over the whole end state.
"""

from __future__ import annotations

import random
import re

import pytest

from environments.base import ArgSpec, Environment, ToolError, ToolSpec
from protocol.messages import Task
from questioning.explorer import ArgumentDrafter, SchemaSampler
from questioning.synthesis import Replayer

STOCK = {"pipe": 40, "valve": 12}


class Orders(Environment):
    """Reserve stock for named orders, cancel them, ship them."""

    def reset(self, task: Task) -> str:
        self.task, self.responses = task, []
        self.stock, self.orders, self.shipped = dict(STOCK), {}, []
        return "items: " + " ".join(f"{k} {v}" for k, v in self.stock.items()) + \
            " ; orders look like ord-0001"

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec("reserve", "hold stock for an order", (
                    ArgSpec("order", kind="id"), ArgSpec("item", choices=tuple(STOCK)),
                    ArgSpec("qty", "int", bounds=(1, 50)))),
                ToolSpec("cancel", "release an order", (ArgSpec("order"),)),
                ToolSpec("ship", "ship an order", (ArgSpec("order"),))]

    def execute(self, call) -> str:
        if call.tool == "reserve":
            order, item, qty = call.args
            if order in self.orders or order in self.shipped:
                raise ToolError("exists", f"order {order} exists")
            if self.stock[item] < qty:
                raise ToolError("short", f"cannot reserve: only {self.stock[item]} left")
            self.stock[item] -= qty
            self.orders[order] = (item, qty)
            return f"reserved {qty} {item} for {order}"
        order = call.args[0]
        if order not in self.orders:
            raise ToolError("unknown", f"no order {order}")
        item, qty = self.orders.pop(order)
        if call.tool == "cancel":
            self.stock[item] += qty
            return f"cancelled {order}"
        self.shipped.append(order)
        return f"shipped {order}"

    def state(self) -> dict:
        return {"stock": dict(self.stock), "orders": dict(self.orders),
                "shipped": list(self.shipped)}

    def evaluate(self, task: Task) -> float:
        return float(self.state() == task.goal.get("state"))

    def tasks(self, split: str) -> list[Task]:
        return []

    def candidate_actions(self) -> list[str]:
        return []

    @classmethod
    def vocabulary(cls) -> list[str]:
        return []


def test_pruning_drops_a_pair_that_undoes_itself():
    """No single action of "reserve; cancel" can go (the cancel alone is refused, the reserve
    alone leaves stock held), so single removals kept it in references."""
    env = Orders()
    task = Task("t", "orders", "", 0)
    env.reset(task)
    for action in ("reserve ord-1 pipe 2", "ship ord-1"):
        env.step(action)
    goal = {"state": env.state()}
    actions = ["reserve ord-7 valve 5", "cancel ord-7", "reserve ord-1 pipe 2", "ship ord-1"]
    pruned = Replayer(Orders).prune(Task("t", "orders", "", 0, goal=goal), actions)
    assert pruned == (["reserve ord-1 pipe 2", "ship ord-1"], 1)


def test_drafter_uses_declared_choices_and_bounds():
    drafter = ArgumentDrafter(random.Random(0))
    qty = ArgSpec("qty", "int", bounds=(5, 9))
    values = {drafter.integer(qty) for _ in range(200)}
    assert values == set(range(5, 10))
    colour = ArgSpec("colour", "int", choices=(7, 11))
    assert {drafter.integer(colour) for _ in range(50)} == {7, 11}


def test_drafter_learns_integers_beyond_three_from_observations_and_refusals():
    drafter = ArgumentDrafter(random.Random(1))
    plain = ArgSpec("qty", "int")
    assert max(drafter.integer(plain) for _ in range(200)) <= 6  # nothing seen yet
    drafter.observe_numbers("cannot reserve: only 17 left")  # a refusal teaches a range
    values = [drafter.integer(plain) for _ in range(400)]
    assert {16, 17, 18} <= set(values) and max(values) <= 34
    assert max(values) > 18  # up to twice the largest seen, not only what was seen


def test_fresh_ids_follow_the_style_of_accepted_ones_and_are_new():
    drafter = ArgumentDrafter(random.Random(2))
    drafter.record("reserve", [(0, "order", "ord-0042")], ok=True)
    taken = {"ord-0042", "pipe"}
    fresh = {drafter.fresh_id("reserve", 0, ["pipe", "valve"], taken) for _ in range(30)}
    assert all(re.fullmatch(r"ord-\d{4}", v) for v in fresh), fresh
    assert not fresh & taken and len(fresh) > 20
    # No accepted value yet: a seen name with digits is the template, else any name.
    assert re.fullmatch(r"A\d\d", drafter.fresh_id("ship", 0, ["A17", "pipe"], set()))
    assert re.fullmatch(r"pipe\d+", drafter.fresh_id("ship", 0, ["pipe"], {"pipe"}))


def test_sampler_proposes_new_order_ids_big_quantities_and_only_declared_items():
    sampler = SchemaSampler(Orders().tools(), random.Random(3))
    env = Orders()
    sampler.start(env.reset(Task("t", "orders", "", 0)))
    calls = [sampler.propose("breadth", 1.0, []) for _ in range(300)]
    reserves = [c.split() for c in calls if c.startswith("reserve ")]
    assert reserves and all(w[2] in STOCK and 1 <= int(w[3]) <= 50 for w in reserves)
    assert any(int(w[3]) > 3 for w in reserves)
    assert any(re.fullmatch(r"ord-\d{4}", w[1]) and w[1] != "ord-0001" for w in reserves)


def test_words_of_refusals_are_not_names():
    sampler = SchemaSampler(Orders().tools(), random.Random(4))
    sampler.start("items: pipe 40")
    sampler.observe("cannot reserve: none qty", refused=True)
    assert {"cannot", "none", "qty"}.isdisjoint(sampler.names)
    assert "pipe" in sampler.names


@pytest.mark.parametrize("bad", [dict(type="str", bounds=(1, 2)), dict(type="int", bounds=(3, 1)),
                                 dict(kind="uuid")])
def test_arg_domains_are_checked_when_declared(bad):
    with pytest.raises(ValueError):
        ArgSpec("x", **bad)


def test_in_a_closed_vocabulary_fresh_names_are_unused_words_of_the_same_shape():
    drafter = ArgumentDrafter(random.Random(5), vocabulary=["ls", "plan.txt", "list.md", "data",
                                                            "budget.md", "(", "x7"])
    fresh = {drafter.fresh_id("touch", 0, ["budget.md"], {"budget.md"}) for _ in range(20)}
    assert fresh == {"plan.txt", "list.md"}
    assert drafter.fresh_id("touch", 0, ["budget.md"], {"budget.md", "plan.txt",
                                                        "list.md"}) is None


def test_in_a_closed_vocabulary_an_id_pattern_beats_a_shape():
    drafter = ArgumentDrafter(random.Random(6), vocabulary=["o1", "o2", "o3", "12", "x7"])
    fresh = {drafter.fresh_id("reserve", 0, ["o1"], {"o1"}) for _ in range(20)}
    assert fresh == {"o2", "o3"}


def test_an_id_one_call_created_is_what_the_next_call_names():
    """``cancel order`` takes the id ``reserve order`` created more often than any word on
    screen would be taken."""
    def share_of_created_id(created: bool) -> float:
        sampler = SchemaSampler(Orders().tools(), random.Random(7))
        sampler.start("items: pipe 40 valve 12 ; orders look like ord-0001")
        if created:
            sampler.record("reserve ord-0042 pipe 2", ok=True, changed=True)
        sampler.observe("reserved 2 pipe for ord-0042")
        calls = [c for c in (sampler.propose("depth", 1.0, ["items: pipe 38"])
                             for _ in range(400)) if c.startswith(("cancel ", "ship "))]
        return sum(c.split()[1] == "ord-0042" for c in calls) / len(calls)

    created, seen_only = share_of_created_id(True), share_of_created_id(False)
    assert created > 0.3 and created > 1.5 * seen_only, (created, seen_only)
