"""The ``bfcl`` environment: BFCL multi-turn entries through the ``bfcl-eval`` package.

Everything here runs the package's real executor and checker: the ground truth of all 800
entries, wrong sequences, unsafe model text, concurrent episodes, the split, held-out
functions, and exploration plus hindsight synthesis on top of the env.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("bfcl_eval")

from environments import make_env, verify_task  # noqa: E402
from environments.base import ARG_TYPES  # noqa: E402
from environments.bfcl import CATEGORIES, BFCLEnv, _data, split_ids  # noqa: E402
from protocol.messages import SPLITS, Task  # noqa: E402
from questioning.explorer import Explorer, ExploreSettings, seed_tasks  # noqa: E402
from questioning.synthesis import HindsightSynthesizer, Preferences  # noqa: E402

ENV = BFCLEnv()
ALL_TASKS = [t for split in SPLITS for t in ENV.tasks(split)]
BY_ID = {t.task_id: t for t in ALL_TASKS}
BASE0 = BY_ID["multi_turn_base_0"]  # TwitterAPI + GorillaFileSystem; workspace/document/...
MISS0 = BY_ID["multi_turn_miss_func_0"]  # ``sort`` is held out until turn 3


def _executor_globals() -> dict:
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    return vars(multi_turn_utils)


def _leftovers(model_name: str) -> list[str]:
    return [k for k in list(_executor_globals()) if k.startswith(model_name + "_")]


def _play(env: BFCLEnv, task: Task, actions) -> float:
    env.reset(task)
    for action in actions:
        env.step(action)
    return env.evaluate(task)


def _fs(env: BFCLEnv) -> dict:
    """The file system's top folder: {name: {name, content} | {name, contents}}."""
    return env.state()["GorillaFileSystem"]["root"]["contents"]


# --- 1. every ground truth passes -----------------------------------------------------------------


def test_all_800_ground_truths_pass_through_the_adapter():
    assert len(ALL_TASKS) == 800
    env, failures, t0 = BFCLEnv(), [], time.perf_counter()
    for task in ALL_TASKS:
        env.reset(task)
        done = False
        for action in task.reference:
            assert not done, (task.task_id, "done before the reference ended")
            obs, done, info = env.step(action)
            if not info["valid"]:
                failures.append((task.task_id, action[:80], obs[:120]))
        assert done, task.task_id
        if env.evaluate(task) != 1.0:
            failures.append((task.task_id, "reward", env.evaluate(task)))
        assert not _leftovers(env.model_name)  # the checker's instances are deleted
    print(f"bfcl 800 ground truths: {time.perf_counter() - t0:.2f} s")
    assert failures == []


def test_references_are_turns_of_calls_then_the_empty_action():
    truth = _data().truths["multi_turn_miss_func_0"]
    assert truth[2] == []  # the held-out function's turn asks for something impossible
    reference = MISS0.reference
    assert reference.count("") == len(truth) == 5
    assert reference[:2] == ["[" + ", ".join(truth[0]) + "]", ""]
    assert reference[4:6] == ["", "[sort('final_report.pdf')]"]  # turn 2: only the end


# --- 2. wrong sequences fail ----------------------------------------------------------------------


def test_wrong_sequences_fail():
    ref = BASE0.reference
    env = BFCLEnv()
    assert _play(env, BASE0, ref) == 1.0
    assert _play(env, BASE0, ref[1:]) == 0.0  # the first turn's calls skipped
    wrong_arg = [ref[0].replace("dir_name='temp'", "dir_name='tmp'")] + ref[1:]
    assert _play(env, BASE0, wrong_arg) == 0.0
    assert _play(env, BASE0, ref[:-1]) == 0.0  # last turn never ended: unfinished
    later = [ref[0], "", "[pwd()]"] + ref[2:]  # an extra step is allowed...
    assert _play(env, BASE0, later) == 1.0
    # ...but not a call in the wrong turn: the state is checked at the end of every turn
    moved = [ref[0][:-1] + ", " + ref[2][1:], "", ""] + ref[4:]
    assert _play(env, BASE0, moved) == 0.0


