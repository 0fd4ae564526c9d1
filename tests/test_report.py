"""``autodidact report`` on a real tiny run (and on two runs overlaid), and the wandb mirror of
that run (offline).

The run is the session's tiny job from tests/test_status.py (:func:`test_status.tiny_run`),
made once however these two files are selected.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_status import PROBE_EVERY, UPDATES, tiny_run

from autodidact.diagnosis import informative_share
from autodidact.report import PLOTS, WHY_PLOTS, Line, Run, missing_reason, report
from metrics.jsonl import read_metrics

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"
EXPECTED_PLOTS = {"heldout_success"} | {p.name for p in PLOTS + WHY_PLOTS}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory)["dir"]


def _series(data: dict, plot: str, metric: str, run: str | None = None,
            x_axis: str | None = None) -> list[dict]:
    return [s for s in data["plots"][plot]["series"] if s["metric"] == metric
            and (run is None or s["run"] == run) and (x_axis is None or s["x_axis"] == x_axis)]


@pytest.mark.timeout(240)
def test_report_of_a_tiny_run(run_dir):
    result = CliRunner().invoke(report, [str(run_dir)])
    assert result.exit_code == 0, (result.output, result.exception)
    out = run_dir / "report"
    data = json.loads((out / "series.json").read_text())
    assert set(data["plots"]) == EXPECTED_PLOTS, set(data["plots"]) ^ EXPECTED_PLOTS
    for name, plot in data["plots"].items():
        png = (out / plot["file"]).read_bytes()
        assert png.startswith(PNG) and len(png) > 5000, name
    label = run_dir.name
    learner = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    assert len(learner) == UPDATES
    for plot, metric in (("loss", "learner/loss"), ("clip_fraction", "learner/clip_fraction"),
                         ("importance_weights", "learner/iw_mean"),
                         ("importance_weights", "learner/iw_max"), ("lag", "learner/lag_mean"),
                         ("reward", "learner/reward")):
        (s,) = _series(data, plot, metric, label)
        assert s["x"] == [r["step"] for r in learner] == list(range(1, UPDATES + 1)), metric
        assert s["y"] == [r[metric] for r in learner], metric
    actor = [r for r in read_metrics(run_dir, "actor") if "actor/success_rate" in r]
    (wall,) = _series(data, "train_success", "actor/success_rate", label, "wall")
    assert len(wall["x"]) == len(actor) and wall["x"] == sorted(wall["x"]) and wall["x"][0] >= 0
    (by_version,) = _series(data, "train_success", "actor/success_rate", label, "version")
    assert by_version["x"] == sorted({r["actor/version"] for r in actor})
    replay = [r for r in read_metrics(run_dir, "replay") if "replay/groups" in r]
    (groups,) = _series(data, "replay", "replay/groups", label)
    assert groups["y"] == [r["replay/groups"] for r in replay]
    assert _series(data, "throughput", "judge/groups_per_s", label)
    summary = json.loads((run_dir / "summary.json").read_text())
    (held,) = _series(data, "heldout_success", "heldout/avg", label)
    assert held["stages"] == ["base", "warm", "rl"] and held["x"] == [0, 0, UPDATES]
    assert held["y"] == [summary[f"success_{s}"]["avg"] for s in ("base", "warm", "rl")]
    head = data["headline"][label]
    assert (head["updates"], head["version"], head["restarts_total"]) == (UPDATES, UPDATES, 0)
    assert head["final_loss"] == learner[-1]["learner/loss"] and head["finished"]
    assert head["groups"] > 0 and head["groups_per_s"] > 0
    md = (out / "report.md").read_text()
    for text in ("## Headline numbers", "held-out avg@k, after RL",
                 f"| learner updates | {UPDATES} |", "## Config", "```yaml", "batch_groups: 2",
                 "redis:", "***@"):
        assert text in md, text
    for plot in data["plots"].values():
        assert f"]({plot['file']})" in md
    # the one series the launcher does not record is named, not invented
    assert any("held-out success vs wall time" in m for m in data["missing"])
    # Why RL moved or stalled: the likely cause and the series it is read from
    found = data["diagnosis"][label]
    assert "## Why RL moved or stalled\n" in md
    assert f"**{found['cause']}**: {found['reason']}." in md
    (entropy,) = _series(data, "why_policy", "learner/entropy", label)
    assert entropy["y"] == [r["learner/entropy"] for r in learner] and min(entropy["y"]) > 0
    (share,) = _series(data, "why_signal", "learner/informative_share", label)
    assert share["y"] == [informative_share(r) for r in learner]
    (val,) = _series(data, "why_success", "heldout/avg", label)
    assert val["x"] == [0, UPDATES] and val["y"] == [summary[f"success_{s}"]["avg"]
                                                    for s in ("warm", "rl")]
    # the validation probe: actor-0 probed at version 0, then once in each later block of
    # PROBE_EVERY versions it reached, and the plot draws every probe beside training success
    probes = [r for r in read_metrics(run_dir, "eval") if "eval/probe_success" in r]
    versions = [r["eval/version"] for r in probes]
    assert versions[0] == 0 and len(versions) >= 2, versions
    assert [v // PROBE_EVERY for v in versions] == sorted({v // PROBE_EVERY for v in versions})
    assert all(r["id"] == "actor-0" and r["eval/probe_tasks"] == 4 for r in probes)
    (probe,) = _series(data, "why_success", "eval/probe_success", label, "version")
    assert probe["x"] == versions and probe["y"] == [r["eval/probe_success"] for r in probes]
    assert not any("eval/probe_success" in m for m in data["missing"])
    # a series a run cannot have is named with the reason: no KL penalty, so no kl_ref
    assert any("learner/kl_ref" in m and "kl_coef=0" in m for m in data["missing"])
    password = (run_dir / "redis" / "password").read_text().strip()
    assert len(password) > 8 and password in (run_dir / "config.yaml").read_text()
    assert password not in md and password not in (out / "series.json").read_text()


def test_a_run_without_the_probe_says_why():
    line = Line("eval", "eval/probe_success", "version")
    off = Run(Path("off"), "off", config={"eval": {"probe_every": 0}})
    assert "eval.probe_every is 0" in missing_reason(off, line)
    older = Run(Path("older"), "older", config={"eval": {"num_tasks": 2}})
    assert "made before the validation probe" in missing_reason(older, line)
    on = Run(Path("on"), "on", config={"eval": {"probe_every": 4}})
    assert "not probed yet" in missing_reason(on, line)


def _variant(run_dir: Path, dest: Path) -> Path:
    """A second "run": the tiny run's files with the loss doubled, no judge and a changed lr."""
    dest.mkdir()
    lines = []
    for rec in read_metrics(run_dir):
        if rec["role"] == "judge":
            continue
        if "learner/loss" in rec:
            rec["learner/loss"] *= 2
        lines.append(json.dumps(rec))
    (dest / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(run_dir / "summary.json", dest / "summary.json")
    shutil.copy(run_dir / "config.yaml", dest / "config.yaml")
    text = (dest / "config.yaml").read_text().replace("lr: 0.0001", "lr: 0.0003", 1)
    (dest / "config.yaml").write_text(text)
    return dest


@pytest.mark.timeout(240)
def test_several_runs_overlay_on_one_plot_per_metric(run_dir, tmp_path):
    other = _variant(run_dir, tmp_path / "variant")
    out = tmp_path / "cmp"
    result = CliRunner().invoke(report, [str(run_dir), str(other), "--labels", "base,hot",
                                         "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads((out / "series.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["base", "hot"]
    assert sorted(p.name for p in out.glob("loss*.png")) == ["loss.png"]
    losses = _series(data, "loss", "learner/loss")
    assert [s["run"] for s in losses] == ["base", "hot"]
    assert losses[1]["y"] == [2 * y for y in losses[0]["y"]] and len(losses[0]["y"]) == UPDATES
    assert [s["run"] for s in _series(data, "throughput", "judge/groups_per_s")] == ["base"]
    assert any("judge/groups_per_s" in m and "'hot'" in m for m in data["missing"])
    md = (out / "report.md").read_text()
    assert "| | base | hot |" in md and "`learner.lr`" in md and "<summary>hot</summary>" in md
    # without --out: the first directory's report/compare/
    default = CliRunner().invoke(report, [str(run_dir), str(other)])
    assert default.exit_code == 0, default.output
    assert (run_dir / "report" / "compare" / "loss.png").exists()
    bad = CliRunner().invoke(report, [str(run_dir), str(other), "--labels", "only-one"])
    assert bad.exit_code == 2 and "--labels" in bad.output


def test_report_without_metrics_is_a_message(tmp_path):
    result = CliRunner().invoke(report, [str(tmp_path)])
    assert result.exit_code == 1 and "no metrics.jsonl" in result.output
    assert isinstance(result.exception, SystemExit)


# --- wandb (offline) -----------------------------------------------------------------------


def _wandb_records(path: Path):
    """Records of a ``.wandb`` transaction log (LevelDB-log framing of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _items(items) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.mark.timeout(240)
def test_wandb_offline_run_has_every_metric_config_and_group(run_dir):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed in this environment")
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    raw = path.read_bytes()
    password = (run_dir / "redis" / "password").read_text().strip()
    assert password.encode() not in raw
    records = list(_wandb_records(path))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.job_type, list(run.tags)) == ("tinygroup", "rl", ["files"])
    config = _items(run.config.update)
    assert config["redis"]["url"].startswith("unix://:***@")
    assert config["learner"]["batch_groups"] == 2
    history = [_items(r.history.item) for r in records
               if r.WhichOneof("record_type") == "history"]
    metrics = read_metrics(run_dir)
    assert len(history) == len(metrics)  # one wandb step per metrics record
    for rec in metrics:  # every metric of every role
        names = {k for k, v in rec.items() if "/" in k and v is not None}
        assert any(names <= set(h) for h in history), names
    logged = [h["learner/loss"] for h in history if "learner/loss" in h]
    assert logged == pytest.approx([r["learner/loss"] for r in metrics if "learner/loss" in r])
    # roles that log no step get their own record count as x-axis, not a constant 0
    replay_steps = [h["replay/step"] for h in history if "replay/groups" in h]
    assert replay_steps == list(range(1, len(replay_steps) + 1))
    assert all(h["learner/wall_s"] >= 0 for h in history if "learner/wall_s" in h)
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    # the launcher closes the mirror after the final evaluation: every stage is there
    result = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout/base_avg"] == result["success_base"]["avg"]
    assert summary["heldout/rl_avg"] == result["success_rl"]["avg"]
    assert "heldout/warm_avg" in summary


@pytest.mark.timeout(120)
def test_wandb_mirror_flushes_late_records_and_writes_the_summary(tmp_path):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed in this environment")
    from autodidact.tracking import WandbMirror
    from metrics.jsonl import MetricsTail, MetricsWriter

    config = {"name": "m", "redis": {"url": "redis://:hunter2secret@127.0.0.1:1/0"},
              "env": {"name": "files"}}
    mirror = WandbMirror(tmp_path, "offline", config, "m", group="arm-a")
    assert mirror.run is not None
    learner, judge = MetricsWriter(tmp_path, "learner"), MetricsWriter(tmp_path, "judge", "j0")
    learner.log({"loss": 0.5, "updates": 1}, step=1)
    judge.log({"groups_per_s": 2.0})
    tail = MetricsTail(tmp_path)
    mirror.sync(tail.read_new())
    judge.log({"groups_per_s": 3.0})  # logged while the roles stop: after the last sync
    mirror.close({"success_base": {"avg": 0.25}, "success_rl": {"avg": 0.75, "greedy": 0.5},
                  "restarts": {"learner": 1, "redis": 0}})
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert b"hunter2secret" not in path.read_bytes()
    records = list(_wandb_records(path))
    history = [_items(r.history.item) for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [h.get("judge/groups_per_s") for h in history] == [None, 2.0, 3.0]
    assert [h["judge/step"] for h in history if "judge/groups_per_s" in h] == [1, 2]
    assert history[0]["learner/step"] == 1 and history[0]["learner/loss"] == 0.5
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "arm-a" and run.job_type == "rl"
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert (summary["heldout/base_avg"], summary["heldout/rl_avg"],
            summary["heldout/rl_greedy"]) == (0.25, 0.75, 0.5)
    assert (summary["restarts/learner"], summary["restarts/total"]) == (1, 1)


@pytest.mark.timeout(120)
def test_a_resumed_run_does_not_mirror_its_old_records_again(tmp_path):
    """``autodidact run --resume`` reads metrics.jsonl from its start again; the wandb run (the
    same id) gets only the records it has not had, with the x-axes carrying on."""
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed in this environment")
    from autodidact.tracking import WandbMirror
    from metrics.jsonl import MetricsTail, MetricsWriter

    config = {"name": "r", "env": {"name": "files"}}
    judge = MetricsWriter(tmp_path, "judge", "j0")
    first = WandbMirror(tmp_path, "offline", config, "r")
    for value in (1.0, 2.0):
        judge.log({"groups_per_s": value})
    first.sync(MetricsTail(tmp_path).read_new())
    first.close({})
    judge.log({"groups_per_s": 3.0})  # after the restart
    time.sleep(1.1)  # wandb names an offline run by the second it starts: two distinct folders
    second = WandbMirror(tmp_path, "offline", config, "r")
    second.sync(MetricsTail(tmp_path).read_new())  # the whole file, as the launcher's tail does
    second.close({})
    histories = []
    for path in sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb")):
        histories.append([_items(r.history.item) for r in _wandb_records(path)
                          if r.WhichOneof("record_type") == "history"])
    assert len(histories) == 2
    assert [h["judge/groups_per_s"] for h in histories[0]] == [1.0, 2.0]
    assert [(h["judge/groups_per_s"], h["judge/step"]) for h in histories[1]] == [(3.0, 3)]


@pytest.mark.timeout(240)
def test_a_finished_run_looks_at_test_once_later(run_dir, tmp_path):
    """``autodidact eval --final-test``: a run made without --final-test gets its one look at
    test afterwards, with its own settings, as --final-test would have made it; a second look
    is refused."""
    from autodidact.cli import main
    from environments import FilesEnv
    from protocol.run_dir import RunDir

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("*.sock", "*.lock"))
    rd = RunDir(copy)
    before = json.loads(rd.summary.read_text())
    assert "test" not in before and before["looked_at_test"] is False
    result = CliRunner().invoke(main, ["eval", "--final-test", "--run-dir", str(copy)])
    assert result.exit_code == 0, (result.output, result.exception)
    summary = json.loads(rd.summary.read_text())
    assert summary["looked_at_test"] is True and set(summary["test"]) == {"base", "warm", "rl"}
    test_ids = {t.task_id for t in FilesEnv().tasks("test")}
    for stage, found in summary["test"].items():
        # the run's own settings: eval.num_tasks=2, eval.k=1 (test_status.TINY_SETS)
        assert found["split"] == "test" and found["tasks"] == 2, (stage, found)
        lines = rd.heldout_records("test", stage).read_text().splitlines()
        assert len(lines) == 2 and {json.loads(x)["task_id"] for x in lines} <= test_ids
        assert all(len(json.loads(x)["rewards"]) == 1 for x in lines)
        assert f"test {stage}: avg@1 " in result.output
    # warmstart.steps=0: the warm-start stage is the base model, measured once
    looks = [json.loads(x) for x in rd.test_looks.read_text().splitlines()]
    assert [(x["stage"], x["who"]) for x in looks] == \
        [("base", "autodidact eval --final-test"), ("rl", "autodidact eval --final-test")]
    assert summary["success_rl"] == before["success_rl"]  # the run's own numbers untouched
    again = CliRunner().invoke(main, ["eval", "--final-test", "--run-dir", str(copy)])
    assert again.exit_code == 1 and "looked at test 2 time(s) already" in again.output
    unfinished = CliRunner().invoke(main, ["eval", "--final-test", "--run-dir", str(tmp_path)])
    assert unfinished.exit_code == 2 and "no config.yaml" in unfinished.output
