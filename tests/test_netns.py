"""Many nodes on one machine: two network namespaces joined by a veth pair stand for two hosts.

Namespace A (10.231.0.1) is the head: ``autodidact run`` with ``actor.num_actors=0`` serves
Redis (``redis.bind``), replay and the learner's weights on the veth address, with CURVE keys
from ``autodidact keys generate``. Namespace B (10.231.0.2) is a worker: ``autodidact node
--actors 2`` with the node bundle of those keys and its own run directory. The two reach each
other only over the veth (B's 127.0.0.1 is not A's), and the run must learn as it does on one
host (tests/test_run_integration.py, at a tiny budget).

Skipped, with the reason, where network namespaces cannot be made (not root, no ``ip``, a
container without CAP_NET_ADMIN). The plaintext check at the end needs no namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autodidact.embedded_redis import REMOTE_URL_FILE, EmbeddedRedis
from metrics.jsonl import read_metrics
from protocol import codec
from protocol.control import ControlPlane, default_prefix
from replay.store import Store, read_stats

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "configs" / "quick.yaml"
HEAD_IP, WORKER_IP = "10.231.0.1", "10.231.0.2"
REDIS_PORT, REPLAY_PORT, WEIGHTS_PORT = 6379, 5555, 5556
UPDATES = 6
NODE = "nodeb"
# The same config on both sides (the worker makes the same tiny base model from it), small
# enough for two cores: batches of 4 groups, a short eval, no experience pool.
RUN_SETS = ["name=netns", "learner.batch_groups=4", "eval.num_tasks=24",
            "experience.enabled=false", "learner.probe_every=0"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def netns_unavailable() -> str | None:
    """Why this machine cannot run the test (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    probe = f"adprobe{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
        inside = subprocess.run(["ip", "netns", "exec", probe, sys.executable, "-c", "0"],
                                capture_output=True, text=True, timeout=30)
        if inside.returncode != 0:
            return f"`ip netns exec` is not permitted here: {inside.stderr.strip()}"
        veth = _ip("link", "add", f"vp{probe[-6:]}", "type", "veth", "peer", "name",
                   f"vq{probe[-6:]}", check=False)
        if veth.returncode != 0:
            return f"veth pairs are not permitted here: {veth.stderr.strip()}"
        _ip("link", "del", f"vp{probe[-6:]}", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Namespaces:
    """Two namespaces ``a`` and ``b`` joined by a veth pair, loopback up in each."""

    def __init__(self):
        tag = secrets.token_hex(3)  # unique per run: names are global to the machine
        self.a, self.b = f"adhead{tag}", f"adwork{tag}"
        self.veth_a, self.veth_b = f"vha{tag}", f"vwb{tag}"  # at most 15 characters
        self.procs: list[subprocess.Popen] = []

    def create(self) -> None:
        _ip("netns", "add", self.a)
        _ip("netns", "add", self.b)
        _ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        for ns, dev, addr in ((self.a, self.veth_a, HEAD_IP), (self.b, self.veth_b, WORKER_IP)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, ns: str, argv: list[str], log: Path) -> subprocess.Popen:
        """``python -m autodidact.cli ARGV`` in namespace ``ns``, output to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "autodidact.cli", *argv],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        return proc

    def python(self, ns: str, code: str, *args: str, wait: bool = True):
        """``python -c CODE ARGS`` in namespace ``ns``: its CompletedProcess, or with
        ``wait=False`` the running Popen (output piped)."""
        argv = ["ip", "netns", "exec", ns, sys.executable, "-c", code, *args]
        if wait:
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def destroy(self) -> None:
        """Stop what we started, then anything left in our namespaces, then the namespaces
        (which takes the veth pair with them)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in (self.a, self.b):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # only processes inside this run's own namespaces
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.veth_a, check=False)  # only if left outside a namespace


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s}s:\n" \
                                            f"{log.read_text()[-4000:]}"
        time.sleep(0.2)


PROBE = """
import socket

def reach(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return type(exc).__name__

print(reach("127.0.0.1", %(port)d), reach("%(head)s", %(port)d))
"""


