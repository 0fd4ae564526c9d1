"""A user's environment outside the package, the worked example of docs/environments.md.

Run it with ``PYTHONPATH=examples`` and ``--set env.name=my_envs.counter:counter``.
"""

from environments import ArgSpec, Environment, GoalPart, ToolError, ToolSpec, register_env
from protocol.messages import Task

NAMES = tuple(f"{c}{i}" for c in "ab" for i in range(1, 10))


@register_env("counter")
class Counter(Environment):
    """Named counters: create one, add to it, delete it."""

    def reset(self, task: Task) -> str:
        self.task, self.responses = task, []
        self.counters = {"a1": task.seed % 5}
        return f"counters : a1 {self.counters['a1']}"

    def tools(self):
        return [ToolSpec("new", "create a counter", (ArgSpec("name", kind="id"),)),
                ToolSpec("add", "add to a counter", (ArgSpec("name"),
                                                     ArgSpec("n", "int", bounds=(1, 9)))),
                ToolSpec("drop", "delete a counter", (ArgSpec("name"),))]

    def execute(self, call):
        name = call.args[0]
        if call.tool == "new":
            if name in self.counters:
                raise ToolError("exists", f"error : {name} exists")
            self.counters[name] = 0
        elif name not in self.counters:
            raise ToolError("missing", f"error : no counter {name}")
        elif call.tool == "add":
            self.counters[name] += call.args[1]
        else:
            del self.counters[name]
        return "ok : " + " ".join(f"{k} {v}" for k, v in sorted(self.counters.items()))

    def state(self):
        return {"counters": dict(self.counters)}

    def evaluate(self, task):
        wanted = task.goal.get("all", [])  # exploration resets with an empty goal
        return float(bool(wanted) and all(self.counters.get(k) == v for k, v in wanted))

    def goal_from_states(self, before, after):
        return {"all": [[k, v] for k, v in after["counters"].items()
                        if before["counters"].get(k) != v]}

    def describe_changes(self, before, after):
        return [GoalPart(([k, v],), f"make counter {k} {v}", (k,))
                for k, v in after["counters"].items() if before["counters"].get(k) != v]

    def tasks(self, split):
        if split == "train":
            return []  # no training tasks: self-questioning makes them (from seed 0's world)
        return [Task(f"c/test/{s}", "counter", "make counter b2 4", s,
                     goal={"all": [["b2", 4]]}, reference=["new b2", "add b2 4"],
                     split="test") for s in range(20, 25)]

    def candidate_actions(self):
        free = [n for n in NAMES if n not in self.counters]
        return ([f"new {n}" for n in free] + [f"drop {n}" for n in self.counters]
                + [f"add {n} {k}" for n in self.counters for k in range(1, 10)])

    @classmethod
    def vocabulary(cls):
        # Closed, so the tiny word-level policy can read it; [] for an open one (then use an
        # instruct model: model.path=smollm2-135m).
        words = "new add drop ok error : exists no counter counters make".split()
        return sorted({*words, *NAMES, *map(str, range(100))})
