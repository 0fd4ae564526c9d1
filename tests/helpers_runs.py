"""A whole ``autodidact`` command run by a test, to completion, as the user would run it.

When it overruns its timeout the failure says where the run stood: the last lines of each
role's log in the run directory, not just the launcher's first lines of stderr (what CI
printed when a run under load overran once, and nobody could tell a hang from slowness).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LOG_TAIL_LINES = 15


def run_autodidact(run_dir: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m autodidact.cli ARGS``; fails the test with the run's log tails if it does
    not end within ``timeout`` s or exits non-zero."""
    try:
        proc = subprocess.run([sys.executable, "-m", "autodidact.cli", *args],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else exc.stderr or ""
        raise AssertionError(f"`autodidact {args[0]}` did not end within {timeout:g} s\n"
                             f"{stderr[-3000:]}\n{log_tails(run_dir)}") from None
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def log_tails(run_dir: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of every log under ``run_dir/logs``."""
    out = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out) or f"(no logs under {run_dir / 'logs'})"
