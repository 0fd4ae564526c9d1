"""What ``autodidact ablation`` writes (``autodidact/experiments/arms.py`` runs the cells): the
table (mean ± std over seeds, and each arm's change against the reference paired by seed), its
plot, the doc's generated section between markers (text outside them is kept), the doc's json
(the rows and every cell: the records a later call goes on from) and the seed-0 runs overlaid
with ``autodidact report``.
"""

from __future__ import annotations

import json
import math
import platform
from datetime import date
from pathlib import Path

import click

from autodidact.experiments.arms import NOT_RUN, REFERENCE, Budget, Plan, Result, shared_sets
from protocol.run_dir import RunDir

# --- the table -------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def paired_change(results: list[Result], arm: str, key: str = "avg") -> list[float]:
    """``arm`` minus the reference arm on the same seed, for every seed both finished."""
    ref = {r.seed: r.final[key] for r in results if r.arm == REFERENCE and key in r.final}
    return [r.final[key] - ref[r.seed] for r in results
            if r.arm == arm and key in r.final and r.seed in ref]


def verdict(changes: list[float]) -> str:
    """A plain reading of paired changes: a direction is claimed only when every seed agrees
    and the mean change is larger than its spread."""
    if len(changes) < 2:
        return "too few seeds to say"
    mean, std = mean_std(changes)
    same_sign = all(c > 0 for c in changes) or all(c < 0 for c in changes)
    if same_sign and abs(mean) > std:
        return ("helps" if mean > 0 else "hurts") + f" on all {len(changes)} seeds"
    return "no consistent effect"


def summarize(results: list[Result], k: int) -> list[dict]:
    """One row per arm: mean ± std over seeds, and the change against the reference arm."""
    rows = []
    for arm in dict.fromkeys(r.arm for r in results):
        done = [r for r in results if r.arm == arm and r.final]
        row = {"arm": arm, "seeds": len(done)}
        for key in ("avg", "best", "greedy"):
            row[key] = mean_std([r.final[key] for r in done if key in r.final])
        row["warm"] = mean_std([r.warm["avg"] for r in done if "avg" in r.warm])
        row["rl_gain"] = mean_std([r.final["avg"] - r.warm["avg"] for r in done
                                   if "avg" in r.warm and "avg" in r.final])
        row["updates"] = mean_std([float(r.updates) for r in done if r.run_dir])
        row["minutes"] = mean_std([r.seconds / 60 for r in done if r.seconds])
        if arm != REFERENCE and arm != "zero-shot":
            changes = paired_change(results, arm)
            row["change"] = mean_std(changes)
            row["verdict"] = verdict(changes)
        rows.append(row)
    return rows


def _pm(pair: tuple[float, float], scale: float = 100.0, spec: str = ".1f") -> str:
    mean, std = pair
    if math.isnan(mean):
        return "–"
    return f"{mean * scale:{spec}} ± {std * scale:{spec}}"


def _signed(pair: tuple[float, float]) -> str:
    mean, std = pair
    return "–" if math.isnan(mean) else f"{mean * 100:+.1f} ± {std * 100:.1f}"


