"""Examples re-grounded in other worlds (questioning/regrounding.py): on ``files``, whose
``entities()`` type and relate its names, and on a plugin env written here that has none."""

from __future__ import annotations

import json
import random

import pytest

from environments import Environment, GoalPart, ToolError, ToolSpec, register_env
from environments.base import ArgSpec, verify_task
from environments.files import FilesEnv
from protocol.config import ConfigError, load_config
from protocol.messages import HELD_OUT_SPLITS, Task
from protocol.run_dir import RunDir
from questioning.factory import TaskFactory
from questioning.regrounding import REFUSALS, ExampleRegrounder, substitute, world_names
from questioning.task_store import TaskStore


def _files_env():
    return FilesEnv(explore_worlds=60)


@pytest.fixture(scope="module")
def files_made():
    """Every files training template re-grounded in worlds it was never written for."""
    examples = _files_env().tasks("train")
    regrounder = ExampleRegrounder(_files_env, examples, per_world=0, seed=0)
    rng = random.Random(0)
    targets = sorted(set(_files_env().train_worlds) - {t.seed for t in examples})
    made = []
    for example in rng.sample(examples, 120):
        task = regrounder.reground(example, rng.choice(targets))
        made.append((example, task))
    return regrounder, made


def test_most_files_examples_find_a_world_and_each_made_task_verifies(files_made):
    regrounder, made = files_made
    kept = [(e, t) for e, t in made if t is not None]
    assert len(kept) >= 0.6 * len(made), regrounder.stats
    for example, task in kept:
        assert task.seed != example.seed and task.source == "synthetic"
        assert task.meta["method"] == "example" and task.meta["example"] == example.task_id
        assert verify_task(FilesEnv, task, explore_worlds=60) == (True, "ok")
        assert len(task.reference) == len(example.reference)


def test_the_names_are_the_target_worlds_and_the_words_stay(files_made):
    _, made = files_made
    moves = [(e, t) for e, t in made if t is not None and e.meta["template"] == "move_out"]
    assert moves
    for _, task in moves:
        assert task.query.split()[0] == "move" and task.query.endswith("into root")
        env = _files_env()
        env.reset(task)
        names = world_names(env, env.state())
        moved, folder = task.query.split()[1], task.query.split()[3]
        assert names[moved]["type"] == "file" and names[moved]["attributes"]["folder"] == folder


def test_the_goal_asks_what_the_example_asked_not_the_cd_on_the_way(files_made):
    _, made = files_made
    for example, task in made:
        if task is None:
            continue
        asks_cwd = any("cwd" in c for c in example.goal["all"])
        assert any("cwd" in c for c in task.goal["all"]) == asks_cwd, (example, task)


def test_a_query_naming_what_the_calls_never_touch_is_refused(files_made):
    """"delete every file in data containing green": the word chose which file to delete;
    mapped, the query would no longer say what the calls do."""
    regrounder, made = files_made
    chosen = [t for e, t in made if e.meta["template"] == "delete_word"]
    assert chosen and all(t is None for t in chosen)
    assert regrounder.stats["refused_criterion"] >= len(chosen)
    refused = {k.removeprefix("refused_") for k in regrounder.stats if k.startswith("refused_")}
    assert refused <= set(REFUSALS), refused  # every refusal is one of the documented reasons


def test_substitute_replaces_whole_names_at_once():
    mapping = {"docs": "mail", "mail": "docs", "a.md": "b.md"}
    assert substitute("move a.md from docs into mail", mapping) == "move b.md from mail into docs"
    assert substitute("docs.md and email stay", mapping) == "docs.md and email stay"
    assert substitute("cd docs/", mapping) == "cd mail/"


# --- an env written here: no entities(), names only in its state ------------------------------

JARS = tuple(f"jar{i}" for i in range(12))
SHELVES = ("top", "middle", "bottom", "left", "right")


class Pantry(Environment):
    """Jars on shelves; ``move <jar> <shelf>``. It names its changes but has no entities()."""

    def reset(self, task: Task) -> str:
        self.task, self.responses = task, []
        rng = random.Random(task.seed)
        self.jars = {j: rng.choice(SHELVES) for j in rng.sample(JARS, 5)}
        return "jars : " + " ".join(self.jars)

    def tools(self):
        return [ToolSpec("move", "put a jar on a shelf", (ArgSpec("jar"), ArgSpec("shelf")))]

    def execute(self, call):
        jar, shelf = call.args
        if jar not in self.jars or shelf not in SHELVES or self.jars[jar] == shelf:
            raise ToolError("bad", "error : cannot")
        self.jars[jar] = shelf
        return "ok"

    def state(self):
        return {"jars": dict(self.jars)}

    def evaluate(self, task):
        conds = task.goal.get("all", [])
        return float(bool(conds) and all(self.jars.get(j) == s for j, s in conds))

    def describe_changes(self, before, after):
        return [GoalPart(([j, s],), f"put {j} on the {s} shelf", (j,))
                for j, s in after["jars"].items() if before["jars"].get(j) != s]

    def candidate_actions(self):
        return [f"move {j} {s}" for j in self.jars for s in SHELVES if s != self.jars[j]]

    @classmethod
    def vocabulary(cls):
        return []

    def tasks(self, split):
        seeds = {"train": range(0, 4), "validation": range(20, 22), "test": range(22, 24)}[split]
        out = []
        for seed in seeds:
            self.reset(Task("w", "pantry", "", seed))
            jar = sorted(self.jars)[0]
            shelf = next(s for s in SHELVES if s != self.jars[jar])
            out.append(Task(f"pantry/{split}/{seed}", "pantry", f"put {jar} on the {shelf} shelf",
                            seed, goal={"all": [[jar, shelf]]}, reference=[f"move {jar} {shelf}"],
                            split=split))
        return out

    train_worlds = range(0, 10)