def test_force_quit_after_the_step_limit_fails_the_entry():
    env = BFCLEnv(max_steps_per_turn=2)
    env.reset(BASE0)
    steps = [env.step("[pwd()]") for _ in range(3)]
    assert [s[1] for s in steps] == [False, False, True]
    assert steps[-1][2]["force_quit"] and "error" in steps[-1][0]
    assert env.step(BASE0.reference[0])[2]["error"] == "episode_over"
    assert env.evaluate(BASE0) == 0.0
    # a third executed step in one turn force-quits; two per turn are within the limit
    assert _play(env, BASE0, ["[pwd()]", "[pwd()]"] + BASE0.reference) == 0.0
    padded = []
    for action in BASE0.reference:
        padded += ["[pwd()]", action] if action else [action]
    assert _play(env, BASE0, padded) == 1.0


# --- 3. unsafe text is rejected before anything runs --------------------------------------------


def _unsafe_cases(tmp_path):
    pwned, opened = tmp_path / "pwned", tmp_path / "opened"
    return [
        (f"[touch(file_name=__import__('os').system('touch {pwned}'))]", "bad_argument"),
        (f"[cd(folder=open('{opened}','w').write('1'))]", "bad_argument"),
        (f"[cd(open('{opened}','w'))]", "bad_argument"),  # positional too
        ("[touch(file_name=__import__('antigravity'))]", "bad_argument"),
        ("[cd(folder=__import__('this').s)]", "bad_argument"),
        (f"[__import__('os').system('touch {pwned}')]", "bad_callee"),
        ("[os.system('ls')]", "bad_callee"),
        ("[cd.__globals__()]", "bad_callee"),
        ("[cd(folder=os.sep)]", "bad_argument"),
        ("[cd(folder=(lambda: 'document')())]", "bad_argument"),
        ("[cd(folder=[c for c in 'document'])]", "bad_argument"),
        ("[cd(folder=f'{1}')]", "bad_argument"),
        ("[cd(folder='docu' + 'ment')]", "bad_argument"),
        ("[cd(folder=b'document')]", "bad_argument"),
        ("[cd(folder={'document'})]", "bad_argument"),  # a set
        ("[cd(folder=1e999)]", "bad_argument"),  # inf
        ("[cd(*['document'])]", "bad_argument"),
        ("[cd(**{'folder': 'document'})]", "unknown_argument"),
        ("[cd(path='document')]", "unknown_argument"),
        ("[cd('document', folder='document')]", "duplicate_argument"),
        ("[cd('document', 'x')]", "arity"),
        (f"[eval(\"__import__('os').system('touch {pwned}')\")]", "unknown_tool"),
        ("[exec('import antigravity')]", "unknown_tool"),
        ("[_load_scenario({})]", "unknown_tool"),  # a private method of the entry's class
        ("[get_account_info()]", "unknown_tool"),  # TradingBot: not one of this entry's classes
        ("[mkdir(dir_name='x'), get_stock_info(symbol='A')]", "unknown_tool"),  # all or nothing
        ("[cd(folder='" + "a" * 9000 + "')]", "too_long"),
        ("[" * 300 + "]" * 300, "syntax"),
        ("cd(folder='document'", "syntax"),
        ("Sure! Let me help.", "syntax"),
        ("[cd(folder='document'); import os]", "syntax"),
    ]


