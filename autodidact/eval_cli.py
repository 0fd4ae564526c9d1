"""``autodidact eval``: avg@k and best@k of a model (or the reference solutions) on an env's
held-out tasks, through the same rollout code the actors train with.

Writes one JSON line per task as each batch ends, a summary next to it (with the settings it
was made with, ``"complete": false`` until the last batch), and prints a table per category.
``--resume`` continues an interrupted evaluation: tasks already in the file with the same
settings are not run again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import click

from autodidact.base_model import prepare_model
from autodidact.cli_common import check_model, config_option, load, load_run, set_option
from autodidact.engine_env import ensure_engine
from autodidact.resolve import Flags, set_keys
from autodidact.stages import record_test_look, write_split
from inference.models import model_folder
from metrics.intervals import format_rate
from protocol.config import RunConfig
from protocol.errors import ConfigError
from protocol.messages import SPLITS
from protocol.run_dir import RunDir


@click.command("eval")
@config_option
@set_option("env.max_turns=40")
@click.option("--env", "env_name", default=None,
              help="Environment (default: the config's env.name). Without -c, the env's own "
                   "rollout limits apply (bfcl: long contexts and actions).")
@click.option("--split", type=click.Choice(SPLITS), default="validation", show_default=True,
              help="validation: where settings are chosen; test: look once, at the end (the "
                   "look is recorded in the run directory's eval/test_looks.jsonl).")
@click.option("--model", "model_path", default=None,
              help="Local Hugging Face model folder, or a named model (smollm2-135m) "
                   "(default: the run's model.path, else its tiny model, made from the env's "
                   "vocabulary if missing).")
@click.option("-k", "k", type=int, default=8, show_default=True, help="Episodes per task.")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature (default eval.temperature; 0 = greedy).")
@click.option("--policy", type=click.Choice(["model", "ground-truth"]), default="model",
              show_default=True,
              help="ground-truth replays each task's reference actions (should score 100%).")
@click.option("--limit", type=int, default=0, help="Evaluate only this many tasks (0 = all).")
@click.option("--per-category", type=click.IntRange(min=0), default=0,
              help="Evaluate this many tasks of each category (0 = all), drawn with the seed.")
@click.option("--device", default=None, help="Torch device (default actor.device).")
@click.option("--batch-tasks", type=int, default=32, show_default=True,
              help="Tasks rolled out together (batch = batch-tasks x k episodes).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default runs/<name>): the tiny model, split.json, eval/.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Per-task JSONL (default <run-dir>/eval/<env>-<split>-<policy>-k<k>.jsonl).")
@click.option("--final-test", is_flag=True,
              help="A finished run's one look at test, for a run made without --final-test: "
                   "its base, warm-start and final policies on test with the run's own "
                   "settings (its config.yaml; --set still applies), into its summary.json. "
                   "Needs --run-dir; refused once the run has looked at test.")
@click.option("--resume", is_flag=True,
              help="Keep the tasks --out already holds from an evaluation with the same "
                   "settings and run only the rest (a larger --per-category holds a smaller "
                   "one's tasks).")
def eval_command(config, sets, env_name, split, model_path, k, temperature, policy, limit,
                 per_category, device, batch_tasks, run_dir, out, final_test, resume):
    """Evaluate on the env's held-out tasks: avg@k and best@k, overall and per category.

    \b
    autodidact eval --env bfcl -k 8                      tiny local model (near zero)
    autodidact eval --env bfcl --policy ground-truth -k 1  the harness itself: 100%
    autodidact eval --env bfcl --model /models/Qwen2.5-7B-Instruct --device cuda -k 8
    """
    if k < 1:
        raise click.UsageError("-k must be at least 1")
    if final_test:
        look_at_test_later(run_dir, sets)
        return
    cfg, path = load_run(config, sets, run_dir,
                         Flags(env=env_name, env_limits=config is None, device=device))
    check_model(model_path or cfg.model.path)
    if policy == "model":
        ensure_engine(cfg)
    try:
        summary = run_eval(cfg, path, split, model_path, k, temperature, policy, limit,
                           batch_tasks, out, per_category=per_category, resume=resume,
                           own_limits=config is None and "env.max_context" not in set_keys(sets))
    except (KeyError, ValueError, RuntimeError, OSError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(render_table(summary))


def look_at_test_later(run_dir: str | None, sets: tuple[str, ...]) -> None:
    """``--final-test``: :func:`autodidact.stages.final_test_later` on the run's own config."""
    from autodidact.stages import final_test_later

    if not run_dir:
        raise click.UsageError("--final-test needs --run-dir: the finished run to look at")
    rd = RunDir(Path(run_dir).resolve())
    if not rd.config.exists():
        raise click.UsageError(f"--run-dir {run_dir}: no config.yaml; is it a run directory?")
    cfg = load(str(rd.config), sets)
    try:
        test = final_test_later(cfg, rd.path, say)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for stage, result in test.items():
        click.echo(f"test {stage}: avg@{cfg.eval.k} {format_rate(result['avg'], result['avg_ci'])}"
                   f" on {result['tasks']} tasks")


