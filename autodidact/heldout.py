"""Held-out success along a run, from the weight versions it kept: the points of a learning
curve, for ``autodidact ablation --curve-versions`` and ``bench/heldout_curve.py``.

A run keeps its published versions when made with ``weights.keep`` at least its updates. Each
asked version is merged into the run's warm-started policy and evaluated with ``autodidact
eval`` on the run's own held-out tasks (its config: the same tasks, k and temperature as the
run's evaluations), kept in ``RUN/heldout_curve.json`` so a second call evaluates only what is
missing, with its per-task records in ``RUN/eval/`` (the version named as the policy), so each
point has a 95% interval (:func:`curve_intervals`). Version 0 and the last version are the
run's own evaluations after warm-start and after RL (``summary.json``).

The per-task records of held-out evaluations (one JSON line per task with ``task_id`` and the
k ``rewards``: ``autodidact eval --out`` and a run's own ``eval/heldout-<split>-<stage>.jsonl``)
are read here too (:func:`read_records`, :func:`run_records`): paired intervals
(``metrics/intervals.py``) are taken from them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from metrics.intervals import rate_interval
from protocol.config import load_config
from protocol.run_dir import HELD_OUT_STAGES, RunDir

ROOT = Path(__file__).resolve().parents[1]


def read_records(path: Path) -> dict[str, list[float]]:
    """``{task_id: rewards}`` from a file of per-task records; ValueError naming the file and
    line of anything else (a summary passed instead, a line cut short)."""
    rows = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows[row["task_id"]] = [float(r) for r in row["rewards"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a per-task record of a held-out evaluation "
                             f"({exc}); pass the .jsonl, not its summary") from None
    if not rows:
        raise ValueError(f"{path}: no per-task records")
    return rows


def run_records(run_dir: Path, split: str) -> dict[str, dict[str, list[float]]]:
    """The run's own held-out evaluations on ``split`` that kept per-task records, by stage
    (``base``, ``warm``, ``rl``; a run made before records were kept has none)."""
    rd = RunDir(run_dir)
    return {stage: read_records(rd.heldout_records(split, stage)) for stage in HELD_OUT_STAGES
            if rd.heldout_records(split, stage).exists()}


def run_points(run_dir: Path) -> dict[int, float]:
    """Held-out avg@k after warm-start (version 0) and after RL (the last version)."""
    summary = json.loads(RunDir(run_dir).summary.read_text())
    last = int((summary.get("learner") or {}).get("learner/version", 0))
    points = {}
    if summary.get("success_warm"):
        points[0] = summary["success_warm"]["avg"]
    if summary.get("success_rl") and last:
        points[last] = summary["success_rl"]["avg"]
    return points


def evaluate_version(run_dir: Path, version: int) -> float:
    """avg@k of published ``version`` merged into the run's warm-start, on the run's held-out
    tasks (a subprocess: ``autodidact eval`` picks the engine's interpreter itself)."""
    from autodidact.stages import resumed_policy, save_published

    rd = RunDir(run_dir)
    weights = rd.weights_file(version)
    if not weights.exists():
        kept = [p.name for p in rd.published_weights()]
        raise SystemExit(f"{run_dir}: version {version} was not kept (kept: "
                         f"{kept or 'none'}); make the run with weights.keep >= its updates")
    cfg = load_config(rd.config)
    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        # the policy RL started from: the warm-start, or the base without one
        init = resumed_policy(cfg, run_dir, cfg.model.path)
        model = save_published(init, weights, Path(tmp) / "policy")
        out = Path(tmp) / "eval.jsonl"
        subprocess.run([sys.executable, "-m", "autodidact.cli", "eval", "-c", str(rd.config),
                        "--model", str(model), "-k", str(cfg.eval.k),
                        "--limit", str(cfg.eval.num_tasks), "--run-dir", str(Path(tmp) / "run"),
                        "--out", str(out)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        summary = json.loads(out.with_suffix(".summary.json").read_text())
        kept = version_records_path(run_dir, version, summary["split"])
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, kept)  # the version's per-task records: its interval
        return summary["avg"]


def version_records_path(run_dir: Path, version: int, split: str) -> Path:
    """Where an evaluated weight version's per-task records are kept: ``autodidact eval``'s
    file of the run's env, ``split`` and k, the version named as its policy."""
    cfg = load_config(RunDir(run_dir).config)
    return RunDir(run_dir).eval_results(cfg.env.label(), split, f"version-{version}",
                                        cfg.eval.k)


def curve_intervals(run_dir: Path, points: dict[int, float]) -> dict[int, list[float]]:
    """The 95% interval of every point of ``points`` (a curve of the run) whose per-task
    records were kept: version 0 and the last from the run's own evaluations, the others from
    :func:`evaluate_version`'s files (none for a run made before records were kept)."""
    summary = json.loads(RunDir(run_dir).summary.read_text())
    split = (summary.get("success_rl") or {}).get("split")
    if not split or not points:
        return {}
    own = run_records(run_dir, split)
    found = {0: own.get("warm"), max(points): own.get("rl")}
    for version in points:
        path = version_records_path(run_dir, version, split)
        if version not in found and path.exists():
            found[version] = read_records(path)
    return {v: list(rate_interval(list(records.values())))
            for v, records in sorted(found.items()) if records and v in points}


def curve(run_dir: Path, versions: list[int], evaluate: bool = True) -> dict[int, float]:
    """Held-out avg@k per version: the run's own points plus ``versions``, cached (with
    ``evaluate`` false, only the versions already in the cache)."""
    cache_path = run_dir / "heldout_curve.json"
    cache = {int(v): s for v, s in json.loads(cache_path.read_text()).items()} \
        if cache_path.exists() else {}
    points = run_points(run_dir)
    last = max(points, default=0)
    for v in versions:
        if v in points or v >= last and last:
            continue
        if v not in cache:
            if not evaluate:
                continue
            print(f"[heldout] {run_dir.name}: evaluating version {v}", flush=True)
            cache[v] = evaluate_version(run_dir, v)
            cache_path.write_text(json.dumps(cache, indent=1))
        points[v] = cache[v]
    return dict(sorted(points.items()))
