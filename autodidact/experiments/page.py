"""What ``autodidact ablation`` writes (``autodidact/experiments/arms.py`` runs the cells): the
table (mean ± std over seeds, avg@k's 95% interval, and each arm's change against the reference
with its paired 95% interval and the label read off it), its plot, the doc's generated section
between markers (text outside them is kept), the doc's json (the rows and every cell with its
per-task outcomes: the records a later call goes on from) and the seed-0 runs overlaid with
``autodidact report``. ``--from-json`` writes the section, plot and json again from the json
alone (:func:`rewrite_from_json`).

The intervals (``metrics/intervals.py``) are over tasks and samples where the cells kept
per-task records (every seed's tasks pooled; a change paired task by task, as the same seed
evaluates the same tasks), else Student's t over the seeds' numbers, marked in the table.
"""

from __future__ import annotations

import json
import math
import platform
from datetime import date
from pathlib import Path

import click

from autodidact.experiments.arms import (
    NOT_RUN,
    REFERENCE,
    Plan,
    Result,
    recorded_result,
    shared_sets,
)
from metrics.intervals import (
    LEVEL,
    effect_label,
    format_diff,
    format_rate,
    paired_interval,
    rate_interval,
    seed_interval,
    seed_paired_interval,
    t_quantile,
)
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
    return [b.final[key] - a.final[key] for a, b in reference_pairs(results, arm)
            if key in a.final and key in b.final]


def reference_pairs(results: list[Result], arm: str) -> list[tuple[Result, Result]]:
    """(reference, ``arm``) of every seed both finished: the same seed builds the same base
    model and evaluates the same tasks, so the two are compared task by task."""
    ref = {r.seed: r for r in results if r.arm == REFERENCE and r.final}
    return [(ref[r.seed], r) for r in results if r.arm == arm and r.final and r.seed in ref]


def pooled(results: list[Result], stage: str) -> dict[str, list[float]] | None:
    """Every result's per-task outcomes of ``stage`` as one sample (task ids prefixed by the
    seed, as each seed draws its own tasks); None unless every result kept them."""
    kept = [(r.seed, r.per_task(stage)) for r in results]
    if not kept or any(tasks is None for _, tasks in kept):
        return None
    return {f"seed {seed}/{task}": outcomes for seed, tasks in kept
            for task, outcomes in tasks.items()}


def rate_over_seeds(results: list[Result], stage: str = "final") -> dict:
    """avg@k of ``stage`` over the results' seeds: ``{"value": the mean over seeds, "low",
    "high", "over"}``; the 95% interval is over tasks and samples (every seed's records
    pooled) where every seed kept per-task records, else Student's t over the seeds."""
    values = [getattr(r, stage)["avg"] for r in results if "avg" in getattr(r, stage)]
    value = mean_std(values)[0]
    tasks = pooled(results, stage)
    if tasks:
        low, high = rate_interval(list(tasks.values()))
        return {"value": value, "low": low, "high": high, "over": "tasks"}
    low, high = seed_interval(values)
    if not math.isnan(low):  # t knows nothing of rates: kept within 0 and 1
        low, high = max(low, 0.0), min(high, 1.0)
    return {"value": value, "low": low, "high": high, "over": "seeds"}


def change_over_seeds(pairs: list[tuple[Result, Result]], a_stage: str = "final",
                      b_stage: str = "final") -> dict:
    """B - A avg@k over ``pairs`` (A's ``a_stage`` and B's ``b_stage``, one pair per seed):
    ``{"value", "low", "high", "over", "label"}``. Paired bootstrap over the seeds' pooled
    tasks where both sides kept per-task records, else Student's t over the per-seed
    differences; the label is the interval's (:func:`metrics.intervals.effect_label`)."""
    pairs = [(a, b) for a, b in pairs if "avg" in getattr(a, a_stage)
             and "avg" in getattr(b, b_stage)]
    if not pairs:
        return {"value": math.nan, "low": math.nan, "high": math.nan, "over": "",
                "label": "nothing to compare"}
    before = pooled([a for a, _ in pairs], a_stage)
    after = pooled([b for _, b in pairs], b_stage)
    if before and after:
        found = paired_interval(before, after)
        change = {"value": found["diff"], "low": found["low"], "high": found["high"],
                  "over": "tasks"}
    else:
        diffs = [getattr(b, b_stage)["avg"] - getattr(a, a_stage)["avg"] for a, b in pairs]
        low, high = seed_paired_interval(diffs)
        change = {"value": mean_std(diffs)[0], "low": low, "high": high, "over": "seeds"}
    if math.isnan(change["low"]):
        label = "no interval (one seed, no per-task records)"
    else:
        label = effect_label(change["low"], change["high"])
    return {**change, "label": label}


