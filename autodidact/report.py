"""``autodidact report``: plots and a markdown summary of one run, or of several overlaid.

    autodidact report runs/x                       -> runs/x/report/
    autodidact report runs/a runs/b --labels a,b   -> runs/a/report/compare/ (or --out DIR)

Reads only files in the run directory: ``metrics.jsonl`` (every role's records),
``summary.json`` (held-out success before warm-start, after warm-start and after RL; restarts),
``config.yaml`` (shown with the Redis password redacted), and for the table of training tasks
by origin ``replay.lmdb``, ``split.json`` and ``tasks.lmdb`` (:mod:`autodidact.task_origins`).
Writes one PNG per plot, a ``report.md`` with the config, headline numbers, why RL moved or
stalled (the likely cause, :mod:`autodidact.diagnosis`, and the plots it is read from) and
tasks by origin, and ``series.json`` with every plotted series (the raw points: plots of noisy
per-record series draw a running mean over them) and each run's diagnosis.

x-axes: ``update`` is the learner's update count (the ``step`` of its records); ``version`` the
policy version an actor's groups were generated with; ``wall`` seconds since the run's first
metrics record (the start of the RL phase, unless an explore stage logged before it). A series
that a run did not log is left out of the plot and named in report.md; a plot with no series at
all is not drawn.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from autodidact import diagnosis, task_origins
from metrics.intervals import format_rate
from metrics.jsonl import read_metrics
from protocol.config import redacted_config, url_password
from protocol.run_dir import HELD_OUT_STAGES, RunDir


@dataclass
class Line:
    role: str  # a role of metrics.jsonl, or "heldout": the run's summary.json (Run.series)
    metric: str
    x: str  # "update" | "wall" | "version"


@dataclass
class Panel:
    ylabel: str
    lines: list[Line]
    log_y: bool = False


@dataclass
class Plot:
    name: str
    title: str
    panels: list[Panel]
    about: str = ""


def _u(metric: str) -> Line:
    return Line("learner", metric, "update")


def _w(role: str, metric: str) -> Line:
    return Line(role, metric, "wall")


PLOTS = [
    Plot("train_success", "Actor success rate on training tasks", [
        Panel("success rate (mean per policy version)", [Line("actor", "actor/success_rate",
                                                              "version")]),
        Panel("success rate", [_w("actor", "actor/success_rate")]),
    ], "rollouts the actors generated, by the policy version they were sampled with and over "
       "wall time (a running mean)"),
    Plot("reward", "Reward", [
        Panel("mean reward of the batch", [_u("learner/reward")]),
        Panel("actor mean reward", [_w("actor", "actor/reward")]),
    ], "the learner's batches by update; the actors' groups over wall time"),
    Plot("loss", "Loss", [
        Panel("loss", [_u("learner/loss"), _u("learner/pg_loss")]),
        Panel("grad norm", [_u("learner/grad_norm")]),
    ]),
    Plot("clip_fraction", "Clip fraction", [
        Panel("fraction of tokens", [_u("learner/clip_fraction"),
                                     _u("learner/dual_clip_fraction")]),
    ]),
    Plot("importance_weights", "Importance weights (behaviour vs proximal policy)", [
        Panel("importance weight", [_u("learner/iw_mean"), _u("learner/iw_max")]),
        Panel("fraction / KL", [_u("learner/iw_masked_fraction"), _u("learner/kl_behaviour")]),
    ]),
    Plot("lag", "Policy lag of trained groups (versions)", [
        Panel("lag", [_u("learner/lag_min"), _u("learner/lag_mean"), _u("learner/lag_max")]),
    ]),
    Plot("throughput", "Throughput per role", [
        Panel("learner updates/s", [_w("learner", "learner/updates_per_s")]),
        Panel("tokens/s", [_w("learner", "learner/tokens_per_s"),
                           _w("actor", "actor/tokens_per_s")]),
        Panel("groups/s", [_w("replay", "replay/groups_per_s"),
                           _w("judge", "judge/groups_per_s")]),
    ], "actor tokens/s is per actor (a running mean over every actor's records)"),
    Plot("idle", "Idle fraction per role", [
        Panel("idle fraction", [_w("learner", "learner/idle_fraction"),
                                _w("actor", "actor/idle_fraction")]),
    ]),
    Plot("replay", "Replay store", [
        Panel("groups", [_w("replay", "replay/groups"), _w("replay", "replay/unjudged")]),
        Panel("bytes", [_w("replay", "replay/bytes")]),
    ]),
]


# What "Why RL moved or stalled" shows (autodidact/diagnosis.py reads the same series): the
# viewer's Run page draws these too.
WHY_PLOTS = [
    Plot("why_success", "Training-task success vs validation", [
        Panel("success rate", [Line("actor", "actor/success_rate", "version"),
                               Line("eval", "eval/probe_success", "version"),
                               Line("heldout", "heldout/avg", "version"),
                               Line("heldout", "heldout/base_avg", "version")]),
    ], "actor success on the training tasks (mean per policy version) beside validation: the "
       "validation probe every `eval.probe_every` versions (`eval/probe_success`: the same "
       "`eval.probe_tasks` validation tasks each time, one rollout each at the actors' "
       "sampling settings), and the held-out split's avg@k after warm-start at version 0 and "
       "after RL at the last version (`heldout/avg`), before warm-start at version 0 "
       "(`heldout/base_avg`)"),
    Plot("why_signal", "Signal in the groups", [
        Panel("informative share", [_u("learner/informative_share")]),
        Panel("mean reward of the batch", [_u("learner/reward")]),
    ], "the share of the groups each update saw whose rollouts did not all score the same "
       "(trained groups with different outcomes, over the trained and the set-aside ones)"),
    Plot("why_policy", "How the policy moved", [
        Panel("entropy (nats/token)", [_u("learner/entropy")]),
        Panel("KL (nats/token)", [_u("learner/kl_behaviour"), _u("learner/kl_initial"),
                                  _u("learner/kl_ref")]),
    ], "entropy of the policy at the trained tokens; k3 KL to the behaviour policy (every "
       "update) and to the initial policy (`kl_initial` every `learner.diagnostics_every` "
       "updates, or `kl_ref` every update under a KL penalty)"),
    Plot("why_step", "The steps", [
        Panel("grad norm", [_u("learner/grad_norm")]),
        Panel("importance weight", [_u("learner/iw_mean"), _u("learner/iw_max")]),
        Panel("fraction of tokens", [_u("learner/clip_fraction"),
                                     _u("learner/iw_masked_fraction")]),
        Panel("learning rate", [_u("learner/lr")]),
    ], "grad norm before clipping, importance weights proximal/behaviour, the tokens the PPO "
       "clip bound and those the weight cap dropped, and the learning rate"),
]


# An env mix (env.mix): success per member env, in "Why RL moved or stalled" beside
# why_success (the viewer's Run page draws it too); only for runs that have member envs.
ENV_METRIC = re.compile(r"^(?:actor|eval)/env/([^/]+)/")


def env_success_plot(envs: list[str]) -> Plot:
    """Each member env's training-task success, validation probe and held-out validation
    avg@k, one line per env in each panel."""
    return Plot("why_success_envs", "Success per env (env mix)", [
        Panel("training success (mean per policy version)",
              [Line("actor", f"actor/env/{env}/success", "version") for env in envs]),
        Panel("validation probe", [Line("eval", f"eval/env/{env}/probe_success", "version")
                                   for env in envs]),
        Panel("validation avg@k", [Line("eval", f"eval/env/{env}/success_avg", "update")
                                   for env in envs]),
    ], "an env mix's success per member env: the actors' rollouts of each env's training "
       "tasks by the policy version they were sampled with (`actor/env/<id>/success`), the "
       "validation probe's tasks of each env (`eval/env/<id>/probe_success`), and each "
       "held-out validation evaluation's avg@k per env (`eval/env/<id>/success_avg`, on the "
       "learner-update axis: before and after warm-start at update 0, after RL at the last "
       "update; the intervals are in the headline table)")


def run_envs(run: Run) -> list[str]:
    """The member envs of an env mix run, from summary.json's per-env results and the
    per-env metrics (``actor/env/<id>/...``, ``eval/env/<id>/...``); [] for one env."""
    found = [env for key in [*(f"success_{s}" for s in HELD_OUT_STAGES)]
             for env in ((run.summary.get(key) or {}).get("envs") or {})]
    found += [env for r in (run.summary.get("test") or {}).values() if isinstance(r, dict)
              for env in (r.get("envs") or {})]
    for r in run.records:
        if r.get("role") in ("actor", "eval"):
            found += [m.group(1) for key in r if (m := ENV_METRIC.match(key))]
    return list(dict.fromkeys(found))


def env_plots(runs: list[Run]) -> tuple[Plot | None, list[Run]]:
    """The per-env success plot of ``runs``' member envs and the runs that have them; None
    and [] where no run is an env mix."""
    per_run = [(run, run_envs(run)) for run in runs]
    envs = list(dict.fromkeys(env for _, found in per_run for env in found))
    return (env_success_plot(envs) if envs else None), [run for run, found in per_run if found]


# --- one run ---------------------------------------------------------------------------------


@dataclass
class Run:
    path: Path
    label: str
    records: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    t0: float = 0.0

    @classmethod
    def load(cls, path: Path, label: str) -> Run:
        import yaml

        run = cls(path, label, records=read_metrics(path))
        try:
            run.summary = json.loads(RunDir(path).summary.read_text())
        except (OSError, ValueError):
            run.summary = {}
        try:
            run.config = yaml.safe_load(RunDir(path).config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            run.config = {}
        run.secrets = _secrets(path, run.config)
        run.config = redacted_config(run.config) if isinstance(run.config, dict) else {}
        times = [r["t"] for r in run.records if isinstance(r.get("t"), (int, float))]
        run.t0 = min(times) if times else 0.0
        for r in run.records:  # derived, for the plots: the learner logs its parts
            share = diagnosis.informative_share(r) if r.get("role") == "learner" else None
            if share is not None:
                r["learner/informative_share"] = share
        return run

    def config_value(self, section: str, key: str):
        value = (self.config.get(section) or {}).get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) \
            else None

    def rows(self, role: str, metric: str) -> list[dict]:
        return [r for r in self.records if r.get("role") == role
                and isinstance(r.get(metric), (int, float)) and not isinstance(r[metric], bool)]

    def series(self, line: Line) -> tuple[list, list]:
        if line.role == "heldout":
            return self._heldout(line.metric)
        rows = self.rows(line.role, line.metric)
        if line.x == "update":
            xs = [r.get("step", r.get("learner/updates")) for r in rows]
            pts = [(x, r[line.metric]) for x, r in zip(xs, rows) if x is not None]
            return [p[0] for p in pts], [p[1] for p in pts]
        if line.x == "version":
            by_version: dict[int, list[float]] = {}
            for r in rows:
                v = r.get(f"{line.role}/version")
                if isinstance(v, (int, float)):
                    by_version.setdefault(int(v), []).append(r[line.metric])
            versions = sorted(by_version)
            return versions, [sum(by_version[v]) / len(by_version[v]) for v in versions]
        rows = sorted((r for r in rows if isinstance(r.get("t"), (int, float))),
                      key=lambda r: r["t"])
        return [r["t"] - self.t0 for r in rows], [r[line.metric] for r in rows]


    def _heldout(self, metric: str) -> tuple[list, list]:
        """Held-out avg@k on the policy-version axis: ``heldout/avg`` after warm-start
        (version 0) and after RL (the last version), ``heldout/base_avg`` before warm-start
        (version 0); what summary.json holds of them."""
        final = headline(self)["version"] or 0
        stages = (("warm", 0), ("rl", final)) if metric == "heldout/avg" else (("base", 0),)
        pts = [(x, (self.summary.get(f"success_{stage}") or {}).get("avg"))
               for stage, x in stages]
        pts = [(x, y) for x, y in pts if isinstance(y, (int, float))]
        return [x for x, _ in pts], [y for _, y in pts]


def _secrets(path: Path, config: dict) -> list[str]:
    """Strings that must never reach a report: the run's Redis password, however it is found."""
    found = []
    try:
        found.append(RunDir(path).redis_password.read_text().strip())
    except OSError:
        pass
    url = (config.get("redis") or {}).get("url") if isinstance(config, dict) else None
    if isinstance(url, str):
        found.append(url_password(url))
    return [s for s in found if len(s) >= 4]


