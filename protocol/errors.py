"""Errors that cross role boundaries, each with a short machine-readable reason.

Servers count rejections by ``reason`` (``replay/rejected/<reason>``), so reasons are a closed
vocabulary: add one here rather than inventing strings at call sites.
"""

from __future__ import annotations

import sys

# Why a frame was refused. Stable strings: they appear in metrics, logs and error replies.
REJECT_REASONS = (
    "oversize",  # frame longer than the configured maximum
    "not_msgpack",  # bytes that do not decode as msgpack
    "bad_envelope",  # msgpack, but not [magic, version, type, id, body]
    "future_version",  # schema version newer than this build understands
    "old_version",  # schema version older than the oldest this build accepts
    "unknown_type",  # type tag not in the registry
    "unexpected_type",  # a known type the receiving endpoint does not serve
    "missing_field",  # a required field is absent
    "unknown_field",  # a field this schema version does not define
    "wrong_type",  # a field of the wrong Python/msgpack type
    "wrong_dtype",  # an array with a dtype other than the schema's
    "bad_array",  # array bytes that do not match dtype and shape
    "invalid",  # well-typed but inconsistent (e.g. masks of different lengths)
    "store_full",  # the replay store cannot take more data (map full)
    "disk_full",  # the replay store's file system is full: nothing stored, send again later
    "unauthorized",  # a learner-only request without the run's learner token
    "auth",  # a CURVE handshake refused (unknown client key, plaintext client): no frame read
)


# A role's exit code for a state no restart can change (a damaged checkpoint, a lock another
# process holds): the supervisor gives up on the role at once instead of restarting it.
EXIT_UNRECOVERABLE = 78  # EX_CONFIG in sysexits.h


def exit_unrecoverable(message: str):
    """Print ``message`` (one line naming the file and what to do) and exit with
    :data:`EXIT_UNRECOVERABLE`."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_UNRECOVERABLE)


class AutodidactError(Exception):
    """Base class for errors this package raises on purpose."""


class SchemaError(AutodidactError):
    """A frame or message that does not match the schema.

    ``reason`` is one of REJECT_REASONS; ``path`` names the offending field (``a.b[3].c``).
    """

    def __init__(self, reason: str, detail: str = "", path: str = ""):
        assert reason in REJECT_REASONS, reason
        self.reason = reason
        self.detail = detail
        self.path = path
        where = f" at {path}" if path else ""
        super().__init__(f"{reason}{where}: {detail}" if detail else f"{reason}{where}")


class TransportTimeout(AutodidactError):
    """A request was not answered within its deadline (after retries)."""


class ReplayDiskFull(TransportTimeout):
    """Replay answered ``disk_full``: nothing was stored. A TransportTimeout, so every caller
    that waits out an absent server waits out a full disk the same way (the client has
    already backed off before raising it)."""


class RemoteError(AutodidactError):
    """The peer answered with an Error reply."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"remote refused: {reason}: {detail}")


class ConfigError(AutodidactError):
    """A config file or override that names an unknown key or an impossible value."""


class EnvFailed(AutodidactError):
    """A served env's call failed for a reason of the service, not of the env: ``reason`` is
    ``timeout`` (no answer within ``env.call_timeout_s``), ``refused`` (the server refused the
    frame: a client and server of different builds) or one of
    ``protocol.env_wire.FAILURE_REASONS`` (``worker_died``, ``bad_reply``, ...); ``stderr``
    holds the worker's last output lines where the server sent them. The env instance is
    unusable afterwards: make a fresh one."""

    def __init__(self, reason: str, detail: str = "", stderr: list[str] | tuple = ()):
        self.reason = reason
        self.detail = detail
        self.stderr = list(stderr)
        tail = "".join(f"\n  | {line}" for line in self.stderr)
        super().__init__(f"env call failed ({reason}): {detail}{tail}")
