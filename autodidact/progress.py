"""What ``autodidact run`` shows and records while it trains: the live progress line, the
replay server's stats as metrics, the wandb mirror of metrics.jsonl, the closing summary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import redis
from rich.console import Console
from rich.markup import escape

from autodidact.tracking import WandbMirror
from metrics.intervals import format_rate
from metrics.jsonl import MetricsTail, MetricsWriter, read_metrics
from protocol.config import RunConfig
from protocol.errors import RemoteError, TransportTimeout
from protocol.run_dir import HELD_OUT_STAGES

log = logging.getLogger(__name__)
console = Console(stderr=True, soft_wrap=True)

REPORT_EVERY_S = 10.0


class ReplayMonitor:
    """Logs the replay server's stats (sizes, rejections) and ingest rate as ``replay/...``."""

    def __init__(self, run_dir: Path, cfg: RunConfig):
        from protocol.replay_client import ReplayClient

        self.client = ReplayClient.for_run(cfg, timeout_s=5.0)
        self.metrics = MetricsWriter(run_dir, "replay")
        self._last: tuple[float, int] | None = None
        self.disk_full = False  # the replay store's file system was full at the last look

    def log(self) -> None:
        try:
            stats = self.client.stats()
        except (TransportTimeout, RemoteError) as exc:
            log.warning("replay stats unavailable: %s", exc)
            return
        self.disk_full = bool(stats.get("disk_full_now"))
        now, groups = time.monotonic(), int(stats.get("groups", 0))
        if self._last is not None:
            stats["groups_per_s"] = (groups - self._last[1]) / max(now - self._last[0], 1e-9)
        self._last = (now, groups)
        self.metrics.log({k: v for k, v in stats.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        self.client.close()
        self.metrics.close()


class Progress:
    """The live progress line, fed from the new records of metrics.jsonl."""

    def __init__(self, run_dir: Path):
        self.tail = MetricsTail(run_dir)
        self.learner: dict = {}
        self.actors: list[dict] = []
        # (seconds in, groups stored) when this process began counting: the rate is of groups
        # added since then, not of those a resumed run's earlier processes stored
        self.start: tuple[float, int] | None = None

    def begin(self, control, elapsed_s: float = 0.0) -> None:
        """Count groups from now on (``show`` begins at its first line when Redis is away)."""
        self.start = (elapsed_s, control.counters().get("actor/accepted", 0))

    def update(self) -> list[dict]:
        records = self.tail.read_new()
        for rec in records:
            if rec.get("role") == "learner" and "learner/checkpoint_fallback" in rec:
                console.print(f"  [yellow]{fallback_text(rec, self.learner)}[/]", highlight=False)
            if rec.get("role") == "learner" and "learner/loss" in rec:
                self.learner = rec
            elif rec.get("role") == "actor":
                self.actors = (self.actors + [rec])[-20:]
        return records

    def show(self, control, roles, elapsed_s) -> None:
        rates = [a.get("actor/success_rate", 0) for a in self.actors]
        success = sum(rates) / max(len(rates), 1)
        counters = control.counters()
        groups = counters.get("actor/accepted", 0)
        judged = counters.get("judge/groups_labelled", 0)
        if self.start is None:
            self.start = (elapsed_s, groups)
        since_s, since_groups = self.start
        rate = (groups - since_groups) / max(elapsed_s - since_s, 1e-9)
        lr = self.learner
        console.print(
            f"  [{elapsed_s:5.0f}s] update {lr.get('learner/updates', 0):>4}  "
            f"version {lr.get('learner/version', 0):>4}  actor success {success:6.1%}  "
            f"groups {groups:>6} ({rate:.1f}/s, judged {judged})  "
            f"lag {lr.get('learner/lag_mean', 0):.2f}  restarts {len(roles.restart_log)}",
            highlight=False)


def fallback_text(record: dict, last: dict) -> str:
    """The line for a learner that resumed from ``previous.pt`` because ``latest.pt`` was
    damaged (``record``), given the learner's last record before it (``last``)."""
    at = int(record.get("learner/resumed_at_update") or 0)
    logged = last.get("learner/updates")
    lost = (f"{int(logged) - at} updates lost (the last logged was {int(logged)})"
            if logged is not None and logged >= at else "the updates after it are lost")
    return (f"learner: checkpoints/latest.pt was damaged; resumed from previous.pt at update "
            f"{at}: {lost}; replay serves the groups they trained on again "
            f"(logs/learner.log says why)")


def checkpoint_fallbacks(run_dir: Path) -> list[str]:
    """Every checkpoint fallback in the run's metrics, as :func:`fallback_text` says it."""
    out, last = [], {}
    for rec in read_metrics(run_dir, "learner"):
        if "learner/checkpoint_fallback" in rec:
            out.append(fallback_text(rec, last))
        elif "learner/loss" in rec:
            last = rec
    return out


class Reporter:
    """Every ``REPORT_EVERY_S`` of training: the replay stats as metrics, the new metrics
    records into wandb, the restarts into the run state, the progress line."""

    def __init__(self, cfg: RunConfig, run_dir: Path, coordinator, mirror: WandbMirror):
        self.coordinator, self.mirror = coordinator, mirror
        self.progress = Progress(run_dir)
        self.replay = ReplayMonitor(run_dir, cfg)
        self.t0 = time.monotonic()
        self._last = 0.0
        with contextlib.suppress(redis.RedisError):  # Redis is being restarted: show() begins
            self.progress.begin(coordinator.control)

    def tick(self, roles) -> None:
        if time.monotonic() - self._last <= REPORT_EVERY_S:
            return
        self._last = time.monotonic()
        self.replay.log()
        if self.replay.disk_full:
            console.print("  [red]disk full: replay cannot store anything; clients keep their "
                          "data and retry, the run goes on once space is freed[/]")
        self.mirror.sync(self.progress.update())
        self.coordinator.publish_restarts(roles)
        with contextlib.suppress(redis.RedisError):  # Redis is being restarted
            self.progress.show(self.coordinator.glance, roles, time.monotonic() - self.t0)

    def close(self) -> None:
        """The last records into wandb (the mirror itself is closed after the summary)."""
        self.replay.close()
        self.mirror.sync(self.progress.update())


def print_summary(summary: dict) -> None:
    def pct(result, key="avg"):
        if (result or {}).get(key) is None:
            return "n/a"
        return format_rate(result[key], result["avg_ci"]) if key == "avg" and "avg_ci" in result \
            else f"{result[key]:.1%}"

    def line(by_stage: dict) -> str:
        """One split's stages, ``{"base" | "warm" | "rl": result}``."""
        base, warm, rl = (by_stage.get(stage) for stage in HELD_OUT_STAGES)
        greedy = [pct(r, "greedy") for r in (base, warm, rl)]
        return (f"avg@k: base {pct(base)} -> warm-start {pct(warm)} -> RL {pct(rl)}"
                + ("" if set(greedy) == {"n/a"}  # eval.greedy off
                   else f"   (greedy: {' -> '.join(greedy)})"))

    learner = summary.get("learner", {})
    for text in summary.get("checkpoint_fallbacks") or []:
        console.print(f"[yellow]{escape(text)}[/]", highlight=False)
    reasons = summary.get("failure_reasons") or {}
    for role in summary.get("failed_roles") or []:
        why = reasons.get(role) or "no reason in its log"
        console.print(f"[red]run failed: {role} failed for good ({escape(why)}; its log: "
                      f"logs/{role}.log); no held-out success after RL[/]", highlight=False)
    split = summary.get("eval_split", "held-out")
    validation = {stage: summary.get(f"success_{stage}") for stage in HELD_OUT_STAGES}
    console.print(f"[bold]summary[/]  {split} {line(validation)}   "
                  f"{learner.get('learner/updates', 0)} updates, "
                  f"version {learner.get('learner/version', 0)}", highlight=False)
    envs = list(dict.fromkeys(env for r in validation.values() if r
                              for env in r.get("envs") or {}))
    for env in envs:  # an env mix: each member env's, then the mean over them
        console.print(f"  {env}  " + line({stage: (r or {}).get("envs", {}).get(env)
                                            for stage, r in validation.items()}),
                      highlight=False)
    if envs:
        console.print("  mean over envs  " + line(
            {stage: (r or {}).get("mean_over_envs") for stage, r in validation.items()}),
            highlight=False)
    if summary.get("test"):
        console.print(f"[bold]test[/]     {line(summary['test'])}   (looked at once)",
                      highlight=False)
