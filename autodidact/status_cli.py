"""``autodidact status``: a live view of a run from its Redis, replay server and metrics file.

Every source is optional, so the command also describes a run that has finished, crashed or
lost its Redis (it says which sources answered):

    Redis (the run's ``config.yaml``)   phase, published version, learner updates, heartbeats,
                                        counters (groups accepted, judged), restarts (when the
                                        launcher publishes them in the run state)
    pids.json + /proc                   whether each role's process is still running
    the replay server (stats request)   groups and bytes stored, unjudged groups (judge backlog)
    replay.lmdb (read-only)             the same counts when the server is gone
    metrics.jsonl (its last few MiB)    lag, actor success rate, groups/s, last record per role
    summary.json                        restarts and held-out success once the run has ended
    replay.lmdb, split.json, tasks.lmdb training tasks by origin (hand-written, self-made):
                                        groups drawn, success, informative share
                                        (:mod:`autodidact.task_origins`)
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import click

from autodidact import task_origins
from autodidact.viewer.groups import GroupIndex
from protocol.config import redact_url
from protocol.run_dir import HELD_OUT_STAGES, REPLAY_STORE, SUMMARY, RunDir

TAIL_BYTES = 4 * 1024 * 1024  # the end of metrics.jsonl that status reads (a long run's is big)
RECENT_ACTOR_RECORDS = 20  # actor success rate: mean over this many latest actor records
RATE_WINDOW_S = 60.0  # groups/s from actor records: over this last stretch of time
# Tasks by origin unpack every stored group once (seconds for 10,000): a first look at a big
# store stops after this long and says how many it counted; --watch goes on from there.
ORIGINS_BUDGET_S = 10.0


# --- sources ---------------------------------------------------------------------------------


def read_config(run_dir: Path) -> tuple[dict, str]:
    """``config.yaml`` as a dict (``{}`` when missing or unreadable) and a note why not."""
    import yaml

    path = RunDir(run_dir).config
    try:
        values = yaml.safe_load(path.read_text()) or {}
        return (values, "") if isinstance(values, dict) else ({}, f"{path} is not a mapping")
    except FileNotFoundError:
        return {}, f"no {path.name} yet"
    except (OSError, yaml.YAMLError) as exc:
        return {}, f"{path.name} unreadable: {exc}"


def redis_target(run_dir: Path, cfg: dict) -> tuple[str, str]:
    """The run's Redis URL (with its password: never print it) and key prefix."""
    from protocol.control import default_prefix

    rcfg = cfg.get("redis") or {}
    url = rcfg.get("url") or ""
    if not url:  # config.yaml not written yet: the embedded server's socket and password
        sock, password = RunDir(run_dir).redis_socket, RunDir(run_dir).redis_password
        if sock.exists() and password.exists():
            url = f"unix://:{password.read_text().strip()}@{sock}"
    prefix = rcfg.get("prefix") or default_prefix(cfg.get("name") or run_dir.name)
    return url, prefix


def quick_redis(url: str):
    """A client that answers or fails within seconds. No retries: a dead run's Redis must not
    stall a reader for the roles' ~40 s back-off."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2,
                                retry=Retry(NoBackoff(), 0))


def query_redis(url: str, prefix: str, ttl_s: float) -> dict:
    """One snapshot of the control plane; ``{"error": ...}`` when Redis does not answer."""
    import redis

    from protocol.control import ControlPlane

    if not url:
        return {"error": "no Redis URL (config.yaml missing)"}
    client = quick_redis(url)
    try:
        control = ControlPlane(client, prefix, ttl_s)
        return {"state": control.state(), "version": control.get_version(),
                "counters": control.counters(), "heartbeats": control.alive(),
                "task_queue": control.task_queue_len()}
    except (redis.RedisError, OSError, ValueError) as exc:
        return {"error": _one_line(exc)}
    finally:
        client.close()


def query_replay(cfg: dict, timeout_s: float = 2.0) -> dict:
    """The replay server's own stats; ``{"error": ...}`` when it does not answer in time."""
    from protocol.config import SecurityConfig
    from protocol.replay_client import ReplayClient
    from protocol.security import curve_for

    address = (cfg.get("replay") or {}).get("address") or ""
    if not address:
        return {"error": "no replay.address in config.yaml"}
    client = None
    try:
        sec = cfg.get("security") or {}
        security = SecurityConfig(keys_dir=sec.get("keys_dir", ""),
                                  allow_plaintext_remote=bool(sec.get("allow_plaintext_remote")))
        client = ReplayClient(address, retry_after_s=0.5, timeout_s=timeout_s,
                              curve=curve_for(security, address))
        return client.stats()
    except Exception as exc:  # timeout, refused, bad keys: status reports it and goes on
        return {"error": _one_line(exc)}
    finally:
        if client is not None:
            client.close()


