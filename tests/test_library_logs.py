"""What a user cannot act on stays out of the run's terminal (issue 56, part 6): library
loggers (vLLM's engine start-up, deprecation warnings) go to ``logs/libraries.log``, the
run's own lines still reach stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import logging, sys, warnings
from autodidact.cli_common import library_logs_to, setup_logging
setup_logging(False)
library_logs_to(__import__("pathlib").Path(sys.argv[1]))
logging.getLogger("vllm.v1.engine.core").info("Initializing a V1 LLM engine")
logging.getLogger("vllm").warning("dispatcher fallback")
warnings.warn("torch_dtype is deprecated", FutureWarning)
logging.getLogger("autodidact.launcher").info("the run's own line")
"""


def test_library_lines_go_to_their_log_and_the_runs_own_lines_to_the_terminal(tmp_path):
    log = tmp_path / "libraries.log"
    # A process of its own: logging and warnings are process-wide, the suite's must not change.
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    assert "the run's own line" in terminal
    for noise in ("Initializing a V1 LLM engine", "dispatcher fallback", "torch_dtype"):
        assert noise not in terminal
        assert noise in log.read_text()

