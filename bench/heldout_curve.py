"""Held-out success along a run, from the weight versions it kept: a learning curve per run,
and the updates each group of runs needs to reach a held-out level.

    python -m bench.heldout_curve --versions 5,10 \
        --group outcome=runs/abl-smollm2/questioning-s0,runs/abl-smollm2/questioning-s1 \
        --group attribution=runs/abl-smollm2/questioning-attributing-s0,... \
        [--level 0.55] [--json docs/results/attribution_smollm2.json] \
        [--plot docs/results/attribution_smollm2.png]

    python -m bench.heldout_curve --ablation docs/results/ablation_smollm2.json \
        --group grpo=+questioning --group reference=+questioning+attributing ...

The first form evaluates the asked versions of run directories (``autodidact/heldout.py``;
kept in each run, so asking again costs nothing). The second reads the curves an ablation
recorded with ``--curve-versions`` in its json, one group per arm, all seeds: the run
directories need not exist any more.

The level defaults to the first group's mean final held-out success; the updates to reach it
are read off each run's curve by linear interpolation between evaluated versions (None when a
run never reaches it), and the ratio of the groups' means is the data efficiency.

Every point whose per-task records were kept (the run's own evaluations, and versions evaluated
since records are kept; in an ablation's json, version 0 and the last) is printed with its 95%
interval (``metrics/intervals.py``). The updates to a level and their ratios carry none: they
are read off noisy crossings, so read them beside the paired gains below.

With --ablation the runs are paired by seed: a seed's arms share one warm-start, and the seeds'
warm-starts differ by more than RL moves them (30.5, 39.5, 41.0% on SmolLM2), so one level for
all seeds would be reached at version 0 by some and never by others. Each seed gets its own
level instead, the first group's final success on that seed (or --level above the seed's
version 0 with --gain), and the data efficiency is the first group's updates over each other
group's, seed by seed. The plot then draws the change since the warm-start. Each group's mean
gain over its start is compared with the first group's seed by seed: the difference with its
95% t-interval over the seeds (only per-seed numbers exist) and the label read off it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from autodidact.experiments.arms import Records, recorded_result
from autodidact.heldout import curve, curve_intervals
from metrics.intervals import effect_label, format_diff, rate_interval, seed_paired_interval


def updates_to_reach(points: dict[int, float], level: float) -> float | None:
    """The first update at which the piecewise-linear curve reaches ``level``."""
    items = sorted(points.items())
    for (v0, s0), (v1, s1) in zip(items, items[1:]):
        if s0 >= level:
            return float(v0)
        if s1 >= level:
            return v0 + (v1 - v0) * (level - s0) / (s1 - s0)
    return float(items[-1][0]) if items and items[-1][1] >= level else None


def run_curves(groups: dict[str, list[Path]], versions: list[int]) -> dict:
    """``{group: {run dir: {version: avg@k}}}`` evaluated from the run directories."""
    return {name: {str(d): curve(d, versions) for d in dirs} for name, dirs in groups.items()}


def run_intervals(curves: dict) -> dict:
    """``{group: {run dir: {version: [low, high]}}}``: the 95% interval of every point of
    :func:`run_curves` whose per-task records the run kept."""
    return {name: {run: curve_intervals(Path(run), points) for run, points in cs.items()}
            for name, cs in curves.items()}


def ablation_curves(path: Path, groups: dict[str, str]) -> tuple[dict, dict]:
    """``{group: {"seed S": {version: avg@k}}}`` from an ablation's json, whose runs carry
    the curves ``--curve-versions`` recorded; a group is one arm, over every seed that has one.
    With it, the intervals of version 0 and the last, from the cells' per-task outcomes where
    the json kept them (``{group: {"seed S": {version: [low, high]}}}``)."""
    runs = list(Records(path).by_cell.values())  # "runs" and "other_records" alike
    curves, intervals = {}, {}
    for name, arm in groups.items():
        cells = [recorded_result(r) for r in runs if r["arm"] == arm and r.get("curve")]
        if not cells:
            raise SystemExit(f"{path}: no run of the arm {arm!r} recorded a curve; run the "
                             "ablation with --curve-versions (arms: "
                             f"{sorted({r['arm'] for r in runs})})")
        curves[name] = {f"seed {c.seed}": c.curve for c in cells}
        intervals[name] = {f"seed {c.seed}": ends_intervals(c) for c in cells}
    return curves, intervals


def ends_intervals(cell) -> dict[int, list[float]]:
    """The intervals of a recorded cell's version 0 (after warm-start) and last version (after
    RL), from its per-task outcomes; none where the cell kept none."""
    ends = {min(cell.curve): cell.per_task("warm"), max(cell.curve): cell.per_task("final")}
    return {v: list(rate_interval(list(tasks.values()))) for v, tasks in ends.items() if tasks}


def compare(curves: dict, level: float | None, paired: bool = False,
            gain: float | None = None) -> dict:
    """The level and the updates each run's curve needs to reach it: one level for every run,
    by default the first group's mean final success; or, ``paired``, as :func:`compare_paired`."""
    if paired:
        return compare_paired(curves, level, gain)
    if level is None:
        level = float(np.mean([c[max(c)] for c in next(iter(curves.values())).values()]))
    reach = {name: {run: updates_to_reach(c, level) for run, c in cs.items()}
             for name, cs in curves.items()}
    return {"level": level, "curves": curves, "updates_to_level": reach}


