"""The config is resolved once (file, --set, flags, start defaults) into a checked object that
nothing assigns to afterwards: values learned later make a new checked config."""

from __future__ import annotations

import ast
import contextlib
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from autodidact.resolve import (
    Flags,
    learner_threads,
    resolve_config,
    resolve_run,
    with_model,
    with_redis_url,
)
from protocol.config import (
    RunConfig,
    load_config,
    redact_url,
    redacted_config,
    to_dict,
    url_password,
    with_values,
)
from protocol.control import default_prefix
from protocol.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


# --- resolution ------------------------------------------------------------------------------


def test_flags_override_set_which_overrides_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: r\nredis: {url: 'redis://file'}\nactor: {device: cpu}\n")
    cfg = resolve_config(path, ["redis.url=redis://set", "replay.address=tcp://set:1"],
                         Flags(redis_url="redis://flag", weights_addr="tcp://w:2",
                               device="cuda:1"))
    assert cfg.redis.url == "redis://flag"
    assert cfg.replay.address == "tcp://set:1"  # no flag: --set stays
    assert (cfg.weights.address, cfg.actor.device) == ("tcp://w:2", "cuda:1")
    assert cfg.redis.prefix == ""  # only commands that talk to Redis fill it in


def test_start_defaults_fill_only_what_the_config_leaves_empty(tmp_path):
    cfg, run_dir = resolve_run(None, ["name=r7"], None,
                               Flags(redis_prefix=True, local_services=True))
    assert run_dir == (Path("runs") / "r7").resolve() and not run_dir.exists()
    assert cfg.redis.prefix == default_prefix("r7")
    assert cfg.replay.address.startswith("ipc://") or cfg.replay.address.startswith("tcp://")
    cfg, run_dir = resolve_run(None, ["redis.prefix=p", "replay.address=tcp://127.0.0.1:9"],
                               tmp_path, Flags(redis_prefix=True, local_services=True))
    assert (cfg.redis.prefix, cfg.replay.address) == ("p", "tcp://127.0.0.1:9")
    assert run_dir == tmp_path.resolve()


def test_env_switch_resets_options_and_takes_the_envs_limits_without_a_file():
    sets = ["env.options={num_worlds: 3}"]
    same = resolve_config(None, sets, Flags(env="files"))
    assert same.env.options == {"num_worlds": 3}  # the config's own env: options kept
    other = resolve_config(None, [], Flags(env="bfcl"))
    assert (other.env.name, other.env.options) == ("bfcl", {})
    assert other.env.max_context == RunConfig().env.max_context  # limits only when asked
    # --env applies first, the --set beside it after: its options are the new env's to take
    # (tests/test_context_check.py has the options a file gave, which --env does reset)
    with pytest.raises(ConfigError, match="env.options.num_worlds: unknown option of "
                                          "environment 'bfcl'"):
        resolve_config(None, sets, Flags(env="bfcl"))
    own = resolve_config(None, [], Flags(env="bfcl", env_limits=True))
    assert (own.env.max_turns, own.env.max_context, own.actor.max_action_tokens) == \
        (64, 16384, 256)
    # ... but a limit the command sets itself is the command's
    mine = resolve_config(None, ["actor.max_action_tokens=128", "env.max_turns=8"],
                          Flags(env="bfcl", env_limits=True))
    assert (mine.env.max_turns, mine.env.max_context, mine.actor.max_action_tokens) == \
        (8, 16384, 128)
    with pytest.raises(ConfigError, match="nope"):
        resolve_config(None, [], Flags(env="nope"))


def test_the_configured_envs_limits_apply_without_a_file_and_without_env():
    """``explore --set env.name=shop`` (no -c, no --env) explores with shop's own limits."""
    shop = resolve_config(None, ["env.name=shop"], Flags(env_limits=True))
    assert (shop.env.max_turns, shop.env.max_context, shop.actor.max_action_tokens) == (6, 512, 8)
    mine = resolve_config(None, ["env.name=shop", "env.max_turns=12"], Flags(env_limits=True))
    assert (mine.env.max_turns, mine.env.max_context) == (12, 512)
    files = resolve_config(None, [], Flags(env_limits=True))  # files declares none
    assert files.env.max_turns == RunConfig().env.max_turns
    with pytest.raises(ConfigError, match="env.name: .*nope"):
        resolve_config(None, ["env.name=nope"], Flags(env_limits=True))


