"""One call format against another on one env: two ``autodidact eval --split test`` runs on the
same tasks, each arm's rates with 95% intervals, and B - A paired by task.

    python -m bench.call_formats --a runs/bfcl-text --b runs/bfcl-pythonic-window \\
        [--env bfcl] [--json docs/results/bfcl_formats.json]

Each argument is an eval's run directory (``--run-dir``), whose
``eval/<env>-test-model-k*.jsonl`` holds one record per task (a BFCL entry, a held-out world's
task), or such a file itself (an eval's ``--out``). Per arm: avg@k and best@k (two-level
bootstrap over tasks and samples, ``metrics.intervals``), the valid-action rate (actions that
parsed and named a declared tool, of all actions), and the share of episodes that reach a first
action (an episode whose prompt leaves no room for one ends before it), overall and per category
(BFCL's four; an env's name where its tasks have none). B - A: avg@k and the reached share,
paired by task. Tasks only one arm has are left out of the pairing (an arm still running).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.output import command_line, write_result
from metrics.intervals import effect_label, paired_interval, rate_interval


def records(arm_path: Path, env: str = "bfcl") -> dict[str, dict]:
    """``{task_id: record}`` of the test eval of ``env`` in the run dir ``arm_path``, or in the
    file ``arm_path`` (an eval's ``--out``, such as an arm kept in the repository between
    sessions). A line cut short by a kill is skipped, as ``--resume`` skips it."""
    if arm_path.is_file():
        path = arm_path
    else:
        files = sorted((arm_path / "eval").glob(f"{env}-test-model-k*.jsonl"))
        if not files:
            raise SystemExit(f"{arm_path}/eval: no {env}-test-model-k*.jsonl; run autodidact "
                             f"eval --env {env} --split test --run-dir {arm_path} first")
        path = files[-1]
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        rows[row["task_id"]] = row
    return rows


def arm(rows: dict[str, dict]) -> dict:
    """One arm's rates over its entries, with intervals, overall and per category."""
    out = {"entries": len(rows), **_rates(list(rows.values()))}
    categories = sorted({r["category"] for r in rows.values()})
    out["categories"] = {c: _rates([r for r in rows.values() if r["category"] == c])
                         for c in categories}
    return out


def _rates(rows: list[dict]) -> dict:
    success = [[float(x >= 1.0) for x in r["rewards"]] for r in rows]
    reached = [[float(n > 0) for n in r["steps"]] for r in rows]
    valid, total = sum(r["valid_steps"] for r in rows), sum(r["total_steps"] for r in rows)
    return {"avg": sum(map(_mean, success)) / len(rows), "avg_ci": rate_interval(success),
            "best": sum(max(s) for s in success) / len(rows),
            "best_ci": rate_interval([[max(s)] for s in success]),
            "reached_first_action": sum(map(_mean, reached)) / len(rows),
            "reached_ci": rate_interval(reached),
            "valid_action_rate": valid / total if total else 0.0,
            "actions": total}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """B - A on the entries both arms have: avg@k and the reached share, paired by entry."""
    out = {}
    for name, of in (("avg", lambda r: [float(x >= 1.0) for x in r["rewards"]]),
                     ("reached_first_action", lambda r: [float(n > 0) for n in r["steps"]])):
        paired = paired_interval({t: of(r) for t, r in a.items()},
                                 {t: of(r) for t, r in b.items()})
        out[name] = {**paired, "label": effect_label(paired["low"], paired["high"])}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True,
                        help="baseline arm's eval run dir or results file")
    parser.add_argument("--b", type=Path, required=True,
                        help="the other arm's eval run dir or results file")
    parser.add_argument("--env", default="bfcl", help="the env both arms evaluated")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    a, b = records(args.a, args.env), records(args.b, args.env)
    result = {"command": command_line("bench.call_formats", argv), "env": args.env,
              "a": {"results": str(args.a), **arm(a)},
              "b": {"results": str(args.b), **arm(b)}, "b_minus_a": compare(a, b)}
    write_result(result, args.json, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
