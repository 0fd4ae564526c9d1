"""Config files: every one shipped parses; bad keys, types and values are refused by name."""

from pathlib import Path

import pytest

from protocol.config import RunConfig, load_config
from protocol.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(ROOT.glob("configs/**/*.yaml"))


def test_there_are_shipped_configs():
    assert SHIPPED, "configs/ holds no YAML"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), RunConfig)


def test_default_yaml_matches_embedded_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == RunConfig()


def test_overrides_apply_with_types():
    cfg = load_config(overrides=["replay.max_groups=12", "redis.heartbeat_ttl_s=3", "name=x"])
    assert (cfg.replay.max_groups, cfg.redis.heartbeat_ttl_s, cfg.name) == (12, 3.0, "x")


@pytest.mark.parametrize("override, names", [
    ("replay.bogus=1", "replay.bogus"),
    ("bogus.key=1", "bogus"),
    ("replay.max_groups=many", "replay.max_groups"),
    ("replay.max_groups=true", "replay.max_groups"),
    ("replay.map_size=-5", "replay.map_size"),
    ("replay.judge_lease_s=0", "replay.judge_lease_s"),
    ("redis=3", "redis"),
    ("novalue", "key=value"),
])
def test_bad_config_is_refused_naming_the_key(override, names):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert names in str(info.value)


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replay:\n  max_grups: 3\n")
    with pytest.raises(ConfigError, match="replay.max_grups"):
        load_config(path)
