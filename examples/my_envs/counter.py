"""A user's environment outside the package, the worked example of docs/environments.md.

Run it with ``PYTHONPATH=examples`` and ``--set env.name=my_envs.counter:counter``.
"""

from environments import (
    ArgSpec,
    Environment,
    GoalPart,
    ToolError,
    ToolSpec,
    check_split,
    parser_words,
    register_env,
    world_split,
)
from protocol.messages import Task

NAMES = tuple(f"{c}{i}" for c in "ab" for i in range(1, 10))
MOST = 99  # a counter's largest value: every number it can show is a word of the vocabulary
WORLDS = range(25)  # world_split: 15 train, 5 validation (seeds 3, 8 ...), 5 test (4, 9 ...)
TOOLS = (ToolSpec("new", "create a counter", (ArgSpec("name", kind="id"),)),
         ToolSpec("add", "add to a counter", (ArgSpec("name"),
                                              ArgSpec("n", "int", bounds=(1, 9)))),
         ToolSpec("drop", "delete a counter", (ArgSpec("name"),)))


@register_env("counter")
class Counter(Environment):
    """Named counters: create one, add to it, delete it."""

    # No training tasks: explore visits these worlds; the held-out ones are world_split's.
    train_worlds = [s for s in WORLDS if world_split(s) == "train"]

    def reset(self, task: Task) -> str:
        self.task, self.responses = task, []
        # Not seed % 5: world_split goes by seed % 5, so every test world would start alike.
        self.counters = {"a1": task.seed % 7}
        return f"counters : a1 {self.counters['a1']}"

    def tools(self):
        return list(TOOLS)

    def execute(self, call):
        name = call.args[0]
        if name not in NAMES:  # refusals never echo a word outside the vocabulary
            raise ToolError("bad_name", "error : not a counter name")
        if call.tool == "new":
            if name in self.counters:
                raise ToolError("exists", f"error : {name} exists")
            self.counters[name] = 0
        elif name not in self.counters:
            raise ToolError("missing", f"error : no counter {name}")
        elif call.tool == "add":
            n = call.args[1]
            if not 1 <= n <= 9:
                raise ToolError("bad_n", "error : n must be 1 to 9")
            if self.counters[name] + n > MOST:
                raise ToolError("too_big", f"error : {name} would pass {MOST}")
            self.counters[name] += n
        else:
            del self.counters[name]
        return "ok : " + " ".join(f"{k} {v}" for k, v in sorted(self.counters.items()))

    def state(self):
        return {"counters": dict(self.counters)}

    def evaluate(self, task):
        wanted = task.goal.get("all", [])  # exploration resets with an empty goal
        try:
            return float(bool(wanted) and all(self.counters.get(k) == v for k, v in wanted))
        except (TypeError, ValueError):  # a goal it cannot read (an LLM's) holds nowhere
            return 0.0

    def goal_from_states(self, before, after):
        return {"all": [[k, v] for k, v in after["counters"].items()
                        if before["counters"].get(k) != v]}

    def describe_changes(self, before, after):
        return [GoalPart(([k, v],), f"make counter {k} {v}", (k,))
                for k, v in after["counters"].items() if before["counters"].get(k) != v]

    def tasks(self, split):
        if split == "train":
            return []  # no training tasks: self-questioning makes them, in train_worlds
        # held out: whole worlds (seeds) no training task or exploration uses
        return [Task(f"c/{split}/{s}", "counter", "make counter b2 4", s,
                     goal={"all": [["b2", 4]]}, reference=["new b2", "add b2 4"],
                     split=split) for s in WORLDS if world_split(s) == check_split(split)]

    def candidate_actions(self):
        free = [n for n in NAMES if n not in self.counters]
        return ([f"new {n}" for n in free] + [f"drop {n}" for n in self.counters]
                + [f"add {n} {k}" for n in self.counters for k in range(1, 10)
                   if self.counters[n] + k <= MOST])

    @classmethod
    def vocabulary(cls):
        # Closed, so the tiny word-level policy can read it; [] for an open one (then use an
        # instruct model: model.path=smollm2-135m). Every word of every query ("and" joins the
        # parts of one), observation and refusal, the parser's own included (parser_words).
        words = "ok error : exists no counter counters make and not a name must be to would pass"
        return sorted({*words.split(), *parser_words(TOOLS), *NAMES,
                       *map(str, range(MOST + 1))})