# Run in the worker's namespace while the run trains. Replay (up from before the warm-start):
# a plaintext client gets no answer, and the server counts the refused handshake. Weights:
# the server's stats show the bytes it served (to the node's actors: the head runs none).
WEIGHTS_PROBE = """
import json, sys, time
from protocol.errors import TransportTimeout
from protocol.security import CurveKeys
from protocol.replay_client import ReplayClient

replay_addr, weights_addr, keys = sys.argv[1:4]
deadline = time.monotonic() + float(sys.argv[4])
curve = CurveKeys.load(keys)

def stats_until(address, done):
    client, stats = ReplayClient(address, curve=curve, timeout_s=2), {}
    while time.monotonic() < deadline and not done(stats):
        try:
            stats = client.stats()
        except TransportTimeout:  # not up yet
            time.sleep(0.5)
    client.close()
    return stats

stats_until(replay_addr, bool)
plain = ReplayClient(replay_addr, timeout_s=2)
try:
    plain.stats()
    print("plaintext answered")
except TransportTimeout:
    print("plaintext refused")
plain.close()
print(json.dumps(stats_until(replay_addr, lambda s: s.get("rejected/auth", 0) > 0)))
print(json.dumps(stats_until(weights_addr, lambda s: s.get("bytes", 0) > 0)))
"""


@pytest.fixture(scope="module")
def multinode_run(request, tmp_path_factory):
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"multi-node test skipped: {reason}")
    tmp = tmp_path_factory.mktemp("netns")
    # RL starts from quick.yaml's warm-started policy, made once for the session (conftest):
    # what is under test here is the head and the node, not a warm-start of their own. Asked
    # for after the skip, so a machine without namespaces does not make it for nothing.
    place = request.getfixturevalue("quick_warm_start")
    head_dir, worker_dir, keys = place(tmp / "head"), tmp / "worker", tmp / "keys"
    subprocess.run([sys.executable, "-m", "autodidact.cli", "keys", "generate", "--out",
                    str(keys), "--client", NODE], check=True, capture_output=True, cwd=ROOT)
    sets = [a for s in RUN_SETS for a in ("--set", s)]
    ns = Namespaces()
    try:
        ns.create()
        head_log, node_log = tmp / "head.log", tmp / "node.log"
        head = ns.popen(ns.a, [
            "run", "--run-dir", str(head_dir), "-c", str(QUICK), *sets,
            "--max-updates", str(UPDATES),
            "--set", "actor.num_actors=0",
            # One learner thread: with no actor of its own the head's learner would take both
            # cores (learner.torch_threads=auto), but its "other host" is this machine, whose
            # cores the node's actors share (two threads there ran its 6 updates 17 CPU-s).
            "--set", "learner.torch_threads=1",
            "--set", f"redis.bind={HEAD_IP}:{REDIS_PORT}",
            "--set", f"replay.address=tcp://{HEAD_IP}:{REPLAY_PORT}",
            "--set", f"weights.address=tcp://{HEAD_IP}:{WEIGHTS_PORT}",
            "--set", f"security.keys_dir={keys}"], head_log)
        remote_url = head_dir / "redis" / REMOTE_URL_FILE
        _wait_for(remote_url, head, head_log, timeout_s=90)
        # From the worker's namespace, loopback is its own: the head's Redis is not there.
        probe = ns.python(ns.b, PROBE % {"port": REDIS_PORT, "head": HEAD_IP})
        node = ns.popen(ns.b, [
            "node", "--actors", "2", "--node-name", NODE, "--run-dir", str(worker_dir),
            "-c", str(QUICK), *sets, "--progress-s", "10",
            "--redis-url-file", str(remote_url),
            "--replay-addr", f"tcp://{HEAD_IP}:{REPLAY_PORT}",
            "--weights-addr", f"tcp://{HEAD_IP}:{WEIGHTS_PORT}",
            "--set", f"security.keys_dir={keys / 'nodes' / NODE}"], node_log)
        weights_probe = ns.python(ns.b, WEIGHTS_PROBE, f"tcp://{HEAD_IP}:{REPLAY_PORT}",
                                  f"tcp://{HEAD_IP}:{WEIGHTS_PORT}", str(keys / "nodes" / NODE),
                                  "300", wait=False)
        try:
            head.wait(timeout=360)
        except subprocess.TimeoutExpired:
            pytest.fail(f"head did not finish:\n{head_log.read_text()[-5000:]}\n"
                        f"node:\n{node_log.read_text()[-3000:]}")
        try:  # the node sees the run's phase turn "done" and stops its actors
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node did not stop after the run:\n{node_log.read_text()[-3000:]}")
        out, err = weights_probe.communicate(timeout=30)
        yield {"head": head, "node": node, "weights_probe": (out, err), "head_dir": head_dir,
               "worker_dir": worker_dir, "head_log": head_log.read_text(),
               "node_log": node_log.read_text(), "probe": probe,
               "remote_url": remote_url.read_text().strip()}
    finally:
        ns.destroy()