def store_stats(run_dir: Path) -> dict:
    """Counts read from ``replay.lmdb`` directly (read-only; safe while the server runs)."""
    if not RunDir(run_dir).replay_store.exists():
        return {"error": f"no {REPLAY_STORE}"}
    try:
        from replay.store import read_stats

        return read_stats(run_dir)
    except Exception as exc:
        return {"error": _one_line(exc)}


def read_pids(run_dir: Path) -> dict[str, int]:
    pids = {}
    try:
        pids = {str(k): int(v) for k, v in json.loads(RunDir(run_dir).pids.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        pids["redis"] = int(RunDir(run_dir).redis_pid.read_text())
    except (OSError, ValueError):
        pass
    return pids


def process_running(pid: int) -> bool | None:
    """Whether ``pid`` is a live process of this run (its command line names autodidact or
    redis); None where that cannot be told (not Linux)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if Path("/proc/self/cmdline").exists():
        try:
            raw = cmdline.read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":  # a zombie has exited
            return False
        return b"autodidact" in raw or b"redis" in raw
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return None


def read_metrics_tail(run_dir: Path, max_bytes: int = TAIL_BYTES) -> tuple[list[dict], float]:
    """The records in the last ``max_bytes`` of metrics.jsonl, and the time of its first."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return [], math.nan
    with open(path, "rb") as f:
        first = _parse(f.readline())
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - max_bytes))
        chunk = f.read()
    lines = chunk.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first line of the window is cut
    records = [r for r in map(_parse, lines) if r is not None]
    t_first = first.get("t", math.nan) if first else math.nan
    return records, t_first


def _parse(line: bytes) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


# --- the snapshot ----------------------------------------------------------------------------


def collect(run_dir: Path, replay_timeout_s: float = 2.0, groups: GroupIndex | None = None,
            origins_budget_s: float = ORIGINS_BUDGET_S) -> dict:
    """Everything ``status`` shows, as one JSON-able dict. ``groups``: an index of the replay
    store kept between calls, so each reads only the groups stored since the last."""
    now = time.time()
    cfg, cfg_note = read_config(run_dir)
    notes = [cfg_note] if cfg_note else []
    url, prefix = redis_target(run_dir, cfg)
    ttl = float((cfg.get("redis") or {}).get("heartbeat_ttl_s") or 10.0)
    live = query_redis(url, prefix, ttl)
    redis_ok = "error" not in live
    if not redis_ok:
        notes.append(f"Redis not reachable ({live['error']}): Redis values are missing, the rest "
                     "comes from the run directory")
    summary = _read_json(RunDir(run_dir).summary)
    records, t_first = read_metrics_tail(run_dir)
    pids = read_pids(run_dir)
    learner = _last(records, "learner", "learner/loss")
    done = bool(_last(records, "learner", "learner/done")) or "learner" in summary
    state = live.get("state", {}) if redis_ok else {}
    phase = state.get("phase") or ("done" if done else "unknown")
    snap = {
        "run_dir": str(run_dir), "name": cfg.get("name") or run_dir.name,
        "phase": phase, "finished": done or phase == "done",
        "redis": {"url": redact_url(url) if url else "", "prefix": prefix,
                  "reachable": redis_ok, **({"error": live["error"]} if not redis_ok else {})},
        "started_at": state.get("started_at"),
        "version": live.get("version") if redis_ok else learner.get("learner/version"),
        "learner_updates": state.get("learner_updates", learner.get("learner/updates")),
        "lag_mean": learner.get("learner/lag_mean"), "lag_max": learner.get("learner/lag_max"),
        "loss": learner.get("learner/loss"),
        # of the groups the last update drew, the share replay set aside as carrying no signal
        "uninformative_share": learner.get("learner/uninformative_share"),
        "learner_record_age_s": _age(now, learner),
        "task_queue": live.get("task_queue"),
        "counters": live.get("counters", {}),
    }
    if snap["version"] is None and learner:
        snap["version"] = learner.get("learner/version")
    snap["actor_success_rate"], snap["actor_records"] = _actor_success(records)
    snap.update(_groups_rate(records, now, live.get("counters", {}), t_first,
                             snap["finished"]))
    snap["roles"], restarts_source = _roles(records, pids, live.get("heartbeats", []), state,
                                            summary, now, ttl)
    snap["restarts"] = {r["name"]: r["restarts"] for r in snap["roles"]
                        if r["restarts"] is not None}
    snap["restarts_source"] = restarts_source
    if restarts_source is None:
        notes.append("restarts: not published while a run is live (summary.json has them at "
                     "the end)")
    replay_alive = _replay_alive(pids)
    snap["replay"], snap["judge_backlog"] = _replay(run_dir, cfg, records, live, replay_alive,
                                                    replay_timeout_s, notes)
    snap["task_origins"] = task_origins.run_origins(run_dir, groups, origins_budget_s)
    snap["heldout"] = {s: (summary.get(f"success_{s}") or {}).get("avg")
                       for s in HELD_OUT_STAGES if summary.get(f"success_{s}")}
    envs = heldout_envs(summary)
    if envs:  # an env mix: each member env's held-out success (a run of one env: none)
        snap["heldout_envs"] = envs
    snap["metrics_span_s"] = (records[-1]["t"] - t_first) if records and "t" in records[-1] \
        and math.isfinite(t_first) else None
    if not records:
        notes.append("metrics.jsonl has no records yet")
    snap["notes"] = notes
    return snap


