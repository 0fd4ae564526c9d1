"""Coverage of an environment by self-questioning, as numbers.

Per tool: how many calls exploration made of it, how many of those succeeded, and what share of
the stored tasks use it in their reference (a tool tried often that never worked is what
``unlock`` probes go after, questioning/preconditions.py). Per argument: how many distinct
values were tried, and per argument type the same summed. A tool no stored task uses, or an
argument never given a value, is a *gap*; the explorer favours tools by how few stored tasks
use them, gaps most (``SchemaSampler.task_share``). Per kind of task (:data:`TASK_KINDS`): the
share of the stored tasks; goal-directed explorations go after the kind the store holds fewest
of. The saved report also counts the candidates synthesis refused, by reason (``refused``:
``duplicate``, ``contaminated``, ``goal_not_reached`` ...), summed over every explore of the
run directory.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence

from environments.base import ToolSpec
from protocol.messages import Task
from protocol.run_dir import RunDir

_TOOL_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")  # "mv a b" and "mod.f(x=1)" alike


def tools_used(task: Task) -> set[str]:
    """The tools a task's reference calls."""
    found = (_TOOL_WORD.match(action.strip()) for action in task.reference)
    return {m.group().rsplit(".", 1)[-1] for m in found if m}


# Kinds of stored task the report counts: what its goal asks for (``state``: an end state,
# ``read``: a read-only call's answer, ``event``: calls made in order, one undoing another),
# and ``long``: three or more reference calls on one entity. A task may be long and of a kind.
TASK_KINDS = ("state", "read", "event", "long")
LONG_PLAN_CALLS = 3


def task_kinds(task: Task) -> list[str]:
    """The kinds ``task`` counts as, from what synthesis wrote in its meta (``goal_kind``,
    ``entity_calls``); a task made elsewhere (an LLM's, the env's own) counts as ``state``."""
    kinds = [task.meta.get("goal_kind", "state")]
    if task.meta.get("entity_calls", 0) >= LONG_PLAN_CALLS:
        kinds.append("long")
    return kinds


def goal_kind(goal) -> str:
    """What a goal asks for, read off its conditions alone (so it holds for any task, the
    env's own too): ``event`` when a condition names an event, else ``read`` when one names a
    response, else ``state``."""
    conds = goal.get("all", []) if isinstance(goal, dict) else []
    keys = {k for c in conds if isinstance(c, dict) for k in c}
    return "event" if "event" in keys else "read" if "response" in keys else "state"


def count_tool_uses(tasks: Sequence[Task]) -> Counter:
    """How many of ``tasks`` use each tool (what :func:`coverage` takes as ``uses``)."""
    return Counter(name for task in tasks for name in tools_used(task))


def coverage(tools: Sequence[ToolSpec], ok_calls: Mapping[str, int],
             tried: Mapping[tuple[str, str], set], uses: Mapping[str, int],
             n_tasks: int, kinds: Mapping[str, int] | None = None,
             tries: Mapping[str, int] | None = None) -> dict:
    """The coverage report (JSON-able) of ``n_tasks`` stored tasks of which ``uses[tool]`` use
    each tool and ``kinds[kind]`` are of each of ``TASK_KINDS``; ``tries[tool]``: calls of it
    during exploration, ``ok_calls[tool]`` those that worked. See the module docstring."""
    n = max(n_tasks, 1)
    per_tool = {t.name: {"tries": int((tries or {}).get(t.name, 0)),
                         "ok_calls": int(ok_calls.get(t.name, 0)),
                         "task_share": round(uses.get(t.name, 0) / n, 4)} for t in tools}
    per_arg = {f"{t.name}.{a.name}": len(tried.get((t.name, a.name), ()))
               for t in tools for a in t.args}
    per_type: Counter = Counter()
    for t in tools:
        for a in t.args:
            per_type[a.type] += per_arg[f"{t.name}.{a.name}"]
    kind_share = {k: round((kinds or {}).get(k, 0) / n, 4) for k in TASK_KINDS}
    return {"tasks": n_tasks, "tools": per_tool, "args": per_arg, "kinds": kind_share,
            "values_by_type": dict(per_type),
            "gaps": {"tools": [name for name in per_tool if not uses.get(name)],
                     "args": [name for name, n_values in per_arg.items() if not n_values]}}


def read_refused(run_dir) -> dict[str, int] | None:
    """The candidates explore refused by reason, as its report (``explore/coverage.json``)
    keeps them; None when there is no report or it predates the counts."""
    try:
        report = json.loads(RunDir(run_dir).coverage.read_text())
    except (OSError, ValueError):  # no explore yet, or a report cut short
        return None
    refused = report.get("refused") if isinstance(report, dict) else None
    if not isinstance(refused, dict):
        return None
    return {k: v for k, v in refused.items() if isinstance(v, int)}


def render(report: dict) -> str:
    """Two lines for a terminal: tools with tasks, then the gaps."""
    tools = report["tools"]
    covered = sum(1 for v in tools.values() if v["task_share"] > 0)
    gaps = report["gaps"]
    kinds = ", ".join(f"{k} {v:.1%}" for k, v in report.get("kinds", {}).items())
    return (f"coverage: {covered}/{len(tools)} tools used by the {report['tasks']} stored "
            f"tasks; values tried by type {report['values_by_type']}\n"
            f"  kinds of task: {kinds or 'not counted'}\n"
            f"  gaps: tools {gaps['tools'] or 'none'}; arguments never given a value "
            f"{gaps['args'] or 'none'}")
