"""Why training success moves during RL: what the actors rolled out, window by window.

    python -m bench.training_success RUN_DIR [RUN_DIR ...] [--window 5] [--json OUT]

Reads each run's replay store (every stored rollout) and its learner metrics, and prints per
window of policy versions:

* success of all, unguided and guided rollouts;
* the task mix: mean difficulty and reference length of the tasks rolled out, the share that
  the run had rolled out before (revisits), and the share that the warm-start had trained on
  (its examples' task ids, ``policy_init/warmstart_tasks.json``), with the success on those
  tasks and on the rest;
* the policy: mean negative log-prob of the sampled action tokens (a sampled estimate of the
  per-token entropy), invalid actions per step, episodes cut at the turn limit;
* staleness: the learner's mean lag (versions behind) over the updates of the window.

Then it splits the change in unguided success between the first and the last window (of those
with at least half the typical number of episodes) into the part the task mix explains (the
last window's per-difficulty success weighted by the first window's mix, against the last
window's own mix) and the change within tasks rolled out in both windows (the same task ids
early and late: the policy itself, not the mix).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.run_compare import stored_groups
from metrics.jsonl import read_metrics
from protocol.run_dir import RunDir


@dataclass
class Episode:
    """One stored rollout, as this analysis sees it."""

    version: int
    group_id: str
    task_id: str
    difficulty: float
    reference_len: int
    guided: bool
    success: bool
    neg_logprob: float  # mean over the sampled action tokens
    invalid_share: float  # invalid actions / actions
    truncated: bool
    warmstarted: bool | None = None  # the warm-start trained on this task (None: not recorded)


def episodes(run_dir: Path) -> list[Episode]:
    """Every stored rollout of ``run_dir``, oldest policy version first."""
    path = RunDir(run_dir).warmstart_tasks
    warm = set(json.loads(path.read_text())) if path.exists() else None
    out = [_episode(group, t, None if warm is None else group.task.task_id in warm)
           for group in stored_groups(run_dir) for t in group.trajectories]
    return sorted(out, key=lambda e: e.version)


def _episode(group, traj, warmstarted: bool | None = None) -> Episode:
    sampled = traj.action_mask > 0
    steps = traj.steps or []
    return Episode(
        version=group.policy_versions()[0], group_id=group.group_id, task_id=group.task.task_id,
        difficulty=float(group.task.difficulty), reference_len=len(group.task.reference),
        guided=bool(traj.experience_ids), success=bool(traj.success),
        neg_logprob=float(-traj.logprobs[sampled].mean()) if sampled.any() else float("nan"),
        invalid_share=sum(not s.valid for s in steps) / max(len(steps), 1),
        truncated=bool(traj.info.get("truncated", False)), warmstarted=warmstarted)


def windows(eps: list[Episode], width: int) -> dict[int, list[Episode]]:
    by: dict[int, list[Episode]] = defaultdict(list)
    for e in eps:
        by[e.version // width * width].append(e)
    return dict(sorted(by.items()))


def _rate(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else float("nan")


def window_rows(eps: list[Episode], width: int, lags: dict[int, float]) -> list[dict]:
    """One row per window of ``width`` policy versions (see the module docstring)."""
    seen: set[str] = set()
    rows = []
    for start, group in windows(eps, width).items():
        revisits = [e.task_id in seen for e in group]
        seen.update(e.task_id for e in group)
        rows.append({
            "versions": f"{start}-{start + width - 1}", "episodes": len(group),
            "success": _rate(e.success for e in group),
            "success_unguided": _rate(e.success for e in group if not e.guided),
            "success_guided": _rate(e.success for e in group if e.guided),
            "difficulty": _rate(e.difficulty for e in group),
            "reference_len": _rate(e.reference_len for e in group),
            "revisit_share": _rate(revisits),
            "warmstarted_share": _rate(e.warmstarted for e in group
                                       if e.warmstarted is not None),
            "success_warmstarted": _rate(e.success for e in group if e.warmstarted),
            "success_other": _rate(e.success for e in group if e.warmstarted is False),
            "neg_logprob": float(np.nanmean([e.neg_logprob for e in group])),
            "invalid_per_step": _rate(e.invalid_share for e in group),
            "truncated": _rate(e.truncated for e in group),
            "lag_mean": _rate(v for u, v in lags.items() if start <= u < start + width),
        })
    return rows


def learner_lags(run_dir: Path) -> dict[int, float]:
    """The learner's mean lag per update, keyed by the version it trained at."""
    return {int(r["learner/version"]) - 1: float(r["learner/lag_mean"])
            for r in read_metrics(run_dir, "learner") if "learner/lag_mean" in r}


