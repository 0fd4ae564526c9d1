"""How `autodidact run` starts a learner of several processes (torchrun), and that stopping
it leaves none of its ranks behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from autodidact.roles import learner_argv
from autodidact.supervisor import RoleSpec, Supervisor
from protocol.config import load_config

pytestmark = pytest.mark.timeout(60)


def test_one_learner_process_is_the_plain_role_command(tmp_path):
    cfg = load_config(None, [])
    argv = learner_argv(cfg, tmp_path, tmp_path / "config.yaml", "--resume")
    assert argv[:3] == ["-m", "autodidact.cli", "learner"] and argv[-1] == "--resume"


def test_several_learner_processes_go_through_torchrun(tmp_path):
    cfg = load_config(None, ["learner.nproc=2", "learner.batch_groups=16"])
    argv = learner_argv(cfg, tmp_path, tmp_path / "config.yaml")
    assert argv[:4] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert argv[4:7] == ["-m", "autodidact.cli", "learner"]


def test_the_training_roles_of_a_run(tmp_path):
    from autodidact.roles import training_roles

    cfg = load_config(None, ["actor.num_actors=2", "judge.workers=1", "explore.stage=alongside",
                             "experience.update_every=3"])
    specs = training_roles(cfg, tmp_path, tmp_path / "config.yaml", max_updates=9)
    assert [s.name for s in specs] == ["learner", "actor-0", "actor-1", "judge-0",
                                       "experience", "explore"]
    learner = specs[0]
    assert learner.argv[-2:] == ["--max-updates", "9"] and learner.restart_argv[-1] == "--resume"
    assert specs[2].argv[-2:] == ["--actor-id", "actor-1"]
    assert specs[2].log_path == tmp_path / "logs" / "actor-1.log"
    assert specs[-1].argv[-2:] == ["--rounds", "0"]
    resumed = training_roles(cfg, tmp_path, tmp_path / "config.yaml", resume=True)[0]
    assert resumed.argv[-1] == "--resume"
    quiet = load_config(None, ["actor.num_actors=0", "judge.workers=0",
                               "experience.update_every=0"])
    assert [s.name for s in training_roles(quiet, tmp_path, tmp_path / "c.yaml")] == ["learner"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return state != "Z"


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_stopping_a_process_group_role_stops_its_children(tmp_path, ignores_sigterm):
    """Like torchrun: a parent with a child; the child must not outlive the stop, even when
    the parent dies first (SIGKILL after the grace period) or ignores SIGTERM."""
    child_pid = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time\n"
            f"{'signal.signal(signal.SIGTERM, signal.SIG_IGN)' if ignores_sigterm else ''}\n"
            "c = subprocess.Popen([sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(300)'])\n"
            f"open({str(child_pid)!r}, 'w').write(str(c.pid))\n"
            "time.sleep(300)\n")
    with Supervisor() as sup:
        sup.start(RoleSpec("learner", ["-c", code], process_group=True))
        deadline = time.monotonic() + 20
        while not (child_pid.exists() and child_pid.read_text()):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        pid = int(child_pid.read_text())
        assert _alive(pid)
        sup.stop(grace_s=1.0)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "a rank outlived its torchrun"
