"""The environment interface (parser, registry) and the built-in ``files`` environment."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from environments import (
    ActionError,
    ArgSpec,
    Environment,
    FilesEnv,
    ToolSpec,
    env_class,
    env_names,
    make_env,
    parse_action,
    register_env,
    verify_reference,
)
from environments.files import build_tasks, goal_holds, make_world
from protocol.messages import HELD_OUT_SPLITS, SPLITS, Task

VOCAB = set(FilesEnv.vocabulary())
ALL_TASKS = build_tasks()


def _task(seed=0, goal=None, reference=()):
    goal = goal if goal is not None else {"all": [{"cwd": ["nowhere"]}]}
    return Task(
        task_id=f"t{seed}", env="files", query="q", seed=seed, goal=goal, reference=list(reference)
    )


def _fresh(seed=0, **kw) -> FilesEnv:
    env = FilesEnv()
    env.reset(_task(seed, **kw))
    return env


def _words_ok(text: str) -> bool:
    return set(text.split()) <= VOCAB


# --- parser -----------------------------------------------------------------------------------

SPECS = [
    ToolSpec("mv", "move", (ArgSpec("src"), ArgSpec("dst"))),
    ToolSpec("cat", "show", (ArgSpec("file"), ArgSpec("start", "int", required=False))),
    ToolSpec("pwd", "where"),
]


def test_parser_accepts_literal_calls():
    assert parse_action("mv a.txt docs", SPECS).args == ("a.txt", "docs")
    assert parse_action("  mv 'a.txt'   \"docs\"\n", SPECS).args == ("a.txt", "docs")
    assert parse_action("cat a.txt 3", SPECS).args == ("a.txt", 3)
    assert parse_action("cat a.txt", SPECS).args == ("a.txt",)
    assert parse_action("pwd", SPECS).tool == "pwd"
    assert parse_action("mv x ..", SPECS).args == ("x", "..")


@pytest.mark.parametrize(
    "text,kind",
    [
        ("", "empty"),
        ("   \n\t", "empty"),
        ("rmrf a", "unknown_tool"),
        ("mv a", "arity"),
        ("mv a b c", "arity"),
        ("pwd now", "arity"),
        ("cat a.txt three", "bad_argument"),
        ("cat a.txt 3.5", "bad_argument"),
        ("mv 'unclosed b", "syntax"),
        ("mv a\\", "syntax"),
        ("mv [[[a]]] {{b}}", "bad_argument"),
        ("mv a;rm b", "bad_argument"),
        ("mv $(ls) b", "bad_argument"),
        ("__import__('os').system('ls')", "unknown_tool"),
        ("mv a.txt d\u00f6cs", "bad_characters"),
        ("mv a.txt \u202edocs", "bad_characters"),
        ("mv a\x00 b", "bad_characters"),
        ("x" * 100_000, "too_long"),
        ("mv '' docs", "bad_argument"),
    ],
)
def test_parser_rejects_malformed_calls(text, kind):
    with pytest.raises(ActionError) as err:
        parse_action(text, SPECS)
    assert err.value.kind == kind
    assert err.value.observation.startswith("error :")


def test_parser_rejects_non_text():
    with pytest.raises(ActionError):
        parse_action(b"mv a b", SPECS)


def test_toolspec_rejects_optional_before_required():
    with pytest.raises(ValueError):
        ToolSpec("bad", "", (ArgSpec("a", required=False), ArgSpec("b")))
    with pytest.raises(ValueError):
        ArgSpec("a", "complex")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "rmrf",
        "mv a",
        "ls a b c",
        "cat",
        "\u00e9\u00e8\u4e2d",
        "\x00\x01\xff",
        "x" * 100_000,
        "ls [[[[]]]]",
        "cd ((((",
        "__import__('os').system('rm -rf /')",
        "cat {'a': 1}",
        "mv notes.txt ../../etc",
        "cd /etc",
        "rm *",
        "touch evil.sh",
        "mkdir report.txt",
    ],
)
def test_env_step_on_invalid_text_gives_error_observation(text):
    env = _fresh()
    before = env.state()
    obs, done, info = env.step(text)
    assert obs.startswith("error :") and not done
    assert set(info) >= {"valid", "tool", "error"} and info["error"]
    assert env.state() == before
    assert _words_ok(obs)


@settings(max_examples=150, deadline=None)
@given(
    st.text(max_size=300)
    | st.sampled_from([t.name for t in FilesEnv().tools()]).flatmap(
        lambda tool: st.lists(st.text(max_size=20), max_size=4).map(lambda a: " ".join([tool] + a))
    )
)
def test_env_step_never_raises(text):
    env = _fresh(3)
    obs, done, info = env.step(text)
    assert isinstance(obs, str) and isinstance(info["valid"], bool)
    assert len(obs.split()) <= 40 and _words_ok(obs)


# --- tools ------------------------------------------------------------------------------------


def _unused(env, names):
    """The first of ``names`` that appears nowhere in the world."""
    text = json.dumps(env.tree)
    return next(n for n in names if f'"{n}"' not in text)


def _layout(env):
    """(a top-level file, a top-level folder, a file inside that folder)."""
    tree = env.tree
    x = sorted(n for n, v in tree.items() if isinstance(v, str))[0]
    f = sorted(n for n, v in tree.items() if isinstance(v, dict))[0]
    y = sorted(n for n, v in tree[f].items() if isinstance(v, str))[0]
    return x, f, y


def test_reset_is_deterministic_and_observes_root():
    a, b = FilesEnv(), FilesEnv()
    obs = a.reset(_task(7))
    assert obs == b.reset(_task(7)) and a.state() == b.state()
    assert obs.startswith("path : / contents :")
    assert make_world(7) != make_world(8)
    json.dumps(a.state())  # JSON-able


def test_ls_cd_pwd():
    env = _fresh()
    x, f, _ = _layout(env)
    obs, _, info = env.step("ls")
    assert (
        f + "/" in obs.split()
        and x in obs.split()
        and info == {"valid": True, "tool": "ls", "error": None}
    )
    assert env.step(f"ls {f}")[0] == env._listing(env.tree[f])
    assert env.step(f"cd {f}")[0] == f"ok path : / {f}"
    assert env.state()["cwd"] == [f]
    assert env.step("pwd")[0] == f"path : / {f}"
    env.step("cd ..")
    assert env.state()["cwd"] == []
    env.step(f"cd {f}")
    env.step("cd /")
    assert env.state()["cwd"] == []
    assert env.step(f"cd {x}")[2]["error"] == "not_a_folder"
    assert env.step("cd photos")[2]["error"] in ("no_such_folder", None)


def test_cat_and_grep():
    env = _fresh()
    x, f, y = _layout(env)
    content = env.tree[x]
    assert env.step(f"cat {x}")[0] == content
    assert env.step(f"cat {x} 1")[0] == " ".join(content.split()[1:])
    assert env.step(f"cat {x} 99")[0] == "( empty )"
    assert env.step(f"cat {f}")[2]["error"] == "is_a_folder"
    word = content.split()[0]
    assert x in env.step(f"grep {word}")[0].split()
    assert env.step("grep zzz")[0] == "( no match )"
    assert y in env.step(f"grep {env.tree[f][y].split()[0]} {f}")[0].split()


def test_mv_moves_and_renames():
    env = _fresh()
    x, f, _ = _layout(env)
    content = env.tree[x]
    obs, _, info = env.step(f"mv {x} {f}")
    assert obs == f"ok moved {x} into {f}" and info["error"] is None
    assert x not in env.tree and env.tree[f][x] == content
    env.step(f"cd {f}")
    new = _unused(env, ("poem.md", "poem.txt", "diary.md", "story.md"))
    assert env.step(f"mv {x} {new}")[0] == f"ok renamed {x} to {new}"
    assert env.tree[f][new] == content and x not in env.tree[f]
    assert env.step(f"mv {new} ..")[0] == f"ok moved {new} into root"
    assert env.tree[new] == content
    assert env.step(f"mv {new} docs")[2]["error"] == "no_such_entry"  # it is no longer here


def test_mv_refusals_leave_state_unchanged():
    env = _fresh()
    x, f, _ = _layout(env)
    before = env.state()
    new_folder = _unused(env, ("archive", "backup", "projects", "games"))
    new_file = _unused(env, ("poem.md", "poem.txt", "diary.md", "story.md"))
    for action, kind in [
        (f"mv {x} {x}", "same_name"),
        (f"mv {x} /", "exists"),
        (f"mv {x} {new_folder}", "bad_name"),
        (f"mv {f} {new_file}", "bad_name"),
        (f"mv {x} etc", "bad_name"),
        ("mv nothing.txt docs", "bad_name"),
        (f"mv {f} ..", "exists"),
        (f"mv {f} {x}", "exists"),
    ]:
        obs, _, info = env.step(action)
        assert info["valid"] and info["error"] == kind, (action, info)
        assert env.state() == before and obs.startswith("error :")


def test_cp_copies_files_only():
    env = _fresh()
    x, f, _ = _layout(env)
    assert env.step(f"cp {x} {f}")[0] == f"ok copied {x} into {f}"
    assert env.tree[x] == env.tree[f][x]
    new = _unused(env, ("poem.md", "poem.txt", "diary.md", "story.md"))
    assert env.step(f"cp {x} {new}")[0] == f"ok copied {x} to {new}"
    assert env.tree[new] == env.tree[x]
    assert env.step(f"cp {f} {new}")[2]["error"] == "is_a_folder"
    assert env.step(f"cp {x} {f}")[2]["error"] == "exists"


def test_rm_mkdir_touch():
    env = _fresh()
    x, f, _ = _layout(env)
    assert env.step(f"rm {x}")[0] == f"ok removed {x}" and x not in env.tree
    assert env.step(f"rm {f}")[2]["error"] == "not_empty"
    z = _unused(env, ("archive", "backup", "projects", "games"))
    assert env.step(f"mkdir {z}")[0] == f"ok created folder {z}" and env.tree[z] == {}
    assert env.step(f"mkdir {z}")[2]["error"] == "exists"
    assert env.step("mkdir poem.md")[2]["error"] == "bad_name"
    assert env.step(f"rm {z}")[0] == f"ok removed {z}" and z not in env.tree
    assert env.step(f"touch {x}")[0] == f"ok created file {x}" and env.tree[x] == ""
    assert env.step(f"touch {x}")[0] == f"ok touched {x}"
    assert env.step(f"touch {f}")[2]["error"] == "bad_name"


def test_goal_conditions():
    env = _fresh()
    x, f, _ = _layout(env)
    state = env.state()
    assert goal_holds(
        state,
        {
            "all": [
                {"file": [x], "content": env.tree[x]},
                {"folder": [f]},
                {"absent": ["zzz"]},
                {"cwd": []},
            ]
        },
    )
    assert not goal_holds(state, {"all": [{"file": [x], "content": "other"}]})
    for malformed in (
        {},
        {"all": []},
        {"all": "x"},
        [],
        {"all": [{"what": 1}]},
        None,
        {"all": [{"file": 5}]},
        {"all": [{"cwd": None}]},
        {"all": [{"absent": "x"}]},
        {"all": [{"file": [[1]]}]},
    ):
        assert not goal_holds(state, malformed)


def test_goal_from_states_relabels_what_changed():
    env = _fresh()
    x, f, _ = _layout(env)
    before = env.state()
    env.step(f"mv {x} {f}")
    goal = env.goal_from_states(before, env.state())
    assert goal_holds(env.state(), goal) and not goal_holds(before, goal)


# --- tasks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("holdout", ["task", "world"])
def test_task_set_size_ids_and_splits(holdout):
    env = FilesEnv(holdout=holdout)
    by_split = {s: env.tasks(s) for s in SPLITS}
    every = [t for ts in by_split.values() for t in ts]
    ids = [t.task_id for t in every]
    assert len(ids) >= 500 and len(set(ids)) == len(ids)  # the three splits are disjoint
    train_worlds = {t.seed for t in by_split["train"]}
    for split in HELD_OUT_SPLITS:
        held = by_split[split]
        assert 0.15 < len(held) / len(ids) < 0.25
        # "world" (the default): held-out worlds are unseen in training
        assert bool(train_worlds & {t.seed for t in held}) == (holdout == "task")
    assert all(t.env == "files" and t.split == s for s, ts in by_split.items() for t in ts)
    assert FilesEnv(holdout=holdout).tasks("train") == by_split["train"]  # stable
    assert len({(t.seed, t.query) for t in every}) == len(ids)
    with pytest.raises(ValueError):
        env.tasks("valid")


def test_reference_lengths_are_mixed():
    lengths = Counter(len(t.reference) for t in ALL_TASKS)
    assert min(lengths) == 1 and max(lengths) <= 5
    assert lengths[1] > 100 and lengths[2] > 100 and sum(lengths[n] for n in (3, 4, 5)) > 100


def test_every_reference_verifies_and_no_task_starts_solved():
    for task in ALL_TASKS:
        env = FilesEnv()
        env.reset(task)
        assert env.evaluate(task) == 0.0, task.task_id
        assert verify_reference(FilesEnv, task), task.task_id


def test_replays_stay_in_vocabulary_and_candidates_cover_reference():
    for task in ALL_TASKS:
        env = FilesEnv()
        assert _words_ok(task.query), task.query
        assert _words_ok(env.reset(task))
        for i, action in enumerate(task.reference):
            candidates = env.candidate_actions()
            assert action in candidates, (task.task_id, action)
            assert len(candidates) <= 400 and len(set(candidates)) == len(candidates)
            assert _words_ok(action)
            obs, done, info = env.step(action)
            assert _words_ok(obs) and len(obs.split()) <= 40, obs
            assert info["valid"] and info["error"] is None
            # References are minimal: the goal is reached at the last step, not before.
            assert done == (i == len(task.reference) - 1), (task.task_id, i)


def test_random_walks_over_candidates_stay_in_vocabulary():
    rng = random.Random(0)
    for seed in range(30):
        env = _fresh(seed)
        for _ in range(25):
            candidates = env.candidate_actions()
            assert len(candidates) <= 400
            action = rng.choice(candidates)
            assert _words_ok(action)
            obs, _, info = env.step(action)
            assert info["valid"], action  # every candidate is well-formed
            assert _words_ok(obs) and len(obs.split()) <= 40, (action, obs)


def test_vocabulary_is_small_and_covers_tool_descriptions():
    vocab = FilesEnv.vocabulary()
    assert len(vocab) == len(VOCAB) < 300
    assert all(" " not in w and w for w in vocab)
    for tool in FilesEnv().tools():
        assert _words_ok(tool.usage()) and _words_ok(tool.description)


def test_step_before_reset_and_foreign_task():
    with pytest.raises(RuntimeError):
        FilesEnv().step("ls")
    with pytest.raises(ValueError):
        FilesEnv().reset(Task(task_id="x", env="other", query="q", seed=0))


# --- registry ---------------------------------------------------------------------------------


def test_registry_lookup_and_unknown_name():
    assert "files" in env_names()
    env = make_env("files", num_worlds=5)
    assert isinstance(env, FilesEnv) and env.num_worlds == 5
    assert env_class("environments.files:files") is FilesEnv  # "module:name" imports a plugin
    with pytest.raises(KeyError, match="unknown environment 'nope'.*files"):
        make_env("nope")


def test_registry_accepts_a_new_env_and_refuses_clashes():
    @register_env("toy-test-env")
    class Toy(FilesEnv):
        pass

    assert env_class("toy-test-env") is Toy and Toy.name == "toy-test-env"
    with pytest.raises(ValueError):
        register_env("toy-test-env")(type("Other", (FilesEnv,), {}))
    with pytest.raises(TypeError):
        register_env("not-an-env")(dict)
    assert issubclass(Toy, Environment)


def test_default_instructions_teach_the_call_form():
    """The system prompt a chat model gets (environments.base.tool_instructions): every tool
    with its arguments, and an example reply that is itself a valid call now."""
    from environments.base import parse_action

    env = FilesEnv()
    env.reset(env.tasks("test")[0])
    text = env.instructions()
    for tool in env.tools():
        assert f"- {tool.usage()}: {tool.description}" in text
    example = text.split("Example reply:\n", 1)[1].split("\n", 1)[0]
    assert example in env.candidate_actions()
    parse_action(example, env.tools())  # raises if the example is not a call
    _, _, info = env.step(example)
    assert info["valid"]


@pytest.mark.parametrize("reply, call", [
    ("ls docs", ("ls", ("docs",))),
    ("You can use the command `ls docs` to list them.", ("ls", ("docs",))),
    ("```bash\ncd docs\n```", ("cd", ("docs",))),
    ("Try `sudo rm -rf /` or `pwd`.", ("pwd", ())),  # the first span that is a call
])
def test_a_call_in_an_instruct_models_prose_is_read(reply, call):
    from environments.base import parse_reply

    parsed = parse_reply(reply, FilesEnv().tools())
    assert (parsed.tool, parsed.args) == call


@pytest.mark.parametrize("reply", ["You should list the folder first.",
                                   "Use the ls command on docs.", "`sudo ls` then `rm -rf /`"])
def test_prose_without_a_call_stays_invalid(reply):
    env = FilesEnv()
    env.reset(env.tasks("test")[0])
    _, _, info = env.step(reply)
    assert not info["valid"] and info["error"] == "unknown_tool"
