"""Soak: a real run under random SIGKILLs, then an audit of every group by id.

Starts ``autodidact run`` (configs/quick.yaml with 4 actors, 1 judge, the learner, the
experience extractor, replay and the embedded Redis, all separate processes) and, once RL has
begun, SIGKILLs one role chosen at random about every ``--kill-every`` seconds (Redis and the
replay server included). The launcher restarts what died. After ``--minutes`` the run is
stopped with SIGTERM (as Ctrl-C or a scheduler would), and the audit reads the durable records
only:

- acknowledged: group ids the actors were told were stored (``acks/<actor>.log``);
- stored: the replay store (``replay.lmdb``); consumed: the learner's checkpoint ledger;
- lost = acknowledged but not stored; duplicates = ids the ledger holds more than once;
- skipped = ids replay marks consumed that the checkpoint's ledger does not hold.

Faults beyond role kills, each once, at a share of the time (``--faults``):

- ``launcher``: SIGKILL the launcher alone; every role and Redis must be gone within 20 s
  (``orphans`` counts those that were not), then ``autodidact run --resume`` carries on;
- ``checkpoint``: flip 64 bytes of ``checkpoints/latest.pt``, then SIGKILL the learner: the
  restarted learner refuses the damaged file and resumes from ``previous.pt``
  (``checkpoint_fallbacks``); replay serves again what only the lost checkpoint covered;
- ``--map-size`` small: the store fills, pushes are refused ``store_full`` and the run goes on
  (``store_full`` in the report).

Resources (``--sample-every``): every role's resident memory and open file descriptors (from
``/proc``, the launcher's and Redis's included) and the replay store's groups and bytes, sampled
through the run. ``resources`` in the report compares, per role, the mean of the last fifth of
the run with the mean of the fifth after ``--settle`` minutes (samples within 2 minutes of a
role's restart left out: a process refills its caches after a kill); ``flat`` says whether
every growth is within ``--flat`` (10%). With ``--max-groups`` below what the run makes, the
store must reach it, evict and go on (``at_capacity``, ``evicted``).

Usage::

    .venv/bin/python -m bench.soak [--minutes 10] [--kill-every 60] [--run-dir runs/soak]
                                   [--faults launcher,checkpoint] [--map-size BYTES]
                                   [-c CONFIG] [--max-groups N] [--sample-every 30]
                                   [--json FILE]

Exits 1 when anything was lost or trained twice, or resources were asked for and grew.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from metrics.jsonl import read_metrics
from replay.store import EVICTED, EVICTED_STALE, Store

ROOT = Path(__file__).resolve().parents[1]

QUICK = ROOT / "configs" / "quick.yaml"


def start_run(run_dir: Path, args, resume: bool = False) -> subprocess.Popen:
    sets = [f"actor.num_actors={args.actors}", f"judge.workers={args.judges}",
            "eval.num_tasks=0", "learner.max_updates=1000000", "tracking.wandb=disabled",
            f"learner.max_minutes={args.minutes + 30}", "learner.checkpoint_every=5",
            f"name=soak-{args.seed}", f"seed={args.seed}", *args.sets]
    if args.map_size:
        sets.append(f"replay.map_size={args.map_size}")
    if args.max_groups:
        sets.append(f"replay.max_groups={args.max_groups}")
    cmd = [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(run_dir),
           "-c", str(args.config), *[a for s in sets for a in ("--set", s)],
           *(["--resume"] if resume else [])]
    log = open(run_dir / "launcher.log", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def role_pids(run_dir: Path) -> dict[str, int]:
    """Every role's current pid, Redis included (the launcher rewrites pids.json on restarts)."""
    pids = {}
    try:
        pids.update(json.loads((run_dir / "pids.json").read_text()))
        pids["redis"] = int((run_dir / "redis" / "redis.pid").read_text())
    except (OSError, ValueError):
        pass
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def wait_for_rl(run_dir: Path, launcher: subprocess.Popen, timeout_s: float = 600,
                require_new_learner: int | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while role_pids(run_dir).get("learner") in (None, require_new_learner):
        if launcher.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the run did not reach RL; see {run_dir / 'launcher.log'}")
        time.sleep(1)


def proc_resources(pid: int) -> dict | None:
    """``pid``'s resident KiB (``rss_kib``; ``anon_kib`` of it its own heap and stacks, the rest
    mapped files: LMDB's pages, libraries, which the kernel may drop) and open file
    descriptors (``fds``); None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {"rss_kib": int(fields["VmRSS"].split()[0]),
                "anon_kib": int(fields.get("RssAnon", "0 kB").split()[0]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, KeyError, ValueError):
        return None


class Sampler:
    """Every role's RSS and descriptors and the store's size, every ``every_s`` seconds."""

    def __init__(self, run_dir: Path, every_s: float):
        self.run_dir, self.every_s = run_dir, every_s
        self.samples: list[dict] = []
        self.restarted_at: dict[str, float] = {}
        self._next = 0.0

    def restarted(self, role: str, t: float) -> None:
        self.restarted_at[role] = t

    def maybe(self, t: float, launcher: subprocess.Popen) -> None:
        if not self.every_s or t < self._next:
            return
        self._next = t + self.every_s
        roles = {**role_pids(self.run_dir), "launcher": launcher.pid}
        sample: dict = {"t": round(t, 1), "roles": {}}
        for role, pid in roles.items():
            got = proc_resources(pid)
            if got is not None:
                sample["roles"][role] = {**got, "since_restart_s": round(
                    t - self.restarted_at.get(role, -1e9), 1)}
        replay = [r for r in read_metrics(self.run_dir, "replay") if "replay/groups" in r]
        if replay:
            sample["store"] = {k: replay[-1].get(f"replay/{k}") for k in
                               ("groups", "bytes", "evicted", "evicted_stale")}
        self.samples.append(sample)


def window_mean(samples: list[dict], role: str, key: str, window: tuple[float, float]
                ) -> float | None:
    """Mean of ``key`` for ``role`` over the samples in ``window`` (seconds), leaving out
    those within 120 s of the role's restart."""
    vals = [s["roles"][role][key] for s in samples
            if window[0] <= s["t"] < window[1] and key in s["roles"].get(role, {})
            and s["roles"][role]["since_restart_s"] >= 120]
    return sum(vals) / len(vals) if vals else None


def resource_growth(samples: list[dict], minutes: float, settle_min: float,
                    flat: float, max_groups: int) -> dict:
    """Per role: mean RSS and descriptors in the fifth of the run after ``settle_min`` and in
    its last fifth, and the growth between them; the store's size against its capacity."""
    span = 60 * (minutes - settle_min)
    early = (60 * settle_min, 60 * settle_min + span / 5)
    late = (60 * minutes - span / 5, 1e12)
    per_role: dict = {}
    for role in sorted({r for s in samples for r in s["roles"]}):
        per_role[role] = {}
        for key in ("rss_kib", "anon_kib", "fds"):
            a, b = window_mean(samples, role, key, early), window_mean(samples, role, key, late)
            per_role[role][key] = {"early": a, "late": b,
                                   "growth": None if not a or b is None else round(b / a - 1, 4)}
    growths = [v["growth"] for row in per_role.values() for v in row.values()
               if v["growth"] is not None]
    stores = [s["store"] for s in samples if "store" in s]
    return {"settle_minutes": settle_min, "flat_within": flat, "windows_s": [early, late],
            "per_role": per_role, "max_growth": max(growths, default=None),
            "flat": bool(growths) and max(growths) <= flat,
            "store": {"max_groups": max_groups,
                      "groups_max": max((s["groups"] or 0 for s in stores), default=0),
                      "at_capacity": bool(max_groups) and any(
                          (s["groups"] or 0) >= max_groups for s in stores),
                      "evicted": max((s["evicted"] or 0 for s in stores), default=0),
                      "bytes_last": stores[-1]["bytes"] if stores else None}}


def kind(role: str) -> str:
    """actor-3 -> actor: kills are spread over kinds of role, not over replicas."""
    return role.split("-")[0]


def torment(run_dir: Path, launcher: subprocess.Popen, args,
            sampler: Sampler) -> tuple[Counter, Counter, Counter, subprocess.Popen]:
    """Kill a random role every ~kill_every s until the time is up, and inject each of
    ``args.faults`` once; count kills, restarts (a role whose pid changed) and fault results.
    Returns them and the launcher running at the end."""
    rng = random.Random(args.seed)
    kills: Counter = Counter()
    restarts: Counter = Counter()
    faults: Counter = Counter()
    seen = role_pids(run_dir)
    t0 = time.monotonic()
    end = t0 + 60 * args.minutes
    pending = sorted((t0 + 60 * args.minutes * (i + 1) / (len(args.faults) + 1), fault)
                     for i, fault in enumerate(args.faults))
    next_kill = t0 + rng.uniform(0.5, 1.5) * args.kill_every
    while time.monotonic() < end and launcher.poll() is None:
        now_pids = role_pids(run_dir)
        for role, pid in now_pids.items():
            if role in seen and seen[role] != pid:
                restarts[role] += 1
                sampler.restarted(role, time.monotonic() - t0)
        seen.update(now_pids)
        sampler.maybe(time.monotonic() - t0, launcher)
        if pending and time.monotonic() >= pending[0][0]:
            _, fault = pending.pop(0)
            print(f"  [{time.monotonic() - t0:5.0f}s] fault: {fault}", flush=True)
            launcher = FAULTS[fault](run_dir, launcher, now_pids, faults, args)
            seen = role_pids(run_dir)
            for role in [*seen, "launcher"]:
                sampler.restarted(role, time.monotonic() - t0)
        elif time.monotonic() >= next_kill:
            victims = [r for r, pid in now_pids.items() if alive(pid)]
            if victims:
                # Random, but the least-killed kinds first: every kind dies in a long soak.
                fewest = min(kills[kind(r)] for r in victims)
                role = rng.choice(sorted(r for r in victims if kills[kind(r)] == fewest))
                os.kill(now_pids[role], signal.SIGKILL)
                kills[kind(role)] += 1
                print(f"  [{time.monotonic() - t0:5.0f}s] SIGKILL {role} (pid {now_pids[role]})",
                      flush=True)
            next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.kill_every
        time.sleep(0.5)
    return kills, restarts, faults, launcher


def kill_launcher(run_dir: Path, launcher: subprocess.Popen, pids: dict, faults: Counter,
                  args) -> subprocess.Popen:
    """SIGKILL the launcher alone; count the roles still alive 20 s later; resume the run."""
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    orphans = [r for r, p in pids.items() if alive(p)]
    faults["orphans"] += len(orphans)
    for role in orphans:  # so the resumed run is not refused or doubled
        os.kill(pids[role], signal.SIGKILL)
    faults["launcher_kills"] += 1
    resumed = start_run(run_dir, args, resume=True)
    wait_for_rl(run_dir, resumed, require_new_learner=pids.get("learner"))
    return resumed


def damage_checkpoint(run_dir: Path, launcher: subprocess.Popen, pids: dict, faults: Counter,
                      args) -> subprocess.Popen:
    """Flip 64 bytes of the latest checkpoint, then SIGKILL the learner: its restart must
    fall back to the previous checkpoint."""
    path = run_dir / "checkpoints" / "latest.pt"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))  # in place: a disk error, not a new checkpoint
    os.kill(pids["learner"], signal.SIGKILL)
    faults["checkpoints_damaged"] += 1
    return launcher