def decompose(eps: list[Episode], width: int) -> dict:
    """Unguided success, first window vs last: how much the task mix explains, and the change
    on task ids rolled out in both."""
    ws = windows([e for e in eps if not e.guided], width)
    # A last window of a few groups rolled out after the final update says little: skip
    # windows with under half the typical number of episodes.
    typical = np.median([len(w) for w in ws.values()]) if ws else 0
    ws = {v: w for v, w in ws.items() if len(w) >= typical / 2}
    if len(ws) < 2:
        return {}
    first, last = ws[min(ws)], ws[max(ws)]
    edges = np.unique(np.quantile([e.difficulty for e in eps], [0.25, 0.5, 0.75]))

    def bucket(e):
        return int(np.searchsorted(edges, e.difficulty, side="right"))

    def by_bucket(group):
        out = defaultdict(list)
        for e in group:
            out[bucket(e)].append(e.success)
        return out

    f, la = by_bucket(first), by_bucket(last)
    shared = [b for b in f if b in la]
    first_mix = {b: len(f[b]) / sum(len(f[b]) for b in shared) for b in shared}
    # the last window's policy on the first window's mix of difficulties
    reweighted = sum(first_mix[b] * np.mean(la[b]) for b in shared)
    both = {e.task_id for e in first} & {e.task_id for e in last}
    return {
        "first": _rate(e.success for e in first), "last": _rate(e.success for e in last),
        "last_on_first_mix": float(reweighted),
        "same_tasks": len(both),
        "same_tasks_first": _rate(e.success for e in first if e.task_id in both),
        "same_tasks_last": _rate(e.success for e in last if e.task_id in both),
    }


def analyse(run_dir: Path, width: int) -> dict:
    eps = episodes(run_dir)
    return {"run": str(run_dir), "window": width,
            "windows": window_rows(eps, width, learner_lags(run_dir)),
            "decomposition": decompose(eps, width)}


def show(result: dict) -> str:
    lines = [f"{result['run']}: per {result['window']} policy versions"]
    cols = ["versions", "episodes", "success", "success_unguided", "success_guided",
            "difficulty", "reference_len", "revisit_share", "warmstarted_share",
            "success_warmstarted", "success_other", "neg_logprob", "invalid_per_step",
            "truncated", "lag_mean"]
    lines.append("  " + " ".join(f"{c[:12]:>12}" for c in cols))
    for row in result["windows"]:
        lines.append("  " + " ".join(
            f"{row[c]:>12.3f}" if isinstance(row[c], float) else f"{row[c]:>12}" for c in cols))
    d = result["decomposition"]
    if d:
        lines.append(
            f"  unguided success first -> last window: {d['first']:.3f} -> {d['last']:.3f}; "
            f"last window's policy on the first window's difficulty mix: "
            f"{d['last_on_first_mix']:.3f}; on the {d['same_tasks']} tasks rolled out in both: "
            f"{d['same_tasks_first']:.3f} -> {d['same_tasks_last']:.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--window", type=int, default=5, help="policy versions per row")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    results = [analyse(r, args.window) for r in args.runs]
    for r in results:
        print(show(r) + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
