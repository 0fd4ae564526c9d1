"""Where a finished run's time went: one table from its run directory (metrics.jsonl, the
replay store, the launcher's log), for the real-model runs of issue 20.

    .venv/bin/python -m bench.run_timing runs/smollm2-s0 [runs/smollm2-s1 ...] [--out F.json]

Per run: the stages before RL (from the launcher's stage lines), then the RL phase: seconds
per update and where they went (the learner's step, its wait for a batch, weight
publishing), the learner's tokens/s (all tokens it ran through, and the generated tokens it
trained on), the actors' tokens/s while generating and their idle share, and the weight
publish time; and how RL moved through the run: the learner's batch reward, KL to the
behaviour policy, gradient norm, clip fraction and lag, each averaged over quarters of its
updates. Reads only; run it after the run has stopped (the replay store is opened read-only).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from bench.output import command_line, write_result
from metrics.jsonl import read_metrics

STAGES = {  # the launcher's stage lines -> seconds
    "explore": re.compile(r"explore: .* in ([\d.]+)s"),
    "warm-start": re.compile(r"warm-start: .* in ([\d.]+)s"),
}


def replay_groups(run_dir: Path) -> dict:
    """What the run's replay store holds: groups, all tokens and generated tokens, and the
    learning signal in them: the share of groups whose outcomes differ (the others carry no
    outcome advantage) and the training success of the first and second half of the policy
    versions that acted."""
    import numpy as np

    from protocol.codec import decode_body
    from protocol.messages import Group
    from replay.store import Store

    store = Store(run_dir, readonly=True)
    groups = total = generated = mixed = 0
    by_version: list[tuple[int, bool]] = []
    try:
        with store.env.begin() as txn:
            for _, body in store.iter_bodies(txn):
                group = decode_body(Group.TYPE, body)
                groups += 1
                outcomes = {bool(t.success) for t in group.trajectories}
                mixed += len(outcomes) > 1
                version = group.policy_versions()[0]
                for traj in group.trajectories:
                    total += len(traj.tokens)
                    generated += int(np.asarray(traj.action_mask).sum())
                    by_version.append((version, bool(traj.success)))
    finally:
        store.close()
    by_version.sort()
    half = len(by_version) // 2
    return {"groups": groups, "tokens": total, "generated": generated,
            "mixed_group_share": mixed / max(groups, 1),
            "train_success_first_half": success_rate(by_version[:half]),
            "train_success_second_half": success_rate(by_version[half:])}


def success_rate(rows: list[tuple[int, bool]]) -> float:
    return sum(success for _, success in rows) / len(rows) if rows else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# What RL did to the policy over a run: did reward follow as the policy moved?
DRIFT = ("learner/reward", "learner/kl_behaviour", "learner/grad_norm", "learner/clip_fraction",
         "learner/lag_mean")


def by_quarter(steps: list[dict], key: str) -> list[float] | None:
    """``key``'s mean over each quarter of the updates (None where no update logged it)."""
    values = [r[key] for r in steps if key in r]
    if len(values) < 4:
        return None
    n = len(values)
    return [statistics.fmean(values[i * n // 4:(i + 1) * n // 4]) for i in range(4)]


def timing(run_dir: Path, log_text: str = "") -> dict:
    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("role") == "learner" and "learner/step_s" in r]
    actors = [r for r in records if r.get("role") == "actor" and "actor/rollout_s" in r]
    stored = replay_groups(run_dir)
    total, generated = stored["tokens"], stored["generated"]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_s = [r["learner/step_s"] for r in steps]
    idle_s = [r.get("learner/idle_s", 0.0) for r in steps]
    publish_s = [r.get("learner/publish_s", 0.0) for r in steps]
    span = (steps[-1]["t"] - steps[0]["t"]) / max(len(steps) - 1, 1) if len(steps) > 1 else \
        float("nan")
    rollout_s = sum(r["actor/rollout_s"] for r in actors)
    actor_idle = sum(r.get("actor/idle_s", 0.0) for r in actors)
    trained = sum(r.get("learner/tokens", 0.0) for r in steps)
    row = {
        "run": run_dir.name, "updates": len(steps), "groups_stored": stored["groups"],
        "mixed_group_share": stored["mixed_group_share"],
        "train_success_first_half": stored["train_success_first_half"],
        "train_success_second_half": stored["train_success_second_half"],
        "seconds_per_update": span, "learner_step_s": median(step_s),
        "learner_wait_s": median(idle_s), "publish_s": median(publish_s),
        "learner_generated_tokens_per_s": trained / max(sum(step_s), 1e-9),
        "learner_tokens_per_s": None, "actor_tokens_per_s": generated / max(rollout_s, 1e-9),
        "actor_idle_fraction": actor_idle / max(actor_idle + rollout_s, 1e-9),
        "success": {k: summary.get(k) for k in ("success_base", "success_warm", "success_rl")},
        "by_quarter": {key: by_quarter(steps, key) for key in DRIFT},
    }
    if steps:  # every token of the groups it trained on, estimated by their generated share
        share = trained / max(generated, 1)
        row["learner_tokens_per_s"] = share * total / max(sum(step_s), 1e-9)
    for name, pattern in STAGES.items():
        found = pattern.search(log_text)
        row[f"{name}_s"] = float(found.group(1)) if found else None
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--log", action="append", default=[],
                   help="the launcher's output of a run (stage times), in the runs' order")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for i, run in enumerate(args.runs):
        log_text = Path(args.log[i]).read_text() if i < len(args.log) else ""
        rows.append(timing(Path(run), log_text))
    print("| run | updates | s / update | learner step s | learner wait s | publish s | "
          "learner tok/s (all / generated) | actor tok/s generating | actor idle | "
          "groups with mixed outcomes | training success 1st → 2nd half |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['updates']} | {r['seconds_per_update']:.1f} | "
              f"{r['learner_step_s']:.1f} | {r['learner_wait_s']:.1f} | {r['publish_s']:.2f} | "
              f"{r['learner_tokens_per_s'] or 0:.0f} / {r['learner_generated_tokens_per_s']:.1f}"
              f" | {r['actor_tokens_per_s']:.1f} | {100 * r['actor_idle_fraction']:.0f}% | "
              f"{100 * r['mixed_group_share']:.0f}% | {100 * r['train_success_first_half']:.0f}%"
              f" → {100 * r['train_success_second_half']:.0f}% |")
    print("\nby quarter of the updates: " + ", ".join(DRIFT))
    for r in rows:
        print(f"{r['run']}: " + "; ".join(
            "/".join(f"{v:.3g}" for v in quarters) if quarters else "-"
            for quarters in r["by_quarter"].values()))
    if args.out:
        write_result({"command": command_line("bench.run_timing", argv), "runs": rows},
                     Path(args.out))
    return rows


if __name__ == "__main__":
    main()
