"""No orphan roles, no second launcher or learner (issue 21, part 1).

- a supervisor killed outright (SIGKILL: no clean-up of its own runs) takes its roles and the
  embedded redis-server with it (the kernel's parent-death signal), and a role that ignores
  that signal is ended by its orphan watchdog;
- a live redis-server of a run directory is refused, never doubled;
- run-directory locks name their holder's pid and free themselves when the holder dies;
- end to end: ``autodidact run --resume`` on a live run directory is refused naming the
  launcher's pid; SIGKILL of the launcher alone leaves no role and no Redis behind; the run
  directory is 0700 and its stores, config and Redis AOF are not readable by others; a
  resume on damaged checkpoints fails once, says so and drops the earlier run's numbers;
- the test session itself fails when a process it started outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from autodidact.embedded_redis import EmbeddedRedis
from protocol.run_dir import LAUNCHER_LOCK, RunDir, single_writer_lock

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "configs" / "quick.yaml"


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PARENT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from autodidact.embedded_redis import EmbeddedRedis
    from autodidact.supervisor import RoleSpec, Supervisor

    run_dir = Path(sys.argv[1])
    server = EmbeddedRedis(run_dir)
    server.start()
    roles = Supervisor()
    role = roles.start(RoleSpec("sleeper", ["-c", "import time; time.sleep(300)"]))
    # A role that ignores SIGTERM (stuck retrying a Redis that went down with the launcher):
    # its orphan watchdog ends it.
    stubborn = roles.start(RoleSpec("stubborn", ["-c", (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "from autodidact.supervisor import exit_when_orphaned; exit_when_orphaned(1.0); "
        "time.sleep(300)")]))
    (run_dir / "pids.json").write_text(json.dumps([role.pid, stubborn.pid, server.proc.pid]))
    time.sleep(300)
""")


@pytest.mark.timeout(60)
def test_a_supervisor_killed_outright_takes_its_roles_and_redis_with_it(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    children = []
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pids.json").exists():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        children = json.loads((tmp_path / "pids.json").read_text())
        time.sleep(0.5)  # the stubborn role has set its SIGTERM handler
        assert all(alive(p) for p in children)
        parent.kill()
        parent.wait()
        assert wait_gone(children, 10) == []
    finally:
        parent.kill()
        parent.wait()
        kill_all(children)


@pytest.mark.timeout(60)
def test_a_live_redis_of_the_run_directory_is_refused_not_doubled(tmp_path):
    first = EmbeddedRedis(tmp_path)
    url = first.start()
    try:
        with pytest.raises(RuntimeError, match=f"pid {first.proc.pid}.*kill {first.proc.pid}"):
            EmbeddedRedis(tmp_path).start()
        assert redis.Redis.from_url(url).ping()  # the live one was left alone
    finally:
        first.stop()
    second = EmbeddedRedis(tmp_path)  # its pid file is gone with it: a new one may start
    second.start()
    second.stop()


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from protocol.run_dir import single_writer_lock
    single_writer_lock(Path(sys.argv[1]), sys.argv[2], "busy")
    print("held", flush=True)
    time.sleep(300)
""")


@pytest.mark.timeout(60)
def test_a_run_directory_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), LAUNCHER_LOCK],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"in use by pid {holder.pid}$"):
            single_writer_lock(tmp_path, LAUNCHER_LOCK, "in use by pid {pid}")
    finally:
        holder.kill()
        holder.wait()
    fd = single_writer_lock(tmp_path, LAUNCHER_LOCK, "in use by pid {pid}")  # SIGKILL freed it
    assert RunDir(tmp_path).launcher_lock.read_text().strip() == str(os.getpid())
    os.close(fd)


LEAKY = textwrap.dedent("""
    import subprocess, sys

    def test_leaves_a_sleeper_behind():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
""")


@pytest.mark.timeout(120)
def test_the_session_fails_when_a_process_it_started_outlives_it(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=100,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"})
    assert inner.returncode == 1, inner.stdout[-2000:] + inner.stderr[-2000:]
    assert "1 passed" in inner.stdout
    assert "1 process(es) the tests started outlived the session" in inner.stdout
    assert "time.sleep(300)" in inner.stdout


def run_argv(run_dir: Path, *extra: str) -> list[str]:
    # Reach training quickly: a token warm-start and held-out evaluation.
    return [sys.executable, "-m", "autodidact.cli", "run", "--run-dir", str(run_dir),
            "-c", str(QUICK), "--set", "warmstart.steps=2", "--set", "eval.num_tasks=2",
            "--set", "eval.k=1", "--set", "eval.greedy=false", "--set", "learner.max_minutes=5",
            "--set", "learner.max_updates=1000", *extra]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_killed_alone_leaves_nothing_and_a_live_run_refuses_a_second(tmp_path):
    run_dir = tmp_path / "run"
    log = (tmp_path / "launcher.log").open("wb")
    launcher = subprocess.Popen(run_argv(run_dir), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    rd = RunDir(run_dir)
    roles = []
    try:
        deadline = time.monotonic() + 240
        while not (rd.pids.exists() and len(json.loads(rd.pids.read_text() or "{}")) >= 4):
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training roles never started"
            time.sleep(0.5)
        roles = [*json.loads(rd.pids.read_text()).values(), int(rd.redis_pid.read_text())]
        assert len(roles) >= 4 and all(alive(p) for p in roles)
        # The run's files are its owner's alone.
        assert run_dir.stat().st_mode & 0o777 == 0o700
        private = [rd.replay_store / "data.mdb", rd.config, rd.checkpoints.parent / "pids.json",
                   *rd.redis.rglob("*.aof*")]
        assert len(private) > 3
        assert {str(p): oct(p.stat().st_mode & 0o077) for p in private if p.is_file()} == \
            {str(p): "0o0" for p in private if p.is_file()}

        second = subprocess.run(run_argv(run_dir, "--resume"), cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 1
        assert f"in use by another autodidact run (pid {launcher.pid})" in \
            second.stdout + second.stderr
        assert all(alive(p) for p in roles)  # the refused one touched nothing

        launcher.kill()
        launcher.wait()
        assert wait_gone(roles, 20) == [], "roles outlived their launcher"
    finally:
        launcher.kill()
        launcher.wait()
        kill_all(roles)
        log.close()

    # Damaged checkpoints: the resumed run's learner refuses them in one line, is not
    # restarted, and the run says it failed instead of printing the earlier numbers.
    rd.checkpoints.mkdir(exist_ok=True)
    for path in (rd.checkpoint, rd.previous_checkpoint):
        path.write_bytes(b"PK\x03\x04" + os.urandom(4096))  # cut-short zip archives
    rd.summary.write_text(json.dumps({"success_rl": {"avg": 0.99}}))  # an earlier run's
    failed = subprocess.run(run_argv(run_dir, "--resume"), cwd=ROOT, capture_output=True,
                            text=True, timeout=200)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "run failed: learner failed for good" in failed.stderr
    # ... and quotes the learner's own reason, not only where its log is.
    assert "failed for good (exit code 78: learner: no good checkpoint in" in failed.stderr
    assert "move the directory away" in failed.stderr
    summary = json.loads(rd.summary.read_text())
    assert summary["failed_roles"] == ["learner"] and "success_rl" not in summary
    learner_log = (rd.logs / "learner.log").read_text()
    assert learner_log.count("learner: no good checkpoint in") == 1  # not restarted
