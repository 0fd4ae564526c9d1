"""Self-navigating vs plain RL at the same budget, on the built-in environment.

    python bench/self_navigating.py [--updates 120] [--out runs/bench-nav] [--set k=v ...]

Runs `autodidact run -c configs/quick.yaml` twice from the same seed — experience off, then on —
and prints, from each run's replay store and summary:

* success of guided vs unguided rollouts in the same groups, over the first and last thirds of
  training (the self-navigating run only);
* success of *unguided* rollouts per window of 10 policy versions in both runs, and how many
  updates each needs to reach the plain run's final level (unguided rollouts only, so the
  self-navigating run is not credited for the advice in its prompts);
* held-out avg@k after warm-start and after RL (evaluation never injects experience).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import protocol.messages  # noqa: E402,F401  (registers the message types)
from protocol import codec  # noqa: E402
from replay.store import Store  # noqa: E402

WINDOW = 10


def run(out: Path, name: str, updates: int, sets: list[str], reuse: bool) -> Path:
    run_dir = out / name
    if reuse and (run_dir / "summary.json").exists():
        return run_dir
    args = [sys.executable, "-m", "autodidact.cli", "run", "-c", str(ROOT / "configs/quick.yaml"),
            "--run-dir", str(run_dir), "--max-updates", str(updates),
            "--set", f"name=bench-{name}", "--set", "learner.max_minutes=30",
            "--set", "eval.num_tasks=100", *[a for s in sets for a in ("--set", s)]]
    print(f"[bench] {name}: {' '.join(args[2:])}", flush=True)
    subprocess.run(args, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir


def rollouts(run_dir: Path) -> list[tuple[int, bool, bool, str]]:
    """(policy version, guided, success, group id) per stored trajectory."""
    store = Store(run_dir, readonly=True)
    out = []
    try:
        with store.env.begin() as txn:
            for _, body in store.iter_bodies(txn):
                group = codec.decode_body("group", bytes(body))
                version = group.policy_versions()[0]
                out += [(version, bool(t.experience_ids), t.success, group.group_id)
                        for t in group.trajectories]
    finally:
        store.close()
    return out


def unguided_curve(rows) -> dict[int, float]:
    by_window: dict[int, list[bool]] = {}
    for version, guided, success, _ in rows:
        if not guided:
            by_window.setdefault(version // WINDOW, []).append(success)
    return {w * WINDOW: float(np.mean(v)) for w, v in sorted(by_window.items())}


def updates_to_reach(curve: dict[int, float], level: float) -> int | None:
    return next((v for v, s in curve.items() if s >= level), None)


def same_group_split(rows, lo: int, hi: int) -> tuple[float, float, int]:
    groups: dict[str, list[tuple[bool, bool]]] = {}
    for version, guided, success, gid in rows:
        if lo <= version < hi:
            groups.setdefault(gid, []).append((guided, success))
    mixed = [g for g in groups.values() if any(x for x, _ in g) and not all(x for x, _ in g)]
    with_exp = [s for g in mixed for x, s in g if x]
    without = [s for g in mixed for x, s in g if not x]
    return (float(np.mean(with_exp)) if with_exp else float("nan"),
            float(np.mean(without)) if without else float("nan"), len(mixed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-nav")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--reuse", action="store_true",
                        help="analyse finished runs in --out instead of running them again")
    args = parser.parse_args()
    plain = run(args.out, "plain", args.updates, [*args.sets, "experience.enabled=false"],
                args.reuse)
    nav = run(args.out, "nav", args.updates, [*args.sets, "experience.enabled=true"],
              args.reuse)
    curves = {name: unguided_curve(rollouts(d)) for name, d in (("plain", plain), ("nav", nav))}
    last = [s for v, s in curves["plain"].items() if v >= args.updates - 2 * WINDOW]
    level = float(np.mean(last))
    print(f"\nunguided training success per {WINDOW} versions:")
    for name, curve in curves.items():
        print(f"  {name:5s} " + " ".join(f"{v}:{s:.2f}" for v, s in curve.items()))
    print(f"plain run's final level (last {2 * WINDOW} versions): {level:.3f}")
    for name, curve in curves.items():
        print(f"  {name:5s} reaches it at version {updates_to_reach(curve, level)}")
    nav_rows = rollouts(nav)
    third = args.updates // 3
    for label, lo, hi in (("first third", 0, third), ("last third", 2 * third, 10**9)):
        w, wo, n = same_group_split(nav_rows, lo, hi)
        print(f"nav, {label}: success with experience {w:.3f} vs without {wo:.3f} "
              f"in the same {n} groups")
    for name, d in (("plain", plain), ("nav", nav)):
        s = json.loads((d / "summary.json").read_text())
        print(f"{name:5s} held-out avg@k: warm-start {s['success_warm']['avg']:.3f} -> "
              f"RL {s['success_rl']['avg']:.3f}")


if __name__ == "__main__":
    main()
