"""Mirror ``<run dir>/metrics.jsonl`` into wandb from one process (the launcher).

Roles only append JSON lines, which is cheap and crash-safe; the launcher tails the file and
logs each record to one wandb run (offline by default, into the run directory, so nothing
leaves the machine until the user runs ``wandb sync``; ``tracking.wandb=online`` after
``wandb login``). The run carries the resolved config with the Redis password redacted, the
group ``tracking.group`` (one ablation arm per group), ``job_type="rl"`` and the env name as a
tag. Each role's records keep their own x-axis, ``<role>/step``: the record's ``step`` (learner
updates, actor groups), or for roles that log none (replay, judge, experience) the number of
records that role has logged so far. ``<role>/wall_s`` is the record's own time, in seconds since
the first record of the run, so wall-time plots use when a value was measured, not when it was
mirrored. At close, the run's headline numbers (held-out success before warm-start, after
warm-start and after RL, updates, restarts) go into the wandb summary.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from metrics.jsonl import MetricsTail
from protocol.config import redacted_config
from protocol.run_dir import HELD_OUT_STAGES, RunDir

log = logging.getLogger(__name__)

ROLES = ("actor", "learner", "replay", "judge", "experience", "explore", "eval")


class WandbMirror:
    def __init__(self, run_dir: Path, mode: str, config: dict, name: str, group: str = ""):
        self.run = None
        self.run_dir = Path(run_dir)
        self._defined: set[str] = set()
        self._counts: dict[str, int] = {}
        self._t0: float | None = None
        self._synced = 0  # records passed to sync so far: metrics.jsonl's first ``_synced``
        # A resumed run (same wandb id) has already mirrored this many of the file's records;
        # the launcher's tail reads the file from its start again, and those are not re-logged.
        self._cursor = RunDir(self.run_dir).wandb_cursor
        self._mirrored = _read_count(self._cursor)
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        config = redacted_config(config)  # whoever calls: no password reaches wandb
        tags = [t for t in _env_names(config) if t]
        try:
            import wandb

            self.run = wandb.init(project="autodidact", name=name, group=group or None,
                                  job_type="rl", tags=tags, dir=str(run_dir), mode=mode,
                                  config=config, resume="allow", id=_run_id(run_dir))
            for role in ROLES:
                self._define(role)
        except Exception as exc:  # tracking must never take a training run down
            log.warning("wandb disabled: %s", exc)
            self.run = None

    def _define(self, role: str) -> None:
        if role in self._defined:
            return
        self._defined.add(role)
        self.run.define_metric(f"{role}/step")
        self.run.define_metric(f"{role}/*", step_metric=f"{role}/step")

    def sync(self, records: list[dict]) -> None:
        """Log ``records`` (new lines of metrics.jsonl) to wandb."""
        if self.run is None:
            return
        try:
            for rec in records:
                values = self._values(rec)  # counted either way: the x-axes carry on
                if self._synced >= self._mirrored:
                    self.run.log(values)
                self._synced += 1
            if records and self._synced > self._mirrored:
                self._mirrored = self._synced
                self._cursor.write_text(str(self._mirrored))
        except Exception as exc:  # a wandb failure must not stop the launcher's loop
            log.warning("wandb log failed: %s", exc)

    def _values(self, rec: dict) -> dict:
        role = str(rec.get("role", "run"))
        self._define(role)
        count = self._counts[role] = self._counts.get(role, 0) + 1
        values = {k: v for k, v in rec.items() if "/" in k and v is not None}
        values[f"{role}/step"] = rec["step"] if rec.get("step") is not None else count
        t = rec.get("t")
        if isinstance(t, (int, float)):
            self._t0 = t if self._t0 is None else min(self._t0, t)
            values[f"{role}/wall_s"] = t - self._t0
        return values

    def close(self, summary: dict | None = None) -> None:
        """Mirror the records appended since the last :meth:`sync` (assumes every record of
        metrics.jsonl from its start was passed to sync, as the launcher does), put ``summary``
        (default: ``<run dir>/summary.json`` when there is one) into the run's summary as flat
        ``heldout/...``, ``restarts/...`` values, and finish the wandb run: when this returns,
        the offline run is complete on disk."""
        if self.run is None:
            return
        # Roles log their last records while they stop, after the launcher's last sync: the
        # records past the ones synced (in metrics.jsonl's order, as MetricsTail reads them).
        try:
            self.sync(MetricsTail(self.run_dir).read_new()[self._synced:])
        except OSError as exc:
            log.warning("wandb: last metrics not mirrored: %s", exc)
        try:
            if summary is None:
                summary = read_summary(self.run_dir)
            values = summary_values(summary)
            if values:
                self.run.summary.update(values)
        except Exception as exc:
            log.warning("wandb summary not written: %s", exc)
        self.run.finish()
        self.run = None
        # finish() may return before the offline transaction log is on disk; teardown waits
        # for wandb's service process to flush it and exit (this process has no other run).
        try:
            import wandb

            wandb.teardown()
        except Exception as exc:
            log.warning("wandb teardown: %s", exc)


def _read_count(path: Path) -> int:
    try:
        return max(int(path.read_text().strip()), 0)
    except (OSError, ValueError):
        return 0


def read_summary(run_dir: Path) -> dict:
    path = RunDir(run_dir).summary
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def summary_values(summary: dict) -> dict[str, float]:
    """The headline numbers of ``summary.json``, flat: ``heldout/<stage>_<avg|best|greedy>``
    (stages base, warm, rl; under ``env.mix`` also ``heldout/<stage>_<env>_avg`` and
    ``heldout/<stage>_mean_over_envs_avg``), ``learner/final_<name>``, ``restarts/<role>`` and
    ``restarts/total``."""
    out: dict[str, float] = {}
    for stage in HELD_OUT_STAGES:
        result = summary.get(f"success_{stage}") or {}
        for key in ("avg", "best", "greedy", "tasks"):
            if isinstance(result.get(key), (int, float)):
                out[f"heldout/{stage}_{key}"] = result[key]
        for env, one in (result.get("envs") or {}).items():  # an env mix: each env's avg@k
            if isinstance(one, dict) and isinstance(one.get("avg"), (int, float)):
                out[f"heldout/{stage}_{env}_avg"] = one["avg"]
        mean = (result.get("mean_over_envs") or {}).get("avg")
        if isinstance(mean, (int, float)):
            out[f"heldout/{stage}_mean_over_envs_avg"] = mean
    learner = summary.get("learner") or {}
    for key in ("learner/updates", "learner/version", "learner/loss", "learner/reward",
                "learner/lag_mean"):
        if isinstance(learner.get(key), (int, float)):
            out[f"learner/final_{key.split('/', 1)[1]}"] = learner[key]
    restarts = summary.get("restarts") or {}
    if restarts:
        for role, n in restarts.items():
            out[f"restarts/{role}"] = n
        out["restarts/total"] = sum(n for n in restarts.values() if isinstance(n, int))
    return out


def _env_names(config: dict) -> list[str]:
    """The run's env name, or under ``env.mix`` each member's id."""
    env = config.get("env") if isinstance(config, dict) else None
    if not isinstance(env, dict):
        return []
    mix = env.get("mix")
    if isinstance(mix, list) and mix:
        return [str(m.get("id") or str(m.get("name", "")).rpartition(":")[2])
                for m in mix if isinstance(m, dict)]
    return [str(env.get("name", ""))]


def _run_id(run_dir: Path) -> str:
    """Stable per run directory, so a resumed run continues the same wandb run."""
    import hashlib

    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
