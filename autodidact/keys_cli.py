"""``autodidact keys generate``: CURVE key pairs for ZeroMQ sockets that leave this machine.

The layout it writes is the one ``security.keys_dir`` reads (see ``protocol/security.py``)::

    DIR/server.key, server.key_secret     the replay server's pair
    DIR/client.key, client.key_secret     a client pair for this machine's own roles ("local")
    DIR/authorized/<name>.key             every client public key the server accepts
    DIR/nodes/<name>/                     server.key + client.key + client.key_secret: copy it
                                          to node <name> and point its security.keys_dir there

DIR itself is the replay server's keys_dir. Secret keys are written mode 0600.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import click

from protocol.security import AUTHORIZED, CLIENT_KEY, NODES, SERVER_KEY

LOCAL = "local"  # the client pair of the server's own machine
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@click.group()
def keys():
    """CURVE keys: authentication and encryption for ZeroMQ sockets that leave this machine.

    \b
    autodidact keys generate --out keys --clients 2     server pair, local pair, 2 node pairs
    autodidact keys generate --out keys --client gpu1 --client gpu2
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

    Only clients whose public key is in DIR/authorized/ are served. Servers read it at start:
    restart the replay server after changing it.
    """
    import zmq.auth

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
        for name in ["server", LOCAL, *nodes]:
            zmq.auth.create_certificates(stage, name)
            (stage / f"{name}.key_secret").chmod(0o600)
            (stage / f"{name}.key").chmod(0o644)
        _install(stage, "server", out, SERVER_KEY)
        for name in [LOCAL, *nodes]:
            shutil.copyfile(stage / f"{name}.key", out / AUTHORIZED / f"{name}.key")
        _install(stage, LOCAL, out, CLIENT_KEY)
        for name in nodes:
            node = out / NODES / name
            node.mkdir(parents=True, mode=0o700)
            shutil.copyfile(out / SERVER_KEY, node / SERVER_KEY)
            _install(stage, name, node, CLIENT_KEY)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _say_how(out, nodes)


def _install(stage: Path, name: str, dest: Path, as_name: str) -> None:
    os.replace(stage / f"{name}.key", dest / as_name)
    os.replace(stage / f"{name}.key_secret", dest / f"{as_name}_secret")


def _say_how(out: Path, nodes: list[str]) -> None:
    d = str(out.resolve())  # roles may run from another working directory
    rows = [(f"{SERVER_KEY}, {SERVER_KEY}_secret", "the replay server's key pair"),
            (f"{CLIENT_KEY}, {CLIENT_KEY}_secret", f"this machine's client pair ({LOCAL})"),
            (f"{AUTHORIZED}/", "client public keys the server accepts: "
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
