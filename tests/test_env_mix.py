"""Several envs in one run (``env.mix``, environments/mixed.py), with real parts throughout.

* Config: an empty mix is a run of one env, as before; members that cannot work are refused
  in one line naming the field.
* The mixed env: task ids unique across envs, each task carrying its member; reset, step,
  evaluate and a rollout's batched calls go to the member of the episode's task; the union
  vocabulary; an open-vocabulary member refused under the tiny model.
* The feeder draws each env's tasks in its weight's share; retrieval keeps to the task's env.
* Per-env held-out results (ground-truth replays of every reference: 100% in each env).
* Real runs (slow): ``autodidact run`` over ``files`` + ``shop`` in process, resumed, and one
  with ``shop`` served by a real ``autodidact env serve`` process: per-env validation results
  in summary.json, and every stored group one env's task.
"""

from __future__ import annotations

import collections
import json
import os
import random
import uuid
from pathlib import Path

import pytest
from helpers_replay import stored_groups
from helpers_runs import run_autodidact

from autodidact.stages import StartRefused, check_mix
from autodidact.status_cli import collect
from autodidact.task_mix import TaskFeeder, member_weights
from environments import FilesEnv, ShopEnv, env_class, env_maker
from environments.base import call_each, check_env_options, make_envs, task_env_of_run
from environments.mixed import MixedEnv, member_task
from episodes.evaluate import evaluate_model, per_env
from navigating.extraction import with_env_tag
from navigating.pool import ExperiencePool, env_tag, experience_id
from protocol import env_wire as wire
from protocol.config import TASK_ENV_MEMBER, dump_resolved, load_config
from protocol.errors import ConfigError
from protocol.messages import SPLITS, Experience

FILES_SHOP = "env.mix=[{name: files}, {name: shop}]"


def mix_cfg(*extra: str):
    return load_config(None, [FILES_SHOP, *extra])


# --- config -----------------------------------------------------------------------------------


def test_an_empty_mix_is_a_run_of_one_env():
    cfg = load_config(None)
    assert cfg.env.mix == [] and cfg.env.members() == []
    assert env_class(cfg.env) is FilesEnv
    assert env_maker(cfg.env).options == {}
    again = load_config(None, ["env.options.num_worlds=50"])
    assert env_maker(again.env).options == {"num_worlds": 50}
    # the resolved config reads back to the same config
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mix-{uuid.uuid4().hex}.yaml"
    try:
        path.write_text(dump_resolved(cfg))
        assert load_config(path) == cfg
    finally:
        path.unlink()


