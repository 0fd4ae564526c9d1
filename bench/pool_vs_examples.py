"""The self-made task pool beside the env's own training tasks, and how the policy fared on each
while training: what a run trained only on self-made tasks was given, against what it is
measured on (issue 53, part 2).

    .venv/bin/python -m bench.pool_vs_examples RUN_DIR [RUN_DIR ...] --json OUT

Per run directory, two pools of *training* tasks: hand-written (the env's ``tasks("train")``,
the env named in the run's ``config.yaml``, with its options; ``Task.source == "original"``)
and self-made (the run's ``tasks.lmdb``, ``"synthetic"``). Validation and test tasks are never
opened. Each pool is described by, each as shares per bucket and a mean:

- ``kind``, from the goal itself (so it reads both pools alike): a goal is ``{"all":
  [conditions]}``; a condition that is a dict with the key ``"event"`` is an event, with
  ``"response"`` a read, anything else a state condition; a task is ``event`` if any condition
  is, else ``read`` if any is, else ``state``. ``long``: 3 or more reference calls name one
  entity (as ``questioning.synthesis.most_calls_on_one`` counts them);
- ``calls``: reference calls; ``conditions``: goal conditions; ``entities``: distinct
  non-numeric argument words across the reference calls; ``query_words``: words of the query;
- ``tools``: the share of tasks whose reference uses each tool (``coverage.tools_used``),

and per feature the total variation distance between the pools (0: the same shares, 1: no
bucket in common; for tools, between the two pools' tool uses each normalized to 1), so the
biggest mismatch can be named. Then success while training, from the groups in the run's
replay store (opened read-only as the viewer's group index opens it; each group carries its
task): per pool the share of rollouts that succeeded, overall and per bucket of kind, long,
calls and (when ``policy_init/warmstart_tasks.json`` exists) whether the task was one of the
warm-start examples; once over all groups and once over the first 10% by creation time, the
closest to the warm-started policy. Several run directories: also every count pooled.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

from bench.output import command_line, write_result
from protocol.codec import decode_body
from protocol.messages import Task
from protocol.run_dir import RunDir
from questioning.coverage import goal_kind
from questioning.probes import is_number

POOLS = {"original": "hand-written", "synthetic": "self-made"}  # Task.source -> pool name
HAND, MADE = POOLS.values()
KINDS = ("state", "read", "event")
LONG_PLAN_CALLS = 3  # questioning.coverage.LONG_PLAN_CALLS
EARLY_SHARE = 0.1  # the first tenth of the groups by creation time


def capped(top: int, start: int = 0) -> tuple[str, ...]:
    """Buckets ``start``, ..., ``top - 1`` and ``top+``."""
    return (*map(str, range(start, top)), f"{top}+")


# feature -> its buckets in order; a number falls in the first bucket whose bound holds it
BUCKETS: dict[str, tuple[str, ...]] = {
    "kind": KINDS,
    "long": ("yes", "no"),
    "calls": capped(5),
    "conditions": capped(4),
    "entities": capped(5),
    "query_words": ("0-3", "4-5", "6-7", "8-10", "11-15", "16+"),
}
NUMERIC = ("calls", "conditions", "entities", "query_words")
SUCCESS_BY = ("kind", "long", "calls")  # the buckets success is also reported per


def bucket(feature: str, value: int | str) -> str:
    if isinstance(value, str):
        return value
    for name in BUCKETS[feature]:
        low, _, high = name.rstrip("+").partition("-")
        if name.endswith("+") and value >= int(low):
            return name
        if int(low) <= value <= int(high or low):
            return name
    raise ValueError(f"{feature}: {value} is in no bucket")


# --- one task -------------------------------------------------------------------------------


def conditions_of(goal) -> list:
    """The conditions of a goal: ``goal["all"]``; a goal of another shape is one condition
    (none when empty)."""
    if isinstance(goal, dict) and isinstance(goal.get("all"), list):
        return goal["all"]
    return [goal] if goal else []


def entity_words(reference: Sequence[str]) -> set[str]:
    """The distinct non-numeric argument words of the reference calls."""
    return {w for action in reference for w in action.split()[1:] if not is_number(w)}


def features(task: Task) -> dict[str, int | str]:
    """A task's value of each feature of :data:`BUCKETS`."""
    from questioning.synthesis import most_calls_on_one

    entities = entity_words(task.reference)
    long = most_calls_on_one(task.reference, entities) >= LONG_PLAN_CALLS
    return {"kind": goal_kind(task.goal), "long": "yes" if long else "no",
            "calls": len(task.reference), "conditions": len(conditions_of(task.goal)),
            "entities": len(entities), "query_words": len(task.query.split())}


