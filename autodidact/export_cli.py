"""``autodidact export``: a run's trained policy as a folder other tools load.

    autodidact export --run-dir runs/x --out policy/ --merged   plain transformers folder
    autodidact export --run-dir runs/x --out adapter/           a LoRA run: a PEFT adapter

The weights come from the learner's newest good checkpoint (verified as ``--resume`` verifies
it) over the base the run trained on (``model.path`` of ``<run>/config.yaml``).
"""

from __future__ import annotations

from pathlib import Path

import click

from autodidact.stages import save_policy
from learner.checkpoint import CheckpointError, read_checkpoint
from protocol.config import load_config
from protocol.errors import ConfigError
from protocol.run_dir import RunDir
from protocol.weights import AdapterMeta


@click.command("export")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The run whose checkpoint to export.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder to write.")
@click.option("--merged", is_flag=True,
              help="A LoRA run: merge the adapter into the base and write a plain Hugging Face "
                   "model (without it, the adapter alone, in PEFT's format). A full "
                   "fine-tuning run is always written whole.")
def export(run_dir, out, merged):
    """Write the newest good checkpoint of RUN_DIR as a loadable model (or adapter)."""
    run_dir = Path(run_dir)
    try:
        init = load_config(RunDir(run_dir).config).model.path
        found = read_checkpoint(run_dir)
    except (ConfigError, OSError, CheckpointError) as exc:
        raise click.ClickException(str(exc)) from None
    if found is None:
        raise click.ClickException(f"{RunDir(run_dir).checkpoints} holds no checkpoint: "
                                   f"nothing was trained in {run_dir} yet")
    state, path = found
    adapter = AdapterMeta.from_metadata(state.get("adapter"))
    try:
        if adapter is not None and not merged:
            from inference.lora import to_peft_folder

            written = to_peft_folder(state["model"], adapter, out)
            what = f"LoRA adapter (rank {adapter.rank}) of {adapter.base_id}"
        else:
            written = save_policy(init, state["model"], adapter, Path(out))
            what = "merged model" if adapter is not None else "model"
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{what} from {path} (update {state['updates']}, version {state['version']}) "
               f"-> {written}")