def test_unsafe_actions_are_rejected_without_side_effects(tmp_path):
    assert "antigravity" not in sys.modules and "this" not in sys.modules
    env = BFCLEnv()
    for action, kind in _unsafe_cases(tmp_path):
        env.reset(BASE0)
        before = env.state()
        obs, done, info = env.step(action)
        assert (info["valid"], info["error"]) == (False, kind), action[:80]
        assert obs.startswith("error"), action[:80]
        assert env.state() == before, action[:80]
        assert env.calls == [[], []], action[:80]  # turn 0 ended with nothing recorded
        assert info["role"] == "user" and not done  # the package ends the turn on bad text
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "opened").exists()
    assert "antigravity" not in sys.modules and "this" not in sys.modules


def test_plain_data_arguments_of_every_kind_work():
    env = BFCLEnv()
    env.reset(BASE0)
    text = ("[touch(file_name='résumé ☃.txt'), "
            "echo(content='run ls(x) \\tail(', file_name='résumé ☃.txt')]")
    obs, _, info = env.step(text)
    assert info["valid"] and info["error"] is None, obs
    # the package's executor would rewrite "ls(" inside the string; the adapter prevents that
    assert _fs(env)["résumé ☃.txt"]["content"] == "run ls(x) \tail("
    twitter = env.state()["TwitterAPI"]
    login = f"[authenticate_twitter({twitter['username']!r}, password={twitter['password']!r})]"
    assert env.step(login)[2]["error"] is None
    obs, _, info = env.step("[post_tweet(content='hi', tags=('#a', '#b'), mentions=[])]")
    assert info["valid"] and info["error"] is None, obs
    tweets = env.state()["TwitterAPI"]["tweets"]
    assert any(t["tags"] == ["#a", "#b"] for t in tweets.values())


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=80), st.from_regex(r"\[[a-z_]{1,8}\([^)]{0,30}\)\]")))
def test_nothing_the_model_writes_raises(text):
    env = BFCLEnv()
    env.reset(BASE0)
    obs, done, info = env.step(text)
    assert isinstance(obs, str) and isinstance(done, bool) and isinstance(info["valid"], bool)
    env.close()


def test_odd_inputs_do_not_raise():
    env = BFCLEnv()
    for text in [None, 12, "", "[]", "```\n[pwd()]\n```", "\x00", "[" + "(" * 500, "\ud800"]:
        env.reset(BASE0)
        _, _, info = env.step(text)
        assert isinstance(info["valid"], bool)
    env.reset(BASE0)
    assert env.step("```\n[pwd()]\n```")[2]["valid"]  # the package strips code fences


# --- 4. episodes never share state ----------------------------------------------------------------


def test_two_episodes_of_one_entry_are_independent():
    a, b = BFCLEnv(), BFCLEnv()
    a.reset(BASE0)
    b.reset(BASE0)
    start = b.state()
    a.step("[cd(folder='document'), mkdir(dir_name='temp')]")
    assert b.state() == start != a.state()
    b.step("[touch(file_name='b.txt')]")
    assert "b.txt" in _fs(b) and "b.txt" not in _fs(a)
    assert "temp" not in _fs(b)["document"]["contents"]
    for action in BASE0.reference[1:]:
        a.step(action)
    assert a.evaluate(BASE0) == 0.0  # a never ended its first turn where the reference does
    old = b.model_name
    b.reset(BASE0)
    assert b.state() == start and not _leftovers(old)


def test_threads_running_the_same_entry_do_not_interfere():
    results, names = [], []

    def worker(task):
        env = BFCLEnv()
        for _ in range(15):
            results.append(_play(env, task, task.reference))
            names.append(env.model_name)

    tasks = [BASE0, BASE0, BY_ID["multi_turn_long_context_8"], BY_ID["multi_turn_base_1"]]
    threads = [threading.Thread(target=worker, args=(t,)) for t in tasks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0] * 60
    assert len(set(names)) == 60  # a fresh model name, hence fresh instances, per episode
    assert not [k for n in names for k in _leftovers(n)]


# --- 5. keyword and positional arguments ----------------------------------------------------------


