"""Per-env evidence of an env mix (issue 55 part 2): ``status``, the viewer's Run page and
``report`` show each env's held-out success with its interval and the mean over envs; the
actors and the validation probe log success per env, and report draws it; the frontier
feeder keeps each env's share of the draws at its weight.

The summary.json of a mix run is made by the code the launcher uses
(:func:`autodidact.stages.heldout_result` over per-task records of two envs, each stage's
numbers different, so a table that shows the wrong stage or env fails); the run of one env is
the same without ``env`` in its records. The feeder draws through the real Redis of
tests/conftest.py.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from autodidact.stages import heldout_result
from autodidact.status_cli import collect, status
from episodes.evaluate import summarize
from metrics.intervals import format_rate

# per stage, per env: the avg@k of each of the env's 4 tasks (k=2 rollouts each)
STAGES = {"base": {"files": [0.0, 0.0, 0.5, 0.0], "shop": [0.0, 0.0, 0.0, 0.0]},
          "warm": {"files": [1.0, 0.5, 0.5, 0.0], "shop": [0.5, 0.0, 0.0, 0.0]},
          "rl": {"files": [1.0, 1.0, 0.5, 1.0], "shop": [0.5, 0.5, 0.0, 1.0]}}
TEST_RL = {"files": [1.0, 1.0, 1.0, 0.5], "shop": [0.0, 0.5, 0.0, 0.0]}


def task_records(per_env: dict[str, list[float]], mix: bool = True) -> list[dict]:
    """Per-task records as episodes.evaluate.task_record writes them (k=2)."""
    out = []
    for env, avgs in per_env.items():
        for i, avg in enumerate(avgs):
            rewards = [1.0] * round(2 * avg) + [0.0] * (2 - round(2 * avg))
            out.append({"task_id": f"{env}/{i:04d}/t", "category": "c",
                        **({"env": env} if mix else {}), "rewards": rewards, "avg": avg,
                        "best": float(avg > 0)})
    return out


def write_summary(run_dir: Path, mix: bool = True) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {f"success_{stage}": heldout_result("validation", summarize(task_records(v, mix)))
               for stage, v in STAGES.items()}
    summary["eval_split"] = "validation"
    summary["looked_at_test"] = 1
    summary["test"] = {"rl": heldout_result("test", summarize(task_records(TEST_RL, mix)))}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text("name: mixtest\n")
    return summary


@pytest.fixture
def mix_run(tmp_path) -> tuple[Path, dict]:
    run_dir = tmp_path / "mix"
    return run_dir, write_summary(run_dir)


# --- status and the viewer ---------------------------------------------------------------------


def test_status_shows_each_envs_held_out_success_and_the_mean(mix_run):
    run_dir, summary = mix_run
    rows = collect(run_dir, replay_timeout_s=0.1)["heldout_envs"]
    got = {(r["split"], r["stage"], r["env"]): r for r in rows}
    assert set(got) == {(split, stage, env) for split, stages in
                        (("validation", ("base", "warm", "rl")), ("test", ("rl",)))
                        for stage in stages for env in ("files", "shop", "mean over envs")}
    for stage in ("base", "warm", "rl"):
        for env in ("files", "shop"):
            one = summary[f"success_{stage}"]["envs"][env]
            row = got[("validation", stage, env)]
            assert (row["avg"], row["ci"], row["tasks"]) == (one["avg"], one["avg_ci"], 4)
        assert got[("validation", stage, "mean over envs")]["avg"] == pytest.approx(
            sum(STAGES[stage]["files"] + STAGES[stage]["shop"]) / 8)
    assert got[("test", "rl", "shop")]["avg"] == 0.125
    assert got[("test", "rl", "files")]["avg"] == 0.875

    text = CliRunner().invoke(status, ["--run-dir", str(run_dir)],
                           env={"COLUMNS": "400"}).output
    lines = {line.split("  ")[0].strip(): line for line in text.splitlines()}
    shop_rl = summary["success_rl"]["envs"]["shop"]
    assert f"rl {format_rate(shop_rl['avg'], shop_rl['avg_ci'])}, 4 tasks" in \
        lines["validation shop"]
    assert "base 0.0%" in lines["validation shop"] and "warm 12.5%" in lines["validation shop"]
    assert "rl 87.5%" in lines["test files"] and "base" not in lines["test files"]
    assert "rl 68.8%" in lines["validation mean over envs"]  # (87.5 + 50) / 2


def test_a_run_of_one_env_shows_what_it_showed(tmp_path):
    run_dir = tmp_path / "one"
    write_summary(run_dir, mix=False)
    snap = collect(run_dir, replay_timeout_s=0.1)
    assert "heldout_envs" not in snap
    assert set(snap["heldout"]) == {"base", "warm", "rl"}
    text = CliRunner().invoke(status, ["--run-dir", str(run_dir)],
                           env={"COLUMNS": "400"}).output
    assert "held-out avg" in text and "validation files" not in text and "mean over" not in text


def test_the_viewers_run_page_gets_each_envs_rows(mix_run, tmp_path):
    from starlette.testclient import TestClient

    from autodidact.viewer.data import RunView
    from autodidact.viewer.server import Viewer, make_app

    run_dir, summary = mix_run
    one = tmp_path / "one"
    write_summary(one, mix=False)
    with TestClient(make_app(Viewer([RunView(run_dir, "mix"), RunView(one, "one")]))) as c:
        info = c.get("/api/run?run=0").json()
        rows = {(r["split"], r["stage"], r["env"]): r for r in info["heldout_envs"]}
        assert rows[("validation", "warm", "shop")]["ci"] == \
            summary["success_warm"]["envs"]["shop"]["avg_ci"]
        assert rows[("test", "rl", "mean over envs")]["avg"] == 0.5
        assert "heldout_envs" not in c.get("/api/run?run=1").json()
    js = (Path(__file__).parents[1] / "autodidact/viewer/static/app.js").read_text()
    assert "info.heldout_envs" in js and "Held-out success per env" in js


# --- report ------------------------------------------------------------------------------------


def test_report_has_each_envs_test_rows_and_the_mean(mix_run, tmp_path):
    from autodidact.report import make_report

    run_dir, summary = mix_run
    text = (make_report([run_dir]) / "report.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1].rstrip(" |")
            for line in text.splitlines() if line.startswith("| ")}
    for env in ("files", "shop"):
        one = summary["test"]["rl"]["envs"][env]
        assert rows[f"test avg@k of {env}, after RL (95% interval)"] == \
            format_rate(one["avg"], one["avg_ci"])
        assert f"test avg@k of {env}, after warm-start (95% interval)" not in rows  # not looked
        warm = summary["success_warm"]["envs"][env]
        assert rows[f"held-out avg@k of {env}, after warm-start (95% interval)"] == \
            format_rate(warm["avg"], warm["avg_ci"])
    assert rows["test avg@k, mean over envs, after RL"] == "50.0%"
    one = tmp_path / "one"
    write_summary(one, mix=False)
    text = (make_report([one]) / "report.md").read_text()
    assert "test avg@k, after RL" in text and " of files" not in text and "mean over" not in text
    assert "why_success_envs" not in text


# --- the actors and the probe over a mix, and what report and the diagnosis make of them -------


@pytest.mark.timeout(300)
def test_actors_and_the_probe_log_success_per_env_and_report_draws_it(tmp_path, control):
    """The real actor loop (tiny model over the mix's vocabulary, a faked replay and weight
    channel as tests/test_validation_probe.py has them) logs each env's success; actor-0's
    probe each env's probe success; a held-out evaluation each env's avg@k; report draws all
    three per env."""
    from helpers_procs import serve_until
    from test_validation_probe import SpyNavigator, StoringReplay, VersionPerGroup

    from actor.actor import Actor
    from autodidact.base_model import prepare_model
    from autodidact.report import make_report
    from autodidact.resolve import actor_settings
    from autodidact.stages import held_out_eval
    from autodidact.wiring import build_probe
    from environments import env_maker
    from inference.backends.hf import TransformersBackend
    from metrics.jsonl import read_metrics
    from protocol.config import TASK_ENV_MEMBER, load_config

    cfg = load_config(None, ["env.mix=[{name: files}, {name: shop}]", "env.max_turns=2",
                             "eval.probe_every=2", "eval.probe_tasks=2", "eval.num_tasks=2",
                             "eval.k=1", "eval.greedy=false", "actor.group_size=2",
                             "actor.groups_in_flight=2"])
    model = prepare_model(cfg, tmp_path)
    train = env_maker(cfg.env)().tasks("train")
    files = [t for t in train if t.meta[TASK_ENV_MEMBER] == "files"][:6]
    shop = [t for t in train if t.meta[TASK_ENV_MEMBER] == "shop"][:6]
    control.init_admission(0, 0)
    control.push_tasks([t for pair in zip(files, shop) for t in pair])
    replay = StoringReplay()
    actor = Actor(actor_settings(cfg), tmp_path, control, replay, TransformersBackend(model),
                  VersionPerGroup(replay), "actor-0", navigator=SpyNavigator(),
                  probe=build_probe(cfg, tmp_path, "actor-0"))
    assert collections.Counter(t.meta[TASK_ENV_MEMBER] for t in actor.probe.tasks) == \
        {"files": 2, "shop": 2}
    serve_until(actor, lambda: len(replay.pushed) >= 6, what="6 groups")
    actor_records = [r for r in read_metrics(tmp_path, "actor") if "actor/success_rate" in r]
    seen = collections.Counter()
    for r in actor_records:  # each record's per-env rates are its own groups' rollouts
        envs = [k.split("/")[2] for k in r if k.startswith("actor/env/")]
        assert envs and set(envs) <= {"files", "shop"}, r
        seen.update(envs)
        assert all(0.0 <= r[f"actor/env/{env}/success"] <= 1.0 for env in envs)
    assert set(seen) == {"files", "shop"}, seen
    probes = [r for r in read_metrics(tmp_path, "eval") if "eval/probe_success" in r]
    assert probes
    for r in probes:  # two tasks of each env: the overall rate is the mean of the envs'
        assert r["eval/probe_success"] == pytest.approx(
            (r["eval/env/files/probe_success"] + r["eval/env/shop/probe_success"]) / 2)
    held_out_eval(cfg, tmp_path, model, "rl", 3, say=lambda line: None)

    series = json.loads((make_report([tmp_path]) / "series.json").read_text())
    plot = series["plots"]["why_success_envs"]
    drawn = {(s["metric"], s["x_axis"]) for s in plot["series"]}
    assert drawn == {(f"{prefix}/env/{env}/{name}", axis) for env in ("files", "shop")
                     for prefix, name, axis in (("actor", "success", "version"),
                                                ("eval", "probe_success", "version"),
                                                ("eval", "success_avg", "update"))}
    assert [s["x"] for s in plot["series"]
            if s["metric"] == "eval/env/shop/success_avg"] == [[3]]
    text = (tmp_path / "report" / "report.md").read_text()
    assert "Success per env (env mix)" in text and "why_success_envs.png" in text
    assert (tmp_path / "report" / "why_success_envs.png").stat().st_size > 0


def test_the_diagnosis_reads_training_success_per_env():
    from autodidact.diagnosis import diagnose, training_success_by_env

    records = []
    for v in range(12):  # files rises from 0.1 to 0.9, shop stays at 0.2
        records.append({"role": "learner", "step": v + 1, "learner/updates": v + 1,
                        "learner/version": v + 1, "learner/loss": 0.1, "learner/reward": 0.3,
                        "learner/groups": 8, "learner/degenerate_groups": 2})
        files = 0.1 + 0.8 * v / 11
        records.append({"role": "actor", "actor/version": v, "actor/success_rate":
                        (files + 0.2) / 2, "actor/env/files/success": files,
                        "actor/env/shop/success": 0.2})
        if v % 3 == 0:
            records.append({"role": "eval", "eval/version": v, "eval/probe_success": 0.3,
                            "eval/env/files/probe_success": 0.4,
                            "eval/env/shop/probe_success": 0.2})
    assert set(training_success_by_env(records)) == {"files", "shop"}
    found = diagnose(records)
    per_env = found.numbers["training success per env"]
    assert per_env["files"] == pytest.approx((0.1 + 0.8 / 11, 0.9 - 0.8 / 11))
    assert per_env["shop"] == pytest.approx((0.2, 0.2))
    assert found.numbers["validation probe per env"]["files"] == pytest.approx((0.4, 0.4))
    assert "per env: files 17% → 83% (probe 40% → 40%), shop 20% → 20% (probe 20% → 20%)" \
        in found.reason
    # a run of one env: no per-env numbers, the line as before
    one = [{k: v for k, v in r.items() if "/env/" not in k} for r in records]
    assert "training success per env" not in diagnose(one).numbers
    assert "per env" not in diagnose(one).reason


# --- the frontier feeder over a mix ------------------------------------------------------------


def test_the_frontier_feeder_keeps_each_envs_share_and_the_frontier_within_it(control):
    from autodidact.task_mix import TaskFeeder, frontier_weight
    from environments import env_maker
    from protocol.config import TASK_ENV_MEMBER, load_config

    mix = "env.mix=[{name: files, weight: 1}, {name: shop, weight: 3}]"
    cfg = load_config(None, [mix, "tasks.curriculum=frontier"])
    original = env_maker(cfg.env)().tasks("train")
    files = [t for t in original if t.meta[TASK_ENV_MEMBER] == "files"]
    shop = [t for t in original if t.meta[TASK_ENV_MEMBER] == "shop"]
    # every shop task far from the frontier (64 failures), half of files' at it (1 of 2)
    near = {t.task_id for t in files[::2]}
    control.record_outcomes({**{t.task_id: (0, 64) for t in shop + files[1::2]},
                             **{tid: (1, 2) for tid in near}})
    floor = cfg.tasks.frontier_floor
    far, at = frontier_weight(0, 64, floor), frontier_weight(1, 2, floor)
    # the env weight times the frontier weight would give shop 3 far / (3 far + (at + far) / 2)
    assert far < 0.2 and at == 1.0 and 3 * far / (3 * far + (at + far) / 2) < 0.5
    feeder = TaskFeeder(cfg, control, original, 0.0)
    drawn = []
    while len(drawn) < 4000:
        feeder.top_up()
        while (task := control.pop_task()) is not None:
            drawn.append(task)
    by_env = collections.Counter(t.meta[TASK_ENV_MEMBER] for t in drawn)
    assert abs(by_env["shop"] / len(drawn) - 0.75) < 0.03, by_env  # its weight's share
    # within files the frontier still decides: its tasks at the frontier drawn ~1/(1+far)
    files_drawn = [t for t in drawn if t.meta[TASK_ENV_MEMBER] == "files"]
    share_near = sum(t.task_id in near for t in files_drawn) / len(files_drawn)
    assert abs(share_near - 1 / (1 + far)) < 0.05, share_near