MEAN_OVER_ENVS = "mean over envs"


def heldout_envs(summary: dict) -> list[dict]:
    """Of an env mix's summary.json, one row per held-out result of each member env and of
    the mean over envs: ``{"split", "stage", "env", "avg", "ci", "best", "best_ci",
    "tasks"}``, validation's stages first, then test's where the run looked (the mean's
    row has no interval nor tasks); [] for a run of one env."""
    results = [(r.get("split") or summary.get("eval_split") or "validation", stage, r)
               for stage in HELD_OUT_STAGES
               for r in [summary.get(f"success_{stage}")] if isinstance(r, dict)]
    test = summary.get("test") if isinstance(summary.get("test"), dict) else {}
    results += [("test", stage, test[stage]) for stage in HELD_OUT_STAGES
                if isinstance(test.get(stage), dict)]
    rows = []
    for split, stage, result in results:
        for env, one in (result.get("envs") or {}).items():
            rows.append({"split": split, "stage": stage, "env": env, "avg": one.get("avg"),
                         "ci": one.get("avg_ci"), "best": one.get("best"),
                         "best_ci": one.get("best_ci"), "tasks": one.get("tasks")})
        mean = result.get("mean_over_envs")
        if isinstance(mean, dict):
            rows.append({"split": split, "stage": stage, "env": MEAN_OVER_ENVS,
                         "avg": mean.get("avg"), "ci": None, "best": mean.get("best"),
                         "best_ci": None, "tasks": None})
    return rows


def _replay_alive(pids: dict[str, int]) -> bool | None:
    if "replay" not in pids:
        return None
    return process_running(pids["replay"])


