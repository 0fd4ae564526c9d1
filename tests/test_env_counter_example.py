"""docs/environments.md and its worked plugin, examples/my_envs/counter.py: the page's checks run
as written (through the real CLI, in a temporary directory), the counter's closed vocabulary
holds every word its observations, refusals and queries can contain, and what the page counts
is what the code has."""

from __future__ import annotations

import importlib
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from environments import Environment, world_split
from protocol.messages import Task
from questioning.task_store import TaskStore

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "environments.md"
EXAMPLE = REPO / "examples" / "my_envs" / "counter.py"


@pytest.fixture(scope="module")
def counter():
    """The plugin module, imported as a user's run imports it (``PYTHONPATH=examples``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "examples"))
        return importlib.import_module("my_envs.counter")


# --- what the page counts ------------------------------------------------------------------------

NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine "
                                      "ten eleven twelve".split())}


def test_the_page_names_every_method_it_counts():
    text = PAGE.read_text()
    said = re.search(r"## The minimum: (\w+) methods\n(.*?)\n## ", text, re.S)
    required = sorted(Environment.__abstractmethods__)
    assert NUMBERS[said.group(1)] == len(required)
    table = re.findall(r"^\| `(\w+)\(", said.group(2), re.M)
    assert sorted(table) == required


def test_the_page_gives_the_examples_true_length():
    length = int(re.search(r"is a complete plugin \((\d+)\s+lines\)", PAGE.read_text()).group(1))
    assert length == len(EXAMPLE.read_text().splitlines())


# --- the vocabulary --------------------------------------------------------------------------


def kinds_raised(path: Path, error: str) -> set[str]:
    return set(re.findall(rf'{error}\("(\w+)"', path.read_text()))


def test_its_vocabulary_holds_every_word_its_observations_and_refusals_contain(counter):
    vocab = set(counter.Counter.vocabulary())
    env, rng = counter.Counter(), random.Random(0)
    names = [*counter.NAMES, "a0", "a10", "c1", "zz", "97", "x/y", "b2.txt", "-1"]
    numbers = ["-5", "0", "1", "9", "10", "99", "100", "123456789", "2.5", "true", "b2"]
    malformed = ["", "   ", "fly", "add", "new", "drop a1 a2", "add b2 3 4", '"', "new 'b2",
                 "x" * 300, "new b\u00e9", "new b2\x00", "add b2 `3`", "new [b2]", "ls -la",
                 "```\nnew b2\n```", "try `add a1 2` now", 123, None]
    words, kinds = set(), set()

    def step(action):
        obs, _, info = env.step(action)
        words.update(obs.split())
        kinds.add(info["error"])

    for seed in [*range(5), *range(20, 25)]:
        task = Task(f"probe/{seed}", "counter", "", seed)
        words.update(env.reset(task).split())
        for action in malformed:
            step(action)
        for _ in range(300):
            pick = rng.random()
            if pick < 0.4:
                step(rng.choice(env.candidate_actions()))
            elif pick < 0.9:
                tool = rng.choice(["new", "add", "drop", "add", "mul"])
                step(" ".join([tool, rng.choice(names)]
                              + [rng.choice(numbers)] * (tool == "add" or rng.random() < 0.1)))
            else:
                step(rng.choice(malformed))
        env.reset(task)
        step("new b9")
        for _ in range(12):  # past the largest value a counter may show
            step("add b9 9")
        for action in ["new a1", "add b3 1", "drop b3", "drop b9", "drop b9"]:
            step(action)
    for task in env.tasks("test"):
        words.update(task.query.split())
    assert words <= vocab, sorted(words - vocab)
    # Every refusal the parser and the counter can give was met, so none escaped the check.
    assert kinds_raised(REPO / "environments" / "base.py", "ActionError") <= kinds, kinds
    assert kinds_raised(EXAMPLE, "ToolError") <= kinds, kinds


# --- the page's checks, as written -------------------------------------------------------------


def page_commands() -> tuple[dict[str, str], list[str]]:
    """The ``export`` and the ``autodidact`` lines of the page's "checks to run" block."""
    section = PAGE.read_text().split("## The checks to run", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    exports = [line for line in lines if line.startswith("export ")]
    assert len(exports) == 1, lines
    env = dict(word.split("=", 1) for word in shlex.split(exports[0])[1:])
    commands = [line for line in lines if line.startswith("autodidact ")]
    assert len(commands) == len(lines) - 1, lines
    return env, commands


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_pages_checks_run_as_written(tmp_path, counter):
    exported, commands = page_commands()
    assert exported["PYTHONPATH"] == "examples"  # from the repository root, as the page runs
    env = {**os.environ, "PYTHONPATH": str(REPO / "examples")}
    said = {}
    for command in commands:
        args = [a.replace("$E", exported["E"]) for a in shlex.split(command)[1:]]
        out = subprocess.run([sys.executable, "-m", "autodidact.cli", *args], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-2000:])
        said[" ".join(args[:2])] = out.stdout + out.stderr
    assert set(said) == {"eval --env", "explore --set", "explore --profile-only",
                         "tasks verify"}, list(said)

    assert re.search(r"overall\s+5\s+100\.0% \(95% 100\.0–100\.0\)\s+100\.0%",
                     said["eval --env"])
    stored = int(re.search(r"explore: (\d+) tasks stored", said["explore --set"]).group(1))
    assert stored >= 20
    # Its describe_changes does not word deletions: no task asks for a drop, but drop is a
    # step of some (drop a1, new a1: counter a1 0), found among the listed calls (the page).
    assert "gaps: tools none" in said["explore --set"]
    assert "Environment counter: 3 tools" in said["explore --profile-only"]
    assert f"verified {stored}/{stored} tasks" in said["tasks verify"]

    # Every query explore made is in the counter's words (parts joined by its "and").
    with TaskStore(tmp_path / "runs" / "c", readonly=True) as store:
        tasks = store.all()
    assert len(tasks) == stored
    dropping = [t for t in tasks if any(a.startswith("drop ") for a in t.reference)]
    assert dropping and not any("drop" in t.query or "delete" in t.query for t in dropping)
    vocab = set(counter.Counter.vocabulary())
    assert all(set(t.query.split()) <= vocab for t in tasks), \
        [t.query for t in tasks if not set(t.query.split()) <= vocab]
    # No train tasks: the worlds it declares, never a held-out one (world_split's validation
    # and test seeds); it used to be seed 0's world alone.
    seeds = {t.seed for t in tasks}
    assert len(seeds) >= 10 and seeds <= set(counter.Counter.train_worlds), sorted(seeds)
    assert all(world_split(s) == "train" for s in seeds), sorted(seeds)


def test_tasks_verify_help_names_no_option_of_one_env():
    from click.testing import CliRunner

    from autodidact.cli import main

    out = CliRunner().invoke(main, ["tasks", "verify", "--help"], terminal_width=200)
    text = " ".join(out.output.split())
    assert out.exit_code == 0 and "e.g. --set env.options.KEY=VALUE" in text, text
    assert "num_worlds" not in text  # an option of the built-in files env only
