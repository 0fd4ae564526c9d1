"""A run's configuration, resolved once: the YAML file and overrides, checked as a whole.

``protocol.config`` checks what a config can check on its own (types, ranges, cross-field
rules); the environment's options can only be checked against the environment registry, which
lives above the protocol, so this is where the two meet. Every command loads its config here.
"""

from __future__ import annotations

from pathlib import Path

from environments import check_env_options
from protocol.config import RunConfig, load_config


def resolve_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The checked config for ``path`` plus ``section.key=value`` overrides; raises
    :class:`~protocol.errors.ConfigError` naming the first bad key."""
    cfg = load_config(path, list(overrides))
    check_env_options(cfg.env)
    return cfg
