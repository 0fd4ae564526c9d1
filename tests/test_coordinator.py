"""The coordinator keeps the control plane: run state, a fed task queue, Redis refilled."""

from __future__ import annotations

from autodidact.coordinator import Coordinator
from autodidact.resolve import resolve_config
from protocol.messages import Task


def _tasks(n: int) -> list[Task]:
    return [Task(task_id=f"t{i}", env="files", seed=0, query=f"q{i}") for i in range(n)]


def test_the_run_state_follows_the_phases(control, tmp_path):
    coordinator = Coordinator(resolve_config(None, []), tmp_path, control)
    coordinator.start()
    state = control.state()
    assert state["phase"] == "starting" and state["run_dir"] == str(tmp_path)
    coordinator.tick()  # no feeder before training: nothing queued
    assert control.task_queue_len() == 0
    coordinator.feed(_tasks(3), share=0.0)
    assert control.state()["phase"] == "rl"
    coordinator.finishing()
    assert control.state()["phase"] == "finishing"
    coordinator.done()
    assert control.state()["phase"] == "done"


def test_start_opens_admission_and_a_second_start_keeps_its_counters(control, tmp_path):
    """Admission grants nothing until the coordinator opens it (before any actor starts);
    a resumed run's start must not reset what is already admitted."""
    cfg = resolve_config(None, [])
    assert control.admit("a0", 4, max_staleness=0, batch_groups=2) == 0  # not opened yet
    coordinator = Coordinator(cfg, tmp_path, control)
    coordinator.start()
    assert control.admit("a0", 4, max_staleness=0, batch_groups=2) == 2  # (0 + 0 + 1) * 2
    Coordinator(cfg, tmp_path, control).start()  # --resume: the counters stay
    assert control.admit("a0", 4, max_staleness=0, batch_groups=2) == 0


def test_each_tick_keeps_the_queue_fed(control, tmp_path):
    cfg = resolve_config(None, ["actor.num_actors=1", "actor.groups_in_flight=1"])
    coordinator = Coordinator(cfg, tmp_path, control)
    coordinator.start()
    coordinator.feed(_tasks(5), share=0.0)
    coordinator.tick()
    queued = control.task_queue_len()
    assert queued >= coordinator.feeder.low_water
    control.r.delete(control.keys.tasks)  # the actors drew every task
    assert control.task_queue_len() < coordinator.feeder.low_water
    coordinator.tick()
    assert control.task_queue_len() >= coordinator.feeder.low_water


def test_lost_run_state_is_put_back(control, tmp_path):
    coordinator = Coordinator(resolve_config(None, []), tmp_path, control)
    coordinator.start()
    control.r.delete(control.keys.state)  # Redis lost its data
    coordinator.tick()
    assert control.state()["run_dir"] == str(tmp_path)
    assert coordinator.redis_watch.restores == 1


def test_restarts_count_the_roles_and_redis(control, tmp_path):
    class Roles:
        def restarts(self):
            return {"actor-0": 2}

    coordinator = Coordinator(resolve_config(None, []), tmp_path, control)
    coordinator.publish_restarts(Roles())
    assert coordinator.restarts(Roles()) == {"actor-0": 2, "redis": 0}
    assert "actor-0" in str(control.state().get("restarts"))
