"""``autodidact eval``: avg@k and best@k of a model (or the reference solutions) on an env's
held-out tasks, through the same rollout code the actors train with.

Writes one JSON line per task and a summary next to it, and prints a table per category.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import click

from protocol.config import RunConfig

# Same texts as autodidact.cli's (cli.py imports this module, so importing back is circular).
CONFIG_HELP = "YAML config file (default: embedded defaults, as in configs/default.yaml)."
SET_HELP = "Override one config value, e.g. --set env.max_turns=40 (repeatable)."


@click.command("eval")
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--env", "env_name", default=None,
              help="Environment (default: the config's env.name). Without -c, the env's own "
                   "rollout limits apply (bfcl: long contexts and actions).")
@click.option("--split", type=click.Choice(["test", "train"]), default="test", show_default=True)
@click.option("--model", "model_path", default=None,
              help="Local Hugging Face model folder (default: the run's tiny model, made from "
                   "the env's vocabulary if missing).")
@click.option("-k", "k", type=int, default=8, show_default=True, help="Episodes per task.")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature (default eval.temperature; 0 = greedy).")
@click.option("--policy", type=click.Choice(["model", "ground-truth"]), default="model",
              show_default=True,
              help="ground-truth replays each task's reference actions (should score 100%).")
@click.option("--limit", type=int, default=0, help="Evaluate only this many tasks (0 = all).")
@click.option("--device", default=None, help="Torch device (default actor.device).")
@click.option("--batch-tasks", type=int, default=32, show_default=True,
              help="Tasks rolled out together (batch = batch-tasks x k episodes).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default runs/<name>): the tiny model, split.json, eval/.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Per-task JSONL (default <run-dir>/eval/<env>-<split>-<policy>-k<k>.jsonl).")
def eval_command(config, sets, env_name, split, model_path, k, temperature, policy, limit,
                 device, batch_tasks, run_dir, out):
    """Evaluate on the env's held-out tasks: avg@k and best@k, overall and per category.

    \b
    autodidact eval --env bfcl -k 8                      tiny local model (near zero)
    autodidact eval --env bfcl --policy ground-truth -k 1  the harness itself: 100%
    autodidact eval --env bfcl --model /models/Qwen2.5-7B-Instruct --device cuda -k 8
    """
    from autodidact.cli import _load, resolve_run_dir

    if k < 1:
        raise click.UsageError("-k must be at least 1")
    cfg = _load(config, sets)
    if env_name:
        _use_env(cfg, env_name, env_defaults=config is None)
    if device:
        cfg.actor.device = device
    path = resolve_run_dir(cfg, run_dir)
    try:
        summary = run_eval(cfg, path, split, model_path, k, temperature, policy, limit,
                           batch_tasks, out)
    except (KeyError, ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(render_table(summary))


def _use_env(cfg: RunConfig, name: str, env_defaults: bool) -> None:
    from environments import env_class

    cls = env_class(name)
    if name != cfg.env.name:
        cfg.env.name, cfg.env.options = name, {}
    if env_defaults:
        limits = dict(getattr(cls, "default_limits", {}))
        cfg.actor.max_action_tokens = limits.pop("max_action_tokens",
                                                 cfg.actor.max_action_tokens)
        for key, value in limits.items():
            setattr(cfg.env, key, value)


def run_eval(cfg: RunConfig, run_dir: Path, split: str, model_path: str | None, k: int,
             temperature: float | None, policy: str, limit: int, batch_tasks: int,
             out: str | None) -> dict:
    from autodidact.launcher import prepare_model, write_split
    from environments.base import env_maker
    from episodes.evaluate import evaluate
    from episodes.rollout import rollout_settings

    make_env = env_maker(cfg.env)
    env = make_env()
    write_split(run_dir, env)
    tasks = env.tasks(split)
    if limit:
        tasks = random.Random(cfg.seed).sample(tasks, min(limit, len(tasks)))
    if not tasks:
        raise ValueError(f"env {cfg.env.name!r} has no {split} tasks")
    model_path = model_path or prepare_model(cfg, run_dir)
    settings = rollout_settings(cfg)
    # Replayed references are never read by a model: only a sampling model needs the guard.
    settings.max_context = (1 << 30 if policy == "ground-truth"
                            else min(settings.max_context, _model_positions(model_path)))
    temperature = cfg.eval.temperature if temperature is None else temperature
    say(f"eval: {len(tasks)} {cfg.env.name} {split} tasks x {k} ({policy}, model {model_path}, "
        f"T={temperature}, device {cfg.actor.device})")
    t0 = time.monotonic()

    def progress(done, total):
        say(f"eval: {done}/{total} tasks ({time.monotonic() - t0:.0f}s)")

    if policy == "ground-truth":
        from transformers import AutoTokenizer

        result = evaluate(None, tasks, make_env, settings, k=k, batch_tasks=batch_tasks,
                          seed=cfg.seed, policy=policy, progress=progress,
                          tokenizer=AutoTokenizer.from_pretrained(model_path))
    else:
        from inference.engines import make_backend

        with make_backend(cfg, model_path) as backend:
            result = evaluate(backend, tasks, make_env, settings, temperature=temperature, k=k,
                              batch_tasks=batch_tasks, seed=cfg.seed, progress=progress)
    summary = {"env": cfg.env.name, "split": split, "policy": policy, "model": model_path,
               "k": k, "temperature": temperature, "seconds": time.monotonic() - t0,
               **{key: v for key, v in result.items() if key != "per_task"}}
    write_results(out or run_dir / "eval" / f"{cfg.env.name}-{split}-{policy}-k{k}.jsonl",
                  result["per_task"], summary)
    return summary


def _model_positions(model_path: str) -> int:
    """The model's position limit, so the context guard never lets a prompt outgrow it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def write_results(path, per_task: list[dict], summary: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in per_task:
            f.write(json.dumps(record) + "\n")
    summary_path = path.with_suffix(".summary.json")
    summary_path.write_text(json.dumps(summary, indent=1))
    say(f"eval: per-task results in {path}, summary in {summary_path}")


def render_table(summary: dict) -> str:
    k = summary["k"]
    rows = [(name, s["tasks"], s["avg"], s["best"])
            for name, s in summary["categories"].items()]
    rows.append(("overall", summary["tasks"], summary["avg"], summary["best"]))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'category':<{width}}  {'tasks':>5}  {f'avg@{k}':>7}  {f'best@{k}':>7}"]
    lines += [f"{name:<{width}}  {n:>5}  {avg:>7.1%}  {best:>7.1%}"
              for name, n, avg, best in rows]
    return "\n".join(lines)


def say(message: str) -> None:
    click.echo(message, err=True)
    sys.stderr.flush()