class BarePantry(Pantry):
    """The pantry without training tasks of its own."""

    def tasks(self, split):
        return [] if split == "train" else super().tasks(split)


@pytest.fixture
def pantry():
    from environments.base import _ENVS

    register_env("pantry")(Pantry)
    register_env("bare_pantry")(BarePantry)
    yield
    _ENVS.pop("pantry", None)
    _ENVS.pop("bare_pantry", None)


def test_an_env_without_entities_regrounds_by_the_names_in_its_state(pantry):
    examples = Pantry().tasks("train")
    regrounder = ExampleRegrounder(Pantry, examples, per_world=4, seed=1)
    made = [t for seed in range(4, 10) for t in regrounder.propose(Task("w", "pantry", "", seed))]
    assert len(made) >= 12, regrounder.stats
    for task in made:
        assert verify_task(Pantry, task) == (True, "ok")
        jar, shelf = task.goal["all"][0]
        assert task.query == f"put {jar} on the {shelf} shelf"
        assert task.reference == [f"move {jar} {shelf}"]


def test_explore_with_examples_alone_stores_them_in_training_worlds_only(pantry, tmp_path):
    cfg = load_config(None, ["env.name=pantry", "explore.proposer=schema",
                             "explore.from_examples=3",
                             "explore.explorations_per_seed=1"])
    with TaskStore(tmp_path) as store:
        summary = TaskFactory(cfg, tmp_path, store, say=lambda _: None).run(rounds=1)
        tasks = store.all()
    assert tasks and all(t.meta["method"] == "example" for t in tasks)
    held_out = {t.seed for split in HELD_OUT_SPLITS for t in Pantry().tasks(split)}
    assert not {t.seed for t in tasks} & held_out
    assert summary["examples_proposed"] >= len(tasks)


def test_explore_that_could_make_no_task_is_refused(pantry, tmp_path):
    with pytest.raises(ConfigError, match="from_examples"):
        load_config(None, ["explore.hindsight=never", "explore.from_examples=0"])
    cfg = load_config(None, ["env.name=bare_pantry", "explore.hindsight=never",
                             "explore.from_examples=2"])
    with TaskStore(tmp_path) as store, pytest.raises(ValueError, match="no training task"):
        TaskFactory(cfg, tmp_path, store, say=lambda _: None)


def test_hindsight_auto_is_on_where_no_example_is_regrounded(pantry, tmp_path):
    def factory(*sets):
        cfg = load_config(None, ["env.name=pantry", "explore.proposer=schema", *sets])
        with TaskStore(tmp_path / "-".join(sets or ["none"])) as store:
            return TaskFactory(cfg, tmp_path, store, say=lambda _: None).uses_hindsight
    assert factory("explore.from_examples=0") and not factory("explore.from_examples=2")
    assert not factory()  # the default re-grounds examples
    assert factory("explore.from_examples=2", "explore.hindsight=always")


# --- the default run's recipe, end to end -----------------------------------------------------

QUICK_RECIPE = ["name=regrounded", "warmstart.steps=3", "eval.num_tasks=0",
                "learner.batch_groups=2", "actor.group_size=2", "actor.num_actors=1",
                "experience.enabled=false", "learner.probe_every=0", "tracking.wandb=disabled",
                # configs/quick.yaml pins the old recipe; these put the default's back, small
                "explore.from_examples=2", "explore.explorations_per_seed=1", "explore.seeds=6",
                "learner.kl_coef=0.1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_warm_starts_on_both_and_trains_rl_on_the_envs_own_tasks(tmp_path):
    """tasks.synthetic_share auto with re-grounded examples: explore stores them, the
    warm-start takes hand-written and re-grounded references, RL draws hand-written tasks."""
    from helpers_replay import stored_groups
    from helpers_runs import run_autodidact
    from test_run_integration import QUICK

    run_dir = tmp_path / "run"
    sets = [arg for s in QUICK_RECIPE for arg in ("--set", s)]
    proc = run_autodidact(run_dir, "run", "--run-dir", str(run_dir), "-c", str(QUICK),
                          "--max-updates", "2", *sets, timeout=360)
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert (summary["synthetic_share"], summary["rl_synthetic_share"]) == (0.5, 0.0)
    assert summary["tasks"]["hand_written"] == len(FilesEnv().tasks("train"))
    assert summary["tasks"]["self_made"] > 0 and "self-made" in proc.stdout + proc.stderr
    references = json.loads((RunDir(run_dir).policy_init / "warmstart_tasks.json").read_text())
    assert any(r.startswith("synth/") for r in references)
    assert any(not r.startswith("synth/") for r in references)
    groups = stored_groups(run_dir)
    assert groups and all(g.task.source == "original" for g in groups)
    with TaskStore(run_dir, readonly=True) as store:
        assert all(t.meta["method"] == "example" for t in store.all())
