"""``autodidact keys generate``: CURVE key pairs for ZeroMQ sockets that leave this machine;
``autodidact keys tokens``: a run directory's role tokens, for a replay socket without them.

The layout it writes is the one ``security.keys_dir`` reads (see ``protocol/security.py``)::

    DIR/server.key, server.key_secret     the replay server's pair
    DIR/client.key, client.key_secret     this machine's ("local") pair for what only reads
                                          (status, progress, experience) and weight links
    DIR/<role>.key, <role>.key_secret     its pair for each role it runs: learner, actor, judge
    DIR/authorized/<role>/<name>.key      the keys the replay server serves as <role>
    DIR/authorized/reader/<name>.key      client keys it serves read-only requests
    DIR/nodes/<name>/                     server.key, client, actor and judge pairs (a worker
                                          node runs no learner): copy it to node <name> and
                                          point its security.keys_dir there

DIR itself is the replay server's keys_dir. Secret keys are written mode 0600.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import click

from protocol.messages import REPLAY_ROLES
from protocol.run_dir import RunDir, role_token
from protocol.security import AUTHORIZED, CLIENT_KEY, NODES, READER, SERVER_KEY

LOCAL_ROLES = ("learner", "actor", "judge")  # the head runs every role
NODE_ROLES = ("actor", "judge")  # a worker node (``autodidact node``) runs actors and judges

LOCAL = "local"  # the client pair of the server's own machine
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@click.group()
def keys():
    """CURVE keys: authentication and encryption for ZeroMQ sockets that leave this machine.

    \b
    autodidact keys generate --out keys --clients 2     server pair, local pair, 2 node pairs
    autodidact keys generate --out keys --client gpu1 --client gpu2
    autodidact keys tokens --run-dir runs/x           the run's role tokens, without keys
    """


@keys.command("generate")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Directory to write (the replay server's security.keys_dir).")
@click.option("--clients", type=click.IntRange(min=0), default=0,
              help="Client pairs for other nodes, named client-1 .. client-N.")
@click.option("--client", "names", multiple=True, metavar="NAME",
              help="A client pair for the node NAME (repeatable).")
@click.option("--force", is_flag=True,
              help="Replace existing keys; authorized/ and nodes/ are made afresh.")
def generate(out, clients, names, force):
    """Create the server key pair, a client pair for this machine and one per other node.

    Only clients whose public key is in DIR/authorized/ are served, and only as the role of
    its folder there. Servers read it at start: restart the replay server after changing it.
    """
    out = Path(out)
    nodes = [f"client-{i}" for i in range(1, clients + 1)] + list(names)
    bad = [n for n in nodes if not NAME.match(n) or n == LOCAL]
    if bad or len(set(nodes)) != len(nodes):
        raise click.UsageError(f"client names must be unique, letters, digits, '_.-', not "
                               f"{LOCAL!r}: {bad or sorted(nodes)}")
    existing = [p for p in (out / SERVER_KEY, out / f"{SERVER_KEY}_secret", out / CLIENT_KEY,
                            out / f"{CLIENT_KEY}_secret", out / AUTHORIZED, out / NODES)
                if p.exists()]
    if existing and not force:
        raise click.ClickException(
            f"{out} already holds keys ({', '.join(p.name for p in existing)}); refusing to "
            "overwrite them: --force replaces them all (every node then needs its new files)")
    out.mkdir(parents=True, exist_ok=True)
    for d in (out / AUTHORIZED, out / NODES):  # keys of the old server would be stale
        shutil.rmtree(d, ignore_errors=True)
    (out / AUTHORIZED).mkdir()
    # Generated in a private (0700) staging directory, secrets chmod 0600 before they move in.
    stage = Path(tempfile.mkdtemp(prefix=".keys-", dir=out))
    try:
        _pair(stage, "server", out, SERVER_KEY)
        _client_pairs(stage, LOCAL, out, LOCAL_ROLES)
        for name in nodes:
            node = out / NODES / name
            node.mkdir(parents=True, mode=0o700)
            shutil.copyfile(out / SERVER_KEY, node / SERVER_KEY)
            _client_pairs(stage, name, node, NODE_ROLES, authorized=out / AUTHORIZED)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _say_how(out, nodes)


@keys.command("tokens")
@click.option("--run-dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The run directory whose replay server tells roles apart by token.")
def tokens(run_dir):
    """Make the run directory's missing role tokens (learner.token, actor.token, judge.token;
    mode 0600); existing ones are kept. Without CURVE keys the replay server serves each
    role's requests only to frames carrying its token, and reads them at start: restart it,
    and give plaintext worker nodes copies of actor.token and judge.token."""
    rd = RunDir(run_dir)
    had = {role for role in REPLAY_ROLES if rd.role_token(role).exists()}
    for role in REPLAY_ROLES:
        role_token(rd.path, role, create=True)
    made = [role for role in REPLAY_ROLES if role not in had]
    click.echo(f"{rd.path}: made {', '.join(f'{r}.token' for r in made) or 'nothing'}; kept "
               f"{', '.join(f'{r}.token' for r in REPLAY_ROLES if r in had) or 'nothing'}")
    if made:
        click.echo("restart the replay server and the run's roles so they read them")


def _client_pairs(stage: Path, node: str, dest: Path, roles: tuple[str, ...],
                  authorized: Path | None = None) -> None:
    """Node ``node``'s client pair and one pair per role into ``dest``; each public key also
    into ``authorized/<role>/<node>.key`` (the client pair under ``reader/``)."""
    authorized = authorized or dest / AUTHORIZED
    for role, as_name in [(READER, CLIENT_KEY), *((r, f"{r}.key") for r in roles)]:
        public = _pair(stage, f"{node}.{role}", dest, as_name)
        (authorized / role).mkdir(exist_ok=True)
        shutil.copyfile(public, authorized / role / f"{node}.key")


def _pair(stage: Path, name: str, dest: Path, as_name: str) -> Path:
    """A new key pair ``dest/as_name`` (public) + ``as_name_secret`` (0600); the public path."""
    import zmq.auth

    zmq.auth.create_certificates(stage, name)
    (stage / f"{name}.key_secret").chmod(0o600)
    (stage / f"{name}.key").chmod(0o644)
    os.replace(stage / f"{name}.key", dest / as_name)
    os.replace(stage / f"{name}.key_secret", dest / f"{as_name}_secret")
    return dest / as_name


def _say_how(out: Path, nodes: list[str]) -> None:
    d = str(out.resolve())  # roles may run from another working directory
    rows = [(f"{SERVER_KEY}, {SERVER_KEY}_secret", "the replay server's key pair"),
            (f"{CLIENT_KEY}, {CLIENT_KEY}_secret", f"this machine's client pair ({LOCAL})"),
            (", ".join(f"{r}.key" for r in LOCAL_ROLES), "its pair for each role"),
            (f"{AUTHORIZED}/<role>/", "client public keys the server serves as <role>: "
             + ", ".join([LOCAL, *nodes]))]
    rows += [(f"{NODES}/{n}/", f"keys for node {n}") for n in nodes]
    lines = [f"wrote CURVE keys to {d}/"] + [f"  {a:<34} {b}" for a, b in rows]
    lines += ["use:", f"  on the replay server's machine (also for the roles it runs there): "
                      f"--set security.keys_dir={d}"]
    lines += [f"  on node {n}: copy {d}/{NODES}/{n}/ there (e.g. scp -r) and --set "
              "security.keys_dir=<that copy>" for n in nodes]
    lines.append(f"  *_secret files are private (mode 0600); {SERVER_KEY}_secret never leaves "
                 "the server's machine")
    click.echo("\n".join(lines))