def compare_paired(curves: dict, level: float | None, gain: float | None) -> dict:
    """Runs keyed alike in every group (by seed), only the keys every group has: a level per
    key (``level``, else the key's version-0 success plus ``gain``, else the first group's
    final success on it), the updates to reach it, each group's ratio to the first group per
    key, and each run's mean gain over its start."""
    common = set.intersection(*(set(cs) for cs in curves.values()))
    left_out = sorted(set().union(*curves.values()) - common)
    curves = {name: {k: c for k, c in cs.items() if k in common} for name, cs in curves.items()}
    first = next(iter(curves.values()))
    levels = {key: level if level is not None
              else c[min(c)] + gain if gain is not None else c[max(c)]
              for key, c in first.items()}
    reach = {name: {key: updates_to_reach(c, levels[key]) for key, c in cs.items()}
             for name, cs in curves.items()}
    base = reach[next(iter(curves))]
    ratio = {name: {key: base[key] / got for key, got in r.items() if got and base[key]}
             for name, r in reach.items()}
    # The area under the curve above its start: less at the mercy of one noisy evaluation
    # than the first crossing of a level.
    mean_gain = {name: {key: float(np.mean([s - c[min(c)] for v, s in c.items() if v > min(c)]))
                        for key, c in cs.items()}
                 for name, cs in curves.items()}
    return {"level": levels, "paired": True, "left_out": left_out, "curves": curves,
            "updates_to_level": reach, "ratio_to_first": ratio, "mean_gain": mean_gain,
            "gain_vs_first": gain_vs_first(mean_gain)}


def gain_vs_first(mean_gain: dict) -> dict:
    """Each group's mean gain minus the first group's, seed by seed: ``{group: {"value",
    "low", "high", "label"}}``, the 95% t-interval over the seeds' differences and its label."""
    first_name, first = next(iter(mean_gain.items()))
    out = {}
    for name, gains in mean_gain.items():
        if name == first_name:
            continue
        diffs = [gains[key] - first[key] for key in first if key in gains]
        low, high = seed_paired_interval(diffs)
        out[name] = {"value": float(np.mean(diffs)) if diffs else float("nan"), "low": low,
                     "high": high, "seeds": len(diffs),
                     "label": effect_label(low, high) if len(diffs) > 1
                     else "no interval (one seed)"}
    return out