# --- headline numbers ------------------------------------------------------------------------


def headline(run: Run) -> dict:
    learner = [r for r in run.records if r.get("role") == "learner"
               and isinstance(r.get("learner/updates"), (int, float))]
    losses = [r["learner/loss"] for r in run.rows("learner", "learner/loss")]
    last_actor: dict[str, dict] = {}
    for r in run.rows("actor", "actor/groups"):
        last_actor[r.get("id", "actor")] = r
    groups = sum(r["actor/groups"] for r in last_actor.values()) if last_actor else None
    times = [r["t"] for r in run.records if isinstance(r.get("t"), (int, float))]
    span = (max(times) - min(times)) if times else None
    restarts = run.summary.get("restarts") if isinstance(run.summary.get("restarts"),
                                                          dict) else None
    out = {
        "finished": any("learner/done" in r for r in learner) or "learner" in run.summary,
        "updates": learner[-1]["learner/updates"] if learner else None,
        "version": learner[-1].get("learner/version") if learner else None,
        "wall_s": span, "groups": groups,
        "groups_per_s": groups / span if groups is not None and span else None,
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "final_reward": _last_value(run, "learner", "learner/reward"),
        "final_lag_mean": _last_value(run, "learner", "learner/lag_mean"),
        "restarts_total": sum(v for v in restarts.values() if isinstance(v, int))
        if restarts is not None else None,
        "restarts": {k: v for k, v in (restarts or {}).items() if v},
    }
    out["heldout_split"] = run.summary.get("eval_split", "held-out")
    out["looked_at_test"] = run.summary.get("looked_at_test")
    test = run.summary.get("test") or {}
    for stage in HELD_OUT_STAGES:
        result = run.summary.get(f"success_{stage}") or {}
        for key in ("avg", "avg_ci", "best", "greedy", "tasks"):
            out[f"heldout_{stage}_{key}"] = result.get(key)
        out[f"test_{stage}_avg"] = (test.get(stage) or {}).get("avg")
        out[f"test_{stage}_avg_ci"] = (test.get(stage) or {}).get("avg_ci")
        # an env mix: each member env's held-out avg@k and the mean over envs (test, where
        # the run looked)
        _per_env(out, f"heldout_{stage}", result)
        _per_env(out, f"test_{stage}", test.get(stage) or {})
    return out


