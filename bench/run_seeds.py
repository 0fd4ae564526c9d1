"""One config over several seeds: held-out success before training, after the warm-start and
after RL, per seed and as mean ± std, and whether RL moved it (issue 20's 3-seed table).

    .venv/bin/python -m bench.run_seeds -c configs/smollm2.yaml --seeds 0,1,2 \\
        --out docs/results/smollm2_seeds.json

Seed N is ``autodidact run -c CONFIG --run-dir runs/<name>-sN --set seed=N --set name=<name>-sN``
(``<name>`` is the config's own), run one after another so runs never share the cores. A run
that finished before with the same command is reused (the stamp ``autodidact ablation`` uses),
so a measurement cut off by the end of a session goes on where it stopped. ``--no-run`` only
reads what has finished.

"RL moved success" is claimed the way the ablation claims an effect: every seed's change
(after RL minus after the warm-start, avg@k) has the same sign and the mean change is larger
than its standard deviation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autodidact.experiments.arms import Result, run_argv, run_or_reuse
from autodidact.experiments.page import mean_std, verdict
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
    """Mean ± std over the finished seeds of every stage's avg/best/greedy, the paired
    changes warm-start - base and RL - warm-start, and a plain reading of the RL change."""
    done = [r for r in results if r.final]
    row: dict = {"seeds": [r.seed for r in done]}
    for stage in STAGES:
        for key in KEYS:
            row[f"{stage}_{key}"] = mean_std([getattr(r, stage)[key] for r in done
                                              if key in getattr(r, stage)])
    rl_change = [r.final["avg"] - r.warm["avg"] for r in done]
    row["warm_change"] = mean_std([r.warm["avg"] - r.base["avg"] for r in done])
    row["rl_change"] = mean_std(rl_change)
    row["rl_change_greedy"] = mean_std([r.final["greedy"] - r.warm["greedy"] for r in done
                                        if "greedy" in r.final and "greedy" in r.warm])
    row["rl_verdict"] = verdict(rl_change)
    row["updates"] = mean_std([float(r.updates) for r in done])
    row["minutes"] = mean_std([r.seconds / 60 for r in done if r.seconds])
    return row


def pct(value: float) -> str:
    return f"{value * 100:.1f}"


def table(results: list[Result], row: dict, k: int) -> str:
    """Markdown: one line per seed, then mean ± std."""
    head = (f"| seed | base avg@{k} | warm-start avg@{k} | after RL avg@{k} | RL − warm-start "
            "| greedy base → warm → RL | RL updates | minutes |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        if not r.final:
            lines.append(f"| {r.seed} | {r.error} |" + " |" * 6)
            continue
        greedy = " → ".join(pct(getattr(r, s).get("greedy", float("nan"))) for s in STAGES)
        lines.append(f"| {r.seed} | {pct(r.base['avg'])} | {pct(r.warm['avg'])} | "
                     f"{pct(r.final['avg'])} | {(r.final['avg'] - r.warm['avg']) * 100:+.1f} | "
                     f"{greedy} | {r.updates} | {r.seconds / 60:.1f} |")

    def pm(pair, scale=100.0):
        return f"{pair[0] * scale:.1f} ± {pair[1] * scale:.1f}"
    lines.append(f"| mean ± std ({len(row['seeds'])}) | {pm(row['base_avg'])} | "
                 f"{pm(row['warm_avg'])} | {pm(row['final_avg'])} | {pm(row['rl_change'])} | "
                 f"{pm(row['base_greedy'])} → {pm(row['warm_greedy'])} → "
                 f"{pm(row['final_greedy'])} | {pm(row['updates'], 1)} | "
                 f"{pm(row['minutes'], 1)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="a config override for every seed (part of the reuse stamp)")
    parser.add_argument("--out", type=Path, help="write the per-seed results and summary here")
    parser.add_argument("--no-run", action="store_true", help="only read finished seeds")
    args = parser.parse_args(argv)
    name = read_yaml(args.config).get("name") or args.config.stem
    k = load_config(args.config, args.sets).eval.k  # the config's own default when unset
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    results = [run_seed(args.config, name, s, args.sets, not args.no_run) for s in seeds]
    row = summarize(results)
    print(table(results, row, k))
    print(f"RL change (avg@{k}, after RL − after warm-start): {row['rl_verdict']}")
    if args.out:
        args.out.write_text(json.dumps({
            "config": str(args.config), "sets": args.sets, "summary": row,
            "runs": [{**r.__dict__, "run_dir": r.run_dir and r.run_dir.name}
                     for r in results]}, indent=1, default=str))


if __name__ == "__main__":
    main()
