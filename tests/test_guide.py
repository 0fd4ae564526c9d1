"""docs/environments.md, the guide for env authors: each statement a new author relies on holds
against the code (issue 53). Where the tools live and ArgSpec's positional order; that the
parser enforces neither ``choices`` nor ``bounds``; the shape of the goals self-questioning
makes; the event log kept outside ``state()``; the form the ``describe_*`` hooks receive; the
task's fields; explore's four kinds of task; the counter example's ``world_split``; and what
declaring ``choices`` does to the explorer's drafting. Fast: no runs, a few explorations."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import random
import re
from pathlib import Path

import pytest

import environments
import environments.tools
from environments import ArgSpec, ToolCall, ToolError, ToolSpec, parse_action, world_split
from environments.call_formats import FORMATS
from environments.shop import ShopEnv, make_world
from episodes.evaluate import task_category
from protocol.messages import Task
from questioning.coverage import LONG_PLAN_CALLS, TASK_KINDS, task_kinds
from questioning.explorer import (
    Exploration,
    Explorer,
    ExploreSettings,
    ExploreStep,
    SchemaSampler,
    seed_tasks,
)
from questioning.synthesis import HindsightSynthesizer, Preferences, make_task

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "environments.md"
EXAMPLE = REPO / "examples" / "my_envs" / "counter.py"


def page() -> str:
    return PAGE.read_text()


def flat() -> str:
    """The page with every run of whitespace one space: statements span line breaks."""
    return " ".join(page().split())


def paragraph(start: str) -> str:
    """The flattened paragraph (or list item) of the page that begins with ``start``."""
    for block in re.split(r"\n\s*\n|\n(?=- )", page()):
        if block.strip().startswith(start):
            return " ".join(block.split())
    raise AssertionError(f"no paragraph of the page starts with {start!r}")


@pytest.fixture(scope="module")
def counter():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "examples"))
        return importlib.import_module("my_envs.counter")


def explored(env, seed: int, actions: list[str]) -> Exploration:
    """An exploration of ``actions`` from world ``seed``, recorded as the explorer records one."""
    first = env.reset(Task(f"explore/{seed}", env.name, "", seed))
    exp = Exploration(f"{seed}/0", env.name, seed, first, env.state())
    for action in actions:
        obs, _, info = env.step(action)
        exp.steps.append(ExploreStep(env.canonical_action(action), obs, info["valid"],
                                     info["tool"], info["error"], "breadth", "schema",
                                     env.state()))
    return exp


def shop_actions(seed: int) -> list[str]:
    """Reserve, read, cancel (undoing the reservation), restock: a state, a read and an event
    goal from one exploration."""
    world = make_world(seed)
    item = sorted(world["stock"])[0]
    order = next(o for o in ("o1", "o2", "o3", "o4") if o not in world["orders"])
    return [f"reserve {order} {item} 1", f"stock {item}", f"cancel {order}",
            f"restock {item} 1"]


# --- 1. where the tools live, ArgSpec's order, what the parser checks ----------------------------


def test_the_tool_classes_live_where_the_page_says():
    text = paragraph("**Tools.**")
    assert "`environments/tools.py`" in text and "importable from `environments`" in text
    for name in ("ArgSpec", "ToolSpec", "ToolError"):
        assert getattr(environments, name) is getattr(environments.tools, name)
        assert getattr(environments.tools, name).__module__ == "environments.tools"


def signatures_on_the_page() -> dict[str, ast.Call]:
    block = re.search(r"\*\*Tools\.\*\*.*?```python\n(.*?)```", page(), re.S).group(1)
    calls = {}
    for line in block.splitlines():
        call = ast.parse(line.split("#")[0].strip(), mode="eval").body
        calls[call.func.id] = call
    return calls


@pytest.mark.parametrize("cls", [ArgSpec, ToolSpec])
def test_the_pages_signature_is_the_dataclasss_field_order(cls):
    call = signatures_on_the_page()[cls.__name__]
    written = [(a.id, dataclasses.MISSING) for a in call.args]
    written += [(k.arg, ast.literal_eval(k.value)) for k in call.keywords]
    fields = [(f.name, f.default if f.default_factory is dataclasses.MISSING
               else f.default_factory()) for f in dataclasses.fields(cls)]
    assert written == fields


def test_the_pages_tool_error_takes_what_tool_error_takes():
    call = signatures_on_the_page()["ToolError"]
    params = list(inspect.signature(ToolError.__init__).parameters)[1:]
    assert [a.id for a in call.args] == params and not call.keywords
    err = ToolError("bad_n", "error : n must be 1 to 9")
    assert (err.kind, err.observation) == ("bad_n", "error : n must be 1 to 9")


SPEC = ToolSpec("pick", "", (ArgSpec("colour", choices=("red", "blue")),
                             ArgSpec("n", "int", bounds=(1, 9))))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_parser_enforces_neither_choices_nor_bounds(fmt):
    assert "it enforces neither `choices` nor `bounds`" in paragraph("The parser checks only")
    outside = ToolCall("pick", ("green", 500))  # not a choice, past the bounds
    written = FORMATS[fmt].write(outside, SPEC)
    assert FORMATS[fmt].parse(written, [SPEC]) == outside
    # ... while a value of the wrong type is refused, as the page says it checks types
    with pytest.raises(environments.ActionError):
        FORMATS[fmt].parse(FORMATS[fmt].write(ToolCall("pick", ("green", "many")), SPEC),
                           [SPEC])


def test_the_env_refuses_an_out_of_bounds_value_itself(counter):
    env = counter.Counter()
    env.reset(Task("t", "counter", "", 0))
    env.step("new b2")
    assert parse_action("add b2 12", env.tools()) == ToolCall("add", ("b2", 12))
    _, _, info = env.step("add b2 12")  # parsed: the counter's own ToolError refuses it
    assert info == {"valid": True, "tool": "add", "error": "bad_n"}
    assert "for an `n` outside 1–9" in paragraph("The parser checks only")


# --- 2. goals are {"all": [conditions]} ---------------------------------------------------------

SHOP_KEYS = {"stock", "order", "no_order", "event", "response"}


def test_synthesized_goals_are_all_of_conditions():
    text = paragraph("- **Shape.**")
    assert '`{"all": [condition, ...]}`' in text
    assert 'no `{"response": ...}` or `{"event": ...}` goal' in text
    seed = next(s for s in range(50) if world_split(s) == "train" and make_world(s)["orders"])
    exp = explored(ShopEnv(), seed, shop_actions(seed))
    tasks = HindsightSynthesizer(ShopEnv, Preferences(), seed=0).propose(exp)
    assert {t.meta["goal_kind"] for t in tasks} == {"state", "read", "event"}
    sorts = paragraph("- **Three sorts of condition**")
    for task in tasks:
        assert set(task.goal) == {"all"} and isinstance(task.goal["all"], list)
        for cond in task.goal["all"]:
            assert isinstance(cond, dict) and len(cond) == 1 and set(cond) <= SHOP_KEYS
            assert f'`{{"{next(iter(cond))}": ' in sorts  # each key is on the page
    events = [t for t in tasks if t.meta["goal_kind"] == "event"]
    assert all({next(iter(c)) for c in t.goal["all"]} == {"event"} for t in events)
    reads = [t for t in tasks if t.meta["goal_kind"] == "read"]
    assert all(any("response" in c for c in t.goal["all"]) for t in reads)


def test_a_condition_is_whatever_the_env_writes(counter):
    assert "the counter's `[\"b2\", 4]`" in paragraph("- **Shape.**")
    exp = explored(counter.Counter(), 0, ["new b2", "add b2 3"])
    tasks = HindsightSynthesizer(counter.Counter, Preferences(), seed=0).propose(exp)
    assert tasks and all(set(t.goal) == {"all"} for t in tasks)
    assert {"all": [["b2", 3]]} in [t.goal for t in tasks]


@pytest.mark.parametrize("make", ["shop", "counter"])
def test_evaluate_takes_every_goal_the_page_lists(make, counter):
    text = paragraph("- **What `evaluate` must accept:**")
    assert "`{}`" in text and "never raise" in text
    env = ShopEnv() if make == "shop" else counter.Counter()
    for goal in ({}, {"all": []}, {"description": "x"}, {"all": [{"nothing": 1}]},
                 {"all": [[["x"], 1]]}, {"all": "b2"}, {"foo": [1, 2]}):  # an LLM's, say
        task = Task("t", env.name, "", 0, goal=goal)
        env.reset(task)
        assert env.evaluate(task) == 0.0, goal


def test_the_default_describe_changes_reads_goal_from_states_all(counter):
    assert "the default `describe_changes` reads its `\"all\"`" in flat()
    env = counter.Counter()
    before, after = {"counters": {"a1": 0}}, {"counters": {"a1": 0, "b2": 4}}
    goal = env.goal_from_states(before, after)
    assert goal == {"all": [["b2", 4]]}
    base = environments.Environment.describe_changes(env, before, after)
    assert [p.conditions for p in base] == [tuple(goal["all"])]


# --- 3. events: a log outside state() ------------------------------------------------------------


def test_shop_keeps_its_events_outside_state():
    text = paragraph("- **Events need a log outside `state()`.**")
    assert "`self.events`" in text and "`call.text()`" in text
    env = ShopEnv()
    seed = 0
    reserve, _, cancel, _ = shop_actions(seed)
    task = Task("t", "shop", "", seed)
    env.reset(task)
    start = env.state()
    # The policy may write JSON: the log still holds the plain text describe_event gets.
    spec = {t.name: t for t in env.tools()}["reserve"]
    env.step(FORMATS["json"].write(parse_action(reserve, env.tools()), spec), "json")
    env.step(f"stock {reserve.split()[2]}")
    env.step(cancel)
    assert env.state() == start  # the snapshot cannot show what happened...
    assert env.events == [reserve, cancel]  # ... the log can
    assert set(env.state()) == {"stock", "orders"}
    part = env.describe_event(reserve, "", start, start)
    assert part.conditions == ({"event": reserve},)
    both = Task("t", "shop", "", seed, goal={"all": [{"event": reserve}, {"event": cancel}]})
    assert env.evaluate(both) == 1.0
    backwards = Task("t", "shop", "", seed, goal={"all": [{"event": cancel},
                                                          {"event": reserve}]})
    assert env.evaluate(backwards) == 0.0  # in their order
    env.reset(task)
    assert env.events == [] and env.evaluate(both) == 0.0  # reset clears it


# --- 4. what describe_response / describe_event receive ------------------------------------------


class Recording(ShopEnv):
    """Shop, recording what its describe_* hooks and step are given; its canonical form of
    an action is the text with two trailing spaces, so a hook given it is seen to be."""

    calls: list = []
    formats: set = set()

    def step(self, action_text, call_format="text"):
        Recording.formats.add(call_format)
        return super().step(action_text, call_format)

    def canonical_action(self, text):
        return text + "  "

    def describe_event(self, action, observation, before, after):
        Recording.calls.append(("event", action, observation, before, after))
        return super().describe_event(action, observation, before, after)

    def describe_response(self, action, observation, before):
        Recording.calls.append(("response", action, observation, before, before))
        return super().describe_response(action, observation, before)


def test_the_describe_hooks_get_the_recorded_text_action():
    text = paragraph("**What `describe_response` and `describe_event` receive and return.**")
    assert "plain `tool arg ...` form" in text and "`canonical_action`" in text
    Recording.calls, Recording.formats = [], set()
    explorer = Explorer(Recording, ExploreSettings(breadth_steps=20, depth_steps=20), seed=0)
    synth = HindsightSynthesizer(Recording, Preferences(), seed=0)
    steps = set()  # (action, observation, state before, state after) of every step
    for seed in (0, 1, 2, 5):
        exp = explorer.explore(Task(f"explore/{seed}", "shop", "", seed), 0)
        states = [exp.initial_state] + [s.state for s in exp.steps]
        steps |= {(s.action, s.observation, json.dumps(states[t], sort_keys=True),
                   json.dumps(s.state, sort_keys=True)) for t, s in enumerate(exp.steps)}
        synth.propose(exp)
    assert Recording.formats == {"text"}  # the explorer steps in the text format
    hooks = {hook for hook, *_ in Recording.calls}
    assert hooks == {"event", "response"}, hooks
    tools = ShopEnv().tools()
    for _, action, observation, before, after in Recording.calls:
        assert action.endswith("  ")  # through canonical_action, as the explorer recorded it
        assert parse_action(action, tools).text() == action.strip()  # plain text form
        assert not action.lstrip().startswith(("{", "[", "<"))
        # what step returned for it, and the states around it (a read: the state at it)
        at = (action, observation, json.dumps(before, sort_keys=True),
              json.dumps(after, sort_keys=True))
        assert at in steps, at
    # What they must return: a GoalPart (conditions, text, entities) or None.
    env = ShopEnv()
    part = env.describe_event("reserve o9 pipe 2", "ok", {}, {})
    assert isinstance(part, environments.GoalPart) and isinstance(part.conditions, tuple)
    assert env.describe_event("orders", "orders : empty", {}, {}) is None
    assert "`GoalPart(conditions, text, entities)`" in text
    assert [f.name for f in dataclasses.fields(environments.GoalPart)] == \
        ["conditions", "text", "entities"]


# --- 5. the task's fields ------------------------------------------------------------------------


def test_the_page_names_every_field_of_a_task():
    text = paragraph("**Tasks.**")
    named = re.findall(r"`(\w+)`", text)
    fields = [f.name for f in dataclasses.fields(Task)]
    assert set(fields) <= set(named), set(fields) - set(named)
    assert "`task_id`" in text and "has an id," not in flat()
    assert Task("t", "e", "", 0).source == "original"


def test_what_the_page_says_of_source_difficulty_and_meta():
    text = paragraph("**Tasks.**")
    env = ShopEnv()
    made = make_task(env, 0, "q", {"all": [{"no_order": "o1"}]}, ["a", "b", "c"],
                     {"dependent_ops": 2})
    assert made.source == "synthetic" and made.split == "train"
    assert made.difficulty == 3 + 0.5 * 2  # the steps plus half of those a later one needs
    assert all(t.difficulty == len(t.reference) for t in env.tasks("validation"))
    assert "shop gives its reference's length" in text
    # meta["category"] is what eval reports by, the env's name where it is absent
    assert task_category(Task("t", "shop", "", 0, meta={"category": "cancel"})) == "cancel"
    assert task_category(Task("t", "shop", "", 0)) == "shop"
    assert '`meta["category"]`' in text and "`--per-category`" in text
    for split in ("validation", "test"):
        assert {t.split for t in env.tasks(split)} == {split}


# --- 6. the kinds of task ------------------------------------------------------------------------


def kinds_on_the_page() -> list[str]:
    block = page().split("It also gives each **kind of task**", 1)[1]
    return re.findall(r"^- `(\w+)`:", block.split("\n\n", 2)[1], re.M)


def test_the_page_defines_exactly_the_kinds_task_kinds_returns():
    assert kinds_on_the_page() == list(TASK_KINDS) == ["state", "read", "event", "long"]
    base = {"steps": 2}
    assert task_kinds(Task("t", "e", "", 0, meta=base)) == ["state"]  # an LLM's, the env's
    for kind in ("state", "read", "event"):
        assert task_kinds(Task("t", "e", "", 0, meta={**base, "goal_kind": kind})) == [kind]
    three = {**base, "goal_kind": "event", "entity_calls": 3}
    assert task_kinds(Task("t", "e", "", 0, meta=three)) == ["event", "long"]
    two = {**base, "goal_kind": "state", "entity_calls": 2}
    assert task_kinds(Task("t", "e", "", 0, meta=two)) == ["state"]
    assert LONG_PLAN_CALLS == 3 and "three or more reference calls on one entity" in flat()


def test_the_kinds_link_to_goal_directed_probes():
    assert "[questioning](questioning.md), step 6." in flat()
    assert "\n6. **Goal-directed exploration**" in (REPO / "docs" / "questioning.md").read_text()


# --- 7. the counter example splits its worlds with world_split ------------------------------------


def test_the_counter_splits_its_worlds_with_world_split(counter):
    env = counter.Counter()
    assert "world_split" in EXAMPLE.read_text() and "range(15" not in EXAMPLE.read_text()
    worlds = list(counter.WORLDS)
    assert list(env.train_worlds) == [s for s in worlds if world_split(s) == "train"]
    held_out = set()
    for split in ("validation", "test"):
        seeds = [t.seed for t in env.tasks(split)]
        assert seeds == [s for s in worlds if world_split(s) == split], split
        held_out |= set(seeds)
        assert {t.split for t in env.tasks(split)} == {split}
    assert not held_out & set(env.train_worlds)  # no held-out world is a training world
    assert [t.seed for t in seed_tasks(env)] == list(env.train_worlds)  # what explore visits
    with pytest.raises(ValueError):
        env.tasks("dev")


def test_the_page_says_which_seeds_the_counter_holds_out(counter):
    env, text = counter.Counter(), flat()
    train = list(env.train_worlds)
    v = [t.seed for t in env.tasks("validation")]
    t = [t.seed for t in env.tasks("test")]
    assert f"the {len(train)} worlds it declares (seeds {', '.join(map(str, train[:6]))}, ...)" \
        in text
    assert f"validation tasks are in seeds {v[0]}, {v[1]}, ..., {v[-1]}" in text
    assert f"test tasks in {t[0]}, {t[1]}, ..., {t[-1]}" in text
    # A world starts a1 at seed % 7, so the held-out worlds are not all alike.
    assert "`a1` at `seed % 7`" in text
    starts = {s: env.reset(Task("t", "counter", "", s)).split()[-1] for s in counter.WORLDS}
    assert all(int(a1) == s % 7 for s, a1 in starts.items())
    assert len({starts[s] for s in t}) > 1 and len({starts[s] for s in v}) > 1


def test_the_pages_snippet_is_the_examples_code():
    snippet = re.search(r"self-questioning:\n\n```python\n(.*?)```", page(), re.S).group(1)
    source = {line.split("  #")[0].strip() for line in EXAMPLE.read_text().splitlines()}
    code = [line.split("  #")[0].strip() for line in snippet.splitlines()]
    missing = [c for c in code if c and c != "..." and not c.startswith("#") and c not in source]
    assert not missing


# --- 8. choices: what the explorer draws with and without them ------------------------------------

SEEN = ("counters : o3 1 o8 2 note plan red blue draft alpha beta gamma delta epsilon zeta "
        "eta theta iota kappa lambda")
IDS = tuple(f"o{i}" for i in range(1, 10))


def draws(arg: ArgSpec, n: int = 300) -> list[str]:
    sampler = SchemaSampler([ToolSpec("cancel", "", (arg,))], random.Random(0))
    sampler.start(SEEN)
    return [sampler.draft("cancel", 0, arg) for _ in range(n)]


def test_without_choices_an_argument_is_drawn_from_every_name_seen():
    text = paragraph("**Declare `choices` for every argument whose values come from a known set**")
    assert "`kind=\"id\"`" in text and "Without them" in text
    values = draws(ArgSpec("order"))
    names = set(SEEN.split()) - {":"}
    unrelated = [v for v in values if v not in IDS]
    assert len(unrelated) > len(values) / 2  # mostly words that are no order id at all
    assert len(set(values) & names) > 10  # from dozens of the names seen


def test_with_choices_the_explorer_draws_from_them_mostly_those_shown():
    values = draws(ArgSpec("order", choices=IDS))
    assert set(values) <= set(IDS)
    shown = sum(v in ("o3", "o8") for v in values) / len(values)
    assert shown > 0.75  # 80% from the choices this world shows, the rest from any
    assert "80% of the time from those this world shows" in flat()


def test_choices_win_over_kind_id():
    assert "where an argument has both, `choices` wins" in flat()
    both = draws(ArgSpec("order", choices=IDS, kind="id"))
    assert set(both) <= set(IDS) and sum(v in ("o3", "o8") for v in both) > len(both) / 2
    fresh = draws(ArgSpec("order", kind="id"))
    assert sum(v not in SEEN.split() for v in fresh) > len(fresh) / 2  # names nobody used
