"""OpenEnv both ways, against real OpenEnv server processes built with openenv-core (the
``openenv`` extra), no mocks:

* ``autodidact env serve files --openenv`` (ours, in a process) driven by our adapter
  (``env.name=openenv``) step for step beside ``FilesEnv`` in process: the same observations,
  done, validity, tools, and the server's reward equal to the in-process ``goal_progress``;
* the same server driven by openenv-core's own ``GenericEnvClient``;
* ``tests/openenv_native.py``, an MCP-tool env written only with openenv-core's classes, driven
  by the adapter: JSON-schema tools as ToolSpecs, reward and done from the server;
* the actor's rollout path (a tiny sampled policy) on the adapter, replayed in process;
* what an env without state() says, the config, the serve flag's refusals, a server at
  capacity, a call past the deadline, and replies that do not fit (one EnvFailed naming the
  field).

One server of each kind for the whole module; each is started with the parent-death signal in
a session of its own and killed in the fixture's finally, so nothing outlives the tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_procs import stop_group

from autodidact.supervisor import die_with_parent
from environments import (
    FilesEnv,
    check_env_options,
    env_class,
    env_maker,
    env_names,
    world_split,
)
from environments.base import ToolCall, ToolError
from protocol.config import EnvConfig
from protocol.errors import ConfigError, EnvFailed
from protocol.transport import free_tcp_port

# Only the tests with a server need openenv-core: the ``servers`` fixture skips them without
# it; the others (config, refusals, replies that do not fit, the default import) always run.

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
START_S = 60.0  # an OpenEnv server imports openenv-core (~5 s alone) before it listens


class OpenEnvServer:
    """An OpenEnv server process at http://127.0.0.1:<free port>, its output in ``log``."""

    def __init__(self, argv: list[str], log: Path):
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [a.replace("{port}", str(self.port)).replace("{url}", self.url)
                     for a in argv]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(  # dies with pytest, in a group of its own
                [sys.executable, *self.argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
                env={**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}"})

    def wait_up(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{self.argv} not up in {START_S:g} s: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_group(self.proc)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(ours, native): started together (each spends seconds importing), stopped however the
    module ends. Skips the test where openenv-core is not installed."""
    if importlib.util.find_spec("openenv") is None:
        pytest.skip("openenv-core is not installed (pip install -e '.[openenv]'; "
                    "scripts/setup.sh installs it)")
    logs = tmp_path_factory.mktemp("openenv")
    ours = OpenEnvServer(["-m", "autodidact.cli", "env", "serve", "files", "--openenv",
                          "--address", "{url}", "--max-sessions", "8"], logs / "ours.log")
    native = OpenEnvServer([str(HERE / "openenv_native.py"), "{port}"], logs / "native.log")
    try:
        ours.start()
        native.start()
        deadline = time.monotonic() + START_S
        import openenv.core.generic_client  # noqa: F401  (its ~5 s while the servers start)
        ours.wait_up(deadline)
        native.wait_up(deadline)
        yield ours, native
    finally:
        ours.stop()
        native.stop()


def adapter(url: str, **options):
    return env_maker(EnvConfig(name="openenv", options={"url": url, **options}))()


def _plain(tools):
    """Tools as the JSON schema carries them (``kind`` is ours alone)."""
    return [(t.name, t.description, [(a.name, a.type, a.required, a.choices, a.bounds)
                                     for a in t.args]) for t in tools]


# --- our env served as OpenEnv, driven by our adapter ----------------------------------------


ACTIONS = ["ls", "cd music", "frobnicate", "cd", "cd /", "ls docs", "mv ideas.md music"]


@pytest.mark.slow
def test_adapter_drives_our_served_env_like_in_process(servers):
    ours, _ = servers
    env = adapter(ours.url, seeds=5)
    task = env.tasks("train")[0]
    local = FilesEnv()
    local_task = local.tasks("train")[0]  # seed 0 is the first train task there
    assert task.seed == 0 and task.task_id == "openenv-0"
    first = env.reset(task)
    assert first == f"{local_task.query}\n{local.reset(local_task)}"
    assert _plain(env.tools()) == _plain(local.tools())
    assert env.evaluate(task) == 0.0
    for action in ACTIONS:
        served, mine = env.step(action), local.step(action)
        assert served == mine, action
        assert env.evaluate(task) == local.goal_progress(local_task), action
    assert env.done and env.evaluate(task) == 1.0  # the last action moves the file
    assert env.server_state()["world"] == local.state()
    assert env.responses == local.responses
    with pytest.raises(ToolError):
        env.execute(ToolCall("cd", ("nowhere",)))
    env.close()


def test_a_rollout_through_the_adapter_replays_in_process(servers, files_policy_path):
    """The actor's own rollout path (episodes.rollout, a tiny policy, sampled) on the
    adapter: each episode's actions replayed in FilesEnv give its observations, and its reward
    is the in-process goal_progress."""
    from transformers import AutoTokenizer

    from episodes.rollout import RolloutSettings, rollout, start_episodes
    from inference.backends import SamplingParams, TransformersBackend
    from inference.codecs import make_codec

    ours, _ = servers
    make = env_maker(EnvConfig(name="openenv", options={"url": ours.url, "seeds": 5}))
    tasks = make().tasks("train")[:2]
    local_tasks = FilesEnv().tasks("train")
    codec_ = make_codec(AutoTokenizer.from_pretrained(files_policy_path))
    with TransformersBackend(files_policy_path, version=0) as backend:
        episodes = start_episodes(tasks, 2, make, codec_)
        rollout(backend, episodes, codec_, SamplingParams(
            temperature=1.0, max_new_tokens=16, stop_token_ids=(codec_.eoa_id,), seed=5),
            RolloutSettings(max_turns=3))
    steps = 0
    for ep in episodes:
        traj = ep.to_trajectory()
        local, task = FilesEnv(), local_tasks[ep.task.seed]  # seed k: the k-th train task
        local.reset(task)
        for step in traj.steps:
            assert local.step(step.action)[0] == step.observation
        steps += len(traj.steps)
        assert traj.reward == local.goal_progress(task) == ep.env.evaluate(ep.task)
        ep.env.close()
    assert steps > 0


def test_openenv_client_drives_our_served_env(servers):
    from openenv.core.generic_client import GenericEnvClient

    ours, _ = servers
    local = FilesEnv()
    held_out = local.tasks("validation")[0]
    with GenericEnvClient(base_url=ours.url).sync() as client:
        result = client.reset(task_id=held_out.task_id)
        obs = result.observation
        assert obs["task_id"] == held_out.task_id and obs["query"] == held_out.query
        assert {t["name"] for t in obs["tools"]} == {t.name for t in local.tools()}
        assert result.done is False
        local.reset(held_out)
        for action in held_out.reference:
            result = client.step({"action": action})
            text, done, info = local.step(action)
            assert result.observation["text"] == text
            assert result.observation["valid"] is info["valid"]
            assert result.reward == local.goal_progress(held_out)
        assert result.done is True and result.reward == 1.0
        state = client.state()
        assert state.get("step_count") == len(held_out.reference)
        assert state.get("world") == local.state()


# --- an OpenEnv-native MCP env, driven by our adapter ----------------------------------------


def test_adapter_drives_a_native_mcp_env(servers):
    from openenv_native import target_of

    _, native = servers
    env = adapter(native.url, seeds=10)
    assert {t.seed for s in ("train", "validation", "test") for t in env.tasks(s)} == \
        set(range(10))
    assert all(world_split(t.seed) == "test" for t in env.tasks("test"))
    task = env.tasks("train")[1]  # seed 1: target 3
    env.reset(task)
    assert [(t.name, [(a.name, a.type, a.required, a.choices, a.bounds) for a in t.args])
            for t in env.tools()] == [("add", [("n", "int", True, (), (1, 3))]),
                                      ("show", []),
                                      ("paint", [("colour", "str", True, ("red", "blue"),
                                                  None)]),
                                      ("zero_out", []), ("nap", [])]
    assert env.candidate_actions() == ["show", "paint red", "paint blue", "zero_out", "nap"]
    assert env.step("add 3")[0] == "counter 3" and env.step("zero_out")[0] == "counter 0"
    assert env.step("show") == (f"counter 0 target {target_of(1)}", False,
                                {"valid": True, "tool": "show", "error": None})
    assert env.step("add 2")[:2] == ("counter 2", False)
    assert env.evaluate(task) == 0.0
    refused = env.step("add 9")  # the parser takes it; the server's schema refuses it
    assert refused[2] == {"valid": True, "tool": "add", "error": "execution_error"}
    assert env.step("undo")[2]["valid"] is False  # not a tool the server listed
    assert env.step("add 1") == ("counter 3", True, {"valid": True, "tool": "add",
                                                    "error": None})
    assert env.evaluate(task) == 1.0
    assert env.evaluate(task.__class__(**{**task.__dict__, "goal": {}})) == 0.0
    assert env.server_state()["value"] == 3
    env.reset(task)  # the same session, a new episode
    assert env.evaluate(task) == 0.0 and not env.done
    env.close()
    total = adapter(native.url, reward="sum")  # every step's reward counts, not the last only
    total.reset(task)
    assert [total.step(a)[1] for a in ("add 3", "add 1")] == [True, False]
    assert total.evaluate(task) == 1.0  # with reward=last: 0.0, the last step's
    total.close()


def test_a_server_at_capacity_is_refused_with_a_hint(servers):
    _, native = servers  # at most 8 sessions
    envs = [adapter(native.url) for _ in range(9)]
    try:
        for env in envs[:8]:
            env.reset(env.tasks("train")[0])
        with pytest.raises(EnvFailed, match="CAPACITY_REACHED.*max_concurrent_envs") as full:
            envs[8].reset(envs[8].tasks("train")[0])
        assert full.value.reason == "refused"
    finally:
        for env in envs:
            env.close()


# --- what an env without state() says ----------------------------------------------------------


def test_no_state_is_one_clear_line(servers, tmp_path):
    _, native = servers
    env = adapter(native.url)
    env.reset(env.tasks("train")[0])
    with pytest.raises(NotImplementedError, match="no state\\(\\) snapshot"):
        env.state()
    with pytest.raises(NotImplementedError, match="tasks.synthetic_share=0"):
        env.goal_from_states({}, {})
    env.close()
    # autodidact explore stops with that line, not a traceback
    from autodidact.cli import main

    for extra in ([], ["--profile-only"]):
        result = CliRunner().invoke(main, [
            "explore", "--run-dir", str(tmp_path / "run"), "--set", "env.name=openenv",
            "--set", f"env.options.url={native.url}", "--set", "explore.proposer=schema",
            *extra])
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert lines[-1].startswith("Error: openenv: an OpenEnv server offers no state()"), \
            lines
        assert "Traceback" not in result.output


# --- config, serve flag, failures --------------------------------------------------------------


def test_config_names_the_adapter_and_checks_its_options():
    assert env_class("openenv").name == "openenv"
    # a service env: not among the envs a check of every env makes with their defaults
    assert "openenv" not in env_names()
    check_env_options(EnvConfig(name="openenv", options={"url": "http://h:1", "seeds": 3}))
    with pytest.raises(ConfigError, match="env.options.seeds"):
        check_env_options(EnvConfig(name="openenv", options={"seeds": "many"}))
    with pytest.raises(ConfigError, match="env.options.address"):
        check_env_options(EnvConfig(name="openenv", options={"address": "http://h:1"}))
    with pytest.raises(ValueError, match="env.options.url"):
        adapter("tcp://127.0.0.1:1")


def test_no_server_is_env_failed(servers):
    env = adapter(f"http://127.0.0.1:{free_tcp_port()}", timeout_s=2)
    with pytest.raises(EnvFailed) as failed:
        env.reset(env.tasks("train")[0])
    assert failed.value.reason == "no_worker" and "env.options.url" in str(failed.value)
    ours, _ = servers  # something answers HTTP there, but not a WebSocket
    env = adapter(ours.url + "/health")
    with pytest.raises(EnvFailed) as failed:
        env.reset(env.tasks("train")[0])
    assert failed.value.reason == "no_worker"


def test_a_call_past_the_deadline_is_env_failed(servers):
    _, native = servers
    # nap takes 3 s; 1 s leaves a loaded machine room for the reconnect and reset after it
    env = adapter(native.url, timeout_s=1.0)
    task = env.tasks("train")[0]
    env.reset(task)
    with pytest.raises(EnvFailed) as late:
        env.step("nap")
    assert late.value.reason == "timeout" and "env.options.timeout_s" in str(late.value)
    env.reset(task)  # the late session was closed (its reply dropped); a new one works
    assert env.step("show")[0].startswith("counter 0")
    env.close()


def test_replies_that_do_not_fit_name_the_field():
    from environments.openenv_adapter import (
        OpenEnvSession,
        _field,
        _is_reward,
        tool_from_schema,
    )

    session = OpenEnvSession("http://127.0.0.1:1", 1.0)
    for raw, field in [("not json", "not JSON"), ("[1]", "field data"),
                       (json.dumps({"type": "observation"}), "field data")]:
        with pytest.raises(EnvFailed, match=field) as failed:
            session._data("step", raw)
        assert failed.value.reason == "bad_reply"
    with pytest.raises(EnvFailed, match="CAPACITY_REACHED.*max_concurrent_envs") as failed:
        session._data("reset", json.dumps({"type": "error", "data": {
            "code": "CAPACITY_REACHED", "message": "full"}}))
    assert failed.value.reason == "refused"
    for reward in ("high", float("nan")):
        with pytest.raises(EnvFailed, match="field reward"):
            _field({"reward": reward}, "reward", _is_reward, "a number", "step")
    with pytest.raises(ValueError, match=r"inputSchema.properties.x.type"):
        tool_from_schema({"name": "t", "inputSchema": {"properties": {"x": {"type": "when"}}}})
    with pytest.raises(ValueError, match="tools\\[\\].name"):
        tool_from_schema({"description": "no name"})
    with pytest.raises(ValueError, match=r"properties.x.type: None"):  # two types: which?
        tool_from_schema({"name": "t", "inputSchema": {"properties": {
            "x": {"type": ["integer", "string"]}}}})
    opt = tool_from_schema({"name": "get-it", "inputSchema": {"properties": {
        "a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "b": {"type": "string"},
        "c": {"type": ["number", "null"], "minimum": 0, "maximum": 1.5}},
        "required": ["b"]}})
    assert opt.name == "get_it"
    assert [(a.name, a.type, a.required, a.bounds) for a in opt.args] == [
        ("b", "str", True, None), ("a", "int", False, None), ("c", "float", False, (0, 1.5))]


def test_default_import_leaves_openenv_out():
    """openenv-core and its web stack load only when an OpenEnv path runs."""
    code = ("import sys, environments, autodidact.cli, autodidact.env_serve\n"
            "environments.env_class('openenv')\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'openenv', 'websockets', "
            "'uvicorn', 'fastapi', 'gradio', 'fastmcp'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("argv, says", [
    (["--address", "tcp://127.0.0.1:5"], "http://HOST:PORT"),
    (["--address", "http://127.0.0.1:5", "--keys-dir", "k"], "--keys-dir does not apply"),
    (["--address", "http://10.1.2.3:5"], "--allow-plaintext-remote"),
    (["--address", "http://127.0.0.1:5", "--workers", "4"], "--workers does not apply"),
])
def test_serve_flag_refuses_in_one_line(argv, says):
    from autodidact.cli import main

    result = CliRunner().invoke(main, ["env", "serve", "files", "--openenv", *argv])
    assert result.exit_code == 2 and says in result.output, result.output


def test_eval_takes_the_context_the_server_s_tools_need(servers, files_policy_path, tmp_path):
    """The adapter declares the max_context its server's tool schemas need once it has them;
    ``autodidact eval --env openenv`` (no config file, ``--set env.options.url``) takes it, and
    a ``--set env.max_context`` too short for one call is refused at start in one line."""
    from environments.openenv_adapter import OpenEnvEnv, schema_tool

    _, native = servers
    env = adapter(native.url)
    assert OpenEnvEnv.default_limits == {}  # the class cannot know: its instances learn it
    tools = env.tools()
    chars = len(json.dumps([schema_tool(t) for t in tools]))
    declared = env.default_limits["max_context"]
    assert declared % 256 == 0 and declared >= chars // 3 + 4 * 2 * env.max_obs_words
    env.close()
    common = ["eval", "--env", "openenv", "--set", f"env.options.url={native.url}", "--model",
              files_policy_path, "-k", "1", "--limit", "1", "--set", "env.max_turns=2"]
    result = CliRunner().invoke(main_cli(), [*common, "--run-dir", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    summary = json.loads(next((tmp_path / "a" / "eval").glob("*.summary.json")).read_text())
    assert summary["env_settings"]["max_context"] == declared
    result = CliRunner().invoke(main_cli(), [*common, "--run-dir", str(tmp_path / "b"),
                                             "--set", "env.max_context=17"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: env.max_context=17 is too short for an episode of openenv "
                           "past its first call: its opening prompt takes ") \
        and f"(the env declares {declared}); set env.max_context to at least {declared}" in last


def main_cli():
    from autodidact.cli import main

    return main


def test_adapter_sessions_end_cleanly(servers):
    """Last: every adapter session above, closed or refused, left the native server's log
    clean (openenv-core 0.3.0 logs a traceback for a session whose client closes the socket
    before the server; only our adapter talks to that server: openenv-core's own client,
    used on ours, races it so)."""
    _, native = servers
    assert "Traceback" not in native.log.read_text(), native.log.read_text()[-3000:]