def _per_env(out: dict, prefix: str, result: dict) -> None:
    """``result``'s per-env avg@k (an env mix's) into ``out`` as ``<prefix>_env_<id>_avg``
    and ``_avg_ci``, the mean over envs as ``<prefix>_mean_over_envs``, and each env's id
    in ``out["envs"]``."""
    for env, one in (result.get("envs") or {}).items():
        out.setdefault("envs", [])
        if env not in out["envs"]:
            out["envs"].append(env)
        out[f"{prefix}_env_{env}_avg"] = one.get("avg")
        out[f"{prefix}_env_{env}_avg_ci"] = one.get("avg_ci")
    out[f"{prefix}_mean_over_envs"] = (result.get("mean_over_envs") or {}).get("avg")


def _last_value(run: Run, role: str, metric: str):
    rows = run.rows(role, metric)
    return rows[-1][metric] if rows else None


# --- plotting --------------------------------------------------------------------------------


def _running_mean(ys: list[float], window: int) -> list[float]:
    if window <= 1:
        return list(ys)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _window(n: int) -> int:
    return max(1, n // 25)


XLABEL = {"update": "learner update", "wall": "wall time (s)", "version": "policy version"}


def missing_reason(run: Run, line: Line) -> str:
    """Why ``run`` has no ``line``: where the run's config or age explains it, that; else that
    its metrics lack it."""
    own = f"not in the metrics of run '{run.label}'"

    def learner(key):
        return run.config_value("learner", key)

    if line.role == "heldout":
        return f"run '{run.label}' has no such held-out evaluation in summary.json " \
               "(eval.num_tasks=0, eval.before_rl=false, or the run did not get that far)"
    if line.metric == "eval/probe_success" or (line.role == "eval"
                                                and line.metric.endswith("/probe_success")):
        return _probe_missing(run, own)
    if line.metric == "learner/kl_initial":
        if learner("kl_coef"):
            return f"run '{run.label}' has learner.kl_coef > 0: its KL to the initial policy " \
                   "is `learner/kl_ref`, drawn beside it"
        if learner("diagnostics_every") == 0:
            return f"run '{run.label}' has learner.diagnostics_every=0 (off)"
        if learner("diagnostics_every") is None:
            return f"{own}: made before the learner logged it (learner.diagnostics_every)"
    if line.metric == "learner/kl_ref" and not learner("kl_coef"):
        return f"run '{run.label}' has no KL penalty (learner.kl_coef=0); " \
               "`learner/kl_initial` is its KL to the initial policy"
    if line.metric == "learner/entropy" and learner("diagnostics_every") is None:
        return f"{own}: made before the learner logged it"
    return own


def _probe_missing(run: Run, own: str) -> str:
    """Why a run has no validation probe: off, made before it existed, or not yet probed."""
    every = run.config_value("eval", "probe_every")
    if every == 0:
        return f"run '{run.label}': eval.probe_every is 0 (the validation probe is off)"
    if every is None:
        return f"{own}: made before the validation probe (eval.probe_every)"
    return f"{own}: actor-0 has not probed yet (eval.probe_every={every})"


def draw_plot(plot: Plot, runs: list[Run], out_dir: Path, notes: list[str]) -> dict | None:
    """Draw ``plot`` for ``runs`` into ``out_dir/<name>.png``; its series, or None if none."""
    import matplotlib.pyplot as plt

    found = [[(line, run, *run.series(line)) for line in panel.lines for run in runs]
             for panel in plot.panels]
    for panel_found in found:
        for line, run, xs, _ in panel_found:
            if not xs:
                notes.append(f"`{line.metric}` (vs {line.x}): {missing_reason(run, line)}")
    panels = [(p, [f for f in pf if f[2]]) for p, pf in zip(plot.panels, found)]
    panels = [(p, pf) for p, pf in panels if pf]
    if not panels:
        notes.append(f"plot '{plot.name}' not drawn: none of its series was logged")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    series = []
    for ax, (panel, pf) in zip(axes[0], panels):
        metrics = list(dict.fromkeys(f[0].metric for f in pf))
        for line, run, xs, ys in pf:
            color = colors[runs.index(run) % len(colors)]
            style = styles[metrics.index(line.metric) % len(styles)]
            window = _window(len(ys)) if line.x == "wall" else 1
            label = run.label if len(metrics) == 1 else (
                f"{run.label}: {line.metric}" if len(runs) > 1 else line.metric)
            ax.plot(xs, _running_mean(ys, window), style, color=color, label=label,
                    marker="." if len(xs) < 30 else None)
            series.append({"run": run.label, "metric": line.metric, "x_axis": line.x,
                           "x": xs, "y": ys, "running_mean": window})
        ax.set_xlabel(XLABEL[pf[0][0].x])
        ax.set_ylabel(panel.ylabel)
        if len(metrics) == 1:
            ax.set_title(metrics[0], fontsize=9)
        ax.grid(alpha=0.3)
        if len(pf) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(plot.title)
    fig.tight_layout()
    fig.savefig(out_dir / f"{plot.name}.png", dpi=90)
    plt.close(fig)
    return {"file": f"{plot.name}.png", "title": plot.title, "about": plot.about,
            "series": series}


def draw_heldout(runs: list[Run], out_dir: Path, notes: list[str]) -> dict | None:
    """Held-out success at the three points the launcher measures it: the base model and the
    warm-started one (both at update 0) and the final weights (at the last update)."""
    import matplotlib.pyplot as plt

    series = []
    for run in runs:
        final = headline(run)["updates"] or 0
        for key in ("avg", "greedy"):
            pts = [(stage, x, (run.summary.get(f"success_{stage}") or {}).get(key))
                   for stage, x in (("base", 0), ("warm", 0), ("rl", final))]
            pts = [p for p in pts if isinstance(p[2], (int, float))]
            if pts:
                series.append({"run": run.label, "metric": f"heldout/{key}",
                               "x_axis": "update", "stages": [p[0] for p in pts],
                               "x": [p[1] for p in pts], "y": [p[2] for p in pts]})
        if not any(s["run"] == run.label for s in series):
            notes.append(f"held-out success: run '{run.label}' has none in summary.json "
                         "(eval.num_tasks=0, or the run did not get that far)")
    notes.append("held-out success vs wall time: not plotted; the launcher evaluates held-out "
                 "tasks only before warm-start, after it and after RL, and does not record when")
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = {"base": "o", "warm": "s", "rl": "^"}
    for s in series:
        color = colors[[r.label for r in runs].index(s["run"]) % len(colors)]
        style = "-" if s["metric"] == "heldout/avg" else "--"
        ax.plot(s["x"], s["y"], style, color=color, alpha=0.6,
                label=f"{s['run']}: {s['metric'].split('/')[1]}")
        for stage, x, y in zip(s["stages"], s["x"], s["y"]):
            ax.plot([x], [y], markers[stage], color=color)
            if s is series[0]:
                ax.annotate(stage, (x, y), textcoords="offset points", xytext=(5, -10),
                            fontsize=7)
    ax.set_xlabel(XLABEL["update"])
    ax.set_ylabel("held-out success")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Held-out success: base, after warm-start, after RL", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "heldout_success.png", dpi=90)
    plt.close(fig)
    return {"file": "heldout_success.png", "title": "Held-out success",
            "about": "avg@k (sampled) and greedy success on the held-out tasks; base and "
                     "warm-start at update 0, after RL at the last update", "series": series}


# --- markdown --------------------------------------------------------------------------------


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _pct_ci(v, interval) -> str:
    return _pct(v) if v is None or not interval else format_rate(v, interval)


def _num(v, spec=".4g") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float) and not math.isfinite(v):
        return "n/a"
    return format(v, spec) if isinstance(v, float) else str(v)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def origins_markdown(runs: list[Run], tables: list[dict]) -> list[str]:
    """The "Tasks by origin" section: one row per run and origin (task_origins.run_origins)."""
    several = len(runs) > 1
    out = ["## Tasks by origin", "",
           "Hand-written tasks are the env's training split, self-made ones the pool of "
           "verified self-questioned tasks; groups, success and informative groups (rollouts "
           "that did not all score the same) are counted over the groups replay holds, and "
           "*drawn* is the share of those groups that were self-made.", ""]
    for run, table in zip(runs, tables):
        name = f"**{run.label}**: " if several else ""
        out.append(f"- {name}{task_origins.counted_words(table)}; `tasks.synthetic_share` "
                   f"{task_origins.share_words(table)}")
    out += ["", ("| run " if several else "") + "| origin | tasks | groups drawn | success | "
            "informative groups |", "|---" * (5 + several) + "|"]
    for run, table in zip(runs, tables):
        for row in table["origins"]:
            out.append((f"| {run.label} " if several else "") + f"| {row['origin']} | "
                       f"{_num(row['tasks'])} | {row['groups']} | "
                       f"{_pct(row['success'])} ({row['successes']}/{row['rollouts']}) | "
                       f"{_pct(row['informative_share'])} "
                       f"({row['informative']}/{row['groups']}) |")
    return out + [""]