# --- a pool -----------------------------------------------------------------------------------


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def distribution(counts: Counter, buckets: Iterable[str], total: int) -> dict:
    return {"counts": {b: counts[b] for b in buckets},
            "shares": {b: share(counts[b], total) for b in buckets}}


def pool_features(tasks: Sequence[Task]) -> dict:
    """Per feature the counts and shares per bucket and the mean (None for a pool without
    tasks; ``kind`` has no mean, ``long``'s is its share of ``yes``); per tool the share of
    tasks that use it."""
    from questioning.coverage import tools_used

    rows = [features(t) for t in tasks]
    n = len(rows)
    out: dict = {"tasks": n}
    for name, buckets in BUCKETS.items():
        counts = Counter(bucket(name, r[name]) for r in rows)
        out[name] = distribution(counts, buckets, n)
        if name in NUMERIC:
            out[name]["mean"] = share(sum(r[name] for r in rows), n)
        elif name == "long":
            out[name]["mean"] = share(counts["yes"], n)
    uses = Counter(tool for t in tasks for tool in tools_used(t))
    out["tools"] = {"counts": dict(sorted(uses.items())),
                    "shares": {tool: share(k, n) for tool, k in sorted(uses.items())}}
    return out


def tv_distance(p: dict[str, int], q: dict[str, int]) -> float | None:
    """Total variation distance between two count tables, each normalized to 1: 0 when the
    shares are the same, 1 when no bucket has counts in both; None when either is empty."""
    np_, nq = sum(p.values()), sum(q.values())
    if not np_ or not nq:
        return None
    return 0.5 * sum(abs(p.get(b, 0) / np_ - q.get(b, 0) / nq) for b in set(p) | set(q))


def compare(hand: Sequence[Task], made: Sequence[Task]) -> dict:
    """Both pools' features and, per feature, the distance between them; ``biggest`` names
    the feature whose distance is largest."""
    pools = {HAND: pool_features(hand), MADE: pool_features(made)}
    distance = {name: tv_distance(pools[HAND][name]["counts"], pools[MADE][name]["counts"])
                for name in (*BUCKETS, "tools")}
    known = {k: v for k, v in distance.items() if v is not None}
    return {"pools": pools, "distance": distance,
            "biggest": max(known, key=known.get) if known else None}


# --- success while training -------------------------------------------------------------------


@dataclass
class Rolled:
    """One stored group: when it was made, its task, and how its rollouts did."""

    created: float
    seq: int
    task: Task
    rollouts: int
    successes: int


def read_groups(run_dir: Path) -> tuple[list[Rolled], int, str]:
    """Every stored group of ``run_dir`` with its task, oldest first; how many could not be
    read (body or task damaged); and why the store could not be opened ("" when it could).
    The store is opened read-only, as the viewer's group index opens it."""
    from autodidact.viewer.groups import GroupIndex, ViewError, summarize
    from replay.store import GroupRecord

    groups: list[Rolled] = []
    damaged = 0
    try:
        with GroupIndex(run_dir).reading() as store, store.begin_read() as txn:
            records = {key.decode(): GroupRecord.unpack(raw)
                       for key, raw in txn.cursor(db=store.db["index"])}
            for seq, gid, body in store.iter_since(txn, 0):
                rec = records.get(gid)
                if rec is None:
                    continue
                summary = summarize(gid, bytes(body), rec)  # counts as the report counts them
                task = None if summary.damaged else _task_of(bytes(body))
                if task is None:
                    damaged += 1
                    continue
                groups.append(Rolled(summary.created, seq, task, summary.rollouts,
                                     summary.successes))
    except ViewError as exc:
        return [], 0, str(exc)
    groups.sort(key=lambda g: (g.created, g.seq))
    return groups, damaged, ""