def _replay(run_dir, cfg, records, live, replay_alive, timeout_s, notes):
    rcfg = cfg.get("replay") or {}
    stats, source = {}, None
    if replay_alive is not False and rcfg.get("address"):
        stats = query_replay(cfg, timeout_s)
        if "error" in stats:
            notes.append(f"replay server not answering ({stats['error']})")
            stats = {}
        else:
            source = "replay server"
            if stats.get("disk_full_now"):
                notes.append("disk full: the replay server cannot store anything until space "
                             "is freed on the run directory's file system")
    if not stats:
        stats = store_stats(run_dir)
        if "error" in stats:
            stats = {}
        else:
            source = REPLAY_STORE
    last = _last(records, "replay", "replay/groups")
    if not stats and last:
        stats = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("replay/")}
        source = f"metrics.jsonl ({_fmt_age(_age(time.time(), last))} old)"
    fill = {"source": source, "groups": stats.get("groups"), "bytes": stats.get("bytes"),
            "max_groups": rcfg.get("max_groups"), "max_bytes": rcfg.get("max_bytes"),
            "judged": stats.get("judged"), "consumed": stats.get("consumed")}
    fill["groups_fill"] = _ratio(fill["groups"], fill["max_groups"])
    fill["bytes_fill"] = _ratio(fill["bytes"], fill["max_bytes"])
    backlog = {"unjudged": None, "leased": None, "source": None}
    if stats.get("unjudged") is not None:
        backlog = {"unjudged": stats["unjudged"], "leased": stats.get("leased"), "source": source}
    elif stats.get("groups") is not None and stats.get("judged") is not None:
        backlog = {"unjudged": stats["groups"] - stats["judged"], "leased": None,
                   "source": f"{source}: stored - judged"}
    elif "judge/groups_labelled" in live.get("counters", {}):
        c = live["counters"]
        backlog = {"unjudged": c.get("actor/accepted", 0) - c["judge/groups_labelled"],
                   "leased": None, "source": "Redis counters: accepted - labelled"}
    return fill, backlog


# Written by the launcher about a stage (held-out evaluations), not by a role's process.
RECORDS_WITHOUT_PROCESS = ("eval",)


def _roles(records, pids, heartbeats, state, summary, now, ttl):
    """One row per role instance seen in pids.json, heartbeats or metrics."""
    last_by_id: dict[str, dict] = {}
    for rec in records:
        if rec.get("role") in RECORDS_WITHOUT_PROCESS:
            continue
        member = rec.get("id") or rec.get("role")
        if member:
            last_by_id[str(member)] = rec
    beats = {str(h.get("id")): h for h in heartbeats}
    if isinstance(state.get("restarts"), dict):
        restarts, source = state["restarts"], "Redis"
    elif isinstance(summary.get("restarts"), dict):
        restarts, source = summary["restarts"], SUMMARY
    else:
        restarts, source = {}, None
    names = list(pids) + [n for n in beats if n not in pids] + \
        [n for n in last_by_id if n not in pids and n not in beats]
    rows = []
    for name in names:
        pid = pids.get(name)
        running = process_running(pid) if pid else None
        beat = beats.get(name)
        rec = last_by_id.get(name)
        hb_age = now - beat["t"] if beat and isinstance(beat.get("t"), (int, float)) else None
        if beat is not None or running:
            alive = True
        elif running is False:
            alive = False
        else:
            alive = None
        rows.append({
            "name": name, "role": (beat or rec or {}).get("role") or name.split("-")[0],
            "pid": pid, "process": {True: "running", False: "exited", None: None}[running],
            "heartbeat_age_s": hb_age, "heartbeat_ttl_s": ttl,
            "last_metrics_age_s": _age(now, rec), "alive": alive,
            "restarts": restarts.get(name), "groups": (beat or {}).get("groups"),
            "version": (beat or {}).get("version"), "waiting": _waiting(beat),
        })
    return rows, source


def _waiting(beat: dict | None) -> str | None:
    """What a live role says it waits on, in words: an actor whose served env failed every
    group of its last batch says ``env_failed`` and its failures by reason."""
    reason = (beat or {}).get("waiting")
    if not isinstance(reason, str):  # True: an actor waiting for admission, nothing to say
        return None
    counts = (beat or {}).get(reason)
    if isinstance(counts, dict) and counts:
        reason += " (" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")"
    return reason


def _actor_success(records) -> tuple[float | None, int]:
    rates = [r["actor/success_rate"] for r in records if r.get("role") == "actor"
             and isinstance(r.get("actor/success_rate"), (int, float))][-RECENT_ACTOR_RECORDS:]
    return (sum(rates) / len(rates) if rates else None), len(rates)