def why_markdown(runs: list[Run], diagnoses: list[diagnosis.Diagnosis],
                 plots: list[dict]) -> list[str]:
    """The "Why RL moved or stalled" section: each run's likely cause, and its plots."""
    several = len(runs) > 1
    out = ["## Why RL moved or stalled", "",
           "The likely cause, read off the first and last quarter of the updates, the "
           "validation probe over the same quarters (where `eval.probe_every` > 0) and the "
           "validation after warm-start and after RL (`autodidact/diagnosis.py`; "
           "docs/reports.md says how):", ""]
    for run, d in zip(runs, diagnoses):
        name = f"{run.label}: " if several else ""
        out.append(f"- {name}**{d.cause}**: {d.reason}.")
    out.append("")
    for p in plots:
        out += [f"### {p['title']}", "", p["about"] + ".", "", f"![{p['title']}]({p['file']})",
                ""]
    return out


def markdown(runs: list[Run], heads: list[dict], plots: list[dict], notes: list[str],
             origins: list[dict] | None = None, why: list[str] | None = None) -> str:
    import yaml

    labels = [r.label for r in runs]
    out = [f"# Run report: {', '.join(labels)}", "",
           f"Made by `autodidact report` at {time.strftime('%Y-%m-%d %H:%M:%S')} from:", ""]
    out += [f"- **{r.label}**: `{r.path}`" for r in runs]
    out += ["", "## Headline numbers", "", "| | " + " | ".join(labels) + " |",
            "|---" * (len(runs) + 1) + "|"]

    def row(name, fmt, key):
        out.append(f"| {name} | " + " | ".join(fmt(h.get(key)) for h in heads) + " |")

    def rate_row(name, prefix):
        out.append(f"| {name} | " + " | ".join(_pct_ci(h.get(f"{prefix}_avg"),
                                                      h.get(f"{prefix}_avg_ci"))
                                                for h in heads) + " |")

    row("held-out split", str, "heldout_split")
    for stage, name in (("base", "before warm-start"), ("warm", "after warm-start"),
                        ("rl", "after RL")):
        rate_row(f"held-out avg@k, {name} (95% interval)", f"heldout_{stage}")
    for stage, name in (("base", "before warm-start"), ("warm", "after warm-start"),
                        ("rl", "after RL")):
        row(f"held-out greedy, {name}", _pct, f"heldout_{stage}_greedy")
    envs = list(dict.fromkeys(env for h in heads for env in h.get("envs", [])))
    for env in envs:  # an env mix: each member env's, and the mean over them
        for stage, name in (("base", "before warm-start"), ("warm", "after warm-start"),
                            ("rl", "after RL")):
            rate_row(f"held-out avg@k of {env}, {name} (95% interval)",
                     f"heldout_{stage}_env_{env}")
    if envs:
        for stage, name in (("base", "before warm-start"), ("warm", "after warm-start"),
                            ("rl", "after RL")):
            row(f"held-out avg@k, mean over envs, {name}", _pct,
                f"heldout_{stage}_mean_over_envs")
    row("held-out best@k, after RL", _pct, "heldout_rl_best")
    row("held-out tasks", _num, "heldout_rl_tasks")
    row("looked at test", _num, "looked_at_test")
    if any(h.get("test_rl_avg") is not None for h in heads):
        for stage, name in (("base", "before warm-start"), ("warm", "after warm-start"),
                            ("rl", "after RL")):
            rate_row(f"test avg@k, {name} (95% interval)", f"test_{stage}")
        stages = [(stage, name) for stage, name in (("base", "before warm-start"),
                                                    ("warm", "after warm-start"),
                                                    ("rl", "after RL"))
                  if any(h.get(f"test_{stage}_mean_over_envs") is not None for h in heads)]
        for env in envs:  # an env mix: each member env's test result, and the mean
            for stage, name in stages:
                rate_row(f"test avg@k of {env}, {name} (95% interval)", f"test_{stage}_env_{env}")
        for stage, name in stages:
            row(f"test avg@k, mean over envs, {name}", _pct, f"test_{stage}_mean_over_envs")
    row("learner updates", _num, "updates")
    row("policy version", _num, "version")
    row("wall time of the metrics (s)", lambda v: _num(v, ".0f"), "wall_s")
    row("groups generated", _num, "groups")
    row("groups/s", lambda v: _num(v, ".2f"), "groups_per_s")
    row("final loss", _num, "final_loss")
    row("mean loss, last 10 updates", _num, "mean_loss_last_10")
    row("final batch reward", lambda v: _num(v, ".3f"), "final_reward")
    row("final lag (mean)", lambda v: _num(v, ".2f"), "final_lag_mean")
    row("restarts", _num, "restarts_total")
    out.append("| roles restarted | " + " | ".join(
        ", ".join(f"{k} {v}" for k, v in h["restarts"].items()) or "none" for h in heads) + " |")
    row("finished (learner done)", _num, "finished")
    out.append("")
    out += why or []
    if origins:
        out += origins_markdown(runs, origins)
    out += ["## Plots", ""]
    for p in plots:
        out += [f"### {p['title']}", ""]
        if p.get("about"):
            out += [p["about"] + ".", ""]
        out += [f"![{p['title']}]({p['file']})", ""]
    if notes:
        out += ["## Missing series", ""] + [f"- {n}" for n in dict.fromkeys(notes)] + [""]
    out += ["## Config", "", "The resolved config (`config.yaml`), Redis password redacted.", ""]
    if len(runs) > 1:
        flats = [_flat(r.config) for r in runs]
        keys = sorted(set().union(*flats))
        differ = [k for k in keys if len({json.dumps(f.get(k), default=str)
                                          for f in flats}) > 1]
        differ = [k for k in differ if k not in ("replay.address", "model.path", "redis.url")]
        if differ:
            out += ["Keys that differ between the runs:", "",
                    "| key | " + " | ".join(labels) + " |", "|---" * (len(runs) + 1) + "|"]
            out += [f"| `{k}` | " + " | ".join(f"`{f[k]}`" if k in f else "(absent)"
                                               for f in flats) + " |" for k in differ]
            out.append("")
    for r in runs:
        text = yaml.safe_dump(r.config, sort_keys=False) if r.config else "(no config.yaml)\n"
        if len(runs) > 1:
            out += [f"<details><summary>{r.label}</summary>", "", "```yaml", text + "```", "",
                    "</details>", ""]
        else:
            out += ["```yaml", text + "```", ""]
    return "\n".join(out)


