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


# --- why a role failed, quoted from its log ---------------------------------------------------


def failing(tmp_path, name: str, code: str, earlier: str = "") -> tuple[Supervisor, str]:
    """A role whose log already holds an earlier run's lines, started, left to fail for good."""
    log = tmp_path / f"{name}.log"
    log.write_text(earlier)
    spec = RoleSpec(name, ["-c", code], max_restarts=1, log_path=log)
    sup = Supervisor(backoff_s=0.05)
    sup.start(spec)
    wait_for(lambda: sup.check() == [name])
    return sup, sup.failure(name)


def test_an_unrecoverable_exit_is_quoted_by_its_last_line(tmp_path):
    from protocol.errors import EXIT_UNRECOVERABLE

    code = ("import logging, sys\n"
            "logging.basicConfig(format='%(asctime)s %(levelname)s %(name)s: %(message)s')\n"
            "logging.getLogger('learner').error('latest.pt is damaged; trying previous.pt')\n"
            "print('learner: no good checkpoint in ck/ [a] [red]; move ck/ away', "
            "file=sys.stderr)\n"
            f"raise SystemExit({EXIT_UNRECOVERABLE})\n")
    sup, why = failing(tmp_path, "learner", code)
    with sup:
        assert why == (f"exit code {EXIT_UNRECOVERABLE}: learner: no good checkpoint in ck/ "
                       f"[a] [red]; move ck/ away")


def test_a_crash_is_quoted_by_its_exception_not_an_earlier_runs(tmp_path):
    code = ("import logging\n"
            "logging.basicConfig(format='%(asctime)s %(levelname)s %(name)s: %(message)s')\n"
            "logging.getLogger('actor').error('replay slow')\n"
            "def load():\n"
            "    raise ValueError('model.path: no config.json in /m')\n"
            "load()\n")
    earlier = "Traceback (most recent call last):\n  File 'x'\nKeyError: 'an earlier run'\n"
    sup, why = failing(tmp_path, "actor-0", code, earlier)
    with sup:
        assert why == "exit code 1: ValueError: model.path: no config.json in /m"
        assert len(sup.restart_log) == 1  # the restart's own words, not the first attempt's


def test_a_role_that_logs_an_error_and_exits_is_quoted_by_that_error(tmp_path):
    code = ("import logging, sys\n"
            "logging.basicConfig(format='%(asctime)s %(levelname)s %(name)s: %(message)s')\n"
            "logging.getLogger('judge').error('llm.url refused the connection')\n"
            "logging.getLogger('judge').warning('closing')\n"
            "sys.exit(2)\n")
    sup, why = failing(tmp_path, "judge-0", code)
    with sup:
        assert why.startswith("exit code 2: ") and why.endswith(
            " ERROR judge: llm.url refused the connection")


def test_a_killed_role_says_by_what_and_a_silent_one_says_only_that(tmp_path):
    sup, why = failing(tmp_path, "oom", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with sup:
        assert why == "killed by SIGKILL"
    sup, why = failing(tmp_path, "quiet", "raise SystemExit(3)", earlier="an earlier run\n")
    with sup:
        assert why == "exit code 3"