def multinode(test):
    """A test of the two-namespace run: slow (the run takes 1-2 minutes on 2 cores)."""
    return pytest.mark.slow(pytest.mark.timeout(540)(test))



@multinode
def test_head_and_node_finished_cleanly(multinode_run):
    run = multinode_run
    assert run["head"].returncode == 0, run["head_log"][-5000:]
    assert run["node"].returncode == 0, run["node_log"][-3000:]
    assert "(the learner finished); stopping" in run["node_log"], run["node_log"][-3000:]


@multinode
def test_namespaces_reach_each_other_only_over_the_veth(multinode_run):
    probe = multinode_run["probe"]
    assert probe.returncode == 0, probe.stderr
    local, veth = probe.stdout.split()
    assert local == "refused"  # 127.0.0.1 inside the worker's namespace is not the head
    assert veth == "open"
    assert f"@{HEAD_IP}:{REDIS_PORT}/0" in multinode_run["remote_url"]


@multinode
def test_the_run_learned_as_on_one_host(multinode_run):
    head_dir = multinode_run["head_dir"]
    summary = json.loads((head_dir / "summary.json").read_text())
    assert summary["learner"]["learner/updates"] == UPDATES
    assert summary["learner"]["learner/version"] == UPDATES
    assert summary["success_rl"]["avg"] > summary["success_base"]["avg"], summary
    assert not any(summary["restarts"].values()), summary["restarts"]


@multinode
def test_curve_refused_plaintext_and_weights_travelled_over_the_veth(multinode_run):
    out, err = multinode_run["weights_probe"]
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0] == "plaintext refused", (out, err)
    replay, weights = json.loads(lines[1]), json.loads(lines[2])
    assert replay.get("rejected/auth", 0) >= 1, replay  # the plaintext probe's handshake
    assert weights["chunks"] > 0 and weights["bytes"] > 0, weights


