"""CURVE authentication and encryption for the ZeroMQ sockets, and the loopback guard.

A keys directory (``security.keys_dir``, made by ``autodidact keys generate``) holds::

    server.key            the replay server's public key            every node
    server.key_secret     the replay server's secret key            the server's node only
    client.key            this node's client public key             every node
    client.key_secret     this node's client secret key             every node
    <role>.key(_secret)   the pair a role of this node uses           every node, a pair per
                          (learner, actor, judge; else client.key)    role it runs
    authorized/<role>/    public keys the server serves as <role>     the server's node
    authorized/*.key      keys it serves as any role (older layout)   the server's node
    nodes/<name>/         (generate's output only) a ready keys_dir for node <name>

Files are pyzmq certificates (``zmq.auth.load_certificate``). A server refuses every client
whose public key is not in ``authorized/``; ZeroMQ refuses such a handshake before any frame
reaches the application, so an unknown client simply gets no answer. Refusals are counted from
a socket monitor (``rejected/auth`` in the server's stats) and logged, rate-limited.

A key's folder says which role it may act as (protocol.messages.REPLAY_SENDER): the replay
server reads each frame's sender key (its ZAP User-Id) and refuses an actor's key that asks for
a batch, a judge's that pushes. Every authorized key may send the requests that only read.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth import load_certificate, load_certificates
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from protocol.errors import ConfigError
from protocol.messages import REPLAY_ROLES

log = logging.getLogger(__name__)

SERVER_KEY = "server.key"
CLIENT_KEY = "client.key"
AUTHORIZED = "authorized"
READER = "reader"  # authorized/reader/: keys served the requests that only read
NODES = "nodes"
ZAP_DOMAIN = "autodidact"
AUTH_REASON = "auth"  # key of refused handshakes in ServerCounters.rejected
# Every way a handshake on a CURVE server fails: unknown client key (ZAP said no), a plaintext
# client (mechanism mismatch) or a client holding the wrong server key (cannot decrypt).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True)
class CurveKeys:
    """The keys of one node (z85 bytes, as pyzmq's socket options take them)."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None  # only on the replay server's node
    authorized: frozenset = field(default_factory=frozenset)  # client public keys it accepts
    keys_dir: str = ""
    # the roles each authorized key may act as (a key of the older flat layout: all of them)
    roles_by_key: dict = field(default_factory=dict)

    @classmethod
    def load(cls, keys_dir, role: str | None = None) -> CurveKeys:
        """The keys of ``keys_dir``; the client pair is ``<role>.key`` when the directory has
        one for ``role``, else ``client.key``."""
        d = Path(keys_dir).expanduser()
        where = f"security.keys_dir={keys_dir}"
        if not d.is_dir():
            raise ConfigError(f"{where}: no such directory (make one with `autodidact keys "
                              "generate --out DIR`)")
        server_public, server_secret = _load_pair(d / SERVER_KEY, where)
        client = d / f"{role}.key" if role else None
        if client is None or not client.with_name(client.name + "_secret").exists():
            client = d / CLIENT_KEY
        client_public, client_secret = _load_pair(client, where)
        if client_secret is None:
            raise ConfigError(f"{where}: {client.name}_secret is missing (this node's client "
                              "key pair; see nodes/<name>/ in the generated directory)")
        roles_by_key = _authorized_roles(d / AUTHORIZED)
        return cls(server_public, client_public, client_secret, server_secret,
                   frozenset(roles_by_key), str(d), roles_by_key)

    def roles_of(self, client_public: bytes) -> frozenset:
        """The roles the client holding this public key may act as on the replay socket."""
        return self.roles_by_key.get(client_public, frozenset())

    # --- the two ends of a link -------------------------------------------------------------

    def apply_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client: it trusts only the server holding ``server.key``."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret

    def apply_server(self, sock: zmq.Socket) -> CurveGuard:
        """Make ``sock`` (not yet bound) a CURVE server accepting only ``authorized`` keys."""
        if self.server_secret is None:
            raise ConfigError(f"security.keys_dir={self.keys_dir}: no {SERVER_KEY}_secret, so "
                              "this node cannot serve (only the replay server's node has it)")
        if not self.authorized:
            raise ConfigError(f"security.keys_dir={self.keys_dir}: no client keys in "
                              f"{AUTHORIZED}/, the server would refuse every client")
        return CurveGuard(sock, self)


def _authorized_roles(folder: Path) -> dict:
    """{public key: roles} from ``authorized/<role>/*.key``, ``authorized/reader/*.key`` (no
    role: reads only) and the flat ``authorized/*.key`` (every role)."""
    roles: dict = collections.defaultdict(set)
    if folder.is_dir():
        for key in load_certificates(folder):
            roles[key].update(REPLAY_ROLES)
        for role in (READER, *REPLAY_ROLES):
            if (folder / role).is_dir():
                for key in load_certificates(folder / role):
                    roles[key].update({role} - {READER})
    return {key: frozenset(r) for key, r in roles.items()}


def _load_pair(path: Path, where: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from ``x.key_secret`` if present, else ``x.key``."""
    secret = path.with_name(path.name + "_secret")
    try:
        return load_certificate(secret if secret.exists() else path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read {path.name}: {exc}") from None


class _KeyCheck:
    """ZAP credentials provider (runs in the authenticator's thread): accepts the authorized
    keys and remembers the last refused ones so the server's log can name them."""

    def __init__(self, authorized: frozenset):
        self.authorized = authorized
        self.refused: collections.deque = collections.deque(maxlen=8)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.authorized:
            return True
        self.refused.append(key.decode(errors="replace"))
        return False


class CurveGuard:
    """What a CURVE server socket needs beside its keys: a ZAP handler (without one, libzmq
    accepts any client that knows the server's public key) and a count of refused handshakes.

    The ZAP handler is per context (it binds ``inproc://zeromq.zap.01``), so a CURVE server
    gets a context of its own (see RouterServer). ``drain`` is called from the server's poll
    loop; it never blocks.
    """

    LOG_EVERY_S = 10.0

    def __init__(self, sock: zmq.Socket, keys: CurveKeys):
        self._check = _KeyCheck(keys.authorized)
        self._auth = ThreadAuthenticator(sock.context, log=logging.getLogger("zmq.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, self._check)
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.zap_domain = ZAP_DOMAIN.encode()
        self._sock = sock
        self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.refused = 0
        self._unlogged = 0
        self._last_log = -self.LOG_EVERY_S

    def drain(self) -> int:
        """Refused handshakes since the last call (each also counted in ``refused``)."""
        n = 0
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            n += bool(event["event"] & HANDSHAKE_FAILED)
        if n:
            self.refused += n
            self._unlogged += n
        now = time.monotonic()
        if self._unlogged and now - self._last_log >= self.LOG_EVERY_S:
            recent = set()
            while self._check.refused:  # appended by the ZAP thread; popleft is thread-safe
                recent.add(self._check.refused.popleft())
            log.warning("refused %d ZeroMQ handshake(s) (%d in all): unknown client key, "
                        "plaintext client or wrong server key; unknown keys seen: %s",
                        self._unlogged, self.refused, ", ".join(sorted(recent)) or "none")
            self._unlogged, self._last_log = 0, now
        return n

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._auth.stop()


# --- the loopback guard ------------------------------------------------------------------------


def leaves_loopback(address: str) -> bool:
    """Whether a ZeroMQ address can carry traffic off this machine: ``ipc://`` and
    ``inproc://`` never do; ``tcp://`` does unless its host is loopback (``127.x``, ``::1``,
    ``localhost``). ``tcp://*:p`` and ``tcp://0.0.0.0:p`` bind every interface, so they do."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ConfigError(f"not a ZeroMQ address: {address!r} (e.g. tcp://127.0.0.1:5555)")
    if scheme in ("ipc", "inproc"):
        return False
    host = rest.rsplit(";", 1)[-1].rsplit(":", 1)[0]  # connect may name a source
    return not is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine
    only: ``localhost`` or a loopback address (``127.0.0.0/8``, ``::1``). ``*``, ``0.0.0.0``,
    ``::``, an interface or any other name can be reached from elsewhere."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def curve_for(security, *addresses: str | None, role: str | None = None) -> CurveKeys | None:
    """The keys a socket of this node uses (``role``'s client pair when there is one), from
    ``security`` (a SecurityConfig, or None for plain sockets): loaded from ``keys_dir`` when
    set; else None, after refusing any of ``addresses`` that leaves loopback unless
    ``allow_plaintext_remote``."""
    if security is None:
        return None
    if security.keys_dir:
        return CurveKeys.load(security.keys_dir, role)
    for address in addresses:
        if address and leaves_loopback(address) and not security.allow_plaintext_remote:
            raise ConfigError(
                f"{address} leaves this machine but security.keys_dir is empty: make keys with "
                "`autodidact keys generate --out DIR` and --set security.keys_dir=DIR on every "
                "node (or --set security.allow_plaintext_remote=true to send plaintext)")
    return None
