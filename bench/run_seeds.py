"""One config over several seeds: held-out success before training, after the warm-start and
after RL, per seed and as mean ± std, and whether RL moved it (issue 20's 3-seed table).

    .venv/bin/python -m bench.run_seeds -c configs/smollm2.yaml --seeds 0,1,2 \\
        --out docs/results/smollm2_seeds.json

Seed N is ``autodidact run -c CONFIG --run-dir runs/<name>-sN --set seed=N --set name=<name>-sN``
(``<name>`` is the config's own unless ``--name``), run one after another so runs never
share the cores. A run that finished before with the same command is reused (the stamp
``autodidact ablation`` uses), so a measurement cut off by the end of a session goes on where
it stopped. ``--no-run`` only reads what has finished; ``--from-json F`` reads the runs a json
written by ``--out`` records and writes its summary again (the runs may be gone). Runs made
with ``--set eval.final_test=true`` looked at the test split once after RL: their test
results are summarized the same way, apart (``test_summary``, ``test_runs``).

Every stage's avg@k over the seeds carries a 95% interval, and so do the changes warm-start −
base and RL − warm-start, paired within each run (``autodidact/experiments/page.py``,
``metrics/intervals.py``): over the runs' held-out tasks and samples where they kept per-task
records, else Student's t over the seeds. "RL moved success" is the label of RL − warm-start's
paired interval: "helps" or "hurts" only when it excludes 0, never from the sign of the means.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from autodidact.experiments.arms import (
    Result,
    recorded_result,
    run_argv,
    run_or_reuse,
    test_result,
)
from autodidact.experiments.page import (
    change_over_seeds,
    change_text,
    mean_std,
    no_nan,
    rate_over_seeds,
    rate_text,
)
from protocol.config import load_config, read_yaml

ROOT = Path(__file__).resolve().parents[1]

STAGES = ("base", "warm", "final")  # Result's evaluations, in the order they happen
KEYS = ("avg", "best", "greedy")


def run_seed(config: Path, name: str, seed: int, sets: list[str], may_run: bool,
             runs: Path = ROOT / "runs") -> Result:
    """Seed ``seed`` of ``config`` in ``runs``: reused when finished with the same command,
    else run (unless ``may_run`` is false, then an unfinished result)."""
    run_dir = (runs / f"{name}-s{seed}").resolve()
    argv = run_argv(config, run_dir, None, [*sets, f"seed={seed}", f"name={name}-s{seed}"])
    log = run_dir.parent / f"{run_dir.name}.log"
    print(f"[seeds] seed {seed}: {' '.join(argv[2:])} (reused if finished; log {log})",
          flush=True)
    return run_or_reuse(name, seed, run_dir, argv, log, may_run=may_run)


def summarize(results: list[Result]) -> dict:
    """Mean ± std over the finished seeds of every stage's avg/best/greedy, every stage's
    avg@k with its 95% interval, the changes warm-start - base and RL - warm-start with their
    paired intervals, and the label of the RL change's interval."""
    done = [r for r in results if r.final]
    row: dict = {"seeds": [r.seed for r in done]}
    for stage in STAGES:
        for key in KEYS:
            row[f"{stage}_{key}"] = mean_std([getattr(r, stage)[key] for r in done
                                              if key in getattr(r, stage)])
        row[f"{stage}_avg_ci"] = rate_over_seeds(done, stage)
    row["warm_change"] = change_over_seeds([(r, r) for r in done], "base", "warm")
    row["rl_change"] = change_over_seeds([(r, r) for r in done], "warm", "final")
    row["rl_change_greedy"] = mean_std([r.final["greedy"] - r.warm["greedy"] for r in done
                                        if "greedy" in r.final and "greedy" in r.warm])
    row["rl_verdict"] = row["rl_change"]["label"]
    row["updates"] = mean_std([float(r.updates) for r in done])
    row["minutes"] = mean_std([r.seconds / 60 for r in done if r.seconds])
    return row


def pct(value: float) -> str:
    return f"{value * 100:.1f}"


