"""The token log: the learner's log-prob of every token of the newest groups it trained.

A run viewer colours a rollout's tokens by the learner/sampler ratio where the learner has
seen them; the sampler's log-probs travel with the trajectory, the learner's are kept here,
one file per group (``<run dir>/learner_tokens/<group id>.npz``, the format in
protocol/run_dir.py)::

    log = TokenLog(run_dir, keep=cfg.token_log_groups)   # rank 0; keep 0 writes nothing
    log.write(groups, stats["token_logprobs"], version)  # after each update
    read_token_log(run_dir, group_id)                    # {"version", "logprobs"} or None

Only the newest ``keep`` files stay: the learner lists the folder once when it starts (oldest
first by modification time) and then prunes by the order it wrote. Writing never stops
training: a file that cannot be written (full disk, no permission) is warned about once and
counted (``errors``, the metric ``learner/token_log_errors``).

This module imports numpy alone (no torch), so a viewer can read the log cheaply.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from protocol.run_dir import RunDir

log = logging.getLogger(__name__)

SUFFIX = ".npz"
TEMP_PREFIX = ".writing-"  # a file being written; left behind only by a crash


class TokenLog:
    """Writes ``learner_tokens/<group id>.npz`` for each trained group and keeps the newest
    ``keep`` of them; with ``keep`` 0 it does nothing at all."""

    def __init__(self, run_dir: str | os.PathLike, keep: int):
        self.run = RunDir(run_dir)
        self.folder = self.run.learner_tokens
        self.keep = keep
        self.errors = 0
        self._warned = False
        self._written: OrderedDict[Path, None] = OrderedDict()  # oldest first
        if keep > 0:
            try:
                self._written.update(dict.fromkeys(self._existing()))
                self._prune()
            except OSError as exc:
                self._failed("list", exc)

    @property
    def enabled(self) -> bool:
        return self.keep > 0

    def write(self, groups: Sequence, logprobs: list[list[np.ndarray]], version: int) -> None:
        """One file per group of ``groups`` (its ``group_id``) with ``logprobs[g]``, one
        array per trajectory, and ``version``; then prune to the newest ``keep``."""
        if not self.enabled:
            return
        if len(logprobs) != len(groups):
            raise ValueError(f"{len(logprobs)} log-prob lists for {len(groups)} groups")
        for group, per_traj in zip(groups, logprobs):
            path = self.run.learner_tokens_file(group.group_id)
            arrays = {f"logprobs_{i}": np.asarray(a, dtype=np.float32)
                      for i, a in enumerate(per_traj)}
            try:
                self._write_file(path, version=np.array([version], dtype=np.int64), **arrays)
            except OSError as exc:
                self._failed(f"write {path.name}", exc)
                continue
            self._written.pop(path, None)
            self._written[path] = None
        self._prune()

    def close(self) -> None:
        """Nothing stays open between writes; forget what was written."""
        self._written.clear()

    # --- inside ---

    def _write_file(self, path: Path, **arrays: np.ndarray) -> None:
        """Write to a temporary name in the same folder, then rename over ``path``: a reader
        sees the whole old file or the whole new one."""
        self.folder.mkdir(parents=True, exist_ok=True)
        temp = self.folder / f"{TEMP_PREFIX}{path.name}"
        try:
            with open(temp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(temp, path)
        except OSError:
            temp.unlink(missing_ok=True)
            raise

    def _existing(self) -> list[Path]:
        """The files a previous learner of this run left, oldest first (crash leftovers of a
        write removed)."""
        if not self.folder.is_dir():
            return []
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.startswith(TEMP_PREFIX):
                Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                found.append((entry.stat().st_mtime_ns, entry.name, Path(entry.path)))
        return [path for *_, path in sorted(found)]

    def _prune(self) -> None:
        while len(self._written) > self.keep:
            path, _ = self._written.popitem(last=False)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                self._failed(f"remove {path.name}", exc)

    def _failed(self, what: str, exc: OSError) -> None:
        self.errors += 1
        if not self._warned:
            self._warned = True
            log.warning("token log: could not %s in %s (%s); training goes on, later failures "
                        "are counted in learner/token_log_errors", what, self.folder, exc)


def read_token_log(run_dir: str | os.PathLike, group_id: str) -> dict | None:
    """The learner's log-probs of group ``group_id``: ``{"version": int, "logprobs": [one
    float32 array per trajectory, aligned with its tokens, NaN where not scored]}``; None when
    there is no such file (never trained, pruned, the log off) or it cannot be read."""
    path = RunDir(run_dir).learner_tokens_file(group_id)
    try:
        with np.load(path, allow_pickle=False) as data:
            count = sum(name.startswith("logprobs_") for name in data.files)
            return {"version": int(data["version"][0]),
                    "logprobs": [data[f"logprobs_{i}"] for i in range(count)]}
    except (OSError, ValueError, KeyError, IndexError, zipfile.BadZipFile):
        return None