def _task_of(body: bytes) -> Task | None:
    try:
        task = msgpack.unpackb(body, raw=False, strict_map_key=True)["task"]
        return decode_body(Task.TYPE, msgpack.packb(task, use_bin_type=True))
    except Exception:  # a task that does not decode is damaged, like a body that does not
        return None


def early(groups: Sequence[Rolled], fraction: float = EARLY_SHARE) -> list[Rolled]:
    """The first ``fraction`` of ``groups`` (oldest first), at least one when there are any."""
    return list(groups[:math.ceil(fraction * len(groups))])


def _tally(rows: Iterable[Rolled]) -> dict:
    rows = list(rows)
    rollouts = sum(g.rollouts for g in rows)
    successes = sum(g.successes for g in rows)
    return {"groups": len(rows), "tasks": len({g.task.task_id for g in rows}),
            "rollouts": rollouts, "successes": successes, "success": share(successes, rollouts)}


def success_table(groups: Sequence[Rolled], examples: set[str] | None = None) -> dict:
    """Per pool: success overall and per bucket of :data:`SUCCESS_BY` (only buckets with
    groups), and per ``example`` (yes: the task was a warm-start example) when ``examples``
    is given."""
    out = {}
    for source, name in POOLS.items():
        mine = [g for g in groups if (g.task.source == "synthetic") == (source == "synthetic")]
        values = [features(g.task) for g in mine]
        row: dict = {"overall": _tally(mine)}
        for feature in SUCCESS_BY:
            keys = [bucket(feature, v[feature]) for v in values]
            row[feature] = {b: _tally(g for g, k in zip(mine, keys) if k == b)
                            for b in BUCKETS[feature] if b in keys}
        if examples is not None:
            keys = ["yes" if g.task.task_id in examples else "no" for g in mine]
            row["example"] = {b: _tally(g for g, k in zip(mine, keys) if k == b)
                              for b in ("yes", "no") if b in keys}
        out[name] = row
    return out


def success(groups: Sequence[Rolled], examples: set[str] | None = None) -> dict:
    first = early(groups)
    return {"groups": len(groups), "early_groups": len(first),
            "all": success_table(groups, examples), "early": success_table(first, examples)}


# --- a run directory --------------------------------------------------------------------------


def train_tasks(run_dir: Path) -> tuple[str, list[Task]]:
    """The env named in the run's ``config.yaml`` (with its options) and its training tasks:
    the hand-written pool. Only the ``train`` split is asked for."""
    from environments.base import env_maker
    from protocol.config import load_config

    cfg = load_config(RunDir(run_dir).config)
    return cfg.env.name, list(env_maker(cfg.env)().tasks("train"))


def self_made(run_dir: Path) -> list[Task]:
    """The run's self-made pool (``tasks.lmdb``, opened read-only: no lock, no write)."""
    from questioning.task_store import TaskStore, exists

    if not exists(run_dir):
        return []
    with TaskStore(run_dir, readonly=True) as store:
        return store.all(source="synthetic")


def warmstart_examples(run_dir: Path) -> set[str] | None:
    try:
        ids = json.loads(RunDir(run_dir).warmstart_tasks.read_text())
    except (OSError, ValueError):
        return None
    return {str(i) for i in ids} if isinstance(ids, list) else None


@dataclass
class RunData:
    name: str
    env: str
    hand: list[Task]
    made: list[Task]
    groups: list[Rolled]
    damaged: int
    error: str
    examples: set[str] | None


def load_run(run_dir: Path,
             hand: Callable[[Path], tuple[str, list[Task]]] | None = None) -> RunData:
    env, tasks = (hand or train_tasks)(run_dir)
    groups, damaged, error = read_groups(run_dir)
    return RunData(run_dir.name, env, tasks, self_made(run_dir), groups, damaged, error,
                   warmstart_examples(run_dir))


def analyse(data: Sequence[RunData]) -> dict:
    """The comparison and success of one run's data, or of several runs' pooled."""
    groups = sorted((g for d in data for g in d.groups), key=lambda g: (g.created, g.seq))
    known = [d.examples for d in data if d.examples is not None]
    examples = set().union(*known) if known else None
    return {**compare([t for d in data for t in d.hand], [t for d in data for t in d.made]),
            "success": success(groups, examples),
            "damaged_groups": sum(d.damaged for d in data),
            "errors": [f"{d.name}: {d.error}" for d in data if d.error]}


