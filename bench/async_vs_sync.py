"""Asynchronous vs synchronous RL on the same processes, model, environment and updates.

Both modes run the real system (`autodidact run`: private Redis, replay server, 2 actors, the
learner) from the same warm-started model for the same number of updates:

- **sync**: ``learner.max_staleness=0``. Actors may run only ``batch_groups`` groups ahead of
  the learner's version, so they collect a full batch, then wait while the learner trains and
  broadcasts, then collect the next one: the synchronous loop of AgentEvolver/veRL.
- **async**: ``learner.max_staleness=S`` (default 4). Actors keep rolling out while the learner
  trains, bounded by the staleness invariant; the decoupled loss corrects the lag.

Wall time is measured on the RL phase only (first to last learner update in metrics.jsonl), so
model set-up and evaluation are excluded from both. With ``--eval-tasks N`` each mode ends with
the held-out evaluation of the config (N tasks), so the two are also compared on what their
updates bought: each rate with its 95% interval, and async − sync with its paired interval and
the label read off it (the same tasks; ``metrics/intervals.py``). Each mode's busy time is
read back too: the actors' seconds rolling out and the learner's seconds stepping, whose sum
over max bounds what overlapping them can gain. Usage::

    .venv/bin/python -m bench.async_vs_sync [--updates 40] [--staleness 4]
    .venv/bin/python -m bench.async_vs_sync -c configs/smollm2.yaml --updates 12 \
        --init runs/abl-smollm2/warmstart/s0-plain --eval-tasks 40 --out runs/async-smollm2

``--curve-versions 4,8`` (with ``--eval-tasks`` and ``--set weights.keep=N`` ≥ the updates, so
the versions are kept) also evaluates those versions of each mode (``bench/heldout_curve.py``)
and reports the seconds each mode took to reach the sync run's final held-out success, on the
same clock as the wall time (from the first update; reached before it counts as 0 s).

``--init DIR`` starts both modes from ``DIR/policy_init`` (a warm-start made before) instead of
making one; ``--out`` keeps the runs there, and a mode whose run finished with the same
settings is read back instead of run again.
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

import numpy as np

from bench.output import command_line, write_result
from metrics.intervals import format_rate
from metrics.jsonl import read_metrics

ROOT = Path(__file__).resolve().parents[1]
NO_CI = (float("nan"), float("nan"))  # a run made before held-out intervals were kept


def run_mode(name: str, root: Path, seed_dir: Path, updates: int, staleness: int,
             extra: list[str], config: Path | None = None, eval_tasks: int = 0) -> dict:
    run_dir = root / name
    sets = [f"eval.num_tasks={eval_tasks}", "eval.before_rl=false", "tracking.wandb=disabled",
            f"learner.max_staleness={staleness}", f"learner.max_updates={updates}",
            "learner.max_minutes=60", *extra]
    cmd = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(run_dir)]
    cmd += ["-c", str(config)] if config else []
    for s in sets:
        cmd += ["--set", s]
    stamp = run_dir / "bench_argv.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == cmd[1:]
            and (run_dir / "summary.json").exists()):
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        for part in ("model", "policy_init"):  # the same starting weights for both modes
            if (seed_dir / part).exists():
                shutil.copytree(seed_dir / part, run_dir / part)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=open(run_dir / "launcher.log", "w"))
        stamp.write_text(json.dumps(cmd[1:]))
    return measure(name, run_dir)


def measure(name: str, run_dir: Path) -> dict:
    """What one mode's run did: RL wall time, throughput, lag, busy time per role, held-out."""
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    wall = rows[-1]["t"] - rows[0]["t"]
    trajectories = sum(r["learner/groups"] for r in rows[1:]) * _group_size(run_dir)
    # Busy time inside the measured span (after the first update), per role.
    actor = [r for r in read_metrics(run_dir, "actor")
             if "actor/rollout_s" in r and rows[0]["t"] < r["t"] <= rows[-1]["t"]]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"mode": name, "updates": len(rows), "wall_s": wall,
            "samples_per_s": trajectories / wall,
            "lag_mean": sum(r["learner/lag_mean"] for r in rows) / len(rows),
            "reward_last10": sum(r["learner/reward"] for r in rows[-10:]) / min(10, len(rows)),
            "learner_step_s": sum(r["learner/step_s"] for r in rows[1:]),
            "learner_idle_s": sum(r["learner/idle_s"] for r in rows[1:]),
            "actor_rollout_s": sum(r["actor/rollout_s"] for r in actor),
            "actor_idle_s": sum(r["actor/idle_s"] for r in actor),
            "held_out": summary.get("success_rl"), "warm": summary.get("success_warm"),
            # per update: where the learner's time went (the plot shows the cores' contention)
            "step_s_each": [r["learner/step_s"] for r in rows],
            "idle_s_each": [r["learner/idle_s"] for r in rows],
            # the wall time's clock at each published version, for the time to a success
            "seconds_at_versions": {int(r["learner/version"]): r["t"] - rows[0]["t"]
                                    for r in rows}}


