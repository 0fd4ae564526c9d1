"""How a bench says what it measured: the command that reproduces it, and the json it writes.

Every result under docs/results/ carries the command that wrote it (tests/test_docs.py checks
the index for it), so each bench builds that line the same way.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """``python -m <module> <arguments>``: ``argv`` as given to ``main``, else this process's."""
    return "python -m " + module + "".join(
        " " + shlex.quote(arg) for arg in (sys.argv[1:] if argv is None else argv))


def write_result(result: dict, path: Path | None, echo: bool = False) -> str:
    """The result as indented json, written to ``path`` (if any) and printed with ``echo``."""
    text = json.dumps(result, indent=1)
    if path:
        path.write_text(text + "\n")
    if echo:
        print(text)
    return text
