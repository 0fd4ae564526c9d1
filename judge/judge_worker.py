"""The judge role: label every step of every stored trajectory GOOD or BAD.

    while not stopped:
        groups = replay.pull_judge_work(judge_id, max_groups, lease_s)   # leased, not taken
        for group in groups:
            labels = judge every trajectory         # LLM calls: at most `concurrency` at once
            cross-check with the reference judge    # LLM backends only: judge/agreement
            replay.submit_labels(labels)            # first labels for a group win
        every few seconds: metrics judge/*

A judge killed mid-group has submitted nothing for it, so nothing is half-written: its lease
runs out (``judge.lease_s``) and the replay server serves the group to the next judge that
pulls. A group the learner had to take before its labels arrived (``judge.deadline_s``) is no
longer served to judges.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from judge.step_judges import Judgement, StepJudge, agreement
from metrics.jsonl import MetricsWriter
from protocol.control import ControlPlane
from protocol.errors import EnvFailed, TransportTimeout
from protocol.messages import Group, StepLabels
from protocol.replay_client import ReplayClient
from protocol.role import StopEvent
from protocol.role_config import JudgeSettings

log = logging.getLogger(__name__)


class JudgeWorker:
    """Built from its settings, its replay client and its judges: ``judge`` labels,
    ``cross_check`` (or None) grades the same trajectories for ``judge/agreement``,
    ``between_pulls`` (or None; e.g. the policy judge following newer weights) runs before
    each pull. It owns all of them from here on: :meth:`close` releases them."""

    def __init__(self, settings: JudgeSettings, run_dir: Path, replay: ReplayClient,
                 judge: StepJudge, cross_check: StepJudge | None = None,
                 judge_id: str = "judge-0", control: ControlPlane | None = None,
                 between_pulls=None):
        self.cfg = settings.judge
        self.replay = replay
        self.judge = judge
        self.cross_check = cross_check
        self.judge_id = judge_id
        self.control = control
        self.between_pulls = between_pulls
        self.pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix=judge_id)
        self.metrics = MetricsWriter(run_dir, "judge", judge_id)
        self.window = JudgeWindow()
        self.totals = {"groups": 0, "steps": 0, "duplicates": 0}
        self._stop = StopEvent()
        self._closed = False

    def request_stop(self, *_):
        self._stop.set()

    def close(self) -> None:
        """Wait for the judge calls in flight (a thread left running would hold the model),
        then release the clients and the judges."""
        if self._closed:
            return
        self._closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.replay.close()
        self.metrics.close()
        for part in (self.judge, self.cross_check, self.between_pulls):
            close = getattr(part, "close", None)
            if close is not None:
                close()

    def run(self, stop: threading.Event | None = None, poll_s: float = 0.05,
            log_every_s: float = 5.0) -> None:
        self._stop.use(stop)
        next_log = time.monotonic() + log_every_s
        while not self._stop.is_set():
            if self.between_pulls is not None:
                self.between_pulls()
            try:
                groups = self.replay.pull_judge_work(self.judge_id, self.cfg.max_groups,
                                                     self.cfg.lease_s)
            except TransportTimeout as exc:  # no answer, or a full disk (ReplayDiskFull)
                log.warning("%s: pull: %s; retrying", self.judge_id, exc)
                continue
            if not groups:
                self._stop.wait(poll_s)
            for group in groups:
                if self._stop.is_set():  # the rest of the lease simply runs out
                    break
                try:
                    self.submit(self.judge_group(group))
                except TransportTimeout as exc:  # its lease runs out; it is judged again
                    log.warning("%s: labels for %s not stored: %s", self.judge_id,
                                group.group_id, exc)
                    break
                except EnvFailed as exc:  # a served env failed a replay: as above, the lease
                    # runs out and the group is judged again (or trains on outcomes alone
                    # once judge.deadline_s passes)
                    log.warning("%s: group %s not judged: %s", self.judge_id, group.group_id,
                                exc)
                    break
            if time.monotonic() >= next_log:
                self.log_metrics()
                next_log = time.monotonic() + log_every_s
        self.log_metrics()

    def judge_group(self, group: Group) -> StepLabels:
        t0 = time.monotonic()
        judgements = list(self.pool.map(lambda t: self.judge.judge(group.task, t),
                                        group.trajectories))
        agree = None
        if self.cross_check is not None:
            ref = [self.cross_check.judge(group.task, t) for t in group.trajectories]
            agree = [agreement(a.labels, b.labels) for a, b in zip(judgements, ref)
                     if a.labels]
        self.window.add(group, judgements, agree, time.monotonic() - t0)
        info = {"how": [j.how for j in judgements], "attempts": [j.attempts for j in judgements],
                "reasons": [j.reasons for j in judgements]}
        return StepLabels(group.group_id, [j.labels for j in judgements], self.judge.name, info)

    def submit(self, labels: StepLabels) -> None:
        status = self.replay.submit_labels(labels)
        self.totals["groups"] += 1
        self.totals["steps"] += sum(len(row) for row in labels.labels)
        self.totals["duplicates"] += status == "duplicate"
        if self.control is not None:
            self.control.incr("judge/groups_labelled")

    def log_metrics(self) -> None:
        values = self.window.flush()
        if not values:
            return
        stats = {f"{k}_total": float(v) for k, v in self.judge.stats.items()}
        self.metrics.log({**values, **stats, **{f"{k}_total": float(v)
                                                 for k, v in self.totals.items()}})


class JudgeWindow:
    """Throughput and label statistics since the last flush."""

    def __init__(self):
        self._reset()

    def _reset(self):
        self.t0 = time.monotonic()
        self.groups = self.steps = 0
        self.busy_s = 0.0
        self.good = {True: 0, False: 0}  # by outcome success
        self.labelled = {True: 0, False: 0}
        self.how: dict[str, int] = {}
        self.agreements: list[float] = []

    def add(self, group: Group, judgements: list[Judgement], agree, seconds: float) -> None:
        self.groups += 1
        self.busy_s += seconds
        for traj, j in zip(group.trajectories, judgements):
            won = traj.reward > 0
            self.steps += len(j.labels)
            self.good[won] += sum(j.labels)
            self.labelled[won] += len(j.labels)
            self.how[j.how] = self.how.get(j.how, 0) + 1
        if agree:
            self.agreements += agree

    def flush(self) -> dict[str, float]:
        if not self.groups:
            return {}
        wall = max(time.monotonic() - self.t0, 1e-9)
        values = {
            "groups_per_s": self.groups / wall, "labels_per_s": self.steps / wall,
            "busy_fraction": min(self.busy_s / wall, 1.0),
            # What the judge could do flat out: the number to compare with actor throughput.
            "capacity_groups_per_s": self.groups / max(self.busy_s, 1e-9),
            "groups": float(self.groups), "steps": float(self.steps),
        }
        for won, name in ((True, "good_frac_success"), (False, "good_frac_failure")):
            if self.labelled[won]:
                values[name] = self.good[won] / self.labelled[won]
        trajectories = sum(self.how.values())
        for how, n in self.how.items():
            values[f"how_{how}"] = n / trajectories
        if self.agreements:
            values["agreement"] = sum(self.agreements) / len(self.agreements)
        self._reset()
        return values
