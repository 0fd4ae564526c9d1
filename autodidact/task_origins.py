"""A run's training by task origin: hand-written tasks (the env's own, ``Task.source ==
"original"``) beside self-made ones (``"synthetic"``, from self-questioning).

One table, computed here and shown by ``autodidact report``, ``autodidact status`` and the
viewer's Run and Tasks pages. Per origin: how many tasks the run can draw, how many of the
groups replay holds rolled them out, the share of those rollouts that succeeded, and the share
of those groups that were informative (their rollouts did not all score the same: a group whose
rollouts all score alike has a zero outcome advantage, so RL learns nothing from it). Beside it,
``tasks.synthetic_share`` as configured and as the launcher resolved it.

Everything is read from the run directory, read-only: the replay store (through the viewer's
group index, which unpacks each group once and then only the new ones), ``split.json``,
``tasks.lmdb``, ``config.yaml`` and ``summary.json``. The counts are over the groups replay
still holds: once ``replay.max_groups`` or ``replay.max_bytes`` evicts, the oldest drop out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb

from autodidact.viewer.groups import GroupIndex, Summary, ViewError
from protocol.run_dir import RunDir

ORIGINS = {"original": "hand-written", "synthetic": "self-made"}  # Task.source -> the name shown


@dataclass
class OriginRow:
    origin: str  # "hand-written" | "self-made"
    source: str  # the Task.source it counts: "original" | "synthetic"
    tasks: int | None  # tasks of this origin the run can draw; None: not written yet
    groups: int = 0  # stored groups that rolled out a task of this origin
    rollouts: int = 0
    successes: int = 0  # rollouts that succeeded
    informative: int = 0  # groups whose rollouts did not all score the same

    def as_dict(self) -> dict:
        return {**asdict(self), "success": share(self.successes, self.rollouts),
                "informative_share": share(self.informative, self.groups)}


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def origin_table(summaries: Iterable[Summary], tasks: dict[str, int | None],
                 synthetic_share: dict) -> dict:
    """The table from group summaries, the task counts by source and the share settings."""
    rows = {source: OriginRow(name, source, tasks.get(source)) for source, name in
            ORIGINS.items()}
    damaged = 0
    for s in summaries:
        if s.damaged:  # its task is unknown: counting it under either origin would be a guess
            damaged += 1
            continue
        row = rows["synthetic" if s.source == "synthetic" else "original"]
        row.groups += 1
        row.rollouts += s.rollouts
        row.successes += s.successes
        row.informative += not s.outcome_equal
    counted = sum(r.groups for r in rows.values())
    drawn = share(rows["synthetic"].groups, counted)  # what the mixture gave, for comparison
    return {"origins": [r.as_dict() for r in rows.values()], "groups_counted": counted,
            "damaged": damaged, "synthetic_share": {**synthetic_share, "drawn": drawn}}


def task_counts(run_dir: Path) -> dict[str, int | None]:
    """Tasks the run can draw per source: the env's train split (``split.json``, written when
    RL starts) and the self-made pool (``tasks.lmdb``, which the Redis pool mirrors)."""
    from questioning.task_store import TaskStore, exists

    split = _read_json(RunDir(run_dir).split)
    train = split.get("train")
    synthetic: int | None = 0
    if exists(run_dir):
        try:
            with TaskStore(run_dir, readonly=True) as store:
                synthetic = store.count()
        except (lmdb.Error, OSError):  # damaged (StoreDamaged is an OSError): unknown, not 0
            synthetic = None
    return {"original": len(train) if isinstance(train, list) else None,
            "synthetic": synthetic}


def synthetic_share_setting(run_dir: Path) -> dict:
    """``tasks.synthetic_share`` as configured (-1: auto) and as the launcher resolved it for
    this run (``summary.json``; None until the stages before RL have run)."""
    import yaml

    try:
        cfg = yaml.safe_load(RunDir(run_dir).config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    tasks = cfg.get("tasks") if isinstance(cfg, dict) else None
    configured = tasks.get("synthetic_share") if isinstance(tasks, dict) else None
    effective = _read_json(RunDir(run_dir).summary).get("synthetic_share")
    return {"configured": _number(configured), "effective": _number(effective)}


def run_origins(run_dir: Path, index: GroupIndex | None = None,
                budget_s: float = float("inf")) -> dict:
    """The table of ``run_dir``. ``index`` (the viewer's, or one kept across ``status
    --watch`` refreshes) is brought up to date for at most ``budget_s`` seconds; ``complete``
    is False when the groups read by then are fewer than the store holds."""
    index = index or GroupIndex(run_dir)
    error = ""
    try:
        index.refresh(budget_s)
    except ViewError as exc:  # no store yet, or one that cannot be opened: said, not raised
        error = str(exc)
    summaries, stored = index.summaries()
    table = origin_table(summaries, task_counts(run_dir), synthetic_share_setting(run_dir))
    table.update(groups_stored=stored, complete=len(summaries) >= stored, error=error)
    return table


# --- words, shared by the report and status ---------------------------------------------------


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def share_words(table: dict) -> str:
    """``tasks.synthetic_share`` configured, effective, and drawn: the self-made share of the
    groups counted, what the mixture actually gave."""
    s = table["synthetic_share"]
    configured = "-" if s["configured"] is None else (
        "auto (-1)" if s["configured"] < 0 else f"{s['configured']:g}")
    effective = "- (not resolved yet)" if s["effective"] is None else f"{s['effective']:g}"
    return f"configured {configured}, effective {effective}, drawn {percent(s['drawn'])}"


def counted_words(table: dict) -> str:
    """Which groups the numbers are over, and what is missing from them."""
    if table["error"]:
        return table["error"]
    if table["complete"]:
        words = f"over the {table['groups_stored']} groups stored in replay.lmdb"
    else:  # the index ran out of time: the rest are counted on a later look
        words = (f"over the {table['groups_counted'] + table['damaged']} read so far of the "
                 f"{table['groups_stored']} groups stored in replay.lmdb")
    if table["damaged"]:
        words += f"; {table['damaged']} damaged groups left out"
    return words


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None