def _groups_rate(records, now, counters, t_first, finished) -> dict:
    """Groups per second: recent (the launcher's ``replay/groups_per_s``, else the actors'
    cumulative ``actor/groups`` over the last minute of records) and over the whole run."""
    actor = [r for r in records if r.get("role") == "actor"
             and isinstance(r.get("actor/groups"), (int, float)) and "t" in r]
    recent = None
    last_replay = _last(records, "replay", "replay/groups_per_s")
    if last_replay and now - last_replay.get("t", 0) < 30:
        recent = last_replay["replay/groups_per_s"]
    elif actor:
        end = actor[-1]["t"]
        by_id: dict[str, list[dict]] = {}
        for r in actor:
            if r["t"] >= end - RATE_WINDOW_S:
                by_id.setdefault(r.get("id", "actor"), []).append(r)
        rates = [(rs[-1]["actor/groups"] - rs[0]["actor/groups"]) / (rs[-1]["t"] - rs[0]["t"])
                 for rs in by_id.values() if len(rs) > 1 and rs[-1]["t"] > rs[0]["t"]]
        recent = sum(rates) if rates else None
    total = None
    if actor:
        last = {}
        for r in actor:
            last[r.get("id", "actor")] = r
        total = sum(r["actor/groups"] for r in last.values())
    if counters.get("actor/accepted") is not None:
        total = counters["actor/accepted"]
    # over the metrics' span: from the first record (the RL phase's start) to now, or to the
    # last record once the run has finished (as ``autodidact report`` computes it)
    end = now if not finished else (records[-1].get("t") if records else None)
    span = end - t_first if isinstance(end, (int, float)) and math.isfinite(t_first) else None
    overall = total / span if total is not None and span else None
    return {"groups_total": total, "groups_per_s": recent, "groups_per_s_overall": overall}


def _last(records, role, key) -> dict:
    for rec in reversed(records):
        if rec.get("role") == role and key in rec:
            return rec
    return {}


def _age(now, rec) -> float | None:
    t = (rec or {}).get("t")
    return now - t if isinstance(t, (int, float)) else None


def _ratio(a, b) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200]


# --- rendering -------------------------------------------------------------------------------


def _fmt_age(age: float | None) -> str:
    if age is None:
        return "-"
    if age < 120:
        return f"{age:.0f}s"
    if age < 7200:
        return f"{age / 60:.0f}m"
    return f"{age / 3600:.1f}h"


