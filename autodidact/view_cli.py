"""``autodidact view``: the run viewer's command (docs/viewer.md)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--run-dir", "run_dirs", multiple=True, type=click.Path(path_type=Path),
              default=[Path("runs/default")], show_default=True,
              help="A run directory; repeat to compare runs. A folder of runs (an ablation's "
                   "output) serves each arm.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; keep the loopback and tunnel over SSH for a remote run.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on; 0 picks a free one.")
def view(run_dirs, host, port):
    """Serve a read-only web page over run directories, live while a run goes on."""
    from autodidact.viewer.server import serve

    missing = [str(p) for p in run_dirs if not p.is_dir()]
    if missing:
        raise click.BadParameter(f"no such run directory: {', '.join(missing)}",
                                 param_hint="--run-dir")
    serve(list(run_dirs), host, port)