@multinode
def test_replay_stored_groups_from_both_remote_actors(multinode_run):
    head_dir = multinode_run["head_dir"]
    stats = read_stats(head_dir)
    assert stats["groups"] >= UPDATES * 4
    store = Store(head_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            groups = [codec.decode_body("group", bytes(b)) for _, b in store.iter_bodies(txn)]
    finally:
        store.close()
    assert {g.actor_id for g in groups} == {f"{NODE}-actor-0", f"{NODE}-actor-1"}
    versions = {int(v) for g in groups for t in g.trajectories
                for v, m in zip(t.versions, t.action_mask) if m}
    assert len(versions) > 1 and max(versions) >= 2, versions


@multinode
def test_remote_actors_loaded_newer_weights(multinode_run):
    head_dir, worker_dir = multinode_run["head_dir"], multinode_run["worker_dir"]
    with EmbeddedRedis(head_dir) as url:  # the head's Redis data survives in its AOF
        control = ControlPlane.connect(url, default_prefix("netns"))
        assert control.get_version() == UPDATES
        acked = {v: control.version_acks(v) for v in range(1, UPDATES + 1)}
    newer = [v for v, who in acked.items() if who & {f"{NODE}-actor-0", f"{NODE}-actor-1"}]
    assert len(newer) >= 2, acked
    rows = [r for r in read_metrics(worker_dir, "actor") if "actor/version" in r]
    assert {r["id"] for r in rows} == {f"{NODE}-actor-0", f"{NODE}-actor-1"}
    assert max(r["actor/version"] for r in rows) >= 2
    # The worker has its own run directory: nothing of the head's was read from disk there.
    assert not (worker_dir / "weights").exists()
    assert not list(worker_dir.glob("replay.lmdb"))


def test_plaintext_remote_address_is_refused_at_start(tmp_path):
    """No keys and no allow_plaintext_remote: an actor (or node) refuses a replay address off
    this machine at start, naming security.keys_dir. Needs no namespaces."""
    for cmd in (["actor"], ["node", "--actors", "1"]):
        proc = subprocess.run(
            [sys.executable, "-m", "autodidact.cli", *cmd, "--run-dir", str(tmp_path),
             "--redis-url", "redis://:pw@192.0.2.1:6379/0",
             "--replay-addr", "tcp://192.0.2.1:5555"],
            capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        assert "security.keys_dir" in proc.stderr and "tcp://192.0.2.1:5555" in proc.stderr


# --- autodidact node's parts, without namespaces -------------------------------------------


def test_without_root_the_multinode_test_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns_unavailable() == "needs root to make network namespaces (ip netns)"


def test_node_roles_have_node_prefixed_ids_and_pinned_gpus(tmp_path):
    from autodidact.node_cli import node_roles
    from autodidact.roles import role_argv

    specs = node_roles("gpu1", 3, 1, 2, tmp_path, tmp_path / "c.yaml", tmp_path, role_argv)
    assert [s.name for s in specs] == ["gpu1-actor-0", "gpu1-actor-1", "gpu1-actor-2",
                                       "gpu1-judge-0"]
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in specs] == ["0", "1", "0", "0"]
    assert specs[1].argv[-2:] == ["--actor-id", "gpu1-actor-1"]
    assert specs[3].argv[-2:] == ["--judge-id", "gpu1-judge-0"]
    assert all(s.env == {} for s in node_roles("n", 2, 0, 0, tmp_path, tmp_path, tmp_path,
                                                 role_argv))


def test_worker_hint_names_reachable_addresses_and_no_secret(tmp_path):
    from autodidact.node_cli import reachable, worker_hint
    from protocol.config import load_config

    assert reachable("tcp://0.0.0.0:5555", "head") == "tcp://head:5555"
    assert reachable("tcp://*:5556", "head") == "tcp://head:5556"
    assert reachable("tcp://10.0.0.1:5555", "head") == "tcp://10.0.0.1:5555"
    cfg = load_config(None, ["redis.bind=0.0.0.0:6379", "replay.address=tcp://0.0.0.0:5555",
                             "weights.address=tcp://*:5556", "security.keys_dir=/k"])
    cfg.redis.url = "unix://:secret@/r/redis.sock"
    hint = worker_hint(cfg, tmp_path, host="head")
    assert "--replay-addr tcp://head:5555" in hint and "--weights-addr tcp://head:5556" in hint
    assert str(tmp_path / "redis" / "remote_url") in hint and "secret" not in hint
    assert "/k/nodes/NAME" in hint
    cfg.redis.bind = ""
    assert "redis.bind" in worker_hint(cfg, tmp_path, host="head")


@pytest.mark.parametrize("extra, message", [
    (["--redis-url", "redis://h:1/0", "--redis-url-file", "FILE"], "not both"),
    (["--node-name", "bad name"], "--node-name"),
    (["--actors", "0"], "nothing to start"),
])
def test_node_refuses_bad_options(tmp_path, extra, message):
    url_file = tmp_path / "url"
    url_file.write_text("redis://:pw@127.0.0.1:1/0\n")
    extra = [str(url_file) if a == "FILE" else a for a in extra]
    if "--redis-url" not in extra and "--redis-url-file" not in extra:
        extra += ["--redis-url-file", str(url_file)]
    proc = subprocess.run([sys.executable, "-m", "autodidact.cli", "node", "--run-dir",
                           str(tmp_path), "--replay-addr", "tcp://127.0.0.1:1", *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_node_waits_for_weights_then_stops_when_the_learner_finishes(control, tmp_path):
    from autodidact.node_cli import HeadWatch, supervise_node, wait_for_head
    from autodidact.supervisor import RoleSpec, Supervisor

    watch, stopping = HeadWatch(control), []
    control.set_state(phase="rl")
    waiter = threading.Timer(1.0, lambda: control.r.set(control.keys.weights, b"x"))
    waiter.start()
    t0 = time.monotonic()
    assert wait_for_head(watch, stopping, progress_s=60)
    assert time.monotonic() - t0 >= 0.9  # returned once the announcement appeared
    with Supervisor() as roles:
        roles.start(RoleSpec("n-actor-0", ["-c", "import time; time.sleep(60)"]))
        threading.Timer(1.0, lambda: control.set_state(phase="finishing")).start()
        assert supervise_node("n", roles, watch, stopping, 60, head_gone_s=60) == 0


def test_node_stops_when_the_head_is_gone_or_on_a_signal(tmp_path):
    import redis

    from autodidact.node_cli import HeadWatch, supervise_node
    from autodidact.supervisor import RoleSpec, Supervisor
    from protocol.control import ControlPlane

    dead = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    watch = HeadWatch(ControlPlane(dead, "x"))
    with Supervisor() as roles:
        roles.start(RoleSpec("n-actor-0", ["-c", "import time; time.sleep(60)"]))
        assert supervise_node("n", roles, watch, [], 60, head_gone_s=1.0) == 1
        assert supervise_node("n", roles, watch, ["SIGTERM"], 60, head_gone_s=1.0) == 0
