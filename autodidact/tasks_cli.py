"""``autodidact tasks ...``: inspect, count, export, re-verify and check for held-out tasks in
disguise the synthesized tasks of a run.

Every command opens ``<run-dir>/tasks.lmdb`` read-only, so it is safe while the explorer is
still writing to it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import click

from autodidact.cli_common import config_option, load, set_option
from protocol.errors import ConfigError, EnvFailed
from protocol.messages import Task
from protocol.run_dir import RunDir, StoreDamaged
from questioning.task_store import TaskStore

SHOW_FAILED = 5  # failing task ids listed per reason by `verify`

COLUMNS = ("task_id", "seed", "method", "steps", "difficulty", "query")


def run_dir_option(f):
    return click.option("--run-dir", type=click.Path(exists=True, file_okay=False),
                        required=True, help="Run directory holding tasks.lmdb.")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def tasks():
    """Inspect the run's synthesized tasks (<run-dir>/tasks.lmdb)."""


def _read_all(run_dir) -> list[Task]:
    try:
        with TaskStore(Path(run_dir), readonly=True) as store:
            return store.all()
    except (FileNotFoundError, StoreDamaged) as exc:
        raise click.ClickException(str(exc)) from None


def _as_dict(task: Task) -> dict:
    return dataclasses.asdict(task)


def _json(obj, indent: int | None = None) -> str:
    # Free-form meta may hold bytes (the codec allows them); JSON has no such type.
    return json.dumps(obj, indent=indent, ensure_ascii=False,
                      default=lambda o: o.hex() if isinstance(o, bytes) else str(o))


# --- list --------------------------------------------------------------------------------------


def _row(task: Task) -> list[str]:
    return [task.task_id, str(task.seed), str(task.meta.get("method", "")),
            str(len(task.reference)), f"{task.difficulty:g}", task.query]


def _table(rows: list[list[str]]) -> str:
    # The query goes last and unpadded: it is the long column, so it may run past the width.
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    lines = []
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(cells + [row[-1]]))
    return "\n".join(lines)


@tasks.command("list")
@run_dir_option
@click.option("--method", default=None, help="Only tasks made this way (meta.method).")
@click.option("--seed", type=int, default=None, help="Only tasks in this world seed.")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True,
              help="Show at most this many (0 = all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line instead.")
def list_tasks(run_dir, method, seed, limit, as_json):
    """A table of the stored tasks, oldest first."""
    found = [t for t in _read_all(run_dir)
             if (method is None or t.meta.get("method") == method)
             and (seed is None or t.seed == seed)]
    shown = found[:limit] if limit else found
    if as_json:
        for task in shown:
            click.echo(_json(_as_dict(task)))
        return
    if shown:
        click.echo(_table([list(map(str.upper, COLUMNS))] + [_row(t) for t in shown]))
    click.echo(f"{len(found)} tasks ({len(shown)} shown)")


# --- show and export ---------------------------------------------------------------------------


@tasks.command("show")
@click.argument("task_id")
@run_dir_option
def show(task_id, run_dir):
    """One task, whole, as indented JSON."""
    try:
        with TaskStore(Path(run_dir), readonly=True) as store:
            task = store.get(task_id)
    except (FileNotFoundError, StoreDamaged) as exc:
        raise click.ClickException(str(exc)) from None
    if task is None:
        raise click.ClickException(f"no task {task_id!r} in {RunDir(run_dir).task_store}")
    click.echo(_json(_as_dict(task), indent=2))


@tasks.command("export")
@run_dir_option
@click.option("--out", type=click.File("w", encoding="utf-8"), default="-",
              help="File to write (default: stdout).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "json"]), default="jsonl",
              show_default=True, help="One object per line, or one JSON array.")
def export(run_dir, out, fmt):
    """Every stored task, oldest first."""
    found = [_as_dict(t) for t in _read_all(run_dir)]
    if fmt == "json":
        out.write(_json(found, indent=2) + "\n")
    else:
        out.writelines(_json(d) + "\n" for d in found)
    click.echo(f"wrote {len(found)} tasks to {out.name}", err=True)


# --- verify ------------------------------------------------------------------------------------


def _verify_one(task: Task, cfg, run_env) -> str:
    from environments.base import task_env_of_run, verify_task

    # Only the run's env (served or not, with the config's options) verifies: a task of
    # another env is reported, never built, so the module its ``meta.env_spec`` names is not
    # imported. ``-c``/``--set env.name=...`` verifies another env's tasks.
    if not task_env_of_run(task, cfg.env):
        return f"other_env:{task.env!r}"
    try:
        ok, reason = verify_task(run_env, task, **dict(cfg.env.options))
    except Exception as exc:  # one broken task must not hide the verdict on the others
        return f"error:{type(exc).__name__}"
    return "ok" if ok else reason


def _run_config(config, sets, run_dir):
    """The config -c names, else the run's own config.yaml (which env, with which options,
    made its tasks), else the defaults; ``--set`` on top."""
    run_config = RunDir(run_dir).config
    return load(config or (str(run_config) if run_config.exists() else None), sets)