def summarize(results: list[Result], k: int) -> list[dict]:
    """One row per arm: mean ± std over seeds, avg@k's 95% interval, the RL gain and the
    change against the reference arm with their paired intervals and the reading of each."""
    rows = []
    for arm in dict.fromkeys(r.arm for r in results):
        done = [r for r in results if r.arm == arm and r.final]
        row = {"arm": arm, "seeds": len(done)}
        for key in ("avg", "best", "greedy"):
            row[key] = mean_std([r.final[key] for r in done if key in r.final])
        row["avg_ci"] = rate_over_seeds(done)
        row["warm"] = mean_std([r.warm["avg"] for r in done if "avg" in r.warm])
        row["rl_gain"] = change_over_seeds([(r, r) for r in done], "warm", "final")
        row["updates"] = mean_std([float(r.updates) for r in done if r.run_dir])
        row["minutes"] = mean_std([r.seconds / 60 for r in done if r.seconds])
        if arm != REFERENCE and arm != "zero-shot":
            row["change"] = change_over_seeds(reference_pairs(results, arm))
            row["verdict"] = row["change"]["label"]
        rows.append(row)
    return rows


OVER_SEEDS = "†"  # marks an interval over seeds (no per-task records), not over tasks


def _pm(pair: tuple[float, float], scale: float = 100.0, spec: str = ".1f") -> str:
    mean, std = pair
    if math.isnan(mean):
        return "–"
    return f"{mean * scale:{spec}} ± {std * scale:{spec}}"


def rate_text(rate: dict) -> str:
    """A rate of :func:`rate_over_seeds` with its interval (marked when over seeds)."""
    if math.isnan(rate["value"]):
        return "–"
    return format_rate(rate["value"], (rate["low"], rate["high"])) + _mark(rate)


def _interval_cell(rate: dict) -> str:
    if math.isnan(rate["low"]):
        return "–"
    return f"{100 * rate['low']:.1f}–{100 * rate['high']:.1f}" + _mark(rate)


def change_text(change: dict) -> str:
    """A change of :func:`change_over_seeds` with its interval (marked when over seeds)."""
    if math.isnan(change["value"]):
        return "–"
    return format_diff(change["value"], (change["low"], change["high"])) + _mark(change)


def _mark(interval: dict) -> str:
    return f" {OVER_SEEDS}" if interval["over"] == "seeds" else ""


