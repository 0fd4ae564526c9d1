"""What a run or an evaluation checks at start about its context, and how ``--env`` and
``--set`` combine (autodidact/resolve.py), on the files env and its tiny policy, no mocks:

* ``env.max_context`` too short for one episode's opening prompt, a call, its observation and
  the next call is refused at start in one line with the numbers and the setting to change:
  by ``autodidact eval`` and by a run's stages (before any of them runs); one token more
  passes;
* ``--env`` switches env first and keeps every ``--set`` beside it (``eval`` and
  ``explore`` resolve through the same path).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from autodidact.cli import main
from autodidact.resolve import Flags, check_context, context_need, resolve_config, resolve_run
from environments import FilesEnv
from protocol.config import with_values
from protocol.errors import ConfigError
from protocol.transport import free_tcp_port

LINE = re.compile(r"env\.max_context=(\d+) is too short for an episode of files past its first "
                  r"call: its opening prompt takes (\d+) tokens, a call up to (\d+) "
                  r"\(actor\.max_action_tokens\), its observation about (\d+) and the next call "
                  r"(\d+): (\d+) in all; set env\.max_context to at least (\d+) "
                  r"\(--set env\.max_context=(\d+)\)$")


@pytest.fixture(scope="module")
def files_cfg(files_policy_path):
    return resolve_config(None, ["env.name=files", f"model.path={files_policy_path}"])


def test_a_context_too_short_is_refused_with_the_numbers(files_cfg, files_policy_path):
    task = FilesEnv().tasks("train")[0]
    need = context_need(files_cfg, files_policy_path, task)
    assert need.prompt > 0 and need.observation > 0 and need.declared == 0
    assert need.call == files_cfg.actor.max_action_tokens
    assert need.total == need.prompt + need.call + need.observation + need.call
    short = with_values(files_cfg, {"env.max_context": need.total - 1})
    with pytest.raises(ConfigError) as refused:
        check_context(short, files_policy_path, task)
    line = str(refused.value)
    numbers = [int(n) for n in LINE.fullmatch(line).groups()]
    assert numbers == [need.total - 1, need.prompt, need.call, need.observation, need.call,
                       need.total, need.total, need.total]
    enough = with_values(files_cfg, {"env.max_context": need.total})
    assert check_context(enough, files_policy_path, task) is enough
    with pytest.raises(ConfigError, match=r"holds 40 positions, too few .*longer context$"):
        check_context(enough, files_policy_path, task, positions=40)


def test_eval_refuses_a_short_context_in_one_line(files_cfg, files_policy_path, tmp_path):
    task = FilesEnv().tasks("validation")[0]
    total = context_need(files_cfg, files_policy_path, task).total
    result = CliRunner().invoke(main, [
        "eval", "--env", "files", "--model", files_policy_path, "--run-dir", str(tmp_path),
        "-k", "1", "--limit", "1", "--set", f"env.max_context={total - 1}"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and LINE.fullmatch(last[len("Error: "):]), last
    assert "Traceback" not in result.output
    assert not (tmp_path / "eval").exists()  # refused before any episode


def test_a_run_is_refused_before_its_stages(files_cfg, files_policy_path, tmp_path):
    from autodidact.stages import StartRefused, up_to_training

    task = FilesEnv().tasks("train")[0]
    total = context_need(files_cfg, files_policy_path, task).total
    cfg = with_values(files_cfg, {"env.max_context": total - 1})
    with pytest.raises(StartRefused) as refused:  # the launcher prints it and exits 1
        up_to_training(cfg, tmp_path, None, {}, resume=False)  # no control plane: never asked
    assert LINE.fullmatch(str(refused.value)), refused.value
    assert not (tmp_path / "summary.json").exists()


# --- --env with --set ---------------------------------------------------------------------------


def test_env_flag_keeps_every_set_beside_it(tmp_path):
    url = "http://127.0.0.1:1"
    cfg = resolve_config(None, [f"env.options.url={url}", "env.options.seeds=3",
                                "env.max_turns=7"], Flags(env="openenv", env_limits=True))
    assert (cfg.env.name, cfg.env.options, cfg.env.max_turns) == \
        ("openenv", {"url": url, "seeds": 3}, 7)
    # a file's other env: its options go, the --set ones stay (explore resolves the same way)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"env": {"name": "files", "options": {"num_worlds": 5}}}))
    cfg, _ = resolve_run(path, [f"env.options.url={url}"], tmp_path / "run",
                         Flags(env="openenv", redis_prefix=True))
    assert cfg.env.options == {"url": url}
    cfg = resolve_config(path, [f"env.options={{url: '{url}', seeds: 2}}"], Flags(env="openenv"))
    assert cfg.env.options == {"url": url, "seeds": 2}
    cfg = resolve_config(path, [], Flags(env="openenv"))  # nothing set: the options reset
    assert cfg.env.options == {}
    cfg = resolve_config(path, ["env.options.num_worlds=9"], Flags(env="files"))  # same env
    assert cfg.env.options == {"num_worlds": 9}


def test_eval_with_env_openenv_keeps_the_url(files_policy_path, tmp_path):
    """The issue's command: before, ``--env`` dropped the url and the env refused ''."""
    pytest.importorskip("websockets")
    url = f"http://127.0.0.1:{free_tcp_port()}"  # nothing there: every episode fails
    result = CliRunner().invoke(main, [
        "eval", "--env", "openenv", "--set", f"env.options.url={url}", "--set",
        "env.options.timeout_s=2", "--model", files_policy_path, "--run-dir", str(tmp_path),
        "-k", "1", "--limit", "1"])
    assert "env.options.url must be" not in result.output, result.output
    assert result.exit_code == 0, result.output
    summary = json.loads(next((tmp_path / "eval").glob("*.summary.json")).read_text())
    assert summary["env_settings"]["options"]["url"] == url
    [record] = [json.loads(line) for line in next((tmp_path / "eval").glob("*.jsonl"))
                .read_text().splitlines()]
    assert record["env_failed"] == 1