def test_explore_without_a_file_takes_the_envs_limits(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from autodidact.cli import main
    from questioning import factory

    seen = {}

    def profile_only(cfg, run_dir):
        seen.update(turns=cfg.env.max_turns, tokens=cfg.actor.max_action_tokens)
        raise ValueError("stop here")

    monkeypatch.setattr(factory, "profile_only", profile_only)
    result = CliRunner().invoke(main, ["explore", "--profile-only", "--run-dir", str(tmp_path),
                                       "--set", "env.name=shop"])
    assert "stop here" in result.output and seen == {"turns": 6, "tokens": 8}


def test_proposer_flags_need_a_model_and_gpu_actors_use_cuda():
    with pytest.raises(ConfigError, match="--proposer-model"):
        resolve_config(None, [], Flags(llm_url="http://h/v1"))
    cfg = resolve_config(None, ["llm.model=m"], Flags(llm_url="http://h/v1"))
    assert (cfg.llm.url, cfg.llm.model) == ("http://h/v1", "m")
    assert resolve_config(None, [], Flags(gpu_actors=True)).actor.device == "cuda"
    assert resolve_config(None, ["actor.backend=vllm"],
                          Flags(gpu_actors=True)).actor.device == "cpu"


# --- later values make a new config ----------------------------------------------------------


def test_with_values_makes_a_new_checked_config_and_leaves_the_old_one():
    cfg = load_config(None, [])
    before = to_dict(cfg)
    new = with_redis_url(cfg, "unix://:pw@/tmp/r.sock")
    newer = with_model(new, "/models/m")
    assert to_dict(cfg) == before
    assert (new.redis.url, new.model.path) == ("unix://:pw@/tmp/r.sock", "")
    assert (newer.redis.url, newer.model.path) == ("unix://:pw@/tmp/r.sock", "/models/m")
    assert with_values(cfg, {"eval.k": 2, "seed": 3}).seed == 3
    assert isinstance(with_values(cfg, {"eval.temperature": 1}).eval.temperature, float)
    with pytest.raises(ConfigError, match="replay.max_groups"):
        with_values(cfg, {"replay.max_groups": 0})
    with pytest.raises(ConfigError, match="unknown key replay.nope"):
        with_values(cfg, {"replay.nope": 1})
    with pytest.raises(ConfigError, match="expected int"):
        with_values(cfg, {"eval.k": "two"})
    assert to_dict(cfg) == before


def test_the_launcher_connects_redis_through_a_new_config(tmp_path):
    """The embedded Redis URL is learned after the check: start_control_plane returns a new
    config naming it, and the one it was given is left as it was."""
    from autodidact.launcher import start_control_plane

    cfg, run_dir = resolve_run(None, ["name=mut"], tmp_path,
                               Flags(redis_prefix=True, local_services=True))
    before = to_dict(cfg)
    with contextlib.ExitStack() as stack:
        new, coordinator = start_control_plane(stack, cfg, run_dir)
        assert coordinator.control.state()["phase"] == "starting"
        assert new.redis.url.startswith("unix://") and new.redis.url != cfg.redis.url
    assert to_dict(cfg) == before and cfg.redis.url == ""


def test_the_control_plane_releases_its_redis_clients_on_exit(tmp_path):
    """On a Redis it did not start, the run leaves no client connected once its stack closes:
    both the coordinator's plane and its fail-fast reporting client are released."""
    import redis

    from autodidact.embedded_redis import EmbeddedRedis
    from autodidact.launcher import start_control_plane

    cfg, run_dir = resolve_run(None, ["name=clients"], tmp_path,
                               Flags(redis_prefix=True, local_services=True))
    (tmp_path / "server").mkdir()
    with EmbeddedRedis(tmp_path / "server") as url, redis.Redis.from_url(url) as probe:
        cfg = with_redis_url(cfg, url)
        with contextlib.ExitStack() as stack:
            _, coordinator = start_control_plane(stack, cfg, run_dir)
            coordinator.glance.r.ping()  # the reporting client connects on its first call
            assert len(probe.client_list()) == 3  # control, glance and the probe
        # The server notices a closed socket on its next event-loop pass
        deadline = time.monotonic() + 5
        while len(probe.client_list()) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(probe.client_list()) == 1


# --- nothing in the application assigns to a config -----------------------------------------


CONFIG_NAMES = {"cfg", "config", "run_cfg", "judge_cfg"}


def config_assignments(source: str) -> list[int]:
    """Lines assigning to an attribute of a config object (``cfg.x.y = ...``,
    ``self.cfg.x = ...``, ``setattr(cfg.x, ...)``)."""
    def from_config(node) -> bool:
        while isinstance(node, ast.Attribute):
            if node.attr in CONFIG_NAMES and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                return True
            node = node.value
        return isinstance(node, ast.Name) and node.id in CONFIG_NAMES

    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and node.args and from_config(node.args[0]):
            lines.append(node.lineno)
        flat = []
        for t in targets:
            flat += t.elts if isinstance(t, ast.Tuple) else [t]
        lines += [node.lineno for t in flat
                  if isinstance(t, ast.Attribute) and from_config(t.value)]
    return sorted(set(lines))


@pytest.mark.parametrize("source, hits", [
    ("cfg.redis.url = u\n", 1),
    ("self.cfg.actor.device = 'cuda'\n", 1),
    ("cfg.env.name, cfg.env.options = n, {}\n", 1),
    ("setattr(cfg.env, k, v)\n", 1),
    ("cfg = with_model(cfg, p)\nx.cfg = cfg\nsettings.max_context = 3\n", 0),
])
def test_the_assignment_check_can_fail(source, hits):
    assert len(config_assignments(source)) == hits


def test_no_application_module_assigns_to_a_config():
    found = {str(p.relative_to(ROOT)): config_assignments(p.read_text())
             for p in sorted((ROOT / "autodidact").glob("*.py"))}
    assert {f: lines for f, lines in found.items() if lines} == {}


def test_commands_resolve_without_touching_the_checked_config(tmp_path, monkeypatch):
    """`autodidact eval` with --env and --device: the values arrive in the resolved config
    (checked once), not assigned afterwards."""
    import autodidact.eval_cli as eval_cli

    seen = []

    def fake_run_eval(cfg, run_dir, *args, **kwargs):
        seen.append(to_dict(cfg))
        return {"k": 1, "categories": {}, "tasks": 0, "avg": 0.0, "best": 0.0}

    monkeypatch.setattr(eval_cli, "run_eval", fake_run_eval)
    from autodidact.cli import main

    result = CliRunner().invoke(main, ["eval", "--env", "files", "--device", "cuda:3",
                                       "--run-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen[0]["actor"]["device"] == "cuda:3" and seen[0]["env"]["name"] == "files"


# --- what may be shown -----------------------------------------------------------------------


def test_one_redaction_for_configs_and_their_dicts():
    cfg = with_redis_url(RunConfig(), "redis://:s3cretpw@10.0.0.1:6379/0")
    shown = redacted_config(cfg)
    assert shown["redis"]["url"] == "redis://:***@10.0.0.1:6379/0"
    assert "s3cretpw" not in str(shown) and cfg.redis.url.endswith("@10.0.0.1:6379/0")
    read_back = to_dict(cfg)
    assert redacted_config(read_back) == shown and "s3cretpw" in str(read_back)  # a copy
    assert url_password(cfg.redis.url) == "s3cretpw" and url_password("redis://h:1") == ""
    assert redact_url("unix://:pw@/r/redis.sock") == "unix://:***@/r/redis.sock"
    assert redacted_config({"name": "x"}) == {"name": "x"}


def test_max_updates_zero_is_a_run_without_rl_updates_not_the_configs_default(tmp_path):
    """``autodidact run --max-updates 0``: warm-start and its evaluations, no update (0 was
    read as "not given" and the run trained learner.max_updates)."""
    from autodidact.resolve import learner_settings
    from autodidact.roles import training_roles

    cfg = resolve_config(None, ["learner.max_updates=30"])
    assert learner_settings(cfg, 0).max_updates == 0
    assert learner_settings(cfg).max_updates == 30
    [learner] = [r for r in training_roles(cfg, tmp_path, tmp_path / "c.yaml", 0)
                 if r.name == "learner"]
    argv = list(learner.argv)
    assert argv[argv.index("--max-updates") + 1] == "0"
    [default] = [r for r in training_roles(cfg, tmp_path, tmp_path / "c.yaml")
                 if r.name == "learner"]
    assert "--max-updates" not in default.argv


@pytest.mark.parametrize("sets, gpu, cores, threads", [
    ([], False, 2, 1),  # the default run: 2 actors on 1 thread each leave none free: 1
    (["actor.num_actors=1"], False, 2, 1),  # SmolLM2's layout: one core each
    (["actor.num_actors=1"], False, 8, 7),
    (["actor.num_actors=2", "actor.torch_threads=2"], False, 8, 4),
    (["learner.max_staleness=0"], False, 8, 8),  # synchronous: the roles take turns
    (["actor.device=cuda"], True, 8, 8),  # actors computing on a GPU take no core here
    (["actor.backend=vllm", "actor.num_actors=1"], True, 8, 8),
    (["actor.backend=vllm", "actor.num_actors=1"], False, 8, 7),  # vLLM on the CPU
    (["learner.torch_threads=3"], False, 8, 3),  # a number is kept
])
def test_auto_learner_threads_take_the_cores_the_actors_leave(sets, gpu, cores, threads):
    assert learner_threads(resolve_config(None, sets), gpu, cores) == threads


@pytest.mark.parametrize("value", ["0", "many", "1.5", "true"])
def test_learner_threads_are_a_positive_number_or_auto(value):
    with pytest.raises(ConfigError, match="torch_threads"):
        resolve_config(None, [f"learner.torch_threads={value}"])
