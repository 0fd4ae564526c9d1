"""CURVE on the replay link: real keys from ``autodidact keys generate``, real sockets on
tcp://127.0.0.1, a real replay server. Only authorized client keys are served; everything else
gets no answer and is counted; plaintext addresses off this machine are refused at start."""

from __future__ import annotations

import stat
import threading
import time

import pytest
import zmq
from click.testing import CliRunner
from helpers_replay import ServerProc, make_group, push_all

from autodidact.cli import main
from protocol.config import ReplayConfig, RunConfig, SecurityConfig
from protocol.errors import ConfigError, TransportTimeout
from protocol.replay_client import ReplayClient
from protocol.security import CurveKeys, curve_for, leaves_loopback
from replay.server import ReplayServer


def generate(out, *args):
    return CliRunner().invoke(main, ["keys", "generate", "--out", str(out), *args])


@pytest.fixture
def curve_server(tmp_path, keys_dir):
    """A CURVE replay server in a thread of this process (starts in well under a second)."""
    server = ReplayServer(tmp_path / "run", ReplayConfig(), "tcp://127.0.0.1:*",
                          curve=CurveKeys.load(keys_dir))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield server
    server.request_stop()
    thread.join(5)
    server.close()


def run_cfg(keys_dir="", address="", **security) -> RunConfig:
    cfg = RunConfig()
    cfg.replay.address = address
    cfg.security = SecurityConfig(keys_dir=str(keys_dir), **security)
    return cfg


def refused(server) -> int:
    return server.rpc.counters.rejected["auth"]


def wait_until(predicate, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# --- keys generate ---------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_generate_writes_private_secrets_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "keys"
    result = generate(out, "--clients", "2", "--client", "gpu1")
    assert result.exit_code == 0, result.output
    assert "security.keys_dir=" in result.output and "nodes/gpu1" in result.output
    nodes = ("client-1", "client-2", "gpu1")
    secrets = [out / "server.key_secret", out / "client.key_secret",
               *(out / f"{r}.key_secret" for r in ("learner", "actor", "judge")),
               *(out / "nodes" / n / f"{k}.key_secret" for n in nodes
                 for k in ("client", "actor", "judge"))]
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    authorized = {d.name: sorted(p.name for p in d.iterdir())
                  for d in (out / "authorized").iterdir()}
    every = ["client-1.key", "client-2.key", "gpu1.key", "local.key"]
    assert authorized == {"reader": every, "actor": every, "judge": every,
                          "learner": ["local.key"]}  # worker nodes run no learner
    assert not (out / "nodes" / "gpu1" / "server.key_secret").exists()  # never leaves
    assert not (out / "nodes" / "gpu1" / "learner.key_secret").exists()

    server = CurveKeys.load(out)
    node = CurveKeys.load(out / "nodes" / "gpu1")
    assert server.server_secret and node.server_secret is None
    assert node.server_public == server.server_public
    assert node.client_public in server.authorized and server.client_public in server.authorized
    assert len(server.authorized) == 4 * 4 - 3  # a client pair per node + one per role
    assert server.roles_of(node.client_public) == frozenset()  # reads only
    assert server.roles_of(CurveKeys.load(out, "learner").client_public) == {"learner"}
    assert server.roles_of(CurveKeys.load(out / "nodes" / "gpu1", "actor").client_public) \
        == {"actor"}

    before = (out / "server.key_secret").read_bytes()
    again = generate(out)
    assert again.exit_code == 1 and "--force" in again.output
    assert (out / "server.key_secret").read_bytes() == before
    forced = generate(out, "--force")
    assert forced.exit_code == 0, forced.output
    assert (out / "server.key_secret").read_bytes() != before
    assert not (out / "nodes").exists()  # the old nodes' keys belong to the old server
    assert sorted(p.name for p in (out / "authorized").rglob("*.key")) == ["local.key"] * 4


def test_generate_refuses_bad_client_names(tmp_path):
    for args in (["--client", "local"], ["--client", "a/b"], ["--client", "x", "--client", "x"]):
        result = generate(tmp_path / "k", *args)
        assert result.exit_code == 2, (args, result.output)
    assert not (tmp_path / "k").exists()


# --- the link --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_authorized_node_is_served_by_a_server_started_from_config(tmp_path, keys_dir):
    """The whole path a deployment takes: `python -m replay.server --set security.keys_dir`,
    and a node that holds only its nodes/<name>/ copy."""
    with ServerProc(tmp_path / "run", f"security.keys_dir={keys_dir}") as server:
        node = ReplayClient.for_run(run_cfg(keys_dir / "nodes" / "gpu1", server.address),
                                    role="actor", retry_after_s=0.5, timeout_s=10)
        assert push_all(node, [make_group(1), make_group(2)]) == {"g-1": "stored",
                                                                  "g-2": "stored"}
        assert node.stats()["groups"] == 2
        node.close()
    assert "CURVE, 7 authorized client keys" in server.log_text()


@pytest.mark.timeout(20)
def test_unknown_client_key_gets_no_answer_and_is_counted(curve_server, keys_dir):
    known = CurveKeys.load(keys_dir)
    public, secret = zmq.curve_keypair()  # a valid key pair the server never heard of
    stranger = ReplayClient(curve_server.address, retry_after_s=0.3, timeout_s=1.0,
                            curve=CurveKeys(known.server_public, public, secret))
    with pytest.raises(TransportTimeout):
        stranger.stats()
    stranger.push_group(make_group(7))
    time.sleep(0.3)
    assert stranger.poll_acks(0.2) == [] and stranger.unacked() == ["g-7"]
    stranger.close()
    wait_until(lambda: refused(curve_server) >= 1)

    # ... and the server goes on serving the clients it knows.
    client = ReplayClient(curve_server.address, retry_after_s=0.5, timeout_s=5,
                          curve=CurveKeys.load(keys_dir, "actor"))
    assert push_all(client, [make_group(1)]) == {"g-1": "stored"}
    stats = client.stats()
    client.close()
    assert stats["groups"] == 1 and stats["rejected/auth"] >= 1
    assert "g-7" not in curve_server.index


@pytest.mark.timeout(20)
def test_plaintext_client_and_wrong_server_key_are_refused(curve_server, tmp_path):
    plain = ReplayClient(curve_server.address, retry_after_s=0.3, timeout_s=1.0)
    with pytest.raises(TransportTimeout):
        plain.stats()
    plain.close()
    wait_until(lambda: refused(curve_server) >= 1)

    # A node of another key set: it expects another server key, the server does not know it.
    assert generate(tmp_path / "other").exit_code == 0
    other = ReplayClient(curve_server.address, retry_after_s=0.3, timeout_s=1.0,
                         curve=CurveKeys.load(tmp_path / "other"))
    n = refused(curve_server)
    with pytest.raises(TransportTimeout):
        other.stats()
    other.close()
    wait_until(lambda: refused(curve_server) > n)
    assert curve_server.rpc.counters.received == 0  # not one frame got through


@pytest.mark.timeout(10)
def test_a_node_without_the_server_secret_cannot_serve(tmp_path, keys_dir):
    with pytest.raises(ConfigError, match="server.key_secret"):
        ReplayServer(tmp_path / "run", ReplayConfig(), "tcp://127.0.0.1:*",
                     curve=CurveKeys.load(keys_dir / "nodes" / "gpu1"))
    # The failed start released the store lock: a proper server starts on the same run dir.
    server = ReplayServer(tmp_path / "run", ReplayConfig(), "tcp://127.0.0.1:*",
                          curve=CurveKeys.load(keys_dir))
    server.close()


def test_missing_keys_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="security.keys_dir.*keys generate"):
        curve_for(SecurityConfig(keys_dir=str(tmp_path / "nope")), "ipc:///x")


