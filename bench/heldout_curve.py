"""Held-out success along a run, from the weight versions it kept: a learning curve per run,
and the updates each group of runs needs to reach a held-out level.

    python bench/heldout_curve.py --versions 5,10 \
        --group outcome=runs/abl-smollm2/questioning-s0,runs/abl-smollm2/questioning-s1 \
        --group attribution=runs/abl-smollm2/questioning-attributing-s0,... \
        [--level 0.55] [--json docs/attribution_smollm2.json] [--plot docs/attribution_smollm2.png]

A run keeps its published versions when made with ``weights.keep`` at least its updates
(``autodidact ablation`` passes it). Each asked version is merged into the run's warm-started
policy and evaluated with ``autodidact eval`` on the run's own held-out tasks (its config: the
same tasks, k and temperature as the run's evaluations), kept in ``RUN/heldout_curve.json`` so
a second call evaluates only what is missing. Version 0 and the last version are the run's own
evaluations after warm-start and after RL (``summary.json``).

The level defaults to the first group's mean final held-out success; the updates to reach it
are read off each run's curve by linear interpolation between evaluated versions (None when a
run never reaches it), and the ratio of the groups' means is the data efficiency.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol.config import load_config  # noqa: E402
from protocol.run_dir import RunDir  # noqa: E402


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
        return json.loads(out.with_suffix(".summary.json").read_text())["avg"]


def curve(run_dir: Path, versions: list[int]) -> dict[int, float]:
    """Held-out avg@k per version: the run's own points plus ``versions``, cached."""
    cache_path = run_dir / "heldout_curve.json"
    cache = {int(v): s for v, s in json.loads(cache_path.read_text()).items()} \
        if cache_path.exists() else {}
    points = run_points(run_dir)
    last = max(points, default=0)
    for v in versions:
        if v in points or v >= last and last:
            continue
        if v not in cache:
            print(f"[heldout] {run_dir.name}: evaluating version {v}", flush=True)
            cache[v] = evaluate_version(run_dir, v)
            cache_path.write_text(json.dumps(cache, indent=1))
        points[v] = cache[v]
    return dict(sorted(points.items()))


def updates_to_reach(points: dict[int, float], level: float) -> float | None:
    """The first update at which the piecewise-linear curve reaches ``level``."""
    items = sorted(points.items())
    for (v0, s0), (v1, s1) in zip(items, items[1:]):
        if s0 >= level:
            return float(v0)
        if s1 >= level:
            return v0 + (v1 - v0) * (level - s0) / (s1 - s0)
    return float(items[-1][0]) if items and items[-1][1] >= level else None


def compare(groups: dict[str, list[Path]], versions: list[int],
            level: float | None) -> dict:
    curves = {name: {str(d): curve(d, versions) for d in dirs} for name, dirs in groups.items()}
    first = next(iter(curves.values()))
    if level is None:
        level = float(np.mean([c[max(c)] for c in first.values()]))
    reach = {name: {run: updates_to_reach(c, level) for run, c in cs.items()}
             for name, cs in curves.items()}
    return {"level": level, "curves": curves, "updates_to_level": reach}


def show(result: dict) -> str:
    lines = [f"held-out level: {result['level']:.1%}"]
    for name, cs in result["curves"].items():
        for run, c in cs.items():
            reach = result["updates_to_level"][name][run]
            pts = "  ".join(f"v{v}:{s:.1%}" for v, s in c.items())
            lines.append(f"  {name:12s} {Path(run).name:32s} {pts}   reaches it at "
                         f"{'never' if reach is None else f'{reach:.1f}'}")
    means = {}
    for name, reach in result["updates_to_level"].items():
        got = [r for r in reach.values() if r is not None]
        means[name] = float(np.mean(got)) if got else None
        lines.append(f"  {name}: reached by {len(got)}/{len(reach)} runs, mean updates "
                     f"{'–' if not got else f'{means[name]:.1f}'}")
    names = list(means)
    if len(names) == 2 and all(means[n] for n in names):
        lines.append(f"  {names[0]} / {names[1]} updates to the level: "
                     f"{means[names[0]] / means[names[1]]:.2f}x")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """One line per run (a colour per group), the group's mean at the versions every run of it
    has, and the level as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for colour, (name, cs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"],
                                  result["curves"].items()):
        for c in cs.values():
            vs = sorted(c)
            ax.plot(vs, [100 * c[v] for v in vs], color=colour, alpha=0.35, marker=".")
        shared = sorted(set.intersection(*(set(c) for c in cs.values())))
        ax.plot(shared, [100 * np.mean([c[v] for c in cs.values()]) for v in shared],
                color=colour, linewidth=2.5, marker="o", label=f"{name} (mean of {len(cs)})")
    ax.axhline(100 * result["level"], color="grey", linestyle="--", linewidth=1, label="level")
    ax.set_xlabel("RL update (weight version)")
    ax.set_ylabel("held-out success, avg@k (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", action="append", required=True, metavar="NAME=DIR,DIR",
                    help="a named group of run directories (repeatable)")
    ap.add_argument("--versions", default="", help="extra versions to evaluate, e.g. 5,10")
    ap.add_argument("--level", type=float, default=None,
                    help="held-out avg@k to reach (default: the first group's mean final)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="also draw the curves here (png)")
    args = ap.parse_args()
    groups = {}
    for text in args.group:
        name, _, dirs = text.partition("=")
        groups[name] = [Path(d) for d in dirs.split(",") if d]
    versions = [int(v) for v in args.versions.split(",") if v]
    result = compare(groups, versions, args.level)
    print(show(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        print(f"plot: {plot(result, args.plot)}")


if __name__ == "__main__":
    main()