def test_positional_and_keyword_arguments_are_the_same_call():
    forms = [
        "[cd(folder='document'), mkdir(dir_name='temp'), "
        "mv(source='final_report.pdf', destination='temp'), sort(file_name='temp')]",
        "[cd('document'), mkdir('temp'), mv('final_report.pdf', 'temp'), sort('temp')]",
        "[cd('document'), mkdir(dir_name='temp'), mv('final_report.pdf', destination='temp'),"
        " sort('temp')]",
    ]
    outcomes = []
    for form in forms:
        env = BFCLEnv()
        initial = (env.reset(BASE0), env.state())[1]
        obs, _, info = env.step(form)
        assert info["valid"]
        outcomes.append((env.state(), obs, info["calls"]))
        assert env.state() != initial
    assert outcomes[0] == outcomes[1] == outcomes[2]
    env.reset(BASE0)
    env.step("[cd('document')]")
    assert env.step("[sort('final_report.pdf')]")[0] == (
        env.step("[sort(file_name='final_report.pdf')]")[0])


# --- 6. the split -------------------------------------------------------------------------------


def test_split_is_half_test_per_category_deterministic_and_disjoint():
    env = BFCLEnv()
    train, validation, test = (env.tasks(s) for s in ("train", "validation", "test"))
    per = Counter((t.meta["category"], t.split) for t in train + validation + test)
    sizes = {"train": 66, "validation": 34, "test": 100}
    assert per == {(c, s): n for c in CATEGORIES for s, n in sizes.items()}
    ids = split_ids()
    assert ids == split_ids()
    assert [t.task_id for t in train] == ids["train"] and [t.task_id for t in test] == ids["test"]
    assert [t.task_id for t in validation] == ids["validation"]
    assert not set(ids["train"]) & set(ids["test"])
    assert not (set(ids["train"]) | set(ids["test"])) & set(ids["validation"])
    assert sorted(t.seed for t in train + validation + test) == list(range(800))
    again = BFCLEnv(categories=list(reversed(CATEGORIES)))  # option order changes nothing
    assert [(t.task_id, t.seed) for t in again.tasks("train")] == [
        (t.task_id, t.seed) for t in train]
    # pinned: a change of the split would silently move tasks between train and test
    assert ids["train"][:3] == ["multi_turn_base_0", "multi_turn_base_2", "multi_turn_base_3"]
    digests = {s: hashlib.sha256(" ".join(ids[s]).encode()).hexdigest()[:16] for s in ids}
    # the test half is the one published results were measured on before validation existed
    assert digests == {"train": "9e7ee8241f418908", "validation": "0b489701ab6fed5a",
                       "test": "acc8e204e259f8e7"}
    base_only = BFCLEnv(categories=["multi_turn_base"])
    assert {t.meta["category"] for t in base_only.tasks("test")} == {"multi_turn_base"}
    assert {t.seed for t in base_only.tasks("test")} <= set(range(200))
    with pytest.raises(ValueError):
        BFCLEnv(categories=["simple"])


def test_per_category_draws_that_many_of_each_category_the_same_way_every_time():
    from episodes.evaluate import select_tasks
    from protocol.config import RunConfig

    env = BFCLEnv()
    drawn = select_tasks(RunConfig(), "test", env=env, per_category=3)
    assert Counter(t.meta["category"] for t in drawn) == {c: 3 for c in CATEGORIES}
    assert [t.task_id for t in drawn] == [
        t.task_id for t in select_tasks(RunConfig(), "test", env=env, per_category=3)]
    assert {t.split for t in drawn} == {"test"}
    other_seed = select_tasks(RunConfig(seed=1), "test", env=env, per_category=3)
    assert [t.task_id for t in other_seed] != [t.task_id for t in drawn]
    assert len(select_tasks(RunConfig(), "test", env=env, per_category=3, limit=5)) == 5
    # A larger draw holds the smaller one (eval --resume reuses its results).
    larger = {t.task_id for t in select_tasks(RunConfig(), "test", env=env, per_category=10)}
    assert {t.task_id for t in drawn} < larger and len(larger) == 10 * len(CATEGORIES)