def seconds_to_level(points: dict[int, float], seconds: dict[int, float],
                     level: float) -> float | None:
    """When a mode's held-out curve first reaches ``level``, in seconds on ``seconds``' clock:
    the (fractional) update read off the curve, then the time at that update interpolated."""
    from bench.heldout_curve import updates_to_reach

    update = updates_to_reach(points, level)
    if update is None:
        return None
    versions = sorted(seconds)
    return float(np.interp(update, versions, [seconds[v] for v in versions]))


def time_to_level(results: list[dict], root: Path, versions: list[int]) -> dict:
    """Each mode's held-out curve and its seconds to the sync run's final held-out success."""
    from autodidact.heldout import curve

    level = results[0]["held_out"]["avg"]
    out = {"level": level, "modes": {}}
    for r in results:
        points = curve(root / r["mode"], versions)
        out["modes"][r["mode"]] = {
            "curve": points,
            "seconds_to_level": seconds_to_level(points, r["seconds_at_versions"], level)}
    return out


def plot(results: list[dict], reached: dict | None, path: Path) -> Path:
    """Left: the learner's seconds per update, stepping and waiting for data, per mode.
    Right (with a curve): held-out success against seconds from the first update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if reached else 1, figsize=(11 if reached else 6, 4.3),
                             squeeze=False)
    ax = axes[0][0]
    for r, colour in zip(results, ("tab:blue", "tab:orange")):
        updates = range(1, len(r["step_s_each"]) + 1)
        ax.plot(updates, r["step_s_each"], color=colour, marker="o", label=f"{r['mode']}: stepping")
        ax.plot(updates, r["idle_s_each"], color=colour, linestyle=":", marker=".",
                label=f"{r['mode']}: waiting for data")
    ax.set_xlabel("learner update")
    ax.set_ylabel("seconds")
    ax.set_title("the learner's time per update")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if reached:
        ax = axes[0][1]
        for r, colour in zip(results, ("tab:blue", "tab:orange")):
            points = reached["modes"][r["mode"]]["curve"]
            vs = sorted(points)
            ax.plot([r["seconds_at_versions"].get(v, 0.0) for v in vs],
                    [100 * points[v] for v in vs], color=colour, marker="o", label=r["mode"])
        ax.axhline(100 * reached["level"], color="grey", linestyle="--", linewidth=1,
                   label="sync's final held-out")
        ax.set_xlabel("seconds from the first update (version 0 drawn at 0)")
        ax.set_ylabel("held-out success, avg@k (%)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _group_size(run_dir: Path) -> int:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["actor"]["group_size"]


def make_seed(root: Path, extra: list[str], config: Path | None = None) -> Path:
    """Make the model and its warm-start once (a one-update run)."""
    seed_dir = root / "seed"
    cmd = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(seed_dir),
           *(["-c", str(config)] if config else []),
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
    ap.add_argument("-c", "--config", type=Path, default=None,
                    help="config both modes start from (default: the embedded defaults)")
    ap.add_argument("--init", type=Path, default=None,
                    help="a run directory whose policy_init/ both modes start from")
    ap.add_argument("--eval-tasks", type=int, default=0,
                    help="held-out tasks each mode is evaluated on at the end (0: none)")
    ap.add_argument("--out", type=Path, default=None,
                    help="keep the runs here (and reuse finished ones); default a temp dir")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--async-set", dest="async_sets", action="append", default=[],
                    help="overrides for the async mode only, e.g. learner.torch_threads=1 to "
                         "split the cores between the roles instead of oversubscribing them")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the modes here (png)")
    ap.add_argument("--curve-versions", default="",
                    help="versions of each mode to evaluate for the time to the same held-out "
                         "success, e.g. 4,8 (needs --eval-tasks and weights.keep)")
    args = ap.parse_args()
    versions = [int(v) for v in args.curve_versions.split(",") if v]
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-async-"))
    try:
        seed_dir = args.init or make_seed(root, args.sets, args.config)
        results = [run_mode(mode, root, seed_dir, args.updates, staleness, args.sets + extra,
                            args.config, args.eval_tasks)
                   for mode, staleness, extra in (("sync", 0, []),
                                                  ("async", args.staleness, args.async_sets))]
        reached = time_to_level(results, root, versions) if versions else None
        change = held_out_change(root) if args.eval_tasks else None
    finally:
        if args.out is None and not os.environ.get("KEEP_BENCH"):
            shutil.rmtree(root, ignore_errors=True)
    print(report(results, reached, change))
    if args.json:
        write_result({"command": command_line("bench.async_vs_sync", None), "modes": results,
                      "time_to_level": reached, "held_out_change": change}, args.json)
    if args.plot:
        print(f"plot: {plot(results, reached, args.plot)}")


def held_out_change(root: Path) -> dict:
    """async − sync held-out avg@k after RL: the same config and seed evaluate the same tasks,
    so the interval is paired task by task where both runs kept per-task records."""
    from autodidact.experiments.arms import read_result
    from autodidact.experiments.page import change_over_seeds

    sync, asyn = (read_result(mode, 0, root / mode) for mode in ("sync", "async"))
    return change_over_seeds([(sync, asyn)])


def report(results: list[dict], reached: dict | None = None,
           change: dict | None = None) -> str:
    from autodidact.experiments.page import change_text

    lines = []
    for r in results:
        held = r["held_out"]
        held_text = (f"  held-out avg {format_rate(held['avg'], held.get('avg_ci', NO_CI))}"
                     if held else "")
        lines.append(
            f"{r['mode']:>5}: {r['updates']} updates in {r['wall_s']:6.1f}s  "
            f"{r['samples_per_s']:7.2f} samples/s  lag {r['lag_mean']:.2f}  reward(last 10) "
            f"{r['reward_last10']:.3f}  busy: actors {r['actor_rollout_s']:.0f}s, learner "
            f"{r['learner_step_s']:.0f}s{held_text}")
    sync, asyn = results
    lines.append(f"async/sync speed-up: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}x "
                 f"(wall {sync['wall_s'] / asyn['wall_s']:.2f}x)")
    # Perfect overlap of rolling out and training, with neither slowed by the other, makes a
    # synchronous update's time (A + L) into max(A, L); on shared cores it is less than that.
    a, lrn = sync["actor_rollout_s"], sync["learner_step_s"]
    if a and lrn:
        lines.append(f"overlap bound from the sync run's busy times: (A + L) / max(A, L) = "
                     f"({a:.0f} + {lrn:.0f}) / {max(a, lrn):.0f} = {(a + lrn) / max(a, lrn):.2f}x")
    if change:
        lines.append(f"async − sync held-out avg after RL: {change_text(change)}: "
                     f"{change['label']}")
    if reached:
        lines.append(report_time_to_level(reached))
    return "\n".join(lines)


def report_time_to_level(reached: dict) -> str:
    lines = [f"time to the sync run's final held-out success ({reached['level']:.1%}):"]
    for mode, r in reached["modes"].items():
        pts = "  ".join(f"v{v}:{s:.1%}" for v, s in sorted(r["curve"].items()))
        when = r["seconds_to_level"]
        lines.append(f"  {mode:>5}: {pts}   reached at "
                     f"{'never' if when is None else f'{when:.0f}s'}")
    sync, asyn = (reached["modes"][m]["seconds_to_level"] for m in ("sync", "async"))
    if sync and asyn:
        lines.append(f"  sync/async time to that success: {sync / asyn:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