def table(rows: list[dict], k: int) -> str:
    """The markdown table: success in percent, mean ± std over seeds."""
    lines = [f"| setting | seeds | avg@{k} | best@{k} | greedy | Δ avg@{k} vs {REFERENCE} "
             f"(paired) | reading | after warm-start avg@{k} | RL gain (after RL − warm-start) "
             "| RL updates | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        trained = row["arm"] != "zero-shot"
        lines.append(" | ".join([
            f"| {row['arm']}", str(row["seeds"]), _pm(row["avg"]), _pm(row["best"]),
            _pm(row["greedy"]), _signed(row["change"]) if "change" in row else "",
            row.get("verdict", "reference" if row["arm"] == REFERENCE else ""),
            _pm(row["warm"]) if trained else "",
            _signed(row["rl_gain"]) if trained else "",
            _pm(row["updates"], 1.0, ".0f") if trained else "",
            _pm(row["minutes"], 1.0) if trained else ""]) + " |")
    return "\n".join(lines)


def per_seed_table(results: list[Result], k: int) -> str:
    seeds = sorted({r.seed for r in results})
    lines = ["| setting | " + " | ".join(f"seed {s} avg@{k} / best@{k}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for arm in dict.fromkeys(r.arm for r in results):
        cells = []
        for s in seeds:
            r = next((r for r in results if r.arm == arm and r.seed == s), None)
            if r is None or not r.final:
                cells.append(f"failed: {r.error}" if r and r.error and r.error != NOT_RUN
                             else "–")
            else:
                cells.append(f"{r.final['avg']:.1%} / {r.final['best']:.1%}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the plot --------------------------------------------------------------------------------


def plot(results: list[Result], rows: list[dict], k: int, path: Path) -> Path:
    """Left: held-out avg@k and best@k per arm (bars: mean over seeds, whiskers: std, dots:
    seeds). Right: avg@k before training, after the warm-start and after RL, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [row["arm"] for row in rows]
    fig, (bars, stages) = plt.subplots(1, 2, figsize=(13, 4.8),
                                       gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for offset, key, colour in ((-width / 2, "avg", "tab:blue"), (width / 2, "best", "tab:orange")):
        means = [row[key][0] * 100 for row in rows]
        stds = [row[key][1] * 100 for row in rows]
        xs = [i + offset for i in range(len(arms))]
        drawn = bars.bar(xs, means, width, yerr=stds, capsize=4, color=colour, alpha=0.75,
                         label=f"{key}@{k}")
        bars.bar_label(drawn, fmt="%.1f", fontsize=7, padding=2)
        for x, arm in zip(xs, arms):
            ys = [r.final[key] * 100 for r in results if r.arm == arm and key in r.final]
            bars.scatter([x] * len(ys), ys, color="black", s=10, zorder=3)
    bars.set_xticks(range(len(arms)), [a.replace("+", "\n+").strip() for a in arms], fontsize=8)
    bars.set_ylabel("held-out success (%)")
    bars.set_title("held-out original tasks, mean ± std over seeds (dots: seeds)")
    bars.legend()
    for arm in arms[1:] if arms and arms[0] == "zero-shot" else arms:
        done = [r for r in results if r.arm == arm and r.final and r.warm]
        if done:
            ys = [mean_std([r.base.get("avg", math.nan) for r in done])[0] * 100,
                  mean_std([r.warm["avg"] for r in done])[0] * 100,
                  mean_std([r.final["avg"] for r in done])[0] * 100]
            stages.plot([0, 1, 2], ys, marker="o", label=arm)
    stages.set_xticks([0, 1, 2], ["zero-shot", "warm-start", "after RL"])
    stages.set_ylabel(f"held-out avg@{k} (%)")
    stages.set_title("where the gain comes from")
    if stages.get_legend_handles_labels()[0]:  # nothing finished yet: no lines to name
        stages.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the doc ---------------------------------------------------------------------------------

BEGIN = "<!-- ablation:begin (written by `autodidact ablation`; text outside is kept) -->"
END = "<!-- ablation:end -->"


def section(results: list[Result], rows: list[dict], k: int, command: str, plot_name: str,
            budget: Budget, sets: list[str], nav_sets: tuple[str, ...] = ()) -> str:
    shared = shared_sets(k, budget, sets)
    nav_text = f" The arms that navigate also: `{' '.join(nav_sets)}`." if nav_sets else ""
    seeds = sorted({r.seed for r in results})
    failed = [r for r in results if r.error and r.error != NOT_RUN]
    pending = [r for r in results if r.error == NOT_RUN]
    minutes = sum(r.seconds for r in results) / 60
    lines = [
        BEGIN, "",
        f"Made by `{command}` on {date.today().isoformat()}: {len(seeds)} seed(s) "
        f"({', '.join(map(str, seeds))}), {budget.updates} RL updates per run, "
        f"{minutes:.0f} min of runs in all on {_machine()}, one run at a time.",
        "",
        "Every arm trains only on tasks the agent wrote itself (`tasks.synthetic_share=1.0`) "
        "and is scored on the built-in env's held-out original tasks: success in percent, "
        f"avg@{k} and best@{k} over {k} sampled episodes per task, greedy with temperature 0. "
        f"Settings shared by every run: `{' '.join(shared)}`.{nav_text}",
        "", table(rows, k), "",
        f"The change against {REFERENCE} is paired by seed (the same seed builds the same base "
        "model, explores the same way and evaluates the same tasks); the reading claims a "
        "direction only when every seed agrees and the mean change exceeds its spread.",
        "", "Per seed:", "", per_seed_table(results, k), "",
        f"![ablation]({plot_name})", ""]
    if failed:
        lines += ["Runs that failed: " + "; ".join(f"{r.arm} seed {r.seed} ({r.error})"
                                                    for r in failed), ""]
    if pending:
        lines += [f"Not run yet ({len(pending)} of {len(results)}; the same command without "
                  "`--no-run` runs them): " + ", ".join(f"{r.arm} seed {r.seed}"
                                                        for r in pending), ""]
    return "\n".join([*lines, END])


def _machine() -> str:
    import os

    return f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"


def write_doc(doc: Path, body: str) -> None:
    """Replace the generated section of ``doc`` (or create the doc), keeping the rest."""
    old = doc.read_text() if doc.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + body + rest.split(END, 1)[1]
    else:
        new = (old.rstrip() + "\n\n" if old else "# Ablation\n\n") + body + "\n"
    doc.write_text(new)



# --- the outputs -----------------------------------------------------------------------------


def write_outputs(results: list[Result], plan: Plan, doc: Path, command: str) -> Path:
    """The doc's generated section, its plot, and its json: the table's rows and every cell,
    the records a later call reuses. Returns the plot's path."""
    rows = summarize(results, plan.k)
    doc.parent.mkdir(parents=True, exist_ok=True)
    plot_path = plot(results, rows, plan.k, doc.with_suffix(".png"))
    write_doc(doc, section(results, rows, plan.k, command, plot_path.name, plan.budget,
                           plan.sets, plan.nav_sets))
    doc.with_suffix(".json").write_text(json.dumps(
        {"budget": {"updates": plan.budget.updates,
                    "sets": shared_sets(plan.k, plan.budget, plan.sets),
                    "nav_sets": list(plan.nav_sets)},
         "run_seconds": sum(r.seconds for r in results), "rows": _no_nan(rows),
         "runs": [{**r.__dict__, "run_dir": _shown_path(r.run_dir)} for r in results],
         "other_records": plan.records.others(results) if plan.records else []},
        indent=1, default=str))
    return plot_path


def _no_nan(value):
    """``value`` with NaN (a statistic of nothing) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def _shown_path(path: Path | None) -> str | None:
    """``path`` relative to the working directory when inside it (for a committed doc)."""
    if path is None:
        return None
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def overlay(results: list[Result], out: Path) -> None:
    """``autodidact report`` of the first seed's runs, overlaid, in ``OUT/report``."""
    from autodidact.report import make_report

    first = min((r.seed for r in results), default=None)
    runs = [r for r in results if r.seed == first and r.run_dir and r.final
            and RunDir(r.run_dir).summary.exists()]  # a recorded cell's directory may be gone
    if len(runs) < 1:
        return
    path = make_report([r.run_dir for r in runs], [r.arm for r in runs], out / "report")
    click.echo(f"training curves of seed {first}, overlaid: {path / 'report.md'}")