# --- words ------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _cell(dist: dict, b: str) -> str:
    return f"{_pct(dist['shares'][b])} ({dist['counts'][b]})"


def _mean(value: float | None, name: str) -> str:
    if value is None:
        return "-"
    return _pct(value) if name == "long" else f"{value:.2f}"


def _rate(t: dict | None) -> str:
    if not t or not t["groups"]:
        return "-"
    return f"{_pct(t['success'])} ({t['successes']}/{t['rollouts']}, {t['groups']} groups)"


def markdown(title: str, result: dict, tools_shown: int = 10) -> str:
    hand, made = result["pools"][HAND], result["pools"][MADE]
    lines = [f"### {title}", "",
             f"{hand['tasks']} hand-written training tasks, {made['tasks']} self-made; "
             f"biggest mismatch: {result['biggest'] or '-'}"
             + (f" (TV {result['distance'][result['biggest']]:.2f})" if result["biggest"]
                else ""), "",
             "| feature | hand-written | self-made | distance (TV) |", "|---|---:|---:|---:|"]
    for name, buckets in BUCKETS.items():
        d = result["distance"][name]
        mean = (f" mean {_mean(hand[name]['mean'], name)} / {_mean(made[name]['mean'], name)}"
                if "mean" in hand[name] else "")
        lines.append(f"| **{name}**{mean} | | | {'-' if d is None else f'{d:.2f}'} |")
        for b in buckets:
            if hand[name]["counts"][b] or made[name]["counts"][b]:
                lines.append(f"| {name} {b} | {_cell(hand[name], b)} | "
                             f"{_cell(made[name], b)} | |")
    d = result["distance"]["tools"]
    lines.append(f"| **tools** (share of tasks using) | | | {'-' if d is None else f'{d:.2f}'} |")
    tools = set(hand["tools"]["counts"]) | set(made["tools"]["counts"])
    gap = {t: abs((hand["tools"]["shares"].get(t) or 0) - (made["tools"]["shares"].get(t) or 0))
           for t in tools}
    for tool in sorted(tools, key=lambda t: (-gap[t], t))[:tools_shown]:
        lines.append(f"| tool {tool} | {_pct(hand['tools']['shares'].get(tool, 0.0))} | "
                     f"{_pct(made['tools']['shares'].get(tool, 0.0))} | |")
    s = result["success"]
    lines += ["", f"Success while training ({s['groups']} groups; first 10%: "
              f"{s['early_groups']} groups):", "",
              "| rollouts of | hand-written, all | self-made, all | hand-written, first 10% | "
              "self-made, first 10% |", "|---|---:|---:|---:|---:|"]
    rows = [("overall", None)] + [(f, b) for f in (*SUCCESS_BY, "example")
                                  for b in BUCKETS.get(f, ("yes", "no"))]
    for feature, b in rows:
        cells = []
        for part in ("all", "early"):
            for pool in (HAND, MADE):
                row = s[part][pool]
                cells.append(row["overall"] if b is None else row.get(feature, {}).get(b))
        if b is None or any(cells):
            label = "all tasks" if b is None else f"{feature} {b}"
            lines.append(f"| {label} | " + " | ".join(map(_rate, cells)) + " |")
    for error in result["errors"]:
        lines.append(f"\n{error}")
    if result["damaged_groups"]:
        lines.append(f"\n{result['damaged_groups']} damaged groups left out")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (autodidact run)")
    p.add_argument("--json", type=Path, default=None, help="write everything here")
    args = p.parse_args(argv)
    data = [load_run(run) for run in args.runs]
    out: dict = {"command": command_line("bench.pool_vs_examples", argv), "runs": {}}
    for run, d in zip(args.runs, data):
        result = {"env": d.env, **analyse([d])}
        out["runs"][str(run)] = result
        print(markdown(f"{run} ({d.env})", result))
    if len(data) > 1:
        out["pooled"] = analyse(data)
        print(markdown(f"pooled over {len(data)} runs", out["pooled"]))
    write_result(out, args.json)
    return out


if __name__ == "__main__":
    main()
