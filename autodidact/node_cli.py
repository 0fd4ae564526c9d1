"""``autodidact node``: the actors and judges of one worker node of a multi-node run.

The head node runs Redis, replay, the learner (``autodidact run`` with
``actor.num_actors=0``); every other node runs this command with the head's addresses::

    cfg = the run's config + --redis-url/--replay-addr/--weights-addr (CURVE keys checked;
          actor.device=cuda with --gpus-per-node), resolved once (autodidact/resolve.py)
    model = model.path, or the run's tiny model made here (the same one the head makes): a
          new config naming it
    write <run-dir>/node-<name>.yaml (mode 0600: the Redis URL carries its password)
    wait until Redis answers and the learner has announced weights (head up, warm-start over)
    with Supervisor() as roles:
        start <name>-actor-0..N-1 (actor i on GPU i % --gpus-per-node) and <name>-judge-0..M-1
        until SIGTERM/SIGINT, the run's phase is finishing/done, Redis has been gone for
        --head-gone-s, or a role failed for good:
            restart dead roles (with back-off); every --progress-s print a progress line
    every role is stopped on exit

Role ids are ``<node name>-actor-<i>`` / ``<node name>-judge-<j>``: unique across nodes and the
same after a restart, so a restarted actor finds its outbox (``<run-dir>/acks/<id>.*``).
Logs go to ``<run-dir>/logs/<id>.log``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import sys
import time
from pathlib import Path

import click

from autodidact.base_model import prepare_model
from autodidact.cli_common import config_option, role_config, set_option
from autodidact.resolve import with_model
from autodidact.roles import role_argv, write_resolved_config
from autodidact.supervisor import RoleSpec, Supervisor
from protocol.config import redact_url
from protocol.run_dir import RunDir

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def default_node_name() -> str:
    return socket.gethostname().split(".")[0] or "node"


@click.command("node")
@config_option
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="This node's run directory (default runs/<name>): logs, actor outboxes, "
                   "metrics. Need not be shared with the head when --weights-addr is set.")
@set_option("actor.backend=vllm")
@click.option("--redis-url", default=None,
              help="The run's Redis (the head's <run-dir>/redis/remote_url).")
@click.option("--redis-url-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the Redis URL from this file (keeps its password out of argv).")
@click.option("--replay-addr", default=None, help="The head's replay server, tcp://HEAD:5555.")
@click.option("--weights-addr", default=None,
              help="The learner's weight server, tcp://HEAD:5556 (else the actors read "
                   "<run-dir>/weights/, which must then be the head's, shared).")
@click.option("--actors", type=click.IntRange(min=0), default=1, show_default=True,
              help="Actor processes on this node.")
@click.option("--judges", type=click.IntRange(min=0), default=0, show_default=True,
              help="Judge processes on this node.")
@click.option("--node-name", default=None,
              help="Prefix of the role ids (default: the short host name).")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=0, show_default=True,
              help="Pin actor i (and judge j) to GPU i % N with CUDA_VISIBLE_DEVICES and "
                   "actor.device=cuda; 0 = leave devices to the config.")
@click.option("--progress-s", type=float, default=30.0, show_default=True,
              help="Seconds between progress lines.")
@click.option("--head-gone-s", type=float, default=60.0, show_default=True,
              help="Stop (exit 1) when the run's Redis has not answered for this long.")
def node(config, run_dir, sets, redis_url, redis_url_file, replay_addr, weights_addr, actors,
         judges, node_name, gpus_per_node, progress_s, head_gone_s):
    """Start this worker node's actors and judges against the head's services.

    \b
    autodidact node --actors 8 --gpus-per-node 8 \\
        --redis-url-file head-redis-url --replay-addr tcp://head:5555 \\
        --weights-addr tcp://head:5556 --set security.keys_dir=keys/nodes/gpu1 \\
        -c run.yaml
    """
    name = node_name or default_node_name()
    if not NAME.match(name):
        raise click.UsageError(f"--node-name must be letters, digits and '_.-', got {name!r}")
    if redis_url_file and redis_url:
        raise click.UsageError("give --redis-url or --redis-url-file, not both")
    if redis_url_file:
        redis_url = Path(redis_url_file).read_text().strip()
    if actors + judges == 0:
        raise click.UsageError("nothing to start: --actors and --judges are both 0")
    cfg, path = role_config(config, sets, run_dir, redis_url, replay_addr, weights_addr,
                            gpu_actors=gpus_per_node > 0)
    code = run_node(cfg, path, name, actors, judges, gpus_per_node, progress_s,
                    head_gone_s)
    sys.exit(code)


def run_node(cfg, run_dir: Path, name: str, actors: int, judges: int, gpus: int,
             progress_s: float = 30.0, head_gone_s: float = 60.0) -> int:
    """Start, supervise and stop this node's roles; returns a process exit code. ``cfg`` is
    the node's resolved config (``gpus`` pins actors to GPUs; its device is resolved with
    ``Flags(gpu_actors=True)``)."""
    import redis

    from protocol.control import ControlPlane

    rd = RunDir(run_dir)
    if not cfg.model.path:  # deterministic: the head's base model
        cfg = with_model(cfg, prepare_model(cfg, run_dir))
    # Named per node: the run dir may be shared.
    config_path = write_resolved_config(cfg, run_dir, rd.node_config(name))
    logs = rd.logs
    logs.mkdir(exist_ok=True)
    stopping: list[str] = []
    previous = {s: signal.signal(s, lambda signum, _: stopping.append(signal.Signals(signum).name))
                for s in (signal.SIGTERM, signal.SIGINT)}
    say(f"node {name}: {actors} actor(s), {judges} judge(s); redis {redact_url(cfg.redis.url)}, "
        f"replay {cfg.replay.address}, weights {cfg.weights.address or rd.weights}; "
        f"logs in {logs}")
    # The node's own watch client fails fast (the roles' clients retry for ~40 s): the loop
    # must keep restarting roles and answering signals while the head is away.
    client = redis.Redis.from_url(cfg.redis.url, socket_timeout=5, socket_connect_timeout=5)
    watch = HeadWatch(ControlPlane(client, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s))
    try:
        if not wait_for_head(watch, stopping, progress_s):
            return 0
        with Supervisor(pids_path=rd.node_pids(name)) as roles:
            for spec in node_roles(name, actors, judges, gpus, run_dir, config_path, logs,
                                   role_argv):
                roles.start(spec)
            try:
                return supervise_node(name, roles, watch, stopping, progress_s, head_gone_s)
            finally:
                # All producers, no order to keep; one shared grace period, since an actor
                # may be mid-fetch of weights, or retrying Redis, from a head already gone.
                # SIGKILL after it loses nothing: the outboxes are on disk.
                roles.stop(grace_s=STOP_GRACE_S, together=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        client.close()


def node_roles(name, actors, judges, gpus, run_dir, config_path, logs, role_argv) -> list:
    specs = []
    for kind, count, flag in (("actor", actors, "--actor-id"), ("judge", judges, "--judge-id")):
        for i in range(count):
            rid = f"{name}-{kind}-{i}"
            env = {"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else {}
            specs.append(RoleSpec(rid, role_argv(kind, run_dir, config_path, flag, rid),
                                  log_path=logs / f"{rid}.log", env=env))
    return specs


ENDED = ("finishing", "done")  # run phases after the learner has finished
CHECK_S = 0.5  # how often the run's phase is read (one HGETALL)
STOP_GRACE_S = 25.0  # SIGTERM to SIGKILL; within Slurm's default KillWait (30 s)


class HeadWatch:
    """The run as this node sees it through Redis: its phase, and how long Redis has been
    out of reach (the head's Redis goes away with the head)."""

    def __init__(self, control):
        self.control = control
        self.unreachable_since: float | None = None
        self.error = ""

    def phase(self) -> str | None:
        """The run's phase, or None while Redis does not answer."""
        import redis

        try:
            phase = self.control.state().get("phase", "")
        except redis.RedisError as exc:
            self.unreachable_since = self.unreachable_since or time.monotonic()
            self.error = str(exc)
            return None
        self.unreachable_since = None
        return phase

    def unreachable_s(self) -> float:
        return 0.0 if self.unreachable_since is None else time.monotonic() - self.unreachable_since


def supervise_node(name, roles, watch, stopping, progress_s, head_gone_s) -> int:
    """Restart dead roles until a stop signal, the run's end (or its head gone), or a role
    that failed for good."""
    t0 = last_check = last_print = time.monotonic()
    while not stopping:
        failed = roles.check()
        if failed:
            say(f"node {name}: roles failed for good: {', '.join(failed)}; see the logs")
            return 1
        now = time.monotonic()
        if now - last_check >= CHECK_S:  # the head's Redis may stop soon after the learner
            last_check = now
            phase = watch.phase()
            if phase in ENDED:
                say(f"node {name}: the run is {phase} (the learner finished); stopping")
                return 0
            if watch.unreachable_s() > head_gone_s:
                say(f"node {name}: redis unreachable for {watch.unreachable_s():.0f}s "
                    f"({watch.error}): the head is gone; stopping")
                return 1
            if now - last_print >= progress_s:
                last_print = now
                say(progress_line(name, roles, watch, now - t0))
        time.sleep(0.5)
    say(f"node {name}: {stopping[0]}: stopping every role")
    return 0


def wait_for_head(watch, stopping, progress_s) -> bool:
    """Block until the run is live (the head may not be up yet, or still warm-starting):
    Redis answers, the run is not over, the learner has announced weights. False on a stop
    signal."""
    import redis

    last = -progress_s
    while not stopping:
        phase = watch.phase()
        if phase is None:
            why = f"redis not reachable yet ({watch.error})"
        elif phase in ENDED:
            why = f"the run is {phase} (over, or not started again yet)"
        else:
            try:
                if watch.control.r.exists(watch.control.keys.weights):
                    return True
                why = "the learner has not announced weights yet"
            except redis.RedisError as exc:
                why = f"redis: {exc}"
        if time.monotonic() - last >= progress_s:
            last = time.monotonic()
            say(f"waiting for the head: {why}")
        time.sleep(1.0)
    return False


def progress_line(name, roles, watch, elapsed_s) -> str:
    import redis

    control = watch.control
    try:
        beats = {h["id"]: h for h in control.alive() if str(h.get("id", "")).startswith(name + "-")}
        version = control.get_version()
    except redis.RedisError as exc:
        beats, version = {}, f"? (redis: {exc})"
    up = sum(run.proc.poll() is None for run in roles.roles.values())
    groups = sum(int(h.get("groups", 0)) for h in beats.values() if h.get("role") == "actor")
    versions = sorted({h["version"] for h in beats.values() if h.get("version") is not None})
    return (f"[{elapsed_s:5.0f}s] node {name}: {up}/{len(roles.roles)} roles up, "
            f"{len(beats)} heartbeating, run version {version}, actor versions "
            f"{versions or '-'}, groups {groups}, restarts {len(roles.restart_log)}")


def say(message: str) -> None:
    with contextlib.suppress(OSError):  # stdout of a detached srun step may be gone
        click.echo(f"{time.strftime('%H:%M:%S')} {message}", err=True)


def reachable(address: str, host: str) -> str:
    """A bind address as other machines connect to it: ``tcp://*:p``/``tcp://0.0.0.0:p`` at
    ``host``; anything else as it is."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if address.startswith(wildcard):
            return f"tcp://{host}:{address[len(wildcard):]}"
    return address


def worker_hint(cfg, run_dir: Path, host: str | None = None) -> str:
    """The command a worker node runs against this head, for the head to print (secrets are
    named by file, never shown): Redis from ``<run-dir>/redis/remote_url``, the replay and
    weight servers at this host, keys from the node's bundle."""
    host = host or socket.gethostname()
    if cfg.redis.bind:
        redis_arg = f"--redis-url-file <copy of {RunDir(run_dir).redis_remote_url}>"
    elif cfg.redis.url and not cfg.redis.url.startswith("unix:"):
        redis_arg = f"--redis-url {redact_url(cfg.redis.url)}"
    else:
        return ("  workers: none can reach this head's Redis: set redis.bind=0.0.0.0:6379 "
                "(and replay.address/weights.address to tcp:// addresses)")
    parts = ["autodidact node --actors N", redis_arg,
             f"--replay-addr {reachable(cfg.replay.address, host)}"]
    if cfg.weights.address:
        parts.append(f"--weights-addr {reachable(cfg.weights.address, host)}")
    if cfg.security.keys_dir:
        parts.append(f"--set security.keys_dir=<copy of {cfg.security.keys_dir}/nodes/NAME>")
    parts.append("-c <this run's config> [--set ... as here]")
    hint = "  workers: " + " ".join(parts)
    if not cfg.security.keys_dir:  # replay tells roles apart by token: the node needs them
        rd = RunDir(run_dir)
        hint += (f"\n  (without keys, copy {rd.role_token('actor')} and "
                 f"{rd.role_token('judge')} into the node's --run-dir first)")
    return hint
