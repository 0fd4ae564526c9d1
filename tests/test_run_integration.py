"""`autodidact run` end to end with real processes: Redis, replay, 2 actors, learner.

Small budget (a weak warm-start and a few dozen updates) so it fits the suite; asserts that
data flowed, weights moved and were loaded, the store holds several policy versions, metrics
are finite, the policy learned, and that a resumed run continues version, optimizer step and
ledger.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_learning import reward_contrast
from helpers_replay import stored_groups
from helpers_runs import run_autodidact

from autodidact.embedded_redis import EmbeddedRedis
from autodidact.report import report
from environments import FilesEnv
from metrics.jsonl import read_metrics
from protocol.control import ControlPlane, default_prefix
from protocol.run_dir import RunDir
from replay.store import read_stats

# The module fixture (warm-start, then a run) counts against its first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUICK = Path(__file__).resolve().parents[1] / "configs" / "quick.yaml"
# quick.yaml's 30 updates. 20 were tried to save time, and on a quiet machine the run then
# often ended before a guided group was trained (test_self_navigating_pool_grew_..., 2 of 4
# runs failed at 20, none at 30).
UPDATES = 30
RESUMED = 2  # further updates of the resumed run


def run_cli(run_dir: Path, *extra: str, timeout: int = 600,
            meanwhile=None) -> subprocess.CompletedProcess:
    """``autodidact run`` to completion; ``meanwhile(run_dir)`` runs in a thread alongside.
    The timeout is for a hang: the run takes minutes in the loaded suite, not ten."""
    # Guidance sooner and from similar tasks too: with the defaults (first extraction after 10
    # updates, same-task lessons only) a short run may end before a guided group is trained,
    # and this run is here to exercise that path.
    args = ["run", "--run-dir", str(run_dir), "-c", str(QUICK), "--set", "name=itest",
            "--set", "experience.update_every=3", "--set", "experience.min_similarity=0.5"]
    helper = threading.Thread(target=meanwhile, args=(run_dir,), daemon=True) if meanwhile \
        else None
    if helper:
        helper.start()
    proc = run_autodidact(run_dir, *args, *extra, timeout=timeout)
    if helper:
        helper.join(5)
    return proc


def kill_redis_mid_training(run_dir: Path, after_updates: int = 10) -> None:
    """SIGKILL the run's embedded redis-server once the learner is ``after_updates`` in."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        rows = [r for r in read_metrics(run_dir, "learner") if "learner/updates" in r]
        if rows and rows[-1]["learner/updates"] >= after_updates:
            pid = int((run_dir / "redis" / "redis.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            (run_dir / "redis_killed").write_text(str(rows[-1]["learner/updates"]))
            return
        time.sleep(0.5)



@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, quick_warm_start):
    # RL starts from quick.yaml's warm-started policy, made once for the session (conftest).
    run_dir = quick_warm_start(tmp_path_factory.mktemp("run"))
    # Redis is SIGKILLed a third of the way in: the launcher restarts it and every role
    # rides out the gap on its client's back-off (test_roles_rode_out_a_redis_kill).
    proc = run_cli(run_dir, "--max-updates", str(UPDATES),
                   meanwhile=lambda d: kill_redis_mid_training(d, after_updates=UPDATES // 3))
    return run_dir, proc


def test_the_warm_start_names_the_tasks_it_trained_on(finished_run):
    run_dir, _ = finished_run
    ids = json.loads((run_dir / "policy_init" / "warmstart_tasks.json").read_text())
    train = set(json.loads((run_dir / "split.json").read_text())["train"])
    assert ids and len(set(ids)) == len(ids) and set(ids) <= train


def test_roles_rode_out_a_redis_kill(finished_run):
    run_dir, proc = finished_run
    assert (run_dir / "redis_killed").exists(), "the run ended before redis could be killed"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"]["redis"] == 1
    # Reconnected, not crashed and restarted by the supervisor.
    assert not any(n for role, n in summary["restarts"].items() if role != "redis"), summary
    assert summary["learner"]["learner/updates"] == UPDATES


def test_groups_flowed_and_versions_moved(finished_run):
    run_dir, _ = finished_run
    stats = read_stats(run_dir)
    assert stats["groups"] >= UPDATES * 8  # at least what the updates of 8 groups consumed
    assert stats["consumed"] >= UPDATES * 8 - 8  # the last checkpoint's ledger was committed
    groups = stored_groups(run_dir)
    versions = {int(v) for g in groups for t in g.trajectories
                for v, m in zip(t.versions, t.action_mask) if m}
    assert len(versions) > 1, versions
    assert max(versions) >= 2


def test_actors_acknowledged_new_weights(finished_run):
    run_dir, _ = finished_run
    with EmbeddedRedis(run_dir) as url:  # the run's Redis data survives in its AOF
        control = ControlPlane.connect(url, default_prefix("itest"))
        assert control.get_version() == UPDATES
        acked = [v for v in range(1, UPDATES + 1) if control.version_acks(v)]
        assert len(acked) >= 3, acked
        assert control.version_acks(acked[-1]) <= {"actor-0", "actor-1"}


def test_learner_metrics_finite_and_learning(finished_run):
    run_dir, _ = finished_run
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    assert len(rows) == UPDATES
    for r in rows:
        for key in ("learner/loss", "learner/grad_norm", "learner/iw_mean", "learner/tokens_per_s"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
    replay_rows = read_metrics(run_dir, "replay")
    assert replay_rows and replay_rows[-1]["replay/groups"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["success_rl"]["avg"] > summary["success_base"]["avg"]
    # Each step lowered the loss on the batch it was taken on (re-scored after the step). The
    # training-reward curve of 20 to 30 batches of 32 rollouts is too noisy to show this
    # reliably: first-5 vs last-5 means failed about one run in four while held-out success
    # rose.
    gains = [r["learner/step_gain"] for r in rows]
    assert sum(g > 0 for g in gains) >= 0.9 * len(gains), gains
    assert all(r["learner/step_kl"] < 0.5 for r in rows), [r["learner/step_kl"] for r in rows]


def test_rl_moved_the_policy_towards_its_better_rollouts(finished_run):
    """What the warm-start alone cannot do (tests/helpers_learning.py): the final policy raised
    the log-probs of its first policies' rollouts that beat their group more than of those
    below it, by more than the same contrast with the two shuffled within groups."""
    run_dir, _ = finished_run
    contrast = reward_contrast(run_dir)
    # z: the contrast in standard deviations of its shuffled copies. This module's run of 30
    # updates measured 12.9 and 10.1 (contrast 0.47 and 0.46 nats/token; shuffled 0.09 ± 0.03,
    # 0.14 ± 0.03) and 11.9 after its resume; of 20, 8.1 and 11.4 (contrast 0.26 and 0.38;
    # shuffled 0.07 ± 0.02, 0.10 ± 0.02). z > 4 is far in the tail of what a policy that moved
    # as far, but not towards reward, would show, and far below what these runs show.
    assert contrast.z() > 4, str(contrast)


def test_self_navigating_pool_grew_and_guided_rollouts_were_trained(finished_run):
    run_dir, _ = finished_run
    pool_rows = read_metrics(run_dir, "experience")
    assert pool_rows and pool_rows[-1]["experience/pool_size"] > 0  # extracted during training
    actor_rows = [r for r in read_metrics(run_dir, "actor") if "actor/retrieval_hit_rate" in r]
    assert actor_rows and max(r["actor/retrieval_hit_rate"] for r in actor_rows) > 0
    assert any("actor/success_with_exp" in r for r in actor_rows)
    assert all(r["actor/guided_fraction"] <= 0.5 for r in actor_rows)  # share 0.5, rounded
    learner_rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    # the pool starts empty here (no explore stage): guidance begins after the first extraction
    guided_rows = [r for r in learner_rows if r["learner/guided_fraction"] > 0]
    assert guided_rows and all(r["learner/guided_fraction"] <= 0.5 for r in learner_rows)
    assert all(r["learner/stripped_fraction"] == r["learner/guided_fraction"]
               for r in learner_rows)
    assert all(r["learner/boosted_token_fraction"] > 0 for r in guided_rows)
    groups = stored_groups(run_dir)
    guided = [t for g in groups for t in g.trajectories if t.experience_ids]
    assert guided and all(t.experience_span and t.experience_span[1] <= t.prompt_len
                          for t in guided)


def test_judges_kept_up_and_the_learner_trained_on_step_labels(finished_run):
    run_dir, _ = finished_run
    learner_rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    assert all(r["learner/alpha"] == 0.1 for r in learner_rows)  # composite, constant alpha
    labelled = sum(r["learner/labelled_groups"] for r in learner_rows)
    timeouts = sum(r["learner/judge_timeouts"] for r in learner_rows)
    assert labelled + timeouts == sum(r["learner/groups"] for r in learner_rows)
    assert labelled >= 0.9 * (labelled + timeouts), (labelled, timeouts)  # the judge kept up
    judge_rows = [r for r in read_metrics(run_dir, "judge") if "judge/groups_per_s" in r]
    assert judge_rows and all(r["judge/how_reference"] == 1.0 for r in judge_rows)
    # Successful rollouts of a warm-started policy are mostly GOOD steps, failed ones not. Over
    # the whole run: one flush window may hold only failed rollouts (seen in a loaded suite).
    success = [r["judge/good_frac_success"] for r in judge_rows if "judge/good_frac_success" in r]
    failure = [r["judge/good_frac_failure"] for r in judge_rows if "judge/good_frac_failure" in r]
    assert success and np.mean(success) > (np.mean(failure) if failure else 0.0)
    stats = read_stats(run_dir)
    assert stats["judged"] >= labelled


def test_the_run_evaluates_on_validation_and_never_looks_at_test_unasked(finished_run):
    run_dir, _ = finished_run
    rd = RunDir(run_dir)
    summary = json.loads(rd.summary.read_text())
    assert summary["eval_split"] == "validation" and summary["looked_at_test"] is False
    assert "test" not in summary and not rd.test_looks.exists()
    validation = {t.task_id for t in FilesEnv().tasks("validation")}
    for stage in ("base", "warm", "rl"):
        result = summary[f"success_{stage}"]
        assert result["split"] == "validation"
        assert result["avg_ci"][0] <= result["avg"] <= result["avg_ci"][1]
        lines = rd.heldout_records("validation", stage).read_text().splitlines()
        assert len(lines) == result["tasks"]
        assert {json.loads(line)["task_id"] for line in lines} <= validation
    assert not list(rd.eval.glob("heldout-test-*"))


def test_the_report_says_why_rl_moved_and_it_is_not_no_signal(finished_run, tmp_path):
    """The likely-cause line of `autodidact report` (autodidact/diagnosis.py) on a run that
    learned: not "no signal" (tests/test_diagnosis_run.py plants that one). A run of this
    module's shape (of 30 updates then) measured training success 17% -> 33% over the
    quarters, 65% of its groups informative, validation +8.8 points (95% -2.5 to +20.0, 40
    tasks): "overfitting the training tasks", the interval being that wide. Also the
    learner's diagnostics, logged on the way: the entropy every update, the KL to the initial
    policy every 10th from the first, 0 there."""
    run_dir, _ = finished_run
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    assert all(r["learner/entropy"] > 0 for r in rows)
    kl = {r["step"]: r["learner/kl_initial"] for r in rows if "learner/kl_initial" in r}
    assert sorted(kl) == list(range(1, UPDATES + 1, 10)) and abs(kl[1]) < 1e-6 < kl[11]
    result = CliRunner().invoke(report, [str(run_dir), "--out", str(tmp_path)])
    assert result.exit_code == 0, (result.output, result.exception)
    found = json.loads((tmp_path / "series.json").read_text())["diagnosis"][run_dir.name]
    assert found["cause"] not in ("no signal", "too early to tell"), found["line"]
    assert f"**{found['cause']}**: {found['reason']}." in (tmp_path / "report.md").read_text()


# Before the resume test: it reads the run's summary as the run left it (a worker runs
# a module's tests in file order).
def test_the_navigating_bench_writes_its_json_from_finished_runs(finished_run, tmp_path):
    """bench.self_navigating --reuse --json on two finished arms (here the same run twice):
    the curves, the version each reaches the plain arm's final level at, held-out success,
    and nav − plain (0 on one run) with the command that wrote them."""
    from bench import self_navigating

    run_dir, _ = finished_run
    out = tmp_path / "bench"
    out.mkdir()
    for arm in ("plain", "nav"):
        (out / arm).symlink_to(run_dir)
    path = tmp_path / "nav.json"
    argv = ["--reuse", "--out", str(out), "--updates", str(UPDATES), "--json", str(path)]
    self_navigating.main(argv)
    record = json.loads(path.read_text())
    assert record["command"] == "python -m bench.self_navigating " + " ".join(argv)
    summary = json.loads((run_dir / "summary.json").read_text())
    for arm in ("plain", "nav"):
        got = record["arms"][arm]
        assert got["curve"] and all(0.0 <= s <= 1.0 for s in got["curve"].values())
        assert got["reaches_level_at"] is not None  # a run reaches its own final level
        assert got["rl"]["value"] == pytest.approx(summary["success_rl"]["avg"])
    assert record["minus_baseline_after_rl"]["nav"]["value"] == pytest.approx(0.0)
    assert set(record["nav_same_groups"]) == {"first third", "last third"}


def test_resume_continues_version_step_and_ledger(finished_run):
    run_dir, _ = finished_run
    before = torch.load(run_dir / "checkpoints/latest.pt", weights_only=True)
    # No evaluation and no experience role: this test reads the learner's checkpoint alone
    # (the run's own evaluations and pool were read above).
    run_cli(run_dir, "--resume", "--max-updates", str(UPDATES + RESUMED),
            "--set", "eval.num_tasks=0", "--set", "experience.enabled=false")
    after = torch.load(run_dir / "checkpoints/latest.pt", weights_only=True)
    assert (before["updates"], after["updates"]) == (UPDATES, UPDATES + RESUMED)
    assert after["version"] == before["version"] + RESUMED
    assert after["consumed"][:len(before["consumed"])] == before["consumed"]
    new = after["consumed"][len(before["consumed"]):]
    assert len(new) == RESUMED * 8 and not set(new) & set(before["consumed"])
    steps = [s["step"] for s in after["optimizer"]["state"].values()]
    assert all(int(s) == UPDATES + RESUMED for s in steps)
