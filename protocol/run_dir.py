"""One writer per LMDB store: an ``flock`` on a file in the store's directory.

The kernel drops the lock when the holder dies, even by SIGKILL, so a crashed writer never
leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def single_writer_lock(store_dir: Path, lock_name: str, busy_message: str) -> int:
    """Take the lock ``store_dir/lock_name`` (creating the directory) and return its fd, which
    holds the lock until closed; raise RuntimeError(``busy_message``) if another process has it."""
    store_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(store_dir / lock_name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(busy_message) from None
    return fd