FAULTS = {"launcher": kill_launcher, "checkpoint": damage_checkpoint}


def audit(run_dir: Path) -> dict:
    import torch

    acked: set[str] = set()
    for path in (run_dir / "acks").glob("*.log"):
        for line in path.read_text().splitlines():
            if line.strip():
                acked.add(line.split()[0])
    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            index = store.load_index(txn)
            evicted = store.get_meta(txn, EVICTED, 0)
            evicted_stale = store.get_meta(txn, EVICTED_STALE, 0)
    finally:
        store.close()
    ckpt = torch.load(run_dir / "checkpoints" / "latest.pt", map_location="cpu",
                      weights_only=True)
    ledger = list(ckpt["consumed"])
    # Set aside as carrying no signal: marked consumed by replay, never meant for training.
    marked = {g for g, rec in index.items() if rec.consumed and not rec.set_aside}
    # Eviction (replay.max_groups) deletes groups and keeps only their count: an acknowledged
    # group no longer stored was trained on (the ledger has it) and evicted, or evicted
    # untrained (set aside as carrying no signal, or past the staleness bound), or lost.
    # Evicted ids are not kept, so the audit is by count: "lost" is what the untrained
    # evictions cannot account for (exact when nothing was evicted).
    gone = acked - index.keys()
    unused_gone = gone - set(ledger)
    evicted_untrained = evicted - len(gone & set(ledger))
    return {
        "acknowledged": len(acked), "stored": len(index), "consumed": len(ledger),
        "judged": sum(r.judged for r in index.values()),
        "in_flight_at_stop": sum(r.delivered and not r.consumed for r in index.values()),
        "evicted": evicted, "evicted_stale": evicted_stale,
        "evicted_after_training": len(gone & set(ledger)),
        "evicted_untrained": evicted_untrained,
        "lost": max(0, len(unused_gone) - evicted_untrained),
        "duplicates": len(ledger) - len(set(ledger)),
        # Trained on, not stored: evicted after training (consumed groups go first).
        "ledger_not_stored": max(0, len(set(ledger) - index.keys())
                                 - (evicted - evicted_stale)),
        # Marked consumed by replay but not trained per the checkpoint: skipped for good.
        "skipped": len(marked - set(ledger)),
        # In the checkpoint, not yet committed to replay (a kill between the two): the next
        # learner start commits them with its hello.
        "ledger_uncommitted": len((set(ledger) & index.keys()) - marked),
        "set_aside": sum(rec.set_aside for rec in index.values()),
        "learner_updates": int(ckpt["updates"]), "learner_version": int(ckpt["version"]),
        "checkpoint_fallbacks": (run_dir / "logs" / "learner.log").read_text(
            errors="replace").count("resuming from"),
        "store_full": max((r.get("replay/store_full", 0)
                           for r in read_metrics(run_dir, "replay")), default=0),
    }