# --- the report ------------------------------------------------------------------------------


def make_report(run_dirs: list[Path], labels: list[str] | None = None,
                out: Path | None = None) -> Path:
    """Write the report of ``run_dirs`` (overlaid when several) and return its directory."""
    import matplotlib

    matplotlib.use("Agg")
    run_dirs = [Path(d) for d in run_dirs]
    labels = labels or default_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run directories")
    if out is None:
        out = RunDir(run_dirs[0]).report / ("compare" if len(run_dirs) > 1 else "")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [Run.load(d, label) for d, label in zip(run_dirs, labels)]
    for run in runs:
        if not run.records:
            click.echo(f"note: {run.path} has no metrics.jsonl records", err=True)
    notes: list[str] = []
    plots = []
    held = draw_heldout(runs, out, notes)
    if held:
        plots.append(held)
    why_plots = [p for p in (draw_plot(plot, runs, out, notes) for plot in WHY_PLOTS) if p]
    per_env, mix_runs = env_plots(runs)
    if per_env:  # an env mix: each member env's success, beside training vs validation
        drawn = draw_plot(per_env, mix_runs, out, notes)
        if drawn:
            why_plots.insert(1, drawn)
    plots += [p for p in (draw_plot(plot, runs, out, notes) for plot in PLOTS) if p]
    heads = [headline(r) for r in runs]
    origins = [task_origins.run_origins(r.path) for r in runs]
    diagnoses = [diagnosis.run_diagnosis(r.path, r.records, r.summary) for r in runs]
    secrets = [s for r in runs for s in r.secrets]
    md = _scrub(markdown(runs, heads, plots, notes, origins,
                         why_markdown(runs, diagnoses, why_plots)), secrets)
    (out / "report.md").write_text(md)
    data = {"runs": [{"label": r.label, "dir": str(r.path)} for r in runs],
            "headline": {r.label: h for r, h in zip(runs, heads)},
            "diagnosis": {r.label: d.to_json() for r, d in zip(runs, diagnoses)},
            "task_origins": {r.label: t for r, t in zip(runs, origins)},
            "plots": {p["file"][:-4]: p for p in why_plots + plots},
            "missing": list(dict.fromkeys(notes))}
    (out / "series.json").write_text(_scrub(json.dumps(data, indent=1, default=str), secrets))
    return out