@tasks.command("verify")
@config_option
@set_option("env.options.KEY=VALUE")  # the env's own options, whichever env made the tasks
@run_dir_option
def verify(config, sets, run_dir):
    """Replay each task's reference in a fresh env: the goal must hold after it, not before.

    The run's own config.yaml is used unless -c names another: it says which environment
    (a plugin module included, imported here) and with which options the tasks were made.
    Only tasks of that env are verified: a task of another is counted as other_env:<env>,
    and what its meta.env_spec names is never imported. Exits 1 when any task fails.
    """
    cfg = _run_config(config, sets, run_dir)
    stored = _read_all(run_dir)
    from environments.base import env_class

    try:
        # imports a plugin module, which registers its env; a served env must answer
        run_env = env_class(cfg.env)
    except (KeyError, ImportError, ConfigError, EnvFailed) as exc:
        raise click.ClickException(f"env.name={cfg.env.name}: {exc}") from None
    failed: dict[str, list[str]] = {}
    for task in stored:
        reason = _verify_one(task, cfg, run_env)
        if reason != "ok":
            failed.setdefault(reason, []).append(task.task_id)
    bad = sum(map(len, failed.values()))
    click.echo(f"verified {len(stored) - bad}/{len(stored)} tasks")
    for reason, ids in sorted(failed.items(), key=lambda kv: -len(kv[1])):
        more = ", ..." if len(ids) > SHOW_FAILED else ""
        click.echo(f"  {reason}: {len(ids)} ({', '.join(ids[:SHOW_FAILED])}{more})")
    if any(reason.startswith("other_env:") for reason in failed):
        click.echo(f"  tasks of another env than {cfg.env.name} are not verified: give theirs "
                   "with -c or --set env.name=MODULE:NAME")
    if failed:
        sys.exit(1)


# --- stats -------------------------------------------------------------------------------------


def _counts(counter: Counter, order=None) -> str:
    keys = sorted(counter, key=order) if order else sorted(counter, key=lambda k: -counter[k])
    return ", ".join(f"{k} {counter[k]}" for k in keys) or "none"


@tasks.command("stats")
@run_dir_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead.")
def stats(run_dir, as_json):
    """How many tasks are stored, in how many worlds, by method and by steps; and how many
    candidates explore refused, by reason (duplicate, contaminated, ...: the explore report,
    explore/coverage.json)."""
    from questioning.coverage import read_refused

    stored = _read_all(run_dir)
    refused = read_refused(run_dir)
    report = {"tasks": len(stored), "worlds": len({t.seed for t in stored}),
              "methods": dict(Counter(str(t.meta.get("method", "")) for t in stored)),
              "steps": dict(sorted(Counter(len(t.reference) for t in stored).items())),
              "refused": refused}
    if as_json:
        click.echo(_json(report))
        return
    click.echo(f"{report['tasks']} tasks in {report['worlds']} worlds")
    click.echo(f"  by method: {_counts(Counter(report['methods']))}")
    click.echo(f"  by steps:  {_counts(Counter(report['steps']), order=int)}")
    if refused is None:
        click.echo(f"refused at synthesis: not recorded ({RunDir(run_dir).coverage} is "
                   "missing or older than the counts; explore again to record them)")
    else:
        click.echo(f"refused at synthesis: {_counts(Counter(refused))}")


# --- check-contamination -----------------------------------------------------------------------


def _heldout_index(cfg):
    """The held-out tasks of the env ``cfg`` names, indexed (questioning/decontamination.py)."""
    from environments.base import env_maker
    from questioning.decontamination import HeldOutIndex

    try:
        env = env_maker(cfg.env)()  # imports a plugin module, which registers its env
    except (KeyError, ImportError, TypeError) as exc:
        raise click.ClickException(f"env.name={cfg.env.name}: {exc}") from None
    try:
        return HeldOutIndex.of_env(env)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


@tasks.command("check-contamination")
@config_option
@set_option("env.options.KEY=VALUE")
@run_dir_option
def check_contamination(config, sets, run_dir):
    """Look for held-out tasks in disguise among the stored ones: in the same world (seed),
    the same query, or goals one of which contains the other (docs/questioning.md).

    Held out are the validation and test tasks of the env the run's own config.yaml names
    (or -c). Prints one line per overlap (stored task, held-out task, split, why) and exits 1
    when there is any.
    """
    from protocol.messages import HELD_OUT_SPLITS

    cfg = _run_config(config, sets, run_dir)
    stored = _read_all(run_dir)
    index = _heldout_index(cfg)
    overlaps = index.overlaps(stored)
    for task, o in overlaps:
        click.echo(f"{task.task_id}  {o.heldout_id}  {o.split}  {o.why}")
    checked = (f"{len(stored)} stored tasks against {index.size} held-out tasks "
               f"({', '.join(HELD_OUT_SPLITS)}) of {cfg.env.name}")
    if overlaps:
        click.echo(f"{len(overlaps)} of {checked} overlap one; explore into a fresh run "
                   "directory, which refuses them (reason contaminated)")
        sys.exit(1)
    click.echo(f"checked {checked}: no overlap")
