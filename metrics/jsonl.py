"""One metrics interface for every role: append-only JSONL in the run directory.

Each record is one line ``{"t": unix time, "role": ..., "id": ..., "step": ..., "<role>/<name>":
value, ...}`` written with a single ``write`` on an O_APPEND file, so processes can share
``<run dir>/metrics.jsonl`` without interleaving. The launcher mirrors the file into wandb
(offline by default) so that only one process pays for wandb.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from protocol.run_dir import RunDir


class MetricsWriter:
    def __init__(self, run_dir: Path, role: str, member: str = ""):
        self.path = RunDir(run_dir).metrics
        self.role = role
        self.member = member or role
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, values: dict, step: int | None = None) -> dict:
        """Record ``values``; bare names are namespaced as ``<role>/<name>``."""
        record = {"t": time.time(), "role": self.role, "id": self.member}
        if step is not None:
            record["step"] = step
        for key, value in values.items():
            name = key if "/" in key else f"{self.role}/{key}"
            record[name] = _finite_or_none(value)
        os.write(self._fd, (json.dumps(record) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None marks it visibly
    return value


def read_metrics(run_dir: Path, role: str | None = None) -> list[dict]:
    path = RunDir(run_dir).metrics
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write
        if role is None or rec.get("role") == role:
            out.append(rec)
    return out


class MetricsTail:
    """Reads the records appended to metrics.jsonl since the last call (a line still being
    written waits for the next call), so long runs never re-read the whole file."""

    def __init__(self, run_dir: Path):
        self.path = RunDir(run_dir).metrics
        self.offset = 0

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
        return out


class RateMeter:
    """Counts events and reports a rate per second since the last report."""

    def __init__(self):
        self.count = 0
        self._last = time.monotonic()

    def add(self, n: int = 1) -> None:
        self.count += n

    def rate(self) -> float:
        now = time.monotonic()
        rate = self.count / max(now - self._last, 1e-9)
        self.count, self._last = 0, now
        return rate