def table(rows: list[dict], k: int) -> str:
    """The markdown table: success in percent, mean ± std over seeds; avg@k's 95% interval,
    and the changes with their paired 95% intervals and readings (:mod:`metrics.intervals`)."""
    lines = [f"| setting | seeds | avg@{k} | avg@{k} 95% interval | best@{k} | greedy | "
             f"Δ avg@{k} vs {REFERENCE} (paired, 95% interval) | reading | after warm-start "
             f"avg@{k} | RL gain: after RL − warm-start (paired, 95% interval) | RL updates | "
             "minutes per run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        trained = row["arm"] != "zero-shot"
        lines.append(" | ".join([
            f"| {row['arm']}", str(row["seeds"]), _pm(row["avg"]), _interval_cell(row["avg_ci"]),
            _pm(row["best"]), _pm(row["greedy"]),
            change_text(row["change"]) if "change" in row else "",
            row.get("verdict", "reference" if row["arm"] == REFERENCE else ""),
            _pm(row["warm"]) if trained else "",
            f"{change_text(row['rl_gain'])}: {row['rl_gain']['label']}" if trained else "",
            _pm(row["updates"], 1.0, ".0f") if trained else "",
            _pm(row["minutes"], 1.0) if trained else ""]) + " |")
    return "\n".join(lines)


def held_out_line(result: Result) -> str:
    """One run's held-out avg@k after the warm-start and after RL with their intervals, and
    RL's change with its paired interval and label (for the benches that print runs)."""
    gain = change_over_seeds([(result, result)], "warm", "final")
    return (f"warm-start {rate_text(rate_over_seeds([result], 'warm'))} -> RL "
            f"{rate_text(rate_over_seeds([result]))}; RL − warm-start {change_text(gain)}: "
            f"{gain['label']}")


def comparison_line(a: Result, b: Result) -> str:
    """``b`` − ``a`` held-out avg@k after RL (two runs of one seed, so the same tasks), with
    its paired interval and label."""
    change = change_over_seeds([(a, b)])
    return f"{b.arm} − {a.arm} held-out avg@k after RL: {change_text(change)}: {change['label']}"


def per_seed_table(results: list[Result], k: int) -> str:
    """avg@k (with its interval where the run kept one) / best@k of every cell, and, where
    per-task records were kept, each arm's paired change against the reference on that seed."""
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
                cells.append(f"{_seed_rate(r)} / {r.final['best']:.1%}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seed_rate(result: Result) -> str:
    """One cell's avg@k, with the interval of its own evaluation where its records were kept."""
    if result.per_task("final"):
        return rate_text(rate_over_seeds([result]))
    return f"{result.final['avg']:.1%}"


def per_seed_changes(results: list[Result], k: int) -> str:
    """Each arm against the reference, seed by seed, with the paired interval of the seed's
    own evaluations; empty where no seed kept per-task records."""
    seeds = sorted({r.seed for r in results})
    lines = []
    for arm in dict.fromkeys(r.arm for r in results if r.arm not in (REFERENCE, "zero-shot")):
        pairs = {a.seed: (a, b) for a, b in reference_pairs(results, arm)}
        cells = [_seed_change(pairs.get(s)) for s in seeds]
        if any(cell != "–" for cell in cells):
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    return "\n".join([f"| Δ avg@{k} vs {REFERENCE} | "
                      + " | ".join(f"seed {s} (paired, 95% interval)" for s in seeds) + " |",
                      "|---|" + "---|" * len(seeds), *lines])


def _seed_change(pair: tuple[Result, Result] | None) -> str:
    if pair is None or not pair[0].per_task("final") or not pair[1].per_task("final"):
        return "–"
    change = change_over_seeds([pair])
    return f"{change_text(change)}: {change['label']}"


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


def section(results: list[Result], rows: list[dict], k: int, plot_name: str, setup: dict,
            made: dict | None, rewritten: dict | None = None) -> str:
    """The doc's generated section. ``setup``: the json's ``budget`` (``updates``, the shared
    ``sets``, ``nav_sets``); ``made``: the command, date and machine of the call that wrote the
    cells; ``rewritten``: the command and date that wrote the table again from the json."""
    nav_text = f" The arms that navigate also: `{' '.join(setup['nav_sets'])}`." \
        if setup.get("nav_sets") else ""
    seeds = sorted({r.seed for r in results})
    failed = [r for r in results if r.error and r.error != NOT_RUN]
    pending = [r for r in results if r.error == NOT_RUN]
    minutes = sum(r.seconds for r in results) / 60
    origin = (f"Made by `{made['command']}` on {made['date']}" if made
              else "Made by `autodidact ablation` (its command and date were not recorded)")
    machine = f" on {made['machine']}" if made and made.get("machine") else ""
    lines = [
        BEGIN, "",
        f"{origin}: {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {setup['updates']} RL "
        f"updates per run, {minutes:.0f} min of runs in all{machine}, one run at a time.",
        ""]
    if rewritten:
        lines += [f"The table was written again on {rewritten['date']} by "
                  f"`{rewritten['command']}` from the cells its json records (nothing was run "
                  "again).", ""]
    changes = per_seed_changes(results, k)
    lines += [
        "Every arm trains only on tasks the agent wrote itself (`tasks.synthetic_share=1.0`) "
        "and is scored on the built-in env's held-out original tasks: success in percent, "
        f"avg@{k} and best@{k} over {k} sampled episodes per task, greedy with temperature 0. "
        f"Settings shared by every run: `{' '.join(setup['sets'])}`.{nav_text} "
        + held_out_text(results),
        "", table(rows, k), "",
        intervals_text(rows),
        "", "Per seed:", "", per_seed_table(results, k), "",
        *([changes, ""] if changes else []),
        f"![ablation]({plot_name})", ""]
    if failed:
        lines += ["Runs that failed: " + "; ".join(f"{r.arm} seed {r.seed} ({r.error})"
                                                    for r in failed), ""]
    if pending:
        lines += [f"Not run yet ({len(pending)} of {len(results)}; the same command without "
                  "`--no-run` runs them): " + ", ".join(f"{r.arm} seed {r.seed}"
                                                        for r in pending), ""]
    return "\n".join([*lines, END])


def held_out_text(results: list[Result]) -> str:
    """Which tasks were held out: the split the runs' records name, and for cells made before
    held-out splits were named, that their tasks shared worlds with training."""
    finished = [r for r in results if r.final and r.arm != "zero-shot"]  # the runs' own
    splits = sorted({r.final["split"] for r in finished if r.final.get("split")})
    older = [r for r in finished if not r.final.get("split")]
    text = f"Held out: the env's `{'`, `'.join(splits)}` split. " if splits else ""
    if older:
        text += ("The cells made before held-out splits were named (issue 36) held out tasks, "
                 "not worlds: their held-out tasks ran in the same worlds (file trees) as "
                 "training tasks, so their numbers and intervals say nothing about unseen "
                 "worlds.")
    return text.strip()


def intervals_text(rows: list[dict]) -> str:
    """How the table's intervals were taken and read."""
    shown = [interval for row in rows
             for interval in (row["avg_ci"], row["rl_gain"], row.get("change"))
             if interval and not math.isnan(interval["value"])]
    over_seeds = any(interval["over"] == "seeds" for interval in shown)
    text = ("Every interval is 95% (`metrics/intervals.py`, docs/benchmarks.md). Where the runs "
            "kept per-task records, avg@k's interval is a bootstrap over the seeds' held-out "
            "tasks and each task's samples, and a change's is paired: the same seed evaluates "
            "the same tasks, so every draw takes the same tasks for both sides. The reading is "
            "the label of the paired interval alone: helps (above 0), hurts (below 0), no change "
            "(it holds 0); never the sign of the means.")
    if over_seeds:
        text += (f" {OVER_SEEDS} marks an interval over seeds instead: the cells recorded only "
                 "per-seed numbers (no per-task records), so it is Student's t over the seeds, "
                 "which also holds training's seed-to-seed spread")
        seeds = max(row["seeds"] for row in rows)
        text += (f" (with {seeds} seeds: {seeds - 1} degrees of freedom, t = "
                 f"{t_quantile(LEVEL, seeds - 1):.2f})." if seeds > 1 else ".")
    return text


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
    setup = {"updates": plan.budget.updates, "sets": shared_sets(plan.k, plan.budget, plan.sets),
             "nav_sets": list(plan.nav_sets)}
    made = {"command": command, "date": date.today().isoformat(), "machine": _machine()}
    return _publish(results, plan.k, doc, setup, made,
                    plan.records.others(results) if plan.records else [])


def rewrite_from_json(doc: Path, command: str) -> tuple[Path, str]:
    """The doc's section, plot and json written again from the cells its json records (what
    ``autodidact ablation --from-json`` does): the table read with today's code, nothing run,
    no run directory read. Returns the plot's path and the table."""
    data = json.loads(doc.with_suffix(".json").read_text())
    results = [recorded_result(record) for record in data["runs"]]
    setup = data["budget"]
    k = recorded_k(setup["sets"])
    rewritten = {"command": command, "date": date.today().isoformat()}
    plot_path = _publish(results, k, doc, setup, data.get("made"),
                         data.get("other_records", []), rewritten)
    return plot_path, table(summarize(results, k), k)


def recorded_k(sets: list[str]) -> int:
    """The episodes per task of a recorded ablation: its shared settings hold ``eval.k``
    (``arms.common``)."""
    return next(int(s.split("=", 1)[1]) for s in sets if s.startswith("eval.k="))


def _publish(results: list[Result], k: int, doc: Path, setup: dict, made: dict | None,
             others: list[dict], rewritten: dict | None = None) -> Path:
    rows = summarize(results, k)
    doc.parent.mkdir(parents=True, exist_ok=True)
    plot_path = plot(results, rows, k, doc.with_suffix(".png"))
    write_doc(doc, section(results, rows, k, plot_path.name, setup, made, rewritten))
    doc.with_suffix(".json").write_text(json.dumps(
        {"budget": setup, "made": made, **({"rewritten": rewritten} if rewritten else {}),
         "run_seconds": sum(r.seconds for r in results), "rows": no_nan(rows),
         "runs": [{**r.__dict__, "run_dir": _shown_path(r.run_dir)} for r in results],
         "other_records": others},
        indent=1, default=str))
    return plot_path


def no_nan(value):
    """``value`` with NaN (a statistic of nothing) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [no_nan(v) for v in value]
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
