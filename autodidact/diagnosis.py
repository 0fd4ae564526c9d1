"""Why RL moved or stalled: one line naming the likely cause, with the numbers behind it.

:func:`diagnose` is a pure function of a run's metrics records (``metrics.jsonl``, the
validation probe's among them) and its validation points (after warm-start and after RL, from
``summary.json`` and the per-task records); :func:`run_diagnosis` gathers those from a run
directory. ``autodidact report``
(its "Why RL moved or stalled" section) and the viewer's Run page show the same line.

It compares the first and the last quarter of the learner's updates, and reads, in this order:

1. **learning** when validation after RL beats validation after warm-start: the paired 95%
   interval of the difference lies above 0 (without per-task records, the difference is at
   least :data:`VALIDATION_GAIN`), whatever the training tasks did;
2. when **training success rose** (actor success on training tasks, by policy version; the
   batch reward where actors logged none) by at least :data:`RISE`: **overfitting the training
   tasks** if there is a validation after RL (it did not beat, or step 1 would have said so),
   or if the validation probe (``eval.probe_every``: the same validation tasks every few
   versions, at the actors' sampling settings) did not rise by :data:`RISE` over the same
   quarters of the policy versions; else **learning**: with the probe rising too, or said to
   be on the training tasks alone without either;
3. otherwise, **no signal** when fewer than :data:`NO_SIGNAL_SHARE` of the groups the learner
   saw were informative (their rollouts did not all score the same, so every advantage was
   zero);
4. otherwise, **drift without reward** when the policy kept moving: the KL to the behaviour
   policy or to the initial one, or the grad norm, rose (:data:`DRIFT_RATIO`,
   :data:`KL_FLOOR`, :data:`DRIFT_KL_INITIAL`, :data:`GRAD_RATIO`);
5. else **stalled, cause unclear**, with the same numbers.

Fewer than :data:`MIN_UPDATES` updates are **too early to tell**, except a run whose learner
never filled a batch because replay set aside every group as uninformative: **no signal**.

The thresholds are rules of thumb, named here with why; the line always carries the numbers,
so a reader can disagree with the label.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from autodidact.heldout import run_records
from metrics.intervals import format_diff, paired_interval
from metrics.jsonl import read_metrics
from protocol.run_dir import RunDir

# Fewer updates than this leave quarters of one batch each: their difference is one batch's
# noise, not a trend.
MIN_UPDATES = 8
# A rise in training success (or batch reward, both in [0, 1] for the built-in envs) of at
# least 5 points between the first and last quarter. A rule of thumb, not a significance
# test: on 200-update files runs (16 groups of 8 a batch) the means of two halves of one
# quarter differ by 2 to 12 points, so a smaller rise is noise as often as not; validation,
# read first, has an interval and decides "learning" without it. The validation probe's rise is
# held to the same bar, over the same quarters: training success carried over if validation
# rose as far as training success had to. A quarter of a 200-version run probed every 10
# versions on 32 tasks averages 160 rollouts of the same tasks (about ±8 points alone), so a
# probe under the bar is "not shown to rise", which with a rise in training is what overfitting
# looks like from here.
RISE = 0.05
# "Most groups uninformative": fewer than half carried any signal. Below that, most of the
# rollouts the actors make teach nothing; with learner.skip_uninformative the learner still
# fills its batches, but from a thin slice of the tasks, at several times the rollout cost.
NO_SIGNAL_SHARE = 0.5
# Without per-task records there is no paired interval; one seed's paired 95% interval of
# RL - warm-start on the files env's 200 validation tasks is about ±5 points wide
# (docs/evaluation.md), so a gain below that is not told from noise.
VALIDATION_GAIN = 0.05
# The KL to the behaviour policy "rose" when the last quarter's mean is at least twice the
# first's and at least KL_FLOOR: below 1e-3 nats/token it is the float noise of an on-policy
# step (an fp32 learner behind fp32 actors measured 1e-4, protocol/config.py autocast).
DRIFT_RATIO = 2.0
KL_FLOOR = 1e-3
# The KL to the initial policy starts at 0 at the first update, so a ratio says nothing: it
# "rose" when it grew by at least 0.02 nats/token: over an action of 50 tokens (the files
# env's), 1 nat, the sampled actions' likelihood changed e-fold. A policy that moved that far
# and gained no reward is drifting.
DRIFT_KL_INITIAL = 0.02
# The grad norm "rose" when the last quarter's mean is at least 1.5 times the first's: the
# clipped step (learner.grad_clip) then points ever harder in directions reward does not pay.
GRAD_RATIO = 1.5

CAUSES = ("learning", "overfitting the training tasks", "no signal", "drift without reward",
          "stalled, cause unclear", "too early to tell")


@dataclass
class Diagnosis:
    cause: str
    """One of :data:`CAUSES`."""
    reason: str
    """Why, with the numbers behind it (one line, no trailing period)."""
    numbers: dict = field(default_factory=dict)
    """Every number read: first and last quarter of each series, shares, validation."""

    @property
    def line(self) -> str:
        return f"{self.cause}: {self.reason}"

    def to_json(self) -> dict:
        """JSON-able, strictly: a number that is not finite (a NaN the metrics held) is None."""
        return {"cause": self.cause, "reason": self.reason, "line": self.line,
                "numbers": _finite_only(self.numbers)}


@dataclass
class Validation:
    """Validation success after warm-start and after RL, with the paired 95% interval of the
    difference when both kept per-task records."""
    warm: float
    rl: float | None
    low: float | None = None
    high: float | None = None
    split: str = "validation"

    def rose(self) -> bool:
        if self.rl is None:
            return False
        if self.low is not None:
            return self.low > 0
        return self.rl - self.warm >= VALIDATION_GAIN

    def words(self) -> str:
        if self.rl is None:
            return f"{self.split} {self.warm:.1%} after warm-start, none after RL yet"
        interval = (self.low, self.high) if self.low is not None else (float("nan"),) * 2
        return (f"{self.split} {self.warm:.1%} → {self.rl:.1%}, "
                f"{format_diff(self.rl - self.warm, interval)}")


# --- the series --------------------------------------------------------------------------------


def informative_share(record: dict) -> float | None:
    """The share of the groups an update saw that were informative: trained groups whose
    rollouts did not all score the same, over those plus the groups replay set aside as
    uninformative (``learner.skip_uninformative``); None when the record lacks the counts."""
    try:
        groups = float(record["learner/groups"])
        flat = float(record["learner/degenerate_groups"])
        skipped = float(record.get("learner/uninformative_groups", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    seen = groups + skipped
    return (groups - flat) / seen if seen > 0 else None


def updates(records: list[dict]) -> list[dict]:
    """The learner's update records in update order, the last of each update kept (a learner
    that resumed from a checkpoint logs the updates after it again)."""
    by_step = {}
    for r in records:
        if r.get("role") == "learner" and _num(r.get("learner/reward")) is not None:
            step = r.get("step", r.get("learner/updates"))
            if _num(step) is not None:
                by_step[int(step)] = r
    return [by_step[s] for s in sorted(by_step)]


def _mean_by_version(records: list[dict], role: str, version_key: str,
                     rate_key: str) -> list[tuple[int, float]]:
    """``role``'s ``rate_key`` by policy version (``version_key``), the mean per version."""
    by_version: dict[int, list[float]] = {}
    for r in records:
        v, rate = r.get(version_key), _num(r.get(rate_key))
        if r.get("role") == role and rate is not None and _num(v) is not None:
            by_version.setdefault(int(v), []).append(rate)
    return [(v, sum(xs) / len(xs)) for v, xs in sorted(by_version.items())]


