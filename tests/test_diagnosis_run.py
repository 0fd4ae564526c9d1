""""Why RL moved or stalled" on a real run planted to carry no signal: ``actor.group_size=1``,
so every group is one rollout and all of a group's rollouts score the same by construction
(every outcome advantage is 0), trained on anyway (``learner.skip_uninformative=false``) so the
learner logs its updates. ``autodidact report`` and the viewer must both name it "no signal",
with the same line, and the learner must have logged its diagnostics on the way.

The learning run's side is in tests/test_run_integration.py (its whole quick.yaml run, shared
with that module's other tests); the shared tiny run's report and viewer pages check the
section's plots (tests/test_report.py, tests/test_viewer.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_runs import run_autodidact
from starlette.testclient import TestClient

from autodidact.report import WHY_PLOTS, report
from autodidact.viewer.data import RunView
from autodidact.viewer.server import Viewer, make_app
from metrics.jsonl import read_metrics

pytestmark = pytest.mark.slow

QUICK = Path(__file__).resolve().parents[1] / "configs" / "quick.yaml"
UPDATES = 8  # autodidact.diagnosis.MIN_UPDATES: the fewest it reads quarters from
# About 20 s alone on 2 cores: no warm-start, no evaluation, two groups of one rollout a batch.
PLANTED = ["name=nosignal", "warmstart.steps=0", "eval.num_tasks=0", "learner.batch_groups=2",
           "actor.group_size=1", "learner.skip_uninformative=false", "actor.num_actors=1",
           "experience.enabled=false", "learner.probe_every=0", "learner.diagnostics_every=2",
           "tracking.wandb=disabled"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("nosignal") / "run"
    run_dir.mkdir()
    sets = [arg for s in PLANTED for arg in ("--set", s)]
    run_autodidact(run_dir, "run", "--run-dir", str(run_dir), "-c", str(QUICK),
                   "--max-updates", str(UPDATES), *sets, timeout=300)
    return run_dir


@pytest.mark.timeout(400)
def test_the_learner_logged_its_diagnostics(run_dir):
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, UPDATES + 1))
    assert all(r["learner/entropy"] > 0 for r in rows)
    # every second update from the first; the first scores the initial policy itself
    kl = {r["step"]: r["learner/kl_initial"] for r in rows if "learner/kl_initial" in r}
    assert sorted(kl) == [1, 3, 5, 7] and kl[1] == pytest.approx(0.0, abs=1e-6)
    # the planted run trained on groups of one: nothing informative, ever
    assert all(r["learner/degenerate_groups"] == r["learner/groups"] for r in rows)


def test_report_and_viewer_name_no_signal(run_dir, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(report, [str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads((out / "series.json").read_text())
    found = data["diagnosis"][run_dir.name]
    assert found["cause"] == "no signal", found["line"]
    assert "0% of groups informative" in found["reason"]
    md = (out / "report.md").read_text()
    assert "## Why RL moved or stalled" in md and f"**no signal**: {found['reason']}." in md
    drawn = {p.name for p in WHY_PLOTS} & set(data["plots"])
    assert drawn == {p.name for p in WHY_PLOTS}
    for name in drawn:
        assert f"]({name}.png)" in md and (out / f"{name}.png").stat().st_size > 5000
    # no evaluation was asked for: the validation points are named as missing, with why
    assert any("heldout/avg" in m and "eval.num_tasks=0" in m for m in data["missing"])
    with TestClient(make_app(Viewer([RunView(run_dir, "planted")]))) as client:
        curves = client.get("/api/curves?runs=0").json()["runs"][0]
    assert curves["diagnosis"]["line"] == found["line"]
    assert [p["name"] for p in curves["plots"] if p["section"] == "why"] == \
        [p.name for p in WHY_PLOTS]