def show(result: dict) -> str:
    level = result["level"]
    lines = [f"held-out level: {level:.1%}" if not result.get("paired") else
             "held-out level per run: " + ", ".join(f"{k} {v:.1%}" for k, v in level.items())]
    if result.get("left_out"):
        lines.append("  left out, not in every group: " + ", ".join(result["left_out"]))
    intervals = result.get("intervals") or {}
    for name, cs in result["curves"].items():
        for run, c in cs.items():
            reach = result["updates_to_level"][name].get(run)
            known = intervals.get(name, {}).get(run, {})
            pts = "  ".join(f"v{v}:{s:.1%}" + (f" (95% {100 * known[v][0]:.1f}–"
                                                f"{100 * known[v][1]:.1f})" if v in known else "")
                            for v, s in c.items())
            lines.append(f"  {name:12s} {Path(run).name:32s} {pts}   reaches it at "
                         f"{'never' if reach is None else f'{reach:.1f}'}")
    means = {}
    for name, reach in result["updates_to_level"].items():
        got = [r for r in reach.values() if r is not None]
        means[name] = float(np.mean(got)) if got else None
        lines.append(f"  {name}: reached by {len(got)}/{len(reach)} runs, mean updates "
                     f"{'–' if not got else f'{means[name]:.1f}'}")
    names = list(means)
    if not result.get("paired") and len(names) == 2 and all(means[n] for n in names):
        lines.append(f"  {names[0]} / {names[1]} updates to the level: "
                     f"{means[names[0]] / means[names[1]]:.2f}x")
    for name, ratio in result.get("ratio_to_first", {}).items():
        if name != names[0]:
            per = ", ".join(f"{k} {r:.2f}x" for k, r in ratio.items())
            mean = f"{np.mean(list(ratio.values())):.2f}x" if ratio else "–"
            lines.append(f"  {names[0]} / {name} updates, paired: {per or 'none'} (mean {mean})")
    for name, gain in result.get("mean_gain", {}).items():
        per = ", ".join(f"{k} {100 * g:+.2f}" for k, g in gain.items())
        lines.append(f"  {name}: mean gain over the evaluated versions after 0, points: {per} "
                     f"(mean {100 * np.mean(list(gain.values())):+.2f})")
    for name, change in result.get("gain_vs_first", {}).items():
        lines.append(f"  {name} − {names[0]} mean gain, paired by seed: "
                     f"{format_diff(change['value'], (change['low'], change['high']))} over "
                     f"{change['seeds']} seeds (t): {change['label']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """One line per run (a colour per group), the group's mean at the versions every run of it
    has, and the level as a dashed line; paired, the change since each run's version 0 (the
    seeds start apart) and no level line (each seed has its own)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paired = bool(result.get("paired"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for colour, (name, cs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"],
                                  result["curves"].items()):
        shown = {run: {v: 100 * (s - (c[min(c)] if paired else 0)) for v, s in c.items()}
                 for run, c in cs.items()}
        for c in shown.values():
            vs = sorted(c)
            ax.plot(vs, [c[v] for v in vs], color=colour, alpha=0.35, marker=".")
        shared = sorted(set.intersection(*(set(c) for c in shown.values())))
        ax.plot(shared, [np.mean([c[v] for c in shown.values()]) for v in shared],
                color=colour, linewidth=2.5, marker="o", label=f"{name} (mean of {len(cs)})")
    if not paired:
        ax.axhline(100 * result["level"], color="grey", linestyle="--", linewidth=1,
                   label="level")
    ax.set_xlabel("RL update (weight version)")
    ax.set_ylabel("held-out success since the warm-start, avg@k (points)" if paired
                  else "held-out success, avg@k (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", action="append", required=True, metavar="NAME=DIR,DIR",
                    help="a named group of run directories, or with --ablation of one arm "
                         "(NAME=ARM) (repeatable)")
    ap.add_argument("--ablation", type=Path, default=None,
                    help="read the curves an ablation recorded in this json (its --doc with "
                         ".json) instead of evaluating run directories")
    ap.add_argument("--versions", default="", help="extra versions to evaluate, e.g. 5,10")
    ap.add_argument("--level", type=float, default=None,
                    help="held-out avg@k to reach (default: the first group's mean final; "
                         "with --ablation, its final on each seed)")
    ap.add_argument("--gain", type=float, default=None,
                    help="with --ablation: each seed's level is its version-0 success plus this")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="also draw the curves here (png)")
    args = ap.parse_args()
    groups = dict(text.partition("=")[::2] for text in args.group)
    if args.gain is not None and (not args.ablation or args.level is not None):
        ap.error("--gain sets a level per seed: it needs --ablation and no --level")
    if args.ablation:
        curves, intervals = ablation_curves(args.ablation, groups)
    else:
        curves = run_curves({name: [Path(d) for d in dirs.split(",") if d]
                             for name, dirs in groups.items()},
                            [int(v) for v in args.versions.split(",") if v])
        intervals = run_intervals(curves)
    result = compare(curves, args.level, paired=bool(args.ablation), gain=args.gain)
    result["intervals"] = intervals
    print(show(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        print(f"plot: {plot(result, args.plot)}")


if __name__ == "__main__":
    main()
