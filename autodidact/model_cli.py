"""``autodidact model``: models a config can name, and GGUF files made into model folders.

    autodidact model list                          the named models and where each stands
    autodidact model path smollm2-135m             its folder (converted on first use)
    autodidact model convert FILE.gguf --out DIR   any GGUF as a plain Hugging Face folder
"""

from __future__ import annotations

import click

from inference.models import (
    NAMED,
    ModelNotFound,
    cache_dir,
    convert_gguf,
    is_named,
    model_folder,
    named_gguf,
)


@click.group()
def model():
    """Named models (``model.path=smollm2-135m``) and GGUF conversion."""


@model.command("list")
def list_models():
    """The named models: the package each ships in and whether it is installed."""
    for name, spec in NAMED.items():
        try:
            where = str(named_gguf(name))
        except ModelNotFound:
            where = f"not installed ({spec.install})"
        click.echo(f"{name:14s} {where}")
    click.echo(f"cache: {cache_dir()}")


@model.command("path")
@click.argument("name")
def model_path(name):
    """Print NAME's Hugging Face folder, converting its GGUF on first use."""
    if not is_named(name):
        raise click.UsageError(f"unknown model {name!r}; named models: {', '.join(NAMED)}")
    try:
        click.echo(model_folder(name))
    except (ModelNotFound, ImportError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@model.command("convert")
@click.argument("source")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder to write (replaced if it exists).")
def convert(source, out):
    """Write SOURCE (a GGUF file, or a named model) as a plain fp32 Hugging Face folder:
    weights dequantised, tokenizer with its chat template, generation config."""
    try:
        gguf = named_gguf(source) if is_named(source) else source
        click.echo(convert_gguf(gguf, out))
    except (ModelNotFound, ImportError, ValueError) as exc:  # e.g. gguf/accelerate missing
        raise click.ClickException(str(exc)) from None
