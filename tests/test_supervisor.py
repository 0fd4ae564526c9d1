"""The process supervisor with real child processes."""

import signal
import time

from autodidact.supervisor import RoleSpec, Supervisor


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_dead_role_is_restarted_with_backoff(tmp_path):
    log = tmp_path / "crash.log"
    spec = RoleSpec("crash", ["-c", "import sys; print('up', flush=True); sys.exit(3)"],
                    max_restarts=2, log_path=log)
    with Supervisor(backoff_s=0.2) as sup:
        sup.start(spec)
        t0 = time.monotonic()
        wait_for(lambda: sup.check() == ["crash"])
        assert [code for _, code in sup.restart_log] == [3, 3]
        assert time.monotonic() - t0 >= 0.2 + 0.4  # back-off doubled between the restarts
    assert log.read_text().count("up") == 3


def test_an_unrecoverable_exit_fails_at_once_without_restarts(tmp_path):
    from protocol.errors import EXIT_UNRECOVERABLE

    log = tmp_path / "bad.log"
    spec = RoleSpec("bad", ["-c", f"print('up', flush=True); raise SystemExit("
                            f"{EXIT_UNRECOVERABLE})"], max_restarts=5, log_path=log)
    with Supervisor(backoff_s=0.05) as sup:
        sup.start(spec)
        wait_for(lambda: sup.check() == ["bad"])
        assert sup.restart_log == []
    assert log.read_text().count("up") == 1


def test_clean_exit_is_not_restarted(tmp_path):
    with Supervisor(backoff_s=0.05) as sup:
        sup.start(RoleSpec("ok", ["-c", "pass"]))
        wait_for(lambda: sup.exited("ok") == 0)
        time.sleep(0.2)
        assert sup.check() == [] and sup.restart_log == []


def test_killed_role_comes_back_and_stop_ends_all(tmp_path):
    with Supervisor(backoff_s=0.05) as sup:
        first = sup.start(RoleSpec("sleeper", ["-c", "import time; time.sleep(60)"]))
        first.send_signal(signal.SIGKILL)
        wait_for(lambda: (sup.check() or True) and sup.roles["sleeper"].proc is not first
                 and sup.exited("sleeper") is None)
        second = sup.roles["sleeper"].proc
    assert second.poll() is not None  # stopped on exit of the with-block