# --- the loopback guard ----------------------------------------------------------------------

REMOTE = ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://gpu-node:5555",
          "tcp://eth0:5555", "tcp://[2001:db8::1]:5555"]
LOCAL = ["ipc:///tmp/replay.sock", "inproc://replay", "tcp://127.0.0.1:5555",
         "tcp://127.0.0.2:5555", "tcp://localhost:5555", "tcp://[::1]:5555", "tcp://127.0.0.1:*"]


@pytest.mark.parametrize("address", REMOTE)
def test_plaintext_off_this_machine_is_refused_unless_allowed(address):
    assert leaves_loopback(address)
    with pytest.raises(ConfigError, match="security.keys_dir"):
        curve_for(SecurityConfig(), address)
    with pytest.raises(ConfigError, match="security.keys_dir"):
        ReplayClient.for_run(run_cfg(address=address))
    assert curve_for(SecurityConfig(allow_plaintext_remote=True), address) is None


@pytest.mark.parametrize("address", LOCAL)
def test_local_addresses_need_no_keys(address):
    assert not leaves_loopback(address)
    assert curve_for(SecurityConfig(), address) is None


def test_with_keys_any_address_is_allowed(keys_dir):
    keys = curve_for(SecurityConfig(keys_dir=str(keys_dir)), "tcp://0.0.0.0:5555")
    assert keys is not None and keys.server_secret is not None


def test_cli_refuses_a_plaintext_remote_replay_at_start(tmp_path):
    result = CliRunner().invoke(main, ["replay", "--run-dir", str(tmp_path),
                                       "--address", "tcp://0.0.0.0:5555"])
    assert result.exit_code == 2 and "security.keys_dir" in result.output
    result = CliRunner().invoke(main, ["actor", "--run-dir", str(tmp_path), "--redis-url",
                                       "redis://x:1", "--replay-addr", "tcp://10.0.0.9:5555"])
    assert result.exit_code == 2 and "security.allow_plaintext_remote" in result.output