def default_labels(run_dirs: list[Path]) -> list[str]:
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{d.resolve().parent.name}/{d.resolve().name}" for d in run_dirs]


def _scrub(text: str, secrets: list[str]) -> str:
    for s in secrets:
        text = text.replace(s, "***")
    return text


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False))
@click.option("--labels", default=None, metavar="A,B,...",
              help="Comma-separated names for the runs in the plots (default: directory names).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output directory (default: DIR/report, or the first DIR's report/compare "
                   "for several).")
def report(run_dirs, labels, out):
    """Write plots (PNG), report.md and series.json for one run directory, or several overlaid
    for comparison."""
    names = [s.strip() for s in labels.split(",")] if labels else None
    if names is not None and len(names) != len(run_dirs):
        raise click.UsageError(f"--labels has {len(names)} names for {len(run_dirs)} run "
                               "directories")
    if names is not None and len(set(names)) != len(names):
        raise click.UsageError("--labels must be distinct")
    missing = [d for d in run_dirs if not RunDir(d).metrics.exists()]
    if len(missing) == len(run_dirs):
        raise click.ClickException(f"no metrics.jsonl in {', '.join(missing)}: not a run "
                                   "directory, or the run has not started its roles yet")
    path = make_report([Path(d) for d in run_dirs], names, Path(out) if out else None)
    click.echo(f"report written to {path / 'report.md'}")


if __name__ == "__main__":
    report()
