"""The embedded Redis served over TCP for other machines (``redis.bind``): password required,
the password never in argv, the remote URL written mode 0600, the port kept across restarts."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest
import redis

from autodidact.embedded_redis import REMOTE_URL_FILE, EmbeddedRedis, parse_bind


def _ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        return client.ping()
    finally:
        client.close()


def _without_password(url: str) -> str:
    return url.replace(url[url.index("//") + 2:url.index("@") + 1], "")


def test_bind_serves_tcp_with_the_password_and_writes_the_remote_url(tmp_path):
    server = EmbeddedRedis(tmp_path, bind="127.0.0.1:0")
    with server as url:
        assert url.startswith("unix://")  # this machine's roles keep the unix socket
        remote = server.remote_url()
        password = (tmp_path / "redis" / "password").read_text().strip()
        assert remote == f"redis://:{password}@127.0.0.1:{server.port}/0"
        assert server.port > 0 and _ping(remote) and _ping(url)
        with pytest.raises(redis.AuthenticationError):
            _ping(f"redis://:wrong@127.0.0.1:{server.port}/0")
        with pytest.raises(redis.RedisError, match="NOAUTH|[Aa]uthenticat"):
            _ping(_without_password(remote))
        path = tmp_path / "redis" / REMOTE_URL_FILE
        assert path.read_text().strip() == remote
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert password not in argv  # through stdin, never argv (ps shows argv)
        assert server.remote_url("head.example") == \
            f"redis://:{password}@head.example:{server.port}/0"


def test_restart_keeps_the_tcp_port_and_url(tmp_path):
    server = EmbeddedRedis(tmp_path, bind="127.0.0.1:0")
    with server:
        remote = server.remote_url()
        redis.Redis.from_url(remote).set("k", "v")
        server.proc.kill()
        server.proc.wait()
        server.restart()
        assert server.remote_url() == remote
        assert redis.Redis.from_url(remote).get("k") == b"v"  # from the append-only file


def test_wildcard_bind_advertises_the_host_name_and_serves_loopback(tmp_path):
    server = EmbeddedRedis(tmp_path, bind="0.0.0.0:0")
    with server:
        assert server.advertised_host() == socket.gethostname()
        assert f"@{socket.gethostname()}:{server.port}/0" in server.remote_url()
        assert _ping(server.remote_url("127.0.0.1"))


def test_long_run_dir_serves_tcp_on_the_bind_port(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    server = EmbeddedRedis(deep, bind="127.0.0.1:0")
    with server as url:
        assert url.startswith("redis://") and f":{server.port}/0" in url  # no unix socket
        assert url == server.remote_url()
        assert _ping(url)


def test_without_bind_there_is_no_tcp_listener_and_no_remote_url(tmp_path):
    server = EmbeddedRedis(tmp_path)
    with server as url:
        assert url.startswith("unix://")
        assert not (tmp_path / "redis" / REMOTE_URL_FILE).exists()
        with pytest.raises(RuntimeError, match="redis.bind"):
            server.remote_url()


@pytest.mark.parametrize("bind", ["6379", "host:", ":6379", "host:port", "h:70000"])
def test_bad_bind_is_refused_naming_the_key(bind):
    with pytest.raises(ValueError, match="redis.bind"):
        parse_bind(bind)


def test_parse_bind_accepts_ipv6():
    assert parse_bind("[::]:6379") == ("::", 6379)
    assert parse_bind("0.0.0.0:0") == ("0.0.0.0", 0)
