"""The command line: every command documents itself; stats prints one JSON object."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from autodidact.cli import main
from protocol.config import RunConfig, load_config

COMMANDS = ["run", "config", "replay", "actor", "learner", "judge", "explore", "eval", "tasks",
            "keys", "node", "status", "report"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output
    assert len(result.output.splitlines()) > 3


def test_config_prints_resolved_yaml(tmp_path):
    result = CliRunner().invoke(main, ["config", "--set", "replay.max_groups=7"])
    assert result.exit_code == 0
    path = tmp_path / "c.yaml"
    path.write_text(result.output)
    assert load_config(path).replay.max_groups == 7
    assert load_config(path).learner == RunConfig().learner


def test_bad_override_is_a_usage_error():
    result = CliRunner().invoke(main, ["config", "--set", "replay.nope=1"])
    assert result.exit_code == 2 and "replay.nope" in result.output


def test_role_alone_needs_addresses(tmp_path):
    result = CliRunner().invoke(main, ["actor", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--redis-url" in result.output


def test_replay_stats_on_missing_store(tmp_path):
    result = CliRunner().invoke(main, ["replay", "stats", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "no replay store" in result.output


def test_replay_stats_prints_one_json_object(tmp_path):
    from protocol.replay_client import ReplayClient
    from tests.helpers_replay import ServerProc, make_group, push_all

    with ServerProc(tmp_path) as server:
        client = ReplayClient(server.address)
        statuses = push_all(client, [make_group(i, versions=(i, i)) for i in range(3)])
        client.close()
    assert set(statuses.values()) == {"stored"}
    out = subprocess.run([sys.executable, "-m", "autodidact.cli", "replay", "stats",
                          "--run-dir", str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout
    stats = json.loads(out)
    assert stats["groups"] == 3 and stats["oldest_version"] == 0 and stats["newest_version"] == 2