def test_task_fields():
    task = BASE0
    assert (task.env, task.goal, task.source, task.seed) == (
        "bfcl", {"bfcl_entry": "multi_turn_base_0"}, "original", 0)
    assert task.query == _data().entries["multi_turn_base_0"]["question"][0][0]["content"]
    assert BFCLEnv.query_in_prompt is False
    assert BFCLEnv().reset(task) == task.query


# --- 7. held-out functions ------------------------------------------------------------------------


def test_missed_function_is_rejected_before_its_turn_and_accepted_from_it():
    env = BFCLEnv()
    env.reset(MISS0)
    assert "sort" not in {t.name for t in env.tools()}
    assert '"name": "sort"' not in env.instructions()
    before = env.state()
    obs, _, info = env.step("[cd(folder='document'), sort(file_name='final_report.pdf')]")
    assert (info["valid"], info["error"]) == (False, "unknown_tool")
    assert env.state() == before  # cd did not run either
    env.reset(MISS0)
    for action in MISS0.reference[:4]:  # turns 0 and 1
        env.step(action)
    assert env.turn == 2
    assert env.step("[sort(file_name='final_report.pdf')]")[2]["error"] == "unknown_tool"
    assert env.turn == 3  # the bad call ended turn 2
    env.reset(MISS0)
    observations = [env.step(a)[0] for a in MISS0.reference[:5]]
    assert env.turn == 3 and "'name': 'sort'" in observations[-1]  # the package's prompt
    assert "sort" in {t.name for t in env.tools()} and '"name": "sort"' in env.instructions()
    obs, _, info = env.step("[sort(file_name='final_report.pdf')]")
    assert info["valid"] and info["error"] is None, obs


def test_tools_follow_the_entry_and_the_union_before_any_reset():
    fresh = BFCLEnv().tools()
    assert len(fresh) == 128 and len({t.name for t in fresh}) == 128
    assert all(a.type in ARG_TYPES for t in fresh for a in t.args)
    env = BFCLEnv()
    env.reset(BASE0)
    entry = _data().entries["multi_turn_base_0"]
    assert [t.name for t in env.tools()] == [d["name"] for d in entry["function"]]
    mv = next(t for t in env.tools() if t.name == "mv")
    assert [(a.name, a.type, a.required) for a in mv.args] == [
        ("source", "str", True), ("destination", "str", True)]
    post = next(t for t in env.tools() if t.name == "post_tweet")
    assert [(a.name, a.type) for a in post.args] == [
        ("content", "str"), ("tags", "list"), ("mentions", "list")]
    assert env.candidate_actions() == []


# --- 8. timing -----------------------------------------------------------------------------------


def test_reset_and_ten_steps_are_fast():
    env = BFCLEnv()
    actions = ["[ls()]", "[cd(folder='document')]", "[ls(a=True)]", "[pwd()]",
               "[cat(file_name='final_report.pdf')]", "[mkdir(dir_name='temp')]",
               "[mv(source='final_report.pdf', destination='temp')]", "[cd(folder='temp')]",
               "[wc(file_name='final_report.pdf')]", "[du()]"]
    env.reset(BASE0)  # warm caches (the dataset loads once per process)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        env.reset(BASE0)
        for action in actions:
            _, _, info = env.step(action)
            assert info["valid"] and info["error"] is None, action
        runs.append((time.perf_counter() - t0) * 1000)
    ms = min(runs)
    print(f"bfcl reset+10 steps: {ms:.2f} ms")
    assert ms < 500


# --- state, goals, observations ------------------------------------------------------------------