def table(results: list[Result], row: dict, k: int) -> str:
    """Markdown: one line per seed (RL − warm-start with its paired interval where the run
    kept per-task records), then mean ± std, then each stage's avg@k and the RL change with
    their 95% intervals over the seeds."""
    head = (f"| seed | base avg@{k} | warm-start avg@{k} | after RL avg@{k} | RL − warm-start "
            "| greedy base → warm → RL | RL updates | minutes |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        if not r.final:
            lines.append(f"| {r.seed} | {r.error} |" + " |" * 6)
            continue
        greedy = " → ".join(pct(getattr(r, s).get("greedy", float("nan"))) for s in STAGES)
        lines.append(f"| {r.seed} | {pct(r.base['avg'])} | {pct(r.warm['avg'])} | "
                     f"{pct(r.final['avg'])} | {seed_change(r)} | "
                     f"{greedy} | {r.updates} | {r.seconds / 60:.1f} |")

    def pm(pair, scale=100.0):
        return f"{pair[0] * scale:.1f} ± {pair[1] * scale:.1f}"
    rl = row["rl_change"]
    lines.append(f"| mean ± std ({len(row['seeds'])}) | {pm(row['base_avg'])} | "
                 f"{pm(row['warm_avg'])} | {pm(row['final_avg'])} | "
                 f"{pm(mean_std(changes(results)))} | "
                 f"{pm(row['base_greedy'])} → {pm(row['warm_greedy'])} → "
                 f"{pm(row['final_greedy'])} | {pm(row['updates'], 1)} | "
                 f"{pm(row['minutes'], 1)} |")
    lines.append(f"| 95% interval | {rate_text(row['base_avg_ci'])} | "
                 f"{rate_text(row['warm_avg_ci'])} | {rate_text(row['final_avg_ci'])} | "
                 f"{change_text(rl)}: {rl['label']} | | | |")
    return "\n".join(lines)


def changes(results: list[Result]) -> list[float]:
    """Each finished seed's RL − warm-start avg@k."""
    return [r.final["avg"] - r.warm["avg"] for r in results if r.final]


def seed_change(result: Result) -> str:
    """One run's RL − warm-start, with its paired interval where it kept per-task records."""
    change = change_over_seeds([(result, result)], "warm", "final")
    if change["over"] == "tasks":
        return f"{change_text(change)}: {change['label']}"
    return f"{(result.final['avg'] - result.warm['avg']) * 100:+.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="a config override for every seed (part of the reuse stamp)")
    parser.add_argument("--name", default=None,
                        help="runs/<name>-sN and the runs' name (default: the config's name); "
                             "another name keeps another measurement's runs of that config")
    parser.add_argument("--out", type=Path, help="write the per-seed results and summary here")
    parser.add_argument("--no-run", action="store_true", help="only read finished seeds")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="run and read nothing else: the runs a json of --out records, "
                             "summarized again (and written back to it, or to --out)")
    args = parser.parse_args(argv)
    if args.from_json:
        recorded = json.loads(args.from_json.read_text())
        args.config, args.sets = Path(recorded["config"]), recorded["sets"]
        args.out = args.out or args.from_json
        results = [recorded_result(run) for run in recorded["runs"]]
    elif args.config is None:
        parser.error("-c/--config is needed unless --from-json")
    else:
        name = args.name or read_yaml(args.config).get("name") or args.config.stem
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        results = [run_seed(args.config, name, s, args.sets, not args.no_run) for s in seeds]
    k = load_config(args.config, args.sets).eval.k  # the config's own default when unset
    if args.from_json:
        command = recorded.get("command", "")
        tests = [recorded_result(run) for run in recorded.get("test_runs", [])]
    else:
        command = " ".join(["python -m bench.run_seeds", *(argv or sys.argv[1:])])
        tests = [t for t in map(test_result, results) if t is not None]
    row = summarize(results)
    split = next((r.final.get("split") for r in results if r.final), None) or "held-out"
    print(f"{split} split:\n{table(results, row, k)}")
    print(f"RL change (avg@{k}, after RL − after warm-start): {change_text(row['rl_change'])}, "
          f"{row['rl_verdict']}")
    test_row = summarize(tests) if tests else None
    if test_row:
        print(f"test split (each run looked once, after RL):\n{table(tests, test_row, k)}")
    if args.out:
        args.out.write_text(json.dumps({
            "command": command, "config": str(args.config), "sets": args.sets,
            "split": split, "summary": no_nan(row), "runs": recorded_runs(results),
            "test_summary": test_row and no_nan(test_row), "test_runs": recorded_runs(tests)},
            indent=1, default=str))


def recorded_runs(results: list[Result]) -> list[dict]:
    return [{**r.__dict__, "run_dir": r.run_dir and r.run_dir.name} for r in results]


if __name__ == "__main__":
    main()