def audit_again(run_dir: Path, json_path: str) -> int:
    """The audit of a finished soak's run directory, into its soak.json (and ``json_path``)."""
    path = run_dir / "soak.json"
    report = {**json.loads(path.read_text()), **audit(run_dir)}
    path.write_text(json.dumps(report, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    ok = passed(report)
    print({k: v for k, v in report.items() if k != "samples"})
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


def passed(report: dict) -> bool:
    """Nothing lost, trained twice or skipped, no orphan, the fallback where a checkpoint was
    damaged; resources flat and the store at its capacity where they were asked for."""
    resources, faults = report.get("resources"), report.get("faults", {})
    max_groups = (resources or {}).get("store", {}).get("max_groups")
    return not (report["lost"] or report["duplicates"] or report["skipped"]
                or report["ledger_not_stored"] or faults.get("orphans")
                or (faults.get("checkpoints_damaged") and not report["checkpoint_fallbacks"])
                or (resources and not resources["flat"])
                or (resources and max_groups and not resources["store"]["at_capacity"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--judges", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=str(ROOT / "runs" / "soak"))
    parser.add_argument("--faults", default="",
                        help=f"comma-separated, each injected once: {', '.join(FAULTS)}")
    parser.add_argument("--map-size", type=int, default=0,
                        help="replay.map_size in bytes (small: the store fills up)")
    parser.add_argument("-c", "--config", default=str(QUICK),
                        help="the run's config (default configs/quick.yaml)")
    parser.add_argument("--max-groups", type=int, default=0,
                        help="replay.max_groups (below what the run makes: it evicts)")
    parser.add_argument("--sample-every", type=float, default=0.0,
                        help="seconds between resource samples (0: none)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="minutes before resources are compared")
    parser.add_argument("--flat", type=float, default=0.10,
                        help="the growth allowed between the early and the late window")
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="one more config value for the run (repeatable), e.g. "
                             "experience.max_pool=1000 so the pool reaches its cap")
    parser.add_argument("--audit-only", action="store_true",
                        help="audit --run-dir's finished soak again (its soak.json kept but "
                             "for the audit's fields), no run")
    args = parser.parse_args()
    if args.audit_only:
        return audit_again(Path(args.run_dir).resolve(), args.json)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    print(f"soak: {args.minutes:g} min, a SIGKILL every ~{args.kill_every:g} s, "
          f"{args.actors} actors, {args.judges} judge(s); run in {run_dir}", flush=True)
    launcher = start_run(run_dir, args)
    sampler = Sampler(run_dir, args.sample_every)
    try:
        wait_for_rl(run_dir, launcher)
        kills, restarts, faults, launcher = torment(run_dir, launcher, args, sampler)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)  # as Ctrl-C: every role stops, checkpoints
        launcher.wait(300)
    report = {"command": "python -m bench.soak " + " ".join(sys.argv[1:]),
              "minutes": args.minutes, "kills": dict(kills), "restarts": dict(restarts),
              "faults": dict(faults), "launcher_exit": launcher.returncode, **audit(run_dir)}
    if args.sample_every:
        report["resources"] = resource_growth(sampler.samples, args.minutes, args.settle,
                                              args.flat, args.max_groups)
        report["samples"] = sampler.samples
    (run_dir / "soak.json").write_text(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    width = max(map(len, report))
    for key, value in report.items():
        if key != "samples":
            print(f"  {key:<{width}}  {value}")
    ok = passed(report)
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
