"""``autodidact view``: the run viewer's command (docs/viewer.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.option("--run-dir", "run_dirs", multiple=True, type=click.Path(path_type=Path),
              default=[Path("runs/default")], show_default=True,
              help="A run directory; repeat to compare runs. A folder of runs (an ablation's "
                   "output) serves each arm.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; keep the loopback and tunnel over SSH for a remote run. "
                   "Any other address needs --allow-remote.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on; 0 picks a free one.")
@click.option("--allow-remote", is_flag=True,
              help="Serve on a --host other than the loopback. Every request then needs a "
                   "token, printed once at start in the viewer's URL.")
def view(run_dirs, host, port, allow_remote):
    """Serve a read-only web page over run directories, live while a run goes on."""
    from autodidact.viewer.server import remote_refusal, serve
    from protocol.security import is_loopback_host

    if not (allow_remote or is_loopback_host(host)):
        click.echo(remote_refusal(host), err=True)
        sys.exit(2)
    missing = [str(p) for p in run_dirs if not p.is_dir()]
    if missing:
        raise click.BadParameter(f"no such run directory: {', '.join(missing)}",
                                 param_hint="--run-dir")
    serve(list(run_dirs), host, port, allow_remote=allow_remote)
