"""What the run-comparing benchmarks share: start a whole run, read back what its actors did.

Each benchmark runs ``autodidact run`` as a user would (its own processes, its own run
directory) and then reads the run's replay store, so what is compared is what was trained on.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np

import protocol.messages  # noqa: F401  (registers the message types)
from autodidact.experiments.arms import run_argv
from protocol import codec
from replay.store import Store

ROOT = Path(__file__).resolve().parents[1]

WINDOW = 10  # policy versions per point of a success curve


def arguments(doc: str, updates: int, config: str, out: str) -> argparse.ArgumentParser:
    """The options every run-comparing benchmark takes, with its own defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--updates", type=int, default=updates)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / config)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / out)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--reuse", action="store_true",
                        help="analyse finished runs in --out instead of running them again")
    return parser


def run(out: Path, name: str, config: Path, updates: int, sets: list[str], reuse: bool) -> Path:
    """``autodidact run`` into ``out/name`` (skipped with ``reuse`` when it finished before)."""
    run_dir = out / name
    if reuse and (run_dir / "summary.json").exists():
        return run_dir
    args = run_argv(config, run_dir, updates, [f"name=bench-{name}", "learner.max_minutes=30",
                                                "eval.num_tasks=100", *sets])
    print(f"[bench] {name}: {' '.join(args[2:])}", flush=True)
    subprocess.run(args, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir


def stored_groups(run_dir: Path):
    """Every group the run's replay store holds, decoded (read-only, beside a live writer)."""
    store = Store(run_dir, readonly=True)
    try:
        with store.begin_read() as txn:
            for _, body in store.iter_bodies(txn):
                yield codec.decode_body("group", bytes(body))
    finally:
        store.close()


def rollouts(run_dir: Path) -> list[tuple[int, bool, bool, str]]:
    """(policy version, guided, success, group id) per stored trajectory."""
    return [(group.policy_versions()[0], bool(t.experience_ids), t.success, group.group_id)
            for group in stored_groups(run_dir) for t in group.trajectories]


def success_curve(rows, unguided_only: bool = True) -> dict[int, float]:
    """Training success per window of ``WINDOW`` policy versions (first version -> rate)."""
    by_window: dict[int, list[bool]] = {}
    for version, guided, success, _ in rows:
        if not (guided and unguided_only):
            by_window.setdefault(version // WINDOW, []).append(success)
    return {w * WINDOW: float(np.mean(v)) for w, v in sorted(by_window.items())}


def updates_to_reach(curve: dict[int, float], level: float) -> int | None:
    """The first version whose window reaches ``level``; None if none does."""
    return next((v for v, s in curve.items() if s >= level), None)


def final_level(curve: dict[int, float], updates: int) -> float:
    """Mean success over the last two windows of a run of ``updates`` updates."""
    last = [s for v, s in curve.items() if v >= updates - 2 * WINDOW]
    return float(np.mean(last)) if last else float("nan")


def arms_record(curves: dict[str, dict[int, float]], level: float, held: dict,
                baseline: str) -> dict:
    """What a mechanism bench writes to its json for one seed: each arm's training-success
    curve, the version it reaches ``level`` (the baseline arm's final level) at, its held-out
    avg@k after the warm-start and after RL with RL's paired change, and each other arm −
    ``baseline`` after RL, paired (``held``: arm -> :class:`~autodidact.experiments.arms.
    Result`)."""
    from autodidact.experiments.page import change_over_seeds, rate_over_seeds

    arms = {}
    for arm, curve in curves.items():
        result = held[arm]
        arms[arm] = {"curve": {str(v): s for v, s in curve.items()},
                     "reaches_level_at": updates_to_reach(curve, level),
                     "warm": rate_over_seeds([result], "warm"),
                     "rl": rate_over_seeds([result]),
                     "rl_minus_warm": change_over_seeds([(result, result)], "warm", "final"),
                     "run_dir": str(result.run_dir)}
    return {"level": level, "baseline": baseline, "arms": arms,
            "minus_baseline_after_rl": {arm: change_over_seeds([(held[baseline], held[arm])])
                                        for arm in held if arm != baseline}}