def test_state_is_json_and_goals_from_states_hold_exactly_after_the_change():
    env = BFCLEnv()
    env.reset(BASE0)
    before = env.state()
    assert json.loads(json.dumps(before)) == before
    env.step("[cd(folder='document'), mkdir(dir_name='temp'), "
             "mv(source='final_report.pdf', destination='temp')]")
    after = env.state()
    goal = env.goal_from_states(before, after)
    paths = {tuple(p): v for p, v in goal["all"]}
    doc = ("GorillaFileSystem", "root", "contents", "document", "contents")
    assert paths[doc + ("final_report.pdf", "content")] is None  # removed
    assert paths[doc + ("temp", "name")] == "temp"
    synthetic = Task("s", "bfcl", "move it", 0, goal=goal)
    assert env.evaluate(synthetic) == 1.0
    env.reset(synthetic)
    assert env.evaluate(synthetic) == 0.0 and env.goal_progress(synthetic) == 0.0
    obs, done, _ = env.step("[cd(folder='document'), mkdir(dir_name='temp')]")
    assert not done and 0.0 < env.goal_progress(synthetic) < 1.0
    obs, done, _ = env.step("[mv(source='final_report.pdf', destination='temp')]")
    assert done and env.evaluate(synthetic) == 1.0
    parts = env.describe_changes(before, after)
    assert {p.text.split()[0] for p in parts} == {"set", "remove"}
    assert sorted(c for p in parts for c in map(json.dumps, p.conditions)) == sorted(
        map(json.dumps, goal["all"]))


def test_long_tool_results_are_cut_and_user_turns_are_not():
    env = BFCLEnv(max_obs_chars=120)
    task = BY_ID["multi_turn_long_context_0"]
    env.reset(task)
    obs, _, _ = env.step("[find()]")
    assert len(obs) <= 120 and obs.endswith("[truncated]")
    assert env.step("")[0] == _data().entries[task.task_id]["question"][1][0]["content"]


def test_vocabulary_spells_queries_prompts_and_references():
    vocab = set(BFCLEnv.vocabulary())
    for task in ALL_TASKS[::40]:
        assert set(task.query.split()) <= vocab
        assert set(" ".join(task.reference).split()) <= vocab
    env = BFCLEnv()
    env.reset(MISS0)
    assert set(env.instructions().split()) <= vocab


def test_registry_builds_the_env():
    env = make_env("bfcl", max_obs_chars=500)
    assert isinstance(env, BFCLEnv) and env.max_obs_chars == 500


# --- 9. exploration and hindsight synthesis -------------------------------------------------------


def test_exploration_and_hindsight_make_verified_tasks():
    env = make_env("bfcl")
    seeds = seed_tasks(env, limit=2)
    explorer = Explorer(lambda: make_env("bfcl"), ExploreSettings(breadth_steps=10,
                                                                  depth_steps=5), seed=0)
    synth = HindsightSynthesizer(lambda: make_env("bfcl"), Preferences())
    made = []
    for seed in seeds:
        exp = explorer.explore(seed, 0)
        assert len(exp.steps) == 15 and any(s.valid for s in exp.steps)
        assert all(s.action.startswith("[") or not s.valid for s in exp.steps)  # canonical
        made += synth.propose(exp)
    verified = [t for t in made if verify_task(BFCLEnv, t) == (True, "ok")]
    assert verified, synth.stats
    task = verified[0]
    assert task.env == "bfcl" and task.goal["all"] and task.query.startswith(("set", "remove"))
    assert _play(BFCLEnv(), task, task.reference) == 1.0


def test_shell_style_actions_become_python_calls():
    env = BFCLEnv()
    env.reset(BASE0)
    assert env.canonical_action("cd document") == "[cd(folder='document')]"
    assert env.canonical_action("ls true") == "[ls(a=True)]"
    assert env.canonical_action("[cd('document')]") == "[cd('document')]"
    obs, _, info = env.step("cd document")
    assert info["valid"] and info["calls"] == ["cd(folder='document')"]
    assert env.step("cd")[2]["error"] == "arity"