def _fmt(value, spec: str = "", none: str = "-") -> str:
    if value is None:
        return none
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _size(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(snap: dict, console) -> None:
    from rich.table import Table

    redis_note = "reachable" if snap["redis"]["reachable"] else "[red]not reachable[/]"
    finished = " [green](finished)[/]" if snap["finished"] else ""
    console.print(f"[bold]{snap['name']}[/]  {snap['run_dir']}  phase [bold]{snap['phase']}[/]"
                  f"{finished}  redis {redis_note}", highlight=False)
    roles = Table(title="roles", title_justify="left")
    for col in ("role", "pid", "process", "heartbeat", "last metrics", "restarts", "status"):
        roles.add_column(col)
    for r in snap["roles"]:
        status = {True: "[green]alive[/]", False: "[red]dead[/]", None: "[yellow]?[/]"}[r["alive"]]
        if r["alive"] is False and snap["finished"]:
            status = "stopped"
        elif r["alive"] and r.get("waiting"):
            status += f" [yellow]waiting: {r['waiting']}[/]"
        beat = _fmt_age(r["heartbeat_age_s"]) if r["heartbeat_age_s"] is not None else "-"
        roles.add_row(r["name"], _fmt(r["pid"]), _fmt(r["process"]), beat,
                      _fmt_age(r["last_metrics_age_s"]), _fmt(r["restarts"]), status)
    console.print(roles)
    rp, jb = snap["replay"], snap["judge_backlog"]
    fill = f"{_fmt(rp['groups'])} / {_fmt(rp['max_groups'])} groups"
    if rp["groups_fill"] is not None:
        fill += f" ({rp['groups_fill']:.1%})"
    fill += f", {_size(rp['bytes'])} / {_size(rp['max_bytes'])}"
    if rp["bytes_fill"] is not None:
        fill += f" ({rp['bytes_fill']:.1%})"
    lines = [
        ("version", f"{_fmt(snap['version'])}   learner updates {_fmt(snap['learner_updates'])}"
                    f"   (last learner record {_fmt_age(snap['learner_record_age_s'])} ago)"),
        ("lag", f"mean {_fmt(snap['lag_mean'], '.2f')}, max {_fmt(snap['lag_max'])}"),
        ("loss", _fmt(snap["loss"], ".4f")),
        ("uninformative", f"{_fmt(snap['uninformative_share'], '.1%')} of the groups the last "
                          "update drew set aside (no signal)"),
        ("actor success", f"{_fmt(snap['actor_success_rate'], '.1%')} (last "
                          f"{snap['actor_records']} actor records)"),
        ("groups/s", f"{_fmt(snap['groups_per_s'], '.2f')} recent, "
                     f"{_fmt(snap['groups_per_s_overall'], '.2f')} over the run; "
                     f"{_fmt(snap['groups_total'])} groups"),
        ("replay fill", f"{fill}  ({_fmt(rp['source'])})"),
        ("judge backlog", f"{_fmt(jb['unjudged'])} unjudged"
                          + (f", {jb['leased']} leased" if jb.get("leased") is not None else "")
                          + f"  ({_fmt(jb['source'])})"),
    ]
    if snap["task_queue"] is not None:
        lines.append(("task queue", str(snap["task_queue"])))
    lines += _origin_lines(snap["task_origins"])
    if snap["heldout"]:
        lines.append(("held-out avg", "  ".join(f"{k} {v:.1%}" for k, v in
                                                 snap["heldout"].items() if v is not None)))
    lines += _env_lines(snap.get("heldout_envs") or [])
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in lines:
        table.add_row(k, v)
    console.print(table)
    for note in snap["notes"]:
        console.print(f"[dim]note: {note}[/]", highlight=False)


def _env_lines(rows: list[dict]) -> list[tuple[str, str]]:
    """An env mix's held-out success: a line per split and member env (then the mean over
    envs), each stage's avg@k with its 95% interval."""
    from metrics.intervals import format_rate

    by_line: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r["avg"] is None:
            continue
        value = format_rate(r["avg"], r["ci"]) if r["ci"] else f"{r['avg']:.1%}"
        tasks = f", {r['tasks']} tasks" if r["tasks"] is not None else ""
        by_line.setdefault((r["split"], r["env"]), []).append(f"{r['stage']} {value}{tasks}")
    return [(f"{split} {env}", "  ".join(parts)) for (split, env), parts in by_line.items()]


def _origin_lines(table: dict) -> list[tuple[str, str]]:
    """Two lines: each origin's tasks, groups, success and informative share; the share."""
    rows = "; ".join(f"{r['origin']} {_fmt(r['tasks'])} tasks, {r['groups']} groups, "
                     f"{task_origins.percent(r['success'])} success, "
                     f"{task_origins.percent(r['informative_share'])} informative"
                     for r in table["origins"])
    return [("tasks by origin", rows),
            ("synthetic share", f"{task_origins.share_words(table)}  "
                                f"({task_origins.counted_words(table)})")]


# --- the command -----------------------------------------------------------------------------


@click.command("status")
@click.option("--run-dir", type=click.Path(file_okay=False), default="runs/default",
              show_default=True, help="Run directory of the job.")
@click.option("--watch", type=float, default=None, metavar="SECONDS",
              help="Refresh every SECONDS until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the status as one JSON object (one per refresh with --watch).")
def status(run_dir, watch, as_json):
    """Show a live view of a run: roles with heartbeats and restarts, version, lag, success
    rate, groups/s, replay fill and judge backlog (from Redis, the replay server and
    metrics.jsonl; a finished or dead run is read from its directory)."""
    from rich.console import Console

    path = Path(run_dir)
    if not path.is_dir():
        raise click.ClickException(f"no run directory at {path}")
    path = path.resolve()
    if watch is not None and watch <= 0:
        raise click.UsageError("--watch needs a positive number of seconds")
    console = Console(soft_wrap=True)
    groups = GroupIndex(path)  # kept across --watch refreshes: each reads only new groups
    try:
        while True:
            snap = collect(path, groups=groups)
            if as_json:
                click.echo(json.dumps(snap, default=str))
            else:
                if watch:
                    console.clear()
                render(snap, console)
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        return


if __name__ == "__main__":
    status()
