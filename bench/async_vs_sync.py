"""Asynchronous vs synchronous RL on the same processes, model, environment and updates.

Both modes run the real system (`autodidact run`: private Redis, replay server, 2 actors, the
learner) from the same warm-started model for the same number of updates:

- **sync**: ``learner.max_staleness=0``. Actors may run only ``batch_groups`` groups ahead of
  the learner's version, so they collect a full batch, then wait while the learner trains and
  broadcasts, then collect the next one: the synchronous loop of AgentEvolver/veRL.
- **async**: ``learner.max_staleness=S`` (default 4). Actors keep rolling out while the learner
  trains, bounded by the staleness invariant; the decoupled loss corrects the lag.

Wall time is measured on the RL phase only (first to last learner update in metrics.jsonl), so
model set-up and evaluation are excluded from both. Usage::

    .venv/bin/python bench/async_vs_sync.py [--updates 40] [--staleness 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from metrics.jsonl import read_metrics  # noqa: E402


def run_mode(name: str, root: Path, seed_dir: Path, updates: int, staleness: int,
             extra: list[str]) -> dict:
    run_dir = root / name
    run_dir.mkdir()
    for part in ("model", "policy_init"):  # the same starting weights for both modes
        shutil.copytree(seed_dir / part, run_dir / part)
    sets = ["eval.num_tasks=0", "tracking.wandb=disabled", f"learner.max_staleness={staleness}",
            f"learner.max_updates={updates}", "learner.max_minutes=30", *extra]
    cmd = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=open(run_dir / "launcher.log", "w"))
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    wall = rows[-1]["t"] - rows[0]["t"]
    trajectories = sum(r["learner/groups"] for r in rows[1:]) * _group_size(run_dir)
    return {"mode": name, "updates": len(rows), "wall_s": wall,
            "samples_per_s": trajectories / wall,
            "lag_mean": sum(r["learner/lag_mean"] for r in rows) / len(rows),
            "reward_last10": sum(r["learner/reward"] for r in rows[-10:]) / min(10, len(rows))}


def _group_size(run_dir: Path) -> int:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["actor"]["group_size"]


def make_seed(root: Path, extra: list[str]) -> Path:
    """Make the tiny model and its warm-start once (a zero-update run)."""
    seed_dir = root / "seed"
    cmd = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(seed_dir),
           "--set", "eval.num_tasks=0", "--set", "tracking.wandb=disabled",
           "--set", "learner.max_updates=1", *sum((["--set", s] for s in extra), [])]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return seed_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=40)
    ap.add_argument("--staleness", type=int, default=4)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="extra config overrides for both modes")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    try:
        seed_dir = make_seed(root, args.sets)
        results = [run_mode("sync", root, seed_dir, args.updates, 0, args.sets),
                   run_mode("async", root, seed_dir, args.updates, args.staleness, args.sets)]
    finally:
        if not os.environ.get("KEEP_BENCH"):
            shutil.rmtree(root, ignore_errors=True)
    for r in results:
        print(f"{r['mode']:>5}: {r['updates']} updates in {r['wall_s']:6.1f}s  "
              f"{r['samples_per_s']:7.1f} samples/s  lag {r['lag_mean']:.2f}  "
              f"reward(last 10) {r['reward_last10']:.3f}")
    sync, asyn = results
    print(f"async/sync speed-up: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}x "
          f"(wall {sync['wall_s'] / asyn['wall_s']:.2f}x)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