def training_success(records: list[dict]) -> list[tuple[int, float]]:
    """Actor success on training tasks, the mean of its records per policy version."""
    return _mean_by_version(records, "actor", "actor/version", "actor/success_rate")


def probe_success(records: list[dict]) -> list[tuple[int, float]]:
    """The validation probe's success (``eval/probe_success``, actor/probe.py) by policy
    version; the mean where a version was probed twice (an actor restarted there)."""
    return _mean_by_version(records, "eval", "eval/version", "eval/probe_success")


def _env_series(records: list[dict], role: str, pattern: str,
                version_key: str) -> dict[str, list[tuple[int, float]]]:
    """Per member env of an env mix, ``role``'s per-env rate (``pattern`` with the env's id
    for ``{}``) by policy version, the mean per version; {} for a run of one env."""
    found = re.compile("^" + re.escape(pattern).replace(r"\{\}", "([^/]+)") + "$")
    envs = dict.fromkeys(m.group(1) for r in records if r.get("role") == role
                         for key in r if (m := found.match(key)))
    return {env: _mean_by_version(records, role, version_key, pattern.format(env))
            for env in envs}


def training_success_by_env(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """An env mix's actor success per member env (``actor/env/<id>/success``) by policy
    version; {} for a run of one env."""
    return _env_series(records, "actor", "actor/env/{}/success", "actor/version")


def probe_success_by_env(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """An env mix's validation probe success per member env (``eval/env/<id>/probe_success``)
    by policy version; {} for a run of one env."""
    return _env_series(records, "eval", "eval/env/{}/probe_success", "eval/version")


def probe_quarters(probe: list[tuple[int, float]],
                   versions: list[int]) -> tuple[float, float] | None:
    """Mean probe success over the policy versions of the first and of the last quarter of
    ``versions`` (training success's), so both series are read over the same quarters; None
    when either quarter holds no probe (too few, or a run without one)."""
    if len(versions) < 2:
        return None
    q = max(1, len(versions) // 4)
    first = [y for v, y in probe if v <= versions[q - 1]]
    last = [y for v, y in probe if v >= versions[-q]]
    if not first or not last:
        return None
    return sum(first) / len(first), sum(last) / len(last)


def quarters(values: list[float]) -> tuple[float, float] | None:
    """Means of the first and the last quarter of ``values`` (at least one value each)."""
    if not values:
        return None
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


def _finite_only(value):
    if isinstance(value, dict):
        return {k: _finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_only(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _series(rows: list[dict], metric: str) -> list[float]:
    return [x for x in (_num(r.get(metric)) for r in rows) if x is not None]


def _quarter_series(rows: list[dict], metric: str) -> tuple[float, float] | None:
    """First and last quarter means of ``metric`` over the updates' quarters: a metric logged
    every n updates (``kl_initial``) is read within the first and the last quarter of the
    updates, not of its own records."""
    q = max(1, len(rows) // 4)
    first, last = _series(rows[:q], metric), _series(rows[-q:], metric)
    if not first or not last:
        return None
    return sum(first) / len(first), sum(last) / len(last)


# --- the diagnosis -----------------------------------------------------------------------------


def diagnose(records: list[dict], validation: Validation | None = None) -> Diagnosis:
    """The likely cause of what RL did in the run whose metrics ``records`` are (every role's,
    as ``metrics.jsonl`` holds them), with ``validation`` after warm-start and after RL when
    known. Pure: reads nothing else."""
    rows = updates(records)
    if len(rows) < MIN_UPDATES:
        return _too_early(records, len(rows))
    numbers = _numbers(records, rows, validation)
    train = numbers["training success"]
    rise = train[1] - train[0]
    said = _evidence(numbers, validation)
    if validation is not None and validation.rose():
        flat = "" if rise >= RISE else "; validation rose while training success stayed flat"
        return Diagnosis("learning", said + flat, numbers)
    if rise >= RISE:
        return _training_rose(numbers, validation, said)
    share = numbers["informative share"]
    if share < NO_SIGNAL_SHARE:
        return Diagnosis("no signal", f"only {share:.0%} of groups informative (rollouts that "
                         f"did not all score the same), under {NO_SIGNAL_SHARE:.0%}; {said}",
                         numbers)
    moved = _drift(numbers)
    if moved:
        return Diagnosis("drift without reward", f"{', '.join(moved)} while training success "
                         f"stayed flat; {said}", numbers)
    return Diagnosis("stalled, cause unclear", f"training success flat, signal in "
                     f"{share:.0%} of groups, no drift; {said}", numbers)


def _training_rose(numbers: dict, validation: Validation | None, said: str) -> Diagnosis:
    """Training success rose and validation after RL, where there is one, did not beat: which
    validation shows it did not carry over (the end point, the probe, both), or that it did."""
    probe = numbers["validation probe"]
    behind = []
    if validation is not None and validation.rl is not None:
        behind.append("validation after RL does not beat after warm-start")
    if probe is not None and probe[1] - probe[0] < RISE:
        behind.append(f"the validation probe did not rise by {RISE * 100:.0f} points over the "
                      "same quarters")
    if behind:
        return Diagnosis("overfitting the training tasks", f"{said}; training success rose "
                         f"but {' and '.join(behind)}", numbers)
    if probe is not None:
        return Diagnosis("learning", f"{said}; the validation probe rose with it", numbers)
    return Diagnosis("learning", f"{said}; on the training tasks alone (no validation after RL "
                     "nor validation probe to show it carries over)", numbers)


def _too_early(records: list[dict], n: int) -> Diagnosis:
    """Too few updates to compare quarters; unless replay set every group aside."""
    replay = [r for r in records if r.get("role") == "replay"
              and _num(r.get("replay/set_aside")) is not None]
    set_aside = _num(replay[-1].get("replay/set_aside")) if replay else None
    stored = _num(replay[-1].get("replay/groups")) if replay else None
    if n == 0 and set_aside:
        numbers = {"updates": 0, "set aside": set_aside, "groups stored": stored}
        return Diagnosis("no signal", f"replay set aside {set_aside:.0f} groups as "
                         f"uninformative (rollouts that all scored the same) and the learner "
                         f"never filled a batch", numbers)
    return Diagnosis("too early to tell", f"{n} learner updates; the diagnosis compares the "
                     f"first and last quarters of at least {MIN_UPDATES}", {"updates": n})


def _numbers(records, rows, validation) -> dict:
    """Every number the causes are read from: first/last quarter pairs, and shares."""
    by_version = training_success(records)
    success = [rate for _, rate in by_version]
    train = quarters(success) or _quarter_series(rows, "learner/reward")
    seen = [(informative_share(r), r) for r in rows]
    informative = sum((r["learner/groups"] - r["learner/degenerate_groups"])
                      for s, r in seen if s is not None)
    total = sum(r["learner/groups"] + r.get("learner/uninformative_groups", 0)
                for s, r in seen if s is not None)
    numbers = {
        "updates": len(rows),
        "training success": train,
        "training success from": "actor/success_rate" if success else "learner/reward",
        "batch reward": _quarter_series(rows, "learner/reward"),
        "informative share": informative / total if total else 0.0,
        "informative groups": [informative, total],
        "kl_behaviour": _quarter_series(rows, "learner/kl_behaviour"),
        "kl_initial": _quarter_series(rows, "learner/kl_initial")
        or _quarter_series(rows, "learner/kl_ref"),
        "grad_norm": _quarter_series(rows, "learner/grad_norm"),
        "entropy": _quarter_series(rows, "learner/entropy"),
        "validation probe": probe_quarters(probe_success(records),
                                           [v for v, _ in by_version]),
    }
    per_env = training_success_by_env(records)  # an env mix: each member env's
    if per_env:
        numbers["training success per env"] = {
            env: quarters([rate for _, rate in series]) for env, series in per_env.items()}
        probes = {env: probe_quarters(series, [v for v, _ in by_version])
                  for env, series in probe_success_by_env(records).items()}
        numbers["validation probe per env"] = {env: q for env, q in probes.items() if q}
    if validation is not None:
        numbers["validation"] = {"warm": validation.warm, "rl": validation.rl,
                                 "low": validation.low, "high": validation.high}
    return numbers


def _drift(numbers: dict) -> list[str]:
    """What rose between the first and last quarter, in words with its numbers."""
    moved = []
    kl_b, kl_i, grad = numbers["kl_behaviour"], numbers["kl_initial"], numbers["grad_norm"]
    if kl_b and kl_b[1] >= KL_FLOOR and kl_b[1] >= DRIFT_RATIO * kl_b[0]:
        moved.append(f"KL to the behaviour policy rose {kl_b[0]:.2g} → {kl_b[1]:.2g}")
    if kl_i and kl_i[1] - kl_i[0] >= DRIFT_KL_INITIAL:
        moved.append(f"KL to the initial policy rose {kl_i[0]:.2g} → {kl_i[1]:.2g}")
    if grad and grad[1] >= GRAD_RATIO * grad[0]:
        moved.append(f"grad norm rose {grad[0]:.3g} → {grad[1]:.3g}")
    return moved


def _evidence(numbers: dict, validation: Validation | None) -> str:
    train = numbers["training success"]
    what = "training success" if numbers["training success from"] == "actor/success_rate" \
        else "batch reward"
    parts = [f"{what} {train[0]:.0%} → {train[1]:.0%} (first vs last quarter of "
             f"{numbers['updates']} updates)"]
    if numbers["validation probe"] is not None:
        first, last = numbers["validation probe"]
        parts.append(f"validation probe {first:.0%} → {last:.0%} (same quarters)")
    per_env = numbers.get("training success per env") or {}
    if per_env:  # an env mix: where the change came from, env by env
        probes = numbers.get("validation probe per env") or {}
        parts.append("per env: " + ", ".join(
            f"{env} {q[0]:.0%} → {q[1]:.0%}" + (f" (probe {probes[env][0]:.0%} → "
                                                f"{probes[env][1]:.0%})" if env in probes
                                                else "")
            for env, q in per_env.items() if q))
    if validation is not None:
        parts.append(validation.words())
    return ", ".join(parts)


# --- from a run directory ----------------------------------------------------------------------


def run_validation(run_dir: Path, summary: dict) -> Validation | None:
    """Validation after warm-start and after RL from ``summary`` (``summary.json``), with the
    paired interval of the difference when the run kept both stages' per-task records."""
    warm = _num((summary.get("success_warm") or {}).get("avg"))
    if warm is None:
        return None
    rl = _num((summary.get("success_rl") or {}).get("avg"))
    split = summary.get("eval_split") or "validation"
    found = Validation(warm, rl, split=split)
    if rl is not None:
        try:
            stages = run_records(run_dir, split)
        except ValueError:  # a records file cut short: no interval, said as such
            stages = {}
        if "warm" in stages and "rl" in stages:
            paired = paired_interval(stages["warm"], stages["rl"])
            found.low, found.high = paired["low"], paired["high"]
    return found


def run_diagnosis(run_dir: Path, records: list[dict] | None = None,
                  summary: dict | None = None) -> Diagnosis:
    """:func:`diagnose` of the run in ``run_dir`` (its records and summary read unless
    given)."""
    if records is None:
        records = read_metrics(run_dir)
    if summary is None:
        try:
            summary = json.loads(RunDir(run_dir).summary.read_text())
        except (OSError, ValueError):
            summary = {}
    return diagnose(records, run_validation(Path(run_dir), summary))