@pytest.mark.parametrize("setting, says", [
    ("env.mix=[{name: files}, {name: files}]", "env.mix[1].id: 'files' is also mix[0]'s"),
    ("env.mix=[{name: files, weight: 0}]", "env.mix[0].weight must be > 0"),
    ("env.mix=[{name: files, weight: -1.5}]", "env.mix[0].weight must be > 0"),
    ("env.mix=[{name: files, id: a/b}]", "env.mix[0].id: 'a/b' cannot label tasks"),
    ("env.mix=[{name: ''}]", "env.mix[0].name"),
    ("env.mix=[{name: files, colour: red}]", "unknown key env.mix[0].colour"),
    ("env.mix=[{name: shop, address: 'http://x'}]", "env.mix[0].address must be a ZeroMQ"),
])
def test_a_member_that_cannot_work_is_refused_in_one_line(setting, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_mix_with_an_env_address_or_a_remote_plaintext_member_is_refused():
    with pytest.raises(ConfigError, match=r"env.address: with mix"):
        load_config(None, [FILES_SHOP, "env.address=tcp://127.0.0.1:5600"])
    with pytest.raises(ConfigError, match="leaves this machine"):
        load_config(None, ["env.mix=[{name: shop, address: 'tcp://10.1.2.3:5600'}]"])


def test_a_member_option_is_checked_against_its_own_env():
    cfg = load_config(None, ["env.mix=[{name: files, options: {num_worlds: 40}}, "
                             "{name: shop, options: {colours: 3}}]"])
    with pytest.raises(ConfigError, match=r"env.mix\[1\].options.colours: unknown option "
                                          r"of environment 'shop'"):
        check_env_options(cfg.env)
    check_env_options(load_config(None, ["env.mix=[{name: files, options: {num_worlds: 40}}, "
                                         "{name: shop}]"]).env)



def test_env_flag_on_a_mix_is_refused_not_ignored():
    from autodidact.resolve import Flags, resolve_config

    with pytest.raises(ConfigError, match=r"--env shop: the config runs an env mix "
                                          r"\(files\+shop\)") as err:
        resolve_config(None, [FILES_SHOP], Flags(env="shop"))
    assert "\n" not in str(err.value)
    assert resolve_config(None, [FILES_SHOP, "env.mix=[]"], Flags(env="shop")).env.name == "shop"

# --- the mixed env ----------------------------------------------------------------------------


def test_task_ids_are_unique_and_each_task_carries_its_env():
    env = env_maker(mix_cfg().env)()
    assert isinstance(env, MixedEnv) and env.name == "files+shop"
    seen = set()
    for split in SPLITS:
        tasks = env.tasks(split)
        own = FilesEnv().tasks(split) + ShopEnv().tasks(split)
        assert len(tasks) == len(own)
        for task in tasks:
            member = task.meta[TASK_ENV_MEMBER]
            assert task.env == member and task.task_id.startswith(f"{member}/")
            assert task.split == split
        seen |= {t.task_id for t in tasks}
        assert {t.meta[TASK_ENV_MEMBER] for t in tasks} == {"files", "shop"}
    assert len(seen) == sum(len(env.tasks(s)) for s in SPLITS)


def test_two_members_of_one_env_get_ids_of_their_own():
    cfg = load_config(None, ["env.mix=[{name: files, id: small, options: {num_worlds: 10}}, "
                             "{name: files, id: big}]"])
    env = env_maker(cfg.env)()
    train = env.tasks("train")
    small = [t for t in train if t.meta[TASK_ENV_MEMBER] == "small"]
    big = [t for t in train if t.meta[TASK_ENV_MEMBER] == "big"]
    assert small and len(big) > len(small)
    assert all(t.task_id.startswith("small/files/") for t in small)
    assert len({t.task_id for t in train}) == len(train)
    # the member is given the task as it made it
    task = small[0]
    assert member_task(task).task_id == task.task_id.removeprefix("small/")
    assert TASK_ENV_MEMBER not in member_task(task).meta
    assert env.reset(task) == FilesEnv(num_worlds=10).reset(member_task(task))
    assert env.member_id == "small"


def test_episodes_go_to_the_member_of_their_task():
    env = env_maker(mix_cfg().env)()
    train = env.tasks("train")
    shop = next(t for t in train if t.env == "shop")
    files = next(t for t in train if t.env == "files")
    for task, own in ((shop, ShopEnv()), (files, FilesEnv())):
        assert env.reset(task) == own.reset(member_task(task))
        assert env.tools() == own.tools() and env.state() == own.state()
        assert env.candidate_actions() == own.candidate_actions()
        assert env.evaluate(task) == 0.0
        for action in task.reference:
            got = env.step(action)
            assert got == own.step(action)
        assert env.evaluate(task) == 1.0 and env.goal_progress(task) == 1.0
    # a task of the other member is checked on that member's state, not the current one's
    assert env.evaluate(shop) == 1.0


def test_a_rollouts_batched_calls_reach_each_episodes_member():
    make = env_maker(mix_cfg().env)
    train = make().tasks("train")
    tasks = [t for t in train if t.env == "shop"][:2] + [t for t in train if t.env == "files"][:2]
    random.Random(0).shuffle(tasks)
    envs = make_envs(make, len(tasks))
    first = call_each(envs, "reset", [(t,) for t in tasks])
    assert first == [(ShopEnv() if t.env == "shop" else FilesEnv()).reset(member_task(t))
                     for t in tasks]
    steps = max(len(t.reference) for t in tasks)
    for i in range(steps):
        todo = [(e, t) for e, t in zip(envs, tasks) if i < len(t.reference)]
        got = call_each([e for e, _ in todo], "step", [(t.reference[i],) for _, t in todo])
        assert all(info["valid"] and info["error"] is None for _, _, info in got)
    assert call_each(envs, "evaluate", [(t,) for t in tasks]) == [1.0] * len(tasks)
    assert [e.member_id for e in envs] == [t.env for t in tasks]


def test_the_vocabulary_is_the_union_of_the_members():
    cls = env_class(mix_cfg().env)
    assert cls.vocabulary() == sorted(set(FilesEnv.vocabulary()) | set(ShopEnv.vocabulary()))
    assert cls.open_vocabulary_members() == []


def test_an_open_vocabulary_member_is_refused_under_the_tiny_model():
    cfg = load_config(None, ["env.mix=[{name: files}, {name: openenv, id: far, "
                             "options: {url: 'http://127.0.0.1:9'}}]"])
    assert env_class(cfg.env).vocabulary() == []
    with pytest.raises(StartRefused, match=r"env.mix\[1\] \(far\): an open vocabulary.*"
                                           r"set model.path"):
        check_mix(cfg)


def test_a_mix_that_asks_for_self_made_tasks_is_refused():
    with pytest.raises(StartRefused, match="tasks.synthetic_share"):
        check_mix(mix_cfg("tasks.synthetic_share=0.5"))
    with pytest.raises(StartRefused, match="explore.stage=alongside"):
        check_mix(mix_cfg("explore.stage=alongside"))
    check_mix(mix_cfg())  # the default: each env's own tasks


def test_tasks_of_the_mix_are_of_the_run():
    cfg = mix_cfg()
    shop = next(t for t in env_maker(cfg.env)().tasks("train") if t.env == "shop")
    assert task_env_of_run(shop, cfg.env)
    assert task_env_of_run(member_task(shop), cfg.env)  # by its env's name
    assert not task_env_of_run(shop, load_config(None).env)


# --- the feeder and retrieval -----------------------------------------------------------------


def test_the_feeder_draws_each_env_in_its_weight(control):
    mix = "env.mix=[{name: files, weight: 1}, {name: shop, weight: 3}]"
    original = env_maker(load_config(None, [mix]).env)().tasks("train")
    counts = collections.Counter(t.meta[TASK_ENV_MEMBER] for t in original)
    assert counts["files"] > 3 * counts["shop"]  # drawn by pool size, files would dominate
    for curriculum in ("uniform", "frontier"):
        feeder = TaskFeeder(load_config(None, [mix, f"tasks.curriculum={curriculum}"]),
                            control, original, 0.0)
        drawn = []
        while len(drawn) < 3000:  # the queue Redis holds, topped up and emptied
            feeder.top_up()
            while (task := control.pop_task()) is not None:
                drawn.append(task)
        share = sum(t.meta[TASK_ENV_MEMBER] == "shop" for t in drawn) / len(drawn)
        assert abs(share - 0.75) < 0.03, (curriculum, share)
    # one env: no weights, the pool cycled through as before
    assert member_weights(load_config(None), FilesEnv().tasks("train")) is None


def test_retrieval_keeps_to_the_tasks_own_env(redis_url, embedder):
    cfg = mix_cfg()
    tasks = env_maker(cfg.env)().tasks("train")
    shop = next(t for t in tasks if t.env == "shop")
    files = next(t for t in tasks if t.env == "files")

    def lesson(task, content):
        return Experience(exp_id=experience_id(task.query, content), when_to_use=task.query,
                          content=content)

    pool = ExperiencePool.connect(redis_url, f"test:{uuid.uuid4().hex[:8]}", embedder)
    try:
        # the same situation, met in both envs: each env's lesson carries its tag
        pool.add(with_env_tag(files, [lesson(shop, "a files lesson")])
                 + with_env_tag(shop, [lesson(shop, "a shop lesson")]))
        got = pool.retrieve(shop.query, top_k=5, min_similarity=0.5, env_tag=env_tag(shop))
        assert [e.content for e, _ in got] == ["a shop lesson"]
        got = pool.retrieve(shop.query, top_k=5, min_similarity=0.5, env_tag=env_tag(files))
        assert [e.content for e, _ in got] == ["a files lesson"]
        assert len(pool.retrieve(shop.query, top_k=5, min_similarity=0.5)) == 2  # across
    finally:
        pool.close()


# --- per-env held-out results -------------------------------------------------------------------


def test_held_out_results_are_per_env(tmp_path):
    from autodidact.base_model import prepare_model

    cfg = mix_cfg("eval.num_tasks=3", "eval.k=1")
    model = prepare_model(cfg, tmp_path)
    found = evaluate_model(cfg, model, "validation", limit=3, policy="ground-truth")
    records = found["per_task"]
    assert collections.Counter(r["env"] for r in records) == {"files": 3, "shop": 3}
    result = per_env(records)
    assert set(result["envs"]) == {"files", "shop"}
    for one in result["envs"].values():
        assert one["avg"] == 1.0 and one["tasks"] == 3 and len(one["avg_ci"]) == 2
    assert result["mean_over_envs"] == {"avg": 1.0, "best": 1.0}
    assert per_env([{**r, "env": None} for r in records]) == {}


def test_a_member_has_its_own_turn_limit(tmp_path):
    from autodidact.base_model import prepare_model

    cfg = load_config(None, ["env.mix=[{name: files}, {name: shop, max_turns: 1}]",
                             "env.max_turns=8"])
    assert [member.max_turns for _, member, _ in cfg.env.members()] == [8, 1]
    tasks = env_maker(cfg.env)().tasks("validation")
    long_shop = [t for t in tasks if t.env == "shop" and len(t.reference) > 1][:3]
    files = [t for t in tasks if t.env == "files" and len(t.reference) > 1][:3]
    assert len(long_shop) == len(files) == 3
    found = evaluate_model(cfg, prepare_model(cfg, tmp_path), tasks=long_shop + files,
                           policy="ground-truth")
    steps = {r["task_id"]: (r["steps"], r["avg"]) for r in found["per_task"]}
    assert all(steps[t.task_id] == ([1], 0.0) for t in long_shop)  # cut after one action
    assert all(steps[t.task_id] == ([len(t.reference)], 1.0) for t in files)
    with pytest.raises(ConfigError, match=r"env.mix\[0\].max_turns must be >= 0"):
        load_config(None, ["env.mix=[{name: shop, max_turns: -1}]"])


def test_wandb_gets_each_envs_numbers_and_tags():
    from autodidact.tracking import _env_names, summary_values
    from protocol.config import to_dict

    summary = {"success_rl": {"avg": 0.5, "best": 0.75, "tasks": 8, "mean_over_envs": {
        "avg": 0.5, "best": 0.75}, "envs": {"files": {"avg": 0.25}, "shop": {"avg": 0.75}}}}
    values = summary_values(summary)
    assert values["heldout/rl_files_avg"] == 0.25 and values["heldout/rl_shop_avg"] == 0.75
    assert values["heldout/rl_mean_over_envs_avg"] == 0.5 and values["heldout/rl_avg"] == 0.5
    assert _env_names(to_dict(mix_cfg())) == ["files", "shop"]
    assert _env_names(to_dict(load_config(None))) == ["files"]


def test_autodidact_eval_of_a_mix_reports_each_env(tmp_path):
    from click.testing import CliRunner

    from autodidact.cli import main

    out = tmp_path / "gt.jsonl"
    result = CliRunner().invoke(main, ["eval", "--run-dir", str(tmp_path), "--policy",
                                       "ground-truth", "--limit", "3", "--out", str(out),
                                       "--set", FILES_SHOP])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["env"] == "files+shop" and summary["tasks"] == 6
    assert {env: one["tasks"] for env, one in summary["envs"].items()} == {"files": 3, "shop": 3}
    assert summary["mean_over_envs"]["avg"] == 1.0


# --- real runs ----------------------------------------------------------------------------------

# The smallest run that trains: 10 warm-start steps on 40 references (20 of each env), 3
# updates of 4 groups, one actor, one judge, 4 validation tasks of each env, k=1.
TINY = ["--set", "warmstart.steps=10", "--set", "warmstart.max_examples=40",
        "--set", "experience.warmstart_share=0", "--set", "eval.num_tasks=4", "--set", "eval.k=1",
        "--set", "eval.greedy=false", "--set", "learner.batch_groups=4",
        "--set", "learner.checkpoint_every=2", "--set", "learner.max_minutes=3",
        "--set", "actor.num_actors=1", "--set", "actor.group_size=4",
        "--set", "experience.update_every=1", "--set", "tracking.wandb=disabled"]


def run_mix(run_dir: Path, mix: str, *extra: str, updates: int = 3):
    return run_autodidact(run_dir, "run", "--run-dir", str(run_dir), "--set", "name=mixtest",
                          "--set", f"env.mix={mix}", *TINY, "--max-updates", str(updates),
                          *extra, timeout=600)



def check_mixed_run(run_dir: Path, envs: set[str]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    for stage in ("success_base", "success_warm", "success_rl"):
        result = summary[stage]
        assert set(result["envs"]) == envs, (stage, result)
        for one in result["envs"].values():
            assert one["tasks"] == 4 and 0.0 <= one["avg"] <= 1.0 and len(one["avg_ci"]) == 2
        assert result["mean_over_envs"]["avg"] == pytest.approx(
            sum(e["avg"] for e in result["envs"].values()) / len(envs))
        assert result["tasks"] == 4 * len(envs)
    records = [json.loads(line) for line in
               (run_dir / "eval" / "heldout-validation-rl.jsonl").read_text().splitlines()]
    assert collections.Counter(r["env"] for r in records) == {env: 4 for env in envs}
    groups = stored_groups(run_dir)
    assert groups
    seen = collections.Counter()
    for group in groups:
        member = group.task.meta[TASK_ENV_MEMBER]
        assert group.task.task_id.startswith(f"{member}/") and group.task.env == member
        # every rollout of the group is of its task, so of one env
        assert {t.traj_id.rsplit("/", 2)[0] for t in group.trajectories} == {group.task.task_id}
        seen[member] += 1
    assert set(seen) == envs, seen  # the feeder drew from every env
    split = json.loads((run_dir / "split.json").read_text())
    assert split["env"] == "files+shop"
    return summary


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_over_files_and_shop_trains_evaluates_per_env_and_resumes(tmp_path):
    from autodidact.report import make_report

    run_dir = tmp_path / "mix"
    mix = "[{name: files}, {name: shop, max_turns: 6}]"
    proc = run_mix(run_dir, mix)
    summary = check_mixed_run(run_dir, {"files", "shop"})
    assert summary["learner"]["learner/updates"] == 3
    assert "files  avg@k" in proc.stderr + proc.stdout
    assert "warm-start: 40 verified references (files 20, shop 20)" in proc.stderr
    # resumed: the version goes on from the checkpoint, per-env results again
    run_mix(run_dir, mix, "--resume", updates=4)
    summary = check_mixed_run(run_dir, {"files", "shop"})
    assert summary["learner"]["learner/updates"] == 4
    text = (make_report([run_dir]) / "report.md").read_text()
    for env in ("files", "shop"):
        assert f"| held-out avg@k of {env}, after RL (95% interval) |" in text
    assert "| held-out avg@k, mean over envs, after RL |" in text
    # per-env evidence (tests/test_env_mix_evidence.py): the actors' success of each env,
    # each validation's, drawn by report; status's rows per env
    series = json.loads((run_dir / "report" / "series.json").read_text())
    drawn = {s["metric"] for s in series["plots"]["why_success_envs"]["series"]}
    assert {f"actor/env/{env}/success" for env in ("files", "shop")} <= drawn, drawn
    assert {f"eval/env/{env}/success_avg" for env in ("files", "shop")} <= drawn, drawn
    rows = collect(run_dir, replay_timeout_s=0.5)["heldout_envs"]
    assert {(r["stage"], r["env"]) for r in rows} == {
        (stage, env) for stage in ("base", "warm", "rl")
        for env in ("files", "shop", "mean over envs")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_with_shop_served_by_its_own_process(tmp_path):
    from autodidact.env_serve import EnvServerProcess

    tokens = tmp_path / "env_tokens"
    before = os.environ.get(wire.TOKENS_ENV)
    os.environ[wire.TOKENS_ENV] = str(tokens)  # the server's and this run's, not ~/.autodidact
    server = EnvServerProcess("shop", workers=1, log=tmp_path / "serve.log").start()
    try:
        run_dir = tmp_path / "served"
        run_mix(run_dir, f"[{{name: files}}, {{name: shop, address: '{server.address}'}}]",
                updates=2)
        check_mixed_run(run_dir, {"files", "shop"})
    finally:
        server.stop()
        if before is None:
            os.environ.pop(wire.TOKENS_ENV, None)
        else:
            os.environ[wire.TOKENS_ENV] = before
    assert server.proc.poll() is not None  # nothing left running