def run_eval(cfg: RunConfig, run_dir: Path, split: str, model_path: str | None, k: int,
             temperature: float | None, policy: str, limit: int, batch_tasks: int,
             out: str | None, per_category: int = 0, resume: bool = False,
             own_limits: bool = False) -> dict:
    """:func:`episodes.evaluate.evaluate_model` with ``autodidact eval``'s presentation:
    progress lines, per-task JSONL written batch by batch and a summary beside it; returns
    the summary. A sampling model's context is checked first
    (:func:`autodidact.resolve.check_context`; ``own_limits``: a larger ``env.max_context``
    the env declares is taken, for a command without a config file)."""
    from autodidact.resolve import check_context
    from environments.base import env_maker
    from episodes.evaluate import (
        evaluate_model,
        model_positions,
        per_env,
        select_tasks,
        summarize,
    )

    env = env_maker(cfg.env)()
    name = cfg.env.label()  # an env mix: files+shop
    write_split(run_dir, env)
    tasks = select_tasks(cfg, split, limit, env, per_category=per_category)
    if not tasks:
        raise ValueError(f"env {name!r} has no {split} tasks")
    model_path = model_folder(model_path) if model_path else prepare_model(cfg, run_dir)
    if policy == "model":  # replayed references are never read by a model: no context guard
        cfg = check_context(cfg, model_path, tasks[0], own_limits,
                            positions=model_positions(model_path))
    temperature = cfg.eval.temperature if temperature is None else temperature
    settings = {"env": name, "split": split, "policy": policy, "model": model_path,
                "k": k, "temperature": temperature, "seed": cfg.seed,
                "backend": cfg.actor.backend, "env_settings": dataclasses.asdict(cfg.env)}
    results = EvalResults(out or RunDir(run_dir).eval_results(name, split, policy, k),
                          settings)
    kept = results.start({t.task_id for t in tasks}, resume)
    done = {r["task_id"] for r in kept}
    todo = [t for t in tasks if t.task_id not in done]
    say(f"eval: {len(tasks)} {name} {split} tasks x {k} ({policy}, model {model_path}, "
        f"T={temperature}, backend {cfg.actor.backend}, device {cfg.actor.device})"
        + (f"; {len(kept)} kept from {results.path}" if resume else ""))
    t0 = time.monotonic()
    new: list[dict] = []

    def on_batch(records: list[dict]) -> None:
        new.extend(records)
        results.append(records)
        say(f"eval: {len(kept) + len(new)}/{len(tasks)} tasks "
            f"({time.monotonic() - t0:.0f}s)")

    if todo:
        evaluate_model(cfg, model_path, split, k=k, temperature=temperature, tasks=todo,
                       policy=policy, batch_tasks=batch_tasks, on_batch=on_batch)
    summary = {**settings, "complete": True, "seconds": time.monotonic() - t0,
               "kept_from_before": len(kept), **with_intervals(summarize(kept + new)),
               **per_env(kept + new)}  # an env mix: each env's, and the mean over envs
    results.finish(summary)
    if split == "test":
        record_test_look(run_dir, "autodidact eval --split test", model_path)
    return summary


def with_intervals(result: dict) -> dict:
    """:func:`episodes.evaluate.summarize`'s result without its per-task records, and with
    95% intervals beside avg@k and best@k, overall and per category."""
    from episodes.evaluate import success_intervals

    records = result["per_task"]
    categories = {name: {**stats, **success_intervals([r for r in records
                                                        if r["category"] == name])}
                  for name, stats in result["categories"].items()}
    rest = {key: v for key, v in result.items() if key != "per_task"}
    return {**rest, **success_intervals(records), "categories": categories}


class EvalResults:
    """The per-task JSONL and its summary. The summary holds the settings from the first
    batch on (``complete`` false until the end), so an interrupted evaluation is known by
    what made it and ``--resume`` keeps only records the same settings produced."""

    def __init__(self, path, settings: dict):
        self.path = Path(path)
        self.summary_path = self.path.with_suffix(".summary.json")
        self.settings = settings

    def start(self, task_ids: set[str], resume: bool) -> list[dict]:
        """Records to keep (with ``resume``: those of ``task_ids`` already on disk); the file
        is rewritten to hold exactly them."""
        kept = self._previous(task_ids) if resume else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write_summary({**self.settings, "complete": False})
        with self.path.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        return kept

    def _previous(self, task_ids: set[str]) -> list[dict]:
        if not self.path.exists():
            return []
        try:
            before = json.loads(self.summary_path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--resume: {self.summary_path} is unreadable ({exc}); drop "
                             f"--resume to start over") from None
        changed = sorted(key for key in self.settings if before.get(key) != self.settings[key])
        if changed:
            raise ValueError(f"--resume: {self.path} was made with other settings "
                             f"({', '.join(changed)}); drop --resume to start over, or pass "
                             f"--out for a new file")
        records = {}
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the line a kill cut short: that task runs again
            if record.get("task_id") in task_ids:
                records[record["task_id"]] = record
        return list(records.values())

    def append(self, records: list[dict]) -> None:
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())

    def finish(self, summary: dict) -> None:
        self._write_summary(summary)
        say(f"eval: per-task results in {self.path}, summary in {self.summary_path}")

    def _write_summary(self, summary: dict) -> None:
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, self.summary_path)


def render_table(summary: dict) -> str:
    """avg@k with its 95% interval, best@k and the valid-action rate, per category and
    overall."""
    k = summary["k"]
    rows = [(name, s) for name, s in summary["categories"].items()] + [("overall", summary)]
    width = max(len(name) for name, _ in rows)
    avg_width = len("100.0% (95% 100.0–100.0)")
    lines = [f"{'category':<{width}}  {'tasks':>5}  {f'avg@{k} (95% interval)':>{avg_width}}  "
             f"{f'best@{k}':>7}  {'valid actions':>13}"]
    lines += [f"{name:<{width}}  {s['tasks']:>5}  "
              f"{format_rate(s['avg'], s.get('avg_ci', (math.nan, math.nan))):>{avg_width}}  "
              f"{s['best']:>7.1%}  {s.get('valid_action_rate', 0.0):>13.1%}"
              for name, s in rows]
    return "\n".join(lines)


def say(message: str) -> None:
    click.echo(message, err=True)
    sys.stderr.flush()
